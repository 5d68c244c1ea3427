"""An admitted turn keeps the lease of the live attempt a retry took it over from.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05

A retry of a running turn takes the turn's lease over. When that retry then died (SIGKILL, a lost
machine), its lease named a process gone, or ran out, and the turn counted as abandoned: the next turn
of the session discarded it although the attempt it was taken from still ran, and that attempt's work
was lost. ``displaced_owner`` and ``displaced_expires_us`` keep that attempt's lease (on admitted rows
only): its worker renews it, takes the turn back once the retry is gone, and the turn is abandoned
only when both leases are (``outbox.AdmittedLease.abandoned``).

Two nullable columns: no row is written, on either backend (SQLite adds them in place, PostgreSQL in
the catalogue only).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_COLUMNS = ("displaced_owner", "displaced_expires_us")


def upgrade() -> None:
    op.add_column("ts_outbox", sa.Column("displaced_owner", sa.String(128), nullable=True))
    op.add_column("ts_outbox", sa.Column("displaced_expires_us", sa.BigInteger, nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # SQLite's own DROP COLUMN (3.35 and later), as 0007's downgrade: no rebuild of the table.
        found = op.get_bind().exec_driver_sql("SELECT sqlite_version()").scalar()
        if tuple(int(p) for p in str(found).split(".")) < (3, 35):
            raise RuntimeError(
                f"downgrading below revision 0013 needs SQLite 3.35 or later (DROP COLUMN); this is {found}"
            )
        for column in _COLUMNS:
            op.execute(f"ALTER TABLE ts_outbox DROP COLUMN {column}")
        return
    for column in _COLUMNS:
        op.drop_column("ts_outbox", column)
