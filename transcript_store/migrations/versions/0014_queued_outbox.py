"""Lookups of one turn's outbox row that read the session's rows on PostgreSQL tables never analyzed:
the outbox queue indexes without the blocked rows.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05

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

Built in the upgrade's transaction: a read of ``ts_outbox`` (small: rows leave it as turns reach their
engine). No row changes. The downgrade builds the outbox indexes whole again.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

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
    """Build the outbox queue indexes again without the blocked rows."""
    _outbox_indexes(_QUEUED)


def downgrade() -> None:
    """As before: the outbox indexes over every row (right, and on tables never analyzed, slower)."""
    _outbox_indexes(None)
