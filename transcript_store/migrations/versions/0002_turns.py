"""Turn commits: the host-side outbox, the engine-side ledger (receipts + messages), engine state.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
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
        "ts_outbox",
        sa.Column("scope", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("turn_id", ID, nullable=False),
        sa.Column("engine_id", ID, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("enqueue_seq", sa.Integer, nullable=False),
        sa.Column("admission", sa.Text, nullable=False),
        sa.Column("terminal", sa.Text, nullable=True),
        sa.Column("messages", sa.Text, nullable=True),
        sa.Column("is_heartbeat", sa.Boolean, nullable=False),
        sa.Column("block_reason", sa.Text, nullable=True),
        sa.Column("attempt_count", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("last_attempt_us", sa.BigInteger, nullable=True),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_expires_us", sa.BigInteger, nullable=True),
        sa.Column("created_us", sa.BigInteger, nullable=False),
        sa.Column("updated_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("scope", "session_id", "turn_id", name="ts_outbox_pk"),
        _session_fk("ts_outbox"),
    )
    op.create_index(
        "ts_outbox_order", "ts_outbox", ["scope", "session_id", "engine_id", "enqueue_seq"], unique=False
    )
    op.create_index("ts_outbox_state", "ts_outbox", ["state", "scope", "session_id"], unique=False)
    op.create_table(
        "ts_receipts",
        sa.Column("scope", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("engine_id", ID, nullable=False),
        sa.Column("advancement_key", ID, nullable=False),
        sa.Column("payload_hash", sa.String(64), nullable=False),
        sa.Column("admission_entry_id", ID, nullable=False),
        sa.Column("terminal_entry_id", ID, nullable=False),
        sa.Column("message_count", sa.Integer, nullable=False),
        sa.Column("is_heartbeat", sa.Boolean, nullable=False),
        sa.Column("committed_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("scope", "session_id", "engine_id", "advancement_key", name="ts_receipts_pk"),
        _session_fk("ts_receipts"),
    )
    # "Was this logical turn committed by any engine?" without scanning the session's receipts.
    op.create_index("ts_receipts_key", "ts_receipts", ["scope", "session_id", "advancement_key"], unique=False)
    op.create_table(
        "ts_turn_messages",
        sa.Column("scope", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("engine_id", ID, nullable=False),
        sa.Column("advancement_key", ID, nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint(
            "scope", "session_id", "engine_id", "advancement_key", "idx", name="ts_turn_messages_pk"
        ),
        _session_fk("ts_turn_messages"),
    )
    op.create_table(
        "ts_engine_state",
        sa.Column("scope", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("engine_id", ID, nullable=False),
        sa.Column("key", ID, nullable=False),
        sa.Column("value", sa.Text, nullable=False),
        sa.Column("updated_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("scope", "session_id", "engine_id", "key", name="ts_engine_state_pk"),
        _session_fk("ts_engine_state"),
    )


def downgrade() -> None:
    op.drop_table("ts_engine_state")
    op.drop_table("ts_turn_messages")
    op.drop_table("ts_receipts")
    op.drop_table("ts_outbox")
