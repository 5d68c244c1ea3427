# ruff: noqa: F811  (the module-scoped fixtures of test_hermes, imported, are taken as parameters)
"""Session switches in the REAL Hermes Agent (hermes-agent==0.19.0, run by `make test-hermes`): ``/new`` then
``/resume``, a CLI ``/branch`` and back, a subagent of an agent with a session database, and a restart on
the id a compression rotated to. Each store session is read whole (off-branch entries too): a message
stored twice, or in another Hermes session's store session, fails the check."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hermes import _need_hermes, home, key, make_agent, server  # noqa: F401

pytestmark = pytest.mark.hermes
WORDS = " ".join(["filler"] * 40)


def stored(engine: Any, hermes_session: str) -> list[str]:
    """Every message entry of the session's store lineage (off-branch ones too), by identity."""
    from transcript_store.hermes import is_context_message

    return [key(m) for m in engine.stored_messages(hermes_session) if not is_context_message(m)]


def session_db(home: Path) -> Any:
    from hermes_state import SessionDB

    return SessionDB(home / f"state-{uuid.uuid4().hex[:8]}.db")


def test_new_then_resume_keeps_each_conversation_once_in_its_own_store_session(home: Path, server: Any) -> None:
    """The CLI's ``/new`` and ``/resume`` (``agent.session_id`` set, ``reset_session_state()``)."""
    server.reset()
    db = session_db(home)
    agent = make_agent(server, db)
    engine = agent.context_compressor
    a = agent.session_id
    hist = None
    for i in range(2):
        hist = agent.run_conversation(f"apple{i} {WORDS}", conversation_history=hist)["messages"]
    b = f"new_{uuid.uuid4().hex[:6]}"
    agent.session_id = b
    agent.reset_session_state()
    bh = agent.run_conversation(f"banana0 {WORDS}", conversation_history=None)["messages"]
    agent.session_id = a
    agent.reset_session_state()
    hist = db.get_messages_as_conversation(a, repair_alternation=True)
    hist = agent.run_conversation(f"apple2 {WORDS}", conversation_history=hist)["messages"]
    agent.shutdown_memory_provider(hist)
    assert stored(engine, a) == [key(m) for m in hist]
    assert stored(engine, b) == [key(m) for m in bh]


def test_a_cli_branch_and_a_resume_of_its_parent_keep_their_own_turns(home: Path, server: Any) -> None:
    """What the CLI's ``/branch`` does to the session database and the agent, then ``/resume`` of the parent."""
    server.reset()
    db = session_db(home)
    agent = make_agent(server, db)
    engine = agent.context_compressor
    p = agent.session_id
    hist = None
    for i in range(2):
        hist = agent.run_conversation(f"pear{i} {WORDS}", conversation_history=hist)["messages"]
    assert hist is not None
    b = f"br_{uuid.uuid4().hex[:6]}"
    db.end_session(p, "branched")
    db.create_session(session_id=b, source="cli", model="fake-model",
                      model_config={"_branched_from": p}, parent_session_id=p)
    for m in hist:
        db.append_message(session_id=b, role=m.get("role", "user"), content=m.get("content"),
                          tool_calls=m.get("tool_calls"), tool_call_id=m.get("tool_call_id"))
    agent.session_id = b
    agent.reset_session_state()
    bh = agent.run_conversation(f"plum0 {WORDS}", conversation_history=list(hist))["messages"]
    agent.session_id = p
    agent.reset_session_state()
    ph = db.get_messages_as_conversation(p, repair_alternation=True)
    ph = agent.run_conversation(f"pear2 {WORDS}", conversation_history=ph)["messages"]
    agent.shutdown_memory_provider(ph)
    assert stored(engine, p) == [key(m) for m in ph]
    assert stored(engine, b) == [key(m) for m in bh]


def test_a_subagent_of_an_agent_with_a_session_database_stays_out_of_its_parent(home: Path, server: Any) -> None:
    """``delegate_task`` builds the child with the parent's session database and a parent link."""
    from fake_openai import Fault
    from run_agent import AIAgent

    server.reset()
    tag = f"rowan-{uuid.uuid4().hex[:6]}"  # the store may hold another module's subagents
    agent = AIAgent(
        base_url=server.base_url, api_key="test-key", model="fake-model", quiet_mode=True,
        enabled_toolsets=["context_engine", "delegation"], skip_context_files=True, skip_memory=True,
        session_db=session_db(home),
    )
    engine = agent.context_compressor
    engine.threshold_percent = 0.9  # no compaction: the delegation tools make a large system prompt
    engine.update_model(engine.model, 128000)
    hist = agent.run_conversation(f"elm-first {WORDS}")["messages"]
    call = {"id": "call_delegate", "type": "function", "function": {
        "name": "delegate_task", "arguments": json.dumps({"goal": f"{tag}: count the rowan berries"})}}
    server.queue(Fault(reply={"role": "assistant", "content": "", "tool_calls": [call]}))
    hist = agent.run_conversation("rowan-parent: please delegate", conversation_history=hist)["messages"]
    rt = engine.runtime()

    def child() -> list[str]:
        keys = [s.session_key for s in rt.store.list_sessions(engine.scope)
                if s.session_key and s.session_key != agent.session_id]
        return [k for s in keys for k in stored(engine, s) if k.startswith(f'["user", "{tag}')]

    deadline = time.monotonic() + 20  # delegate_task runs its subagent in the background
    while not child() and time.monotonic() < deadline:
        time.sleep(0.2)
    hist = agent.run_conversation(f"elm-last {WORDS}", conversation_history=hist)["messages"]
    agent.shutdown_memory_provider(hist)
    assert stored(engine, agent.session_id) == [key(m) for m in hist]
    assert len(child()) == 1, "the subagent's task never reached the store, or twice"


@pytest.mark.parametrize("in_place", [False, True])
def test_a_restart_on_the_id_a_compression_left_stores_nothing_twice(home: Path, server: Any, in_place: bool) -> None:
    """A new agent (a restarted process) resumes the session a compression rotated to (or kept)."""
    from run_agent import AIAgent

    server.reset()
    db = session_db(home)

    def agent_for(session_id: str | None) -> Any:
        made = AIAgent(base_url=server.base_url, api_key="test-key", model="fake-model", quiet_mode=True,
                       enabled_toolsets=["context_engine"], skip_context_files=True, skip_memory=True,
                       session_db=db, session_id=session_id)
        made.compression_in_place = in_place
        made.context_compressor.threshold_percent = 6000
        made.context_compressor.update_model(made.context_compressor.model, made.context_compressor.context_length)
        return made

    agent = agent_for(None)
    first = agent.session_id
    words = " ".join(["filler"] * 700)
    hist = None
    for i in range(8):
        hist = agent.run_conversation(f"fig{i} turn {i}. {words}", conversation_history=hist)["messages"]
    agent.shutdown_memory_provider(hist)
    assert agent.context_compressor.compression_count >= 1
    tip = agent.session_id
    assert (tip == first) == in_place
    again = agent_for(tip)
    hist = db.get_messages_as_conversation(tip, repair_alternation=True)
    for i in range(8, 11):
        hist = again.run_conversation(f"fig{i} turn {i}. {words}", conversation_history=hist)["messages"]
    again.shutdown_memory_provider(hist)
    keys = stored(again.context_compressor, tip)
    assert len(keys) == len(set(keys)), "a message was stored twice"
    for i in range(11):
        assert sum(k.startswith(f'["user", "fig{i} turn {i}.') for k in keys) == 1, i
