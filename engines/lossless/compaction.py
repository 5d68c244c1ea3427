"""Compaction: plan in memory (the summarizer runs outside any transaction), then write in ONE transaction.

Each round takes one step, in this order of preference:

1. condense the oldest run of ``condense_fanin`` summaries of one depth into one summary of depth + 1;
2. while over the target (or once, when forced): a leaf pass over the oldest raw chunk outside the
   protected fresh tail (bounded by messages and tokens), with the preceding summary for continuity;
   the user message of a turn in progress stays raw while its rounds are in the tail (``turn_question``);
3. while over the target: condense the newest run of two or more summaries of one depth, else the
   newest two summaries (mixed depths).

A summary must be smaller than what it replaces and hold to the ``max_tokens`` it was asked for
(counted with the engine's estimator): normal, then aggressive, then a deterministic truncation (the
summarizer's answer, if it summarized but ran long, cut at a clean boundary with a marker; else the
start of every input message). A step that cannot shrink is skipped; a summarizer that raises, or
answers anything but a string, ends the plan (the raw messages stay in context). The write checks
the session's incarnation and the view's epoch, so a plan made on a context that a reset or another
compaction changed meanwhile, or on an earlier session under the same id (deleted and created again
while the summarizer ran), is refused instead of applied to the wrong items.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import delete, insert, select

from transcript_store import faults
from transcript_store.core import Core, foreign_incarnation, now_us
from transcript_store.cursors import decode_cursor
from transcript_store.models import RESULT_ROLES, call_answered, calls_made, out_of_context
from transcript_store.summarize import Level, Summarizer, hold, summarized, summary_input, summary_lines, summary_text
from transcript_store.tokens import TokenEstimator

from .config import Budget, LosslessConfig
from .context import Item, SummaryInfo, render_summary, units
from .ingest import column_text, searchable_text
from .tables import View, context_items, keyed, messages, rows_of, summaries, summary_children, summary_sources

Step = tuple[str, int, int]  # (leaf | condense, start index, end index)


@dataclass
class NewSummary:
    """A summary made by a plan: its row, and the messages (leaf) or summaries (condensed) it covers."""

    info: SummaryInfo
    level: str
    tokens: int
    source_tokens: int
    sources: list[int] = field(default_factory=list)
    children: list[int] = field(default_factory=list)


@dataclass
class Plan:
    """What a compaction would write: new summaries and the context list before and after.

    ``incarnation``: of the session the context was read from, as its view's cursor names it (None: no
    cursor, or a format-1 one that does not say).
    """

    incarnation: int | None
    epoch: int
    next_summary: int
    before: list[Item]
    after: list[Item]
    summaries: list[NewSummary] = field(default_factory=list)
    error: str | None = None
    skipped: int = 0

    @property
    def tokens_before(self) -> int:
        """Context tokens of the snapshot."""
        return sum(i.tokens for i in self.before)

    @property
    def tokens_after(self) -> int:
        """Context tokens once the plan is written."""
        return sum(i.tokens for i in self.after)


# ---------------------------------------------------------------------------------------------- choosing


def tail_start(items: Sequence[Item], config: LosslessConfig, budget: Budget) -> int:
    """Index where the protected fresh tail begins: recent whole units within the message and token caps,
    at least the newest unit while it fits the window (``fresh_tail_messages`` 0 aside), and the last
    unit whatever the caps while its tool calls wait for results (``_awaits_results``)."""
    count = tokens = 0
    start = len(items)
    every = units(items)
    for begin, end in reversed(every):
        unit = items[begin:end]
        if any(i.summary is not None for i in unit):
            break
        size = sum(i.tokens for i in unit)
        if count + len(unit) > config.fresh_tail_messages or tokens + size > budget.tail_tokens:
            break
        count, tokens, start = count + len(unit), tokens + size, begin
    newest = items[every[-1][0] : every[-1][1]] if every else []
    if (
        start == len(items)
        and config.fresh_tail_messages > 0
        and newest
        and all(i.summary is None for i in newest)
        and sum(i.tokens for i in newest) <= budget.window
    ):
        # The newest unit over the tail's token cap left the tail empty, and it was summarized: the
        # model lost its last reply verbatim, and a summary larger than a small budget replaced
        # messages that fit it (assemble then showed nothing at all). It stays raw while it fits the window.
        start = every[-1][0]
    if every and _awaits_results(newest):
        # A summary would take the call, and the results that arrive next would follow it raw: a tool
        # message whose call is in no message (the host drops it: the model never sees the result). With
        # fresh_tail_messages 0, or a call larger than the tail's token cap, it was summarized.
        start = min(start, every[-1][0])
    return start


def _awaits_results(unit: Sequence[Item]) -> bool:
    """Whether a unit is an assistant's tool calls (or function call) not all answered by the results after it."""
    wanted = set(calls_made(unit[0].message)) if unit else set()
    answered = {call_answered(i.message) for i in unit[1:]}
    return not wanted <= answered


def leaf_chunks(items: Sequence[Item], config: LosslessConfig, budget: Budget) -> Iterator[tuple[int, int]]:
    """[start, end) of each raw chunk outside the tail, oldest first; each at least one whole unit, else
    bounded. The planner takes the first it can summarize smaller: a chunk it cannot (a tiny exchange
    before a large tool unit) is passed over, not the end of compaction. The user message of a turn still
    in progress (``turn_question``) stays raw when all that follows it is in the fresh tail."""
    limit = tail_start(items, config, budget)
    held = turn_question(items)
    if held is not None and held + 1 == limit:
        limit = held
    start = 0
    while (chunk := _chunk_from(items, config, start, limit)) is not None:
        yield chunk
        start = chunk[1]


def turn_question(items: Sequence[Item]) -> int | None:
    """Index of the user message of a turn still in progress: the newest user message when the context
    ends in a tool or function result (the model is asked again next), else None.

    A host compacting in the middle of a turn (Hermes' compress after a tool round) shows that message
    verbatim whatever the engine does with it: summarized, it cost a summarizer call (or a part of one)
    for a summary the host's answer left out then (it came back a turn later). It stays raw only when
    the turn's tool rounds after it are all raw too (in the fresh tail): a summary of older rounds of
    the turn is a user-role message, and after the raw question it would be the newest user message,
    which a host takes for the turn's own (Hermes did: the question left its requests). Summarizing
    the rounds needs the question in their summary, as before."""
    if not items or items[-1].role not in RESULT_ROLES:
        return None
    return next((i for i in range(len(items) - 1, -1, -1) if items[i].role == "user"), None)


def _chunk_from(items: Sequence[Item], config: LosslessConfig, start: int, limit: int) -> tuple[int, int] | None:
    first = next((i for i in range(start, len(items)) if items[i].summary is None), None)
    if first is None or first >= limit:
        return None
    end = count = tokens = 0
    for begin, stop in units(items):
        if begin < first:
            continue
        unit = items[begin:stop]
        if stop > limit or any(i.summary is not None for i in unit):
            break
        size = sum(i.tokens for i in unit)
        if end and (count + len(unit) > config.leaf_chunk_messages or tokens + size > config.leaf_chunk_tokens):
            break
        end, count, tokens = stop, count + len(unit), tokens + size
    return (first, end) if end > first else None


def candidates(
    items: Sequence[Item], config: LosslessConfig, budget: Budget, over: bool, forced: bool
) -> Iterator[Step]:
    """The steps worth taking now, most preferred first (see module doc)."""
    fanin = config.condense_fanin
    i = 0
    while i < len(items):
        j = i
        while j < len(items) and _depth(items[i]) is not None and _depth(items[j]) == _depth(items[i]):
            j += 1
        if j - i >= fanin:
            yield "condense", i, i + fanin
        i = max(j, i + 1)
    if over or forced:
        for chunk in leaf_chunks(items, config, budget):
            yield "leaf", *chunk
    if over:
        block = _newest_block(items, fanin)
        if block is not None:
            yield "condense", *block


def _depth(item: Item) -> int | None:
    return None if item.summary is None else item.summary.depth


def _newest_block(items: Sequence[Item], fanin: int) -> tuple[int, int] | None:
    """The newest run of 2+ summaries of one depth (its last ``fanin``), else the newest two summaries.

    Condensing the newest, shallowest summaries first keeps the DAG balanced (depth grows with the log
    of the history); always folding the oldest summary into the next would grow a chain instead.
    """
    marked = [(k, item.summary.depth) for k, item in enumerate(items) if item.summary is not None]
    for n in range(len(marked) - 1, 0, -1):
        (k, depth), (prev_k, prev_depth) = marked[n], marked[n - 1]
        if depth == prev_depth and prev_k == k - 1:
            start = k - 1
            while start > 0 and _depth(items[start - 1]) == depth:
                start -= 1
            return max(start, k + 1 - fanin), k + 1
    for n in range(len(marked) - 1, 0, -1):
        if marked[n - 1][0] == marked[n][0] - 1:
            return marked[n - 1][0], marked[n][0] + 1
    return None


# ---------------------------------------------------------------------------------------------- planning


class Planner:
    """Builds a compaction plan for one session's context list."""

    def __init__(
        self,
        config: LosslessConfig,
        budget: Budget,
        summarizer: Summarizer,
        estimator: TokenEstimator,
        focus: str | None = None,
        shown: Callable[[SummaryInfo], int] | None = None,
    ) -> None:
        """A planner for one compaction; ``shown``: the messages a stored summary summarized (``shown_count``),
        for a summary whose ``SummaryInfo.shown`` is not known (its ``message_count`` without it)."""
        self.config, self.budget, self.focus = config, budget, focus
        self.summarizer, self.estimator = summarizer, estimator
        self.shown = shown

    def _shown(self, info: SummaryInfo) -> int:
        """The messages ``info`` summarized (its hidden sources left out)."""
        if info.shown is None:
            info.shown = info.message_count if self.shown is None else self.shown(info)
        return info.shown

    def plan(self, items: list[Item], view: View, *, force: bool) -> Plan:
        """Compact until under the target (or until nothing can shrink, or the round limit)."""
        plan = Plan(incarnation_of(view), view.epoch, view.next_summary, list(items), list(items))
        skip: set[tuple[str, int, int]] = set()
        for _ in range(self.config.max_rounds):
            after = plan.after
            over = plan.tokens_after > self.budget.target
            forced = force and not plan.summaries
            chosen = next(
                (
                    (kind, start, end)
                    for kind, start, end in candidates(after, self.config, self.budget, over, forced)
                    if (kind, after[start].ordinal, end - start) not in skip
                ),
                None,
            )
            if chosen is None:
                break
            kind, start, end = chosen
            key = (kind, after[start].ordinal, end - start)
            try:
                made = self._step(kind, after, start, end, plan.next_summary + len(plan.summaries))
            except Exception as e:  # any summarizer failure: keep the raw items, report why
                plan.error = f"summarizer failed: {type(e).__name__}: {e}"
                break
            if made is None:
                skip.add(key)
                plan.skipped += 1
                continue
            plan.summaries.append(made)
            after[start:end] = [Item(after[start].ordinal, made.tokens, summary=made.info)]
        return plan

    def _step(self, kind: str, items: list[Item], start: int, end: int, seq: int) -> NewSummary | None:
        chunk = items[start:end]
        source_tokens = sum(i.tokens for i in chunk)
        if kind == "leaf":
            # The summary just before the chunk, for continuity (condensations need none: their
            # children already are the continuous story).
            before = items[start - 1].summary if start > 0 else None
            previous = before.content if before is not None else None
            ordinals = [int(i.message_ordinal or 0) for i in chunk]
            # What the host keeps out of the model's context is covered (a source of the leaf, which the recall
            # tools never list: tables.messages.c.hidden), never summarized: a summary would carry it into
            # every later context.
            inputs = [i.message or {} for i in chunk if not out_of_context(i.message)]
            if not inputs:
                return None
            shape = SummaryInfo(seq, "leaf", 0, min(ordinals), max(ordinals), len(chunk), "", shown=len(inputs))
            made = self._summarize(inputs, previous, self.budget.leaf_summary_tokens, source_tokens, shape)
            if made is not None:
                made.sources = ordinals
            return made
        children = [i.summary for i in chunk if i.summary is not None]
        # Each child as an earlier summary, its text alone: with its id and range as its first line, the
        # extractive summarizer took that line for the child's gist (every line of a condensed summary read
        # "- user: [sum_1 | msg_0..msg_3]") and a model was shown it as the user's words. The DAG records
        # which children a condensed summary covers.
        # Each child counts the messages it summarized: its ``message_count`` counts the hidden messages it
        # covers too, which no summary ever held (a condensed summary of two leaves of 2 shown and 2 hidden
        # messages each said it summarized 8).
        counts = [self._shown(c) for c in children]
        inputs = [summary_input(c.content, n) for c, n in zip(children, counts, strict=True)]
        shape = SummaryInfo(
            seq,
            "condensed",
            1 + max(c.depth for c in children),
            min(c.earliest for c in children),
            max(c.latest for c in children),
            sum(c.message_count for c in children),
            "",
            shown=sum(counts),
        )
        made = self._summarize(inputs, None, self.budget.condensed_summary_tokens, source_tokens, shape)
        if made is not None:
            made.children = [c.seq for c in children]
        return made

    def _summarize(
        self, inputs: list[dict[str, Any]], previous: str | None, max_tokens: int, source_tokens: int,
        shape: SummaryInfo,
    ) -> NewSummary | None:
        """Escalate until the summary fits ``max_tokens`` and is smaller than its sources: normal,
        aggressive, then truncation (of the last answer that summarized but ran long, else of the inputs)."""
        levels: tuple[Level, ...] = ("normal", "aggressive")
        long: str | None = None
        for level in levels:
            answer = self.summarizer.summarize(
                inputs, previous_summary=previous, focus=self.focus, level=level, max_tokens=max_tokens
            )
            # Checked and cleaned before its tokens are counted: NUL, replaced only when written, was counted
            # as another character than the one shown, and assemble went over its budget.
            text = summary_text(answer)
            made = self._made(shape, text, level, source_tokens, max_tokens)
            if made is not None:
                return made
            # A summarizer that ignores max_tokens (a model asked for 600 tokens that writes 3000) made a
            # summary all the same, only too long: cut to its budget it keeps its start, which beats the
            # start of every message. An answer as long as its sources (an echo, garbage) summarized nothing.
            if text and self._tokens(shape, text) < source_tokens:
                long = text
        if long is not None:
            made = self._made(shape, hold(long, max_tokens, self.estimator), "truncated", source_tokens, max_tokens)
            if made is not None:
                return made
        overhead = self._tokens(shape, "")
        room = min(max_tokens, source_tokens // 2) - overhead
        if room < 8:
            return None
        text = truncate(inputs, room, self.estimator)
        return self._made(shape, text, "truncated", source_tokens, max_tokens)

    def _made(
        self, shape: SummaryInfo, text: str, level: str, source_tokens: int, max_tokens: int
    ) -> NewSummary | None:
        """The summary of ``text``, or None when it is empty, over ``max_tokens`` or not smaller than its sources."""
        if not text or self.estimator.count_text(text) > max_tokens:
            return None
        tokens = self._tokens(shape, text)
        if tokens >= source_tokens:
            return None
        return NewSummary(replace(shape, content=text), level, tokens, source_tokens)

    def _tokens(self, shape: SummaryInfo, text: str) -> int:
        return int(self.estimator.count_messages([render_summary(replace(shape, content=text))]))


def shown_count(core: Core, scope: str, session_id: str, seq: int) -> int:
    """How many messages summary ``seq`` summarized: the visible sources of the leaves under it (a leaf
    covers the hidden messages of its chunk, never given to the summarizer). O(messages covered) keyed
    reads; a compaction asks it only of a stored summary it condenses."""
    leaves: list[int] = []
    todo = [seq]
    edges = summary_children.c
    while todo:
        parent = todo.pop()
        q = select(edges.child_seq).where(edges.scope == scope, edges.session_id == session_id)
        kids = list(core.conn.execute(keyed(q, edges.parent_seq, parent).order_by(edges.child_seq)).scalars())
        todo += kids
        if not kids:
            leaves.append(parent)
    src = summary_sources.c
    ordinals: list[int] = []
    for leaf in leaves:
        q = select(src.message_ordinal).where(src.scope == scope, src.session_id == session_id)
        ordinals += core.conn.execute(keyed(q, src.summary_seq, leaf).order_by(src.message_ordinal)).scalars()
    m = messages.c
    return sum(not r.hidden for r in rows_of(core, scope, session_id, m.ordinal, ordinals, (m.ordinal, m.hidden)))


def truncate(inputs: Sequence[dict[str, Any]], budget: int, estimator: TokenEstimator) -> str:
    """The deterministic last resort: the start of every message, one line each, cut to ``budget`` tokens."""
    # An earlier summary (a condensation's child) by its own lines, not its header or notes.
    lines = [
        f"- {m.get('role', '?')}: {' '.join(searchable_text(m).split())[:200]}" if summarized(m) is None
        else " ".join(" | ".join(summary_lines(str(m.get("content") or ""))).split())[:200]
        for m in inputs
    ]
    text = "(truncated)\n" + "\n".join(lines)
    if estimator.count_text(text) <= budget:
        return text
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimator.count_text(text[:mid] + "…") <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + "…" if lo else ""


# ---------------------------------------------------------------------------------------------- writing


def write_plan(core: Core, scope: str, session_id: str, plan: Plan, ts: int | None = None) -> bool:
    """Write a plan in the caller's transaction (its summaries made at ``ts``, default now); False when
    the context changed since it was planned."""
    sess = core.session_row(scope, session_id, lock=True)
    if sess is None:
        return False
    view = View.load(core, scope, session_id)
    # A session deleted and created again under the id starts over at the same epoch and counters:
    # only its incarnation tells it apart (a plan of the earlier one must never land in it).
    if view.cursor is None or foreign_incarnation(plan.incarnation, sess.incarnation, sess.created_us):
        return False
    if view.epoch != plan.epoch or view.next_summary != plan.next_summary:
        return False
    key = {"scope": scope, "session_id": session_id}
    ts = now_us() if ts is None else ts
    core.conn.execute(insert(summaries), [_summary_row(key, s, ts) for s in plan.summaries])
    sources = [{**key, "summary_seq": s.info.seq, "message_ordinal": o} for s in plan.summaries for o in s.sources]
    if sources:
        core.conn.execute(insert(summary_sources), sources)
    faults.point("lossless.compact.mid_write")
    children = [
        {**key, "parent_seq": s.info.seq, "child_seq": c, "idx": n}
        for s in plan.summaries
        for n, c in enumerate(s.children)
    ]
    if children:
        core.conn.execute(insert(summary_children), children)
    before = {i.ordinal: i.target for i in plan.before}
    after = {i.ordinal: i.target for i in plan.after}
    for first, last in _runs(plan.before, {o for o, target in before.items() if after.get(o) != target}):
        ci = context_items.c
        core.conn.execute(
            delete(context_items).where(
                ci.scope == scope, ci.session_id == session_id, ci.item_ordinal >= first, ci.item_ordinal <= last
            )
        )
    added = [i for i in plan.after if before.get(i.ordinal) != i.target]
    if added:
        core.conn.execute(
            insert(context_items),
            [{**key, "item_ordinal": i.ordinal, "message_ordinal": None, "summary_seq": i.target[1]} for i in added],
        )
    faults.point("lossless.compact.before_view")
    view.tokens += plan.tokens_after - plan.tokens_before
    view.next_summary = plan.next_summary + len(plan.summaries)
    view.epoch += 1
    view.save(core, scope, session_id)
    return True


def plan_landed(core: Core, scope: str, session_id: str, plan: Plan, ts: int) -> bool:
    """Whether ``write_plan(..., plan, ts)``, which ran to its end, landed: its first summary is stored,
    made at ``ts``, in the session the plan was made on; or that session is gone since (deleted, perhaps
    made again under the id: never compacted in its place). An earlier attempt's write whose COMMIT was
    uncertain: its retry finds the epoch moved, by that very write, and must not take it for another
    writer's (and plan again)."""
    sess = core.session_row(scope, session_id)
    if sess is None or foreign_incarnation(plan.incarnation, sess.incarnation, sess.created_us):
        return True
    first = plan.summaries[0]
    s = summaries.c
    row = core.conn.execute(
        select(s.created_us, s.content).where(
            s.scope == scope, s.session_id == session_id, s.summary_seq == first.info.seq
        )
    ).first()
    return row is not None and row.created_us == ts and row.content == column_text(first.info.content)


def _runs(items: Sequence[Item], removed: set[int]) -> list[tuple[int, int]]:
    """(first, last) item ordinal of each run of consecutive ``items`` whose ordinal is in ``removed``.

    The items are the whole context list as planned, and the epoch check above refuses a plan when a
    compaction or a reset changed it since (an import only appends after it): the stored items from
    ``first`` to ``last`` are exactly the run's. A range of the primary key is an index lookup on a
    PostgreSQL table never analyzed; a list of item ordinals (``IN``) was a filter over the session's
    whole context list (786 rows removed for a four-item leaf at 800 items)."""
    out: list[tuple[int, int]] = []
    extends = False
    for item in items:
        if item.ordinal not in removed:
            extends = False
        elif extends:
            out[-1] = (out[-1][0], item.ordinal)
        else:
            out.append((item.ordinal, item.ordinal))
            extends = True
    return out


def incarnation_of(view: View) -> int | None:
    """The session incarnation the view's cursor was issued for (None: no cursor, or a format-1 one)."""
    state = None if view.cursor is None else decode_cursor(view.cursor)
    return None if state is None else state.incarnation


def _summary_row(key: dict[str, str], s: NewSummary, ts: int) -> dict[str, Any]:
    return {
        **key,
        "summary_seq": s.info.seq,
        "kind": s.info.kind,
        "depth": s.info.depth,
        "level": s.level,
        "tokens": s.tokens,
        "source_tokens": s.source_tokens,
        "earliest_ordinal": s.info.earliest,
        "latest_ordinal": s.info.latest,
        "message_count": s.info.message_count,
        "content": column_text(s.info.content),
        "created_us": ts,
    }
