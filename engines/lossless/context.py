"""The model-visible context list: loading it (one indexed query), rendering it, fitting it to a budget.

A context item is one stored message or one summary. Summaries render as a user-role message that
names the summary id, so the model can expand it with the recall tools. Units group an assistant
tool call with its tool results: nothing here (or in compaction) ever splits a unit.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from transcript_store.core import Core
from transcript_store.models import RESULT_ROLES, calls_made, canonical_json

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
    #: when the summary was written (microseconds since the epoch; 0 for one not yet stored)
    created_us: int = 0
    #: the messages it summarized: ``message_count`` less the hidden ones it covers (models.out_of_context,
    #: never given to a summarizer); None when not known here (``compaction.shown_count`` reads it)
    shown: int | None = None


@dataclass
class Item:
    """One context item: a message (``message`` set) or a summary (``summary`` set), with its tokens."""

    ordinal: int
    tokens: int
    message_ordinal: int | None = None
    message: dict[str, Any] | None = None
    summary: SummaryInfo | None = None
    #: the engine's estimator's count of this item's rendered message alone (``ContextCache``, when the
    #: estimator's count of a list follows from these: ``tokens.count_from_parts``), else None
    counted: int | None = None

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
    """The context list in order, each item with its message or summary: O(items) rows by primary key."""
    return [slot.item(message) for slot, message in _with_messages(_load_slots(core, scope, session_id, 0))]


@dataclass(frozen=True)
class _Slot:
    """One context item as loaded: its stored message as text (parsed afresh for every caller)."""

    ordinal: int
    tokens: int
    message_ordinal: int | None
    text: str | None
    summary: SummaryInfo | None
    counted: int | None = None

    def item(self, message: dict[str, Any] | None) -> Item:
        """The item, with ``message`` parsed from ``text``."""
        return Item(self.ordinal, self.tokens, self.message_ordinal, message, self.summary, self.counted)


def _with_messages(slots: Sequence[_Slot]) -> list[tuple[_Slot, dict[str, Any] | None]]:
    """Each slot with its message parsed: one ``json.loads`` of all the texts as an array (a third faster
    than one call per message at 2,000 messages)."""
    texts = [s.text for s in slots if s.text is not None]
    parsed = iter(json.loads("[" + ",".join(texts) + "]") if texts else [])
    return [(s, next(parsed) if s.text is not None else None) for s in slots]


def _load_slots(core: Core, scope: str, session_id: str, start: int) -> list[_Slot]:
    """The context items from item ordinal ``start`` on, in order: O(items read) rows by primary key.

    Three lookups rather than one join on purpose: on a PostgreSQL table that was never analyzed the
    planner may run a join as a nested loop that walks the whole session once per context item. The
    messages and summaries are one index lookup per key (``tables.rows_of``).
    """
    ci = context_items.c
    query = select(ci.item_ordinal, ci.message_ordinal, ci.summary_seq).where(
        ci.scope == scope, ci.session_id == session_id
    )
    if start > 0:
        query = query.where(ci.item_ordinal >= start)
    rows = core.conn.execute(query.order_by(ci.item_ordinal)).all()
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
                s.summary_seq, s.kind, s.depth, s.earliest_ordinal, s.latest_ordinal, s.message_count, s.content,
                s.created_us,
            )
            out.append(_Slot(r.item_ordinal, s.tokens, None, None, info))
        else:
            m = found[r.message_ordinal]
            out.append(_Slot(r.item_ordinal, m.tokens, r.message_ordinal, m.message, None))
    return out


@dataclass(frozen=True)
class _Cached:
    """A session's context list as a process last loaded it, and what it was loaded at."""

    incarnation: int
    epoch: int
    next_item: int
    slots: tuple[_Slot, ...]
    size: int  # characters of text held


class ContextCache:
    """The context lists a process loaded lately, so that a turn reads only the items added since.

    Why it is sound: within one epoch of a session's view the context list only grows at its end (an
    import appends items at ``View.next_item``; a compaction and a reset, the only writers that remove
    or replace items, bump ``View.epoch``), the rows an item points at never change, and the view is
    written in the same transaction as the items it describes. So a list loaded at (incarnation, epoch,
    next_item) is the prefix of the list at any later ``next_item`` of the same incarnation and epoch,
    and the items from the cached ``next_item`` on are all that is new. The incarnation (a random number
    per session's life, carried by the view's cursor) tells a session deleted and created again under
    its id from the one cached; a view whose cursor has none (format 1) is loaded whole every time.

    Without it an assembly read and parsed the whole context list every turn: ~70 ms at 2,000 context
    messages on SQLite, growing with the session (a large budget keeps that many in context). Bounded
    by sessions and by characters held; the least recently used session goes first. Messages are
    parsed afresh for every caller (one ``json.loads`` of the texts): a caller may change the dicts it
    is given without changing what the next caller gets.
    """

    def __init__(
        self, count: Callable[[dict[str, Any]], int] | None, *, sessions: int = 256, chars: int = 64 << 20
    ) -> None:
        """``count``: the count of one rendered message alone when a list's count follows from those, else None."""
        self._count = count
        self._sessions = sessions
        self._chars = chars
        self._held = 0
        self._lists: OrderedDict[tuple[str, str], _Cached] = OrderedDict()
        self._lock = threading.Lock()

    def items(
        self, core: Core, scope: str, session_id: str, *, incarnation: int | None, epoch: int, next_item: int
    ) -> tuple[list[Item], int]:
        """The context list in order, in the caller's snapshot whose view says ``incarnation``, ``epoch`` and
        ``next_item``; and how many item rows were read for it."""
        key = (scope, session_id)
        with self._lock:
            cached = self._lists.get(key)
        if (
            incarnation is None
            or cached is None
            or (cached.incarnation, cached.epoch) != (incarnation, epoch)
            or cached.next_item > next_item
        ):
            fresh = _load_slots(core, scope, session_id, 0)
            parsed = _with_messages(fresh)
            kept: tuple[_Slot, ...] = ()
            read = len(fresh)
        else:
            fresh = _load_slots(core, scope, session_id, cached.next_item) if cached.next_item < next_item else []
            kept, read = cached.slots, len(fresh)
            parsed = _with_messages(kept + tuple(fresh))
        if self._count is not None:
            counted = []
            for n, (slot, message) in enumerate(parsed):
                if slot.counted is None:
                    rendered = message if message is not None else render_summary(_info(slot))
                    slot = _Slot(slot.ordinal, slot.tokens, slot.message_ordinal, slot.text, slot.summary,
                                 self._count(rendered))
                    parsed[n] = (slot, message)
                counted.append(slot)
            slots = tuple(counted)
        else:
            slots = kept + tuple(fresh)
        if incarnation is not None:
            self._keep(key, _Cached(incarnation, epoch, next_item, slots, sum(len(s.text or "") for s in slots)))
        return [slot.item(message) for slot, message in parsed], read

    def clear(self) -> None:
        """Forget every list held (the next assembly of each session reads it whole)."""
        with self._lock:
            self._lists.clear()
            self._held = 0

    def _keep(self, key: tuple[str, str], entry: _Cached) -> None:
        with self._lock:
            old = self._lists.pop(key, None)
            if old is not None:
                self._held -= old.size
            if entry.size > self._chars:
                return
            self._lists[key] = entry
            self._held += entry.size
            while len(self._lists) > self._sessions or self._held > self._chars:
                _, gone = self._lists.popitem(last=False)
                self._held -= gone.size


def _info(slot: _Slot) -> SummaryInfo:
    assert slot.summary is not None
    return slot.summary


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


def compacted_at_ms(items: Sequence[Item]) -> int | None:
    """When the newest summary among the items was written (milliseconds, rounded up), None without one."""
    made = [i.summary.created_us for i in items if i.summary is not None and i.summary.created_us > 0]
    return -(-max(made) // 1000) if made else None


def units(items: Sequence[Item]) -> list[tuple[int, int]]:
    """[start, end) index ranges that must stay together: a tool call with its results (or an older-format
    function call with its function result), else one item."""
    out: list[tuple[int, int]] = []
    for i, item in enumerate(items):
        joins = (
            item.role in RESULT_ROLES
            and out
            and items[i - 1].message is not None
            and (items[i - 1].role in RESULT_ROLES or bool(calls_made(items[i - 1].message)))
        )
        if joins:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def after_reset(items: list[Item], start: int | None) -> list[Item]:
    """The items from the one covering active position ``start`` on (a host's reset: its context starts
    again there); the whole list when ``start`` is None. The list covers positions 0, 1, 2, ... in order;
    a summary reaching past ``start`` stays (what follows the reset is never left out), tool or function
    results at its start aside: their call is before it."""
    if not start:
        return items
    covered = 0
    for n, item in enumerate(items):
        covered += item.summary.message_count if item.summary is not None else 1
        if covered > start:
            # A reset keeping a tail from inside a tool round: the context began with a result whose call
            # it left out, a request the Chat Completions API refuses (legacy's fit skips them too).
            while n < len(items) and items[n].role in RESULT_ROLES:
                n += 1
            return items[n:]
    return []


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
