"""`serve` reads numbers as they are written, and answers HEAD on its GET routes.

An integer query parameter is an optional ``-`` and ASCII digits: ``1_0``, ``+5``, ``5.0`` and `` 5``
were read as Python's ``int`` reads them. A fence's anchor is the library's ``Anchor``, now strict:
``"seq": "1"`` or ``true`` was honoured as seq 1. Both are 422 ``invalid_request`` and write nothing.
``HEAD`` on a route that takes ``GET`` was 405; it is answered as the ``GET``, headers only.
"""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlsplit

import pytest
from service_process import ServiceProcess
from test_service import (
    ENGINES,
    TOKEN_A,
    TOKENS,
    db_url,  # noqa: F401 (fixture: one database per backend for the module)
    new_id,
    open_session,
    user,
)

#: integers as a client may write them that are no integer of a query string; each is refused
NOT_DECIMAL = ("1_0", "+5", "5.0", " 5", "5 ", "5\n", "\u0665", "\uff15", "0x5", "5e0", "", "-", "--5", "1,5")


@pytest.fixture(scope="module")
def server(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:  # noqa: F811
    with ServiceProcess(db_url, TOKENS, tmp_path_factory.mktemp("strictlog") / "serve.log") as proc:
        yield proc


def concrete(path: str, sid: str) -> str:
    """A path of the OpenAPI document with its parameters filled in."""
    return path.replace("{engine}", "legacy").replace("{session_id}", sid)


def integer_query_parameters(server: ServiceProcess) -> list[tuple[str, str, dict[str, Any]]]:
    """(path, parameter, schema) of every integer query parameter of a GET route the document lists."""
    status, doc = server.call("GET", "/openapi.json", TOKEN_A)
    assert status == 200
    found = []
    for path, ops in doc["paths"].items():
        for param in ops.get("get", {}).get("parameters", []):
            if param["in"] == "query" and param["schema"].get("type") == "integer":
                found.append((path, param["name"], param["schema"]))
    return found


def test_an_integer_query_parameter_is_ascii_digits_only(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    params = integer_query_parameters(server)
    assert {name for _path, name, _schema in params} == {"limit"} and len(params) == 2, params
    for path, name, schema in params:
        where = concrete(path, sid)
        status, before = server.call("GET", where, TOKEN_A)
        assert status == 200, before
        for bad in NOT_DECIMAL:
            status, err = server.call("GET", f"{where}?{name}={quote(bad, safe='')}", TOKEN_A)
            assert status == 422 and err["error"]["code"] == "invalid_request", (path, bad, err)
            assert err["error"]["message"].startswith(f"query.{name}: must be an integer written as ASCII digits"), err
        for bad in (str(schema["minimum"] - 1), str(schema["maximum"] + 1), "-1", "9" * 5000):
            status, err = server.call("GET", f"{where}?{name}={bad}", TOKEN_A)
            assert status == 422 and err["error"]["code"] == "invalid_request", (path, bad[:10], err)
        for good in ("1", "05", str(schema["maximum"])):
            status, data = server.call("GET", f"{where}?{name}={good}", TOKEN_A)
            assert status == 200, (path, good, data)
        assert server.call("GET", where, TOKEN_A) == (200, before)  # nothing written
    status, page = server.call("GET", "/v1/sessions?limit=1", TOKEN_A)
    assert status == 200 and len(page["sessions"]) == 1


def test_a_fence_with_a_number_of_another_json_type_is_a_422_that_writes_nothing(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    status, _ = server.call("POST", f"/v1/sessions/{sid}/entries", TOKEN_A, {"items": [{"message": user("one")}]})
    assert status == 200
    status, admission = server.call(
        "POST", f"/v1/sessions/{sid}/admissions", TOKEN_A, {"message": user("q"), "turn_id": "t1"}
    )
    assert status == 200 and admission["anchor"]["seq"] == 1
    anchor = admission["anchor"]
    status, fenced = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {"fence": anchor})
    assert status == 200 and len(fenced["entries"]) == 1
    bad_fences = [{**anchor, name: value} for name, value in (
        ("seq", "1"), ("seq", True), ("seq", 1.0), ("generation", "0"), ("generation", False),
        ("position", "1"), ("position", True), ("incarnation", str(anchor["incarnation"])), ("entry_id", 5),
    )]
    routes = [f"/v1/sessions/{sid}/delta"] + [
        f"/v1/engines/{engine}/sessions/{sid}/{what}" for engine in ENGINES for what in ("assemble", "compact")
    ]
    states = {e: server.call("GET", f"/v1/engines/{e}/sessions/{sid}/bootstrap", TOKEN_A) for e in ENGINES}
    for fence in bad_fences:
        for route in routes:
            status, err = server.call("POST", route, TOKEN_A, {"fence": fence})
            assert status == 422 and err["error"]["code"] == "invalid_request", (route, fence, err)
            assert err["error"]["message"].startswith("body.fence."), err
    status, page = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {})
    assert status == 200 and [e["message"] for e in page["entries"]] == [user("one"), user("q")]
    for engine in ENGINES:  # no compaction ran, no import: the engines' import state is as it was
        assert server.call("GET", f"/v1/engines/{engine}/sessions/{sid}/bootstrap", TOKEN_A) == states[engine]


def raw_request(server: ServiceProcess, method: str, path: str, token: str | None = TOKEN_A,
                conn: http.client.HTTPConnection | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request on ``conn`` (a new connection without one): (status, headers, body as read)."""
    parts = urlsplit(server.url)
    own = conn is None
    conn = conn or http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=30)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        if own:
            conn.close()


def test_head_on_a_get_route_answers_as_the_get_without_its_body(server: ServiceProcess) -> None:
    sid = new_id("s")
    open_session(server, session_id=sid)
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=30)
    try:
        for path in ("/v1/whoami", "/v1/sessions", f"/v1/sessions/{sid}", "/v1/engines", "/v1/engines/legacy",
                     f"/v1/engines/legacy/sessions/{sid}/bootstrap", f"/v1/engines/legacy/sessions/{sid}/receipts",
                     "/openapi.json", "/v1/sessions/no-such-session", "/v1/sessions?limit=1_0"):
            got = raw_request(server, "GET", path, conn=conn)
            head = raw_request(server, "HEAD", path, conn=conn)  # the same connection goes on after it
            assert head[0] == got[0] and head[2] == b"", (path, head)
            assert head[1]["content-length"] == got[1]["content-length"] == str(len(got[2])), (path, head, got)
            assert head[1]["content-type"] == got[1]["content-type"], path
    finally:
        conn.close()
    status, headers, body = raw_request(server, "HEAD", "/v1/whoami", token=None)
    assert status == 401 and body == b"" and headers["www-authenticate"] == "Bearer"
    # A route without GET: HEAD is its 405, as GET is; Allow lists HEAD wherever it lists GET.
    status, headers, body = raw_request(server, "HEAD", f"/v1/sessions/{sid}/delta")
    assert status == 405 and body == b"" and headers["allow"] == "POST", headers
    status, headers, _ = raw_request(server, "DELETE", "/v1/whoami")
    assert status == 405 and headers["allow"] == "GET, HEAD", headers
    # A path that a GET route and a POST route both serve: Allow lists both routes' methods (it listed
    # the first route's only: "POST" for the session list, "GET, HEAD" for an engine's bootstrap).
    for path in ("/v1/sessions", f"/v1/engines/legacy/sessions/{sid}/bootstrap"):
        for method in ("DELETE", "PUT", "PATCH"):
            status, headers, _ = raw_request(server, method, path)
            assert status == 405 and headers["allow"] == "GET, HEAD, POST", (method, path, headers)
    status, data = server.call("POST", f"/v1/sessions/{sid}/delta", TOKEN_A, {})
    assert status == 200 and data["entries"] == []  # HEADs wrote nothing
