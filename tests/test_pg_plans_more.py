"""Query plans of the store's other paths on PostgreSQL tables never analyzed (a new deployment;
autovacuum off or behind): a lookup of one session or one turn stays an index lookup, whatever the
length of the session or the number of sessions in the scope (README, "PostgreSQL deployment")."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event
from test_pg_plans import _plan_of_any, assert_lookups, assert_never_analyzed

from transcript_store import TranscriptStore

A = "scope-a"
_KINDS = ("SELECT", "WITH", "UPDATE", "DELETE", "INSERT")
# An INSERT of VALUES looks nothing up (its plan names no parameter).
_VALUES = re.compile(r"\s*INSERT\b(?!.*\bSELECT\b).*\bVALUES\b", re.I | re.S)


def _never_analyzed(store: TranscriptStore, *tables: str) -> None:
    """Autovacuum off for this test's database's ``tables``: it would ANALYZE them."""
    with store.db.engine.begin() as conn:
        for table in tables:
            conn.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")


def _statements(store: TranscriptStore, calls: dict[str, Callable[[], Any]]) -> dict[str, list[tuple[str, Any]]]:
    """The statements each call sent that look rows up, by the call's name."""
    captured: list[tuple[str, Any]] = []

    def listen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        captured.append((statement, parameters))

    out: dict[str, list[tuple[str, Any]]] = {}
    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        for name, call in calls.items():
            captured.clear()
            call()
            sent = [(s, p) for s, p in captured if s.lstrip().upper().startswith(_KINDS) and not _VALUES.match(s)]
            out[name] = [(s, p) for s, p in sent if isinstance(p, (dict, tuple))]  # (tuple: SQLite's)
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    return out


def _assert_index_lookups(store: TranscriptStore, statements: dict[str, list[tuple[str, Any]]]) -> None:
    """Every statement, planned as the store plans it (generically): no table scanned, no row read and
    thrown away, no more than a page's rows touched; and the tables were never analyzed."""
    with store.db.engine.connect() as conn:
        for name, sent in statements.items():
            assert sent, name
            for sql, params in sent:
                assert_lookups(name, *_plan_of_any(conn, sql, params))
        assert_never_analyzed(conn, "relname LIKE 'ts_%%'")


def test_a_session_is_found_by_its_key_through_the_key_index(store: TranscriptStore) -> None:
    """Opening or finding a session by its key, with 60 keyed sessions in the scope, reads that one
    session by the active-key index. The lookup said ``active IS TRUE``, from which neither backend
    proves the partial index's ``active``: both read the scope's sessions by the primary key and
    filtered them on the key (on PostgreSQL never analyzed, 60 rows removed; on SQLite a search of the
    primary key by the scope alone), on every open of a session by key."""
    if store.backend == "postgresql":
        _never_analyzed(store, "ts_sessions")
    for i in range(60):
        store.create_session(A, session_id=f"s{i:02d}", session_key=f"agent:main:k{i:02d}")
    calls = {
        "find_session": lambda: store.find_session(A, "agent:main:k30"),
        "open_session": lambda: store.open_session(A, "agent:main:k31"),
    }
    statements = _statements(store, calls)
    assert store.find_session(A, "agent:main:k30").session_id == "s30"  # type: ignore[union-attr]
    if store.backend == "sqlite":
        with store.db.engine.connect() as conn:
            for name, sent in statements.items():
                keyed = [(s, p) for s, p in sent if "session_key" in s.split("FROM", 1)[-1]]
                assert keyed, name
                for sql, params in keyed:
                    details = [str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]
                    assert any("USING INDEX ts_sessions_active_key" in d for d in details), (name, details)
            conn.rollback()
        return
    _assert_index_lookups(store, statements)


def test_branch_and_rewrite_count_the_visible_messages_by_one_probe(store: TranscriptStore) -> None:
    """PostgreSQL never analyzed: every statement of a branch to the head's parent and of a rewrite of
    the last message of a 2,000-message session touches a few rows. The session's visible count, which
    both write, was max(position) over the active path, answered by reading the whole path (2,000 rows);
    it is now a backward probe of the position index."""
    if store.backend == "sqlite":
        pytest.skip("SQLite answers max() of an index's column by one probe (EXPLAIN QUERY PLAN: SEARCH)")
    _never_analyzed(store, "ts_sessions", "ts_entries", "ts_active_path")
    sid = store.create_session(A, session_id="s1").session_id
    added = store.append_many(A, sid, [{"message": {"role": "user", "content": f"m{i}"}} for i in range(2000)])
    calls = {
        "branch": lambda: store.branch(A, sid, added[-2].entry_id),
        "rewrite": lambda: store.rewrite_entries(
            A, sid, [{"entry_id": added[-2].entry_id, "message": {"role": "user", "content": "again"}}]
        ),
    }
    statements = _statements(store, calls)
    assert store.get_session(A, sid).visible_count == 1999
    _assert_index_lookups(store, statements)


def test_a_mirrored_turn_looks_entries_up_by_seq_through_the_primary_key(store: TranscriptStore) -> None:
    """PostgreSQL never analyzed: every statement of mirroring a host turn onto the end of a
    2,000-message session touches a few rows. Its anchors read the entries at their positions by seq,
    an equality on the seq for which the planner took the entry-id index and filtered the session's
    entries (2,001 rows removed, twice a turn); a lookup by seq is now in seq order under LIMIT 1."""
    if store.backend == "sqlite":
        pytest.skip("SQLite looks an equality on its primary key up by that key")
    from transcript_store import mirror

    _never_analyzed(store, "ts_sessions", "ts_entries", "ts_active_path", "ts_engine_state")
    sid = store.create_session(A, session_id="s1").session_id
    store.append_many(A, sid, [{"message": {"role": "user", "content": f"m{i}"}} for i in range(2000)])
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]

    def mirrored() -> Any:
        return store.write(
            lambda c: mirror.mirror_turn(
                c, store.config, A, sid, admission=("h-q", 2000), terminal=("h-a", 2001), messages=messages
            )
        )

    statements = _statements(store, {"mirror_turn": mirrored})
    assert [e.message for e in store.list_entries(A, sid, after_seq=1999, limit=5)] == messages  # seqs from 0
    _assert_index_lookups(store, statements)


def _sqlite_plan(conn: Any, sql: str, params: Any) -> list[str]:
    """EXPLAIN QUERY PLAN of a captured statement, one detail a line."""
    return [str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]


def _turn_lookups(statements: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The statements that read, change or delete one outbox row by its turn id."""
    by_turn = re.compile(r"\bts_outbox\.turn_id = (%\(\w+\)s|\?)")
    return [(s, p) for s, p in statements if by_turn.search(s) and not s.lstrip().upper().startswith("INSERT")]


def _outbox_node(plan: str) -> str:
    """The plan node that reads ``ts_outbox`` itself (not an alias of it), with its conditions."""
    lines = plan.splitlines()
    at = next(i for i, line in enumerate(lines) if re.search(r"Scan.* on ts_outbox(?! \w)", line))
    depth = len(lines[at]) - len(lines[at].lstrip(" ->"))
    node = [lines[at]]
    for line in lines[at + 1:]:
        if "->" in line or len(line) - len(line.lstrip()) <= depth:
            break
        node.append(line)
    return "\n".join(node)


def test_an_outbox_row_is_found_by_its_turn_id_in_one_probe(store: TranscriptStore) -> None:
    """Every statement that reads, changes or deletes a turn's outbox row (an admission, a fast
    completion, a queued turn's acceptance and drain, a discard, a block by hand) finds the row by one
    probe on (scope, session, turn id), in a session that keeps 200 blocked rows: on PostgreSQL never
    analyzed the primary key and ``ts_outbox_order`` cost the same and the planner took the latter, which
    filtered the session's 200 rows at each of them (revision 0014: the queue indexes hold no blocked
    row). SQLite: a search on all three columns."""
    from workers.turn_worker import counting_engine

    from transcript_store.turns import Turns

    if store.backend == "postgresql":
        _never_analyzed(store, "ts_sessions", "ts_entries", "ts_active_path", "ts_outbox", "ts_receipts")
    sid = store.create_session(A, session_id="s1").session_id
    turns = Turns(store)
    reply = [{"message": {"role": "assistant", "content": "a"}}]
    for t in range(200):  # blocked rows stay in the outbox for good (audit evidence, never retried)
        turns.admit(A, sid, {"role": "user", "content": f"q{t}"}, turn_id=f"b{t}", engine_id="e")
        turns.complete(A, sid, f"b{t}", reply, None)
        turns.block(A, sid, f"b{t}", "refused")

    def admit(turn_id: str) -> None:
        turns.admit(A, sid, {"role": "user", "content": f"q {turn_id}"}, turn_id=turn_id, engine_id="e")

    def queued() -> None:
        admit("t-queued")
        turns.complete(A, sid, "t-queued", reply, None)
        assert turns.drain(lambda engine_id: counting_engine if engine_id == "e" else None).committed == 1

    def blocked() -> None:
        admit("t-blocked")
        turns.complete(A, sid, "t-blocked", reply, None)
        turns.block(A, sid, "t-blocked", "by hand")

    calls = {
        "fast completion": lambda: (admit("t-fast"), turns.complete(A, sid, "t-fast", reply, counting_engine)),
        "queued and drained": queued,
        "discarded": lambda: (admit("t-gone"), turns.discard(A, sid, "t-gone")),
        "blocked by hand": blocked,
    }
    every = _statements(store, calls)
    statements = {name: _turn_lookups(sent) for name, sent in every.items()}
    assert [i.turn_id for i in turns.intents(A) if i.state != "blocked"] == []
    with store.db.engine.connect() as conn:
        for name, sent in statements.items():
            assert sent, name
            for sql, params in sent:
                if store.backend == "sqlite":
                    details = [d for d in _sqlite_plan(conn, sql, params) if re.match(r"\w+ ts_outbox\b", d)]
                    assert details and all(
                        d.startswith("SEARCH ts_outbox USING") and "(scope=? AND session_id=? AND turn_id=?)" in d
                        for d in details
                    ), (name, sql, details)
                    continue
                plan, executed = _plan_of_any(conn, sql, params)
                # The row itself, by its key (a state or owner it must have is a filter of that one row).
                assert re.search(r"Index Cond: .*turn_id", _outbox_node(plan)), f"{name}:\n{plan}"
                assert_lookups(name, plan, executed)
            conn.rollback()
    # And the session's queue is read without its blocked rows (the head, an earlier queued turn, the
    # admission's check); the drain's listing of groups with work, across sessions, aside.
    every = {name: [(s, p) for s, p in sent if "DISTINCT" not in s] for name, sent in every.items()}
    if store.backend == "postgresql":
        _assert_index_lookups(store, every)
        return
    with store.db.engine.connect() as conn:
        partial = {r[1] for r in conn.exec_driver_sql("PRAGMA index_list(ts_outbox)") if r[4]}
        queue_reads = 0
        for name, sent in every.items():
            for sql, params in sent:
                details = _sqlite_plan(conn, sql, params)
                assert not [d for d in details if d.startswith("SCAN ts_")], (name, sql, details)
                if "!= 'blocked'" in sql:  # the queue, read through an index without the blocked rows
                    queue_reads += 1
                    search = re.compile(r"SEARCH (?:ts_outbox|earlier) USING (?:COVERING )?INDEX (\w+)")
                    used = {m.group(1) for d in details if (m := search.match(d)) and "turn_id=?" not in d}
                    assert used and used <= partial, (name, sql, details, partial)
        assert queue_reads, every
        conn.rollback()
