"""The lossless engine: its messages, the summary DAG, the model-visible context items, full-text search.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

Every table is keyed by (scope, session_id, ...) and cascades from ts_sessions. The tables themselves are
the same on both backends; only the search structures differ (see ``_sqlite_search`` / ``_pg_search``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

ID = sa.String(255)
KEY = ("scope", "session_id")


def _session_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        list(KEY), ["ts_sessions.scope", "ts_sessions.session_id"], ondelete="CASCADE", name=f"{table}_session_fk"
    )


def _fk(table: str, name: str, column: str, target: str, target_column: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        [*KEY, column],
        [f"{target}.scope", f"{target}.session_id", f"{target}.{target_column}"],
        ondelete="CASCADE",
        name=f"{table}_{name}_fk",
    )


def _key_columns() -> list[sa.Column[str]]:
    return [sa.Column("scope", ID, nullable=False), sa.Column("session_id", ID, nullable=False)]


def upgrade() -> None:
    op.create_table(
        "ts_lcm_messages",
        *_key_columns(),
        sa.Column("ordinal", sa.Integer, nullable=False),
        sa.Column("entry_id", ID, nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("content", sa.Text, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("tokens", sa.Integer, nullable=False),
        sa.Column("created_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint(*KEY, "ordinal", name="ts_lcm_messages_pk"),
        _session_fk("ts_lcm_messages"),
    )
    # The per-message idempotency of every import: an entry is ingested once per session.
    op.create_index("ts_lcm_messages_entry", "ts_lcm_messages", [*KEY, "entry_id"], unique=True)
    op.create_table(
        "ts_lcm_summaries",
        *_key_columns(),
        sa.Column("summary_seq", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("depth", sa.Integer, nullable=False),
        sa.Column("level", sa.String(16), nullable=False),
        sa.Column("tokens", sa.Integer, nullable=False),
        sa.Column("source_tokens", sa.Integer, nullable=False),
        sa.Column("earliest_ordinal", sa.Integer, nullable=False),
        sa.Column("latest_ordinal", sa.Integer, nullable=False),
        sa.Column("message_count", sa.Integer, nullable=False),
        sa.Column("content", sa.Text, nullable=False),
        sa.Column("created_us", sa.BigInteger, nullable=False),
        sa.CheckConstraint("kind IN ('leaf', 'condensed')", name="ts_lcm_summaries_kind"),
        sa.PrimaryKeyConstraint(*KEY, "summary_seq", name="ts_lcm_summaries_pk"),
        _session_fk("ts_lcm_summaries"),
    )
    op.create_table(
        "ts_lcm_summary_sources",
        *_key_columns(),
        sa.Column("summary_seq", sa.Integer, nullable=False),
        sa.Column("message_ordinal", sa.Integer, nullable=False),
        sa.PrimaryKeyConstraint(*KEY, "summary_seq", "message_ordinal", name="ts_lcm_summary_sources_pk"),
        _session_fk("ts_lcm_summary_sources"),
        _fk("ts_lcm_summary_sources", "summary", "summary_seq", "ts_lcm_summaries", "summary_seq"),
        _fk("ts_lcm_summary_sources", "message", "message_ordinal", "ts_lcm_messages", "ordinal"),
    )
    op.create_index("ts_lcm_summary_sources_message", "ts_lcm_summary_sources", [*KEY, "message_ordinal"])
    op.create_table(
        "ts_lcm_summary_children",
        *_key_columns(),
        sa.Column("parent_seq", sa.Integer, nullable=False),
        sa.Column("child_seq", sa.Integer, nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.PrimaryKeyConstraint(*KEY, "parent_seq", "child_seq", name="ts_lcm_summary_children_pk"),
        _session_fk("ts_lcm_summary_children"),
        _fk("ts_lcm_summary_children", "parent", "parent_seq", "ts_lcm_summaries", "summary_seq"),
        _fk("ts_lcm_summary_children", "child", "child_seq", "ts_lcm_summaries", "summary_seq"),
    )
    # A summary is condensed at most once: the DAG's edges from a child are unique.
    op.create_index("ts_lcm_summary_children_child", "ts_lcm_summary_children", [*KEY, "child_seq"], unique=True)
    op.create_table(
        "ts_lcm_context_items",
        *_key_columns(),
        sa.Column("item_ordinal", sa.Integer, nullable=False),
        sa.Column("message_ordinal", sa.Integer, nullable=True),
        sa.Column("summary_seq", sa.Integer, nullable=True),
        sa.CheckConstraint(
            "(message_ordinal IS NULL) <> (summary_seq IS NULL)", name="ts_lcm_context_items_one_target"
        ),
        sa.PrimaryKeyConstraint(*KEY, "item_ordinal", name="ts_lcm_context_items_pk"),
        _session_fk("ts_lcm_context_items"),
        _fk("ts_lcm_context_items", "message", "message_ordinal", "ts_lcm_messages", "ordinal"),
        _fk("ts_lcm_context_items", "summary", "summary_seq", "ts_lcm_summaries", "summary_seq"),
    )
    for column in ("message_ordinal", "summary_seq"):
        where = sa.text(f"{column} IS NOT NULL")
        op.create_index(
            f"ts_lcm_context_items_{column}",
            "ts_lcm_context_items",
            [*KEY, column],
            unique=True,
            sqlite_where=where,
            postgresql_where=where,
        )
    if op.get_bind().dialect.name == "sqlite":
        _sqlite_search()
    else:
        _pg_search()


# The one place the schema branches on the backend: full-text search has no portable form.
# SQLite: an FTS5 table with the trigram tokenizer (substring matches, so CJK text without spaces is
# searchable), kept in step by triggers in the writing transaction. Its rowids come from a small map
# table whose INTEGER PRIMARY KEY is stable across VACUUM (an implicit rowid of a composite-key table
# is not), so a delete finds its FTS row through an index instead of scanning the FTS table.
# PostgreSQL: a stored generated tsvector column ('simple': no stemming, language-neutral) with a GIN
# index for ranked word search, and a pg_trgm GIN index for CJK-safe ILIKE substring search. The column
# (not an expression index) because a session-scoped scan would otherwise recompute to_tsvector for
# every row it filters; the planner picks that scan on small or fresh tables. Generated by the server,
# so the application's tables (engines/lossless/tables.py) need not know about it.

_SOURCES = {"message": ("ts_lcm_messages", "ordinal"), "summary": ("ts_lcm_summaries", "summary_seq")}


def _sqlite_search() -> None:
    op.execute(
        "CREATE TABLE ts_lcm_search_map ("
        " id INTEGER PRIMARY KEY, scope VARCHAR(255) NOT NULL, session_id VARCHAR(255) NOT NULL,"
        " kind VARCHAR(16) NOT NULL, ref INTEGER NOT NULL,"
        " CONSTRAINT ts_lcm_search_map_ref UNIQUE (scope, session_id, kind, ref))"
    )
    op.execute("CREATE VIRTUAL TABLE ts_lcm_search USING fts5(content, tokenize = 'trigram')")
    for kind, (table, ref) in _SOURCES.items():
        match = f"scope = old.scope AND session_id = old.session_id AND kind = '{kind}' AND ref = old.{ref}"
        op.execute(
            f"CREATE TRIGGER {table}_search_ai AFTER INSERT ON {table} BEGIN"
            f" INSERT INTO ts_lcm_search_map (scope, session_id, kind, ref)"
            f" VALUES (new.scope, new.session_id, '{kind}', new.{ref});"
            f" INSERT INTO ts_lcm_search (rowid, content) VALUES (last_insert_rowid(), new.content);"
            f" END"
        )
        op.execute(
            f"CREATE TRIGGER {table}_search_ad AFTER DELETE ON {table} BEGIN"
            f" DELETE FROM ts_lcm_search WHERE rowid = (SELECT id FROM ts_lcm_search_map WHERE {match});"
            f" DELETE FROM ts_lcm_search_map WHERE {match};"
            f" END"
        )


def _pg_search() -> None:
    op.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    for table, _ref in _SOURCES.values():
        op.execute(
            f"ALTER TABLE {table} ADD COLUMN search_tsv tsvector"
            " GENERATED ALWAYS AS (to_tsvector('simple', content)) STORED"
        )
        op.execute(f"CREATE INDEX {table}_fts ON {table} USING gin (search_tsv)")
        op.execute(f"CREATE INDEX {table}_trgm ON {table} USING gin (content gin_trgm_ops)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for table, _ref in _SOURCES.values():
            op.execute(f"DROP TRIGGER IF EXISTS {table}_search_ai")
            op.execute(f"DROP TRIGGER IF EXISTS {table}_search_ad")
        op.execute("DROP TABLE IF EXISTS ts_lcm_search")
        op.execute("DROP TABLE IF EXISTS ts_lcm_search_map")
    # The PostgreSQL search column and indexes go with their tables; pg_trgm stays (others may use it).
    for table in (
        "ts_lcm_context_items",
        "ts_lcm_summary_children",
        "ts_lcm_summary_sources",
        "ts_lcm_summaries",
        "ts_lcm_messages",
    ):
        op.drop_table(table)
