"""Findings of the database-layer review (round 2): reading the schema revision, which every store's open
does, was the one read not retried on a transient error."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from conftest import PG_ADMIN
from sqlalchemy.engine import make_url

from transcript_store import StoreConfig, TranscriptStore, migrate


@contextmanager
def refusing_for_a_moment(store_url: str, backend: str, seconds: float) -> Iterator[None]:
    """The database refuses the store's connections (PostgreSQL: ALLOW_CONNECTIONS false, as a server
    shutting down or starting does) or its reads (SQLite: another connection's exclusive lock) for
    ``seconds`` from now, then takes them again."""
    if backend == "sqlite":
        path = make_url(store_url).database
        assert path is not None
        blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        blocker.execute("PRAGMA locking_mode = EXCLUSIVE")
        blocker.execute("BEGIN EXCLUSIVE")
        blocker.execute("SELECT count(*) FROM alembic_version").fetchall()

        def release() -> None:
            blocker.execute("COMMIT")
            blocker.close()
    else:
        name = make_url(store_url).database

        def allow(on: bool) -> None:
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS {'true' if on else 'false'}")

        allow(False)

        def release() -> None:
            allow(True)

    releaser = threading.Timer(seconds, release)
    releaser.start()
    try:
        yield
    finally:
        releaser.join()


def test_a_store_opened_while_its_database_refuses_for_a_moment_opens_once_it_takes_it_again(
    store_url: str, backend: str
) -> None:
    """Opening a store reads its schema revision; that read was the one not retried on a transient
    error: a service or gateway worker started while PostgreSQL restarted (or while another process held
    a SQLite store's lock past the busy timeout) failed at once, TransientStoreError (the CLI's exit 5),
    with every one of its retries (TRANSCRIPT_STORE_RETRY_ATTEMPTS) unused."""
    config = StoreConfig(url=store_url, retry_attempts=100, busy_timeout_ms=0, auto_upgrade=False)
    with refusing_for_a_moment(store_url, backend, 0.3):
        started = time.monotonic()
        store = TranscriptStore(config=config)
    try:
        assert store.db.retries > 0 and time.monotonic() - started >= 0.25
        assert store.current_revision() == migrate.HEAD
    finally:
        store.close()


def test_the_revision_read_by_itself_is_retried_too(store_url: str, backend: str) -> None:
    """``TranscriptStore.current_revision`` (the CLI's ``current``, ``doctor``, ``upgrade``'s check) is retried
    as every other read."""
    store = TranscriptStore(config=StoreConfig(url=store_url, retry_attempts=100, busy_timeout_ms=0,
                                               auto_upgrade=False))
    try:
        store.db.dispose()  # (PostgreSQL: no pooled connection that the refusal would leave open)
        with refusing_for_a_moment(store_url, backend, 0.3):
            assert store.current_revision() == migrate.HEAD
        assert store.db.retries > 0
    finally:
        store.close()
