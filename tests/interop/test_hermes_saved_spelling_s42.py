# ruff: noqa: F811  (the module-scoped fixtures of test_hermes, imported, are taken as parameters)
"""Messages Hermes' session database saves in another spelling than the live list held them, against the
REAL Hermes Agent (hermes-agent==0.19.0, run by `make test-hermes`).

Hermes runs ``sanitize_context`` over user and assistant texts it loads (a ``<memory-context>`` tag the
user typed or an answer quoted is taken out; 0.19.0 keeps the text sent in the row's ``api_content``) and
saves a message with content parts (an image) as their text (``[screenshot]`` for an image). Wherever the
adapter stored from the database (a ``/resume``, ``/branch``, ``/retry``, the session end after an
``/undo``), the saved spelling replaced the live message in the visible transcript: the live one left the
active branch and every message after it was written again. Each test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hermes import _need_hermes, home, key, server  # noqa: F401
from test_hermes_retry_after_undo_s41 import answered, fresh_agent, retry
from test_hermes_retry_switch_s41 import assert_once, cli_for, other_session
from test_hermes_undo_review3 import WORDS, everything, on_store, undo, visible  # noqa: F401

pytestmark = pytest.mark.hermes

#: a user message carrying a ``<memory-context>`` block (pasted): Hermes' database hands it back without it
TAGGED = "ss-what does this say? <memory-context>recalled: the sky is green</memory-context> " + WORDS
#: a user message with an image part: Hermes' database keeps its text, the image as ``[screenshot]``
PICTURE = [{"type": "text", "text": "ss-what is in this picture?"},
           {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]


def differs(db: Any, agent: Any, hist: list[dict[str, Any]]) -> None:
    """The database's copy differs from the list Hermes holds (the case arose)."""
    saved = [key(m) for m in db.get_messages_as_conversation(agent.session_id)]
    assert saved != [key(m) for m in hist], "the case did not arise: the database saved the list as it is"


def assert_kept(engine: Any, hermes_session: str, shown: list[dict[str, Any]]) -> None:
    """The store session shows ``shown`` as Hermes held it, and holds nothing else: not a message twice, no
    saved spelling off the branch (nothing written again)."""
    assert_once(engine, hermes_session, shown)
    assert len(everything(engine, hermes_session)) == len(shown), "messages were written again off the branch"


@pytest.mark.parametrize("first", ["tagged", "picture", "quoted"])
def test_a_resume_of_another_session_keeps_what_hermes_showed(
    home: Path, server: Any, on_store: Any, first: str
) -> None:
    """A user message with a ``<memory-context>`` block, one with an image, or an answer quoting the tag,
    then ``/resume`` of another session: the session left shows the live messages, none written again."""
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    ask: Any = {"tagged": TAGGED, "picture": PICTURE, "quoted": f"ss-how is recall marked? {WORDS}"}[first]
    hist = answered(agent, server, ask, None, "ss-it is wrapped in <memory-context> tags")
    hist = answered(agent, server, f"ss-next {WORDS}", hist, "ss-reply 1")
    differs(db, agent, hist)
    left = agent.session_id
    assert_kept(engine, left, hist)
    cli_for(agent, db, hist)._handle_resume_command(f"/resume {other_session(db, 'ss-')}")
    assert_kept(engine, left, hist)


def test_a_branch_keeps_what_hermes_showed(home: Path, server: Any, on_store: Any) -> None:
    """``/branch`` after a user message with a ``<memory-context>`` block: the parent keeps the live list."""
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist = answered(agent, server, TAGGED, None, "sb-reply 0")
    hist = answered(agent, server, f"sb-next {WORDS}", hist, "sb-reply 1")
    differs(db, agent, hist)
    left = agent.session_id
    cli_for(agent, db, hist)._handle_branch_command("/branch")
    assert agent.session_id != left, "the case did not arise: no branch"
    assert_kept(engine, left, hist)


def test_the_session_end_after_an_undo_keeps_what_hermes_showed(home: Path, server: Any, on_store: Any) -> None:
    """A user message with a ``<memory-context>`` block, a later turn ``/undo`` takes back, then the exit: the
    kept turns as Hermes showed them, the undone one off the visible transcript (stored, once)."""
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist = answered(agent, server, TAGGED, None, "su-reply 0")
    hist = answered(agent, server, f"su-undone {WORDS}", hist, "su-undone reply")
    kept = undo(agent, db, hist)
    assert len(kept) == 2, "the case did not arise: nothing undone"
    differs(db, agent, kept)
    agent.shutdown_memory_provider(agent._session_messages)  # the CLI's exit, the undone turn in its list
    assert visible(engine, agent.session_id) == [key(m) for m in kept]
    keys = everything(engine, agent.session_id)
    assert len(keys) == len(set(keys)) == len(hist), "a message was written again"


@pytest.mark.parametrize("first", ["tagged", "quoted"])
def test_a_retry_then_a_resume_stores_the_retried_exchange_once_as_hermes_showed(
    home: Path, server: Any, on_store: Any, first: str
) -> None:
    """A user message with a ``<memory-context>`` block (or an answer quoting the tag), then ``/retry`` of a
    later turn and ``/resume`` of another session: the retried exchange once, the old one off the visible
    transcript, the first exchange as Hermes showed it."""
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    if first == "tagged":
        hist = answered(agent, server, TAGGED, None, "sr-reply 0")
    else:
        hist = answered(agent, server, f"sr-0 {WORDS}", None, "sr-it is wrapped in <memory-context> tags")
    hist = answered(agent, server, f"sr-ask {WORDS}", hist, "sr-first answer")
    message, before = retry(agent, hist)
    final = answered(agent, server, message, before, "sr-second answer")
    assert len(db.get_messages_as_conversation(agent.session_id)) == len(final) + 2, "the case did not arise"
    left = agent.session_id
    cli_for(agent, db, final)._handle_resume_command(f"/resume {other_session(db, 'sr-')}")
    shown = visible(engine, left)
    assert shown == [key(m) for m in final]
    keys = everything(engine, left)
    assert len(keys) == len(set(keys)) == len(final) + 1, "a message was written again"


@pytest.mark.parametrize("first", ["tagged", "picture", "quoted"])
def test_turns_on_a_history_reloaded_from_the_database_write_nothing_again(
    home: Path, server: Any, on_store: Any, first: str
) -> None:
    """Hermes' gateway runs every turn on the history it reloads from its database (the saved spelling of
    the earlier turns): the live messages the turn before stored stay visible, nothing written again."""
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    ask: Any = {"tagged": TAGGED, "picture": PICTURE, "quoted": f"sg-how is recall marked? {WORDS}"}[first]
    hist = answered(agent, server, ask, None, "sg-it is wrapped in <memory-context> tags")
    reloaded = db.get_messages_as_conversation(agent.session_id, repair_alternation=True)
    assert [key(m) for m in reloaded] != [key(m) for m in hist], "the case did not arise"
    answered(agent, server, f"sg-next {WORDS}", reloaded, "sg-reply 1")
    shown = visible(engine, agent.session_id)
    assert shown[:2] == [key(m) for m in hist]
    keys = everything(engine, agent.session_id)
    assert len(keys) == len(set(keys)) == 4, "messages were written again off the branch"


def test_an_interrupted_turn_keeps_what_hermes_showed(home: Path, server: Any, on_store: Any) -> None:
    """A user message with a ``<memory-context>`` block interrupted before its reply (the ``on_session_end``
    hook stores it from Hermes' database), then ``/resume`` of another session: the live message once,
    nothing written again."""
    from test_hermes import run_interrupted

    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist = answered(agent, server, f"si-0 {WORDS}", None, "si-reply 0")
    done = run_interrupted(agent, server, TAGGED, hist)["messages"]
    differs(db, agent, done)
    left = agent.session_id
    assert_kept(engine, left, done)
    cli_for(agent, db, done)._handle_resume_command(f"/resume {other_session(db, 'si-')}")
    assert_kept(engine, left, done)
