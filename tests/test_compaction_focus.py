"""A compaction's focus is checked before the summarizer runs, by every engine and the host.

A lone surrogate in ``focus`` was refused only when the summary holding it was stored: after the
summarizer (a paid model call in production) had run. A focus of another type reached the summarizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import module_store_fixtures
from sqlalchemy import select

from engines.legacy import LegacyEngine
from engines.lossless import LosslessEngine
from engines.lossless.tables import metadata as lossless_metadata
from transcript_store import InvalidInput, TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.schema import metadata
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

SCOPE = "focus"
shared_url, store, sid = module_store_fixtures(SCOPE, "focus")
BAD = ["bad \ud800 focus", b"bytes", 7, ["a"]]


class Counting:
    """The extractive summarizer, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        self.calls += 1
        return ExtractiveSummarizer().summarize(messages, **kw)


def everything(store: TranscriptStore) -> list[list[tuple[Any, ...]]]:
    """Every row of the store's and the lossless engine's tables."""
    with store.db.engine.connect() as conn:
        return [[tuple(r) for r in conn.execute(select(t).order_by(*t.primary_key.columns))]
                for md in (metadata, lossless_metadata) for t in md.tables.values()]


def make(kind: str, store: TranscriptStore, summarizer: Counting) -> Any:
    ctx = EngineContext(store=store, summarizer=summarizer, estimator=RoughEstimator(),
                        config={"fresh_tail_messages": 2, "leaf_chunk_messages": 4} if kind == "lossless" else {})
    return LosslessEngine(ctx) if kind == "lossless" else LegacyEngine(ctx)


@pytest.mark.parametrize("kind", ["legacy", "lossless"])
def test_a_bad_focus_is_refused_before_the_summarizer_and_changes_nothing(
    store: TranscriptStore, sid: str, kind: str
) -> None:
    store.append_many(SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant",
                                                "content": f"message {i} " + "words " * 40}} for i in range(12)])
    summarizer = Counting()
    engine = make(kind, store, summarizer)
    if kind == "lossless":
        engine.bootstrap(scope=SCOPE, session_id=sid, fence=None)
    before = everything(store)
    for bad in BAD:
        with pytest.raises(InvalidInput, match="focus"):
            engine.compact(scope=SCOPE, session_id=sid, force=True, focus=bad)
    assert summarizer.calls == 0 and everything(store) == before
    result = engine.compact(scope=SCOPE, session_id=sid, force=True, focus="words")  # a good one still works
    assert result.ok and result.compacted and summarizer.calls >= 1


def test_the_focus_text_is_not_written_into_the_summary(store: TranscriptStore, sid: str) -> None:
    """A compaction's focus picks what the summary keeps; its own words stay out of the stored summary.

    The header echoed the focus: ``lcm_grep`` then found the summary for a word no message held, and a
    focus quoting a message kept that text after the message was redacted.
    """
    store.append_many(SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant",
                                                "content": f"message {i} " + "words " * 40}} for i in range(12)])
    engine = make("lossless", store, Counting())
    engine.bootstrap(scope=SCOPE, session_id=sid, fence=None)
    result = engine.compact(scope=SCOPE, session_id=sid, force=True, focus="zebracrossing words")
    assert result.ok and result.compacted
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "zebracrossing"}, scope=SCOPE, session_id=sid))
    assert found["results"] == [], found
    with store.db.engine.connect() as conn:
        texts = [r[0] for r in conn.execute(select(lossless_metadata.tables["ts_lcm_summaries"].c.content))]
    assert texts and not any("zebracrossing" in t for t in texts)
