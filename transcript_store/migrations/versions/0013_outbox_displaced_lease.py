"""An admitted turn keeps the leases of the live attempts retries took it over from.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05

A retry of a running turn takes the turn's lease over. When that retry then died (SIGKILL, a lost
machine), its lease named a process gone, or ran out, and the turn counted as abandoned: the next turn
of the session discarded it although the attempt it was taken from still ran, and that attempt's work
was lost. ``displaced_leases`` keeps the lease of every live attempt a retry took the turn from (on
admitted rows only; a JSON list ``[{"owner": ..., "expires_us": ...}, ...]``, oldest first, at most 16,
the abandoned ones pruned at every write): each worker renews its own, the most recent live one takes
the turn back once its holder is gone, a failing holder hands it to that one, and the turn is abandoned
only when the holder's lease and every listed one are (``outbox.AdmittedLease.abandoned``).

One nullable column: no row is written, on either backend (SQLite adds it in place, PostgreSQL in the
catalogue only).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_COLUMN = "displaced_leases"


def upgrade() -> None:
    """Add the column."""
    op.add_column("ts_outbox", sa.Column(_COLUMN, sa.Text, nullable=True))


def downgrade() -> None:
    """Drop the column (the displaced attempts' leases are forgotten: a running retried turn counts as
    abandoned once its holder's lease is, as before this revision)."""
    if op.get_bind().dialect.name == "sqlite":
        # SQLite's own DROP COLUMN (3.35 and later), as 0007's downgrade: no rebuild of the table.
        found = op.get_bind().exec_driver_sql("SELECT sqlite_version()").scalar()
        if tuple(int(p) for p in str(found).split(".")) < (3, 35):
            raise RuntimeError(
                f"downgrading below revision 0013 needs SQLite 3.35 or later (DROP COLUMN); this is {found}"
            )
        op.execute(f"ALTER TABLE ts_outbox DROP COLUMN {_COLUMN}")
        return
    op.drop_column("ts_outbox", _COLUMN)
