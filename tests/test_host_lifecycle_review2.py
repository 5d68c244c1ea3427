"""The host runtime's lifecycle, reviewed: engines made around ``dispose`` (a service closed with
requests still running), and engines left undisposed by a maintenance pass outliving the close."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from conftest import wait_until
from hosting import CountingEngine, RecordingModel

from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.errors import EngineError, StorageFull, TransientStoreError
from transcript_store.host import HostRuntime
from transcript_store.maintenance import BackgroundMaintenance
from transcript_store.quarantine import records
from transcript_store.registry import EngineRegistry
from transcript_store.service import Service
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

SCOPE = "tenant-1"


class DisposableEngine(CountingEngine):
    """A counting engine whose instances say whether they were disposed of."""

    made: list[DisposableEngine] = []

    def __init__(self, ctx: EngineContext, **info: Any) -> None:
        super().__init__(ctx, engine_id="disposable", **info)
        self.disposed = 0
        DisposableEngine.made.append(self)

    def dispose(self) -> None:
        self.disposed += 1


@pytest.fixture(autouse=True)
def _fresh_made() -> None:
    DisposableEngine.made = []


def make_host(store: TranscriptStore, engine_id: str, factory: Any) -> HostRuntime:
    """A host running the engine ``factory`` makes under ``engine_id``, with the stand-in model."""
    registry = EngineRegistry()
    registry.register_factory(engine_id, factory)
    return HostRuntime(store, load_settings(config_path=None, engine=engine_id), RecordingModel(),
                       registry=registry, summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())


def make_service(store: TranscriptStore, factory: Any) -> Service:
    service = Service(store, load_settings(config_path=None, engine="legacy"))
    registry = service.runtime.registry
    assert registry is not None
    registry.register_factory("disposable", factory)
    return service


def test_engine_whose_factory_outlives_the_service_close_is_disposed(store: TranscriptStore) -> None:
    """A request still making its engine when ``Service.close`` gives up waiting: the engine it made
    after the runtime was disposed of is disposed too (it was kept in the runtime, never released),
    and the request learns the service is closed (an EngineError: 503 engine_unavailable)."""
    started, release = threading.Event(), threading.Event()

    def slow_factory(ctx: EngineContext) -> DisposableEngine:
        started.set()
        assert release.wait(30)
        return DisposableEngine(ctx)

    service = make_service(store, slow_factory)
    outcome: list[BaseException | object] = []

    def request() -> None:
        with service.inflight.call():
            try:
                outcome.append(service.engine("disposable"))
            except BaseException as e:  # the test reads what the request got
                outcome.append(e)

    thread = threading.Thread(target=request)
    thread.start()
    assert started.wait(30)
    service.close(wait_seconds=0.2)  # gives up on the request, still inside the factory
    release.set()
    thread.join(30)
    assert len(DisposableEngine.made) == 1
    assert DisposableEngine.made[0].disposed == 1
    assert len(outcome) == 1 and isinstance(outcome[0], EngineError)
    assert "disposable" not in service.runtime.quarantined  # the close's doing, not the engine's failure


def test_engine_asked_for_after_the_service_closed_is_not_made(store: TranscriptStore) -> None:
    """A request that asks for an engine once the service closed (it outlived the close's wait) makes
    none: its factory would run and its instance stay undisposed, holding what it opened."""
    service = make_service(store, DisposableEngine)
    service.close(wait_seconds=0)
    with pytest.raises(EngineError, match="disposed"):
        service.engine("disposable")
    assert DisposableEngine.made == []
    assert "disposable" not in service.runtime.quarantined


class SlowUpkeep(DisposableEngine):
    """Background maintenance that runs until released; records whether it was disposed under it."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx, turn_maintenance_mode="background")
        self.started, self.release = threading.Event(), threading.Event()
        self.disposed_while_running = False
        self.pass_over = threading.Event()

    def maintain(self, **_kw: Any) -> None:
        self.started.set()
        assert self.release.wait(timeout=20)
        self.disposed_while_running = self.disposed > 0
        self.pass_over.set()


def test_engine_whose_maintenance_pass_outlives_dispose_is_disposed_when_it_ends(
    store: TranscriptStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dispose() leaves an engine whose background pass still runs (not disposed under it): it was then
    never disposed of at all, its resources held for the rest of the process. It is, once the pass ends."""
    monkeypatch.setattr(BackgroundMaintenance.close, "__defaults__", (0.3,))  # close's wait, shortened
    host = make_host(store, "disposable", SlowUpkeep)
    sid = store.create_session(SCOPE).session_id
    assert host.run_turn(SCOPE, sid, "hi", turn_id="t1").engine_id == "disposable"
    engine = host.engine("disposable")[0]
    assert isinstance(engine, SlowUpkeep)
    try:
        assert engine.started.wait(10)
        host.dispose()
        assert engine.disposed == 0  # not under the running pass
    finally:
        engine.release.set()
    assert engine.pass_over.wait(10)
    wait_until(lambda: engine.disposed == 1, "the engine disposed of once its pass ended", timeout=10)
    assert not engine.disposed_while_running
    time.sleep(0.1)
    assert engine.disposed == 1 and len(SlowUpkeep.made) == 1


class ExitingDispose(CountingEngine):
    """A plugin whose dispose ends with SystemExit (a ``sys.exit`` in its cleanup)."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx, engine_id="exiting")

    def dispose(self) -> None:
        raise SystemExit("cleanup exited")


def test_a_plugin_dispose_raising_system_exit_does_not_stop_the_close(store: TranscriptStore) -> None:
    """A plugin's ``dispose`` that raised SystemExit escaped ``HostRuntime.dispose`` (only Exception was
    caught): the engines after it were never disposed of, and ``Service.close`` never closed the store.
    As in the registry's own checks, a plugin's SystemExit is its failure, logged, not the host's exit."""
    service = make_service(store, DisposableEngine)
    registry = service.runtime.registry
    assert registry is not None
    registry.register_factory("exiting", ExitingDispose)
    service.engine("exiting")
    service.engine("disposable")
    service.close(wait_seconds=0)  # raised SystemExit
    assert [e.disposed for e in DisposableEngine.made] == [1]
    assert store.closed


@pytest.mark.parametrize("failure", [
    TransientStoreError("transient database error: the server closed the connection"),
    StorageFull("database storage is full: database or disk is full"),
])
def test_a_factory_failing_with_the_database_leaves_the_engine_selectable(
    store: TranscriptStore, failure: Exception
) -> None:
    """A factory that reads the store (a plugin warming its state) and fails because the database did
    quarantined its engine for the rest of the process, as the factory's own bug would: only that
    turn runs on legacy, as for any engine call the database failed; the next turn makes it again."""
    failures = [failure]

    def warming(ctx: EngineContext) -> DisposableEngine:
        if failures:
            raise failures.pop()  # what its ctx.store.read(...) raised, the store's retries run out
        return DisposableEngine(ctx)

    host = make_host(store, "disposable", warming)
    try:
        sid = store.create_session(SCOPE).session_id
        out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
        assert out.engine_id == "legacy" and str(failure) in (out.degraded_reason or "")
        assert "disposable" not in host.quarantined and store.read(lambda c: records(c)) == []
        out = host.run_turn(SCOPE, sid, "again", turn_id="t2")
        assert (out.engine_id, out.degraded_reason, out.commit_status) == ("disposable", None, "committed")
    finally:
        host.dispose()


class ExitingAssemble(CountingEngine):
    """A plugin whose assemble ends with SystemExit (a ``sys.exit`` deep in its code)."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx, engine_id="exiting")

    def assemble(self, **kw: Any) -> Any:
        raise SystemExit(3)


def test_a_lifecycle_method_raising_system_exit_is_the_engines_failure(store: TranscriptStore) -> None:
    """An engine's ``assemble`` that raised SystemExit went through the engine guard (Exception only):
    the turn failed with it and the host process (a chat, a gateway worker) exited, instead of the
    engine being isolated and the turn answered by legacy, as for any exception of a lifecycle method."""
    host = make_host(store, "exiting", ExitingAssemble)
    try:
        sid = store.create_session(SCOPE).session_id
        out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
        assert (out.engine_id, out.commit_status) == ("legacy", "committed")
        assert "SystemExit" in (out.degraded_reason or "")
        assert host.quarantined["exiting"][0] == "assemble"
        assert [r.engine_id for r in store.read(lambda c: records(c))] == ["exiting"]
    finally:
        host.dispose()


class ExitingCommit(CountingEngine):
    """A plugin whose commit_turn ends with SystemExit."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx, engine_id="exiting")

    def commit_turn(self, **kw: Any) -> Any:
        raise SystemExit("commit exited")


def test_a_commit_turn_raising_system_exit_queues_the_turn(store: TranscriptStore) -> None:
    """The same inside the commit's transaction: the accepted turn waits in the outbox for its engine,
    which is isolated, as after any failed commit, instead of the host process exiting."""
    host = make_host(store, "exiting", ExitingCommit)
    try:
        sid = store.create_session(SCOPE).session_id
        out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
        assert (out.engine_id, out.commit_status) == ("exiting", "queued")
        assert host.quarantined["exiting"][0] == "commit_turn"
        assert [r.engine_id for r in store.read(lambda c: records(c))] == ["exiting"]
        assert [e.message["content"] for e in store.read_visible(SCOPE, sid)][-2] == "hello"
    finally:
        host.dispose()
