# ruff: noqa: F811  (the module-scoped fixtures of test_hermes, imported, are taken as parameters)
"""Leaving a session after a CLI ``/retry`` in the REAL Hermes Agent (hermes-agent==0.19.0, `make test-hermes`).

The CLI's own ``HermesCLI.retry_last`` takes the last exchange out of its list and sends its user message
again, leaving the exchange's rows active in the session database: the database then holds
``[..., X, A_old, X, A_new]`` while Hermes shows ``[..., X, A_new]``. The CLI's own ``/resume`` and
``/branch`` handlers run here (on an instance holding only what they read): they tell the engine the switch
with ``bind_session_state`` alone, and the adapter stores the session it leaves from that database. So
did the ``on_session_end`` hook that ends an interrupted turn, and the session end after an ``/undo``
of a turn after the retry. Each stored the old exchange and the retried message again, in the visible
transcript beside the retried exchange. What the user saw when they left is the list Hermes held.
Each test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hermes import _need_hermes, home, key, run_interrupted, server  # noqa: F401
from test_hermes_retry_after_undo_s41 import answered, fresh_agent, retried, retry
from test_hermes_undo_review3 import WORDS, everything, on_store, undo, visible  # noqa: F401

pytestmark = pytest.mark.hermes


def cli_for(agent: Any, db: Any, history: list[dict[str, Any]]) -> Any:
    """A ``HermesCLI`` holding what its ``/resume`` and ``/branch`` read: the agent, its database, the
    list it shows (the screen's recap and the working directory left alone)."""
    from datetime import datetime

    from cli import HermesCLI

    cli = HermesCLI.__new__(HermesCLI)
    cli.agent, cli._session_db, cli.session_id = agent, db, agent.session_id
    cli.conversation_history = list(history)
    cli._pending_resume_sessions = cli._pending_title = None
    cli._resumed = False
    cli.model, cli.max_turns, cli.reasoning_config = agent.model, 90, None
    cli.session_start = datetime.now()
    cli._display_resumed_history = lambda: None
    cli._restore_session_cwd = lambda *_a, **_k: None
    return cli


def other_session(db: Any, tag: str) -> str:
    """A session of an earlier run in the same database, for ``/resume`` to switch to."""
    sid = f"other_{uuid.uuid4().hex[:8]}"
    db.create_session(session_id=sid, source="cli", model="fake-model")
    db.append_message(session_id=sid, role="user", content=f"{tag}other question {WORDS}")
    db.append_message(session_id=sid, role="assistant", content=f"{tag}other answer")
    db.end_session(sid, "cli_close")
    return sid


def assert_once(engine: Any, hermes_session: str, shown: list[dict[str, Any]]) -> None:
    """The store session shows ``shown`` and holds no message twice."""
    assert visible(engine, hermes_session) == [key(m) for m in shown]
    keys = everything(engine, hermes_session)
    assert len(keys) == len(set(keys)), "a message was stored twice"


@pytest.mark.parametrize("turn_between", [True, False])
@pytest.mark.parametrize("undo_first", [True, False])
def test_a_resume_of_another_session_after_a_retry_stores_what_hermes_showed(
    home: Path, server: Any, on_store: Any, undo_first: bool, turn_between: bool
) -> None:
    """``/resume`` of another session after a ``/retry``: the session left shows the retried exchange once;
    the resumed one gets its own turns."""
    tag = f"rs{int(undo_first)}{int(turn_between)}-"
    agent, db, final = retried(home, server, on_store, tag, undo_first, turn_between)
    engine = agent.context_compressor
    left = agent.session_id
    cli = cli_for(agent, db, final)
    other = other_session(db, tag)
    cli._handle_resume_command(f"/resume {other}")
    assert agent.session_id == other and cli.session_id == other
    assert_once(engine, left, final)
    there = answered(agent, server, f"{tag}there {WORDS}", cli.conversation_history, f"{tag}there answer")
    assert_once(engine, other, there)
    agent.shutdown_memory_provider(agent._session_messages)  # the CLI's exit
    assert_once(engine, left, final)
    assert_once(engine, other, there)


def test_a_resume_back_after_a_retry_follows_what_hermes_then_shows(
    home: Path, server: Any, on_store: Any
) -> None:
    """``/resume`` of the session left after the retry: Hermes replays its database (hermes-agent 0.19.0's
    CLI ``/retry`` left the old exchange's rows active), so it shows and sends the old exchange before the
    retried one; the store follows that list, having stored what the user saw when they left."""
    agent, db, final = retried(home, server, on_store, "rb-", False, True)
    engine = agent.context_compressor
    left = agent.session_id
    cli = cli_for(agent, db, final)
    cli._handle_resume_command(f"/resume {other_session(db, 'rb-')}")
    assert_once(engine, left, final)
    cli._handle_resume_command(f"/resume {left}")
    assert sum("rb-first answer" in key(m) for m in cli.conversation_history) == 1, "Hermes replays no old exchange"
    after = answered(agent, server, f"rb-back {WORDS}", cli.conversation_history, "rb-back answer")
    agent.shutdown_memory_provider(agent._session_messages)
    assert visible(engine, left) == [key(m) for m in after]


@pytest.mark.parametrize("undo_first", [True, False])
def test_a_branch_after_a_retry_leaves_the_parent_as_hermes_showed_it(
    home: Path, server: Any, on_store: Any, undo_first: bool
) -> None:
    """``/branch`` after a ``/retry``: the parent shows the retried exchange once, the branch (Hermes copies
    the list it shows into it) its own turns after it."""
    tag = f"br{int(undo_first)}-"
    agent, db, final = retried(home, server, on_store, tag, undo_first, True)
    engine = agent.context_compressor
    parent = agent.session_id
    cli = cli_for(agent, db, final)
    cli._handle_branch_command("/branch")
    branch = agent.session_id
    assert branch != parent and cli.session_id == branch
    assert_once(engine, parent, final)
    there = answered(agent, server, f"{tag}on the branch {WORDS}", cli.conversation_history, f"{tag}branch answer")
    assert_once(engine, branch, there)
    agent.shutdown_memory_provider(agent._session_messages)
    assert_once(engine, parent, final)
    assert_once(engine, branch, there)


@pytest.mark.parametrize("undo_first", [True, False])
def test_an_interrupted_retry_stores_what_hermes_showed(
    home: Path, server: Any, on_store: Any, undo_first: bool
) -> None:
    """The retried turn interrupted before its reply: the ``on_session_end`` hook ending it stores the list
    Hermes goes on with (the retried message, the old exchange off the visible transcript), and so does a
    ``/resume`` of another session after it."""
    tag = f"ir{int(undo_first)}-"
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist: list[dict[str, Any]] | None = None
    for i in range(3):
        hist = answered(agent, server, f"{tag}{i} {WORDS}", hist, f"{tag}reply {i}")
    assert hist is not None
    kept = undo(agent, db, hist) if undo_first else hist
    kept = answered(agent, server, f"{tag}between {WORDS}", kept, f"{tag}first answer")
    message, before = retry(agent, kept)
    done = run_interrupted(agent, server, message, before)["messages"]
    assert not any(f"{tag}first answer" in key(m) for m in done)
    saved = [key(m) for m in db.get_messages_as_conversation(agent.session_id)]
    assert sum(f"{tag}first answer" in k for k in saved) == 1, "the case did not arise: no old exchange saved"
    assert_once(engine, agent.session_id, done)
    left = agent.session_id
    cli = cli_for(agent, db, done)
    cli._handle_resume_command(f"/resume {other_session(db, tag)}")
    assert_once(engine, left, done)


def test_an_undo_after_a_retry_then_exit_stores_what_hermes_showed(
    home: Path, server: Any, on_store: Any
) -> None:
    """A turn after the retried one, ``/undo`` of it, exit: the session end follows the database (it counts a
    rewind, and the list at exit holds the undone turn); the old exchange the retry left there stays off
    the visible transcript."""
    agent, db, final = retried(home, server, on_store, "ux-", False, True)
    engine = agent.context_compressor
    later = answered(agent, server, f"ux-later {WORDS}", final, "ux-later answer")
    kept = undo(agent, db, later)
    assert [key(m) for m in kept] == [key(m) for m in final]
    agent.shutdown_memory_provider(agent._session_messages)  # the undone turn in it
    assert visible(engine, agent.session_id) == [key(m) for m in kept]


def test_a_message_sent_twice_and_a_retry_twice_leave_what_hermes_showed_at_a_switch(
    home: Path, server: Any, on_store: Any
) -> None:
    """The same message sent twice (the database and Hermes hold both exchanges) stays twice; a ``/retry``
    done twice leaves the last answer only. Then ``/resume`` of another session."""
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    hist = answered(agent, server, f"tw-0 {WORDS}", None, "tw-reply 0")
    hist = answered(agent, server, "tw-go on", hist, "tw-more 1")
    hist = answered(agent, server, "tw-go on", hist, "tw-more 2")  # sent twice, answered twice: both shown
    hist = answered(agent, server, f"tw-ask {WORDS}", hist, "tw-answer 1")
    for n in (2, 3):
        message, before = retry(agent, hist)
        hist = answered(agent, server, message, before, f"tw-answer {n}")
    saved = [key(m) for m in db.get_messages_as_conversation(agent.session_id)]
    assert len(saved) == len(hist) + 4, "the case did not arise: the retried exchanges are not saved"
    left = agent.session_id
    cli_for(agent, db, hist)._handle_resume_command(f"/resume {other_session(db, 'tw-')}")
    assert visible(engine, left) == [key(m) for m in hist]
    assert sum("tw-more" in k for k in visible(engine, left)) == 2
    # Each message as often as Hermes held it; the retried answers once each, off the visible transcript.
    retried_away = [key({"role": "assistant", "content": f"tw-answer {n}"}) for n in (1, 2)]
    assert Counter(everything(engine, left)) == Counter([key(m) for m in hist] + retried_away)
