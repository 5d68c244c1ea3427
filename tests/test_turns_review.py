"""A hostile review of the turn API (``Turns``): what a caller building its own anchors, leases and
configs can do, and what an uncertain commit or a changed transcript leaves behind, on both backends.

Each test here failed on the code before its fix (see the docstrings).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from conftest import assistant, module_store_fixtures, user
from sqlalchemy import Connection
from test_compaction_focus import everything
from test_outbox_review import commits_lost
from workers.turn_worker import count_turn, counting_engine

from transcript_store import TranscriptStore, TransientStoreError
from transcript_store.core import Core
from transcript_store.errors import InvalidInput, PayloadTooLarge
from transcript_store.fences import MAX_TURN_BYTES
from transcript_store.ledger import CommitResult, TurnPayload
from transcript_store.outbox import MAX_DRAIN, AdmittedLease, OutboxConfig
from transcript_store.turns import CommitIn, Turns, new_owner

S = "turns-review"
E = "engine-1"

shared_url, store, sid = module_store_fixtures(S, "turns-review")


def only(deliver: CommitIn) -> Any:
    return lambda engine_id: deliver if engine_id == E else None


def broken(c: Core, turn: TurnPayload) -> CommitResult:
    raise RuntimeError("engine down")


def captured_then_failed(turns: Turns, session_id: str, turn_id: str, text: str) -> Any:
    """A turn accepted, captured by a drain (ready) whose delivery failed: its admission."""
    admission, _ = turns.admit(S, session_id, user(text), turn_id=turn_id, engine_id=E)
    turns.complete(S, session_id, turn_id, [{"message": assistant(f"re {text}")}], None)
    report = turns.drain(only(broken))
    assert report.failed and turns.intent(S, session_id, turn_id).state == "ready"
    return admission


@pytest.mark.parametrize("change", ["rewrite", "branch"])
def test_a_captured_turn_whose_transcript_changed_is_blocked_not_retried_forever(
    store: TranscriptStore, sid: str, change: str
) -> None:
    """A ready row (captured, its delivery failed) was sent to the ledger as it was after the session
    was rewritten: refused at every drain ("generation mismatch"), it held the engine's later turns of
    the session back for good. After a branch away it was committed though off the active branch,
    while an accepted row in its place was blocked. Both are now checked again and blocked."""
    turns = Turns(store)
    admission = captured_then_failed(turns, sid, "t1", "first")
    if change == "rewrite":
        store.rewrite_entries(S, sid, [{"entry_id": admission.anchor.entry_id, "message": user("first, edited")}])
    else:
        store.branch(S, sid, admission.anchor.parent_id)
    turns.admit(S, sid, user("second"), turn_id="t2", engine_id=E)
    turns.complete(S, sid, "t2", [{"message": assistant("re second")}], None)
    report = turns.drain(only(counting_engine))
    assert report.blocked == 1 and report.committed == 1 and not report.failed
    blocked = turns.intent(S, sid, "t1")
    assert blocked is not None and blocked.state == "blocked"
    assert blocked.block_reason and blocked.block_reason.startswith(("stale", "non_descendant"))
    assert turns.intent(S, sid, "t2") is None  # delivered
    assert [r.advancement_key for r in turns.receipts(S, sid)] == ["t2"]
    assert not turns.recover(S, sid, E, only(counting_engine)).must_degrade


def test_a_captured_turn_whose_transcript_held_is_still_delivered(store: TranscriptStore, sid: str) -> None:
    turns = Turns(store)
    captured_then_failed(turns, sid, "t1", "first")
    report = turns.drain(only(counting_engine))
    assert report.committed == 1 and report.blocked == 0
    assert [r.advancement_key for r in turns.receipts(S, sid)] == ["t1"]


def test_accept_refuses_a_terminal_the_turn_can_never_close_with(store: TranscriptStore, sid: str) -> None:
    """Turns.accept took a terminal of a generation or incarnation the session does not have, or on a
    branch not descending from the admission: the acceptance stood, the drain blocked the turn for
    good, and the genuine terminal was refused (OutboxCollision) after it."""
    turns = Turns(store)
    admission, _ = turns.admit(S, sid, user("q"), turn_id="t1", engine_id=E)
    real = store.anchor(S, sid, store.append(S, sid, assistant("a")).entry_id)
    store.branch(S, sid, admission.anchor.parent_id)  # a sibling of the admitted entry
    elsewhere = store.anchor(S, sid, store.append(S, sid, assistant("elsewhere")).entry_id)
    store.branch(S, sid, real.entry_id)
    forged = {
        "generation": real.model_copy(update={"generation": real.generation + 1}),
        "incarnation": real.model_copy(update={"incarnation": (real.incarnation or 0) + 1}),
        "idempotency key": real.model_copy(update={"idempotency_key": "not-its-key"}),
        "non-descendant": elsewhere,
    }
    before = everything(store)
    for what, terminal in forged.items():
        with pytest.raises(InvalidInput):
            turns.accept(S, sid, "t1", terminal)
        assert everything(store) == before, what
    assert turns.accept(S, sid, "t1", real).state == "accepted"
    assert turns.drain(only(counting_engine)).committed == 1


HOSTILE_LEASES = [
    AdmittedLease("t1", "someone", "soon"),  # type: ignore[arg-type]
    AdmittedLease("t1", "someone", 2**70),
    AdmittedLease("t1", "someone", True),  # type: ignore[arg-type]
    AdmittedLease("t1", "someone", -1),
    AdmittedLease("t1", "bad\x00owner", 1),
    AdmittedLease("t1", "\ud800", 1),
    AdmittedLease("t1", 12345, 1),  # type: ignore[arg-type]
    AdmittedLease("t1", "x" * 500, 1),
]


@pytest.mark.parametrize("lease", HOSTILE_LEASES, ids=range(len(HOSTILE_LEASES)))
def test_hand_back_checks_the_lease_it_is_given(store: TranscriptStore, sid: str, lease: AdmittedLease) -> None:
    """The lease's owner and expiry reached arithmetic and the row unchecked: TypeError, OverflowError,
    UnicodeEncodeError, or a NUL owner written to the row."""
    turns = Turns(store)
    me = new_owner()
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id=E, owner=me)
    before = everything(store)
    with pytest.raises(InvalidInput):
        turns.hand_back(S, sid, "t1", owner=me, lease=lease)
    assert everything(store) == before


@contextmanager
def statement_reply_lost(store: TranscriptStore) -> Iterator[None]:
    """The next one-statement write commits, then its caller sees the connection drop."""
    real = store.db._statement
    armed = [True]

    @contextmanager
    def lossy() -> Iterator[Connection]:
        with real() as conn:
            yield conn
        if armed[0]:
            armed[0] = False
            raise TransientStoreError("injected: connection lost after the statement committed")

    store.db._statement = lossy  # type: ignore[method-assign]
    try:
        yield
    finally:
        store.db._statement = real  # type: ignore[method-assign]


@contextmanager
def receipt_statement_reply_lost() -> Iterator[None]:
    """The one-statement receipt insert commits, then the statement itself raises (its reply lost), as a
    connection dropped after the server committed does; ``statement_reply_lost`` raises only after the
    statement's function returned."""
    from transcript_store import hot

    real = hot.run
    armed = [True]

    def lossy(conn: Any, stmt: Any, params: Any = None) -> Any:
        result = real(conn, stmt, params)
        if armed[0] and "INSERT INTO ts_receipts" in str(stmt):
            armed[0] = False
            raise TransientStoreError("injected: the statement committed, its reply was lost")
        return result

    hot.run = lossy
    try:
        yield
    finally:
        hot.run = real
    assert not armed[0], "the one-statement receipt insert never ran: the case under test did not arise"


@pytest.mark.parametrize("way", ["statement", "statement-raises", "transaction"])
def test_commit_turn_whose_answer_was_lost_reports_its_own_commit(
    store: TranscriptStore, sid: str, way: str
) -> None:
    """The first commit landed, its answer was lost, the retry found the receipt: the caller was told
    ``duplicate`` for a commit it made (with ``apply``: engine state written by a call saying it was
    not). A second call with the same key is still ``duplicate``."""
    turns = Turns(store)
    admission, _ = turns.admit(S, sid, user("2+2?"), turn_id="t1", engine_id=E)
    done = turns.complete(S, sid, "t1", [{"message": assistant("4")}], None)
    messages = [user("2+2?"), assistant("4")]
    apply = count_turn if way == "transaction" else None
    if way == "statement-raises":
        if store.backend == "sqlite":
            pytest.skip("SQLite runs in the process: a statement that raised wrote nothing, no answer is lost")
        lost = receipt_statement_reply_lost()
    else:
        lost = statement_reply_lost(store) if way == "statement" else commits_lost(store, lambda n: n == 1)
    with lost:
        first = turns.commit_turn(E, "t1", admission, done.terminal, messages, apply=apply)
    assert first.status == "committed"
    again = turns.commit_turn(E, "t1", admission, done.terminal, messages, apply=apply)
    assert again.status == "duplicate" and again.receipt == first.receipt
    assert len(turns.receipts(S, sid)) == 1


def test_a_drain_limit_no_drain_takes_is_refused_by_the_config() -> None:
    """OutboxConfig took any positive drain_limit, and every drain() without a limit then refused it."""
    with pytest.raises(InvalidInput, match="drain_limit"):
        OutboxConfig(drain_limit=MAX_DRAIN + 1)
    assert OutboxConfig(drain_limit=MAX_DRAIN).drain_limit == MAX_DRAIN


def test_replies_over_the_turn_cap_are_refused_before_anything_is_written(store: TranscriptStore, sid: str) -> None:
    """Replies each within the entry cap but together over the closed range's cap were written and the
    turn accepted, then blocked ``too_large`` in the same call: an accepted turn no engine ever gets."""
    turns = Turns(store)
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id=E)
    third = MAX_TURN_BYTES // 3 + 1024
    big = [{"message": assistant("x" * third)} for _ in range(3)]
    before = everything(store)
    with pytest.raises(PayloadTooLarge):
        turns.complete(S, sid, "t1", big, only(counting_engine)(E))
    assert everything(store) == before
    done = turns.complete(S, sid, "t1", big[:2], only(counting_engine)(E))  # within the cap: as before
    assert done.commit is not None and done.commit.status == "committed"
