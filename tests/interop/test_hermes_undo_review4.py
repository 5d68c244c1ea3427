# ruff: noqa: F811  (the module-scoped fixtures of test_hermes, imported, are taken as parameters)
"""``/undo`` in the REAL Hermes Agent (hermes-agent==0.19.0, run by `make test-hermes`), review 4.

Once a session's database counts a rewind (``rewind_count``, for ever after), the adapter follows what
the database holds at a session end. A turn Hermes could not write there is a kept one all the same;
an ``/undo`` of the turn a compaction's answer kept fresh leaves the view its context messages alone.
Each test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hermes import _need_hermes, home, key, server  # noqa: F401
from test_hermes_undo_review3 import everything, on_store, start, undo, visible  # noqa: F401

pytestmark = pytest.mark.hermes


@pytest.mark.parametrize("in_place", [False, True])
def test_a_compaction_mid_turn_after_an_undo_keeps_the_turns_rounds_visible(
    home: Path, server: Any, on_store: Any, in_place: bool
) -> None:
    """An ``/undo``, then a turn whose tool rounds pass the trigger: Hermes compacts mid-turn and tells the
    engine the session ended (``commit_memory_session``) before its rotation's flush. The rounds stay
    visible, each stored once (Hermes has written each round by then)."""
    from fake_openai import Fault

    from transcript_store.hermes import is_context_message

    agent, db, hist = start(home, server, on_store, "sloe-", 3)
    agent.compression_in_place = in_place
    engine = agent.context_compressor
    kept = undo(agent, db, hist)
    engine.threshold_percent = 6000
    engine.update_model(engine.model, engine.context_length)
    musings = [f"sloe-round{r} thinking aloud: " + " ".join([f"step{r}"] * 1500) for r in range(3)]
    server.queue(*(
        Fault(reply={"role": "assistant", "content": musings[r], "tool_calls": [{
            "id": f"call_sloe_{r}", "type": "function",
            "function": {"name": "lcm_grep", "arguments": json.dumps({"pattern": f"sloe{r}"})},
        }]})
        for r in range(3)
    ))
    count = engine.compression_count
    final = agent.run_conversation("sloe-big please look it up", conversation_history=kept)["messages"]
    assert engine.compression_count > count, "no compaction mid-turn: the case did not arise"
    agent.shutdown_memory_provider(agent._session_messages)
    shown = visible(engine, agent.session_id)
    for m in final:
        if m.get("role") != "system" and not is_context_message(m):
            assert key(m) in shown, f"a kept message left the visible transcript: {key(m)[:80]}"
    keys = everything(engine, agent.session_id)
    assert len(keys) == len(set(keys)), "a message was stored twice"


def test_a_turn_hermes_could_not_save_stays_visible_after_an_undo(home: Path, server: Any, on_store: Any) -> None:
    """After an ``/undo`` (the database counts a rewind), a turn whose rows Hermes could not write (its
    database locked by another writer the whole turn: Hermes logs it and goes on) is a turn the user
    kept: the session end stores it, never moves it off the visible transcript."""
    import sqlite3

    agent, db, hist = start(home, server, on_store, "damson-", 3)
    engine = agent.context_compressor
    kept = undo(agent, db, hist)
    db._WRITE_MAX_RETRIES = 1  # Hermes retries a locked write 15 times over a second each: one is enough here
    other = sqlite3.connect(str(db.db_path), timeout=0.1)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process writing to the same state.db
        final = agent.run_conversation(f"damson-new {words()}", conversation_history=kept)["messages"]
        saved = db.get_messages_as_conversation(agent.session_id)
        assert len(saved) < len(final), "Hermes saved the turn: the case did not arise"
        agent.shutdown_memory_provider(agent._session_messages)
    finally:
        other.rollback()
        other.close()
    shown = visible(engine, agent.session_id)
    new = final[max(i for i, m in enumerate(final) if str(m.get("content")).startswith("damson-new")):]
    assert new and all(key(m) in shown for m in new), "the turn Hermes could not save left the transcript"
    assert shown[-len(new):] == [key(m) for m in new]
    assert not any(v.startswith('["user", "damson-2 ') for v in shown), "\n".join(v[:60] for v in shown)


def words() -> str:
    """A user message's filler."""
    return " ".join(["filler"] * 40)


def test_a_new_turn_after_undoing_the_compacted_views_fresh_turn_leaves_the_undone_one(
    home: Path, server: Any, on_store: Any
) -> None:
    """A compaction's answer keeps the current user message fresh after its context messages; ``/undo``
    of that turn leaves the view its context messages alone, and the next turn sends a new message after
    them. Matched with no answer, the view was taken for the end of the transcript: the new turn was
    stored after the undone one, which stayed visible for good (the session end follows Hermes' database,
    which holds the next summary) and went back to the model in that summary."""
    from transcript_store.hermes import is_context_message

    agent, db, hist = start(home, server, on_store, "damson-", 3)
    engine = agent.context_compressor
    assert engine.compression_count >= 1 and is_context_message(hist[0]), "no compaction: the case did not arise"
    kept = undo(agent, db, hist)
    assert kept and all(is_context_message(m) for m in kept), "the view holds more than its context"
    sent_before = len(server.chat_requests)
    final = agent.run_conversation(f"damson-new {words()}", conversation_history=kept)["messages"]
    for r in server.chat_requests[sent_before:]:
        assert "damson-2 " not in json.dumps(r["messages"]), "the undone turn went back to the model"
    shown = visible(engine, agent.session_id)
    assert not any(v.startswith('["user", "damson-2 ') for v in shown), "the undone turn stayed visible"
    assert shown[-2:] == [key(m) for m in final[-2:]]
    assert sum(v.startswith('["user", "damson-0 ') for v in shown) == 1
    assert sum(v.startswith('["user", "damson-1 ') for v in shown) == 1
    agent.shutdown_memory_provider(agent._session_messages)
    assert visible(engine, agent.session_id) == shown


def test_undoing_the_compacted_views_fresh_turn_then_exit_leaves_it_off_the_transcript(
    home: Path, server: Any, on_store: Any
) -> None:
    """The same ``/undo``, then exit: Hermes' database keeps the view's context messages alone, matched
    with no answer before; the undone turn stayed visible to every later read and resume."""
    from transcript_store.hermes import is_context_message

    agent, db, hist = start(home, server, on_store, "damson-", 3)
    engine = agent.context_compressor
    assert is_context_message(hist[0]), "no compaction: the case did not arise"
    kept = undo(agent, db, hist)
    assert kept and all(is_context_message(m) for m in kept)
    agent.shutdown_memory_provider(agent._session_messages)
    shown = visible(engine, agent.session_id)
    assert not any(v.startswith('["user", "damson-2 ') for v in shown), "the undone turn stayed visible"
    assert [v[:19] for v in shown if v.startswith('["user"')] == ['["user", "damson-0 ', '["user", "damson-1 ']
    agent.shutdown_memory_provider(agent._session_messages)  # again: nothing changes
    assert visible(engine, agent.session_id) == shown
