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
