"""The pages of a session export (transfer._export_pages), on both backends: bounded by the entries' stored
sizes, not by the payload cap's worst case, and together exactly the session's entries in seq order."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from sqlalchemy import event
from test_pg_plans import _generic_plan, assert_lookups, assert_never_analyzed

from transcript_store import TranscriptStore, showing, transfer

SCOPE = "pages"


def _fill(store: TranscriptStore, sid: str, contents: list[str]) -> None:
    store.create_session(SCOPE, session_id=sid)
    for start in range(0, len(contents), 1000):
        store.append_many(SCOPE, sid, [
            {"message": {"role": "user" if i % 2 == 0 else "assistant", "content": contents[i]}}
            for i in range(start, min(len(contents), start + 1000))
        ])


def _export(store: TranscriptStore, sid: str) -> tuple[bytes, int, list[str]]:
    """The export's bytes and entry count, and the statements it ran."""
    executed: list[str] = []

    def listen(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        executed.append(statement)

    out = io.BytesIO()
    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        count = store.read(lambda c: transfer.write_export_in(c, SCOPE, sid, out))
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    return out.getvalue(), count, executed


def test_an_export_of_many_small_entries_reads_few_pages(store: TranscriptStore) -> None:
    """Pages counted for the worst case (64 MiB over the 4 MiB payload cap: 16 entries) read a session of
    6,000 small entries in 375 statements, 5,000 for 80,000; pages bounded by the stored sizes take a few
    dozen, and the file is the same: every entry once, in seq order."""
    n = 6000
    _fill(store, "small", [f"message {i} " + "y" * (i % 40) for i in range(n)])
    data, count, executed = _export(store, "small")
    reads = [s for s in executed if "ts_entries" in s]
    assert count == n
    assert len(reads) <= 40, len(reads)  # n / 16 = 375 before
    header, records = store.export_session(SCOPE, "small")
    assert [r["seq"] for r in records] == list(range(n))
    assert data == b"".join(transfer.export_line(r) for r in [header, *records])


def test_a_page_holds_its_byte_budget_and_a_larger_entry_alone(store: TranscriptStore) -> None:
    """Entries of mixed sizes: each page's stored bytes stay within the budget, an entry larger than the
    budget is a page by itself, and the pages together are the session."""
    budget = transfer._EXPORT_PAGE_BYTES
    contents = [f"small {i}" for i in range(30)] + ["m" * (budget // 3)] * 10 + ["L" * (budget * 2)]
    contents += [f"after {i}" for i in range(30)] + ["m" * (budget // 2 + 1)] * 3
    _fill(store, "mixed", contents)
    pages = store.read(lambda c: list(transfer._export_pages(c, SCOPE, "mixed")))
    for page in pages:
        assert page, "an empty page"
        size = sum(r["size_bytes"] for r in page)
        assert size <= budget or len(page) == 1, [r["size_bytes"] for r in page]
    records = [r for page in pages for r in page]
    assert [r["seq"] for r in records] == list(range(len(contents)))
    assert [r["message"]["content"] for r in records] == contents
    big = next(p for p in pages if p[0]["message"]["content"].startswith("L"))
    assert len(big) == 1
    # two entries of more than half the budget never share a page
    halves = [sum(1 for r in p if r["size_bytes"] > budget // 2) for p in pages]
    assert max(halves) == 1 and sum(halves) == 4, halves


def test_an_empty_session_exports_its_header_only(store: TranscriptStore) -> None:
    """No entries, no page: the header line alone, as before."""
    store.create_session(SCOPE, session_id="empty")
    data, count, _ = _export(store, "empty")
    header, records = store.export_session(SCOPE, "empty")
    assert count == 0 and records == [] and data == transfer.export_line(header)


def _statements(store: TranscriptStore, fn: Any) -> tuple[Any, list[str]]:
    """What ``fn(core)`` returns in one read, and the statements it ran."""
    executed: list[str] = []

    def listen(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        executed.append(statement)

    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        return store.read(fn), executed
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)


def test_show_all_pages_as_an_export_does(store: TranscriptStore) -> None:
    """`sessions show --all` paged by the payload cap's worst case (16 entries a page at 4 MiB: 375 reads
    for 6,000 small entries, about 5,000 for 80,000); it reads the export's pages now, bounded by the stored
    sizes, and shows the same entries: every one once, in seq order, off-branch ones marked."""
    n = 6000
    _fill(store, "small", [f"message {i} " + "y" * (i % 40) for i in range(n)])
    store.branch(SCOPE, "small", store.list_entries(SCOPE, "small", limit=3)[2].entry_id)
    store.append(SCOPE, "small", {"role": "user", "content": "on a branch"})
    (info, shown), executed = _statements(store, lambda c: showing.read_all_in(c, SCOPE, "small", every=True))
    reads = [s for s in executed if "ts_entries" in s]
    assert len(reads) <= 40, len(reads)
    assert info.entry_count == n + 1
    assert shown == store.list_entries(SCOPE, "small", limit=10_000)
    assert [e.active for e in shown[:4]] == [True, True, True, False] and shown[-1].active
    out = io.BytesIO()
    _, executed = _statements(
        store, lambda c: showing.write_json_in(c, SCOPE, "small", out, every=True, encoding="utf-8", errors="strict")
    )
    assert len([s for s in executed if "ts_entries" in s]) <= 40
    assert json.loads(out.getvalue())["entries"] == [e.model_dump(mode="json") for e in shown]


def test_show_of_the_visible_transcript_pages_by_stored_sizes(store: TranscriptStore) -> None:
    """`sessions show` (the visible transcript) paged by the payload cap's worst case too: 375 reads for
    6,000 small visible messages. Its pages are bounded by the visible messages' stored sizes now (read by
    position, as the rows are), each within the budget or one larger message alone, and show the same."""
    n = 6000
    budget = transfer._EXPORT_PAGE_BYTES
    contents = [f"message {i} " + "y" * (i % 40) for i in range(n)]
    contents += ["L" * (budget + 1), "m" * (budget // 2 + 1), "m" * (budget // 2 + 1), "tail"]
    _fill(store, "small", contents)
    # off the path in the middle of the seqs: the branch from message 3,000 on, appended again after it
    store.branch(SCOPE, "small", store.list_entries(SCOPE, "small", after_seq=2999, limit=1)[0].entry_id)
    store.append_many(SCOPE, "small", [
        {"message": {"role": "user" if i % 2 == 0 else "assistant", "content": contents[i]}}
        for i in range(3001, len(contents))
    ])
    expected = store.read_visible(SCOPE, "small")
    (info, shown), executed = _statements(store, lambda c: showing.read_all_in(c, SCOPE, "small", every=False))
    reads = [s for s in executed if "ts_entries" in s]
    assert len(reads) <= 40, len(reads)
    assert len(expected) == len(contents) and store.get_session(SCOPE, "small").entry_count > len(contents)
    assert shown == expected and info.visible_count == len(expected)
    pages = store.read(lambda c: list(showing.entry_pages(c, SCOPE, "small", every=False)))
    for page in pages:
        assert sum(e.size_bytes for e in page) <= budget or len(page) == 1, [e.size_bytes for e in page]
    assert [e for p in pages for e in p] == expected


def test_the_sizes_of_a_page_are_index_lookups_on_tables_never_analyzed(store: TranscriptStore) -> None:
    """PostgreSQL before its first ANALYZE: the stored sizes of the next 20 entries (by seq: an export,
    `show --all`) or of the next 20 visible messages (by position: `show`) near the tail of a 2,000-entry
    session with an off-path branch scan no table and read no row they throw away."""
    if store.backend == "sqlite":
        pytest.skip("a PostgreSQL plan")
    with store.db.engine.begin() as conn:  # this test's database only: autovacuum would ANALYZE them
        for table in ("ts_sessions", "ts_entries", "ts_active_path"):
            conn.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
    _fill(store, "s1", [f"m{i}" for i in range(1000)])
    store.branch(SCOPE, "s1", store.list_entries(SCOPE, "s1", after_seq=9, limit=1)[0].entry_id)
    store.append_many(SCOPE, "s1", [{"message": {"role": "user", "content": f"n{i}"}} for i in range(1000)])
    reads = {
        "sizes by seq": lambda c: c.entry_sizes(SCOPE, "s1", 1900, 20),
        "sizes by position": lambda c: c.visible_sizes(SCOPE, "s1", 900, 20),
    }
    for name, read in reads.items():
        got, executed = _captured(store, read)
        assert len(got) == 20, name
        [(sql, params)] = executed
        with store.db.engine.connect() as conn:
            assert_lookups(name, _generic_plan(conn, sql, params, "ANALYZE, COSTS OFF"))
            assert_never_analyzed(conn, "relname IN ('ts_entries', 'ts_active_path')")


def _captured(store: TranscriptStore, fn: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """What ``fn(core)`` returns in one read, and the statements it sent with their parameters."""
    captured: list[tuple[str, Any]] = []

    def listen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        captured.append((statement, parameters))

    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        return store.read(fn), [(s, p) for s, p in captured if s.lstrip().upper().startswith("SELECT")]
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)


def test_pages_of_one_large_entry_each_share_their_sizes_read(store: TranscriptStore) -> None:
    """Entries larger than half the budget go a page each, and each page read the sizes again (two of them,
    one already known): two statements an entry, where the worst case's 16 a page took one for 16 (an
    export of 4,000 entries of 70 KB took 5.2 s on PostgreSQL instead of 2.9 s). The sizes read ahead
    decide the next pages: about one statement an entry, the same file."""
    budget = transfer._EXPORT_PAGE_BYTES
    n = 120
    contents = [f"{i} " + "m" * (budget // 2 + 1) for i in range(n)] + ["small"] * 3 + ["L" * (budget * 2)]
    _fill(store, "large", contents)
    data, count, executed = _export(store, "large")
    reads = [s for s in executed if "ts_entries" in s]
    assert count == len(contents)
    assert len(reads) <= len(contents) * 1.1, len(reads)  # 2 * 124 before
    header, records = store.export_session(SCOPE, "large")
    assert data == b"".join(transfer.export_line(r) for r in [header, *records])
    pages = store.read(lambda c: list(transfer._export_pages(c, SCOPE, "large")))
    # the last of them shares its page with the small ones that fit, the larger one goes alone
    assert [len(p) for p in pages] == [1] * (n - 1) + [4, 1]
