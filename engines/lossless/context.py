"""The model-visible context list: loading it (one indexed query), rendering it, fitting it to a budget.

A context item is one stored message or one summary. Summaries render as a user-role message that
names the summary id, so the model can expand it with the recall tools. Units group an assistant
tool call with its tool results: nothing here (or in compaction) ever splits a unit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from transcript_store.core import Core
from transcript_store.models import canonical_json

from .tables import context_items, message_id, messages, rows_of, summaries, summary_id


@dataclass
class SummaryInfo:
    """The fields of a summary the context and compaction need."""

    seq: int
    kind: str
    depth: int
    earliest: int
    latest: int
    message_count: int
    content: str


@dataclass
class Item:
    """One context item: a message (``message`` set) or a summary (``summary`` set), with its tokens."""

    ordinal: int
    tokens: int
    message_ordinal: int | None = None
    message: dict[str, Any] | None = None
    summary: SummaryInfo | None = None

    @property
    def role(self) -> str | None:
        """The message role, None for a summary."""
        return None if self.message is None else str(self.message.get("role"))

    @property
    def target(self) -> tuple[str, int]:
        """("message", ordinal) or ("summary", seq): what the stored row points at."""
        if self.summary is not None:
            return "summary", self.summary.seq
        assert self.message_ordinal is not None
        return "message", self.message_ordinal


def load_items(core: Core, scope: str, session_id: str) -> list[Item]:
    """The context list in order, each item with its message or summary: O(items) rows by primary key.

    Three lookups rather than one join on purpose: on a PostgreSQL table that was never analyzed the
    planner may run a join as a nested loop that walks the whole session once per context item. The
    messages and summaries are one index lookup per key (``tables.rows_of``).
    """
    ci = context_items.c
    rows = core.conn.execute(
        select(ci.item_ordinal, ci.message_ordinal, ci.summary_seq)
        .where(ci.scope == scope, ci.session_id == session_id)
        .order_by(ci.item_ordinal)
    ).all()
    mc, sc = messages.c, summaries.c
    ordinals = [r.message_ordinal for r in rows if r.message_ordinal is not None]
    stored = rows_of(core, scope, session_id, mc.ordinal, ordinals, (mc.ordinal, mc.message, mc.tokens))
    found = {r.ordinal: r for r in stored}
    seqs = [r.summary_seq for r in rows if r.summary_seq is not None]
    infos = {r.summary_seq: r for r in rows_of(core, scope, session_id, sc.summary_seq, seqs, tuple(summaries.c))}
    out = []
    for r in rows:
        if r.summary_seq is not None:
            s = infos[r.summary_seq]
            info = SummaryInfo(
                s.summary_seq, s.kind, s.depth, s.earliest_ordinal, s.latest_ordinal, s.message_count, s.content
            )
            out.append(Item(r.item_ordinal, s.tokens, summary=info))
        else:
            m = found[r.message_ordinal]
            out.append(Item(r.item_ordinal, m.tokens, r.message_ordinal, json.loads(m.message)))
    return out


def render_summary(info: SummaryInfo) -> dict[str, Any]:
    """The message the model sees in place of what a summary covers."""
    head = (
        f"[Summary {summary_id(info.seq)} | {info.kind} depth {info.depth} | {info.message_count} messages "
        f"{message_id(info.earliest)}..{message_id(info.latest)} | details: lcm_expand {summary_id(info.seq)}]"
    )
    return {"role": "user", "content": f"{head}\n{info.content}"}


def render(items: Sequence[Item]) -> list[dict[str, Any]]:
    """The messages of the items, in order."""
    out = []
    for item in items:
        if item.summary is not None:
            out.append(render_summary(item.summary))
        else:
            assert item.message is not None
            out.append(item.message)
    return out


def epoch(items: Sequence[Item]) -> str:
    """A hash of the summary prefix: it changes only when the summaries in context change."""
    prefix = [[i.summary.seq, i.summary.content] for i in items if i.summary is not None]
    return hashlib.sha256(canonical_json(prefix).encode("utf-8")).hexdigest()[:16]


def units(items: Sequence[Item]) -> list[tuple[int, int]]:
    """[start, end) index ranges that must stay together: a tool call with its results, else one item."""
    out: list[tuple[int, int]] = []
    for i, item in enumerate(items):
        joins = (
            item.role == "tool"
            and out
            and items[i - 1].message is not None
            and (items[i - 1].role == "tool" or bool((items[i - 1].message or {}).get("tool_calls")))
        )
        if joins:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def fit(items: list[Item], budget: int) -> list[Item]:
    """Drop the oldest whole units until the items fit ``budget`` tokens (only when over it)."""
    total = sum(i.tokens for i in items)
    if total <= budget:
        return items
    start = 0
    for begin, end in units(items):
        if total <= budget:
            break
        total -= sum(i.tokens for i in items[begin:end])
        start = end
    return items[start:]
