"""Maintenance after bootstrap (OpenClaw's reason "bootstrap"), over both backends: the host runs the
engine's ``maintain`` inline right after the bootstrap of a turn, before the prompt is assembled, inside
the turn's fence; an engine whose ``maintain`` takes no fence is maintained after the commit only; a
failing pass never breaks the turn; the lossless engine's pass never covers the admitted entry. A
compaction inside a turn (the engine's ``compact`` before the prompt or in an overflow's recovery,
lossless ``assemble``'s own) holds the turn's fence as well."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from hosting import CountingEngine, RecordingModel
from sqlalchemy import select

from engines.lossless import LosslessEngine
from engines.lossless.tables import messages, summaries, summary_sources
from transcript_store import TranscriptStore
from transcript_store.engine import AssembleResult, BootstrapResult, CompactResult, EngineContext, MaintainResult
from transcript_store.errors import ModelError
from transcript_store.host import HostRuntime
from transcript_store.models import Admission, Anchor
from transcript_store.quarantine import records
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

SCOPE = "tenant-bm"


class Booting(CountingEngine):
    """Records bootstrap, maintain (with its fence and thread) and assemble in order."""

    def __init__(self, ctx: EngineContext, engine_id: str, mode: str, fail: bool) -> None:
        super().__init__(ctx, engine_id, turn_maintenance_mode=mode)
        self.order: list[str] = []
        self.maintained: list[tuple[Anchor | None, str]] = []
        self.fail = fail

    def bootstrap(self, *, scope: str, session_id: str, fence: Anchor | None, **_kw: Any) -> BootstrapResult:
        self.order.append("bootstrap")
        return BootstrapResult(bootstrapped=True)

    def assemble(self, **kw: Any) -> Any:
        self.order.append("assemble")
        return super().assemble(**kw)

    def _record(self, fence: Anchor | None) -> MaintainResult:
        self.order.append("maintain")
        self.maintained.append((fence, threading.current_thread().name))
        if self.fail:
            raise RuntimeError("maintenance bug")
        return MaintainResult(changed=False, reason="checked")


class Fenced(Booting):
    """A maintain that takes the turn's fence."""

    def maintain(self, *, scope: str, session_id: str, fence: Anchor | None = None, **_kw: Any) -> MaintainResult:
        return self._record(fence)


class Unfenced(Booting):
    """A maintain that takes no fence (``**kw`` is no promise to honour one)."""

    def maintain(self, *, scope: str, session_id: str, **kw: Any) -> MaintainResult:
        return self._record(kw.get("fence"))


def make(store: TranscriptStore, kind: type[Booting], mode: str, fail: bool = False) -> tuple[HostRuntime, Any]:
    made: list[Booting] = []

    def factory(ctx: EngineContext) -> Booting:
        made.append(kind(ctx, "booting", mode, fail))
        return made[-1]

    registry = EngineRegistry()
    registry.register_factory("booting", factory)
    host = HostRuntime(
        store,
        load_settings(config_path=None, engine="booting"),
        RecordingModel(),
        registry=registry,
        summarizer=ExtractiveSummarizer(),
        estimator=RoughEstimator(),
    )
    host.engine("booting")
    return host, made[0]


def admitted_entry(store: TranscriptStore, sid: str, text: str) -> str:
    return next(e.entry_id for e in store.read_visible(SCOPE, sid) if e.message == {"role": "user", "content": text})


@pytest.mark.parametrize("mode", ["foreground", "background"])
def test_maintain_runs_once_after_bootstrap_inline_and_fenced_before_assemble(
    store: TranscriptStore, mode: str
) -> None:
    sid = store.create_session(SCOPE, session_id="bm-a").session_id
    host, engine = make(store, Fenced, mode)
    me = threading.current_thread().name
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.commit_status == "committed" and out.engine_id == "booting"
    assert host.maintenance.wait(10)
    # Bootstrap, then its maintenance inline on the caller's thread (background mode too), then assemble;
    # the turn's own maintain follows the commit (deferred in background mode).
    assert engine.order[:3] == ["bootstrap", "maintain", "assemble"]
    fence, thread = engine.maintained[0]
    assert thread == me
    assert fence is not None and fence.entry_id == admitted_entry(store, sid, "hello")
    after_commit = "transcript-store-maintain" if mode == "background" else me
    assert engine.maintained[1:] == [(None, after_commit)]
    # Once: the next turn bootstraps nothing, so it is maintained after its commit only.
    host.run_turn(SCOPE, sid, "again", turn_id="t2")
    assert host.maintenance.wait(10)
    assert engine.order.count("bootstrap") == 1 and len(engine.maintained) == 3
    host.dispose()

    # A maintain that takes no fence is not run inside the turn (it could read the admitted entry).
    other = store.create_session(SCOPE, session_id="bm-b").session_id
    host, engine = make(store, Unfenced, mode)
    host.run_turn(SCOPE, other, "hello", turn_id="u1")
    assert host.maintenance.wait(10)
    assert engine.order[:2] == ["bootstrap", "assemble"] and engine.maintained == [(None, after_commit)]
    host.dispose()


@pytest.mark.parametrize("mode", ["foreground", "background"])
def test_a_failing_maintain_after_bootstrap_does_not_break_the_turn(
    store: TranscriptStore, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    sid = store.create_session(SCOPE, session_id="bm-f").session_id
    host, engine = make(store, Fenced, mode, fail=True)
    with caplog.at_level(logging.WARNING):
        out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    # The engine's failure quarantines it, as an inline maintain's does; the turn has not started (no
    # assembly yet), so it runs and commits on legacy.
    assert out.commit_status == "committed" and out.engine_id == "legacy"
    assert "maintain of engine booting failed after its bootstrap" in caplog.text and "maintenance bug" in caplog.text
    assert engine.order == ["bootstrap", "maintain"]
    assert "booting" in host.quarantined
    assert [(r.engine_id, r.operation) for r in store.read(lambda c: records(c))] == [("booting", "maintain")]
    assert [e.message["role"] for e in store.read_visible(SCOPE, sid)] == ["user", "assistant"]
    host.dispose()


# ---------------------------------------------------------------------------------------------- lossless

#: the engine's marks: a 2,000-token window compacts over 1,500; the host's prompt budget is far larger,
#: so assemble itself never compacts this history (only maintain does)
SMALL = {"context_window": 2000, "fresh_tail_messages": 0, "leaf_chunk_messages": 4, "leaf_chunk_tokens": 64}


def lossless_host(store: TranscriptStore, summarizer: Any = None) -> tuple[HostRuntime, RecordingModel]:
    model = RecordingModel()
    settings = load_settings(config_path=None, engine="lossless", engine_config={"lossless": SMALL})
    host = HostRuntime(store, settings, model, registry=EngineRegistry(), summarizer=summarizer or
                       ExtractiveSummarizer(), estimator=RoughEstimator())
    return host, model


def history(store: TranscriptStore, sid: str, n: int = 8) -> None:
    """A transcript from before the engine was selected: about 1,700 tokens, over the threshold."""
    for i in range(n):
        long = " ".join(f"Sentence {j} of turn {i} says something about topic {i * j}." for j in range(12))
        store.append(SCOPE, sid, {"role": "user", "content": f"question {i}: {long}"})
        store.append(SCOPE, sid, {"role": "assistant", "content": f"answer {i}: {long}"})


def covered_entries(store: TranscriptStore, sid: str) -> set[str]:
    """The transcript entries some summary of the engine covers."""

    def run(c: Any) -> set[str]:
        q = select(messages.c.entry_id).join(
            summary_sources,
            (summary_sources.c.scope == messages.c.scope)
            & (summary_sources.c.session_id == messages.c.session_id)
            & (summary_sources.c.message_ordinal == messages.c.ordinal),
        ).where(messages.c.session_id == sid)
        return {r[0] for r in c.conn.execute(q)}

    return store.read(run)


def summary_count(store: TranscriptStore, sid: str) -> int:
    q = select(summaries.c.summary_seq).where(summaries.c.session_id == sid)
    return len(store.read(lambda c: list(c.conn.execute(q))))


def test_lossless_maintain_after_bootstrap_compacts_before_the_prompt_within_the_fence(store: TranscriptStore) -> None:
    sid = store.create_session(SCOPE, session_id="bm-l").session_id
    history(store, sid)
    host, model = lossless_host(store)
    out = host.run_turn(SCOPE, sid, "the new question", turn_id="t1")
    assert out.commit_status == "committed" and out.engine_id == "lossless"
    # The maintenance after the bootstrap compacted the imported history before this turn's prompt (a
    # background-mode engine: the turn's own pass comes after the reply)...
    prompt = model.requests[0]
    assert any("[Summary" in str(m.get("content")) for m in prompt)
    # ...and the admitted entry is the prompt's last message, as the user sent it, covered by no summary.
    assert prompt[-1] == {"role": "user", "content": "the new question"}
    assert host.maintenance.wait(10)
    assert admitted_entry(store, sid, "the new question") not in covered_entries(store, sid)
    host.dispose()


class ImportingSummarizer(ExtractiveSummarizer):
    """While the inline maintenance plans, an unfenced reader (another process's ``bootstrap`` with no
    fence) imports the whole transcript into the engine's copy, the admitted entry included."""

    def __init__(self, sid: str) -> None:
        super().__init__()
        self.sid = sid
        self.engine: LosslessEngine | None = None
        self.armed = False

    def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        if self.armed and self.engine is not None:
            self.armed = False
            self.engine.bootstrap(scope=SCOPE, session_id=self.sid, fence=None)
        return super().summarize(messages, **kw)


def test_lossless_maintain_never_compacts_the_admitted_entry_when_the_copy_crossed_the_fence(
    store: TranscriptStore, caplog: pytest.LogCaptureFixture
) -> None:
    sid = store.create_session(SCOPE, session_id="bm-x").session_id
    history(store, sid)
    summarizer = ImportingSummarizer(sid)
    host, _model = lossless_host(store, summarizer)
    engine, _info = host.engine("lossless")
    summarizer.engine = engine

    def arm(_scope: str, _sid: str, _admission: Admission) -> None:
        summarizer.armed = True

    host.before_assemble = arm
    with caplog.at_level(logging.WARNING):
        out = host.run_turn(SCOPE, sid, "the new question", turn_id="t1")
    # The compaction's write found the engine's copy past the fence: nothing written, the fence error
    # degrades the turn (as a bootstrap's would), which commits on legacy.
    assert out.commit_status == "committed" and out.engine_id == "legacy"
    assert "crossed" in (out.degraded_reason or "")
    assert admitted_entry(store, sid, "the new question") not in covered_entries(store, sid)
    assert summary_count(store, sid) == 0
    host.dispose()


class CompactsInTurn(CountingEngine):
    """An engine that owns compaction and records the fence each ``compact`` gets; its assembly says it
    may hide an overflow (``before the prompt``: the host's safeguard then asks it to compact)."""

    def __init__(self, ctx: EngineContext, overflow: bool) -> None:
        super().__init__(ctx, "compacting", owns_compaction=True)
        self.overflow = overflow
        self.fences: list[Anchor | None] = []

    def assemble(self, **kw: Any) -> Any:
        result = super().assemble(**kw)
        if not self.overflow:
            return result
        return AssembleResult(messages=result.messages, estimated_tokens=kw["token_budget"] - 1,
                              prompt_authority="preassembly_may_overflow")

    def compact(self, *, scope: str, session_id: str, fence: Anchor | None = None, **kw: Any) -> CompactResult:
        self.fences.append(fence)
        return CompactResult(ok=True, compacted=True)


class CompactsUnfenced(CompactsInTurn):
    """The same, with a ``compact`` that declares no ``fence`` (``**kw`` is no promise to honour one)."""

    def compact(self, **kw: Any) -> CompactResult:  # type: ignore[override]
        self.fences.append(kw.get("fence"))
        return CompactResult(ok=True, compacted=True)


def compacting_host(
    store: TranscriptStore, kind: type[CompactsInTurn], overflow: bool
) -> tuple[HostRuntime, CompactsInTurn, RecordingModel]:
    made: list[CompactsInTurn] = []

    def factory(ctx: EngineContext) -> CompactsInTurn:
        made.append(kind(ctx, overflow=overflow))
        return made[-1]

    registry = EngineRegistry()
    registry.register_factory("compacting", factory)
    model = RecordingModel()
    host = HostRuntime(store, load_settings(config_path=None, engine="compacting"), model, registry=registry,
                       summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())
    host.engine("compacting")
    return host, made[0], model


@pytest.mark.parametrize("when", ["before the prompt", "overflow recovery"])
@pytest.mark.parametrize("kind", [CompactsInTurn, CompactsUnfenced])
def test_a_compaction_inside_a_turn_is_given_the_turns_fence(
    store: TranscriptStore, when: str, kind: type[CompactsInTurn]
) -> None:
    """The host's own compaction calls inside a turn (its safeguard before the prompt, the recovery of a
    provider's overflow) gave an engine no fence: its compaction read and wrote the session as it is,
    the admitted entry in reach. A ``compact`` that declares ``fence`` now gets the turn's, as the
    maintain after a bootstrap does; one that does not is called as before."""
    sid = store.create_session(SCOPE, session_id="bm-c").session_id
    host, engine, model = compacting_host(store, kind, overflow=when == "before the prompt")
    if when == "overflow recovery":
        overflow = ModelError("maximum context length exceeded", status=400, code="context_length_exceeded")
        model.fail_next.append(overflow)
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.commit_status == "committed" and out.engine_id == "compacting"
    assert len(engine.fences) == 1
    fence = engine.fences[0]
    if kind is CompactsInTurn:
        assert fence is not None and fence.entry_id == admitted_entry(store, sid, "hello")
    else:
        assert fence is None
    host.dispose()


def test_lossless_assemble_compacts_within_the_fence_or_the_turn_degrades_with_nothing_written(
    store: TranscriptStore,
) -> None:
    """A turn whose assembly is over the prompt's budget compacts in ``assemble`` (turns another host
    committed on legacy, imported now). While the summarizer ran, an unfenced reader imported the admitted
    entry into the engine's copy: the compaction's write landed all the same (its summary stayed after
    the turn degraded). Now the write refuses it (ReadFenceError "crossed"), and the turn runs on legacy."""
    sid = store.create_session(SCOPE, session_id="bm-ax").session_id
    summarizer = ImportingSummarizer(sid)
    model = RecordingModel()
    settings = load_settings(config_path=None, engine="lossless", token_budget=3000, max_output_tokens=200,
                             engine_config={"lossless": {"leaf_chunk_messages": 4, "fresh_tail_messages": 2}})
    host = HostRuntime(store, settings, model, registry=EngineRegistry(), summarizer=summarizer,
                       estimator=RoughEstimator())
    engine, _info = host.engine("lossless")
    summarizer.engine = engine
    assert host.run_turn(SCOPE, sid, "hello", turn_id="t1").engine_id == "lossless"  # bootstrapped here
    assert host.maintenance.wait(10)
    history(store, sid, 20)  # about 4,000 tokens, over the prompt's budget: assemble compacts them
    before = summary_count(store, sid)

    def arm(_scope: str, _sid: str, _admission: Admission) -> None:
        summarizer.armed = True

    host.before_assemble = arm
    out = host.run_turn(SCOPE, sid, "the new question", turn_id="t2")
    assert out.commit_status == "committed" and out.engine_id == "legacy"
    assert "crossed" in (out.degraded_reason or "")
    assert not summarizer.armed  # the assembly's compaction was planned, and its write refused
    assert summary_count(store, sid) == before
    assert admitted_entry(store, sid, "the new question") not in covered_entries(store, sid)
    host.dispose()
