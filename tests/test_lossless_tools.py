"""The lossless engine's recall tools and budgets against hostile input, on both backends.

The model writes a tool's arguments: any text, any id, any regex. None of it may raise out of the turn
(the host would quarantine the engine), hold the process, or reach the database as a value it refuses.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import BACKENDS, fresh_url

from engines.lossless import LosslessEngine
from engines.lossless import search as search_module
from engines.lossless.context import load_items
from transcript_store import StoreConfig, TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.models import ClosedRange
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-lt"
SMALL = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
         "condensed_summary_tokens": 160, "condense_fanin": 3}
#: arguments that once raised out of handle_tool_call (and so quarantined the engine)
BAD_ARGUMENTS = [
    ("lcm_describe", {"id": "sum_\u00b2"}),  # '²'.isdigit() is True, int('²') raises
    ("lcm_expand", {"id": "msg_\u00b2"}),
    ("lcm_describe", {"id": "msg_99999999999999999999"}),  # past SQLite's INTEGER
    ("lcm_expand", {"id": "sum_99999999999"}),  # past PostgreSQL's int4
    ("lcm_describe", {"id": "x\x00y"}),  # PostgreSQL takes no NUL in text
    ("lcm_describe", {"id": "abc\ud800"}),  # a lone surrogate (JSON "\ud800") cannot be encoded
    ("lcm_grep", {"pattern": "foo\x00bar"}),  # SQLite FTS5: 'unterminated string'
    ("lcm_grep", {"pattern": "caf\ud800"}),
    ("lcm_grep", {"pattern": "x" * 5000}),
    ("lcm_grep", {"pattern": " ".join(["word"] * 100)}),
    ("lcm_grep", {"pattern": "((a{1000}){1000}){1000}", "mode": "regex"}),  # compiling it would not end
]


@pytest.fixture(scope="module", params=BACKENDS)
def shared_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from fresh_url(str(request.param), request, tmp_path_factory.mktemp("lossless_tools"))


@pytest.fixture(scope="module")
def store(shared_url: str) -> Iterator[TranscriptStore]:
    s = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False))
    yield s
    s.close()


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(A, session_id=f"s-{uuid.uuid4().hex[:12]}").session_id


def make_engine(store: TranscriptStore, config: dict[str, Any] | None = None) -> LosslessEngine:
    ctx = EngineContext(store=store, config=config or {}, summarizer=ExtractiveSummarizer(),
                        estimator=RoughEstimator())
    return LosslessEngine(ctx)


def turn(store: TranscriptStore, engine: LosslessEngine, sid: str, turn_id: str, *replies: str) -> None:
    """Admit, append and commit one finished turn."""
    admission = store.admit(A, sid, {"role": "user", "content": f"question {turn_id} " + "words " * 30},
                            turn_id=turn_id)
    texts = replies or (f"answer {turn_id} " * 10,)
    appended = store.append_many(A, sid, [{"message": {"role": "assistant", "content": t}} for t in texts])
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    store.write(lambda c: engine.commit_turn(
        tx=c, advancement_key=turn_id, admission=admission.anchor, terminal=terminal, messages=closed.messages
    ))


def call(engine: LosslessEngine, sid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(engine.handle_tool_call(name, args, scope=A, session_id=sid))
    return out


def context_tokens(store: TranscriptStore, sid: str) -> int:
    return sum(i.tokens for i in store.read(lambda c: load_items(c, A, sid)))


# ---------------------------------------------------------------------------------------------- regex


def test_a_regex_is_bounded_in_time_and_frees_the_process(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catastrophically backtracking regex answers an error within its bound, and other threads run
    meanwhile (matching releases the GIL)."""
    monkeypatch.setattr(search_module, "REGEX_SECONDS", 0.5, raising=False)
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "a" * 36 + "!")
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.02)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        start = time.monotonic()
        out = call(engine, sid, "lcm_grep", {"pattern": "(a|aa)+$", "mode": "regex"})
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        ticker.join()
    assert "ran past its 0.5 s bound" in out.get("error", ""), out
    assert elapsed < 3, elapsed
    assert sum(start + 0.1 < t < start + elapsed for t in ticks) >= 5  # the ticker ran during the match
    assert call(engine, sid, "lcm_grep", {"pattern": r"a{3}!", "mode": "regex"})["count"] == 1


def test_regex_size_is_bounded_before_compiling(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "2024-01-31 " + "z" * 300)
    start = time.monotonic()
    for pattern in ("((a{1000}){1000}){1000}", "(?:x{400}){400}", "a{0,4294967294}", "y{99999999999999999999}"):
        out = call(engine, sid, "lcm_grep", {"pattern": pattern, "mode": "regex"})
        assert out.get("error", "").startswith("regular expression too large"), (pattern, out)
    assert time.monotonic() - start < 2
    for pattern in (r"\d{4}-\d{2}-\d{2}", r"z{300}", r".{0,200}z{9}", r"[{]?\d{4}-", r"\p{L}{3}z"):
        assert call(engine, sid, "lcm_grep", {"pattern": pattern, "mode": "regex"})["count"] == 1, pattern
    assert search_module.expanded_size("(a{1000}){1000}") == 1_000_000
    assert search_module.expanded_size("ab{3}(cd){2,5}[x{9}]") == 1 + 3 + 10 + 1
