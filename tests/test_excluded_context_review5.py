"""Messages the host keeps out of the model's context (OpenClaw's ``excludeFromContext``, kept by its plugin
in the stored message) cost the service engines nothing and are never summarized, on both backends.

The OpenClaw plugin left them out of what it assembled, but the engines behind the service counted them:
their tokens took the budget of the messages the model then did not get (legacy and lossless alike),
and the lossless engine (and the legacy compaction) summarized them, a hidden consult prompt reaching
the model at every later turn through its summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from conftest import module_store_fixtures

from engines.legacy import LegacyEngine
from engines.lossless import LosslessEngine
from engines.lossless.context import load_items
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.models import ClosedRange, out_of_context
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-excluded5"
SECRET = "hidden consult instructions "

shared_url, store, sid = module_store_fixtures(A, "excluded5")


class Recording(ExtractiveSummarizer):
    """The extractive summarizer, noting every message it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, Any]] = []

    def summarize(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> str:  # type: ignore[override]
        self.seen += list(messages)
        return super().summarize(messages, **kwargs)


def hidden(text: str, *, lean: bool = False) -> dict[str, Any]:
    """A user message as the OpenClaw plugin stores one OpenClaw excludes from the model's context."""
    host = {"role": "user", "content": text, "excludeFromContext": True, "timestamp": 1}
    if lean:
        return {"role": "user", "content": text, "openclaw_lean": {"message": {**host, "content": None}, "refs": []}}
    return {"role": "user", "content": text, "openclaw": host}


def turn(
    store: TranscriptStore, engine: Any, sid: str, key: str, messages: list[dict[str, Any]], *, scope: str = A
) -> None:
    """Admit the first message, append the others, commit the turn."""
    admission = store.admit(scope, sid, messages[0], turn_id=key)
    appended = store.append_many(scope, sid, [{"message": m} for m in messages[1:]])
    terminal = store.anchor(scope, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    store.write(lambda c: engine.commit_turn(tx=c, advancement_key=key, admission=admission.anchor,
                                             terminal=terminal, messages=closed.messages))


def conversation(store: TranscriptStore, engine: Any, sid: str, *, with_hidden: bool) -> None:
    """Six turns; with ``with_hidden`` each holds a long hidden exchange too (one in the lean form)."""
    for n in range(6):
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"question {n} " + "words " * 20}]
        if with_hidden:
            messages += [hidden(SECRET * 100, lean=n % 2 == 1),
                         {"role": "assistant", "content": "status " * 300,
                          "openclaw": {"role": "assistant", "excludeFromContext": True}}]
        messages.append({"role": "assistant", "content": f"answer {n} " + "more " * 80})
        turn(store, engine, sid, f"k{n}", messages)


def ctx(store: TranscriptStore, summarizer: Any, config: dict[str, Any] | None = None) -> EngineContext:
    return EngineContext(store=store, config=config or {}, summarizer=summarizer, estimator=RoughEstimator())


def test_the_marker_is_read_where_the_plugin_keeps_it() -> None:
    assert out_of_context(hidden("x")) and out_of_context(hidden("x", lean=True))
    assert not out_of_context({"role": "user", "content": "x", "openclaw": {"role": "user"}})
    assert not out_of_context({"role": "user", "content": "x", "openclaw": {"excludeFromContext": "yes"}})
    assert not out_of_context(None) and not out_of_context({"openclaw_lean": "x"})


@pytest.mark.parametrize("kind", ["legacy", "lossless"])
def test_hidden_messages_take_no_budget(store: TranscriptStore, kind: str) -> None:
    """Under a budget that fits the visible conversation, the same messages are shown, with the same
    estimate, whether or not hidden messages sit between them."""
    answers = []
    for with_hidden in (False, True):
        session = store.create_session(A).session_id
        make = LegacyEngine if kind == "legacy" else LosslessEngine
        engine = make(ctx(store, ExtractiveSummarizer(), {"fresh_tail_messages": 64} if kind == "lossless" else None))
        conversation(store, engine, session, with_hidden=with_hidden)
        out = engine.assemble(scope=A, session_id=session, fence=None, token_budget=2000)
        assert not any(out_of_context(m) for m in out.messages)
        answers.append(([m["content"] for m in out.messages], out.estimated_tokens))
    assert answers[1] == answers[0]
    assert any(m.startswith("question 0") for m in answers[0][0])  # all of it fits


def test_the_lossless_engine_never_summarizes_them(store: TranscriptStore, sid: str) -> None:
    summarizer = Recording()
    config = {"fresh_tail_messages": 2, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
              "condensed_summary_tokens": 160, "condense_fanin": 3}
    engine = LosslessEngine(ctx(store, summarizer, config))
    conversation(store, engine, sid, with_hidden=True)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=200)
    assert result.compacted and summarizer.seen
    assert not any(out_of_context(m) or SECRET in str(m.get("content")) for m in summarizer.seen)
    items = store.read(lambda c: load_items(c, A, sid))
    assert all(i.tokens == 0 for i in items if out_of_context(i.message))
    assert not any(SECRET in str(m.get("content"))
                   for m in engine.assemble(scope=A, session_id=sid, fence=None, token_budget=2000).messages)


def test_the_legacy_compaction_never_summarizes_them(store: TranscriptStore, sid: str) -> None:
    summarizer = Recording()
    engine = LegacyEngine(ctx(store, summarizer))
    conversation(store, engine, sid, with_hidden=True)
    result = engine.compact(scope=A, session_id=sid, force=True)
    assert result.compacted and summarizer.seen
    assert not any(out_of_context(m) or SECRET in str(m.get("content")) for m in summarizer.seen)
