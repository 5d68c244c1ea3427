"""Stores migrated by an early revision 0007 get what the final 0007 gives.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

Revision 0007 was amended after some stores had run it (commit 4470843): on SQLite it gained the
trigger that refuses a session inserted without an incarnation (a process of an older release still
running), and on both backends the fill gained "a creation time of 0 becomes 1" (0 is a cursor's "no
session"). A store that ran the first version is at 0007 all the same, so it never got either. Both
are idempotent: nothing changes on a store that ran the final 0007.
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

#: the trigger of the final revision 0007 (same name, same statement)
TRIGGER = "ts_sessions_incarnation_required"


def upgrade() -> None:
    op.execute("UPDATE ts_sessions SET incarnation = 1 WHERE incarnation = 0")
    if op.get_bind().dialect.name == "sqlite":
        op.execute(
            f"CREATE TRIGGER IF NOT EXISTS {TRIGGER} BEFORE INSERT ON ts_sessions WHEN NEW.incarnation = 0 BEGIN "
            "SELECT RAISE(ABORT, 'ts_sessions.incarnation must be set (schema revision 0007 or later)'); END"
        )


def downgrade() -> None:
    # Nothing to undo: the final 0007 gives the same (its downgrade drops the trigger).
    pass
