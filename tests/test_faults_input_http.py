"""Fault campaign, part 4d: hostile requests to every route of a real ``transcript-store serve`` process.

Part 4b calls ``Service`` in-process with the bodies pydantic accepted; the schemathesis run of
test_service.py only looks for 500s. Here hypothesis draws whole HTTP requests for every operation of
the server's OpenAPI document, sent over a socket: path ids percent-encoded from NUL bytes, lone
surrogates (invalid UTF-8 once encoded), control characters, SQL metacharacters and huge strings;
query strings of negative, huge and non-numeric limits; JSON bodies of the route's own fields with
hostile values, arbitrary JSON, deep nesting, and raw bytes that are not JSON or not UTF-8; the other
scope's token, a wrong one, none. The contract, on both backends, after every request:

- never a 5xx: the input, not the server or its database, is at fault;
- every refusal (4xx) is ``{"error": {"code", "message"}}`` with one of the documented codes (README,
  "HTTP service": the library errors' codes and the HTTP layer's);
- a refused request leaves every row of every table exactly as it was (read by a store of the test's
  own on the same database), and a GET never changes any.

The default tier draws ``FAULT_INPUT_HTTP_EXAMPLES`` (6) requests per operation and backend; the slow
tier (``make test-slow``) 100.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_process import ServiceProcess, request
from test_faults_input import NASTY, deep, ints, json_values, limits, messages, payloads, texts, weighted, wrong
from workers.fault_worker import report, table_rows

from transcript_store import TranscriptStore
from transcript_store.service_app import DEFAULT_MAX_BODY as MAX_BODY
from transcript_store.service_app import ERRORS, HTTP_CODES

# 6 in make test (CI time: each request is a round trip to a busy server); the slow tier's 100 is the figure.
EXAMPLES = int(os.environ.get("FAULT_INPUT_HTTP_EXAMPLES", "6"))
SLOW_EXAMPLES = 100
TOKEN_A, TOKEN_B = "token-a-0123456789abcdef", "token-b-0123456789abcdef"
TOKENS = {TOKEN_A: "scope-a", TOKEN_B: "scope-b"}
#: every code a refusal may carry, as the README's OpenClaw section lists them
REFUSAL_CODES = {
    "invalid_input", "invalid_message", "unauthorized", "session_not_found", "entry_not_found", "engine_not_found",
    "not_found", "method_not_allowed", "request_timeout", "turn_key_conflict", "advancement_key_collision",
    "idempotency_conflict", "session_key_conflict", "read_fence", "transcript_mirror", "host_requirement",
    "engine_contract", "payload_too_large", "request_too_large", "unsupported_media_type", "invalid_request",
}
README = Path(__file__).resolve().parent.parent / "README.md"
#: h11's bound on a request head it buffers (DEFAULT_MAX_INCOMPLETE_EVENT_SIZE), which uvicorn keeps
MAX_HEAD = 16 * 1024
#: the statuses each code comes with (``invalid_request``: 422 for a body, 400 for a request not parsed)
STATUS_OF: dict[str, set[int]] = {"invalid_request": {400, 422}}
for _kind, _status, _code in ERRORS:
    STATUS_OF.setdefault(_code, set()).add(_status)
for _status, _code in HTTP_CODES.items():
    STATUS_OF.setdefault(_code, set()).add(_status)


def encode(value: Any) -> str:
    """A path segment or query value as a client would send it: UTF-8 (lone surrogates as the bytes
    they would be: invalid UTF-8), every byte but unreserved ASCII percent-encoded."""
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def dumps(value: Any) -> bytes:
    """A drawn body as JSON bytes (NaN, lone-surrogate escapes and all); what JSON cannot hold, as its repr."""
    return json.dumps(value, default=repr).encode("utf-8")


# ---------------------------------------------------------------------------------------------- world


@pytest.fixture
def server(store_url: str, tmp_path: Path) -> Iterator[ServiceProcess]:
    """A real server on this test's database."""
    with ServiceProcess(store_url, TOKENS, tmp_path / "serve.log") as proc:
        yield proc


def build_world(server: ServiceProcess) -> dict[str, Any]:
    """Sessions in both scopes, a committed turn per engine, an admitted user entry; what the draws use."""
    def ok(method: str, path: str, token: str, body: Any = None) -> Any:
        status, data = server.call(method, path, token, body)
        assert status == 200, (method, path, status, data)
        return data

    for token in (TOKEN_A, TOKEN_B):
        ok("POST", "/v1/sessions", token, {"session_id": "s1", "session_key": "k1"})
    ok("POST", "/v1/sessions", TOKEN_A, {"session_id": "s2"})
    ok("POST", "/v1/sessions", TOKEN_B, {"session_id": "only-b"})
    for n, engine in enumerate(("legacy", "lossless")):
        turn = {"advancement_key": f"K{n}", "admission": {"entry_id": f"K{n}.u", "position": 2 * n},
                "terminal": {"entry_id": f"K{n}.a", "position": 2 * n + 1},
                "messages": [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": f"a{n}"}]}
        ok("POST", f"/v1/engines/{engine}/sessions/s1/commit_turn", TOKEN_A, turn)
    admitted = ok("POST", "/v1/sessions/s2/admissions", TOKEN_A,
                  {"message": {"role": "user", "content": "held"}, "turn_id": "T1"})
    delta = ok("POST", "/v1/sessions/s1/delta", TOKEN_A, {"max_messages": 1})
    return {"anchor": admitted["anchor"], "cursor": delta["cursor"], "commit": turn}


# ---------------------------------------------------------------------------------------------- strategies


def mostly(valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` 5 draws in 6."""
    return weighted(valid, hostile, 6)


path_ids = mostly(st.sampled_from(["s1", "s2", "only-b", "nowhere"]), st.one_of(st.sampled_from(NASTY), texts, wrong))
engine_ids = mostly(st.sampled_from(["legacy", "lossless"]), st.one_of(st.sampled_from(["nope", "LEGACY"]), texts))
tokens = mostly(st.just(TOKEN_A), st.sampled_from([TOKEN_B, None, "wrong"]))
raw_bodies = st.sampled_from([
    b"", b"{", b"[]", b"null", b"\xff\xfe\x00", b'{"a": "\xed\xa0\x80"}', b"[" * 100_000 + b"]" * 100_000,
    b'{"limit": ' + b"9" * 5000 + b"}", b'{"x": NaN}', b'{"session_id": "s1", "session_id": 5}',
])


def fields(**strategies: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A body of the route's fields (all, some, or with an unknown one), arbitrary JSON, or raw bytes."""
    return st.one_of(
        st.fixed_dictionaries(strategies).map(dumps),
        st.fixed_dictionaries({}, optional=strategies).map(dumps),
        st.fixed_dictionaries({}, optional={**strategies, "unknown": payloads}).map(dumps),
        st.one_of(payloads, deep).map(dumps),
        raw_bodies,
    )


def bodies(w: dict[str, Any]) -> dict[str, st.SearchStrategy[bytes]]:
    """Per body-taking route (by its last path segment or path), the drawn body."""
    anchor = w["anchor"]
    anchors = mostly(st.sampled_from([None, anchor]), st.one_of(
        st.sampled_from(sorted(anchor)).flatmap(
            lambda k: st.one_of(texts, ints, wrong).map(lambda v: {**anchor, k: v})),
        json_values))
    cursor = w["cursor"]
    cursors = mostly(st.sampled_from([None, cursor]), st.one_of(
        st.integers(0, len(cursor) - 1).map(lambda n: cursor[:n]), texts, wrong))
    ids = mostly(st.sampled_from(["n1", "n2", "T9"]), st.one_of(st.sampled_from(NASTY), texts, wrong))
    optional_ids = st.one_of(st.none(), ids)
    plain = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": texts})
    message = mostly(plain, messages)
    budgets = mostly(st.sampled_from([None, 50, 4000]), limits)
    ref = st.fixed_dictionaries({"entry_id": ids}, optional={"position": st.one_of(st.none(), ints)})
    commit = w["commit"]
    commit_edits = {"advancement_key": ids, "admission": mostly(ref, payloads), "terminal": mostly(ref, payloads),
                    "messages": mostly(st.lists(plain, min_size=1, max_size=3),
                                       st.one_of(st.lists(messages, max_size=3), payloads)),
                    "is_heartbeat": mostly(st.booleans(), wrong), "session_target": st.one_of(st.none(), payloads)}
    return {
        "/v1/sessions": fields(session_id=optional_ids, session_key=optional_ids,
                               rebind_key=mostly(st.booleans(), wrong)),
        "delta": fields(cursor=cursors, max_messages=limits, max_bytes=limits, fence=anchors),
        "entries": fields(items=mostly(st.lists(st.fixed_dictionaries({"message": message}, optional={
            "entry_id": ids, "idempotency_key": optional_ids, "kind": texts, "payload": payloads}),
            min_size=1, max_size=3), payloads)),
        "admissions": fields(message=message, turn_id=ids, entry_id=optional_ids),
        "bootstrap": fields(page=st.one_of(st.none(), st.fixed_dictionaries({}, optional={
            "cursor": st.one_of(st.none(), texts), "next_cursor": st.one_of(st.none(), texts),
            "entries": st.lists(st.fixed_dictionaries({"entry_id": ids, "message": message}), max_size=3)}), payloads),
            done=mostly(st.booleans(), wrong)),
        "assemble": fields(token_budget=budgets, fence=anchors, available_tools=mostly(
            st.lists(st.sampled_from(["lcm_grep", "x"]), max_size=2), payloads),
            prompt=st.one_of(st.none(), texts, message)),
        "compact": fields(force=mostly(st.booleans(), wrong), focus=st.one_of(st.none(), texts, wrong),
                          token_budget=budgets, fence=anchors),
        "maintain": fields(unknown=payloads),
        "host_compaction": fields(summary=mostly(st.sampled_from(["earlier talk"]), st.one_of(texts, wrong)),
                                  first_kept_position=mostly(st.sampled_from([0, 2, 4]), st.one_of(ints, wrong)),
                                  first_kept_entry_id=ids, reset=mostly(st.booleans(), wrong)),
        "commit_turn": st.one_of(
            st.sampled_from(sorted(commit_edits)).flatmap(
                lambda k: commit_edits[k].map(lambda v: dumps({**commit, k: v}))),
            st.just(dumps(commit)), fields(**commit_edits)),
    }


def operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path template, operation) of every route of the OpenAPI document."""
    return [(method.upper(), path, op)
            for path, ops in sorted(doc["paths"].items()) for method, op in sorted(ops.items())]


def draw_request(data: st.DataObject, method: str, template: str, op: dict[str, Any],
                 w: dict[str, Any]) -> tuple[str, bytes | None, str | None]:
    """A request for one operation: its path (ids percent-encoded), query, body and token."""
    path = template
    for param in op.get("parameters", []):
        if param["in"] == "path":
            value = data.draw(engine_ids if param["name"] == "engine" else path_ids)
            path = path.replace("{" + param["name"] + "}", encode(value))
    query = {p["name"]: data.draw(mostly(st.none(), st.one_of(limits, texts, wrong)))
             for p in op.get("parameters", []) if p["in"] == "query"}
    query = {k: encode(v) for k, v in query.items() if v is not None}
    if query:
        path += "?" + urlencode(query, safe="%")
    body: bytes | None = None
    if "requestBody" in op:
        key = template if template == "/v1/sessions" else template.rsplit("/", 1)[-1]
        body = data.draw(bodies(w)[key])
    return path, body, data.draw(tokens)


def hostile_http_campaign(request_: pytest.FixtureRequest, server: ServiceProcess, store_url: str, backend: str,
                          examples: int) -> None:
    """Draw ``examples`` requests per operation and check the contract after each."""
    started = time.monotonic()
    world = build_world(server)
    status, doc = server.call("GET", "/openapi.json", TOKEN_A)
    assert status == 200
    ops = operations(doc)
    assert len(ops) == 17, [(m, p) for m, p, _ in ops]  # the module docstring's "every operation"
    figures: dict[str, dict[str, int]] = {}
    with TranscriptStore(store_url) as mine:
        names = sorted(table_rows(mine))
        state = {"rows": table_rows(mine, names=names)}

        def check(method: str, template: str, path: str, body: bytes | None, token: str | None) -> None:
            counts = figures.setdefault(f"{method} {template}", {"requests": 0, "refused": 0})
            counts["requests"] += 1
            where = f"{method} {path[:200]} body {body[:200] if body else body!r}"
            try:
                status, answer = request(server.url, method, path, token, raw=body,
                                         headers={"Content-Type": "application/json"} if body is not None else None)
            except (ConnectionResetError, BrokenPipeError):
                # Refused before it was all read, the connection closed while the client still sent: a body
                # over the server's limit (413, seen under load), or a request head past what the HTTP
                # parser buffers (uvicorn answers 400 "Invalid HTTP request" and closes; ids are at most 255
                # characters, so only a path or query no client builds from them gets there). The rows are
                # checked below as for any refusal.
                too_large = body is not None and len(body) > MAX_BODY
                assert too_large or len(path) > MAX_HEAD, f"{where}: connection reset"
                code = "request_too_large" if too_large else "invalid_request"
                status, answer = (413 if too_large else 400), {"error": {"code": code, "message": "(reset)"}}
            assert status < 500, f"{where} -> {status}: {str(answer)[:400]}"
            # Refused before its body, route or method is looked at (413: by length); a head past the parser's
            # buffer never reaches the token check (uvicorn's 400 and reset, above), with a token or without.
            if token not in TOKENS and not (status == 400 and len(path) > MAX_HEAD):
                assert status in (401, 413), f"{where} without a known token -> {status}: {str(answer)[:300]}"
            after = table_rows(mine, names=names)
            if status >= 400:
                counts["refused"] += 1
                assert isinstance(answer, dict) and set(answer) == {"error"}, f"{where} -> {status}: {answer!r}"
                code = answer["error"].get("code")
                assert code in REFUSAL_CODES and answer["error"].get("message"), (where, answer)
                assert status in STATUS_OF[code], f"{where}: {code} with status {status}"
            if status >= 400 or method == "GET":
                changed = {t for t in names if after[t] != state["rows"][t]}
                what = "refused" if status >= 400 else "a read"
                assert not changed, f"{where} -> {status} ({what}) but wrote {changed}"
            state["rows"] = after

        def campaign(method: str, template: str, op: dict[str, Any]) -> None:
            @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(data=st.data())
            def run(data: st.DataObject) -> None:
                check(method, template, *draw_request(data, method, template, op, world))

            run()

        for method, template, op in ops:
            campaign(method, template, op)
    total = sum(c["requests"] for c in figures.values())
    refused = sum(c["refused"] for c in figures.values())
    report(request_, backend, {
        "routes": len(figures), "examples_per_route": examples, "requests": total, "refusals": refused,
        "accepted": total - refused, "server_errors": 0, "writes_by_refused_requests": 0,
        "seconds": round(time.monotonic() - started, 1),
    })
    assert refused > 0 and total - refused > 0, figures


def test_hostile_requests_get_documented_refusals_and_write_nothing(
    request: pytest.FixtureRequest, server: ServiceProcess, store_url: str, backend: str,
) -> None:
    hostile_http_campaign(request, server, store_url, backend, EXAMPLES)


@pytest.mark.slow
def test_hostile_requests_100_per_route(
    request: pytest.FixtureRequest, server: ServiceProcess, store_url: str, backend: str,
) -> None:
    hostile_http_campaign(request, server, store_url, backend, SLOW_EXAMPLES)


def test_the_documented_refusal_codes_are_the_servers() -> None:
    """The list the campaign holds refusals to is the server's 4xx codes, each named in the README."""
    served = {code for _kind, status, code in ERRORS if status < 500} | set(HTTP_CODES.values()) | {"invalid_request"}
    assert served == REFUSAL_CODES, served ^ REFUSAL_CODES
    readme = README.read_text(encoding="utf-8")
    assert [c for c in sorted(REFUSAL_CODES) if f"`{c}`" not in readme] == []


@pytest.mark.parametrize("backend", ["sqlite"])  # the HTTP layer's, before any store call
def test_a_request_without_a_known_token_is_401_whatever_its_body_route_or_method(server: ServiceProcess) -> None:
    """The token was checked by each route: a malformed body was answered 422, an unknown route 404 and
    a wrong method 405 before a request without a token was refused."""
    for token in (None, "wrong", TOKEN_A + "x"):
        for method, path, body in [("POST", "/v1/sessions", b"{"), ("POST", "/v1/sessions", b"\xff"),
                                   ("GET", "/v1/nothing", None), ("DELETE", "/v1/sessions", None),
                                   ("GET", "/openapi.json", None), ("POST", "/v1/sessions", b"x" * 3_000_000)]:
            status, answer = request(server.url, method, path, token, raw=body)
            assert status == 401 and answer["error"]["code"] == "unauthorized", (token, method, path, status, answer)
    assert request(server.url, "GET", "/v1/nothing", TOKEN_A)[0] == 404  # with one: as before


@pytest.mark.parametrize("backend", ["sqlite"])  # the HTTP layer's, before any store call
def test_the_401_of_a_large_or_expecting_body_is_read_by_the_client(store_url: str, tmp_path: Path) -> None:
    """A chunked body past four times the limit got its 401 with the connection closed while the client
    still sent (a reset, where a token holder got its 413); a request expecting 100-continue was told to
    send a body that is never read (refused for its token, or for its length, before it is sent)."""
    with ServiceProcess(store_url, TOKENS, tmp_path / "serve.log", extra_args=("--max-body", "1048576")) as server:
        for token, want in ((None, 401), ("wrong", 401), (TOKEN_A, 413)):
            status, answer = request(server.url, "POST", "/v1/sessions", token, raw=b"x" * (20 << 20), chunked=True)
            assert status == want, (token, status, answer)
        for auth, length, want in ((b"", 4000, b"401"), (b"", 4_000_000, b"413"),
                                   (b"Authorization: Bearer " + TOKEN_A.encode() + b"\r\n", 4_000_000, b"413")):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
                conn.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n" + auth
                             + b"Content-Length: " + str(length).encode() + b"\r\n\r\n")
                head = conn.recv(200)
            assert head.startswith(b"HTTP/1.1 " + want), (auth, length, head)
