# ruff: noqa: F811  (the module-scoped fixtures of test_hermes, imported, are taken as parameters)
"""``/retry`` after an earlier ``/undo`` in the REAL Hermes Agent (hermes-agent==0.19.0, run by `make test-hermes`).

The CLI's own ``HermesCLI.retry_last`` runs: it takes the last exchange out of the CLI's history and sends
its user message again, leaving the exchange's rows active in the session database (the gateway's
``/retry`` rewrites them; the CLI's does not), so the database then holds the old exchange before the
retried one. After an earlier ``/undo`` (the database counts a rewind) the session end followed the
database: the old exchange and the retried user message came back into the visible transcript, beside the
retried exchange Hermes showed and the model answered. Each test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hermes import _need_hermes, home, key, make_agent, server  # noqa: F401
from test_hermes_undo_review3 import WORDS, everything, on_store, undo, visible  # noqa: F401

pytestmark = pytest.mark.hermes


def retry(agent: Any, history: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Hermes' own ``/retry`` (``HermesCLI.retry_last``): the message it sends again and the history it
    leaves (the last exchange taken out)."""
    from cli import HermesCLI

    cli = HermesCLI.__new__(HermesCLI)  # retry_last reads only these
    cli.conversation_history = list(history)
    cli.agent = agent
    message = HermesCLI.retry_last(cli)
    assert message, "nothing to retry"
    return message, cli.conversation_history


def roomy(agent: Any) -> None:
    """A trigger no turn here reaches: the visible transcript is Hermes' list itself, no compacted view."""
    engine = agent.context_compressor
    engine.threshold_percent = 60000
    engine.update_model(engine.model, engine.context_length)


def answered(
    agent: Any, server: Any, text: str, history: list[dict[str, Any]] | None, reply: str
) -> list[dict[str, Any]]:
    """One turn of ``agent`` whose model answers ``reply``; the list Hermes goes on with."""
    from fake_openai import Fault

    server.queue(Fault(reply={"role": "assistant", "content": reply}))
    return list(agent.run_conversation(text, conversation_history=history)["messages"])


def fresh_agent(home: Path, server: Any, on_store: Any) -> tuple[Any, Any]:
    """A new session database and an agent on it, on the store, its trigger out of reach (``roomy``)."""
    from hermes_state import SessionDB

    server.reset()
    db = SessionDB(home / f"state-{uuid.uuid4().hex[:8]}.db")
    agent = on_store(make_agent(server, db))
    roomy(agent)
    return db, agent


def retried(home: Path, server: Any, on_store: Any, tag: str, undo_first: bool, turn_between: bool) -> Any:
    """Three turns, an ``/undo`` of the last (or none), a new turn (or none), then ``/retry`` of the last
    turn: the agent, Hermes' database and the list Hermes shows after the retry."""
    db, agent = fresh_agent(home, server, on_store)
    hist: list[dict[str, Any]] | None = None
    for i in range(3):
        hist = answered(agent, server, f"{tag}{i} {WORDS}", hist, f"{tag}reply {i}")
    assert hist is not None
    kept = undo(agent, db, hist) if undo_first else hist
    if turn_between:
        kept = answered(agent, server, f"{tag}between {WORDS}", kept, f"{tag}first answer")
    message, before = retry(agent, kept)
    final = answered(agent, server, message, before, f"{tag}second answer")
    saved = [key(m) for m in db.get_messages_as_conversation(agent.session_id)]
    assert len(saved) == len(final) + 2, "Hermes' database lost the old exchange: the case did not arise"
    return agent, db, final


@pytest.mark.parametrize("turn_between", [True, False])
@pytest.mark.parametrize("undo_first", [True, False])
def test_a_retry_then_exit_leaves_the_retried_exchange_once_what_hermes_shows(
    home: Path, server: Any, on_store: Any, undo_first: bool, turn_between: bool
) -> None:
    """The session end stores the list Hermes shows: the retried exchange once, the old one off the visible
    transcript (stored, once: nothing is deleted), an earlier ``/undo`` or none."""
    tag = f"fig{int(undo_first)}{int(turn_between)}-"
    agent, _db, final = retried(home, server, on_store, tag, undo_first, turn_between)
    engine = agent.context_compressor
    agent.shutdown_memory_provider(agent._session_messages)  # the CLI's exit
    shown = visible(engine, agent.session_id)
    assert shown == [key(m) for m in final]
    keys = everything(engine, agent.session_id)
    assert len(keys) == len(set(keys)), "a message was stored twice"
    if turn_between:
        assert sum(f"{tag}first answer" in k for k in keys) == 1, "the old exchange is not stored"
        assert not any(f"{tag}first answer" in v for v in shown), "the old exchange stayed visible"
    agent.shutdown_memory_provider(agent._session_messages)  # again: nothing changes
    assert visible(engine, agent.session_id) == shown
    assert everything(engine, agent.session_id) == keys


def test_a_session_resumed_after_the_retry_follows_what_hermes_replays(
    home: Path, server: Any, on_store: Any
) -> None:
    """A new process resuming the session gets the database's list from Hermes, the old exchange before the
    retried one (hermes-agent 0.19.0's CLI ``/retry`` leaves its rows active): the store follows what that
    Hermes shows and sends to the model, the retry's own process having stored what it showed."""
    from run_agent import AIAgent

    agent, db, final = retried(home, server, on_store, "lime-", True, True)
    agent.shutdown_memory_provider(agent._session_messages)
    assert visible(agent.context_compressor, agent.session_id) == [key(m) for m in final]
    agent.context_compressor.close()  # the process ends: the next one starts with no runtime of its own
    again = on_store(AIAgent(base_url=server.base_url, api_key="test-key", model="fake-model", quiet_mode=True,
                             enabled_toolsets=["context_engine"], skip_context_files=True, skip_memory=True,
                             session_db=db, session_id=agent.session_id))
    roomy(again)
    engine = again.context_compressor
    resumed = db.get_messages_as_conversation(agent.session_id, repair_alternation=True)
    assert sum("lime-first answer" in key(m) for m in resumed) == 1, "Hermes replays no old exchange"
    after = answered(again, server, f"lime-resumed {WORDS}", resumed, "lime-third answer")
    again.shutdown_memory_provider(again._session_messages)
    assert visible(engine, agent.session_id) == [key(m) for m in after]


def test_an_undone_turn_the_same_as_a_kept_one_leaves_the_transcript_at_exit(
    home: Path, server: Any, on_store: Any
) -> None:
    """The list at exit is taken for the conversation only when the database keeps every message of it active
    as many times as the list holds it: an ``/undo`` of a turn that says what an earlier one said (the
    same question, the same answer) is still followed, its copy off the visible transcript."""
    db, agent = fresh_agent(home, server, on_store)
    hist = answered(agent, server, f"date-again {WORDS}", None, "date-same answer")
    hist = answered(agent, server, f"date-again {WORDS}", hist, "date-same answer")
    kept = undo(agent, db, hist)
    assert len(kept) == 2 and [key(m) for m in kept] == [key(m) for m in hist[2:]]
    agent.shutdown_memory_provider(agent._session_messages)  # the undone copy in it
    assert visible(agent.context_compressor, agent.session_id) == [key(m) for m in kept]
