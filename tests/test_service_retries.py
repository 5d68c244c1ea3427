"""Paths and queries that are not UTF-8, on a real server process.

A path or query that percent-decodes to bytes that are not UTF-8 (``/v1/sessions/%FF``) was read with
each bad byte as U+FFFD and used: it reached, and wrote to, the session whose id holds that character.
It is 400 ``invalid_input`` now, on every route, before anything is read or written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from conftest import assistant, user
from service_process import ServiceProcess
from test_service import TOKEN_A, TOKENS
from workers.fault_worker import table_rows

from transcript_store import TranscriptStore

SCOPE = TOKENS[TOKEN_A]


@pytest.fixture
def server(store_url: str, tmp_path: Path) -> Any:
    with ServiceProcess(store_url, TOKENS, tmp_path / "serve.log") as proc:
        yield proc


def create(server: ServiceProcess, body: dict[str, Any], key: str | None, token: str = TOKEN_A) -> tuple[int, Any]:
    headers = {"Idempotency-Key": key} if key is not None else None
    return server.call("POST", "/v1/sessions", token, body, headers=headers)


def ids(store: TranscriptStore, scope: str = SCOPE) -> list[str]:
    return [s.session_id for s in store.list_sessions(scope)]


# ---------------------------------------------------------------------------------------------- not UTF-8


ODD = "\ufffd"  # what a byte that is not UTF-8 decoded to
#: percent-encoded bytes that are not UTF-8: a lone continuation byte, 0xFF, an overlong '/', a surrogate
BAD = ("%FF", "a%80b", "%C0%AF", "%ED%A0%80")


def test_a_path_that_is_not_utf8_reaches_no_session_and_writes_nothing(
    server: ServiceProcess, store: TranscriptStore
) -> None:
    for sid in (ODD, f"a{ODD}b", ODD * 2, ODD * 3):
        status, _ = create(server, {"session_id": sid}, None)
        assert status == 200
    turn = {"advancement_key": "K1", "admission": {"entry_id": "u1", "position": 0},
            "terminal": {"entry_id": "a1", "position": 1}, "messages": [user("q"), assistant("a")]}
    status, _ = server.call("POST", f"/v1/engines/legacy/sessions/{quote(ODD)}/commit_turn", TOKEN_A, turn)
    assert status == 200  # the session is reached by its id, percent-encoded as UTF-8
    before = table_rows(store)
    engine = "/v1/engines/legacy/sessions"
    routes: list[tuple[str, str, Any]] = [
        ("GET", "/v1/sessions/{}", None),
        ("POST", "/v1/sessions/{}/delta", {}),
        ("POST", "/v1/sessions/{}/entries", {"items": [{"message": user("stray")}]}),
        ("POST", "/v1/sessions/{}/admissions", {"message": user("stray"), "turn_id": "T1"}),
        ("GET", "/v1/engines/{}", None),
        ("GET", engine + "/{}/bootstrap", None),
        ("POST", engine + "/{}/bootstrap", {"page": {"entries": [{"entry_id": "h1", "message": user("x")}]}}),
        ("POST", engine + "/{}/assemble", {}),
        ("POST", engine + "/{}/compact", {}),
        ("POST", engine + "/{}/host_compaction", {"summary": "s", "first_kept_position": 0,
                                                 "first_kept_entry_id": "u1"}),
        ("POST", engine + "/{}/maintain", {}),
        ("POST", engine + "/{}/commit_turn", {**turn, "advancement_key": "K2"}),
        ("GET", engine + "/{}/receipts", None),
        ("GET", "/v1/engines/{}/sessions/" + quote(ODD) + "/receipts", None),
    ]
    for method, template, body in routes:
        for bad in BAD:
            path = template.format(bad)
            status, data = server.call(method, path, TOKEN_A, body)
            assert status == 400 and data["error"]["code"] == "invalid_input", (method, path, status, data)
            assert "UTF-8" in data["error"]["message"], data
            assert set(data["error"]) == {"code", "message"}
    # A token is still asked for first, as on every route.
    status, data = server.call("GET", "/v1/sessions/%FF", None)
    assert status == 401 and data["error"]["code"] == "unauthorized"
    assert table_rows(store) == before
    status, data = server.call("GET", f"/v1/sessions/{quote(ODD)}", TOKEN_A)
    assert status == 200 and data["session_id"] == ODD


def test_a_query_that_is_not_utf8_is_refused(server: ServiceProcess, store: TranscriptStore) -> None:
    status, _ = create(server, {"session_id": "holder", "session_key": ODD}, None)
    assert status == 200
    status, _ = create(server, {"session_id": ODD}, None)
    assert status == 200
    for query in ("session_key=%FF", "after=%FF", "session_key=a%C0%AFb", "%FF=1", "limit=10&after=%ED%A0%80"):
        for path in ("/v1/sessions", "/v1/engines/legacy/sessions/holder/receipts"):
            status, data = server.call("GET", f"{path}?{query}", TOKEN_A)
            assert status == 400 and data["error"]["code"] == "invalid_input", (path, query, data)
            assert "UTF-8" in data["error"]["message"], data
    # The same characters, sent as UTF-8, are read as they are.
    status, data = server.call("GET", f"/v1/sessions?session_key={quote(ODD)}", TOKEN_A)
    assert status == 200 and [s["session_id"] for s in data["sessions"]] == ["holder"]
    status, data = server.call("GET", f"/v1/sessions?after={quote('holder')}", TOKEN_A)
    assert status == 200 and [s["session_id"] for s in data["sessions"]] == [ODD]
