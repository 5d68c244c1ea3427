# ruff: noqa: F811  (the module-scoped fixtures of test_hermes, imported, are taken as parameters)
"""``/undo`` in the REAL Hermes Agent (hermes-agent==0.19.0, run by `make test-hermes`).

The CLI's own ``HermesCLI.undo_last`` runs (on an instance holding only what it reads): it truncates the
CLI's history, soft-deletes the undone rows in the session database (``rewind_to_message``, which counts
the rewind on the session's row) and tells memory providers, never the context engine. At exit the CLI
passes ``on_session_end`` the agent's ``_session_messages``, which /undo leaves holding the undone turn:
the store showed the undone turn to every later read and resume. Nothing is deleted: the undone turn
stays in the store, off the active branch, as Hermes keeps its rows (``active = 0``). Each test runs on
SQLite and on PostgreSQL (the engine copies of its agents use the ``store_url`` fixture's store)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hermes import _need_hermes, home, key, make_agent, server  # noqa: F401

pytestmark = pytest.mark.hermes
WORDS = " ".join(["filler"] * 40)


@pytest.fixture
def on_store(store_url: str) -> Iterator[Any]:
    """Puts an agent's engine copy on the test's store; every copy is released at the end (its database
    is dropped after)."""
    engines: list[Any] = []

    def put(agent: Any) -> Any:
        engine = agent.context_compressor
        engine.close()  # the plugin's configured store (the home's SQLite file), opened at agent start
        engine.db_url = store_url
        engines.append(engine)
        return agent

    yield put
    for engine in engines:
        engine.close()


def visible(engine: Any, hermes_session: str) -> list[str]:
    """The store session's visible transcript (what a resume or a read sees), by identity."""
    from transcript_store.hermes import is_context_message

    rt = engine.runtime()
    sid = engine._store_session(rt, hermes_session)
    return [key(e.message) for e in rt.store.read_visible(engine.scope, sid)
            if e.kind == "message" and e.message is not None and not is_context_message(e.message)]


def everything(engine: Any, hermes_session: str) -> list[str]:
    """Every message entry of the store session (off-branch ones too), by identity."""
    return [key(m) for m in engine.stored_messages(hermes_session)]


def undo(agent: Any, db: Any, history: list[dict[str, Any]], n: int = 1) -> list[dict[str, Any]]:
    """Hermes' own ``/undo n`` (``HermesCLI.undo_last``, no prompt buffer); the history it leaves."""
    from cli import HermesCLI

    cli = HermesCLI.__new__(HermesCLI)  # undo_last reads only these
    cli.conversation_history = list(history)
    cli._session_db = db
    cli.session_id = agent.session_id
    cli.agent = agent
    HermesCLI.undo_last(cli, n, prefill=False)
    return cli.conversation_history


def start(home: Path, server: Any, on_store: Any, tag: str, turns: int) -> tuple[Any, Any, list[dict[str, Any]]]:
    from hermes_state import SessionDB

    server.reset()
    db = SessionDB(home / f"state-{uuid.uuid4().hex[:8]}.db")
    agent = on_store(make_agent(server, db))
    hist: list[dict[str, Any]] | None = None
    for i in range(turns):
        hist = agent.run_conversation(f"{tag}{i} {WORDS}", conversation_history=hist)["messages"]
    assert hist is not None
    return agent, db, hist


@pytest.mark.parametrize("n", [1, 2, 3])
def test_undo_then_exit_leaves_the_undone_turns_off_the_visible_transcript(
    home: Path, server: Any, on_store: Any, n: int
) -> None:
    agent, db, hist = start(home, server, on_store, f"quince{n}-", 3)
    engine = agent.context_compressor
    kept = undo(agent, db, hist, n)
    assert len(kept) < len(hist) and (n < 3 or not kept)
    assert agent._session_messages[-1] == hist[-1]  # the list Hermes passes at exit: the undone turn in it
    agent.shutdown_memory_provider(agent._session_messages)  # the CLI's exit
    assert visible(engine, agent.session_id) == [key(m) for m in kept]
    assert not any(f"quince{n}-{3 - k} " in v for k in range(1, n + 1) for v in visible(engine, agent.session_id))
    # Nothing is deleted: the undone messages stay in the store, each once, off the active branch.
    all_keys = everything(engine, agent.session_id)
    assert sorted(all_keys) == sorted(key(m) for m in hist)
    # A later session end with the same stale list (the /new boundary, then exit) changes nothing.
    agent.shutdown_memory_provider(agent._session_messages)
    assert visible(engine, agent.session_id) == [key(m) for m in kept]
    assert everything(engine, agent.session_id) == all_keys


def test_a_resume_after_undo_and_exit_sees_only_what_the_user_kept(home: Path, server: Any, on_store: Any) -> None:
    """A new process resumes the session from Hermes' database: its turns follow the kept ones only."""
    from run_agent import AIAgent

    agent, db, hist = start(home, server, on_store, "medlar-", 3)
    kept = undo(agent, db, hist)
    agent.shutdown_memory_provider(agent._session_messages)
    again = on_store(AIAgent(base_url=server.base_url, api_key="test-key", model="fake-model", quiet_mode=True,
                    enabled_toolsets=["context_engine"], skip_context_files=True, skip_memory=True,
                    session_db=db, session_id=agent.session_id))
    resumed = db.get_messages_as_conversation(agent.session_id, repair_alternation=True)
    assert [key(m) for m in resumed] == [key(m) for m in kept]
    after = again.run_conversation(f"medlar-new {WORDS}", conversation_history=resumed)["messages"]
    again.shutdown_memory_provider(after)
    assert visible(again.context_compressor, agent.session_id) == [key(m) for m in after]


def test_turns_after_an_undo_are_kept_whatever_list_the_session_ends_with(
    home: Path, server: Any, on_store: Any
) -> None:
    """What the user did not undo (the turns before it, the ones after it) stays visible, once each."""
    agent, db, hist = start(home, server, on_store, "loquat-", 2)
    engine = agent.context_compressor
    kept = undo(agent, db, hist)
    hist2 = kept
    for i in range(2):
        hist2 = agent.run_conversation(f"loquat-after{i} {WORDS}", conversation_history=hist2)["messages"]
    agent.shutdown_memory_provider(agent._session_messages)
    assert visible(engine, agent.session_id) == [key(m) for m in hist2]
    keys = everything(engine, agent.session_id)
    assert len(keys) == len(set(keys)), "a message was stored twice"


def test_undo_then_a_switch_to_another_session_leaves_the_undone_turn_off_the_one_left(
    home: Path, server: Any, on_store: Any
) -> None:
    """``/undo`` then ``/resume`` of another conversation: Hermes ends none (no ``on_session_end``), the
    adapter stores what the database saved of the one left (``bind_session_state``)."""
    agent, db, hist = start(home, server, on_store, "sorb-", 3)
    engine = agent.context_compressor
    a = agent.session_id
    kept = undo(agent, db, hist)
    agent.session_id = f"other_{uuid.uuid4().hex[:6]}"
    agent.reset_session_state()
    other = agent.run_conversation(f"rowan-other {WORDS}", conversation_history=None)["messages"]
    agent.shutdown_memory_provider(other)
    assert visible(engine, a) == [key(m) for m in kept]
    assert visible(engine, agent.session_id) == [key(m) for m in other]


@pytest.mark.parametrize("in_place", [False, True])
def test_undo_after_a_compaction_keeps_the_lineage_and_drops_only_the_undone_turn(
    home: Path, server: Any, on_store: Any, in_place: bool
) -> None:
    """The database holds the compacted view (the adapter's answer) then the later turns: the lineage's
    transcript before the undone turn, compacted or not, stays visible."""
    from hermes_state import SessionDB

    server.reset()
    db = SessionDB(home / f"state-{uuid.uuid4().hex[:8]}.db")
    agent = on_store(make_agent(server, db))
    agent.compression_in_place = in_place
    engine = agent.context_compressor
    engine.threshold_percent = 6000
    engine.update_model(engine.model, engine.context_length)
    words = " ".join(["filler"] * 700)
    first = agent.session_id
    hist: list[dict[str, Any]] | None = None
    for i in range(8):
        hist = agent.run_conversation(f"yew{i} turn {i}. {words}", conversation_history=hist)["messages"]
    assert hist is not None and engine.compression_count >= 1
    assert (agent.session_id == first) == in_place
    before = visible(engine, agent.session_id)
    assert sum(v.startswith('["user", "yew7 turn 7.') for v in before) == 1
    kept = undo(agent, db, hist)
    assert kept and len(kept) < len(hist)
    agent.shutdown_memory_provider(agent._session_messages)
    after = visible(engine, agent.session_id)
    assert after == before[: len(after)] and len(after) < len(before)
    assert not any(v.startswith('["user", "yew7 turn 7.') for v in after)
    for i in range(7):
        assert sum(v.startswith(f'["user", "yew{i} turn {i}.') for v in after) == 1, i
