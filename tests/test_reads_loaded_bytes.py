"""A delta page's ``max_bytes`` bounds what its statement loads, not only what the read hands back.

Cut in Python after the fetch, a page of up to ``max_messages`` + 1 whole rows came from the database first:
the default read (1,000 messages, 1 MB) of a session of 200 KB messages loaded 200 MB for a 1 MB page, and
a message over the page's bytes alone was loaded in full to answer "required_bytes". Both backends, a
session that never branched (the linear statement) and one that did (the path statement), fenced or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from conftest import assistant, user

import transcript_store.core as core_module
from transcript_store import DeltaPage, TranscriptStore

A = "scope-a"
BIG = 200_000  # characters of each large message (ASCII: as many bytes, and a little JSON around them)


@contextmanager
def loaded_payload_bytes() -> Iterator[list[int]]:
    """The payload characters every delta page statement returned, statement by statement."""
    loaded: list[int] = []
    original = core_module.Core._page_rows

    def counting(self: Any, statement: Any, params: Any) -> Any:
        head, page = original(self, statement, params)
        loaded.append(sum(len(r.payload) for r in page if r.payload is not None))
        return head, page

    with pytest.MonkeyPatch.context() as m:
        m.setattr(core_module.Core, "_page_rows", counting)
        yield loaded


def _session(store: TranscriptStore, branched: bool) -> str:
    sid = store.create_session(A).session_id
    first = store.append(A, sid, user("small question"))
    if branched:
        store.append(A, sid, assistant("an answer left behind on the old branch"))
        store.branch(A, sid, first.entry_id)
    for i in range(12):
        store.append(A, sid, (assistant if i % 2 == 0 else user)(f"{i}:" + "x" * BIG))
    return sid


def _page(result: Any) -> DeltaPage:
    assert isinstance(result, DeltaPage), result
    return result


@pytest.mark.parametrize("branched", [False, True], ids=["linear", "branched"])
@pytest.mark.parametrize("fenced", [False, True], ids=["unfenced", "fenced"])
def test_a_page_loads_no_more_than_its_bytes(store: TranscriptStore, branched: bool, fenced: bool) -> None:
    sid = _session(store, branched)
    fence = store.admit(A, sid, user("next"), turn_id="t1").anchor if fenced else None
    with loaded_payload_bytes() as loaded:
        page = _page(store.read_visible_delta(A, sid, None, max_messages=1000, max_bytes=450_000, fence=fence))
    # the small question and two large messages fit; the third large one is the first over the bytes
    assert [e.role for e in page.entries] == ["user", "assistant", "user"]
    assert page.has_more and page.required_bytes is None
    assert page.serialized_bytes <= 450_000
    assert loaded and max(loaded) <= 450_000, loaded  # was the 12 messages: ~2.4 MB

    # the rest of the session in pages of the same bound, each loading at most its bound
    cursor, seen = page.cursor, len(page.entries)
    with loaded_payload_bytes() as loaded:
        while True:
            more = _page(store.read_visible_delta(A, sid, cursor, max_messages=1000, max_bytes=450_000, fence=fence))
            seen += len(more.entries)
            cursor = more.cursor
            if not more.has_more:
                break
    assert seen == 13
    assert loaded and max(loaded) <= 450_000, loaded


@pytest.mark.parametrize("branched", [False, True], ids=["linear", "branched"])
def test_a_message_over_the_page_is_not_loaded_to_say_so(store: TranscriptStore, branched: bool) -> None:
    sid = _session(store, branched)
    start = _page(store.read_visible_delta(A, sid, None, max_messages=1))
    assert [e.role for e in start.entries] == ["user"]
    with loaded_payload_bytes() as loaded:
        page = _page(store.read_visible_delta(A, sid, start.cursor, max_messages=1000, max_bytes=BIG // 2))
    assert page.entries == [] and page.has_more
    assert page.required_bytes is not None and page.required_bytes > BIG
    assert loaded and sum(loaded) == 0, loaded  # was ~2.4 MB for an empty answer
    # and with the bytes it asked for, the message comes
    again = _page(store.read_visible_delta(A, sid, start.cursor, max_messages=1000, max_bytes=page.required_bytes))
    assert len(again.entries) == 1 and again.entries[0].message["content"].startswith("0:")
    assert again.has_more


@pytest.mark.parametrize("branched", [False, True], ids=["linear", "branched"])
def test_pages_cut_by_bytes_are_the_pages_cut_after_the_fetch(store: TranscriptStore, branched: bool) -> None:
    """Every split of the session by (messages, bytes) is the one the rows' stored sizes give."""
    sid = _session(store, branched)
    everything = _page(store.read_visible_delta(A, sid, None, max_messages=1000, max_bytes=64 * 1024 * 1024))
    sizes = [e.size_bytes for e in everything.entries]
    for max_messages in (1, 2, 5, 1000):
        for max_bytes in (sizes[1] - 1, sizes[1], sizes[0] + sizes[1], sizes[0] + sizes[1] + 1, 3 * sizes[1]):
            expected: list[list[int]] = []
            at = 0
            while at < len(sizes):
                take, used = 0, 0
                while at + take < len(sizes) and take < max_messages and used + sizes[at + take] <= max_bytes:
                    used += sizes[at + take]
                    take += 1
                if take == 0:
                    expected.append([])
                    break
                expected.append(sizes[at : at + take])
                at += take
            got: list[list[int]] = []
            cursor = None
            while True:
                page = _page(store.read_visible_delta(A, sid, cursor, max_messages=max_messages, max_bytes=max_bytes))
                got.append([e.size_bytes for e in page.entries])
                if not page.entries:
                    assert page.required_bytes == sizes[sum(len(g) for g in got)]
                    break
                cursor = page.cursor
                if not page.has_more:
                    break
            assert got == expected, (max_messages, max_bytes)
