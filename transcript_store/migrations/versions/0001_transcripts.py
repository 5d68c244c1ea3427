"""Sessions, entries and the materialized active path.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.String(255)


def _session_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["scope", "session_id"],
        ["ts_sessions.scope", "ts_sessions.session_id"],
        ondelete="CASCADE",
        name=f"{table}_session_fk",
    )


def upgrade() -> None:
    op.create_table(
        "ts_sessions",
        sa.Column("scope", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("session_key", ID, nullable=True),
        sa.Column("active", sa.Boolean, nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("last_seq", sa.Integer, nullable=False),
        sa.Column("head_seq", sa.Integer, nullable=True),
        sa.Column("head_entry_id", ID, nullable=True),
        sa.Column("path_length", sa.Integer, nullable=False),
        sa.Column("visible_count", sa.Integer, nullable=False),
        sa.Column("created_us", sa.BigInteger, nullable=False),
        sa.Column("updated_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("scope", "session_id", name="ts_sessions_pk"),
    )
    active_key = sa.text("active AND session_key IS NOT NULL")
    op.create_index(
        "ts_sessions_active_key",
        "ts_sessions",
        ["scope", "session_key"],
        unique=True,
        sqlite_where=active_key,
        postgresql_where=active_key,
    )
    op.create_table(
        "ts_entries",
        sa.Column("scope", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("entry_id", ID, nullable=False),
        sa.Column("parent_id", ID, nullable=True),
        sa.Column("depth", sa.Integer, nullable=False),
        sa.Column("position", sa.Integer, nullable=True),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("role", sa.String(16), nullable=True),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("size_bytes", sa.Integer, nullable=False),
        sa.Column("idempotency_key", ID, nullable=True),
        sa.Column("turn_id", ID, nullable=True),
        sa.Column("created_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("scope", "session_id", "seq", name="ts_entries_pk"),
        _session_fk("ts_entries"),
    )
    op.create_index(
        "ts_entries_entry_id", "ts_entries", ["scope", "session_id", "entry_id"], unique=True
    )
    for column in ("idempotency_key", "turn_id"):
        where = sa.text(f"{column} IS NOT NULL")
        op.create_index(
            f"ts_entries_{column}",
            "ts_entries",
            ["scope", "session_id", column],
            unique=True,
            sqlite_where=where,
            postgresql_where=where,
        )
    op.create_table(
        "ts_active_path",
        sa.Column("scope", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("depth", sa.Integer, nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("position", sa.Integer, nullable=True),
        sa.PrimaryKeyConstraint("scope", "session_id", "depth", name="ts_active_path_pk"),
        _session_fk("ts_active_path"),
    )
    where = sa.text("position IS NOT NULL")
    op.create_index(
        "ts_active_path_position",
        "ts_active_path",
        ["scope", "session_id", "position"],
        unique=True,
        sqlite_where=where,
        postgresql_where=where,
    )


def downgrade() -> None:
    op.drop_table("ts_active_path")
    op.drop_table("ts_entries")
    op.drop_table("ts_sessions")
