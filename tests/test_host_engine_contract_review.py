"""The host's engine contract against OpenClaw's, over both backends: what a review of host.py, engine.py,
compaction.py, summarize.py and the legacy engine found."""

from __future__ import annotations

from typing import Any

import pytest
from hosting import CountingEngine
from test_host import SCOPE, make_host

from transcript_store import TranscriptStore
from transcript_store.engine import AssembleResult
from transcript_store.errors import InvalidInput
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
