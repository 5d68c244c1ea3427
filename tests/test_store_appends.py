"""Appends and admissions: dense seq, stable ids, the parent chain, idempotency, lossless payloads."""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event

from transcript_store import (
    Admission,
    AppendItem,
    IdempotencyConflict,
    InvalidMessage,
    TranscriptStore,
    UnknownEntry,
)

A = "scope-a"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(A, session_id="s1", session_key="agent:main:test:1").session_id


def test_generated_ids_are_22_letters_and_digits_with_128_random_bits(store: TranscriptStore) -> None:
    # Shorter than a UUID's hex (each id is stored in its row, a parent pointer, an index and a
    # receipt), never starting with "-" (a CLI would take it for an option), never repeating.
    sessions = [store.create_session(A).session_id for _ in range(20)]
    entries = [store.append(A, sessions[0], user(f"m{i}")).entry_id for i in range(20)]
    ids = sessions + entries
    assert all(re.fullmatch(r"[0-9A-Za-z]{22}", i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    # Every character position varies, the most significant (last) one too: 2**128 / 62**21 is 7.8, so
    # it takes "0" to "7", and 40 ids leave it constant by chance with a probability below 1e-30.
    assert all(len({i[k] for i in ids}) > 1 for k in range(22))


def test_appends_get_dense_seq_stable_ids_and_a_parent_chain(store: TranscriptStore, sid: str) -> None:
    made = [
        store.append(A, sid, {"role": "system", "content": "be brief"}),
        store.append(A, sid, user("hello")),
        store.append(A, sid, kind="custom", payload={"tool": "clock"}),
        store.append(A, sid, assistant("hi")),
        store.append(A, sid, kind="compaction", payload={"summary": "..."}),
        store.append(A, sid, user("bye")),
    ]
    assert [e.seq for e in made] == list(range(6))
    assert [e.parent_id for e in made] == [None] + [e.entry_id for e in made[:-1]]
    assert len({e.entry_id for e in made}) == 6
    assert [e.position for e in made] == [0, 1, None, 2, None, 3]
    assert all(e.active and e.generation == 0 for e in made)
    stored = store.list_entries(A, sid)
    assert [(e.entry_id, e.seq, e.parent_id, e.position) for e in stored] == [
        (e.entry_id, e.seq, e.parent_id, e.position) for e in made
    ]
    assert store.get_entries(A, sid, [made[3].entry_id]) == [made[3]]
    info = store.get_session(A, sid)
    assert (info.entry_count, info.visible_count, info.head_entry_id, info.generation) == (
        6, 4, made[-1].entry_id, 0,
    )
    # created_at: UTC, in append order, the same when read back.
    assert all(e.created_at.utcoffset() == timedelta(0) for e in made)
    assert [e.created_at for e in made] == sorted(e.created_at for e in made)
    assert store.get_entries(A, sid, [made[1].entry_id])[0].created_at == made[1].created_at


def test_a_caller_given_entry_id_is_kept(store: TranscriptStore, sid: str) -> None:
    e = store.append(A, sid, user("x"), entry_id="msg-0001")
    assert e.entry_id == "msg-0001"
    assert store.get_entries(A, sid, ["msg-0001"])[0].message == user("x")
    # The same id with the same content is the same entry; with other content it is a conflict.
    assert store.append(A, sid, user("x"), entry_id="msg-0001") == e
    with pytest.raises(IdempotencyConflict):
        store.append(A, sid, user("y"), entry_id="msg-0001")
    # An entry id and an idempotency key that name two different entries conflict.
    store.append(A, sid, user("x"), idempotency_key="key-2")
    with pytest.raises(IdempotencyConflict):
        store.append(A, sid, user("x"), entry_id="msg-0001", idempotency_key="key-2")
    assert len(store.list_entries(A, sid)) == 2


def test_an_idempotency_key_returns_the_stored_entry_never_a_second_copy(store: TranscriptStore, sid: str) -> None:
    first = store.append(A, sid, assistant("answer"), idempotency_key="reply-1")
    store.append(A, sid, user("later"))
    again = store.append(A, sid, assistant("answer"), idempotency_key="reply-1")
    assert again == first
    assert again.seq == 0
    assert len(store.list_entries(A, sid)) == 2
    assert [e.idempotency_key for e in store.read_visible(A, sid)] == ["reply-1", None]
    # The same content with its keys in another order is the same content.
    meta = store.append(A, sid, {"role": "user", "content": "x", "meta": {"a": 1, "b": 2}}, idempotency_key="k")
    same = store.append(A, sid, {"meta": {"b": 2, "a": 1}, "content": "x", "role": "user"}, idempotency_key="k")
    assert same.entry_id == meta.entry_id
    # Keys belong to their session.
    store.create_session(A, session_id="s2")
    elsewhere = store.append(A, "s2", user("two"), idempotency_key="reply-1")
    assert elsewhere.entry_id != first.entry_id and elsewhere.message == user("two")
    assert len(store.list_entries(A, sid)) == 3


def test_an_idempotency_key_retried_under_a_fresh_entry_id_returns_the_stored_entry(
    store: TranscriptStore, sid: str
) -> None:
    """The key is the request's identity, as a turn id is an admission's: a retry that drew a new entry id
    for the same content lands on the first entry; an entry id that names another entry conflicts."""
    first = store.append(A, sid, assistant("answer"), entry_id="attempt-1", idempotency_key="reply-1")
    assert store.append(A, sid, assistant("answer"), entry_id="attempt-2", idempotency_key="reply-1") == first
    assert store.get_entries(A, sid, ["attempt-1"])[0] == first
    with pytest.raises(UnknownEntry):
        store.get_entries(A, sid, ["attempt-2"])
    other = store.append(A, sid, user("later"), entry_id="other")
    with pytest.raises(IdempotencyConflict):
        store.append(A, sid, assistant("answer"), entry_id=other.entry_id, idempotency_key="reply-1")
    assert len(store.list_entries(A, sid)) == 2


def test_an_idempotency_key_with_other_content_conflicts(store: TranscriptStore, sid: str) -> None:
    store.append(A, sid, assistant("answer"), idempotency_key="reply-1")
    for retry in (
        {"message": assistant("another answer")},
        {"message": user("answer")},
        {"message": {"role": "assistant", "content": "answer", "extra": 1}},
        {"kind": "custom", "payload": {"role": "assistant", "content": "answer"}},
    ):
        with pytest.raises(IdempotencyConflict):
            store.append(A, sid, idempotency_key="reply-1", **retry)
    assert len(store.list_entries(A, sid)) == 1


def test_a_retry_equal_in_python_but_not_as_json_is_other_content(store: TranscriptStore, sid: str) -> None:
    """1, 1.0 and True are one value to ``==``; stored, they are three texts: a retry under the key with
    another of them is other content, not the stored entry."""
    stored = store.append(A, sid, {"role": "user", "content": "x", "n": 1, "z": 0.0}, idempotency_key="k")
    admitted = store.admit(A, sid, {"role": "user", "content": "q", "ok": True}, turn_id="t1")
    for n, z in ((1.0, 0.0), (True, 0.0), (1, -0.0), (1, 0)):
        with pytest.raises(IdempotencyConflict):
            store.append(A, sid, {"role": "user", "content": "x", "n": n, "z": z}, idempotency_key="k")
    with pytest.raises(IdempotencyConflict):
        store.admit(A, sid, {"role": "user", "content": "q", "ok": 1}, turn_id="t1")
    assert store.append(A, sid, {"z": 0.0, "n": 1, "content": "x", "role": "user"}, idempotency_key="k") == stored
    assert store.admit(A, sid, {"role": "user", "content": "q", "ok": True}, turn_id="t1") == admitted
    assert len(store.list_entries(A, sid)) == 2


def test_append_many_is_one_chain_in_one_transaction(store: TranscriptStore, sid: str) -> None:
    store.append(A, sid, user("before"))
    made = store.append_many(
        A, sid,
        [
            AppendItem(message=assistant("a")),
            {"kind": "metadata", "payload": {"usage": {"tokens": 3}}},
            {"message": user("b"), "idempotency_key": "b"},
        ],
    )
    assert [e.seq for e in made] == [1, 2, 3]
    assert made[0].parent_id == store.list_entries(A, sid)[0].entry_id
    assert [e.parent_id for e in made[1:]] == [made[0].entry_id, made[1].entry_id]
    # A retry of a keyed item inside a batch returns the stored one and appends only the rest.
    retry = store.append_many(A, sid, [{"message": user("b"), "idempotency_key": "b"}, {"message": user("c")}])
    assert retry[0] == made[2]
    assert retry[1].seq == 4 and retry[1].parent_id == made[2].entry_id


def test_an_appends_writes_are_one_statement_on_postgresql_and_long_ones_the_same(
    store: TranscriptStore, sid: str
) -> None:
    """On PostgreSQL the entries, their active-path rows and the new head go in one statement (one
    round trip); an append longer than that statement takes (a bulk load) writes them in three. Both
    leave the same chain, positions, head and counts; a delta page reads them back."""
    executed: list[str] = []

    def listen(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        executed.append(statement.split()[0])

    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        short = store.append_many(A, sid, [{"message": user("q")}, {"kind": "custom", "payload": {"i": 1}},
                                            {"message": assistant("a \x00 \u00e9")}])
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    writes = [s for s in executed if s != "SELECT"]
    assert writes == (["WITH"] if store.backend == "postgresql" else ["INSERT", "INSERT", "UPDATE"])
    # One read: the session's lock, which also tells that none of the items is stored yet.
    assert executed.count("SELECT") == 1
    long = store.append_many(A, sid, [{"message": user(f"m{i}")} for i in range(40)])
    made = short + long
    assert [e.seq for e in made] == list(range(43))
    assert [e.parent_id for e in made[1:]] == [e.entry_id for e in made[:-1]]
    assert [e.position for e in made[:4]] == [0, None, 1, 2] and made[-1].position == 41
    assert store.list_entries(A, sid) == made
    info = store.get_session(A, sid)
    assert (info.head_entry_id, info.visible_count) == (made[-1].entry_id, 42)
    page = store.read_visible_delta(A, sid, None, max_messages=100)
    assert [e.entry_id for e in page.entries] == [e.entry_id for e in made if e.kind == "message"]


def test_an_admission_that_waited_for_the_lock_finds_the_entry_written_meanwhile(
    store: TranscriptStore, sid: str
) -> None:
    """An append asks "is any item stored already?" in the statement that locks the session. On
    PostgreSQL a lock that waited for another writer returns the session as that writer left it, but
    the question was answered in the statement's earlier snapshot: the append notices (the session's
    last_seq moved) and looks again, so a turn admitted meanwhile by the other writer comes back as
    the stored entry, not as a duplicate-key error."""
    written = threading.Event()
    release = threading.Event()

    def first_writer(c: Any) -> Any:
        appended = c.append(A, sid, [store.prepare_admission(user("q"), turn_id="t1")])
        written.set()
        assert release.wait(10)
        return appended[0]

    results: dict[str, Any] = {}
    holder = threading.Thread(target=lambda: results.setdefault("first", store.write(first_writer)))
    holder.start()
    assert written.wait(10)
    waiter = threading.Thread(
        target=lambda: results.setdefault("second", store.admit(A, sid, user("q"), turn_id="t1"))
    )
    waiter.start()
    time.sleep(0.5)  # the admission is now waiting for the session's lock (SQLite: the write lock)
    assert waiter.is_alive()
    release.set()
    holder.join(10)
    waiter.join(10)
    assert results["second"].anchor.entry_id == results["first"].entry_id
    assert [e.entry_id for e in store.list_entries(A, sid)] == [results["first"].entry_id]


def test_an_appends_lock_finds_the_head_and_the_stored_items_by_index_at_any_length(
    store: TranscriptStore, sid: str
) -> None:
    """The statement that locks the session for an append also reads its head entry and probes for
    stored items; each is an index lookup, whatever the session's length. On a never-analyzed
    PostgreSQL the first version (a plain join on the head's seq) had the planner read every entry of
    the session and filter them (2,999 rows at 3,000 entries)."""
    store.append_many(A, sid, [{"message": user(f"m{i}")} for i in range(2000)])
    captured: list[tuple[str, Any]] = []

    def listen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        captured.append((statement, parameters))

    items = store.prepare([{"message": assistant("a")}, {"message": assistant("b")}])
    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        store.write(lambda c: c.append_to_session(A, sid, items, with_head=True))
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    sql, params = captured[0]
    assert "FROM ts_sessions" in sql and " AS known" in sql
    with store.db.engine.connect() as conn:
        if store.backend == "sqlite":
            details = [str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]
            assert details and not [d for d in details if d.startswith("SCAN ")], details
        else:
            # Probed for ids that are not stored (the common case, and the one that walks furthest).
            params = {k: f"absent-{k}" if k.startswith("b_known") else v for k, v in params.items()}
            plan = "\n".join(str(r[0]) for r in conn.exec_driver_sql("EXPLAIN ANALYZE " + sql, params))
            removed = [int(n) for n in re.findall(r"Rows Removed by (?:Join )?Filter: (\d+)", plan)]
            assert max(removed, default=0) <= 1, plan
        conn.rollback()


def test_append_many_with_one_bad_item_writes_nothing(store: TranscriptStore, sid: str) -> None:
    store.append(A, sid, user("before"))
    with pytest.raises(InvalidMessage):
        store.append_many(A, sid, [{"message": user("ok")}, {"message": {"role": "user"}}])
    with pytest.raises(IdempotencyConflict):
        store.append_many(A, sid, [{"message": user("x"), "entry_id": "e"}, {"message": user("y"), "entry_id": "e"}])
    with pytest.raises(IdempotencyConflict):
        store.append_many(A, sid, [{"message": user("fine")}, {"message": user("before"), "entry_id": "dup"},
                                   {"message": assistant("other"), "entry_id": "dup"}])
    assert [e.message for e in store.list_entries(A, sid)] == [user("before")]


def test_an_idempotency_key_twice_in_one_append_conflicts_and_writes_nothing(
    store: TranscriptStore, sid: str
) -> None:
    """As an entry id twice: the second row's insert hit the key's unique index, a StoreUnavailable
    (a database error) for what is the caller's input."""
    store.append(A, sid, user("before"))
    for second in (user("x"), user("y")):
        with pytest.raises(IdempotencyConflict, match="appears twice"):
            store.append_many(A, sid, [{"message": user("x"), "idempotency_key": "k"},
                                       {"message": second, "idempotency_key": "k"}])
    # A key already stored answers each of its items with the stored entry, as a retry does.
    stored = store.append(A, sid, user("x"), idempotency_key="k")
    again = store.append_many(A, sid, [{"message": user("x"), "idempotency_key": "k"}] * 2)
    assert again == [stored, stored]
    assert [e.message for e in store.list_entries(A, sid)] == [user("before"), user("x")]


def test_every_chat_message_shape_round_trips_with_unknown_keys(store: TranscriptStore, sid: str) -> None:
    shapes: list[dict[str, Any]] = [
        {"role": "system", "content": "rules", "x_origin": "config"},
        {"role": "developer", "content": "dev"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look", "x_part_extra": [1, 2]},
                {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}},
            ],
            "name": "ana",
            "metadata": {"nested": {"deep": [None, True, 1.5, "s", 2**80, -0.25, 1e300]}},
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}, "x_tc": 7}
            ],
            "reasoning_content": "hmm",
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42", "x_latency_ms": 12},
        {"role": "function", "name": "legacy", "content": "old style"},
        {"role": "assistant", "content": "done", "refusal": None, "annotations": []},
    ]
    made = [store.append(A, sid, m) for m in shapes]
    assert [e.message for e in made] == shapes
    assert [e.message for e in store.read_visible(A, sid)] == shapes
    assert [e.role for e in store.read_visible(A, sid)] == [m["role"] for m in shapes]
    page = store.read_visible_delta(A, sid)
    assert page.kind == "page" and [e.message for e in page.entries] == shapes


def test_non_message_events_are_stored_but_not_visible(store: TranscriptStore, sid: str) -> None:
    m1 = store.append(A, sid, user("one"))
    events = [
        store.append(A, sid, kind="custom", payload={"type": "tool-progress", "pct": 50}),
        store.append(A, sid, kind="metadata", payload={"model": "x"}),
        store.append(A, sid, kind="compaction", payload={"summary": "s", "first_kept": m1.entry_id}),
        store.append(A, sid, kind="custom"),
    ]
    m2 = store.append(A, sid, assistant("two"))
    assert [e.entry_id for e in store.read_visible(A, sid)] == [m1.entry_id, m2.entry_id]
    assert m2.position == 1 and m2.parent_id == events[-1].entry_id
    for e in events:
        assert (e.position, e.message, e.role) == (None, None, None)
    assert [e.payload for e in events] == [
        {"type": "tool-progress", "pct": 50}, {"model": "x"}, {"summary": "s", "first_kept": m1.entry_id}, {},
    ]
    stored = store.list_entries(A, sid)
    assert [e.kind for e in stored] == ["message", "custom", "metadata", "compaction", "custom", "message"]
    assert store.get_entries(A, sid, [events[0].entry_id])[0].payload == {"type": "tool-progress", "pct": 50}
    assert store.get_session(A, sid).visible_count == 2


NUL_MESSAGE: dict[str, Any] = {
    "role": "user",
    "content": "before\x00after \x00\x00 end",
    "x\x00key": ["\x00", {"\x00": "\x00"}],
}


def test_nul_bytes_round_trip_losslessly(store: TranscriptStore, sid: str) -> None:
    """Documented decision: U+0000 is kept, escaped as \\u0000 in the stored JSON text."""
    made = store.append(A, sid, NUL_MESSAGE, idempotency_key="nul")
    event = store.append(A, sid, kind="custom", payload={"blob": "a\x00b", "\x00": 0})
    assert made.message == NUL_MESSAGE
    assert store.get_entries(A, sid, [made.entry_id])[0].message == NUL_MESSAGE
    assert store.get_entries(A, sid, [event.entry_id])[0].payload == {"blob": "a\x00b", "\x00": 0}
    assert store.read_visible(A, sid)[0].message == NUL_MESSAGE
    page = store.read_visible_delta(A, sid)
    assert page.kind == "page" and page.entries[0].message == NUL_MESSAGE
    # The idempotent retry recognises the same content.
    assert store.append(A, sid, dict(NUL_MESSAGE), idempotency_key="nul").entry_id == made.entry_id
    with pytest.raises(IdempotencyConflict):
        store.append(A, sid, {**NUL_MESSAGE, "content": "before after"}, idempotency_key="nul")
    assert made.size_bytes == len(json.dumps(NUL_MESSAGE, ensure_ascii=False, separators=(",", ":")).encode())
    # Any other Unicode, too; sizes count UTF-8 bytes.
    text = "héllo 🙂 مرحبا 你好 \u200d\u2028\ufeff \U0010fffd"
    wide = store.append(A, sid, user(text))
    assert store.get_entries(A, sid, [wide.entry_id])[0].message == user(text)
    assert wide.size_bytes == len(json.dumps(user(text), ensure_ascii=False, separators=(",", ":")).encode())


# ---------------------------------------------------------------------------------------------- admissions


def test_admit_appends_the_user_message_and_returns_its_anchor(store: TranscriptStore, sid: str) -> None:
    earlier = store.append(A, sid, user("earlier"))
    store.append(A, sid, kind="metadata", payload={})
    adm = store.admit(A, sid, user("question"), turn_id="turn-1")
    assert isinstance(adm, Admission)
    assert adm.turn_id == "turn-1"
    a = adm.anchor
    assert (a.scope, a.session_id, a.session_key, a.generation) == (A, sid, "agent:main:test:1", 0)
    assert (a.seq, a.position) == (2, 1)
    assert a.parent_id == store.list_entries(A, sid)[1].entry_id
    assert adm.fence == a
    entry = store.get_entries(A, sid, [a.entry_id])[0]
    assert (entry.turn_id, entry.role, entry.message) == ("turn-1", "user", user("question"))
    assert store.anchor(A, sid, a.entry_id) == a
    assert earlier.turn_id is None
    # Turn ids are per session, and apart from idempotency keys.
    store.create_session(A, session_id="s2")
    assert store.admit(A, "s2", user("question"), turn_id="turn-1").anchor.session_id == "s2"
    assert store.append(A, sid, user("question"), idempotency_key="turn-1").entry_id != a.entry_id


def test_re_admitting_the_same_turn_returns_the_identical_admission(store: TranscriptStore, sid: str) -> None:
    first = store.admit(A, sid, user("question"), turn_id="turn-1")
    store.append(A, sid, assistant("answer"))
    store.append(A, sid, user("next"))
    again = store.admit(A, sid, user("question"), turn_id="turn-1")
    assert again == first
    assert again.model_dump() == first.model_dump()
    assert len(store.list_entries(A, sid)) == 3
    # A retry that generated a fresh entry id for the same turn still lands on the first admission.
    assert store.admit(A, sid, user("question"), turn_id="turn-1", entry_id="fresh-id") == first
    assert len(store.list_entries(A, sid)) == 3


def test_re_admitting_a_turn_with_other_content_conflicts(store: TranscriptStore, sid: str) -> None:
    store.admit(A, sid, user("question"), turn_id="turn-1")
    with pytest.raises(IdempotencyConflict):
        store.admit(A, sid, user("another question"), turn_id="turn-1")
    assert len(store.list_entries(A, sid)) == 1


def test_an_admission_must_be_a_user_message(store: TranscriptStore, sid: str) -> None:
    for message in (
        assistant("not a user"),
        {"role": "system", "content": "s"},
        {"role": "tool", "tool_call_id": "c", "content": "x"},
        {"role": "user"},
        "hello",
    ):
        with pytest.raises(InvalidMessage):
            store.admit(A, sid, message, turn_id="turn-1")  # type: ignore[arg-type]
    assert store.list_entries(A, sid) == []


def test_a_mirror_compares_host_messages_as_json(store: TranscriptStore, sid: str) -> None:
    """A host message that equals the mirrored one only to ``==`` (1.0 for 1) is a change: the mirror
    branches there and holds the host's text."""
    from transcript_store.mirror import HostMessage, align

    first = [HostMessage(None, {"role": "user", "content": "x", "n": 1}), HostMessage(None, assistant("a"))]
    done = store.write(lambda c: align(c, store.config, A, sid, 0, first))
    assert (done.imported, done.matched, done.rewound) == (2, 0, False)
    again = store.write(lambda c: align(c, store.config, A, sid, 0, first))
    assert (again.imported, again.matched, again.rewound) == (0, 2, False)
    moved = [HostMessage(None, {"role": "user", "content": "x", "n": 1.0})]
    done = store.write(lambda c: align(c, store.config, A, sid, 0, moved))
    assert (done.imported, done.matched, done.rewound) == (1, 0, True)
    page = store.read_visible_delta(A, sid, None)
    assert [repr(e.message) for e in page.entries] == [repr(moved[0].message)]
