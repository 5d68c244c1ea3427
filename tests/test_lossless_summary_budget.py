"""A summary is held to the ``max_tokens`` it was asked for, on both backends.

A summarizer (a model) that ignores ``max_tokens`` answered a long summary, and the engine stored it as
it was: a leaf of 600 tokens asked for came back at 2,000, compaction gained little, and a context that
had to shrink hardly did. Now an answer over its budget (counted with the engine's estimator) is
refused and the aggressive one asked for; the last answer that summarized but ran long is cut at a
clean boundary and marked; an answer as large as its sources falls back to the start of every message.
What a cut drops stays in the tables (the messages, a condensed summary's children): the recall tools
find it.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
import unicodedata
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import commit_with as commit
from conftest import finished_turn, module_store_fixtures
from sqlalchemy import select
from test_lossless_compaction_review import A, invariants

from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from engines.lossless.tables import View, messages, summaries
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.model import message_text
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator, TokenEstimator

LEAF, CONDENSED = 40, 60
CONFIG = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": LEAF,
          "condensed_summary_tokens": CONDENSED, "condense_fanin": 3}
BUDGET = {"leaf": LEAF, "condensed": CONDENSED}
MARK = re.compile(r"\n\[… cut to (\d+) tokens\]\Z")

shared_url, store, sid = module_store_fixtures(A, "summary_budget")


class Verbose:
    """Ignores ``max_tokens``: a long summary, still smaller than what it summarizes (one line per input,
    or prose, or CJK text without a space). ``obeys``: the levels at which it keeps to the budget."""

    def __init__(self, style: str = "lines", obeys: Sequence[str] = ()) -> None:
        self.style, self.obeys = style, tuple(obeys)
        self.calls: list[tuple[str, int, str]] = []  # (level, max_tokens, answer)

    def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        level, max_tokens = kw.get("level", "normal"), kw.get("max_tokens", 1024)
        obeys = level in self.obeys
        answer = ExtractiveSummarizer().summarize(messages, **kw) if obeys else self.long(messages)
        self.calls.append((level, max_tokens, answer))
        return answer

    def long(self, messages: Sequence[dict[str, Any]]) -> str:
        """Short lines, sentences or CJK sentences: a clean boundary always lies near where the budget ends."""
        words = [" ".join(message_text(m).split()).split(" ")[:16] for m in messages]
        if self.style == "lines":
            return "\n".join(line for w in words for line in textwrap.wrap(" ".join(w)[:100], 24))
        if self.style == "prose":
            return " ".join(" ".join(w[n:n + 4]).capitalize() + "." for w in words for n in range(0, len(w), 4))
        return "".join(f"对话{n}空格。" * 4 for n in range(len(messages)))


class CharEstimator:
    """One token per character: counts four times what the rough estimator does for English."""

    def count_text(self, text: str) -> int:
        return len(text)

    def count_messages(self, messages: Sequence[dict[str, Any]]) -> int:
        return 3 + sum(4 + len(message_text(m)) for m in messages)


def make_engine(
    store: TranscriptStore, summarizer: Any, config: dict[str, Any] | None = None,
    estimator: TokenEstimator | None = None,
) -> LosslessEngine:
    return LosslessEngine(EngineContext(store=store, config={**CONFIG, **(config or {})}, summarizer=summarizer,
                                        estimator=estimator or RoughEstimator()))


def run_turns(store: TranscriptStore, engine: LosslessEngine, sid: str, n: int) -> None:
    for i in range(n):
        assert commit(store, engine, finished_turn(store, A, sid, f"t{i}")).status == "committed"


def summary_rows(store: TranscriptStore, sid: str) -> list[Any]:
    return store.read(lambda c: c.conn.execute(
        select(summaries).where(summaries.c.scope == A, summaries.c.session_id == sid)
        .order_by(summaries.c.summary_seq)).all())


def compact_all(engine: LosslessEngine, sid: str) -> None:
    for budget in (1200, 900):
        result = engine.compact(scope=A, session_id=sid, force=True, token_budget=budget)
        assert result.ok and result.compacted, result


# ---------------------------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("style", ["lines", "prose", "cjk"])
def test_a_summary_over_its_budget_is_cut_to_it_at_a_clean_boundary(
    store: TranscriptStore, sid: str, style: str
) -> None:
    verbose = Verbose(style)
    engine = make_engine(store, verbose)
    run_turns(store, engine, sid, 16)
    compact_all(engine, sid)
    rows = summary_rows(store, sid)
    assert {r.kind for r in rows} == {"leaf", "condensed"}
    est = RoughEstimator()
    asked = {max_tokens for _level, max_tokens, _answer in verbose.calls}
    assert asked == {LEAF, CONDENSED}
    answers = [answer for _level, _max, answer in verbose.calls]
    cut = set()
    for r in rows:
        assert est.count_text(r.content) <= BUDGET[r.kind], (r.summary_seq, r.kind, est.count_text(r.content))
        mark = MARK.search(r.content)
        if mark is None:  # an answer within its budget (a condensation of two short children) stays whole
            assert r.level == "normal" and r.content in answers, r.content
            continue
        assert int(mark.group(1)) == BUDGET[r.kind] and r.level == "truncated", r.content
        cut.add(r.kind)
        body = r.content[: mark.start()]
        source = next(a for a in answers if a.startswith(body))  # the start of what the summarizer said
        rest = source[len(body):]
        if style == "lines":  # at a line end (its trailing space dropped)
            assert rest.lstrip(" ").startswith("\n"), (body[-40:], rest[:40])
        elif style == "prose":
            assert body.endswith(".") and rest[:1] == " ", (body[-40:], rest[:40])
        else:
            assert body.endswith("。"), body[-20:]
    assert cut == {"leaf", "condensed"}
    assert invariants(store, sid, full=True) == []


def test_a_cut_summary_loses_nothing_from_the_tables(store: TranscriptStore, sid: str) -> None:
    """What the cut drops is in the message rows, which ``lcm_expand`` and ``lcm_grep`` read."""
    engine = make_engine(store, Verbose("lines"))
    for i in range(12):
        tail = " the zebra-password is 4711" if i == 1 else ""
        turn = finished_turn(store, A, sid, f"t{i}", question=f"question {i} " + "words " * 40 + tail)
        assert commit(store, engine, turn).status == "committed"
    compact_all(engine, sid)
    rows = summary_rows(store, sid)
    assert rows and not any("zebra" in r.content for r in rows)
    stored = store.read(lambda c: c.conn.execute(
        select(messages.c.entry_id, messages.c.message).where(messages.c.scope == A, messages.c.session_id == sid)
    ).all())
    visible = store.read_visible(A, sid)
    assert sorted((r.entry_id, json.loads(r.message)) for r in stored) == sorted(
        (e.entry_id, e.message) for e in visible), "every message is kept, exactly"
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "zebra-password"}, scope=A, session_id=sid))
    assert found["count"] == 1, found
    leaf = next(r for r in rows if r.kind == "leaf" and r.earliest_ordinal == 0)
    expanded = json.loads(engine.handle_tool_call("lcm_expand", {"id": f"sum_{leaf.summary_seq}"},
                                                  scope=A, session_id=sid))
    assert [i["kind"] for i in expanded["items"]] == ["message"] * leaf.message_count, expanded
    assert invariants(store, sid, full=True) == []


def test_compaction_reaches_its_target_with_a_summarizer_that_ignores_max_tokens(
    store: TranscriptStore, sid: str
) -> None:
    """Summaries of 90% of their sources took round after round and left the context over its target."""

    def padded(messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        text = "\n".join(" ".join(message_text(m).split()) for m in messages)
        return text[: int(len(text) * 0.85)]

    class Padded:
        def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
            return padded(messages, **kw)

    engine = make_engine(store, Padded())
    run_turns(store, engine, sid, 20)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=1600)
    assert result.ok and result.compacted, result
    target = engine.budget(A, sid, 1600).target
    assert result.tokens_after is not None and result.tokens_after <= target, (result, target)
    assert store.read(lambda c: View.load(c, A, sid)).tokens == result.tokens_after
    assert invariants(store, sid, full=True) == []


def test_an_answer_over_budget_is_asked_again_at_the_aggressive_level(store: TranscriptStore, sid: str) -> None:
    """A summarizer that keeps to the budget when pressed gets the chance: its own brief summary, uncut."""
    verbose = Verbose("lines", obeys=("aggressive",))
    engine = make_engine(store, verbose)
    run_turns(store, engine, sid, 12)
    compact_all(engine, sid)
    rows = summary_rows(store, sid)
    levels = [(r.summary_seq, r.kind, r.level) for r in rows]
    assert rows and {r.level for r in rows if r.kind == "leaf"} == {"aggressive"}, levels
    # A condensation's answer is shorter (its children's text alone, since their ids no longer open each):
    # one within the budget at the normal level is kept as it is, never asked again.
    fitting = {a for level, m, a in verbose.calls if level == "normal" and RoughEstimator().count_text(a) <= m}
    assert all(r.content in fitting for r in rows if r.level == "normal"), levels
    assert not any(MARK.search(r.content) for r in rows)
    assert all(RoughEstimator().count_text(r.content) <= BUDGET[r.kind] for r in rows)
    assert [level for level, _max, _answer in verbose.calls][:2] == ["normal", "aggressive"]
    assert invariants(store, sid, full=True) == []


def test_the_budget_is_counted_with_the_engines_estimator(store: TranscriptStore, sid: str) -> None:
    """The extractive summarizer keeps to ``max_tokens`` by its rough count; an engine counting one token
    per character holds the summary to ``max_tokens`` characters, and the context's count is its own."""
    est = CharEstimator()
    config = {"leaf_summary_tokens": 160, "condensed_summary_tokens": 200, "leaf_chunk_tokens": 4000}
    engine = make_engine(store, ExtractiveSummarizer(), config, est)
    run_turns(store, engine, sid, 12)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=6000)
    assert result.ok and result.compacted, result
    rows = summary_rows(store, sid)
    assert rows
    for r in rows:
        assert len(r.content) <= config[f"{r.kind}_summary_tokens"], (r.summary_seq, len(r.content))
    problems = store.read(lambda c: audit(c, A, sid)).problems
    assert problems == []


def test_an_answer_as_large_as_its_sources_falls_back_to_the_start_of_every_message(
    store: TranscriptStore, sid: str
) -> None:
    """An echo summarized nothing: the truncation keeps the start of each source message, not of the echo."""

    class Echo:
        def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
            return json.dumps(list(messages))

    engine = make_engine(store, Echo(), {"leaf_summary_tokens": 120})
    run_turns(store, engine, sid, 10)
    assert engine.compact(scope=A, session_id=sid, force=True, token_budget=1200).compacted
    rows = summary_rows(store, sid)
    assert rows and all(r.level == "truncated" and r.content.startswith("(truncated)\n") for r in rows)
    budgets = {"leaf": 120, "condensed": CONDENSED}
    assert all(RoughEstimator().count_text(r.content) <= budgets[r.kind] for r in rows)
    assert invariants(store, sid, full=True) == []


# ---------------------------------------------------------------------------------------------- the cut

TEXTS = {
    "lines": "\n".join(f"- line {n}: " + "some words " * 4 for n in range(80)),
    "prose": " ".join(f"Sentence number {n} says a thing." for n in range(200)),
    "one word": "x" * 5000,
    "cjk": "汉字没有空格" * 300,
    "accents": "e\u0301" * 2000,
    "emoji": "👩\u200d💻\ufe0f" * 600,
}


@pytest.mark.parametrize("estimator", [RoughEstimator(), CharEstimator()], ids=["rough", "chars"])
@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("budget", [16, 50, 333])
def test_hold_cuts_within_the_budget_deterministically(name: str, budget: int, estimator: TokenEstimator) -> None:
    from transcript_store.summarize import CUT_MARK, hold

    text = TEXTS[name]
    held = hold(text, budget, estimator)
    assert held == hold(text, budget, estimator)
    mark = "\n" + CUT_MARK.format(max_tokens=budget)
    if estimator.count_text(mark) >= budget:
        assert held == ""  # not even the marker fits: no summary (compaction falls back or skips the step)
        return
    assert 0 < estimator.count_text(held) <= budget, (held, estimator.count_text(held))
    assert held.endswith(mark)
    body = held[: -len(mark)]
    assert body and text.startswith(body)
    rest = text[len(body):]
    assert not unicodedata.combining(rest[0]) and rest[0] not in "\u200d\ufe0e\ufe0f", repr(rest[:3])
    assert body[-1] not in "\u200d"
    if name in ("lines", "prose"):
        assert rest[:1] in (" ", "\n"), repr(rest[:10])  # never inside a word
    if budget == 333:  # room for a line end or a sentence end in the last quarter of what fits
        assert name != "lines" or rest.lstrip(" ").startswith("\n")
        assert name != "prose" or body.endswith(".")
    # The cut keeps most of what fits: at least three quarters of the longest prefix within the budget.
    longest = max(n for n in range(len(text) + 1)
                  if n <= 4 * budget + 8 and estimator.count_text(text[:n]) <= budget - estimator.count_text(mark))
    assert len(body) >= math.floor(longest * 3 / 4) - 1, (len(body), longest)


def test_hold_keeps_a_text_within_the_budget_as_it_is() -> None:
    from transcript_store.summarize import hold

    assert hold("a short summary", 16, RoughEstimator()) == "a short summary"
    assert hold("x" * 100, 1, RoughEstimator()) == ""  # not even the marker fits
