"""A review of the writes outside the store core under retries: an engine's, a lease's, a drain's report.

A write whose COMMIT lands but whose caller sees the connection drop is retried whole; the retry must
answer the write that landed, never judge it someone else's (a plan refused as raced, a hand-back
reported not done, a blocked row not counted), nor do the work again. Each test here failed on the code
before its fix (see the docstrings).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conftest import commit_with, finished_turn, user
from test_outbox_review import commit_fails_once, commits_lost
from test_session_lifecycle_review import commit_lost_then, two_clients
from workers.turn_worker import counting_engine

from engines.lossless import LosslessEngine
from engines.lossless.tables import View
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

S = "lost-commit-scope"
SMALL = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
         "condensed_summary_tokens": 160, "condense_fanin": 3}


class Counting(ExtractiveSummarizer):
    """The extractive summary, counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def summarize(self, messages: Any, **kw: Any) -> Any:
        self.calls += 1
        return super().summarize(messages, **kw)


def lossless(store: TranscriptStore, summarizer: Counting) -> LosslessEngine:
    return LosslessEngine(EngineContext(store=store, config=SMALL, summarizer=summarizer, estimator=RoughEstimator()))


def delivered_or_replaced(other: TranscriptStore, sid: str, *, delivered: bool) -> Callable[[], None]:
    """What another client does between a lost COMMIT and its retry: drain ``sid``'s turn to the engine
    (one committed), or delete the session and make it again under its id."""

    def drain() -> None:
        report = Turns(other).drain(lambda _engine: counting_engine, scope=S, session_id=sid)
        assert report.committed == 1, report

    def replace() -> None:
        other.delete_session(S, sid)
        other.create_session(S, session_id=sid)

    return drain if delivered else replace


def stale_then_accepted(store: TranscriptStore, turns: Turns, sid: str) -> None:
    """A new session ``sid`` holding two accepted turns of engine "e", the first one's question rewritten
    since: its range is stale, so a drain blocks it and delivers the second."""
    store.create_session(S, session_id=sid)
    for turn_id in ("t1", "t2"):
        turns.admit(S, sid, user(f"q {turn_id}"), turn_id=turn_id, engine_id="e")
        done = turns.complete(S, sid, turn_id, [{"message": {"role": "assistant", "content": "a"}}], None)
        assert done.intent.state == "accepted"
        if turn_id == "t1":
            question = store.read_visible(S, sid)[0]
            store.rewrite_entries(S, sid, [{"entry_id": question.entry_id, "message": user("rewritten")}])


def test_a_lossless_compaction_retried_after_a_lost_commit_is_not_planned_again(store_url: str) -> None:
    """A lossless compaction whose plan's COMMIT landed but was reported lost: the retry found the view's
    epoch moved (by its own plan) and refused the plan as raced by another writer, so the compaction
    planned again on the new context: a second round of summaries and summarizer calls nobody asked for
    (a forced compaction compacted twice). It is the compaction that landed, once."""
    with two_clients(store_url) as (store, _other):
        counts: dict[str, tuple[int, int, int]] = {}
        for sid, lose in (("plain", False), ("lost", True)):
            summarizer = Counting()
            engine = lossless(store, summarizer)
            store.create_session(S, session_id=sid)
            for i in range(6):
                assert commit_with(store, engine, finished_turn(store, S, sid, f"t{i}")).status == "committed"
            epoch = store.read(lambda c, sid=sid: View.load(c, S, sid).epoch)
            if lose:
                with commit_lost_then(store, lambda: None):
                    result = engine.compact(scope=S, session_id=sid, force=True)
            else:
                result = engine.compact(scope=S, session_id=sid, force=True)
            assert result.ok and result.compacted, result
            view = store.read(lambda c, sid=sid: View.load(c, S, sid))
            counts[sid] = (view.epoch - epoch, view.next_summary, summarizer.calls)
        assert counts["lost"] == counts["plain"], counts


def test_a_hand_back_retried_after_its_session_was_made_again_reports_it_handed(store_url: str) -> None:
    """A retry's hand-back of the turn it took over, whose COMMIT landed but was reported lost, its session
    deleted and made again before the retry: the retry found no turn held in the new session and
    reported False (not handed back) for a turn it had handed back."""
    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        store.create_session(S, session_id="h")
        turns.admit(S, "h", user("q1"), turn_id="t1", engine_id="legacy", owner="worker/a")
        taken: list[Any] = []
        turns.admit(S, "h", user("q1"), turn_id="t1", engine_id="legacy", owner="worker/b", taken_over=taken)

        def replace() -> None:
            other.delete_session(S, "h")
            other.create_session(S, session_id="h")

        with commit_lost_then(store, replace):
            assert turns.hand_back(S, "h", "t1", owner="worker/b", lease=taken[0])


def test_a_hand_back_retried_after_the_turn_was_completed_reports_it_handed(store_url: str) -> None:
    """The same, the attempt the turn was handed back to completing it before the retry: the retry found
    the row accepted and reported False for its own hand-back."""
    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        store.create_session(S, session_id="c")
        turns.admit(S, "c", user("q1"), turn_id="t1", engine_id="e", owner="worker/a")
        taken: list[Any] = []
        turns.admit(S, "c", user("q1"), turn_id="t1", engine_id="e", owner="worker/b", taken_over=taken)

        def complete() -> None:
            done = Turns(other).complete(S, "c", "t1", [{"message": {"role": "assistant", "content": "a"}}], None)
            assert done.intent.state == "accepted"

        with commit_lost_then(store, complete):
            assert turns.hand_back(S, "c", "t1", owner="worker/b", lease=taken[0])


def test_a_drain_whose_claim_was_retried_counts_the_rows_it_blocked(store_url: str) -> None:
    """A drain's claim that blocked a stale row and claimed the next, its COMMIT landed but reported lost:
    the retry found the row blocked already (by itself) and its own claim, and the report said 0 blocked."""
    with two_clients(store_url) as (store, _other):
        turns = Turns(store)
        stale_then_accepted(store, turns, "d")
        with commits_lost(store, lambda n: n == 1):  # the claim's
            report = turns.drain(lambda _engine: counting_engine, scope=S, session_id="d")
        assert (report.committed, report.blocked) == (1, 1), report
        intent = turns.intent(S, "d", "t1")
        assert intent is not None and intent.state == "blocked"


def test_a_legacy_compaction_retried_after_its_session_was_made_again_writes_nothing_there(store_url: str) -> None:
    """The legacy engine's compaction whose COMMIT landed but was reported lost, its session deleted and
    made again before the retry: the retry found no compaction pointer in the new session, as it had
    read none in its own, and wrote its marker and pointer there (a summary of another conversation)."""
    from transcript_store.compaction import compact_session, load_pointer

    class Summarizer:
        def summarize(self, messages: Any, previous_summary: str | None = None, focus: str | None = None) -> str:
            return f"summary of {len(messages)}"

    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="z")
        store.append_many(S, "z", [{"message": user(f"message {i} " + "words " * 40)} for i in range(8)])

        def replace() -> None:
            other.delete_session(S, "z")
            other.create_session(S, session_id="z")
            other.append(S, "z", user("theirs"))

        with commit_lost_then(store, replace):
            result = compact_session(store, S, "z", summarizer=Summarizer(), estimator=RoughEstimator(),
                                     keep_last=2, force=True)
        assert result.ok and result.compacted, result
        assert [e.kind for e in store.list_entries(S, "z")] == ["message"]
        assert load_pointer(store, S, "z") is None


def test_a_lossless_compaction_retried_after_its_session_was_made_again_leaves_that_one_alone(
    store_url: str,
) -> None:
    """The same, the session deleted and made again (another conversation ingested) before the retry: the
    retry refused its plan (another incarnation) and the compaction planned again, on the new session,
    and compacted that one: summaries of another conversation this call was never asked for."""
    with two_clients(store_url) as (store, other):
        summarizer = Counting()
        engine = lossless(store, summarizer)
        store.create_session(S, session_id="n")
        for i in range(6):
            assert commit_with(store, engine, finished_turn(store, S, "n", f"t{i}")).status == "committed"

        def replace() -> None:
            other.delete_session(S, "n")
            other.create_session(S, session_id="n")
            theirs = lossless(other, Counting())
            for i in range(6):
                assert commit_with(other, theirs, finished_turn(other, S, "n", f"u{i}")).status == "committed"

        with commit_lost_then(store, replace):
            result = engine.compact(scope=S, session_id="n", force=True)
        assert result.ok and result.compacted, result
        assert store.read(lambda c: View.load(c, S, "n").epoch) == 0
        assert summarizer.calls == 1


def test_a_lossless_import_retried_after_a_lost_commit_reports_what_it_imported(store_url: str) -> None:
    """A lossless bootstrap whose import's COMMIT landed but was reported lost: the retry found the
    messages imported (by itself) and imported nothing, and the bootstrap reported 0 messages imported."""
    with two_clients(store_url) as (store, _other):
        store.create_session(S, session_id="i")
        store.append_many(S, "i", [{"message": user(f"message {i}")} for i in range(5)])
        engine = lossless(store, Counting())
        with commit_lost_then(store, lambda: None):
            result = engine.bootstrap(scope=S, session_id="i", fence=None)
        assert result.bootstrapped and result.imported_messages == 5, result
        assert engine.stats["imported"] == 5


def test_an_acceptance_by_hand_retried_after_a_lost_commit_answers_its_own_acceptance(store_url: str) -> None:
    """``Turns.accept`` whose COMMIT landed but was reported lost, and a drain delivered the turn before
    the retry (or its session was deleted and made again): the retry found no intent and raised
    UnknownTurn (UnknownSession) for the acceptance that landed."""
    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        for sid in ("a1", "a2"):
            store.create_session(S, session_id=sid)
            turns.admit(S, sid, user("q"), turn_id="t1", engine_id="e")
            reply = store.append(S, sid, {"role": "assistant", "content": "a"})
            terminal = store.anchor(S, sid, reply.entry_id)

            with commit_lost_then(store, delivered_or_replaced(other, sid, delivered=sid == "a1")):
                intent = turns.accept(S, sid, "t1", terminal)
            assert intent.turn_id == "t1" and intent.state == "accepted", intent


def test_a_block_by_hand_retried_after_its_session_was_deleted_answers_its_own_block(store_url: str) -> None:
    """``Turns.block`` whose COMMIT landed but was reported lost, the session deleted before the retry:
    the retry found no row and raised UnknownTurn for the block that landed."""
    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        store.create_session(S, session_id="b")
        turns.admit(S, "b", user("q"), turn_id="t1", engine_id="e")
        assert turns.complete(S, "b", "t1", [{"message": {"role": "assistant", "content": "a"}}], None).commit is None
        with commit_lost_then(store, lambda: other.delete_session(S, "b")):
            intent = turns.block(S, "b", "t1", "never deliverable")
        assert intent.state == "blocked" and intent.turn_id == "t1", intent


def test_a_service_session_retried_after_a_lost_commit_answers_it_as_created(store_url: str) -> None:
    """The service's session create by id with ``rebind_key`` whose COMMIT landed but was reported lost,
    and before the retry another caller rebound the key to its own session (ending this one): the retry
    answered this call's session ended, an answer no order of the two calls gives (``open_session``
    answers its session as it created it)."""
    from mirror_helpers import legacy_service

    from transcript_store.service_models import OpenSession

    with two_clients(store_url) as (store, other):
        svc = next(legacy_service(store))
        theirs = next(legacy_service(other))
        with commit_lost_then(store, lambda: theirs.open_session(S, OpenSession(session_id="o2", session_key="k",
                                                                                 rebind_key=True))):
            info = svc.open_session(S, OpenSession(session_id="o1", session_key="k", rebind_key=True))
        assert (info.session_id, info.active, info.session_key) == ("o1", True, "k"), info
        holder = store.find_session(S, "k")
        assert holder is not None and holder.session_id == "o2"
        svc.runtime.dispose()
        theirs.runtime.dispose()


def test_the_retries_of_a_commit_that_did_not_land_write_it(store_url: str) -> None:
    """The other side of each check above: a COMMIT that failed (did not land) is written by the retry,
    once, and reported as its caller would see it without the failure."""
    with two_clients(store_url) as (store, _other):
        summarizer = Counting()
        engine = lossless(store, summarizer)
        store.create_session(S, session_id="f")
        store.append_many(S, "f", [{"message": user(f"message {i}")} for i in range(3)])
        with commit_fails_once(store, lambda: None):
            assert engine.bootstrap(scope=S, session_id="f", fence=None).imported_messages == 3
        assert store.read(lambda c: View.load(c, S, "f").next_item) == 3
        for i in range(6):
            assert commit_with(store, engine, finished_turn(store, S, "f", f"t{i}")).status == "committed"
        with commit_fails_once(store, lambda: None):
            result = engine.compact(scope=S, session_id="f", force=True)
        assert result.compacted
        assert store.read(lambda c: View.load(c, S, "f").epoch) == 1

        turns = Turns(store)
        store.create_session(S, session_id="fh")
        turns.admit(S, "fh", user("q1"), turn_id="t1", engine_id="e", owner="worker/a")
        taken: list[Any] = []
        turns.admit(S, "fh", user("q1"), turn_id="t1", engine_id="e", owner="worker/b", taken_over=taken)
        with commit_fails_once(store, lambda: None):
            assert turns.hand_back(S, "fh", "t1", owner="worker/b", lease=taken[0])
        intent = turns.intent(S, "fh", "t1")
        assert intent is not None and intent.lease_owner == "worker/a"

        stale_then_accepted(store, turns, "fd")
        with commit_fails_once(store, lambda: None):
            report = turns.drain(lambda _engine: counting_engine, scope=S, session_id="fd")
        assert (report.committed, report.blocked) == (1, 1), report


def test_a_legacy_compaction_whose_session_was_made_again_while_it_summarized_writes_nothing_there(
    store_url: str,
) -> None:
    """The legacy engine's compaction, its session deleted and made again under the id while the summarizer
    ran: the write found no compaction pointer in the new session, as it had read none in its own, and
    wrote its marker and pointer there (a summary of another conversation in someone else's session)."""
    from transcript_store.compaction import compact_session, load_pointer

    with two_clients(store_url) as (store, other):

        class Replacing:
            def summarize(self, messages: Any, previous_summary: str | None = None, focus: str | None = None) -> str:
                other.delete_session(S, "w")
                other.create_session(S, session_id="w")
                other.append(S, "w", user("theirs"))
                return f"summary of {len(messages)}"

        store.create_session(S, session_id="w")
        store.append_many(S, "w", [{"message": user(f"message {i} " + "words " * 40)} for i in range(8)])
        result = compact_session(store, S, "w", summarizer=Replacing(), estimator=RoughEstimator(), keep_last=2,
                                 force=True)
        assert not result.compacted, result
        assert [e.kind for e in store.list_entries(S, "w")] == ["message"]
        assert load_pointer(store, S, "w") is None


def test_a_bootstrap_page_whose_commit_did_not_land_is_imported_by_the_retry(store_url: str) -> None:
    """A host page that rewinds the mirror (the host edited its last message and imports from its start
    again, under the same next cursor) whose COMMIT did not land: the retry found the resume point and the
    mirror's size as the page leaves them (a rewind replaces as many messages as it drops) and answered
    the earlier attempt's import, which never happened: the edit was reported imported and never stored."""
    from mirror_helpers import a, legacy_service

    from transcript_store.service_models import BootstrapRequest, HostEntry, ImportPage

    with two_clients(store_url) as (store, _other):
        store.create_session(S, session_id="rw")
        svc = next(legacy_service(store))

        def page(*messages: tuple[str, str]) -> BootstrapRequest:
            entries = [HostEntry(entry_id=eid, message=a(text)) for eid, text in messages]
            return BootstrapRequest(page=ImportPage(cursor=None, next_cursor="c1", entries=entries), done=False)

        svc.bootstrap(S, "legacy", "rw", page(("h0", "first"), ("h1", "second")))
        with commit_fails_once(store, lambda: None):
            out = svc.bootstrap(S, "legacy", "rw", page(("h0", "first"), ("h1b", "second, edited")))
        assert (out.imported, out.rewound, out.visible_count) == (1, True, 2), out
        assert [e.message["content"] for e in store.read_visible(S, "rw") if e.message] == ["first", "second, edited"]
        svc.runtime.dispose()


def test_an_admission_retried_after_a_lost_commit_reports_the_lease_it_took_over(store_url: str) -> None:
    """A retry's admission that took the turn over from a live attempt, its COMMIT landed but reported
    lost: the retry found the turn its own already (nothing to take over) and emptied ``taken_over``, so
    the caller had no lease to hand the turn back with should it fail, and discarded the live attempt's."""
    with two_clients(store_url) as (store, _other):
        turns = Turns(store)
        store.create_session(S, session_id="to")
        turns.admit(S, "to", user("q1"), turn_id="t1", engine_id="e", owner="worker/a")
        taken: list[Any] = []
        with commit_lost_then(store, lambda: None):
            turns.admit(S, "to", user("q1"), turn_id="t1", engine_id="e", owner="worker/b", taken_over=taken)
        assert [(lease.turn_id, lease.owner) for lease in taken] == [("t1", "worker/a")], taken
        assert turns.hand_back(S, "to", "t1", owner="worker/b", lease=taken[0])
        intent = turns.intent(S, "to", "t1")
        assert intent is not None and intent.lease_owner == "worker/a"


def test_a_drain_whose_claim_did_not_land_counts_no_block_another_drain_made(store_url: str) -> None:
    """A drain's claim that blocked a stale row and claimed the next, its COMMIT failed (did not land),
    and another drain blocked that row and delivered the next before the retry: the retry found the row
    blocked (by the other drain) and counted it as its own, so both drains reported the one block."""
    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        stale_then_accepted(store, turns, "db")
        theirs: list[Any] = []

        def drain() -> None:
            theirs.append(Turns(other).drain(lambda _engine: counting_engine, scope=S, session_id="db"))

        with commit_fails_once(store, drain):
            mine = turns.drain(lambda _engine: counting_engine, scope=S, session_id="db")
        assert (theirs[0].committed, theirs[0].blocked) == (1, 1), theirs
        assert (mine.committed, mine.blocked) == (0, 0), mine


def test_a_lossless_import_retried_after_another_importer_reports_what_it_imported(store_url: str) -> None:
    """A lossless bootstrap whose import's COMMIT landed but was reported lost, and another process's
    engine imported a message appended since before the retry: the retry found the view moved past what
    its import had saved, imported nothing, and reported 0 messages for the 5 it imported."""
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="il")
        store.append_many(S, "il", [{"message": user(f"message {i}")} for i in range(5)])
        engine, theirs = lossless(store, Counting()), lossless(other, Counting())

        def grow_and_import() -> None:
            other.append(S, "il", user("later"))
            assert theirs.bootstrap(scope=S, session_id="il", fence=None).imported_messages == 1

        with commit_lost_then(store, grow_and_import):
            result = engine.bootstrap(scope=S, session_id="il", fence=None)
        assert result.bootstrapped and result.imported_messages == 5, result
        assert engine.stats["imported"] == 5


def test_a_lossless_import_that_did_not_land_reports_none_another_importer_made(store_url: str) -> None:
    """A lossless bootstrap whose import's COMMIT did not land, and another process's engine imported the
    same 5 messages before the retry: the retry found the view as its own import would have left it and
    reported those 5 as its own (both engines said they imported them)."""
    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="if")
        store.append_many(S, "if", [{"message": user(f"message {i}")} for i in range(5)])
        engine, theirs = lossless(store, Counting()), lossless(other, Counting())
        imported: list[int] = []

        def import_theirs() -> None:
            imported.append(theirs.bootstrap(scope=S, session_id="if", fence=None).imported_messages)

        with commit_fails_once(store, import_theirs):
            result = engine.bootstrap(scope=S, session_id="if", fence=None)
        assert imported == [5]
        assert result.bootstrapped and result.imported_messages == 0, result
        assert engine.stats["imported"] == 0


def test_a_hand_back_that_did_not_land_is_not_reported_handed_by_its_retry(store_url: str) -> None:
    """A retry's hand-back whose COMMIT did not land: before its retry, the attempt it took the turn from
    ended (left the list of attempts), or another retry took the turn over from it. Its retry then
    discarded the turn (no live attempt to hand it to) or only left that list, found the turn no longer
    its own, and answered True (handed back) for a hand-back that never happened."""
    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        for sid in ("hl1", "hl2"):
            store.create_session(S, session_id=sid)
            turns.admit(S, sid, user("q1"), turn_id="t1", engine_id="e", owner="worker/a")
            taken: list[Any] = []
            turns.admit(S, sid, user("q1"), turn_id="t1", engine_id="e", owner="worker/b", taken_over=taken)

            def end_a(sid: str = sid) -> None:
                assert not Turns(other).discard(S, sid, "t1", owner="worker/a")  # it leaves the list

            def take_over(sid: str = sid) -> None:
                Turns(other).admit(S, sid, user("q1"), turn_id="t1", engine_id="e", owner="worker/c")

            with commit_fails_once(store, end_a if sid == "hl1" else take_over):
                assert not turns.hand_back(S, sid, "t1", owner="worker/b", lease=taken[0]), sid
            intent = turns.intent(S, sid, "t1")
            if sid == "hl1":
                assert intent is None  # discarded by the retry: no attempt left to hand it to
            else:
                assert intent is not None and intent.lease_owner == "worker/c"
                assert [o for o, _ in intent_leases(store, sid)] == ["worker/a"]


def intent_leases(store: TranscriptStore, sid: str) -> list[tuple[str, int]]:
    from transcript_store import outbox

    row = store.read(lambda c: outbox.get_row(c, S, sid, "t1"))
    return outbox.parse_displaced(row.displaced_leases)


def test_a_host_compaction_retried_after_its_session_was_made_again_writes_nothing_there(store_url: str) -> None:
    """The service's record of a host's compaction whose COMMIT landed but was reported lost, its session
    deleted and made again before the retry: the retry wrote the pointer (the summary of this call's
    conversation) into the new session, and answered that session's size."""
    from mirror_helpers import legacy_service

    from transcript_store.compaction import load_pointer
    from transcript_store.service_models import HostCompactionRequest

    with two_clients(store_url) as (store, other):
        svc = next(legacy_service(store))
        store.create_session(S, session_id="hc")
        store.append_many(S, "hc", [{"message": user(f"message {i}")} for i in range(4)])
        kept = store.read_visible(S, "hc")[2].entry_id
        req = HostCompactionRequest(summary="what came before", first_kept_position=2, first_kept_entry_id=kept)
        def replace() -> None:
            other.delete_session(S, "hc")
            other.create_session(S, session_id="hc")
            other.append_many(S, "hc", [{"message": user(f"theirs {i}")} for i in range(3)])

        with commit_lost_then(store, replace):
            out = svc.host_compaction(S, "legacy", "hc", req)
        assert (out.first_kept_position, out.visible_count) == (2, 4), out
        assert load_pointer(other, S, "hc") is None
        svc.runtime.dispose()


def test_a_session_created_by_id_and_retried_after_it_was_ended_answers_it_active(store_url: str) -> None:
    """``create_session`` with the caller's id whose COMMIT landed but was reported lost, the session ended
    by another client before the retry: the retry found its own session (the same id and key: a no-op)
    and answered it ended, an answer no order of the two calls gives (``open_session`` answers its
    session as it created it)."""
    with two_clients(store_url) as (store, other):
        with commit_lost_then(store, lambda: other.end_session(S, "ce")):
            info = store.create_session(S, session_id="ce", session_key="chat:ce")
        assert (info.session_id, info.session_key, info.active) == ("ce", "chat:ce", True), info
        assert not other.get_session(S, "ce").active


def test_a_discard_retried_after_the_turn_was_admitted_again_reports_it_discarded(store_url: str) -> None:
    """A failed attempt's discard of its turn (``discard(owner=)``) whose COMMIT landed but was reported
    lost, and another attempt of the turn admitted it again before the retry: the retry found an intent
    of the turn (the new attempt's, nothing of its own) and answered False (not discarded) for the
    discard that landed. Without an owner, the retry deleted the new attempt's intent: it stands."""
    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        for sid, owner in (("dd", "worker/a"), ("dn", None)):
            store.create_session(S, session_id=sid)
            turns.admit(S, sid, user("q1"), turn_id="t1", engine_id="e", owner="worker/a")

            def admit_again(sid: str = sid) -> None:
                Turns(other).admit(S, sid, user("q1"), turn_id="t1", engine_id="e", owner="worker/c")

            with commit_lost_then(store, admit_again):
                assert turns.discard(S, sid, "t1", owner=owner), sid
            intent = turns.intent(S, sid, "t1")
            assert intent is not None and intent.lease_owner == "worker/c", sid


def test_a_completion_queued_after_its_engine_failed_and_retried_answers_its_own_acceptance(store_url: str) -> None:
    """``complete`` whose fast commit failed (the engine raised) and whose slow acceptance's COMMIT landed
    but was reported lost, and before the retry a drain delivered the turn (or its session was deleted
    and made again): the retry found no intent and raised UnknownTurn (UnknownSession) for the turn it
    had queued, and the host took the completed turn for a failed one."""

    def failing(_c: Any, _turn: Any) -> Any:
        raise RuntimeError("the engine is down")

    with two_clients(store_url) as (store, other):
        turns = Turns(store)
        for sid in ("q1", "q2"):
            store.create_session(S, session_id=sid)
            turns.admit(S, sid, user("q"), turn_id="t1", engine_id="e")

            with commit_lost_then(store, delivered_or_replaced(other, sid, delivered=sid == "q1")):
                done = turns.complete(S, sid, "t1", [{"message": {"role": "assistant", "content": "a"}}], failing)
            assert done.intent.state == "accepted" and done.commit is None, done
            assert done.fast_path_error is not None and "engine is down" in done.fast_path_error, done


def test_a_recovery_discard_retried_after_the_turn_was_admitted_again_reports_it(store_url: str) -> None:
    """Recovery's discard of an abandoned turn whose COMMIT landed but was reported lost, and another
    attempt admitted the turn again before the retry: the retry found an intent of the turn (the new
    attempt's) and left the turn out of the report's discarded turns, though it had discarded it."""
    import time

    from transcript_store.outbox import OutboxConfig

    with two_clients(store_url) as (store, other):
        store.create_session(S, session_id="rd")
        Turns(store, OutboxConfig(turn_lease_seconds=0.05)).admit(
            S, "rd", user("q1"), turn_id="t1", engine_id="e", owner="worker/a"
        )
        time.sleep(0.2)  # its lease ran out: abandoned

        def admit_again() -> None:
            Turns(other).admit(S, "rd", user("q1"), turn_id="t1", engine_id="e", owner="worker/c")

        with commit_lost_then(store, admit_again):
            report = Turns(store).recover(S, "rd", "e", lambda _engine: counting_engine)
        assert report.discarded == ["t1"], report
        intent = Turns(store).intent(S, "rd", "t1")
        assert intent is not None and intent.lease_owner == "worker/c"
