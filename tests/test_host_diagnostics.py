"""``runtime_settings.diagnostics``: the contract's fallback / degraded reasons, filled where the host degrades."""

from __future__ import annotations

from typing import Any

import pytest
from hosting import CountingEngine, RecordingModel

from transcript_store import TranscriptStore
from transcript_store.engine import DEGRADE_NO_FENCE, RuntimeSettings
from transcript_store.host import HostRuntime
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

SCOPE = "tenant-1"


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(SCOPE, session_id="sess", session_key="agent:main:test").session_id


def make_host(store: TranscriptStore, engine: str = "legacy", **factories: Any) -> HostRuntime:
    registry = EngineRegistry()
    for engine_id, factory in factories.items():
        registry.register_factory(engine_id, factory)
    return HostRuntime(store, load_settings(config_path=None, engine=engine), RecordingModel(), registry=registry,
                       summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())


def legacy_settings(host: HostRuntime) -> list[RuntimeSettings]:
    """What the (real) legacy engine's assemble is handed as ``runtime_settings``, call by call."""
    legacy, _info = host.engine("legacy")
    seen: list[RuntimeSettings] = []
    assemble = legacy.assemble

    def recording(**kw: Any) -> Any:
        seen.append(kw["runtime_settings"])
        return assemble(**kw)

    legacy.assemble = recording
    return seen


def test_a_normal_turn_has_no_diagnostics(store: TranscriptStore, sid: str) -> None:
    host = make_host(store)
    seen = legacy_settings(host)
    host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert seen and seen[-1].runtime.mode == "normal"
    assert seen[-1].diagnostics.fallback_reason is None and seen[-1].diagnostics.degraded_reason is None


def test_an_engine_without_the_fence_declaration_falls_back_with_its_reason(store: TranscriptStore, sid: str) -> None:
    host = make_host(store, "nofence", nofence=lambda ctx: CountingEngine(ctx, "nofence", transcript_semantics={}))
    seen = legacy_settings(host)
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.engine_id == "legacy" and out.degraded_reason == DEGRADE_NO_FENCE
    rs = seen[-1]
    assert rs.runtime.mode == "degraded" and rs.context_engine_selection.source == "fallback"
    assert rs.diagnostics.fallback_reason == rs.diagnostics.degraded_reason == DEGRADE_NO_FENCE


def test_a_quarantined_engine_falls_back_with_its_reason(store: TranscriptStore, sid: str) -> None:
    def broken(ctx: Any) -> Any:
        raise RuntimeError("factory broke")

    host = make_host(store, "broken", broken=broken)
    seen = legacy_settings(host)
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.engine_id == "legacy" and "broken" in host.quarantined
    assert seen[-1].diagnostics.fallback_reason == out.degraded_reason
    assert "factory broke" in str(seen[-1].diagnostics.degraded_reason)


def test_an_engine_failing_its_assembly_hands_legacy_the_reason(store: TranscriptStore, sid: str) -> None:
    class Fails(CountingEngine):
        def assemble(self, **kw: Any) -> Any:
            raise KeyError("oops")

    host = make_host(store, "fails", fails=lambda ctx: Fails(ctx, "fails"))
    seen = legacy_settings(host)
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.engine_id == "legacy" and "fails" in host.quarantined
    assert seen[-1].diagnostics.degraded_reason == out.degraded_reason and "KeyError" in str(out.degraded_reason)


def test_an_unfenced_legacy_read_is_a_degraded_run(store: TranscriptStore, sid: str) -> None:
    host = make_host(store)
    store.append(SCOPE, sid, {"role": "assistant", "content": "earlier"})

    def rewrite(scope: str, session_id: str, admission: Any) -> None:
        last = [e for e in store.read_visible(scope, session_id) if e.role == "assistant"][-1]
        store.rewrite_entries(scope, session_id, [{"entry_id": last.entry_id,
                                                   "message": {"role": "assistant", "content": "redacted"}}])

    host.before_assemble = rewrite
    seen = legacy_settings(host)
    try:
        out = host.run_turn(SCOPE, sid, "next", turn_id="t1")
    finally:
        host.dispose()
    assert "legacy read unfenced" in str(out.degraded_reason)
    assert seen[0].diagnostics.degraded_reason is None  # the fenced try, before the fence was found broken
    assert seen[-1].runtime.mode == "degraded" and seen[-1].diagnostics.degraded_reason == out.degraded_reason
    assert seen[-1].diagnostics.fallback_reason is None  # legacy was the selection: nothing fell back
