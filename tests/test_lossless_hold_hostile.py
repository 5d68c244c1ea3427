"""A hostile review of the summary budget (``hold``) and of ``audit()``, on both backends.

``hold`` cut a long answer "never between a character and its accents or joiners", as
``unicodedata.combining`` saw them: Thai and Devanagari vowel signs, the keycap mark, a skin tone, a
flag's second letter all have combining class 0, and were cut off their character. It now cuts between
two user-perceived characters (extended grapheme clusters). Its prefix search bisected from the whole
answer, counting half of a 2 MB answer, then a quarter, ...: it now doubles from a short prefix, so a
cut costs what the budget holds, not what the summarizer wrote. Estimators that are not monotonic
in the prefix length (as a BPE is not), a marker larger than the budget, degenerate texts: never over
the budget, never a loop. A summarizer that fails the aggressive retry ends the plan as documented.

``audit()`` held every payload of the transcript at once while it walked the imported branch (a
session of large tool outputs: its whole size in memory); it now keeps the links only. A seeded walk of
branches, rewrites, deletes and re-creations, events and resets, and compactions raced by other
writers in threads, all audit clean.
"""

from __future__ import annotations

import random
import threading
import time
import tracemalloc
import zlib
from collections.abc import Sequence
from typing import Any

import pytest
import regex
from conftest import commit_with as commit
from conftest import finished_turn, module_store_fixtures, tool_round
from sqlalchemy import select

from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from engines.lossless.context import SummaryInfo, load_items, render_summary
from engines.lossless.tables import View, summaries
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.model import message_text
from transcript_store.summarize import CUT_MARK, ExtractiveSummarizer, hold
from transcript_store.tokens import RoughEstimator, TokenEstimator

A = "scope-hold-hostile"
SMALL = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 40,
         "condensed_summary_tokens": 60, "condense_fanin": 2}

shared_url, store, sid = module_store_fixtures(A, "hold_hostile")


def characters(text: str) -> set[int]:
    """The offsets between two user-perceived characters (extended grapheme clusters) of ``text``."""
    return {0} | {m.end() for m in regex.finditer(r"\X", text)}


def body_of(held: str, budget: int) -> str:
    mark = "\n" + CUT_MARK.format(max_tokens=budget)
    assert held.endswith(mark), held[-60:]
    return held[: -len(mark)]


# ---------------------------------------------------------------------------------------------- estimators


class CharEstimator:
    """One token per character."""

    def count_text(self, text: str) -> int:
        return len(text)

    def count_messages(self, messages: Sequence[dict[str, Any]]) -> int:
        return 3 + sum(4 + len(message_text(m)) for m in messages)


class BpeLike:
    """Not monotonic in the prefix length, as a BPE is not: a word cut short costs more than the whole
    word (``"summar"`` two tokens, ``"summary"`` one), and a line end merges with what follows it."""

    def count_text(self, text: str) -> int:
        words = regex.findall(r"\w+|[^\w\s]|\s+", text)
        tokens = sum(1 + len(w) // 6 for w in words)
        if words and words[-1][-1:].isalnum() and len(words[-1]) % 3:
            tokens += 2  # a cut word: its pieces do not merge
        return tokens - text.count("\n[")  # "\n[" is one token

    def count_messages(self, messages: Sequence[dict[str, Any]]) -> int:
        return 3 + sum(3 + self.count_text(message_text(m)) for m in messages)


class Jumpy:
    """Counts that jump up and down with the last characters (a stable hash): no order at all."""

    def count_text(self, text: str) -> int:
        return len(text) // 5 + zlib.crc32(text[-3:].encode("utf-8", "surrogatepass")) % 7

    def count_messages(self, messages: Sequence[dict[str, Any]]) -> int:
        return 3 + sum(4 + self.count_text(message_text(m)) for m in messages)


class CostlyMark(RoughEstimator):
    """Counts the ellipsis of the marker as 500 tokens: the marker alone is over any budget."""

    def count_text(self, text: str) -> int:
        return super().count_text(text) + 500 * text.count("…")


class Counting(RoughEstimator):
    """Counts how many characters it was asked to count."""

    def __init__(self) -> None:
        self.read = 0

    def count_text(self, text: str) -> int:
        self.read += len(text)
        return super().count_text(text)


# ---------------------------------------------------------------------------------------------- hold: characters

SCRIPTS = {
    "thai": "สวัสดีครับวันนี้อากาศดีมาก" * 120,  # vowel signs above and below: combining class 0 for most
    "devanagari": "नमस्तेदुनियाकैसेहो" * 150,  # vowel signs (Mc and Mn), class 0
    "keycap": "1\ufe0f\u20e3#\ufe0f\u20e3" * 300,  # the keycap mark is Me, class 0
    "flags": "🇫🇷🇯🇵🇧🇷" * 200,  # a flag is two regional indicators
    "skin tones": "👍🏽👋🏿" * 300,
    "subdivision flag": "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f" * 100,  # tag characters
    "hangul jamo": "\u1112\u1161\u11ab\u1100\u1173\u11af" * 300,  # a syllable spelled in conjoining jamo
    "zwj family": "👨\u200d👩\u200d👧\u200d👦" * 300,
    "accents": "e\u0301\u0323a\u0300" * 500,
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_hold_never_cuts_a_character_apart(name: str) -> None:
    """At every budget, what is kept ends between two user-perceived characters of the answer: before,
    Thai, Devanagari, keycaps, skin tones, flags and jamo lost their vowel signs, marks or second halves."""
    text = SCRIPTS[name]
    bounds = characters(text)
    first = min(bounds - {0})  # a budget with room for less than one character splits it (see below)
    split = []
    for budget in range(16, 90):
        for est in (RoughEstimator(), CharEstimator()):
            held = hold(text, budget, est)
            assert est.count_text(held) <= budget
            if held:
                body = body_of(held, budget)
                assert body and text.startswith(body)
                if len(body) not in bounds and len(body) >= first:
                    split.append((budget, type(est).__name__, body[-2:], text[len(body):len(body) + 2]))
    assert split == [], split[:5]


def test_a_character_longer_than_the_budget_is_still_cut_within_it() -> None:
    """One cluster longer than what fits (a letter under 3,000 accents, one ZWJ chain): no character
    boundary fits, the cut falls between two code points, within the budget all the same."""
    for text in ("e" + "\u0301" * 3000, "👩\u200d" * 2000 + "👩", "\u0301" * 3000, "\u200d" * 3000):
        held = hold(text, 40, RoughEstimator())
        assert 0 < RoughEstimator().count_text(held) <= 40 and text.startswith(body_of(held, 40))


# ---------------------------------------------------------------------------------------------- hold: estimators


TEXTS = {
    "lines": "\n".join(f"- point {n}: the summary says something longer" for n in range(200)),
    "crlf": "\r\n".join(f"line {n} of a windows answer" for n in range(300)),
    "one word": "supercalifragilistic" * 500,
    "cjk": "汉字没有空格。" * 400,
    "nul": "\x00" * 4000,
    "lone surrogates": "\ud800a\udfff" * 1000,
    "only combining": "\u0301\u0302" * 2000,
    "only zwj": "\u200d" * 4000,
}


@pytest.mark.parametrize("estimator", [BpeLike(), Jumpy(), CostlyMark(), CharEstimator(), RoughEstimator()],
                         ids=["bpe-like", "jumpy", "costly-mark", "chars", "rough"])
@pytest.mark.parametrize("name", list(TEXTS))
def test_hold_is_within_budget_whatever_the_estimator(name: str, estimator: TokenEstimator) -> None:
    """An estimator that counts a shorter prefix higher, or the marker above the budget: the cut is
    within the budget or empty (never over it, never a loop), the same every time, a prefix of the answer."""
    text = TEXTS[name]
    for budget in (16, 17, 40, 129, 600):
        held = hold(text, budget, estimator)
        assert held == hold(text, budget, estimator)
        assert estimator.count_text(held) <= budget, (budget, held[-40:])
        if held == text:
            continue
        if held:
            body = body_of(held, budget)
            assert body and text.startswith(body) and body == body.rstrip()
            assert not body.endswith("\r")  # a CRLF line end is cut whole
        else:  # nothing fits: not even the marker, or no prefix (the planner falls back or skips the step)
            mark = "\n" + CUT_MARK.format(max_tokens=budget)
            small = min((estimator.count_text(text[:n].rstrip() + mark) for n in range(1, 12)), default=0)
            assert estimator.count_text(mark) > budget or small > budget or isinstance(estimator, Jumpy)


def test_a_marker_over_the_budget_gives_nothing() -> None:
    assert hold("x" * 1000, 40, CostlyMark()) == ""
    assert hold("x" * 1000, 16, CharEstimator()) == ""  # 21 characters of marker


def test_a_crlf_answer_is_cut_at_a_line_end() -> None:
    text = TEXTS["crlf"]
    body = body_of(hold(text, 200, RoughEstimator()), 200)
    assert text[len(body):].startswith("\r\n"), repr(text[len(body):len(body) + 4])


# ---------------------------------------------------------------------------------------------- hold: cost


# The assertions are proportions of the answer's size (what was read, the time of one count): 500 KB
# shows a bisection as well as 2 MB does; 2 MB in the slow tier.
@pytest.mark.parametrize("size", [500_000, pytest.param(2_000_000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("unit", ["word ", "x", "汉", "e\u0301"], ids=["words", "one word", "cjk", "accents"])
def test_holding_a_2mb_answer_costs_about_one_count_of_it(unit: str, size: int) -> None:
    """The search bisected from the whole length: it counted half the answer, a quarter, ... (twice the
    answer in all, 0.75 s for 2 MB of CJK). Doubling from a short prefix reads what the budget holds."""
    text = unit * (size // len(unit))
    started = time.perf_counter()
    RoughEstimator().count_text(text)
    one_count = time.perf_counter() - started  # what the caller already spent on the answer
    est = Counting()
    started = time.perf_counter()
    held = hold(text, 600, est)
    elapsed = time.perf_counter() - started
    assert 0 < RoughEstimator().count_text(held) <= 600
    assert est.read <= len(text) + size // 10, (est.read, len(text))  # the first count, then short prefixes
    assert elapsed < 3 * one_count + 0.5, (elapsed, one_count)  # (0.4 s for 2 MB of CJK, alone)


# ---------------------------------------------------------------------------------------------- the engine


def make_engine(
    store: TranscriptStore, summarizer: Any, config: dict[str, Any] | None = None,
    estimator: TokenEstimator | None = None,
) -> LosslessEngine:
    return LosslessEngine(EngineContext(store=store, config={**SMALL, **(config or {})}, summarizer=summarizer,
                                        estimator=estimator or RoughEstimator()))


def run_turns(store: TranscriptStore, engine: LosslessEngine, sid: str, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        assert commit(store, engine, finished_turn(store, A, sid, f"t{i}")).status == "committed"


def summary_rows(store: TranscriptStore, sid: str) -> list[Any]:
    return store.read(lambda c: c.conn.execute(
        select(summaries).where(summaries.c.scope == A, summaries.c.session_id == sid)
        .order_by(summaries.c.summary_seq)).all())


def problems(store: TranscriptStore, sid: str) -> list[str]:
    return store.read(lambda c: audit(c, A, sid)).problems


class Wordy:
    """Ignores ``max_tokens``: 30 characters per input in ``script``, without a space, still far smaller
    than what it summarizes. ``then``: what the aggressive call does instead (raise, or answer it)."""

    def __init__(self, script: str = "thai", then: Any = "same") -> None:
        self.script, self.then = script, then
        self.levels: list[str] = []
        self.answers: list[str] = []

    def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> Any:
        self.levels.append(kw["level"])
        if kw["level"] == "aggressive" and self.then != "same":
            if isinstance(self.then, BaseException):
                raise self.then
            return self.then
        self.answers.append(SCRIPTS[self.script][: 30 * len(messages)])  # no line, sentence or space to cut at
        return self.answers[-1]


@pytest.mark.parametrize("script", ["thai", "devanagari"])
def test_cut_summaries_keep_whole_characters_and_assemble_keeps_its_budget(
    store: TranscriptStore, sid: str, script: str
) -> None:
    """The cut as stored: whole characters, its tokens those of what assemble shows, the view's total the
    context's, and an assembled context within any budget it is given."""
    wordy = Wordy(script)
    engine = make_engine(store, wordy, {"leaf_summary_tokens": 33, "condensed_summary_tokens": 47})
    run_turns(store, engine, sid, 14)
    for budget in (1200, 800):
        assert engine.compact(scope=A, session_id=sid, force=True, token_budget=budget).ok
    rows = summary_rows(store, sid)
    cut = [r for r in rows if r.level == "truncated"]
    assert cut, [(r.summary_seq, r.level) for r in rows]
    est = RoughEstimator()
    for r in rows:
        limit = 33 if r.kind == "leaf" else 47
        assert est.count_text(r.content) <= limit and r.tokens < r.source_tokens, r.summary_seq
        info = SummaryInfo(r.summary_seq, r.kind, r.depth, r.earliest_ordinal, r.latest_ordinal, r.message_count,
                           r.content)
        assert r.tokens == est.count_messages([render_summary(info)])
    for r in cut:
        body = body_of(r.content, 33 if r.kind == "leaf" else 47)
        answer = next(a for a in wordy.answers if a.startswith(body))
        assert len(body) in characters(answer), (r.summary_seq, body[-3:], answer[len(body):len(body) + 3])
    items = store.read(lambda c: load_items(c, A, sid))
    assert store.read(lambda c: View.load(c, A, sid)).tokens == sum(i.tokens for i in items)
    for budget in (300, 700, 5000):
        shown = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=budget)
        assert shown.estimated_tokens <= budget, (budget, shown.estimated_tokens)
    assert problems(store, sid) == []


@pytest.mark.parametrize("then", [RuntimeError("rate limited"), None, 42], ids=["raises", "none", "int"])
def test_an_aggressive_retry_that_fails_ends_the_plan_and_keeps_the_raw_messages(
    store: TranscriptStore, sid: str, then: Any
) -> None:
    """A long normal answer, then the retry raises or answers no text: as documented for any summarizer
    failure, the plan ends (``ok: false``, the reason given), nothing of the step is written, the raw
    messages stay, and a later compaction with a working summarizer picks up from there."""
    wordy = Wordy("thai", then=then)
    engine = make_engine(store, wordy)
    run_turns(store, engine, sid, 8)
    before = store.read(lambda c: View.load(c, A, sid))
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=1000)
    assert not result.ok and not result.compacted and "summarizer failed" in str(result.reason), result
    assert wordy.levels == ["normal", "aggressive"]
    assert summary_rows(store, sid) == [] and store.read(lambda c: View.load(c, A, sid)) == before
    assert problems(store, sid) == []
    again = make_engine(store, ExtractiveSummarizer()).compact(scope=A, session_id=sid, force=True, token_budget=1000)
    assert again.ok and again.compacted, again
    assert problems(store, sid) == []


@pytest.mark.parametrize("estimator", [BpeLike(), Jumpy()], ids=["bpe-like", "jumpy"])
def test_compaction_with_an_erratic_estimator_shrinks_and_ends(
    store: TranscriptStore, sid: str, estimator: TokenEstimator
) -> None:
    """Every summary within its budget by the engine's count and smaller than its sources, whatever the
    estimator's order; compaction ends (rounds bounded) and the tables audit clean."""
    engine = make_engine(store, Wordy("thai"), estimator=estimator)
    run_turns(store, engine, sid, 12)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=1000)
    assert result.ok and result.compacted and result.tokens_after < result.tokens_before, result
    for r in summary_rows(store, sid):
        assert estimator.count_text(r.content) <= (40 if r.kind == "leaf" else 60) and r.tokens < r.source_tokens
    assert problems(store, sid) == []


def test_a_budget_smaller_than_the_marker_skips_the_step_and_ends(store: TranscriptStore, sid: str) -> None:
    """``leaf_summary_tokens`` 16 counted per character: neither the marker (21) nor the fallback fits. No
    summary over its budget is written, the compaction ends, and says it could not shrink."""
    engine = make_engine(store, Wordy("thai"), {"leaf_summary_tokens": 16, "condensed_summary_tokens": 16},
                         CharEstimator())
    run_turns(store, engine, sid, 8)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=100_000)
    assert result.ok and not result.compacted, result
    assert summary_rows(store, sid) == [] and problems(store, sid) == []


# ---------------------------------------------------------------------------------------------- audit


def test_audit_holds_the_links_of_the_transcript_not_its_payloads(store: TranscriptStore, sid: str) -> None:
    """1,200 messages of 10 KB: the audit held every row of the transcript, payloads included, while it
    walked the imported branch (12 MB here; a session of large tool outputs, its whole size). It keeps
    each entry's links and reads the payloads a page at a time."""
    filler = "x" * 10_000
    for start in range(0, 1200, 200):
        store.append_many(A, sid, [{"message": {"role": "user", "content": f"m{i} {filler}"}}
                                   for i in range(start, start + 200)])
    engine = make_engine(store, ExtractiveSummarizer())
    engine.bootstrap(scope=A, session_id=sid, fence=None)
    size = store.session_bytes(A, sid)
    tracemalloc.start()
    try:
        found = store.read(lambda c: audit(c, A, sid))
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found.problems == [] and found.messages == 1200
    assert peak < size / 2, (peak, size)


OPS = ["turn"] * 6 + ["maintain", "compact", "branch", "rewrite", "grep", "assemble", "event", "append",
                      "recreate", "empty"]


# One seed's 70 steps in make test (it reaches every move the assertion asks for); the second seed in
# the slow tier.
@pytest.mark.parametrize("seed", [7, pytest.param(20, marks=pytest.mark.slow)])
def test_a_seeded_walk_of_moves_audits_clean_after_every_step(store: TranscriptStore, sid: str, seed: int) -> None:
    """Turns with tool calls, compactions at several budgets, branches anywhere (to the empty path too),
    redactions, events, appends outside a turn, searches (which apply a pending reset), the session
    deleted and created again under its id: after every step the audit finds nothing."""
    rnd = random.Random(seed)
    engine = make_engine(store, ExtractiveSummarizer(), {"context_window": 900})
    n, most, seen = 0, 0, []
    for step in range(70):
        op = rnd.choice(OPS)
        seen.append(op)
        visible = store.read_visible(A, sid)
        if op == "turn":
            n += 1
            tools = [*tool_round(f"c{n}", "result " * rnd.randint(1, 60)), {"role": "assistant", "content": "ok"}]
            turn = finished_turn(store, A, sid, f"t{n}", replies=tools if rnd.random() < 0.3 else None)
            assert commit(store, engine, turn).status == "committed"
        elif op == "maintain":
            engine.maintain(scope=A, session_id=sid)
        elif op == "compact":
            engine.compact(scope=A, session_id=sid, force=True, token_budget=rnd.choice([300, 600, 1200]))
        elif op == "branch" and visible:
            store.branch(A, sid, rnd.choice(visible).entry_id)
        elif op == "rewrite" and visible:
            target = rnd.choice(visible).entry_id
            store.rewrite_entries(A, sid, [{"entry_id": target, "message": {"role": "user", "content": "[redacted]"}}])
        elif op == "grep":
            engine.handle_tool_call("lcm_grep", {"pattern": "question"}, scope=A, session_id=sid)
        elif op == "assemble":
            engine.assemble(scope=A, session_id=sid, fence=None, token_budget=rnd.choice([400, 5000]))
        elif op == "event":
            store.append(A, sid, kind="custom", payload={"step": step})
        elif op == "append":
            store.append(A, sid, {"role": "user", "content": f"appended outside a turn {step}"})
        elif op == "recreate" and rnd.random() < 0.4:
            store.delete_session(A, sid)
            store.create_session(A, session_id=sid)
        elif op == "empty" and rnd.random() < 0.3:
            store.branch(A, sid, None)
        found = store.read(lambda c: audit(c, A, sid))
        assert found.problems == [], (step, seen[-5:])
        most = max(most, found.summaries)
    assert most >= 4 and {"branch", "rewrite", "recreate", "empty"} <= set(seen), (most, seen)
    engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)
    found = store.read(lambda c: audit(c, A, sid))
    assert found.problems == []
    assert found.covered_entry_ids == {e.entry_id for e in store.read_visible(A, sid)}


class Gated(ExtractiveSummarizer):
    """Summarizes once ``go`` is set: the compaction's plan waits while other writers move the session."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting, self.go = threading.Event(), threading.Event()

    def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        self.waiting.set()
        assert self.go.wait(30)
        return super().summarize(messages, **kw)


@pytest.mark.parametrize("move", ["commits", "branch", "rewrite", "compaction"])
def test_a_compaction_raced_by_other_writers_in_threads_audits_clean(
    store: TranscriptStore, sid: str, move: str
) -> None:
    """While one thread's summarizer runs, the main thread commits turns, branches, redacts or compacts
    through another engine; audits run all along. Whatever the compaction then writes or refuses, the
    audit finds nothing, in the middle of the race or after it."""
    gated = Gated()
    slow, other = make_engine(store, gated), make_engine(store, ExtractiveSummarizer())
    run_turns(store, other, sid, 10)
    outcome: list[Any] = []
    worker = threading.Thread(target=lambda: outcome.append(
        slow.compact(scope=A, session_id=sid, force=True, token_budget=900)))
    worker.start()
    try:
        assert gated.waiting.wait(30)
        if move == "commits":
            for i in range(10, 14):
                run_turns(store, other, sid, 1, start=i)
                assert problems(store, sid) == []
        elif move == "branch":
            store.branch(A, sid, store.read_visible(A, sid)[5].entry_id)
            run_turns(store, other, sid, 1, start=10)
        elif move == "rewrite":
            target = store.read_visible(A, sid)[2].entry_id
            store.rewrite_entries(A, sid, [{"entry_id": target, "message": {"role": "user", "content": "[redacted]"}}])
        else:
            assert other.compact(scope=A, session_id=sid, force=True, token_budget=900).compacted
        assert problems(store, sid) == []
    finally:
        gated.go.set()
        worker.join(60)
    assert outcome and outcome[0] is not None
    assert problems(store, sid) == []
    other.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)
    assert problems(store, sid) == []


def test_audits_in_a_thread_see_one_snapshot_while_turns_commit(store: TranscriptStore, sid: str) -> None:
    """An operator's audit on a live session: each reads one snapshot, so turns committing and compacting
    meanwhile are never half seen."""
    engine = make_engine(store, ExtractiveSummarizer(), {"context_window": 800})
    run_turns(store, engine, sid, 4)
    stop, found = threading.Event(), []

    def audits() -> None:
        while not stop.is_set():
            found.extend(problems(store, sid))

    watcher = threading.Thread(target=audits)
    watcher.start()
    try:
        for i in range(4, 16):
            run_turns(store, engine, sid, 1, start=i)
            engine.maintain(scope=A, session_id=sid)
    finally:
        stop.set()
        watcher.join(30)
    assert found == []
    assert summary_rows(store, sid), "compactions ran while the audits did"
