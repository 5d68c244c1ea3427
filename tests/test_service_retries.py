"""Retrying `POST /v1/sessions` and the other writing routes safely, and paths and queries that are not
UTF-8, on a real server process.

A client whose answer to ``POST /v1/sessions {}`` was lost cannot tell whether a session was made; its
retry made a second one, the id being drawn per request. An ``Idempotency-Key`` header names the
request instead: the session's id is derived from it, so a retry finds the session its first attempt
made (and one reusing the key for another request is 409 ``idempotency_conflict``). An append under one
keys each item that names no entry by the header, so its retry appends nothing; every other writing route
refuses the header (400), naming what makes it safe to retry instead of letting a client count on it.

A path or query that percent-decodes to bytes that are not UTF-8 (``/v1/sessions/%FF``) was read with
each bad byte as U+FFFD and used: it reached, and wrote to, the session whose id holds that character.
It is 400 ``invalid_input`` now, on every route, before anything is read or written.
"""

from __future__ import annotations

import http.client
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlsplit

import pytest
from conftest import assistant, module_store_fixtures, user
from service_process import SharedServer, Tenant
from workers.fault_worker import table_rows

from transcript_store import StoreConfig, TranscriptStore

# One database and one server per backend for the module; each test works in scopes of its own (its
# ``Tenant``'s), so what it counts in them is what it made. ``table_rows`` reads the whole database: a
# write anywhere, to another test's rows too, still shows.
shared_url, store, _ = module_store_fixtures("unused", "service_retries")


@pytest.fixture(scope="module")
def shared_server(shared_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer]:
    with SharedServer(shared_url, tmp_path_factory.mktemp("service_retries") / "serve.log") as shared:
        yield shared


@pytest.fixture
def server(shared_server: SharedServer) -> Tenant:
    """This test's scopes on the module's server."""
    return shared_server.tenant()


@pytest.fixture
def scope() -> str:
    """A scope of this test's own, for the tests of the Python API (no server)."""
    return f"api-{uuid.uuid4().hex[:12]}"


def create(server: Tenant, body: dict[str, Any], key: str | None, token: str | None = None) -> tuple[int, Any]:
    headers = {"Idempotency-Key": key} if key is not None else None
    return server.call("POST", "/v1/sessions", token or server.token_a, body, headers=headers)


def ids(store: TranscriptStore, scope: str) -> list[str]:
    return [s.session_id for s in store.list_sessions(scope)]


# ---------------------------------------------------------------------------------------------- Idempotency-Key


def test_a_retried_create_under_an_idempotency_key_makes_one_session(
    server: Tenant, store: TranscriptStore
) -> None:
    status, first = create(server, {}, "create-1")
    assert status == 200, first
    for _ in range(2):  # the retries of a client whose answer was lost
        status, again = create(server, {}, "create-1")
        assert (status, again) == (200, first)
    assert ids(store, server.scope_a) == [first["session_id"]]
    # Another key is another session; so is every request without one (a fresh id each).
    status, other = create(server, {}, "create-2")
    assert status == 200 and other["session_id"] != first["session_id"]
    for _ in range(2):
        status, _fresh = create(server, {}, None)
        assert status == 200
    assert len(ids(store, server.scope_a)) == 4
    # The key is the caller's within its scope: another token's same key makes that scope's own session.
    status, theirs = create(server, {}, "create-1", token=server.token_b)
    assert status == 200 and theirs["scope"] == server.scope_b
    assert ids(store, server.scope_b) == [theirs["session_id"]]
    # An entry appended to the session, then the retry: the session as it is, nothing made anew.
    status, _ = server.call("POST", f"/v1/sessions/{first['session_id']}/entries", server.token_a,
                            {"items": [{"message": user("hi"), "entry_id": "e1"}]})
    assert status == 200
    status, late = create(server, {}, "create-1")
    assert status == 200 and late["session_id"] == first["session_id"] and late["visible_count"] == 1
    assert len(ids(store, server.scope_a)) == 4


def test_a_keyed_open_under_an_idempotency_key_answers_its_session_after_a_rebind(
    server: Tenant, store: TranscriptStore
) -> None:
    status, first = create(server, {"session_key": "agent:1"}, "open-1")
    assert status == 200 and first["session_key"] == "agent:1" and first["active"], first
    status, again = create(server, {"session_key": "agent:1"}, "open-1")
    assert (status, again) == (200, first)
    # Another caller moves the key to a session of its own meanwhile: the retry is still answered with
    # the session the first attempt made (ended now), not by a new one.
    status, _ = create(server, {"session_id": "newer", "session_key": "agent:1", "rebind_key": True}, None)
    assert status == 200
    status, late = create(server, {"session_key": "agent:1"}, "open-1")
    assert status == 200 and late["session_id"] == first["session_id"] and late["active"] is False, late
    assert sorted(ids(store, server.scope_a)) == sorted([first["session_id"], "newer"])
    # A first request under a key that found the key's holder made nothing: it answers the holder.
    status, holder = create(server, {"session_key": "agent:1"}, "open-2")
    assert status == 200 and holder["session_id"] == "newer"
    assert len(ids(store, server.scope_a)) == 2


def test_retries_racing_under_one_idempotency_key_make_one_session(
    server: Tenant, store: TranscriptStore
) -> None:
    """A client that gave up waiting and retried while its first attempt still ran: both are answered with
    the one session (on PostgreSQL the later insert waits for the earlier and finds its row)."""
    for body in ({}, {"session_key": "raced"}):
        results: list[tuple[int, Any]] = []

        def attempt(body: dict[str, Any] = body, results: list[tuple[int, Any]] = results) -> None:
            results.append(create(server, body, f"race-{len(body)}"))

        threads = [threading.Thread(target=attempt) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [status for status, _ in results] == [200] * 8, results
        assert len({data["session_id"] for _, data in results}) == 1, results
    assert len(ids(store, server.scope_a)) == 2


def test_a_retry_under_an_idempotency_key_whose_session_was_deleted_does_not_make_it_again(
    server: Tenant, store: TranscriptStore
) -> None:
    """The first request's answer was lost and another client deleted the session it made before the
    retry (the CLI's delete): the retry found no session under the key's id and made it again, a session its
    deleter saw go
    (the tombstone ``delete_session`` leaves was not looked at). It is 404 ``session_not_found`` now,
    writing nothing; another key still creates."""
    for body in ({}, {"session_key": "deleted-key"}):
        status, made = create(server, body, f"deleted-{len(body)}")
        assert status == 200, made
        store.delete_session(server.scope_a, made["session_id"])  # (the CLI's delete: the API has none)
        before = table_rows(store)
        status, data = create(server, body, f"deleted-{len(body)}")
        assert status == 404 and data["error"]["code"] == "session_not_found", (body, data)
        assert "Idempotency-Key" in data["error"]["message"] and "deleted" in data["error"]["message"]
        assert table_rows(store) == before and ids(store, server.scope_a) == []
    status, fresh = create(server, {}, "deleted-other")
    assert status == 200 and ids(store, server.scope_a) == [fresh["session_id"]]


def test_an_idempotency_key_reused_for_another_request_is_a_409_that_writes_nothing(
    server: Tenant, store: TranscriptStore
) -> None:
    status, made = create(server, {}, "reused")
    assert status == 200
    status, keyed = create(server, {"session_key": "k-made"}, "reused-keyed")
    assert status == 200
    before = table_rows(store)
    for key, body in (("reused", {"session_key": "k-other"}), ("reused-keyed", {}),
                      ("reused-keyed", {"session_key": "k-other"})):
        status, data = create(server, body, key)
        assert status == 409 and data["error"]["code"] == "idempotency_conflict", (body, data)
        assert "Idempotency-Key" in data["error"]["message"]
    assert table_rows(store) == before
    # The same request again is answered as the first attempt was.
    assert create(server, {}, "reused") == (200, made)
    assert create(server, {"session_key": "k-made"}, "reused-keyed") == (200, keyed)
    assert sorted(ids(store, server.scope_a)) == sorted([made["session_id"], keyed["session_id"]])


def test_an_idempotency_key_beside_a_session_id_or_rebind_key_is_refused_and_writes_nothing(
    server: Tenant, store: TranscriptStore
) -> None:
    """The key is remembered by the session whose id it derives: only a request without a session_id leaves
    that trace. Beside a session_id it was ignored, so the same key answered 200 for another request (the
    same key, another body), and a ``rebind_key`` under it was dropped (answered as a plain open). Both are
    refused now, writing nothing, whether the key was used before or not; the request without the header
    still works."""
    status, made = create(server, {}, "used")
    assert status == 200
    before = table_rows(store)
    for key in ("used", "fresh"):
        status, data = create(server, {"session_id": "named"}, key)
        assert status == 400 and data["error"]["code"] == "invalid_input", (key, data)
        assert "Idempotency-Key" in data["error"]["message"] and "session_id" in data["error"]["message"]
        for body in ({"rebind_key": True}, {"session_key": "k", "rebind_key": True}):
            status, data = create(server, body, key)
            assert status == 422 and data["error"]["code"] == "invalid_request", (key, body, data)
            assert "rebind_key" in data["error"]["message"], data
    assert table_rows(store) == before
    assert create(server, {}, "used") == (200, made)  # the key's own request is still answered as it was
    status, named = create(server, {"session_id": "named"}, None)
    assert status == 200 and named["session_id"] == "named"
    assert sorted(ids(store, server.scope_a)) == sorted([made["session_id"], "named"])


def test_rebind_key_without_a_session_id_and_a_session_key_is_a_422_that_writes_nothing(
    server: Tenant, store: TranscriptStore
) -> None:
    """``rebind_key`` moves a key to the session of an id. Without the id, a request opened the key's holder
    (or made one) and dropped the flag; without the key there is nothing to move. Refused now."""
    status, holder = create(server, {"session_id": "holder", "session_key": "k"}, None)
    assert status == 200
    before = table_rows(store)
    for body, missing in (({"rebind_key": True}, "session_id and session_key"),
                          ({"session_key": "k", "rebind_key": True}, "no session_id"),
                          ({"session_key": "k2", "rebind_key": True}, "no session_id"),
                          ({"session_id": "other", "rebind_key": True}, "no session_key"),
                          ({"session_id": "holder", "rebind_key": True}, "no session_key")):
        status, data = create(server, body, None)
        assert status == 422 and data["error"]["code"] == "invalid_request", (body, data)
        assert "rebind_key" in data["error"]["message"] and missing in data["error"]["message"], (body, data)
        assert "Value error" not in data["error"]["message"], data  # pydantic's prefix, not ours
    assert table_rows(store) == before
    # With both it acts; false, it is the plain open it always was.
    status, other = create(server, {"session_id": "other", "session_key": "k", "rebind_key": True}, None)
    assert status == 200 and other["session_key"] == "k" and other["active"]
    status, old = server.call("GET", "/v1/sessions/holder", server.token_a)
    assert status == 200 and old["active"] is False and holder["active"]
    assert create(server, {"session_key": "k", "rebind_key": False}, None) == create(server, {"session_key": "k"}, None)


def test_rebind_key_without_a_session_id_and_a_session_key_is_refused_by_the_service_api(
    store: TranscriptStore, scope: str
) -> None:
    """The Python API refuses it too: the request model at construction (what the route validates), and the
    service for a request built without validation or changed since."""
    from mirror_helpers import legacy_service
    from pydantic import ValidationError

    from transcript_store.errors import InvalidInput
    from transcript_store.service_models import OpenSession

    for body in ({"rebind_key": True}, {"session_key": "k", "rebind_key": True},
                 {"session_id": "s", "rebind_key": True}):
        with pytest.raises(ValidationError, match="rebind_key"):
            OpenSession(**body)
    for svc in legacy_service(store):
        before = table_rows(store)
        for body in ({"rebind_key": True}, {"session_key": "k", "rebind_key": True},
                     {"session_id": "s", "rebind_key": True}):
            for key in (None, "idem"):
                with pytest.raises(InvalidInput, match="rebind_key"):
                    svc.open_session(scope, OpenSession.model_construct(**body), key)
        changed = OpenSession(session_key="k")
        changed.rebind_key = True
        with pytest.raises(InvalidInput, match="rebind_key"):
            svc.open_session(scope, changed)
        with pytest.raises(InvalidInput, match="Idempotency-Key"):
            svc.open_session(scope, OpenSession(session_id="s"), "idem")
        assert table_rows(store) == before
        assert svc.open_session(scope, OpenSession(session_id="s", session_key="k", rebind_key=True)).active


def test_a_bad_idempotency_key_is_a_400_that_writes_nothing(server: Tenant, store: TranscriptStore) -> None:
    for key in ("x" * 256, "tab\there", "caf\u00e9"):
        status, data = create(server, {}, key)
        assert status == 400 and data["error"]["code"] == "invalid_input", (key, data)
        assert "Idempotency-Key" in data["error"]["message"]
    # Sent twice, with two values: which one the request is would be a guess.
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=60)
    try:
        conn.putrequest("POST", "/v1/sessions")
        for name, value in (("Authorization", f"Bearer {server.token_a}"), ("Content-Type", "application/json"),
                            ("Content-Length", "2"), ("Idempotency-Key", "one"), ("Idempotency-Key", "two")):
            conn.putheader(name, value)
        conn.endheaders(b"{}")
        response = conn.getresponse()
        status, data = response.status, json.loads(response.read())
    finally:
        conn.close()
    assert status == 400 and data["error"]["code"] == "invalid_input", data
    assert ids(store, server.scope_a) == []
    status, made = create(server, {}, "x" * 255)  # the longest key
    assert status == 200 and ids(store, server.scope_a) == [made["session_id"]]


def append(server: Tenant, sid: str, items: list[dict[str, Any]], key: str | None) -> tuple[int, Any]:
    headers = {"Idempotency-Key": key} if key is not None else None
    return server.call("POST", f"/v1/sessions/{sid}/entries", server.token_a, {"items": items}, headers=headers)


def test_a_retried_append_under_an_idempotency_key_appends_once(server: Tenant, store: TranscriptStore) -> None:
    """The header was read on ``POST /v1/sessions`` only: a client retrying an append under it after a lost
    answer appended its entries a second time. Each item with neither an entry_id nor an idempotency_key
    now takes a key derived from the header and its index; an item's own id or key stays its own."""
    from transcript_store.core import derived_id

    status, made = create(server, {"session_id": "s"}, None)
    assert status == 200, made
    items = [{"message": user("a")}, {"message": assistant("b")}, {"message": user("c"), "entry_id": "own-id"},
             {"message": assistant("d"), "idempotency_key": "own-key"}, {"kind": "custom", "payload": {"n": 1}}]
    status, first = append(server, "s", items, "append-1")
    assert status == 200, first
    request = derived_id("Idempotency-Key entries\x00append-1")
    assert [e["idempotency_key"] for e in first["entries"]] == [
        f"Idempotency-Key:{request}:0", f"Idempotency-Key:{request}:1", None, "own-key", f"Idempotency-Key:{request}:4"
    ]
    assert first["entries"][2]["entry_id"] == "own-id"
    rows = table_rows(store)
    for _ in range(2):  # the retries of a client whose answer was lost: the same entries, nothing written
        assert append(server, "s", items, "append-1") == (200, first)
        assert table_rows(store) == rows
    assert store.get_session(server.scope_a, "s").visible_count == 4
    # Another key is another request: appended again (so is a request without a key: items without ids).
    status, other = append(server, "s", items[:2], "append-2")
    assert status == 200 and [e["seq"] for e in other["entries"]] == [5, 6], other
    status, plain = append(server, "s", items[:1], None)
    assert status == 200 and plain["entries"][0]["idempotency_key"] is None
    assert store.get_session(server.scope_a, "s").visible_count == 7
    # The key names entries of its session only: another session's append under it writes there.
    create(server, {"session_id": "t"}, None)
    status, there = append(server, "t", items[:1], "append-1")
    assert status == 200 and there["entries"][0]["seq"] == 0


def test_an_idempotency_key_reused_for_another_append_is_a_409_that_writes_nothing(
    server: Tenant, store: TranscriptStore
) -> None:
    """The key is compared item by item, as an item's own idempotency_key is: another message at an index
    the first request used is 409 ``idempotency_conflict``; so is fewer or more items (below)."""
    create(server, {"session_id": "s"}, None)
    status, first = append(server, "s", [{"message": user("a")}, {"message": assistant("b")}], "reused")
    assert status == 200, first
    rows = table_rows(store)
    for items in ([{"message": user("other")}], [{"message": user("a")}, {"message": assistant("other")}],
                  [{"kind": "custom", "payload": {"x": 1}}], [{"message": user("a")}, {"message": user("b")}]):
        status, data = append(server, "s", items, "reused")
        assert status == 409 and data["error"]["code"] == "idempotency_conflict", (items, data)
        assert "Idempotency-Key 'reused'" in data["error"]["message"], data
        assert table_rows(store) == rows


def test_an_idempotency_key_reused_for_an_append_with_fewer_or_more_items_is_a_409_that_writes_nothing(
    server: Tenant, store: TranscriptStore
) -> None:
    """Compared item by item only, a prefix of the first request under its key was answered with the first
    entries (200), and a request with more items answered them and appended the rest (200): another request
    under a used key half answered. Either is 409 ``idempotency_conflict`` now, writing nothing; the same
    request again is answered as the first was."""
    create(server, {"session_id": "s"}, None)
    a, b, c = {"message": user("a")}, {"message": assistant("b")}, {"message": user("c")}
    status, first = append(server, "s", [a, b], "reused")
    assert status == 200, first
    rows = table_rows(store)
    for items, index in (([a], 1), ([a, b, c], 2), ([{"message": user("a"), "entry_id": "x"}], 0)):
        status, data = append(server, "s", items, "reused")
        assert status == 409 and data["error"]["code"] == "idempotency_conflict", (items, data)
        assert "Idempotency-Key 'reused'" in data["error"]["message"], data
        assert f"at index {index}" in data["error"]["message"], data
        assert table_rows(store) == rows
    assert append(server, "s", [a, b], "reused") == (200, first)
    assert table_rows(store) == rows


def test_appends_of_different_lengths_racing_under_one_idempotency_key_land_one_request(
    server: Tenant, store: TranscriptStore
) -> None:
    """Requests of one, two and three items racing under one key: the check runs in the append's own
    transaction, under the session's lock, so one request lands whole and every other one of another
    length is 409 (never its first entries answered, or its extras appended after another's)."""
    create(server, {"session_id": "s"}, None)
    bodies = [[{"message": user(f"m{i}")} for i in range(n)] for n in (1, 2, 3)] * 3
    results: list[tuple[int, int, Any]] = []

    def attempt(items: list[dict[str, Any]]) -> None:
        results.append((len(items), *append(server, "s", items, "raced")))

    threads = [threading.Thread(target=attempt, args=(items,)) for items in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    landed = {n for n, status, _ in results if status == 200}
    assert len(landed) == 1, results
    assert all(status == 409 for n, status, _ in results if n not in landed), results
    assert store.get_session(server.scope_a, "s").visible_count == landed.pop()


def test_items_with_their_own_keys_mixed_in_under_an_idempotency_key_are_compared_by_place(
    server: Tenant, store: TranscriptStore
) -> None:
    """Items with their own entry_id or idempotency_key keep them; the header keys the others by index. The
    same mixed request again is answered as the first; a keyless item where the first request had one with
    its own key, or the other way round, or fewer or more of them, is 409 and writes nothing."""
    create(server, {"session_id": "s"}, None)
    a, b, c = {"message": user("a")}, {"message": assistant("b")}, {"message": user("c")}
    own = {"message": assistant("own"), "entry_id": "own-id"}
    key = {"kind": "custom", "payload": {}, "idempotency_key": "k"}
    items = [a, own, b, key, c]
    status, first = append(server, "s", items, "mixed")
    assert status == 200 and [e["seq"] for e in first["entries"]] == [0, 1, 2, 3, 4], first
    rows = table_rows(store)
    assert append(server, "s", items, "mixed") == (200, first)
    assert table_rows(store) == rows
    for other in ([a, own, b, key], [a, own, b, key, c, c], [a, b, b, key, c], [a, own, b, key, own],
                  [own, a, b, key, c], [key]):
        status, data = append(server, "s", other, "mixed")
        assert status == 409 and data["error"]["code"] == "idempotency_conflict", (other, data)
        assert "Idempotency-Key 'mixed'" in data["error"]["message"], data
        assert table_rows(store) == rows
    # The first request's item at this one's length had its own key, and its items without one come after
    # it (index 4): answered 200 with the first three entries until the entries past the length were read.
    for shorter, index in (([a, own, b], 4), ([a, own, b, key], 4), ([a], 2), ([a, own], 2)):
        status, data = append(server, "s", shorter, "mixed")
        assert status == 409 and data["error"]["code"] == "idempotency_conflict", (shorter, data)
        assert f"at index {index}, where this one has none" in data["error"]["message"], data
        assert table_rows(store) == rows
    # Entries appended since (under another key, or none) do not stand in for the first request's.
    assert append(server, "s", [{"message": user("later")}, {"message": user("later-2")}], "later")[0] == 200
    assert append(server, "s", [{"message": user("plain")}], None)[0] == 200
    rows = table_rows(store)
    assert append(server, "s", items, "mixed") == (200, first)
    assert append(server, "s", [{"message": user("later")}], "later")[0] == 409
    assert table_rows(store) == rows
    # Under a fresh key the same items append again: their own ids and keys answer their entries.
    status, again = append(server, "s", items, "mixed-2")
    assert status == 200 and [e["seq"] for e in again["entries"]] == [8, 1, 9, 3, 10], again
    assert append(server, "s", items, "mixed-2") == (200, again)


def test_a_request_reusing_an_append_key_whose_first_keyed_items_lie_past_it_is_a_409_that_writes_nothing(
    server: Tenant, store: TranscriptStore
) -> None:
    """The first request's items without an id or key all came past the other request's length plus one,
    where the header's keys were looked for: a request of items with their own ids or keys only was
    answered by them (200, appending those that were new), and one whose items without them were all new
    appended them under the header's keys too (200), next to the first request's. Each is 409 now, writing
    nothing, and the first request's retry is still answered as it was."""
    create(server, {"session_id": "s"}, None)
    own = [{"message": user(f"own-{i}"), "entry_id": f"own-{i}"} for i in range(3)]
    keyed = {"kind": "custom", "payload": {}, "idempotency_key": "k"}
    items = [*own, keyed, {"message": user("a")}, {"message": assistant("b")}]
    status, first = append(server, "s", items, "past")
    assert status == 200, first
    rows = table_rows(store)
    for other in ([own[0]], [keyed], [{"message": user("new"), "entry_id": "new"}], [own[0], own[1], keyed],
                  [{"message": user("a")}], [own[0], {"message": user("a")}], [{"message": user("x")}] * 2):
        status, data = append(server, "s", other, "past")
        assert status == 409 and data["error"]["code"] == "idempotency_conflict", (other, data)
        assert "Idempotency-Key 'past'" in data["error"]["message"], data
        assert "at index 4, where this one has none" in data["error"]["message"], data
        assert table_rows(store) == rows, other
    # Its retry with an item of another id of its own where the first had one: found, the keyed items said
    # a retry, and the other item was appended (200). 409 too; so is any retry appending an entry.
    for index, item in ((0, {"message": user("new"), "entry_id": "new"}), (3, {**keyed, "idempotency_key": "k2"})):
        status, data = append(server, "s", [*items[:index], item, *items[index + 1:]], "past")
        assert status == 409 and data["error"]["code"] == "idempotency_conflict", (index, data)
        assert f"idempotency_key this one has at index {index}" in data["error"]["message"], data
        assert table_rows(store) == rows
    assert append(server, "s", items, "past") == (200, first)
    assert table_rows(store) == rows
    # A request under a fresh header with no item for it to key is 400: it left no trace of the header, so
    # another request under it afterwards was taken for a first one (200). Without the header it appends.
    for other in ([own[0]], [{"message": user("new"), "entry_id": "new"}, keyed]):
        status, data = append(server, "s", other, "fresh")
        assert status == 400 and data["error"]["code"] == "invalid_input", (other, data)
        assert "Idempotency-Key" in data["error"]["message"] and "without the header" in data["error"]["message"]
        assert table_rows(store) == rows
    status, data = append(server, "s", [{"message": user("new"), "entry_id": "new"}, keyed], None)
    assert status == 200 and [e["seq"] for e in data["entries"]] == [6, 3], data
    assert append(server, "s", [{"message": user("c")}], "fresh")[0] == 200


def test_an_append_with_a_bad_idempotency_key_or_a_reserved_item_key_is_a_400_that_writes_nothing(
    server: Tenant, store: TranscriptStore
) -> None:
    create(server, {"session_id": "s"}, None)
    rows = table_rows(store)
    for key in ("x" * 256, "tab\there", ""):
        status, data = append(server, "s", [{"message": user("a")}], key)
        assert status == 400 and data["error"]["code"] == "invalid_input", (key, data)
        assert "Idempotency-Key" in data["error"]["message"]
    # The keys derived from a header are the header's: an item cannot take one as its own, with or without one.
    for key in ("k", None):
        status, data = append(server, "s", [{"message": user("a"), "idempotency_key": "Idempotency-Key:x:0"}], key)
        assert status == 400 and data["error"]["code"] == "invalid_input", (key, data)
        assert "Idempotency-Key:" in data["error"]["message"]
    status, data = _two_keys(server, "/v1/sessions/s/entries", {"items": [{"message": user("a")}]})
    assert status == 400 and data["error"]["code"] == "invalid_input", data
    assert table_rows(store) == rows
    status, data = append(server, "s", [{"message": user("a")}], "x" * 255)  # the longest key
    assert status == 200 and data["entries"][0]["idempotency_key"].startswith("Idempotency-Key:")


def test_an_append_under_an_idempotency_key_to_a_missing_or_foreign_session_is_a_404_as_without_it(
    server: Tenant, store: TranscriptStore
) -> None:
    """An append whose every item has its own id or key, under a header, to a session the scope does not
    have was 400 ``invalid_input`` (send it without the header), and without the header it is 404: the
    client dropping the header was answered 404 then. It is 404 ``session_not_found`` whatever the header
    and the items, for an id no session has and for another scope's session alike, writing nothing."""
    create(server, {"session_id": "s"}, None, token=server.token_b)  # scope B's session s: not scope A's
    rows = table_rows(store)
    bodies = ([{"message": user("a"), "entry_id": "own"}], [{"message": user("a"), "idempotency_key": "own"}],
              [{"message": user("a")}, {"message": user("b"), "entry_id": "own"}])
    for sid in ("nope", "s"):
        for items in bodies:
            for key in (None, "fresh"):
                status, data = append(server, sid, items, key)
                assert status == 404 and data["error"]["code"] == "session_not_found", (sid, items, key, data)
    assert table_rows(store) == rows


def _two_keys(server: Tenant, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """``POST path`` with two Idempotency-Key headers."""
    raw = json.dumps(body).encode()
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=60)
    try:
        conn.putrequest("POST", path)
        for name, value in (("Authorization", f"Bearer {server.token_a}"), ("Content-Type", "application/json"),
                            ("Content-Length", str(len(raw))), ("Idempotency-Key", "one"), ("Idempotency-Key", "two")):
            conn.putheader(name, value)
        conn.endheaders(raw)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_an_idempotency_key_on_a_route_safe_to_retry_by_its_body_is_refused_and_writes_nothing(
    server: Tenant, store: TranscriptStore
) -> None:
    """Every other writing route was silent about the header: a client counting on it for a safe retry was
    misled (a compaction's retry compacted again). Such a request is 400 ``invalid_input`` naming what makes
    the route's retry safe, writing nothing, on a first request and its retries alike; the request without
    the header acts, and its reads (GET, delta, assemble) ignore the header as before."""
    create(server, {"session_id": "s"}, None)
    engine = "/v1/engines/legacy/sessions/s"
    turn = {"advancement_key": "k0", "admission": {"entry_id": "u0", "position": 0},
            "terminal": {"entry_id": "a0", "position": 1}, "messages": [user("q0"), assistant("a0")]}
    routes: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
        (f"{engine}/commit_turn", turn, {**turn, "messages": [user("q1"), assistant("a1")]}, "advancement_key"),
        (f"{engine}/host_compaction", {"summary": "they talked", "first_kept_position": 0, "first_kept_entry_id": "u0"},
         {"summary": "other", "first_kept_position": 0, "first_kept_entry_id": "u0"}, "first_kept_entry_id"),
        ("/v1/sessions/s/admissions", {"message": user("q1"), "turn_id": "t1"},
         {"message": user("other"), "turn_id": "t1"}, "turn_id"),
        (f"{engine}/compact", {}, {"force": False}, '"force": false'),
        (f"{engine}/maintain", {}, {}, "retried safely as it is"),
        (f"{engine}/bootstrap", {"page": {"entries": [{"entry_id": "h0", "message": user("x")}]}},
         {"page": {"entries": [{"entry_id": "h1", "message": user("y")}]}}, "page.cursor"),
    ]
    for path, body, other, field in routes:
        rows = table_rows(store)
        for sent in (body, body, other):  # a first request, its retry, another body under the same key
            status, data = server.call("POST", path, server.token_a, sent, headers={"Idempotency-Key": "safe-1"})
            assert status == 400 and data["error"]["code"] == "invalid_input", (path, data)
            assert "Idempotency-Key" in data["error"]["message"] and field in data["error"]["message"], (path, data)
        status, data = _two_keys(server, path, body)
        assert status == 400 and data["error"]["code"] == "invalid_input", (path, data)
        assert table_rows(store) == rows, path
        status, data = server.call("POST", path, server.token_a, body)  # without the header it acts
        assert status == 200, (path, data)
    # The header changes nothing on a read.
    for method, path, body in (("GET", "/v1/sessions/s", None), ("POST", "/v1/sessions/s/delta", {}),
                               ("POST", f"{engine}/assemble", {}), ("GET", f"{engine}/receipts", None)):
        rows = table_rows(store)
        assert server.call(method, path, server.token_a, body, headers={"Idempotency-Key": "read"}) == \
            server.call(method, path, server.token_a, body), path
        assert table_rows(store) == rows, path


def test_the_service_api_derives_the_item_keys_of_an_append_under_an_idempotency_key(
    store: TranscriptStore, scope: str
) -> None:
    """``Service.append`` takes the header's value as the HTTP route passes it: a retry appends nothing, a bad
    key or a reserved item key is InvalidInput; items of a request built without validation are keyed too."""
    from mirror_helpers import legacy_service

    from transcript_store.errors import IdempotencyConflict, InvalidInput
    from transcript_store.service import header_item_key
    from transcript_store.service_models import AppendRequest

    store.create_session(scope, session_id="s")
    for svc in legacy_service(store):
        req = AppendRequest(items=[{"message": user("a")}])
        first = svc.append(scope, "s", req, "api-1")
        assert first[0].idempotency_key == header_item_key("api-1", 0)
        assert svc.append(scope, "s", req, "api-1") == first
        raw = AppendRequest.model_construct(items=[{"message": user("a")}])
        assert svc.append(scope, "s", raw, "api-1") == first
        rows = table_rows(store)
        with pytest.raises(IdempotencyConflict, match="Idempotency-Key 'api-1'"):
            svc.append(scope, "s", AppendRequest(items=[{"message": user("b")}]), "api-1")
        with pytest.raises(InvalidInput, match="Idempotency-Key"):
            svc.append(scope, "s", req, "")
        reserved = AppendRequest(items=[{"message": user("b"), "idempotency_key": first[0].idempotency_key}])
        with pytest.raises(InvalidInput, match="Idempotency-Key:"):
            svc.append(scope, "s", reserved)
        assert table_rows(store) == rows
        assert len(header_item_key("x" * 255, 9_999)) <= 43


def test_an_append_under_an_idempotency_key_retried_after_a_lost_commit_answers_its_entries(
    shared_url: str, scope: str
) -> None:
    """The transaction retried after its COMMIT landed finds every item it keyed: the same request, not a
    409 for a request that found some of them."""
    from mirror_helpers import legacy_service
    from test_faults_connections import lose_commits

    from transcript_store.service_models import AppendRequest

    # A store of its own: the commits it loses are its own, not those of the module's store.
    with TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False)) as store:
        store.create_session(scope, session_id="s")
        lose = [0]

        def lost() -> bool:
            lose[0] -= 1
            return lose[0] >= 0

        for svc in legacy_service(store):
            req = AppendRequest(items=[{"message": user("a")}, {"message": assistant("b"), "entry_id": "own"},
                                       {"message": user("c")}])
            lose_commits(store, lost)
            lose[0] = 1
            first = svc.append(scope, "s", req, "lost-1")
            assert lose[0] < 0 and [e.seq for e in first] == [0, 1, 2]
            rows = table_rows(store)
            assert svc.append(scope, "s", req, "lost-1") == first
            assert table_rows(store) == rows


def test_an_append_item_with_an_empty_key_of_its_own_is_refused_under_an_idempotency_key_too(
    server: Tenant, store: TranscriptStore
) -> None:
    """An item's own empty ``idempotency_key`` is 400 ``invalid_input`` without the header; under one it was
    taken for no key, given the header's, and appended (200): the invalid input was silently replaced."""
    create(server, {"session_id": "s"}, None)
    rows = table_rows(store)
    for key in (None, "append-empty"):
        status, data = append(server, "s", [{"message": user("a"), "idempotency_key": ""}], key)
        assert status == 400 and data["error"]["code"] == "invalid_input", (key, data)
        assert "idempotency_key" in data["error"]["message"], data
    assert table_rows(store) == rows


def test_the_service_api_refuses_append_items_that_are_not_a_list(store: TranscriptStore, scope: str) -> None:
    """A request built without validation whose items are not a list was InvalidInput from the store; read
    for reserved keys first, None (or a number) was a TypeError, with the header or without."""
    from mirror_helpers import legacy_service

    from transcript_store.errors import InvalidInput
    from transcript_store.service_models import AppendRequest

    store.create_session(scope, session_id="s")
    rows = table_rows(store)
    for svc in legacy_service(store):
        for items in (None, 5, "ab"):
            for key in (None, "api-1"):
                with pytest.raises(InvalidInput, match="items must be a list"):
                    svc.append(scope, "s", AppendRequest.model_construct(items=items), key)
    assert table_rows(store) == rows


# ---------------------------------------------------------------------------------------------- not UTF-8


ODD = "\ufffd"  # what a byte that is not UTF-8 decoded to
#: percent-encoded bytes that are not UTF-8: a lone continuation byte, 0xFF, an overlong '/', a surrogate
BAD = ("%FF", "a%80b", "%C0%AF", "%ED%A0%80")


def test_a_path_that_is_not_utf8_reaches_no_session_and_writes_nothing(
    server: Tenant, store: TranscriptStore
) -> None:
    for sid in (ODD, f"a{ODD}b", ODD * 2, ODD * 3):
        status, _ = create(server, {"session_id": sid}, None)
        assert status == 200
    turn = {"advancement_key": "K1", "admission": {"entry_id": "u1", "position": 0},
            "terminal": {"entry_id": "a1", "position": 1}, "messages": [user("q"), assistant("a")]}
    status, _ = server.call("POST", f"/v1/engines/legacy/sessions/{quote(ODD)}/commit_turn", server.token_a, turn)
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
            status, data = server.call(method, path, server.token_a, body)
            assert status == 400 and data["error"]["code"] == "invalid_input", (method, path, status, data)
            assert "UTF-8" in data["error"]["message"], data
            assert set(data["error"]) == {"code", "message"}
    # A token is still asked for first, as on every route.
    status, data = server.call("GET", "/v1/sessions/%FF", None)
    assert status == 401 and data["error"]["code"] == "unauthorized"
    assert table_rows(store) == before
    status, data = server.call("GET", f"/v1/sessions/{quote(ODD)}", server.token_a)
    assert status == 200 and data["session_id"] == ODD


def test_a_query_that_is_not_utf8_is_refused(server: Tenant, store: TranscriptStore) -> None:
    status, _ = create(server, {"session_id": "holder", "session_key": ODD}, None)
    assert status == 200
    status, _ = create(server, {"session_id": ODD}, None)
    assert status == 200
    for query in ("session_key=%FF", "after=%FF", "session_key=a%C0%AFb", "%FF=1", "limit=10&after=%ED%A0%80"):
        for path in ("/v1/sessions", "/v1/engines/legacy/sessions/holder/receipts"):
            status, data = server.call("GET", f"{path}?{query}", server.token_a)
            assert status == 400 and data["error"]["code"] == "invalid_input", (path, query, data)
            assert "UTF-8" in data["error"]["message"], data
    # The same characters, sent as UTF-8, are read as they are.
    status, data = server.call("GET", f"/v1/sessions?session_key={quote(ODD)}", server.token_a)
    assert status == 200 and [s["session_id"] for s in data["sessions"]] == ["holder"]
    status, data = server.call("GET", f"/v1/sessions?after={quote('holder')}", server.token_a)
    assert status == 200 and [s["session_id"] for s in data["sessions"]] == [ODD]


def test_a_query_parameter_the_route_does_not_take_or_given_twice_is_refused(
    server: Tenant, store: TranscriptStore
) -> None:
    """A typo (``?sesion_key=``) listed the whole scope: an unknown query parameter was dropped; of one given
    twice the last counted. Both are 422 ``invalid_request`` now, on reads and writes, and write nothing."""
    for sid, key in (("one", "agent:a:one"), ("two", "agent:a:two")):
        status, _ = create(server, {"session_id": sid, "session_key": key}, None)
        assert status == 200
    before = table_rows(store)
    refused = [
        ("GET", "/v1/sessions?sesion_key=agent:a:one", None, "sesion_key"),
        ("GET", "/v1/sessions?limit=1&limit=5", None, "limit"),
        ("GET", "/v1/sessions/one?verbose=1", None, "verbose"),
        ("GET", "/v1/engines/legacy/sessions/one/receipts?after=a&after=b", None, "after"),
        ("POST", "/v1/sessions/one/entries?dry_run=1", {"items": [{"message": user("hi")}]}, "dry_run"),
        ("POST", "/v1/sessions?session_id=three", {}, "session_id"),
    ]
    for method, path, body, name in refused:
        status, data = server.call(method, path, server.token_a, body)
        assert status == 422 and data["error"]["code"] == "invalid_request", (path, data)
        assert name in data["error"]["message"], (path, data)
    assert table_rows(store) == before
    # What the routes do take still works, and an empty query string is no parameter.
    status, data = server.call("GET", "/v1/sessions?session_key=agent:a:one&limit=5", server.token_a)
    assert status == 200 and [s["session_id"] for s in data["sessions"]] == ["one"]
    status, data = server.call("GET", "/v1/sessions/one?", server.token_a)
    assert status == 200 and data["session_id"] == "one"
    status, data = server.call("POST", "/v1/sessions/one/entries", server.token_a,
                               {"items": [{"message": user("hi")}, {"message": assistant("hello")}]})
    assert status == 200, data


def test_a_create_by_id_answers_the_session_only_with_its_own_session_key(
    server: Tenant, store: TranscriptStore
) -> None:
    """README: ``POST /v1/sessions`` with a ``session_id`` answers the session as it is when asked with the
    ``session_key`` it was made with (or none, for one made without): another key, or none beside a key,
    is 409 ``idempotency_conflict`` and writes nothing. README said only "answers it as it is", and a
    client reading it got a 409 for ``{"session_id": X}`` on a session made with a key."""
    status, made = create(server, {"session_id": "by-id", "session_key": "k1"}, None)
    assert status == 200, made
    assert create(server, {"session_id": "by-id", "session_key": "k1"}, None) == (200, made)
    for body in ({"session_id": "by-id"}, {"session_id": "by-id", "session_key": "k2"}):
        status, data = create(server, body, None)
        assert status == 409 and data["error"]["code"] == "idempotency_conflict", (body, data)
    status, bare = create(server, {"session_id": "bare"}, None)
    assert status == 200 and create(server, {"session_id": "bare"}, None) == (200, bare)
    status, data = create(server, {"session_id": "bare", "session_key": "k3"}, None)
    assert status == 409 and data["error"]["code"] == "idempotency_conflict", data
    # Nothing written by the refusals: both sessions as they were made, k2 and k3 held by none.
    stored = [store.get_session(server.scope_a, sid) for sid in ("by-id", "bare")]
    assert [(s.session_key, s.active, s.incarnation) for s in stored] == [
        ("k1", True, made["incarnation"]), (None, True, bare["incarnation"])]
    assert store.find_session(server.scope_a, "k2") is None and store.find_session(server.scope_a, "k3") is None
    assert sorted(ids(store, server.scope_a)) == ["bare", "by-id"]
