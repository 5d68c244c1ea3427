"""Summary budgets follow a small window, on both backends.

The thresholds are fractions of the window in force, but ``leaf_summary_tokens`` (600) and
``condensed_summary_tokens`` (800) were fixed counts: at a window of 1,024 tokens (target 512, fresh
tail 256) one leaf of 24 messages came out at ~590 tokens, larger than the whole target. Compaction ended
"still over the target", the context stayed over the threshold, and every maintenance pass after it
compacted again for nothing. A summarizer that writes what it is allowed (a model asked for 800 tokens)
made it worse: at a host budget of 2,000 tokens a condensed summary and the tail did not fit the target,
and each turn's maintenance condensed again. Now a leaf is held to ``room // condense_fanin`` and a
condensed summary to ``room // 2``, ``room`` being the target less the fresh tail's share
(``config.summary_caps``); a normal window keeps the configured budgets.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import commit_with, finished_turn, module_store_fixtures
from sqlalchemy import select

from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from engines.lossless.config import LosslessConfig, budget
from engines.lossless.context import load_items
from engines.lossless.tables import summaries
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.model import message_text
from transcript_store.summarize import ExtractiveSummarizer, Level, hold
from transcript_store.tokens import RoughEstimator

A = "scope-sw"
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega",
         "migration", "database", "index")

shared_url, store, sid = module_store_fixtures(A, "small_window")


class Recording(ExtractiveSummarizer):
    """The extractive summarizer, recording the ``max_tokens`` of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        self.asked.append(int(kw.get("max_tokens", 1024)))
        return super().summarize(messages, **kw)


class Thorough:
    """Writes what it is allowed, as a model asked for ``max_tokens`` does: the messages' text, cut to
    ``max_tokens`` (half of it at the aggressive level). Deterministic."""

    def __init__(self) -> None:
        self.calls = 0

    def summarize(
        self, messages: Sequence[dict[str, Any]], *, previous_summary: str | None = None, focus: str | None = None,
        level: Level = "normal", max_tokens: int = 1024,
    ) -> str:
        self.calls += 1
        allowed = max_tokens if level == "normal" else max(16, max_tokens // 2)
        return hold("\n".join(" ".join(message_text(m).split()) for m in messages), allowed, RoughEstimator())


def make_engine(store: TranscriptStore, summarizer: Any, config: dict[str, Any] | None = None) -> LosslessEngine:
    return LosslessEngine(EngineContext(store=store, config=config or {}, summarizer=summarizer,
                                        estimator=RoughEstimator()))


def exchange(rnd: random.Random, i: int) -> list[dict[str, Any]]:
    """A question and an answer of three lines each, every line one the extractive summarizer keeps."""

    def sentence(n: int) -> str:
        return " ".join(rnd.choice(WORDS) for _ in range(n)).capitalize() + "."

    return [
        {"role": "user", "content": f"Question {i}: {sentence(25)}\nThe error was {sentence(25)}\n"
                                    f"We decided {sentence(25)}"},
        {"role": "assistant", "content": f"Answer {i}: {sentence(30)}\nThe result is {sentence(30)}\n"
                                         f"Next we must {sentence(30)}"},
    ]


def context_summaries(store: TranscriptStore, sid: str) -> list[int]:
    """The tokens of each summary in the context list."""
    return [i.tokens for i in store.read(lambda c: load_items(c, A, sid)) if i.summary is not None]


def test_the_budgets_follow_a_small_window_and_a_normal_one_keeps_the_configured() -> None:
    config = LosslessConfig()
    for window in (9_600, 32_000, 200_000):
        marks = budget(config, window, None)
        assert (marks.leaf_summary_tokens, marks.condensed_summary_tokens) == (600, 800)
    marks = budget(config, 1024, None)
    assert (marks.target, marks.tail_tokens) == (512, 256)
    assert (marks.leaf_summary_tokens, marks.condensed_summary_tokens) == (64, 128)  # room 256: // 4, // 2
    fanin = LosslessConfig(condense_fanin=2, leaf_summary_tokens=100)
    assert (budget(fanin, 1024, None).leaf_summary_tokens, budget(fanin, 4000, None).leaf_summary_tokens) == (100, 100)
    assert budget(fanin, 600, None).leaf_summary_tokens == 75  # room 150 // 2
    tiny = budget(config, 256, None)  # room 64: the leaf's 16 is the floor
    assert (tiny.leaf_summary_tokens, tiny.condensed_summary_tokens) == (16, 32)


def test_one_leaf_never_outgrows_the_target_of_a_small_window(store: TranscriptStore, sid: str) -> None:
    """24 messages, then a tool round in progress, at ``context_window`` 1,024 (the extractive summarizer).

    The leaf of the 24 messages was ~590 tokens, over the target (512): compaction ended at ~960 tokens,
    over the threshold (768), and each maintenance pass after it compacted again, without progress."""
    rnd = random.Random(7)
    history = [m for i in range(12) for m in exchange(rnd, i)]
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    result = " ".join(" ".join(rnd.choice(WORDS) for _ in range(10)) + "." for _ in range(12))
    history += [exchange(rnd, 12)[0], {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": result}]
    store.append_many(A, sid, [{"message": m} for m in history])
    summarizer = Recording()
    engine = make_engine(store, summarizer, {"context_window": 1024})
    engine.bootstrap(scope=A, session_id=sid, fence=None)
    marks = engine.budget(A, sid)

    compacted = engine.compact(scope=A, session_id=sid)
    assert compacted.ok and compacted.compacted, compacted
    assert compacted.reason is None and compacted.tokens_after <= marks.target, compacted
    assert max(context_summaries(store, sid)) <= marks.target - marks.tail_tokens
    assert summarizer.asked and max(summarizer.asked) <= marks.leaf_summary_tokens < 600
    calls = len(summarizer.asked)
    again = engine.maintain(scope=A, session_id=sid)
    assert (again.changed, again.reason) == (False, "under the threshold"), again
    assert len(summarizer.asked) == calls
    shown = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=1024)
    assert shown.prompt_authority == "assembled"
    assert str(shown.messages[0]["content"]).startswith("[Summary sum_")
    assert store.read(lambda c: audit(c, A, sid)).problems == []


@pytest.mark.parametrize("host_budget", [2000, 1024])
def test_a_long_session_in_a_small_host_budget_settles_under_the_target(
    store: TranscriptStore, sid: str, host_budget: int
) -> None:
    """Turn after turn as a host runs them (commit, maintenance, assembly) at a small host budget, with a
    summarizer that writes what it is allowed. A condensed summary of 800 tokens left no room for the
    tail: maintenance ended over the target after every turn, and called the summarizer again at the next.
    Now every compaction ends under the target, summaries included, and assembly shows them all."""
    rnd = random.Random(11)
    summarizer = Thorough()
    engine = make_engine(store, summarizer)
    marks = None
    for i in range(30):
        question, answer = exchange(rnd, i)
        turn = finished_turn(store, A, sid, f"t{i}", [answer], question=str(question["content"]))
        assert commit_with(store, engine, turn).status == "committed"
        shown = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=host_budget)
        assert shown.prompt_authority == "assembled"
        marks = engine.budget(A, sid)
        held = context_summaries(store, sid)
        if held:  # every summary in context is shown: assemble cut none of them for room
            assert sum(str(m["content"]).startswith("[Summary sum_") for m in shown.messages) == len(held)
        maintained = engine.maintain(scope=A, session_id=sid)
        assert maintained.reason in (None, "under the threshold"), (i, maintained)
    assert marks is not None and marks.window == host_budget
    rows = store.read(lambda c: c.conn.execute(
        select(summaries.c.kind, summaries.c.tokens).where(summaries.c.scope == A, summaries.c.session_id == sid)
    ).all())
    assert {r.kind for r in rows} == {"leaf", "condensed"}
    assert max(context_summaries(store, sid)) <= marks.target - marks.tail_tokens
    assert store.read(lambda c: audit(c, A, sid)).problems == []
