"""The lossless engine when the active path moves (branch, rewrite) or the session is created again.

A reset keeps the context items that are still true (the common prefix), forgets every engine row of
messages that left the active path (and the summaries made from them), and goes on from where the
paths diverge; a commit after a branch ingests its turn; a compaction planned on an earlier session
under the same id never lands in the new one. Both backends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
from conftest import EngineTurn as Turn
from conftest import assistant, finished_turn, module_store_fixtures, tool_round, user
from conftest import commit_with as commit
from sqlalchemy import select

from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from engines.lossless.context import load_items
from engines.lossless.tables import messages, summaries
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.models import Admission, ClosedRange
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-b"
SMALL = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
         "condensed_summary_tokens": 160, "condense_fanin": 3}


class Counting(ExtractiveSummarizer):
    """Counts calls; ``hook`` runs once, on the first call (while a compaction is being planned)."""

    def __init__(self, hook: Any = None) -> None:
        super().__init__()
        self.calls, self.hook = 0, hook

    def summarize(self, *args: Any, **kwargs: Any) -> str:
        self.calls += 1
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return str(super().summarize(*args, **kwargs))


shared_url, store, sid = module_store_fixtures(A, "branches")


def make_engine(store: TranscriptStore, config: dict[str, Any] | None = None, summarizer: Any = None) -> LosslessEngine:
    return LosslessEngine(EngineContext(store=store, config=config or {}, summarizer=summarizer or Counting(),
                                        estimator=RoughEstimator()))




def chat(store: TranscriptStore, engine: LosslessEngine, sid: str, n: int, prefix: str = "t") -> list[Turn]:
    """``n`` turns the way a host runs them: assemble, reply, commit, compact after the turn."""
    turns = []
    for i in range(n):
        replies = [assistant(f"answer {prefix}{i} " * 10)]
        if i % 4 == 1:
            replies = [*tool_round(f"{prefix}{i}", f"result {i} " * 15), assistant(f"done {i} " * 8)]
        admission = store.admit(A, sid, user(f"question {prefix}{i} " + "words " * 30), turn_id=f"{prefix}{i}")
        engine.assemble(scope=A, session_id=sid, fence=admission.anchor, token_budget=1500)
        appended = store.append_many(A, sid, [{"message": m} for m in replies])
        terminal = store.anchor(A, sid, appended[-1].entry_id)
        closed = store.read_closed_range(admission, terminal)
        assert isinstance(closed, ClosedRange)
        turn = (admission, terminal, closed.messages)
        assert commit(store, engine, turn).status == "committed"
        engine.maintain(scope=A, session_id=sid)
        turns.append(turn)
    return turns


def context(store: TranscriptStore, sid: str) -> list[Any]:
    return store.read(lambda c: load_items(c, A, sid))


def engine_text(store: TranscriptStore, sid: str) -> str:
    """Every message and summary text the engine keeps for the session (what the recall tools search)."""

    def run(c: Any) -> str:
        got = [r.message for r in c.conn.execute(select(messages.c.message).where(messages.c.session_id == sid))]
        got += [r.content for r in c.conn.execute(select(summaries.c.content).where(summaries.c.session_id == sid))]
        return "\n".join(got)

    return store.read(run)


def consistent(store: TranscriptStore, sid: str, fence: Admission | None = None) -> None:
    """Audit clean, the context covers exactly the visible transcript (before ``fence``), every message
    row is visible."""
    result = store.read(lambda c: audit(c, A, sid))
    assert result.problems == []
    visible = {e.entry_id for e in store.read_visible(A, sid)} - ({fence.anchor.entry_id} if fence else set())
    assert result.covered_entry_ids == visible
    stored = store.read(lambda c: {r.entry_id for r in c.conn.execute(
        select(messages.c.entry_id).where(messages.c.scope == A, messages.c.session_id == sid))})
    assert stored <= visible


def pairing(out: list[dict[str, Any]]) -> list[str]:
    """Tool calls without results or results without calls in an assembled list."""
    problems, pending = [], set()
    for m in out:
        if m.get("role") == "tool":
            if m.get("tool_call_id") not in pending:
                problems.append(f"orphan {m.get('tool_call_id')}")
            pending.discard(m.get("tool_call_id"))
            continue
        if pending:
            problems.append(f"unanswered {sorted(pending)}")
        pending = {c["id"] for c in m.get("tool_calls") or []}
    return problems + ([f"unanswered {sorted(pending)}"] if pending else [])


def tool(engine: LosslessEngine, sid: str, name: str, **args: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(engine.handle_tool_call(name, args, scope=A, session_id=sid))
    return out


# ---------------------------------------------------------------------------------------------- A


def test_a_plan_of_a_deleted_session_never_lands_in_the_session_made_again(store: TranscriptStore, sid: str) -> None:
    def start_over() -> None:  # while the summarizer runs: the user resets the chat under the same id
        store.delete_session(A, sid)
        store.create_session(A, session_id=sid)
        other = make_engine(store)
        for i in range(8):
            commit(store, other, finished_turn(store, A, sid, f"new{i}", [assistant(f"new answer {i}")],
                                               question=f"NEW question {i}"))

    engine = make_engine(store, {"fresh_tail_messages": 2, "leaf_chunk_messages": 6}, Counting(start_over))
    for i in range(8):
        commit(store, engine, finished_turn(store, A, sid, f"old{i}", [assistant(f"OLD private detail {i} " * 10)],
                                            question=f"OLD question {i} " + "words " * 30))
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=400)
    assert result.tokens_before < 400  # the old session's plan was refused; the retry read the new session
    assert "OLD" not in engine_text(store, sid)
    shown = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000).messages
    assert "OLD" not in json.dumps(shown)
    consistent(store, sid)


# ---------------------------------------------------------------------------------------------- D


def test_a_commit_after_a_branch_ingests_its_turn(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    for i in range(3):
        commit(store, engine, finished_turn(store, A, sid, f"t{i}"))
    rejected = finished_turn(store, A, sid, "t3", [assistant("OLD ANSWER the user rejected")])
    commit(store, engine, rejected)
    store.branch(A, sid, rejected[0].anchor.parent_id)  # regenerate turn 3, no assemble in between
    again = finished_turn(store, A, sid, "t3-again", [assistant("NEW ANSWER")], question="question t3 again")
    assert commit(store, engine, again).status == "committed"
    # Right after the commit (an outbox drain runs no assemble): the engine holds the new turn.
    assert [i.message["content"] for i in context(store, sid)][-2:] == ["question t3 again", "NEW ANSWER"]
    assert tool(engine, sid, "lcm_grep", pattern="NEW ANSWER")["count"] == 1
    assert tool(engine, sid, "lcm_grep", pattern="OLD ANSWER")["count"] == 0
    consistent(store, sid)
    shown = [m["content"] for m in engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000).messages]
    assert shown[-2:] == ["question t3 again", "NEW ANSWER"]


def test_a_commit_of_a_turn_the_view_already_holds_ingests_nothing_twice(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    turns = [finished_turn(store, A, sid, f"t{i}") for i in range(3)]
    engine.bootstrap(scope=A, session_id=sid, fence=None)  # the view is ahead of every commit below
    for turn in turns:
        assert commit(store, engine, turn).status == "committed"
    assert len(context(store, sid)) == 6
    consistent(store, sid)


# ---------------------------------------------------------------------------------------------- B


def test_regenerating_the_last_reply_keeps_the_summaries(store: TranscriptStore, sid: str) -> None:
    counting = Counting()
    engine = make_engine(store, SMALL, counting)
    turns = chat(store, engine, sid, 40)
    before = context(store, sid)
    kept_summaries = [i.summary.seq for i in before if i.summary is not None]
    assert kept_summaries
    store.branch(A, sid, turns[-1][0].anchor.parent_id)  # regenerate the last turn
    counting.calls = 0
    admission = store.admit(A, sid, user("question again"), turn_id="again")
    out = engine.assemble(scope=A, session_id=sid, fence=admission.anchor, token_budget=1500)
    after = context(store, sid)
    assert [i.summary.seq for i in after if i.summary is not None] == kept_summaries
    assert [i.target for i in after] == [i.target for i in before][: len(after)]
    assert len(after) == len(before) - 2  # only the last turn's question and answer left
    assert counting.calls == 0  # nothing to summarize again
    assert pairing(out.messages) == []
    assert out.estimated_tokens <= 1500
    consistent(store, sid, admission)


def test_a_rewrite_inside_a_summary_keeps_what_is_still_true(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    turns = chat(store, engine, sid, 40)
    deep = [i for i in context(store, sid) if i.summary is not None and i.summary.depth > 0]
    assert deep, "the chat is long enough for a condensed summary"
    target = turns[8][1]  # an answer summarized deep inside the DAG
    store.rewrite_entries(A, sid, [{"entry_id": target.entry_id, "message": assistant("[edited]")}])
    out = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)
    assert pairing(out.messages) == []
    after = context(store, sid)
    # Summaries that cover only messages before the edit stay (some from inside a dropped condensed one).
    assert any(i.summary is not None for i in after)
    assert target.position is not None  # (ordinals are positions in this linear chat)
    assert all(i.summary.latest < target.position for i in after if i.summary is not None)
    consistent(store, sid)
    engine.compact(scope=A, session_id=sid, force=True, token_budget=1500)
    consistent(store, sid)


def test_branching_back_imports_the_abandoned_branch_again(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    turns = chat(store, engine, sid, 12)
    fork = turns[9][0].anchor.parent_id
    old_head = store.read_visible(A, sid)[-1].entry_id
    store.branch(A, sid, fork)
    chat(store, engine, sid, 3, prefix="b")
    consistent(store, sid)
    assert tool(engine, sid, "lcm_grep", pattern="answer t10")["count"] == 0
    store.branch(A, sid, old_head)
    out = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)
    assert "answer t11" in json.dumps(out.messages) and "question b0" not in json.dumps(out.messages)
    assert tool(engine, sid, "lcm_grep", pattern="answer t11")["count"] >= 1
    assert tool(engine, sid, "lcm_grep", pattern="question b0")["count"] == 0
    consistent(store, sid)


def test_a_branch_after_a_reset_by_the_recall_tools_leaves_nothing_behind(store: TranscriptStore, sid: str) -> None:
    """The recall tools apply a pending reset without importing; the still-true messages of the leaf it
    dropped waited for the next import to come back into the context. A branch before them in between
    left the view's cursor valid (no reset came for them): they stayed stored out of the context, and
    lcm_grep found them after they had left the active path."""
    engine = make_engine(store, SMALL)
    turns = chat(store, engine, sid, 12)
    assert context(store, sid)[0].summary is not None
    store.branch(A, sid, turns[0][1].entry_id)  # the first turn only: the leaf over it reaches past it
    assert tool(engine, sid, "lcm_grep", pattern="answer t0")["count"] == 1  # the tool applies the reset
    store.branch(A, sid, None)  # the first turn leaves the path too
    chat(store, engine, sid, 2, prefix="n")
    assert tool(engine, sid, "lcm_grep", pattern="answer t0")["count"] == 0
    consistent(store, sid)


# ---------------------------------------------------------------------------------------------- C


@pytest.mark.parametrize("first", ["assemble", "recall tools"])
def test_a_redaction_leaves_nothing_for_the_recall_tools(store: TranscriptStore, sid: str, first: str) -> None:
    """Also when a recall tool is the first to run after the rewrite (no import in between): it applies
    the pending reset before it answers (it answered from the rows as they were)."""
    engine = make_engine(store, SMALL)
    secret = None
    for i in range(24):
        text = "my password is hunter2-SECRET" if i == 3 else f"answer {i} " * 10
        turn = finished_turn(store, A, sid, f"t{i}", [assistant(text)])
        secret = turn[1] if i == 3 else secret
        commit(store, engine, turn)
        engine.maintain(scope=A, session_id=sid)
    engine.compact(scope=A, session_id=sid, force=True, token_budget=1500)
    assert secret is not None and "hunter2" in engine_text(store, sid)
    with_secret = [r["id"] for r in tool(engine, sid, "lcm_grep", pattern="hunter2", search_in="all")["results"]]
    assert any(i.startswith("sum_") for i in with_secret)
    store.rewrite_entries(A, sid, [{"entry_id": secret.entry_id, "message": assistant("[redacted]")}])
    if first == "assemble":
        engine.assemble(scope=A, session_id=sid, fence=None, token_budget=1500)
    assert tool(engine, sid, "lcm_grep", pattern="hunter2", search_in="all")["count"] == 0
    assert "hunter2" not in engine_text(store, sid)
    assert tool(engine, sid, "lcm_grep", pattern="hunter.*SECRET", mode="regex", search_in="all")["count"] == 0
    assert "error" in tool(engine, sid, "lcm_describe", id=secret.entry_id)
    for old in with_secret:
        assert "hunter2" not in json.dumps(tool(engine, sid, "lcm_expand", id=old))
        assert "hunter2" not in json.dumps(tool(engine, sid, "lcm_describe", id=old))
    if store.backend == "sqlite":  # the FTS5 index rows went with their rows (0004 triggers)
        left = store.read(lambda c: c.conn.exec_driver_sql(
            "SELECT count(*) FROM ts_lcm_search WHERE content LIKE '%hunter2%'").scalar())
        assert left == 0
    if first != "assemble":  # the reset forgot, the next import brings the rewritten message
        engine.assemble(scope=A, session_id=sid, fence=None, token_budget=1500)
    assert tool(engine, sid, "lcm_grep", pattern="redacted", search_in="messages")["count"] == 1
    consistent(store, sid)


# ---------------------------------------------------------------------------------------------- crash

CRASH_WORKER = """
import sys
sys.path[:0] = [sys.argv[3]]
from test_lossless_branches import SMALL, make_engine
from transcript_store import StoreConfig, TranscriptStore
store = TranscriptStore(config=StoreConfig(url=sys.argv[1], auto_upgrade=False))
make_engine(store, SMALL).assemble(scope="scope-b", session_id=sys.argv[2], fence=None, token_budget=1500)
"""


def test_sigkill_in_the_middle_of_a_reset_leaves_the_engine_as_it_was(
    store: TranscriptStore, sid: str, shared_url: str
) -> None:
    engine = make_engine(store, SMALL)
    turns = chat(store, engine, sid, 16)
    before = rows_of(store, sid)
    store.rewrite_entries(A, sid, [{"entry_id": turns[5][1].entry_id, "message": assistant("[edited]")}])
    env = {**os.environ, "TRANSCRIPT_STORE_FAULTS": "lossless.reset.mid_forget=1"}
    proc = subprocess.run([sys.executable, "-c", CRASH_WORKER, shared_url, sid, os.path.dirname(__file__)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert rows_of(store, sid) == before  # the reset's deletes died with its transaction
    assert store.read(lambda c: audit(c, A, sid)).problems == []
    engine.assemble(scope=A, session_id=sid, fence=None, token_budget=1500)
    assert rows_of(store, sid) != before
    consistent(store, sid)


def rows_of(store: TranscriptStore, sid: str) -> tuple[str, list[Any]]:
    return engine_text(store, sid), [i.target for i in context(store, sid)]
