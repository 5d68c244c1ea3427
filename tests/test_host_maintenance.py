"""Deferred maintenance over both backends: a background-mode engine's ``maintain`` runs after the turn,
off the caller's thread, once per waiting session; a foreground engine's runs inline; failures stay
the engine's."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from hosting import CountingEngine, RecordingModel

from transcript_store import TranscriptStore
from transcript_store.engine import CompactResult, EngineContext, MaintainResult
from transcript_store.host import HostRuntime, RuntimeContext
from transcript_store.maintenance import BackgroundMaintenance
from transcript_store.quarantine import records
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

SCOPE = "tenant-m"


class Upkeep(CountingEngine):
    """Records every maintain call with the thread it ran on; ``gate`` (when set) holds it."""

    def __init__(self, ctx: EngineContext, mode: str, fail: bool = False) -> None:
        super().__init__(ctx, "upkeep", turn_maintenance_mode=mode)
        self.maintained: list[tuple[str, str]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail = fail

    def maintain(self, *, scope: str, session_id: str, **_kw: Any) -> MaintainResult:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        self.maintained.append((session_id, threading.current_thread().name))
        if self.fail:
            raise RuntimeError("maintenance bug")
        return MaintainResult(changed=False, reason="checked")


def make(
    store: TranscriptStore, mode: str, fail: bool = False, kind: type[Upkeep] | None = None
) -> tuple[HostRuntime, Any]:
    """A host whose engine ``upkeep`` is a ``kind`` (default Upkeep), made at once and returned with it."""
    made: list[Upkeep] = []

    def factory(ctx: EngineContext) -> Upkeep:
        made.append((kind or Upkeep)(ctx, mode, fail))
        return made[-1]

    registry = EngineRegistry()
    registry.register_factory("upkeep", factory)
    host = HostRuntime(
        store,
        load_settings(config_path=None, engine="upkeep"),
        RecordingModel(),
        registry=registry,
        summarizer=ExtractiveSummarizer(),
        estimator=RoughEstimator(),
    )
    host.engine("upkeep")
    return host, made[0]


@pytest.fixture
def sessions(store: TranscriptStore) -> tuple[str, str]:
    return (
        store.create_session(SCOPE, session_id="m-a").session_id,
        store.create_session(SCOPE, session_id="m-b").session_id,
    )


def test_background_maintain_runs_after_the_reply_off_the_callers_thread(
    store: TranscriptStore, sessions: tuple[str, str]
) -> None:
    host, engine = make(store, "background")
    engine.gate = threading.Event()
    try:
        out = host.run_turn(SCOPE, sessions[0], "hello", turn_id="t1")
        # The turn is committed and returned while its maintenance is still held.
        assert out.commit_status == "committed" and out.engine_id == "upkeep"
        assert engine.entered.wait(10) and engine.maintained == []
        assert host.maintenance.pending() == 1
    finally:
        engine.gate.set()
    assert host.maintenance.wait(10)
    assert engine.maintained == [("m-a", "transcript-store-maintain")]
    host.dispose()


def test_waiting_passes_for_one_session_are_coalesced(store: TranscriptStore, sessions: tuple[str, str]) -> None:
    host, engine = make(store, "background")
    engine.gate = threading.Event()
    a, b = sessions
    try:
        host.run_turn(SCOPE, a, "first", turn_id="a1")
        assert engine.entered.wait(10)  # a's first pass is running (held)
        for i in range(3):
            host.run_turn(SCOPE, a, f"more {i}", turn_id=f"a{i + 2}")
            host.run_turn(SCOPE, b, f"b {i}", turn_id=f"b{i}")
        # One pass running, and one waiting per session however many turns asked.
        assert host.maintenance.pending() == 3
    finally:
        engine.gate.set()
    assert host.maintenance.wait(10)
    assert [s for s, _ in engine.maintained] == ["m-a", "m-a", "m-b"]
    assert host.maintenance.runs == 3
    host.dispose()


def test_foreground_maintain_runs_inline_before_the_turn_returns(
    store: TranscriptStore, sessions: tuple[str, str]
) -> None:
    host, engine = make(store, "foreground")
    host.run_turn(SCOPE, sessions[0], "hello", turn_id="t1")
    assert engine.maintained == [("m-a", threading.current_thread().name)]
    assert host.maintenance.runs == 0 and host.maintenance.pending() == 0
    host.dispose()


def test_a_failing_background_maintain_quarantines_the_engine_not_the_turn(
    store: TranscriptStore, sessions: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    host, engine = make(store, "background", fail=True)
    with caplog.at_level(logging.WARNING):
        out = host.run_turn(SCOPE, sessions[0], "hello", turn_id="t1")
        assert out.commit_status == "committed" and out.engine_id == "upkeep"
        assert host.maintenance.wait(10)
    assert "background maintain of engine upkeep" in caplog.text and "maintenance bug" in caplog.text
    # The next turn quarantines it before it starts (recorded in the store) and goes to the fallback;
    # the quarantined engine is not asked again.
    out2 = host.run_turn(SCOPE, sessions[0], "again", turn_id="t2")
    assert out2.engine_id == "legacy" and out2.commit_status == "committed"
    assert "upkeep" in host.quarantined
    recs = store.read(lambda c: records(c))
    assert [(r.engine_id, r.operation) for r in recs] == [("upkeep", "maintain")]
    assert host.maintenance.wait(10) and len(engine.maintained) == 1
    host.dispose()


class _CallsBack(RecordingModel):
    """Runs ``during`` (once) inside its first model call: while the turn is in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.during: Any = None

    def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
        if self.during is not None:
            during, self.during = self.during, None
            during()
        return super().complete(messages, tools, **kw)


def test_a_pass_failing_while_another_turn_runs_leaves_that_turn_on_its_engine(
    store: TranscriptStore, sessions: tuple[str, str]
) -> None:
    """The maintenance thread's failure is the engine's, but a turn already running on it (on the
    caller's thread) commits through it: pulling the engine from under it would leave its accepted turn
    waiting in the outbox. The quarantine lands before the next turn."""
    host, engine = make(store, "background", fail=True)
    model = _CallsBack()
    host.model = model
    engine.gate = threading.Event()
    a, b = sessions
    assert host.run_turn(SCOPE, a, "first", turn_id="a1").engine_id == "upkeep"
    assert engine.entered.wait(10)  # a's pass is held until b's turn is at its model call

    def fail_now() -> None:
        assert engine.gate is not None
        engine.gate.set()
        assert host.maintenance.wait(10) and len(engine.maintained) == 1  # it ran, and raised

    model.during = fail_now
    out = host.run_turn(SCOPE, b, "second", turn_id="b1")
    assert (out.engine_id, out.commit_status) == ("upkeep", "committed")
    assert receipts_of(store, b) == ["b1"]
    nxt = host.run_turn(SCOPE, b, "third", turn_id="b2")
    assert nxt.engine_id == "legacy" and "upkeep" in host.quarantined
    host.dispose()


def receipts_of(store: TranscriptStore, sid: str) -> list[str]:
    return [r.advancement_key for r in Turns(store).receipts(SCOPE, sid, "upkeep")]


def test_a_deferred_pass_gets_a_runtime_context_without_the_finished_turns_fence(
    store: TranscriptStore, sessions: tuple[str, str]
) -> None:
    seen: list[Any] = []

    class Looks(Upkeep):
        def maintain(self, *, scope: str, session_id: str, **kw: Any) -> MaintainResult:
            seen.append(kw.get("runtime_context"))
            return MaintainResult(changed=False, reason="looked")

    host, _ = make(store, "background", kind=Looks)  # every host param
    host.run_turn(SCOPE, sessions[0], "hello", turn_id="t1")
    assert host.maintenance.wait(10)
    assert len(seen) == 1 and isinstance(seen[0], RuntimeContext)
    assert (seen[0].session_id, seen[0].fence, seen[0].turn_id) == ("m-a", None, None)
    host.dispose()


def test_dispose_lets_waiting_maintenance_finish(store: TranscriptStore, sessions: tuple[str, str]) -> None:
    host, engine = make(store, "background")
    engine.gate = threading.Event()
    host.run_turn(SCOPE, sessions[0], "hello", turn_id="t1")
    host.run_turn(SCOPE, sessions[1], "hello", turn_id="t2")
    assert engine.entered.wait(10)
    threading.Timer(0.3, engine.gate.set).start()
    host.dispose()
    assert [s for s, _ in engine.maintained] == ["m-a", "m-b"]
    # After dispose nothing new is queued.
    host.maintenance.schedule(("upkeep", SCOPE, "m-a"), {})
    assert host.maintenance.pending() == 0


def test_close_gives_up_on_a_stuck_pass_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    ran: list[str] = []

    def run(key: tuple[str, str, str], _params: dict[str, Any]) -> None:
        release.wait(10)
        ran.append(key[2])

    queue = BackgroundMaintenance(run)
    queue.schedule(("e", "s", "one"), {})
    queue.schedule(("e", "s", "two"), {})
    with caplog.at_level(logging.WARNING):
        queue.close(timeout=0.2)
    assert "still running at close" in caplog.text and "1 waiting pass(es) dropped" in caplog.text
    release.set()
    assert ran in ([], ["one"])  # the running pass may finish; the waiting one never starts


class Compacting(Upkeep):
    """Compacts (or not, per ``compacts``) on every manual compaction."""

    compacts = True

    def compact(self, **kw: Any) -> CompactResult:
        self.calls.append(("compact", kw))
        return CompactResult(ok=True, compacted=self.compacts, reason="done" if self.compacts else "nothing to do")


@pytest.mark.parametrize("mode", ["foreground", "background"])
def test_maintain_follows_a_manual_compaction_that_compacted(
    store: TranscriptStore, sessions: tuple[str, str], mode: str
) -> None:
    host, engine = make(store, mode, kind=Compacting)
    assert host.compact(SCOPE, sessions[1]).compacted
    assert host.maintenance.wait(10)
    assert [s for s, _ in engine.maintained] == ["m-b"]
    engine.compacts = False  # nothing changed: nothing to maintain
    assert not host.compact(SCOPE, sessions[1]).compacted
    assert host.maintenance.wait(10) and len(engine.maintained) == 1
    host.dispose()


def test_a_forked_child_gets_a_queue_of_its_own_and_a_closed_one_stays_closed() -> None:
    """The parent's thread is not in the child and its lock may have been held at the fork: the child
    starts afresh (its passes run on its own thread); a queue closed before the fork takes nothing."""
    import os
    import signal

    release = threading.Event()
    open_queue = BackgroundMaintenance(lambda _k, _p: release.wait(10))
    open_queue.schedule(("e", "s", "parent"), {})  # the parent's thread is busy at the fork
    closed_ran: list[str] = []
    closed_queue = BackgroundMaintenance(lambda key, _p: closed_ran.append(key[2]))
    closed_queue.close()
    try:
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)
            ran: list[str] = []
            open_queue._run_one = lambda key, _p: ran.append(key[2])
            open_queue.schedule(("e", "s", "child"), {})
            ok = open_queue.wait(5) and ran == ["child"]
            closed_queue.schedule(("e", "s", "child"), {})
            ok = ok and closed_queue.wait(5) and closed_ran == []
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
    assert os.waitstatus_to_exitcode(status) == 0
    assert open_queue.wait(10)
    open_queue.close()
