"""Hostile review of session export/import (transcript_store/transfer.py), on both backends.

What the CLI and store tests already cover (test_cli.py: the JSONL round trip and a list of refusals;
test_store_delta / test_store_closed_range / test_store_fence: cursors and anchors of an imported
session; test_faults_connections: a retried import) is not repeated here. This file covers: an exact
round trip of a session with branches, rewrites, every kind and tricky JSON through the CLI's JSON text;
the imported session working on; import over an existing session; malformed trees and values; times the
store cannot read back; turn ids where the store never puts them; the header's own ids; a large import.
Every refusal is a typed error and leaves every table of the store byte for byte as it was.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import inspect, text

from transcript_store import IdempotencyConflict, InvalidInput, SessionKeyConflict, TranscriptStore
from transcript_store.errors import InvalidMessage

SRC, DST = "src", "dst"

#: JSON values whose texts differ although Python compares some of them equal (1 == 1.0 == True)
NUMBERS = {"int": 1, "float": 1.0, "bool": True, "neg_zero": -0.0, "big": 10**30, "tiny": 1e-7,
           "wide": 2**53 + 1, "exp": 1e16, "zero": 0, "f_zero": 0.0, "null": None}
TRICKY = (
    "astral \U0001f600\U00010348, NUL \u0000, RTL \u202e, BOM \ufeff, e\u0301, tab\t, "
    "LS \u2028 PS \u2029 NEL \u0085 FS \u001c VT \u000b, \\u0000 as text"
)


def user(content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": content, **extra}


def assistant(content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **extra}


def build(store: TranscriptStore, sid: str = "s1") -> None:
    """A session with every kind, a turn id, an idempotency key, two branches, a rewrite and odd JSON."""
    store.create_session(SRC, session_id=sid, session_key=f"key:{sid}")
    store.append(SRC, sid, {"role": "system", "content": TRICKY}, entry_id="sys")
    store.admit(SRC, sid, user("q1", numbers=NUMBERS), turn_id="turn-1", entry_id="u1")
    store.append(SRC, sid, assistant(None, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1.0}'}}]), entry_id="a1")
    store.append(SRC, sid, {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r"}]},
                 entry_id="t1", idempotency_key="idem-1")
    store.append(SRC, sid, kind="custom", payload={"z": 1, "a": [1.0, True, {"n": None}], "k": NUMBERS},
                 entry_id="ev1")
    store.append(SRC, sid, kind="metadata", payload={}, entry_id="md1")
    store.append(SRC, sid, assistant("old answer"), entry_id="a2")
    # A branch back to the tool result: a2 stays, off the path.
    store.branch(SRC, sid, "t1")
    store.append(SRC, sid, assistant("new answer \U0001f680"), entry_id="a3")
    store.append(SRC, sid, kind="compaction", payload={"summary": "s", "first_kept": "u1"}, entry_id="c1")
    # A rewrite: the generation rotates and the path is re-appended under new ids.
    store.rewrite_entries(SRC, sid, [{"entry_id": "a3", "message": assistant("rewritten \U0001f680")}])
    store.append(SRC, sid, user("after the rewrite"), entry_id="u2")


def jsonl(header: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """The export as the CLI writes it."""
    return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"
                   for r in [header, *records])


def from_jsonl(text_: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The export as the CLI reads it."""
    lines = [json.loads(line) for line in text_.split("\n") if line.strip()]
    return lines[0], lines[1:]


def snapshot(store: TranscriptStore) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, for "nothing changed"."""
    def run(conn: Any) -> dict[str, list[tuple[Any, ...]]]:
        names = sorted(inspect(conn).get_table_names())
        return {n: sorted((tuple(r) for r in conn.execute(text(f'SELECT * FROM "{n}"'))), key=repr) for n in names}

    return store.db.read(run)


def refused_cleanly(store: TranscriptStore, header: Any, records: Any, words: str,
                    error: type[Exception] = InvalidInput, **kwargs: Any) -> None:
    """The import raises ``error`` naming ``words``, and not one row of the store changed."""
    before = snapshot(store)
    with pytest.raises(error, match=words):
        store.import_session(DST, header, records, **kwargs)
    assert snapshot(store) == before
    assert store.list_sessions(DST) == []


def edit(records: list[dict[str, Any]], target: str, /, **changes: Any) -> list[dict[str, Any]]:
    return [{**r, **changes} if r["entry_id"] == target else r for r in records]


# ---------------------------------------------------------------------------------------------- round trip


def test_round_trip_through_the_jsonl_text_is_exact(store: TranscriptStore) -> None:
    """Entries, off-branch entries, head, generations, keys, microsecond times and JSON texts (1, 1.0 and
    true stay three texts) survive export -> JSONL -> import into another scope -> export."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    assert header["generation"] == 1 and header["head_entry_id"] == "u2"
    first = jsonl(header, records)
    kept = copy.deepcopy((header, records))
    info = store.import_session(DST, *from_jsonl(first))
    assert (header, records) == kept  # the import never edits what it is given

    again_header, again_records = store.export_session(DST, "s1")
    assert again_records == records
    assert {**again_header, "scope": SRC} == header
    # Byte for byte, but for the scope: the JSON texts of the numbers are the same texts.
    assert jsonl({**again_header, "scope": SRC}, again_records) == first
    assert '"numbers":{"int":1,"float":1.0,"bool":true,"neg_zero":-0.0,"big":1000000000000000000000000000000,' in first

    src_info, dst_info = store.get_session(SRC, "s1"), store.get_session(DST, "s1")
    assert info == dst_info
    same = ("session_id", "session_key", "generation", "head_entry_id", "entry_count", "visible_count", "active",
            "created_at", "updated_at")
    assert {k: getattr(dst_info, k) for k in same} == {k: getattr(src_info, k) for k in same}
    assert dst_info.incarnation != src_info.incarnation  # another session for cursors
    # Every entry (off-branch ones too, with their active flags) and the visible transcript, as Entry objects
    # (whose == takes 1 for 1.0: the JSON texts above are the check of the numbers' kinds).
    assert store.list_entries(DST, "s1") == store.list_entries(SRC, "s1")
    assert store.read_visible(DST, "s1") == store.read_visible(SRC, "s1")
    assert any(not e.active for e in store.list_entries(DST, "s1"))
    numbers = next(e for e in store.list_entries(DST, "s1") if e.entry_id == "u1").message["numbers"]  # type: ignore[index]
    assert [type(numbers[k]) for k in ("int", "float", "bool")] == [int, float, bool]
    assert str(numbers["neg_zero"]) == "-0.0" and numbers["wide"] == 2**53 + 1


def test_a_round_trip_keeps_times_to_the_microsecond_and_any_utc_offset(store: TranscriptStore) -> None:
    build(store)
    header, records = store.export_session(SRC, "s1")
    records = edit(records, "sys", created_at="1970-01-01T00:00:00+00:00")
    records = edit(records, "u1", created_at="2024-02-29T23:59:59.000001Z")
    records = edit(records, "a1", created_at="2024-03-01T05:30:00.000001+05:30")  # = 2024-03-01T00:00:00.000001Z
    records = edit(records, "t1", created_at="2242-03-16T12:56:31.999999+00:00")
    records = edit(records, "ev1", created_at="9999-12-31T23:59:59+00:00")  # whole seconds read back exactly
    header = {**header, "created_at": "2000-01-01T00:00:00.999999-00:00"}
    store.import_session(DST, header, records)
    times = {e.entry_id: e.created_at.isoformat() for e in store.list_entries(DST, "s1")}
    assert times["sys"] == "1970-01-01T00:00:00+00:00"
    assert times["u1"] == "2024-02-29T23:59:59.000001+00:00"
    assert times["a1"] == "2024-03-01T00:00:00.000001+00:00"
    assert times["t1"] == "2242-03-16T12:56:31.999999+00:00"
    assert times["ev1"] == "9999-12-31T23:59:59+00:00"
    assert store.get_session(DST, "s1").created_at.isoformat() == "2000-01-01T00:00:00.999999+00:00"
    out = {r["entry_id"]: r["created_at"] for r in store.export_session(DST, "s1")[1]}
    assert out["a1"] == "2024-03-01T00:00:00.000001+00:00" and out["t1"] == "2242-03-16T12:56:31.999999+00:00"


def test_the_imported_session_works_on_like_the_original(store: TranscriptStore) -> None:
    """Appends continue at the head and the dense seq, the turn id and idempotency key replay, a branch to
    an off-branch entry and a rewrite work, and the generation rotates from the imported one."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    store.import_session(DST, header, records)
    replay = store.admit(DST, "s1", user("q1", numbers=NUMBERS), turn_id="turn-1")
    assert replay.anchor.entry_id == "u1"
    with pytest.raises(IdempotencyConflict):
        store.admit(DST, "s1", user("q1, other"), turn_id="turn-1")
    keyed = store.append(DST, "s1", {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r"}]},
                         idempotency_key="idem-1")
    assert keyed.entry_id == "t1"
    new = store.append(DST, "s1", user("next"))
    assert new.seq == len(records) and new.parent_id == header["head_entry_id"]
    assert new.position == header["visible_count"] and new.generation == header["generation"]
    store.branch(DST, "s1", "a2")
    assert [e.entry_id for e in store.read_visible(DST, "s1")][-1] == "a2"
    result = store.rewrite_entries(DST, "s1", [{"entry_id": "a2", "message": assistant("again")}])
    assert result.changed and result.generation == header["generation"] + 1
    assert store.get_session(SRC, "s1").generation == header["generation"]


# ---------------------------------------------------------------------------------------------- existing sessions


def test_an_import_over_an_existing_session_is_refused_and_changes_nothing(store: TranscriptStore) -> None:
    build(store)
    header, records = store.export_session(SRC, "s1")
    store.append(SRC, "s1", user("written after the export"))
    before = snapshot(store)
    with pytest.raises(IdempotencyConflict, match="already exists"):
        store.import_session(SRC, header, records)  # over its own source
    with pytest.raises(SessionKeyConflict):
        store.import_session(SRC, header, records, session_id="s1-copy")  # the key is the source's
    assert snapshot(store) == before
    store.import_session(DST, header, records)
    with pytest.raises(IdempotencyConflict):
        store.import_session(DST, header, records)  # the same file twice
    # The key is free again once the session holding it ended: a copy may take it.
    store.end_session(SRC, "s1")
    copy_info = store.import_session(SRC, header, records, session_id="s1-copy")
    assert copy_info.session_key == header["session_key"] and copy_info.entry_count == len(records)
    # An ended session's export is imported ended, and never conflicts on its key.
    ended_header, ended_records = store.export_session(SRC, "s1")
    assert ended_header["active"] is False
    info = store.import_session(SRC, ended_header, ended_records, session_id="s1-ended")
    assert info.active is False and info.session_key == header["session_key"]


# ---------------------------------------------------------------------------------------------- refusals


def test_malformed_trees_and_records_are_refused_and_change_nothing(store: TranscriptStore) -> None:
    build(store)
    header, records = store.export_session(SRC, "s1")
    by_id = {r["entry_id"]: r for r in records}
    first, second = records[0]["entry_id"], records[1]["entry_id"]
    cases: list[tuple[Any, Any, str, type[Exception]]] = [
        # Trees: a cycle, a self-parent, a parent that comes later, records out of order or repeated.
        (header, edit(edit(records, first, parent_id=second), second, parent_id=first), "not an earlier entry",
         InvalidInput),
        (header, edit(records, first, parent_id=first), "not an earlier entry", InvalidInput),
        (header, [records[1], records[0], *records[2:]], "seq", InvalidInput),
        (header, [*records[:3], records[2], *records[4:]], "seq", InvalidInput),
        (header, [*records[:-1], {**records[-1], "seq": len(records) - 2}], "seq", InvalidInput),
        (header, edit(records, "a1", parent_id="ghost"), "not an earlier entry", InvalidInput),
        # The head: on an off-branch entry with the old path's flags, on a missing entry, on none.
        ({**header, "head_entry_id": "a2"}, records, "path to the head", InvalidInput),
        ({**header, "head_entry_id": "a2\u0000"}, records, "head_entry_id", InvalidInput),
        ({**header, "head_entry_id": None}, records, "path to the head", InvalidInput),
        (header, edit(records, "a2", active=True), "path to the head", InvalidInput),
        (header, edit(records, "a2", active=1), "active", InvalidInput),
        # Truncated: a record missing, a record cut short, an empty list.
        (header, records[:-1], "entries", InvalidInput),
        (header, [*records[:-1], {k: v for k, v in records[-1].items() if k in ("entry_id", "parent_id")}],
         "Field required", InvalidInput),
        (header, [], "entries", InvalidInput),
        # Not objects, not lists.
        (header, [*records[:-1], json.dumps(records[-1])], "JSON object", InvalidInput),
        (header, [*records[:-1], None], "JSON object", InvalidInput),
        (header, [*records[:-1], [records[-1]]], "JSON object", InvalidInput),
        (header, jsonl(header, records), "list", InvalidInput),
        (header, {"0": records[0]}, "list", InvalidInput),
        (header, None, "list", InvalidInput),
        (header, iter(records), "list", InvalidInput),
        ([header], records, "header", InvalidInput),
        (None, records, "header", InvalidInput),
        (json.dumps(header), records, "header", InvalidInput),
        # Wrong types that lax parsing would take: bools and floats for integers, numbers for texts.
        (header, edit(records, "a1", seq=True), "seq", InvalidInput),
        (header, edit(records, "a1", seq=float(by_id["a1"]["seq"])), "seq", InvalidInput),
        ({**header, "entry_count": str(len(records))}, records, "entry_count", InvalidInput),
        (header, edit(records, "a1", entry_id=5), "entry_id", InvalidInput),
        (header, edit(records, "a1", position=-1), "position", InvalidInput),
        ({**header, "generation": -1}, records, "generation", InvalidInput),
        # Payloads: a message where a payload belongs and back, NUL and lone surrogates, nesting.
        (header, edit(records, "ev1", message={"role": "user", "content": "x"}, payload=None), "payload",
         InvalidInput),
        (header, edit(records, "sys", payload={"x": 1}), "payload", InvalidInput),
        (header, edit(records, "sys", message={"role": "system", "content": "\ud800"}), "surrogate", InvalidInput),
        (header, edit(records, "ev1", payload={"\udfff": 1}), "surrogate", InvalidInput),
        (header, edit(records, "ev1", payload={"n": float("nan")}), "non-finite", InvalidInput),
        (header, edit(records, "ev1", payload={"deep": _nested(65)}), "deeper than 64", InvalidInput),
        (header, edit(records, "ev1", payload={"deep": _nested(100_000)}), "deeper than 64", InvalidInput),
        (header, edit(records, "sys", message={"role": "system"}), "content", InvalidMessage),
        # Ids: NUL, lone surrogates, control characters, empty.
        (header, edit(records, "sys", entry_id="sys\u0000"), "entry_id", InvalidInput),
        (header, edit(records, "sys", entry_id="\ud800"), "entry_id", InvalidInput),
        (header, edit(records, "a1", parent_id="u1\u0000"), "parent", InvalidInput),
        (header, edit(records, "t1", idempotency_key="idem\u0000"), "idempotency_key", InvalidInput),
        (header, edit(records, "u1", turn_id="turn\u0085"), "turn_id", InvalidInput),
        (header, edit(records, "u1", turn_id=""), "turn_id", InvalidInput),
        ({**header, "session_id": "s\u0000"}, records, "session_id", InvalidInput),
    ]
    for h, rs, words, error in cases:
        with pytest.raises(error, match=words):
            store.import_session(DST, h, rs)
    assert store.list_sessions(DST) == []
    # One snapshot check over all of them (a snapshot per case would be most of the test's time).
    refused_cleanly(store, header, edit(records, "a1", parent_id="ghost"), "not an earlier entry")
    # 64 levels below the payload object is the deepest accepted, and it round-trips.
    deep = edit(records, "ev1", payload={"deep": _nested(64)})
    (edited,) = (r for r in deep if r["entry_id"] == "ev1")
    del edited["size_bytes"]  # edited by hand: the size is computed (a stale one is refused)
    store.import_session(DST, header, deep)
    out = store.export_session(DST, "s1")[1]
    assert [r for r in out if r["entry_id"] != "ev1"] == [r for r in deep if r["entry_id"] != "ev1"]
    (back,) = (r for r in out if r["entry_id"] == "ev1")
    assert back == {**edited, "size_bytes": len(json.dumps(edited["payload"], separators=(",", ":")))}


def _nested(levels: int) -> Any:
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_times_that_are_no_iso_text_are_refused(store: TranscriptStore) -> None:
    """Numbers were guessed to be Unix seconds or milliseconds, and a seventh fractional digit was cut
    off: only an ISO 8601 text with at most microseconds is a time."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    bad = [
        1_700_000_000_000,  # taken for milliseconds
        1_700_000_000,  # taken for seconds
        1.5,
        "1700000000",  # a numeric text, taken for seconds too
        "2024-01-01T00:00:00.1234567+00:00",  # seven digits: the seventh was dropped
        b"2024-01-01T00:00:00+00:00",
        True,
    ]
    for value in bad:
        refused_cleanly(store, header, edit(records, "a1", created_at=value), "created_at")
    for name in ("created_at", "updated_at"):
        refused_cleanly(store, {**header, name: 1_700_000_000}, records, name)
    # The source session is readable, the store holds nothing new.
    assert len(store.list_entries(SRC, "s1")) == len(records)


def test_far_future_times_read_back_exactly(store: TranscriptStore) -> None:
    """Reads made a datetime through floating-point seconds: a time after about 2242 came back a
    microsecond off, and the last microsecond of 9999 made every read of the session raise ValueError
    (as the session's own time, the import itself failed with a bare ValueError)."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    late = "3000-01-01T00:00:00.000001+00:00"
    last = "9999-12-31T23:59:59.999999+00:00"
    moved = edit(edit(records, "a1", created_at=late), "u2", created_at=last)
    store.import_session(DST, {**header, "created_at": late, "updated_at": last}, moved)
    by_id = {e.entry_id: e for e in store.list_entries(DST, "s1")}
    assert by_id["a1"].created_at == datetime.fromisoformat(late)
    assert by_id["u2"].created_at == datetime.fromisoformat(last)
    info = store.get_session(DST, "s1")
    assert info is not None and info.created_at == datetime.fromisoformat(late)
    assert info.updated_at == datetime.fromisoformat(last)
    _header, again = store.export_session(DST, "s1")
    assert [r["created_at"] for r in again] == [r["created_at"] for r in moved]


def test_a_turn_id_only_on_a_user_message(store: TranscriptStore) -> None:
    """The store gives a logical turn id only to an admitted user message (admit, or a commit binding an
    admission). Imported on an assistant message or an event it was accepted before, and the turn id was
    then unusable: every admission of it raised IdempotencyConflict."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    for entry_id in ("a1", "sys", "ev1", "md1"):
        refused_cleanly(store, header, edit(records, entry_id, turn_id="turn-x"), "turn_id")
    # Moved from its user message to another user message: accepted (an append-then-commit binds so).
    moved = edit(edit(records, "u1", turn_id=None), "u2", turn_id="turn-1")
    store.import_session(DST, header, moved)
    assert store.admit(DST, "s1", user("after the rewrite"), turn_id="turn-1").anchor.entry_id == "u2"


def test_the_headers_own_ids_are_checked(store: TranscriptStore) -> None:
    """The header's scope, session id and key were taken unchecked when not used (the scope never is; the
    id and key are not when the import names new ones): NUL, lone surrogates and empty texts passed."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    for value in ("", "src\u0000", "\ud800", "a\x1bb"):
        refused_cleanly(store, {**header, "scope": value}, records, "scope", session_id="new", session_key="k:new")
        refused_cleanly(store, {**header, "session_id": value}, records, "session_id", session_id="new",
                        session_key="k:new")
        refused_cleanly(store, {**header, "session_key": value}, records, "session_key", session_id="new",
                        session_key="k:new")
    refused_cleanly(store, {**header, "scope": 5}, records, "scope", session_id="new", session_key="k:new")
    # From another scope, under new ids: fine.
    info = store.import_session(DST, header, records, session_id="new", session_key="k:new")
    assert (info.scope, info.session_id, info.session_key) == (DST, "new", "k:new")


# ---------------------------------------------------------------------------------------------- size


def test_a_large_branched_import_round_trips(store: TranscriptStore) -> None:
    """3,000 entries on a deep chain with a side branch every 100 entries: one transaction, exact."""
    store.create_session(SRC, session_id="big")
    for block in range(30):
        items = [{"message": (user if i % 2 == 0 else assistant)(f"m{block}.{i} \U0001f600"),
                  "entry_id": f"e{block}.{i}"} for i in range(99)]
        store.append_many(SRC, "big", items)
        store.append(SRC, "big", assistant(f"side {block}"), entry_id=f"side{block}")
        store.branch(SRC, "big", f"e{block}.98")
    header, records = store.export_session(SRC, "big")
    assert header["entry_count"] == 3000 and sum(not r["active"] for r in records) == 30
    store.import_session(DST, *from_jsonl(jsonl(header, records)))
    assert store.export_session(DST, "big")[1] == records
    assert store.read_visible(DST, "big") == store.read_visible(SRC, "big")
