"""A hostile review of the turn outbox: admission -> acceptance -> drain -> commit, leases, drain claims,
recovery, blocking and discarding, with real threads and processes on both backends.

Each test here failed on the code before its fix (see the docstrings).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from conftest import assistant, module_store_fixtures, user, wait_until
from hosting import RecordingModel
from sqlalchemy import Connection
from test_host import make_host
from workers.turn_worker import counting_engine

from transcript_store import SessionBusy, TranscriptStore, TransientStoreError, outbox
from transcript_store.core import Core
from transcript_store.errors import InvalidInput
from transcript_store.leases import LeaseKeeper
from transcript_store.ledger import CommitResult, TurnPayload, count_turn_messages, get_state
from transcript_store.outbox import OutboxConfig, TurnIntent, claim_head
from transcript_store.turns import CommitIn, Turns

S = "review-scope"
E = "engine-1"

shared_url, store, sid = module_store_fixtures(S, "outbox-review")


def engines(deliver: CommitIn = counting_engine) -> Callable[[str], CommitIn | None]:
    return lambda engine_id: deliver if engine_id == E else None


def queued(turns: Turns, session_id: str, turn_id: str, engine: str = E) -> None:
    """Admit and accept a turn without delivering it."""
    turns.admit(S, session_id, user(f"q {turn_id}"), turn_id=turn_id, engine_id=engine)
    done = turns.complete(S, session_id, turn_id, [{"message": assistant(f"a {turn_id}")}], None)
    assert done.commit is None and done.intent.state == "accepted"


def engine_order(store: TranscriptStore, session_id: str) -> tuple[list[str], int]:
    """(keys in the engine's commit order, ledger messages) of a session."""

    def run(c: Core) -> tuple[list[str], int]:
        return get_state(c, S, session_id, E, "order") or [], count_turn_messages(c, S, session_id, E)

    return store.read(run)


@contextmanager
def commits_lost(
    store: TranscriptStore, which: Callable[[int], bool], between: Callable[[], object] | None = None
) -> Iterator[None]:
    """The write transactions ``which(n)`` picks (n counts from 1) commit, then ``between`` runs (another
    client, when given) and their caller sees the connection drop (a server gone between COMMIT and its
    reply): an uncertain commit, retried whole."""
    real = store.db._transaction
    count = [0]

    @contextmanager
    def lossy(write: bool) -> Iterator[Connection]:
        with real(write) as conn:
            yield conn
        if write:
            count[0] += 1
            if which(count[0]):
                if between is not None:
                    between()
                raise TransientStoreError("injected: connection lost after COMMIT (the commit landed)")

    store.db._transaction = lossy  # type: ignore[method-assign]
    try:
        yield
    finally:
        store.db._transaction = real  # type: ignore[method-assign]


@contextmanager
def commit_fails_once(store: TranscriptStore, between: Callable[[], object]) -> Iterator[None]:
    """The next write transaction fails at its COMMIT, which does not land (rolled back), and its caller
    sees the connection drop, as for a lost COMMIT; ``between`` runs before the retry."""
    real = store.db._transaction
    armed = [True]

    class _Fail(Exception):
        pass

    @contextmanager
    def failing(write: bool) -> Iterator[Connection]:
        try:
            with real(write) as conn:
                yield conn
                if write and armed[0]:
                    armed[0] = False
                    raise _Fail
        except _Fail:
            between()
            raise TransientStoreError("injected: connection lost at COMMIT (the commit did not land)") from None

    store.db._transaction = failing  # type: ignore[method-assign]
    try:
        yield
    finally:
        store.db._transaction = real  # type: ignore[method-assign]


def dead_identity() -> str:
    """The identity of a process of this machine that has exited."""
    child = subprocess.run(
        [sys.executable, "-c", "from transcript_store import identity; print(identity.current())"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return child.stdout.strip()


# ---------------------------------------------------------------------------------------------- leases


def test_a_failing_attempt_does_not_stop_the_renewal_of_the_retry_that_took_its_turn_over(
    store: TranscriptStore, sid: str
) -> None:
    """Two threads of one host run the same turn (a gateway retry after a timeout): the retry takes the
    turn's lease over, then the first attempt's model call fails. The first attempt's ``release`` of its
    lease dropped the retry's renewal (the keeper held one renewal per turn, whoever's), so the running
    retry's lease ran out while its worker lived: the session's next admission discarded the turn and
    the retry ended in ``TurnOvertaken``. Each attempt now releases only its own renewal."""
    lease = 1.0  # renewed every lease/3: 0.5 s ran out under a keeper held off a loaded machine's CPU
    host, _ = make_host(store)
    host.turns = Turns(store, OutboxConfig(turn_lease_seconds=lease))
    second_started, go = threading.Event(), threading.Event()
    calls: list[str] = []
    lock = threading.Lock()
    recording = RecordingModel()

    class TwoAttempts:
        name = "two-attempts"

        def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
            with lock:
                calls.append(threading.current_thread().name)
                first = len(calls) == 1
            if first:
                assert second_started.wait(20)
                raise RuntimeError("the provider broke")
            second_started.set()
            assert go.wait(30)
            return recording.complete(messages, tools, **kw)

    host.model = TwoAttempts()
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        try:
            results[name] = host.run_turn(S, sid, "q1", turn_id="t1")
        except BaseException as e:  # reported below
            results[name] = e

    first = threading.Thread(target=run, args=("first",), name="first")
    first.start()
    deadline = time.monotonic() + 20
    while host.turns.intent(S, sid, "t1") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    retry = threading.Thread(target=run, args=("retry",), name="retry")
    retry.start()
    first.join(30)
    assert isinstance(results.get("first"), RuntimeError), results
    try:
        time.sleep(3 * lease)  # the retry's model call still runs: its lease must have been renewed
        with pytest.raises(SessionBusy):
            Turns(store).admit(S, sid, user("other"), turn_id="o1", engine_id="legacy")
    finally:
        go.set()
        retry.join(30)
    out = results.get("retry")
    assert out is not None and not isinstance(out, BaseException), repr(out)
    assert out.commit_status == "committed"
    assert [r.advancement_key for r in Turns(store).receipts(S, sid)] == ["t1"]
    host.dispose()


def test_the_keeper_releases_only_the_calling_attempts_renewal(store: TranscriptStore, sid: str) -> None:
    """The keeper's side of the test above: a hold under a new owner (a retry's takeover) replaces the
    earlier attempt's, and a release from the earlier attempt's thread leaves the retry's renewing."""
    # A 1.5 s lease, renewed every half second: a keeper paused on a loaded machine still renews it in
    # time (0.3 s ran out meanwhile); the test waits for the renewal instead of sleeping past the lease.
    turns = Turns(store, OutboxConfig(turn_lease_seconds=1.5))
    keeper = LeaseKeeper(store)
    try:
        turns.admit(S, sid, user("q1"), turn_id="t1", engine_id=E, owner="worker/a")
        held, go = threading.Event(), threading.Event()

        def earlier_attempt() -> None:  # holds, then releases from its own thread once the retry holds too
            keeper.hold(S, sid, "t1", 1.5, "worker/a")
            held.set()
            go.wait(60)
            keeper.release(S, sid, "t1")

        # One thread for the earlier attempt's hold and release: a release is the calling thread's, and a
        # second thread released the first one's hold only when it happened to get the ended one's id.
        first = threading.Thread(target=earlier_attempt)
        first.start()
        assert held.wait(60)
        turns.admit(S, sid, user("q1"), turn_id="t1", engine_id=E, owner="worker/b")  # the retry takes over
        keeper.hold(S, sid, "t1", 1.5, "worker/b")
        go.set()
        first.join()
        assert keeper.holds(S, sid, "t1")
        taken = turns.intent(S, sid, "t1")
        assert taken is not None and taken.lease_owner == "worker/b" and taken.lease_expires_at is not None
        renewals = keeper.renewals
        wait_until(lambda: keeper.renewals > renewals, "the retry's lease renewed")
        renewed = turns.intent(S, sid, "t1")
        assert renewed is not None and renewed.lease_owner == "worker/b" and renewed.lease_expires_at is not None
        assert renewed.lease_expires_at > taken.lease_expires_at
        with pytest.raises(SessionBusy):
            turns.admit(S, sid, user("q2"), turn_id="t2", engine_id=E)
        keeper.release(S, sid, "t1")
        assert not keeper.holds(S, sid, "t1")
    finally:
        keeper.close()


# ---------------------------------------------------------------------------------------------- drain


def test_a_drain_whose_commit_was_uncertain_reports_the_delivery(store: TranscriptStore, sid: str) -> None:
    """The delivery's COMMIT landed but the drain saw the connection drop; its retry found the ledger
    holding the turn (``duplicate``) and the row gone, took that for a claim lost to another drain and
    reported nothing delivered, the session stopped, and no ``on_committed``: a committed turn reported
    as still queued (the host answered ``queued``). It is reported as the delivery that landed."""
    turns = Turns(store)
    queued(turns, sid, "t1")
    seen: list[tuple[str, str]] = []
    # The drain's writes: 1 the claim, 2 the delivery.
    with commits_lost(store, lambda n: n == 2):
        report = turns.drain(engines(), on_committed=lambda i, r: seen.append((i.turn_id, r.status)))
    assert (report.committed, report.duplicates, report.failed, report.stopped_sessions) == (1, 0, [], [])
    assert seen == [("t1", "committed")]
    assert turns.intent(S, sid, "t1") is None and engine_order(store, sid) == (["t1"], 2)


def test_a_claim_whose_commit_was_uncertain_is_still_this_drains(store: TranscriptStore, sid: str) -> None:
    """(Held already.) The claim's COMMIT lost: the retry recognises its own lease and delivers."""
    turns = Turns(store)
    queued(turns, sid, "t1")
    with commits_lost(store, lambda n: n == 1):
        report = turns.drain(engines())
    assert (report.committed, report.stopped_sessions) == (1, [])
    assert engine_order(store, sid) == (["t1"], 2)


def test_a_delivery_interrupted_by_a_base_exception_releases_its_claim(store: TranscriptStore, sid: str) -> None:
    """An engine's commit interrupted by a BaseException that is not an Exception (KeyboardInterrupt,
    SystemExit in a worker thread) left the drain's claim standing: in a process that lives on, the
    session's deliveries stopped for the whole delivery lease (60 s, up to a year as configured). The
    claim is released as for a failure, and the interruption goes on up."""
    turns = Turns(store, OutboxConfig(delivery_lease_seconds=3600.0))
    queued(turns, sid, "t1")

    def interrupted(c: Core, turn: TurnPayload) -> CommitResult:
        counting_engine(c, turn)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        turns.drain(engines(interrupted))
    row = turns.intent(S, sid, "t1")
    assert row is not None and row.state == "ready" and row.lease_owner is None
    report = turns.drain(engines())
    assert (report.committed, report.stopped_sessions) == (1, [])
    assert engine_order(store, sid) == (["t1"], 2)


# ---------------------------------------------------------------------------------------------- block


def test_a_turn_claimed_by_a_dead_drain_can_be_blocked_at_once(store: TranscriptStore, sid: str) -> None:
    """The turn an operator blocks is typically the one whose delivery kills the drain's process (an
    engine that crashes it every time). Its claim, of a process gone from this machine, is free at once
    for the next drain, but ``block`` refused it ("being delivered now") for the claim's whole lease, so
    the next drain claimed it again, and crashed again. A claim of a provably gone process is no
    delivery: the row is blocked, and never reaches the engine."""
    turns = Turns(store)
    queued(turns, sid, "t1")
    queued(turns, sid, "t2")
    gone = f"{dead_identity()}/0badc0de"
    claimed = store.write(lambda c: claim_head(c, (S, sid, E), gone, 3600.0))
    assert isinstance(claimed, TurnIntent) and claimed.turn_id == "t1"
    blocked = turns.block(S, sid, "t1", "crashes the drain")
    assert (blocked.state, blocked.lease_owner) == ("blocked", None)
    report = turns.drain(engines())
    assert (report.committed, report.failed) == (1, [])
    assert engine_order(store, sid) == (["t2"], 2)
    # A live claim still refuses the block.
    queued(turns, sid, "t3")
    assert isinstance(store.write(lambda c: claim_head(c, (S, sid, E), "live-worker/1", 3600.0)), TurnIntent)
    with pytest.raises(InvalidInput, match="being delivered"):
        turns.block(S, sid, "t3", "not now")
    assert outbox.MAX_LEASE_SECONDS >= 3600.0


def test_the_keeper_refuses_a_lease_it_could_not_store(store: TranscriptStore, sid: str) -> None:
    """A lease past what its column holds (microseconds in 64 bits) was held, and every renewal failed
    (an overflow, logged and retried at each look) while the keeper said it held the turn: the lease ran
    out in a live worker. Refused (``InvalidInput``), as ``OutboxConfig`` refuses it; so is a time limit
    that is not a number of seconds (NaN renewed for ever)."""
    keeper = LeaseKeeper(store)
    try:
        for bad_lease in (1e30, outbox.MAX_LEASE_SECONDS * 2, "30", True):
            with pytest.raises(InvalidInput):
                keeper.hold(S, sid, "t1", bad_lease, "worker/a")  # type: ignore[arg-type]
        for bad_limit in (float("nan"), -1.0, "60"):
            with pytest.raises(InvalidInput):
                keeper.hold(S, sid, "t1", 30.0, "worker/a", max_seconds=bad_limit)  # type: ignore[arg-type]
        assert not keeper.holds(S, sid, "t1")
    finally:
        keeper.close()


# ---------------------------------------------------------------------------------------------- admission


def test_a_retry_whose_turn_is_discarded_meanwhile_is_admitted_not_an_assertion(
    store: TranscriptStore, sid: str
) -> None:
    """PostgreSQL: a retry's admission met the earlier attempt's intent (ON CONFLICT DO NOTHING, which
    locks nothing), and that attempt's failure discarded it before the retry read it back: the retry
    failed on ``assert row is not None`` (an untyped AssertionError; under ``python -O`` an
    AttributeError). The transaction is run again and the retry admitted."""
    if store.db.dialect.is_sqlite:
        pytest.skip("SQLite runs one writer at a time: the discard cannot commit inside the admission")
    from sqlalchemy import event

    turns = Turns(store)
    turns.admit(S, sid, user("q1"), turn_id="t1", engine_id=E, owner="worker/a")
    me = threading.get_ident()
    seen: list[str] = []  # this thread's statements since the admission began

    def before(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        # The statement after the INSERT that met the earlier intent (the admission reads it back): the
        # earlier attempt's discard commits just before it, from another connection.
        if threading.get_ident() != me:
            return
        if seen and seen[-1] == "insert" and "ts_outbox" in statement:
            other = threading.Thread(target=lambda: turns.discard(S, sid, "t1", owner="worker/a"))
            other.start()
            other.join(30)
            seen.append("discarded")
        elif not seen or seen[-1] != "discarded":
            seen.append("insert" if statement.lstrip().upper().startswith("INSERT INTO TS_OUTBOX") else "other")

    event.listen(store.db.engine, "before_cursor_execute", before)
    try:
        _admission, intent = turns.admit(S, sid, user("q1"), turn_id="t1", engine_id=E, owner="worker/b")
    finally:
        event.remove(store.db.engine, "before_cursor_execute", before)
    assert "discarded" in seen  # the discard ran inside the admission
    assert (intent.state, intent.lease_owner) == ("admitted", "worker/b")
    row = turns.intent(S, sid, "t1")
    assert row is not None and row.lease_owner == "worker/b"


# ---------------------------------------------------------------------------------------------- recovery


def test_a_recovery_whose_discard_was_uncertain_reports_it(store: TranscriptStore, sid: str) -> None:
    """Recovery's discard of an abandoned turn committed, its caller saw the connection drop, and the
    retry found nothing to discard: the report (and ``outbox recover``) said nothing was discarded."""
    Turns(store, OutboxConfig(turn_lease_seconds=0.0)).admit(S, sid, user("q1"), turn_id="t1", engine_id=E)
    turns = Turns(store)
    with commits_lost(store, lambda n: n == 1):
        report = turns.recover(S, sid, E, engines())
    assert report.discarded == ["t1"] and turns.intent(S, sid, "t1") is None


def test_an_owner_naming_an_impossible_pid_is_not_an_untyped_error(store: TranscriptStore, sid: str) -> None:
    """A caller's own lease owner (``admit(owner=...)`` takes any short text) shaped like a process
    identity of this machine with a pid past a C long made the "is its process gone?" check raise
    OverflowError from ``os.kill``: every later admission of the session (and a drain or block meeting
    such a claim) failed with that untyped error. Unknown is not dead: the session is busy, typed."""
    from transcript_store import identity

    me = identity.current()
    if me.machine is None:
        pytest.skip("no /proc: identities carry no machine key here")
    forged = f"{me.host}:{2**70}:{int(me.start_time)}:{me.token}.{me.machine}.1/x"
    turns = Turns(store)
    turns.admit(S, sid, user("q1"), turn_id="t1", engine_id=E, owner=forged)
    with pytest.raises(SessionBusy):
        turns.admit(S, sid, user("q2"), turn_id="t2", engine_id=E)
    assert turns.recover(S, sid, E, engines()).running == ["t1"]


# ---------------------------------------------------------------------------------------------- storms


def test_drains_racing_with_instant_claim_takeovers_and_a_block_keep_order_and_exactly_once(
    store: TranscriptStore, sid: str
) -> None:
    """Four drains at once with a delivery lease shorter than some deliveries (their claims are taken over
    by the other drains mid-delivery, and they lose them at commit) while an operator blocks a queued
    turn: each turn reaches the engine once, in enqueue order, and the blocked one never does. (With a
    lease of 0 every claim is taken over at once: drains on PostgreSQL then thrash, thousands of claims
    lost for a dozen turns, but the same holds.)"""
    from transcript_store.errors import UnknownTurn

    turns = Turns(store, OutboxConfig(delivery_lease_seconds=0.05))
    lock = threading.Lock()
    ids = [f"t{i:02d}" for i in range(12)]
    for turn_id in ids:
        queued(turns, sid, turn_id)

    overdue = {"t01", "t05"}  # their first delivery outlives its claim

    def slow(c: Core, turn: TurnPayload) -> CommitResult:
        result = counting_engine(c, turn)
        with lock:
            late = turn.advancement_key in overdue
            overdue.discard(turn.advancement_key)
        time.sleep(0.15 if late else 0.005)
        return result

    errors: list[BaseException] = []

    def drain() -> None:
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and store.read(lambda c: outbox.pending(c, S, sid)):
                turns.drain(engines(slow), session_id=sid)
        except BaseException as e:  # reported below
            errors.append(e)

    workers = [threading.Thread(target=drain) for _ in range(4)]
    for w in workers:
        w.start()
    time.sleep(0.02)
    blocked: set[str] = set()
    while True:
        try:
            turns.block(S, sid, "t08", "taken out by hand")
            blocked.add("t08")
            break
        except UnknownTurn:  # delivered before the operator got to it
            break
        except InvalidInput:  # being delivered right now: try again
            time.sleep(0.01)
    for w in workers:
        w.join(30)
    assert errors == []
    order, messages = engine_order(store, sid)
    expected = [t for t in ids if t not in blocked]
    assert order == expected and messages == 2 * len(expected)
    assert sorted(r.advancement_key for r in turns.receipts(S, sid)) == expected
    assert [(i.turn_id, i.state) for i in turns.intents(S) if i.session_id == sid] == [(t, "blocked") for t in blocked]


def test_a_discard_whose_commit_failed_does_not_claim_the_retrys_intent(store: TranscriptStore, sid: str) -> None:
    """A failing attempt's discard (by owner) whose COMMIT did not land, and a retry of the turn that
    takes the intent over before the discard is run again: the second run deletes nothing (the intent
    is the retry's) but answered True ("discarded"), taking the first run's word for it."""
    turns = Turns(store)
    turns.admit(S, sid, user("q1"), turn_id="t1", engine_id=E, owner="worker/a")
    retry = Turns(store)

    def take_over() -> None:
        retry.admit(S, sid, user("q1"), turn_id="t1", engine_id=E, owner="worker/b")

    with commit_fails_once(store, take_over):
        assert turns.discard(S, sid, "t1", owner="worker/a") is False
    row = turns.intent(S, sid, "t1")
    assert row is not None and (row.state, row.lease_owner) == ("admitted", "worker/b")


def test_a_renewal_that_succeeded_is_not_discarded_by_the_admission_that_judged_it_expired(
    store: TranscriptStore, sid: str
) -> None:
    """PostgreSQL: the next turn's admission reads the running turn's lease as expired (its worker was
    late to renew), and the worker's renewal commits before the admission deletes the turn: the renewal
    answered True (the keeper goes on as if the turn were its own) and the turn was deleted all the same,
    to fail at its completion. The admission now locks what it judges: a renewal answering True means
    the turn stands; one that lost the race answers False."""
    if store.db.dialect.is_sqlite:
        pytest.skip("SQLite runs one writer at a time: no renewal can land inside the admission")
    from sqlalchemy import event

    Turns(store, OutboxConfig(turn_lease_seconds=0.0)).admit(
        S, sid, user("q1"), turn_id="t1", engine_id=E, owner="worker/a"
    )
    time.sleep(0.01)  # t1's lease has run out: the next admission takes it for abandoned
    me = threading.get_ident()
    renewed: list[bool] = []
    renewal: list[threading.Thread] = []

    def before(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if threading.get_ident() != me or renewal or not statement.lstrip().upper().startswith("DELETE FROM TS_OUTBOX"):
            return
        worker = threading.Thread(target=lambda: renewed.append(
            store.write(lambda c: outbox.renew_lease(c, S, sid, "t1", "worker/a", 300.0))
        ))
        renewal.append(worker)
        worker.start()
        worker.join(1.0)  # landed at once (nothing held t1's row), or waits for this admission

    event.listen(store.db.engine, "before_cursor_execute", before)
    try:
        try:
            Turns(store).admit(S, sid, user("q2"), turn_id="t2", engine_id=E)
            admitted = True
        except SessionBusy:
            admitted = False
    finally:
        event.remove(store.db.engine, "before_cursor_execute", before)
    assert renewal, "the admission deleted nothing"
    renewal[0].join(30)
    t1 = Turns(store).intent(S, sid, "t1")
    assert renewed == [t1 is not None]  # a renewal that answered True keeps its turn
    assert admitted == (t1 is None)
