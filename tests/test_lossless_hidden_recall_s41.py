"""The lossless engine's recall tools never find or open a message the host keeps out of the model's context
(OpenClaw's ``excludeFromContext``), on both backends: a tool's answer is model context too.

The engine stored such messages, never showed, counted or summarized them, but lcm_grep found them
(full text and regex), lcm_describe previewed them and lcm_expand opened them, by their id and among a
leaf's sources: a context-free command's output or a hidden consult prompt reached the model through a
search. They stay stored (the transcript and the engine's copy keep them); revision 0016 marks the rows
of a store written before, so an upgraded store hides them too.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from alembic import command
from conftest import module_store_fixtures
from sqlalchemy import select
from test_excluded_context_review5 import turn

from engines.lossless import LosslessEngine
from engines.lossless.tables import messages
from transcript_store import StoreConfig, TranscriptStore, migrate
from transcript_store.db import Database
from transcript_store.engine import EngineContext
from transcript_store.models import out_of_context
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-hidden-s41"
WORD = "kumquat"
SECRET = "zanzibar-consult"  # only ever in hidden messages
TURNS = 4

shared_url, store, sid = module_store_fixtures(A, "hidden_s41")


def hidden(role: str, text: str, *, lean: bool = False) -> dict[str, Any]:
    """A message as the OpenClaw plugin stores one that OpenClaw keeps out of the model's context."""
    host = {"role": role, "content": text, "excludeFromContext": True, "timestamp": 1}
    if lean:
        return {"role": role, "content": text, "openclaw_lean": {"message": {**host, "content": None}, "refs": []}}
    return {"role": role, "content": text, "openclaw": host}


def conversation(store: TranscriptStore, sid: str) -> LosslessEngine:
    """TURNS turns, each a visible question and answer holding WORD, then a hidden command and its reply
    holding WORD and SECRET (newer than the visible ones: a newest-first page meets them first). Also a
    visible message that only names the marker (a candidate of revision 0016 it must leave visible)."""
    config = {"fresh_tail_messages": 2, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
              "condensed_summary_tokens": 160, "condense_fanin": 3}
    engine = LosslessEngine(EngineContext(store=store, config=config, summarizer=ExtractiveSummarizer(),
                                          estimator=RoughEstimator()))
    for n in range(TURNS):
        turn(store, engine, sid, f"k{n}", [
            {"role": "user", "content": f"question {n} about the {WORD} " + "words " * 20},
            {"role": "assistant", "content": f"answer {n}: the {WORD} grows here " + "more " * 40},
            hidden("user", f"!{WORD} {SECRET} the command {n} " + "hush " * 30, lean=n % 2 == 1),
            hidden("assistant", f"{SECRET} the output {n} of {WORD} " + "quiet " * 30),
        ], scope=A)
    turn(store, engine, sid, "k-last", [
        {"role": "user", "content": "what does excludeFromContext do"},
        {"role": "assistant", "content": "it keeps a message out",
         "openclaw": {"role": "assistant", "excludeFromContext": "yes"}},  # not True: shown
    ], scope=A)
    return engine


def call(engine: LosslessEngine, sid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(engine.handle_tool_call(name, args, scope=A, session_id=sid))
    return out


def rows(store: TranscriptStore, sid: str) -> list[tuple[int, str, bool]]:
    """(ordinal, entry id, out of context) of every message row of the engine, read without its new column."""
    m = messages.c
    q = select(m.ordinal, m.entry_id, m.message).where(m.scope == A, m.session_id == sid).order_by(m.ordinal)
    return [(r.ordinal, r.entry_id, out_of_context(json.loads(r.message)))
            for r in store.read(lambda c: c.conn.execute(q).all())]


def ids(found: dict[str, Any]) -> list[str]:
    assert "error" not in found, found
    return [r["id"] for r in found["results"]]


@pytest.mark.parametrize("mode, pattern", [("full_text", WORD), ("full_text", f"{WORD.upper()} the"),
                                           ("regex", "k[u]mq?uat"), ("regex", "^")])
def test_lcm_grep_finds_only_the_messages_the_model_may_see(store: TranscriptStore, sid: str, mode: str,
                                                             pattern: str) -> None:
    engine = conversation(store, sid)
    table = rows(store, sid)
    hidden_ids = {f"msg_{o}" for o, _, out in table if out}
    assert len(hidden_ids) == 2 * TURNS
    for sort in ("recency", "relevance"):
        every = ids(call(engine, sid, "lcm_grep", {"pattern": pattern, "mode": mode, "search_in": "messages",
                                                    "sort": sort, "limit": 200}))
        assert every and not hidden_ids & set(every), (sort, every)
        # every visible message ("^"), or the visible question and answer of each turn
        assert len(every) == (len(table) - len(hidden_ids) if pattern == "^" else 2 * TURNS), (sort, every)
        # A limit of N gives N visible hits while there are: the page is a prefix of the whole list.
        for limit in (1, 2, 3):
            page = call(engine, sid, "lcm_grep", {"pattern": pattern, "mode": mode, "search_in": "all",
                                                  "sort": sort, "limit": limit})
            got = [r for r in page["results"] if r["kind"] == "message"]
            assert not hidden_ids & {r["id"] for r in got}
            assert page["count"] == limit and SECRET not in json.dumps(page)
            if sort == "recency":
                assert [r["id"] for r in got] == every[: len(got)]


@pytest.mark.parametrize("mode", ["full_text", "regex"])
def test_text_only_hidden_messages_hold_is_never_found(store: TranscriptStore, sid: str, mode: str) -> None:
    engine = conversation(store, sid)
    for search_in in ("messages", "summaries", "all"):
        found = call(engine, sid, "lcm_grep", {"pattern": SECRET, "mode": mode, "search_in": search_in})
        assert found["count"] == 0 and found["results"] == [], found
    engine.compact(scope=A, session_id=sid, force=True, token_budget=200)
    found = call(engine, sid, "lcm_grep", {"pattern": SECRET, "mode": mode})
    assert found["count"] == 0, found


def test_describe_and_expand_never_open_a_hidden_message(store: TranscriptStore, sid: str) -> None:
    engine = conversation(store, sid)
    table = rows(store, sid)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=200)
    assert result.compacted
    for ordinal, entry_id, out in table:
        for ident in (f"msg_{ordinal}", entry_id):
            described = call(engine, sid, "lcm_describe", {"id": ident})
            opened = call(engine, sid, "lcm_expand", {"id": ident})
            if out:
                assert "error" in described and "error" in opened, (described, opened)
                assert SECRET not in json.dumps([described, opened])
            else:
                assert described["id"] == opened["id"] == f"msg_{ordinal}"
    # Every leaf lists its visible sources only, paged over them alone; none of its text is hidden text.
    visible = {f"msg_{o}" for o, _, out in table if not out}
    leaves = 0
    for seq in range(1, 64):
        described = call(engine, sid, "lcm_describe", {"id": f"sum_{seq}"})
        if "error" in described:
            break
        assert SECRET not in json.dumps(described)
        if described["kind"] != "leaf":
            continue
        leaves += 1
        whole = call(engine, sid, "lcm_expand", {"id": f"sum_{seq}", "limit": 200})
        listed = [i["id"] for i in whole["items"]]
        assert set(listed) <= visible and whole["total"] == len(listed) == described["source_messages"]
        assert SECRET not in json.dumps(whole)
        paged, offset = [], 0
        while offset is not None:
            page = call(engine, sid, "lcm_expand", {"id": f"sum_{seq}", "offset": offset, "limit": 1})
            paged += [i["id"] for i in page["items"]]
            offset = page["next_offset"]
        assert paged == listed
    assert leaves


def test_an_upgraded_store_hides_what_an_earlier_release_stored(store_url: str) -> None:
    """Rows stored before revision 0016 (taken down to 0015: the column dropped) are marked by its upgrade:
    the hidden ones stop matching; the one that only names the marker, or holds it not as true, stays."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        sid = store.create_session(A, session_id="s1").session_id
        conversation(store, sid)
    db = Database(StoreConfig(url=store_url))
    try:
        cfg = migrate.alembic_config()
        with db.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0015")
        migrate.upgrade(db)
    finally:
        db.dispose()
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        engine = LosslessEngine(EngineContext(store=store, config={}, summarizer=ExtractiveSummarizer(),
                                              estimator=RoughEstimator()))
        m = messages.c
        flagged = store.read(lambda c: c.conn.execute(
            select(m.ordinal, m.hidden).where(m.scope == A, m.session_id == "s1").order_by(m.ordinal)).all())
        assert [bool(r.hidden) for r in flagged] == [out for _, _, out in rows(store, "s1")]
        for mode in ("full_text", "regex"):
            assert call(engine, "s1", "lcm_grep", {"pattern": SECRET, "mode": mode})["count"] == 0
        named = call(engine, "s1", "lcm_grep", {"pattern": "excludeFromContext"})
        assert named["count"] == 1
        kept = call(engine, "s1", "lcm_grep", {"pattern": "keeps a message out"})
        assert kept["count"] == 1
