"""``outbox status`` reads its rows and its per-state counts in one snapshot: read in two, a turn enqueued
between them made it warn "the outbox holds N rows; showing the first M" of a listing that held every row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_cli import (  # noqa: F401 (_script_mode: autouse, honours real_script)
    SCOPE,
    SUBPROCESS,
    _script_mode,
    assistant,
    open_store,
    run,
    user,
)

from transcript_store import outbox
from transcript_store.turns import Turns


def test_a_turn_enqueued_while_the_status_reads_is_in_neither_its_rows_nor_its_counts(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if SUBPROCESS:
        pytest.skip("injects a write between the command's reads, in this process")
    with open_store(store_url) as store:
        turns = Turns(store)
        store.create_session(SCOPE, session_id="s0")
        turns.admit(SCOPE, "s0", user("hi"), turn_id="t1", engine_id="legacy")
        turns.complete(SCOPE, "s0", "t1", [{"message": assistant("hello")}], None)
        store.create_session(SCOPE, session_id="s1")
    listed = outbox.list_intents

    def then_another_turn(*args: Any, **kwargs: Any) -> Any:
        rows = listed(*args, **kwargs)
        with open_store(store_url) as other:  # another process's turn, committed while the status reads
            other_turns = Turns(other)
            other_turns.admit(SCOPE, "s1", user("hi"), turn_id="t2", engine_id="legacy")
            other_turns.complete(SCOPE, "s1", "t2", [{"message": assistant("hello")}], None)
        monkeypatch.setattr(outbox, "list_intents", listed)  # once
        return rows

    monkeypatch.setattr(outbox, "list_intents", then_another_turn)
    status = run("outbox", "status", "--json", "--db", store_url, cwd=tmp_path)
    assert [r["session_id"] for r in json.loads(status.stdout)] == ["s0"]
    assert "showing the first" not in status.stderr, status.stderr
    # The next status sees both, rows and counts.
    table = run("outbox", "status", "--db", store_url, cwd=tmp_path)
    assert table.stdout.strip().splitlines()[-1] == "2 accepted" and table.stderr == ""
