"""A demanding user's review of the turn-commit machinery (ledger, outbox, leases, recovery), on both
backends. Each test here failed on the code before its fix (see the docstrings)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest
from conftest import assistant, module_store_fixtures, user
from sqlalchemy import Connection
from workers.turn_worker import counting_engine

from transcript_store import TranscriptStore
from transcript_store.errors import InvalidInput, StoreUnavailable
from transcript_store.leases import LeaseKeeper
from transcript_store.outbox import OutboxConfig
from transcript_store.turns import CommitIn, Turns

S = "commit-review2"
E = "engine-1"

shared_url, store, sid = module_store_fixtures(S, "commit-review2")


def queued(turns: Turns, session_id: str, turn_id: str) -> None:
    """Admit and accept a turn without delivering it."""
    turns.admit(S, session_id, user(f"q {turn_id}"), turn_id=turn_id, engine_id=E)
    done = turns.complete(S, session_id, turn_id, [{"message": assistant(f"a {turn_id}")}], None)
    assert done.commit is None and done.intent.state == "accepted"


@contextmanager
def writes_fail_while(store: TranscriptStore, down: list[bool]) -> Iterator[None]:
    """Every write transaction fails (the database unreachable) while ``down[0]`` is set."""
    real = store.db._transaction

    @contextmanager
    def outage(write: bool) -> Iterator[Connection]:
        if write and down[0]:
            raise StoreUnavailable("injected: the database is unreachable")
        with real(write) as conn:
            yield conn

    store.db._transaction = outage  # type: ignore[method-assign]
    try:
        yield
    finally:
        store.db._transaction = real  # type: ignore[method-assign]


def test_a_drain_claim_whose_engine_lookup_failed_is_not_renewed_for_ever(store: TranscriptStore, sid: str) -> None:
    """On PostgreSQL a drain renews its claim of the row it delivers (LeaseKeeper) and stopped renewing it
    only after the delivery's transaction: when the engine lookup failed before it (the engine not
    installed, or ``commit_in`` raising) and the failure could not be recorded either (the database gone
    for that moment), the claim stayed held by the keeper, renewed every third of its lease for as long as
    the process lived (a ``serve``, a host runtime): every later drain found the row "leased" and the
    session's turns never reached their engine. The claim now runs out after its lease, as one left by a
    drain that died does, and the next drain delivers the turn."""
    config = OutboxConfig(delivery_lease_seconds=0.6)
    turns = Turns(store, config)
    queued(turns, sid, "t1")
    down = [False]

    def lookup(engine_id: str) -> CommitIn | None:
        down[0] = True  # the database goes away right after the claim: the failure cannot be recorded
        return None

    with writes_fail_while(store, down):
        with suppress(StoreUnavailable):
            turns.drain(lookup, scope=S, session_id=sid)
        down[0] = False  # back
    time.sleep(1.5)  # past the claim's lease: a renewal held it on

    def engines(engine_id: str) -> CommitIn | None:
        return counting_engine if engine_id == E else None

    report = Turns(store, config).drain(engines, scope=S, session_id=sid)
    assert report.committed == 1 and turns.intent(S, sid, "t1") is None


@pytest.mark.parametrize(
    ("lease", "owner"), [(-1, "o/1"), (float("nan"), "o/1"), (30, None), (30, 7), (30, "")]
)
def test_a_lease_keeper_refuses_a_lease_it_could_never_renew(
    store: TranscriptStore, lease: float, owner: object
) -> None:
    """``LeaseKeeper.hold`` took a negative or NaN lease, and an owner that is no string, without a word:
    the first was never renewed (the running turn then lost to the session's next admission), the second
    dropped at its first renewal as if the turn were gone. OutboxConfig refuses such leases
    (``InvalidInput``, README: "0 up to a year"); the keeper now does too, holding nothing."""
    keeper = LeaseKeeper(store)
    try:
        with pytest.raises(InvalidInput):
            keeper.hold(S, "s", "t", lease, owner)  # type: ignore[arg-type]
        assert not keeper.holds(S, "s", "t")
        keeper.hold(S, "s", "t", 0, "o/1")  # a zero lease: nothing to keep, as before
        assert not keeper.holds(S, "s", "t")
    finally:
        keeper.close()
