"""Receipts reference the transcript's entries instead of copying the turn's messages.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30

Entries are immutable and live as long as their session (so as long as its receipts), and a commit now
checks that its messages ARE the transcript's closed range, so the receipt keeps the raw seqs of those
entries (``message_seqs``, comma-separated) and the ledger stops writing a second copy of every turn
into ``ts_turn_messages`` (it doubled the bytes of a committed turn; bench/README.md). Receipts written
before this revision keep their copies there and are read from it; nothing is rewritten.

The receipt's primary key becomes (scope, session, advancement key, engine): it then also answers "which
engines committed this logical turn" (a key prefix), and the separate ``ts_receipts_key`` index, a
second copy of those columns per receipt, goes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


OLD_KEY = ["scope", "session_id", "engine_id", "advancement_key"]
NEW_KEY = ["scope", "session_id", "advancement_key", "engine_id"]


def _primary_key(columns: list[str]) -> None:
    if op.get_bind().dialect.name == "sqlite":
        # SQLite cannot alter a primary key: batch mode copies the table into the new shape.
        with op.batch_alter_table("ts_receipts", recreate="always") as batch:
            batch.drop_constraint("ts_receipts_pk", type_="primary")
            batch.create_primary_key("ts_receipts_pk", columns)
    else:
        op.drop_constraint("ts_receipts_pk", "ts_receipts", type_="primary")
        op.create_primary_key("ts_receipts_pk", "ts_receipts", columns)


def upgrade() -> None:
    with op.batch_alter_table("ts_receipts") as batch:
        batch.add_column(sa.Column("message_seqs", sa.Text, nullable=True))
    # IF EXISTS: stores created before ts_receipts_key was added to 0002 (366c9a8) never had it.
    op.drop_index("ts_receipts_key", table_name="ts_receipts", if_exists=True)
    _primary_key(NEW_KEY)


def downgrade() -> None:
    # Copy referenced messages back, so a downgraded ledger still answers committed_messages.
    bind = op.get_bind()
    rows = bind.execute(
        sa.text(
            "SELECT scope, session_id, engine_id, advancement_key, message_seqs FROM ts_receipts "
            "WHERE message_seqs IS NOT NULL"
        )
    ).all()
    for scope, session_id, engine_id, key, seqs in rows:
        for idx, seq in enumerate(int(s) for s in seqs.split(",")):
            entry = bind.execute(
                sa.text("SELECT role, payload FROM ts_entries WHERE scope = :s AND session_id = :i AND seq = :q"),
                {"s": scope, "i": session_id, "q": seq},
            ).one()
            bind.execute(
                sa.text(
                    "INSERT INTO ts_turn_messages (scope, session_id, engine_id, advancement_key, idx, role, payload) "
                    "VALUES (:s, :i, :e, :k, :x, :r, :p)"
                ),
                {"s": scope, "i": session_id, "e": engine_id, "k": key, "x": idx, "r": entry.role, "p": entry.payload},
            )
    _primary_key(OLD_KEY)
    op.create_index("ts_receipts_key", "ts_receipts", ["scope", "session_id", "advancement_key"], unique=False)
    with op.batch_alter_table("ts_receipts") as batch:
        batch.drop_column("message_seqs")
