"""Review round 21: an unknown turn's error, a retry killed after it took a running turn over, the first
model request's budget.

Each test here failed on the code before its fix (see the docstrings).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import assistant, module_store_fixtures, user
from hosting import CountingEngine, RecordingModel
from test_host import make_host
from test_outbox_handback import _Gate

from transcript_store import (
    SessionBusy,
    StoreConfig,
    TranscriptStore,
    UnknownSession,
    UnknownTurn,
)
from transcript_store.engine import AssembleResult, EngineContext
from transcript_store.errors import OutboxCollision
from transcript_store.host import UNANSWERED_TOOL_CALL, HostRuntime
from transcript_store.model import ModelResponse
from transcript_store.outbox import OutboxConfig
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

S = "review-r21"
ROOT = Path(__file__).resolve().parents[1]
LEASE = 0.5

shared_url, store, sid = module_store_fixtures(S, "review-r21")


# ---------------------------------------------------------------------------------------------- 1


def test_an_unknown_turn_is_unknown_turn_in_accept_complete_and_block(store: TranscriptStore, sid: str) -> None:
    """``Turns.accept`` (and ``complete``, through the same check) of a turn the outbox does not hold raised
    ``OutboxCollision``, while ``Turns.block`` raised ``UnknownTurn``. Now ``UnknownTurn`` everywhere: a
    subclass of ``OutboxCollision``, so that callers catching the old error still catch it."""
    turns = Turns(store)
    anchor = store.anchor(S, sid, store.append(S, sid, user("x")).entry_id)
    before = store.list_entries(S, sid)
    calls = {
        "accept": lambda: turns.accept(S, sid, "nope", anchor),
        "complete": lambda: turns.complete(S, sid, "nope", [{"message": assistant("a")}], None),
        "complete fast": lambda: turns.complete(
            S, sid, "nope", [{"message": assistant("a")}], lambda c, p: pytest.fail("no commit for an unknown turn")
        ),
        "block": lambda: turns.block(S, sid, "nope", "never works"),
    }
    for name, call in calls.items():
        with pytest.raises(UnknownTurn) as refused:
            call()
        assert isinstance(refused.value, OutboxCollision) and isinstance(refused.value, LookupError), name
        assert (refused.value.session_id, refused.value.turn_id) == (sid, "nope"), name
    assert store.list_entries(S, sid) == before  # nothing of the refused completions was written


def test_accept_in_an_unknown_session_is_unknown_session(store: TranscriptStore) -> None:
    """Before anything about its turn, as every call of a session (``block`` and ``complete`` did so)."""
    anchor_of = store.create_session(S, session_id="r21-real")
    anchor = store.anchor(S, anchor_of.session_id, store.append(S, anchor_of.session_id, user("x")).entry_id)
    with pytest.raises(UnknownSession):
        Turns(store).accept(S, "r21-missing", "t1", anchor)


# ---------------------------------------------------------------------------------------------- 2

#: a retry of turn t1 in its own worker process; killed by its fault point right after its admission
#: committed, that is once it has taken the turn's lease over from the attempt still running it
_RETRY = """
import sys
from transcript_store import StoreConfig, TranscriptStore
from test_host import make_host
store = TranscriptStore(config=StoreConfig(url=sys.argv[1], auto_upgrade=False))
host, _ = make_host(store)
host.run_turn(sys.argv[2], sys.argv[3], "q1", turn_id="t1")
print("the retry finished", flush=True)
"""


def _killed_retry(url: str, session_id: str) -> None:
    """Run a retry of t1 in a real process, SIGKILLed at ``admit.after_commit``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "TRANSCRIPT_STORE_FAULTS": "admit.after_commit=1",
    }
    done = subprocess.run(
        [sys.executable, "-c", _RETRY, url, S, session_id], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -9, (done.returncode, done.stdout, done.stderr[-2000:])


def _start_first(host: HostRuntime, model: _Gate, session_id: str) -> dict[str, Any]:
    """The first attempt of t1, in a thread, held in its model call until ``model.go``."""
    results: dict[str, Any] = {}

    def run() -> None:
        try:
            results["first"] = host.run_turn(S, session_id, "q1", turn_id="t1")
        except BaseException as e:  # reported by the test
            results["first"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    results["thread"] = thread
    assert model.first_called.wait(30)
    return results


def _finish_first(model: _Gate, results: dict[str, Any]) -> Any:
    model.go.set()
    results["thread"].join(60)
    return results.get("first")


def _committed_once(store: TranscriptStore, session_id: str, out: Any) -> None:
    assert out is not None and not isinstance(out, BaseException), repr(out)
    assert out.commit_status == "committed"
    assert [r.advancement_key for r in Turns(store).receipts(S, session_id)] == ["t1"]
    assert [e.message["content"] for e in store.read_visible(S, session_id)][:1] == ["q1"]


def test_a_killed_retry_leaves_the_turn_to_the_attempt_still_running_it(
    store: TranscriptStore, sid: str, shared_url: str
) -> None:
    """A retry of t1 (another worker process) took the running turn's lease over and was SIGKILLed. Its
    lease then named a process provably gone, so the turn counted as abandoned at once: the recovery before
    the session's next turn discarded it, the next turn was admitted, and the first attempt, alive and
    about to succeed, ended in ``TurnOvertaken``: the turn was lost. The first attempt keeps it now: the
    session is busy while it runs, recovery discards nothing, and it commits the turn, once."""
    host, _ = make_host(store)
    model = _Gate(AssertionError("no second model call"))
    host.model = model
    results = _start_first(host, model, sid)
    try:
        _killed_retry(shared_url, sid)
        intent = Turns(store).intent(S, sid, "t1")
        assert intent is not None and intent.state == "admitted"
        report = Turns(store).recover(S, sid, "legacy", host.commit_in)
        assert report.discarded == [] and report.running == ["t1"]
        with pytest.raises(SessionBusy) as busy:
            Turns(store).admit(S, sid, user("next"), turn_id="t2", engine_id="legacy")
        assert busy.value.turn_id == "t1"
    finally:
        out = _finish_first(model, results)
    _committed_once(store, sid, out)
    host.model = RecordingModel()
    assert host.run_turn(S, sid, "next", turn_id="t2").commit_status == "committed"
    host.dispose()


def test_a_retry_failing_after_a_killed_one_hands_the_turn_back_to_the_first_attempt(
    store: TranscriptStore, sid: str, shared_url: str
) -> None:
    """First attempt A runs t1; retry B (a real process) takes it over and is SIGKILLed; retry C takes it
    over from dead B and fails. C took it from no live attempt, so it discarded the intent, and A's
    completion found nothing (``OutboxCollision``): lost. C hands it back to A now (A's is the lease B
    took), and A commits it, once."""
    host, _ = make_host(store)
    model = _Gate(ConnectionError("the provider went away"))
    host.model = model
    results = _start_first(host, model, sid)
    try:
        _killed_retry(shared_url, sid)
        other_store = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False))
        other, _ = make_host(other_store)
        other.model = model
        with pytest.raises(ConnectionError):
            other.run_turn(S, sid, "q1", turn_id="t1")
        other.dispose()
        other_store.close()
        intent = Turns(store).intent(S, sid, "t1")
        assert intent is not None and intent.state == "admitted"
    finally:
        out = _finish_first(model, results)
    _committed_once(store, sid, out)
    host.dispose()


def test_a_retry_from_another_machine_that_stopped_renewing_leaves_the_turn_to_the_running_attempt(
    store: TranscriptStore, sid: str
) -> None:
    """The same where the retry's death cannot be proven (another machine): its lease ran out after a few
    seconds, the first attempt's renewals kept failing ("taken over"), and the next turn's admission
    discarded the running turn. The first attempt's renewals keep it alive now (its keeper takes the turn
    back once the retry's lease ran out); and once neither attempt renews, the turn is abandoned."""
    host, _ = make_host(store)
    host.turns = Turns(store, OutboxConfig(turn_lease_seconds=LEASE))
    model = _Gate(AssertionError("no second model call"))
    host.model = model
    short = Turns(store, OutboxConfig(turn_lease_seconds=LEASE))
    results = _start_first(host, model, sid)
    try:
        taken: list[Any] = []
        short.admit(S, sid, user("q1"), turn_id="t1", engine_id="legacy", owner="elsewhere/retry",
                    taken_over=taken)
        assert len(taken) == 1  # the first attempt's lease, live
        time.sleep(5 * LEASE)  # the retry's lease ran out long ago; the first attempt's keeper renewed
        with pytest.raises(SessionBusy):
            short.admit(S, sid, user("next"), turn_id="t2", engine_id="legacy")
    finally:
        out = _finish_first(model, results)
    _committed_once(store, sid, out)
    # Neither attempt renewing (both on other machines): abandoned after the lease, as before.
    short.admit(S, sid, user("q3"), turn_id="t3", engine_id="legacy", owner="elsewhere/first")
    short.admit(S, sid, user("q3"), turn_id="t3", engine_id="legacy", owner="elsewhere/second")
    time.sleep(3 * LEASE)
    short.admit(S, sid, user("q4"), turn_id="t4", engine_id="legacy")
    assert short.intent(S, sid, "t3") is None
    host.dispose()


# ---------------------------------------------------------------------------------------------- 3

TOKEN_BUDGET = 2000
MAX_OUTPUT = 200


class _Requests:
    """A model recording each request and the tools sent with it; it answers at once."""

    name = "recording"

    def __init__(self) -> None:
        self.sent: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = []

    def complete(self, messages: Any, tools: Any = None, **_kw: Any) -> ModelResponse:
        self.sent.append(([dict(m) for m in messages], list(tools or [])))
        return ModelResponse(message={"role": "assistant", "content": "ok"}, usage={}, model=self.name)

    def sizes(self) -> list[int]:
        est = RoughEstimator()
        return [est.count_messages(m) + (est.count_text(json.dumps(t)) if t else 0) for m, t in self.sent]


def _filler(room: int, tail: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Old messages and then ``tail``, as many tokens as ``room`` by the host's estimator, or just under."""
    est = RoughEstimator()
    old = [{"role": "user", "content": "old words " * 40}, {"role": "assistant", "content": "old answer " * 40}]
    messages = [*old, *tail]
    pad = {"role": "user", "content": ""}
    while est.count_messages([pad, *messages]) < room:
        pad["content"] += "word "
    if est.count_messages([pad, *messages]) > room:
        pad["content"] = pad["content"][:-5]
    return [pad, *messages]


def _dangling(n: int) -> dict[str, Any]:
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
             for i in range(n)]
    return {"role": "assistant", "content": None, "tool_calls": calls}


class _Filling(CountingEngine):
    """Answers with a context of exactly the budget it is given, less ``short`` tokens, ending in an
    assistant's ``calls`` tool calls with no results (a branch to the middle of a tool round); with
    ``grow``, a system-prompt addition that grows as its room shrinks."""

    short = 0
    calls_left = 0
    grow = False

    def assemble(self, **kw: Any) -> AssembleResult:
        self.calls.append(("assemble", kw))
        budget = int(kw["token_budget"])
        tail = [_dangling(self.calls_left)] if self.calls_left else []
        messages = _filler(budget - self.short, tail)
        addition = None
        if self.grow:
            asked = sum(1 for name, _ in self.calls if name == "assemble")
            addition = "Mind the summaries. " * (10 * asked)
        return AssembleResult(
            messages=messages, estimated_tokens=RoughEstimator().count_messages(messages),
            system_prompt_addition=addition,
        )


@pytest.mark.parametrize(
    ("short", "calls", "grow"),
    [(0, 1, False), (70, 6, False), (0, 0, True)],
    ids=["stand-in-at-the-budget", "stand-ins-under-the-margin", "addition-growing-on-its-retry"],
)
def test_the_first_request_of_a_turn_fits_the_budget(
    store: TranscriptStore, sid: str, short: int, calls: int, grow: bool
) -> None:
    """Tool rounds were fitted to the budget, the first request not: the stand-in results that
    ``pair_tool_calls`` gives a call without one, and an engine's system-prompt addition still over after
    the assembly was asked again with it reserved, took the first request over ``token_budget`` (by ~20
    tokens per stand-in; by what the addition grew). It gets less of the engine's context now, oldest
    first, as a tool round does."""
    engines: list[_Filling] = []

    def factory(ctx: EngineContext) -> _Filling:
        engine = _Filling(ctx, "filling")
        engine.short, engine.calls_left, engine.grow = short, calls, grow
        engines.append(engine)
        return engine

    host, _ = make_host(store, "filling", {"filling": factory}, token_budget=TOKEN_BUDGET,
                        max_output_tokens=MAX_OUTPUT)
    model = _Requests()
    host.model = model
    try:
        out = host.run_turn(S, sid, "hello there")
    finally:
        host.dispose()
    assert out.commit_status == "committed" and out.engine_id == "filling" and out.degraded_reason is None
    assert len(model.sent) == 1
    assert max(model.sizes()) <= TOKEN_BUDGET - MAX_OUTPUT, model.sizes()
    request = model.sent[0][0]
    assert request[-1] == {"role": "user", "content": "hello there"}
    if calls:  # the tool round at the end of the engine's context is kept whole, its stand-ins with it
        assert [m["content"] for m in request if m["role"] == "tool"] == [UNANSWERED_TOOL_CALL] * calls
