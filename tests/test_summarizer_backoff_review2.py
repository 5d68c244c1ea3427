"""A failing or slow summarizer pauses automatic compactions (per engine, scope and session), never a forced
one.

Before: every turn over the threshold after a summarizer failure called the summarizer again, and with a
down summary model (the OpenAI summarizer's timeout is 60 s) every such turn waited out its timeout.
The summarizer here is the real OpenAI-compatible one against a local fake endpoint (tests/fake_openai.py)
that answers slower than the summarizer's timeout, or fails.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fake_openai import FakeOpenAI
from hosting import RecordingModel

from engines.legacy import LegacyEngine
from engines.lossless.engine import LosslessEngine
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.hermes import create_engine
from transcript_store.host import HostRuntime
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import PAUSED, OpenAISummarizer
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

SCOPE = "backoff"
#: the summarizer's timeout here; the fake endpoint answers after SLOW seconds when it is "down"
TIMEOUT = 0.5
SLOW = 3.0


class Clock:
    """A clock a test moves (a backoff's ``clock``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake() -> Any:
    with FakeOpenAI() as server:
        yield server


def summarizer(fake: FakeOpenAI) -> OpenAISummarizer:
    return OpenAISummarizer(fake.base_url, "fake-model", timeout=TIMEOUT)


def long_session(store: TranscriptStore, n: int = 30) -> str:
    sid = store.create_session(SCOPE).session_id
    store.append_many(
        SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " + "word " * 300}}
                     for i in range(n)]
    )
    return sid


def kinds(store: TranscriptStore, sid: str) -> list[str]:
    return [e.kind for e in store.list_entries(SCOPE, sid)]


# ------------------------------------------------------------------------------------ the host (legacy)


def test_the_host_pauses_its_built_in_compaction_after_a_summarizer_timeout(
    store: TranscriptStore, fake: FakeOpenAI
) -> None:
    sid = long_session(store)
    host = HostRuntime(store, load_settings(config_path=None, engine="legacy", token_budget=4000), RecordingModel(),
                       registry=EngineRegistry(), summarizer=summarizer(fake), estimator=RoughEstimator())
    clock = Clock()
    host.summary_backoff.clock = clock
    fake.delay = SLOW  # the summary model is down: every request times out

    started = time.monotonic()
    first = host.run_turn(SCOPE, sid, "first", turn_id="t1")
    assert time.monotonic() - started >= TIMEOUT  # the compaction before the prompt waited out the timeout
    assert first.commit_status == "committed" and len(fake.chat_requests) == 1
    for i in range(2, 5):  # later turns over the threshold: no summarizer call, no wait
        started = time.monotonic()
        out = host.run_turn(SCOPE, sid, f"turn {i}", turn_id=f"t{i}")
        assert time.monotonic() - started < TIMEOUT
        assert out.commit_status == "committed" and out.degraded_reason is None
    assert len(fake.chat_requests) == 1

    # Nothing lost, each turn committed once, nothing compacted.
    assert "compaction" not in kinds(store, sid)
    texts = [str((e.message or {}).get("content")) for e in store.read_visible(SCOPE, sid)]
    assert len(texts) == 30 + 2 * 4 and [t for t in texts if t in ("first", "turn 2", "turn 3", "turn 4")] == [
        "first", "turn 2", "turn 3", "turn 4"]
    keys = [r.advancement_key for r in Turns(store).receipts(SCOPE, sid, "legacy")]
    assert len(keys) == len(set(keys)) == 4

    # After the pause (30 s) the next turn tries again; a second failure doubles it (60 s).
    clock.now += 31
    host.run_turn(SCOPE, sid, "turn 5", turn_id="t5")
    assert len(fake.chat_requests) == 2
    clock.now += 31
    host.run_turn(SCOPE, sid, "turn 6", turn_id="t6")
    assert len(fake.chat_requests) == 2

    # A forced compaction always tries: the model is back, it compacts, and the pause is over.
    fake.reset()
    forced = host.compact(SCOPE, sid)
    assert forced.ok and forced.compacted and len(fake.chat_requests) == 1
    assert host.summary_backoff.paused((SCOPE, sid)) is None


# ------------------------------------------------------------------------------------ the engines


def test_the_legacy_engine_pauses_automatic_compactions_not_forced_ones(
    store: TranscriptStore, fake: FakeOpenAI
) -> None:
    sid = long_session(store)
    engine = LegacyEngine(EngineContext(store=store, config={}, summarizer=summarizer(fake),
                                        estimator=RoughEstimator()))
    fake.fail_status = 500
    first = engine.compact(scope=SCOPE, session_id=sid, token_budget=2000)
    assert not first.ok and "summarizer failed" in (first.reason or "") and len(fake.chat_requests) == 1
    second = engine.compact(scope=SCOPE, session_id=sid, token_budget=2000)
    again = engine.compact(scope=SCOPE, session_id=sid, token_budget=2000)
    assert not second.ok and not second.compacted and (second.reason or "").startswith(PAUSED)
    assert again.reason == second.reason  # the same text while the pause lasts (Hermes warns once per text)
    assert len(fake.chat_requests) == 1
    other = long_session(store)  # another session is not paused
    engine.compact(scope=SCOPE, session_id=other, token_budget=2000)
    assert len(fake.chat_requests) == 2
    fake.reset()
    assert engine.compact(scope=SCOPE, session_id=sid, token_budget=2000, force=True).compacted
    assert len(fake.chat_requests) == 1
    assert engine.backoff.paused((SCOPE, sid)) is None and engine.backoff.paused((SCOPE, other)) is not None


def test_the_lossless_engine_pauses_its_maintenance_and_automatic_compactions(
    store: TranscriptStore, fake: FakeOpenAI
) -> None:
    sid = long_session(store)
    config = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
              "condensed_summary_tokens": 160, "condense_fanin": 3, "context_window": 3000}
    engine = LosslessEngine(EngineContext(store=store, config=config, summarizer=summarizer(fake),
                                          estimator=RoughEstimator()))
    engine.bootstrap(scope=SCOPE, session_id=sid, fence=None)
    clock = Clock()
    engine.backoff.clock = clock
    fake.delay = SLOW
    started = time.monotonic()
    first = engine.maintain(scope=SCOPE, session_id=sid)
    assert time.monotonic() - started >= TIMEOUT and not first.changed and len(fake.chat_requests) == 1
    started = time.monotonic()
    second = engine.maintain(scope=SCOPE, session_id=sid)
    pre_prompt = engine.compact(scope=SCOPE, session_id=sid, token_budget=2000)
    assert time.monotonic() - started < TIMEOUT and len(fake.chat_requests) == 1
    assert (second.reason or "").startswith(PAUSED) and (pre_prompt.reason or "").startswith(PAUSED)
    assert not pre_prompt.ok and not pre_prompt.compacted
    clock.now += 31  # the pause is over: maintenance tries again
    engine.maintain(scope=SCOPE, session_id=sid)
    assert len(fake.chat_requests) == 2
    fake.reset()
    forced = engine.compact(scope=SCOPE, session_id=sid, token_budget=2000, force=True)
    assert forced.ok and forced.compacted and fake.chat_requests
    assert engine.backoff.paused((SCOPE, sid)) is None
    assert not (engine.maintain(scope=SCOPE, session_id=sid).reason or "").startswith(PAUSED)


@pytest.mark.parametrize("engine_id", ["lossless", "legacy"])
def test_hermes_automatic_compress_skips_a_summarizer_that_just_failed(
    store_url: str, fake: FakeOpenAI, tmp_path: Path, engine_id: str
) -> None:
    engine = create_engine(allow_stand_in=True, db_url=store_url, engine=engine_id, context_length=64000,
                           threshold_percent=2000, summarizer_factory=lambda: summarizer(fake))
    try:
        engine.on_session_start("s1")
        convo: list[dict[str, Any]] = []
        for i in range(12):
            convo += [{"role": "user", "content": f"question {i} " + "lorem ipsum " * 60},
                      {"role": "assistant", "content": f"answer {i} " + "dolor sit " * 40}]
        fake.delay = SLOW
        engine.compress(list(convo))
        assert "timed out" in (engine._last_summary_error or "") and len(fake.chat_requests) == 1
        convo += [{"role": "user", "content": "more " * 50}, {"role": "assistant", "content": "ok " * 50}]
        started = time.monotonic()
        engine.compress(list(convo))  # Hermes' automatic compress at a later turn
        assert time.monotonic() - started < TIMEOUT and len(fake.chat_requests) == 1
        assert (engine._last_summary_error or "").startswith(PAUSED)
        assert len(engine.stored_messages("s1")) == len(convo)  # stored, nothing lost
        fake.reset()
        engine.compress(list(convo), force=True)  # /compress always tries
        assert fake.chat_requests and engine._last_summary_error is None
    finally:
        engine.close()
