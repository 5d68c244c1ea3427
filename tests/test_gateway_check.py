"""The gateway's exactly-once check must be able to fail: a finished run's store is corrupted in each way the
check claims to rule out (a lost accepted turn, a turn in the engine twice, a partial turn, turns committed
out of admission order, a committed message gone from the transcript) and the check is run again on it.

A real gateway run (a worker process) on real SQLite files and the real PostgreSQL; the corruption is raw SQL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from rich.console import Console

from transcript_store import StoreConfig, TranscriptStore
from transcript_store.gateway import GatewayOptions, GatewayReport, Job, _finish, run_gateway
from transcript_store.models import Admission

QUIET = Console(quiet=True)
TURNS = 3


def _run(store_url: str) -> GatewayOptions:
    """A finished run without faults on legacy: one session of TURNS turns (turn 0 holds a tool round)."""
    options = GatewayOptions(
        db_url=store_url, engine="legacy", workers=1, sessions=1, turns=TURNS, faults=False, progress=False
    )
    report = run_gateway(options, QUIET)
    assert report.ok and report.committed == TURNS, report.problems
    return options


def _recheck(options: GatewayOptions) -> GatewayReport:
    """The run's check again, on the store as it is now (the plan rebuilt from its one session)."""
    with TranscriptStore(config=StoreConfig(url=str(options.db_url))) as store:
        [info] = store.list_sessions(options.scope)
        sid = info.session_id
        plan = {sid: [Job(sid, f"{sid}:turn-{t}", "") for t in range(TURNS)]}
        outcomes = {job.turn_id: {"status": "committed"} for job in plan[sid]}
        report = GatewayReport(url=str(options.db_url), engine="legacy", workers=1, planned_turns=TURNS)
        _finish(store, options, "legacy", plan, outcomes, report, set())
    return report


def _sql(url: str, statement: str, **params: Any) -> list[Any]:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            result = conn.execute(sa.text(statement), params)
            return list(result) if result.returns_rows else []
    finally:
        engine.dispose()


def _key(url: str, turn: int) -> str:
    [(key,)] = _sql(url, "SELECT advancement_key FROM ts_receipts WHERE advancement_key LIKE :k", k=f"%:turn-{turn}")
    return str(key)


def lose_a_turn(url: str) -> str:
    """The accepted turn 1 never reached its engine: no receipt, no intent left."""
    key = _key(url, 1)
    _sql(url, "DELETE FROM ts_receipts WHERE advancement_key = :k", k=key)
    return key


def commit_a_turn_twice(url: str) -> str:
    """Turn 1 reached the engine twice: a second receipt of it, on another engine."""
    key = _key(url, 1)
    _sql(
        url,
        "INSERT INTO ts_receipts (scope, session_id, advancement_key, engine_id, committed_us, message_count, "
        "is_heartbeat, payload_hash, admission_entry_id, terminal_entry_id, message_seqs, admission_seq, terminal_seq) "
        "SELECT scope, session_id, advancement_key, 'lossless', committed_us + 1, message_count, is_heartbeat, "
        "payload_hash, admission_entry_id, terminal_entry_id, message_seqs, admission_seq, terminal_seq "
        "FROM ts_receipts "
        "WHERE advancement_key = :k",
        k=key,
    )
    return key


def commit_part_of_a_turn(url: str) -> str:
    """Turn 0 (user, tool call, tool result, reply) reached the engine without its tool result and reply:
    a receipt of its first two messages, ending at the tool call."""
    key = _key(url, 0)
    [(first, last, seqs)] = _sql(
        url, "SELECT admission_seq, terminal_seq, message_seqs FROM ts_receipts WHERE advancement_key = :k", k=key
    )
    assert (last - first, seqs) == (3, None)  # the tool round is there to be cut (a range: no list stored)
    _sql(
        url, "UPDATE ts_receipts SET terminal_seq = :t, message_count = 2 WHERE advancement_key = :k",
        t=first + 1, k=key,
    )
    return key


def commit_out_of_order(url: str) -> str:
    """Turn 2 reached the engine before turn 1, admitted before it."""
    first, second = _key(url, 1), _key(url, 2)
    [(t1,)] = _sql(url, "SELECT committed_us FROM ts_receipts WHERE advancement_key = :k", k=first)
    [(t2,)] = _sql(url, "SELECT committed_us FROM ts_receipts WHERE advancement_key = :k", k=second)
    _sql(url, "UPDATE ts_receipts SET committed_us = :t WHERE advancement_key = :k", t=t2, k=first)
    _sql(url, "UPDATE ts_receipts SET committed_us = :t WHERE advancement_key = :k", t=t1, k=second)
    return first


def lose_a_committed_reply(url: str) -> str:
    """The reply of committed turn 2 is gone from the transcript the receipt references."""
    key = _key(url, 2)
    [(last,)] = _sql(url, "SELECT terminal_seq FROM ts_receipts WHERE advancement_key = :k", k=key)
    _sql(url, "DELETE FROM ts_entries WHERE seq = :s", s=last)
    return key


def block_a_turn_no_fault_explains(url: str) -> str:
    """Turn 1 never reached its engine and is kept blocked (as a turn a planned rewrite made stale is), in a
    run that planned no rewrite: nothing the run did explains it."""
    key = _key(url, 1)
    [(sid, adm, term)] = _sql(
        url,
        "SELECT r.session_id, a.entry_id, t.entry_id FROM ts_receipts r"
        " JOIN ts_entries a ON a.scope = r.scope AND a.session_id = r.session_id AND a.seq = r.admission_seq"
        " JOIN ts_entries t ON t.scope = r.scope AND t.session_id = r.session_id AND t.seq = r.terminal_seq"
        " WHERE r.advancement_key = :k",
        k=key,
    )
    with TranscriptStore(config=StoreConfig(url=url)) as store:
        admission = Admission(anchor=store.anchor("gateway", sid, adm), turn_id=key)
        terminal = store.anchor("gateway", sid, term)
    _sql(url, "DELETE FROM ts_receipts WHERE advancement_key = :k", k=key)
    _sql(
        url,
        "INSERT INTO ts_outbox (scope, session_id, turn_id, engine_id, state, enqueue_seq, admission, terminal, "
        "is_heartbeat, block_reason, attempt_count, created_us, updated_us) VALUES ('gateway', :sid, :k, "
        "'legacy', 'blocked', :seq, :adm, :term, :no, 'stale: the session moved to another generation', 0, 1, 1)",
        sid=sid, k=key, seq=admission.anchor.seq, adm=admission.model_dump_json(), term=terminal.model_dump_json(),
        no=False,
    )
    return key


@pytest.mark.parametrize(
    "corrupt",
    [
        lose_a_turn, commit_a_turn_twice, commit_part_of_a_turn, commit_out_of_order, lose_a_committed_reply,
        block_a_turn_no_fault_explains,
    ],
)
def test_the_exactly_once_check_fails_on_a_corrupted_store(store_url: str, corrupt: Callable[[str], str]) -> None:
    """The check claimed "every accepted turn is in the engine once" (in admission order, whole) but looked
    at the count of each turn's receipts and at its first message only: a receipt of part of a turn, or
    receipts in another order than the turns' admissions, passed; a committed reply gone from the
    transcript crashed the check (KeyError) instead of failing it; a turn kept blocked passed in a run
    that planned no rewrite to explain it."""
    options = _run(store_url)
    assert _recheck(options).ok
    key = corrupt(store_url)
    report = _recheck(options)
    assert not report.ok
    assert any(key in problem for problem in report.problems), report.problems
