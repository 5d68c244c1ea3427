# ruff: noqa: F811  (the module-scoped fixtures of test_hermes, imported, are taken as parameters)
"""A user message the gateway saves cleaned (``persist_user_message``) while it sent another text, against the
REAL Hermes Agent (hermes-agent==0.19.0, run by `make test-hermes`).

The gateway sends the model a user message with its timestamp prefix (``render_user_content_with_timestamp``)
and passes ``run_conversation`` the clean text as ``persist_user_message``: Hermes saves the clean text in its
session database, the text sent as the row's ``api_content``, and the gateway reloads that database for every
turn. The store keeps the turns as they were stored: nothing written again, nothing lost. Each test runs on
SQLite and PostgreSQL."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hermes import _need_hermes, home, key, server  # noqa: F401
from test_hermes_retry_after_undo_s41 import fresh_agent
from test_hermes_undo_review3 import WORDS, everything, on_store, visible  # noqa: F401

pytestmark = pytest.mark.hermes

#: a platform event time (the gateway renders it as the sent text's prefix)
STAMP = 1_780_000_000.0


def gateway_turn(
    agent: Any, server: Any, clean: str, history: list[dict[str, Any]] | None, *replies: dict[str, Any]
) -> list[dict[str, Any]]:
    """One gateway turn: the model is sent ``clean`` with its timestamp prefix (the gateway's own rendering),
    Hermes saves ``clean`` (``persist_user_message``); the model answers ``replies`` in order."""
    from fake_openai import Fault
    from gateway.message_timestamps import render_user_content_with_timestamp

    sent = render_user_content_with_timestamp(clean, STAMP)
    assert sent != clean, "the case did not arise: no prefix rendered"
    server.queue(*(Fault(reply=r) for r in replies))
    result = agent.run_conversation(sent, conversation_history=history, persist_user_message=clean,
                                    persist_user_timestamp=STAMP)
    return list(result["messages"])


def saved_as_sent(db: Any, agent: Any) -> list[dict[str, Any]]:
    """The history the gateway reloads for the next turn; the case arose: a row saved clean, sent otherwise."""
    reloaded = db.get_messages_as_conversation(agent.session_id, repair_alternation=True)
    assert any(m.get("api_content") and m["api_content"] != m.get("content") for m in reloaded), (
        "the case did not arise: no row keeps another text sent")
    return reloaded


def assert_kept(engine: Any, hermes_session: str, shown: list[dict[str, Any]], stored: int) -> None:
    """The store session shows ``shown`` and holds ``stored`` messages in all: none written again."""
    keys = everything(engine, hermes_session)
    assert visible(engine, hermes_session) == [key(m) for m in shown]
    assert len(keys) == len(set(keys)) == stored, "messages were written again off the branch"


def test_gateway_turns_on_the_reloaded_history_write_nothing_again(home: Path, server: Any, on_store: Any) -> None:
    """Turns on the history reloaded from the database after each: the turns as Hermes holds them once."""
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    first = gateway_turn(agent, server, f"pu-0 {WORDS}", None, {"role": "assistant", "content": "pu-reply 0"})
    assert_kept(engine, agent.session_id, first, 2)
    gateway_turn(agent, server, f"pu-1 {WORDS}", saved_as_sent(db, agent),
                 {"role": "assistant", "content": "pu-reply 1"})
    final = gateway_turn(agent, server, f"pu-2 {WORDS}", saved_as_sent(db, agent),
                         {"role": "assistant", "content": "pu-reply 2"})
    assert_kept(engine, agent.session_id, final, 6)


def test_a_recall_tool_in_a_gateway_turn_keeps_the_message_sent(home: Path, server: Any, on_store: Any) -> None:
    """A recall tool runs in the turn (the conversation is stored with the text sent), then Hermes puts the
    clean text in its list at the turn's end and saves it: the message sent stays, the turn is stored once
    (it was written again after the clean text, the message sent off the branch), and the next turn on the
    reloaded history writes nothing again."""
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist = gateway_turn(agent, server, f"pt-0 {WORDS}", None, {"role": "assistant", "content": "pt-reply 0"})
    call = {"id": "call_pt", "type": "function",
            "function": {"name": "lcm_grep", "arguments": json.dumps({"pattern": "pt-0"})}}
    hist = gateway_turn(agent, server, f"pt-1 {WORDS}", saved_as_sent(db, agent),
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "assistant", "content": "pt-reply 1"})
    assert any(m.get("tool_call_id") == "call_pt" for m in hist), "the case did not arise: no tool ran"
    final = gateway_turn(agent, server, f"pt-2 {WORDS}", saved_as_sent(db, agent),
                         {"role": "assistant", "content": "pt-reply 2"})
    from gateway.message_timestamps import render_user_content_with_timestamp

    # the turn's user message as the recall tool stored it: the text the model was sent, and answered
    sent = {**final[2], "content": render_user_content_with_timestamp(final[2]["content"], STAMP)}
    assert_kept(engine, agent.session_id, [*final[:2], sent, *final[3:]], 8)
