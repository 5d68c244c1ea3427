# ruff: noqa: F811  (the module-scoped fixtures of test_hermes, imported, are taken as parameters)
"""Review of session 42's saved-spelling change against the REAL Hermes Agent (hermes-agent==0.19.0, run by
`make test-hermes`). Each test runs on SQLite and PostgreSQL.

Hermes' gateway runs every turn on the history it reloads from its database, in its saved spelling (a
``<memory-context>`` block taken out, the text sent kept in ``api_content``; an image as ``[screenshot]``).
The adapter keeps the stored live message where the list holds that spelling, but found it anew at every
store of the list: each turn, recall tool call and request took a write transaction, read the stored row
of each such message and checked the form of every message after it, also with nothing new to write."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: hosting
from hosting import store_writes as writes
from test_hermes import _need_hermes, home, key, server  # noqa: F401
from test_hermes_retry_after_undo_s41 import answered, fresh_agent
from test_hermes_saved_spelling_s42 import PICTURE, TAGGED
from test_hermes_undo_review3 import WORDS, everything, on_store, visible  # noqa: F401

pytestmark = pytest.mark.hermes


@pytest.mark.parametrize("first", ["tagged", "picture", "quoted"])
def test_a_reloaded_history_holding_nothing_new_takes_no_write_transaction_each_time(
    home: Path, server: Any, on_store: Any, first: str
) -> None:
    """The history Hermes reloads from its database, stored again and again (each store of the gateway's
    list: the turn, a recall tool call, a request), takes one write transaction at most: the stored
    messages it holds in the saved spelling are learned once."""
    db, agent = fresh_agent(home, server, on_store)
    engine = agent.context_compressor
    ask: Any = {"tagged": TAGGED, "picture": PICTURE, "quoted": f"sw-how is recall marked? {WORDS}"}[first]
    hist = answered(agent, server, ask, None, "sw-it is wrapped in <memory-context> tags")
    hist = answered(agent, server, f"sw-next {WORDS}", hist, "sw-reply 1")
    reloaded = db.get_messages_as_conversation(agent.session_id, repair_alternation=True)
    assert [key(m) for m in reloaded] != [key(m) for m in hist], "the case did not arise"
    count = writes(engine)
    for _ in range(4):
        engine.on_turn_complete(copy.deepcopy(reloaded), session_id=agent.session_id)
    assert count[0] <= 1, f"{count[0]} write transactions for a history holding nothing new"
    assert visible(engine, agent.session_id) == [key(m) for m in hist]
    keys = everything(engine, agent.session_id)
    assert len(keys) == len(set(keys)) == len(hist), "messages were written again"
