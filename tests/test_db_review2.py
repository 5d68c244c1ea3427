"""Findings of the database-layer review (round 2): reading the schema revision, which every store's open
does, was the one read not retried on a transient error; a SQLite path under an unknown user's home
(``~nobody/x.db``) was an untyped RuntimeError; a SQLite URL's query without ``name=value`` was dropped."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from conftest import PG_ADMIN
from sqlalchemy.engine import make_url
from test_cli import one_error_line, run

from transcript_store import InvalidInput, StoreConfig, TranscriptStore, migrate


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


UNKNOWN_HOME = "sqlite:///~no-such-user-h10/store.db"


def test_a_sqlite_path_under_an_unknown_users_home_is_invalid_input(tmp_path: Path) -> None:
    """``~user`` of a user this system does not know: expanding it raised RuntimeError out of the library
    (untyped), an "internal error" in the CLI (exit 1), instead of a bad URL (InvalidInput, exit 2)."""
    with pytest.raises(InvalidInput, match="home folder of a user"):
        TranscriptStore(UNKNOWN_HOME)
    with pytest.raises(InvalidInput, match="home folder of a user"):
        TranscriptStore.upgrade_url(UNKNOWN_HOME)
    for command in (["init"], ["current"], ["doctor"], ["sessions", "export", "s1"]):
        result = run(*command, "--db", UNKNOWN_HOME, cwd=tmp_path, code=2)
        assert "home folder of a user" in one_error_line(result), command
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tail", ["?b.db", "?", "?timeout", "?timeout="])
def test_a_sqlite_url_whose_query_holds_no_parameter_is_refused_too(tail: str, tmp_path: Path) -> None:
    """A query with no ``name=value`` in it (``sqlite:///my?file.db``: a ``?`` in a file name) was dropped
    without a word: the store was made in another file, ``my``, than the one named, and a later command
    with the ``?`` written %3F found no store there."""
    url = f"sqlite:///{tmp_path / 'my'}{tail}"
    with pytest.raises(InvalidInput, match="takes no query parameters"):
        TranscriptStore(url)
    line = one_error_line(run("init", "--db", url, cwd=tmp_path, code=2))
    assert "no query parameters" in line and "%3F" in line, line
    assert list(tmp_path.iterdir()) == []
