"""Opening a store without its schema: ``TranscriptStore(url, create=False)`` opens without checking or
migrating (the CLI's init migrates afterwards), so a database that holds no store is found at first use.
That first use is ``SchemaNotCurrent`` with the command that makes one, on both backends, never a
driver's "no such table" as ``StoreUnavailable`` (which reads as a database outage)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BACKENDS, RUN_ID, _admin_exec, _pg_reachable, pg_url

from transcript_store import SchemaNotCurrent, TranscriptStore
from transcript_store.turns import Turns


@pytest.fixture(params=BACKENDS)
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database without any schema: a SQLite path in a folder not made yet, or an empty PostgreSQL one."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'not-yet' / 'store.db'}"
        return
    problem = _pg_reachable()
    if problem is not None:
        pytest.skip(f"PostgreSQL unreachable: {problem}")
    name = f"ts_empty_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    _admin_exec(f"CREATE DATABASE {name}")
    try:
        yield pg_url(name)
    finally:
        _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_store_opened_without_create_on_no_schema_says_schema_not_current(empty_url: str) -> None:
    with TranscriptStore(empty_url, create=False) as store:
        assert store.current_revision() is None
        with pytest.raises(SchemaNotCurrent, match=r"no transcript-store schema.*transcript-store init"):
            store.create_session("s")
        with pytest.raises(SchemaNotCurrent, match="transcript-store init"):
            store.read_visible_delta("s", "nothing")  # the one-statement path too
        with pytest.raises(SchemaNotCurrent, match="transcript-store init"):
            Turns(store).intents("s")
        # Nothing was made on the way: migrating is still the store's first change.
        assert store.upgrade() == store.current_revision()
        assert store.create_session("s").scope == "s"
