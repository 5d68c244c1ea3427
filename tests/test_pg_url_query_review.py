"""Findings of the database-layer review (round 3): a PostgreSQL URL's query option given without a value
(``?sslmode``, ``?a=1&b``) was dropped by SQLAlchemy's make_url without a word, as a SQLite URL's was."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import fresh_url
from test_cli import one_error_line, run

from transcript_store import InvalidInput, StoreConfig, TranscriptStore
from transcript_store.db import parse_url


@pytest.fixture
def pg_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, migrated PostgreSQL store (the finding is PostgreSQL's: a SQLite URL takes no query)."""
    yield from fresh_url("postgresql", request, tmp_path)


@pytest.mark.parametrize(
    ("tail", "named"),
    [("?sslmode", "'sslmode'"), ("?sslmode=", "'sslmode'"), ("?connect_timeout=5&sslmode", "'sslmode'"),
     ("?application_name=x&sslmode&gssencmode", "'sslmode', 'gssencmode'"), ("?db", "'db'")],
    ids=["alone", "empty-value", "among-valued", "two", "question-mark-in-database-name"],
)
def test_a_postgresql_query_option_without_a_value_is_refused(
    pg_store_url: str, tail: str, named: str, tmp_path: Path
) -> None:
    """``?sslmode`` opened the store with no sslmode asked for (the user believing TLS required), and
    ``/name?db`` (a '?' left unescaped in a database name) opened the database ``name``: the option was
    dropped without a word. Both are refused before connecting, in Python and as a usage error (exit 2)."""
    url = pg_store_url + tail
    with pytest.raises(InvalidInput, match=f"gives no value to {named}: write name=value"):
        TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))
    line = one_error_line(run("current", "--db", url, cwd=tmp_path, code=2))
    assert f"no value to {named}" in line and "%3F" in line, line


@pytest.mark.parametrize(
    "password", ["pa?ss", "pa%3Fss", "x?sslmode", "x?a=1&b"], ids=["raw", "encoded", "option-like", "query-like"]
)
def test_a_question_mark_in_the_password_is_no_query(pg_store_url: str, password: str) -> None:
    """Only the query after the host and database is looked at: a '?' in the password, written as it is or
    percent-encoded, is the password's (the test server trusts its connections, so any password opens)."""
    url = pg_store_url.replace("://postgres@", f"://postgres:{password}@", 1) + "?application_name=review3"
    assert parse_url(url).password == password.replace("%3F", "?")
    with TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False)) as store:
        assert store.current_revision() is not None
        store.create_session("scope-a", session_id="s1")
        assert store.get_session("scope-a", "s1").session_id == "s1"


@pytest.mark.parametrize(
    "url",
    ["postgresql://h/db?", "postgresql://h/db?&", "postgresql://h/db?sslmode=require&",
     "postgresql://u:p?sslmode@h/db", "postgresql://h/d%3Fb?sslmode=require", "postgresql+psycopg://h/db?host=a&host=b"],
)
def test_urls_that_lose_nothing_are_still_taken(url: str) -> None:
    """An empty query, a trailing '&', a '?' in the password and a percent-encoded one in the database name
    drop no option: they are taken as before."""
    parse_url(url)
