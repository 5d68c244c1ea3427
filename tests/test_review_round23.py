"""Findings of the twenty-third review round (the turn-commit API against its own closed range).

Each test failed before its fix: ``Turns.complete`` wrote a turn's replies on a branch that had lost the
turn's question, and ``commit_turn`` receipted turns that ``read_closed_range`` refuses (branched away,
over the byte cap, one entry over the event cap).
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import assistant, module_store_fixtures, user
from hosting import RecordingModel
from test_compaction_focus import everything
from test_host import make_host

from transcript_store import InvalidInput, PayloadTooLarge, TranscriptStore, TurnBranchedAway
from transcript_store.fences import MAX_TURN_EVENTS
from transcript_store.ledger import CommitResult, TurnPayload, commit_turn_in
from transcript_store.models import ClosedRangeFailure
from transcript_store.turns import Turns

S = "round-23"
E = "engine-1"

shared_url, store, sid = module_store_fixtures(S, "round-23")


def deliver(c: Any, turn: TurnPayload) -> CommitResult:
    return commit_turn_in(c, turn)


@pytest.mark.parametrize("fast", [False, True])
def test_a_turn_whose_question_was_branched_away_does_not_complete(
    store: TranscriptStore, sid: str, fast: bool
) -> None:
    """Another writer branched the session back before the turn's question while the turn ran: complete
    appended the reply at the moved head and accepted (or, fast, blocked) the turn, an answer on a
    branch without its question, which ``accept`` would have refused."""
    turns = Turns(store)
    system = store.append(S, sid, {"role": "system", "content": "sys"})
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id=E)
    store.branch(S, sid, system.entry_id)
    before = everything(store)
    with pytest.raises(TurnBranchedAway) as raised:
        turns.complete(S, sid, "t1", [{"message": assistant("A")}], deliver if fast else None)
    assert isinstance(raised.value, InvalidInput) and raised.value.turn_id == "t1"
    assert everything(store) == before
    assert [e.message for e in store.read_visible(S, sid)] == [{"role": "system", "content": "sys"}]


def test_a_turn_with_events_after_its_question_still_completes(store: TranscriptStore, sid: str) -> None:
    """The check reads the path only when the first reply does not follow the question: an event written
    in between (on the same branch) is no reason to refuse."""
    turns = Turns(store)
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id=E)
    store.append(S, sid, kind="custom", payload={"note": "tool started"})
    done = turns.complete(S, sid, "t1", [{"message": assistant("A")}], deliver)
    assert done.commit is not None and done.commit.status == "committed"


def test_the_host_discards_a_turn_branched_away_while_its_model_ran(store: TranscriptStore, sid: str) -> None:
    """Through the host: the turn fails with TurnBranchedAway, nothing of it is written, its intent is
    discarded (the next turn is admitted at once)."""

    class BranchingModel(RecordingModel):
        def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
            if messages[-1].get("content") == "second":
                store.branch(S, sid, None)  # another client empties the branch mid-turn
            return super().complete(messages, tools, **kw)

    host, _ = make_host(store)
    host.model = BranchingModel()
    host.run_turn(S, sid, "first", turn_id="t0")
    with pytest.raises(TurnBranchedAway):
        host.run_turn(S, sid, "second", turn_id="t1")
    assert store.read_visible(S, sid) == []
    assert Turns(store).intent(S, sid, "t1") is None
    after = host.run_turn(S, sid, "third", turn_id="t2")
    assert [m["content"] for m in after.messages][:1] == ["third"]


def _turn(store: TranscriptStore, sid: str, replies: list[dict[str, Any]], events: int = 0) -> tuple[Any, Any]:
    admission = store.admit(S, sid, user("q"), turn_id="t1")
    if events:
        store.append_many(S, sid, [{"kind": "custom", "payload": {"i": i}} for i in range(events)])
    last = None
    for r in replies:
        last = store.append(S, sid, r)
    assert last is not None
    return admission, store.anchor(S, sid, last.entry_id)


@pytest.mark.parametrize("apply", [False, True])
def test_commit_turn_refuses_a_turn_that_left_the_active_branch(store: TranscriptStore, sid: str, apply: bool) -> None:
    """``read_closed_range`` says ``stale`` for a turn branched away; commit_turn receipted it."""
    turns = Turns(store)
    system = store.append(S, sid, {"role": "system", "content": "sys"})
    admission, terminal = _turn(store, sid, [assistant("A")])
    store.branch(S, sid, system.entry_id)
    found = store.read_closed_range(admission, terminal)
    assert isinstance(found, ClosedRangeFailure) and found.reason == "stale"
    before = everything(store)
    with pytest.raises(InvalidInput, match="active branch"):
        turns.commit_turn(E, "t1", admission, terminal, [user("q"), assistant("A")],
                          apply=(lambda c, t: None) if apply else None)
    assert everything(store) == before and turns.receipts(S, sid) == []


def test_commit_turn_refuses_a_turn_over_the_byte_cap(shared_url: str, sid: str) -> None:
    """Three messages of 3 MiB: ``read_closed_range`` says ``too_large``; commit_turn receipted them."""
    from transcript_store import StoreConfig

    big = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False, max_payload_bytes=4 * 1024 * 1024))
    try:
        text = "x" * (3 * 1024 * 1024)
        admission = big.admit(S, sid, user(text), turn_id="t1")
        big.append(S, sid, assistant(text))
        last = big.append(S, sid, assistant(text))
        terminal = big.anchor(S, sid, last.entry_id)
        found = big.read_closed_range(admission, terminal)
        assert isinstance(found, ClosedRangeFailure) and found.reason == "too_large"
        with pytest.raises(PayloadTooLarge):
            Turns(big).commit_turn(E, "t1", admission, terminal, [user(text), assistant(text), assistant(text)])
        assert Turns(big).receipts(S, sid) == []
    finally:
        big.close()


def test_commit_turn_refuses_a_turn_one_entry_over_the_event_cap(store: TranscriptStore, sid: str) -> None:
    """Admission, 19,999 events and the terminal are 20,001 entries: ``too_large`` for the closed range,
    a receipt for commit_turn (its bound was on the seq distance, one more)."""
    admission, terminal = _turn(store, sid, [assistant("A")], events=MAX_TURN_EVENTS - 1)
    found = store.read_closed_range(admission, terminal)
    assert isinstance(found, ClosedRangeFailure) and found.reason == "too_large"
    with pytest.raises(InvalidInput, match=str(MAX_TURN_EVENTS)):
        Turns(store).commit_turn(E, "t1", admission, terminal, [user("q"), assistant("A")])
    assert Turns(store).receipts(S, sid) == []
    # one event fewer is within both caps
    other = store.create_session(S).session_id
    admission, terminal = _turn(store, other, [assistant("A")], events=MAX_TURN_EVENTS - 2)
    assert not isinstance(store.read_closed_range(admission, terminal), ClosedRangeFailure)
    assert Turns(store).commit_turn(E, "t1", admission, terminal, [user("q"), assistant("A")]).status == "committed"


def _long_session(store: TranscriptStore, sid: str, n: int) -> None:
    """``n`` ordinary messages written before the engine ever saw the session (a legacy-era session)."""
    for start in range(0, n, 500):
        store.append_many(S, sid, [
            {"message": {"role": "user" if i % 2 == 0 else "assistant",
                         "content": f"history message {i} " + "lorem ipsum dolor " * 10}}
            for i in range(start, min(n, start + 500))
        ])


def test_lossless_assemble_summarises_a_long_imported_session_before_cutting(
    store: TranscriptStore, sid: str
) -> None:
    """A 2,000-message session switched to lossless: assemble's one compaction pass summarised a few
    hundred messages, and ``fit`` cut the rest of the raw history and the new summaries with it: the
    first turns' requests began at message 1,879, with no summary and no recall hint."""
    _long_session(store, sid, 2000)
    host, model = make_host(store, engine="lossless", token_budget=8000)
    try:
        host.run_turn(S, sid, "first lossless turn", turn_id="t1")
    finally:
        host.dispose()
    request = model.requests[0]
    assert "lcm_grep" in str(request[0]["content"]), "no recall hint in the system prompt"
    assert any("messages msg_0.." in str(m.get("content")) for m in request), "no summary reaching msg_0"


def test_lossless_tells_the_model_when_it_had_to_cut_without_a_summary(store: TranscriptStore, sid: str) -> None:
    """When no summary could be made (a failing summarizer) and the context is cut, the system-prompt
    addition still points at the recall tools: it was None, and the cut went unmentioned."""
    from engines.lossless import LosslessEngine
    from engines.lossless.engine import CUT_HINT
    from transcript_store.engine import EngineContext
    from transcript_store.errors import SummarizerError
    from transcript_store.summarize import ExtractiveSummarizer
    from transcript_store.tokens import RoughEstimator

    class Down(ExtractiveSummarizer):
        def summarize(self, *args: Any, **kwargs: Any) -> Any:
            raise SummarizerError("summarizer down")

    _long_session(store, sid, 300)
    engine = LosslessEngine(EngineContext(store=store, summarizer=Down(), estimator=RoughEstimator(), config={}))
    engine.bootstrap(scope=S, session_id=sid, fence=None)
    result = engine.assemble(scope=S, session_id=sid, fence=None, token_budget=3000)
    assert result.system_prompt_addition == CUT_HINT
    assert not any("[Summary" in str(m.get("content")) for m in result.messages)
    whole = engine.assemble(scope=S, session_id=sid, fence=None, token_budget=200_000)
    assert whole.system_prompt_addition is None  # nothing cut, nothing summarised: nothing to say

