"""The lossless engine's PostgreSQL word index reads the first 100,000 characters of a text.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

PostgreSQL refuses a tsvector whose distinct words take more than 1 MiB. The engine's searchable copy
of a message (its content and tool calls) was indexed whole, so a large tool output of many distinct
words (a file listing of ~2 MB) failed the insert, and with it every commit of that turn: the turn
stayed queued for good and the session ran on legacy from then on. The generated column now reads the
first ``WORD_INDEX_CHARS`` characters (at most 4 bytes each, so under the limit however the text is
made); the rest of a long text is still found by the trigram index on the whole text, which every
search also uses. SQLite's FTS5 index has no such limit: nothing changes there.

PostgreSQL cannot change a generated column's expression before version 17, so the column is dropped
and added again: each table is rewritten once, under an exclusive lock, for the time it takes to
compute its rows' word vectors again.
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

#: characters of a text the word index reads (the trigram index reads all of it)
WORD_INDEX_CHARS = 100_000
TABLES = ("ts_lcm_messages", "ts_lcm_summaries")


def _word_index(table: str, expression: str) -> None:
    op.execute(f"ALTER TABLE {table} DROP COLUMN search_tsv")  # drops its index with it
    op.execute(f"ALTER TABLE {table} ADD COLUMN search_tsv tsvector GENERATED ALWAYS AS ({expression}) STORED")
    op.execute(f"CREATE INDEX {table}_fts ON {table} USING gin (search_tsv)")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        _word_index(table, f"to_tsvector('simple', left(content, {WORD_INDEX_CHARS}))")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        _word_index(table, "to_tsvector('simple', content)")
