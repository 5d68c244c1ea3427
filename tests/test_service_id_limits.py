"""The service holds new ids to the store's byte limit, and answers any Content-Length in its JSON shape.

A session, key or advancement key the service creates is held to ``MAX_ID_BYTES`` like the library's
(``check_id(new=True)``): over it, a 400 that writes nothing, where a too-long key once reached the
receipts index and failed there (a 503 on PostgreSQL). One an earlier release stored longer is still
opened and replayed. A Content-Length of more digits than ``int`` reads is a 413, not a 500.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import assistant, user
from service_process import ServiceProcess
from test_faults_input_tokens import (
    app,  # noqa: F401 (fixture: the service's app in this process)
    asgi_exchange,
)
from test_service import TOKEN_A, TOKENS, commit, open_session

import transcript_store.core as core_module
from transcript_store import TranscriptStore
from transcript_store.service import Service
from transcript_store.service_app import DEFAULT_MAX_BODY
from transcript_store.service_models import CommitTurnRequest
from transcript_store.settings import load_settings

SCOPE = TOKENS[TOKEN_A]
#: 161 characters, 644 bytes of UTF-8: within MAX_ID_CHARS, just past MAX_ID_BYTES
WIDE = "\U0001f642" * 161
TURN = [user("q"), assistant("a")]
IDS = ("u1", "a1")  # short entry ids: only the id under test is long


@pytest.fixture
def server(store_url: str, tmp_path: Path) -> Any:
    with ServiceProcess(store_url, TOKENS, tmp_path / "serve.log") as proc:
        yield proc


def refused(status: int, data: Any, what: str) -> bool:
    return status == 400 and data["error"]["code"] == "invalid_input" and what in data["error"]["message"]


def test_a_new_id_past_640_bytes_is_a_400_that_writes_nothing(server: ServiceProcess, store: TranscriptStore) -> None:
    for body in (
        {"session_id": WIDE},
        {"session_id": "s-key", "session_key": WIDE},
        {"session_id": "s-rebind", "session_key": WIDE, "rebind_key": True},
    ):
        status, data = server.call("POST", "/v1/sessions", TOKEN_A, body)
        assert refused(status, data, "640 bytes"), (body, status, data)
    assert store.list_sessions(SCOPE) == []

    open_session(server, session_id="plain")
    status, data = commit(server, "legacy", "plain", WIDE, 0, TURN, ids=IDS)
    assert refused(status, data, "advancement_key"), (status, data)
    assert store.read_visible(SCOPE, "plain") == []  # the mirror took nothing either
    empty = (200, {"receipts": [], "next": None})
    assert server.call("GET", "/v1/engines/legacy/sessions/plain/receipts", TOKEN_A) == empty
    status, data = commit(server, "legacy", "plain", "k1", 0, TURN, ids=IDS)
    assert status == 200 and data["status"] == "committed", data


def test_ids_an_earlier_release_stored_longer_still_open_and_replay(
    store_url: str, store: TranscriptStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only what the service creates takes the limit: reopening a session by its id, and replaying a
    committed key, name what is already stored (the limit lifted here to store them)."""
    body = {"advancement_key": WIDE, "admission": {"entry_id": IDS[0], "position": 0},
            "terminal": {"entry_id": IDS[1], "position": 1}, "messages": TURN}
    monkeypatch.setattr(core_module, "MAX_ID_BYTES", 10_000)  # an earlier release
    store.create_session(SCOPE, session_id=WIDE, session_key=WIDE)
    store.create_session(SCOPE, session_id="plain")
    earlier = Service(store, load_settings(config_path=None, engine="legacy"))
    try:
        done = earlier.commit_turn(SCOPE, "legacy", "plain", CommitTurnRequest.model_validate(body))
        assert done.status == "committed"
    finally:
        earlier.runtime.dispose()
    monkeypatch.undo()
    with ServiceProcess(store_url, TOKENS, tmp_path / "serve.log") as server:
        assert open_session(server, session_id=WIDE, session_key=WIDE, rebind_key=True)["session_id"] == WIDE
        status, data = server.call("POST", "/v1/engines/legacy/sessions/plain/commit_turn", TOKEN_A, body)
        assert status == 200 and data["status"] == "duplicate", data


@pytest.mark.parametrize("length", [b"9" * 5000, b"1" + b"0" * 4300, b"9" * 20, b"%d" % (DEFAULT_MAX_BODY + 1)])
def test_a_content_length_of_any_digit_count_over_the_limit_is_a_413(app: Any, length: bytes) -> None:  # noqa: F811
    status, data = whoami(app, [(b"content-length", length)])
    assert status == 413 and data["error"]["code"] == "request_too_large", (status, data)


def test_a_content_length_with_thousands_of_leading_zeros_is_read_as_its_value(app: Any) -> None:  # noqa: F811
    status, data = whoami(app, [(b"authorization", b"Bearer tok-A_0123456789"), (b"content-length", b"0" * 5000)])
    assert (status, data) == (200, {"scope": "scope-a"})


def whoami(asgi_app: Any, headers: list[tuple[bytes, bytes]]) -> tuple[int, Any]:
    """One GET /v1/whoami through the ASGI app in this process: (status, JSON body)."""
    status, _headers, body = asgi_exchange(asgi_app, headers)
    return status, json.loads(body)
