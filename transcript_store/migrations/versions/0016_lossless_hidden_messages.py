"""The lossless engine marks the messages the host keeps out of the model's context: the recall tools skip them.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07

OpenClaw keeps some messages out of the model's context (``excludeFromContext``: a context-free command
and its reply, a hidden consult prompt; ``transcript_store.models.out_of_context``). The engine stores
and lists them, and never shows, counts or summarizes them; but lcm_grep found them and lcm_describe and
lcm_expand opened them, and a tool's answer is model context too. ``ts_lcm_messages.hidden`` now says so
for each row (written at import), and every recall tool leaves such a row out, in its SQL.

The rows stored before are marked here: the candidates are the rows whose stored message holds the
word ``excludeFromContext`` at all (one pass over the table), and each is read and decided by the
rule below, ``out_of_context`` as of this revision (a copy: a migration does not follow later code).
The column is added with a default (PostgreSQL 11+ and SQLite add it without copying the table); the
search structures need nothing: each search reads the column of the rows it finds. The downgrade
drops the column (the tools then find those messages again, as before).
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

#: the keys under which OpenClaw's plugin keeps its host message in the stored one (``models._HOST_MESSAGE_KEYS``)
_HOST_MESSAGE_KEYS = ("openclaw", "openclaw_lean")

_CANDIDATES = sa.text(
    "SELECT scope, session_id, ordinal FROM ts_lcm_messages WHERE message LIKE :word"
    " ORDER BY scope, session_id, ordinal"
)
_MESSAGE = sa.text("SELECT message FROM ts_lcm_messages WHERE scope = :s AND session_id = :i AND ordinal = :o")
_HIDE = sa.text("UPDATE ts_lcm_messages SET hidden = :yes WHERE scope = :s AND session_id = :i AND ordinal = :o")


def _out_of_context(message: Any) -> bool:
    """``transcript_store.models.out_of_context`` as of this revision."""
    if not isinstance(message, dict):
        return False
    for key in _HOST_MESSAGE_KEYS:
        host = message.get(key)
        if isinstance(host, dict) and key == "openclaw_lean":
            host = host.get("message")
        if isinstance(host, dict) and host.get("excludeFromContext") is True:
            return True
    return False


def upgrade() -> None:
    """Add ``hidden`` (false) and set it on the stored rows whose message the host keeps out of context."""
    op.add_column(
        "ts_lcm_messages", sa.Column("hidden", sa.Boolean(), nullable=False, server_default=sa.false())
    )
    conn = op.get_bind()
    # Keys first, then each candidate's message by its key: one message in memory at a time (64 MiB each).
    keys = conn.execute(_CANDIDATES, {"word": "%excludeFromContext%"}).all()
    for scope, session_id, ordinal in keys:
        key = {"s": scope, "i": session_id, "o": ordinal}
        raw = conn.execute(_MESSAGE, key).scalar_one()
        try:
            message = json.loads(raw)
        except ValueError:  # never written so (json.dumps), and then no host message to read
            continue
        if _out_of_context(message):
            conn.execute(_HIDE, {**key, "yes": True})


def downgrade() -> None:
    """Drop ``hidden`` (an earlier release's tools find and open those messages again)."""
    if op.get_bind().dialect.name == "sqlite":
        # SQLite's own DROP COLUMN (3.35 and later), as 0007's and 0013's downgrades: an older SQLite
        # failed on a bare syntax error ("near DROP") that named neither the revision nor the need.
        found = op.get_bind().exec_driver_sql("SELECT sqlite_version()").scalar()
        if tuple(int(p) for p in str(found).split(".")) < (3, 35):
            raise RuntimeError(
                f"downgrading below revision 0016 needs SQLite 3.35 or later (DROP COLUMN); this is {found}"
            )
    op.drop_column("ts_lcm_messages", "hidden")
