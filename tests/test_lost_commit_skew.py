"""The lost-COMMIT checks of ``Turns.discard`` and ``Turns.recover`` under clock skew between machines.

A discard (or recovery's discard) whose COMMIT was uncertain is retried whole, and the retry must tell
the intent its earlier attempt discarded from another admission of the turn made since. It told them
by the intent's ``created_us`` (the admitting worker's wall clock) against this process's own clock at
the call's start: with the machines' clocks seconds apart, the retry deleted a running turn admitted
again by a machine whose clock is behind (the turn was lost), left standing an intent written by a
machine whose clock is ahead while answering it discarded (the session stayed busy for the whole
lease), and answered a recovery's discards wrongly both ways. The retry now tells the intent by its
``created_us`` as the earlier attempt read it back from the row: one value compared with itself, never
with this machine's clock.

Another machine's clock is simulated deterministically: the row its admission wrote is shifted by the
skew (``created_us``, ``updated_us``, the lease's expiry: every time it writes from its own clock).
"""

from __future__ import annotations

from conftest import user
from sqlalchemy import update
from test_outbox_review import commit_fails_once, dead_identity
from test_session_lifecycle_review import commit_lost_then, two_clients
from workers.turn_worker import counting_engine

from transcript_store import TranscriptStore
from transcript_store.schema import outbox
from transcript_store.turns import Turns

S = "skew-scope"
SKEW_US = 5_000_000  # five seconds


def written_by_skewed_clock(store: TranscriptStore, sid: str, turn_id: str, skew_us: int) -> None:
    """Make the turn's intent as a machine whose clock is ``skew_us`` off this one's would have written it."""
    shift = {
        outbox.c.created_us: outbox.c.created_us + skew_us,
        outbox.c.updated_us: outbox.c.updated_us + skew_us,
        outbox.c.lease_expires_us: outbox.c.lease_expires_us + skew_us,
    }
    key = (outbox.c.scope == S, outbox.c.session_id == sid, outbox.c.turn_id == turn_id)
    done = store.write(lambda c: c.conn.execute(update(outbox).where(*key).values(shift)).rowcount)
    assert done == 1


def test_a_discard_retried_after_a_machine_behind_admitted_the_turn_again_leaves_it_running(store_url: str) -> None:
    """A discard whose COMMIT landed but was reported lost, and the turn admitted again before the retry by
    a worker whose clock is 5 s behind: the new intent's ``created_us`` fell before this call's start, so
    the retry without an owner took it for the intent it had meant to discard and deleted it (the running
    turn was lost), and the one with an owner answered False for its discard that had landed."""
    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        for sid, owner in (("bn", None), ("bo", "worker/a")):
            store.create_session(S, session_id=sid)
            turns.admit(S, sid, user("q1"), turn_id="t1", engine_id="e", owner="worker/a")

            def admit_again(sid: str = sid) -> None:
                Turns(other).admit(S, sid, user("q1"), turn_id="t1", engine_id="e", owner="worker/c")
                written_by_skewed_clock(other, sid, "t1", -SKEW_US)

            with commit_lost_then(store, admit_again):
                assert turns.discard(S, sid, "t1", owner=owner) is True, sid
            intent = turns.intent(S, sid, "t1")
            assert intent is not None and intent.lease_owner == "worker/c", sid


def test_a_discard_that_did_not_land_deletes_an_intent_a_machine_ahead_wrote(store_url: str) -> None:
    """A discard (without an owner) whose COMMIT did not land, of an intent admitted by a worker whose
    clock is 5 s ahead: its ``created_us`` fell after this call's start, so the retry took it for another
    admission's, answered True (discarded) and deleted nothing: the intent stood, the session busy."""
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="an")
        Turns(other).admit(S, "an", user("q1"), turn_id="t1", engine_id="e", owner="worker/b")
        written_by_skewed_clock(other, "an", "t1", SKEW_US)
        turns = Turns(store)
        with commit_fails_once(store, lambda: None):
            assert turns.discard(S, "an", "t1") is True
        assert turns.intent(S, "an", "t1") is None


def test_a_discard_by_owner_that_did_not_land_is_not_reported_by_a_machine_ahead(store_url: str) -> None:
    """A failed attempt's discard (``owner=``) whose COMMIT did not land, and a retry of the turn that took
    it over meanwhile (the attempt's worker was gone); the intent was admitted by a worker whose clock is
    5 s ahead. The retry found nothing of its own in the intent, took it for another admission's by its
    ``created_us`` and answered True (discarded) of a turn still running elsewhere."""
    gone = f"{dead_identity()}/a"  # abandoned whatever its lease says: a retry takes the turn over
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="ao")
        turns = Turns(store)
        turns.admit(S, "ao", user("q1"), turn_id="t1", engine_id="e", owner=gone)
        written_by_skewed_clock(store, "ao", "t1", SKEW_US)

        def take_over() -> None:
            Turns(other).admit(S, "ao", user("q1"), turn_id="t1", engine_id="e", owner="worker/b")

        with commit_fails_once(store, take_over):
            assert turns.discard(S, "ao", "t1", owner=gone) is False
        intent = turns.intent(S, "ao", "t1")
        assert intent is not None and intent.lease_owner == "worker/b"


def test_a_recovery_discard_retried_after_a_machine_behind_admitted_the_turn_again_reports_it(
    store_url: str,
) -> None:
    """Recovery's discard of an abandoned turn whose COMMIT landed but was reported lost, and the turn
    admitted again before the retry by a worker whose clock is 5 s behind: the retry took the new intent
    for the abandoned one (it was not deleted: it holds another lease) and left the turn out of the
    report, though it had discarded it."""
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="rb")
        Turns(store).admit(S, "rb", user("q1"), turn_id="t1", engine_id="e", owner=f"{dead_identity()}/a")

        def admit_again() -> None:
            Turns(other).admit(S, "rb", user("q1"), turn_id="t1", engine_id="e", owner="worker/c")
            written_by_skewed_clock(other, "rb", "t1", -SKEW_US)

        with commit_lost_then(store, admit_again):
            report = Turns(store).recover(S, "rb", "e", lambda _engine: counting_engine)
        assert report.discarded == ["t1"], report
        intent = Turns(store).intent(S, "rb", "t1")
        assert intent is not None and intent.lease_owner == "worker/c"


def test_a_recovery_discard_that_did_not_land_is_not_reported_by_a_machine_ahead(store_url: str) -> None:
    """Recovery's discard of an abandoned turn whose COMMIT did not land, and a retry of the turn that took
    it over meanwhile; the intent was admitted by a worker whose clock is 5 s ahead. The retry's discard
    found the lease changed (nothing deleted), took the intent for another admission's by its
    ``created_us`` and reported the running turn discarded."""
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="ra")
        Turns(other).admit(S, "ra", user("q1"), turn_id="t1", engine_id="e", owner=f"{dead_identity()}/a")
        written_by_skewed_clock(other, "ra", "t1", SKEW_US)

        def take_over() -> None:
            Turns(other).admit(S, "ra", user("q1"), turn_id="t1", engine_id="e", owner="worker/c")

        with commit_fails_once(store, take_over):
            report = Turns(store).recover(S, "ra", "e", lambda _engine: counting_engine)
        assert report.discarded == [], report
        intent = Turns(store).intent(S, "ra", "t1")
        assert intent is not None and intent.lease_owner == "worker/c"
