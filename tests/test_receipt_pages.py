"""An engine's receipts of a session a page at a time: keyset pages in advancement-key order, both backends.

The pages are ranges of the receipts' primary key after a cursor (the last advancement key seen): they
concatenate to the engine's whole ledger in key order, a receipt committed while a reader pages is on a
later page when its key sorts after the cursor (once), bad cursors and limits are refused before anything
is read, and the read is the primary key's range, never a sort of the session's receipts.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest
from conftest import assistant, module_store_fixtures, user
from sqlalchemy import event, insert, select

from transcript_store import ClosedRange, InvalidInput, TranscriptStore, UnknownSession
from transcript_store.core import Core
from transcript_store.ledger import (
    MAX_RECEIPTS_PAGE,
    Receipt,
    list_receipts,
    parse_receipt_cursor,
    receipt_cursor,
)
from transcript_store.schema import receipts
from transcript_store.turns import Turns

A = "scope-a"
E = "engine-1"

shared_url, store, sid = module_store_fixtures(A, "receipt_pages")


def commit(store: TranscriptStore, sid: str, key: str, engine: str = E) -> Receipt:
    """Admit, answer and commit one turn under ``key``: its receipt."""
    admission = store.admit(A, sid, user(f"question {key}"), turn_id=key)
    appended = store.append_many(A, sid, [{"message": assistant(f"answer {key}")}])
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    result = Turns(store).commit_turn(engine, key, admission, terminal, closed.messages)
    assert result.status == "committed"
    return result.receipt


def put_rows(store: TranscriptStore, sid: str, rows: list[tuple[str, str, int]]) -> None:
    """Receipts (engine, key, committed_us) written as rows: ties in commit time, and many at once."""
    values = [
        {"scope": A, "session_id": sid, "engine_id": engine, "advancement_key": key, "committed_us": us,
         "message_count": 0, "is_heartbeat": True, "payload_hash": bytes(32), "admission_entry_id": "a",
         "terminal_entry_id": "t", "message_seqs": ""}
        for engine, key, us in rows
    ]
    store.write(lambda c: c.conn.execute(insert(receipts), values))


def every_page(store: TranscriptStore, sid: str, limit: int, engine: str = E) -> list[list[Receipt]]:
    """The pages of a ledger from the first on, following ``next``."""
    pages, after = [], None
    while True:
        page = Turns(store).receipts_page(A, sid, engine, after=after, limit=limit)
        assert len(page.receipts) <= limit
        pages.append(page.receipts)
        if page.next is None:
            return pages
        assert page.next == receipt_cursor(page.receipts[-1])
        after = page.next


def whole(store: TranscriptStore, sid: str, engine: str = E) -> list[Receipt]:
    """The engine's whole ledger in the database's key order (``list_receipts`` answers oldest commit first)."""

    def run(c: Core) -> list[Receipt]:
        by_key = {r.advancement_key: r for r in list_receipts(c, A, sid, engine)}
        keyed = select(receipts.c.advancement_key).where(
            receipts.c.scope == A, receipts.c.session_id == sid, receipts.c.engine_id == engine
        )
        return [by_key[k] for k in c.conn.execute(keyed.order_by(receipts.c.advancement_key)).scalars()]

    return store.read(run)


def test_pages_concatenate_to_the_ledger_in_key_order(store: TranscriptStore, sid: str) -> None:
    committed = [commit(store, sid, f"t{i}") for i in (3, 0, 2, 1)]
    # Key order, whatever the commit times; another engine's receipts (some under the same keys) are not
    # listed.
    put_rows(store, sid, [(E, "z-late", 2**62), (E, "a-early", 5), (E, "m-tie", 5), ("engine-2", "b-other", 5),
                          ("engine-2", "t1", 2**62), ("engine-2", "t2", 7)])
    ledger = whole(store, sid)
    assert [r.advancement_key for r in ledger] == ["a-early", "m-tie", "t0", "t1", "t2", "t3", "z-late"]
    assert {r.advancement_key for r in ledger} >= {r.advancement_key for r in committed}
    for limit in (1, 2, 3, 6, 7, 8, MAX_RECEIPTS_PAGE):
        pages = every_page(store, sid, limit)
        assert [r for page in pages for r in page] == ledger, limit
        assert all(len(page) == limit for page in pages[:-1]) and len(pages) == max(1, -(-len(ledger) // limit))
    # A ledger that ends on a page's last receipt: that page's next is null, no empty page follows.
    assert len(every_page(store, sid, 7)) == 1
    assert [r.advancement_key for r in every_page(store, sid, 5, "engine-2")[0]] == ["b-other", "t1", "t2"]


def test_an_empty_ledger_is_one_empty_last_page(store: TranscriptStore, sid: str) -> None:
    page = Turns(store).receipts_page(A, sid, E)
    assert (page.receipts, page.next) == ([], None)


def test_receipts_committed_between_pages_come_once_on_later_pages(store: TranscriptStore, sid: str) -> None:
    turns = Turns(store)
    early = [commit(store, sid, f"k1-{i}") for i in range(3)]
    first = turns.receipts_page(A, sid, E, limit=2)
    assert first.receipts == early[:2] and first.next is not None
    late = [commit(store, sid, f"k2-{i}") for i in range(3)]
    before = commit(store, sid, "k0-before")  # sorts before the cursor: on no later page of this read
    second = turns.receipts_page(A, sid, E, after=first.next, limit=2)
    assert second.receipts == [early[2], late[0]]
    commit(store, sid, "k2-other", engine="engine-2")  # another engine's: not on this engine's pages
    rest = turns.receipts_page(A, sid, E, after=second.next, limit=2)
    assert rest.receipts == late[1:] and rest.next is None
    # A reader that keeps the cursor of the last receipt it saw picks up the keys that sort after it.
    newer = commit(store, sid, "k3-newer")
    assert turns.receipts_page(A, sid, E, after=receipt_cursor(late[-1])).receipts == [newer]
    paged = [r for page in every_page(store, sid, 2) for r in page]
    assert paged == [before, *early, *late, newer] == whole(store, sid)


@pytest.mark.parametrize("after", ["", "k\x00", "\x00", "k" * 256, "a\nb", "\x7f", "\ud800", "k\x85"])
def test_a_bad_cursor_is_refused_and_reads_nothing(store: TranscriptStore, sid: str, after: str) -> None:
    before = whole(store, sid)
    with pytest.raises(InvalidInput):
        Turns(store).receipts_page(A, sid, E, after=after)
    with pytest.raises(InvalidInput):  # before the session is looked at
        Turns(store).receipts_page(A, "no-such-session", E, after=after)
    assert whole(store, sid) == before


@pytest.mark.parametrize("limit", [0, -1, MAX_RECEIPTS_PAGE + 1, True, 2.0, "5", None])
def test_a_bad_limit_is_refused(store: TranscriptStore, sid: str, limit: Any) -> None:
    commit(store, sid, "only")
    with pytest.raises(InvalidInput):
        Turns(store).receipts_page(A, sid, E, limit=limit)
    assert [r.advancement_key for r in whole(store, sid)] == ["only"]


def test_cursors_round_trip_and_unknown_sessions_are_refused(store: TranscriptStore, sid: str) -> None:
    receipt = commit(store, sid, "key:with:colons ' OR 1=1 --")
    assert parse_receipt_cursor(receipt_cursor(receipt)) == "key:with:colons ' OR 1=1 --"
    # A cursor past every receipt, or one of another session, is a position: an empty last page.
    assert Turns(store).receipts_page(A, sid, E, after=receipt_cursor(receipt)).receipts == []
    assert Turns(store).receipts_page(A, sid, E, after="\U0010fffd").next is None
    assert Turns(store).receipts_page(A, sid, E, after="a").receipts == [receipt]
    with pytest.raises(UnknownSession):
        Turns(store).receipts_page(A, "no-such-session", E)
    with pytest.raises(UnknownSession):  # another scope's session is unknown
        Turns(store).receipts_page("scope-b", sid, E)


def test_a_page_is_a_range_of_the_primary_key(store: TranscriptStore, sid: str) -> None:
    """The page read starts at the cursor in the primary key and stops after limit + 1 rows of the engine:
    no sort of the session's receipts, no scan of the rows before the cursor (tables never analyzed)."""
    n = 3000
    put_rows(store, sid, [(engine, f"k{i:05d}", 1_000 + i) for i in range(n) for engine in (E, "engine-2")])
    statements: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, sql: str, params: Any, context: Any, many: bool) -> None:
        if "ts_receipts" in sql:
            statements.append((sql, params))

    event.listen(store.db.engine, "before_cursor_execute", capture)
    try:
        page = Turns(store).receipts_page(A, sid, E, after=f"k{n - 50:05d}", limit=20)
    finally:
        event.remove(store.db.engine, "before_cursor_execute", capture)
    assert [r.advancement_key for r in page.receipts] == [f"k{i:05d}" for i in range(n - 49, n - 29)]
    ((sql, params),) = statements

    def explain(c: Core) -> str:
        if store.backend == "sqlite":
            return "\n".join(str(r[-1]) for r in c.conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params))
        return "\n".join(str(r[0]) for r in c.conn.exec_driver_sql("EXPLAIN (ANALYZE, COSTS OFF) " + sql, params))

    plan = store.read(explain)
    assert not re.search(r"Sort|TEMP B-TREE|Seq Scan|SCAN ts_", plan), plan
    if store.backend == "sqlite":
        assert "advancement_key>?" in plan.replace(" ", ""), plan
    else:
        # The other engine's receipts of the keys in the page's range are passed over in the index (at
        # most one per key here); nothing before the cursor is read.
        scanned = r"Index (?:Only )?Scan using ts_receipts_pk.*actual time=\S+ rows=(\d+)"
        assert [int(m) for m in re.findall(scanned, plan)] == [21], plan
        removed = [int(m) for m in re.findall(r"Rows Removed by (?:Index Recheck|Filter): (\d+)", plan)]
        assert sum(removed) <= 21, plan


def test_the_session_id_is_part_of_the_key(store: TranscriptStore, sid: str) -> None:
    other = store.create_session(A, session_id=f"s-{uuid.uuid4().hex[:12]}").session_id
    mine = commit(store, sid, "mine")
    commit(store, other, "theirs")
    assert Turns(store).receipts_page(A, sid, E).receipts == [mine]
