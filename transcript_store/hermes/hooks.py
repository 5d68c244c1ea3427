"""hermes-agent's plugin hooks that store a turn the engine is not told of."""

from __future__ import annotations

import weakref
from typing import Any

from .runtime import _BOUND, _LIVE, _RUNTIME_LOCK, _TURN
from .sessions import saved_ask


def observe_turn(**kwargs: Any) -> None:
    """hermes-agent's ``post_llm_call`` plugin hook: store the finished turn through the engine copy of the
    agent that ran it (``on_turn_complete``), never raising into Hermes.

    hermes-agent 0.19.0 calls no context-engine method with the conversation after a turn, and its cron
    jobs and ``delegate_task`` subagents end with ``AIAgent.close()``, which calls no ``on_session_end``:
    their turns reached the store only when a compress or a recall tool ran first. The hook fires at the
    end of every turn with a reply (not an interrupted one), in the thread that made the turn's model
    calls, which marked the copy (``update_from_response``, ``should_compress``). A copy bound to
    another session id is not the turn's (Hermes' background review reuses the parent's id on an
    agent of its own: its review prompt is no turn of the conversation) and stores nothing.
    """
    ref = getattr(_TURN, "engine", None)
    _TURN.engine = None
    _TURN.live = None  # the turn finished: ``end_turn`` has nothing of it to store
    engine = ref() if isinstance(ref, weakref.ref) else None
    session_id = kwargs.get("session_id")
    history = kwargs.get("conversation_history")
    if engine is None or not isinstance(session_id, str) or not session_id or session_id != engine.session_id:
        return
    if isinstance(history, list) and history:
        engine.on_turn_complete(history, session_id=session_id)


def note_turn(**kwargs: Any) -> None:
    """hermes-agent's ``pre_llm_call`` plugin hook: keep the live conversation of the turn running on this
    thread (a reference to the list Hermes passes at the turn's start, its user message in it), for
    ``end_turn`` to store should the turn end unfinished; never raising into Hermes.

    An agent without a session database (a cron job, a ``delegate_task`` subagent, a program embedding
    ``AIAgent``) saves nothing ``end_turn`` could read, and Hermes' ``on_session_end`` hook passes no
    messages: a turn interrupted before its reply reached the store only with the agent's next turn,
    and with none (the agent closed after it) never. Not ``pre_api_request``, which would add the tool
    rounds of an interrupted turn: registered, it makes Hermes serialize every request whole for it."""
    session_id = kwargs.get("session_id")
    history = kwargs.get("conversation_history")
    if isinstance(session_id, str) and session_id and isinstance(history, list):
        _TURN.live = (session_id, history)


def end_turn(**kwargs: Any) -> None:
    """hermes-agent's ``on_session_end`` plugin hook, which ends every ``run_conversation``: after a turn
    interrupted or left unfinished, store what Hermes saved of the conversation in its session database,
    through the engine copy bound to its session id; never raising into Hermes.

    Such a turn fires no ``post_llm_call`` (``observe_turn``): its user message reached the store only with
    the conversation's next turn, compaction or session end, and for a cron job or a subagent (closed
    after its one run, or interrupted with its parent) never. Hermes saves the turn (its user message at
    the turn's start, the rest at its end) before it fires the hook, in every agent that has a session
    database; the read is the saved conversation, so the hook of an agent that saves nothing (Hermes'
    background review, which runs under its parent's id) stores nothing of its own. An agent without a
    session database has the live list its turn passed ``note_turn`` in this thread stored instead,
    through its engine copy (the one this thread's model calls marked, else the one last told a session
    in this thread, else the one following the id; none when that copy follows another id: another
    agent's turn). A finished turn was stored by ``observe_turn`` and reads nothing here.
    """
    live = getattr(_TURN, "live", None)
    ref = getattr(_TURN, "engine", None)
    _TURN.live = _TURN.engine = None  # the turn ended: nothing of it is kept for a later one
    if not kwargs.get("interrupted") and kwargs.get("completed", True):
        return
    session_id = kwargs.get("session_id")
    if not isinstance(session_id, str) or not session_id:
        return
    with _RUNTIME_LOCK:
        engine = _BOUND.get(session_id)
    db = engine._bound_db() if engine is not None else None
    if engine is not None and db is not None and engine.session_id == session_id:
        # The list the turn started with, its user message in it: a turn a CLI /retry sent again holds
        # no old exchange, which the database keeps active (``unretried``). Only a list whose user message
        # Hermes saved: the background review's (under its parent's id, its prompt never saved) is not the
        # turn's. Not "saved all of it": one answer the database saved otherwise (``sanitize_context``, a
        # multimodal tool result's summary) kept every later interrupted retry's old exchange visible.
        if isinstance(live, tuple) and live[0] == session_id and saved_ask(db, session_id, live[1]):
            engine._note_shown(session_id, live[1])
        mine = live[1] if isinstance(live, tuple) and live[0] == session_id else None
        engine._store_saved(db, session_id, engine._shown_of(session_id), mine)
        return
    # No session database: the live conversation this thread's turn passed its hooks (``note_turn``).
    if not isinstance(live, tuple) or live[0] != session_id:
        return
    marked = ref() if isinstance(ref, weakref.ref) else None
    if marked is None:
        # No model call of this turn answered (it failed or was interrupted before one did): the copy
        # last told a session in this thread is its agent's. Following another id, the turn is another
        # agent's: the background review, built in its own thread under an id of its own, runs under its
        # parent's id, and its harness prompt went into the parent's store session.
        told = getattr(_TURN, "told", None)
        marked = told() if isinstance(told, weakref.ref) else None
    with _RUNTIME_LOCK:
        engine = marked if marked is not None else _LIVE.get(session_id)
    # A copy following another id made this thread's model calls: another agent's turn (Hermes'
    # background review runs under its parent's id, its engine copy under an id of its own).
    if engine is None or engine.session_id != session_id or engine._bound_db() is not None:
        return
    engine.on_turn_complete(live[1], session_id=session_id)
