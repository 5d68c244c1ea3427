"""An index in the ledger's listing order, so that a page of an engine's receipts is a keyset read.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05

An engine's receipts of a session are listed oldest commit first, ``(committed_us, advancement_key)``.
No index had that order: every listing read all the session's receipts and sorted them, and the HTTP
route answered them all at once (70.6 MB at 200,000 receipts). With ``ts_receipts_commit_order`` a
page after a cursor (``ledger.receipts_page``) reads its own rows from the index and nothing else.

One index, built in the upgrade's transaction from one pass over ``ts_receipts`` (on PostgreSQL
commits wait for it; no row is written).
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_INDEX = "ts_receipts_commit_order"


def upgrade() -> None:
    """Create the index."""
    op.create_index(
        _INDEX, "ts_receipts", ["scope", "session_id", "engine_id", "committed_us", "advancement_key"], unique=False
    )


def downgrade() -> None:
    """Drop the index (listings sort the session's receipts again)."""
    op.drop_index(_INDEX, table_name="ts_receipts")
