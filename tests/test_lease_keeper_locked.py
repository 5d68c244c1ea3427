"""One keeper renews every lease it holds from one thread: a turn whose outbox row another transaction
holds locked (its completion, an admission looking at it, a worker stuck mid-transaction) must not stop
the other turns' renewals. Before, the keeper's renewal waited on that row lock, another running turn's
lease ran out meanwhile, and the next admission to that turn's session discarded it while it ran.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest
from conftest import user
from test_host import SCOPE
from test_turn_serial import _owner

from transcript_store import SessionBusy, TranscriptStore, outbox
from transcript_store.core import Core
from transcript_store.leases import LeaseKeeper
from transcript_store.outbox import OutboxConfig
from transcript_store.turns import Turns

# Renewed every lease/3: with 0.6 s, a keeper thread woken 0.4 s late on a loaded machine (CI runs the OpenClaw
# suite beside the tests) let B's lease run out with no lock involved. Three leases locked still fails the
# keeper that waits on the row.
LEASE = 1.2
LOCKED_FOR = 3.6


def _lease_left(turns: Turns, session_id: str, turn_id: str) -> float:
    intent = turns.intent(SCOPE, session_id, turn_id)
    assert intent is not None and intent.lease_expires_at is not None, (turn_id, intent)
    return (intent.lease_expires_at - datetime.now(UTC)).total_seconds()


def test_a_locked_row_does_not_stop_the_other_renewals(store: TranscriptStore) -> None:
    if store.db.dialect.is_sqlite:
        pytest.skip("SQLite has no row locks: every write waits on the one database write lock")
    turns = Turns(store, OutboxConfig(turn_lease_seconds=LEASE))
    for session_id, turn_id in (("sa", "A"), ("sb", "B")):
        store.create_session(SCOPE, session_id=session_id)
        turns.admit(SCOPE, session_id, user(turn_id), turn_id=turn_id, engine_id="legacy")
    keeper = LeaseKeeper(store)
    locked, free = threading.Event(), threading.Event()

    def stuck(c: Core) -> None:  # a transaction holding A's row, then doing nothing for a while
        assert outbox.get_row(c, SCOPE, "sa", "A", lock=True) is not None
        locked.set()
        free.wait(LOCKED_FOR + 5)

    locker = threading.Thread(target=store.write, args=(stuck,), daemon=True)
    try:
        keeper.hold(SCOPE, "sa", "A", LEASE, _owner(turns, "sa", "A"))
        keeper.hold(SCOPE, "sb", "B", LEASE, _owner(turns, "sb", "B"))
        locker.start()
        assert locked.wait(10)
        deadline = time.monotonic() + LOCKED_FOR
        while time.monotonic() < deadline:
            left = _lease_left(turns, "sb", "B")
            assert left > 0, f"B's lease ran out {-left:.2f} s ago while A's row was locked"
            time.sleep(0.05)
        with pytest.raises(SessionBusy):  # B is still running: the next turn of its session waits
            turns.admit(SCOPE, "sb", user("next"), turn_id="B2", engine_id="legacy")
        assert keeper.holds(SCOPE, "sa", "A")  # a locked row is skipped, not taken for a lost lease
        free.set()
        locker.join(10)
        deadline = time.monotonic() + 30  # a bound only: the renewal ends the wait (5 leases was short under load)
        while _lease_left(turns, "sa", "A") <= 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _lease_left(turns, "sa", "A") > 0  # renewed again once its row is free
    finally:
        free.set()
        if locker.ident is not None:
            locker.join(10)
        keeper.close()
