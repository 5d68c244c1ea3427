"""A lease keeper whose store was closed with a turn still held stops renewing: before, its thread went on
opening connections (SQLAlchemy's disposed pool reconnects) to a database that may be gone by then, as
the test suite's own throwaway PostgreSQL databases were, logging "could not renew" for ever."""

from __future__ import annotations

import logging
import time

import pytest
from conftest import user
from test_host import SCOPE
from test_turn_serial import _owner

from transcript_store import StoreConfig, TranscriptStore
from transcript_store.leases import LeaseKeeper
from transcript_store.outbox import OutboxConfig
from transcript_store.turns import Turns

LEASE = 0.6


def test_closing_the_store_ends_the_renewals(store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    store = TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False))
    turns = Turns(store, OutboxConfig(turn_lease_seconds=LEASE))
    store.create_session(SCOPE, session_id="s1")
    turns.admit(SCOPE, "s1", user("hello"), turn_id="t1", engine_id="legacy")
    keeper = LeaseKeeper(store)
    keeper.hold(SCOPE, "s1", "t1", LEASE, _owner(turns, "s1", "t1"))
    deadline = time.monotonic() + 30  # a bound only: the event ends the wait
    while keeper.renewals == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert keeper.renewals > 0  # renewing while the store is open
    store.close()
    deadline = time.monotonic() + 30  # a bound only: the event ends the wait
    while keeper.holds(SCOPE, "s1", "t1") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not keeper.holds(SCOPE, "s1", "t1")
    renewed = keeper.renewals
    with caplog.at_level(logging.WARNING, logger="transcript_store"):
        time.sleep(2 * LEASE)
    assert keeper.renewals == renewed
    assert not [r for r in caplog.records if "renew" in r.getMessage()], caplog.text
    keeper.close()
