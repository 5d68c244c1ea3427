"""A queued turn whose key ``commit_turn`` receipted in another version (another terminal, heartbeat).

A turn's fast commit failed, so it waits in the outbox; then the engine's ``commit_turn`` is called for
the same advancement key directly, with another version of the turn (a shorter range, or as a heartbeat).
The ledger takes that version (its range is the transcript's), so the turn reached the engine once. The
queued row can then never be delivered: its payload collides with the receipt. Before the fix every drain
tried it again and failed with ``AdvancementKeyCollision`` for ever, holding the engine's later turns of
the session back until an operator ran ``outbox block``. The drain now settles such a row itself: blocked,
with a reason naming both versions, counted in ``DrainReport.blocked`` and kept in the outbox as evidence.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import assistant, module_store_fixtures, user
from test_outbox_review import commits_lost
from workers.turn_worker import count_turn, counting_engine

from transcript_store import TranscriptStore
from transcript_store.core import Core
from transcript_store.errors import AdvancementKeyCollision
from transcript_store.ledger import CommitResult, TurnPayload, count_turn_messages, get_state
from transcript_store.turns import CommitIn, Turns

S = "other-version-scope"
E = "engine-1"

shared_url, store, sid = module_store_fixtures(S, "outbox-other-version")


def engines(deliver: CommitIn = counting_engine) -> Callable[[str], CommitIn | None]:
    return lambda engine_id: deliver if engine_id == E else None


def failing(c: Core, turn: TurnPayload) -> CommitResult:
    raise RuntimeError("engine down")


def queue_turn(
    turns: Turns, session_id: str, turn_id: str, replies: int = 1, *, scope: str = S, engine_id: str = E
) -> None:
    """Admit a turn and complete it while its engine fails (or behind a queued turn): queued for the drain."""
    turns.admit(scope, session_id, user(f"q {turn_id}"), turn_id=turn_id, engine_id=engine_id)
    items = [{"message": assistant(f"a{i} {turn_id}")} for i in range(replies)]
    done = turns.complete(scope, session_id, turn_id, items, failing)
    assert done.commit is None and done.intent.state == "accepted"


def commit_other_version(store: TranscriptStore, turns: Turns, session_id: str, turn_id: str, version: str) -> None:
    """``commit_turn`` of the queued turn's key, directly, in another version than the queued one."""
    intent = turns.intent(S, session_id, turn_id)
    assert intent is not None and intent.terminal is not None
    visible = store.read_visible(S, session_id)
    start = intent.admission.anchor.position
    assert start is not None
    if version == "heartbeat":
        terminal, heartbeat = intent.terminal, True
    else:  # a shorter range: the first reply as the terminal
        terminal, heartbeat = store.anchor(S, session_id, visible[start + 1].entry_id), False
    assert terminal.position is not None
    messages = [e.message for e in visible[start : terminal.position + 1]]
    result = turns.commit_turn(
        E, turn_id, intent.admission, terminal, messages, is_heartbeat=heartbeat, apply=count_turn
    )
    assert result.status == "committed"


@pytest.mark.parametrize("version", ["heartbeat", "terminal"])
def test_drain_settles_a_turn_receipted_in_another_version(
    store: TranscriptStore, sid: str, version: str
) -> None:
    turns = Turns(store)
    queue_turn(turns, sid, "t1", replies=2)
    commit_other_version(store, turns, sid, "t1", version)
    queue_turn(turns, sid, "t2")  # a later turn of the same engine, held back behind t1 before the fix

    report = turns.drain(engines(), scope=S, session_id=sid)
    assert report.failed == [], report.failed  # before the fix: AdvancementKeyCollision, on every drain
    assert report.blocked == 1
    assert report.committed_turns == [(sid, "t2")]

    row = turns.intent(S, sid, "t1")
    assert row is not None and row.state == "blocked"  # kept as evidence, never silently dropped
    assert row.block_reason is not None and row.block_reason.startswith("committed_other_version")
    assert turns.intent(S, sid, "t2") is None  # delivered

    def engine_view(c: Core) -> tuple[list[str], int]:
        return get_state(c, S, sid, E, "order") or [], count_turn_messages(c, S, sid, E)

    order, _ = store.read(engine_view)
    assert order == ["t1", "t2"]  # t1 reached the engine exactly once (the direct commit), then t2
    [receipt] = [r for r in turns.receipts(S, sid, E) if r.advancement_key == "t1"]
    assert receipt.is_heartbeat == (version == "heartbeat")  # the ledger still holds the direct version

    again = turns.drain(engines(), scope=S, session_id=sid)  # settled: nothing more to do
    assert (again.failed, again.blocked, again.delivered) == ([], 0, 0)


def test_direct_commit_after_delivery_is_refused(store: TranscriptStore, sid: str) -> None:
    """The other order: the queued version was delivered first; another version is refused (typed)."""
    turns = Turns(store)
    queue_turn(turns, sid, "t1", replies=2)
    intent = turns.intent(S, sid, "t1")
    assert intent is not None and intent.terminal is not None
    assert turns.drain(engines(), scope=S, session_id=sid).committed == 1
    visible = store.read_visible(S, sid)
    messages = [e.message for e in visible]
    with pytest.raises(AdvancementKeyCollision):
        turns.commit_turn(E, "t1", intent.admission, intent.terminal, messages, is_heartbeat=True)


def test_a_failing_engine_with_the_same_version_receipted_stays_queued(store: TranscriptStore, sid: str) -> None:
    """Only another version settles the row: an engine failure while the ledger holds nothing of the key,
    or holds the queued version itself, keeps it queued for the next drain (as every failure)."""
    turns = Turns(store)
    queue_turn(turns, sid, "t1")
    report = turns.drain(engines(failing), scope=S, session_id=sid)
    assert report.blocked == 0 and len(report.failed) == 1
    row = turns.intent(S, sid, "t1")
    assert row is not None and row.state == "ready"
    assert turns.drain(engines(), scope=S, session_id=sid).committed_turns == [(sid, "t1")]


def test_settling_retried_after_an_uncertain_commit_counts_the_block(store: TranscriptStore, sid: str) -> None:
    """The block's COMMIT lands but its answer is lost: the retry finds the row blocked by that very block
    (not a failure it recorded), and the drain counts it blocked once."""
    turns = Turns(store)
    queue_turn(turns, sid, "t1", replies=2)
    commit_other_version(store, turns, sid, "t1", "heartbeat")
    with commits_lost(store, lambda n: n == 2):  # 1: the claim; the delivery rolls back; 2: the block
        report = turns.drain(engines(), scope=S, session_id=sid)
    assert (report.blocked, report.failed) == (1, [])
    row = turns.intent(S, sid, "t1")
    assert row is not None and row.state == "blocked" and row.attempt_count == 1
