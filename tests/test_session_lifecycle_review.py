"""A review of the session lifecycle under retries: a write whose COMMIT was lost (or a statement that
raced a delete) while another client deleted its session and made another under the same id.

Each test here failed on the code before its fix (see the docstrings).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from conftest import user
from test_outbox_review import commits_lost

from transcript_store import TranscriptStore
from transcript_store.turns import Turns

S = "lifecycle-scope"


@contextmanager
def commit_lost_then(store: TranscriptStore, between: Callable[[], object], *, after: int = 0) -> Iterator[None]:
    """The next write transaction that commits (past the first ``after`` of them) commits; ``between`` runs
    (another client), then the caller sees the connection drop, as when a server dies between COMMIT and
    its reply: the store retries it whole."""
    with commits_lost(store, lambda n: n == after + 1, between):
        yield


@contextmanager
def two_clients(url: str) -> Iterator[tuple[TranscriptStore, TranscriptStore]]:
    mine, other = TranscriptStore(url), TranscriptStore(url)
    try:
        yield mine, other
    finally:
        mine.close()
        other.close()


def replaced_by(other: TranscriptStore, sid: str, *contents: str) -> Callable[[], None]:
    """Another client deletes the session and makes another under its id (holding ``contents``)."""

    def replace() -> None:
        other.delete_session(S, sid)
        other.create_session(S, session_id=sid)
        for text in contents:
            other.append(S, sid, user(text))

    return replace


def texts(store: TranscriptStore, sid: str) -> list[str]:
    return [str(e.message["content"]) for e in store.read_visible(S, sid) if e.message is not None]


def test_an_append_retried_after_its_session_was_made_again_writes_nothing_there(store_url: str) -> None:
    """An append whose COMMIT landed but was reported lost, its session deleted and made again under the
    id (by another client) before the retry: the retry appended the message a second time, into the new
    session, someone else's transcript."""
    with two_clients(store_url) as (store, other):
        for sid, call in [
            ("a1", lambda sid: store.append(S, sid, user("mine"), idempotency_key="k1")),
            ("a2", lambda sid: store.append(S, sid, user("mine"))),
            ("a3", lambda sid: store.append_many(S, sid, [{"message": user("mine")}])),
            ("a4", lambda sid: store.admit(S, sid, user("mine"), turn_id="t1")),
        ]:
            store.create_session(S, session_id=sid)
            with commit_lost_then(store, replaced_by(other, sid, "theirs")):
                call(sid)
            assert texts(other, sid) == ["theirs"], sid


def test_a_turn_admitted_again_after_its_session_was_made_again_is_not(store_url: str) -> None:
    """A turn's admission whose COMMIT was lost, its session replaced before the retry: the retry admitted
    the turn in the new session (its user message and an outbox intent there)."""
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="t")
        turns = Turns(store)
        with commit_lost_then(store, replaced_by(other, "t", "theirs")):
            turns.admit(S, "t", user("mine"), turn_id="t1", engine_id="e")
        assert texts(other, "t") == ["theirs"]
        assert Turns(other).intents(S) == []


def test_a_branch_retried_after_its_session_was_made_again_leaves_that_one_alone(store_url: str) -> None:
    """A branch to the empty path whose COMMIT was lost, its session replaced before the retry: the retry
    moved the new session's head, taking its messages off its visible transcript."""
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="b")
        store.append(S, "b", user("old"))
        with commit_lost_then(store, replaced_by(other, "b", "theirs")):
            store.branch(S, "b", None)
        assert texts(other, "b") == ["theirs"]


def test_a_rewrite_retried_after_its_session_was_made_again_reports_its_own_result(store_url: str) -> None:
    """A rewrite whose COMMIT was lost, its session replaced before the retry: the retry ran the rewrite on
    the new session, and raised UnknownEntry (the entries it rewrote are not there) for a rewrite that
    landed; the new session must stay as its writer left it."""
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="r")
        made = store.append_many(S, "r", [{"message": user("m0")}, {"message": user("m1")}])
        with commit_lost_then(store, replaced_by(other, "r", "theirs")):
            result = store.rewrite_entries(S, "r", [{"entry_id": made[1].entry_id, "message": user("edited")}])
        assert (result.changed, result.rewritten_entries) == (True, 1)
        assert texts(other, "r") == ["theirs"] and other.get_session(S, "r").generation == 0


def test_an_append_retried_after_its_session_was_deleted_reports_its_own_append(store_url: str) -> None:
    """An append whose COMMIT landed but was reported lost, its session deleted before the retry: the
    retry raised UnknownSession, as if the message had never been stored (it was, then deleted)."""
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="d")
        with commit_lost_then(store, lambda: other.delete_session(S, "d")):
            entry = store.append(S, "d", user("mine"), idempotency_key="k1")
        assert entry.message == user("mine") and entry.idempotency_key == "k1"


def test_a_bootstrap_page_retried_after_a_lost_commit_is_its_own_page(store_url: str) -> None:
    """A host transcript page whose COMMIT landed but was reported lost: the retry found the resume point
    moved past the page's cursor, by that very page, and the service answered 409 ``cursor`` (re-read the
    state) for a page it had imported."""
    from mirror_helpers import a, legacy_service

    from transcript_store.service_models import BootstrapRequest, HostEntry, ImportPage

    with two_clients(store_url) as (store, _other):
        store.create_session(S, session_id="m")
        svc = next(legacy_service(store))

        def page(cursor: str | None, next_cursor: str, entry_id: str) -> BootstrapRequest:
            entries = [HostEntry(entry_id=entry_id, message=a(entry_id))]
            at = ImportPage(cursor=cursor, next_cursor=next_cursor, entries=entries)
            return BootstrapRequest(page=at, done=False)

        svc.bootstrap(S, "legacy", "m", page(None, "c1", "h0"))
        with commit_lost_then(store, lambda: None):
            out = svc.bootstrap(S, "legacy", "m", page("c1", "c2", "h1"))
        assert (out.imported, out.cursor, out.position, out.visible_count) == (1, "c2", 2, 2)
        assert texts(store, "m") == ["h0", "h1"]
        svc.runtime.dispose()


def test_a_mirrored_turn_retried_after_a_lost_commit_is_committed(store_url: str) -> None:
    """A turn committed through the service whose COMMIT landed but was reported lost: the retry found the
    ledger's receipt, of its own commit, and answered ``duplicate`` (a replay) for the call that committed
    it; ``Turns.commit_turn`` answers ``committed`` there."""
    from mirror_helpers import a, legacy_service, turn_request
    from mirror_helpers import u as host_user

    with two_clients(store_url) as (store, _other):
        store.create_session(S, session_id="c")
        svc = next(legacy_service(store))
        req = turn_request("t1", 0, [host_user("q"), a("r")], ("h0", "h1"))
        with commit_lost_then(store, lambda: None):
            out = svc.commit_turn(S, "legacy", "c", req)
        assert out.status == "committed"
        assert svc.commit_turn(S, "legacy", "c", req).status == "duplicate"  # a replay by a new call
        svc.runtime.dispose()


def test_create_session_racing_a_delete_of_its_id_is_not_a_key_conflict(store_url: str, backend: str) -> None:
    """``create_session`` of an id that exists, that session deleted by another client between the create's
    INSERT (which did nothing, the id being taken) and its read of the row: the create raised
    SessionKeyConflict, "an active session already has key None", for a session without a key. It is
    created, as it would have been a moment later."""
    if backend == "sqlite":
        pytest.skip("SQLite runs one writer at a time: no delete can land inside the create's transaction")
    from sqlalchemy import event

    with two_clients(store_url) as (store, other):
        for sid, key in [("k1", None), ("k2", "chat:2")]:
            before = other.create_session(S, session_id=sid, session_key=key)
            armed = [True]

            def after(
                conn: object, cursor: object, statement: str, *_rest: object, armed: list[bool] = armed, sid: str = sid
            ) -> None:
                if armed[0] and statement.lstrip().upper().startswith("INSERT INTO TS_SESSIONS"):
                    armed[0] = False
                    other.delete_session(S, sid)  # another client, its own transaction, committed

            event.listen(store.db.engine, "after_cursor_execute", after)
            try:
                made = store.create_session(S, session_id=sid, session_key=key)
            finally:
                event.remove(store.db.engine, "after_cursor_execute", after)
            assert not armed[0]
            assert made.session_key == key and made.incarnation != before.incarnation
            assert other.get_session(S, sid) == made


def test_a_completion_retried_after_its_session_was_made_again_reports_its_own_completion(store_url: str) -> None:
    """A turn's completion whose COMMIT landed but was reported lost, its session replaced before the
    retry: the retry appended the replies to the new session, found no intent there and raised
    UnknownTurn, for a completion that had committed (fast path) or been accepted (no engine)."""
    from workers.turn_worker import counting_engine

    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        for sid, commit_in in [("f", counting_engine), ("q", None)]:
            store.create_session(S, session_id=sid)
            turns.admit(S, sid, user("q"), turn_id="t1", engine_id="e")
            reply = [{"message": {"role": "assistant", "content": "mine"}}]
            with commit_lost_then(store, replaced_by(other, sid, "theirs")):
                done = turns.complete(S, sid, "t1", reply, commit_in)
            assert done.terminal.session_id == sid and (done.commit is not None) == (commit_in is not None)
            assert (done.commit.status if done.commit else done.intent.state) in ("committed", "accepted")
            assert texts(other, sid) == ["theirs"] and Turns(other).intents(S) == []


def test_a_failed_delivery_whose_record_was_retried_is_reported_failed(store_url: str) -> None:
    """A drain's delivery failed (the engine raised); the write that keeps its row queued with the error
    landed but its COMMIT was reported lost: the retry found the claim released (by itself) and took the
    row for one that left the outbox, so the drain reported nothing failed ("left the outbox during its
    delivery") while the row stayed queued with the error: ``outbox drain`` said all was well."""
    from transcript_store.core import Core
    from transcript_store.ledger import CommitResult, TurnPayload

    def refusing(_c: Core, _turn: TurnPayload) -> CommitResult:
        raise RuntimeError("the engine refuses this turn")

    with two_clients(store_url) as (store, _other):
        turns = Turns(store)
        store.create_session(S, session_id="d")
        turns.admit(S, "d", user("q"), turn_id="t1", engine_id="e")
        turns.complete(S, "d", "t1", [{"message": {"role": "assistant", "content": "a"}}], None)
        with commit_lost_then(store, lambda: None, after=1):  # the claim commits; then the failure's record
            report = turns.drain(lambda _engine: refusing, scope=S, session_id="d")
        assert [(sid, turn) for sid, turn, _error in report.failed] == [("d", "t1")], report
        [row] = turns.intents(S)
        assert row.attempt_count == 1 and row.lease_owner is None and "refuses" in (row.last_error or "")


def test_open_session_retried_after_its_session_was_ended_answers_it_active(store_url: str) -> None:
    """``open_session`` whose COMMIT (creating the key's session) landed but was reported lost, the session
    ended by another client before the retry: the retry found no active holder of the key, tried to
    create the session of the id it had drawn, found it (ended) and returned it, ``active`` False: an
    answer no order of the two calls gives (open returns an active session). It answers the session as
    it created it."""
    with two_clients(store_url) as (store, other):

        def end_it() -> None:
            found = other.find_session(S, "chat:o")
            assert found is not None
            other.end_session(S, found.session_id)

        with commit_lost_then(store, end_it):
            opened = store.open_session(S, "chat:o")
        assert opened.active and opened.session_key == "chat:o"
        assert not other.get_session(S, opened.session_id).active  # ended, as the other client left it


def test_an_acceptance_retried_after_a_lost_commit_is_not_a_collision_with_itself(store_url: str) -> None:
    """A turn's completion without an engine (replies + acceptance) whose COMMIT landed but was reported
    lost, and before the retry another client rewrote an earlier message (the generation rotates) or a
    drain delivered the turn: the retry built the terminal's anchor again in the new generation and
    raised OutboxCollision ("already accepted with another terminal"), or found the row delivered and
    raised UnknownTurn, for its own acceptance."""
    from workers.turn_worker import counting_engine

    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        store.create_session(S, session_id="g")
        first = store.append(S, "g", user("before the turn"))

        def rewrite() -> None:
            other.rewrite_entries(S, "g", [{"entry_id": first.entry_id, "message": user("rewritten")}])

        def drain() -> None:
            report = Turns(other).drain(lambda _engine: counting_engine, scope=S, session_id="g")
            assert report.committed == 1, report

        for turn_id, between in [("t1", rewrite), ("t2", drain)]:
            turns.admit(S, "g", user(f"q {turn_id}"), turn_id=turn_id, engine_id="e")
            reply = [{"message": {"role": "assistant", "content": f"a {turn_id}"}}]
            with commit_lost_then(store, between):
                done = turns.complete(S, "g", turn_id, reply, None)
            assert done.intent.state == "accepted" and done.commit is None, turn_id
            stored = turns.intent(S, "g", turn_id)
            if stored is not None:  # t1: accepted (the drain blocks it stale: rewritten)
                assert stored.terminal == done.terminal
            else:  # t2: delivered
                [receipt] = [r for r in turns.receipts(S, "g") if r.advancement_key == turn_id]
                assert receipt.terminal_entry_id == done.terminal.entry_id


def test_a_compaction_retried_after_a_lost_commit_reports_itself_compacted(store_url: str) -> None:
    """A compaction (the legacy engine's and the host's) whose COMMIT landed but was reported lost: the
    retry found the compaction pointer changed since its read, by itself, and reported ``compacted``
    False, "another compaction of the session was written first", for the summary it had written."""
    from typing import Any

    from transcript_store.compaction import compact_session, load_pointer

    class Summarizer:
        def summarize(self, messages: Any, previous_summary: str | None = None, focus: str | None = None) -> str:
            return f"summary of {len(messages)}"

    class Estimator:
        def count_messages(self, messages: Any) -> int:
            return sum(len(str(m.get("content"))) for m in messages)

    with two_clients(store_url) as (store, _other):
        store.create_session(S, session_id="z")
        store.append_many(S, "z", [{"message": user(f"message {i} " + "words " * 40)} for i in range(8)])
        with commit_lost_then(store, lambda: None):
            result = compact_session(store, S, "z", summarizer=Summarizer(), estimator=Estimator(), keep_last=2,
                                     force=True)
        assert result.ok and result.compacted, result
        pointer = load_pointer(store, S, "z")
        assert pointer is not None and pointer["summary"] == "summary of 6"
        assert sum(e.kind == "compaction" for e in store.list_entries(S, "z")) == 1
