"""Review of the byte-bounded delta page statement (core._bytes_bounded): its pages are the pages the old
Python-only cut gave, on random sessions of both backends.

The expectation is computed from ``read_visible`` and the stored sizes alone: a page is the visible messages
after the cursor, at most ``max_messages`` of them, cut before the first whose stored sizes up to it add up to
more than ``max_bytes``; ``has_more`` says a message follows the page; an empty page names the next message's
size as ``required_bytes``. Sessions are linear, branched or rewritten (the path statement), with events
between messages, multibyte text, fenced reads through an admission, and cursors taken mid-session; every
page is read three ways: the statement-only read, the same read in a snapshot, and (unfenced) a read whose
first statement is the path statement because the session is known to have branched.
"""

from __future__ import annotations

import random
import re
import uuid
from functools import partial
from typing import Any

import pytest
from conftest import module_store_fixtures
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event
from test_pg_plans import _generic_plan

import transcript_store.core as core_module
from transcript_store import DeltaPage, TranscriptStore
from transcript_store import reads as reads_module
from transcript_store.models import Anchor, Entry

A = "scope-review-h7"
shared_url, store, sid = module_store_fixtures(A, "loaded-bytes-review")

# Multibyte text: 1-, 2-, 3- and 4-byte UTF-8 characters, and JSON escapes (quote, backslash, control).
TEXT = st.text(alphabet=st.sampled_from(list("ab \"\\\n\té中𝄞ж")), max_size=40)
SIZES = st.sampled_from([0, 1, 7, 300, 2_500, 9_000])  # 9,000 random characters: a TOASTed payload on PG


def _message(role: str, text: str, pad: int, seed: int) -> dict[str, Any]:
    # pseudo-random padding (poorly compressible, so PostgreSQL moves it out of line)
    noise = random.Random(seed).randbytes(pad // 2 + 1).hex()
    return {"role": role, "content": text + noise[:pad]}


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("msg"), st.sampled_from(["user", "assistant", "tool"]), TEXT, SIZES),
        st.tuples(st.just("event"), TEXT),
        st.tuples(st.just("branch"), st.integers(0, 30)),
        st.tuples(st.just("rewrite"), st.integers(0, 30), TEXT, SIZES),
    ),
    min_size=1,
    max_size=14,
)
READS = st.lists(st.tuples(st.integers(1, 6), st.integers(-2, 2), st.integers(0, 5)), min_size=1, max_size=12)


def _build(store: TranscriptStore, sid: str, ops: list[Any]) -> None:
    for n, op in enumerate(ops):
        if op[0] == "msg":
            role = "tool" if op[1] == "tool" else op[1]
            message = _message(role, op[2], op[3], n)
            if role == "tool":
                message["tool_call_id"] = f"c{n}"
            store.append(A, sid, message)
        elif op[0] == "event":
            store.append(A, sid, kind="custom", payload={"note": op[1]})
        else:
            everything = store.list_entries(A, sid, limit=1000)
            if not everything:
                continue
            target = everything[op[1] % len(everything)]
            if op[0] == "branch":
                store.branch(A, sid, target.entry_id)
            else:
                visible = store.read_visible(A, sid)
                if visible:
                    chosen = visible[op[1] % len(visible)]
                    new = _message(chosen.message["role"] if chosen.message["role"] != "tool" else "user",
                                   op[2], op[3], 1000 + n)
                    store.rewrite_entries(A, sid, [{"entry_id": chosen.entry_id, "message": new}])


def _expected(visible: list[Entry], at: int, max_messages: int, max_bytes: int) -> tuple[list[str], bool, int | None]:
    rest = visible[at:]
    taken: list[Entry] = []
    used = 0
    for e in rest[:max_messages]:
        if used + e.size_bytes > max_bytes:
            break
        taken.append(e)
        used += e.size_bytes
    required = rest[0].size_bytes if not taken and rest else None
    return [e.entry_id for e in taken], len(rest) > len(taken), required


def _bytes_choice(visible: list[Entry], at: int, max_messages: int, delta: int, which: int) -> int:
    """A max_bytes at (or one or two bytes around) a boundary of the rest's running sums."""
    sums, run = [], 0
    for e in visible[at : at + max_messages + 2]:
        run += e.size_bytes
        sums.append(run)
    if not sums:
        return max(1, 1 + delta)
    return min(max(1, sums[which % len(sums)] + delta), reads_module.MAX_BYTES)


def _read_three_ways(
    store: TranscriptStore, sid: str, cursor: str | None, max_messages: int, max_bytes: int, fence: Anchor | None
) -> list[DeltaPage]:
    pages: list[Any] = [
        store.read_visible_delta(A, sid, cursor, max_messages=max_messages, max_bytes=max_bytes, fence=fence),
        store.read(
            lambda c: reads_module.read_visible_delta(c, A, sid, cursor, max_messages, max_bytes, fence, snapshot=True)
        ),
    ]
    key = (store.config.url, A, sid)
    if fence is None:
        core_module._BRANCHED.add(key)  # the path statement, whatever the session's shape
        try:
            pages.append(store.read_visible_delta(A, sid, cursor, max_messages=max_messages, max_bytes=max_bytes))
        finally:
            core_module._BRANCHED._keys.pop(key, None)  # back to the linear statement first
    for p in pages:
        assert isinstance(p, DeltaPage), p
    return pages


def _page_through(store: TranscriptStore, sid: str, reads: list[Any], fence: Anchor | None) -> None:
    visible = store.read_visible(A, sid, fence=fence)
    at, cursor = 0, None
    for max_messages, delta, which in reads * 3:
        max_bytes = _bytes_choice(visible, at, max_messages, delta, which)
        ids, has_more, required = _expected(visible, at, max_messages, max_bytes)
        for page in _read_three_ways(store, sid, cursor, max_messages, max_bytes, fence):
            got = [e.entry_id for e in page.entries]
            assert (got, page.has_more, page.required_bytes) == (ids, has_more, required), (
                at, max_messages, max_bytes, [e.size_bytes for e in visible[at:]],
            )
            assert page.serialized_bytes == sum(e.size_bytes for e in page.entries)
            assert page.entries == visible[at : at + len(ids)]  # payloads and all, as read_visible has them
        at += len(ids)
        cursor = page.cursor
        if not has_more:
            break


# 20 sessions drawn in make test, 60 in make test-slow (CI time).
@pytest.mark.parametrize("examples", [20, pytest.param(60, marks=pytest.mark.slow)])
def test_pages_are_the_python_cut_of_the_visible_messages(store: TranscriptStore, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(ops=OPS, reads=READS, fenced=st.booleans(), more=OPS)
    def check(ops: list[Any], reads: list[Any], fenced: bool, more: list[Any]) -> None:
        _check_pages(store, ops, reads, fenced, more)

    check()


def _check_pages(store: TranscriptStore, ops: list[Any], reads: list[Any], fenced: bool, more: list[Any]) -> None:
    """One drawn session paged through: every page is the Python cut of the visible messages."""
    sid = store.create_session(A, session_id=f"s-{uuid.uuid4().hex[:12]}").session_id
    _build(store, sid, ops)
    fence = None
    if fenced:
        fence = store.admit(A, sid, {"role": "user", "content": "the turn é中"}, turn_id="t1").anchor
        store.append(A, sid, _message("assistant", "after the fence", 300, 7))
    _page_through(store, sid, reads, fence)
    if fence is None:
        # a cursor mid-session, the session grown (or branched) after it: the pages from there on
        visible = store.read_visible(A, sid)
        first = store.read_visible_delta(A, sid, None, max_messages=max(1, len(visible) // 2),
                                         max_bytes=reads_module.MAX_BYTES)
        assert isinstance(first, DeltaPage)
        _build(store, sid, [op for op in more if op[0] in ("msg", "event")])
        rest = store.read_visible(A, sid)[len(first.entries):]
        page = store.read_visible_delta(A, sid, first.cursor, max_messages=1000, max_bytes=reads_module.MAX_BYTES)
        assert isinstance(page, DeltaPage) and page.entries == rest and not page.has_more


def _statements_of(store: TranscriptStore, read: Any) -> list[tuple[str, Any]]:
    """The SELECT statements ``read()`` sends to the driver."""
    sent: list[tuple[str, Any]] = []

    def listen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        sent.append((statement, parameters))

    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        read()
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    return [(s, p) for s, p in sent if s.lstrip().upper().startswith("SELECT")]


# Wholly in the slow tier (CI time: 50,000 rows written and ANALYZEd, ~30 s of make test's worker time).
# No smaller copy in make test: with 5,000 rows a session PostgreSQL's planner now and then chose a Seq Scan
# or a Sort (cheaper on so small a table), so a smaller table cannot reliably ask for the plan checked here.
@pytest.mark.slow
def test_a_bytes_bounded_page_is_an_index_range_on_analyzed_tables(store: TranscriptStore) -> None:
    """50,000 entries, ANALYZEd: the page statement (linear and path, fenced or not) is an index range scan
    under its LIMIT, the running sum's window reading no more than the page's rows plus one (no scan of the
    session, no sort), whether the bytes cut the page after 3 messages or the messages do."""
    sids = {}
    for shape in ("linear", "branched"):
        sid = store.create_session(A, session_id=f"big-{shape}-{uuid.uuid4().hex[:6]}").session_id
        if shape == "branched":
            kept, _dropped = store.append_many(A, sid, [{"message": {"role": "user", "content": "a"}}] * 2)
            store.branch(A, sid, kept.entry_id)
        for _ in range(5):
            store.append_many(A, sid, [{"message": {"role": "user", "content": f"m{i}"}} for i in range(5_000)])
        sids[shape] = sid
    fence = store.admit(A, sids["linear"], {"role": "user", "content": "q"}, turn_id="t").anchor
    store.append(A, sids["linear"], {"role": "assistant", "content": "after"})
    store.db.analyze(("ts_sessions", "ts_entries", "ts_active_path"))
    store.read_visible_delta(A, sids["branched"], None, max_messages=1)  # known branched: the path statement
    for shape, sid, fenced in (("linear", sids["linear"], None), ("linear", sids["linear"], fence),
                               ("branched", sids["branched"], None)):
        start = store.read_visible_delta(A, sid, None, max_messages=1, fence=fenced)
        assert isinstance(start, DeltaPage)
        for max_messages, max_bytes in ((20, 60), (20, 1_000_000), (1000, 60)):
            statements = _statements_of(
                store,
                partial(
                    store.read_visible_delta, A, sid, start.cursor, max_messages=max_messages, max_bytes=max_bytes,
                    fence=fenced,
                ),
            )
            page_sql = [(s, p) for s, p in statements if "b_run" in s]
            assert len(page_sql) == 1, (shape, statements)
            _assert_page_plan(store, *page_sql[0], max_messages)


def _assert_page_plan(store: TranscriptStore, sql: str, params: Any, max_messages: int) -> None:
    with store.db.engine.connect() as conn:
        if store.backend == "sqlite":
            details = [str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]
            assert not [d for d in details if d.startswith("SCAN ts_") or "TEMP B-TREE" in d], details
        else:
            plan = _generic_plan(conn, sql, params, "ANALYZE, COSTS OFF")
            assert not re.search(r"Seq Scan on ts_(entries|active_path)|Sort\b", plan), plan
            windows = re.findall(r"WindowAgg \(actual [^)]*rows=(\d+)", plan)
            assert windows and max(int(n) for n in windows) <= max_messages + 1, plan
            scanned = [int(n) for n in re.findall(r"Index Scan[^\n]*\(actual [^)]*rows=(\d+)", plan)]
            assert max(scanned) <= max_messages + 2, plan
        conn.rollback()


def _toast_blocks(raw: Any) -> int:
    """The TOAST blocks of ts_entries this connection's statements read so far (flushed, then read)."""
    cur = raw.cursor()
    cur.execute("SELECT pg_stat_force_next_flush()")
    raw.commit()
    cur.execute("SELECT pg_stat_clear_snapshot()")
    cur.execute(
        "SELECT coalesce(toast_blks_read, 0) + coalesce(toast_blks_hit, 0) FROM pg_statio_user_tables "
        "WHERE relname = 'ts_entries'"
    )
    value = int(cur.fetchone()[0])
    raw.commit()
    return value


@pytest.mark.parametrize("branched", [False, True], ids=["linear", "branched"])
def test_a_payload_left_out_is_never_detoasted(store: TranscriptStore, branched: bool) -> None:
    """PostgreSQL: the rows past the page's bytes pass through the window as TOAST pointers; the page
    statement reads the TOAST blocks of the payloads it returns and no others (an empty page: none)."""
    if store.backend == "sqlite":
        pytest.skip("TOAST is PostgreSQL's (SQLite: the finding in the review's report, overflow pages)")
    sid = store.create_session(A, session_id=f"toast-{uuid.uuid4().hex[:8]}").session_id
    first = store.append(A, sid, {"role": "user", "content": "q"})
    if branched:
        store.append(A, sid, {"role": "user", "content": "left behind"})
        store.branch(A, sid, first.entry_id)
    for i in range(8):
        store.append(A, sid, _message("assistant", "", 150_000, 5000 + i))  # 150 KB, out of line, uncompressed
    start = store.read_visible_delta(A, sid, None, max_messages=1)
    assert isinstance(start, DeltaPage)
    blocks = {}
    for max_bytes in (1000, 200_000, reads_module.MAX_BYTES):
        read = partial(store.read_visible_delta, A, sid, start.cursor, max_messages=1000, max_bytes=max_bytes)
        statements = [(s, p) for s, p in _statements_of(store, read) if "b_run" in s]
        assert statements
        raw = store.db.engine.raw_connection()
        try:
            before = _toast_blocks(raw)
            cur = raw.cursor()
            cur.execute(*statements[-1])
            cur.fetchall()
            raw.commit()
            blocks[max_bytes] = _toast_blocks(raw) - before
        finally:
            raw.close()
    assert blocks[1000] == 0, blocks
    assert 0 < blocks[200_000] < blocks[reads_module.MAX_BYTES] / 4, blocks
