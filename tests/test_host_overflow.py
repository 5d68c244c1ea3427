"""Provider overflow recovery: a request the provider refuses as over its context window is compacted once
and retried once, inside the same admitted turn (OpenClaw's overflow-recovery compaction)."""

from __future__ import annotations

from typing import Any

import pytest
from fake_openai import FakeOpenAI, Fault
from hosting import CountingEngine

from transcript_store import TranscriptStore
from transcript_store.errors import ModelError, TurnFailed
from transcript_store.host import HostRuntime
from transcript_store.model import OpenAIChatModel, is_context_overflow
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

SCOPE = "tenant-1"
OVERFLOW = Fault(
    status=400,
    code="context_length_exceeded",
    message="This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
)


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(SCOPE, session_id="sess", session_key="agent:main:test").session_id


@pytest.fixture
def server() -> Any:
    with FakeOpenAI() as s:
        yield s


def make_host(store: TranscriptStore, server: FakeOpenAI, engine: str = "legacy", **factories: Any) -> HostRuntime:
    registry = EngineRegistry()
    for engine_id, factory in factories.items():
        registry.register_factory(engine_id, factory)
    settings = load_settings(config_path=None, engine=engine, token_budget=32000, max_output_tokens=200)
    return HostRuntime(store, settings, OpenAIChatModel(server.base_url, "fake-model", timeout=10),
                       registry=registry, summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())


def history(host: HostRuntime, sid: str, turns: int = 10) -> None:
    for i in range(turns):
        host.run_turn(SCOPE, sid, f"question {i}: " + "tell me more about this " * 20, turn_id=f"h{i}")


def chat_bodies(server: FakeOpenAI) -> list[dict[str, Any]]:
    """The first request of each model loop (a tool round's request ends with a tool result instead)."""
    return [r.body for r in server.requests if r.method == "POST" and r.body["messages"][-1]["role"] == "user"]


def visible(store: TranscriptStore, sid: str) -> list[dict[str, Any]]:
    return [e.message for e in store.read_visible(SCOPE, sid)]


@pytest.mark.parametrize("engine", ["legacy", "lossless"])
@pytest.mark.parametrize("fault", [
    OVERFLOW,
    Fault(status=400, message="This model's maximum context length is 8192 tokens."),  # the message alone
    Fault(status=413, code="context_length_exceeded"),
])
def test_an_overflow_compacts_the_session_and_the_turn_commits_once(
    store: TranscriptStore, sid: str, server: FakeOpenAI, engine: str, fault: Fault
) -> None:
    host = make_host(store, server, engine)
    history(host, sid)
    server.reset()
    server.queue(fault)
    outcome = host.run_turn(SCOPE, sid, "and now?", turn_id="t-over")
    assert outcome.commit_status == "committed" and outcome.degraded_reason is None
    refused, retried = chat_bodies(server)  # one refused request, one retry: no more
    # The retry carried the freshly assembled (compacted) context: shorter than the refused one.
    assert len(str(retried["messages"])) < len(str(refused["messages"]))
    assert retried["messages"][-1] == {"role": "user", "content": "and now?"}
    # The turn persisted once: its user message and reply once in the transcript, one receipt.
    after = visible(store, sid)
    assert [m for m in after if m.get("content") == "and now?"] == [{"role": "user", "content": "and now?"}]
    assert after[-len(outcome.messages):] == outcome.messages
    assert [r.advancement_key for r in Turns(store).receipts(SCOPE, sid, engine)][-1] == "t-over"
    assert [r.advancement_key for r in Turns(store).receipts(SCOPE, sid, engine)].count("t-over") == 1


@pytest.mark.parametrize("engine", ["legacy", "lossless"])
def test_a_second_overflow_fails_the_turn_as_any_model_error(
    store: TranscriptStore, sid: str, server: FakeOpenAI, engine: str
) -> None:
    host = make_host(store, server, engine)
    history(host, sid)
    before = visible(store, sid)
    server.reset()
    server.queue(OVERFLOW, OVERFLOW)
    with pytest.raises(ModelError) as caught:
        host.run_turn(SCOPE, sid, "and now?", turn_id="t-over")
    assert is_context_overflow(caught.value)
    assert len(chat_bodies(server)) == 2  # compacted and retried once, never a third time
    # Failed as any model error fails a turn: its user message stays (as a discarded turn's does), no reply
    # follows it, and no engine advanced past it.
    assert visible(store, sid) == [*before, {"role": "user", "content": "and now?"}]
    assert "t-over" not in [r.advancement_key for r in Turns(store).receipts(SCOPE, sid, engine)]
    # The session is free: the next turn runs (the failed one's intent was discarded).
    assert host.run_turn(SCOPE, sid, "again", turn_id="t-next").commit_status == "committed"


def test_another_model_error_is_not_retried(store: TranscriptStore, sid: str, server: FakeOpenAI) -> None:
    host = make_host(store, server)
    history(host, sid, 3)
    server.reset()
    server.queue(Fault(status=400, message="Invalid 'messages': unsupported role", code="invalid_value"))
    with pytest.raises(ModelError) as caught:
        host.run_turn(SCOPE, sid, "and now?", turn_id="t-bad")
    assert caught.value.status == 400 and caught.value.code == "invalid_value"
    assert not is_context_overflow(caught.value)
    assert len(chat_bodies(server)) == 1


@pytest.mark.parametrize("owns", [True, False])
def test_an_engine_whose_compact_compacts_nothing_fails_the_turn_with_the_overflow(
    store: TranscriptStore, sid: str, server: FakeOpenAI, owns: bool
) -> None:
    """The engine's compact is asked whether or not it owns compaction (OpenClaw: "the active engine's
    compact() method is still invoked for /compact and overflow recovery")."""
    engine: list[CountingEngine] = []

    def factory(ctx: Any) -> CountingEngine:
        engine.append(CountingEngine(ctx, "own", owns_compaction=owns))
        return engine[-1]

    host = make_host(store, server, "own", own=factory)
    history(host, sid, 2)
    server.reset()
    server.queue(OVERFLOW)
    with pytest.raises(ModelError, match="maximum context length"):
        host.run_turn(SCOPE, sid, "and now?", turn_id="t-over")
    compacts = [kw for name, kw in engine[-1].calls if name == "compact"]
    assert len(compacts) == 1 and compacts[0]["force"] is True  # its own compact, asked once, forced
    assert len(chat_bodies(server)) == 1  # nothing compacted: the same request is not sent again
    assert "own" not in host.quarantined  # compacting nothing is no failure of the engine's


def test_a_failing_overflow_compaction_quarantines_the_engine_and_fails_the_turn(
    store: TranscriptStore, sid: str, server: FakeOpenAI
) -> None:
    class Broken(CountingEngine):
        def compact(self, **kw: Any) -> Any:
            raise RuntimeError("compaction broke")

    host = make_host(store, server, "own", own=lambda ctx: Broken(ctx, "own", owns_compaction=True))
    history(host, sid, 2)
    server.reset()
    server.queue(OVERFLOW)
    with pytest.raises((RuntimeError, TurnFailed)):
        host.run_turn(SCOPE, sid, "and now?", turn_id="t-over")
    assert host.quarantined["own"][0] == "compact"
    assert visible(store, sid)[-1] == {"role": "user", "content": "and now?"}  # no reply written
    assert "t-over" not in [r.advancement_key for r in Turns(store).receipts(SCOPE, sid, "own")]


def test_an_overflow_after_a_tool_ran_fails_the_turn_and_never_runs_the_tool_again(
    store: TranscriptStore, sid: str, server: FakeOpenAI
) -> None:
    """Starting the model loop over after a tool of the turn ran would run the tool again (its side effect
    twice) and drop its first result: only the turn's first request is recovered; a tool round's fails."""
    host = make_host(store, server)
    history(host, sid, 3)
    calls: list[dict[str, Any]] = []
    schema, _ = host.host_tools["lookup"]
    host.host_tools["lookup"] = (schema, lambda args: calls.append(args) or "noted")
    before = visible(store, sid)
    server.reset()
    server.queue(Fault(reply={"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "lookup", "arguments": '{"query": "x"}'}}]}),
        OVERFLOW)
    with pytest.raises(ModelError) as caught:
        host.run_turn(SCOPE, sid, "look it up", turn_id="t-tool")
    assert is_context_overflow(caught.value)
    assert calls == [{"query": "x"}]  # the tool ran once
    assert len([r for r in server.requests if r.method == "POST"]) == 2  # the first request and the tool round's
    assert visible(store, sid) == [*before, {"role": "user", "content": "look it up"}]
    assert host.run_turn(SCOPE, sid, "again", turn_id="t-next").commit_status == "committed"
