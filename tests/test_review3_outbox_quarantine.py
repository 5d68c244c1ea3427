"""Review 3 of the drain's own block of another committed version, through the host (both backends).

A queued turn whose key its engine's ledger already holds as another version (a direct ``commit_turn``
of the key: another terminal, a heartbeat) is settled by the drain: blocked, ``committed_other_version``,
and the engine's later turns of the session go on. Every real drain (``run_turn``'s, the gateway's
recovery, ``transcript-store outbox drain``) delivers through ``HostRuntime.commit_in``, which quarantined
the engine on any error of its ``commit_turn`` that was not the database's. The ledger's
``AdvancementKeyCollision`` is no fault of the engine (the key was committed before, as another payload),
yet it isolated the engine for the rest of the process and wrote a quarantine record: the very next turn
of the session, queued behind the settled one, failed "engine unavailable", and every later turn of every
session of that process ran on legacy.
"""

from __future__ import annotations

from typing import Any

from hosting import CountingEngine, RecordingModel
from test_outbox_other_version_review import failing, queue_turn

from transcript_store import TranscriptStore
from transcript_store.core import Core
from transcript_store.host import HostRuntime
from transcript_store.ledger import CommitResult, TurnPayload, commit_turn_in, get_state
from transcript_store.quarantine import records
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

S = "review3-scope"
E = "counting"


def _host(store: TranscriptStore) -> HostRuntime:
    registry = EngineRegistry()
    registry.register_factory(E, lambda ctx: CountingEngine(ctx, E))
    return HostRuntime(store, load_settings(config_path=None, engine=E), RecordingModel(), registry=registry,
                       summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())


def _queue(turns: Turns, sid: str, turn_id: str, replies: int = 1) -> None:
    """A turn completed while its fast commit failed: queued for the drain."""
    queue_turn(turns, sid, turn_id, replies, scope=S, engine_id=E)


def _commit_as_heartbeat(store: TranscriptStore, turns: Turns, sid: str, turn_id: str) -> None:
    """``commit_turn`` of the queued turn's key, directly, as a heartbeat (another version)."""
    intent = turns.intent(S, sid, turn_id)
    assert intent is not None and intent.terminal is not None
    start, end = intent.admission.anchor.position, intent.terminal.position
    assert start is not None and end is not None
    messages = [e.message for e in store.read_visible(S, sid)[start : end + 1]]
    result = turns.commit_turn(E, turn_id, intent.admission, intent.terminal, messages, is_heartbeat=True)
    assert result.status == "committed"


def test_a_host_drain_settling_another_version_keeps_the_engine_and_delivers_the_next_turn(
    store: TranscriptStore,
) -> None:
    sid = store.create_session(S, session_id="review3-host").session_id
    host = _host(store)
    try:
        turns = host.turns
        _queue(turns, sid, "t1", replies=2)
        _commit_as_heartbeat(store, turns, sid, "t1")
        _queue(turns, sid, "t2")  # the engine's next turn of the session, behind t1

        report = turns.drain(host.commit_in, scope=S, session_id=sid)  # as run_turn, recovery and the CLI do
        assert report.blocked == 1
        # Before the fix: the collision quarantined the engine, so t2 failed "engine unavailable".
        assert report.failed == [], report.failed
        assert report.committed_turns == [(sid, "t2")]
        assert E not in host.quarantined
        assert store.read(lambda c: records(c, live_only=False)) == []
        row = turns.intent(S, sid, "t1")
        assert row is not None and row.state == "blocked"
        assert row.block_reason is not None and row.block_reason.startswith("committed_other_version")

        def counted(c: Core) -> Any:
            return get_state(c, S, sid, E, "turns")

        assert store.read(counted) == 1  # t2 only: the direct heartbeat commit applied nothing of the engine's
        # The engine still serves the process's later turns (it ran on legacy for good before).
        assert host.run_turn(S, sid, "and then", turn_id="t3").engine_id == E
    finally:
        host.dispose()


def test_a_failed_delivery_of_the_very_version_receipted_stays_queued(store: TranscriptStore) -> None:
    """The receipt holds the queued version itself (committed directly, same range and flag) and the
    delivery fails for another reason (the engine down): nothing is settled, the row stays queued, and the
    next drain with the engine up finds it ``duplicate``. Only another version blocks."""
    sid = store.create_session(S, session_id="review3-same").session_id
    turns = Turns(store)
    _queue(turns, sid, "t1", replies=2)
    intent = turns.intent(S, sid, "t1")
    assert intent is not None and intent.terminal is not None
    start, end = intent.admission.anchor.position, intent.terminal.position
    assert start is not None and end is not None
    messages = [e.message for e in store.read_visible(S, sid)[start : end + 1]]
    same = turns.commit_turn(E, "t1", intent.admission, intent.terminal, messages)
    assert same.status == "committed"

    report = turns.drain(lambda engine_id: failing, scope=S, session_id=sid)
    assert report.blocked == 0 and [t for _s, t, _e in report.failed] == ["t1"]
    row = turns.intent(S, sid, "t1")
    assert row is not None and row.state == "ready" and row.block_reason is None

    again = turns.drain(lambda engine_id: _ledger, scope=S, session_id=sid)
    assert (again.duplicates, again.blocked, again.failed) == (1, 0, [])
    assert turns.intent(S, sid, "t1") is None


def _ledger(c: Core, turn: TurnPayload) -> CommitResult:
    return commit_turn_in(c, turn)
