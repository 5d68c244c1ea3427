"""Receipts keep their payload hash as 32 bytes, and their fixed-width columns first.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30

A receipt is the ledger's whole per-turn cost now that it references the transcript (0005), and a
third of it was the SHA-256 written as 64 hex characters. The hash becomes the 32 raw bytes (``bytea``
on PostgreSQL, a BLOB on SQLite); the API still speaks hex (``Receipt.payload_hash``), so stored
replays compare exactly as before. The table is rebuilt with ``committed_us``, ``message_count`` and
``is_heartbeat`` ahead of the text columns: on PostgreSQL an 8-byte integer after text is padded to
its alignment in every row. Nothing else changes: same keys, same rows, same primary key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

ID = sa.String(255)
OLD = "ts_receipts_0005"
KEY = ["scope", "session_id", "advancement_key", "engine_id"]
#: every column but the hash, in the order of the new table
COLUMNS = [
    "scope",
    "session_id",
    "advancement_key",
    "engine_id",
    "committed_us",
    "message_count",
    "is_heartbeat",
    "admission_entry_id",
    "terminal_entry_id",
    "message_seqs",
]


def _columns(hash_type: Any) -> list[sa.Column[Any]]:
    return [
        sa.Column("scope", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("advancement_key", ID, nullable=False),
        sa.Column("engine_id", ID, nullable=False),
        sa.Column("committed_us", sa.BigInteger, nullable=False),
        sa.Column("message_count", sa.Integer, nullable=False),
        sa.Column("is_heartbeat", sa.Boolean, nullable=False),
        sa.Column("payload_hash", hash_type, nullable=False),
        sa.Column("admission_entry_id", ID, nullable=False),
        sa.Column("terminal_entry_id", ID, nullable=False),
        sa.Column("message_seqs", sa.Text, nullable=True),
    ]


def _rebuild(hash_type: Any, convert: str, python: Callable[[Any], Any]) -> None:
    """Move ts_receipts aside, create it in the new shape, copy every row converting the hash."""
    bind = op.get_bind()
    op.rename_table("ts_receipts", OLD)
    if bind.dialect.name == "postgresql":
        # Index names are schema-wide on PostgreSQL: free the primary key's name for the new table.
        op.execute(f"ALTER TABLE {OLD} RENAME CONSTRAINT ts_receipts_pk TO {OLD}_pk")
    else:
        # SQLite has neither decode() nor encode() for hex before 3.41: the conversion is Python's.
        bind.connection.driver_connection.create_function("ts_convert_hash", 1, python, deterministic=True)  # type: ignore[union-attr]
    op.create_table(
        "ts_receipts",
        *_columns(hash_type),
        sa.PrimaryKeyConstraint(*KEY, name="ts_receipts_pk"),
        sa.ForeignKeyConstraint(
            ["scope", "session_id"],
            ["ts_sessions.scope", "ts_sessions.session_id"],
            ondelete="CASCADE",
            name="ts_receipts_session_fk",
        ),
    )
    if bind.dialect.name == "postgresql":
        _grant_as(OLD, "ts_receipts")
    names = ", ".join(COLUMNS)
    expression = convert if bind.dialect.name == "postgresql" else "ts_convert_hash(payload_hash)"
    op.execute(f"INSERT INTO ts_receipts ({names}, payload_hash) SELECT {names}, {expression} FROM {OLD}")
    op.drop_table(OLD)


#: (grantee, privilege, grantable) of a table's explicit grants, its owner's own left out
_GRANTS = sa.text(
    "SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee,"
    " a.privilege_type, a.is_grantable"
    " FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee"
    " WHERE c.oid = CAST(:t AS regclass) AND a.grantee <> c.relowner"
)


def _grant_as(old: str, new: str) -> None:
    """Grant on ``new`` what was granted on ``old`` (PostgreSQL): dropping the old table drops its
    grants, and a deployment whose workers run as a role that may only read and write rows (not own
    tables) would find every commit refused after the upgrade ("permission denied for table")."""
    for grantee, privilege, grantable in op.get_bind().execute(_GRANTS, {"t": old}).all():
        op.execute(f"GRANT {privilege} ON {new} TO {grantee}" + (" WITH GRANT OPTION" if grantable else ""))


def upgrade() -> None:
    _rebuild(sa.LargeBinary(32), "decode(payload_hash, 'hex')", lambda h: bytes.fromhex(str(h)))


def downgrade() -> None:
    _rebuild(sa.String(64), "encode(payload_hash, 'hex')", lambda b: bytes(b).hex())
