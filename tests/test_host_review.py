"""A hostile review of the host runtime: what an engine, a model or a broken fence can make of a turn.

Each test here failed on the code before its fix (see the docstrings).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from conftest import module_store_fixtures
from hosting import CountingEngine, RecordingModel
from test_host import make_host

from transcript_store import TranscriptStore
from transcript_store.errors import EngineContractError, ModelError, ModelTimeout
from transcript_store.host import HostRuntime, TurnFailed
from transcript_store.ledger import list_receipts
from transcript_store.maintenance import BackgroundMaintenance
from transcript_store.model import ModelResponse
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

SCOPE = "host-review"
shared_url, store, sid = module_store_fixtures(SCOPE, "host-review")


def reply(content: Any = "final answer", **extra: Any) -> ModelResponse:
    return ModelResponse(message={"role": "assistant", "content": content, **extra}, usage={}, model="scripted")


class Scripted:
    """A model answering from a script: a ModelResponse, or an exception to raise."""

    name = "scripted"

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.calls = 0

    def complete(self, messages: Any, tools: Any = None, **_kw: Any) -> ModelResponse:
        self.calls += 1
        step = self.script.pop(0) if self.script else reply()
        if isinstance(step, BaseException):
            raise step
        return step


def receipts(store: TranscriptStore, session_id: str) -> list[tuple[str, str]]:
    return [(r.engine_id, r.advancement_key) for r in store.read(lambda c: list_receipts(c, SCOPE, session_id))]


def test_an_unfenced_legacy_turn_over_the_threshold_still_answers(store: TranscriptStore, sid: str) -> None:
    """The fence broke (a rewrite before assembly): legacy reads unfenced, but the compaction before the
    prompt was handed the broken fence, raised ReadFenceError, and the turn failed (intent discarded)."""
    for i in range(30):
        store.append(SCOPE, sid, {"role": "user", "content": f"message {i} " + "lorem ipsum dolor sit amet " * 8})
        store.append(SCOPE, sid, {"role": "assistant", "content": f"answer {i} " + "consectetur adipiscing " * 8})
    host, _ = make_host(store, token_budget=2000, max_output_tokens=100)

    def rewrite(scope: str, session_id: str, admission: Any) -> None:
        last = [e for e in store.read_visible(scope, session_id) if e.role == "assistant"][-1]
        store.rewrite_entries(scope, session_id, [{"entry_id": last.entry_id,
                                                   "message": {"role": "assistant", "content": "redacted"}}])

    host.before_assemble = rewrite
    try:
        out = host.run_turn(SCOPE, sid, "next " + "lorem ipsum " * 10, turn_id="t1")
    finally:
        host.dispose()
    assert out.commit_status == "blocked" and "legacy read unfenced" in str(out.degraded_reason)
    assert out.reply["role"] == "assistant" and host.turns.intent(SCOPE, sid, "t1") is not None


class ToolRaises(CountingEngine):
    def get_tool_schemas(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": "recall", "parameters": {"type": "object"}}}]

    def handle_tool_call(self, name: str, args: Any, **_kw: Any) -> str:
        raise RuntimeError("recall index corrupt")


class AssembleRaisesOnRetry(CountingEngine):
    assembled = 0

    def assemble(self, **kw: Any) -> Any:
        type(self).assembled += 1
        if type(self).assembled == 2:
            raise RuntimeError("assemble broke on the retry")
        return super().assemble(**kw)


@pytest.mark.parametrize("case", ["engine tool raised", "assemble raised on the retry"])
def test_a_turn_that_reached_the_model_never_moves_to_legacy_on_its_retry(
    store: TranscriptStore, sid: str, case: str
) -> None:
    """An attempt reached the model on engine x, the model timed out, and the retry degraded (x was
    quarantined, or its assemble raised): the turn was reassigned to legacy and committed there, a
    started turn switching engines. It now fails, saying so, and the intent is gone."""
    call = {"id": "c1", "type": "function", "function": {"name": "recall", "arguments": "{}"}}
    if case == "engine tool raised":
        factory, model = ToolRaises, Scripted(reply(None, tool_calls=[call]), ModelTimeout("provider timeout"))
    else:
        AssembleRaisesOnRetry.assembled = 0
        factory, model = AssembleRaisesOnRetry, Scripted(ModelTimeout("provider timeout"))
    host, _ = make_host(store, "x", factories={"x": lambda ctx: factory(ctx, "x")})
    host.model = model
    try:
        with pytest.raises(TurnFailed, match="cannot switch engines"):
            host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    finally:
        host.dispose()
    assert receipts(store, sid) == [] and host.turns.intent(SCOPE, sid, "t1") is None


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_a_model_reply_that_is_no_assistant_message_is_the_models_failure(
    store: TranscriptStore, sid: str, role: str
) -> None:
    """A reply with role user, system or tool was committed as the turn's answer; an invalid reply
    raised InvalidInput (InvalidMessage), which reads as the caller's own input refused."""
    extra = {"tool_call_id": "c9"} if role == "tool" else {}
    bad = ModelResponse(message={"role": role, "content": "not an answer", **extra}, usage={}, model="scripted")
    invalid = ModelResponse(message={"role": "assistant"}, usage={}, model="scripted")  # no content, no calls
    for turn_id, answer in (("t1", bad), ("t2", invalid)):
        host, _ = make_host(store)
        host.model = Scripted(answer)
        try:
            with pytest.raises(ModelError, match="the model answered"):
                host.run_turn(SCOPE, sid, "hello", turn_id=turn_id)
        finally:
            host.dispose()
        assert host.turns.intent(SCOPE, sid, turn_id) is None
    assert receipts(store, sid) == []
    assert [e.role for e in store.read_visible(SCOPE, sid)] == ["user", "user"]  # the two admissions only


class ToolsWithoutHandler(CountingEngine):
    def get_tool_schemas(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": "recall", "parameters": {"type": "object"}}}]


def test_an_engine_offering_tools_without_a_handler_is_quarantined_not_every_turn_failed(
    store: TranscriptStore, sid: str
) -> None:
    """engine.handle_tool_call was looked up outside the engine guard: every turn whose model called the
    tool raised AttributeError, and the engine was never quarantined."""
    call = {"id": "c1", "type": "function", "function": {"name": "recall", "arguments": "{}"}}
    host, _ = make_host(store, "x", factories={"x": lambda ctx: ToolsWithoutHandler(ctx, "x")})
    host.model = Scripted(reply(None, tool_calls=[call]), reply("answered"), reply("next"))
    try:
        first = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
        assert first.reply["content"] == "answered" and "x" in host.quarantined
        second = host.run_turn(SCOPE, sid, "again", turn_id="t2")
        assert second.engine_id == "legacy" and second.commit_status == "committed"
    finally:
        host.dispose()


@pytest.mark.parametrize("engine", ["broken", "not-installed"])
def test_spawn_subagent_runs_on_legacy_when_the_engine_cannot_load(
    store: TranscriptStore, sid: str, engine: str
) -> None:
    """spawn_subagent raised EngineError for an engine that fails to load or is not installed, where
    run_turn and compact answer on legacy (the hooks are documented best effort)."""

    def broken(ctx: Any) -> Any:
        raise RuntimeError("factory broke")

    host, _ = make_host(store, engine, factories={"broken": broken})
    try:
        assert host.spawn_subagent(SCOPE, sid, "child:1", lambda child: f"ran in {child}").startswith("ran in ")
    finally:
        host.dispose()


class SlowMaintain(CountingEngine):
    """Background maintenance that runs until released; records whether it was disposed under it."""

    release = threading.Event()

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx, "slow", turn_maintenance_mode="background")
        self.disposed = False
        self.disposed_while_running = False
        self.started = threading.Event()

    def maintain(self, **_kw: Any) -> None:
        self.started.set()
        assert type(self).release.wait(timeout=20)
        self.disposed_while_running = self.disposed

    def dispose(self) -> None:
        self.disposed = True


def test_dispose_leaves_an_engine_whose_maintenance_pass_still_runs(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dispose() waited 10 s (+1 s join) for a background pass, then disposed every engine while the pass
    was still running on its instance."""
    monkeypatch.setattr(BackgroundMaintenance.close, "__defaults__", (0.3,))  # close's wait, shortened
    SlowMaintain.release.clear()
    host, _ = make_host(store, "slow", factories={"slow": SlowMaintain})
    try:
        host.run_turn(SCOPE, sid, "hi", turn_id="t1")
        engine = host.engine("slow")[0]
        assert engine.started.wait(timeout=10)
        host.dispose()
        assert not engine.disposed
    finally:
        SlowMaintain.release.set()
    time.sleep(0.2)
    assert not engine.disposed_while_running


@pytest.mark.parametrize("engine", ["legacy", "lossless"])
def test_every_request_of_a_tool_round_fits_the_budget(store: TranscriptStore, sid: str, engine: str) -> None:
    """The budget was the first request's only: every later request of the turn also carried the tool
    calls and results, uncounted (legacy: 9 of 28 requests over a 2,800-token prompt budget)."""
    estimator = RoughEstimator()
    schema = {"type": "function", "function": {"name": "lookup", "description": "Look things up.",
                                                "parameters": {"type": "object", "properties": {}}}}
    model = RecordingModel()
    settings = load_settings(config_path=None, engine=engine, token_budget=3000, max_output_tokens=200)
    host = HostRuntime(store, settings, model, summarizer=ExtractiveSummarizer(), estimator=estimator,
                       host_tools={"lookup": (schema, lambda _args: "reference text. " * 120)})
    try:
        for i in range(14):
            host.run_turn(SCOPE, sid, f"question {i}: use tool lookup " + "tell me more about this " * 40)
        host.maintenance.wait(30)
        tools = [schema] + (list(host.engine(engine)[0].get_tool_schemas()) if engine == "lossless" else [])
    finally:
        host.dispose()
    assert len(model.requests) == 28
    sizes = [estimator.count_messages(r) + estimator.count_text(json.dumps(tools)) for r in model.requests]
    assert max(sizes) <= 3000 - 200, sizes


class GarbageCompact(CountingEngine):
    def compact(self, **_kw: Any) -> Any:
        return "compacted, sort of"


def test_a_compact_answer_that_is_no_result_is_the_engines_failure(store: TranscriptStore, sid: str) -> None:
    """host.compact validated the engine's answer outside the engine guard: a pydantic ValidationError
    escaped and the engine was not quarantined."""
    host, _ = make_host(store, "x", factories={"x": lambda ctx: GarbageCompact(ctx, "x", owns_compaction=True)})
    try:
        with pytest.raises(EngineContractError, match="no CompactResult"):
            host.compact(SCOPE, sid)
        assert "x" in host.quarantined
        assert host.compact(SCOPE, sid).ok  # the next one runs on legacy
    finally:
        host.dispose()
