"""Lookups that read a session's rows on PostgreSQL tables never analyzed: an index of the bound
admissions, and outbox queue indexes without the blocked rows.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05

``ts_entries_bound`` (new): the session's bound admissions in seq order. A commit of an admission
without a turn id looks for the last admission bound before it (``ledger._LAST_BOUND``), and a retried
admission for the first one after it (``outbox._LATER_ADMISSION``). No index served (session, seq) among
bound entries only: the primary key walked every entry between the two (every message of a long turn,
every entry of a mirrored stretch), or the turn-id index read every bound admission of the session (one
a turn) and sorted them. One probe now on both backends, and one index row a turn. Partial on
``turn_id IS NOT NULL AND role = 'user'`` (an admission is a user message, and no other entry has a turn
id), which both statements say in those very words (``core.BOUND_ADMISSION``; SQLite takes a partial
index only for a WHERE clause holding its condition term for term). Not on ``turn_id IS NOT NULL``
alone: a lookup by turn id implies that, and on tables never analyzed PostgreSQL costs this index (the
session's key) as the turn-id index (the whole key) and took it, reading every bound admission.

``ts_outbox_order`` and ``ts_outbox_state`` (built again, partial on ``state <> 'blocked'``): blocked
rows stay in the outbox for good, and both indexes start with, or hold, the session. On tables never
analyzed PostgreSQL estimates one row for a session's key alone, so for a lookup of one turn's row (by
scope, session and turn id: the primary key exactly) ``ts_outbox_order`` cost the same as the primary
key, ``ts_outbox_state`` too when the lookup names a state, and the planner took one of them (which
one wins such a tie is an accident of when each index was made; a second index on the key wins it only
while it is the newest) and filtered every row the session kept: at every read, update and delete of a
turn's row, several a turn. A lookup names no ``state <> 'blocked'``, so it can
only take the primary key now. The statements that read the queue say it (``outbox._queued``), and
find a session's queue head, or an earlier queued turn, without passing its blocked rows.

Built in the upgrade's transaction: a read of ``ts_entries`` (on PostgreSQL writes to it wait for the
upgrade to commit; on SQLite the upgrade holds the write lock anyway) and of ``ts_outbox`` (small: rows
leave it as turns reach their engine). No row changes. The downgrade builds the outbox indexes whole
again and drops ``ts_entries_bound``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_BOUND = "turn_id IS NOT NULL AND role = 'user'"
_QUEUED = "state <> 'blocked'"
#: outbox index -> its columns
_OUTBOX = {
    "ts_outbox_order": ["scope", "session_id", "engine_id", "enqueue_seq"],
    "ts_outbox_state": ["state", "scope", "session_id"],
}


def _outbox_indexes(where: str | None) -> None:
    for name, columns in _OUTBOX.items():
        op.drop_index(name, table_name="ts_outbox")
        condition = None if where is None else sa.text(where)
        op.create_index(name, "ts_outbox", columns, unique=False, sqlite_where=condition, postgresql_where=condition)


def upgrade() -> None:
    """Create the bound-admission index; build the outbox queue indexes without the blocked rows."""
    op.create_index(
        "ts_entries_bound",
        "ts_entries",
        ["scope", "session_id", "seq"],
        unique=False,
        sqlite_where=sa.text(_BOUND),
        postgresql_where=sa.text(_BOUND),
    )
    _outbox_indexes(_QUEUED)


def downgrade() -> None:
    """As before: the outbox indexes over every row, no bound-admission index (right, and on tables
    never analyzed, slower)."""
    _outbox_indexes(None)
    op.drop_index("ts_entries_bound", table_name="ts_entries")
