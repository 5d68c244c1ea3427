"""The pages of a session export (transfer._export_pages), on both backends: bounded by the entries' stored
sizes, not by the payload cap's worst case, and together exactly the session's entries in seq order."""

from __future__ import annotations

import io
from typing import Any

from sqlalchemy import event

from transcript_store import TranscriptStore, transfer

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
    assert [len(p) for p in pages[-3:]] == [1, 1, 1]


def test_an_empty_session_exports_its_header_only(store: TranscriptStore) -> None:
    """No entries, no page: the header line alone, as before."""
    store.create_session(SCOPE, session_id="empty")
    data, count, _ = _export(store, "empty")
    header, records = store.export_session(SCOPE, "empty")
    assert count == 0 and records == [] and data == transfer.export_line(header)
