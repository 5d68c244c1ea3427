"""A retry that takes a running turn over and then fails hands the turn back to the attempt it took it
from, instead of discarding it: that attempt may still be running, and its work is the turn's.

Two attempts of one logical turn run at once when a gateway presents the turn again (its first worker
looked slow or dead). The retry takes the turn's lease over. Before, a retry that then failed (provider
timeouts on every attempt, a degradation, an error) discarded the intent, and the first attempt, alive
and about to succeed, found nothing at its completion (``OutboxCollision``): the turn was lost although
one attempt of it succeeded. Each test here failed on the code before the hand-back.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from conftest import module_store_fixtures, user, wait_until
from hosting import CountingEngine, RecordingModel
from test_host import make_host

from transcript_store import SessionBusy, StoreConfig, TranscriptStore
from transcript_store.errors import ModelTimeout
from transcript_store.host import HostRuntime, TurnFailed
from transcript_store.leases import LeaseKeeper
from transcript_store.outbox import OutboxConfig
from transcript_store.turns import Turns

S = "handback-scope"
LEASE = 0.5
#: a keeper's lease where a test needs it kept alive: renewed every second, so a process paused for
#: up to two seconds (a loaded machine) does not let it run out
HOLD = 3.0

shared_url, store, sid = module_store_fixtures(S, "outbox-handback")


class _TakenOver(logging.Handler):
    """Sets ``seen`` once a lease keeper has found a turn taken over by a retry (its renewal failed)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "taken over by a retry" in record.getMessage():
            self.seen.set()


class _Gate:
    """A model whose first attempt (the first thread to call it) waits for ``go``; every later call
    (the retry's) fails with ``retry_error``, after the retry's admission took the turn over and the
    first attempt's keeper found it so (its renewal failed while the retry held the turn)."""

    name = "gated"

    def __init__(self, retry_error: BaseException, *, await_takeover: bool = True) -> None:
        """``await_takeover=False``: the retry fails at once (a first attempt whose turn a third attempt
        takes over from a dead one logs no take-over of its own, and ``_run_two`` is not what runs it)."""
        self.await_takeover = await_takeover
        self.recording = RecordingModel()
        self.first_thread: int | None = None
        self.first_called = threading.Event()
        self.go = threading.Event()
        self.retry_error = retry_error
        self.retry_calls = 0
        self.lock = threading.Lock()
        self.taken_over = _TakenOver()

    def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
        with self.lock:
            if self.first_thread is None:
                self.first_thread = threading.get_ident()
            mine = self.first_thread == threading.get_ident()
            if not mine:
                self.retry_calls += 1
        if mine:
            self.first_called.set()
            assert self.go.wait(60)
            return self.recording.complete(messages, tools, **kw)
        if self.await_takeover:
            assert self.taken_over.seen.wait(60)
        raise self.retry_error


def _run_two(host: HostRuntime, model: _Gate, sid: str, retry_host: HostRuntime | None = None) -> dict[str, Any]:
    """Start the first attempt, let its model call begin, run the retry to its end; the first attempt
    is still waiting for ``model.go`` when this returns (the caller sets it)."""
    results: dict[str, Any] = {}

    def run(name: str, h: HostRuntime) -> None:
        try:
            results[name] = h.run_turn(S, sid, "q1", turn_id="t1")
        except BaseException as e:  # reported by the caller
            results[name] = e

    leases = logging.getLogger("transcript_store.leases")
    leases.addHandler(model.taken_over)
    try:
        first = threading.Thread(target=run, args=("first", host), daemon=True)
        first.start()
        assert model.first_called.wait(30)
        retry = threading.Thread(target=run, args=("retry", retry_host or host), daemon=True)
        retry.start()
        retry.join(90)
        assert not retry.is_alive()
    finally:
        leases.removeHandler(model.taken_over)
    results["first_thread"] = first
    return results


def _finish(model: _Gate, results: dict[str, Any]) -> Any:
    model.go.set()
    results["first_thread"].join(60)
    return results.get("first")


def _still_running_then_committed(store: TranscriptStore, sid: str, model: _Gate, results: dict[str, Any]) -> None:
    """The first attempt still holds the turn after the retry failed (its keeper renews its lease again,
    moving its expiry on: the session is busy), then completes it: committed, once."""
    turns = Turns(store)
    try:
        handed = turns.intent(S, sid, "t1")
        assert handed is not None and handed.lease_expires_at is not None, handed

        def renewed() -> bool:
            intent = turns.intent(S, sid, "t1")
            assert intent is not None and intent.state == "admitted", intent
            assert intent.lease_expires_at is not None and handed.lease_expires_at is not None
            return intent.lease_expires_at > handed.lease_expires_at

        wait_until(renewed, "the first attempt's lease renewed again after the retry failed")
        with pytest.raises(SessionBusy):
            turns.admit(S, sid, user("other"), turn_id="o1", engine_id="legacy")
    finally:
        out = _finish(model, results)
    assert out is not None and not isinstance(out, BaseException), repr(out)
    assert out.commit_status == "committed"
    assert [r.advancement_key for r in Turns(store).receipts(S, sid)] == ["t1"]


def _kept_leases(host: HostRuntime, store: TranscriptStore) -> None:
    # Renewed every second: a lease as short as LEASE ran out on a loaded machine while its keeper waited
    # to be scheduled. The tests wait for renewals (the lease's expiry moving on), not for it to run out.
    host.turns = Turns(store, OutboxConfig(turn_lease_seconds=HOLD))


def test_a_retry_failing_on_timeouts_hands_the_turn_back_to_the_running_attempt(
    store: TranscriptStore, sid: str
) -> None:
    """The retry times out on every attempt (``TurnFailed``); the first attempt, still in its model
    call, keeps the turn: its lease is renewed again (its expiry moves on; the session stays busy for
    other turns) and its completion commits the turn, once."""
    host, _ = make_host(store)
    _kept_leases(host, store)
    model = _Gate(ModelTimeout("the provider timed out"))
    host.model = model
    results = _run_two(host, model, sid)
    try:
        failed = results.get("retry")
        assert isinstance(failed, TurnFailed), repr(failed)
        assert "handed back" in str(failed)
        assert model.retry_calls == host.settings.max_attempts
        intent = host.turns.intent(S, sid, "t1")
        assert intent is not None and intent.state == "admitted"
    finally:
        _still_running_then_committed(store, sid, model, results)
    host.dispose()


def test_a_retry_in_another_worker_hands_the_turn_back(store: TranscriptStore, sid: str, shared_url: str) -> None:
    """The same across two hosts (two workers, each its own store and lease keeper): the first worker's
    keeper, whose renewals failed while the retry held the turn, renews it again once handed back."""
    host, _ = make_host(store)
    _kept_leases(host, store)
    other_store = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False))
    other, _ = make_host(other_store)
    _kept_leases(other, other_store)
    model = _Gate(ModelTimeout("the provider timed out"))
    host.model = model
    other.model = model
    results = _run_two(host, model, sid, retry_host=other)
    try:
        assert isinstance(results.get("retry"), TurnFailed), repr(results.get("retry"))
    finally:
        _still_running_then_committed(store, sid, model, results)
    other.dispose()
    other_store.close()
    host.dispose()


def test_a_retry_failing_with_an_error_hands_the_turn_back(store: TranscriptStore, sid: str) -> None:
    """Any error of the retry (here the provider's connection breaking): raised to its caller as it is,
    and the turn stays the first attempt's."""
    host, _ = make_host(store)
    _kept_leases(host, store)
    model = _Gate(ConnectionError("the provider went away"))
    host.model = model
    results = _run_two(host, model, sid)
    out = _finish(model, results)
    assert isinstance(results.get("retry"), ConnectionError), repr(results.get("retry"))
    assert out is not None and not isinstance(out, BaseException), repr(out)
    assert out.commit_status == "committed"
    assert [r.advancement_key for r in Turns(store).receipts(S, sid)] == ["t1"]
    host.dispose()


def test_a_degrading_retry_does_not_move_a_running_attempts_turn(
    store: TranscriptStore, sid: str, shared_url: str
) -> None:
    """The retry's engine fails before the model call (a degradation, in another worker): it would have
    handed the turn, still running on its engine in the first worker, to the legacy engine. It is
    ``SessionBusy`` for the retry instead (an attempt of the turn runs), and the first attempt commits
    on its engine."""
    engines: list[CountingEngine] = []

    def factory(ctx: Any) -> CountingEngine:
        engines.append(CountingEngine(ctx))
        return engines[-1]

    host, _ = make_host(store, engine="counting", factories={"counting": factory})
    _kept_leases(host, store)
    other_store = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False))
    other, _ = make_host(other_store, engine="counting", factories={"counting": factory})
    _kept_leases(other, other_store)
    model = _Gate(AssertionError("the retry never reaches its model call"))
    host.model = model
    other.model = model
    first_thread: list[int] = []
    real_assemble = CountingEngine.assemble

    def assemble(self: CountingEngine, **kw: Any) -> Any:
        if first_thread and threading.get_ident() != first_thread[0]:
            raise RuntimeError("the engine broke for the retry")
        first_thread.append(threading.get_ident())
        return real_assemble(self, **kw)

    CountingEngine.assemble = assemble  # type: ignore[method-assign]
    try:
        results = _run_two(host, model, sid, retry_host=other)
    finally:
        CountingEngine.assemble = real_assemble  # type: ignore[method-assign]
    out = _finish(model, results)
    refused = results.get("retry")
    assert isinstance(refused, SessionBusy) and refused.turn_id == "t1", repr(refused)
    assert out is not None and not isinstance(out, BaseException), repr(out)
    assert out.commit_status == "committed" and out.engine_id == "counting" and out.degraded_reason is None
    assert [r.advancement_key for r in Turns(store).receipts(S, sid, "counting")] == ["t1"]
    assert Turns(store).receipts(S, sid, "legacy") == []
    other.dispose()
    other_store.close()
    host.dispose()


def test_a_retry_that_took_over_a_dead_attempt_still_discards(store: TranscriptStore, sid: str) -> None:
    """Nothing is handed back to an attempt whose lease had run out when the retry took the turn over
    (its worker is gone): the failing retry discards the intent, and the session is free at once."""
    turns = Turns(store, OutboxConfig(turn_lease_seconds=0.05))
    turns.admit(S, sid, user("q1"), turn_id="t1", engine_id="legacy", owner="gone/worker")
    time.sleep(0.1)
    host, model = make_host(store)
    model.fail_next = [ModelTimeout("timed out")] * host.settings.max_attempts
    with pytest.raises(TurnFailed) as failed:
        host.run_turn(S, sid, "q1", turn_id="t1")
    assert "handed back" not in str(failed.value)
    assert host.turns.intent(S, sid, "t1") is None
    assert host.run_turn(S, sid, "next").commit_status == "committed"
    host.dispose()


def test_the_keeper_renews_a_handed_back_lease_again(
    store: TranscriptStore, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hold whose renewal failed because a retry took the turn over is kept (not dropped) while its
    attempt runs: renewed again once the turn is handed back; dropped when the intent is gone.

    Waits for each renewal instead of sleeping: with a lease as long as the sleep (the retry's and the
    hold's once were), a process paused on a loaded machine let the retry's lease run out first, and
    the keeper rightly took the turn back before the hand-back could."""
    turns = Turns(store, OutboxConfig(turn_lease_seconds=LEASE))
    retry = Turns(store, OutboxConfig(turn_lease_seconds=60))  # the retry holds the turn while the test looks
    keeper = LeaseKeeper(store)
    try:
        caplog.set_level(logging.WARNING, logger="transcript_store.leases")
        turns.admit(S, sid, user("q1"), turn_id="t1", engine_id="legacy", owner="worker/a")
        keeper.hold(S, sid, "t1", HOLD, "worker/a")
        taken: list[Any] = []
        retry.admit(S, sid, user("q1"), turn_id="t1", engine_id="legacy", owner="worker/b", taken_over=taken)
        assert [lease.owner for lease in taken] == ["worker/a"]
        wait_until(lambda: "taken over by a retry" in caplog.text or not keeper.holds(S, sid, "t1"),
                   "a renewal of worker/a's lease finding the turn taken over")
        assert keeper.holds(S, sid, "t1")
        renewals = keeper.renewals
        assert turns.hand_back(S, sid, "t1", owner="worker/b", lease=taken[0])
        intent = turns.intent(S, sid, "t1")
        assert intent is not None and intent.lease_owner == "worker/a" and intent.lease_expires_at is not None
        handed_until = intent.lease_expires_at
        wait_until(lambda: keeper.renewals > renewals, "worker/a's lease renewed again after the hand-back")
        renewed = turns.intent(S, sid, "t1")
        assert renewed is not None and renewed.lease_owner == "worker/a"
        assert renewed.lease_expires_at is not None and renewed.lease_expires_at > handed_until
        with pytest.raises(SessionBusy):
            turns.admit(S, sid, user("q2"), turn_id="t2", engine_id="legacy")
        turns.discard(S, sid, "t1")
        wait_until(lambda: not keeper.holds(S, sid, "t1"), "the hold dropped once its intent is gone")
    finally:
        keeper.close()


def test_a_long_delivery_keeps_its_drain_claim(store: TranscriptStore, sid: str) -> None:
    """An engine's commit running longer than the drain's claim (``delivery_lease_seconds``): another
    drain took the expired claim over and ran the engine's commit again, while the first delivery's
    rolled back when it found its claim lost. The claim is renewed while the delivery runs, so the
    second drain finds the session busy and the engine's commit runs once."""
    if store.db.dialect.is_sqlite:
        pytest.skip("SQLite: a delivery holds the write lock, so no other drain can claim meanwhile")
    from workers.turn_worker import counting_engine

    config = OutboxConfig(delivery_lease_seconds=1.5)
    turns = Turns(store, config)
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id="slow")
    done = turns.complete(S, sid, "t1", [{"message": {"role": "assistant", "content": "a"}}], None)
    assert done.intent.state == "accepted"
    calls: list[str] = []
    started = threading.Event()
    second_done = threading.Event()

    def slow(c: Any, payload: Any) -> Any:
        calls.append(threading.current_thread().name)
        started.set()
        if threading.current_thread().name == "first":
            assert second_done.wait(60)  # runs on until the second drain has tried
        return counting_engine(c, payload)

    reports: dict[str, Any] = {}

    def drain(name: str) -> None:
        reports[name] = Turns(store, config).drain(lambda engine_id: slow, scope=S, session_id=sid)

    first = threading.Thread(target=drain, args=("first",), name="first")
    first.start()
    assert started.wait(30)
    # Unrenewed, the first claim would have run out by now; renewed every third of it (a loaded machine
    # may pause the renewing thread for most of a claim: a claim of 0.4 s ran out meanwhile).
    time.sleep(2.0)
    try:
        drain("second")
    finally:
        second_done.set()
    first.join(60)
    assert calls == ["first"], calls
    assert reports["first"].committed == 1 and reports["second"].delivered == 0
    assert [r.advancement_key for r in Turns(store).receipts(S, sid)] == ["t1"]


def test_a_refused_retry_reports_no_lease_taken_over(store: TranscriptStore, sid: str) -> None:
    """A retry's admission that took the turn over from a live attempt and was then refused (here
    ``TurnOvertaken``: a later turn was admitted meanwhile) rolled the take-over back, but the lease it
    had put in ``taken_over`` stayed there: the caller was told of a take-over that never happened. A
    refused call leaves ``taken_over`` empty, and the turn with the attempt that holds it."""
    from transcript_store.errors import TurnOvertaken

    turns = Turns(store)
    turns.admit(S, sid, user("q1"), turn_id="t1", engine_id="e", owner="worker/a")
    store.admit(S, sid, user("q2"), turn_id="t2")  # the store's own admit: no turn, not held back
    taken: list[Any] = ["stale"]
    with pytest.raises(TurnOvertaken):
        turns.admit(S, sid, user("q1"), turn_id="t1", engine_id="e", owner="worker/b", taken_over=taken)
    assert taken == []
    intent = turns.intent(S, sid, "t1")
    assert intent is not None and intent.lease_owner == "worker/a"
