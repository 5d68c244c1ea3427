"""The host runtime's lifecycle, reviewed: engines made around ``dispose`` (a service closed with
requests still running), and engines left undisposed by a maintenance pass outliving the close."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hosting import CountingEngine

from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.errors import EngineError
from transcript_store.service import Service
from transcript_store.settings import load_settings

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
