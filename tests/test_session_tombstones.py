"""A session made by a call whose COMMIT was lost, deleted by another client before the retry: the retry
must not make it again. ``delete_session`` leaves a tombstone of the incarnation it deleted
(``ts_deleted_sessions``, revision 0015) that tells "my earlier attempt landed, then it was deleted"
from "my earlier attempt never landed"; a deliberate create under the id after a delete still creates.

Each retry test here failed on the code before the tombstone (see the docstrings).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
from conftest import user
from sqlalchemy import func, insert, select
from test_outbox_review import commit_fails_once
from test_session_lifecycle_review import commit_lost_then, two_clients

from transcript_store import TranscriptStore, UnknownSession
from transcript_store.core import TOMBSTONE_SECONDS, Core, now_us
from transcript_store.schema import deleted_sessions

S = "tombstone-scope"
T = TypeVar("T")


def gone(store: TranscriptStore, sid: str) -> bool:
    try:
        store.get_session(S, sid)
    except UnknownSession:
        return True
    return False


def tombstones(store: TranscriptStore, sid: str | None = None) -> list[tuple[str, int]]:
    q = select(deleted_sessions.c.session_id, deleted_sessions.c.incarnation).where(deleted_sessions.c.scope == S)
    if sid is not None:
        q = q.where(deleted_sessions.c.session_id == sid)
    return store.read(lambda c: [(r.session_id, r.incarnation) for r in c.conn.execute(q)])


def test_a_created_session_deleted_before_the_retry_is_not_created_again(store_url: str) -> None:
    """``create_session`` with the caller's id whose COMMIT landed but was reported lost, the session
    deleted by another client before the retry: the retry found no session under the id and created it
    again, a session the other client had deleted. It answers the session it created; it stays deleted."""
    with two_clients(store_url) as (store, other):
        for sid, key in (("c1", None), ("c2", "chat:c2")):
            with commit_lost_then(store, lambda sid=sid: other.delete_session(S, sid)):
                info = store.create_session(S, session_id=sid, session_key=key)
            assert (info.session_id, info.session_key, info.active) == (sid, key, True), info
            assert gone(other, sid), sid
            assert tombstones(other, sid) == [(sid, info.incarnation)]
        assert other.find_session(S, "chat:c2") is None


def test_a_created_session_replaced_before_the_retry_answers_its_own(store_url: str) -> None:
    """As above, and another client made a session under the id again before the retry: the retry
    answered that session (the id and key matched: a no-op) as the one this call created. It answers
    its own session, and leaves the other client's alone."""
    with two_clients(store_url) as (store, other):
        made: list[int] = []

        def replace() -> None:
            other.delete_session(S, "r1")
            made.append(other.create_session(S, session_id="r1").incarnation)
            other.append(S, "r1", user("theirs"))

        with commit_lost_then(store, replace):
            info = store.create_session(S, session_id="r1")
        assert info.incarnation != made[0] and info.entry_count == 0
        now = other.get_session(S, "r1")
        assert now.incarnation == made[0] and now.entry_count == 1


def test_an_opened_session_deleted_before_the_retry_is_not_created_again(store_url: str) -> None:
    """``open_session`` whose COMMIT (creating the key's session) landed but was reported lost, the session
    deleted by another client before the retry: the retry found no holder of the key and created the
    session again under the id it had drawn. It answers the session it created; the key stays free."""
    with two_clients(store_url) as (store, other):

        def delete_it() -> None:
            found = other.find_session(S, "chat:o")
            assert found is not None
            other.delete_session(S, found.session_id)

        with commit_lost_then(store, delete_it):
            opened = store.open_session(S, "chat:o")
        assert opened.active and opened.session_key == "chat:o"
        assert gone(other, opened.session_id) and other.find_session(S, "chat:o") is None


def test_an_imported_session_deleted_before_the_retry_is_not_imported_again(store_url: str) -> None:
    """``import_session`` whose COMMIT landed but was reported lost, the session deleted by another client
    before the retry: the retry imported it again, every entry, under the deleted session's id. It
    answers the session it imported; it stays deleted (and replaced by another, that one stays)."""
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="src")
        store.append_many(S, "src", [{"message": user("one")}, {"message": user("two")}])
        header, records = store.export_session(S, "src")
        for sid, again in (("i1", False), ("i2", True)):

            def delete_it(sid: str = sid, again: bool = again) -> None:
                other.delete_session(S, sid)
                if again:
                    other.create_session(S, session_id=sid)

            with commit_lost_then(store, delete_it):
                info = store.import_session(S, header, records, session_id=sid)
            assert (info.session_id, info.entry_count) == (sid, 2), info
            assert gone(other, sid) if not again else other.get_session(S, sid).entry_count == 0


def test_a_service_session_deleted_before_the_retry_is_not_created_again(store_url: str) -> None:
    """The service's session create by id whose COMMIT landed but was reported lost, the session deleted
    by another client before the retry: the retry created it again."""
    from mirror_helpers import legacy_service

    from transcript_store.service_models import OpenSession

    with two_clients(store_url) as (store, other):
        svc = next(legacy_service(store))
        with commit_lost_then(store, lambda: other.delete_session(S, "sv")):
            info = svc.open_session(S, OpenSession(session_id="sv", session_key="k", rebind_key=True))
        assert (info.session_id, info.session_key, info.active) == ("sv", "k", True), info
        assert gone(other, "sv") and other.find_session(S, "k") is None
        svc.runtime.dispose()


def test_a_service_session_under_an_idempotency_key_deleted_before_the_retry_is_not_created_again(
    store_url: str,
) -> None:
    """A create under an ``Idempotency-Key`` whose COMMIT landed but was reported lost, the session deleted
    by another client before the store's own retry: the retry found no session under the key's id and
    created it again. It answers the session it created; it stays deleted."""
    from mirror_helpers import legacy_service

    from transcript_store.core import derived_id
    from transcript_store.service_models import OpenSession

    with two_clients(store_url) as (store, other):
        svc = next(legacy_service(store))
        for n, key in enumerate((None, "idem-k")):
            sid = derived_id(f"Idempotency-Key\x00idem-{n}")
            with commit_lost_then(store, lambda sid=sid: other.delete_session(S, sid)):
                info = svc.open_session(S, OpenSession(session_key=key), f"idem-{n}")
            assert (info.session_id, info.session_key, info.active) == (sid, key, True), info
            assert gone(other, sid) and tombstones(other, sid) == [(sid, info.incarnation)]
        svc.runtime.dispose()


def raced_inside_the_retry(
    store: TranscriptStore, at: Callable[[str], bool], race: Callable[[], object], call: Callable[[], T]
) -> tuple[T, threading.Thread]:
    """Run ``call``, its first COMMIT lost, and ``race`` in a thread (3 s) before the retry's statement ``at`` picks."""
    from sqlalchemy import event

    armed: list[bool] = []
    racing: list[threading.Thread] = []

    def before(conn: object, cursor: object, statement: str, *_rest: object) -> None:
        if armed and at(statement):
            armed.clear()
            racing.append(threading.Thread(target=race))
            racing[0].start()
            racing[0].join(3)

    event.listen(store.db.engine, "before_cursor_execute", before)
    try:
        with commit_lost_then(store, lambda: armed.append(True)):
            out = call()
    finally:
        event.remove(store.db.engine, "before_cursor_execute", before)
    return out, racing[0]


def deleted_inside_the_retry(store: TranscriptStore, other: TranscriptStore, sid: str, call: Callable[[], T]) -> T:
    """Run ``call`` (a write making session ``sid``) with its first COMMIT lost; inside the retry's
    transaction, just before its insert of the session, another client deletes ``sid`` (its own
    transaction, in a thread, given 3 s: it commits then, unless it waits for a lock the retry holds)."""
    out, deleting = raced_inside_the_retry(
        store, lambda statement: statement.lstrip().upper().startswith("INSERT INTO TS_SESSIONS"),
        lambda: other.delete_session(S, sid), call)
    deleting.join(30)
    assert not deleting.is_alive()
    return out


def test_a_delete_landing_inside_the_retry_does_not_let_it_make_the_session_again(
    store_url: str, backend: str
) -> None:
    """PostgreSQL: a create (or import) whose COMMIT landed but was reported lost, and another client's
    delete of the session committing inside the retry's transaction, between its read of the row and
    its insert: the retry found its session there, then its insert found nothing to conflict with, and
    it made the session again. The retry locks the row it reads: the delete waits for it, then deletes."""
    if backend == "sqlite":
        pytest.skip("SQLite runs one writer at a time: no delete can land inside the retry's transaction")
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="src")
        exported = store.export_session(S, "src")
        for sid, info in [
            ("rc", deleted_inside_the_retry(store, other, "rc", lambda: store.create_session(S, session_id="rc"))),
            ("ri", deleted_inside_the_retry(store, other, "ri",
                                            lambda: store.import_session(S, *exported, session_id="ri"))),
        ]:
            assert info.session_id == sid and gone(other, sid), sid
            assert tombstones(other, sid) == [(sid, info.incarnation)], sid


def test_a_service_retry_and_a_rebind_of_its_key_do_not_deadlock(store_url: str, backend: str) -> None:
    """PostgreSQL: the service's create by id with ``rebind_key`` whose COMMIT landed but was reported lost;
    inside the retry another caller rebinds the key (its lock on the key held, it waits for this session's
    row, to end it). The retry locked the row first and the key's lock then: a deadlock, one of the two
    transactions aborted (40P01) and run again a second later. The retry takes the key's lock first."""
    if backend == "sqlite":
        pytest.skip("SQLite runs one writer at a time: no rebind can run inside the retry's transaction")
    from mirror_helpers import legacy_service

    from transcript_store.service_models import OpenSession

    with two_clients(store_url) as (store, other):
        svc, theirs = next(legacy_service(store)), next(legacy_service(other))
        info, rebinding = raced_inside_the_retry(
            store, lambda statement: "pg_advisory_xact_lock" in statement,
            lambda: theirs.open_session(S, OpenSession(session_id="kb2", session_key="k", rebind_key=True)),
            lambda: svc.open_session(S, OpenSession(session_id="kb1", session_key="k", rebind_key=True)))
        rebinding.join(30)
        assert (info.session_id, info.active) == ("kb1", True)
        holder = other.find_session(S, "k")
        assert holder is not None and holder.session_id == "kb2" and not other.get_session(S, "kb1").active
        assert (store.db.retries, other.db.retries) == (1, 0)  # the lost COMMIT's retry alone
        svc.runtime.dispose()
        theirs.runtime.dispose()


def test_a_retry_whose_first_commit_did_not_land_creates_the_session(store_url: str) -> None:
    """The other side: a first attempt whose COMMIT failed (did not land), another client creating and
    deleting a session under the id meanwhile: that tombstone is of another incarnation, so the retry
    creates the session, once, as the call would have without the failure."""
    with two_clients(store_url) as (store, other):

        def made_and_deleted() -> None:
            other.create_session(S, session_id="n1", session_key="chat:n1")
            other.delete_session(S, "n1")

        with commit_fails_once(store, made_and_deleted):
            info = store.create_session(S, session_id="n1", session_key="chat:n1")
        assert other.get_session(S, "n1") == info and len(tombstones(other, "n1")) == 1
        with commit_fails_once(store, lambda: None):
            opened = store.open_session(S, "chat:n2")
        found = other.find_session(S, "chat:n2")
        assert found is not None and found.session_id == opened.session_id


def test_a_deliberate_create_after_a_delete_makes_the_session_again(store: TranscriptStore) -> None:
    """A create under the id of a deleted session is a new call, not a retry: it makes a new session (a new
    incarnation), as many times as the id is deleted and created; each delete leaves its tombstone."""
    made = [store.create_session(S, session_id="d1", session_key="chat:d1")]
    for _ in range(2):
        store.delete_session(S, "d1")
        made.append(store.create_session(S, session_id="d1", session_key="chat:d1"))
        store.append(S, "d1", user("again"))
    assert len({m.incarnation for m in made}) == 3 and store.get_session(S, "d1").entry_count == 1
    assert sorted(tombstones(store, "d1")) == sorted(("d1", m.incarnation) for m in made[:2])
    exported = store.export_session(S, "d1")
    imported = store.import_session(S, *exported, session_id="d2", session_key="chat:d2")
    store.delete_session(S, "d2")
    again = store.import_session(S, *exported, session_id="d2", session_key="chat:d2")
    assert again.incarnation != imported.incarnation and store.get_session(S, "d2") == again


def test_tombstones_past_the_retry_horizon_are_pruned_by_the_next_delete(store: TranscriptStore) -> None:
    """Tombstones are bounded: each delete removes those older than ``TOMBSTONE_SECONDS`` (far past any
    call's retries), of every session; younger ones stay."""
    old = now_us() - TOMBSTONE_SECONDS * 1_000_000 - 1
    young = now_us() - TOMBSTONE_SECONDS * 1_000_000 // 2

    def seed(c: Core) -> None:
        c.conn.execute(insert(deleted_sessions), [
            {"scope": S, "session_id": "old", "incarnation": 1, "deleted_us": old},
            {"scope": "other-scope", "session_id": "old", "incarnation": 2, "deleted_us": old},
            {"scope": S, "session_id": "young", "incarnation": 3, "deleted_us": young},
        ])

    store.write(seed)
    store.create_session(S, session_id="p1")
    gone_one = store.delete_session(S, "p1")
    assert sorted(tombstones(store)) == sorted([("young", 3), ("p1", gone_one.incarnation)])
    total = store.read(lambda c: c.conn.execute(select(func.count()).select_from(deleted_sessions)).scalar_one())
    assert total == 2


@pytest.mark.parametrize("lost", [False, True])
def test_a_delete_retried_after_a_lost_commit_leaves_one_tombstone(store_url: str, lost: bool) -> None:
    """A delete whose COMMIT was lost (or failed) is answered once and leaves one tombstone of the
    session it deleted: the retry writes no second one and raises nothing."""
    with two_clients(store_url) as (store, other):
        made = store.create_session(S, session_id="x1")
        ctx = commit_lost_then(store, lambda: None) if lost else commit_fails_once(store, lambda: None)
        with ctx:
            assert store.delete_session(S, "x1").incarnation == made.incarnation
        assert tombstones(other, "x1") == [("x1", made.incarnation)]
