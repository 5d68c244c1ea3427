"""Review round 21: an unknown turn's error, a retry killed after it took a running turn over, the first
model request's budget; then (its second review) every live attempt of a turn retries took over is
remembered, not just the last one, and a turn discarded while it ran is a failed turn, not an unknown one.

Each test here failed on the code before its fix (see the docstrings).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
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
    identity,
    outbox,
)
from transcript_store.cli import exit_code
from transcript_store.engine import AssembleResult, EngineContext
from transcript_store.errors import OutboxCollision
from transcript_store.host import UNANSWERED_TOOL_CALL, HostRuntime
from transcript_store.model import ModelResponse
from transcript_store.outbox import OutboxConfig
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

S = "review-r21"
ROOT = Path(__file__).resolve().parents[1]
# Renewed every lease/3 by the running attempt's keeper: with 0.5 s, a keeper thread held off the CPU that long
# (CI runs the OpenClaw suite beside the tests) let a live attempt's lease run out, which these tests assert
# never happens.
LEASE = 1.0

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



def _still_running(store: TranscriptStore, host: HostRuntime, sid: str) -> None:
    """Recovery leaves t1 running, and the next turn of the session waits for it."""
    report = Turns(store).recover(S, sid, "legacy", host.commit_in)
    assert report.discarded == [] and report.running == ["t1"]
    with pytest.raises(SessionBusy) as busy:
        Turns(store).admit(S, sid, user("next"), turn_id="t2", engine_id="legacy")
    assert busy.value.turn_id == "t1"


def _committed_then_next(store: TranscriptStore, host: HostRuntime, sid: str, out: Any) -> None:
    """t1 committed exactly once by its first attempt; the session's next turn then runs."""
    _committed_once(store, sid, out)
    host.model = RecordingModel()
    assert host.run_turn(S, sid, "next", turn_id="t2").commit_status == "committed"
    host.dispose()

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
        _still_running(store, host, sid)
    finally:
        out = _finish_first(model, results)
    _committed_then_next(store, host, sid, out)


def test_a_retry_failing_after_a_killed_one_hands_the_turn_back_to_the_first_attempt(
    store: TranscriptStore, sid: str, shared_url: str
) -> None:
    """First attempt A runs t1; retry B (a real process) takes it over and is SIGKILLed; retry C takes it
    over from dead B and fails. C took it from no live attempt, so it discarded the intent, and A's
    completion found nothing (``OutboxCollision``): lost. C hands it back to A now (A's is the lease B
    took), and A commits it, once."""
    host, _ = make_host(store)
    model = _Gate(ConnectionError("the provider went away"), await_takeover=False)
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
        time.sleep(2.5 * LEASE)  # the retry's lease ran out long ago; the first attempt's keeper renewed
        with pytest.raises(SessionBusy):
            short.admit(S, sid, user("next"), turn_id="t2", engine_id="legacy")
    finally:
        out = _finish_first(model, results)
    _committed_once(store, sid, out)
    # Neither attempt renewing (both on other machines): abandoned after the lease, as before.
    short.admit(S, sid, user("q3"), turn_id="t3", engine_id="legacy", owner="elsewhere/first")
    short.admit(S, sid, user("q3"), turn_id="t3", engine_id="legacy", owner="elsewhere/second")
    time.sleep(2 * LEASE)
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


# ---------------------------------------------------------------------------------------------- 4
# The second review of 2: the intent kept ONE displaced lease (the last one), so with three attempts of
# a turn the first one's was forgotten; and a turn discarded while it ran surfaced as an unknown turn.

Q1 = {"role": "user", "content": "q1"}


def _renew(store: TranscriptStore, session_id: str, owner: str, lease: float) -> str:
    """One renewal by ``owner``'s lease keeper (``LeaseKeeper._renew`` without its thread)."""
    return store.write(lambda c: outbox.renewal(c, S, session_id, "t1", owner, lease))


def test_the_first_of_three_attempts_keeps_its_turn_once_both_retries_stop(store: TranscriptStore, sid: str) -> None:
    """A runs t1; retry B takes it over from live A; retry C takes it over from live B. The intent kept
    one displaced lease, B's over A's: A's renewals were "taken over" for good, and once B and C stopped
    renewing the turn counted as abandoned while A still ran: the next turn discarded it and A's
    completion found nothing (``UnknownTurn``). Every live attempt is kept now: A renews its own lease in
    the intent and takes the turn back once B's and C's have run out."""
    lease = 1.0
    turns = Turns(store, OutboxConfig(turn_lease_seconds=lease))
    a, b, c = "elsewhere/A", "elsewhere/B", "elsewhere/C"
    turns.admit(S, sid, Q1, turn_id="t1", engine_id="legacy", owner=a)
    from_b: list[Any] = []
    from_c: list[Any] = []
    turns.admit(S, sid, Q1, turn_id="t1", engine_id="legacy", owner=b, taken_over=from_b)
    turns.admit(S, sid, Q1, turn_id="t1", engine_id="legacy", owner=c, taken_over=from_c)
    assert [x.owner for x in from_b] == [a] and [x.owner for x in from_c] == [b]
    # B and C stop renewing (they died on other machines); A's keeper renews every third of a lease.
    outcomes = []
    for _ in range(8):
        outcomes.append(_renew(store, sid, a, lease))
        time.sleep(lease / 3)
    assert outcomes[0] == "taken over" and outcomes[-1] == "renewed", outcomes
    intent = turns.intent(S, sid, "t1")
    assert intent is not None and intent.lease_owner == a
    report = turns.recover(S, sid, "legacy", lambda engine_id: None)
    assert report.discarded == [] and report.running == ["t1"]
    with pytest.raises(SessionBusy) as busy:
        turns.admit(S, sid, user("next"), turn_id="t2", engine_id="legacy")
    assert busy.value.turn_id == "t1"
    done = turns.complete(S, sid, "t1", [{"message": assistant("A's answer")}], None)
    assert done.intent.state == "accepted"


#: a worker running a retry of t1 whose model call never returns: it holds the turn (renewing its lease)
#: from its admission until it is killed
_STUCK_RETRY = """
import sys, time
from transcript_store import StoreConfig, TranscriptStore
from test_host import make_host
store = TranscriptStore(config=StoreConfig(url=sys.argv[1], auto_upgrade=False))
host, _ = make_host(store)

class Stuck:
    name = "stuck"

    def complete(self, *args, **kwargs):
        print("in the model", flush=True)
        time.sleep(600)

host.model = Stuck()
host.run_turn(sys.argv[2], sys.argv[3], "q1", turn_id="t1")
"""


def test_a_turn_two_killed_retries_took_over_one_after_the_other_stays_with_the_first_attempt(
    store: TranscriptStore, sid: str, shared_url: str
) -> None:
    """A (this process's host) runs t1; retry B (a worker process) takes it over from A and runs; retry C
    (another one) takes it over from live B and is SIGKILLed at once; then B is SIGKILLed. The intent had
    kept B's lease only, over A's: with B and C provably gone the turn was abandoned, recovery discarded
    it, the next turn was admitted and A ended ``TurnOvertaken``: the turn was lost. A's keeper takes it
    back now, the session stays busy while A runs, and A commits it, once."""
    host, _ = make_host(store)
    host.turns = Turns(store, OutboxConfig(turn_lease_seconds=LEASE))
    model = _Gate(AssertionError("no second model call here"))
    host.model = model
    results = _start_first(host, model, sid)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    b = subprocess.Popen(
        [sys.executable, "-c", _STUCK_RETRY, shared_url, S, sid], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert b.stdout is not None and b.stdout.readline().strip() == "in the model"
        intent = Turns(store).intent(S, sid, "t1")
        assert intent is not None and intent.lease_owner is not None  # B's: another process
        assert intent.lease_owner.split("/")[0] != str(identity.current())
        b_owner = intent.lease_owner
        _killed_retry(shared_url, sid)  # C, from live B
        intent = Turns(store).intent(S, sid, "t1")
        assert intent is not None and intent.lease_owner not in (b_owner, None)
    finally:
        b.send_signal(signal.SIGKILL)
        b.wait(30)
    try:
        me = str(identity.current())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            intent = Turns(store).intent(S, sid, "t1")
            if intent is None or (intent.lease_owner or "").split("/")[0] == me:
                break
            time.sleep(LEASE / 5)
        assert intent is not None and (intent.lease_owner or "").split("/")[0] == me, intent
        time.sleep(3 * LEASE)  # the lease it took back is A's keeper's to renew
        _still_running(store, host, sid)
    finally:
        out = _finish_first(model, results)
    _committed_then_next(store, host, sid, out)


class _Scripted:
    """A model for attempts of one turn in threads named "A", "B", "C": each waits in its call until
    released; A then answers, the others fail (``ConnectionError``: not retried, the call gives up)."""

    name = "scripted"

    def __init__(self) -> None:
        self.entered = {name: threading.Event() for name in "ABC"}
        self.release = {name: threading.Event() for name in "ABC"}
        self.recording = RecordingModel()

    def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
        me = threading.current_thread().name
        self.entered[me].set()
        assert self.release[me].wait(60)
        if me == "A":
            return self.recording.complete(messages, tools, **kw)
        raise ConnectionError(f"attempt {me}: the provider went away")


def test_retries_failing_out_of_order_hand_the_turn_to_the_attempt_still_running(
    store: TranscriptStore, sid: str
) -> None:
    """A runs t1; B takes it over from live A; C from live B. B fails first (C holds the turn: nothing to
    hand back), then C fails and handed the turn back to B, whose attempt had ended: nobody renewed it,
    the turn was abandoned a lease later and discarded while A still ran. An attempt that ends leaves the
    intent's list of displaced attempts now, and C hands the turn to A, which commits it."""
    host, _ = make_host(store)
    # Longer than LEASE: A's keeper must renew across the whole test while CI runs other suites beside it
    # (with 0.5 s, a keeper held off the CPU that long let A's lease run out: t2 was admitted, once).
    lease = 2.0
    host.turns = Turns(store, OutboxConfig(turn_lease_seconds=lease))
    model = _Scripted()
    host.model = model
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        try:
            results[name] = host.run_turn(S, sid, "q1", turn_id="t1")
        except BaseException as e:  # reported below
            results[name] = e

    threads = {name: threading.Thread(target=run, args=(name,), name=name, daemon=True) for name in "ABC"}
    try:
        for name in "ABC":  # each admission takes the turn over from the one before, still running
            threads[name].start()
            assert model.entered[name].wait(30), name
        for name in "BC":  # B fails first, then C
            model.release[name].set()
            threads[name].join(60)
            assert isinstance(results.get(name), ConnectionError), (name, results.get(name))
        time.sleep(2 * lease)  # a lease given to B (whose attempt is over) would have run out long ago
        report = Turns(store).recover(S, sid, "legacy", host.commit_in)
        assert report.discarded == [] and report.running == ["t1"]
        with pytest.raises(SessionBusy):
            Turns(store).admit(S, sid, user("next"), turn_id="t2", engine_id="legacy")
    finally:
        model.release["A"].set()
        threads["A"].join(60)
    _committed_once(store, sid, results.get("A"))
    host.dispose()


def test_session_busy_tells_when_the_last_live_lease_runs_out(store: TranscriptStore, sid: str) -> None:
    """A (lease 30 s) runs t1; retry B (lease 0.5 s) took it over and stopped renewing. The session is busy
    for A, until A's lease runs out; but the host's ``SessionBusy`` (and ``reassign``'s) named B's expiry,
    already past: a caller waiting until then was refused again. Each names A's now."""
    Turns(store, OutboxConfig(turn_lease_seconds=30)).admit(S, sid, Q1, turn_id="t1", engine_id="legacy",
                                                            owner="elsewhere/A")
    Turns(store, OutboxConfig(turn_lease_seconds=LEASE)).admit(S, sid, Q1, turn_id="t1", engine_id="legacy",
                                                               owner="elsewhere/B")
    time.sleep(2 * LEASE)
    host, _ = make_host(store)
    refusals: dict[str, SessionBusy] = {}
    try:
        host.run_turn(S, sid, "next", turn_id="t2")
    except SessionBusy as e:
        refusals["host"] = e
    try:
        Turns(store).admit(S, sid, user("next"), turn_id="t3", engine_id="legacy")
    except SessionBusy as e:
        refusals["admit"] = e
    try:
        store.write(lambda c: outbox.reassign(c, S, sid, "t1", "legacy", owner="elsewhere/C"))
    except SessionBusy as e:
        refusals["reassign"] = e
    host.dispose()
    assert sorted(refusals) == ["admit", "host", "reassign"]
    now = datetime.now(UTC)
    for where, busy in refusals.items():
        assert busy.turn_id == "t1", where
        assert busy.lease_expires_at is not None and busy.lease_expires_at > now + timedelta(seconds=20), (
            where, busy.lease_expires_at, now)


def test_at_most_sixteen_displaced_attempts_are_kept_and_never_one_forgotten(
    store: TranscriptStore, sid: str
) -> None:
    """The list of displaced attempts is bounded: a retry that would make it one more live attempt to
    remember is ``SessionBusy`` naming the turn (nothing written), instead of forgetting one of them;
    attempts that ended or whose lease ran out make room again."""
    turns = Turns(store, OutboxConfig(turn_lease_seconds=60))
    MAX_DISPLACED = getattr(outbox, "MAX_DISPLACED", 16)  # (read so: this module runs on older code too)
    owners = [f"elsewhere/w{i}" for i in range(MAX_DISPLACED + 2)]
    for owner in owners[: MAX_DISPLACED + 1]:
        turns.admit(S, sid, Q1, turn_id="t1", engine_id="legacy", owner=owner)
    before = store.list_entries(S, sid)
    with pytest.raises(SessionBusy) as busy:
        turns.admit(S, sid, Q1, turn_id="t1", engine_id="legacy", owner=owners[-1])
    assert busy.value.turn_id == "t1" and busy.value.lease_expires_at is not None
    intent = turns.intent(S, sid, "t1")
    assert intent is not None and intent.lease_owner == owners[MAX_DISPLACED]
    assert store.list_entries(S, sid) == before
    lease = store.read(lambda c: outbox.AdmittedLease.of(outbox.get_row(c, S, sid, "t1")))
    assert [o for o, _ in lease.displaced_leases()] == owners[:MAX_DISPLACED]
    # w3's attempt ends (its call gave up): it leaves the list, and the next retry finds room.
    assert not turns.discard(S, sid, "t1", owner=owners[3])
    turns.admit(S, sid, Q1, turn_id="t1", engine_id="legacy", owner=owners[-1])
    lease = store.read(lambda c: outbox.AdmittedLease.of(outbox.get_row(c, S, sid, "t1")))
    assert [o for o, _ in lease.displaced_leases()] == [o for o in owners[: MAX_DISPLACED + 1] if o != owners[3]]
    # The holder fails: the turn goes to the most recent live attempt, not to one that ended.
    assert turns.hand_back(S, sid, "t1", owner=owners[-1], lease=outbox.AdmittedLease("t1", owners[MAX_DISPLACED], 1))
    intent = turns.intent(S, sid, "t1")
    assert intent is not None and intent.lease_owner == owners[MAX_DISPLACED]


def test_a_turn_discarded_while_it_ran_is_a_failed_turn_not_an_unknown_one(store: TranscriptStore, sid: str) -> None:
    """A running turn whose intent was discarded meanwhile (its worker's lease was taken for abandoned)
    found no intent at its completion. ``Turns.complete`` raises ``UnknownTurn`` for that since this round,
    and ``run_turn`` passed it on: the CLI exited 3, "not found", saying "no turn intent" of a turn that
    did exist. It raises ``OutboxCollision`` again, as it did before (exit 1), saying what happened."""
    host, _ = make_host(store)
    model = _Gate(AssertionError("no second model call"))
    host.model = model
    results = _start_first(host, model, sid)
    try:
        assert Turns(store).discard(S, sid, "t1")  # as recovery does with a lease it found abandoned
    finally:
        out = _finish_first(model, results)
    assert isinstance(out, OutboxCollision) and not isinstance(out, UnknownTurn | LookupError), repr(out)
    assert exit_code(out) == 1
    assert "discarded while this attempt ran" in str(out) and "no turn intent" not in str(out)
    assert [e.message["content"] for e in store.read_visible(S, sid)] == ["q1"]  # no reply written
    host.model = RecordingModel()
    assert host.run_turn(S, sid, "next", turn_id="t2").commit_status == "committed"
    host.dispose()


@pytest.mark.parametrize(
    "text",
    [
        json.dumps([{"owner": "elsewhere/A", "expires_us": 300_000_000_000_000_000}]),  # past year 9999
        json.dumps([{"owner": "elsewhere/A", "expires_us": 2**70}]),  # past BIGINT
        json.dumps([{"owner": "elsewhere/" + "x" * 190, "expires_us": 4_000_000_000_000_000}]),  # owner too long
        "[" * 100_000 + "]" * 100_000,  # deeper than json can read
    ],
    ids=["past-9999", "past-bigint", "long-owner", "deep"],
)
def test_a_malformed_displaced_list_is_ignored_not_a_crash(store: TranscriptStore, text: str) -> None:
    """A hand-edited or corrupt displaced_leases crashed every admission of its session (OverflowError,
    RecursionError) and the holder's discard (a BIGINT or varchar(128) refusal); its items are left out."""
    from sqlalchemy import update

    from transcript_store.schema import outbox as table

    turns = Turns(store, OutboxConfig(turn_lease_seconds=600))
    sid = store.create_session(S).session_id  # the store is the module's: a session of this case's own
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id="legacy", owner="elsewhere/H")
    store.write(lambda c: c.conn.execute(update(table).where(table.c.session_id == sid).values(displaced_leases=text)))
    with pytest.raises(SessionBusy):  # the holder's own lease runs for 600 s: busy, typed
        turns.admit(S, sid, user("n"), turn_id="t2", engine_id="legacy")
    assert turns.discard(S, sid, "t1", owner="elsewhere/H")  # nothing live to hand it to: discarded
    turns.admit(S, sid, user("n"), turn_id="t2", engine_id="legacy")


def test_reassign_gives_the_turn_back_to_its_only_live_attempt(store: TranscriptStore) -> None:
    """B ran t1, retry C took it over and died; B's engine then failed before the model (the host moves
    the turn to legacy): reassign(owner=B) was SessionBusy although B was the only live attempt, and the
    host then gave the turn up, leaving it abandoned while its caller heard the session was busy."""
    from sqlalchemy import update

    from transcript_store import outbox as ob
    from transcript_store.core import now_us
    from transcript_store.schema import outbox as table

    turns = Turns(store, OutboxConfig(turn_lease_seconds=60))
    sid = store.create_session(S).session_id
    first, retry = "elsewhere/B", "elsewhere/C"
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id="legacy", owner=first)
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id="legacy", owner=retry, taken_over=[])
    past = now_us() - 5_000_000  # the retry died: its lease ran out
    store.write(lambda c: c.conn.execute(update(table).where(table.c.session_id == sid).values(lease_expires_us=past)))
    assert store.write(lambda c: ob.reassign(c, S, sid, "t1", "other", first))
    intent = turns.intent(S, sid, "t1")
    assert intent is not None and intent.lease_owner == first and intent.engine_id == "other", intent
    assert intent.lease_expires_at is not None and intent.lease_expires_at > datetime.now(UTC)
    row = store.read(lambda c: ob.get_row(c, S, sid, "t1"))
    assert row is not None and row.displaced_leases is None
    # a live retry still holds its turn: an earlier attempt may not take it
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id="other", owner=retry, taken_over=[])
    with pytest.raises(SessionBusy):
        store.write(lambda c: ob.reassign(c, S, sid, "t1", "legacy", first))
