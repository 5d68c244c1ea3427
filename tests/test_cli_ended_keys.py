"""A session key names its active session only: the CLI names the ended sessions that held a key it finds no
active session for, and the store lists them (``TranscriptStore.ended_sessions``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import (  # noqa: F401 (_script_mode: autouse, honours real_script)
    SCOPE,
    _script_mode,
    one_error_line,
    run,
)

from transcript_store import InvalidInput, TranscriptStore


def test_a_key_whose_sessions_all_ended_is_answered_with_their_ids(
    store: TranscriptStore, store_url: str, tmp_path: Path
) -> None:
    """``sessions export KEY`` of a key only ended sessions held said "unknown session 'KEY'" (exit 3) while
    ``sessions list`` showed the key: now the error names those sessions, latest ended first."""
    for sid in ("first", "second"):
        store.create_session(SCOPE, session_id=sid, session_key="agent:gone")
        store.append(SCOPE, sid, {"role": "user", "content": f"in {sid}"})
        store.end_session(SCOPE, sid)
    store.create_session(SCOPE, session_id="other", session_key="agent:other")
    store.end_session(SCOPE, "other")
    for command in (("sessions", "export", "agent:gone"), ("sessions", "show", "agent:gone")):
        result = run(*command, "--db", store_url, cwd=tmp_path, code=3)
        line = one_error_line(result)
        assert "unknown session 'agent:gone'" in line and "'second', 'first'" in line and "other" not in line, line
    # A key no session ever held is unknown as before, and the ended session's id still works.
    assert "ended sessions" not in one_error_line(run("sessions", "show", "agent:never", "--db", store_url,
                                                      cwd=tmp_path, code=3))
    run("sessions", "show", "second", "--db", store_url, cwd=tmp_path)


def test_ended_sessions_lists_a_scopes_ended_holders_of_a_key(store: TranscriptStore) -> None:
    """The store's answer: ended sessions only, of that scope and key, latest ended first, ``limit`` of them."""
    for sid in ("a1", "a2", "a3"):
        store.create_session(SCOPE, session_id=sid, session_key="k")
        store.end_session(SCOPE, sid)
    store.create_session(SCOPE, session_id="live", session_key="k")
    store.create_session("other-scope", session_id="b1", session_key="k")
    store.end_session("other-scope", "b1")
    assert [s.session_id for s in store.ended_sessions(SCOPE, "k")] == ["a3", "a2", "a1"]
    assert [s.session_id for s in store.ended_sessions(SCOPE, "k", limit=1)] == ["a3"]
    assert store.ended_sessions(SCOPE, "nobody") == []
    for bad in (0, 101, -1, True, "2"):
        with pytest.raises(InvalidInput):
            store.ended_sessions(SCOPE, "k", limit=bad)  # type: ignore[arg-type]
