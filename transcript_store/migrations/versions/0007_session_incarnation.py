"""Sessions get an incarnation of their own instead of using their creation time.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

A cursor carries the incarnation of the session it was issued for, so that a session deleted and
created again under the same id does not honour the old session's cursors. Until now that was the
session's creation time, which an import carries over from its export: a session imported, deleted and
imported again from the same export had the same incarnation twice, and a cursor of the first import
was honoured on the second (skipping whatever the second had at the positions the cursor covered).
Every session created or imported from now on draws a random incarnation. Existing sessions keep their
creation time as their incarnation, so the cursors engines hold stay valid across the upgrade.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


#: existing sessions keep their creation time as their incarnation; 0 (a session imported as created
#: at exactly 1970-01-01T00:00:00Z) is the value a cursor uses for "no session", so it becomes 1
FILL = "UPDATE ts_sessions SET incarnation = CASE WHEN created_us > 0 THEN created_us ELSE 1 END"
#: SQLite: an insert that leaves the incarnation out (its DEFAULT 0: a process of an older release still
#: running) is refused, as PostgreSQL's NOT NULL refuses it, instead of a session no cursor can tell apart
TRIGGER = "ts_sessions_incarnation_required"


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # Never a batch rebuild of ts_sessions on SQLite: with foreign keys on (every store connection),
        # dropping the old table deletes every session's entries, path, outbox and receipts through
        # their ON DELETE CASCADE. SQLite's own ADD COLUMN changes no row; NOT NULL needs a default
        # there, which the trigger refuses.
        op.execute("ALTER TABLE ts_sessions ADD COLUMN incarnation BIGINT NOT NULL DEFAULT 0")
        op.execute(FILL)
        op.execute(
            f"CREATE TRIGGER {TRIGGER} BEFORE INSERT ON ts_sessions WHEN NEW.incarnation = 0 BEGIN "
            "SELECT RAISE(ABORT, 'ts_sessions.incarnation must be set (schema revision 0007 or later)'); END"
        )
        return
    op.add_column("ts_sessions", sa.Column("incarnation", sa.BigInteger, nullable=True))
    op.execute(FILL)
    op.alter_column("ts_sessions", "incarnation", existing_type=sa.BigInteger, nullable=False)


def downgrade() -> None:
    # Back to the creation time as the incarnation: cursors issued since (random incarnations) reset
    # once and are answered with cursors of the old kind.
    if op.get_bind().dialect.name == "sqlite":
        # SQLite's own DROP COLUMN (3.35 and later), for the reason upgrade() gives: no table rebuild.
        found = op.get_bind().exec_driver_sql("SELECT sqlite_version()").scalar()
        version = tuple(int(p) for p in str(found).split("."))
        if version < (3, 35):
            raise RuntimeError(
                f"downgrading below revision 0007 needs SQLite 3.35 or later (DROP COLUMN); this is {version}"
            )
        op.execute(f"DROP TRIGGER IF EXISTS {TRIGGER}")
        op.execute("ALTER TABLE ts_sessions DROP COLUMN incarnation")
        return
    op.drop_column("ts_sessions", "incarnation")
