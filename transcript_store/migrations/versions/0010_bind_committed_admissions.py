"""Entries committed without a logical turn id take the key they were committed under.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

From this release a turn is committed under one key: its admitted entry's logical turn id, and an
entry appended without one (a mirrored host transcript) takes the key of its first commit. Entries
committed before had no such binding, so the same closed range could still be committed again under
another key, and reach an engine twice. Each one takes the smallest key a receipt names it under,
unless that key is already another entry's turn id (the same key reused for another admission of
the session: that entry keeps it, and this one stays unbound, as before).

One pass over the receipts (joined to their admitted entries through the entry-id index), in the
upgrade's transaction; an update only for entries appended without a turn id and committed since.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Driven by the receipts, each admitted entry found through the entry-id index. Left to the planner,
# SQLite walked the session's entries and read every receipt of the session for each (no index on the
# receipts' admission entry at this revision): entries x receipts, 13 s for a 10,000-turn session and
# minutes past 20,000, the write lock held throughout. SQLite keeps a CROSS JOIN's order; PostgreSQL
# gets its statistics first (tables never analyzed got a nested loop too: 61 s at 20,000).
_JOIN = (
    " ts_entries e ON e.scope = r.scope AND e.session_id = r.session_id AND e.entry_id = r.admission_entry_id"
    " WHERE e.turn_id IS NULL GROUP BY e.scope, e.session_id, e.seq"
)
_SELECT = "SELECT e.scope, e.session_id, e.seq, min(r.advancement_key) AS key FROM ts_receipts r"
_UNBOUND = {"sqlite": sa.text(_SELECT + " CROSS JOIN" + _JOIN), "postgresql": sa.text(_SELECT + " JOIN" + _JOIN)}
_BIND = sa.text(
    "UPDATE ts_entries SET turn_id = :key WHERE scope = :scope AND session_id = :session_id AND seq = :seq"
    " AND turn_id IS NULL AND NOT EXISTS (SELECT 1 FROM ts_entries x"
    " WHERE x.scope = :scope AND x.session_id = :session_id AND x.turn_id = :key)"
)


def upgrade() -> None:
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT 1 FROM ts_receipts LIMIT 1")).first() is None:
        return  # nothing committed (a new store): nothing to bind, and no statistics of empty tables
    if bind.dialect.name == "postgresql":
        # (Statistics of the data there is. Of a new store's empty tables they told the planner that
        # the tables stay empty, and the first thousands of rows were read with plans for none.)
        bind.execute(sa.text("ANALYZE ts_entries"))
        bind.execute(sa.text("ANALYZE ts_receipts"))
    for row in bind.execute(_UNBOUND.get(bind.dialect.name, _UNBOUND["postgresql"])).all():
        bind.execute(_BIND, {"scope": row.scope, "session_id": row.session_id, "seq": row.seq, "key": row.key})


def downgrade() -> None:
    # The bound turn ids stay: they name the key each turn was committed under, which every release
    # reads as a logical turn id (an admission under it again is the same admission).
    pass
