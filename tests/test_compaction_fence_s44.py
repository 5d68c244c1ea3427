"""The built-in compaction around a running turn's fence, a host's compaction and tool-call pairs, on both
backends (a review of the host's manual compaction, ``compaction.compact_session`` and the legacy engine).

1. ``HostRuntime.compact`` while a turn of the session was running (admitted, not completed) called the
   engine's ``compact`` without the turn's fence: the built-in compaction read the turn's admitted message,
   counted it among the ``keep_last`` kept verbatim (one message of the conversation fewer was kept) and
   named it in the pointer. It now gets the running turn's fence, as the compactions inside a turn do.
2. A host's compaction that kept only the turn it ran in (its first kept position the mirror's end, or the
   running turn's fence) was not found by the built-in compaction: it summarised the messages the host's
   summary stood for again from the first, without that summary, and showed the newest of them again.
   Now such a compaction leaves nothing older to compact, and nothing is written.
3. ``split_point`` (where the built-in compaction cuts) and the legacy engine's ``_fit`` (where its
   assembly starts) stepped over a tool result only when it was the message right at the cut: a hidden
   message (``excludeFromContext``) between a tool call and its result let the cut land between them, and
   the kept messages began with a result whose call was summarised (or the assembly showed one without
   its call).
4. ``split_point`` counted hidden messages among the ``keep_last`` kept verbatim: a hidden exchange at the
   end (a context-free command and its reply) left the model no message after the summary.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import module_store_fixtures
from hosting import CountingEngine, RecordingModel
from mirror_helpers import A, a, hosted, legacy_service, page, shown, u

from engines.legacy import LegacyEngine
from transcript_store import TranscriptStore, compaction
from transcript_store.engine import CompactResult, EngineContext
from transcript_store.errors import ReadFenceError
from transcript_store.host import HostRuntime
from transcript_store.registry import EngineRegistry
from transcript_store.service import Service
from transcript_store.service_models import CompactRequest, HostCompactionRequest
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

shared_url, store, sid = module_store_fixtures(A, "compaction_fence_s44")
HEAD = "[Summary of the earlier conversation]\n"
TALK = " tell me more about this" * 20


@pytest.fixture(scope="module")
def service(store: TranscriptStore) -> Iterator[Service]:
    yield from legacy_service(store)


def talk(n: int) -> list[dict[str, Any]]:
    """``n`` long messages q0, r1, ... (user and assistant in turn)."""
    return [u(f"q{i}{TALK}") if i % 2 == 0 else a(f"r{i}{TALK}") for i in range(n)]


class Delegating(CountingEngine):
    """A test engine that leaves compaction to the host: its ``compact`` (no ``fence`` keyword) delegates."""

    def compact(self, **kw: Any) -> CompactResult:
        self.calls.append(("compact", kw))
        return kw["runtime_context"].delegate_compaction_to_runtime(force=kw["force"], focus=kw["focus"])


def host_on(store: TranscriptStore, engine: str) -> HostRuntime:
    """A host on ``engine`` ("legacy" or "delegating") whose built-in compaction keeps the last 2 messages."""
    registry = EngineRegistry()
    registry.register_factory("delegating", lambda ctx: Delegating(ctx, "delegating"))
    settings = load_settings(config_path=None, engine=engine, engine_config={"legacy": {"keep_last": 2}})
    return HostRuntime(store, settings, RecordingModel(), registry=registry, summarizer=ExtractiveSummarizer(),
                       estimator=RoughEstimator())


@pytest.mark.parametrize("engine", ["legacy", "delegating"])
def test_a_manual_compaction_during_a_running_turn_keeps_to_its_fence(
    store: TranscriptStore, sid: str, engine: str
) -> None:
    store.append_many(A, sid, [{"message": m} for m in talk(12)])
    host = host_on(store, engine)
    try:
        # Another worker's turn is running: admitted, its model call not answered yet.
        admission, _intent = host.turns.admit(A, sid, u("and now?"), turn_id="t-run", engine_id=engine)
        assert admission.anchor.position == 12
        out = host.compact(A, sid)
    finally:
        host.dispose()
    assert out.compacted, out.reason
    pointer = compaction.load_pointer(store, A, sid)
    assert pointer is not None
    # The last keep_last messages before the turn's own stay verbatim; unfenced, the admitted message was
    # one of them (first kept: r11) and the pointer was made after it.
    assert pointer["first_kept_position"] == 10
    assert pointer["made_at_count"] == 12
    assert pointer["seen_entry_id"] != admission.anchor.entry_id
    [marker] = [e for e in store.list_entries(A, sid) if e.kind == "compaction"]
    assert admission.anchor.entry_id not in marker.payload["summarized_entry_ids"]
    assert "and now?" not in pointer["summary"]


def test_a_manual_compaction_whose_running_turn_lost_its_fence_is_refused(store: TranscriptStore, sid: str) -> None:
    said = store.append_many(A, sid, [{"message": m} for m in talk(12)])
    host = host_on(store, "legacy")
    try:
        host.turns.admit(A, sid, u("and now?"), turn_id="t-run", engine_id="legacy")
        store.branch(A, sid, said[-2].entry_id)  # another client moved the head back before the turn's message
        with pytest.raises(ReadFenceError):
            host.compact(A, sid)
        assert "legacy" not in host.quarantined  # the fence's failure, not the engine's
    finally:
        host.dispose()
    assert compaction.load_pointer(store, A, sid) is None
    assert not [e for e in store.list_entries(A, sid) if e.kind == "compaction"]


def test_a_host_compaction_that_kept_only_the_running_turn_is_carried_on(service: Service, sid: str) -> None:
    s = service.store
    page(s, sid, None, "c1", hosted(*[(f"h{i}", m) for i, m in enumerate(talk(10))]))
    # The host compacted inside a turn and kept only that turn: its message (h10) is not mirrored yet.
    req = HostCompactionRequest(summary="the host's summary", first_kept_position=10, first_kept_entry_id="h10")
    service.host_compaction(A, "legacy", sid, req)
    before = compaction.load_pointer(s, A, sid)
    assert shown(service, sid) == [f"{HEAD}the host's summary"]
    out = service.compact(A, "legacy", sid, CompactRequest(force=True))
    # Nothing is older than the host's summary: the compaction summarised q0..r3 again from the first,
    # without the host's summary, and showed r4..r9 (which that summary stood for) again.
    assert not out.compacted, out
    assert compaction.load_pointer(s, A, sid) == before
    assert shown(service, sid) == [f"{HEAD}the host's summary"]
    # Once the turn and more are committed and imported, the next compaction summarises from the host's
    # first kept message on, carrying the host's summary.
    later = [(f"h{i}", m) for i, m in enumerate(talk(18))][10:]
    page(s, sid, "c1", "c2", hosted(*later))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted
    after = shown(service, sid)
    assert "the host's summary" in after[0] and "q0" not in after[0] and "q10" in after[0]
    assert [m[:3] for m in after[1:]] == [m["content"][:3] for _, m in later[-6:]]


def test_a_host_compaction_at_the_running_turns_fence_is_carried_on(store: TranscriptStore, sid: str) -> None:
    store.append_many(A, sid, [{"message": m} for m in talk(10)])
    admission = store.admit(A, sid, u("and now?"), turn_id="t-run")
    fence = admission.anchor
    # The host compacted inside that turn and kept only it (its admitted message).
    store.write(lambda c: compaction.record_host_compaction(
        c, A, sid, summary="the host's summary", first_kept_position=10, first_kept_entry_id=fence.entry_id
    ))
    before = compaction.load_pointer(store, A, sid)
    eng = LegacyEngine(EngineContext(store=store, config={"keep_last": 2}, summarizer=ExtractiveSummarizer(),
                                     estimator=RoughEstimator()))
    assert [m["content"] for m in eng.assemble(scope=A, session_id=sid, fence=fence, token_budget=100_000).messages] \
        == [f"{HEAD}the host's summary"]
    out = eng.compact(scope=A, session_id=sid, fence=fence, force=True)
    assert not out.compacted, out
    assert compaction.load_pointer(store, A, sid) == before
    assert [m["content"] for m in eng.assemble(scope=A, session_id=sid, fence=fence, token_budget=100_000).messages] \
        == [f"{HEAD}the host's summary"]


def call(call_id: str) -> dict[str, Any]:
    """An assistant message calling one tool."""
    fn = {"name": "lookup", "arguments": '{"q":"x"}'}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": fn}]}


def hidden(text: str) -> dict[str, Any]:
    """A message the host keeps out of the model's context (OpenClaw's ``excludeFromContext``)."""
    return {"role": "user", "content": text, "openclaw": {"excludeFromContext": True}}


def result(call_id: str, text: str) -> dict[str, Any]:
    """A tool's result."""
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def test_the_built_in_compaction_never_cuts_between_a_call_and_its_result_over_a_hidden_message(
    store: TranscriptStore, sid: str
) -> None:
    tail = [call("c1"), hidden("a hidden consult"), result("c1", "found it"), a("done")]
    store.append_many(A, sid, [{"message": m} for m in [*talk(8), *tail]])
    eng = LegacyEngine(EngineContext(store=store, config={"keep_last": 3}, summarizer=ExtractiveSummarizer(),
                                     estimator=RoughEstimator()))
    assert eng.compact(scope=A, session_id=sid, force=True).compacted
    pointer = compaction.load_pointer(store, A, sid)
    assert pointer is not None
    # The last 3 begin at the hidden message: the call (at 8) was summarised, its result kept.
    assert pointer["first_kept_position"] == 8
    out = eng.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000).messages
    assert [m.get("role") for m in out] == ["user", "assistant", "tool", "assistant"]


def test_the_legacy_assembly_never_starts_on_a_result_behind_a_hidden_message(
    store: TranscriptStore, sid: str
) -> None:
    store.append_many(A, sid, [{"message": m} for m in [call("c1"), hidden("a hidden consult"),
                                                         result("c1", "found it"), a("done")]])
    eng = LegacyEngine(EngineContext(store=store, config={}, estimator=RoughEstimator()))
    est = RoughEstimator()
    room = est.count_messages([result("c1", "found it")]) + est.count_messages([a("done")])
    # Room for the result and the last answer, not the call: the hidden message costs nothing, so the
    # assembly began at it, and showed the result without its call.
    out = eng.assemble(scope=A, session_id=sid, fence=None, token_budget=room).messages
    assert [m.get("role") for m in out] == ["assistant"]


def test_the_built_in_compaction_keeps_the_last_keep_last_messages_the_model_is_shown(
    store: TranscriptStore, sid: str
) -> None:
    # The host's last exchange is hidden (a context-free command and its reply): counted among the keep_last,
    # it left the model no message verbatim after the summary, the newest question and answer summarised.
    tail = [hidden("/status"), {"role": "assistant", "content": "all fine", "openclaw": {"excludeFromContext": True}}]
    store.append_many(A, sid, [{"message": m} for m in [*talk(10), *tail]])
    eng = LegacyEngine(EngineContext(store=store, config={"keep_last": 2}, summarizer=ExtractiveSummarizer(),
                                     estimator=RoughEstimator()))
    assert eng.compact(scope=A, session_id=sid, force=True).compacted
    pointer = compaction.load_pointer(store, A, sid)
    assert pointer is not None and pointer["first_kept_position"] == 8
    out = eng.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000).messages
    assert [m["content"][:2] for m in out[1:]] == ["q8", "r9"]


def test_a_delegated_compaction_through_the_service_holds_the_requests_fence(store: TranscriptStore, sid: str) -> None:
    """``Service.compact`` gave the request's fence to the runtime context only when the engine's ``compact``
    declared a ``fence`` keyword: an engine that hands its compaction to the runtime (no such keyword) had
    the built-in compaction read the running turn's admitted message, as the host's manual one did."""
    store.append_many(A, sid, [{"message": m} for m in talk(12)])
    svc = Service(store, load_settings(config_path=None, engine_config={"legacy": {"keep_last": 2}}))
    assert svc.runtime.registry is not None
    svc.runtime.registry.register_factory("delegating", lambda ctx: Delegating(ctx, "delegating"))
    try:
        admission = store.admit(A, sid, u("and now?"), turn_id="t-run")
        out = svc.compact(A, "delegating", sid, CompactRequest(force=True, fence=admission.anchor))
    finally:
        svc.runtime.dispose()
    assert out.compacted, out.reason
    pointer = compaction.load_pointer(store, A, sid)
    assert pointer is not None
    assert (pointer["first_kept_position"], pointer["made_at_count"]) == (10, 12)
    assert pointer["seen_entry_id"] != admission.anchor.entry_id
