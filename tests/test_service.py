"""`transcript-store serve` through a real server process, on SQLite and PostgreSQL.

One server per backend for the module (each test works in its own sessions), plus dedicated servers
for the tests that need their own settings: two instances behind one database, a small body limit,
an engine that raises. The OpenAPI document is fuzzed with schemathesis for a bounded time.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import psycopg
import pytest
from conftest import BACKENDS, RUN_ID, _admin_exec, pg_url
from service_process import ServiceProcess

from transcript_store import TranscriptStore
from transcript_store.engine import EngineInfo
from transcript_store.errors import InvalidInput, StorageFull
from transcript_store.service import TokenMap
from transcript_store.service_app import error_for

TOKEN_A = "token-a-0123456789abcdef"
TOKEN_B = "token-b-0123456789abcdef"
TOKENS = {TOKEN_A: "scope-a", TOKEN_B: "scope-b"}
ENGINES = ["legacy", "lossless"]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module", params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One database per backend for the module (a fresh SQLite file, or a fresh PostgreSQL database)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('svc') / 'service.db'}"
        return
    template = request.getfixturevalue("pg_template")
    name = f"ts_svc_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    _admin_exec(f"CREATE DATABASE {name} TEMPLATE {template}")
    try:
        yield pg_url(name)
    finally:
        _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="module")
def server(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(db_url, TOKENS, tmp_path_factory.mktemp("svclog") / "serve.log") as proc:
        yield proc


def open_session(server: ServiceProcess, token: str = TOKEN_A, **body: Any) -> dict[str, Any]:
    status, data = server.call("POST", "/v1/sessions", token, body)
    assert status == 200, data
    return dict(data)


def commit(
    server: ServiceProcess, engine: str, sid: str, key: str, start: int, messages: list[dict[str, Any]],
    token: str = TOKEN_A, ids: tuple[str, str] | None = None,
) -> tuple[int, Any]:
    adm, term = ids or (f"{key}-u", f"{key}-a")
    body = {
        "advancement_key": key,
        "admission": {"entry_id": adm, "position": start},
        "terminal": {"entry_id": term, "position": start + len(messages) - 1},
        "messages": messages,
    }
    return server.call("POST", f"/v1/engines/{engine}/sessions/{sid}/commit_turn", token, body)


# ---------------------------------------------------------------------------------------------- auth


def test_every_request_needs_a_known_token(server: ServiceProcess) -> None:
    for token in (None, "not-a-token"):
        for method, path in (("GET", "/v1/whoami"), ("GET", "/openapi.json"), ("POST", "/v1/sessions")):
            status, data = server.call(method, path, token, {})
            assert status == 401, (method, path, data)
            assert data["error"]["code"] == "unauthorized"
    status, data = server.call("GET", "/v1/whoami", TOKEN_A)
    assert (status, data) == (200, {"scope": "scope-a"})
    status, doc = server.call("GET", "/openapi.json", TOKEN_B)
    assert status == 200 and "/v1/engines/{engine}/sessions/{session_id}/commit_turn" in doc["paths"]
    assert doc["components"]["securitySchemes"]


def test_tokens_from_the_environment_split_at_the_last_equals_sign() -> None:
    padded = "c2VjcmV0LXRva2VuIQ=="  # base64 with '=' padding
    tokens = TokenMap.load(env=f" {padded}=openclaw , plain-token-0123=scope-b ")
    assert len(tokens) == 2
    assert tokens.scope_for(padded) == "openclaw"
    assert tokens.scope_for("plain-token-0123") == "scope-b"
    assert tokens.scope_for("c2VjcmV0LXRva2VuIQ") is None  # a prefix of the token opens nothing
    for bad in ("no-separator", "=openclaw", "token-0123=", "token-0123= ", "===", "tökén-0123=scope-a",
                "tok\x7fen-0123=scope-a"):
        with pytest.raises(InvalidInput):
            TokenMap.load(env=bad)


def test_a_tokens_file_saved_with_a_byte_order_mark_opens_its_first_token(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_bytes("\ufefffirst-token-0123 scope-a\nsecond-token-0123 scope-b\n".encode())
    tokens = TokenMap.load(path=str(path))
    assert tokens.scope_for("first-token-0123") == "scope-a" and tokens.scope_for("second-token-0123") == "scope-b"


# ---------------------------------------------------------------------------------------------- sessions


def test_sessions_appends_admissions_and_delta_reads(server: ServiceProcess) -> None:
    sid, key = new_id("s"), new_id("key")
    created = open_session(server, session_id=sid, session_key=key)
    assert created["session_id"] == sid and created["visible_count"] == 0
    assert open_session(server, session_id=sid, session_key=key)["session_id"] == sid  # idempotent
    assert open_session(server, session_key=key)["session_id"] == sid  # open by key
    status, listed = server.call("GET", f"/v1/sessions?session_key={key}", TOKEN_A)
    assert status == 200 and [s["session_id"] for s in listed["sessions"]] == [sid]

    items = [{"message": user("one"), "entry_id": "e1"}, {"message": assistant("two"), "entry_id": "e2"}]
    status, data = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A, {"items": items})
    assert status == 200 and [e["entry_id"] for e in data["entries"]] == ["e1", "e2"]
    status, again = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A, {"items": items})
    assert status == 200 and [e["seq"] for e in again["entries"]] == [0, 1]  # the stored ones

    status, admission = server.call(
        "POST", f"/v1/sessions/{sid}/admissions", TOKEN_A, {"message": user("three"), "turn_id": "t1"}
    )
    assert status == 200 and admission["anchor"]["position"] == 2

    status, page = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {"max_messages": 2})
    assert status == 200 and page["kind"] == "page" and page["has_more"]
    assert [e["entry_id"] for e in page["entries"]] == ["e1", "e2"]
    status, rest = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {"cursor": page["cursor"]})
    assert status == 200 and [e["message"]["content"] for e in rest["entries"]] == ["three"]
    # A fenced read never returns the admitted entry or anything after it.
    status, fenced = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {"fence": admission["anchor"]})
    assert status == 200 and [e["entry_id"] for e in fenced["entries"]] == ["e1", "e2"]
    status, reset = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {"cursor": "garbage"})
    assert status == 200 and reset == {"kind": "reset", "cursor": reset["cursor"], "reason": "invalid_cursor"}

    status, err = server.call("GET", f"/v1/sessions/{new_id('nope')}", TOKEN_A)
    assert status == 404 and err["error"]["code"] == "session_not_found"


def test_key_rebinding_ends_the_previous_holder(server: ServiceProcess) -> None:
    key = new_id("key")
    first = open_session(server, session_id=new_id("s"), session_key=key)
    status, err = server.call("POST", "/v1/sessions", TOKEN_A, {"session_id": new_id("s"), "session_key": key})
    assert status == 409 and err["error"]["code"] == "session_key_conflict"
    second = open_session(server, session_id=new_id("s"), session_key=key, rebind_key=True)
    status, old = server.call("GET", f"/v1/sessions/{first['session_id']}", TOKEN_A)
    assert status == 200 and old["active"] is False
    assert open_session(server, session_key=key)["session_id"] == second["session_id"]


# ---------------------------------------------------------------------------------------------- scope isolation


def test_a_token_never_reaches_another_scope(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid, session_key="shared-key")
    status, _ = commit(server, "legacy", sid, "k1", 0, [user("secret"), assistant("hidden")])
    assert status == 200
    status, admission = server.call(
        "POST", f"/v1/sessions/{sid}/admissions", TOKEN_A, {"message": user("next"), "turn_id": "t2"}
    )
    assert status == 200
    base = f"/v1/engines/legacy/sessions/{sid}"
    probes: list[tuple[str, str, Any]] = [
        ("GET", f"/v1/sessions/{sid}", None),
        ("POST", f"/v1/sessions/{sid}/delta", {}),
        ("POST", f"/v1/sessions/{sid}/entries", {"items": [{"message": user("x")}]}),
        ("POST", f"/v1/sessions/{sid}/admissions", {"message": user("x"), "turn_id": "t9"}),
        ("GET", f"{base}/bootstrap", None),
        ("POST", f"{base}/bootstrap", {"page": {"entries": [{"entry_id": "h1", "message": user("x")}]}}),
        ("POST", f"{base}/assemble", {}),
        ("POST", f"{base}/compact", {}),
        ("POST", f"{base}/maintain", {}),
        ("GET", f"{base}/receipts", None),
    ]
    for method, path, body in probes:
        status, data = server.call(method, path, TOKEN_B, body)
        assert status == 404 and data["error"]["code"] == "session_not_found", (method, path, data)
    status, data = commit(server, "legacy", sid, "k1", 0, [user("secret"), assistant("hidden")], token=TOKEN_B)
    assert status == 404 and data["error"]["code"] == "session_not_found"
    # Scope A's anchors are worth nothing to scope B, even on a session B owns under the same id.
    open_session(server, token=TOKEN_B, session_id=sid, session_key="shared-key")
    status, data = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_B, {"fence": admission["anchor"]})
    assert status == 404 and data["error"]["code"] == "session_not_found"
    status, page = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_B, {})
    assert status == 200 and page["entries"] == []
    status, listed = server.call("GET", "/v1/sessions?session_key=shared-key", TOKEN_B)
    assert [s["scope"] for s in listed["sessions"]] == ["scope-b"]
    status, receipts = server.call("GET", f"{base}/receipts", TOKEN_B)
    assert status == 200 and receipts["receipts"] == []


# ---------------------------------------------------------------------------------------------- the ledger


def receipt_pages(server: ServiceProcess, sid: str, limit: int | None, engine: str = "legacy") -> list[list[Any]]:
    """Every page of an engine's receipts over HTTP, following ``next`` (``limit`` None: the default)."""
    pages, after = [], None
    while True:
        query = {k: v for k, v in (("after", after), ("limit", limit)) if v is not None}
        path = f"/v1/engines/{engine}/sessions/{sid}/receipts"
        status, page = server.call("GET", f"{path}?{urlencode(query)}" if query else path, TOKEN_A)
        assert status == 200 and set(page) == {"receipts", "next"}, page
        assert len(page["receipts"]) <= (limit or 1000)
        pages.append(page["receipts"])
        if page["next"] is None:
            return pages
        after = page["next"]


def test_receipts_come_a_page_at_a_time(server: ServiceProcess) -> None:
    """``limit`` receipts a page, in advancement-key order; ``next`` leads to the next page and is null on
    the last; a receipt committed between two pages under a key after the cursor comes once, on a later
    page; no parameter: the first page of 1000 (the whole ledger of a short session, ``next`` null)."""
    sid = new_id("s")
    open_session(server, session_id=sid)
    # The cursor is a key: any id, characters the URL reserves included, percent-encoded.
    keys = [f"turn:{i} ' OR 1=1/?&#%+=;\u00e9\u65e5%2F%zz" for i in range(5)]
    for i, key in enumerate(keys[:3]):
        assert commit(server, "legacy", sid, key, 2 * i, [user(key), assistant("ok")])[1]["status"] == "committed"
    path = f"/v1/engines/legacy/sessions/{sid}/receipts"
    status, first = server.call("GET", f"{path}?limit=2", TOKEN_A)
    assert status == 200 and [r["advancement_key"] for r in first["receipts"]] == keys[:2] and first["next"]
    for i, key in enumerate(keys[3:], 3):
        assert commit(server, "legacy", sid, key, 2 * i, [user(key), assistant("ok")])[1]["status"] == "committed"
    status, second = server.call("GET", f"{path}?{urlencode({'after': first['next'], 'limit': 2})}", TOKEN_A)
    assert [r["advancement_key"] for r in second["receipts"]] == keys[2:4] and second["next"]
    status, last = server.call("GET", f"{path}?{urlencode({'after': second['next'], 'limit': 2})}", TOKEN_A)
    assert [r["advancement_key"] for r in last["receipts"]] == keys[4:] and last["next"] is None
    for limit in (1, 2, 4, 5, 10_000, None):
        pages = receipt_pages(server, sid, limit)
        assert [r["advancement_key"] for page in pages for r in page] == keys, limit
        assert len(pages) == (1 if limit is None else -(-len(keys) // limit)), limit
    assert receipt_pages(server, sid, None, engine="lossless") == [[]]


def test_a_bad_receipts_cursor_or_limit_is_refused(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    assert commit(server, "legacy", sid, "k1", 0, [user("q"), assistant("a")])[1]["status"] == "committed"
    path = f"/v1/engines/legacy/sessions/{sid}/receipts"
    status, before = server.call("GET", path, TOKEN_A)
    assert status == 200 and before["next"] is None
    for after in ("", "a\x00b", "a\nb", "\x7f", "k\x85"):
        for where in (path, "/v1/engines/legacy/sessions/no-such-session/receipts"):
            status, err = server.call("GET", f"{where}?{urlencode({'after': after})}", TOKEN_A)
            assert status == 400 and err["error"]["code"] == "invalid_input", (after, err)
    for query in ("limit=0", "limit=10001", "limit=-1", "limit=ten", "limit=1.5", "after=" + "1" * 300):
        status, err = server.call("GET", f"{path}?{query}", TOKEN_A)
        assert status == 422 and err["error"]["code"] == "invalid_request", (query, err)
    assert server.call("GET", path, TOKEN_A) == (200, before)
    status, doc = server.call("GET", "/openapi.json", TOKEN_A)
    route = doc["paths"]["/v1/engines/{engine}/sessions/{session_id}/receipts"]["get"]
    assert {"after", "limit"} <= {p["name"] for p in route["parameters"]}


def test_a_bad_sessions_cursor_is_refused_also_beside_a_session_key(server: ServiceProcess) -> None:
    """``GET /v1/sessions``'s ``after`` that is not an id is 400, as the README says: beside a
    ``session_key`` it was not looked at, and the request answered 200."""
    key = new_id("key")
    sid = open_session(server, session_key=key)["session_id"]
    for after in ("", "a\x00b", "a\nb", "\x7f"):
        for query in ({"after": after}, {"session_key": key, "after": after}):
            status, err = server.call("GET", f"/v1/sessions?{urlencode(query)}", TOKEN_A)
            assert status == 400 and err["error"]["code"] == "invalid_input", (query, err)
    status, found = server.call("GET", f"/v1/sessions?{urlencode({'session_key': key, 'after': 'a'})}", TOKEN_A)
    assert status == 200 and [s["session_id"] for s in found["sessions"]] == [sid]


@pytest.mark.parametrize("engine", ENGINES)
def test_commit_turn_committed_duplicate_collision(server: ServiceProcess, engine: str) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    turn = [user("hello"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "found"}, assistant("done")]
    status, first = commit(server, engine, sid, "turn-1", 0, turn)
    assert status == 200 and first["status"] == "committed"
    assert first["receipt"]["message_count"] == 4 and first["terminal"]["position"] == 3
    for _ in range(2):
        status, again = commit(server, engine, sid, "turn-1", 0, turn)
        assert status == 200 and again["status"] == "duplicate"
        assert again["receipt"] == first["receipt"]
    status, clash = commit(server, engine, sid, "turn-1", 0, [user("hello"), assistant("other"), *turn[2:]])
    assert status == 409 and clash["error"]["code"] == "advancement_key_collision"
    status, clash = commit(server, engine, sid, "turn-1", 0, turn[:2])
    assert status == 409 and clash["error"]["code"] == "advancement_key_collision"
    # The ledger's hash covers the admission and terminal entries: a replay naming others collides.
    for ids, start in ((("other-u", "other-a"), 0), (("turn-1-u", "other-a"), 0), (None, 7)):
        status, clash = commit(server, engine, sid, "turn-1", start, turn, ids=ids)
        assert status == 409 and clash["error"]["code"] == "advancement_key_collision", (ids, start, clash)
    status, second = commit(server, engine, sid, "turn-2", 4, [user("again"), assistant("sure")])
    assert status == 200 and second["status"] == "committed"

    status, receipts = server.call("GET", f"/v1/engines/{engine}/sessions/{sid}/receipts", TOKEN_A)
    assert [r["advancement_key"] for r in receipts["receipts"]] == ["turn-1", "turn-2"]
    status, page = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {})
    assert [e["message"] for e in page["entries"]] == [*turn, user("again"), assistant("sure")]  # each once
    status, assembled = server.call("POST", f"/v1/engines/{engine}/sessions/{sid}/assemble", TOKEN_A, {})
    assert status == 200 and assembled["estimated_tokens"] > 0
    assert assembled["messages"][-2:] == [user("again"), assistant("sure")]


@pytest.mark.parametrize("engine", ENGINES)
def test_an_assemble_prompt_or_tool_name_no_engine_could_store_is_a_400(server: ServiceProcess, engine: str) -> None:
    """The prompt and the tool names reached the engine (a third party's, perhaps) unchecked: NaN, a lone
    surrogate, nesting 900 deep, a message no chat API takes all answered 200."""
    sid = new_id("s")
    open_session(server, session_id=sid)
    path = f"/v1/engines/{engine}/sessions/{sid}/assemble"
    deep = '{"role": "user", "content": "x", "meta": ' + "[" * 900 + "]" * 900 + "}"
    for raw in (
        b'{"prompt": {"role": "user", "content": "x", "score": NaN}}',
        b'{"prompt": "pasted \\ud800 text"}',
        b'{"prompt": {"role": "robot", "content": "x"}}',
        ('{"prompt": ' + deep + "}").encode(),
        b'{"available_tools": ["lookup", "bad \\udc00 name"]}',
    ):
        status, data = server.call("POST", path, TOKEN_A, raw=raw, headers={"Content-Type": "application/json"})
        assert status == 400 and data["error"]["code"] in ("invalid_input", "invalid_message"), (raw[:60], data)
    status, data = server.call("POST", path, TOKEN_A, {"prompt": "plain words", "available_tools": ["lookup"]})
    assert status == 200, data


@pytest.mark.parametrize("engine", ENGINES)
def test_a_host_turn_committed_under_a_second_key_is_refused(server: ServiceProcess, engine: str) -> None:
    """The same host entries under another advancement key would reach the engine twice: the mirrored
    admission keeps the key it was first committed under (409 turn_key_conflict, nothing written)."""
    sid = new_id("s")
    open_session(server, session_id=sid)
    turn = [user("hello"), assistant("hi")]
    assert commit(server, engine, sid, "run-1", 0, turn, ids=("h-u", "h-a"))[1]["status"] == "committed"
    status, clash = commit(server, engine, sid, "run-2", 0, turn, ids=("h-u", "h-a"))
    assert status == 409 and clash["error"]["code"] == "turn_key_conflict", clash
    status, receipts = server.call("GET", f"/v1/engines/{engine}/sessions/{sid}/receipts", TOKEN_A)
    assert status == 200 and [r["advancement_key"] for r in receipts["receipts"]] == ["run-1"]
    assert commit(server, engine, sid, "run-1", 0, turn, ids=("h-u", "h-a"))[1]["status"] == "duplicate"


def test_commit_turn_past_the_mirror_is_behind(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    status, data = commit(server, "legacy", sid, "k", 3, [user("late"), assistant("reply")])
    assert status == 409 and data["error"] == {
        "code": "transcript_mirror", "reason": "behind", "message": data["error"]["message"]}
    status, data = commit(server, "legacy", sid, "k", 0, [user("late"), assistant("reply")])
    assert status == 200 and data["status"] == "committed"


def three_legacy_turns(server: ServiceProcess) -> tuple[str, str]:
    """A new session with three turns committed to the legacy engine (k0-k2: q0/a0 ... q2/a2); its id and
    the legacy engine's path of it."""
    sid = new_id("s")
    open_session(server, session_id=sid)
    for k in range(3):
        status, data = commit(server, "legacy", sid, f"k{k}", 2 * k, [user(f"q{k}"), assistant(f"a{k}")])
        assert status == 200, data
    return sid, f"/v1/engines/legacy/sessions/{sid}"


def test_a_host_compaction_is_what_the_legacy_engine_assembles(server: ServiceProcess) -> None:
    # OpenClaw's own compaction (which the plugin delegates to for the legacy engine) moves no message: a
    # marker in its transcript says where its summary stands. Without it the mirror assembled every
    # message the host had compacted, and an overflow recovery's retry overflowed again.
    sid, path = three_legacy_turns(server)

    def assemble() -> Any:
        status, data = server.call("POST", f"{path}/assemble", TOKEN_A, {"token_budget": 100000})
        assert status == 200, data
        return data

    assert assemble()["compacted_at_ms"] is None
    before = int(time.time() * 1000)
    status, data = server.call("POST", f"{path}/host_compaction", TOKEN_A,
                               {"summary": "they talked", "first_kept_position": 4, "first_kept_entry_id": "k2-u"})
    assert (status, data) == (200, {"first_kept_position": 4, "visible_count": 6}), data
    shown = assemble()
    head = "[Summary of the earlier conversation]\n"
    assert [m["content"] for m in shown["messages"]] == [f"{head}they talked", "q2", "a2"]
    assert before <= shown["compacted_at_ms"] <= int(time.time() * 1000) + 1
    # The same compaction told again (the plugin finds it in the host's transcript at each bootstrap of a
    # new process) keeps its time: recorded anew, replies since it lost their signed thinking.
    time.sleep(0.01)
    status, data = server.call("POST", f"{path}/host_compaction", TOKEN_A,
                               {"summary": "they talked", "first_kept_position": 4, "first_kept_entry_id": "k2-u"})
    assert (status, data) == (200, {"first_kept_position": 4, "visible_count": 6}), data
    assert assemble()["compacted_at_ms"] == shown["compacted_at_ms"]
    # Past the mirror's end: import first.
    status, data = server.call("POST", f"{path}/host_compaction", TOKEN_A,
                               {"summary": "s", "first_kept_position": 7, "first_kept_entry_id": "x"})
    assert status == 409 and data["error"]["reason"] == "behind", data
    for bad in ({"summary": " ", "first_kept_position": 1, "first_kept_entry_id": "x"},
                {"summary": "s", "first_kept_position": -1, "first_kept_entry_id": "x"},
                {"summary": "s", "first_kept_position": 1, "first_kept_entry_id": ""}):
        status, data = server.call("POST", f"{path}/host_compaction", TOKEN_A, bad)
        assert status in (400, 422), (bad, status, data)
    assert [m["content"] for m in assemble()["messages"]][1:] == ["q2", "a2"]  # refused calls changed nothing
    # A compaction inside a turn that kept only that turn: the summary alone, then the turn once committed.
    status, data = server.call("POST", f"{path}/host_compaction", TOKEN_A,
                               {"summary": "all of it", "first_kept_position": 6, "first_kept_entry_id": "k3-u"})
    assert status == 200, data
    assert [m["content"] for m in assemble()["messages"]] == [f"{head}all of it"]
    status, data = commit(server, "legacy", sid, "k3", 6, [user("q3"), assistant("a3")])
    assert status == 200, data
    assert [m["content"] for m in assemble()["messages"]][1:] == ["q3", "a3"]
    status, info = server.call("GET", f"/v1/sessions/{sid}", TOKEN_A)
    assert info["visible_count"] == 8  # every message where the host has it


def test_an_older_host_compaction_found_later_leaves_a_newer_compaction_in_place(server: ServiceProcess) -> None:
    # A new plugin process reads the host's transcript from its start and tells the service of the newest
    # compaction there. The service's own compaction since (the legacy engine's) was replaced by that older
    # one: its summary covered less, and the context grew back by what the newer one had compacted.
    sid = new_id("s")
    open_session(server, session_id=sid)
    for k in range(5):
        long = " and so on" * 40  # long enough that the legacy engine's summary shrinks the context
        status, data = commit(server, "legacy", sid, f"k{k}", 2 * k, [user(f"q{k}{long}"), assistant(f"a{k}{long}")])
        assert status == 200, data
    path = f"/v1/engines/legacy/sessions/{sid}"
    host_made = int(time.time() * 1000) - 60000  # a minute ago
    older = {"summary": "the host's", "first_kept_position": 2, "first_kept_entry_id": "k1-u",
             "compacted_ms": host_made}
    status, data = server.call("POST", f"{path}/host_compaction", TOKEN_A, older)
    assert (status, data) == (200, {"first_kept_position": 2, "visible_count": 10}), data
    status, data = server.call("POST", f"{path}/compact", TOKEN_A, {"force": True})
    assert status == 200 and data["compacted"] is True, data

    def shown() -> list[str]:
        status, data = server.call("POST", f"{path}/assemble", TOKEN_A, {"token_budget": 100000})
        assert status == 200, data
        return [m["content"] for m in data["messages"]]

    newer = shown()
    assert len(newer) == 7 and newer[0] != "[Summary of the earlier conversation]\nthe host's", newer
    status, data = server.call("POST", f"{path}/host_compaction", TOKEN_A, older)
    assert (status, data) == (200, {"first_kept_position": 4, "visible_count": 10}), data
    assert shown() == newer
    # A compaction the host made after it is recorded.
    later = {**older, "summary": "the host's, later", "compacted_ms": int(time.time() * 1000) + 1000}
    status, data = server.call("POST", f"{path}/host_compaction", TOKEN_A, later)
    assert status == 200 and shown()[0].endswith("the host's, later"), data


def test_a_host_compaction_naming_another_message_than_its_position_holds_is_refused(server: ServiceProcess) -> None:
    # The host names the first message its compaction kept by entry id and position. The service took the
    # mirror's message at the position whatever id it had: a position the mirror holds another message at
    # (the host's transcript moved under it) put the summary in front of messages the host never kept.
    sid, path = three_legacy_turns(server)
    for kept in ("k1-u", "elsewhere"):
        status, data = server.call("POST", f"{path}/host_compaction", TOKEN_A,
                                   {"summary": "s", "first_kept_position": 4, "first_kept_entry_id": kept})
        assert status == 409 and data["error"]["reason"] == "behind", (kept, status, data)
    status, data = server.call("POST", f"{path}/assemble", TOKEN_A, {"token_budget": 100000})
    assert status == 200 and data["compacted_at_ms"] is None and len(data["messages"]) == 6, data
    # A turn's middle message is mirrored without the host's id (a commit names only its two ends): there
    # the position is all there is to go by.
    middle = {"role": "assistant", "content": "thinking it over"}
    status, data = commit(server, "legacy", sid, "k3", 6, [user("q3"), middle, assistant("a3")])
    assert status == 200, data
    status, data = server.call("POST", f"{path}/host_compaction", TOKEN_A,
                               {"summary": "s", "first_kept_position": 7, "first_kept_entry_id": "host-middle"})
    assert (status, data) == (200, {"first_kept_position": 7, "visible_count": 9}), data
    status, data = server.call("POST", f"{path}/assemble", TOKEN_A, {"token_budget": 100000})
    assert [m["content"] for m in data["messages"]][1:] == ["thinking it over", "a3"], data


def test_a_host_compaction_keeping_only_its_turn_survives_the_turn_mirrored_under_a_derived_id(
    server: ServiceProcess,
) -> None:
    # A compaction inside a turn that kept only that turn names a message the mirror does not hold yet.
    # When the mirror then stores it under an id derived from the host's (the host's id is taken by a message
    # off the active branch), the pointer named an entry off the path and the summary vanished.
    sid = new_id("s")
    open_session(server, session_id=sid)
    base = f"/v1/engines/legacy/sessions/{sid}"

    def page(cursor: str | None, next_cursor: str, entries: list[tuple[str, dict[str, Any]]]) -> None:
        body = {"done": False, "page": {"cursor": cursor, "next_cursor": next_cursor,
                                        "entries": [{"entry_id": e, "message": m} for e, m in entries]}}
        status, data = server.call("POST", f"{base}/bootstrap", TOKEN_A, body)
        assert status == 200, data

    first = [(f"h{i}", user(f"m{i}")) for i in range(6)]
    page(None, "g1:7", [*first, ("h6", user("an answer the host took back"))])
    # The host's transcript was replaced (a reset): the mirror branches at position 5, "h6" stays off it.
    page(None, "g2:6", [*first[:5], ("h5b", user("m5 again"))])
    status, data = server.call("POST", f"{base}/host_compaction", TOKEN_A,
                               {"summary": "all of it", "first_kept_position": 6, "first_kept_entry_id": "h6"})
    assert (status, data) == (200, {"first_kept_position": 6, "visible_count": 6}), data
    page("g2:6", "g2:7", [("h6", user("the turn's question"))])
    status, data = server.call("POST", f"{base}/assemble", TOKEN_A, {"token_budget": 100000})
    assert status == 200, data
    head = "[Summary of the earlier conversation]\n"
    assert [m["content"] for m in data["messages"]] == [f"{head}all of it", "the turn's question"], data


def test_commit_turn_of_entries_the_client_appended(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    status, admission = server.call(
        "POST", f"/v1/sessions/{sid}/admissions", TOKEN_A, {"message": user("q"), "turn_id": "t1"}
    )
    status, data = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A, {"items": [{"message": assistant("a")}]})
    terminal_id = data["entries"][0]["entry_id"]
    body = {"advancement_key": "t1", "admission": admission["anchor"], "terminal": {"entry_id": terminal_id},
            "messages": [user("q"), assistant("a")]}
    status, data = server.call("POST", f"/v1/engines/lossless/sessions/{sid}/commit_turn", TOKEN_A, body)
    assert status == 200 and data["status"] == "committed"
    assert data["admission"]["entry_id"] == admission["anchor"]["entry_id"]
    body["messages"] = [user("q"), assistant("not what is stored")]
    body["advancement_key"] = "t1-other"
    status, data = server.call("POST", f"/v1/engines/lossless/sessions/{sid}/commit_turn", TOKEN_A, body)
    assert status == 409 and data["error"]["reason"] == "turn_mismatch"


# ---------------------------------------------------------------------------------------------- bootstrap


@pytest.mark.parametrize("engine", ENGINES)
def test_bootstrap_imports_host_pages_idempotently(server: ServiceProcess, engine: str) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid, session_key=new_id("k"))
    base = f"/v1/engines/{engine}/sessions/{sid}/bootstrap"
    host = [user("h0"), assistant("h1"), user("h2"), assistant("h3"), user("h4")]
    entries = [{"entry_id": f"host-{i}", "message": m} for i, m in enumerate(host)]
    status, state = server.call("GET", base, TOKEN_A)
    assert (status, state) == (200, {"cursor": None, "position": 0, "visible_count": 0})

    page1 = {"cursor": None, "next_cursor": "c2", "entries": entries[:2]}
    page2 = {"cursor": "c2", "next_cursor": "c5", "entries": entries[2:]}
    status, out = server.call("POST", base, TOKEN_A, {"page": page1, "done": False})
    assert status == 200 and (out["imported"], out["cursor"], out["position"]) == (2, "c2", 2)
    status, out = server.call("POST", base, TOKEN_A, {"page": page2, "done": True})
    assert status == 200 and (out["imported"], out["position"], out["visible_count"]) == (3, 5, 5)
    assert out["result"]["bootstrapped"] is True
    # A page read from a cursor the mirror no longer holds is refused; a re-import matches everything.
    status, err = server.call("POST", base, TOKEN_A, {"page": page2})
    assert status == 409 and err["error"]["reason"] == "cursor"
    status, out = server.call("POST", base, TOKEN_A, {"page": {**page1, "next_cursor": "x"}, "done": False})
    assert (out["imported"], out["matched"], out["rewound"]) == (0, 2, False)
    # The host rewrote its transcript from position 1: the mirror branches there.
    changed = [entries[0], {"entry_id": "host-1b", "message": assistant("h1 rewritten")}]
    status, out = server.call("POST", base, TOKEN_A, {"page": {"cursor": None, "next_cursor": "y",
                                                              "entries": changed}})
    assert status == 200 and (out["imported"], out["matched"], out["rewound"]) == (1, 1, True)
    status, page = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {})
    assert [e["message"]["content"] for e in page["entries"]] == ["h0", "h1 rewritten"]
    # The next turn lines up with the imported prefix.
    status, data = commit(server, engine, sid, "after", 2, [user("h2 again"), assistant("ok")])
    assert status == 200 and data["status"] == "committed"


# ---------------------------------------------------------------------------------------------- engines


def test_engine_descriptions_compaction_and_maintenance(server: ServiceProcess) -> None:
    status, listed = server.call("GET", "/v1/engines", TOKEN_A)
    assert {"legacy", "lossless"} <= {e["id"] for e in listed["engines"]}
    status, lossless = server.call("GET", "/v1/engines/lossless", TOKEN_A)
    assert lossless["durable"] and lossless["info"]["owns_compaction"] is True
    status, legacy = server.call("GET", "/v1/engines/legacy", TOKEN_A)
    assert legacy["durable"] and legacy["info"]["owns_compaction"] is False
    sid = new_id("s")
    open_session(server, session_id=sid)
    for method, path in (("GET", "/v1/engines/nope"), ("GET", f"/v1/engines/nope/sessions/{sid}/bootstrap"),
                         ("POST", f"/v1/engines/nope/sessions/{sid}/assemble"),
                         ("GET", f"/v1/engines/nope/sessions/{sid}/receipts")):
        status, err = server.call(method, path, TOKEN_A, {} if method == "POST" else None)
        assert status == 404 and err["error"]["code"] == "engine_not_found", (method, path, err)
    for i in range(12):
        status, _ = commit(server, "lossless", sid, f"k{i}", 2 * i, [user(f"question {i} " * 30),
                                                                      assistant(f"answer {i} " * 30)])
        assert status == 200
    for engine in ENGINES:
        status, result = server.call("POST", f"/v1/engines/{engine}/sessions/{sid}/compact", TOKEN_A,
                                     {"force": True, "token_budget": 2000})
        assert status == 200 and result["ok"] is True, result
        status, result = server.call("POST", f"/v1/engines/{engine}/sessions/{sid}/maintain", TOKEN_A, {})
        assert status == 200 and "changed" in result
    status, assembled = server.call("POST", f"/v1/engines/lossless/sessions/{sid}/assemble", TOKEN_A,
                                    {"token_budget": 3000})
    assert status == 200 and assembled["messages"] and assembled["estimated_tokens"] <= 3000


def test_a_compaction_reaches_pages_imported_without_done(server: ServiceProcess) -> None:
    """The OpenClaw plugin imports the host's pages (``done`` unset) and then compacts: the lossless
    engine, which compacts its own copy, must see those pages, not answer "no progress" on a long
    transcript it never ingested."""
    sid = new_id("s")
    open_session(server, session_id=sid, session_key=new_id("k"))
    host = [(user if i % 2 == 0 else assistant)(f"message {i} " * 60) for i in range(40)]
    page = {"cursor": None, "next_cursor": "c40", "entries": [{"entry_id": f"h{i}", "message": m}
                                                               for i, m in enumerate(host)]}
    status, out = server.call("POST", f"/v1/engines/lossless/sessions/{sid}/bootstrap", TOKEN_A,
                              {"page": page, "done": False})
    assert status == 200 and out["imported"] == 40
    status, result = server.call("POST", f"/v1/engines/lossless/sessions/{sid}/compact", TOKEN_A,
                                 {"force": True, "token_budget": 2000})
    assert status == 200 and result["ok"] is True, result
    assert result["tokens_before"] > 5000 and result["compacted"] is True, result


def lossless_rows(db_url: str, sid: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every lossless row of a session of scope-a (the engine's view state included)."""
    from sqlalchemy import select

    from engines.lossless.tables import context_items, messages, summaries, summary_children, summary_sources
    from transcript_store.ledger import get_state

    def run(c: Any) -> dict[str, list[tuple[Any, ...]]]:
        out = {t.name: sorted(tuple(r) for r in c.conn.execute(select(t).where(t.c.session_id == sid)))
               for t in (messages, summaries, summary_sources, summary_children, context_items)}
        out["view"] = [(json.dumps(get_state(c, "scope-a", sid, "lossless", "view"), sort_keys=True),)]
        return out

    with TranscriptStore(db_url) as store:
        return store.read(run)


@pytest.mark.parametrize("change", ["crossed", "rewritten"])
def test_a_fenced_compaction_writes_nothing_once_the_fence_no_longer_holds(
    server: ServiceProcess, db_url: str, change: str
) -> None:
    """A client compacting inside a running turn passes the turn's admission as ``fence``: only the
    import before the compaction was fenced. When it could not import (the engine's copy already held
    the admitted entry, "crossed", or the session was rewritten) the lossless engine compacted all the
    same, unfenced, its summaries perhaps covering the turn's own message. Its ``compact`` takes the
    fence now, as the host's compactions inside a turn give it: 409 ``read_fence``, nothing written."""
    sid = new_id("s")
    open_session(server, session_id=sid, session_key=new_id("k"))
    path = f"/v1/engines/lossless/sessions/{sid}"
    host = [(user if i % 2 == 0 else assistant)(f"message {i} " * 60) for i in range(40)]
    page = {"cursor": None, "next_cursor": "c40", "entries": [{"entry_id": f"h{i}", "message": m}
                                                               for i, m in enumerate(host)]}
    status, out = server.call("POST", f"{path}/bootstrap", TOKEN_A, {"page": page, "done": False})
    assert status == 200 and out["imported"] == 40
    status, admission = server.call("POST", f"/v1/sessions/{sid}/admissions", TOKEN_A,
                                    {"message": user("the running turn's question"), "turn_id": "T1"})
    assert status == 200, admission
    fence = admission["anchor"]
    status, assembled = server.call("POST", f"{path}/assemble", TOKEN_A, {"fence": fence, "token_budget": 100_000})
    assert status == 200 and len(assembled["messages"]) == 40  # the engine's copy: up to the fence
    if change == "crossed":  # an unfenced import (a bootstrap with no fence): the admitted entry too
        status, out = server.call("POST", f"{path}/bootstrap", TOKEN_A, {"done": True})
        assert status == 200 and out["result"]["bootstrapped"] is True, out
    else:
        with TranscriptStore(db_url) as store:
            store.rewrite_entries("scope-a", sid, [{"entry_id": "h0", "message": user("edited")}])
    before = lossless_rows(db_url, sid)
    status, err = server.call("POST", f"{path}/compact", TOKEN_A, {"force": True, "token_budget": 2000, "fence": fence})
    assert status == 409 and err["error"]["code"] == "read_fence" and err["error"]["reason"] == change, err
    assert lossless_rows(db_url, sid) == before  # no summary, no context item moved, no reset applied
    # Without a fence it compacts as before (a manual compaction between turns).
    status, result = server.call("POST", f"{path}/compact", TOKEN_A, {"force": True, "token_budget": 2000})
    assert status == 200 and result["compacted"] is True, result


# ---------------------------------------------------------------------------------------------- errors


def test_errors_are_json_with_stable_codes(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    cases: list[tuple[str, str, Any, int, str]] = [
        ("POST", f"/v1/sessions/{sid}/entries", {"items": [{"message": {"role": "user"}}]}, 400, "invalid_message"),
        ("POST", f"/v1/sessions/{sid}/entries", {"items": []}, 422, "invalid_request"),
        ("POST", "/v1/sessions", {"session_id": "bad\u0000id"}, 400, "invalid_input"),
        ("POST", "/v1/sessions", {"unknown": 1}, 422, "invalid_request"),
        ("GET", "/v1/nowhere", None, 404, "not_found"),
        ("DELETE", "/v1/whoami", None, 405, "method_not_allowed"),
        ("POST", f"/v1/sessions/{sid}/delta", {"max_messages": 0}, 422, "invalid_request"),
    ]
    for method, path, body, code, name in cases:
        status, data = server.call(method, path, TOKEN_A, body)
        assert status == code and data["error"]["code"] == name, (method, path, data)
        assert set(data["error"]) <= {"code", "message", "reason", "correlation_id"}
    status, data = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A, raw=b"{not json")
    assert status == 422 and data["error"]["code"] == "invalid_request"
    # Every body that is not JSON the service can read is 422 invalid_request, like malformed JSON
    # (these were 400: FastAPI's answer when json.loads fails other than with a JSONDecodeError).
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"items": "\xff\xfe"}', b'{"items": ' + b"9" * 5000 + b"}"):
        status, data = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A, raw=raw)
        assert status == 422 and data["error"]["code"] == "invalid_request", (raw[:20], data)


def test_the_openapi_document_lists_the_405_and_500_every_route_answers(server: ServiceProcess) -> None:
    """A method a known path does not take is 405 ``method_not_allowed``, and an unexpected error a 500
    ``internal_error`` with a correlation id, both in the error shape: the document listed neither."""
    status, doc = server.call("GET", "/openapi.json", TOKEN_A)
    assert status == 200
    error_body = {"$ref": "#/components/schemas/ErrorBody"}
    assert "correlation_id" in doc["components"]["schemas"]["ErrorDetail"]["properties"]
    sid = new_id("s")
    open_session(server, session_id=sid)
    operations = 0
    for path, ops in doc["paths"].items():
        for op in ops.values():
            operations += 1
            for code in ("405", "500"):
                response = op["responses"].get(code)
                assert response is not None, (path, code)
                assert response["content"]["application/json"]["schema"] == error_body, (path, code)
        concrete = path.replace("{engine}", "legacy").replace("{session_id}", sid)
        for method in ("PUT", "PATCH", "DELETE"):
            assert method.lower() not in ops
            status, data = server.call(method, concrete, TOKEN_A)
            assert status == 405 and data["error"]["code"] == "method_not_allowed", (method, path, data)
    assert operations >= 15


def test_a_body_sent_as_another_media_type_is_a_415_that_writes_nothing(server: ServiceProcess) -> None:
    """README's 415 ``unsupported_media_type``: was never answered. ``curl -d '{...}'`` sends
    application/x-www-form-urlencoded; the JSON body went unparsed and the answer was 422 "body: Input
    should be a valid dictionary", blaming a body that is a valid one."""
    sid = new_id("s")
    body = json.dumps({"session_id": sid}).encode()
    for media in ("application/x-www-form-urlencoded", "text/plain", "text/json", "application/jsonx",
                  "multipart/form-data"):
        status, data = server.call("POST", "/v1/sessions", TOKEN_A, raw=body, headers={"Content-Type": media})
        assert status == 415 and data["error"]["code"] == "unsupported_media_type", (media, data)
        assert "application/json" in data["error"]["message"]
    status, data = _bare_post(server, "/v1/sessions", body)  # no Content-Type: not read as JSON either
    assert status == 415 and data["error"]["code"] == "unsupported_media_type", data
    status, data = server.call("GET", f"/v1/sessions/{sid}", TOKEN_A)
    assert status == 404 and data["error"]["code"] == "session_not_found", data
    # JSON under any of its names is read; a body left out, or a query's own error, stays 422
    for media in ("application/json", "application/json; charset=utf-8", "application/merge-patch+json"):
        status, data = server.call("POST", "/v1/sessions", TOKEN_A, raw=body, headers={"Content-Type": media})
        assert status == 200 and data["session_id"] == sid, (media, data)
    status, data = _bare_post(server, f"/v1/engines/legacy/sessions/{sid}/maintain", b"")
    assert status == 422 and data["error"]["code"] == "invalid_request", data
    status, data = server.call("GET", "/v1/sessions?limit=0", TOKEN_A, headers={"Content-Type": "text/plain"})
    assert status == 422 and data["error"]["code"] == "invalid_request", data


def _bare_post(server: ServiceProcess, path: str, body: bytes) -> tuple[int, Any]:
    """A POST without any Content-Type header (the test client names JSON whenever it sends a body)."""
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=60)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Authorization", f"Bearer {TOKEN_A}")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_a_path_with_a_trailing_slash_is_no_route_not_a_redirect(server: ServiceProcess) -> None:
    """404 ``not_found`` as every path no route has: it was a bodiless 307 to the path without the slash,
    so a client that built ``/v1/sessions/`` + an empty id got the scope's session list (and
    ``/v1/engines/`` the engine list) instead of an error, and a POST followed it to another route."""
    sid = new_id("s")
    for method, path, body in (("GET", "/v1/sessions/", None), ("GET", "/v1/engines/", None),
                               ("GET", "/v1/whoami/", None), ("POST", "/v1/sessions/", {"session_id": sid}),
                               ("POST", f"/v1/sessions/{sid}/entries/", {"items": [{"message": user("x")}]})):
        status, data = server.call(method, path, TOKEN_A, body)
        assert status == 404 and data["error"]["code"] == "not_found", (method, path, status, data)
    status, data = server.call("GET", f"/v1/sessions/{sid}", TOKEN_A)
    assert status == 404 and data["error"]["code"] == "session_not_found", data


def test_request_bodies_over_the_limit_are_refused(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    big = {"items": [{"message": user("x" * (9 * 1024 * 1024))}]}
    status, data = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A, big)
    assert status == 413 and data["error"]["code"] == "request_too_large"
    # Without a Content-Length the limit holds while the body streams.
    status, data = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A, big, chunked=True)
    assert status == 413 and data["error"]["code"] == "request_too_large"
    status, page = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {})
    assert page["entries"] == []


def broken_engine(engine_id: str, assemble: str, commit_turn: str) -> str:
    """The source of a plugin engine declaring both guarantees whose two methods run the given lines."""
    return f"""
from transcript_store.engine import EngineInfo, TranscriptSemantics

class Broken:
    info = EngineInfo(id="{engine_id}", transcript_semantics=TranscriptSemantics(
        current_turn_fence="before-current-turn-entry-v1", turn_advancement_idempotency="atomic-idempotent-v1"))

    def __init__(self, ctx):
        pass

    def assemble(self, **kw):
        {assemble}

    def commit_turn(self, **kw):
        {commit_turn}

def create_engine(ctx):
    return Broken(ctx)
"""


def plugin_env(tmp_path: Path, engine_id: str, source: str) -> dict[str, str]:
    """A plugin folder holding ``source`` as engine ``engine_id``, and the environment that finds it."""
    plugin = tmp_path / "plugins" / engine_id
    plugin.mkdir(parents=True)
    (plugin / "plugin.yaml").write_text(f"name: {engine_id}\nentry: create_engine\n")
    (plugin / "__init__.py").write_text(source)
    return {"TRANSCRIPT_STORE_PLUGIN_DIRS": str(tmp_path / "plugins")}


EXPLODING = broken_engine("exploding", 'raise RuntimeError("secret internals at /etc/exploding")',
                          'raise RuntimeError("secret internals at /etc/exploding")')


def test_an_unavailable_store_answers_503_without_naming_the_database(
    pg_template: str, tmp_path: Path
) -> None:
    """PostgreSQL's messages name the server's host, port and database: the client is told the kind
    of failure and a correlation id, the server log the whole message. (SQLite's name no file; a
    server's pooled SQLite connection keeps even a deleted file open.)"""
    name = f"ts_gone_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    _admin_exec(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    try:
        with ServiceProcess(pg_url(name), TOKENS, tmp_path / "serve.log",
                            env={"TRANSCRIPT_STORE_RETRY_ATTEMPTS": "1"}) as server:
            sid = new_id("s")
            open_session(server, session_id=sid)
            _admin_exec(f"DROP DATABASE {name} WITH (FORCE)")
            status, data = server.call("GET", f"/v1/sessions/{sid}", TOKEN_A)
            assert status == 503 and data["error"]["code"] == "store_unavailable", data
            text = json.dumps(data)
            assert name not in text and "127.0.0.1" not in text and "5432" not in text, text
            # The pooled connection was terminated (a transient error); a new one cannot connect.
            assert data["error"]["message"] in (
                "transient database error; see the server log", "cannot connect to the database; see the server log"
            ), data
            status, data = server.call("GET", f"/v1/sessions/{sid}", TOKEN_A)
            assert status == 503 and name not in json.dumps(data), data
            assert data["error"]["message"] == "cannot connect to the database; see the server log", data
            cid = data["error"]["correlation_id"]
            deadline = time.monotonic() + 30
            while cid not in server.log() and time.monotonic() < deadline:
                time.sleep(0.1)
            line = next(x for x in server.log().splitlines() if cid in x)
            assert "store_unavailable" in line and name in line, line
    finally:
        _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_missing_grant_and_a_full_disk_have_their_own_503_codes(pg_template: str, tmp_path: Path) -> None:
    """A role the database refuses is not an outage a client should wait out: the code says so (the
    message, as for any database failure, names no table, host or database)."""
    name = f"ts_ro_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    role = f"ts_svc_ro_{uuid.uuid4().hex[:8]}"
    _admin_exec(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    try:
        _admin_exec(f"CREATE ROLE {role} LOGIN")
        with psycopg.connect(pg_url(name).replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")  # reads only
        url = pg_url(name).replace("postgres@", f"{role}@", 1)
        with ServiceProcess(url, TOKENS, tmp_path / "serve.log") as server:
            status, data = server.call("POST", "/v1/sessions", TOKEN_A, {"session_id": new_id("s")})
            assert status == 503 and data["error"]["code"] == "store_permission_denied", data
            assert data["error"]["message"] == "database permission denied; see the server log", data
            assert "ts_sessions" not in json.dumps(data) and name not in json.dumps(data), data
    finally:
        _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        _admin_exec(f"DROP ROLE IF EXISTS {role}")
    assert error_for(StorageFull("database storage is full: x")) == (503, "store_full")


def test_internal_errors_hide_the_traceback_and_log_a_correlation_id(tmp_path: Path) -> None:
    env = plugin_env(tmp_path, "exploding", EXPLODING)
    with ServiceProcess(f"sqlite:///{tmp_path / 's.db'}", TOKENS, tmp_path / "serve.log", env=env,
                        extra_args=("--max-body", "4096")) as server:
        sid = new_id("s")
        open_session(server, session_id=sid)
        status, data = server.call("POST", f"/v1/engines/exploding/sessions/{sid}/assemble", TOKEN_A, {})
        assert status == 500 and data["error"]["code"] == "internal_error"
        text = json.dumps(data)
        assert "secret" not in text and "Traceback" not in text
        cid = data["error"]["correlation_id"]
        status, data = commit(server, "exploding", sid, "k", 0, [user("q"), assistant("a")])
        assert status == 500 and data["error"]["correlation_id"] != cid
        status, page = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {})
        assert page["entries"] == []  # the failed commit wrote nothing
        status, data = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A,
                                   {"items": [{"message": user("y" * 5000)}]})
        assert status == 413 and data["error"]["code"] == "request_too_large"
        deadline = time.monotonic() + 30
        while cid not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = server.log()
        assert cid in log and "Traceback" in log and "secret internals" in log


MISSHAPEN = broken_engine("misshapen", 'return {"messages": "secret not a list", "estimated_tokens": -1}',
                          'raise ValueError("secret internals of a bug")')


def test_an_engines_value_error_is_the_servers_fault_not_the_requests(db_url: str, tmp_path: Path) -> None:
    """An engine raising ValueError, or returning a result that does not validate (pydantic's error is a
    ValueError), answered 400 invalid_input with the engine's message: the client was blamed, the
    internals shown, and nothing logged. It is a 500 with a correlation id, as any engine bug."""
    env = plugin_env(tmp_path, "misshapen", MISSHAPEN)
    with ServiceProcess(db_url, TOKENS, tmp_path / "serve.log", env=env) as server:
        sid = open_session(server)["session_id"]
        status, data = server.call("POST", f"/v1/engines/misshapen/sessions/{sid}/assemble", TOKEN_A, {})
        assert status == 500 and data["error"]["code"] == "internal_error", data
        assert "secret" not in json.dumps(data)
        status, data = commit(server, "misshapen", sid, "k", 0, [user("q"), assistant("a")])
        assert status == 500 and data["error"]["code"] == "internal_error", data
        assert "secret" not in json.dumps(data)
        status, page = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {})
        assert status == 200 and page["entries"] == []  # the failed commit wrote nothing
    assert "secret internals of a bug" in server.log()


WRONG_RESULT = broken_engine("wrong-result", "return {}", 'return {"status": "committed"}')


def test_a_commit_turn_result_breaking_the_contract_is_refused_and_writes_nothing(
    db_url: str, tmp_path: Path
) -> None:
    """An engine's commit_turn returning something other than a CommitResult was found out after the
    transaction committed: the answer was a 500, and the turn stood mirrored all the same. It is refused
    inside the transaction now (409 ``engine_contract``) and the mirror holds nothing of it."""
    env = plugin_env(tmp_path, "wrong-result", WRONG_RESULT)
    with ServiceProcess(db_url, TOKENS, tmp_path / "serve.log", env=env) as server:
        sid = open_session(server)["session_id"]
        status, data = commit(server, "wrong-result", sid, "k", 0, [user("q"), assistant("a")])
        assert status == 409 and data["error"]["code"] == "engine_contract", data
        status, page = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {})
        assert status == 200 and page["entries"] == [], page


# ---------------------------------------------------------------------------------------------- fleets


def test_two_instances_behind_one_database_commit_once(db_url: str, tmp_path: Path) -> None:
    with (ServiceProcess(db_url, TOKENS, tmp_path / "one.log") as one,
          ServiceProcess(db_url, TOKENS, tmp_path / "two.log") as two):
        sid = new_id("s")
        open_session(one, session_id=sid)
        assert two.call("GET", f"/v1/sessions/{sid}", TOKEN_A)[0] == 200
        results: list[tuple[int, Any]] = []
        turn = [user("race"), assistant("won")]

        def attempt(server: ServiceProcess) -> None:
            results.append(commit(server, "lossless", sid, "racing-key", 0, turn))

        threads = [threading.Thread(target=attempt, args=(s,)) for s in (one, two, one, two)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        statuses = sorted(data["status"] for status, data in results if status == 200)
        assert len(results) == 4 and statuses == ["committed", "duplicate", "duplicate", "duplicate"], results
    with TranscriptStore(db_url) as store:
        assert [e.message for e in store.read_visible(TOKENS[TOKEN_A], sid)] == turn


# ---------------------------------------------------------------------------------------------- fuzzing


# 3 examples per operation, mode and pinning in make test, 5 in make test-slow (CI time).
@pytest.mark.parametrize("examples", [3, pytest.param(5, marks=pytest.mark.slow)])
def test_fuzzing_the_openapi_document_finds_no_server_error(server: ServiceProcess, examples: int) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    status, doc = server.call("GET", "/openapi.json", TOKEN_A)
    assert status == 200
    schema = schemathesis.openapi.from_dict(doc)
    sid = new_id("fuzz")
    open_session(server, session_id=sid, session_key=new_id("fuzz-key"))
    commit(server, "legacy", sid, "seed", 0, [user("seed"), assistant("seeded")])
    headers = {"Authorization": f"Bearer {TOKEN_A}"}
    failures: list[str] = []
    statuses: list[int] = []
    deadline = time.monotonic() + 30
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    for operation in operations:
        params = {}
        names = {p.name for p in operation.path_parameters}
        if "session_id" in names:
            params["session_id"] = sid
        if "engine" in names:
            params["engine"] = "legacy"
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            for pinned in ({}, params):
                if time.monotonic() > deadline:
                    break
                strategy = operation.as_strategy(mode, path_parameters=pinned or None)

                @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=strategy)
                def run(case: Any) -> None:
                    response = case.call(base_url=server.url, headers=headers, timeout=30)
                    statuses.append(response.status_code)
                    if response.status_code >= 500:
                        failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                        f"{response.text[:300]}")
                    elif response.status_code >= 400:
                        assert response.json()["error"]["code"]

                run()
    assert not failures, "\n".join(failures[:10])
    assert len(statuses) >= 100 and any(s < 300 for s in statuses), statuses


# ---------------------------------------------------------------------------------------------- review findings


@pytest.mark.parametrize("engine", ENGINES)
def test_a_nul_character_in_a_message_commits_and_assembles(server: ServiceProcess, engine: str) -> None:
    """U+0000 is legal JSON text (a binary tool output): the lossless engine's own text columns cannot hold
    it on PostgreSQL, and every commit of the turn failed as 'store unavailable' (503), for good."""
    sid = new_id("s")
    open_session(server, session_id=sid)
    tool = {"role": "tool", "tool_call_id": "c1", "content": "bin\u0000ary"}
    turn = [user("read it"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "cat\u0000", "arguments": "{}"}}]}, tool, assistant("ok")]
    status, done = commit(server, engine, sid, "nul-1", 0, turn)
    assert status == 200 and done["status"] == "committed", done
    status, assembled = server.call("POST", f"/v1/engines/{engine}/sessions/{sid}/assemble", TOKEN_A, {})
    assert status == 200 and tool in assembled["messages"], assembled
    status, page = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {})
    assert status == 200 and page["entries"][2]["message"] == tool


def test_out_of_range_anchors_and_bad_path_ids_are_400s(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    status, admission = server.call(
        "POST", f"/v1/sessions/{sid}/admissions", TOKEN_A, {"message": user("q"), "turn_id": "t1"}
    )
    assert status == 200
    for field, value in (("seq", 2**63), ("seq", 2**40), ("position", -5), ("generation", 2**62)):
        fence = {**admission["anchor"], field: value}
        for engine in ENGINES:
            status, err = server.call("POST", f"/v1/engines/{engine}/sessions/{sid}/assemble", TOKEN_A,
                                      {"fence": fence})
            assert status == 400 and err["error"]["code"] == "invalid_input", (engine, field, err)
    for path in ("bootstrap", "receipts"):
        status, err = server.call("GET", f"/v1/engines/lossless/sessions/a%00b/{path}", TOKEN_A)
        assert status == 400 and err["error"]["code"] == "invalid_input", (path, err)


def test_bootstrap_cursors_must_be_printable_and_bounded(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    for bad in ("c\u0000", "c\u0001", "x" * 5000):
        page = {"cursor": None, "next_cursor": bad, "entries": [{"entry_id": "h0", "message": user("hi")}]}
        status, err = server.call("POST", f"/v1/engines/lossless/sessions/{sid}/bootstrap", TOKEN_A,
                                  {"page": page, "done": False})
        assert 400 <= status < 500, (bad[:10], err)
    status, state = server.call("GET", f"/v1/engines/lossless/sessions/{sid}/bootstrap", TOKEN_A)
    assert status == 200 and state["cursor"] is None and state["visible_count"] == 0  # nothing written


def test_an_ended_session_never_takes_its_key_back(server: ServiceProcess) -> None:
    """Rebinding a key to a session that has ended ended the live holder and left the key to nobody (a
    late replay of an old host session): the ended session is answered as it is, the holder keeps the
    key, and a commit of the late replay still lands in the old session."""
    key = new_id("key")
    first = open_session(server, session_id=new_id("s"), session_key=key, rebind_key=True)
    second = open_session(server, session_id=new_id("s"), session_key=key, rebind_key=True)
    again = open_session(server, session_id=first["session_id"], session_key=key, rebind_key=True)
    assert again["session_id"] == first["session_id"] and again["active"] is False
    status, live = server.call("GET", f"/v1/sessions/{second['session_id']}", TOKEN_A)
    assert status == 200 and live["active"] is True
    assert open_session(server, session_key=key)["session_id"] == second["session_id"]
    status, done = commit(server, "legacy", first["session_id"], "late-1", 0, [user("late"), assistant("reply")])
    assert status == 200 and done["status"] == "committed"


def test_new_sessions_rebinding_one_key_at_once_all_succeed(server: ServiceProcess) -> None:
    """Eight new sessions rebinding one key concurrently: each is answered (the last one holds the key),
    none with a conflict (PostgreSQL's unique index refused the later insert of a race)."""
    key = new_id("key")
    results: list[tuple[int, Any]] = []

    def rebind() -> None:
        results.append(server.call("POST", "/v1/sessions", TOKEN_A,
                                   {"session_id": new_id("s"), "session_key": key, "rebind_key": True}))

    threads = [threading.Thread(target=rebind) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [status for status, _ in results] == [200] * 8, results
    status, holders = server.call("GET", f"/v1/sessions?session_key={key}", TOKEN_A)
    assert status == 200 and len(holders["sessions"]) == 1


def test_a_compaction_without_a_budget_gets_the_prompt_budget_assemble_gets(store: TranscriptStore) -> None:
    """Service.compact without a token_budget works to the same prompt budget (the budget less the reply)
    as assemble and maintain, not to the whole token_budget."""
    from transcript_store.engine import CompactResult, EngineInfo
    from transcript_store.service import Service
    from transcript_store.service_models import CompactRequest
    from transcript_store.settings import load_settings

    seen: list[int] = []

    class Recording:
        info = EngineInfo(id="rec", name="Recording")

        def assemble(self, **kw: Any) -> Any:
            raise AssertionError("not assembled")

        def compact(self, **kw: Any) -> CompactResult:
            seen.append(kw["token_budget"])
            return CompactResult(ok=True, compacted=False, reason="recorded")

    service = Service(store, load_settings(config_path=None, token_budget=4000, max_output_tokens=500))
    assert service.runtime.registry is not None
    service.runtime.registry.register_factory("rec", lambda ctx: Recording())
    sid = store.create_session("scope-a").session_id
    service.compact("scope-a", "rec", sid, CompactRequest())
    service.compact("scope-a", "rec", sid, CompactRequest(token_budget=1234))
    assert seen == [4000 - 500, 1234] and service.default_budget == 4000 - 500


class _CopyingEngine:
    """An engine keeping its own copy of the session: its bootstrap reads the transcript up to the fence
    it is given (ReadFenceError once that no longer holds); records what bootstrap and compact got."""

    info = EngineInfo(id="copying", name="Copying")

    def __init__(self, ctx: Any) -> None:
        self.store = ctx.store
        self.calls: list[tuple[str, Any]] = []

    def assemble(self, **kw: Any) -> Any:
        raise AssertionError("not assembled")

    def bootstrap(self, *, scope: str, session_id: str, fence: Any = None, **kw: Any) -> Any:
        self.store.read_visible(scope, session_id, fence=fence)
        self.calls.append(("bootstrap", fence))
        return {"bootstrapped": True}


class _FencedCompact(_CopyingEngine):
    """Its ``compact`` declares ``fence`` and holds it (as the lossless engine's does)."""

    def compact(self, *, scope: str, session_id: str, fence: Any = None, **kw: Any) -> Any:
        if fence is not None:
            self.store.read_visible(scope, session_id, fence=fence)
        # the runtime context it would delegate a compaction through carries the same fence
        assert kw["runtime_context"].fence == fence
        self.calls.append(("compact", fence))
        return {"ok": True, "compacted": True}


class _UnfencedCompact(_CopyingEngine):
    """Its ``compact`` declares no ``fence`` (``**kw`` is no promise to honour one)."""

    def compact(self, **kw: Any) -> Any:
        self.calls.append(("compact", kw.get("fence")))
        return {"ok": True, "compacted": True}


@pytest.mark.parametrize("kind", [_FencedCompact, _UnfencedCompact])
def test_a_fenced_compaction_gives_the_fence_to_a_compact_that_declares_one(
    store: TranscriptStore, kind: type[_CopyingEngine]
) -> None:
    """Service.compact fenced only the engine's import before the compaction, and after an import the
    fence refused it compacted "what the engine holds", unfenced. As the host's compactions inside a turn
    (``host._fenced``), a ``compact`` declaring a ``fence`` keyword is given the request's, and a fence
    its import found broken is the request's ReadFenceError, the compaction not run; one declaring none
    is called as before (no fence, and it compacts what it holds after such an import)."""
    from transcript_store.errors import ReadFenceError
    from transcript_store.service import Service
    from transcript_store.service_models import CompactRequest
    from transcript_store.settings import load_settings

    made: list[_CopyingEngine] = []

    def factory(ctx: Any) -> _CopyingEngine:
        made.append(kind(ctx))
        return made[-1]

    service = Service(store, load_settings(config_path=None))
    assert service.runtime.registry is not None
    service.runtime.registry.register_factory("copying", factory)
    try:
        sid = store.create_session("scope-a").session_id
        store.append("scope-a", sid, user("old question"), entry_id="q0")
        store.append("scope-a", sid, assistant("old answer"))
        fence = store.admit("scope-a", sid, user("the running turn"), turn_id="T1").anchor
        fenced = kind is _FencedCompact
        assert service.compact("scope-a", "copying", sid, CompactRequest(fence=fence)).compacted
        assert made[0].calls == [("bootstrap", fence), ("compact", fence if fenced else None)]
        made[0].calls.clear()
        assert service.compact("scope-a", "copying", sid, CompactRequest()).compacted  # no fence: none given
        assert made[0].calls == [("bootstrap", None), ("compact", None)]
        made[0].calls.clear()
        store.rewrite_entries("scope-a", sid, [{"entry_id": "q0", "message": user("edited")}])
        if fenced:
            with pytest.raises(ReadFenceError) as raised:
                service.compact("scope-a", "copying", sid, CompactRequest(fence=fence))
            assert raised.value.reason == "rewritten" and made[0].calls == []  # not compacted
        else:
            assert service.compact("scope-a", "copying", sid, CompactRequest(fence=fence)).compacted
            assert made[0].calls == [("compact", None)]  # the import refused, what it holds compacted
    finally:
        service.runtime.dispose()


def test_an_engines_own_output_in_serve_is_shown_not_obeyed(db_url: str, tmp_path: Path) -> None:
    """An engine's print() and warnings.warn() in the server process quote stored text: shown on the
    operator's terminal, never obeyed by it, and a lone surrogate in them fails no request."""
    from test_gateway import LOUD_ENGINE

    env = plugin_env(tmp_path, "loud", LOUD_ENGINE)
    with ServiceProcess(db_url, TOKENS, tmp_path / "serve.log", env=env) as server:
        sid = open_session(server)["session_id"]
        status, done = commit(server, "loud", sid, "loud-1", 0, [user("hi"), assistant("hello")])
        assert status == 200 and done["status"] == "committed", done
        status, assembled = server.call("POST", f"/v1/engines/loud/sessions/{sid}/assemble", TOKEN_A, {})
        assert status == 200 and len(assembled["messages"]) == 2, assembled
    log = server.log()
    assert "printed \\x1b]0;owned\\x07 \\ud800 end" in server.stdout_rest
    assert "warned \\x1b[2J here" in log
    assert "\x1b" not in server.stdout_rest + log


def test_a_key_twice_in_one_body_object_is_a_422_that_writes_nothing(server: ServiceProcess) -> None:
    """A JSON object naming a key twice is refused, as ``sessions import`` refuses it: read with the last
    value silently kept, ``{"session_id": "a", "session_id": "b"}`` created ``b``, and a message
    ``{"role": "user", ..., "role": "assistant"}`` was appended as an assistant's."""
    sid, other = new_id("s"), new_id("s")
    status, data = server.call("POST", "/v1/sessions", TOKEN_A,
                               raw=f'{{"session_id": "{other}", "session_id": "{sid}"}}'.encode())
    assert status == 422 and data["error"]["code"] == "invalid_request", data
    assert "'session_id' appears twice" in data["error"]["message"], data
    for gone in (sid, other):
        status, data = server.call("GET", f"/v1/sessions/{gone}", TOKEN_A)
        assert status == 404 and data["error"]["code"] == "session_not_found", data
    open_session(server, session_id=sid)
    raw = b'{"items": [{"message": {"role": "user", "content": "x", "role": "assistant"}}]}'
    status, data = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A, raw=raw)
    assert status == 422 and "'role' appears twice" in data["error"]["message"], data
    status, data = server.call("GET", f"/v1/sessions/{sid}", TOKEN_A)
    assert status == 200 and data["entry_count"] == 0, data
    # the same keys in different objects are no repetition
    raw = b'{"items": [{"message": {"role": "user", "content": "x"}}, {"message": {"role": "user", "content": "y"}}]}'
    status, data = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A, raw=raw)
    assert status == 200 and len(data["entries"]) == 2, data


def _two_authorizations(server: ServiceProcess, first: str, second: str) -> tuple[int, Any]:
    """GET /v1/whoami with two ``Authorization`` headers (the test client sends one)."""
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=60)
    try:
        conn.putrequest("GET", "/v1/whoami")
        conn.putheader("Authorization", f"Bearer {first}")
        conn.putheader("Authorization", f"Bearer {second}")
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_two_authorization_headers_are_a_401(server: ServiceProcess) -> None:
    """A request presents one token: with two ``Authorization`` headers the first one was taken, so a
    request with another scope's token in front of its own (a proxy adding one, a client merging
    headers) reached that scope, and one with a valid token and garbage after it was let in."""
    for first, second in ((TOKEN_A, TOKEN_B), (TOKEN_B, TOKEN_A), (TOKEN_A, "not-a-token"), (TOKEN_A, TOKEN_A)):
        status, data = _two_authorizations(server, first, second)
        assert status == 401 and data["error"]["code"] == "unauthorized", (first, second, data)


def test_a_body_field_of_another_json_type_is_a_422_not_coerced(server: ServiceProcess) -> None:
    """A field of the wrong JSON type is refused, as a field the route does not know is: read leniently,
    ``"rebind_key": "true"`` or ``1`` rebound a key, ``"force": "false"`` compacted unforced,
    ``"token_budget": true`` assembled within 1 token (an empty context, 200), ``"max_messages": "5"`` and
    ``5.0`` were read as 5, and an entry reference's ``"position": "0"`` as 0."""
    sid, key = new_id("s"), new_id("key")
    open_session(server, session_id=sid, session_key=key)
    other = new_id("s")
    engine = f"/v1/engines/legacy/sessions/{sid}"
    turn = {"advancement_key": new_id("k"), "admission": {"entry_id": "u1", "position": 0},
            "terminal": {"entry_id": "a1", "position": 1}, "messages": [user("q"), assistant("a")]}
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/sessions", {"session_id": other, "session_key": key, "rebind_key": "true"}),
        ("/v1/sessions", {"session_id": other, "session_key": key, "rebind_key": 1}),
        (f"/v1/sessions/{sid}/delta", {"max_messages": "5"}),
        (f"/v1/sessions/{sid}/delta", {"max_messages": 5.0}),
        (f"/v1/sessions/{sid}/delta", {"max_bytes": True}),
        (f"{engine}/assemble", {"token_budget": True}),
        (f"{engine}/compact", {"force": "false"}),
        (f"{engine}/bootstrap", {"done": 0}),
        (f"{engine}/host_compaction", {"summary": "s", "first_kept_position": "0", "first_kept_entry_id": "u1"}),
        (f"{engine}/commit_turn", {**turn, "is_heartbeat": "false"}),
        (f"{engine}/commit_turn", {**turn, "admission": {"entry_id": "u1", "position": "0"}}),
    ]
    for path, body in cases:
        status, data = server.call("POST", path, TOKEN_A, body)
        assert status == 422 and data["error"]["code"] == "invalid_request", (path, body, data)
    status, data = server.call("GET", f"/v1/sessions?session_key={key}", TOKEN_A)
    assert status == 200 and [s["session_id"] for s in data["sessions"]] == [sid], data  # not rebound
    status, data = server.call("GET", f"/v1/sessions/{sid}", TOKEN_A)
    assert status == 200 and data["entry_count"] == 0, data  # no turn mirrored
