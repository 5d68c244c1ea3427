"""The lossless engine when the active path moves (branch, rewrite) or the session is created again.

A reset keeps the context items that are still true (the common prefix), forgets every engine row of
messages that left the active path (and the summaries made from them), and goes on from where the
paths diverge; a commit after a branch ingests its turn; a compaction planned on an earlier session
under the same id never lands in the new one. Both backends.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from conftest import BACKENDS, fresh_url
from sqlalchemy import select

from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from engines.lossless.context import load_items
from engines.lossless.tables import messages, summaries
from transcript_store import StoreConfig, TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.ledger import CommitResult
from transcript_store.models import Admission, Anchor, ClosedRange
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-b"
SMALL = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
         "condensed_summary_tokens": 160, "condense_fanin": 3}
Turn = tuple[Admission, Anchor, list[dict[str, Any]]]


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


@pytest.fixture(scope="module", params=BACKENDS)
def shared_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from fresh_url(str(request.param), request, tmp_path_factory.mktemp("branches"))


@pytest.fixture(scope="module")
def store(shared_url: str) -> Iterator[TranscriptStore]:
    s = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False))
    yield s
    s.close()


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(A, session_id=f"s-{uuid.uuid4().hex[:12]}").session_id


def make_engine(store: TranscriptStore, config: dict[str, Any] | None = None, summarizer: Any = None) -> LosslessEngine:
    return LosslessEngine(EngineContext(store=store, config=config or {}, summarizer=summarizer or Counting(),
                                        estimator=RoughEstimator()))


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def tool_round(call_id: str, result: str) -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": '{"q":"x"}'}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


def finished_turn(
    store: TranscriptStore, sid: str, turn_id: str, replies: Sequence[dict[str, Any]] | None = None,
    question: str | None = None,
) -> Turn:
    admission = store.admit(A, sid, user(question or f"question {turn_id} " + "words " * 30), turn_id=turn_id)
    appended = store.append_many(A, sid, [{"message": m} for m in replies or [assistant(f"answer {turn_id} " * 10)]])
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    return admission, terminal, closed.messages


def commit(store: TranscriptStore, engine: LosslessEngine, turn: Turn) -> CommitResult:
    admission, terminal, msgs = turn
    return store.write(lambda c: engine.commit_turn(
        tx=c, advancement_key=admission.turn_id, admission=admission.anchor, terminal=terminal, messages=msgs
    ))


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
        engine.after_turn(scope=A, session_id=sid)
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
            commit(store, other, finished_turn(store, sid, f"new{i}", [assistant(f"new answer {i}")],
                                               question=f"NEW question {i}"))

    engine = make_engine(store, {"fresh_tail_messages": 2, "leaf_chunk_messages": 6}, Counting(start_over))
    for i in range(8):
        commit(store, engine, finished_turn(store, sid, f"old{i}", [assistant(f"OLD private detail {i} " * 10)],
                                            question=f"OLD question {i} " + "words " * 30))
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=400)
    assert result.tokens_before < 400  # the old session's plan was refused; the retry read the new session
    assert "OLD" not in engine_text(store, sid)
    shown = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000).messages
    assert "OLD" not in json.dumps(shown)
    consistent(store, sid)
