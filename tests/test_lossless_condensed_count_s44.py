"""A condensed summary counts the messages its children summarized, not the hidden ones among what they cover.

A leaf over a chunk that holds messages the host keeps out of the model's context (``excludeFromContext``)
summarizes the visible ones only, and its header says so ("Summary of 2 messages" for 2 shown, 2 hidden).
A condensation gave the summarizer each child as an earlier summary of ``message_count`` messages, which
counts the hidden sources too: the condensed summary of two such leaves said "Summary of 8 messages" of 4
it ever summarized (the count a model summarizer is given, "[summary of N earlier messages]", too).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from conftest import module_store_fixtures
from sqlalchemy import select
from test_excluded_context_review5 import turn

from engines.lossless import LosslessEngine
from engines.lossless.tables import messages, summaries, summary_children, summary_sources
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.summarize import ExtractiveSummarizer, summarized
from transcript_store.tokens import RoughEstimator

A = "scope-condensed-count-s44"
CONFIG = {"fresh_tail_messages": 2, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
          "condensed_summary_tokens": 400}

shared_url, store, sid = module_store_fixtures(A, "condensed_count_s44")


class Recording(ExtractiveSummarizer):
    """The extractive summarizer, keeping the count it was given for each earlier summary."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[int] = []

    def summarize(self, messages: Any, **kwargs: Any) -> str:
        self.counts += [n for m in messages if (n := summarized(m)) is not None]
        return super().summarize(messages, **kwargs)


def engine_of(store: TranscriptStore, fanin: int, summarizer: ExtractiveSummarizer) -> LosslessEngine:
    config = {**CONFIG, "condense_fanin": fanin}
    return LosslessEngine(EngineContext(store=store, config=config, summarizer=summarizer,
                                        estimator=RoughEstimator()))


def hidden(role: str, text: str) -> dict[str, Any]:
    """A message as the OpenClaw plugin stores one that OpenClaw keeps out of the model's context."""
    return {"role": role, "content": text, "openclaw": {"role": role, "content": text, "excludeFromContext": True}}


def shown_covered(store: TranscriptStore, sid: str, seq: int) -> int:
    """How many visible messages summary ``seq`` covers, through its leaves' sources."""
    def read(c: Any) -> int:
        leaves, todo = [], [seq]
        while todo:
            s = todo.pop()
            kids = list(c.conn.execute(select(summary_children.c.child_seq).where(
                summary_children.c.session_id == sid, summary_children.c.parent_seq == s)).scalars())
            todo += kids
            leaves += [] if kids else [s]
        src = select(summary_sources.c.message_ordinal).where(
            summary_sources.c.session_id == sid, summary_sources.c.summary_seq.in_(leaves))
        q = select(messages.c.ordinal).where(messages.c.session_id == sid, messages.c.hidden.is_(False),
                                             messages.c.ordinal.in_(src))
        return len(c.conn.execute(q).all())
    return int(store.read(read))


@pytest.mark.parametrize("process", ["another", "the same"])
def test_a_condensed_summary_counts_what_its_children_summarized(
    store: TranscriptStore, sid: str, process: str
) -> None:
    """Children stored by another process (their count read from the database), or by this one (kept)."""
    recording = Recording()
    # another: leaves only (a fanin never reached), condensed by a second engine
    first = engine_of(store, 50, ExtractiveSummarizer()) if process == "another" else engine_of(store, 2, recording)
    for n in range(8):
        turn(store, first, sid, f"k{n}", [
            {"role": "user", "content": f"question {n} about plums " + "words " * 20},
            {"role": "assistant", "content": f"answer {n}: the plums ripen " + "more " * 40},
            hidden("user", f"!status {n} " + "hush " * 30),
            hidden("assistant", f"the output {n} " + "quiet " * 30),
        ], scope=A)
    first.compact(scope=A, session_id=sid, force=True, token_budget=2000)
    second = engine_of(store, 2, recording) if process == "another" else first
    for _ in range(3):
        second.compact(scope=A, session_id=sid, force=True, token_budget=600)
    rows = store.read(lambda c: list(c.conn.execute(select(summaries).where(summaries.c.session_id == sid))))
    condensed = [r for r in rows if r.kind == "condensed"]
    assert condensed and any(r.kind == "leaf" for r in rows)
    for r in rows:
        said = re.match(r"Summary of (\d+) messages", r.content)
        assert said is not None, r.content
        shown = shown_covered(store, sid, r.summary_seq)
        assert 0 < shown <= r.message_count
        assert shown < r.message_count or r.kind == "leaf"  # hidden messages among what a condensed one covers
        assert int(said.group(1)) == shown, (r.kind, r.summary_seq, r.content[:80], r.message_count)
    # the summarizer was told each child's visible count
    assert recording.counts and all(n % 2 == 0 for n in recording.counts)
    leaves_shown = {shown_covered(store, sid, r.summary_seq) for r in rows}
    assert set(recording.counts) <= leaves_shown
