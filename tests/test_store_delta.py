"""Visible-delta reads, cursors and resets; full visible reads and reads of entries by id."""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from conftest import make_legacy
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import event

import transcript_store.core as core_module
import transcript_store.cursors as cursors_module
import transcript_store.models as models_module
import transcript_store.store as store_module
from transcript_store import (
    DeltaMissing,
    DeltaPage,
    DeltaReset,
    Entry,
    InvalidInput,
    TranscriptStore,
    UnknownEntry,
    UnknownSession,
    hot,
)
from transcript_store.core import (
    MAX_ID_BYTES,
    MAX_ID_CHARS,
    Core,
    RecentKeys,
    decode_stored,
    same_json,
    stored_text,
)
from transcript_store.cursors import MAX_CURSOR_CHARS, CursorState, start_cursor
from transcript_store.models import canonical_json, compact_json

A, B = "scope-a", "scope-b"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(A, session_id="s1").session_id


def page_of(result: Any) -> DeltaPage:
    assert isinstance(result, DeltaPage), result
    return result


def reset_of(result: Any) -> DeltaReset:
    assert isinstance(result, DeltaReset), result
    return result


def fill(store: TranscriptStore, sid: str, n: int, *, scope: str = A) -> list[Entry]:
    """n visible messages (user/assistant alternating) with a metadata event after every third."""
    items: list[dict[str, Any]] = []
    for i in range(n):
        items.append({"message": (user if i % 2 == 0 else assistant)(f"m{i}")})
        if i % 3 == 2:
            items.append({"kind": "metadata", "payload": {"after": i}})
    made = []
    for start in range(0, len(items), 1000):
        made += store.append_many(scope, sid, items[start : start + 1000])
    return [e for e in made if e.kind == "message"]


def read_all(
    store: TranscriptStore, sid: str, cursor: str | None, max_messages: int, max_bytes: int = 1_000_000
) -> tuple[list[Entry], str]:
    """Follow a cursor chain to the end; every page must be a page."""
    seen: list[Entry] = []
    while True:
        page = page_of(store.read_visible_delta(A, sid, cursor, max_messages=max_messages, max_bytes=max_bytes))
        assert page.required_bytes is None
        seen += page.entries
        cursor = page.cursor
        if not page.has_more:
            return seen, cursor


# ---------------------------------------------------------------------------------------------- pages


def test_an_empty_session_reads_an_empty_page(store: TranscriptStore, sid: str) -> None:
    page = page_of(store.read_visible_delta(A, sid))
    assert (page.entries, page.has_more, page.serialized_bytes, page.required_bytes) == ([], False, 0, None)
    assert page.cursor.startswith("tsc2.")
    # Events only: still nothing visible.
    store.append(A, sid, kind="custom", payload={"x": 1})
    again = page_of(store.read_visible_delta(A, sid, page.cursor))
    assert again.entries == [] and again.cursor == page.cursor


def test_a_page_carries_every_field(store: TranscriptStore, sid: str) -> None:
    made = [
        store.append(A, sid, user("q"), idempotency_key="q-1"),
        store.append(A, sid, kind="metadata", payload={}),
        store.append(A, sid, assistant("a")),
    ]
    page = page_of(store.read_visible_delta(A, sid))
    assert page.has_more is False
    assert [e.entry_id for e in page.entries] == [made[0].entry_id, made[2].entry_id]
    first, second = page.entries
    assert (first.seq, first.parent_id, first.role, first.message, first.idempotency_key) == (
        0, None, "user", user("q"), "q-1",
    )
    assert (second.seq, second.parent_id, second.role, second.position) == (2, made[1].entry_id, "assistant", 1)
    assert first.created_at == made[0].created_at
    assert page.serialized_bytes == made[0].size_bytes + made[2].size_bytes


def test_a_cursor_chain_sees_every_visible_message_exactly_once(store: TranscriptStore, sid: str) -> None:
    made = fill(store, sid, 23)
    seen, cursor = read_all(store, sid, None, max_messages=4)
    assert [e.entry_id for e in seen] == [e.entry_id for e in made]
    # Appends between reads continue the chain; events between them are skipped.
    more = fill(store, sid, 5)
    seen2, cursor2 = read_all(store, sid, cursor, max_messages=2)
    assert [e.entry_id for e in seen2] == [e.entry_id for e in more]
    assert [e.position for e in seen + seen2] == list(range(28))
    # At the end: an empty page with the very same cursor.
    tail = page_of(store.read_visible_delta(A, sid, cursor2))
    assert (tail.entries, tail.has_more, tail.cursor) == ([], False, cursor2)


def test_has_more_is_exact_at_the_page_boundary(store: TranscriptStore, sid: str) -> None:
    fill(store, sid, 6)
    assert page_of(store.read_visible_delta(A, sid, max_messages=6)).has_more is False
    assert page_of(store.read_visible_delta(A, sid, max_messages=5)).has_more is True
    assert len(page_of(store.read_visible_delta(A, sid, max_messages=7)).entries) == 6


def test_max_bytes_cuts_the_page(store: TranscriptStore, sid: str) -> None:
    made = [store.append(A, sid, user("x" * n)) for n in (10, 20, 30, 40)]
    sizes = [e.size_bytes for e in made]
    page = page_of(store.read_visible_delta(A, sid, max_bytes=sizes[0] + sizes[1]))
    assert [e.entry_id for e in page.entries] == [made[0].entry_id, made[1].entry_id]
    assert page.has_more and page.serialized_bytes == sizes[0] + sizes[1]
    page = page_of(store.read_visible_delta(A, sid, max_bytes=sizes[0] + sizes[1] - 1))
    assert [e.entry_id for e in page.entries] == [made[0].entry_id]
    seen, _ = read_all(store, sid, None, max_messages=10, max_bytes=max(sizes))
    assert [e.entry_id for e in seen] == [e.entry_id for e in made]


def test_a_message_larger_than_max_bytes_reports_required_bytes(store: TranscriptStore, sid: str) -> None:
    small = store.append(A, sid, user("small"))
    big = store.append(A, sid, assistant("B" * 500))
    first = page_of(store.read_visible_delta(A, sid, max_bytes=100))
    assert [e.entry_id for e in first.entries] == [small.entry_id] and first.has_more
    stuck = page_of(store.read_visible_delta(A, sid, first.cursor, max_bytes=100))
    assert stuck.entries == [] and stuck.cursor == first.cursor
    assert (stuck.required_bytes, stuck.has_more, stuck.serialized_bytes) == (big.size_bytes, True, 0)
    # With enough room the same cursor continues.
    ok = page_of(store.read_visible_delta(A, sid, stuck.cursor, max_bytes=big.size_bytes))
    assert [e.entry_id for e in ok.entries] == [big.entry_id] and ok.required_bytes is None
    # From the very start (no cursor) the unchanged cursor is the start cursor.
    start = page_of(store.read_visible_delta(A, sid, max_bytes=1))
    assert start.entries == [] and start.required_bytes == small.size_bytes
    assert start.cursor == start_cursor(A, sid, 0, inc(store, sid))


BAD_LIMITS: list[tuple[Any, Any]] = [
    (0, 1000), (10_001, 1000), (-1, 1000), (True, 1000), (1.0, 1000), ("5", 1000), (None, 1000),
    (10, 0), (10, 64 * 1024 * 1024 + 1), (10, -5), (10, False), (10, None), (10, 1e3),
]


def test_out_of_range_limits_raise_value_error(store: TranscriptStore, sid: str) -> None:
    for max_messages, max_bytes in BAD_LIMITS:
        for cursor in (None, start_cursor(A, sid, 0, inc(store, sid))):
            with pytest.raises(ValueError):
                store.read_visible_delta(A, sid, cursor, max_messages=max_messages, max_bytes=max_bytes)
    # Even for a session that does not exist: limits are checked first.
    with pytest.raises(ValueError):
        store.read_visible_delta(A, "nope", max_messages=0)
    # The edges themselves are fine.
    fill(store, sid, 2)
    assert len(page_of(store.read_visible_delta(A, sid, max_messages=1, max_bytes=64 * 1024 * 1024)).entries) == 1
    assert len(page_of(store.read_visible_delta(A, sid, max_messages=10_000, max_bytes=1)).entries) == 0


def test_an_unknown_session_is_missing(store: TranscriptStore, sid: str) -> None:
    cursor = page_of(store.read_visible_delta(A, sid)).cursor
    assert isinstance(store.read_visible_delta(A, "nope"), DeltaMissing)
    assert isinstance(store.read_visible_delta(A, "nope", cursor), DeltaMissing)
    assert isinstance(store.read_visible_delta(B, sid, cursor), DeltaMissing)
    store.delete_session(A, sid)
    assert store.read_visible_delta(A, sid, cursor).kind == "missing"


# ---------------------------------------------------------------------------------------------- resets


def _body(cursor: str) -> list[Any]:
    raw = cursor[len("tsc2.") :]
    return list(json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))))


def _token(body: Any, *, separators: tuple[str, str] = (",", ":"), pad: bool = False, prefix: str = "tsc2.") -> str:
    raw = base64.urlsafe_b64encode(json.dumps(body, separators=separators).encode()).decode()
    return prefix + (raw if pad else raw.rstrip("="))


def non_canonical_variants(cursor: str) -> dict[str, str]:
    body = _body(cursor)  # [version, scope, session, generation, incarnation, seq, position]
    padded = "tsc2." + base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).decode()
    variants = {
        "empty": "",
        "garbage": "not a cursor",
        "prefix-only": "tsc2.",
        "other-version-prefix": "tsc1." + cursor[5:],
        "upper-prefix": cursor.upper()[:5] + cursor[5:],
        "truncated-1": cursor[:-1],
        "truncated-4": cursor[:-4],
        "extra-char": cursor + "A",
        "trailing-newline": cursor + "\n",
        "leading-space": " " + cursor,
        "pad-1": cursor + "=",
        "pad-2": cursor + "==",
        "spaced-json": _token(body, separators=(", ", ": ")),
        "version-1": _token([1, *body[1:]]),
        "version-3": _token([3, *body[1:]]),
        "format-1-with-incarnation": _token([1, *body[1:]], prefix="tsc1."),
        "format-2-without-incarnation": _token([2, *body[1:4], *body[5:]]),
        "float-seq": _token([*body[:5], float(body[5]), body[6]]),
        "bool-generation": _token([*body[:3], True, *body[4:]]),
        "negative-generation": _token([*body[:3], -1, *body[4:]]),
        "negative-incarnation": _token([*body[:4], -1, *body[5:]]),
        "float-incarnation": _token([*body[:4], float(body[4]), *body[5:]]),
        "huge-incarnation": _token([*body[:4], 2**63, *body[5:]]),
        "seq-without-position": _token([*body[:5], body[5], -1]),
        "position-without-seq": _token([*body[:5], -1, body[6]]),
        "huge-seq": _token([*body[:5], 2**31, body[6]]),
        "extra-element": _token([*body, 0]),
        "short": _token(body[:6]),
        "object": _token({"v": 2, "scope": body[1]}),
        "not-base64": "tsc2.!!!!$$$$",
        "non-ascii": "tsc2." + "é" * 8,
        "too-long": "tsc2." + "A" * MAX_CURSOR_CHARS,
    }
    if padded != cursor:
        variants["padded-base64"] = padded
    if "-" in cursor or "_" in cursor:
        variants["standard-base64"] = cursor.replace("-", "+").replace("_", "/")
    return variants


def test_non_canonical_cursors_reset_as_invalid(store: TranscriptStore) -> None:
    # Find a session whose cursor needs base64 padding and uses the URL-safe alphabet, so the
    # padded and standard-alphabet re-encodings are real alternatives of the same bytes.
    for i in range(200):
        sid = f"~~~{i}"
        store.create_session(A, session_id=sid)
        fill(store, sid, 3)
        first = page_of(store.read_visible_delta(A, sid, max_messages=1))
        if len(json.dumps(_body(first.cursor), separators=(",", ":"))) % 3 and {"-", "_"} & set(first.cursor):
            break
    variants = non_canonical_variants(first.cursor)
    assert {"padded-base64", "standard-base64"} <= set(variants)
    for name, bad in variants.items():
        result = reset_of(store.read_visible_delta(A, sid, bad))
        assert result.reason == "invalid_cursor", name
        assert result.cursor == start_cursor(A, sid, 0, inc(store, sid)), name
    # The fresh cursor of a reset re-reads everything; the original cursor still works.
    assert len(read_all(store, sid, start_cursor(A, sid, 0, inc(store, sid)), max_messages=10)[0]) == 3
    assert len(page_of(store.read_visible_delta(A, sid, first.cursor)).entries) == 2
    # A cursor that is not even a string is a caller error, not a reset.
    for bad in (123, first.cursor.encode(), [first.cursor]):
        with pytest.raises(InvalidInput):
            store.read_visible_delta(A, sid, bad)  # type: ignore[arg-type]


def test_a_cursor_this_process_issued_decodes_from_memory_and_only_that_token(
    store: TranscriptStore, sid: str
) -> None:
    """The cursor of the previous page is remembered when it is issued: decoding it again is a lookup
    (the same state object), while any other spelling of it (a str subclass, a one-character change,
    a non-canonical variant) is decoded from scratch, as before; after the memory is emptied the
    token still decodes; what is remembered is bounded, valid, and only what this process issued."""
    fill(store, sid, 3)
    first = page_of(store.read_visible_delta(A, sid, max_messages=1))
    remembered = cursors_module.decode_cursor(first.cursor)
    assert remembered is not None and cursors_module.decode_cursor(first.cursor) is remembered

    class Sly(str):
        pass

    sly = cursors_module.decode_cursor(Sly(first.cursor))
    assert sly == remembered and sly is not remembered
    for bad in non_canonical_variants(first.cursor).values():
        assert cursors_module.decode_cursor(bad) is None
    assert cursors_module.decode_cursor(first.cursor[:-1] + ("A" if first.cursor[-1] != "A" else "B")) != remembered
    cursors_module._ISSUED.clear()
    again = cursors_module.decode_cursor(first.cursor)
    assert again == remembered and again is not remembered
    assert cursors_module.decode_cursor(first.cursor) is not again  # a decoded token is not remembered
    # Only valid states are remembered (a token decoding refuses stays refused), decoding a presented
    # token adds nothing, and long tokens are not kept.
    for bad_state in (CursorState(A, sid, 0, 1, 1, -5), CursorState(A, sid, True, 1, 1, 1)):  # type: ignore[arg-type]
        token = bad_state.encode()
        assert token not in cursors_module._ISSUED and cursors_module.decode_cursor(token) is None
    cursors_module._ISSUED.clear()
    assert cursors_module.decode_cursor(first.cursor) == remembered and not cursors_module._ISSUED
    long_token = CursorState("x" * 200, "y" * 200, 0, 1, 1, 1).encode()
    assert long_token not in cursors_module._ISSUED and cursors_module.decode_cursor(long_token) is not None
    # Bounded: issuing more than it holds empties it instead of growing.
    for i in range(cursors_module._ISSUED_MAX + 10):
        CursorState(A, sid, 0, i, i, 1).encode()
    assert len(cursors_module._ISSUED) <= cursors_module._ISSUED_MAX
    assert len(page_of(store.read_visible_delta(A, sid, first.cursor)).entries) == 2


def test_the_longest_legal_cursor_is_canonical(store: TranscriptStore) -> None:
    """Ids of 255 characters that JSON escapes still make a cursor the store accepts back."""
    for char in ("é", "🙂", '"', "\\"):
        longest = min(MAX_ID_CHARS, MAX_ID_BYTES // len(char.encode()))
        scope, sid = char * longest, (char * longest)[:-1] + "x"
        store.create_session(scope, session_id=sid)
        made = [store.append(scope, sid, user(str(i))) for i in range(3)]
        page = page_of(store.read_visible_delta(scope, sid, max_messages=2))
        nxt = page_of(store.read_visible_delta(scope, sid, page.cursor, max_messages=2))
        assert [e.entry_id for e in page.entries + nxt.entries] == [e.entry_id for e in made], char


def test_a_cursor_of_another_session_or_scope_is_a_scope_mismatch(store: TranscriptStore, sid: str) -> None:
    fill(store, sid, 4)
    store.create_session(A, session_id="s2")
    store.create_session(B, session_id=sid)
    fill(store, "s2", 2)
    fill(store, sid, 2, scope=B)
    other_session = page_of(store.read_visible_delta(A, "s2", max_messages=1)).cursor
    other_scope = page_of(store.read_visible_delta(B, sid, max_messages=1)).cursor
    for cursor in (other_session, other_scope):
        reset = reset_of(store.read_visible_delta(A, sid, cursor))
        assert reset.reason == "scope_mismatch"
        assert reset.cursor == start_cursor(A, sid, 0, inc(store, sid))
    # A forged cursor that decodes but names another scope never reads that scope's data.
    forged = CursorState(B, sid, 0, -1, -1, inc(store, sid)).encode()
    assert reset_of(store.read_visible_delta(A, sid, forged)).reason == "scope_mismatch"
    # ... and this session's cursor is a mismatch over there.
    mine = page_of(store.read_visible_delta(A, sid, max_messages=1)).cursor
    assert reset_of(store.read_visible_delta(B, sid, mine)).reason == "scope_mismatch"
    assert reset_of(store.read_visible_delta(A, "s2", mine)).reason == "scope_mismatch"


def test_a_rewrite_resets_old_cursors_with_generation_mismatch(store: TranscriptStore, sid: str) -> None:
    made = fill(store, sid, 5)
    start = page_of(store.read_visible_delta(A, sid, max_messages=0 + 1)).cursor
    mid = page_of(store.read_visible_delta(A, sid, start, max_messages=2)).cursor
    result = store.rewrite_entries(A, sid, [{"entry_id": made[3].entry_id, "message": assistant("edited")}])
    assert result.changed and result.generation == 1
    for cursor in (start, mid, start_cursor(A, sid, 0, inc(store, sid))):
        reset = reset_of(store.read_visible_delta(A, sid, cursor))
        assert reset.reason == "generation_mismatch"
        assert reset.cursor == start_cursor(A, sid, 1, inc(store, sid))
    seen, _ = read_all(store, sid, start_cursor(A, sid, 1, inc(store, sid)), max_messages=2)
    assert [e.message for e in seen] == [e.message for e in made[:3]] + [assistant("edited"), made[4].message]


def test_branching_away_from_a_cursor_resets_with_anchor_missing(store: TranscriptStore, sid: str) -> None:
    made = fill(store, sid, 6)
    at4 = read_all(store, sid, None, max_messages=1)[1]  # the cursor after message 5
    at2 = page_of(store.read_visible_delta(A, sid, max_messages=3)).cursor
    store.branch(A, sid, made[3].entry_id)
    regen = store.append(A, sid, user("regenerated"))
    # Message 5 left the active path: that cursor's ground is gone (generation did not rotate).
    reset = reset_of(store.read_visible_delta(A, sid, at4))
    assert reset.reason == "anchor_missing" and reset.cursor == start_cursor(A, sid, 0, inc(store, sid))
    # A cursor whose last message is still on the path continues onto the new branch.
    page = page_of(store.read_visible_delta(A, sid, at2))
    assert [e.entry_id for e in page.entries] == [made[3].entry_id, regen.entry_id]
    # Branching back restores the first cursor's ground.
    store.branch(A, sid, made[5].entry_id)
    tail = page_of(store.read_visible_delta(A, sid, at4))
    assert tail.entries == [] and tail.has_more is False


def test_forged_cursors_reset_never_read_a_wrong_page(store: TranscriptStore, sid: str) -> None:
    made = fill(store, sid, 4)  # seqs: m0=0 m1=1 m2=2 meta=3 m3=4
    seq = {e.position: e.seq for e in made}
    # Names a real message but at the wrong position: the anchor moved.
    moved = CursorState(A, sid, 0, seq[2], 1, inc(store, sid)).encode()
    assert reset_of(store.read_visible_delta(A, sid, moved)).reason == "anchor_moved"
    # Names a seq that does not exist / a position past the end / a non-message entry.
    for forged in (
        CursorState(A, sid, 0, 99, 99, inc(store, sid)),
        CursorState(A, sid, 0, 99, 1, inc(store, sid)),
        CursorState(A, sid, 0, 3, 2, inc(store, sid)),
        CursorState(A, sid, 5, seq[1], 1, inc(store, sid)),
    ):
        result = reset_of(store.read_visible_delta(A, sid, forged.encode()))
        assert result.reason in ("anchor_missing", "anchor_moved", "generation_mismatch")
    # A well-formed cursor the store could have issued is honoured.
    honest = CursorState(A, sid, 0, seq[1], 1, inc(store, sid)).encode()
    assert [e.position for e in page_of(store.read_visible_delta(A, sid, honest)).entries] == [2, 3]


def test_a_forged_cursor_at_the_top_of_the_integer_range_resets(store: TranscriptStore, sid: str) -> None:
    """A cursor that decodes may name any position up to 2**31-1: its page bound (position + limit)
    overflowed PostgreSQL's INTEGER, a StoreUnavailable instead of the reset SQLite gave."""
    fill(store, sid, 3)
    top = 2**31 - 1
    for position, generation in ((top, 0), (top - 5, 0), (top, top)):
        forged = CursorState(A, sid, generation, position, position, inc(store, sid)).encode()
        for limit in (1, 10_000):
            result = reset_of(store.read_visible_delta(A, sid, forged, max_messages=limit))
            assert result.reason in ("anchor_missing", "generation_mismatch")


def test_a_cursor_of_a_deleted_and_recreated_session_resets(store: TranscriptStore, sid: str) -> None:
    fill(store, sid, 4)
    cursor = page_of(store.read_visible_delta(A, sid, max_messages=2)).cursor
    store.delete_session(A, sid)
    store.create_session(A, session_id=sid)
    fill(store, sid, 4)
    # Honouring the old cursor would skip the new session's first two messages: a wrong page.
    reset = store.read_visible_delta(A, sid, cursor)
    assert isinstance(reset, DeltaReset) and reset.reason == "scope_mismatch"
    assert len(read_all(store, sid, reset.cursor, max_messages=3)[0]) == 4


def test_a_cursor_of_an_imported_session_resets_on_another_import_of_the_same_export(
    store: TranscriptStore, sid: str
) -> None:
    """An export keeps the session's creation time, and two imports of it are two incarnations: a
    cursor of the first (deleted) is not honoured on the second, nor an old one after a re-import."""
    fill(store, sid, 2)
    header, records = store.export_session(A, sid)
    store.delete_session(A, sid)
    first = store.import_session(A, header, records)
    fill(store, sid, 4)  # the first import grows to 6 messages; a reader is at the 4th
    cursor = page_of(store.read_visible_delta(A, sid, max_messages=4)).cursor
    store.delete_session(A, sid)
    second = store.import_session(A, header, records)
    for i in range(4):  # other messages at the same positions and seqs
        store.append(A, sid, (user if i % 2 == 0 else assistant)(f"second import {i}"))
    assert first.created_at == second.created_at  # the export's creation time, both times
    assert first.incarnation != second.incarnation
    # Honouring the old cursor would skip the second import's 3rd and 4th messages: a wrong page.
    reset = store.read_visible_delta(A, sid, cursor)
    assert isinstance(reset, DeltaReset) and reset.reason == "scope_mismatch"
    assert len(read_all(store, sid, reset.cursor, max_messages=4)[0]) == 6


def test_a_format_1_cursor_is_still_read_and_answered_with_a_format_2_cursor(
    store: TranscriptStore, sid: str
) -> None:
    """Engines keep cursors in their own tables: an upgrade must not make every one of them reset. Only a
    session from before incarnations (revision 0007) can have issued a format-1 cursor, though: on any
    other (one created since, or deleted and created again under the id) it resets, never reads a page."""
    made = fill(store, sid, 4)
    old = _token([1, A, sid, 0, made[1].seq, 1], prefix="tsc1.")
    assert reset_of(store.read_visible_delta(A, sid, old)).reason == "scope_mismatch"  # a new session's
    make_legacy(store, A, sid)
    page = page_of(store.read_visible_delta(A, sid, old))
    assert [e.entry_id for e in page.entries] == [e.entry_id for e in made[2:]]
    assert page.cursor.startswith("tsc2.") and _body(page.cursor)[4] == inc(store, sid)
    other = _token([1, B, sid, 0, -1, -1], prefix="tsc1.")
    assert reset_of(store.read_visible_delta(A, sid, other)).reason == "scope_mismatch"
    store.delete_session(A, sid)
    store.create_session(A, session_id=sid)
    fill(store, sid, 4)
    assert reset_of(store.read_visible_delta(A, sid, old)).reason == "scope_mismatch"  # not the old session's


def test_every_page_after_a_format_1_cursor_carries_a_format_2_cursor(store: TranscriptStore, sid: str) -> None:
    """Not only a page with entries: a page that stops before a message larger than ``max_bytes``
    (``required_bytes``), and the empty page of a reader that is caught up, hand back the same position
    as a format-2 cursor, as every cursor the store issues is (cursors.py). Both used to hand the
    format-1 token back, so a reader that was caught up, or stuck on a large message, kept a cursor
    that says nothing of the session's incarnation (what the lossless engine's compaction reads)."""
    made = fill(store, sid, 2)
    big = store.append(A, sid, user("x" * 4000))
    make_legacy(store, A, sid)
    stuck_at = _token([1, A, sid, 0, made[1].seq, 1], prefix="tsc1.")
    stuck = page_of(store.read_visible_delta(A, sid, stuck_at, max_bytes=1000))
    assert (stuck.entries, stuck.required_bytes, stuck.has_more) == ([], big.size_bytes, True)
    assert stuck.cursor.startswith("tsc2.") and _body(stuck.cursor) == [2, A, sid, 0, inc(store, sid), made[1].seq, 1]
    after = page_of(store.read_visible_delta(A, sid, stuck.cursor, max_bytes=big.size_bytes))
    assert [e.entry_id for e in after.entries] == [big.entry_id]
    caught_up_at = _token([1, A, sid, 0, big.seq, 2], prefix="tsc1.")
    caught_up = page_of(store.read_visible_delta(A, sid, caught_up_at))
    assert (caught_up.entries, caught_up.has_more, caught_up.cursor) == ([], False, after.cursor)
    # A format-2 cursor is handed back as it was presented: the same token, which is canonical.
    assert page_of(store.read_visible_delta(A, sid, stuck.cursor, max_bytes=1000)).cursor == stuck.cursor


# ---------------------------------------------------------------------------------------------- full reads


def test_read_visible_is_the_whole_active_transcript(store: TranscriptStore, sid: str) -> None:
    made = fill(store, sid, 12)
    assert [e.entry_id for e in store.read_visible(A, sid)] == [e.entry_id for e in made]
    assert all(e.active for e in store.read_visible(A, sid))
    store.branch(A, sid, made[7].entry_id)
    assert [e.entry_id for e in store.read_visible(A, sid)] == [e.entry_id for e in made[:8]]
    assert read_all(store, sid, None, max_messages=3)[0] == store.read_visible(A, sid)


def test_get_entries_reads_any_branch_and_kind_in_the_order_asked(store: TranscriptStore, sid: str) -> None:
    a = store.append(A, sid, user("a"))
    ev = store.append(A, sid, kind="custom", payload={"k": 1})
    b = store.append(A, sid, assistant("b"))
    store.branch(A, sid, ev.entry_id)
    c = store.append(A, sid, assistant("c"))
    got = store.get_entries(A, sid, [c.entry_id, b.entry_id, a.entry_id, ev.entry_id, b.entry_id])
    assert [e.entry_id for e in got] == [c.entry_id, b.entry_id, a.entry_id, ev.entry_id, b.entry_id]
    assert [e.active for e in got] == [True, False, True, True, False]
    assert got[1].message == assistant("b") and got[3].payload == {"k": 1}
    assert store.get_entries(A, sid, []) == []
    for ids in (["nope"], [a.entry_id, "nope"]):
        with pytest.raises(UnknownEntry):
            store.get_entries(A, sid, ids)
    store.create_session(A, session_id="s2")
    with pytest.raises(UnknownEntry):
        store.get_entries(A, "s2", [a.entry_id])
    for bad in ("abc", [1], ["x"] * 10_001):
        with pytest.raises(InvalidInput):
            store.get_entries(A, sid, bad)  # type: ignore[arg-type]


def test_get_entries_of_many_ids_with_array_and_sql_metacharacters(store: TranscriptStore, sid: str) -> None:
    """More than 8 ids go to the database as one array on PostgreSQL (core._entry_rows_of_array): ids
    that an array literal or SQL would read otherwise (NULL, commas, braces, quotes, backslashes) are
    looked up exactly, a repeated one answered each time, a missing one refused with nothing read."""
    ids = ["NULL", "null", "a,b", "{x}", "}", '"q"', "back\\slash", "sp ace", "'; --", "é", ",", "1"]
    for i, entry_id in enumerate(ids):
        store.append(A, sid, user(f"m{i}"), entry_id=entry_id)
    asked = [*reversed(ids), "NULL"]
    got = store.get_entries(A, sid, asked)
    assert [e.entry_id for e in got] == asked
    assert [e.message for e in got][-2:] == [user("m0"), user("m0")]
    with pytest.raises(UnknownEntry):
        store.get_entries(A, sid, [*ids, "absent"])


def test_list_entries_lists_everything_with_the_active_flag(store: TranscriptStore, sid: str) -> None:
    a = store.append(A, sid, user("a"))
    b = store.append(A, sid, assistant("b"))
    store.branch(A, sid, a.entry_id)
    ev = store.append(A, sid, kind="metadata", payload={})
    c = store.append(A, sid, assistant("c"))
    listed = store.list_entries(A, sid)
    assert [(e.entry_id, e.seq, e.active) for e in listed] == [
        (a.entry_id, 0, True), (b.entry_id, 1, False), (ev.entry_id, 2, True), (c.entry_id, 3, True),
    ]
    assert [e.entry_id for e in store.list_entries(A, sid, after_seq=1, limit=1)] == [ev.entry_id]
    assert store.list_entries(A, sid, after_seq=3) == []
    for kwargs in ({"after_seq": -2}, {"limit": 0}, {"limit": 10_001}, {"after_seq": True}):
        with pytest.raises(ValueError):
            store.list_entries(A, sid, **kwargs)


# ---------------------------------------------------------------------------------------------- cost


class _CountingConn:
    """A SQLAlchemy connection that records, per statement, how many rows came back to the store."""

    def __init__(self, conn: Any, log: list[int]) -> None:
        self._conn = conn
        self._log = log

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        result = self._conn.execute(*args, **kwargs)
        if not result.returns_rows:
            self._log.append(0)
            return result
        frozen = result.freeze()
        self._log.append(len(frozen.data))
        return frozen()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def inc(store: TranscriptStore, sid: str) -> int:
    """The session's incarnation, as its cursors carry it."""
    return store.get_session(A, sid).incarnation


@contextmanager
def counting(store: TranscriptStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[int], list[Any]]]:
    rows: list[int] = []
    statements: list[Any] = []

    class CountingCore(Core):
        """Records, per statement, how many rows came back to the store (hot runner or SQLAlchemy)."""

        def __init__(self, conn: Any, dialect: Any, config: Any) -> None:
            super().__init__(_CountingConn(conn, rows), dialect, config)

        def run(self, stmt: Any, params: Any = None) -> Any:
            result = hot.run(self.conn._conn, stmt, params)
            rows.append(len(result.all()))
            return result

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, parameters))

    with monkeypatch.context() as m:
        m.setattr(store_module, "Core", CountingCore)
        event.listen(store.db.engine, "before_cursor_execute", capture)
        try:
            yield rows, statements
        finally:
            event.remove(store.db.engine, "before_cursor_execute", capture)


_PAGE_SCAN = re.compile(r"SCAN (page|sized|\(subquery-\d+\))$")


def _assert_indexed(store: TranscriptStore, statements: list[Any]) -> None:
    """On SQLite, no statement of the read scans a whole table: every access is an index search (the
    scans allowed are of a delta page's own rows, at most a page plus one, produced by an index search
    under its LIMIT: ``page``, ``sized`` (their sizes, cut by max_bytes) and the window's own buffer
    of them, which SQLite calls a numbered subquery).

    (PostgreSQL's plans on these tiny, never-analyzed test tables say nothing about its plans on real
    ones, so there the test relies on the rows each statement returns.)
    """
    if store.backend != "sqlite":
        return
    with store.db.engine.connect() as conn:
        for sql, params in statements:
            details = [str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]
            scans = [d for d in details if d.startswith("SCAN ") and not _PAGE_SCAN.match(d)]
            assert details and not scans, details


def _cost(store: TranscriptStore, monkeypatch: pytest.MonkeyPatch, sid: str, cursor: str | None) -> list[int]:
    with counting(store, monkeypatch) as (rows, statements):
        page = page_of(store.read_visible_delta(A, sid, cursor, max_messages=50))
    assert len(page.entries) == 50 and page.has_more
    _assert_indexed(store, statements)
    return rows


@pytest.mark.parametrize("shape", ["linear", "branched"])
def test_a_delta_page_costs_o_page_not_o_history(
    store: TranscriptStore, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    # A session whose every entry is on its active path, and one with an entry off it (a branch
    # before the history): the page goes through the path's position index either way.
    costs = {}
    for n in (100, 2000):
        sid = f"len-{n}"
        store.create_session(A, session_id=sid)
        if shape == "branched":
            kept, _dropped = store.append_many(A, sid, [{"message": user("a")}, {"message": assistant("b")}])
            store.branch(A, sid, kept.entry_id)
        made = fill(store, sid, n)
        offset = 1 if shape == "branched" else 0  # the kept first message
        # Read once from the start, once from a cursor deep in the transcript.
        at = made[n - 60]
        assert at.position == n - 60 + offset
        deep = CursorState(A, sid, 0, at.seq, at.position, inc(store, sid)).encode()
        costs[n] = (_cost(store, monkeypatch, sid, None), _cost(store, monkeypatch, sid, deep))
    # Same statements, same rows back for 20x the history: the page plus one (it tells has_more),
    # and the session's own row.
    assert costs[100] == costs[2000]
    start, deep = costs[2000]
    assert max(start + deep) == 52 and len(start) <= 3 and len(deep) <= 4


def _delta_statements(store: TranscriptStore, run: Any) -> tuple[int, int]:
    """(transactions begun, statements executed) while ``run()`` reads."""
    began: list[int] = []
    executed: list[int] = []

    def on_begin(_conn: Any) -> None:
        began.append(1)

    def on_statement(*_args: Any) -> None:
        executed.append(1)

    event.listen(store.db.engine, "begin", on_begin)
    event.listen(store.db.engine, "before_cursor_execute", on_statement)
    try:
        run()
    finally:
        event.remove(store.db.engine, "begin", on_begin)
        event.remove(store.db.engine, "before_cursor_execute", on_statement)
    return len(began), len(executed)


def test_an_unfenced_page_is_one_statement_outside_any_transaction(store: TranscriptStore, sid: str) -> None:
    """One round trip on PostgreSQL: the session, the cursor's position and the page in one statement,
    which is its own snapshot; a fenced read and a moved anchor still read in a snapshot."""
    made = fill(store, sid, 30)
    first = page_of(store.read_visible_delta(A, sid, max_messages=10))
    assert _delta_statements(store, lambda: store.read_visible_delta(A, sid, first.cursor, max_messages=10)) == (0, 1)
    assert _delta_statements(store, lambda: store.read_visible_delta(A, "nobody")) == (0, 1)
    fence = store.anchor(A, sid, made[20].entry_id)
    began, _ = _delta_statements(store, lambda: store.read_visible_delta(A, sid, first.cursor, fence=fence))
    assert began == 1
    # The cursor's anchor leaves the path (a branch from before it): the reason needs a second look,
    # which the read takes in a snapshot of its own, and answers as before.
    store.branch(A, sid, made[5].entry_id)
    store.append(A, sid, user("elsewhere"))
    results: list[Any] = []
    began, _ = _delta_statements(store, lambda: results.append(store.read_visible_delta(A, sid, first.cursor)))
    assert reset_of(results[0]).reason == "anchor_missing" and began == 1


def test_a_statement_read_leaves_its_connection_transactional(store: TranscriptStore, sid: str) -> None:
    """The pooled connection a read ran on without a transaction is back in transaction mode: a write
    that fails after its first statement leaves nothing behind. Reads that end every way: a page, a
    missing session, a moved anchor (the statement read gives up for a snapshot), a refused cursor."""
    made = fill(store, sid, 5)
    moved = page_of(store.read_visible_delta(A, sid, max_messages=2)).cursor
    store.branch(A, sid, made[0].entry_id)
    store.append(A, sid, user("elsewhere"))
    for _ in range(3):
        store.read_visible_delta(A, sid, max_messages=2)
        store.read_visible_delta(A, "nobody")
        reset_of(store.read_visible_delta(A, sid, moved))
        with pytest.raises(InvalidInput):
            store.read_visible_delta(A, sid, 42)  # type: ignore[arg-type]

    def fail_after_append(c: Core) -> None:
        c.create_session(A, "half-done", None)
        raise RuntimeError("after the first statement")

    for _ in range(6):
        with pytest.raises(RuntimeError):
            store.write(fail_after_append)
    with pytest.raises(UnknownSession):
        store.get_session(A, "half-done")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _decodes_as_json_loads(text: str) -> None:
    """core.decode_stored gives what json.loads gives (NaN: NaN), or raises what it raises."""
    try:
        expected = json.loads(text)
    except json.JSONDecodeError:
        with pytest.raises(json.JSONDecodeError):
            decode_stored(text)
        return
    got = decode_stored(text)
    assert got == expected or (got != got and expected != expected)  # NaN is not equal to itself


# Examples of the two JSON-codec properties below: make test's, then make test-slow's (CI time).
_DECODE_EXAMPLES = [60, pytest.param(300, marks=pytest.mark.slow)]
_ENCODE_EXAMPLES = [80, pytest.param(400, marks=pytest.mark.slow)]


@pytest.mark.parametrize("examples", _DECODE_EXAMPLES)
def test_stored_payloads_decode_as_json_loads_decodes_them(examples: int) -> None:
    """core.decode_stored (the read path's decoder) on stored texts, bare or with text around them."""

    @settings(max_examples=examples, deadline=None)
    @given(value=_JSON, pad=st.sampled_from(["", " ", "\n", "x", "]", " 1"]), front=st.booleans())
    def check(value: Any, pad: str, front: bool) -> None:
        text = stored_text(value)
        _decodes_as_json_loads(pad + text if front else text + pad)

    check()


@pytest.mark.parametrize("text", ["", "{", "NaN", "[1,2]x", '"\\ud800"', '{"a":1}{}', "1 2", "[" * 50 + "]" * 50])
def test_stored_payload_edge_cases_decode_as_json_loads(text: str) -> None:
    """Edge cases of core.decode_stored against json.loads (NaN, lone surrogates, trailing text)."""
    _decodes_as_json_loads(text)


# What the stored and canonical texts are made of, and what makes compact_json take its second encoding.
_TRICKY = st.text(
    st.sampled_from(["a", "u", "\\", '"', "\x00", "\x1f", "\n", "\x7f", "\x80", "é", "\u2028", "\ud800", "\U0001f600"])
)
_ENCODABLE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | _TRICKY,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8) | _TRICKY | st.integers(), inner, max_size=4),
    max_leaves=20,
)


def _encodes_as_json_dumps(value: Any, sort_keys: bool) -> None:
    """models.compact_json gives json.dumps's text (compact, UTF-8, no NaN), or raises what it raises."""
    try:
        expected = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False, sort_keys=sort_keys)
    except (TypeError, ValueError) as e:
        with pytest.raises(type(e)) as raised:
            compact_json(value, sort_keys=sort_keys)
        assert str(raised.value) == str(e)
        return
    assert compact_json(value, sort_keys=sort_keys) == expected


def test_the_fast_json_encoder_is_in_use() -> None:
    """On CPython the store encodes with _json's C encoder (else the tests below compare json.dumps with itself)."""
    assert models_module._C_JSON is not None


@pytest.mark.parametrize("examples", _ENCODE_EXAMPLES)
def test_stored_and_canonical_texts_are_what_json_dumps_writes(examples: int) -> None:
    """compact_json (every stored payload, every turn's hashed text) against json.dumps: the same text
    for ASCII and non-ASCII values alike, the same error for NaN, unsortable or non-JSON values."""

    @settings(max_examples=examples, deadline=None)
    @given(value=_ENCODABLE, sort_keys=st.booleans())
    def check(value: Any, sort_keys: bool) -> None:
        _encodes_as_json_dumps(value, sort_keys)

    check()


_NUMBERS_AND_CO = st.sampled_from([0, 1, -1, 0.0, -0.0, 1.0, 1e16, 10**16, True, False, None, "1", "a"])
_ALIKE_VALUES = st.recursive(
    _NUMBERS_AND_CO,
    lambda inner: st.lists(inner, max_size=3).map(lambda v: v if len(v) % 2 else tuple(v))
    | st.dictionaries(st.sampled_from("ab"), inner, max_size=2),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None)
@given(a=_ALIKE_VALUES, b=_ALIKE_VALUES)
def test_same_json_is_equality_of_the_canonical_texts(a: Any, b: Any) -> None:
    """What an idempotency or commit check takes for the same content hashes the same: 1, 1.0 and True
    (``==`` in Python) are three values, a tuple is the list it is written as, key order is no matter."""
    assert same_json(a, b) == (canonical_json(a) == canonical_json(b)) == same_json(b, a)


@pytest.mark.parametrize(
    "value",
    [
        "\\u00e9", "é", "\x7f", "\x00", "\ud800", float("nan"), float("inf"), {1: "a", "b": 2}, {"a": {1, 2}},
        [b"x"], {"role": "user", "content": "plain ascii " * 100}, {"content": "日本語のテキスト", "role": "user"},
    ],
)
def test_json_encoder_edge_cases(value: Any) -> None:
    """Escapes, lone surrogates, NaN, mixed key types and non-JSON values, both key orders."""
    for sort_keys in (False, True):
        _encodes_as_json_dumps(value, sort_keys)


def test_a_cycle_is_refused_as_json_dumps_refuses_it() -> None:
    """A value that contains itself: json.dumps's ValueError, and the next encoding is unaffected."""
    loop: list[Any] = ["x"]
    loop.append(loop)
    _encodes_as_json_dumps(loop, False)
    assert compact_json(["x"]) == '["x"]'


def _work_of_read(store: TranscriptStore, read: Any) -> tuple[int, list[Any], Any]:
    """(SQLite virtual-machine steps, the statements sent, the result) of ``read()``."""
    steps = [0]
    sent: list[Any] = []

    def count() -> int:
        steps[0] += 1
        return 0

    def on_checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        if store.backend == "sqlite":
            dbapi_conn.set_progress_handler(count, 1)

    def on_statement(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        sent.append((statement, parameters))

    event.listen(store.db.engine, "checkout", on_checkout)
    event.listen(store.db.engine, "before_cursor_execute", on_statement)
    try:
        result = read()
    finally:
        event.remove(store.db.engine, "checkout", on_checkout)
        event.remove(store.db.engine, "before_cursor_execute", on_statement)
        if store.backend == "sqlite":
            with store.db.engine.connect() as conn:  # the pool's connections, as they were
                conn.connection.driver_connection.set_progress_handler(None, 1)
    return steps[0], sent, result


def _rows_thrown_away(store: TranscriptStore, sent: list[Any]) -> int:
    """PostgreSQL: the most rows any node of the page statements' generic plans read and filtered out."""
    from test_pg_plans import _generic_plan

    pages = [(s, p) for s, p in sent if "LIMIT" in s and "b_after_seq" in s]
    assert pages, sent
    removed = [0]
    with store.db.engine.connect() as conn:
        for sql, params in pages:
            plan = _generic_plan(conn, sql, params, "ANALYZE, COSTS OFF")
            removed += [int(x) for x in re.findall(r"Rows Removed by (?:Join )?Filter: (\d+)", plan)]
        conn.rollback()
    return max(removed)


def test_a_fence_far_behind_the_head_bounds_the_page_scan(store: TranscriptStore) -> None:
    """A fenced page whose fence lies far behind the head (a retried turn's pre-turn read, long after):
    the read stops at the fence instead of walking every entry after it and filtering them out."""
    work = {}
    for n in (300, 3000):
        sid = store.create_session(A, session_id=f"fenced-{n}").session_id
        made = store.append_many(A, sid, [{"message": (user if i % 2 == 0 else assistant)(f"m{i}")} for i in range(n)])
        fence = store.anchor(A, sid, made[100].entry_id)  # a user message
        cursor = CursorState(A, sid, 0, made[60].seq, 60, inc(store, sid)).encode()
        work[n], sent, result = _work_of_read(
            store, lambda: store.read_visible_delta(A, sid, cursor, max_messages=50, fence=fence)  # noqa: B023
        )
        page = page_of(result)
        assert [e.position for e in page.entries] == list(range(61, 100)) and not page.has_more
        if store.backend == "postgresql":
            assert _rows_thrown_away(store, sent) <= 1
    if store.backend == "sqlite":
        assert work[3000] < 1.5 * work[300], work


def test_events_after_the_last_message_are_not_walked_by_each_read(store: TranscriptStore) -> None:
    """A reader polling at the tail of a session that ends in many non-message entries (events, or a
    session of events only) reads the page's window, not every event after it, on every poll."""
    work = {}
    for n in (300, 3000):
        sid = store.create_session(A, session_id=f"events-{n}").session_id
        store.append_many(A, sid, [{"message": user(f"m{i}")} for i in range(20)])
        store.append_many(A, sid, [{"kind": "custom", "payload": {"i": i}} for i in range(n)])
        tail = page_of(store.read_visible_delta(A, sid, None, max_messages=1000)).cursor
        work[n], sent, result = _work_of_read(
            store, lambda: store.read_visible_delta(A, sid, tail, max_messages=20)  # noqa: B023
        )
        assert page_of(result).entries == [] and not page_of(result).has_more
        only = store.create_session(A, session_id=f"only-events-{n}").session_id
        store.append_many(A, only, [{"kind": "custom", "payload": {"i": i}} for i in range(n)])
        steps, more, result = _work_of_read(store, lambda: store.read_visible_delta(A, only, None))  # noqa: B023
        assert page_of(result).entries == []
        work[n] += steps
        sent += more
        if store.backend == "postgresql":
            assert _rows_thrown_away(store, sent) <= 1
    if store.backend == "sqlite":
        assert work[3000] < 1.5 * work[300], work


@pytest.mark.parametrize("seed", range(4))
def test_pages_of_sessions_that_branch_and_rewrite_match_the_visible_transcript(
    store: TranscriptStore, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Random appends, events, branches and rewrites; after each, a reader that kept its cursor, a
    fresh cursor chain and fenced chains all agree with ``read_visible`` (invariants 3 and 4). A
    session read with the one-table page while it had no branch, and with the active path's page once
    it had one; the process-wide hint of branched sessions is forgotten at random, as a process that
    never read the session would have none."""
    import random

    rng = random.Random(seed)
    sid = store.create_session(A, session_id=f"walk-{seed}").session_id
    kept: list[Entry] = []
    cursor: str | None = None
    for step in range(60):
        op = rng.random()
        visible = store.read_visible(A, sid)
        if op < 0.55 or not visible:
            items = [{"message": (user if rng.random() < 0.5 else assistant)(f"s{step}.{i}")}
                     for i in range(rng.randint(1, 6))]
            if rng.random() < 0.3:
                items.insert(rng.randrange(len(items) + 1), {"kind": "custom", "payload": {"step": step}})
            store.append_many(A, sid, items)
        elif op < 0.75:
            store.branch(A, sid, rng.choice(visible).entry_id)
        elif op < 0.9:
            target = rng.choice(visible)
            store.rewrite_entries(A, sid, [{"entry_id": target.entry_id, "message": user(f"edit {step}")}])
        else:
            store.append(A, sid, user(f"lone {step}"))
        if rng.random() < 0.3:
            monkeypatch.setattr(core_module, "_BRANCHED", RecentKeys(core_module._BRANCHED.limit))
        visible = store.read_visible(A, sid)
        want = [(e.entry_id, e.position) for e in visible]
        fresh, _ = read_all(store, sid, None, rng.randint(1, 7))
        assert [(e.entry_id, e.position) for e in fresh] == want
        # The reader that kept its cursor: a page continues it, a reset restarts it.
        result = store.read_visible_delta(A, sid, cursor, max_messages=1000)
        if isinstance(result, DeltaReset):
            kept, result = [], store.read_visible_delta(A, sid, result.cursor, max_messages=1000)
        page = page_of(result)
        kept += page.entries
        cursor = page.cursor
        assert [(e.entry_id, e.position) for e in kept] == want
        users = [e for e in visible if e.role == "user"]
        if users:
            fence = store.anchor(A, sid, rng.choice(users).entry_id)
            before = [(e.entry_id, e.position) for e in store.read_visible(A, sid, fence=fence)]
            got: list[Entry] = []
            at: str | None = None
            while True:
                fenced = page_of(store.read_visible_delta(A, sid, at, max_messages=rng.randint(1, 5), fence=fence))
                got += fenced.entries
                at = fenced.cursor
                if not fenced.has_more:
                    break
            assert [(e.entry_id, e.position) for e in got] == before


def test_a_cursor_before_the_first_message_claiming_a_later_seq_reads_from_the_start(
    store: TranscriptStore, sid: str
) -> None:
    """A start cursor (position -1) whose seq says otherwise is read by its position: from the start,
    never after the seq it claims (which would skip messages)."""
    made = fill(store, sid, 12)
    forged = CursorState(A, sid, 0, made[5].seq, -1, inc(store, sid)).encode()
    result = store.read_visible_delta(A, sid, forged, max_messages=100)
    if isinstance(result, DeltaPage):
        assert [e.entry_id for e in result.entries] == [e.entry_id for e in made]
    else:
        assert reset_of(result).reason == "invalid_cursor"


class _SlowKey:
    """A key whose hashing lets other threads run: a thread switch between any two steps of the set's
    operations, as a free-threaded interpreter may make at any point (with the GIL, CPython 3.11 never
    switches between a look and the touch after it, so plain keys would not find the race)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        time.sleep(0)  # releases the GIL
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SlowKey) and other.value == self.value


def test_the_branched_sessions_hint_is_shared_by_threads_safely(store: TranscriptStore, sid: str) -> None:
    """The hint of sessions found branched is process-wide: a threaded gateway's readers share it. Its
    look-and-touch and its add-and-drop are each one step: a reader never finds a key that another
    thread dropped between its look and its touch (a KeyError out of a delta read).

    Hammered with a limit of two over four keys, so that nearly every add drops a key some other
    thread is about to touch."""
    made = fill(store, sid, 3)
    store.branch(A, sid, made[0].entry_id)
    store.append(A, sid, user("elsewhere"))
    page_of(store.read_visible_delta(A, sid))
    assert core_module._BRANCHED.touch((store.config.url, A, sid))  # the hint a delta read uses
    hint = RecentKeys(2)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def hammer(n: int) -> None:
        start.wait()
        try:
            for i in range(500):
                key = _SlowKey((n + i) % 4)
                if not hint.touch(key):
                    hint.add(key)
        except BaseException as e:  # any error is the failure this test looks for
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(hint) <= 2


def test_a_recent_keys_set_is_not_kept_alive_and_its_lock_is_fresh_in_a_forked_child() -> None:
    """The fork hook that renews each set's lock held every set alive for the life of the process (a
    hook per instance); and a lock a parent's thread held at the fork would block the child for ever."""
    import gc
    import os
    import signal
    import weakref

    dropped = RecentKeys(4)
    gone = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert gone() is None

    held = RecentKeys(4)
    held.add("k")
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with held._lock:
            taken.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the lock a parent's thread held is a fresh one here
            signal.alarm(10)  # a lock still held would block for ever: the alarm ends the child instead
            os._exit(0 if held.touch("k") else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    assert os.waitstatus_to_exitcode(status) == 0
