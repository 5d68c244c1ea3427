"""SQLAlchemy Core tables of the lossless engine (migration 0004 creates them) and its per-session view state.

The search structures (SQLite FTS5 + the per-session slots of its rowids, revision 0012; PostgreSQL
GIN indexes) are not declared here: they differ per backend and are only ever queried through ``search``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    ForeignKeyConstraint,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
)

from transcript_store.core import MAX_INT, Core
from transcript_store.ledger import get_state, put_state

ENGINE_ID = "lossless"
VIEW_KEY = "view"

metadata = MetaData()
ID = String(255)
_DIGITS = re.compile(r"[0-9]{1,10}")


def _key() -> list[Column[Any]]:
    return [Column("scope", ID, nullable=False), Column("session_id", ID, nullable=False)]


def _session_fk(table: str) -> ForeignKeyConstraint:
    return ForeignKeyConstraint(
        ["scope", "session_id"],
        ["ts_sessions.scope", "ts_sessions.session_id"],
        ondelete="CASCADE",
        name=f"{table}_session_fk",
    )


messages = Table(
    "ts_lcm_messages",
    metadata,
    *_key(),
    # The engine's own dense order of ingestion; the entry id is the idempotency of every import.
    Column("ordinal", Integer, nullable=False),
    Column("entry_id", ID, nullable=False),
    Column("generation", Integer, nullable=False),
    Column("position", Integer, nullable=False),
    Column("role", String(16), nullable=False),
    Column("content", Text, nullable=False),  # searchable text: content + tool calls
    Column("message", Text, nullable=False),  # the message exactly as stored in the transcript
    Column("tokens", Integer, nullable=False),
    Column("created_us", BigInteger, nullable=False),
    PrimaryKeyConstraint("scope", "session_id", "ordinal", name="ts_lcm_messages_pk"),
    _session_fk("ts_lcm_messages"),
)

summaries = Table(
    "ts_lcm_summaries",
    metadata,
    *_key(),
    Column("summary_seq", Integer, nullable=False),
    Column("kind", String(16), nullable=False),  # leaf | condensed
    Column("depth", Integer, nullable=False),
    Column("level", String(16), nullable=False),  # normal | aggressive | truncated
    Column("tokens", Integer, nullable=False),  # of the rendered context message
    Column("source_tokens", Integer, nullable=False),  # of the items it replaced
    Column("earliest_ordinal", Integer, nullable=False),
    Column("latest_ordinal", Integer, nullable=False),
    Column("message_count", Integer, nullable=False),
    Column("content", Text, nullable=False),
    Column("created_us", BigInteger, nullable=False),
    CheckConstraint("kind IN ('leaf', 'condensed')", name="ts_lcm_summaries_kind"),
    PrimaryKeyConstraint("scope", "session_id", "summary_seq", name="ts_lcm_summaries_pk"),
    _session_fk("ts_lcm_summaries"),
)

summary_sources = Table(
    "ts_lcm_summary_sources",
    metadata,
    *_key(),
    Column("summary_seq", Integer, nullable=False),
    Column("message_ordinal", Integer, nullable=False),
    PrimaryKeyConstraint("scope", "session_id", "summary_seq", "message_ordinal", name="ts_lcm_summary_sources_pk"),
    _session_fk("ts_lcm_summary_sources"),
)

summary_children = Table(
    "ts_lcm_summary_children",
    metadata,
    *_key(),
    Column("parent_seq", Integer, nullable=False),
    Column("child_seq", Integer, nullable=False),
    Column("idx", Integer, nullable=False),
    PrimaryKeyConstraint("scope", "session_id", "parent_seq", "child_seq", name="ts_lcm_summary_children_pk"),
    _session_fk("ts_lcm_summary_children"),
)

# The ordered model-visible list: each row is exactly one message or one summary. A summary that
# replaces items takes the first replaced item's ordinal, so the order needs no renumbering.
context_items = Table(
    "ts_lcm_context_items",
    metadata,
    *_key(),
    Column("item_ordinal", Integer, nullable=False),
    Column("message_ordinal", Integer, nullable=True),
    Column("summary_seq", Integer, nullable=True),
    PrimaryKeyConstraint("scope", "session_id", "item_ordinal", name="ts_lcm_context_items_pk"),
    _session_fk("ts_lcm_context_items"),
)


@dataclass
class View:
    """The engine's per-session bookkeeping, written in the same transaction as the rows it describes.

    ``cursor``/``generation``/``position``: how far the transcript has been imported. ``next_*``: the
    next free ordinals. ``tokens``: the context total (so a turn can decide to compact in O(1)).
    ``epoch``: bumped by every compaction and rebuild; a compaction planned on an older epoch is refused.
    """

    cursor: str | None = None
    generation: int | None = None
    position: int = -1
    next_ordinal: int = 0
    next_item: int = 0
    next_summary: int = 1
    tokens: int = 0
    epoch: int = 0

    @classmethod
    def load(cls, core: Core, scope: str, session_id: str) -> View:
        """The stored view of a session, or a fresh one."""
        raw = get_state(core, scope, session_id, ENGINE_ID, VIEW_KEY)
        return cls(**raw) if isinstance(raw, dict) else cls()

    def save(self, core: Core, scope: str, session_id: str) -> None:
        """Upsert the view inside the caller's transaction."""
        put_state(core, scope, session_id, ENGINE_ID, VIEW_KEY, asdict(self))


def summary_id(seq: int) -> str:
    """The id tools and rendered summaries show for a summary."""
    return f"sum_{seq}"


def message_id(ordinal: int) -> str:
    """The id tools show for an ingested message."""
    return f"msg_{ordinal}"


def parse_id(raw: object) -> tuple[str, int] | None:
    """("summary" | "message", number) from ``sum_N`` / ``msg_N`` with N in column range, else None."""
    if not isinstance(raw, str):
        return None
    for prefix, kind in (("sum_", "summary"), ("msg_", "message")):
        digits = raw[len(prefix) :]
        # ASCII digits only: str.isdigit() also takes '²' or '٣', which int() refuses or reads as another
        # number; and no more than the INTEGER columns hold (PostgreSQL refuses a larger bound value).
        if raw.startswith(prefix) and _DIGITS.fullmatch(digits) and int(digits) <= MAX_INT:
            return kind, int(digits)
    return None
