"""One behaviour suite, every backend.

``store_url`` yields a fresh database per test: a copy of a migrated SQLite template file, or a
PostgreSQL database created from a migrated template database (dropped after the test). Locally a
missing PostgreSQL skips the PostgreSQL half LOUDLY; with CI=true it is a failure.

At the end of a run with fault-campaign tests, a "fault campaign" section lists every line they
reported (tests/workers/fault_worker.py, ``report()``) and the totals of their counts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from transcript_store import StoreConfig, TranscriptStore
from transcript_store.engine import ContextEngine
from transcript_store.ledger import CommitResult
from transcript_store.models import Admission, Anchor, ClosedRange

if __name__ != "conftest":
    # pytest imports this file as `conftest`; a test importing it as `tests.conftest` made a second copy, with
    # its own run id and its own pool of recycled databases that nothing would drop at the end.
    raise ImportError(f"import the suite's helpers with `from conftest import ...`, not as {__name__}")

PG_ADMIN = os.environ.get("TRANSCRIPT_STORE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
RUN_ID = uuid.uuid4().hex[:8]
BACKENDS = ["sqlite", "postgresql"]
#: the counts of a fault test's figures that add up across tests, in the end-of-run summary
CAMPAIGN_TOTALS = (
    "kills", "connections_killed", "turns", "turns_run", "turns_committed", "retries", "refusals",
    "cross_scope_refusals", "server_crashes",
)


def under_ci() -> bool:
    """CI=true (or 1, yes): what a local run skips loudly is a failure there."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def banner(request: pytest.FixtureRequest, message: str) -> None:
    """``message`` between two rows of ``!`` on the terminal, past output capture: a skip no one may miss."""
    terminal = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if terminal is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            terminal.ensure_newline()
            terminal.write_line("!" * 78 + f"\n{message}\n" + "!" * 78, red=True, bold=True)


def _pg_reachable() -> str | None:
    try:
        with psycopg.connect(PG_ADMIN, connect_timeout=5, autocommit=True) as conn:
            conn.execute("SELECT 1")
        return None
    except psycopg.Error as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__


_PG_PROBLEM = _pg_reachable()

# A run started in the background of a script without job control (`cmd &` in `sh -c`, nohup) inherits SIGINT
# ignored, and Python then leaves it ignored: the tests of Ctrl-C (a plugin's import interrupted, the gateway's
# end) could not interrupt anything. Every test process and every child it starts gets SIGINT's usual meaning.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    if _PG_PROBLEM is None:
        return
    if under_ci():
        raise pytest.UsageError(f"CI=true and PostgreSQL is unreachable at {PG_ADMIN}: {_PG_PROBLEM}")
    banner = "!" * 78
    sys.stderr.write(
        f"\n{banner}\nPostgreSQL unreachable at {PG_ADMIN} ({_PG_PROBLEM}).\n"
        f"THE POSTGRESQL HALF OF THE SUITE IS SKIPPED. Start it and run again.\n{banner}\n"
    )


def campaign_lines(reports: Iterable[pytest.TestReport]) -> list[str]:
    """The fault-campaign lines of this session's tests, in the order the tests ran.

    From the reports' ``fault_figures`` user properties, which ``report()`` adds with every line it
    appends to ``<basetemp>/fault_campaign.jsonl``: the same lines, this session's only (no file left by
    an earlier session or $FAULT_CAMPAIGN_REPORT, which accumulates, can slip in), and nothing to read
    or create on disk in a run without campaign tests. A test's later phase reports carry its earlier
    lines too: the phase with the most lines has them all.
    """
    best: dict[str, tuple[float, list[str]]] = {}
    for rep in reports:
        lines = [str(v) for k, v in getattr(rep, "user_properties", ()) if k == "fault_figures"]
        start, known = best.get(rep.nodeid, (rep.start, []))
        best[rep.nodeid] = (min(start, rep.start), lines if len(lines) > len(known) else known)
    return [line for _, lines in sorted(best.values(), key=lambda b: b[0]) for line in lines]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every fault-campaign line of the run together at its end, with the totals (each test printed its
    line as it ran, lost among the dots)."""
    reports = [r for rs in terminalreporter.stats.values() for r in rs if isinstance(r, pytest.TestReport)]
    lines = campaign_lines(reports)
    if not lines:
        return
    totals: dict[str, list[int]] = {}
    for line in lines:
        figures = json.loads(line)
        for key in CAMPAIGN_TOTALS:
            value = figures.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                total = totals.setdefault(key, [0, 0])
                total[0] += value
                total[1] += 1
    terminalreporter.write_sep("=", "fault campaign")
    for line in lines:
        terminalreporter.write_line(line)
    summary = ", ".join(
        f"{key} {totals[key][0]} ({totals[key][1]} test{'s' * (totals[key][1] > 1)})"
        for key in CAMPAIGN_TOTALS if key in totals
    )
    terminalreporter.write_line(f"totals over {len(lines)} lines: {summary or 'no counts'}")


def pg_url(dbname: str) -> str:
    """A SQLAlchemy URL for a database on the test server."""
    base = psycopg.conninfo.conninfo_to_dict(PG_ADMIN)
    host, port, user = base.get("host", "127.0.0.1"), base.get("port", "5432"), base.get("user", "postgres")
    return f"postgresql+psycopg://{user}@{host}:{port}/{dbname}"


def _admin_exec(sql: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "template.db"
    TranscriptStore(f"sqlite:///{path}").close()
    return path


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    if _PG_PROBLEM is not None:
        pytest.skip(f"PostgreSQL unreachable: {_PG_PROBLEM}")
    name = f"ts_tmpl_{RUN_ID}"
    _admin_exec(f"CREATE DATABASE {name}")
    _admin_exec(_NO_FLUSH_WAIT.format(name=name))
    TranscriptStore.upgrade_url(pg_url(name))
    with psycopg.connect(_conninfo(name), autocommit=True) as conn:
        _TEMPLATE_PRINT.append(_fingerprint(conn))
    yield name
    while _POOL:
        _admin_exec(f"DROP DATABASE IF EXISTS {_POOL.pop()} WITH (FORCE)")
    _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


#: A test database's commits do not wait for the server's WAL flush (one fdatasync, 3-10 ms on the VMs this runs
#: on; the emptying TRUNCATE below took 0.3 s for it). Nothing a test can see changes: a commit is visible to every
#: connection the moment it returns either way, and only a crash of the server itself could lose it, which
#: tests/test_faults_server_crash.py does to a cluster of its own, with synchronous_commit on.
_NO_FLUSH_WAIT = "ALTER DATABASE {name} SET synchronous_commit = off"


# Recycled PostgreSQL databases. CREATE DATABASE ... TEMPLATE copies the system catalogs too (7.5 MB through
# the WAL, ~0.4 s on the CI machine) and half the suite's ~3,400 tests ask for one, so a test's database is
# emptied after it (TRUNCATE: new, empty files, the tables never analyzed again) and handed to the next test of
# this process under a name no test has used (a process's caches keyed by URL can't see the old one). Only a
# database whose schema, grants, settings and statistics still print as the template's is recycled; any
# other is dropped, as every database was before.
_POOL: list[str] = []
_TEMPLATE_PRINT: list[str] = []
#: everything a test could change in a database besides its rows, printed in one text: relations (kind,
#: owner, grants, options, storage), columns, indexes, constraints, triggers, functions, schemas,
#: extensions, types, the database's settings and grants, sequences' positions, the migration revision,
#: and whether a table was ever analyzed or vacuumed (the plan tests need a never-analyzed store).
_FINGERPRINT_SQL = """
SELECT md5(coalesce(string_agg(x, E'\n' ORDER BY x), '')) FROM (
  SELECT concat_ws(' ', 'rel', c.oid, c.oid::regclass, c.relkind, c.relpersistence, c.relowner::regrole, c.relacl,
                   c.reloptions, CASE WHEN c.relkind = 'r' THEN c.reltuples >= 0 END, c.relrowsecurity,
                   c.relforcerowsecurity, c.relreplident)
    FROM pg_class c WHERE c.relnamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace,
                                                  'pg_toast'::regnamespace)
  UNION ALL
  SELECT concat_ws(' ', 'col', a.attrelid::regclass, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod),
                   a.attnotnull, a.attstorage, a.attcollation, pg_get_expr(d.adbin, d.adrelid), a.attacl,
                   a.attstattarget, a.attoptions)
    FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
   WHERE c.relnamespace = 'public'::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL SELECT concat_ws(' ', 'idx', schemaname, indexdef) FROM pg_indexes
   WHERE schemaname NOT IN ('pg_catalog', 'information_schema')
  UNION ALL SELECT concat_ws(' ', 'con', conrelid::regclass, conname, pg_get_constraintdef(oid)) FROM pg_constraint
   WHERE connamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace)
  UNION ALL SELECT concat_ws(' ', 'trg', t.tgrelid::regclass, coalesce(k.conname, t.tgname), t.tgenabled, t.tgtype,
                             CASE WHEN NOT t.tgisinternal THEN pg_get_triggerdef(t.oid) END)
    FROM pg_trigger t LEFT JOIN pg_constraint k ON k.oid = t.tgconstraint  -- foreign keys' too (DISABLE TRIGGER ALL)
  UNION ALL SELECT concat_ws(' ', 'ix', indexrelid::regclass, indisclustered, indisvalid, indisready, indisreplident)
    FROM pg_index WHERE indrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'public'::regnamespace)
  UNION ALL SELECT concat_ws(' ', 'dacl', defaclrole::regrole, defaclnamespace, defaclobjtype, defaclacl)
    FROM pg_default_acl
  UNION ALL SELECT concat_ws(' ', 'xstat', stxrelid::regclass, stxname, stxkind) FROM pg_statistic_ext
  UNION ALL SELECT concat_ws(' ', 'evt', evtname, evtenabled) FROM pg_event_trigger
  UNION ALL SELECT concat_ws(' ', 'fn', p.oid::regprocedure, md5(p.prosrc), p.proacl, p.proconfig) FROM pg_proc p
   WHERE p.pronamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace)
  UNION ALL SELECT concat_ws(' ', 'nsp', nspname, nspowner::regrole, nspacl) FROM pg_namespace
  UNION ALL SELECT concat_ws(' ', 'ext', extname, extversion) FROM pg_extension
  UNION ALL SELECT concat_ws(' ', 'type', oid::regtype, typtype) FROM pg_type
   WHERE typnamespace = 'public'::regnamespace AND typrelid = 0
  UNION ALL SELECT concat_ws(' ', 'rule', schemaname, tablename, rulename, definition) FROM pg_rules
   WHERE schemaname NOT IN ('pg_catalog', 'information_schema')
  UNION ALL SELECT concat_ws(' ', 'pol', schemaname, tablename, policyname, qual, with_check) FROM pg_policies
  UNION ALL SELECT concat_ws(' ', 'seq', schemaname, sequencename, last_value) FROM pg_sequences
  UNION ALL SELECT concat_ws(' ', 'set', setrole, setconfig) FROM pg_db_role_setting
   WHERE setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())
  UNION ALL SELECT concat_ws(' ', 'db', datacl, datallowconn, datconnlimit, datdba::regrole, datcollate, datctype)
    FROM pg_database WHERE datname = current_database()
  UNION ALL SELECT concat_ws(' ', 'stats', count(*)) FROM pg_statistic s JOIN pg_class c ON c.oid = s.starelid
   WHERE c.relnamespace = 'public'::regnamespace
  UNION ALL SELECT concat_ws(' ', 'analyzed', relname) FROM pg_stat_user_tables
   WHERE coalesce(last_analyze, last_autoanalyze, last_vacuum, last_autovacuum) IS NOT NULL
  UNION ALL SELECT concat_ws(' ', 'prepared', gid) FROM pg_prepared_xacts WHERE database = current_database()
  UNION ALL SELECT concat_ws(' ', 'lo', count(*)) FROM pg_largeobject_metadata
  UNION ALL SELECT concat_ws(' ', 'pub', pubname) FROM pg_publication
  UNION ALL SELECT concat_ws(' ', 'alembic', version_num) FROM alembic_version
) AS printed(x)
"""


def _conninfo(dbname: str) -> str:
    return psycopg.conninfo.make_conninfo(PG_ADMIN, dbname=dbname)


def _fingerprint(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute(_FINGERPRINT_SQL).fetchone()
    assert row is not None
    return str(row[0])


def _as_template(dbname: str) -> bool:
    """Whether ``dbname`` prints as the template (its rows aside)."""
    try:
        with psycopg.connect(_conninfo(dbname), autocommit=True, connect_timeout=10) as conn:
            return _fingerprint(conn) == _TEMPLATE_PRINT[0]
    except psycopg.Error:
        return False


def _take_pg_database(template: str) -> str:
    """A migrated, empty database no test of this run has had under its name."""
    while _POOL:
        name = _POOL.pop()
        if _as_template(name):  # autovacuum may have analyzed it while it waited here
            return name
        _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    name = f"ts_t_{RUN_ID}_{uuid.uuid4().hex[:10]}"
    _admin_exec(f"CREATE DATABASE {name} TEMPLATE {template}")
    _admin_exec(_NO_FLUSH_WAIT.format(name=name))  # a database's settings are not copied from its template
    return name


def _give_back_pg_database(name: str) -> None:
    """Empty a test's database and keep it for the next test under a new name, or drop it."""
    fresh = f"ts_t_{RUN_ID}_{uuid.uuid4().hex[:10]}"
    try:
        # waits (up to 5 s each) until they are gone: a backend still exiting would flush its statistics
        # after the reset below, and keep the rename from running
        _admin_exec(f"SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE datname = '{name}'"
                    " AND pid <> pg_backend_pid()")
        # renamed first: a straggler of the test (an unreaped child, a thread's pool) can no longer connect,
        # so no row lands between the TRUNCATE and the next test
        _admin_exec(f"ALTER DATABASE {name} RENAME TO {fresh}")
    except psycopg.Error:
        _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        return
    try:
        with psycopg.connect(_conninfo(fresh), autocommit=True, connect_timeout=10) as conn:
            conn.execute("SET lock_timeout = '5s'")  # a lock still held: dropped, never a hung worker
            # the tables the test wrote (a table no row ever reached has no page): TRUNCATE costs per table
            tables = [r[0] for r in conn.execute(
                "SELECT quote_ident(relname) FROM pg_class WHERE relnamespace = 'public'::regnamespace"
                " AND relkind IN ('r', 'p') AND relname <> 'alembic_version' AND pg_relation_size(oid) > 0")]
            if tables:
                conn.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")
            # the test's row counts, left counted, would have autovacuum analyze these (now empty) tables
            # during a later test that needs them never analyzed; the counters of a fresh database are zero
            conn.execute("SELECT pg_stat_reset()")
            if _fingerprint(conn) == _TEMPLATE_PRINT[0]:
                _POOL.append(fresh)
                return
    except psycopg.Error:
        pass
    _admin_exec(f"DROP DATABASE IF EXISTS {fresh} WITH (FORCE)")


def fresh_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, migrated, empty database of ``backend`` for one test."""
    if backend == "sqlite":
        template = request.getfixturevalue("sqlite_template")
        path = tmp_path / "store.db"
        shutil.copyfile(template, path)
        yield f"sqlite:///{path}"
        return
    name = _take_pg_database(request.getfixturevalue("pg_template"))
    try:
        yield pg_url(name)
    finally:
        _give_back_pg_database(name)


def module_store_fixtures(scope: str, folder: str) -> tuple[Any, Any, Any]:
    """Fixtures ``shared_url`` and ``store`` (one migrated database per backend for a module) and ``sid``
    (a fresh session of ``scope`` per test). For modules whose tests each work in their own session:
    creating a PostgreSQL database per test would be most of such a module's time. Assign the three
    to module names (``shared_url, store, sid = module_store_fixtures(...)``) for pytest to find them."""

    @pytest.fixture(scope="module", params=BACKENDS, name="shared_url")
    def shared_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        yield from fresh_url(str(request.param), request, tmp_path_factory.mktemp(folder))

    @pytest.fixture(scope="module", name="store")
    def store(shared_url: str) -> Iterator[TranscriptStore]:
        s = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False))
        yield s
        s.close()

    @pytest.fixture(name="sid")
    def sid(store: TranscriptStore) -> str:
        return store.create_session(scope, session_id=f"s-{uuid.uuid4().hex[:12]}").session_id

    return shared_url, store, sid


def tool_round(call_id: str, result: str) -> list[dict[str, Any]]:
    """An assistant message calling one tool, and the tool's result."""
    call = {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": '{"q":"x"}'}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from fresh_url(backend, request, tmp_path)


@pytest.fixture
def store(store_url: str) -> Iterator[TranscriptStore]:
    s = TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False))
    yield s
    s.close()


@pytest.fixture
def session_id(store: TranscriptStore) -> str:
    return store.create_session("scope-a", session_id="s1", session_key="agent:main:test:1").session_id


def wait_until(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``condition`` until it is truthy and return its value; fail naming ``what`` after ``timeout``.

    For a test that needs an event another thread or process makes (a lease renewed, a row written): a
    fixed sleep is either too short on a loaded machine (the suite runs on two busy cores) or slow."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g} s: {what}")
        time.sleep(0.02)


def user(text: str) -> dict[str, object]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, object]:
    return {"role": "assistant", "content": text}


#: a finished turn: its admission, the anchor of its last reply, and the closed range's messages
EngineTurn = tuple[Admission, Anchor, list[dict[str, Any]]]


def finished_turn(
    store: TranscriptStore, scope: str, sid: str, turn_id: str,
    replies: Sequence[dict[str, Any]] | None = None, question: str | None = None,
) -> EngineTurn:
    """Admit ``turn_id``'s question, append its replies (default: one answer) and read its closed range."""
    admission = store.admit(scope, sid, user(question or f"question {turn_id} " + "words " * 30), turn_id=turn_id)
    replies = replies or [assistant(f"answer {turn_id} " * 10)]
    appended = store.append_many(scope, sid, [{"message": m} for m in replies])
    terminal = store.anchor(scope, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    return admission, terminal, closed.messages


def commit_with(store: TranscriptStore, engine: ContextEngine, turn: EngineTurn) -> CommitResult:
    """Commit a finished turn through ``engine.commit_turn`` in one store transaction."""
    admission, terminal, msgs = turn
    return store.write(lambda c: engine.commit_turn(
        tx=c, advancement_key=admission.turn_id, admission=admission.anchor, terminal=terminal, messages=msgs
    ))


def make_legacy(store: TranscriptStore, scope: str, session_id: str) -> None:
    """Give a session the incarnation schema revision 0007 gave every session that existed before it (its
    creation time): such a session may hold cursors and anchors made before they carried an incarnation."""
    from sqlalchemy import text

    with store.db.engine.begin() as conn:
        conn.execute(
            text("UPDATE ts_sessions SET incarnation = CASE WHEN created_us > 0 THEN created_us ELSE 1 END"
                 " WHERE scope = :scope AND session_id = :sid"),
            {"scope": scope, "sid": session_id},
        )
