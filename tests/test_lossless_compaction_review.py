"""A hostile review of the lossless engine's compaction, ingest, reset and assembly, on both backends.

What a summarizer answers is not trusted: anything but a string ends the plan (``None`` was the
summary "None"), NUL and lone surrogates become U+FFFD before the tokens are counted (a lone surrogate
failed the write and had the host isolate the engine; NUL was counted short, and assemble went over
its budget). A compaction applies a pending reset first: ``maintain`` after a redaction sent the
redacted message to the summarizer, and the next import threw the summaries away. Garbage that
never shrinks, tiny and huge budgets, a compaction racing another process (a commit, a branch, a
rewrite, another compaction) while its summarizer runs, and a SIGKILL between the summarizer and the
write all leave the tables consistent: ``invariants`` reads them and checks the DAG itself.
"""

from __future__ import annotations

import json
import os
import select as selecting
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import commit_with as commit
from conftest import finished_turn, module_store_fixtures
from hosting import RecordingModel
from sqlalchemy import select

from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from engines.lossless.context import SummaryInfo, load_items, render_summary
from engines.lossless.tables import View, context_items, messages, summaries, summary_children, summary_sources
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.host import HostRuntime
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-cr"
SMALL = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
         "condensed_summary_tokens": 160, "condense_fanin": 3}

shared_url, store, sid = module_store_fixtures(A, "compaction_review")


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


class Scripted(ExtractiveSummarizer):
    """Records what it was sent; answers ``answer(messages, kw)`` (default: the extractive summary)."""

    def __init__(self, answer: Any = None) -> None:
        super().__init__()
        self.answer, self.calls, self.seen = answer, 0, []

    def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> Any:
        self.calls += 1
        self.seen.append(json.dumps([list(messages), kw.get("previous_summary")], ensure_ascii=False))
        if self.answer is not None:
            return self.answer(messages, kw)
        return super().summarize(messages, **kw)


def make_engine(store: TranscriptStore, config: dict[str, Any] | None = None, summarizer: Any = None) -> LosslessEngine:
    return LosslessEngine(EngineContext(store=store, config=config or {}, summarizer=summarizer or Scripted(),
                                        estimator=RoughEstimator()))




def run_turns(store: TranscriptStore, engine: LosslessEngine, sid: str, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        assert commit(store, engine, finished_turn(store, A, sid, f"t{i}")).status == "committed"


def invariants(store: TranscriptStore, sid: str, *, full: bool = False) -> list[str]:
    """Every rule of the engine's tables, read from the tables (not through the engine's own audit).

    The context list, in order, covers the ingested messages at active positions 0, 1, 2, ... each
    exactly once, and every message row is covered; each item is one message or one summary; a leaf has
    sources and depth 0, a condensed summary children and depth 1 + its deepest child's; every source and
    child exists, a summary has one parent at most and none when it is in context; the range and count
    a summary states are those it covers; a summary is smaller than what it replaced; the view's
    position and tokens agree with the list. ``full``: the list covers the whole visible transcript.
    """

    def run(c: Any) -> tuple[list[str], list[str]]:
        def where(t: Any) -> tuple[Any, Any]:
            return t.c.scope == A, t.c.session_id == sid

        msgs = {r.ordinal: r for r in c.conn.execute(select(messages).where(*where(messages)))}
        sums = {r.summary_seq: r for r in c.conn.execute(select(summaries).where(*where(summaries)))}
        sources: dict[int, list[int]] = defaultdict(list)
        for r in c.conn.execute(select(summary_sources).where(*where(summary_sources))):
            sources[r.summary_seq].append(r.message_ordinal)
        kids: dict[int, list[int]] = defaultdict(list)
        parents: dict[int, list[int]] = defaultdict(list)
        edges = select(summary_children).where(*where(summary_children)).order_by(summary_children.c.idx)
        for r in c.conn.execute(edges):
            kids[r.parent_seq].append(r.child_seq)
            parents[r.child_seq].append(r.parent_seq)
        items = c.conn.execute(
            select(context_items).where(*where(context_items)).order_by(context_items.c.item_ordinal)).all()
        problems: list[str] = []

        def covered(seq: int, depth: int = 0) -> list[int]:
            if depth > 64:
                problems.append(f"sum_{seq}: a cycle")
                return []
            out = sorted(sources.get(seq, []))
            for kid in kids.get(seq, []):
                out += covered(kid, depth + 1)
            return out

        for seq, s in sums.items():
            if s.kind == "leaf" and (kids.get(seq) or not sources.get(seq) or s.depth != 0):
                problems.append(f"sum_{seq}: a leaf with children, without sources or at depth {s.depth}")
            if s.kind == "condensed":
                depths = [sums[k].depth for k in kids.get(seq, []) if k in sums]
                if sources.get(seq) or not depths or s.depth != 1 + max(depths):
                    problems.append(f"sum_{seq}: condensed at depth {s.depth} over children of depths {depths}")
            if s.level not in ("normal", "aggressive", "truncated"):
                problems.append(f"sum_{seq}: level {s.level!r}")
            problems += [f"sum_{seq}: source msg_{o} is missing" for o in sources.get(seq, []) if o not in msgs]
            problems += [f"sum_{seq}: child sum_{k} is missing" for k in kids.get(seq, []) if k not in sums]
            if len(parents.get(seq, [])) > 1:
                problems.append(f"sum_{seq}: parents {parents[seq]}")
            got = covered(seq)
            if len(set(got)) != len(got):
                problems.append(f"sum_{seq} covers a message twice")
            if got and (min(got), max(got), len(got)) != (s.earliest_ordinal, s.latest_ordinal, s.message_count):
                problems.append(f"sum_{seq} says {s.earliest_ordinal}..{s.latest_ordinal} x{s.message_count}")
            if not s.content or s.tokens >= s.source_tokens:
                problems.append(f"sum_{seq}: empty, or not smaller than its sources")
        chain: list[int] = []
        for item in items:
            if (item.message_ordinal is None) == (item.summary_seq is None):
                problems.append(f"item {item.item_ordinal} is not exactly one message or one summary")
            elif item.summary_seq is not None:
                if item.summary_seq not in sums or parents.get(item.summary_seq):
                    problems.append(f"item {item.item_ordinal}: sum_{item.summary_seq} missing or under another")
                chain += covered(item.summary_seq)
            elif item.message_ordinal not in msgs:
                problems.append(f"item {item.item_ordinal}: msg_{item.message_ordinal} is missing")
            else:
                chain.append(item.message_ordinal)
        if len(set(chain)) != len(chain):
            problems.append("a message is covered twice by the context")
        positions = [msgs[o].position for o in chain if o in msgs]
        if positions != list(range(len(positions))):
            problems.append(f"the context covers positions {positions}")
        if set(msgs) - set(chain):
            problems.append(f"messages outside the context: {sorted(set(msgs) - set(chain))}")
        view = View.load(c, A, sid)
        if view.position != len(chain) - 1:
            problems.append(f"view.position {view.position}, the context covers {len(chain)} messages")
        if view.tokens != sum(i.tokens for i in load_items(c, A, sid)):
            problems.append(f"view.tokens {view.tokens} is not the context's")
        return problems, [msgs[o].entry_id for o in chain if o in msgs]

    problems, covered_ids = store.read(run)
    problems += store.read(lambda c: audit(c, A, sid)).problems
    if full and covered_ids != [e.entry_id for e in store.read_visible(A, sid)]:
        problems.append("the context does not cover exactly the visible transcript")
    return problems


def summary_rows(store: TranscriptStore, sid: str) -> list[Any]:
    return store.read(lambda c: c.conn.execute(
        select(summaries).where(summaries.c.scope == A, summaries.c.session_id == sid)
        .order_by(summaries.c.summary_seq)).all())


def snapshot(store: TranscriptStore, sid: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every lossless row of the session and its view."""

    def run(c: Any) -> dict[str, list[tuple[Any, ...]]]:
        tables = (messages, summaries, summary_sources, summary_children, context_items)
        out = {t.name: sorted(tuple(r) for r in c.conn.execute(select(t).where(t.c.session_id == sid)))
               for t in tables}
        out["view"] = [(json.dumps(View.load(c, A, sid).__dict__, sort_keys=True),)]
        return out

    return store.read(run)


# ---------------------------------------------------------------------------------------------- answers


@pytest.mark.parametrize("answer", [None, b"a summary in bytes", 42, ["a", "list"], {"content": "a dict"}],
                         ids=["none", "bytes", "int", "list", "dict"])
def test_an_answer_that_is_not_text_fails_the_compaction(store: TranscriptStore, sid: str, answer: Any) -> None:
    """``str(answer)`` made ``None`` (an adapter passing on a model message without content) the summary
    "None", in context in place of the messages it replaced. It is a summarizer failure: nothing written."""
    engine = make_engine(store, SMALL, Scripted(lambda _m, _kw: answer))
    run_turns(store, engine, sid, 8)
    before = snapshot(store, sid)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=800)
    assert not result.ok and not result.compacted, result
    assert "summarizer failed" in (result.reason or "") and type(answer).__name__ in (result.reason or "")
    assert snapshot(store, sid) == before  # every raw message still in context
    assert engine.maintain(scope=A, session_id=sid).changed is False  # logged, never raised
    assert invariants(store, sid, full=True) == []


def test_a_lone_surrogate_in_a_summary_is_shown_as_a_replacement_character(store: TranscriptStore, sid: str) -> None:
    """Half of an emoji (a model's output cut between its surrogates) failed the plan's write with
    UnicodeEncodeError: every compaction of the session raised, assemble over its budget too."""
    half = Scripted(lambda m, kw: ExtractiveSummarizer().summarize(m, **kw)[:80] + " \ud83d")
    engine = make_engine(store, SMALL, half)
    run_turns(store, engine, sid, 10)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=800)
    assert result.ok and result.compacted, result
    made = summary_rows(store, sid)
    assert made and all(r.content.endswith("\ufffd") for r in made)
    fitted = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=400)
    assert fitted.messages and fitted.estimated_tokens <= 400
    assert invariants(store, sid, full=True) == []


def test_a_summarizer_that_emits_lone_surrogates_does_not_get_the_engine_isolated(
    store: TranscriptStore, sid: str
) -> None:
    """Through the host: the failed write in ``maintain`` quarantined the lossless engine for the
    process, and every later turn ran on legacy."""
    half = Scripted(lambda m, kw: ExtractiveSummarizer().summarize(m, **kw)[:60] + " \udfff")
    settings = load_settings(config_path=None, engine="lossless", token_budget=1300, max_output_tokens=100,
                             engine_config={"lossless": SMALL})
    host = HostRuntime(store, settings, RecordingModel(), registry=EngineRegistry(), summarizer=half,
                       estimator=RoughEstimator())
    try:
        for i in range(6):
            out = host.run_turn(A, sid, f"message {i} " + "words " * 40, turn_id=f"t{i}")
            assert host.maintenance.wait(10)
            assert out.engine_id == "lossless" and "lossless" not in host.quarantined, (i, host.quarantined)
    finally:
        host.dispose()
    assert half.calls > 0 and summary_rows(store, sid)
    assert invariants(store, sid, full=True) == []


def test_a_summary_of_nul_characters_is_counted_as_it_is_shown(store: TranscriptStore, sid: str) -> None:
    """NUL became U+FFFD only when written, after its tokens were counted as NUL's: the stored count fell
    short of the summary assemble shows, and assemble went over its budget."""
    engine = make_engine(store, SMALL, Scripted(lambda _m, _kw: "\x00" * 150))
    run_turns(store, engine, sid, 10)
    assert engine.compact(scope=A, session_id=sid, force=True, token_budget=800).compacted
    est = RoughEstimator()
    for r in summary_rows(store, sid):  # the count stored is that of the message shown
        info = SummaryInfo(r.summary_seq, r.kind, r.depth, r.earliest_ordinal, r.latest_ordinal, r.message_count,
                           r.content)
        assert r.tokens == est.count_messages([render_summary(info)]), r.summary_seq
    total = store.read(lambda c: View.load(c, A, sid)).tokens
    for budget in (total, total - 1, total // 2):
        fitted = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=budget)
        assert fitted.estimated_tokens <= budget, (budget, fitted.estimated_tokens)
    assert invariants(store, sid, full=True) == []


# "huge" is 100 KB, many times what any step replaces (the assertion is that no summary is kept larger
# than its sources); the 1 MB answer, which cost seconds of CPU a backend, runs in the slow tier.
@pytest.mark.parametrize("kind", ["same", "verbatim", "huge", pytest.param("huge-1mb", marks=pytest.mark.slow),
                                  "empty", "raises_late"])
def test_garbage_that_never_shrinks_ends_and_keeps_the_dag(store: TranscriptStore, sid: str, kind: str) -> None:
    """The same text every time, the input echoed back, a huge text, nothing, or a failure after some
    summaries: the compaction ends within its rounds (two answers a step), writes only summaries
    smaller than what they replace, and the tables stay consistent."""
    calls = {"n": 0}

    def answer(m: Sequence[dict[str, Any]], kw: dict[str, Any]) -> str:
        calls["n"] += 1
        if kind == "same":
            return "the same summary every time"
        if kind == "verbatim":
            return json.dumps(list(m))
        if kind.startswith("huge"):
            return "word " * (200_000 if kind == "huge-1mb" else 20_000)
        if kind == "empty":
            return "   "
        if calls["n"] > 3:
            raise RuntimeError("provider went away")
        return ExtractiveSummarizer().summarize(m, **kw)

    config = {**SMALL, "max_rounds": 12}
    engine = make_engine(store, config, Scripted(answer))
    run_turns(store, engine, sid, 14)
    for budget in (1, 300, 2000):
        before = calls["n"]
        engine.compact(scope=A, session_id=sid, force=True, token_budget=budget)
        assert calls["n"] - before <= 2 * 2 * config["max_rounds"]  # two attempts at most
        assert invariants(store, sid) == []
    engine.maintain(scope=A, session_id=sid)
    fitted = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=600)
    assert fitted.estimated_tokens <= 600
    assert invariants(store, sid, full=True) == []


@pytest.mark.parametrize("budget", [1, 25, 40, 150, 300, 2500, 10**8])
def test_assembly_stays_within_any_budget_and_keeps_the_newest_turn(
    store: TranscriptStore, sid: str, budget: int
) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 12)
    engine.compact(scope=A, session_id=sid, force=True, token_budget=1500)
    last = store.read_visible(A, sid)[-1].message
    fitted = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=budget)
    assert fitted.estimated_tokens <= budget
    if budget >= RoughEstimator().count_messages([last]):
        assert fitted.messages[-1] == last  # what is dropped is the oldest, never the newest turn
    assert invariants(store, sid, full=True) == []


def test_the_newest_reply_over_the_tails_token_cap_stays_raw(store: TranscriptStore, sid: str) -> None:
    """A last reply larger than the fresh tail's token cap (a quarter of the window by default) left the
    tail empty, and the background compaction summarized it with the turn before: the model next saw a
    summary in place of the reply it had just given ("change line 40 of that script"), though it fit
    the window four times over. While the newest unit fits the window it stays raw."""
    engine = make_engine(store)
    run_turns(store, engine, sid, 24)
    long_reply = assistant("def step():  # a long script\n" + "    value = compute(value) + 1\n" * 150)
    commit(store, engine, finished_turn(store, A, sid, "t24", replies=[long_reply]))
    assert engine.budget(A, sid, 4000).tail_tokens < RoughEstimator().count_messages([long_reply]) < 4000
    result = engine.compact(scope=A, session_id=sid, token_budget=4000)
    assert result.compacted, result
    fitted = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=4000)
    assert fitted.messages[-1] == long_reply and fitted.estimated_tokens <= 4000
    assert invariants(store, sid, full=True) == []


# ---------------------------------------------------------------------------------------------- resets


def test_maintain_applies_a_pending_reset_before_it_summarizes(store: TranscriptStore, sid: str) -> None:
    """A redaction, then the background ``maintain``: it planned on the list from before the rewrite, so
    the summarizer (a model, in production) was sent the redacted secret, and the next import threw
    the summaries it wrote away with the message. The reset comes first, as for the recall tools."""
    scripted = Scripted()
    engine = make_engine(store, {**SMALL, "context_window": 1000}, scripted)
    run_turns(store, engine, sid, 4)
    engine.maintain(scope=A, session_id=sid)
    for i in range(4, 12):
        question = "my password is hunter2, keep it" if i == 9 else None
        commit(store, engine, finished_turn(store, A, sid, f"t{i}", question=question))
    secret = next(e for e in store.read_visible(A, sid) if "hunter2" in json.dumps(e.message))
    store.rewrite_entries(A, sid, [{"entry_id": secret.entry_id, "message": user("[redacted]")}])
    scripted.seen.clear()
    result = engine.maintain(scope=A, session_id=sid)
    assert not any("hunter2" in sent for sent in scripted.seen)
    assert result.changed and scripted.seen
    made = [r.summary_seq for r in summary_rows(store, sid)]
    assert invariants(store, sid) == []
    engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)
    assert [r.summary_seq for r in summary_rows(store, sid)] == made  # the next import keeps them all
    assert not any("hunter2" in r.content for r in summary_rows(store, sid))
    assert invariants(store, sid, full=True) == []


# ---------------------------------------------------------------------------------------------- processes

PAUSED_WORKER = """
import json, os, signal, sys
sys.path[:0] = [sys.argv[3]]
from test_lossless_compaction_review import A, SMALL, Scripted, make_engine
from transcript_store import StoreConfig, TranscriptStore
from transcript_store.summarize import ExtractiveSummarizer
store = TranscriptStore(config=StoreConfig(url=sys.argv[1], auto_upgrade=False))
mode = sys.argv[4]

def answer(messages, kw):
    calls = scripted.calls
    if mode == "pause" and calls == 1:
        print("planning", flush=True)  # the parent changes the session now
        sys.stdin.readline()
    if mode == "kill" and calls == 4:  # three summaries planned in memory, none written
        os.kill(os.getpid(), signal.SIGKILL)
    return ExtractiveSummarizer().summarize(messages, **kw)

scripted = Scripted(answer)
result = make_engine(store, SMALL, scripted).compact(scope=A, session_id=sys.argv[2], force=True, token_budget=900)
print(json.dumps(result.model_dump()), flush=True)
"""


def worker(url: str, sid: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", PAUSED_WORKER, url, sid, os.path.dirname(__file__), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


#: PAUSED_WORKER's pause mode for one session after another, each sent as a line
SERVING_WORKER = """
import json, sys
sys.path[:0] = [sys.argv[2]]
from test_lossless_compaction_review import A, SMALL, Scripted, make_engine
from transcript_store import StoreConfig, TranscriptStore
from transcript_store.summarize import ExtractiveSummarizer
store = TranscriptStore(config=StoreConfig(url=sys.argv[1], auto_upgrade=False))

def answer(messages, kw):
    if scripted.calls == 1:
        print("planning", flush=True)  # the parent changes the session now
        sys.stdin.readline()
    return ExtractiveSummarizer().summarize(messages, **kw)

while line := sys.stdin.readline():
    scripted = Scripted(answer)
    result = make_engine(store, SMALL, scripted).compact(scope=A, session_id=line.strip(), force=True, token_budget=900)
    print(json.dumps(result.model_dump()), flush=True)
"""


class Compactor:
    """A process that compacts the sessions it is sent and waits in its summarizer until told to go: one
    for the race tests of a backend (a process each cost ~1.2 s of CPU to start, most of such a test)."""

    def __init__(self, url: str, log: Path) -> None:
        self.log = log.open("w+")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVING_WORKER, url, os.path.dirname(__file__)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.idle = True  # between two compactions: a test that failed half-way leaves it not idle

    def _line(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = selecting.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.log.seek(0)
            raise AssertionError(f"the compacting process answered nothing: {self.log.read()}")
        return line.strip()

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def plan(self, sid: str) -> None:
        """Start compacting ``sid``; returns once the compaction waits in its summarizer."""
        self.idle = False
        self._send(sid)
        assert self._line() == "planning"

    def go(self) -> dict[str, Any]:
        """Let the compaction go on; its result."""
        self._send("go")
        result: dict[str, Any] = json.loads(self._line())
        self.idle = True
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()
        self.log.close()


@pytest.fixture(scope="module")
def compactors(shared_url: str) -> Iterator[list[Compactor]]:
    held: list[Compactor] = []
    yield held
    for c in held:
        c.close()


@pytest.fixture
def compactor(compactors: list[Compactor], shared_url: str, tmp_path: Path) -> Compactor:
    if not (compactors and compactors[-1].idle and compactors[-1].proc.poll() is None):
        compactors.append(Compactor(shared_url, tmp_path / "compactor.log"))
    return compactors[-1]


@pytest.mark.parametrize("meanwhile", ["commit", "branch", "rewrite", "compact", "recall"])
def test_a_compaction_in_another_process_races_the_session(
    store: TranscriptStore, sid: str, compactor: Compactor, meanwhile: str
) -> None:
    """While a compaction in another process waits in its summarizer, this one commits a turn, branches
    (and commits on the branch), rewrites a summarized message, compacts, or runs a recall tool (which
    applies the reset of a rewrite). Nothing is lost or covered twice, whichever plan lands."""
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 14)
    engine.compact(scope=A, session_id=sid, force=True, token_budget=2000)
    compactor.plan(sid)
    visible = store.read_visible(A, sid)
    if meanwhile == "commit":
        commit(store, engine, finished_turn(store, A, sid, "late"))
    elif meanwhile == "branch":
        store.branch(A, sid, visible[9].entry_id)
        commit(store, engine, finished_turn(store, A, sid, "on-the-branch"))
    elif meanwhile == "rewrite":
        store.rewrite_entries(A, sid, [{"entry_id": visible[2].entry_id, "message": user("rewritten")}])
        commit(store, engine, finished_turn(store, A, sid, "after-the-rewrite"))
    elif meanwhile == "compact":
        assert engine.compact(scope=A, session_id=sid, force=True, token_budget=700).compacted
    else:
        store.rewrite_entries(A, sid, [{"entry_id": visible[4].entry_id, "message": user("rewritten")}])
        engine.handle_tool_call("lcm_grep", {"pattern": "question"}, scope=A, session_id=sid)
    result = compactor.go()
    assert result["ok"] or "changed during compaction" in (result["reason"] or ""), result
    assert invariants(store, sid) == []
    engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)
    assert invariants(store, sid, full=True) == []


def test_sigkill_between_the_summarizer_and_the_write_writes_nothing(
    store: TranscriptStore, sid: str, shared_url: str
) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 14)
    before = snapshot(store, sid)
    proc = worker(shared_url, sid, "kill")
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    assert snapshot(store, sid) == before
    assert invariants(store, sid, full=True) == []
    assert engine.compact(scope=A, session_id=sid, force=True, token_budget=900).compacted
    assert invariants(store, sid, full=True) == []


def _tool_round(n: int) -> list[dict[str, Any]]:
    call = {"id": f"c{n}", "type": "function", "function": {"name": "lookup", "arguments": '{"q":"x"}'}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{n}", "content": f"round {n} " + "data " * 20}]


@pytest.mark.parametrize("ending", ["tool", "function"])
def test_the_question_of_a_turn_in_progress_is_never_summarized(store: TranscriptStore, sid: str, ending: str) -> None:
    """A compaction in the middle of a turn (Hermes compresses after a tool round) sent the turn's user
    message to the summarizer with the older messages when the turn's tool rounds filled the fresh tail:
    a summarizer call for a summary the host's answer left out, since it shows that message verbatim.
    It stays raw now while its rounds are in the tail; once the turn has its reply, it is summarized
    like any older message."""
    summarizer = Scripted()
    engine = make_engine(store, {**SMALL, "fresh_tail_messages": 8}, summarizer)
    question = user("THE QUESTION of this turn " + "please " * 60)
    last = ([{"role": "assistant", "content": "calling", "function_call": {"name": "f", "arguments": "{}"}},
             {"role": "function", "name": "f", "content": "result " * 20}] if ending == "function" else _tool_round(9))
    turn = [question, *_tool_round(1), *_tool_round(2), *_tool_round(3), *last]  # the rounds: 8 messages
    store.append_many(A, sid, [{"message": m} for m in [user("old question " + "words " * 80), assistant("old"),
                                                         *turn]])
    engine.bootstrap(scope=A, session_id=sid, fence=None)
    assert engine.compact(scope=A, session_id=sid, force=True, token_budget=100_000).compacted
    assert summarizer.calls == 1 and "old question" in summarizer.seen[0]
    assert not any("THE QUESTION" in seen for seen in summarizer.seen)
    out = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000).messages
    assert out[1:] == turn  # after the one summary: the question, then its rounds, in order
    assert invariants(store, sid) == []
    # the turn finished: the next compaction may summarize its question like any older message
    store.append(A, sid, assistant("the answer of this turn"))
    store.append(A, sid, user("next question"))
    engine.bootstrap(scope=A, session_id=sid, fence=None)
    engine.compact(scope=A, session_id=sid, force=True, token_budget=100_000)
    assert any("THE QUESTION" in seen for seen in summarizer.seen)
    assert invariants(store, sid) == []
