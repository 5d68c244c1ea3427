"""PostgreSQL text goes over the wire as UTF-8 whatever the environment, and a database that cannot hold
any Unicode text (LATIN1, SQL_ASCII) is refused when the store opens it, before anything is written.

A review found: under ``PGCLIENTENCODING=LATIN1`` (or on a LATIN1 database) an append of a message with
an emoji left the store as ``UnicodeEncodeError``, not a store error, where SQLite took it; a SQL_ASCII
database could not even be opened (SQLAlchemy's first connect raised ``TypeError``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from conftest import _PG_PROBLEM, PG_ADMIN, pg_url

from transcript_store import StoreConfig, StoreUnavailable, TranscriptStore

EMOJI = "caf\u00e9 \U0001f600 \u65e5\u672c"


def _admin(sql: str, dbname: str | None = None) -> list[tuple[object, ...]]:
    info = PG_ADMIN if dbname is None else psycopg.conninfo.make_conninfo(PG_ADMIN, dbname=dbname)
    with psycopg.connect(info, autocommit=True) as conn:
        cur = conn.execute(sql)
        return cur.fetchall() if cur.description else []


@pytest.fixture(params=["LATIN1", "SQL_ASCII"])
def narrow_db(request: pytest.FixtureRequest) -> Iterator[str]:
    """An empty database whose encoding cannot hold every Unicode character."""
    if _PG_PROBLEM is not None:
        pytest.skip(f"PostgreSQL unreachable: {_PG_PROBLEM}")
    name = f"ts_enc_{uuid.uuid4().hex[:10]}"
    _admin(f"CREATE DATABASE {name} ENCODING '{request.param}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    try:
        yield name
    finally:
        _admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_database_not_in_utf8_is_refused_before_anything_is_written(narrow_db: str) -> None:
    url = pg_url(narrow_db)
    with pytest.raises(StoreUnavailable, match=r"encoding is (LATIN1|SQL_ASCII), not UTF8"):
        TranscriptStore.upgrade_url(url)
    with pytest.raises(StoreUnavailable, match="not UTF8"):
        TranscriptStore(config=StoreConfig(url=url, auto_upgrade=True))
    tables = _admin("SELECT tablename FROM pg_tables WHERE schemaname = 'public'", narrow_db)
    assert tables == []  # no schema, no version table: nothing was written


def test_text_goes_as_utf8_whatever_pgclientencoding_says(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's connections speak UTF-8 to the server: libpq's PGCLIENTENCODING (here LATIN1, which
    has no emoji) does not decide which messages and ids can be stored."""
    monkeypatch.setenv("PGCLIENTENCODING", "LATIN1")
    store = TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False))
    try:
        sid = store.create_session("scope-\U0001f600", session_id="s-\U0001f600").session_id
        entry = store.append("scope-\U0001f600", sid, {"role": "user", "content": EMOJI}, entry_id="e-\U0001f600")
        assert store.get_entries("scope-\U0001f600", sid, [entry.entry_id])[0].message["content"] == EMOJI
        assert [e.message["content"] for e in store.read_visible("scope-\U0001f600", sid)] == [EMOJI]
    finally:
        store.close()
