"""PostgreSQL orders ids by the database's collation: doctor says whether that is SQLite's order.

``list_sessions`` and the outbox's session listing order and page ids with ``ORDER BY`` and ``>``,
which follow the database's default collation: on a database created with a linguistic one (an ICU
locale, ``en_US.UTF-8``) the same ids list in another order than on SQLite, and an ``after`` id
starts another page (a review found it with an ICU ``en`` database). Each backend's paging stays
whole; doctor names the order, so an operator sees it before a client depends on it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import _PG_PROBLEM, PG_ADMIN, pg_url
from test_cli import run_json

from transcript_store import TranscriptStore

IDS = ["B", "Z9", "_x", "a", "\u00e4"]


def _admin(sql: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture
def icu_url() -> Iterator[str]:
    """A migrated store in a database whose default collation is ICU's ``en``."""
    if _PG_PROBLEM is not None:
        pytest.skip(f"PostgreSQL unreachable: {_PG_PROBLEM}")
    name = f"ts_icu_{uuid.uuid4().hex[:10]}"
    try:
        _admin(f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en' LOCALE 'C.UTF-8'")
    except psycopg.Error as e:  # a server built without ICU
        pytest.skip(f"this PostgreSQL cannot create an ICU database: {e}")
    try:
        TranscriptStore.upgrade_url(pg_url(name))
        yield pg_url(name)
    finally:
        _admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_doctor_names_an_id_order_other_than_sqlites(icu_url: str, tmp_path: Path) -> None:
    store = TranscriptStore(icu_url, create=False)
    try:
        for sid in IDS:
            store.create_session("s", session_id=sid)
        listed = [s.session_id for s in store.list_sessions("s")]
    finally:
        store.close()
    assert listed != sorted(IDS)  # what doctor warns of: not SQLite's code point order
    order = run_json("doctor", "--db", icu_url, cwd=tmp_path)["store"]["settings"]["id_order"]
    assert order.startswith("the database's collation (ICU en), not SQLite's code point order"), order


def test_doctor_says_code_point_order_on_the_test_database(tmp_path: Path, store_url: str, backend: str) -> None:
    if backend != "postgresql":
        pytest.skip("SQLite compares ids by code point always")
    order = run_json("doctor", "--db", store_url, cwd=tmp_path)["store"]["settings"]["id_order"]
    assert order == "code point (as SQLite)"
