"""Query plans of the read path: a delta page is index lookups at any length, and on PostgreSQL it is
planned once per connection (a generic plan), not again on every execution."""

from __future__ import annotations

import re
from typing import Any

import psycopg.sql
import pytest

from bench.reads import page_statement
from transcript_store import DeltaPage, StoreConfig, TranscriptStore
from transcript_store.db import PG_SESSION_SETTINGS

A = "scope-a"


def _delta_statement(store: TranscriptStore, sid: str, cursor: str) -> tuple[str, Any]:
    """The SQL and parameters of one delta page read, as sent to the driver."""
    sql, params, page = page_statement(store, A, sid, cursor, 20)
    assert isinstance(page, DeltaPage) and len(page.entries) == 20
    return sql, params


def test_store_connections_plan_their_statements_once(store: TranscriptStore) -> None:
    """PostgreSQL: every connection the store opens runs with generic plans (psycopg prepares a
    statement after five runs; without the setting the server re-planned the delta page on
    every execution, 0.13 ms a read)."""
    if store.backend == "sqlite":
        pytest.skip("plan_cache_mode is a PostgreSQL setting (sqlite3 plans a statement when it prepares it)")
    assert "force_generic_plan" in PG_SESSION_SETTINGS
    with store.db.engine.connect() as a, store.db.engine.connect() as b:  # two pool connections
        for conn in (a, b):
            assert conn.exec_driver_sql("SHOW plan_cache_mode").scalar() == "force_generic_plan"
            conn.rollback()
    assert store.db.settings()["plan_cache_mode"] == "force_generic_plan"
    # Switched off, the connections keep the server's own setting.
    with TranscriptStore(config=StoreConfig(url=store.config.url, auto_upgrade=False, pg_generic_plans=False)) as off:
        assert off.db.settings()["plan_cache_mode"] == "auto"


@pytest.mark.parametrize("shape", ["linear", "branched"])
def test_a_delta_page_is_index_lookups_as_a_generic_plan(store: TranscriptStore, shape: str) -> None:
    """The page near the tail of a 2,000-message session walks only its own rows, planned without
    the values (as the store's connections plan it): no table scan, no row read and thrown away,
    whether every entry of the session is on its active path or not."""
    sid = store.create_session(A, session_id="s1", session_key="agent:main:test:1").session_id
    if shape == "branched":
        kept, _dropped = store.append_many(A, sid, [{"message": {"role": "user", "content": "a"}}] * 2)
        store.branch(A, sid, kept.entry_id)
    store.append_many(A, sid, [{"message": {"role": "user", "content": f"m{i}"}} for i in range(2000)])
    start = store.read_visible_delta(A, sid, None, max_messages=10_000)
    assert isinstance(start, DeltaPage) and len(start.entries) == 2000 + (shape == "branched")
    at = store.read_visible_delta(A, sid, None, max_messages=1960)
    assert isinstance(at, DeltaPage)
    # With statistics, as autovacuum gathers them (README, "PostgreSQL deployment": on tables never
    # analyzed the planner has no estimates, custom plans or generic; bench/README.md, "Profiling" 31).
    store.db.analyze(("ts_sessions", "ts_entries", "ts_active_path"))
    sql, params = _delta_statement(store, sid, at.cursor)
    with store.db.engine.connect() as conn:
        if store.backend == "sqlite":
            details = [str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]
            # Only the page's own (at most 21) rows are scanned; every table is searched.
            assert details and not [d for d in details if d.startswith("SCAN ts_")], details
            assert any(d.startswith("SEARCH ts_active_path USING INDEX") for d in details), details
        else:
            # The statement as a server-side prepared one, so that EXPLAIN shows the generic plan.
            names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", sql)))
            assert names and set(names) <= set(params), (names, params)
            numbered = sql
            for i, name in enumerate(names, 1):
                numbered = numbered.replace(f"%({name})s", f"${i}")
            conn.exec_driver_sql("PREPARE ts_delta_page AS " + numbered)
            # Utility statements take no bound parameters: the values go in as quoted literals. The
            # statement is this test's store's only (its pool is disposed at the end of the test).
            driver = conn.connection.driver_connection
            values = ", ".join(psycopg.sql.Literal(params[name]).as_string(driver) for name in names)
            explained = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, COSTS OFF) EXECUTE ts_delta_page({values})")
            plan = "\n".join(str(r[0]) for r in explained)
            assert "$1" in plan or "$2" in plan, plan  # a generic plan names its parameters
            assert not re.search(r"Seq Scan on ts_(entries|active_path)", plan), plan
            removed = [int(n) for n in re.findall(r"Rows Removed by (?:Join )?Filter: (\d+)", plan)]
            assert max(removed, default=0) <= 1, plan
        conn.rollback()
