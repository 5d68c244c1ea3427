"""A service closed under a request still running, reviewed: SQLAlchemy connects again on use after its
engine was disposed of, so a request outliving ``Service.close`` reopened database connections (PostgreSQL
backends, SQLite file handles) that nothing closed again. Now any store call after the close raises
``StoreClosed`` and opens nothing, and a call running across the close ends with its connection closed.
Counted on the real servers: ``pg_stat_activity`` for the test database, this process's open files."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from conftest import PG_ADMIN

from transcript_store import StoreClosed, TranscriptStore
from transcript_store.core import Core
from transcript_store.db import sqlite_file
from transcript_store.errors import StoreUnavailable
from transcript_store.service import Service
from transcript_store.service_models import OpenSession
from transcript_store.settings import load_settings

SCOPE = "tenant-close3"


def open_connections(store_url: str) -> int:
    """PostgreSQL backends connected to the store's database, or this process's open handles of the
    SQLite database's files (the database, its -wal and -shm)."""
    path = sqlite_file(store_url)
    if path is not None:
        names = {str(path.resolve()) + suffix for suffix in ("", "-wal", "-shm")}
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed since it was listed
                count += os.readlink(f"/proc/self/fd/{fd}") in names
        return count
    dbname = store_url.rsplit("/", 1)[1]
    deadline = time.monotonic() + 5  # a backend whose client hung up exits a moment later
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        while True:
            row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (dbname,)).fetchone()
            assert row is not None
            if row[0] == 0 or time.monotonic() > deadline:
                return int(row[0])
            time.sleep(0.05)


def straggler(service: Service, work: Callable[[], Any]) -> tuple[threading.Thread, threading.Event, list[Any]]:
    """A request thread counted in the service's calls, which runs ``work`` once released."""
    release, outcome = threading.Event(), []

    def request() -> None:
        with service.inflight.call():
            assert release.wait(30)
            try:
                outcome.append(work())
            except BaseException as e:  # the test reads what the request got
                outcome.append(e)

    thread = threading.Thread(target=request)
    thread.start()
    return thread, release, outcome


def make_service(store: TranscriptStore) -> Service:
    return Service(store, load_settings(config_path=None, engine="legacy"))


def test_a_request_outliving_the_close_opens_no_connection(store: TranscriptStore, store_url: str) -> None:
    """The request reaches the store only after ``close`` gave up waiting for it: it gets StoreClosed (a
    StoreUnavailable: 503 over HTTP), writes nothing, and no connection is open afterwards."""
    service = make_service(store)
    store.create_session(SCOPE, session_id="kept")
    calls: list[Callable[[], Any]] = [
        lambda: service.open_session(SCOPE, OpenSession(session_key="agent:late")),
        lambda: store.get_session(SCOPE, "kept"),
        lambda: store.create_session(SCOPE, session_id="late"),
    ]
    thread, release, outcome = straggler(service, lambda: [_caught(call) for call in calls])
    service.close(wait_seconds=0.2)
    assert open_connections(store_url) == 0
    release.set()
    thread.join(30)
    assert (open_connections(store_url), len(outcome)) == (0, 1)  # the store was connected to again: 1
    assert len(outcome[0]) == len(calls)
    for got in outcome[0]:
        assert isinstance(got, StoreClosed) and isinstance(got, StoreUnavailable), got
        assert "the store is closed" in str(got)
    assert open_connections(store_url) == 0
    with TranscriptStore(store_url) as again:  # nothing written by the straggler
        assert [s.session_id for s in again.list_sessions(SCOPE)] == ["kept"]
    assert open_connections(store_url) == 0


def _caught(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as e:
        return e


def test_a_transaction_running_across_the_close_ends_with_its_connection_closed(
    store: TranscriptStore, store_url: str
) -> None:
    """A write already running when ``close`` gave up: it ends as it would (its own transaction), but its
    connection is closed with it, not handed back to the disposed pool (where nothing ever closed it);
    its next call raises StoreClosed."""
    service = make_service(store)
    inside, go_on = threading.Event(), threading.Event()

    def slow(c: Core) -> str:
        inside.set()
        assert go_on.wait(30)
        return c.create_session(SCOPE, "across", None).session_id

    def work() -> list[Any]:
        first = _caught(lambda: store.write(slow))
        left = open_connections(store_url)  # the write's connection, had it gone back to the disposed pool
        return [first, left, _caught(lambda: store.get_session(SCOPE, "across"))]

    thread, release, outcome = straggler(service, work)
    release.set()
    assert inside.wait(30)
    service.close(wait_seconds=0.2)
    go_on.set()
    thread.join(30)
    assert len(outcome) == 1
    first, left, second = outcome[0]
    assert not isinstance(first, BaseException), first
    assert (left, open_connections(store_url)) == (0, 0)
    assert isinstance(second, StoreClosed), second


def test_migrations_and_engines_after_the_close_connect_to_nothing(store: TranscriptStore, store_url: str) -> None:
    """The schema calls connect through the engine itself: refused all the same once closed; and an
    engine's background work outliving the close fails with StoreClosed without being quarantined (the
    close's doing, not the engine's)."""
    service = make_service(store)
    service.close(wait_seconds=0)
    for call in (store.current_revision, store.upgrade, store.ensure_current):
        with pytest.raises(StoreClosed):
            call()
    assert not service.runtime._database_failed(RuntimeError("engine bug"))
    assert service.runtime._database_failed(StoreClosed("closed"))
    assert open_connections(store_url) == 0


def test_close_is_idempotent_and_a_new_store_serves(store_url: str) -> None:
    """Closing twice is fine; another ``TranscriptStore`` on the same database works as before."""
    first = TranscriptStore(store_url)
    first.create_session(SCOPE, session_id="one")
    first.close()
    first.close()
    with pytest.raises(StoreClosed):
        first.get_session(SCOPE, "one")
    with TranscriptStore(store_url) as second:
        assert second.get_session(SCOPE, "one").session_id == "one"
    assert open_connections(store_url) == 0
