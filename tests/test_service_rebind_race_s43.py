"""`"rebind_key": true` racing another request that makes the key's holder, on a real server process.

A rebind takes a lock on its key, so rebinds of one key queue up and each finds the holder the one before
it left. The other requests that make a key's holder take no such lock: an open by key
(``{"session_key": K}``), a create by id with the key but no rebind, an ``Idempotency-Key`` open. One of
them that made the holder after the rebind looked for it, and committed while the rebind's insert waited
for it (PostgreSQL: the insert then did nothing), left the rebind answered 409 ``session_key_conflict``,
though a rebind ends the key's other holder, whichever it is (README, "OpenClaw"). SQLite's writers queue
up whole, so there the rebind always finds that holder; the test runs on both backends all the same.

A rebind naming a session that has ended answers it as it is (an ended session never takes a key back),
but only when asked with the key the session was made with, as any create by id: with another key it was
answered 200 whenever that key had a holder, where a create by id (and the same rebind without a holder)
is 409 ``idempotency_conflict``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import module_store_fixtures
from service_process import SharedServer, Tenant
from sqlalchemy import text
from workers.fault_worker import table_rows

from transcript_store import TranscriptStore
from transcript_store.core import Core

shared_url, store, _ = module_store_fixtures("unused", "service_rebind_race")

#: backends of this database waiting for another transaction's lock (PostgreSQL)
_LOCK_WAITS = text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
)


@pytest.fixture(scope="module")
def shared_server(shared_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer]:
    with SharedServer(shared_url, tmp_path_factory.mktemp("service_rebind_race") / "serve.log", tenants=4) as shared:
        yield shared


@pytest.fixture
def server(shared_server: SharedServer) -> Tenant:
    """This test's scopes on the module's server."""
    return shared_server.tenant()


def wait_for_a_lock_wait(store: TranscriptStore) -> None:
    """Until a request of the server waits for the test's open transaction (PostgreSQL); a moment on SQLite,
    whose writer waits for the write lock out of sight."""
    if store.backend == "sqlite":
        time.sleep(0.5)
        return
    deadline = time.monotonic() + 30
    while store.read(lambda c: int(c.conn.execute(_LOCK_WAITS).scalar_one())) == 0:
        assert time.monotonic() < deadline, "the rebind never waited for the other holder's insert"
        time.sleep(0.05)


def test_a_rebind_ends_a_holder_another_request_made_while_it_ran(server: Tenant, store: TranscriptStore) -> None:
    """The key's holder, made by another request (as an open by key makes it) after the rebind looked for it
    and committed while the rebind's insert waited for it, is ended by the rebind, which takes the key."""
    scope, key = server.scope_a, f"key-{uuid.uuid4().hex[:8]}"
    rebound, other = f"rebound-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    made, release = threading.Event(), threading.Event()

    def make_holder(c: Core) -> None:
        c.create_session(scope, other, key)
        made.set()
        assert release.wait(30)

    holder = threading.Thread(target=store.write, args=(make_holder,))
    holder.start()
    answers: list[tuple[int, Any]] = []
    try:
        assert made.wait(30)
        body = {"session_id": rebound, "session_key": key, "rebind_key": True}
        rebind = threading.Thread(target=lambda: answers.append(server.call("POST", "/v1/sessions", server.token_a,
                                                                             body)))
        rebind.start()
        wait_for_a_lock_wait(store)
    finally:
        release.set()
        holder.join(30)
    rebind.join(60)
    assert len(answers) == 1
    status, answer = answers[0]
    assert status == 200, answer
    assert (answer["session_id"], answer["session_key"], answer["active"]) == (rebound, key, True)
    assert store.find_session(scope, key) is not None and store.find_session(scope, key).session_id == rebound
    assert store.get_session(scope, other).active is False


def test_a_rebind_naming_an_ended_session_made_with_another_key_is_a_409_that_writes_nothing(
    server: Tenant, store: TranscriptStore
) -> None:
    """A session is answered by its id only when asked with the key it was made with: another key is 409
    ``idempotency_conflict`` (README). An ended session asked by a rebind with another key was answered 200
    as it was, holding its own key, when that other key had a holder (and 409 when it had none); a late
    replay of the rebind that ended it (its own key) is still answered as it is, the holder keeping it."""
    scope, tag = server.scope_a, uuid.uuid4().hex[:8]
    ended, successor, holder = f"ended-{tag}", f"successor-{tag}", f"holder-{tag}"
    made_with, other = f"made-with-{tag}", f"other-{tag}"

    def post(body: dict[str, Any]) -> tuple[int, Any]:
        return server.call("POST", "/v1/sessions", server.token_a, body)

    assert post({"session_id": ended, "session_key": made_with})[0] == 200
    assert post({"session_id": successor, "session_key": made_with, "rebind_key": True})[0] == 200  # ends it
    for held in (False, True):  # the other key without a holder, then with one
        if held:
            assert post({"session_id": holder, "session_key": other})[0] == 200
        before = table_rows(store)
        status, answer = post({"session_id": ended, "session_key": other, "rebind_key": True})
        assert (status, answer.get("error", {}).get("code")) == (409, "idempotency_conflict"), (held, answer)
        assert table_rows(store) == before, held
        # The same key without a rebind is refused the same way.
        assert post({"session_id": ended, "session_key": other})[0] == 409
    assert store.find_session(scope, other) is not None and store.find_session(scope, other).session_id == holder
    # Replayed with the key it was made with, the ended session is answered as it is; the key stays put.
    status, answer = post({"session_id": ended, "session_key": made_with, "rebind_key": True})
    assert status == 200 and (answer["session_key"], answer["active"]) == (made_with, False)
    assert store.find_session(scope, made_with) is not None
    assert store.find_session(scope, made_with).session_id == successor
