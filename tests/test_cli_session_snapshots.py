"""`sessions delete` and `sessions show` against writes of another connection landing mid-command: a delete
removes the session it looked up or nothing, a show prints one moment of the session. The other
connection's writes run from hooks the tests set in this process, so the command runs in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_cli import (  # noqa: F401 (_script_mode: autouse, honours real_script)
    SCOPE,
    SUBPROCESS,
    _script_mode,
    one_error_line,
    run,
    run_json,
)

from transcript_store import TranscriptStore
from transcript_store import cli as cli_module

pytestmark = pytest.mark.skipif(SUBPROCESS, reason="the hooks run in this process")


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


# ---------------------------------------------------------------------------------------------- delete


def _replace_after_lookup(monkeypatch: pytest.MonkeyPatch, store: TranscriptStore) -> list[str]:
    """After the command looks the session up, another connection deletes it and makes it again under the
    same id and key, with an entry of its own. Returns the list the hook notes each replacement in."""
    looked_up = cli_module.find_session
    done: list[str] = []

    def look_up_then_replace(s: TranscriptStore, scope: str, ref: str) -> Any:
        info = looked_up(s, scope, ref)
        if not done:
            done.append(info.session_id)
            store.delete_session(scope, info.session_id)
            store.create_session(scope, session_id=info.session_id, session_key=info.session_key)
            store.append(scope, info.session_id, _user("made again"))
        return info

    monkeypatch.setattr(cli_module, "find_session", look_up_then_replace)
    return done


@pytest.mark.parametrize("ref", ["s1", "agent:s1"])
def test_delete_spares_a_session_made_again_after_the_lookup(
    store: TranscriptStore, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ref: str
) -> None:
    """The delete looked the session up in one transaction and deleted by id in another: a session deleted
    and made again under the id in between (someone else's now) was deleted in its place, exit 0. It is
    deleted only if it is still the one looked up: else nothing is, exit 3, and the new one stays whole."""
    store.create_session(SCOPE, session_id="s1", session_key="agent:s1")
    store.append_many(SCOPE, "s1", [{"message": _user(f"old {i}")} for i in range(3)])
    done = _replace_after_lookup(monkeypatch, store)
    result = run("sessions", "delete", ref, "--yes", "--db", store_url, cwd=tmp_path, code=3)
    assert done == ["s1"]
    line = one_error_line(result)
    assert "s1" in line and "made again" in line and "nothing changed" in line, line
    survivor = store.get_session(SCOPE, "s1")
    assert survivor.entry_count == 1 and survivor.session_key == "agent:s1"
    assert [e.message for e in store.read_visible(SCOPE, "s1")] == [_user("made again")]


def test_delete_reports_the_entries_it_deleted(
    store: TranscriptStore, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries appended between the lookup and the delete are deleted with the session: the report counts
    them (it counted the entries of the lookup)."""
    store.create_session(SCOPE, session_id="s1")
    store.append(SCOPE, "s1", _user("one"))
    looked_up = cli_module.find_session

    def look_up_then_append(s: TranscriptStore, scope: str, ref: str) -> Any:
        info = looked_up(s, scope, ref)
        store.append(scope, info.session_id, _user("two"))
        return info

    monkeypatch.setattr(cli_module, "find_session", look_up_then_append)
    assert run_json("sessions", "delete", "s1", "--yes", "--db", store_url, cwd=tmp_path) == {
        "deleted": "s1", "entries": 2
    }
    assert store.list_sessions(SCOPE) == []
