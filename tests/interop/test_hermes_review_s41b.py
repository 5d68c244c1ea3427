# ruff: noqa: F811  (the module-scoped fixtures of test_hermes, imported, are taken as parameters)
"""Review of ``unretried`` against the REAL Hermes Agent (hermes-agent==0.19.0, `make test-hermes`).

Hermes' session database does not hand back every message as the live list holds it: it runs
``sanitize_context`` over user and assistant texts (a ``<memory-context>`` tag an answer quotes is taken
out). A message the user really sent twice, its first answer such a text: the saved exchange differed from
the one Hermes showed, and ``unretried`` took it for one a ``/retry`` left behind. Each test runs on SQLite
and on PostgreSQL."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hermes import _need_hermes, home, key, server  # noqa: F401
from test_hermes_retry_after_undo_s41 import answered, fresh_agent
from test_hermes_retry_switch_s41 import cli_for, other_session
from test_hermes_undo_review3 import WORDS, on_store, visible  # noqa: F401

pytestmark = pytest.mark.hermes


def test_a_message_sent_twice_whose_first_answer_the_database_rewrites_stays_at_a_switch(
    home: Path, server: Any, on_store: Any
) -> None:
    """The same question twice, the first answer quoting a ``<memory-context>`` tag (Hermes' database keeps
    it without the tag), then ``/resume`` of another session: both exchanges stay visible."""
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist = answered(agent, server, f"mc-0 {WORDS}", None, "mc-reply 0")
    hist = answered(agent, server, "mc-how is recall marked?", hist, "mc-it is wrapped in <memory-context> tags")
    hist = answered(agent, server, "mc-how is recall marked?", hist, "mc-as I said: a fenced block")
    saved = [key(m) for m in db.get_messages_as_conversation(agent.session_id)]
    assert len(saved) == len(hist) and saved != [key(m) for m in hist], "the case did not arise"
    left = agent.session_id
    assert visible(engine, left) == [key(m) for m in hist]
    cli_for(agent, db, hist)._handle_resume_command(f"/resume {other_session(db, 'mc-')}")
    shown = visible(engine, left)
    assert len(shown) == len(hist), "a real exchange left the visible transcript"
    assert [s[:30] for s in shown] == [key(m)[:30] for m in hist]


def test_a_message_sent_again_and_interrupted_keeps_the_first_exchange_the_database_rewrites(
    home: Path, server: Any, on_store: Any
) -> None:
    """The same question again, interrupted before its reply, its first answer quoting a ``<memory-context>``
    tag: the ``on_session_end`` hook ending the turn, and a ``/resume`` of another session after it, keep
    the first exchange visible."""
    from test_hermes import run_interrupted

    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist = answered(agent, server, f"mi-0 {WORDS}", None, "mi-reply 0")
    hist = answered(agent, server, "mi-how is recall marked?", hist, "mi-it is wrapped in <memory-context> tags")
    done = run_interrupted(agent, server, "mi-how is recall marked?", hist)["messages"]
    saved = [key(m) for m in db.get_messages_as_conversation(agent.session_id)]
    assert len(saved) == len(done) and saved != [key(m) for m in done], "the case did not arise"
    left = agent.session_id
    assert len(visible(engine, left)) == len(done), "a real exchange left the visible transcript"
    cli_for(agent, db, done)._handle_resume_command(f"/resume {other_session(db, 'mi-')}")
    assert [v[:30] for v in visible(engine, left)] == [key(m)[:30] for m in done]


def test_a_retry_of_a_tool_call_exchange_leaves_what_hermes_showed_at_a_switch(
    home: Path, server: Any, on_store: Any
) -> None:
    """``/retry`` of an exchange with a tool round (the assistant's call, its result, the answer), then
    ``/resume`` of another session: the retried exchange once, the old one with its tool round off the
    visible transcript."""
    import json

    from fake_openai import Fault
    from test_hermes_retry_after_undo_s41 import retry
    from test_hermes_retry_switch_s41 import assert_once

    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist = answered(agent, server, f"tc-0 {WORDS}", None, "tc-reply 0")
    call = {"id": "call_tc", "type": "function",
            "function": {"name": "lcm_grep", "arguments": json.dumps({"pattern": "tc-"})}}
    server.queue(Fault(reply={"role": "assistant", "content": "tc-looking", "tool_calls": [call]}),
                 Fault(reply={"role": "assistant", "content": "tc-first answer"}))
    hist = list(agent.run_conversation(f"tc-find it {WORDS}", conversation_history=hist)["messages"])
    assert any(m.get("role") == "tool" for m in hist), "the case did not arise: no tool round"
    message, before = retry(agent, hist)
    final = answered(agent, server, message, before, "tc-second answer")
    assert len(db.get_messages_as_conversation(agent.session_id)) == len(final) + 4
    left = agent.session_id
    cli_for(agent, db, final)._handle_resume_command(f"/resume {other_session(db, 'tc-')}")
    assert_once(engine, left, final)


def test_a_retry_after_an_answer_the_database_rewrites_leaves_what_hermes_showed_at_a_switch(
    home: Path, server: Any, on_store: Any
) -> None:
    """An earlier answer quoting a ``<memory-context>`` tag (saved without it), then a ``/retry`` and
    ``/resume`` of another session: the retried exchange once, the old one off the visible transcript."""
    from test_hermes_retry_after_undo_s41 import retry

    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist = answered(agent, server, f"ra-0 {WORDS}", None, "ra-it is wrapped in <memory-context> tags")
    hist = answered(agent, server, f"ra-ask {WORDS}", hist, "ra-first answer")
    message, before = retry(agent, hist)
    final = answered(agent, server, message, before, "ra-second answer")
    assert len(db.get_messages_as_conversation(agent.session_id)) == len(final) + 2
    left = agent.session_id
    cli_for(agent, db, final)._handle_resume_command(f"/resume {other_session(db, 'ra-')}")
    # The answer as the database saved it (a switch stores from there), the rest as Hermes showed it.
    assert [v[:30] for v in visible(engine, left)] == [key(m)[:30] for m in final]
    assert not any("ra-first answer" in v for v in visible(engine, left)), "the old exchange stayed visible"


def test_an_interrupted_retry_after_an_answer_the_database_rewrites_stores_what_hermes_showed(
    home: Path, server: Any, on_store: Any
) -> None:
    """An earlier answer quoting a ``<memory-context>`` tag (saved without it), then a ``/retry`` whose turn
    is interrupted before its reply: the ``on_session_end`` hook ending it leaves the old exchange off the
    visible transcript and the retried message there once."""
    from test_hermes import run_interrupted
    from test_hermes_retry_after_undo_s41 import retry

    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist = answered(agent, server, f"ri-0 {WORDS}", None, "ri-it is wrapped in <memory-context> tags")
    hist = answered(agent, server, f"ri-ask {WORDS}", hist, "ri-first answer")
    message, before = retry(agent, hist)
    done = run_interrupted(agent, server, message, before)["messages"]
    assert len(db.get_messages_as_conversation(agent.session_id)) == len(done) + 2, "the case did not arise"
    shown = visible(engine, agent.session_id)
    assert not any("ri-first answer" in v for v in shown), "the old exchange stayed visible"
    assert [v[:30] for v in shown] == [key(m)[:30] for m in done]
