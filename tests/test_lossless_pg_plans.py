"""Query plans of the lossless engine on PostgreSQL tables never analyzed: every statement of a turn
(the import at commit, the assembly), of a compaction and of the recall tools is index lookups,
whatever the session's length."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from sqlalchemy import event
from test_lossless import SMALL, A, commit, finished_turn, make_engine, tool_round
from test_pg_plans import _plan_of_any

from engines.lossless.ingest import _known
from transcript_store import TranscriptStore


def test_a_lossless_turn_is_index_lookups_on_tables_never_analyzed(store: TranscriptStore) -> None:
    """PostgreSQL before its first ANALYZE (a new deployment; autovacuum off or behind): in a session of
    300 turns (800 messages), every statement of one more turn's import at commit, of an assembly, of
    a forced compaction and of lcm_describe / lcm_expand scans no table and reads no row it throws away.
    Before, a list of keys (``IN``) was a filter over the session's whole range of an index (here: the
    import's entry-id check removed 800 rows a turn, compaction's DELETE of the four items a leaf
    replaced 786; an assembly at 1,000 turns removed 1,400 rows a batch of 1,000 messages, 33-180 ms),
    and so was one key of an index the planner passed over (``lcm_expand`` of ``msg_N`` found it through
    the entry-id index: 801 rows removed; a summary's children through the child index)."""
    if store.backend == "sqlite":
        pytest.skip("SQLite plans with its own index knowledge: its IN lists are index lookups")
    with store.db.engine.begin() as conn:  # this test's database only: autovacuum would ANALYZE them
        tables = [t for (t,) in conn.exec_driver_sql("SELECT tablename FROM pg_tables WHERE tablename LIKE 'ts%%'")]
        for table in tables:
            conn.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
    sid = store.create_session(A, session_id="s1").session_id
    history: list[dict[str, Any]] = []
    for i in range(300):  # written at once, imported by one bootstrap: the session's rows, quickly
        history.append({"role": "user", "content": f"question {i} " + "words " * 20})
        if i % 3 == 0:
            history += tool_round(f"c{i}", f"result {i} " * 10)
        history.append({"role": "assistant", "content": f"answer {i} " * 8})
    store.append_many(A, sid, [{"message": m} for m in history])
    engine = make_engine(store, {**SMALL, "condense_fanin": 2})
    assert engine.bootstrap(scope=A, session_id=sid, fence=None).imported_messages == len(history)
    for _ in range(3):  # two leaf summaries, then a condensed one over them
        assert engine.compact(scope=A, session_id=sid, force=True, token_budget=1_000_000).compacted
    captured: list[tuple[str, Any]] = []

    def listen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        captured.append((statement, parameters))

    def call(name: str, **args: Any) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(engine.handle_tool_call(name, args, scope=A, session_id=sid))
        assert "error" not in out, out
        return out

    turn = finished_turn(store, sid, "t-last")
    statements: dict[str, list[tuple[str, Any]]] = {}

    def run(name: str, step: Any) -> Any:
        captured.clear()
        out = step()
        statements[name] = list(captured)
        return out

    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        assert run("commit", lambda: commit(store, engine, turn)).status == "committed"
        ingested = [turn[0].anchor.entry_id, turn[1].entry_id]  # what an import after a reset asks again
        known = run("entries already ingested", lambda: store.read(lambda c: _known(c, A, sid, ingested)))
        assert set(known) == set(ingested) and all(visible for _o, _t, visible in known.values())
        context = run("assemble", lambda: engine.assemble(
            scope=A, session_id=sid, fence=None, token_budget=1_000_000
        )).messages
        assert len(context) > 700
        assert run("compaction", lambda: engine.compact(
            scope=A, session_id=sid, force=True, token_budget=1_000_000
        )).compacted
        top = context[0]["content"].split()[1]
        described = run("lcm_describe of a summary", lambda: call("lcm_describe", id=top))
        assert described["kind"] == "condensed", described
        run("lcm_expand of a summary", lambda: call("lcm_expand", id=top))
        leaf = described["children"][0]
        first = run("lcm_expand of a leaf", lambda: call("lcm_expand", id=leaf, limit=3))["items"][0]
        run("lcm_describe of a message", lambda: call("lcm_describe", id=first["entry_id"]))
        run("lcm_expand of a message", lambda: call("lcm_expand", id=first["id"]))
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    kinds = ("SELECT", "WITH", "UPDATE", "DELETE", "INSERT")
    # Every statement but an INSERT of VALUES (nothing to look up: its plan names no parameter).
    values = re.compile(r"\s*INSERT\b(?!.*\bSELECT\b).*\bVALUES\b", re.I | re.S)
    bad: list[str] = []  # every statement that scans a table or throws rows away, to see them all at once
    with store.db.engine.connect() as conn:
        for name, sent in statements.items():
            sent = [(s, p[0] if isinstance(p, list | tuple) and p else p) for s, p in sent]
            sent = [(s, p) for s, p in sent if s.lstrip().upper().startswith(kinds) and isinstance(p, dict)]
            sent = [(s, p) for s, p in sent if not values.match(s)]
            assert sent, name
            for sql, params in sent:
                plan, executed = _plan_of_any(conn, sql, params)
                removed = [int(n) for n in re.findall(r"Rows Removed by (?:Join )?Filter: (\d+)", plan)]
                if re.search(r"Seq Scan on ts_", plan) or (executed and max(removed, default=0) > 1):
                    bad.append(f"{name}: {' '.join(sql.split())[:300]}\n{plan}")
        analyzed = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_user_tables WHERE relname LIKE 'ts%%' "
            "AND coalesce(last_analyze, last_autoanalyze) IS NOT NULL"
        ).scalar()
        conn.rollback()
    assert not bad, "\n\n".join(bad)
    assert analyzed == 0, "the tables were analyzed: this test is about tables that never were"


def test_a_large_import_leaves_the_foreign_key_checks_index_lookups(store: TranscriptStore) -> None:
    """An import of 1,000 messages or more refreshes the statistics of the engine's tables: on tables
    never analyzed, the check of each context item's foreign key (PostgreSQL's own query, by the
    messages' whole primary key) took the entry-id index of the session's key and filtered the session's
    rows, so a bootstrap's import cost grew with the square of its length (10,000 messages through
    the service's bootstrap of a new database: 30 s on PostgreSQL, 2.9 s since, 1.7 s on SQLite)."""
    if store.backend == "sqlite":
        pytest.skip("SQLite checks a foreign key by the parent's primary key")
    with store.db.engine.begin() as conn:  # this test's database only: autovacuum would ANALYZE them
        tables = [t for (t,) in conn.exec_driver_sql("SELECT tablename FROM pg_tables WHERE tablename LIKE 'ts%%'")]
        for table in tables:
            conn.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
    sid = store.create_session(A, session_id="large").session_id
    count = 1_200
    store.append_many(A, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": f"m {i}"}}
                               for i in range(count)])
    engine = make_engine(store)
    assert engine.bootstrap(scope=A, session_id=sid, fence=None).imported_messages == count
    # the query PostgreSQL runs for the foreign key of every context item the engine inserts
    check = ("SELECT 1 FROM ONLY ts_lcm_messages x WHERE scope = %(s)s AND session_id = %(i)s AND ordinal = %(o)s "
             "FOR KEY SHARE OF x")
    with store.db.engine.connect() as conn:
        plan = _plan_of_any(conn, check, {"s": A, "i": sid, "o": count // 2})[0]
    removed = [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)]
    assert max(removed, default=0) <= 1 and "Seq Scan" not in plan, plan


def test_the_commit_of_a_sessions_1000th_message_analyzes_tables_never_analyzed(store: TranscriptStore) -> None:
    """A session grown turn by turn (no import of 1,000 messages at once) on tables never analyzed: the
    foreign-key check of each context item a commit inserts read the session's messages through the
    entry-id index (9,999 rows removed, ~8 ms a turn at 10,000 messages) until an autoanalyze, which
    autovacuum off or behind never ran. The commit that stores a session's 1,000th message analyzes the
    tables that have no statistics; the check is then a primary-key lookup. Commits after it send no
    statement more. (SQLite checks a foreign key by the parent's primary key: the commits just work.)"""
    postgres = store.backend == "postgresql"
    if postgres:
        with store.db.engine.begin() as conn:  # this test's database only: autovacuum would ANALYZE them
            tables = [t for (t,) in conn.exec_driver_sql("SELECT tablename FROM pg_tables WHERE tablename LIKE 'ts%%'")]
            for table in tables:
                conn.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
    sid = store.create_session(A, session_id="grown").session_id
    store.append_many(A, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": f"m {i}"}}
                               for i in range(998)])
    engine = make_engine(store)
    assert engine.bootstrap(scope=A, session_id=sid, fence=None).imported_messages == 998  # under its ANALYZE
    check = ("SELECT 1 FROM ONLY ts_lcm_messages x WHERE scope = %(s)s AND session_id = %(i)s AND ordinal = %(o)s "
             "FOR KEY SHARE OF x")

    def removed() -> int:
        with store.db.engine.connect() as conn:
            plan = _plan_of_any(conn, check, {"s": A, "i": sid, "o": 500})[0]
        return max((int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)), default=0)

    if postgres:
        assert removed() > 900  # the case: the session's rows read for one key
    assert commit(store, engine, finished_turn(store, sid, "t-999")).status == "committed"  # ordinals 998, 999
    assert store.db.analyze_unanalyzed(("ts_lcm_messages", "ts_lcm_context_items")) is False  # analyzed already
    if postgres:
        assert removed() <= 1
    sent: list[str] = []

    def listen(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        sent.append(statement)

    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        assert commit(store, engine, finished_turn(store, sid, "t-1001")).status == "committed"
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    assert sent and not any("ANALYZE" in s or "pg_stats" in s for s in sent)
