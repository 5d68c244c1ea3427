"""The engine-side commit ledger: commit_turn is ONE atomic, idempotent write keyed by advancement key."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import _admin_exec, _pg_reachable, assistant, make_legacy, pg_url, tool_round, user
from hosting import count_transactions
from sqlalchemy import event, func, insert, select, text
from workers.turn_worker import count_turn, counting_engine

from transcript_store import (
    Admission,
    AdvancementKeyCollision,
    Anchor,
    ClosedRange,
    InvalidInput,
    StoreConfig,
    TranscriptStore,
    TurnKeyConflict,
    UnknownSession,
    migrate,
)
from transcript_store.core import Core
from transcript_store.db import Database
from transcript_store.ledger import (
    TurnPayload,
    commit_turn_in,
    committed_messages,
    count_turn_messages,
    get_receipt,
    get_state,
    list_receipts,
    prepare_turn,
    put_state,
)
from transcript_store.schema import receipts, turn_messages
from transcript_store.turns import Turns

A = "scope-a"
E = "engine-1"


def finished_turn(
    store: TranscriptStore, sid: str, turn_id: str, replies: list[dict[str, Any]] | None = None
) -> tuple[Admission, Anchor, list[dict[str, Any]]]:
    """Admit a user message, append the replies: the admission, the terminal anchor and the closed range."""
    admission = store.admit(A, sid, user(f"question {turn_id}"), turn_id=turn_id)
    appended = store.append_many(A, sid, [{"message": m} for m in replies or [assistant(f"answer {turn_id}")]])
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    return admission, terminal, closed.messages


def ledger(store: TranscriptStore, sid: str, engine: str = E) -> tuple[list[str], int, Any]:
    """(receipt keys, ledger message count, engine turn counter) of a session."""

    def run(c: Core) -> tuple[list[str], int, Any]:
        keys = [r.advancement_key for r in list_receipts(c, A, sid, engine)]
        return keys, count_turn_messages(c, A, sid, engine), get_state(c, A, sid, engine, "turns")

    return store.read(run)


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(A, session_id="s1").session_id


@pytest.fixture
def turns(store: TranscriptStore) -> Turns:
    return Turns(store)


# ---------------------------------------------------------------------------------------------- idempotency


def test_commit_then_duplicate(store: TranscriptStore, turns: Turns, sid: str) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1", [*tool_round("c1", "42"), assistant("done")])
    first = turns.commit_turn(E, "t1", admission, terminal, messages, apply=count_turn)
    assert first.status == "committed"
    r = first.receipt
    assert (r.scope, r.session_id, r.engine_id, r.advancement_key) == (A, sid, E, "t1")
    assert (r.admission_entry_id, r.terminal_entry_id, r.message_count) == (
        admission.anchor.entry_id, terminal.entry_id, 4
    )
    assert len(r.payload_hash) == 64 and r.is_heartbeat is False

    again = turns.commit_turn(E, "t1", admission, terminal, messages, apply=count_turn)
    assert again.status == "duplicate"
    assert again.receipt == first.receipt
    assert ledger(store, sid) == (["t1"], 4, 1)
    assert store.read(lambda c: committed_messages(c, A, sid, E, "t1")) == messages


def test_a_first_commit_is_two_statements_and_a_collision_still_reads_as_one(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """The common case reads the range (locking the session in the same statement) and inserts the
    receipt, without reading the ledger first, as one statement outside any transaction (on
    PostgreSQL one round trip). A reused key whose payload fails the range check is still a collision, not an
    InvalidInput about the transcript."""
    admission, terminal, messages = finished_turn(store, sid, "t1")
    executed: list[str] = []

    def listen(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        executed.append(statement.split()[0])

    def began(_conn: Any) -> None:
        executed.append("BEGIN")

    event.listen(store.db.engine, "before_cursor_execute", listen)
    event.listen(store.db.engine, "begin", began)
    try:
        assert turns.commit_turn(E, "t1", admission, terminal, messages).status == "committed"
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
        event.remove(store.db.engine, "begin", began)
    assert executed == ["WITH"]
    other = [messages[0], assistant("another answer")]
    with pytest.raises(AdvancementKeyCollision):
        turns.commit_turn(E, "t1", admission, terminal, other)
    later_admission, later_terminal, later = finished_turn(store, sid, "t2")
    with pytest.raises(AdvancementKeyCollision):  # a valid range of another turn under the taken key
        turns.commit_turn(E, "t1", later_admission.anchor, later_terminal, later)
    assert ledger(store, sid)[0] == ["t1"]


def test_messages_that_serialize_as_their_entries_commit(store: TranscriptStore, turns: Turns, sid: str) -> None:
    """The range check compares decoded entries first, then texts: a caller's tuple where the entry
    holds a JSON list is the same message, so the turn commits (and a replay is a duplicate)."""
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    replies = [{"role": "assistant", "content": None, "tool_calls": (call,)}, assistant("done")]
    admission = store.admit(A, sid, user("q"), turn_id="t1")
    appended = store.append_many(A, sid, [{"message": m} for m in replies])
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    messages = [user("q"), *replies]
    assert turns.commit_turn(E, "t1", admission, terminal, messages).status == "committed"
    assert turns.commit_turn(E, "t1", admission, terminal, messages).status == "duplicate"
    with pytest.raises(InvalidInput, match="differs from its transcript entry"):
        other = [user("q"), {**replies[0], "tool_calls": ({**call, "id": "c2"},)}, assistant("done")]
        turns.commit_turn(E, "t2", admission.anchor, terminal, other)


def test_duplicate_after_restart(store_url: str, store: TranscriptStore, sid: str) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1")
    first = Turns(store).commit_turn(E, "t1", admission, terminal, messages, apply=count_turn)
    store.close()
    reopened = TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False))
    try:
        again = Turns(reopened).commit_turn(E, "t1", admission, terminal, messages, apply=count_turn)
        assert again.status == "duplicate"
        assert again.receipt == first.receipt
        assert ledger(reopened, sid) == (["t1"], 2, 1)
    finally:
        reopened.close()


def test_same_key_with_another_payload_is_a_collision(store: TranscriptStore, turns: Turns, sid: str) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1", [assistant("a"), assistant("b")])
    turns.commit_turn(E, "t1", admission, terminal, messages, apply=count_turn)
    shorter = store.anchor(A, sid, store.list_entries(A, sid)[1].entry_id)
    changed = [messages[0], assistant("other"), messages[2]]
    for attempt in (
        lambda: turns.commit_turn(E, "t1", admission, terminal, changed, apply=count_turn),
        lambda: turns.commit_turn(E, "t1", admission, shorter, messages[:2], apply=count_turn),
        lambda: turns.commit_turn(E, "t1", admission, terminal, messages, is_heartbeat=True, apply=count_turn),
    ):
        with pytest.raises(AdvancementKeyCollision, match=r"^context-engine advancement key collision: t1$"):
            attempt()
    assert ledger(store, sid) == (["t1"], 3, 1)
    assert store.read(lambda c: committed_messages(c, A, sid, E, "t1")) == messages


def test_changed_admitted_user_message(store: TranscriptStore, turns: Turns, sid: str) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1")
    forged = [user("not what was admitted"), *messages[1:]]
    with pytest.raises(InvalidInput, match="admitted user message"):
        turns.commit_turn(E, "t1", admission, terminal, forged, apply=count_turn)
    assert ledger(store, sid) == ([], 0, None)

    turns.commit_turn(E, "t1", admission, terminal, messages, apply=count_turn)
    with pytest.raises(AdvancementKeyCollision):
        turns.commit_turn(E, "t1", admission, terminal, forged, apply=count_turn)
    assert ledger(store, sid) == (["t1"], 2, 1)


def test_engines_keep_separate_ledgers(store: TranscriptStore, turns: Turns, sid: str) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1")
    assert turns.commit_turn(E, "t1", admission, terminal, messages).status == "committed"
    assert turns.commit_turn("engine-2", "t1", admission, terminal, messages).status == "committed"
    assert sorted(r.engine_id for r in turns.receipts(A, sid)) == [E, "engine-2"]
    assert [r.advancement_key for r in turns.receipts(A, sid, "engine-2")] == ["t1"]


# ---------------------------------------------------------------------------------------------- refusals


def test_terminal_outside_the_range_is_refused(store: TranscriptStore, turns: Turns, sid: str) -> None:
    _, earlier, _ = finished_turn(store, sid, "t0")
    admission, terminal, messages = finished_turn(store, sid, "t1", [assistant("a"), assistant("b")])
    with pytest.raises(InvalidInput, match="holds 3 messages, got 2"):
        turns.commit_turn(E, "t1", admission, terminal, messages[:2], apply=count_turn)
    with pytest.raises(InvalidInput, match="holds 3 messages, got 4"):
        turns.commit_turn(E, "t1", admission, terminal, [*messages, assistant("extra")], apply=count_turn)
    with pytest.raises(InvalidInput, match="at or after the admission"):
        turns.commit_turn(E, "t1", admission, earlier, messages, apply=count_turn)
    assert ledger(store, sid) == ([], 0, None)


def test_advancement_key_must_be_the_logical_turn_id(store: TranscriptStore, turns: Turns, sid: str) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1")
    with pytest.raises(TurnKeyConflict, match="admission of logical turn 't1'"):
        turns.commit_turn(E, "t2", admission, terminal, messages, apply=count_turn)
    assert ledger(store, sid) == ([], 0, None)


def test_invalid_inputs_are_refused_before_anything_is_written(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1")
    other = store.create_session(A, session_id="s2").session_id
    foreign_admission, _, _ = finished_turn(store, other, "t9")
    bad: list[tuple[Any, ...]] = [
        ("", "t1", admission, terminal, messages),
        (E, "t1", admission, terminal, "not a list"),
        (E, "t1", admission, terminal, [messages[0], {"role": "wizard", "content": "x"}]),
        (E, "t1", admission, terminal, [assistant("not the user"), messages[1]]),
        (E, "t1", admission, admission, messages),
        (E, "t9", foreign_admission, terminal, messages),
        (E, "t1", {"anchor": "nope"}, terminal, messages),
    ]
    for args in bad:
        with pytest.raises(InvalidInput):
            turns.commit_turn(*args)
    with pytest.raises(InvalidInput, match="is_heartbeat"):
        turns.commit_turn(E, "t1", admission, terminal, messages, is_heartbeat=1)  # type: ignore[arg-type]
    assert ledger(store, sid) == ([], 0, None)
    assert ledger(store, other) == ([], 0, None)


# ---------------------------------------------------------------------------------------------- atomicity


def test_failure_mid_transaction_rolls_back_everything_and_a_retry_commits(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1")
    seen: list[TurnPayload] = []

    def crash_after_state(c: Core, turn: TurnPayload) -> None:
        count_turn(c, turn)
        put_state(c, turn.scope, turn.session_id, turn.engine_id, "cursor", {"position": turn.terminal.position})
        seen.append(turn)
        assert get_state(c, A, sid, E, "turns") == 1  # written inside the transaction
        raise RuntimeError("engine crashed mid-commit")

    with pytest.raises(RuntimeError, match="mid-commit"):
        turns.commit_turn(E, "t1", admission, terminal, messages, apply=crash_after_state)
    assert len(seen) == 1
    assert ledger(store, sid) == ([], 0, None)
    assert store.read(lambda c: get_state(c, A, sid, E, "cursor")) is None
    assert store.read(lambda c: get_receipt(c, A, sid, E, "t1")) is None

    retry = turns.commit_turn(E, "t1", admission, terminal, messages, apply=count_turn)
    assert retry.status == "committed"
    assert ledger(store, sid) == (["t1"], 2, 1)


def test_apply_runs_only_when_newly_committed(store: TranscriptStore, turns: Turns, sid: str) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1")
    calls: list[str] = []

    def apply(c: Core, turn: TurnPayload) -> None:
        calls.append(turn.advancement_key)
        count_turn(c, turn)

    for _ in range(3):
        turns.commit_turn(E, "t1", admission, terminal, messages, apply=apply)
    assert calls == ["t1"]
    assert ledger(store, sid) == (["t1"], 2, 1)


# ---------------------------------------------------------------------------------------------- contents


def test_identical_tool_results_in_different_turns_are_both_kept(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    same = [*tool_round("call_1", '{"temperature": 21}'), assistant("It is 21 degrees.")]
    a1, t1, m1 = finished_turn(store, sid, "t1", same)
    a2, t2, m2 = finished_turn(store, sid, "t2", same)
    assert m1[1:] == m2[1:]
    assert turns.commit_turn(E, "t1", a1, t1, m1, apply=count_turn).status == "committed"
    r2 = turns.commit_turn(E, "t2", a2, t2, m2, apply=count_turn)
    assert r2.status == "committed"
    assert ledger(store, sid) == (["t1", "t2"], 8, 2)
    assert store.read(lambda c: committed_messages(c, A, sid, E, "t1")) == m1
    assert store.read(lambda c: committed_messages(c, A, sid, E, "t2")) == m2


def test_heartbeat_turns(store: TranscriptStore, turns: Turns, sid: str) -> None:
    admission, terminal, messages = finished_turn(store, sid, "hb1", [assistant("HEARTBEAT_OK")])
    plain = prepare_turn(E, "hb1", admission, terminal, messages)
    beat = prepare_turn(E, "hb1", admission, terminal, messages, is_heartbeat=True)
    assert plain.payload_hash != beat.payload_hash

    first = turns.commit_turn(E, "hb1", admission, terminal, messages, is_heartbeat=True, apply=count_turn)
    assert first.status == "committed" and first.receipt.is_heartbeat is True
    assert first.receipt.payload_hash == beat.payload_hash
    again = turns.commit_turn(E, "hb1", admission, terminal, messages, is_heartbeat=True, apply=count_turn)
    assert again.status == "duplicate" and again.receipt.is_heartbeat is True
    with pytest.raises(AdvancementKeyCollision):
        turns.commit_turn(E, "hb1", admission, terminal, messages, apply=count_turn)
    assert ledger(store, sid) == (["hb1"], 2, 1)
    assert turns.receipts(A, sid)[0].is_heartbeat is True


def test_hash_excludes_runtime_facts_and_includes_session_identity(store: TranscriptStore, sid: str) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1")
    one = prepare_turn(E, "t1", admission, terminal, messages)
    # An Anchor instead of the Admission, a copied message list: the same payload.
    copied = prepare_turn(E, "t1", admission.anchor, terminal, [dict(m) for m in messages])
    assert copied.payload_hash == one.payload_hash
    moved = admission.anchor.model_copy(update={"session_key": "other-key"})
    moved_terminal = terminal.model_copy(update={"session_key": "other-key"})
    assert prepare_turn(E, "t1", moved, moved_terminal, messages).payload_hash != one.payload_hash


def test_gaps_are_normal(store: TranscriptStore, turns: Turns, sid: str) -> None:
    finished_turn(store, sid, "t1")
    a2, t2, m2 = finished_turn(store, sid, "t2")
    a3, t3, m3 = finished_turn(store, sid, "t3")
    assert turns.commit_turn(E, "t3", a3, t3, m3, apply=count_turn).status == "committed"
    assert turns.commit_turn(E, "t2", a2, t2, m2, apply=count_turn).status == "committed"
    keys, count, counter = ledger(store, sid)
    assert sorted(keys) == ["t2", "t3"] and (count, counter) == (4, 2)
    assert store.read(lambda c: get_state(c, A, sid, E, "order")) == ["t3", "t2"]


def test_unknown_session_and_foreign_scope_write_nothing(store: TranscriptStore, turns: Turns, sid: str) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1")
    foreign = admission.model_copy(update={"anchor": admission.anchor.model_copy(update={"scope": "scope-b"})})
    foreign_terminal = terminal.model_copy(update={"scope": "scope-b"})
    with pytest.raises(UnknownSession):
        turns.commit_turn(E, "t1", foreign, foreign_terminal, messages, apply=count_turn)
    assert ledger(store, sid) == ([], 0, None)


# ---------------------------------------------------------------------------------------------- references


def test_the_ledger_references_the_transcript_instead_of_copying_it(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1", [*tool_round("c1", "42"), assistant("done")])
    turns.commit_turn(E, "t1", admission, terminal, messages, apply=count_turn)

    def look(c: Core) -> tuple[int, Any]:
        copies = c.conn.execute(select(func.count()).select_from(turn_messages)).scalar_one()
        stored = c.conn.execute(select(
            receipts.c.admission_seq, receipts.c.terminal_seq, receipts.c.message_seqs,
            receipts.c.admission_entry_id, receipts.c.terminal_entry_id,
        )).one()
        return copies, tuple(stored)

    copies, stored = store.read(look)
    assert copies == 0
    seqs = [e.seq for e in store.list_entries(A, sid)]
    # The anchors by seq, the ids read from the entries there, no list for a range without gaps (0017).
    assert stored == (seqs[0], seqs[-1], None, None, None)
    receipt = store.read(lambda c: get_receipt(c, A, sid, E, "t1"))
    assert receipt is not None
    assert (receipt.admission_entry_id, receipt.terminal_entry_id) == (admission.anchor.entry_id, terminal.entry_id)
    assert store.read(lambda c: committed_messages(c, A, sid, E, "t1")) == messages
    assert store.read(lambda c: committed_messages(c, A, sid, E, "unknown")) == []


def test_a_reply_that_differs_from_its_transcript_entry_is_refused(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    admission, terminal, messages = finished_turn(store, sid, "t1", [assistant("a"), assistant("b")])
    changed = [messages[0], messages[1], assistant("not what the transcript holds")]
    with pytest.raises(InvalidInput, match="message 2 of the turn differs from its transcript entry"):
        turns.commit_turn(E, "t1", admission, terminal, changed, apply=count_turn)
    assert ledger(store, sid) == ([], 0, None)
    # A copy with other key order or whitespace is the same JSON: accepted.
    reordered = [messages[0], {"content": "a", "role": "assistant"}, messages[2]]
    assert turns.commit_turn(E, "t1", admission, terminal, reordered, apply=count_turn).status == "committed"


@pytest.mark.parametrize("path", ["one statement", "transaction"])
def test_a_reply_equal_in_python_but_not_as_json_is_refused_and_the_drain_finds_its_duplicate(
    store: TranscriptStore, turns: Turns, sid: str, path: str
) -> None:
    """1.0 and True are ``== 1`` in Python, not in JSON: the check took them for the entry's 1 and
    receipted the turn hashed with them, so the drain of the queued turn (read from the transcript)
    collided with that receipt for ever, and the session's later turns waited behind it."""
    apply = None if path == "one statement" else count_turn
    turns.admit(A, sid, user("2+2?"), turn_id="t1", engine_id=E)
    reply = {"role": "assistant", "content": "4", "meta": {"n": 1, "ok": True, "z": 0.0, "l": [1]}}
    done = turns.complete(A, sid, "t1", [{"message": reply}], commit_in=None)
    admission = store.anchor(A, sid, store.list_entries(A, sid)[0].entry_id)
    for meta in ({"n": 1.0}, {"n": True}, {"ok": 1}, {"z": -0.0}, {"z": 0}, {"l": [1.0]}):
        changed = {**reply, "meta": {**reply["meta"], **meta}}
        with pytest.raises(InvalidInput, match="differs from its transcript entry"):
            turns.commit_turn(E, "t1", admission, done.terminal, [user("2+2?"), changed], apply=apply)
        assert ledger(store, sid)[0] == []
    # The same JSON in other key order, a tuple for a list: the turn.
    same = {"meta": {"l": (1,), "z": 0.0, "ok": True, "n": 1}, "content": "4", "role": "assistant"}
    assert turns.commit_turn(E, "t1", admission, done.terminal, [user("2+2?"), same], apply=apply).status == "committed"
    drained = turns.drain(lambda _engine: counting_engine)
    assert (drained.duplicates, drained.failed) == (1, [])


def test_a_terminal_on_a_branch_that_does_not_descend_from_the_admission_is_refused(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    finished_turn(store, sid, "t0")
    admission, _, messages = finished_turn(store, sid, "t1")
    before = store.list_entries(A, sid)[1]  # t0's answer: the admission's parent
    store.branch(A, sid, before.entry_id)
    store.append_many(A, sid, [{"message": user("another question")}, {"message": messages[1]}])
    elsewhere = store.anchor(A, sid, store.list_entries(A, sid)[-1].entry_id)
    assert elsewhere.position == admission.anchor.position + 1
    with pytest.raises(InvalidInput, match="does not descend from the admitted entry"):
        turns.commit_turn(E, "t1", admission, elsewhere, messages, apply=count_turn)
    assert ledger(store, sid) == ([], 0, None)


@pytest.fixture
def schema_0004_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A database migrated only to revision 0004 (before the ledger referenced the transcript)."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'old.db'}"
    else:
        problem = _pg_reachable()
        if problem is not None:
            pytest.skip(f"PostgreSQL unreachable: {problem}")
        name = f"ts_old_{uuid.uuid4().hex[:10]}"
        _admin_exec(f"CREATE DATABASE {name}")
        url = pg_url(name)
    db = Database(StoreConfig(url=url))
    try:
        migrate.upgrade(db, "0004")
    finally:
        db.dispose()
    yield url
    if backend != "sqlite":
        _admin_exec(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")


def test_receipts_from_before_0005_keep_reading_their_copies(schema_0004_url: str) -> None:
    old = TranscriptStore(config=StoreConfig(url=schema_0004_url, auto_upgrade=False), create=False)
    try:
        old.db.write(lambda conn: _old_receipt(conn))
    finally:
        old.close()
    store = TranscriptStore(config=StoreConfig(url=schema_0004_url, auto_upgrade=True))
    try:
        assert store.current_revision() == migrate.head_revision()
        assert store.read(lambda c: committed_messages(c, A, "s1", E, "old")) == [user("q"), assistant("a")]
        assert store.read(lambda c: count_turn_messages(c, A, "s1", E)) == 2
        # 0006 turned the stored hex hash into bytes; the API still reads it as the same hex.
        assert store.read(lambda c: get_receipt(c, A, "s1", E, "old")).payload_hash == "0" * 64
        # New commits in the same session reference the transcript; both kinds are counted.
        admission, terminal, messages = finished_turn(store, "s1", "t1")
        Turns(store).commit_turn(E, "t1", admission, terminal, messages)
        assert store.read(lambda c: count_turn_messages(c, A, "s1", E)) == 4
        assert store.read(lambda c: committed_messages(c, A, "s1", E, "t1")) == messages
    finally:
        store.close()


def _old_receipt(conn: Any) -> None:
    """What a 0004 ledger held for one committed turn: the receipt and its copied messages."""
    from transcript_store.schema import sessions

    conn.execute(insert(sessions).values(
        scope=A, session_id="s1", session_key=None, active=True, generation=0, last_seq=-1, head_seq=None,
        head_entry_id=None, path_length=0, visible_count=0, created_us=1, updated_us=1,
    ))
    values = dict(
        scope=A, session_id="s1", engine_id=E, advancement_key="old", payload_hash="0" * 64,
        admission_entry_id="gone-a", terminal_entry_id="gone-t", message_count=2, is_heartbeat=False,
        committed_us=1,
    )
    # The 0004 table as it was (schema.py is head's: its hash column holds bytes since 0006).
    names, binds = ", ".join(values), ", ".join(f":{k}" for k in values)
    conn.execute(text(f"INSERT INTO ts_receipts ({names}) VALUES ({binds})"), values)
    for idx, (role, payload) in enumerate([("user", '{"role":"user","content":"q"}'),
                                           ("assistant", '{"role":"assistant","content":"a"}')]):
        conn.execute(insert(turn_messages).values(
            scope=A, session_id="s1", engine_id=E, advancement_key="old", idx=idx, role=role, payload=payload
        ))


def test_what_one_statement_cannot_prove_the_transaction_decides(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """A first commit is one statement only when the range is, beyond doubt, the turn: every entry a
    message on the active path, each text as stored. An event inside the turn, a turn branched away, a
    message that is not its entry, a replay: the transactional check decides each (a turn branched away
    is refused there too: its closed range is ``stale``, and a receipt must be the closed range)."""
    adm, term, msgs = finished_turn(store, sid, "plain")
    assert count_transactions(store, lambda: turns.commit_turn(E, "plain", adm, term, msgs)) == 0
    assert count_transactions(store, lambda: turns.commit_turn(E, "plain", adm, term, msgs)) == 1  # replay
    assert turns.commit_turn(E, "plain", adm, term, msgs).status == "duplicate"
    # An event between the messages: seqs are not contiguous messages.
    admission = store.admit(A, sid, user("with an event"), turn_id="evt")
    store.append(A, sid, kind="metadata", payload={"note": "inside the turn"})
    last = store.append(A, sid, assistant("after the event"))
    terminal = store.anchor(A, sid, last.entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    assert count_transactions(store, lambda: turns.commit_turn(E, "evt", admission, terminal, closed.messages)) == 1
    # A message that is not its entry: refused, nothing written.
    adm2, term2, msgs2 = finished_turn(store, sid, "forged")
    with pytest.raises(InvalidInput):
        turns.commit_turn(E, "forged", adm2, term2, [msgs2[0], assistant("not what was said")])
    # A finished turn branched away before its commit: off the active path, the transaction decides.
    adm3, term3, msgs3 = finished_turn(store, sid, "away")
    store.branch(A, sid, term2.entry_id)

    def away() -> None:
        with pytest.raises(InvalidInput, match="active branch"):
            turns.commit_turn(E, "away", adm3, term3, msgs3)

    assert count_transactions(store, away) == 1
    assert ledger(store, sid)[0] == ["plain", "evt"]


@pytest.mark.parametrize("path", ["one statement", "transaction"])
def test_anchors_naming_another_key_or_generation_are_refused_and_write_nothing(
    store: TranscriptStore, turns: Turns, path: str
) -> None:
    """The hash covers the session key: a receipt written under a forged key or generation would stand
    forever, and the genuine turn would then be a collision. Both commit paths refuse it."""
    sid = store.create_session(A, session_id="keyed", session_key="agent:main:real").session_id
    adm, term, msgs = finished_turn(store, sid, "t1")
    apply = None if path == "one statement" else (lambda c, t: None)  # apply= takes the transaction
    for forged in ({"session_key": "agent:main:forged"}, {"session_key": None}, {"generation": 7}, {"incarnation": 5}):
        with pytest.raises(InvalidInput, match=r"session key|earlier session"):
            turns.commit_turn(
                E, "t1", Admission(anchor=adm.anchor.model_copy(update=forged), turn_id="t1"),
                term.model_copy(update=forged), msgs, apply=apply,
            )
        assert ledger(store, sid)[0] == []
    assert turns.commit_turn(E, "t1", adm, term, msgs, apply=apply).status == "committed"


@pytest.mark.parametrize("path", ["one statement", "transaction"])
def test_anchors_without_or_of_another_incarnation_are_refused_on_both_paths(
    store: TranscriptStore, turns: Turns, path: str
) -> None:
    """An anchor without an incarnation is honoured only by a session from before anchors carried one,
    and a terminal of another incarnation never: the one-statement commit receipted both (it checked
    the admission's incarnation only, and only when it had one), where the transaction refuses them."""
    sid = store.create_session(A, session_id="bare").session_id
    adm, term, msgs = finished_turn(store, sid, "t1")
    apply = None if path == "one statement" else (lambda c, t: None)
    for admission, terminal in (
        (adm.anchor.model_copy(update={"incarnation": None}), term.model_copy(update={"incarnation": None})),
        (adm.anchor, term.model_copy(update={"incarnation": None})),
        (adm.anchor, term.model_copy(update={"incarnation": 5})),
    ):
        with pytest.raises(InvalidInput, match="earlier session"):
            turns.commit_turn(E, "t1", admission, terminal, msgs, apply=apply)
        assert ledger(store, sid)[0] == []
    make_legacy(store, A, sid)  # a session from before revision 0007 honours bare anchors
    bare = [a.model_copy(update={"incarnation": None}) for a in (adm.anchor, term)]
    assert turns.commit_turn(E, "t1", bare[0], bare[1], msgs, apply=apply).status == "committed"


def entry_turn_id(store: TranscriptStore, sid: str, entry_id: str) -> str | None:
    """The logical turn id stored on an entry."""
    return store.read(
        lambda c: c.conn.execute(
            text("SELECT turn_id FROM ts_entries WHERE scope = :a AND session_id = :s AND entry_id = :e"),
            {"a": A, "s": sid, "e": entry_id},
        ).scalar_one()
    )


@pytest.mark.parametrize("path", ["one statement", "transaction"])
def test_an_admitted_turn_is_committed_under_its_own_turn_id_only(
    store: TranscriptStore, turns: Turns, sid: str, path: str
) -> None:
    """Bare anchors carry no turn id: a key other than the admission's would receipt the same closed
    range a second time, and the engine would take the turn twice. Both commit paths refuse it."""
    apply = None if path == "one statement" else count_turn
    adm, term, msgs = finished_turn(store, sid, "t1")
    assert turns.commit_turn(E, "t1", adm.anchor, term, msgs, apply=apply).status == "committed"
    for key in ("t1-again", "t2"):
        with pytest.raises(TurnKeyConflict, match="admission of logical turn 't1'") as info:
            turns.commit_turn(E, key, adm.anchor, term, msgs, apply=apply)
        assert (info.value.key, info.value.entry_id, info.value.turn_key) == (key, adm.anchor.entry_id, "t1")
        assert isinstance(info.value, AdvancementKeyCollision)
    assert ledger(store, sid)[0] == ["t1"]
    # Before its first commit too (the engine of another slot, the same rule).
    adm2, term2, msgs2 = finished_turn(store, sid, "t2")
    with pytest.raises(TurnKeyConflict):
        turns.commit_turn("engine-2", "invented", adm2.anchor, term2, msgs2, apply=apply)
    assert ledger(store, sid, "engine-2")[0] == []
    assert turns.commit_turn("engine-2", "t2", adm2.anchor, term2, msgs2, apply=apply).status == "committed"


@pytest.mark.parametrize("path", ["one statement", "transaction"])
def test_an_appended_user_message_is_bound_to_the_first_key_it_is_committed_under(
    store: TranscriptStore, turns: Turns, sid: str, path: str
) -> None:
    """An entry appended without a logical turn id (a mirrored host transcript) takes its first commit's
    key as its turn id, in that commit: another key for it, or a key that is another entry's turn id,
    is refused and writes nothing; every engine commits it under that key."""
    apply = None if path == "one statement" else count_turn
    first = store.append(A, sid, user("appended, not admitted"))
    last = store.append(A, sid, assistant("reply"))
    adm, term = store.anchor(A, sid, first.entry_id), store.anchor(A, sid, last.entry_id)
    msgs = [user("appended, not admitted"), assistant("reply")]
    admitted, _, _ = finished_turn(store, sid, "taken")
    with pytest.raises(TurnKeyConflict, match="another entry's logical turn id"):
        turns.commit_turn(E, "taken", adm, term, msgs, apply=apply)
    assert entry_turn_id(store, sid, first.entry_id) is None and ledger(store, sid)[0] == []

    assert turns.commit_turn(E, "k1", adm, term, msgs, apply=apply).status == "committed"
    assert entry_turn_id(store, sid, first.entry_id) == "k1"
    assert turns.commit_turn(E, "k1", adm, term, msgs, apply=apply).status == "duplicate"
    with pytest.raises(TurnKeyConflict, match="admission of logical turn 'k1'"):
        turns.commit_turn(E, "k2", adm, term, msgs, apply=apply)
    assert turns.commit_turn("engine-2", "k1", adm, term, msgs, apply=apply).status == "committed"
    with pytest.raises(TurnKeyConflict):
        turns.commit_turn("engine-3", "k2", adm, term, msgs, apply=apply)
    assert ledger(store, sid)[0] == ["k1"] and ledger(store, sid, "engine-3")[0] == []
    # The key is now the entry's logical turn id: admitting it again is the same admission.
    assert store.admit(A, sid, user("appended, not admitted"), turn_id="k1").anchor == adm
    assert admitted.anchor.entry_id != adm.entry_id


def test_one_statement_commits_any_text_and_long_turns_take_the_transaction(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """Texts travel as they are stored (quotes, backslashes, non-ASCII, NUL): the one statement commits
    them; a turn of more messages than it takes goes to the transaction, and both replay."""
    odd = assistant('quote " backslash \\ tab \t ünïcödé 😀 nul \x00 end')
    adm, term, msgs = finished_turn(store, sid, "odd", [odd])
    assert count_transactions(store, lambda: turns.commit_turn(E, "odd", adm, term, msgs)) == 0
    assert turns.commit_turn(E, "odd", adm, term, msgs).status == "duplicate"
    many = [assistant(f"part {i}") for i in range(40)]
    adm2, term2, msgs2 = finished_turn(store, sid, "long", many)
    assert count_transactions(store, lambda: turns.commit_turn(E, "long", adm2, term2, msgs2)) == 1
    assert turns.commit_turn(E, "long", adm2, term2, msgs2).status == "duplicate"
    assert ledger(store, sid)[0] == ["odd", "long"]


def test_a_stored_turn_is_prepared_as_any_turn_without_validating_its_messages_again(
    store: TranscriptStore, sid: str
) -> None:
    """A ready intent's messages are its closed range, validated when they were appended: its payload
    is the same (hash included) as ``prepare_turn``'s, and the turn's shape is still checked."""
    admission, terminal, messages = finished_turn(store, sid, "t1", [assistant("a"), assistant("b"), assistant("c")])
    assert prepare_turn(E, "t1", admission, terminal, messages, messages_validated=True) == prepare_turn(
        E, "t1", admission, terminal, messages
    )
    with pytest.raises(InvalidInput, match="holds 4 messages, got 3"):
        prepare_turn(E, "t1", admission, terminal, messages[:3], messages_validated=True)
    with pytest.raises(InvalidInput, match="first message of a turn"):
        prepare_turn(E, "t1", admission, terminal, [assistant("x"), *messages[1:]], messages_validated=True)
    with pytest.raises(TurnKeyConflict, match="admission of logical turn 't1'"):
        prepare_turn(E, "t2", admission, terminal, messages, messages_validated=True)


def test_a_hash_written_as_text_by_a_process_from_before_0006_reads_as_any(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """SQLite stores what a writer gives: a process of a release before revision 0006 (the hash as 32
    bytes) still running after the upgrade writes the hash's hex text. Reading such a receipt raised
    a bare TypeError; it is the same receipt (PostgreSQL's bytea refuses the old writer instead)."""
    if not store.db.dialect.is_sqlite:
        pytest.skip("PostgreSQL refuses text in a bytea column: the old writer fails, nothing to read")
    admission, terminal, messages = finished_turn(store, sid, "t1")
    first = turns.commit_turn(E, "t1", admission, terminal, messages)
    store.write(lambda c: c.conn.execute(text("UPDATE ts_receipts SET payload_hash = :h"),
                                         {"h": first.receipt.payload_hash.upper()}))
    assert [r.payload_hash for r in turns.receipts(A, sid)] == [first.receipt.payload_hash]
    again = turns.commit_turn(E, "t1", admission, terminal, messages)
    assert again.status == "duplicate" and again.receipt == first.receipt


def _commit_in_process(
    url: str, key: str, turn: tuple[Any, Any, Any], hold: float, out: Any, inside: Any, second: Any
) -> None:
    """commit_turn in a process of its own. The first (``hold`` > 0) says when it is inside ``apply`` (its
    transaction holds the session's lock), waits there for the second to be at its own commit_turn, then
    holds ``hold`` seconds more."""
    import time

    def slow(_core: Core, _turn: TurnPayload) -> None:
        inside.set()
        if hold:
            second.wait(60)
            time.sleep(hold)

    with TranscriptStore(url) as store:
        if not hold:
            second.set()
        try:
            out.put((key, Turns(store).commit_turn(E, key, *turn, apply=slow).status))
        except Exception as e:  # the test reads the error's type
            out.put((key, type(e).__name__))


def test_two_processes_binding_one_appended_message_to_two_keys_commit_one(store: TranscriptStore, sid: str) -> None:
    """The second commit waits for the first's session lock; on PostgreSQL it then read the entry as it
    was before the first bound it (READ COMMITTED re-checks only the locked session row), bound nothing
    and committed too: one turn under two keys. Its bind finding the entry taken refuses it."""
    import multiprocessing

    first = store.append(A, sid, user("appended"))
    last = store.append(A, sid, assistant("reply"))
    turn = (store.anchor(A, sid, first.entry_id), store.anchor(A, sid, last.entry_id),
            [user("appended"), assistant("reply")])
    ctx = multiprocessing.get_context("spawn")
    out: Any = ctx.Queue()
    inside, second = ctx.Event(), ctx.Event()
    procs = []
    # k1 holds the session's lock in its commit when k2 starts, until k2 is at its own commit and a second
    # more: a fixed 1.5 s head start was no bound on a loaded machine, where a spawn alone can take longer.
    for key, hold in (("k1", 1.0), ("k2", 0.0)):
        proc = ctx.Process(target=_commit_in_process, args=(store.config.url, key, turn, hold, out, inside, second))
        proc.start()
        procs.append(proc)
        assert inside.wait(60), "k1 never reached its commit's apply"
    for proc in procs:
        proc.join(60)
    assert dict(out.get(timeout=5) for _ in procs) == {"k1": "committed", "k2": "TurnKeyConflict"}
    assert ledger(store, sid)[0] == ["k1"] and entry_turn_id(store, sid, first.entry_id) == "k1"


def test_a_replay_of_a_turn_committed_under_another_key_before_keys_were_bound_is_a_duplicate(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """A release before this one let a caller commit admitted turn t1 under a key of its own (k1): the
    replay of that commit must stay a duplicate, not become TurnKeyConflict."""
    admission, terminal, messages = finished_turn(store, sid, "t1")
    seq = admission.anchor.seq

    def set_turn_id(value: str | None) -> None:
        store.write(lambda c: c.conn.execute(text("UPDATE ts_entries SET turn_id = :v WHERE seq = :q"),
                                             {"v": value, "q": seq}))

    set_turn_id(None)
    assert turns.commit_turn(E, "k1", admission.anchor, terminal, messages).status == "committed"
    set_turn_id("t1")  # the entry as the old release left it: admitted as t1, committed as k1
    for _ in range(2):
        assert turns.commit_turn(E, "k1", admission.anchor, terminal, messages).status == "duplicate"
    with pytest.raises(AdvancementKeyCollision):
        turns.commit_turn(E, "k1", admission.anchor, terminal, messages, is_heartbeat=True)
    with pytest.raises(TurnKeyConflict):
        turns.commit_turn(E, "k2", admission.anchor, terminal, messages)


@pytest.mark.parametrize("path", ["one statement", "transaction"])
def test_a_range_holding_another_turns_admission_is_refused(
    store: TranscriptStore, turns: Turns, sid: str, path: str
) -> None:
    """``TranscriptStore.admit`` is not held back by a running turn, so a second turn can be admitted
    inside the first. Its messages are its own turn's: a receipt of the first turn's whole range would
    deliver them to the engine a second time, under the other key (a review found both receipted, in
    either order). Both commit paths refuse the range, and write nothing."""
    apply = None if path == "one statement" else count_turn
    first = store.admit(A, sid, user("u0"), turn_id="k0")
    store.append(A, sid, assistant("a0"))
    second, second_end, second_msgs = finished_turn(store, sid, "k1")
    whole = store.read_closed_range(first, second_end)
    assert isinstance(whole, ClosedRange) and len(whole.messages) == 4
    before = ledger(store, sid)

    def refused() -> None:
        with pytest.raises(InvalidInput, match="admission of another logical turn \\('k1'\\)"):
            turns.commit_turn(E, "k0", first, second_end, whole.messages, apply=apply)

    assert count_transactions(store, refused) == 1  # the one statement inserted nothing: the check refused
    assert ledger(store, sid) == before
    assert turns.commit_turn(E, "k1", second, second_end, second_msgs, apply=apply).status == "committed"
    refused()  # after the other turn's commit as before it
    assert ledger(store, sid)[0] == ["k1"]


def test_a_queued_turn_whose_range_holds_another_turns_admission_is_blocked(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """Through the outbox: a turn admitted with ``Turns.admit``, another one admitted with the store's own
    ``admit`` while it runs, answered and committed; the first turn's completion cannot deliver its range
    (the other turn's messages inside it) and blocks it, naming the other turn, instead of a receipt."""
    turns.admit(A, sid, user("v0"), turn_id="j0", engine_id=E)
    inner, inner_end, inner_msgs = finished_turn(store, sid, "j1")
    assert turns.commit_turn(E, "j1", inner, inner_end, inner_msgs).status == "committed"
    done = turns.complete(A, sid, "j0", [{"message": assistant("b0")}], lambda c, p: commit_turn_in(c, p))
    assert done.commit is None and done.intent.state == "blocked"
    assert done.intent.block_reason is not None and done.intent.block_reason.startswith("overlapping_turn")
    assert "'j1'" in done.intent.block_reason
    assert ledger(store, sid)[0] == ["j1"]
    assert turns.drain(lambda _e: lambda c, p: commit_turn_in(c, p), scope=A).delivered == 0
    assert ledger(store, sid)[0] == ["j1"]


def test_an_entry_inside_a_committed_turn_is_not_bound_to_another_key(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """A user message appended during a turn (no turn id: the store's own ``append``) is a message of
    that turn's range. Committed first, that turn took it; a commit naming it as the admission of a
    turn of its own (a bare anchor, which the ledger binds to its key) delivered it a second time (a
    review found both receipted in this order, after the fix for the other)."""
    outer = store.admit(A, sid, user("u0"), turn_id="k0")
    store.append(A, sid, assistant("a0"))
    inner_user = store.append(A, sid, user("u1"))
    inner_end = store.anchor(A, sid, store.append(A, sid, assistant("a1")).entry_id)
    whole = store.read_closed_range(outer, inner_end)
    inner_adm = store.anchor(A, sid, inner_user.entry_id)
    inner = store.read_closed_range(inner_adm, inner_end)
    assert isinstance(whole, ClosedRange) and isinstance(inner, ClosedRange)
    assert turns.commit_turn(E, "k0", outer, inner_end, whole.messages).status == "committed"
    before = ledger(store, sid)
    for engine in (E, "engine-2"):
        with pytest.raises(InvalidInput, match="is a message of turn 'k0', committed already"):
            turns.commit_turn(engine, "k1", inner_adm, inner_end, inner.messages)
    assert ledger(store, sid) == before and store.get_entries(A, sid, [inner_user.entry_id])[0].turn_id is None
    # A user message of no committed turn is bound as before.
    later = store.append(A, sid, user("u2"))
    later_end = store.anchor(A, sid, store.append(A, sid, assistant("a2")).entry_id)
    later_adm = store.anchor(A, sid, later.entry_id)
    closed = store.read_closed_range(later_adm, later_end)
    assert isinstance(closed, ClosedRange)
    assert turns.commit_turn(E, "k2", later_adm, later_end, closed.messages).status == "committed"


def test_a_queued_turn_whose_range_gained_another_turns_admission_is_blocked_at_the_drain(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """Captured ready while a message of its range had no turn id; that message then bound to a key by
    another turn's commit: the ledger refuses the first turn at every delivery. The drain blocked it
    not, and the session's later turns waited behind it for ever (a review found it)."""
    turns.admit(A, sid, user("u0"), turn_id="j0", engine_id=E)
    inner_user = store.append(A, sid, user("u1"))
    inner_end = store.anchor(A, sid, store.append(A, sid, assistant("a1")).entry_id)
    turns.complete(A, sid, "j0", [{"message": assistant("b0")}], None)
    turns.drain(lambda _e: None, scope=A)  # the engine not loaded: captured, stays queued
    assert turns.intent(A, sid, "j0").state == "ready"
    inner_adm = store.anchor(A, sid, inner_user.entry_id)
    inner = store.read_closed_range(inner_adm, inner_end)
    assert isinstance(inner, ClosedRange)
    assert turns.commit_turn(E, "k1", inner_adm, inner_end, inner.messages).status == "committed"
    turns.admit(A, sid, user("u2"), turn_id="j2", engine_id=E)
    turns.complete(A, sid, "j2", [{"message": assistant("b2")}], None)
    report = turns.drain(lambda _e: lambda c, p: commit_turn_in(c, p), scope=A)
    assert report.failed == [] and report.blocked == 1 and report.delivered == 1
    blocked = turns.intent(A, sid, "j0")
    assert blocked.state == "blocked" and blocked.block_reason.startswith("overlapping_turn")
    assert turns.intent(A, sid, "j2") is None and ledger(store, sid)[0] == ["k1", "j2"]
