"""Quarantine records of engines isolated by a host process.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Not session data: keyed by engine and process, read by `doctor` from any process.
    op.create_table(
        "ts_quarantine",
        sa.Column("engine_id", sa.String(255), nullable=False),
        sa.Column("process", sa.String(255), nullable=False),
        sa.Column("operation", sa.String(64), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("created_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("engine_id", "process", name="ts_quarantine_pk"),
    )


def downgrade() -> None:
    op.drop_table("ts_quarantine")
