"""The host-side turn outbox: transitions, the in-order drain, recovery, and the fast completion path."""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from workers.turn_worker import count_turn, counting_engine

from transcript_store import IdempotencyConflict, InvalidInput, TranscriptStore, outbox
from transcript_store.core import Core
from transcript_store.errors import OutboxCollision, UnknownSession, UnknownTurn
from transcript_store.ledger import CommitResult, TurnPayload, commit_turn_in, count_turn_messages, get_state
from transcript_store.outbox import OutboxConfig, TurnIntent, capture, claim_head
from transcript_store.turns import CommitIn, CompletionResult, Turns, turn_payload

A = "scope-a"
E = "engine-1"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def engines(deliver: CommitIn = counting_engine) -> Callable[[str], CommitIn | None]:
    """The drain's engine lookup: ``deliver`` for engine E, nothing for any other."""
    return lambda engine_id: deliver if engine_id == E else None


def accepted(turns: Turns, sid: str, turn_id: str, *, engine: str = E, replies: int = 1) -> CompletionResult:
    """Admit a turn and accept it without delivering it (queued for the drain)."""
    turns.admit(A, sid, user(f"q {turn_id}"), turn_id=turn_id, engine_id=engine)
    answers = [{"message": assistant(f"a{i} {turn_id}")} for i in range(replies)]
    done = turns.complete(A, sid, turn_id, answers, None)
    assert done.commit is None and done.intent.state == "accepted"
    return done


def row_of(turns: Turns, sid: str, turn_id: str) -> TurnIntent:
    """The outbox row of a turn, which must exist."""
    intent = turns.intent(A, sid, turn_id)
    assert intent is not None, f"no outbox row for {turn_id}"
    return intent


def engine_view(store: TranscriptStore, sid: str) -> tuple[list[str], int, Any]:
    """(committed keys in the engine's order, ledger messages, engine turn counter) of a session."""

    def run(c: Core) -> tuple[list[str], int, Any]:
        order = get_state(c, A, sid, E, "order") or []
        return order, count_turn_messages(c, A, sid, E), get_state(c, A, sid, E, "turns")

    return store.read(run)


class Recorder:
    """A counting engine that remembers what it was handed, and can be told to fail."""

    def __init__(self, fail: Callable[[TurnPayload], bool] = lambda _t: False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, c: Core, turn: TurnPayload) -> CommitResult:
        self.calls.append(turn.advancement_key)
        result = commit_turn_in(c, turn, count_turn)
        if self.fail(turn):
            raise RuntimeError(f"engine refused {turn.advancement_key}")
        return result


@pytest.fixture
def turns(store: TranscriptStore) -> Turns:
    return Turns(store)


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(A, session_id="s1").session_id


# ---------------------------------------------------------------------------------------------- common case


def test_fast_path_commits_in_the_completion(store: TranscriptStore, turns: Turns, sid: str) -> None:
    admission, intent = turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    assert (intent.state, intent.enqueue_seq, intent.attempt_count) == ("admitted", admission.anchor.seq, 0)
    assert intent.lease_owner is not None and intent.lease_expires_at is not None
    done = turns.complete(A, sid, "t1", [{"message": assistant("a")}], counting_engine)
    assert done.commit is not None and done.commit.status == "committed"
    assert done.fast_path_error is None
    assert turns.intent(A, sid, "t1") is None
    assert engine_view(store, sid) == (["t1"], 2, 1)
    assert done.commit.receipt.terminal_entry_id == done.terminal.entry_id


def test_engine_failure_on_the_fast_path_falls_back_to_the_drain(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    done = turns.complete(A, sid, "t1", [{"message": assistant("a")}], Recorder(lambda _t: True))
    assert done.commit is None and done.fast_path_error == "RuntimeError: engine refused t1"
    assert done.intent.state == "accepted"
    assert engine_view(store, sid) == ([], 0, None)  # the failed fast path rolled back whole
    assert [e.message for e in store.read_visible(A, sid)] == [user("q"), assistant("a")]
    report = turns.drain(engines())
    assert (report.committed, report.failed) == (1, [])
    assert engine_view(store, sid) == (["t1"], 2, 1)


def test_a_payload_derived_from_the_fast_paths_is_checked_against_the_transcript(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """The fast completion skips commit_turn's range check only for the very payload it built from the
    closed range it read: an engine that commits a modified copy gets the full check, and is refused."""

    def forging(c: Core, p: TurnPayload) -> CommitResult:
        return commit_turn_in(c, replace(p, messages=(p.messages[0], assistant("forged"))))

    def growing(c: Core, p: TurnPayload) -> CommitResult:
        return commit_turn_in(c, replace(p, messages=(*p.messages, assistant("extra"))))

    for deliver in (forging, growing):
        turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
        done = turns.complete(A, sid, "t1", [{"message": assistant("a")}], deliver)
        assert done.commit is None and done.fast_path_error is not None
        assert done.fast_path_error.startswith("InvalidInput: ")
        assert done.intent.state == "accepted"  # queued for the drain, nothing receipted
        assert turns.receipts(A, sid) == []
        assert turns.drain(engines()).committed == 1  # the honest delivery of the same turn
        assert engine_view(store, sid) == (["t1"], 2, 1)
        store.delete_session(A, sid)
        sid = store.create_session(A, session_id="s1").session_id


def test_an_earlier_queued_turn_is_never_overtaken_by_the_fast_path(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    accepted(turns, sid, "t1")
    turns.admit(A, sid, user("q2"), turn_id="t2", engine_id=E)
    done = turns.complete(A, sid, "t2", [{"message": assistant("a2")}], counting_engine)
    assert done.commit is None and done.intent.state == "accepted"
    assert engine_view(store, sid) == ([], 0, None)
    assert turns.drain(engines()).committed == 2
    assert engine_view(store, sid) == (["t1", "t2"], 4, 2)


def test_an_earlier_queued_turn_of_another_engine_does_not_hold_the_fast_path(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    turns.admit(A, sid, user("q1"), turn_id="t1", engine_id="engine-2")
    assert turns.complete(A, sid, "t1", [{"message": assistant("a1")}], None).intent.state == "accepted"
    turns.admit(A, sid, user("q2"), turn_id="t2", engine_id=E)
    done = turns.complete(A, sid, "t2", [{"message": assistant("a2")}], counting_engine)
    assert done.commit is not None and done.commit.status == "committed"
    assert turns.intent(A, sid, "t1") is not None and turns.intent(A, sid, "t1").state == "accepted"


# ---------------------------------------------------------------------------------------------- transitions


def test_identical_rewrites_are_no_ops(store: TranscriptStore, turns: Turns, sid: str) -> None:
    first, intent = turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    again, intent2 = turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    assert again == first and intent2.state == "admitted" and intent2.enqueue_seq == intent.enqueue_seq
    done = turns.complete(A, sid, "t1", [{"message": assistant("a")}], None)
    assert turns.accept(A, sid, "t1", done.terminal) == done.intent
    again2, intent3 = turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    assert again2 == first and intent3.state == "accepted"
    assert len(store.list_entries(A, sid)) == 2


def test_illegal_transitions_are_collisions(store: TranscriptStore, turns: Turns, sid: str) -> None:
    with pytest.raises(OutboxCollision, match="no admitted intent"):
        turns.accept(A, sid, "t0", store.anchor(A, sid, store.append(A, sid, user("x")).entry_id))
    turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    with pytest.raises(OutboxCollision, match="owned by engine"):
        turns.admit(A, sid, user("q"), turn_id="t1", engine_id="engine-2")
    with pytest.raises(IdempotencyConflict):
        turns.admit(A, sid, user("another question"), turn_id="t1", engine_id=E)
    done = turns.complete(A, sid, "t1", [{"message": assistant("a")}, {"message": assistant("b")}], None)
    other = store.anchor(A, sid, store.list_entries(A, sid)[-2].entry_id)
    with pytest.raises(OutboxCollision, match="another terminal"):
        turns.accept(A, sid, "t1", other)
    with pytest.raises(OutboxCollision, match="another terminal"):
        turns.complete(A, sid, "t1", [{"message": assistant("c")}], counting_engine)
    s2 = store.create_session(A, session_id="s2").session_id
    foreign = store.anchor(A, s2, store.append(A, s2, user("y")).entry_id)
    with pytest.raises(InvalidInput, match="another session"):
        turns.accept(A, sid, "t1", foreign)
    # Nothing of the refused attempts was written: the row is as accepted, the transcript is u, a, b.
    assert turns.intent(A, sid, "t1") == done.intent
    assert [e.message for e in store.read_visible(A, sid)][-3:] == [user("q"), assistant("a"), assistant("b")]
    assert turns.drain(engines()).committed == 1
    assert engine_view(store, sid) == (["t1"], 3, 1)


def test_intent_of_an_unknown_session_is_unknown_session(store: TranscriptStore, turns: Turns, sid: str) -> None:
    """None says "no such intent" of a session that is there; a session the scope does not hold (never
    made, another scope's, deleted) is ``UnknownSession``, as every other call of a session says."""
    turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    assert turns.intent(A, sid, "t1") is not None and turns.intent(A, sid, "t9") is None
    other = store.create_session(A, session_id="s2").session_id
    assert turns.intent(A, other, "t1") is None  # known, holding no intent
    for scope, session in (("scope-z", sid), (A, "no-such-session")):
        with pytest.raises(UnknownSession):
            turns.intent(scope, session, "t1")
    store.delete_session(A, other)
    with pytest.raises(UnknownSession):
        turns.intent(A, other, "t1")


def test_intents_page_on_past_the_first_limit(store: TranscriptStore, turns: Turns, sid: str) -> None:
    """``intents_page`` reads the whole outbox a page at a time, in the order of ``intents``, of one scope or
    of every scope: each row once, a row written between pages where it sorts, refusals typed."""
    # "r0" sorts before "s0" and "s1" (a generated id sorted anywhere: after "s1", the first page below held
    # s0's rows, and the check of a row written past the cursor's place failed by chance)
    for session in (sid, store.create_session(A, session_id="s0").session_id,
                    store.create_session(A, session_id="r0").session_id):
        for t in ("t1", "t2"):
            accepted(turns, session, f"{session}-{t}")
        turns.admit(A, session, user("q"), turn_id=f"{session}-t3", engine_id=E)
    store.create_session("scope-b", session_id="s1")
    Turns(store).admit("scope-b", "s1", user("q"), turn_id="b1", engine_id=E)

    def every_page(scope: str | None, limit: int) -> list[TurnIntent]:
        read: list[TurnIntent] = []
        after = None
        while True:
            page = turns.intents_page(scope, after=after, limit=limit)
            assert len(page.intents) <= limit and (page.next is None or len(page.intents) == limit)
            read += page.intents
            if page.next is None:
                return read
            after = page.next

    for scope, total in ((A, 9), (None, 10)):
        whole = turns.intents(scope, limit=10_000)
        assert len(whole) == total and turns.intents(scope, limit=4) == whole[:4]
        for limit in (1, 2, 3, 4, 9, 10, 10_000):
            assert every_page(scope, limit) == whole, (scope, limit)
    first = turns.intents_page(A, limit=4)
    assert first.intents == turns.intents(A, limit=4) and first.next is not None
    # A row written after the cursor's place comes on a later page; rows before it are not read again.
    turns.discard(A, "s0", "s0-t3")
    turns.admit(A, "s0", user("late"), turn_id="s0-late", engine_id=E)
    rest = turns.intents_page(A, after=first.next, limit=10_000)
    assert [i.turn_id for i in first.intents + rest.intents] == [i.turn_id for i in turns.intents(A)]
    assert rest.next is None and "s0-late" in [i.turn_id for i in rest.intents]
    before = turns.intents(None)
    other = turns.intents_page("scope-b", limit=1).intents[0]
    forged = outbox.intent_cursor(other.model_copy(update={"enqueue_seq": 2**31}), "scope-b")
    for scope, after, limit in (
        (A, "tsi1.", 10), (A, "not a cursor", 10), (A, first.next + "x", 10), (A, 7, 10),
        (A, forged, 10), ("scope-b", first.next, 10), (A, None, 0), (A, None, 10_001), (A, None, True),
        ("bad\x00scope", None, 10),
    ):
        with pytest.raises(InvalidInput):
            turns.intents_page(scope, after=after, limit=limit)  # type: ignore[arg-type]
    assert turns.intents(None) == before  # nothing written


def test_an_intent_cursor_is_refused_by_every_other_listing(store: TranscriptStore, turns: Turns, sid: str) -> None:
    """A cursor names the listing that gave it: of one scope, or of every scope (None). The other listing
    refuses it, InvalidInput before anything is read, even where its place is in both (the same token once
    served both); paging a listing with its own cursors is as before."""
    for t in ("t1", "t2"):
        accepted(turns, sid, t)
    turns.admit(A, sid, user("q"), turn_id="t3", engine_id=E)
    store.create_session("scope-b", session_id="s1")
    turns.admit("scope-b", "s1", user("q"), turn_id="b1", engine_id=E)
    scoped = turns.intents_page(A, limit=1)
    every = turns.intents_page(None, limit=1)
    # the same row is the last of both pages: only the listing tells the two cursors apart
    assert scoped.intents == every.intents and scoped.next is not None and every.next is not None
    with pytest.raises(InvalidInput, match="one scope's listing"):
        turns.intents_page(None, after=scoped.next)
    with pytest.raises(InvalidInput, match="every scope's listing"):
        turns.intents_page(A, after=every.next)
    with pytest.raises(InvalidInput, match="another scope's listing"):
        turns.intents_page("scope-b", after=scoped.next)
    with pytest.raises(InvalidInput, match="every scope's listing"):
        turns.intents_page("scope-b", after=every.next)
    assert scoped.next != every.next
    # a cursor of the earlier format, which named no listing, is refused by both
    old = "tsi1." + base64.urlsafe_b64encode(json.dumps([A, sid, 1, "t1"]).encode()).decode().rstrip("=")
    for scope in (A, None):
        with pytest.raises(InvalidInput, match="earlier release"):
            turns.intents_page(scope, after=old)
    # each listing pages on with its own cursors, as before
    assert [i.turn_id for i in turns.intents_page(A, after=scoped.next).intents] == ["t2", "t3"]
    assert [i.turn_id for i in turns.intents_page(None, after=every.next).intents] == ["t2", "t3", "b1"]


def test_discard_deletes_only_an_admitted_intent(store: TranscriptStore, turns: Turns, sid: str) -> None:
    turns.admit(A, sid, user("q1"), turn_id="t1", engine_id=E)
    assert turns.discard(A, sid, "t1") is True
    assert turns.intent(A, sid, "t1") is None
    assert turns.discard(A, sid, "t1") is False
    assert turns.discard(A, sid, "never") is False
    accepted(turns, sid, "t2")
    assert turns.discard(A, sid, "t2") is False
    assert turns.intent(A, sid, "t2") is not None
    report = turns.drain(engines())
    assert report.committed == 1
    assert engine_view(store, sid)[0] == ["t2"]  # admission alone (t1) never advanced the engine


def test_completion_needs_a_terminal_message(turns: Turns, sid: str) -> None:
    turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    with pytest.raises(InvalidInput, match="at least one reply message"):
        turns.complete(A, sid, "t1", [], counting_engine)
    with pytest.raises(InvalidInput, match="at least one reply message"):
        turns.complete(A, sid, "t1", [{"kind": "custom", "payload": {"x": 1}}], counting_engine)
    assert row_of(turns, sid, "t1").state == "admitted"


# ---------------------------------------------------------------------------------------------- stale turns


def test_rewrite_after_acceptance_blocks_the_turn_as_stale(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    done = accepted(turns, sid, "t1")
    edit = {"entry_id": done.intent.admission.anchor.entry_id, "message": user("edited")}
    rewrite = store.rewrite_entries(A, sid, [edit])
    assert rewrite.changed
    engine = Recorder()
    report = turns.drain(engines(engine))
    assert (report.blocked, report.committed, engine.calls) == (1, 0, [])
    row = turns.intent(A, sid, "t1")
    assert row is not None and row.state == "blocked" and row.block_reason is not None
    assert row.block_reason.startswith("stale")
    assert engine_view(store, sid) == ([], 0, None)
    assert turns.drain(engines(engine)).blocked == 0  # kept as audit evidence, never retried
    recovery = turns.recover(A, sid, E, engines(engine))
    assert not recovery.must_degrade and engine.calls == []
    assert [i.turn_id for i in turns.intents(A)] == ["t1"]


def test_branch_after_acceptance_blocks_the_turn_as_stale(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    done = accepted(turns, sid, "t1", replies=2)
    store.branch(A, sid, done.intent.admission.anchor.entry_id)  # the terminal leaves the active branch
    engine = Recorder()
    report = turns.drain(engines(engine))
    assert (report.blocked, report.committed, engine.calls) == (1, 0, [])
    row = turns.intent(A, sid, "t1")
    assert row is not None and row.state == "blocked" and (row.block_reason or "").startswith("stale")
    assert engine_view(store, sid) == ([], 0, None)


def test_blocked_rows_do_not_hold_later_turns(store: TranscriptStore, turns: Turns, sid: str) -> None:
    store.append(A, sid, user("before"))
    store.append(A, sid, assistant("before"))
    done = accepted(turns, sid, "t1")
    store.branch(A, sid, store.list_entries(A, sid)[1].entry_id)  # abandon t1's branch
    turns.admit(A, sid, user("q2"), turn_id="t2", engine_id=E)
    later = turns.complete(A, sid, "t2", [{"message": assistant("a2")}], counting_engine)
    assert later.commit is None  # t1 is still accepted (not known stale yet): t2 queues behind it
    report = turns.drain(engines())
    assert (report.blocked, report.committed) == (1, 1)
    assert row_of(turns, sid, "t1").state == "blocked"
    assert engine_view(store, sid) == (["t2"], 2, 1)
    # With t1 blocked, the next turn takes the fast path again.
    turns.admit(A, sid, user("q3"), turn_id="t3", engine_id=E)
    third = turns.complete(A, sid, "t3", [{"message": assistant("a3")}], counting_engine)
    assert third.commit is not None and third.commit.status == "committed"
    assert engine_view(store, sid) == (["t2", "t3"], 4, 2)
    assert done.intent.turn_id == "t1"


def test_append_only_change_after_acceptance_still_commits_once(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    done = accepted(turns, sid, "t1", replies=2)
    store.append(A, sid, kind="custom", payload={"note": "later event"})
    store.append(A, sid, user("a later message"))
    closed = store.read_closed_range(done.intent.admission, done.terminal)
    assert closed.status == "ok"
    report = turns.drain(engines())
    assert (report.committed, report.blocked, report.duplicates) == (1, 0, 0)
    assert engine_view(store, sid) == (["t1"], 3, 1)
    assert turns.drain(engines()).delivered == 0
    receipts = turns.receipts(A, sid, E)
    assert [(r.advancement_key, r.message_count) for r in receipts] == [("t1", 3)]


def _as_written_without_incarnations(store: TranscriptStore, sid: str, turn_id: str) -> None:
    """Rewrite an outbox row as a release whose anchors had no incarnation wrote it."""
    from sqlalchemy import text

    def run(c: Core) -> None:
        row = c.conn.execute(text("SELECT admission, terminal FROM ts_outbox WHERE session_id = :s AND turn_id = :t"),
                             {"s": sid, "t": turn_id}).one()
        admission = json.loads(row.admission)
        del admission["anchor"]["incarnation"]
        terminal = None if row.terminal is None else json.loads(row.terminal)
        if terminal is not None:
            del terminal["incarnation"]
        c.conn.execute(
            text("UPDATE ts_outbox SET admission = :a, terminal = :m WHERE session_id = :s AND turn_id = :t"),
            {"a": json.dumps(admission), "m": terminal and json.dumps(terminal), "s": sid, "t": turn_id},
        )

    store.write(run)


def test_turns_queued_by_a_release_without_anchor_incarnations_are_delivered(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """Releases between b80616f and 8d8a4a9 gave new sessions random incarnations but wrote anchors
    without one; such a session honours no anchor without one, so after an update their queued turns
    were blocked as stale and never reached the engine. An outbox row goes with its session, so it is
    of the session's present incarnation: delivered, once; an admitted one completes."""
    assert store.get_session(A, sid).incarnation != int(store.get_session(A, sid).created_at.timestamp() * 1e6)
    accepted(turns, sid, "t1")
    _as_written_without_incarnations(store, sid, "t1")
    assert row_of(turns, sid, "t1").admission.anchor.incarnation == store.get_session(A, sid).incarnation
    report = turns.drain(engines())
    assert (report.committed, report.blocked) == (1, 0), report
    turns.admit(A, sid, user("q t2"), turn_id="t2", engine_id=E)
    _as_written_without_incarnations(store, sid, "t2")
    done = turns.complete(A, sid, "t2", [{"message": assistant("a t2")}], None)
    assert done.intent.state == "accepted"
    assert (turns.drain(engines()).committed, engine_view(store, sid)[0]) == (1, ["t1", "t2"])


# ---------------------------------------------------------------------------------------------- failures


def test_failed_commit_is_not_overtaken_while_other_sessions_proceed(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    s2 = store.create_session(A, session_id="s2").session_id
    accepted(turns, sid, "t1")
    accepted(turns, sid, "t2")
    accepted(turns, s2, "u1")
    accepted(turns, s2, "u2")
    engine = Recorder(lambda t: t.session_id == sid)
    report = turns.drain(engines(engine))
    assert report.committed == 2
    assert [(s, t) for s, t, _ in report.failed] == [(sid, "t1")]
    assert report.failed[0][2] == "RuntimeError: engine refused t1"
    assert report.stopped_sessions == [sid]
    assert engine.calls == ["t1", "u1", "u2"]  # t2 never reached the engine
    assert engine_view(store, sid) == ([], 0, None)
    assert engine_view(store, s2)[0] == ["u1", "u2"]
    row = turns.intent(A, sid, "t1")
    assert row is not None and row.state == "ready"
    assert (row.attempt_count, row.last_error) == (1, "RuntimeError: engine refused t1")
    assert row.last_attempt_at is not None and row.lease_owner is None

    again = turns.drain(engines(engine))
    assert again.committed == 0 and row_of(turns, sid, "t1").attempt_count == 2
    fixed = turns.drain(engines())
    assert fixed.committed == 2
    assert engine_view(store, sid) == (["t1", "t2"], 4, 2)


def test_a_turn_its_engine_can_never_take_is_blocked_by_hand_and_the_next_ones_go_on(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """A delivery that fails the same way every time held every later turn of its engine and session
    back for good (and the host ran that session on legacy meanwhile): an operator blocks it."""
    accepted(turns, sid, "t1")
    accepted(turns, sid, "t2")
    turns.admit(A, sid, user("q t3"), turn_id="t3", engine_id=E)
    engine = Recorder(lambda t: t.advancement_key == "t1")
    for _ in range(2):
        assert turns.drain(engines(engine)).committed == 0
    assert [i.turn_id for i in store.read(lambda c: outbox.pending(c, A, sid, E))] == ["t1", "t2", "t3"]
    before = turns.intents(A)
    refused = [(("t9", "never works"), UnknownTurn), (("t3", "running"), InvalidInput), (("t1", "  "), InvalidInput),
               (("t1", "x\x00"), InvalidInput), (("t1", "y" * 501), InvalidInput)]
    for bad, error in refused:
        with pytest.raises(error):
            turns.block(A, sid, *bad)
    with pytest.raises(UnknownSession):
        turns.block("other-scope", sid, "t1", "not its scope")
    assert turns.intents(A) == before  # refused: nothing written
    blocked = turns.block(A, sid, "t1", "the engine refuses it:\n every time")
    assert (blocked.state, blocked.block_reason) == ("blocked", "blocked by hand: the engine refuses it: every time")
    assert turns.block(A, sid, "t1", "again") == blocked  # already blocked: unchanged
    report = turns.drain(engines(engine))
    assert (report.committed, report.failed) == (1, [])
    assert engine_view(store, sid)[0] == ["t2"] and engine.calls.count("t1") == 2  # t1 never committed
    assert [i.turn_id for i in store.read(lambda c: outbox.pending(c, A, sid, E))] == ["t3"]
    assert [(i.turn_id, i.state) for i in turns.intents(A)] == [("t1", "blocked"), ("t3", "admitted")]


def test_a_turn_blocked_by_hand_while_an_overdue_delivery_runs_is_never_committed(
    store: TranscriptStore, sid: str
) -> None:
    """A delivery that outlives its claim's lease (its renewals stalled: a process paused past it): an
    operator may block the row meanwhile. The delivery's commit then finds the row no longer its own
    and rolls back with the engine's commit (it ignored that and left a "blocked" row whose turn the
    engine had). While the claim is renewed, the block is refused. On SQLite writes queue: the block
    waits for the delivery, which commits, and finds no row left."""
    import threading
    import time

    from sqlalchemy import update

    from transcript_store.schema import outbox as outbox_table

    turns = Turns(store, OutboxConfig(delivery_lease_seconds=3.0))
    accepted(turns, sid, "t1")
    # Events, not sleeps: on a loaded machine the drain had not reached the engine 0.3 s after it started,
    # or the engine's 1.2 s ran out before the operator's block (PostgreSQL).
    in_engine, blocked = threading.Event(), threading.Event()

    def slow(c: Core, turn: TurnPayload) -> CommitResult:
        in_engine.set()
        if store.db.dialect.is_sqlite:
            time.sleep(0.5)  # the block waits for this delivery's write lock, whatever it takes
        else:
            assert blocked.wait(30), "the operator's block never came"
        return counting_engine(c, turn)

    reports: list[Any] = []
    drain = threading.Thread(target=lambda: reports.append(turns.drain(engines(slow))))
    drain.start()
    try:
        assert in_engine.wait(30)  # the delivery is in the engine; its claim is renewed every second
        if store.db.dialect.is_sqlite:
            with pytest.raises(UnknownTurn):
                turns.block(A, sid, "t1", "taking it out")
            drain.join()
            assert reports[0].committed == 1 and engine_view(store, sid)[0] == ["t1"]
            return
        with pytest.raises(InvalidInput, match="being delivered now"):
            turns.block(A, sid, "t1", "taking it out")
        # The claim's lease runs out (the stalled renewals), and the operator blocks the row at once. A
        # renewal (every second) landing between the two took the claim back: its lease runs out again.
        for _ in range(10):
            store.write(lambda c: c.conn.execute(update(outbox_table).values(lease_expires_us=0)))
            try:
                assert turns.block(A, sid, "t1", "taking it out").state == "blocked"
                break
            except InvalidInput as e:
                assert "being delivered now" in str(e)
        else:
            pytest.fail("the operator's block was refused ten times")
    finally:
        blocked.set()
        drain.join(60)
    assert (reports[0].committed, reports[0].failed) == (0, [])
    assert engine_view(store, sid) == ([], 0, None) and turns.receipts(A, sid, E) == []
    assert row_of(turns, sid, "t1").state == "blocked"


@pytest.mark.parametrize("bad", [None, "committed", 42, "bogus-status"], ids=repr)
def test_invalid_commit_result_is_recorded_and_keeps_the_row_queued(
    store: TranscriptStore, turns: Turns, sid: str, bad: Any
) -> None:
    accepted(turns, sid, "t1")

    def invalid(c: Core, turn: TurnPayload) -> Any:
        result = commit_turn_in(c, turn, count_turn)  # written, then rolled back with the bad result
        if bad == "bogus-status":
            return result.model_copy(update={"status": "bogus"})
        return bad

    report = turns.drain(engines(invalid))
    assert report.delivered == 0 and len(report.failed) == 1
    row = turns.intent(A, sid, "t1")
    assert row is not None and row.state == "ready" and row.attempt_count == 1
    assert row.last_error is not None and row.last_error.startswith("TranscriptStoreError: invalid commit_turn result")
    assert engine_view(store, sid) == ([], 0, None)
    assert turns.receipts(A, sid) == []


def test_invalid_commit_result_on_the_fast_path_queues_the_turn(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    def no_result(c: Core, turn: TurnPayload) -> Any:
        return None

    done = turns.complete(A, sid, "t1", [{"message": assistant("a")}], no_result)
    assert done.commit is None and "invalid commit_turn result" in (done.fast_path_error or "")
    assert done.intent.state == "accepted" and turns.receipts(A, sid) == []
    assert turns.drain(engines()).committed == 1


def test_unavailable_engine_keeps_the_row(store: TranscriptStore, turns: Turns, sid: str) -> None:
    accepted(turns, sid, "t1", engine="engine-2")
    report = turns.drain(engines())
    assert [f[2] for f in report.failed] == ["engine unavailable"]
    row = turns.intent(A, sid, "t1")
    assert row is not None and row.state == "ready" and row.attempt_count == 1


def test_an_engine_lookup_that_raises_fails_only_its_rows(store: TranscriptStore, turns: Turns, sid: str) -> None:
    s2 = store.create_session(A, session_id="s2").session_id
    accepted(turns, sid, "t1", engine="engine-2")
    accepted(turns, s2, "u1")

    def lookup(engine_id: str) -> CommitIn | None:
        if engine_id == "engine-2":
            raise RuntimeError("plugin failed to load")
        return counting_engine

    report = turns.drain(lookup)
    assert report.committed == 1 and report.stopped_sessions == [sid]
    assert report.failed == [(sid, "t1", "RuntimeError: plugin failed to load")]
    row = turns.intent(A, sid, "t1")
    assert row is not None and (row.attempt_count, row.lease_owner) == (1, None)
    assert row.last_error == "RuntimeError: plugin failed to load"
    # The claim was released: the next drain delivers at once instead of waiting out a lease.
    assert turns.drain(lambda _e: counting_engine).committed == 1


def test_observer_failure_never_requeues(store: TranscriptStore, turns: Turns, sid: str) -> None:
    accepted(turns, sid, "t1")
    seen: list[tuple[str, str]] = []

    def observer(intent: TurnIntent, result: CommitResult) -> None:
        seen.append((intent.turn_id, result.status))
        raise RuntimeError("observer broke")

    report = turns.drain(engines(), on_committed=observer)
    assert (report.committed, report.failed, seen) == (1, [], [("t1", "committed")])
    assert turns.intent(A, sid, "t1") is None
    assert turns.drain(engines(), on_committed=observer).delivered == 0
    assert engine_view(store, sid) == (["t1"], 2, 1)


def test_a_replayed_delivery_is_a_duplicate_and_completes_the_row(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    done = accepted(turns, sid, "t1")
    ready = store.write(lambda c: capture(c, done.intent))
    assert ready.state == "ready" and ready.messages is not None
    payload = turn_payload(ready)
    assert turns.commit_turn(E, "t1", ready.admission, payload.terminal, payload.messages).status == "committed"
    report = turns.drain(engines())
    assert (report.committed, report.duplicates) == (0, 1)
    assert turns.intent(A, sid, "t1") is None


# ---------------------------------------------------------------------------------------------- order


def test_strict_enqueue_order_per_session(store: TranscriptStore, turns: Turns, sid: str) -> None:
    accepted(turns, sid, "t1")
    accepted(turns, sid, "t2")
    refusing = Recorder(lambda t: t.advancement_key == "t1")
    report = turns.drain(engines(refusing))
    assert report.delivered == 0 and report.stopped_sessions == [sid]  # t1 failed: t2 waits behind it
    assert refusing.calls == ["t1"]
    assert turns.drain(engines()).committed == 2
    assert engine_view(store, sid)[0] == ["t1", "t2"]


def test_round_robin_across_sessions_with_a_drain_limit(store: TranscriptStore, turns: Turns) -> None:
    sessions = [store.create_session(A, session_id=f"s{i}").session_id for i in range(3)]
    for n in range(3):
        for s in sessions:
            accepted(turns, s, f"{s}-t{n}")
    order: list[str] = []
    report = turns.drain(engines(), limit=4, on_committed=lambda i, _r: order.append(i.turn_id))
    assert report.committed == 4
    assert order == ["s0-t0", "s1-t0", "s2-t0", "s0-t1"]
    turns.drain(engines(), on_committed=lambda i, _r: order.append(i.turn_id))
    # Each drain starts a new round-robin: one head per session per round, in session order.
    assert order[4:] == ["s0-t2", "s1-t1", "s2-t1", "s1-t2", "s2-t2"]
    for s in sessions:
        assert engine_view(store, s)[0] == [f"{s}-t{n}" for n in range(3)]


def test_default_drain_limit_is_16(store: TranscriptStore, turns: Turns) -> None:
    sessions = [store.create_session(A, session_id=f"s{i}").session_id for i in range(5)]
    for n in range(4):
        for s in sessions:
            accepted(turns, s, f"{s}-t{n}")
    assert turns.config.drain_limit == 16
    assert turns.drain(engines()).committed == 16
    assert turns.drain(engines()).committed == 4


# ---------------------------------------------------------------------------------------------- leases


def test_a_live_delivery_claim_holds_the_session(store: TranscriptStore, turns: Turns, sid: str) -> None:
    accepted(turns, sid, "t1")
    group = (A, sid, E)
    claimed = store.write(lambda c: claim_head(c, group, "dead-worker", 60.0))
    assert isinstance(claimed, TurnIntent) and (claimed.state, claimed.lease_owner) == ("ready", "dead-worker")
    assert store.write(lambda c: claim_head(c, group, "other", 60.0)) == "leased"
    report = turns.drain(engines())
    assert report.delivered == 0 and report.stopped_sessions == [sid]
    assert turns.recover(A, sid, E, engines()).must_degrade
    assert engine_view(store, sid) == ([], 0, None)


def test_a_delivery_claim_of_a_dead_process_is_taken_over_at_once(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """A drain killed mid-delivery leaves its claim (60 s lease): where its process is provably gone from
    this machine, the next drain takes the row over at once instead of stopping the session a minute."""
    accepted(turns, sid, "t1")
    child = subprocess.run(
        [sys.executable, "-c", "from transcript_store import identity; print(identity.current())"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    gone = f"{child.stdout.strip()}/0badc0de"  # a drain's owner: process identity / token
    claimed = store.write(lambda c: claim_head(c, (A, sid, E), gone, 60.0))
    assert isinstance(claimed, TurnIntent) and claimed.lease_owner == gone
    report = turns.drain(engines())
    assert report.committed == 1 and report.stopped_sessions == []
    assert engine_view(store, sid) == (["t1"], 2, 1)


def test_an_expired_delivery_claim_is_taken_over(store: TranscriptStore, turns: Turns, sid: str) -> None:
    accepted(turns, sid, "t1")
    claimed = store.write(lambda c: claim_head(c, (A, sid, E), "dead-worker", 0.0))
    assert isinstance(claimed, TurnIntent)
    report = turns.drain(engines())
    assert report.committed == 1
    assert engine_view(store, sid) == (["t1"], 2, 1)


# ---------------------------------------------------------------------------------------------- recovery


def test_recovery_discards_admitted_intents_with_expired_leases(
    store: TranscriptStore, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    short = Turns(store, OutboxConfig(turn_lease_seconds=0.0))
    short.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    report = short.recover(A, sid, E, engines())
    assert report.discarded == ["t1"] and not report.must_degrade
    assert short.intent(A, sid, "t1") is None
    assert "recovery found no host acceptance" in caplog.text
    assert engine_view(store, sid) == ([], 0, None)
    assert [e.turn_id for e in store.read_visible(A, sid)] == ["t1"]  # the transcript keeps the entry


def test_recovery_never_discards_a_turn_a_retry_has_just_taken_over(
    store: TranscriptStore, turns: Turns, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    short = Turns(store, OutboxConfig(turn_lease_seconds=0.0))
    short.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    seen_expired = store.read(lambda c: outbox.abandoned_admitted(c, A, sid))
    assert [i.turn_id for i in seen_expired] == ["t1"]
    # Between recovery's read and its discard, a retrying worker takes the turn over (a fresh lease).
    turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    monkeypatch.setattr(outbox, "abandoned_admitted", lambda c, scope, session_id: seen_expired)
    report = short.recover(A, sid, E, engines())
    assert report.discarded == [] and report.pending == ["t1"]
    done = turns.complete(A, sid, "t1", [{"message": assistant("a")}], counting_engine)
    assert done.commit is not None and done.commit.status == "committed"


def test_recovery_keeps_a_live_admitted_turn_and_degrades(store: TranscriptStore, turns: Turns, sid: str) -> None:
    turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    report = turns.recover(A, sid, E, engines())
    assert report.discarded == [] and report.pending == ["t1"] and report.must_degrade
    assert row_of(turns, sid, "t1").state == "admitted"


def test_recovery_captures_and_delivers_an_accepted_turn(store: TranscriptStore, turns: Turns, sid: str) -> None:
    accepted(turns, sid, "t1", replies=2)
    report = turns.recover(A, sid, E, engines())
    assert report.drain.committed == 1 and not report.must_degrade
    assert turns.intent(A, sid, "t1") is None
    assert engine_view(store, sid) == (["t1"], 3, 1)


def test_recovery_delivers_a_ready_turn(store: TranscriptStore, turns: Turns, sid: str) -> None:
    done = accepted(turns, sid, "t1")
    assert store.write(lambda c: capture(c, done.intent)).state == "ready"
    assert row_of(turns, sid, "t1").state == "ready"
    report = turns.recover(A, sid, E, engines())
    assert report.drain.committed == 1 and not report.must_degrade
    assert engine_view(store, sid) == (["t1"], 2, 1)


def test_recovery_reports_pending_when_an_earlier_turn_stays_queued(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    accepted(turns, sid, "t1")
    accepted(turns, sid, "t2")
    report = turns.recover(A, sid, E, engines(Recorder(lambda _t: True)))
    assert report.must_degrade and report.pending == ["t1", "t2"]
    assert [t for _, t, _ in report.drain.failed] == ["t1"]
    report = turns.recover(A, sid, E, engines())
    assert not report.must_degrade and report.drain.committed == 2
    assert engine_view(store, sid) == (["t1", "t2"], 4, 2)


def test_recovery_is_per_session_and_per_engine(store: TranscriptStore, turns: Turns, sid: str) -> None:
    s2 = store.create_session(A, session_id="s2").session_id
    accepted(turns, s2, "u1")
    accepted(turns, sid, "t1", engine="engine-2")
    report = turns.recover(A, sid, E, engines())
    assert not report.must_degrade  # engine-2's queue is not this engine's
    assert turns.intent(A, s2, "u1") is not None  # another session is not touched


@pytest.mark.parametrize("fast", [True, False])
def test_re_admitting_a_committed_turn_is_refused_and_writes_nothing(
    store: TranscriptStore, turns: Turns, sid: str, fast: bool
) -> None:
    """A worker retrying a turn id another attempt already delivered (its intent deleted then) was
    given a fresh admitted intent: its replies landed a second time and its commit collided with the
    receipt on every drain, holding the session's later turns back. Refused instead."""
    turns.admit(A, sid, user("q1"), turn_id="t1", engine_id=E)
    turns.complete(A, sid, "t1", [{"message": assistant("a1")}], counting_engine if fast else None)
    if not fast:
        assert turns.drain(engines()).committed == 1
    assert turns.intent(A, sid, "t1") is None
    before = store.list_entries(A, sid)
    with pytest.raises(OutboxCollision, match="already committed"):
        turns.admit(A, sid, user("q1"), turn_id="t1", engine_id=E)
    assert turns.intent(A, sid, "t1") is None and store.list_entries(A, sid) == before
    # The session goes on; a turn id whose attempt failed before it was accepted is still admitted again.
    turns.admit(A, sid, user("q2"), turn_id="t2", engine_id=E)
    assert turns.discard(A, sid, "t2")
    assert turns.admit(A, sid, user("q2"), turn_id="t2", engine_id=E)[1].state == "admitted"
    turns.complete(A, sid, "t2", [{"message": assistant("a2")}], counting_engine)
    assert engine_view(store, sid)[0] == ["t1", "t2"]


def test_re_admitting_a_turn_delivered_with_its_admission_as_terminal_is_refused(
    store: TranscriptStore, turns: Turns, sid: str
) -> None:
    """A turn accepted with the admitted entry itself as its terminal (nothing follows it) and delivered:
    admitted again, it ran again, its new replies collided with the receipt on every drain."""
    admission, _ = turns.admit(A, sid, user("q1"), turn_id="t1", engine_id=E)
    turns.accept(A, sid, "t1", admission.anchor)
    assert turns.drain(engines()).committed == 1 and turns.intent(A, sid, "t1") is None
    before = store.list_entries(A, sid)
    with pytest.raises(OutboxCollision, match="already committed"):
        turns.admit(A, sid, user("q1"), turn_id="t1", engine_id=E)
    assert turns.intent(A, sid, "t1") is None and store.list_entries(A, sid) == before


@pytest.mark.parametrize("fast", [True, False])
def test_a_reply_keyed_as_an_earlier_turns_entry_is_refused_not_blocked_at_the_drain(
    store: TranscriptStore, turns: Turns, sid: str, fast: bool
) -> None:
    """A reply whose idempotency key (or entry id) names an earlier turn's entry is not appended again:
    the turn was accepted with that entry as its terminal and blocked as non_descendant, or accepted
    without that reply. Refused instead, before anything is written; the intent stays admitted."""
    turns.admit(A, sid, user("q1"), turn_id="t1", engine_id=E)
    first = turns.complete(A, sid, "t1", [{"message": assistant("ok"), "idempotency_key": "r"}], counting_engine)
    turns.admit(A, sid, user("q2"), turn_id="t2", engine_id=E)
    before = store.list_entries(A, sid)
    for replies in (
        [{"message": assistant("ok"), "idempotency_key": "r"}],
        [{"message": assistant("ok"), "idempotency_key": "r"}, {"message": assistant("more")}],
        [{"message": assistant("ok"), "entry_id": first.terminal.entry_id}],
    ):
        with pytest.raises(IdempotencyConflict, match="before its admission"):
            turns.complete(A, sid, "t2", replies, counting_engine if fast else None)
        assert turns.intent(A, sid, "t2").state == "admitted"
        assert store.list_entries(A, sid) == before
    done = turns.complete(A, sid, "t2", [{"message": assistant("ok"), "idempotency_key": "r2"}], None)
    # A retry of that completion finds its own replies, after the admission: the same acceptance.
    again = turns.complete(A, sid, "t2", [{"message": assistant("ok"), "idempotency_key": "r2"}], None)
    assert again.terminal == done.terminal and again.intent.state == "accepted"
    assert turns.drain(engines()).committed == 1


def test_a_completion_refused_by_its_own_checks_is_not_queued(
    store: TranscriptStore, turns: Turns, sid: str, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fast completion refused before its engine was reached (a reply naming an earlier entry, an unknown
    session) raises that refusal at once: the slow path runs the same checks, so its second transaction
    is not run, and the log does not say "queueing it" of a turn that nothing queued."""
    turns.admit(A, sid, user("q1"), turn_id="t1", engine_id=E)
    turns.complete(A, sid, "t1", [{"message": assistant("ok"), "idempotency_key": "r"}], counting_engine)
    turns.admit(A, sid, user("q2"), turn_id="t2", engine_id=E)
    before = store.list_entries(A, sid), turns.intents(A), turns.receipts(A, sid)
    writes: list[str] = []
    write = store.write
    monkeypatch.setattr(store, "write", lambda fn: (writes.append(getattr(fn, "__name__", "?")), write(fn))[1])
    engine = Recorder()
    caplog.set_level(logging.INFO, logger="transcript_store.turns")
    for session, error in ((sid, IdempotencyConflict), ("no-such-session", UnknownSession)):
        writes.clear()
        caplog.clear()
        with pytest.raises(error):
            turns.complete(A, session, "t2", [{"message": assistant("ok"), "idempotency_key": "r"}], engine)
        assert writes == ["fast"], "the slow path ran for a refusal it repeats"
        assert not any("queue" in r.getMessage() and "nothing" not in r.getMessage() for r in caplog.records)
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        assert "nothing written or queued" in caplog.records[0].getMessage()
        assert (store.list_entries(A, sid), turns.intents(A), turns.receipts(A, sid)) == before
    assert engine.calls == []
    # The engine's own failure is still queued for the drain, and the log says so once it is.
    writes.clear()
    caplog.clear()
    done = turns.complete(A, sid, "t2", [{"message": assistant("ok2")}], Recorder(lambda _t: True))
    assert done.commit is None and done.intent.state == "accepted" and writes == ["fast", "slow"]
    assert [r.getMessage() for r in caplog.records] == [
        "fast completion of turn t2 failed, queued for the drain: RuntimeError: engine refused t2"
    ]


def test_accept_refuses_a_terminal_that_names_no_stored_message(store: TranscriptStore, turns: Turns, sid: str) -> None:
    """Refused, not accepted and blocked later at the drain: the intent stays admitted."""
    before = store.anchor(A, sid, store.append(A, sid, user("earlier")).entry_id)
    turns.admit(A, sid, user("q"), turn_id="t1", engine_id=E)
    reply = store.append(A, sid, assistant("a"))
    real = store.anchor(A, sid, reply.entry_id)
    event = store.append(A, sid, kind="metadata", payload={"note": "not a message"})
    for forged in (
        before,  # a stored message as it is, but before the admission: never the turn's terminal
        real.model_copy(update={"entry_id": "no-such-entry"}),
        real.model_copy(update={"seq": real.seq + 5}),
        real.model_copy(update={"position": 9}),
        real.model_copy(update={"entry_id": event.entry_id, "seq": event.seq, "parent_id": event.parent_id}),
    ):
        with pytest.raises(InvalidInput, match="terminal"):
            turns.accept(A, sid, "t1", forged)
        assert turns.intent(A, sid, "t1").state == "admitted"
    assert turns.accept(A, sid, "t1", real).state == "accepted"
