"""Fault campaign, part 5: scope isolation. Two scopes hold sessions with the same session ids, session
keys, entry ids, turn ids and advancement keys. Every read and write API is called in scope A with what
only scope B has (its ids, keys, cursors, anchors): it leaks nothing (the answer is the one an unknown
id gets, word for word, or a reset ``scope_mismatch`` / a ``scope`` fence error) and changes nothing in B;
every write in A with B's ids, keys and turn ids makes A's own rows, and B is compared after each one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from test_host import make_host
from workers.fault_worker import report, table_rows
from workers.turn_worker import count_turn, counting_engine

from transcript_store import (
    Anchor,
    DeltaMissing,
    DeltaReset,
    InvalidInput,
    ReadFenceError,
    TranscriptStore,
    TranscriptStoreError,
)
from transcript_store.outbox import AdmittedLease
from transcript_store.turns import Turns

A, B = "scope-a", "scope-b"
ENGINE = "counter"


def populate(store: TranscriptStore, turns: Turns, scope: str) -> dict[str, Any]:
    """The same ids in each scope, a different secret in each: a session with entries, a committed turn,
    an admitted-only turn and an accepted (queued) turn."""
    secret = f"secret of {scope}"
    store.create_session(scope, session_id="s1", session_key="k1")
    store.append(scope, "s1", {"role": "user", "content": f"{secret} 0"}, entry_id="E0", idempotency_key="i0")
    store.append(scope, "s1", {"role": "assistant", "content": f"{secret} 1"}, entry_id="E1")
    admission, _ = turns.admit(scope, "s1", {"role": "user", "content": f"{secret} T1"}, turn_id="T1", engine_id=ENGINE)
    done = turns.complete(scope, "s1", "T1", [{"message": {"role": "assistant", "content": f"{secret} T1 answer"},
                                                "entry_id": "T1.r0"}], counting_engine)
    assert done.commit is not None and done.commit.status == "committed"
    turns.admit(scope, "s1", {"role": "user", "content": f"{secret} T2"}, turn_id="T2", engine_id=ENGINE)
    turns.discard(scope, "s1", "T2")
    turns.admit(scope, "s1", {"role": "user", "content": f"{secret} T3"}, turn_id="T3", engine_id=ENGINE)
    queued = turns.complete(scope, "s1", "T3", [{"message": {"role": "assistant", "content": f"{secret} T3 answer"},
                                                  "entry_id": "T3.r0"}], None)
    turns.admit(scope, "s1", {"role": "user", "content": f"{secret} T4"}, turn_id="T4", engine_id=ENGINE)
    cursor = store.read_visible_delta(scope, "s1", max_messages=2)
    assert cursor.kind == "page"
    return {"admission": admission, "terminal": done.terminal, "queued_terminal": queued.terminal,
            "cursor": cursor.cursor, "fence": store.anchor(scope, "s1", "E1")}


def outcome(call: Callable[[], Any], names: dict[str, str]) -> tuple[str, ...]:
    """What a call answered, with the ids that differ between the two calls compared put in brackets."""
    try:
        result = call()
    except TranscriptStoreError as e:
        kind, text = "raised " + type(e).__name__, str(e)
        if isinstance(e, ReadFenceError):
            text = f"{e.reason}: {text}"
    else:
        kind, text = "returned", repr(result)
    for name, placeholder in names.items():
        text = text.replace(name, placeholder)
    return kind, text


@pytest.fixture
def scoped(store: TranscriptStore) -> tuple[TranscriptStore, Turns, dict[str, Any], dict[str, Any]]:
    """Both scopes populated alike, plus a session only scope B has, with a turn of its own admitted (an
    outbox intent A's ``admit_if_clear`` must not see)."""
    turns = Turns(store)
    a, b = populate(store, turns, A), populate(store, turns, B)
    store.create_session(B, session_id="only-b", session_key="kb")
    store.create_session(B, session_id="ended-b", session_key="kb-ended")
    store.end_session(B, "ended-b")  # a key only an ended session of B's held: ended_sessions of A's says nothing
    store.append(B, "only-b", {"role": "user", "content": "secret of B only"}, entry_id="EB")
    turns.admit(B, "only-b", {"role": "user", "content": "secret of B only TB"}, turn_id="TB", engine_id=ENGINE)
    b["only_cursor"] = store.read_visible_delta(B, "only-b").cursor  # type: ignore[union-attr]
    b["only_fence"] = store.anchor(B, "only-b", "EB")
    return store, turns, a, b


def test_scopes_never_see_or_change_each_other(
    request: pytest.FixtureRequest, backend: str,
    scoped: tuple[TranscriptStore, Turns, dict[str, Any], dict[str, Any]],
) -> None:
    started = time.monotonic()
    store, turns, a, b = scoped
    b_before = table_rows(store, B)
    msg = {"role": "user", "content": "probe"}
    reply = [{"message": {"role": "assistant", "content": "probe answer"}}]
    engines: Callable[[str], Any] = lambda _e: counting_engine  # noqa: E731

    def moved(anchor: Anchor, sid: str) -> Anchor:
        return anchor.model_copy(update={"session_id": sid})

    first, last = a["admission"].anchor, a["terminal"]
    t1_messages = [{"role": "user", "content": "secret of scope-a T1"},
                   {"role": "assistant", "content": "secret of scope-a T1 answer"}]

    # 1. An id only scope B has answers exactly like an id nobody has (same error, same words).
    by_session: dict[str, Callable[[str], Any]] = {
        "get_session": lambda s: store.get_session(A, s),
        "session_bytes": lambda s: store.session_bytes(A, s),
        "end_session": lambda s: store.end_session(A, s),
        "delete_session": lambda s: store.delete_session(A, s),
        "append": lambda s: store.append(A, s, msg, entry_id="EB"),
        "append_many": lambda s: store.append_many(A, s, [{"message": msg, "entry_id": "EB"}]),
        "admit": lambda s: store.admit(A, s, msg, turn_id="T9"),
        "anchor": lambda s: store.anchor(A, s, "EB"),
        "read_visible_delta": lambda s: store.read_visible_delta(A, s),
        "read_visible_delta(B's cursor)": lambda s: store.read_visible_delta(A, s, b["only_cursor"]),
        "read_visible": lambda s: store.read_visible(A, s),
        "read_visible(B's fence)": lambda s: store.read_visible(A, s, fence=b["only_fence"]),
        "get_entries": lambda s: store.get_entries(A, s, ["EB"]),
        "list_entries": lambda s: store.list_entries(A, s),
        "branch": lambda s: store.branch(A, s, "EB"),
        "rewrite_entries": lambda s: store.rewrite_entries(A, s, [{"entry_id": "EB", "message": msg}]),
        "export_session": lambda s: store.export_session(A, s),
        "read_closed_range": lambda s: store.read_closed_range(moved(first, s), moved(last, s)),
        "commit_turn": lambda s: turns.commit_turn(ENGINE, "T1", moved(first, s), moved(last, s), t1_messages),
        "receipts": lambda s: turns.receipts(A, s),
        "intent": lambda s: turns.intent(A, s, "T3"),
        "discard": lambda s: turns.discard(A, s, "T4"),
        "accept": lambda s: turns.accept(A, s, "T4", moved(a["terminal"], s)),
        "turns.admit": lambda s: turns.admit(A, s, msg, turn_id="T9", engine_id=ENGINE),
        # TB is B's pending turn in only-b: B's outbox must not make A's session look "not clear" (None)
        "admit_if_clear": lambda s: turns.admit_if_clear(A, s, msg, turn_id="TB", engine_id=ENGINE),
        "complete": lambda s: turns.complete(A, s, "T4", reply, counting_engine),
        "recover": lambda s: turns.recover(A, s, ENGINE, engines),
        "drain": lambda s: turns.drain(engines, scope=A, session_id=s),
        # TB is B's admitted turn in only-b: neither may reach it from A
        "block": lambda s: turns.block(A, s, "TB", "probe"),
        "hand_back": lambda s: turns.hand_back(A, s, "TB", owner="probe-owner",
                                               lease=AdmittedLease("TB", "probe-owner", None)),
        # the host runtime, legacy engine: its session calls too
        "host.run_turn": lambda s: host.run_turn(A, s, "probe", turn_id="TB"),
        "host.compact": lambda s: host.compact(A, s),
        "host.resolve_session": lambda s: host.resolve_session(A, s),
    }
    names = {"only-b": "<sid>", "nowhere": "<sid>"}
    compared = 0
    host, _model = make_host(store)
    request.addfinalizer(host.dispose)
    for name, call in by_session.items():
        before = table_rows(store)
        foreign, unknown = outcome(lambda c=call: c("only-b"), names), outcome(lambda c=call: c("nowhere"), names)
        assert foreign == unknown, f"{name}: B's id answers {foreign}, an unknown id {unknown}"
        assert "secret of" not in foreign[1], f"{name} leaked: {foreign}"
        assert table_rows(store) == before, f"{name} wrote something"
        compared += 1
    for name, call in {
        "find_session": lambda k: store.find_session(A, k),
        "list_sessions(after)": lambda k: [s.session_id for s in store.list_sessions(A, after=k)],
        "ended_sessions": lambda k: [s.session_id for s in store.ended_sessions(A, k)],
    }.items():
        assert outcome(lambda c=call: c("kb"), {"kb": "<k>"}) == outcome(lambda c=call: c("kz"), {"kz": "<k>"}), name
        ended = {"kb-ended": "<k>"}
        assert outcome(lambda c=call: c("kb-ended"), ended) == outcome(lambda c=call: c("kz"), {"kz": "<k>"}), name
        compared += 1

    # 2. Colliding ids: scope A's own session answers with A's data only; B's cursors and anchors are refused.
    seen = repr([
        store.get_session(A, "s1"), store.list_sessions(A), store.read_visible(A, "s1"),
        store.list_entries(A, "s1"), store.get_entries(A, "s1", ["E0", "E1", "T1.r0"]),
        store.read_visible_delta(A, "s1"), store.export_session(A, "s1"), turns.receipts(A, "s1"),
        turns.intents(A), turns.intent(A, "s1", "T3"), store.find_session(A, "k1"),
        store.read_closed_range(a["admission"], a["terminal"]),
    ])
    assert "secret of scope-b" not in seen and "only-b" not in seen and "secret of scope-a" in seen
    reset = store.read_visible_delta(A, "s1", b["cursor"])
    assert isinstance(reset, DeltaReset) and reset.reason == "scope_mismatch"
    assert isinstance(store.read_visible_delta(A, "only-b", b["cursor"]), DeltaMissing)
    refusals = 0
    before = table_rows(store)
    for name, call, error in [
        ("read_visible(B's fence)", lambda: store.read_visible(A, "s1", fence=b["fence"]), ReadFenceError),
        ("read_visible_delta(B's fence)", lambda: store.read_visible_delta(A, "s1", fence=b["fence"]), ReadFenceError),
        ("accept(B's terminal)", lambda: turns.accept(A, "s1", "T4", b["terminal"]), InvalidInput),
        ("commit_turn(A's admission, B's terminal)", lambda: turns.commit_turn(
            ENGINE, "T1", a["admission"], b["terminal"], [msg, msg]), InvalidInput),
        ("get_entries(B's-only entry)", lambda: store.get_entries(A, "s1", ["EB"]), TranscriptStoreError),
        ("anchor(B's-only entry)", lambda: store.anchor(A, "s1", "EB"), TranscriptStoreError),
        ("branch(B's-only entry)", lambda: store.branch(A, "s1", "EB"), TranscriptStoreError),
        ("rewrite(B's-only entry)", lambda: store.rewrite_entries(A, "s1", [{"entry_id": "EB", "message": msg}]),
         TranscriptStoreError),
    ]:
        with pytest.raises(error) as info:
            call()
        if isinstance(info.value, ReadFenceError):
            assert info.value.reason == "scope", (name, info.value)
        assert "secret of" not in str(info.value), (name, info.value)
        assert table_rows(store) == before, f"{name} wrote something"
        refusals += 1

    # 3. Writes in A with B's ids, keys and turn ids create A's own rows and never touch B: B's rows are
    # compared after each write, so that a write that changes B is named (the compare is a table dump).
    def admit_clear(sid: str, turn_id: str) -> None:
        # B has TB pending in only-b; A's only-b has nothing: the check is A's own, so A's turn is admitted.
        admitted = turns.admit_if_clear(A, sid, {"role": "user", "content": f"A's {turn_id}"},
                                        turn_id=turn_id, engine_id=ENGINE)
        assert admitted is not None, f"A's {sid} is clear, yet admit_if_clear refused {turn_id}"

    made: dict[str, Any] = {}

    def admit_plain() -> None:
        # B's s1 has a turn T1 (admitted, answered, committed): A's only-b gets one under the same id
        made["admission"] = store.admit(A, "only-b", {"role": "user", "content": "A's T1"}, turn_id="T1")

    def append_reply() -> None:
        appended = store.append_many(A, "only-b", [{"message": {"role": "assistant", "content": "A's T1 answer"},
                                                    "entry_id": "T1.r0"}])
        made["terminal"] = store.anchor(A, "only-b", appended[-1].entry_id)

    def commit_directly() -> None:
        messages = [{"role": "user", "content": "A's T1"}, {"role": "assistant", "content": "A's T1 answer"}]
        done = turns.commit_turn(ENGINE, "T1", made["admission"], made["terminal"], messages, apply=count_turn)
        assert done.status == "committed", done

    def import_b() -> None:
        header, records = store.export_session(B, "only-b")
        store.import_session(A, header, records, session_id="imported-from-b", session_key="kz")

    writes: list[tuple[str, Callable[[], Any]]] = [
        ("create_session", lambda: store.create_session(A, session_id="only-b", session_key="kb")),
        ("append", lambda: store.append(A, "only-b", {"role": "user", "content": "A's own"}, entry_id="EB",
                                        idempotency_key="i0")),
        ("admit_if_clear", lambda: admit_clear("only-b", "TB")),
        ("complete", lambda: turns.complete(A, "only-b", "TB", [{"message": {"role": "assistant",
                                                                             "content": "A's TB answer"}}],
                                            counting_engine)),
        # the writes a caller makes without the outbox: an admission, replies, a commit of its own
        ("admit", admit_plain),
        ("append_many", append_reply),
        ("commit_turn", commit_directly),
        ("open_session", lambda: store.open_session(A, "k1")),
        # A's T3 and B's T3 are both queued under the same ids: blocking A's leaves B's queued
        ("block", lambda: turns.block(A, "s1", "T3", "blocked in A only")),
        ("discard", lambda: turns.discard(A, "s1", "T4")),  # its running turn: one turn at a time
        ("turns.admit", lambda: turns.admit(A, "s1", {"role": "user", "content": "A again"}, turn_id="T5",
                                            engine_id=ENGINE)),
        ("drain", lambda: turns.drain(engines, scope=A)),
        ("recover", lambda: turns.recover(A, "s1", ENGINE, engines)),
        ("rewrite_entries", lambda: store.rewrite_entries(A, "s1", [{"entry_id": "E1", "message": {
            "role": "assistant", "content": "rewritten"}}])),
        ("branch", lambda: store.branch(A, "s1", "E0")),
        ("import_session", import_b),
        ("end_session", lambda: store.end_session(A, "s1")),
        ("delete_session", lambda: store.delete_session(A, "only-b")),
    ]
    for name, write in writes:
        write()
        assert table_rows(store, B) == b_before, f"{name} in scope A changed scope B"
    report(request, backend, {
        "apis_compared_with_unknown_ids": compared, "cross_scope_refusals": refusals,
        "cross_scope_writes_checked": len(writes), "leaks": 0,
        "seconds": round(time.monotonic() - started, 1),
    })
