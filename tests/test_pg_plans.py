"""Query plans of the read path: a delta page is index lookups at any length, and on PostgreSQL it is
planned once per connection (a generic plan), not again on every execution."""

from __future__ import annotations

import re
from typing import Any

import psycopg.sql
import pytest
from sqlalchemy import event

from bench.reads import page_statement
from transcript_store import DeltaPage, StoreConfig, TranscriptStore
from transcript_store.core import Core
from transcript_store.db import PG_SESSION_SETTINGS
from transcript_store.store import admit_in

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


def _generic_plan(conn: Any, sql: str, params: Any, explain: str) -> str:
    """``EXPLAIN (explain)`` of ``sql`` prepared on ``conn``, whose store setting plans it generically (as
    every connection of the store does), executed with ``params``: the plan the store's reads run."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", sql)))
    numbered = sql
    for i, name in enumerate(names, 1):
        numbered = numbered.replace(f"%({name})s", f"${i}")
    conn.exec_driver_sql("PREPARE ts_explained AS " + numbered)
    driver = conn.connection.driver_connection
    values = ", ".join(psycopg.sql.Literal(params[name]).as_string(driver) for name in names)
    try:
        rows = conn.exec_driver_sql(f"EXPLAIN ({explain}) EXECUTE ts_explained({values})")
        plan = "\n".join(str(r[0]) for r in rows)
    finally:
        conn.exec_driver_sql("DEALLOCATE ts_explained")
    # A generic plan names its parameters (an UPDATE's conditions may come after its SET values).
    assert not names or re.search(r"\$\d", plan), plan
    return plan


def assert_never_analyzed(conn: Any, tables: str) -> None:
    """No table of the ``tables`` condition (on pg_stat_user_tables) was ever analyzed: the tests of
    plans on tables never analyzed are about those (autovacuum would have analyzed them otherwise)."""
    analyzed = conn.exec_driver_sql(
        f"SELECT count(*) FROM pg_stat_user_tables WHERE {tables} "
        "AND coalesce(last_analyze, last_autoanalyze) IS NOT NULL"
    ).scalar()
    conn.rollback()
    assert analyzed == 0, "the tables were analyzed: this test is about tables that never were"


def assert_lookups(name: str, plan: str, executed: bool = True) -> None:
    """A plan scans no table; run (``executed``), it reads no row it throws away (one at most) and no
    more than a page's rows (20, one more, the session row)."""
    assert not re.search(r"Seq Scan on ts_", plan), f"{name}:\n{plan}"
    if executed:
        removed = [int(n) for n in re.findall(r"Rows Removed by (?:Join )?Filter: (\d+)", plan)]
        assert max(removed, default=0) <= 1, f"{name}:\n{plan}"
        rows = [int(n) for n in re.findall(r"\(actual [^)]*rows=(\d+)", plan)]
        assert max(rows, default=0) <= 22, f"{name}:\n{plan}"


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
            names = re.findall(r"%\((\w+)\)s", sql)
            assert names and set(names) <= set(params), (names, params)
            plan = _generic_plan(conn, sql, params, "ANALYZE, COSTS OFF")
            assert not re.search(r"Seq Scan on ts_(entries|active_path)", plan), plan
            removed = [int(n) for n in re.findall(r"Rows Removed by (?:Join )?Filter: (\d+)", plan)]
            assert max(removed, default=0) <= 1, plan
        conn.rollback()


def test_a_delta_pages_estimated_cost_grows_little_with_the_table(store: TranscriptStore) -> None:
    """The generic plan's estimate of a 20-message page grows by less than 0.1 a message of the
    table (0.03 here: the page's own LIMIT is a parameter, taken for 10% of the rows), so a table
    needs millions of messages before PostgreSQL would JIT-compile a page read (jit_above_cost
    100,000). An entry lookup under a bound LIMIT 1, estimated at 10% of its rows, grew by 0.3 a
    message: at 10,000 messages a page was estimated above 100,000, and every read paid ~17 ms of JIT
    compilation for 0.15 ms of work (bench/README.md, "Profiling" 36)."""
    if store.backend == "sqlite":
        pytest.skip("SQLite has no cost-based JIT and plans each statement when it prepares it")
    sid = store.create_session(A, session_id="s1").session_id
    costs = []
    for added in (2_000, 8_000):  # 2,000 messages, then 10,000
        store.append_many(A, sid, [{"message": {"role": "user", "content": f"m{i}"}} for i in range(added)])
        store.db.analyze(("ts_sessions", "ts_entries", "ts_active_path"))
        at = store.read_visible_delta(A, sid, None, max_messages=1_000)
        assert isinstance(at, DeltaPage)
        sql, params = _delta_statement(store, sid, at.cursor)
        with store.db.engine.connect() as conn:
            top = _generic_plan(conn, sql, params, "COSTS").splitlines()[0]
            conn.rollback()
        found = re.search(r"cost=[\d.]+\.\.([\d.]+)", top)
        assert found, top
        costs.append(float(found.group(1)))
    assert (costs[1] - costs[0]) / 8_000 < 0.1, costs


def test_reads_are_index_lookups_on_tables_never_analyzed(store: TranscriptStore) -> None:
    """PostgreSQL before its first ANALYZE (a new deployment; autovacuum off or not yet around): every
    statement of a delta page (with and without a fence), a closed-range read, a listing and lookups
    of 2 and 12 entries near the tail of a 2,000-message session, and a re-admission, as the store plans them
    (generic plans), scans no table, reads no row it throws away and touches no more than a page's
    rows. The planner has no estimates then: the path-to-entry join scanned the session's entries for
    every page row (119,790 rows removed for a 20-message page at 6,000 entries), and an IN list of
    entry ids or an OR of keys was a filter over the session (bench/README.md, "Profiling" 36)."""
    if store.backend == "sqlite":
        pytest.skip("SQLite plans with its own index knowledge (EXPLAIN QUERY PLAN tests: test_store_delta.py)")
    tables = ("ts_sessions", "ts_entries", "ts_active_path", "ts_outbox")
    with store.db.engine.begin() as conn:  # this test's database only: autovacuum would ANALYZE them
        for table in tables:
            conn.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
    sid = store.create_session(A, session_id="s1").session_id
    turns = []
    for t, replies in enumerate((999, 999, 3)):  # 2,004 entries; the last turn, read whole, is short
        admission = store.admit(A, sid, {"role": "user", "content": f"q{t}"}, turn_id=f"t{t}")
        store.append_many(
            A, sid, [{"message": {"role": "assistant", "content": f"m{t}.{i}"}} for i in range(replies)]
        )
        turns.append(admission)
    tail_entries = store.list_entries(A, sid, after_seq=1990, limit=12)
    last = tail_entries[-1]
    at = store.read_visible_delta(A, sid, None, max_messages=1960)
    assert isinstance(at, DeltaPage)
    terminal = store.anchor(A, sid, last.entry_id)
    captured: list[tuple[str, Any]] = []

    def listen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        captured.append((statement, parameters))

    reads: dict[str, Any] = {
        "delta page": lambda: store.read_visible_delta(A, sid, at.cursor, max_messages=20),
        "fenced delta page": lambda: store.read_visible_delta(
            A, sid, None, max_messages=20, fence=turns[-1].anchor
        ),
        "closed range": lambda: store.read_closed_range(turns[-1], terminal),
        "list_entries": lambda: store.list_entries(A, sid, after_seq=1995, limit=5),
        "get_entries": lambda: store.get_entries(A, sid, [turns[-1].anchor.entry_id, last.entry_id]),
        "get_entries of 12": lambda: store.get_entries(A, sid, [e.entry_id for e in tail_entries]),
        "re-admission": lambda: store.admit(A, sid, {"role": "user", "content": "q2"}, turn_id="t2"),
    }
    event.listen(store.db.engine, "before_cursor_execute", listen)
    statements: dict[str, list[tuple[str, Any]]] = {}
    try:
        for name, read in reads.items():
            captured.clear()
            read()
            statements[name] = [(s, p) for s, p in captured if s.lstrip().upper().startswith(("SELECT", "WITH"))]
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    with store.db.engine.connect() as conn:
        for name, sent in statements.items():
            assert sent, name
            for sql, params in sent:
                assert_lookups(name, _generic_plan(conn, sql, params, "ANALYZE, COSTS OFF"))
        assert_never_analyzed(conn, "relname IN ('ts_entries', 'ts_active_path')")


def _plan_of_any(conn: Any, sql: str, params: Any) -> tuple[str, bool]:
    """(plan, executed): ``EXPLAIN ANALYZE`` of a captured statement in a transaction rolled back, or,
    for a write that cannot run again (its rows are in), the plan alone."""
    try:
        return _generic_plan(conn, sql, params, "ANALYZE, COSTS OFF"), True
    except Exception:  # a unique key the statement's own rows hold now: plan it without running it
        conn.rollback()
        conn.exec_driver_sql("DEALLOCATE ALL")
        return _generic_plan(conn, sql, params, "COSTS OFF"), False
    finally:
        conn.rollback()


def test_commits_are_index_lookups_on_tables_never_analyzed(store: TranscriptStore) -> None:
    """PostgreSQL before its first ANALYZE: every statement of commit_turn near the tail of a
    2,000-entry session of 500 turns (a bare anchor of an entry admitted without a turn id, which the
    commit binds; an admission's one-statement commit; a replay; a commit with an engine's apply), of
    reading a receipt's messages back and of a page of receipts scans no table and reads no row it throws
    away. Before, the range read and the binding UPDATE took the entry-id index and filtered the
    session's entries on the seq, and the one-statement commit joined each entry to the session's whole
    active path, and the check that a bare anchor's entry is no committed turn's message read every bound
    admission of the session: a commit of one long session grew from 2.2 ms to 13.8 ms over 3,000 turns;
    and a receipt's read of its anchors' entry ids at their seqs (revision 0017) filtered 2,005 rows.

    SQLite (no statistics either): no statement scans a table or sorts in a temporary B-tree (a
    subquery walking back to its LIMIT and sorting it made a commit 3.7 ms at 3,000 turns)."""
    from transcript_store.ledger import committed_messages, receipts_page
    from transcript_store.turns import Turns

    tables = ("ts_sessions", "ts_entries", "ts_active_path", "ts_receipts", "ts_engine_state")
    if store.backend != "sqlite":
        with store.db.engine.begin() as conn:  # this test's database only: autovacuum would ANALYZE them
            for table in tables:
                conn.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
    turns = Turns(store)
    sid = store.create_session(A, session_id="s1", session_key="agent:main:test:1").session_id
    store.append_many(A, sid, [{"message": {"role": "user", "content": f"m{i}"}} for i in range(1000)])

    def turns_of_a_session(c: Core) -> None:  # 500 turns admitted under their ids: 1,000 entries more
        for t in range(500):
            admit_in(c, A, sid, store.prepare_admission({"role": "user", "content": f"q{t}"}, turn_id=f"t{t}"))
            c.append(A, sid, store.prepare([{"message": {"role": "assistant", "content": f"a{t}"}}]))

    store.write(turns_of_a_session)
    captured: list[tuple[str, Any]] = []

    def listen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        captured.append((statement, parameters))

    def bare() -> None:
        msgs = [{"role": "user", "content": "bare q"}, {"role": "assistant", "content": "bare a"}]
        added = store.append_many(A, sid, [{"message": m} for m in msgs])
        adm, term = (store.anchor(A, sid, e.entry_id) for e in (added[0], added[-1]))
        captured.clear()
        assert turns.commit_turn("e", "k-bare", adm, term, msgs).status == "committed"

    def admitted(key: str, **apply: Any) -> tuple[Any, Any, list[dict[str, Any]]]:
        admission = store.admit(A, sid, {"role": "user", "content": f"q {key}"}, turn_id=key)
        added = store.append_many(A, sid, [{"message": {"role": "assistant", "content": f"a {key}"}}])
        terminal = store.anchor(A, sid, added[-1].entry_id)
        msgs = [{"role": "user", "content": f"q {key}"}, {"role": "assistant", "content": f"a {key}"}]
        captured.clear()
        assert turns.commit_turn("e", key, admission, terminal, msgs, **apply).status == "committed"
        return admission, terminal, msgs

    def noop(_core: Any, _turn: Any) -> None:
        """An engine's apply that writes nothing: the commit takes the transactional path."""

    statements: dict[str, list[tuple[str, Any]]] = {}
    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        bare()
        statements["bare anchor, bound by the commit"] = list(captured)
        admission, terminal, msgs = admitted("k-one")
        statements["one-statement commit"] = list(captured)
        captured.clear()
        assert turns.commit_turn("e", "k-one", admission, terminal, msgs).status == "duplicate"
        statements["replay"] = list(captured)
        admitted("k-apply", apply=noop)
        statements["commit with apply"] = list(captured)
        captured.clear()
        assert store.read(lambda c: committed_messages(c, A, sid, "e", "k-apply"))[-1]["content"] == "a k-apply"
        statements["a receipt's messages"] = list(captured)
        captured.clear()  # each receipt's anchor ids read from the entries at its seqs (revision 0017)
        page = store.read(lambda c: receipts_page(c, A, sid, "e"))
        assert [r.terminal_entry_id for r in page.receipts][-1] == terminal.entry_id
        statements["a page of receipts"] = list(captured)
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    kinds = ("SELECT", "WITH", "UPDATE", "DELETE", "INSERT")
    # Every statement but an INSERT of VALUES (nothing to look up: its plan names no parameter).
    values = re.compile(r"\s*INSERT\b(?!.*\bSELECT\b).*\bVALUES\b", re.I | re.S)
    with store.db.engine.connect() as conn:
        for name, sent in statements.items():
            sent = [(s, p) for s, p in sent if s.lstrip().upper().startswith(kinds) and not values.match(s)]
            assert sent, name
            for sql, params in sent:
                if store.backend == "sqlite":
                    details = [str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]
                    assert not [d for d in details if d.startswith("SCAN ts_") or "TEMP B-TREE" in d], (
                        f"{name}: {sql}\n{details}"
                    )
                    continue
                assert_lookups(name, *_plan_of_any(conn, sql, params))
        if store.backend == "sqlite":
            conn.rollback()
            return
        assert_never_analyzed(conn, "relname IN ('ts_entries', 'ts_active_path')")


def _keyed_session_read(store: TranscriptStore, read: Any) -> tuple[str, Any, list[tuple[str, Any]]]:
    """PostgreSQL only (else the test is skipped): a session of 2,000 keyed entries in a table never analyzed,
    ``read(core, sid)`` run on it, and the SELECT statements it sent (with their parameters)."""
    if store.backend == "sqlite":
        pytest.skip("SQLite plans with its own index knowledge")
    with store.db.engine.begin() as conn:  # this test's database only: autovacuum would ANALYZE them
        conn.exec_driver_sql("ALTER TABLE ts_entries SET (autovacuum_enabled = off)")
    sid = store.create_session(A, session_id="s1").session_id
    store.append_many(A, sid, [{"message": {"role": "user", "content": f"m{i}"}, "idempotency_key": f"k{i}"}
                               for i in range(2_000)])
    captured: list[tuple[str, Any]] = []

    def listen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        captured.append((statement, parameters))

    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        found = store.read(lambda c: read(c, sid))
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    return sid, found, [(s, p) for s, p in captured if s.lstrip().upper().startswith("SELECT")]


def test_the_idempotency_keys_an_append_under_a_header_checks_are_read_over_a_bounded_key_range(
    store: TranscriptStore,
) -> None:
    """PostgreSQL, tables never analyzed: the check of an append under an ``Idempotency-Key`` (which keys of
    the header the session holds, ``keys_between``) walks the keys' index over their range only, never the
    session's other entries (nor a scan of the table), whatever the session's length."""
    _, found, sent = _keyed_session_read(store, lambda c, sid: c.keys_between(A, sid, "k1990", "k1999", "k199", 3))
    assert found == ["k1990", "k1991", "k1992"]
    assert store.read(lambda c: c.keys_between(A, "s1", "k19a0", "k19a9", "k19a", 3)) == []
    assert len(sent) == 1, sent
    with store.db.engine.connect() as conn:
        plan = _generic_plan(conn, *sent[0], "ANALYZE, COSTS OFF")
        assert_lookups("keys_between", plan)
        assert "ts_entries_idempotency_key" in plan, plan
        assert_never_analyzed(conn, "relname = 'ts_entries'")
