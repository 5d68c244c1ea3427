"""SQLAlchemy Core tables of the lossless engine (migration 0004 creates them) and its per-session view state.

The search structures (SQLite FTS5 + the per-session slots of its rowids, revision 0012; PostgreSQL
GIN indexes) are not declared here: they differ per backend and are only ever queried through ``search``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    ForeignKeyConstraint,
    Integer,
    Label,
    MetaData,
    PrimaryKeyConstraint,
    Row,
    Select,
    String,
    Table,
    Text,
    bindparam,
    cast,
    false,
    func,
    literal_column,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY

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
    # The host keeps the message out of the model's context (``models.out_of_context``, revision 0016):
    # stored and listed, never shown, and never found or opened by the recall tools. Written by every
    # import (``ingest``); a row inserted without it is shown (the server's default, not SQLAlchemy's).
    Column("hidden", Boolean, nullable=False, server_default=false()),
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


# ---------------------------------------------------------------------------------------------- lookups
#
# On PostgreSQL tables never analyzed (a new deployment, autovacuum off or behind) the planner has no
# estimates: every index that starts with (scope, session_id) looks as cheap as any other for one row,
# and it took the wrong one and filtered the session's rows on the key (``ordinal = $3`` by the
# entry-id index: 800 rows removed at 800 messages), and read a list of keys (``IN``, ``= ANY``) as a
# filter over the session's whole range (1,400 rows removed for each batch of an assembly at 1,000
# turns, 33-180 ms). A key is therefore asked as a range in the order of its own index, which only
# that index serves without a sort, and a list of keys as one such lookup per key (the technique of
# transcript_store/core.py, ``_path_with_entries``). SQLite's planner knows its indexes: plain IN lists.


def keyed(query: Select[Any], column: Column[Any], value: Any) -> Select[Any]:
    """``query`` narrowed to ``column = value``, in ``column``'s order: on PostgreSQL tables never analyzed
    an equality took another index of the session's key and filtered on the column; a range in the
    column's order is served by the column's own index alone (the others would need a sort). The caller
    orders by the index's further columns and limits as it needs."""
    return query.where(column >= value, column <= value).order_by(column)


#: what ``rows_of`` selects: a column, or an expression of the row under a label
Selected = Column[Any] | Label[Any]


@functools.cache
def _rows_of_array(column: Column[Any], columns: tuple[Selected, ...]) -> Select[Any]:
    """PostgreSQL: ``columns`` of the session's row for each key of an array (``b_keys``), one lookup each."""
    table = column.table
    keys = func.unnest(cast(bindparam("b_keys"), ARRAY(column.type))).table_valued("key").render_derived(name="keys")
    found = (
        keyed(
            select(*columns).where(
                table.c.scope == bindparam("b_scope"), table.c.session_id == bindparam("b_session")
            ),
            column,
            keys.c.key,
        )
        .limit(literal_column("1"))  # written out: a generic plan takes a bound LIMIT for 10% of the rows
        .lateral("found")
    )
    return select(*[found.c[c.key] for c in columns]).select_from(keys.join(found, true()))


def rows_of(
    core: Core,
    scope: str,
    session_id: str,
    column: Column[Any],
    keys: Sequence[Any],
    columns: Sequence[Selected],
    params: Mapping[str, Any] | None = None,
) -> list[Row[Any]]:
    """``columns`` of the session's rows of ``column``'s table whose ``column`` (unique in the session) is one
    of ``keys``, in no particular order; a key with no row has none. O(keys) index lookups on either backend.

    A column may be an expression of the row (labelled) with bound parameters, given in ``params``: the
    same expression objects at every call (the PostgreSQL query is built once per tuple of columns)."""
    wanted = list(dict.fromkeys(keys))
    if not wanted:
        return []
    if not core.dialect.is_sqlite:
        bound = {**(params or {}), "b_keys": wanted, "b_scope": scope, "b_session": session_id}
        return list(core.conn.execute(_rows_of_array(column, tuple(columns)), bound))
    table = column.table
    out: list[Row[Any]] = []
    for n in range(0, len(wanted), _SQLITE_IN):
        q = select(*columns).where(
            table.c.scope == scope, table.c.session_id == session_id, column.in_(wanted[n : n + _SQLITE_IN])
        )
        out.extend(core.conn.execute(q, dict(params)) if params else core.conn.execute(q))
    return out


#: keys per IN list on SQLite (well under its limit on bound variables)
_SQLITE_IN = 1000
