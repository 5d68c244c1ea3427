"""Review of session 42's lossless and Hermes changes: defects found, each test failing before its fix.

Each test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

from conftest import module_store_fixtures, tool_round

from engines.lossless import LosslessEngine
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-review42"
shared_url, store, sid = module_store_fixtures(A, "review_s42")


def lossless(store: TranscriptStore, sid: str, history: list[dict[str, Any]]) -> LosslessEngine:
    """A lossless engine over ``history``, compacted (its older messages under a leaf)."""
    store.append_many(A, sid, [{"message": m} for m in history])
    engine = LosslessEngine(EngineContext(
        store=store, summarizer=ExtractiveSummarizer(), estimator=RoughEstimator(),
        config={"fresh_tail_messages": 2, "expand_max_chars": 200},
    ))
    engine.bootstrap(scope=A, session_id=sid, fence=None)
    assert engine.compact(scope=A, session_id=sid, force=True).compacted
    return engine


def answer(engine: LosslessEngine, sid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(engine.handle_tool_call(name, args, scope=A, session_id=sid))
    assert "error" not in out, out
    return out


def test_a_nul_character_in_a_source_message_leaves_its_leaf_expandable(store: TranscriptStore, sid: str) -> None:
    """A tool output with a NUL character (a binary file read as text) is stored, its JSON escaping it as
    ``\\u0000``. lcm_expand of its leaf read the tool_call_id through PostgreSQL's JSON, which cannot turn
    ``\\u0000`` into text: the whole page failed ("database error"), where it read the row in Python before;
    expanding the message itself failed so too."""
    binary = "PK\x03\x04\x00\x00header\x00" * 30
    history = [{"role": "user", "content": "read the archive"}, *tool_round("call-bin", binary),
               {"role": "user", "content": "and say \x00 hi"}, *tool_round("call-two", "plain"),
               *[{"role": "assistant", "content": f"reply {n} " * 20} for n in range(3)]]
    engine = lossless(store, sid, history)
    leaf = answer(engine, sid, "lcm_describe", {"id": "msg_2"})["summarized_in"][-1]
    items = {item["id"]: item for item in answer(engine, sid, "lcm_expand", {"id": leaf})["items"]}
    assert items["msg_2"]["tool_call_id"] == "call-bin" and items["msg_2"]["truncated"] is True
    assert items["msg_3"].get("tool_call_id") is None and "hi" in items["msg_3"]["content"]
    assert items["msg_5"]["tool_call_id"] == "call-two"
    piece = answer(engine, sid, "lcm_expand", {"id": "msg_2", "offset": 10})
    assert piece["items"][0]["tool_call_id"] == "call-bin"
    assert piece["total_chars"] == len(binary)
