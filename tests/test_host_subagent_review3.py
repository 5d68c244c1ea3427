"""Subagent spawns, reviewed: an engine whose background maintenance failed is quarantined before a
spawn, as before a turn or a compaction, so the spawn's hooks never run on it (both backends)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hosting import CountingEngine, RecordingModel

from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext, MaintainResult, SubagentSpawnPreparation
from transcript_store.host import HostRuntime
from transcript_store.quarantine import records
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

SCOPE = "tenant-sub3"


class FailingUpkeep(CountingEngine):
    """A background-maintenance engine whose maintain raises; records the subagent hooks called on it."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx, "upkeep", turn_maintenance_mode="background")
        self.hooks: list[str] = []

    def maintain(self, **_kw: Any) -> MaintainResult:
        raise RuntimeError("maintenance bug")

    def prepare_subagent_spawn(self, **_kw: Any) -> SubagentSpawnPreparation:
        self.hooks.append("prepare")
        return SubagentSpawnPreparation(rollback=lambda: self.hooks.append("rollback"))

    def on_subagent_ended(self, **_kw: Any) -> None:
        self.hooks.append("ended")


def make_host(store: TranscriptStore) -> tuple[HostRuntime, FailingUpkeep]:
    """A host on the failing engine, made at once and returned with it."""
    registry = EngineRegistry()
    registry.register_factory("upkeep", FailingUpkeep)
    host = HostRuntime(store, load_settings(config_path=None, engine="upkeep"), RecordingModel(),
                       registry=registry, summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())
    engine, _info = host.engine("upkeep")
    assert isinstance(engine, FailingUpkeep)
    return host, engine


@pytest.mark.parametrize("child_fails", [False, True], ids=["child-ok", "child-fails"])
def test_spawn_after_a_failed_background_maintain_quarantines_first(
    store: TranscriptStore, child_fails: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The failed pass quarantines the engine before the spawn (recorded as its ``maintain`` failure):
    neither prepare_subagent_spawn, nor the rollback or on_subagent_ended, runs on the failed engine,
    and the child runs as on legacy."""
    parent = store.create_session(SCOPE, session_id="parent").session_id
    host, engine = make_host(store)
    try:
        with caplog.at_level(logging.WARNING):
            assert host.run_turn(SCOPE, parent, "hello", turn_id="t1").engine_id == "upkeep"
            assert host.maintenance.wait(10)
        assert "maintenance bug" in caplog.text and "upkeep" not in host.quarantined  # deferred to the caller

        def child(child_sid: str) -> str:
            if child_fails:
                raise ValueError("the child failed")
            return f"ran {child_sid}"

        if child_fails:
            with pytest.raises(ValueError, match="the child failed"):
                host.spawn_subagent(SCOPE, parent, "child:1", child)
        else:
            assert host.spawn_subagent(SCOPE, parent, "child:1", child).startswith("ran ")
        assert engine.hooks == []
        assert host.quarantined["upkeep"][0] == "maintain"
        recs = store.read(lambda c: records(c))
        assert [(r.engine_id, r.operation) for r in recs] == [("upkeep", "maintain")]
    finally:
        host.dispose()
