"""The host's engine contract against OpenClaw's, over both backends: what a review of host.py, engine.py,
compaction.py, summarize.py and the legacy engine found."""

from __future__ import annotations

from typing import Any

import pytest
from hosting import CountingEngine
from test_host import SCOPE, make_host

from transcript_store import TranscriptStore, compaction
from transcript_store.engine import AssembleResult, CompactResult, EngineContext, SessionTarget
from transcript_store.errors import EngineContractError, InvalidInput, UnknownEngine
from transcript_store.host import RuntimeContext, delegate_compaction_to_runtime
from transcript_store.model import LocalResponder, OpenAIChatModel, model_from_settings
from transcript_store.registry import EngineRegistry
from transcript_store.summarize import ExtractiveSummarizer, OpenAISummarizer, hold
from transcript_store.tokens import RoughEstimator


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(SCOPE, session_id="sess", session_key="agent:main:test").session_id


class _Windowed(CountingEngine):
    """Delegates compaction (owns none) and shows only the last two messages: its assembled estimate is
    small whatever the transcript holds, so it says the transcript may overflow (or not)."""

    authority = "preassembly_may_overflow"

    def assemble(self, **kw: Any) -> AssembleResult:
        window = super().assemble(**kw).messages[-2:]
        return AssembleResult(messages=window, estimated_tokens=10 * len(window), prompt_authority=self.authority)


def _long_history(store: TranscriptStore, sid: str) -> None:
    store.append_many(
        SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 300}}
                     for i in range(30)]
    )


@pytest.mark.parametrize("authority", ["preassembly_may_overflow", "assembled"])
def test_preassembly_may_overflow_compacts_on_the_larger_of_the_two_estimates(
    store: TranscriptStore, sid: str, authority: str
) -> None:
    """OpenClaw: with prompt_authority="preassembly_may_overflow" the runner "uses the larger of the assembled
    estimate and the pre-assembly (unwindowed) session-history estimate when deciding whether to preemptively
    compact". The host compared the assembled estimate alone, so for an engine that does not own compaction
    the answer changed nothing: a windowed view hiding a transcript far over the budget never compacted.
    With the default authority ("assembled") the assembled estimate alone decides, as before."""
    _long_history(store, sid)

    def make(ctx: Any) -> _Windowed:
        engine = _Windowed(ctx, "win")
        engine.authority = authority
        return engine

    host, _ = make_host(store, "win", {"win": make}, token_budget=4000)
    out = host.run_turn(SCOPE, sid, "go")
    assert out.engine_id == "win" and out.degraded_reason is None and out.commit_status == "committed"
    kinds = [e.kind for e in store.list_entries(SCOPE, sid)]
    assert ("compaction" in kinds) == (authority == "preassembly_may_overflow")


# ------------------------------------------------------------------------------------------------ summarizers

_BAD_SUMMARIZE_ARGS: list[dict[str, Any]] = [
    {"max_tokens": "100"},
    {"max_tokens": None},
    {"max_tokens": 100.5},
    {"max_tokens": True},
    {"max_tokens": 10**12},
    {"focus": 5},
    {"previous_summary": 5},
    {"previous_summary": ["earlier"]},
    {"messages": [1]},
    {"messages": "a string"},
    {"messages": None},
    {"messages": [{"role": "user", "content": "hi"}, "no dict"]},
]


@pytest.mark.parametrize("kind", ["extractive", "openai"])
@pytest.mark.parametrize("bad", _BAD_SUMMARIZE_ARGS, ids=repr)
def test_summarizers_refuse_bad_arguments_with_a_typed_error(kind: str, bad: dict[str, Any]) -> None:
    """A summarizer is pluggable and public: a token limit given as a string or None, a focus or previous
    summary that is no string, messages that are no list of dicts surfaced as TypeError or AttributeError
    from deep inside it (the OpenAI one before any request). InvalidInput now, before any work."""
    summarizer: Any = ExtractiveSummarizer() if kind == "extractive" else OpenAISummarizer("http://127.0.0.1:9", "m")
    args = {"messages": [{"role": "user", "content": "hi"}], **bad}
    messages = args.pop("messages")
    with pytest.raises(InvalidInput):
        summarizer.summarize(messages, **args)


@pytest.mark.parametrize(("text", "limit"), [("word " * 100, "5"), ("word " * 100, None), (5, 10), (None, 10)])
def test_hold_refuses_bad_arguments_with_a_typed_error(text: Any, limit: Any) -> None:
    """``summarize.hold`` (what cuts a summary to its budget) raised TypeError for a string limit or a text
    that is no string."""
    with pytest.raises(InvalidInput):
        hold(text, limit, RoughEstimator())


# ------------------------------------------------------------------------------------------------ subagents


class _Spawning(CountingEngine):
    """Has the subagent hooks; its prepare refuses a TTL that is no positive number, as an engine may."""

    def prepare_subagent_spawn(self, **kw: Any) -> None:
        self.calls.append(("prepare_subagent_spawn", kw))
        ttl = kw["ttl_seconds"]
        if ttl is not None and not ttl > 0:
            raise ValueError(f"bad ttl {ttl!r}")

    def on_subagent_ended(self, **kw: Any) -> None:
        self.calls.append(("on_subagent_ended", kw))


@pytest.mark.parametrize("ttl", ["60", -1, 0, float("nan"), float("inf"), True, [60]], ids=repr)
def test_a_bad_subagent_ttl_is_refused_before_the_engine_or_the_child(
    store: TranscriptStore, sid: str, ttl: Any
) -> None:
    """``spawn_subagent`` handed ``ttl_seconds`` to the engine's prepare_subagent_spawn unchecked: an engine
    refusing the caller's mistake was quarantined for the rest of the process (every later turn on legacy),
    and the child session was made all the same. InvalidInput now, before the child or any hook."""
    engines: dict[str, _Spawning] = {}
    host, _ = make_host(store, "sp", {"sp": lambda ctx: engines.setdefault("sp", _Spawning(ctx, "sp"))})
    ran: list[str] = []
    try:
        with pytest.raises(InvalidInput, match="ttl_seconds"):
            host.spawn_subagent(SCOPE, sid, "child:1", ran.append, ttl_seconds=ttl)
        assert ran == [] and "sp" not in host.quarantined
        assert [s.session_key for s in store.list_sessions(SCOPE)] == ["agent:main:test"]
        # A good one still runs, on the engine.
        assert host.spawn_subagent(SCOPE, sid, "child:1", lambda child: "done", ttl_seconds=30.5) == "done"
        assert [n for n, _ in engines["sp"].calls] == ["prepare_subagent_spawn", "on_subagent_ended"]
    finally:
        host.dispose()


# ------------------------------------------------------------------------------------------------ models

_HELLO = [{"role": "user", "content": "hello"}]
_BAD_MODEL_MAKERS: dict[str, Any] = {
    "url not a string": lambda: OpenAIChatModel(5, "m"),  # type: ignore[arg-type]
    "model None": lambda: OpenAIChatModel("http://127.0.0.1:9", None),  # type: ignore[arg-type]
    "timeout a string": lambda: OpenAIChatModel("http://127.0.0.1:9", "m", timeout="5"),  # type: ignore[arg-type]
    "timeout NaN": lambda: OpenAIChatModel("http://127.0.0.1:9", "m", timeout=float("nan")),
    "api key an int": lambda: OpenAIChatModel("http://127.0.0.1:9", "m", api_key=5),  # type: ignore[arg-type]
    "fail_every a string": lambda: LocalResponder(fail_every="3"),  # type: ignore[arg-type]
    "fail_every True": lambda: LocalResponder(fail_every=True),
    "url of settings an int": lambda: model_from_settings(5, None, None),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("make", list(_BAD_MODEL_MAKERS.values()), ids=list(_BAD_MODEL_MAKERS))
def test_a_model_built_from_bad_arguments_is_invalid_input(make: Any) -> None:
    """The models are public: a URL that is no string (AttributeError), a timeout given as a string
    (TypeError) or NaN (accepted; every call then failed with urllib's ValueError), a model name of None
    (sent as null), a string ``fail_every`` (TypeError) were not InvalidInput."""
    with pytest.raises(InvalidInput):
        make()


_BAD_COMPLETE_ARGS: dict[str, dict[str, Any]] = {
    "messages a string": {"messages": "hello"},
    "a message not a dict": {"messages": [object()]},
    "tools not dicts": {"tools": [5]},
    "tools a string": {"tools": "lookup"},
    "max_tokens a string": {"max_tokens": "5"},
    "max_tokens zero": {"max_tokens": 0},
    "timeout a string": {"timeout": "5"},
    "timeout negative": {"timeout": -1},
    "timeout NaN": {"timeout": float("nan")},
}


@pytest.mark.parametrize("kind", ["local", "openai"])
@pytest.mark.parametrize("bad", list(_BAD_COMPLETE_ARGS.values()), ids=list(_BAD_COMPLETE_ARGS))
def test_complete_with_bad_arguments_is_invalid_input_before_any_request(kind: str, bad: dict[str, Any]) -> None:
    """``complete`` took anything: a string ``max_tokens`` or ``timeout`` raised TypeError (the OpenAI
    model's after the request was built), a negative timeout urllib's ValueError, a tool that is no dict
    AttributeError. The endpoint here refuses connections: InvalidInput must come before any is tried."""
    model: Any = LocalResponder() if kind == "local" else OpenAIChatModel("http://127.0.0.1:9", "m", timeout=2)
    args = {"messages": _HELLO, **bad}
    with pytest.raises(InvalidInput):
        model.complete(args.pop("messages"), **args)


@pytest.mark.parametrize("content", [object(), "half \ud800 an emoji"], ids=["an object", "a lone surrogate"])
def test_a_request_that_is_no_json_is_invalid_input(content: Any) -> None:
    """A message holding what JSON cannot carry (an object, a lone surrogate) raised TypeError or
    UnicodeEncodeError from inside post_chat_completion."""
    with pytest.raises(InvalidInput, match="no JSON"):
        OpenAIChatModel("http://127.0.0.1:9", "m", timeout=2).complete([{"role": "user", "content": content}])


def test_the_local_responder_takes_a_tool_schema_whose_parameters_are_no_object() -> None:
    """A tool schema whose ``parameters`` (or its ``properties``) is no object raised AttributeError from the
    local responder's argument filling; such a tool is called with no arguments."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": 5}}]
    answer = LocalResponder().complete([{"role": "user", "content": "look up x"}], tools)
    assert answer.message["tool_calls"][0]["function"] == {"name": "lookup", "arguments": "{}"}


# ------------------------------------------------------------------------------------------------ compaction

_BAD_COMPACTION_ARGS: dict[str, dict[str, Any]] = {
    "force a string": {"force": "no"},
    "focus an int": {"focus": 5},
    "budget negative": {"token_budget": -5},
    "budget a string": {"token_budget": "5"},
    "fence a string": {"fence": "abc"},
    "no summarizer": {"summarizer": None},
    "no estimator": {"estimator": None},
    "scope with a lone surrogate": {"scope": "sc\ud800ope"},
    "session id an int": {"session_id": 5},
}


@pytest.mark.parametrize("bad", list(_BAD_COMPACTION_ARGS.values()), ids=list(_BAD_COMPACTION_ARGS))
def test_the_built_in_compaction_refuses_bad_arguments_before_it_writes(
    store: TranscriptStore, sid: str, bad: dict[str, Any]
) -> None:
    """``compaction.compact_session`` (what an engine reaches through delegate_compaction_to_runtime) checked
    only keep_last: a force of "no" forced a compaction (a summary written), a string budget raised
    TypeError, a lone surrogate in the scope UnicodeEncodeError, no estimator AttributeError."""
    _long_history(store, sid)
    args: dict[str, Any] = {
        "scope": SCOPE, "session_id": sid, "summarizer": ExtractiveSummarizer(), "estimator": RoughEstimator(),
        "token_budget": 10**6, **bad,
    }
    with pytest.raises(InvalidInput):
        compaction.compact_session(store, args.pop("scope"), args.pop("session_id"), **args)
    assert "compaction" not in [e.kind for e in store.list_entries(SCOPE, sid)]
    assert compaction.load_pointer(store, SCOPE, sid) is None


@pytest.mark.parametrize("bad", [{"force": "no"}, {"focus": 5}, {"prompt_budget": -1}, {"prompt_budget": "9"}],
                         ids=repr)
def test_delegate_compaction_to_runtime_refuses_bad_arguments(
    store: TranscriptStore, sid: str, bad: dict[str, Any]
) -> None:
    """The runtime context's delegate_compaction_to_runtime (an engine's call): a force of "no" compacted,
    a negative prompt budget was taken as a budget of one token (everything compacted) and a string one
    raised TypeError. InvalidInput, nothing written."""
    _long_history(store, sid)
    host, _ = make_host(store)
    ctx = RuntimeContext(host, SCOPE, sid, None, None, 2000)
    try:
        with pytest.raises(InvalidInput):
            delegate_compaction_to_runtime(ctx, **bad)
        assert "compaction" not in [e.kind for e in store.list_entries(SCOPE, sid)]
        assert delegate_compaction_to_runtime(ctx, force=True).compacted  # a good call still compacts
    finally:
        host.dispose()


# ------------------------------------------------------------------------------------------------ registry


@pytest.mark.parametrize("engine_id", [["legacy"], {"id": 1}, None, 7, "leg\x00acy", "x" * 500], ids=repr)
@pytest.mark.parametrize("method", ["create", "check"])
def test_the_registry_refuses_what_is_no_engine_id_as_unknown(engine_id: Any, method: str) -> None:
    """``EngineRegistry.create`` / ``check`` looked the id up as given: a list or a dict raised TypeError
    (unhashable). An id no engine can have is UnknownEngine, as an id not registered is."""
    registry = EngineRegistry()
    with pytest.raises(UnknownEngine):
        getattr(registry, method)(engine_id, EngineContext(store=None))


@pytest.mark.parametrize("plugin_dirs", ["./my-engines", b"./my-engines", 5, [5], None], ids=repr)
def test_plugin_dirs_that_are_no_list_of_folders_are_invalid_input(plugin_dirs: Any) -> None:
    """``EngineRegistry(plugin_dirs="./my-engines")`` iterated the string: one-letter folders ".", "/", "m",
    ... were each warned about as missing, and the folder named was never searched. An int raised TypeError."""
    with pytest.raises(InvalidInput, match="plugin_dirs"):
        EngineRegistry(plugin_dirs)


def test_a_factory_that_is_not_callable_is_refused_when_registered() -> None:
    """``register_factory("x", 5)`` was taken: the mistake surfaced only when the engine was first made (a
    TypeError the host took for the engine's failure, quarantining it)."""
    registry = EngineRegistry(discover=False)
    with pytest.raises(InvalidInput, match="callable"):
        registry.register_factory("x", 5)  # type: ignore[arg-type]
    assert "x" not in registry.specs


# ------------------------------------------------------------------------------------------------ assembly


@pytest.mark.parametrize("bad", [{"foo": 1}, {"role": "wizard", "content": "x"}, {"role": ["user"], "content": "x"}],
                         ids=repr)
def test_an_assembled_message_without_a_chat_role_is_the_engine_failure(
    store: TranscriptStore, sid: str, bad: dict[str, Any]
) -> None:
    """OpenClaw isolates an engine that "fails contract validation". An assembled message with no chat role
    was sent on to the model (a provider refuses the request: every turn of the session failed, the engine
    never isolated). Now the engine is quarantined and the turn runs on legacy, before the model is called;
    the message never reaches it."""

    class Bad(CountingEngine):
        def assemble(self, **kw: Any) -> AssembleResult:
            super().assemble(**kw)
            return AssembleResult(messages=[bad], estimated_tokens=5)

    host, model = make_host(store, "bad", {"bad": lambda ctx: Bad(ctx, "bad")})
    try:
        out = host.run_turn(SCOPE, sid, "hello")
        assert (out.engine_id, out.commit_status) == ("legacy", "committed")
        assert out.degraded_reason is not None and "bad" in host.quarantined
        assert all(bad not in request for request in model.requests)
    finally:
        host.dispose()


# ------------------------------------------------------------------------------------------------ successors


class _NamesASuccessor(CountingEngine):
    """Owns compaction; its compact names a successor session that is not one of its scope's."""

    target = SessionTarget(scope=SCOPE, session_id="ghost")

    def assemble(self, **kw: Any) -> AssembleResult:
        window = super().assemble(**kw).messages[-2:]
        return AssembleResult(messages=window, estimated_tokens=10**6, prompt_authority="preassembly_may_overflow")

    def compact(self, **kw: Any) -> CompactResult:
        self.calls.append(("compact", kw))
        return CompactResult(ok=True, compacted=True, session_target=self.target)


_BAD_TARGETS = {
    "no such session": SessionTarget(scope=SCOPE, session_id="ghost"),
    "another scope": SessionTarget(scope="other-scope", session_id="sess"),
}


@pytest.mark.parametrize("target", list(_BAD_TARGETS.values()), ids=list(_BAD_TARGETS))
def test_a_manual_compaction_naming_a_successor_that_is_not_a_session_of_the_scope_is_the_engine_failure(
    store: TranscriptStore, sid: str, target: SessionTarget
) -> None:
    """The successor a compaction names was followed unchecked: one that did not exist sent every later turn
    of the session to it (UnknownSession every time, the engine never isolated); one of another scope raised
    InvalidInput, the caller's error for the engine's answer. EngineContractError now, the engine isolated,
    the session in use unchanged: the next turn runs there, on legacy."""

    def make(ctx: Any) -> _NamesASuccessor:
        engine = _NamesASuccessor(ctx, "succ", owns_compaction=True)
        engine.target = target
        return engine

    host, _ = make_host(store, "succ", {"succ": make})
    try:
        with pytest.raises(EngineContractError, match="successor"):
            host.compact(SCOPE, sid)
        assert "succ" in host.quarantined and host.resolve_session(SCOPE, sid) == sid
        out = host.run_turn(SCOPE, sid, "next")
        assert (out.session_id, out.engine_id, out.commit_status) == (sid, "legacy", "committed")
    finally:
        host.dispose()


def test_a_pre_prompt_compaction_naming_no_session_runs_the_turn_on_legacy(store: TranscriptStore, sid: str) -> None:
    """The same answer from the pre-prompt safeguard of an engine that owns compaction: the turn ran on, and
    every later one went to the session that does not exist. Now the engine is isolated, the turn runs on
    legacy in its own session, and so does the next."""
    host, _ = make_host(store, "succ", {"succ": lambda ctx: _NamesASuccessor(ctx, "succ", owns_compaction=True)})
    try:
        first = host.run_turn(SCOPE, sid, "hello")
        assert (first.session_id, first.engine_id, first.commit_status) == (sid, "legacy", "committed")
        assert first.degraded_reason is not None and "succ" in host.quarantined
        second = host.run_turn(SCOPE, sid, "again")
        assert (second.session_id, second.commit_status) == (sid, "committed")
    finally:
        host.dispose()
