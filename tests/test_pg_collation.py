"""PostgreSQL orders ids by the database's collation: doctor says whether that is SQLite's order.

``list_sessions``, the outbox's session listing and an engine's receipt pages (by advancement key)
order and page ids with ``ORDER BY`` and ``>``, which follow the database's default collation: on a
database created with a linguistic one (an ICU locale, ``en_US.UTF-8``) the same ids list in another
order than on SQLite, and an ``after`` id starts another page (a review found it with an ICU ``en``
database). Each backend's paging stays whole; doctor names the order, so an operator sees it before a
client depends on it.
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


#: advancement keys whose ICU order differs from code point order: case, accents, composed and combining
#: forms, punctuation, digits, full-width letters
KEYS = ["a", "A", "b", "B", "a-b", "ab", "a b", "\u00e4", "a\u0308", "\u00c5", "A\u030a", "\u212b", "e", "\u00e9",
        "1", "10", "9", "_x", "-x", "x/y", "x%y", "\uff5a", "z", "\u65e5"]


def test_receipt_pages_are_whole_in_the_collation_order(icu_url: str) -> None:
    """An engine's receipt pages follow the database's collation as ``>`` does (key order, README): under
    ICU, every limit's pages concatenate to the ledger in ``ORDER BY`` order, each key once, another
    engine's receipts of the same keys left out; and that order is not SQLite's."""
    from sqlalchemy import insert, select

    from transcript_store.schema import receipts
    from transcript_store.turns import Turns

    store = TranscriptStore(icu_url, create=False)
    try:
        sid = store.create_session("s", session_id="r1").session_id
        rows = [{"scope": "s", "session_id": sid, "engine_id": engine, "advancement_key": key, "committed_us": i,
                 "message_count": 0, "is_heartbeat": True, "payload_hash": bytes(32), "admission_entry_id": "a",
                 "terminal_entry_id": "t", "message_seqs": ""}
                for i, key in enumerate(KEYS) for engine in ("e1", "e2")]
        store.write(lambda c: c.conn.execute(insert(receipts), rows))
        keyed = select(receipts.c.advancement_key).where(receipts.c.engine_id == "e1")
        ordered = store.read(lambda c: list(c.conn.execute(keyed.order_by(receipts.c.advancement_key)).scalars()))
        assert sorted(ordered) == sorted(KEYS) and ordered != sorted(KEYS)
        turns = Turns(store)
        for limit in (1, 2, 3, 5, len(KEYS) - 1, len(KEYS)):
            paged: list[str] = []
            after: str | None = None
            while True:
                page = turns.receipts_page("s", sid, "e1", after=after, limit=limit)
                paged += [r.advancement_key for r in page.receipts]
                if page.next is None:
                    break
                after = page.next
            assert paged == ordered, limit
    finally:
        store.close()
