"""Invalid input is refused with a typed error before anything is written; odd but valid ids just work."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select

from transcript_store import (
    InvalidInput,
    InvalidMessage,
    PayloadTooLarge,
    StoreConfig,
    TranscriptStore,
    UnknownSession,
)
from transcript_store.ledger import commit_turn_in
from transcript_store.schema import active_path, entries, sessions
from transcript_store.turns import Turns

A = "scope-a"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def snapshot(store: TranscriptStore) -> list[list[tuple[Any, ...]]]:
    """Every stored row of the store's tables, in key order: the store's checksum."""
    with store.db.engine.connect() as conn:
        return [
            [tuple(r) for r in conn.execute(select(t).order_by(*t.primary_key.columns))]
            for t in (sessions, entries, active_path)
        ]


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    sid = store.create_session(A, session_id="s1", session_key="key-1").session_id
    store.append(A, sid, user("existing"), entry_id="E0", idempotency_key="k0")
    store.admit(A, sid, user("turn"), turn_id="T0")
    return sid


def refused(store: TranscriptStore, error: type[Exception], *calls: Callable[[], Any], case: str = "") -> None:
    """Each call raises ``error`` and leaves every stored row as it was."""
    before = snapshot(store)
    for i, call in enumerate(calls):
        with pytest.raises(error):
            call()
            pytest.fail(f"{case}: call #{i} was not refused")
        assert snapshot(store) == before, f"{case}: call #{i} wrote something"


# ---------------------------------------------------------------------------------------------- messages

BAD_MESSAGES: dict[str, Any] = {
    "not-a-dict": "hello",
    "a-list": [{"role": "user", "content": "x"}],
    "none": None,
    "no-role": {"content": "x"},
    "unknown-role": {"role": "robot", "content": "x"},
    "role-not-a-string": {"role": 1, "content": "x"},
    "user-without-content": {"role": "user"},
    "user-with-null-content": {"role": "user", "content": None},
    "content-a-number": {"role": "user", "content": 5},
    "user-with-tool-calls": {"role": "user", "content": "x", "tool_calls": []},
    "tool-without-tool-call-id": {"role": "tool", "content": "x"},
    "tool-with-empty-tool-call-id": {"role": "tool", "content": "x", "tool_call_id": ""},
    "assistant-with-nothing": {"role": "assistant"},
    "tool-call-without-function": {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]},
    "tool-call-without-id": {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]},
    "part-without-type": {"role": "user", "content": [{"text": "x"}]},
    "text-part-without-text": {"role": "user", "content": [{"type": "text"}]},
    "nan": {"role": "user", "content": "x", "score": float("nan")},
    "infinity": {"role": "user", "content": "x", "score": float("inf")},
    "lone-surrogate-content": {"role": "user", "content": "bad \ud800 text"},
    "lone-surrogate-key": {"role": "user", "content": "x", "k\udfff": 1},
    "non-string-key": {"role": "user", "content": "x", 1: "one"},
    "a-set": {"role": "user", "content": "x", "tags": {"a"}},
    "bytes": {"role": "user", "content": "x", "raw": b"\x00"},
    "an-object": {"role": "user", "content": "x", "when": object()},
    # More decimal digits than Python writes (4,300 by default): JSON is decimal.
    "integer-too-long-for-json": {"role": "user", "content": "x", "n": 10**5000},
}


def _deep(levels: int) -> dict[str, Any]:
    value: Any = "bottom"
    for _ in range(levels):
        value = {"v": value}
    return {"role": "user", "content": "x", "deep": value}


BAD_MESSAGES["nested-too-deep"] = _deep(80)


def test_invalid_messages_are_refused_everywhere(store: TranscriptStore, sid: str) -> None:
    for name, bad in BAD_MESSAGES.items():
        refused(
            store,
            InvalidInput,
            lambda bad=bad: store.append(A, sid, bad),
            lambda bad=bad: store.append(A, sid, bad, idempotency_key="k0"),
            lambda bad=bad: store.append_many(A, sid, [{"message": user("fine")}, {"message": bad}]),
            lambda bad=bad: store.admit(A, sid, bad, turn_id="T1"),
            lambda bad=bad: store.rewrite_entries(A, sid, [{"entry_id": "E0", "message": bad}]),
            case=name,
        )


def test_structural_message_errors_are_invalid_message(store: TranscriptStore, sid: str) -> None:
    for name in ("not-a-dict", "no-role", "unknown-role", "tool-without-tool-call-id", "user-with-tool-calls"):
        refused(store, InvalidMessage, lambda n=name: store.append(A, sid, BAD_MESSAGES[n]), case=name)


BAD_EVENTS: list[dict[str, Any]] = [
    {"kind": "bogus", "payload": {}},
    {"kind": "custom", "message": user("x")},
    {"kind": "message", "payload": {"role": "user", "content": "x"}},
    {"kind": "custom", "payload": "not a dict"},
    {"kind": "custom", "payload": [1, 2]},
    {"kind": "metadata", "payload": {"x": float("nan")}},
    {"kind": "compaction", "payload": {"x": "\ud83d"}},
    {"kind": "custom", "payload": {1: 2}},
]


def test_invalid_events_are_refused(store: TranscriptStore, sid: str) -> None:
    for kwargs in BAD_EVENTS:
        refused(store, InvalidInput, lambda kw=kwargs: store.append(A, sid, **kw), case=repr(kwargs))


def test_invalid_append_many_shapes_are_refused(store: TranscriptStore, sid: str) -> None:
    refused(
        store,
        InvalidInput,
        lambda: store.append_many(A, sid, "not a list"),  # type: ignore[arg-type]
        lambda: store.append_many(A, sid, {"message": user("x")}),  # type: ignore[arg-type]
        lambda: store.append_many(A, sid, [user("a bare message is not an item")]),
        lambda: store.append_many(A, sid, [{"message": user("x"), "unknown": 1}]),
        lambda: store.append_many(A, sid, [42]),  # type: ignore[list-item]
    )


# ---------------------------------------------------------------------------------------------- ids

BAD_IDS: dict[str, Any] = {
    "empty": "",
    "nul": "a\x00b",
    "newline": "a\nb",
    "tab": "a\tb",
    "escape": "\x1b[31m",
    "delete": "a\x7fb",
    "c1-next-line": "a\x85b",
    "c1-csi": "\x9b31m",
    "too-long": "x" * 256,
    "lone-surrogate": "a\ud800b",
    "not-a-string": 42,
    "bytes": b"s1",
}


def test_invalid_ids_are_refused_everywhere(store: TranscriptStore, sid: str) -> None:
    for name, bad in BAD_IDS.items():
        refused(
            store,
            InvalidInput,
            lambda bad=bad: store.create_session(bad),
            lambda bad=bad: store.create_session(A, session_id=bad),
            lambda bad=bad: store.create_session(A, session_key=bad),
            lambda bad=bad: store.open_session(A, bad),
            lambda bad=bad: store.append(bad, sid, user("x")),
            lambda bad=bad: store.append(A, bad, user("x")),
            lambda bad=bad: store.append(A, sid, user("x"), entry_id=bad),
            lambda bad=bad: store.append(A, sid, user("x"), idempotency_key=bad),
            lambda bad=bad: store.append_many(A, sid, [{"message": user("x"), "entry_id": bad}]),
            lambda bad=bad: store.admit(A, sid, user("x"), turn_id=bad),
            lambda bad=bad: store.admit(A, sid, user("x"), turn_id="T9", entry_id=bad),
            lambda bad=bad: store.branch(A, sid, bad),
            lambda bad=bad: store.get_entries(A, sid, [bad]),
            lambda bad=bad: store.anchor(A, sid, bad),
            lambda bad=bad: store.rewrite_entries(A, sid, [{"entry_id": bad, "message": user("x")}]),
            lambda bad=bad: store.end_session(bad, sid),
            lambda bad=bad: store.delete_session(A, bad),
            lambda bad=bad: store.read_visible(bad, sid),
            lambda bad=bad: store.read_visible_delta(A, bad),
            lambda bad=bad: store.list_entries(bad, sid),
            lambda bad=bad: store.list_sessions(A, after=bad),
            lambda bad=bad: store.find_session(A, bad),
            case=name,
        )


@pytest.mark.parametrize("longest", ["é" * 255, "漢" * 213, "🙂" * 160], ids=["2-byte", "3-byte", "4-byte"])
def test_the_longest_id_is_accepted(store: TranscriptStore, longest: str) -> None:
    """255 characters, or 640 bytes of UTF-8: four such ids share an index row within PostgreSQL's limit."""
    store.create_session(longest, session_id=longest, session_key=longest)
    entry = store.append(longest, longest, user("x"), entry_id=longest, idempotency_key=longest)
    adm = store.admit(longest, longest, user("q"), turn_id=longest)
    assert store.get_entries(longest, longest, [longest]) == [entry]
    assert adm.turn_id == longest
    # A receipt's key holds four ids: scope, session, advancement key and engine.
    turns = Turns(store)
    turn_id = longest[:-1] + "t"
    turns.admit(longest, longest, user("q2"), turn_id=turn_id, engine_id=longest)
    reply = {"message": {"role": "assistant", "content": "a"}}
    done = turns.complete(longest, longest, turn_id, [reply], commit_turn_in)
    assert done.commit is not None and done.commit.status == "committed"


def test_a_new_id_past_640_bytes_is_refused_and_one_stored_before_the_limit_still_works(
    store: TranscriptStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The byte limit applies to ids given to something new; a session whose id an earlier release
    stored (the limit lifted here to make one) is still read, written to, committed, drained, deleted."""
    import transcript_store.core as core_module

    wide = "🙂" * 161  # 644 bytes
    turns = Turns(store)
    for make_new in (
        lambda: store.create_session(A, session_id=wide),
        lambda: store.create_session(wide),
        lambda: store.open_session(A, wide),
        lambda: store.append(A, "plain", user("x"), entry_id=wide),
        lambda: store.append(A, "plain", user("x"), idempotency_key=wide),
        lambda: store.admit(A, "plain", user("x"), turn_id=wide),
        lambda: turns.admit(A, "plain", user("x"), turn_id="t-wide", engine_id=wide),
    ):
        store.create_session(A, session_id="plain")
        before = snapshot(store)
        with pytest.raises(InvalidInput, match="640 bytes"):
            make_new()
        assert snapshot(store) == before
    monkeypatch.setattr(core_module, "MAX_ID_BYTES", 10_000)  # an earlier release
    store.create_session(A, session_id=wide)
    turns.admit(A, wide, user("queued before the upgrade"), turn_id="t0", engine_id="legacy")
    turns.complete(A, wide, "t0", [{"message": {"role": "assistant", "content": "a0"}}], None)
    monkeypatch.undo()
    assert [e.message["content"] for e in store.read_visible(A, wide) if e.message] == [
        "queued before the upgrade", "a0"]
    store.append(A, wide, user("after the upgrade"))
    assert turns.drain(lambda _engine: commit_turn_in).committed == 1
    assert store.export_session(A, wide)[0]["session_id"] == wide
    store.delete_session(A, wide)
    assert store.find_session(A, wide) is None


SQLISH = [
    "'; DROP TABLE ts_entries; --",
    "a' OR '1'='1",
    '"quoted" \\ back\\slash',
    "%",
    "_",
    "*",
    "$1",
    ":name",
    "?",
    "%(scope_1)s",
    "🙂 unicode ✓",
]


def test_ids_with_sql_metacharacters_are_plain_ids(store: TranscriptStore) -> None:
    for i, odd in enumerate(SQLISH):
        store.create_session(odd, session_id=odd, session_key=odd)
        store.append(odd, odd, user(odd), entry_id=odd, idempotency_key=odd)
        store.admit(odd, odd, user(f"turn {i}"), turn_id=odd)
    store.create_session("plain", session_id="plain")
    for odd in SQLISH:
        # Each lives in its own scope and only there; wildcards match nothing but themselves.
        assert [s.session_id for s in store.list_sessions(odd)] == [odd]
        assert store.find_session(odd, odd) is not None
        assert [e.message for e in store.read_visible(odd, odd)] == [user(odd), user(f"turn {SQLISH.index(odd)}")]
        assert store.get_entries(odd, odd, [odd])[0].idempotency_key == odd
        assert store.append(odd, odd, user(odd), idempotency_key=odd).entry_id == odd
        with pytest.raises(UnknownSession):
            store.get_session(odd, "plain")
    assert [s.session_id for s in store.list_sessions("plain")] == ["plain"]
    assert sum(len(store.list_entries(odd, odd)) for odd in SQLISH) == 2 * len(SQLISH)


# ---------------------------------------------------------------------------------------------- size cap


@pytest.fixture
def small_store(store_url: str) -> Any:
    with TranscriptStore(config=StoreConfig(url=store_url, max_payload_bytes=1024, auto_upgrade=False)) as s:
        yield s


def _message_of_size(size: int) -> dict[str, Any]:
    shell = len(json.dumps(user(""), ensure_ascii=False, separators=(",", ":")).encode())
    return user("x" * (size - shell))


def test_payloads_over_the_cap_are_refused(small_store: TranscriptStore) -> None:
    store = small_store
    sid = store.create_session(A, session_id="s1").session_id
    at_cap = store.append(A, sid, _message_of_size(1024), entry_id="E0")
    assert at_cap.size_bytes == 1024
    over = _message_of_size(1025)
    multibyte = user("é" * 600)  # 600 characters, 1200 bytes: the cap counts UTF-8 bytes
    refused(
        store,
        PayloadTooLarge,
        lambda: store.append(A, sid, over),
        lambda: store.append(A, sid, multibyte),
        lambda: store.append(A, sid, kind="custom", payload={"blob": "x" * 1100}),
        lambda: store.append_many(A, sid, [{"message": user("fine")}, {"message": over}]),
        lambda: store.admit(A, sid, over, turn_id="T1"),
        lambda: store.rewrite_entries(A, sid, [{"entry_id": "E0", "message": over}]),
    )


def test_the_size_cap_is_configurable(store_url: str) -> None:
    with TranscriptStore(config=StoreConfig(url=store_url, max_payload_bytes=4096, auto_upgrade=False)) as s:
        sid = s.create_session(A).session_id
        assert s.append(A, sid, _message_of_size(4096)).size_bytes == 4096
        with pytest.raises(PayloadTooLarge):
            s.append(A, sid, _message_of_size(4097))


# ---------------------------------------------------------------------------------------------- sessions


def test_writes_to_unknown_sessions_and_scopes_are_refused(store: TranscriptStore, sid: str) -> None:
    for scope, session_id in ((A, "nope"), ("scope-b", sid)):
        refused(
            store,
            UnknownSession,
            lambda sc=scope, s=session_id: store.append(sc, s, user("x")),
            lambda sc=scope, s=session_id: store.append_many(sc, s, [{"message": user("x")}]),
            lambda sc=scope, s=session_id: store.admit(sc, s, user("x"), turn_id="T1"),
            lambda sc=scope, s=session_id: store.branch(sc, s, None),
            lambda sc=scope, s=session_id: store.rewrite_entries(sc, s, [{"entry_id": "E0", "message": user("y")}]),
            lambda sc=scope, s=session_id: store.end_session(sc, s),
            lambda sc=scope, s=session_id: store.delete_session(sc, s),
        )


def test_an_admission_made_without_validation_and_missing_fields_is_refused(store: TranscriptStore, sid: str) -> None:
    """``Admission.model_construct()`` leaves a field it is not given unset: reading it raised a bare
    AttributeError in ``read_closed_range`` and ``commit_turn`` (a review found it)."""
    from transcript_store import Admission

    good = store.admit(A, sid, user("a turn"), turn_id="T1")
    reply = store.append(A, sid, {"role": "assistant", "content": "its reply"})
    terminal = store.anchor(A, sid, reply.entry_id)
    messages = [user("a turn"), {"role": "assistant", "content": "its reply"}]
    turns = Turns(store)
    for bad in (Admission.model_construct(), Admission.model_construct(turn_id="T1"),
                Admission.model_construct(anchor="E1", turn_id="T1")):
        refused(store, InvalidInput, lambda bad=bad: store.read_closed_range(bad, terminal),
                lambda bad=bad: turns.commit_turn("e", "T1", bad, terminal, messages), case=repr(bad))
    # Its anchor is all a closed range reads; a commit needs its turn id too.
    anchor = good.anchor
    for bad in (Admission.model_construct(anchor=anchor), Admission.model_construct(anchor=anchor, turn_id=5)):
        refused(store, InvalidInput, lambda bad=bad: turns.commit_turn("e", "T1", bad, terminal, messages),
                case=repr(bad))
    assert turns.commit_turn("e", "T1", good, terminal, messages).status == "committed"
