"""Connections, transactions, retries and the one place where SQLite and PostgreSQL differ.

Every write runs as ``Database.write(fn)``: one transaction around ``fn(conn)``, retried whole on a
transient error. ``fn`` must therefore be re-runnable: callers generate ids and keys *before* the
transaction, so a retry after an uncertain commit finds its own earlier write instead of adding a
second one.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from sqlalchemy import Connection, Engine, Table, create_engine, event, text
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt

from .config import StoreConfig
from .errors import (
    InvalidInput,
    PermissionDenied,
    SchemaNotCurrent,
    StorageFull,
    StoreClosed,
    StoreUnavailable,
    TransientStoreError,
)

T = TypeVar("T")

_PG_TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "57P01", "57P02", "57P03", "55P03", "53300"})
_SQLITE_BUSY_CODES = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED (extended codes are masked)
_SQLITE_FULL = 13
#: SQLITE_PERM, SQLITE_READONLY, SQLITE_AUTH (primary result codes)
_SQLITE_REFUSED = (3, 8, 23)
_SQLITE_READONLY_DBMOVED = 8 | (4 << 8)
_SQLITE_CANTOPEN = 14
#: bytes a SQLite WAL file keeps after a checkpoint restarts it. Without a limit it keeps its high-water
#: size for as long as any process has the store open: one long read (a slow export, a user's
#: ``store.read``) during a burst of writes left a ``serve`` with hundreds of MB of WAL for good. Well
#: above the steady size (the 1000-page autocheckpoint, ~4 MiB), so normal use never truncates.
SQLITE_WAL_SIZE_LIMIT = 64 * 1024 * 1024
_PG_DISK_FULL = "53100"
_PG_INSUFFICIENT_PRIVILEGE = "42501"
_PG_UNDEFINED_TABLE = "42P01"
_SQLITE_ERROR = 1
#: SQLSTATE classes of a statement's own fault on PostgreSQL: data (22), integrity (23), syntax and names (42),
#: but for a prepared statement a pooler in transaction mode finds again on another server connection
#: (42P05; the one it lost is 26000, not a class here): the deployment's, not the statement's
_PG_STATEMENT_FAULT_CLASSES = ("22", "23", "42")
_PG_NOT_STATEMENT_FAULTS = ("42P05",)
#: SQLite's primary result codes of a statement's own fault: SQLITE_ERROR (a syntax error, an unknown column;
#: a missing table is told apart before it, ``is_missing_table``), SQLITE_CONSTRAINT, SQLITE_MISMATCH,
#: SQLITE_RANGE, SQLITE_TOOBIG
_SQLITE_STATEMENT_FAULTS = (_SQLITE_ERROR, 19, 20, 25, 18)
#: retry jitter from the operating system, never the ``random`` module's global generator: drawing from
#: that one moved the sequence of an application that seeds it (reproducible runs, Hypothesis), from any
#: thread that retried; a private seeded generator would draw the same waits in forked siblings.
_JITTER = random.SystemRandom()


def _wait(state: RetryCallState) -> float:
    """Full jitter over an exponential bound: 5 ms before the second attempt, doubling, at most 0.5 s."""
    return _JITTER.uniform(0, min(0.5, 0.005 * 2 ** min(state.attempt_number - 1, 16)))


#: psycopg's IsolationLevel.REPEATABLE_READ (an IntEnum; psycopg is imported only for PostgreSQL)
_REPEATABLE_READ = 3


@dataclass(frozen=True)
class Dialect:
    """What differs between the backends, and nothing else."""

    name: str

    @property
    def is_sqlite(self) -> bool:
        """True for the embedded SQLite backend."""
        return self.name == "sqlite"

    def insert(self, table: Table) -> pg.Insert | sqlite_dialect.Insert:
        """An INSERT that supports ``on_conflict_do_nothing`` on this backend."""
        if self.is_sqlite:
            return sqlite_dialect.insert(table)
        return pg.insert(table)

    def is_transient(self, error: DBAPIError) -> bool:
        """Decide by SQLSTATE / SQLite error code, never by message text."""
        if error.connection_invalidated:
            return True
        orig = error.orig
        if self.is_sqlite:
            code = getattr(orig, "sqlite_errorcode", None)
            return code is not None and (code & 0xFF) in _SQLITE_BUSY_CODES
        sqlstate = getattr(orig, "sqlstate", None)
        if sqlstate is None:
            # psycopg raises OperationalError without SQLSTATE when the connection itself is gone.
            return orig.__class__.__name__ in ("OperationalError", "InterfaceError")
        return sqlstate in _PG_TRANSIENT_SQLSTATES or sqlstate.startswith("08")

    def is_storage_full(self, error: DBAPIError) -> bool:
        """The disk is full: SQLITE_FULL, or PostgreSQL's disk_full (53100)."""
        if self.is_sqlite:
            code = getattr(error.orig, "sqlite_errorcode", None)
            return code is not None and (code & 0xFF) == _SQLITE_FULL
        return getattr(error.orig, "sqlstate", None) == _PG_DISK_FULL

    def is_permission_denied(self, error: DBAPIError) -> bool:
        """The operation is refused to this process: PostgreSQL's insufficient_privilege (42501); on
        SQLite a database this process may only read (SQLITE_READONLY: the file or its folder is not
        writable to it, or the connection is read-only) or an access refusal (SQLITE_PERM, SQLITE_AUTH).
        A file deleted or moved under an open store (SQLITE_READONLY_DBMOVED) is not a permission."""
        if self.is_sqlite:
            code = getattr(error.orig, "sqlite_errorcode", None)
            if code is None or code == _SQLITE_READONLY_DBMOVED:
                return False
            return (code & 0xFF) in _SQLITE_REFUSED
        return getattr(error.orig, "sqlstate", None) == _PG_INSUFFICIENT_PRIVILEGE

    def is_statement_fault(self, error: DBAPIError) -> bool:
        """The statement itself is wrong and fails the same way every time it runs (a constraint it breaks,
        SQL the database cannot parse, a column or value named wrong), not the database or its deployment:
        by SQLSTATE class on PostgreSQL, by primary result code on SQLite. Asked after the kinds above."""
        if self.is_sqlite:
            code = getattr(error.orig, "sqlite_errorcode", None)
            return code is not None and (code & 0xFF) in _SQLITE_STATEMENT_FAULTS
        state = getattr(error.orig, "sqlstate", None)
        return isinstance(state, str) and state[:2] in _PG_STATEMENT_FAULT_CLASSES and (
            state not in _PG_NOT_STATEMENT_FAULTS
        )

    def is_missing_table(self, error: DBAPIError) -> bool:
        """A table the statement names is not there (a database without the store's schema, opened with
        ``create=False``): PostgreSQL's undefined_table (42P01). SQLite has no code of its own for it (a
        plain SQLITE_ERROR), so there its message, fixed by SQLite, says it."""
        if self.is_sqlite:
            code = getattr(error.orig, "sqlite_errorcode", None)
            return code == _SQLITE_ERROR and str(error.orig).startswith("no such table:")
        return getattr(error.orig, "sqlstate", None) == _PG_UNDEFINED_TABLE


def refuse_unwritable_files(path: Path) -> None:
    """PermissionDenied when the store's file, or its WAL or shared-memory file, exists and this process
    may not read and write it (root may, as sqlite3 does)."""
    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        try:
            refused = name.is_file() and not os.access(name, os.R_OK | os.W_OK)
        except OSError:  # a folder on the way this process may not enter: sqlite3's open reports it
            continue
        if refused:
            raise PermissionDenied(
                f"database permission denied: {name} is not readable and writable by this process (a SQLite"
                " store's file, its -wal and its -shm must all be; a -wal or -shm another user's process left"
                " may be removed once no process has the store open)"
            )


def _sqlite_connect_listeners(engine: Engine, config: StoreConfig, path: Path) -> None:
    @event.listens_for(engine, "do_connect")
    def _on_do_connect(*_args: object) -> None:
        # Before sqlite3 opens the file. One this process may only read was opened read-only: reads
        # worked (exit 0) where its folder was writable, and left a -wal and -shm owned by this process
        # that made every write of the store's owner fail ("attempt to write a readonly database")
        # until someone removed them.
        refuse_unwritable_files(path)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        # We own the transactions: pysqlite's implicit BEGIN would be deferred and unlocked.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(config.busy_timeout_ms)}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute(f"PRAGMA journal_size_limit = {SQLITE_WAL_SIZE_LIMIT}")
        cur.execute(f"PRAGMA synchronous = {config.sqlite_synchronous}")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Writers take the write lock up front: a deferred BEGIN that later upgrades can fail with
        # SQLITE_BUSY without waiting on the busy timeout, after part of the work was done. On the
        # driver directly: this runs once per transaction, and exec_driver_sql costs ~10x more.
        write = conn.info.get("ts_write", False) or conn.get_execution_options().get("ts_write", False)
        driver = conn.connection.driver_connection
        assert driver is not None
        statement = "BEGIN IMMEDIATE" if write else "BEGIN"
        try:
            driver.execute(statement)
        except sqlite3.Error as e:
            # SQLAlchemy does not wrap what a "begin" listener raises: wrap it here, so that a write
            # lock still held after the busy timeout is a transient error, translated and retried.
            raise DBAPIError.instance(statement, (), e, sqlite3.Error, dialect=conn.dialect) from e


#: What every PostgreSQL connection of the store runs once (unless ``StoreConfig.pg_generic_plans`` is off).
PG_SESSION_SETTINGS = "SET plan_cache_mode = force_generic_plan"
#: What a transaction runs first when its statement's best plan depends on the values (full-text search)
PG_VALUE_PLANS = "SET LOCAL plan_cache_mode = auto"
#: SQLSTATEs of a server that refuses the setting (an unknown parameter before PostgreSQL 12, a
#: pooler's or a role's restrictions): the connection works without it
_PG_SETTING_REFUSED = frozenset({"42704", "22023", "42501", "0A000", "55P02"})
_log = logging.getLogger(__name__)


def _pg_on_connect(dbapi_conn: Any, _record: object) -> None:
    # psycopg prepares a statement run five times, but the server still plans it again on every
    # execution while it estimates a custom plan cheaper than the generic one: for the delta page's
    # join that was 0.13 ms of planning per read, a third of its time (bench/README.md, "Profiling"
    # 32). The store's own statements are keyed lookups whose best plan does not depend on the values
    # (tests/test_pg_plans.py checks the delta page's); a statement whose plan does (the lossless
    # engine's full-text search) runs PG_VALUE_PLANS in its transaction first. A SET, not a startup
    # option: poolers refuse unknown startup parameters. A server that refuses it still gives a
    # working connection; a connection lost meanwhile fails here, as a transient error.
    import psycopg  # loaded already: dbapi_conn is one of its connections

    dbapi_conn.autocommit = True
    try:
        dbapi_conn.execute(PG_SESSION_SETTINGS)
    except psycopg.Error as e:
        if e.sqlstate not in _PG_SETTING_REFUSED:
            raise
        _log.warning("PostgreSQL refused %r (%s): statements are planned per execution", PG_SESSION_SETTINGS, e)
    dbapi_conn.autocommit = False


def _pg_require_utf8(dbapi_conn: Any, _record: object) -> None:
    """Refuse a database whose encoding is not UTF8 (from the connection's startup report: no round trip).

    The store takes any Unicode text: under LATIN1 a message with an emoji cannot be stored, under
    SQL_ASCII an id's 255 characters are counted as bytes and nothing is checked. Refused when a
    connection opens, so before anything (the schema included) is written."""
    found = dbapi_conn.info.parameter_status("server_encoding")
    if found is not None and found.upper() not in ("UTF8", "UTF-8"):
        dbapi_conn.close()
        raise StoreUnavailable(
            f"the PostgreSQL database's encoding is {found}, not UTF8: the store needs a UTF8 database "
            "(CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"
        )


def _reset_autocommit(conn: Connection, driver: Any) -> None:
    """Give the pooled connection back in transaction mode, or drop it from the pool if it cannot be."""
    if conn.invalidated:
        return
    try:
        driver.autocommit = False
    except BaseException as e:  # not idle (a statement still running after an interrupt): never reuse it
        conn.invalidate(e if isinstance(e, Exception) else None)
        if not isinstance(e, Exception):
            raise


def _reset_read_only(conn: Connection, driver: Any) -> None:
    """Give the pooled connection back as a read-write one, or drop it from the pool if it cannot be."""
    if conn.invalidated:
        return
    try:
        driver.isolation_level, driver.read_only = None, None
    except Exception as e:  # not idle after a failed rollback: never hand out a read-only connection
        conn.invalidate(e)


#: what no database takes in a bound text value: NUL (PostgreSQL) and lone surrogates (UTF-8 cannot encode)
UNSENDABLE = re.compile("[\x00\ud800-\udfff]")


#: what make_url raises for a string that is not a database URL: ArgumentError, or ValueError for a port
#: that is not a number (``postgresql://host:5432x/db``)
NOT_A_URL = (ArgumentError, ValueError)


#: control characters (C0, DEL, C1), NUL and lone surrogates: none belongs in a database URL
_BAD_URL_CHAR = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def parse_url(url: str) -> URL:
    """The database URL a store accepts, parsed; InvalidInput for any other (the CLI: a usage error)."""
    # A file or database name with a newline or an escape sequence would split or act on every line that
    # shows it (an error, doctor, the gateway's report); NUL and lone surrogates no driver can take.
    if _BAD_URL_CHAR.search(url) is not None:
        raise InvalidInput("a database URL must not contain control characters, NUL or lone surrogates")
    if url != url.strip():
        # A space pasted or left in a .env file: "sqlite:///x.db " created and used a file "x.db ", beside
        # the store meant, which then looked empty; on PostgreSQL it named another database.
        raise InvalidInput("a database URL must not start or end with whitespace")
    try:
        parsed = make_url(url)
    except NOT_A_URL as e:
        raise InvalidInput(f"not a database URL: {mask_url(url)}") from e
    if "@" in (parsed.host or ""):
        # A password with an unescaped "@" ends at its first "@": the rest of it becomes the host, which
        # the masked URL, the driver's "failed to resolve host" and the SQLite hint below all showed.
        raise InvalidInput(
            "the URL's host part holds '@': percent-encode an '@' in the user name or password as %40"
            " (the URL is not shown)"
        )
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        # The store's connections are sqlite3's (pysqlite): another driver (an async one, a typo) would
        # fail inside SQLAlchemy, or open the file without the store's connection settings.
        if parsed.get_driver_name() != "pysqlite":
            raise InvalidInput(
                f"unsupported SQLite driver {parsed.get_driver_name()!r}: use sqlite:// (or sqlite+pysqlite://)"
            )
        if parsed.host or parsed.port is not None or parsed.username or parsed.password:
            # sqlite://x.db puts the file name in the host part (two slashes, not three): the driver would
            # have opened an in-memory database, or another file than the one meant.
            raise InvalidInput(
                "a SQLite URL takes no host, port or credentials: name the file after three slashes, sqlite:///relative.db"
                " or sqlite:////absolute/path.db"
                + (f" (sqlite:///{parsed.host}?)" if parsed.host and not parsed.database else "")
            )
        if parsed.database in (None, "", ":memory:"):
            raise InvalidInput("an in-memory SQLite database cannot be shared; give a file path")
        if _home_path(parsed.database or "") is None:
            # sqlite:///~nobody/x.db: expanding it raised RuntimeError, untyped (the CLI's "internal error", exit 1)
            raise InvalidInput(
                f"the SQLite path {parsed.database!r} starts with the home folder of a user this system does not"
                " know: give the path itself"
            )
        if sqlite_uri(parsed):
            # A file: URI's path is not a file name: the store's file checks (a read command never
            # creates a store, the Hermes plugin's absolute path) would look at the wrong file.
            raise InvalidInput(SQLITE_URI_REFUSED)
        if parsed.query or "?" in url:
            # The store sets its connections' options itself (timeout, threads, its own transactions);
            # sqlite3's in a URL were either overridden or, malformed (?timeout=abc), a ValueError from
            # the driver when the first connection opened. A query holding no name=value (sqlite:///my?file.db)
            # was dropped without a word: the store was made in the file "my".
            given = "&".join(sorted(parsed.query)) or url.partition("?")[2]
            raise InvalidInput(
                f"a SQLite URL takes no query parameters (?{given}): the store sets its connections' options"
                " (the lock wait: TRANSCRIPT_STORE_BUSY_TIMEOUT_MS); a '?' in a file name is written %3F"
            )
    elif backend != "postgresql":
        raise InvalidInput(f"unsupported database backend {backend!r}: use sqlite or postgresql")
    elif parsed.port is not None and not 1 <= parsed.port <= 65535:
        # libpq refused it only when connecting ("invalid port number"), which read as a database down
        # (the CLI's exit 5, a service's 503): a URL no server can answer is a bad URL.
        raise InvalidInput(f"the URL's port {parsed.port} is not a TCP port (1 to 65535)")
    else:
        _refuse_options_without_value(url)
        if parsed.query:
            _check_pg_options(parsed.query)
    return parsed


#: the scheme and user part of a URL as make_url's own pattern reads them: a '?' in the password (or the
#: user name) is theirs, and the query starts at the first '?' after them
_SCHEME_AND_USER = re.compile(r"[\w+]+://(?:[^:/]*(?::[^@]*)?@)?")


def _refuse_options_without_value(url: str) -> None:
    """Refuse a PostgreSQL URL's query option given without a value (``?sslmode``, ``?a=1&b``, ``?sslmode=``):
    make_url dropped it without a word, and the connection went without it (no TLS asked for), or to another
    database (``/my?db``: the database ``my``)."""
    start = _SCHEME_AND_USER.match(url)
    query = url[start.end() if start else 0 :].partition("?")[2]
    blank = [name for name, value in parse_qsl(query, keep_blank_values=True) if not value]
    if blank:
        raise InvalidInput(
            f"the URL's query gives no value to {', '.join(repr(name) for name in blank)}: write name=value"
            " (a '?' in a database name is written %3F)"
        )


#: libpq's connection options whose value is one of a few words. libpq refuses another word (a typo,
#: ``sslmode=requre``) only when connecting, and that read as a database down: the CLI's exit 5, a
#: service's 503, every call retried as transient before failing.
_PG_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": ("any", "read-write", "read-only", "primary", "standby", "prefer-standby"),
    "load_balance_hosts": ("disable", "random"),
    "sslnegotiation": ("postgres", "direct"),
}


def _check_pg_options(query: Mapping[str, str | tuple[str, ...]]) -> None:
    """Refuse a PostgreSQL URL's query naming an option libpq does not know, one given twice, or a word
    libpq would refuse on connecting (InvalidInput: a bad URL, not an outage)."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import make_conninfo

    for name, value in query.items():
        if not isinstance(value, str) and name != "host":
            # ``host`` alone may come several times: SQLAlchemy's multi-host form (``?host=A:5432&host=B:5432``,
            # a primary and its standbys), which it hands libpq as one list.
            raise InvalidInput(f"the URL gives the option {name!r} {len(value)} times: give it once")
        if name == "connect_timeout" and isinstance(value, str) and not (value.isascii() and value.isdigit()):
            # psycopg refused it only when connecting ("bad value for connect_timeout"): a bad URL, no outage
            raise InvalidInput(f"the URL's connect_timeout={value!r} is not a number of seconds (0: no limit)")
        choices = _PG_CHOICES.get(name)
        if choices is not None and value not in choices:
            raise InvalidInput(f"the URL's {name}={value!r} is not one of {', '.join(choices)}")
    try:
        make_conninfo("", **{name: v if isinstance(v, str) else ",".join(v) for name, v in query.items()})
    except ProgrammingError as e:  # an option libpq does not know: 'invalid connection option "x"'
        # psycopg's, not libpq's: behind a pooler in transaction mode, the store's setting turns it off
        hint = (" (psycopg's prepare_threshold is no URL option: turn prepared statements off with "
                "TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS=0)") if "prepare_threshold" in query else ""
        raise InvalidInput(f"the URL's query: {str(e).strip()}{hint}") from e


def _refuse_no_regular_file(path: Path, url: str) -> None:
    """InvalidInput for a SQLite path naming a directory, a device, a FIFO or a socket: sqlite3 answered
    "unable to open database file" or "disk I/O error" at the first call, a StoreUnavailable read as the
    database down, and left a ``-journal`` file beside a device (``/dev/null-journal``)."""
    try:
        mode = path.stat().st_mode
    except OSError:  # not there (a store to create), or not to be looked at: sqlite3's open says
        return
    if not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "no regular file (a device, a FIFO or a socket)"
        raise InvalidInput(f"{mask_url(url)} names {what}: give the path of a store's file (or of one to create)")


def _pg_connect_defaults() -> dict[str, object]:
    """The PostgreSQL connection options the store sets unless the URL gives its own."""
    return {"connect_timeout": 10, "application_name": f"transcript-store:{os.getpid()}"}


def create_db_engine(config: StoreConfig) -> Engine:
    """A SQLAlchemy engine for the configured URL with the backend's connection settings."""
    url = parse_url(config.url)
    if url.get_backend_name() == "sqlite":
        assert url.database is not None  # parse_url refuses an in-memory database
        path = _home_path(url.database)
        assert path is not None  # parse_url refuses a path under an unknown user's home
        if str(path) != url.database:  # sqlite:///~/x.db: sqlite3 itself would look for a folder "~"
            url = url.set(database=str(path))
        _refuse_no_regular_file(path, config.url)
        try:
            path.resolve().parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            # A folder this process may not write in (or on a read-only file system) is a permission to
            # fix, as the file itself would be (exit 6): it was "database unavailable" (exit 5), an outage.
            if isinstance(e, PermissionError) or e.errno == errno.EROFS:
                raise PermissionDenied(
                    f"database permission denied: cannot create the directory of {mask_url(config.url)}: {e}"
                ) from e
            raise StoreUnavailable(f"cannot create the directory of {mask_url(config.url)}: {e}") from e
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        _sqlite_connect_listeners(engine, config, path)
        return engine
    if url.get_driver_name() != "psycopg":
        url = url.set(drivername="postgresql+psycopg")
    engine = create_engine(
        url,
        pool_size=config.pool_size,
        max_overflow=config.pool_size,
        # No pool_pre_ping: it costs a round trip per transaction. A connection that died in the
        # pool fails its first statement, which is a transient error: the transaction is retried
        # whole on a fresh connection (the pool drops the invalidated one).
        # UTF-8 always: the client encoding otherwise follows PGCLIENTENCODING or the database's own, and
        # a message the codec could not carry (an emoji under LATIN1) left psycopg as UnicodeEncodeError,
        # a SQL_ASCII database's bytes broke the engine's first connect (TypeError).
        # The URL's own connect_timeout and application_name win (they were overridden, silently).
        # prepare_threshold=None (pg_prepared_statements off): psycopg prepares nothing, for a pooler that
        # hands a client another server connection at each transaction, where a statement prepared on the
        # last one is missing ("prepared statement "_pg3_0" does not exist") or one of the same name is
        # there already. On by default: the turn path's statements are planned once per connection.
        connect_args={
            **{k: v for k, v in _pg_connect_defaults().items() if k not in url.query},
            "client_encoding": "UTF8",
            **({} if config.pg_prepared_statements else {"prepare_threshold": None}),
        },
    )
    event.listen(engine, "connect", _pg_require_utf8)
    if config.pg_generic_plans:
        event.listen(engine, "connect", _pg_on_connect)
    return engine


#: why a SQLite URL in sqlite3's URI mode is refused (opening a store, and the CLI's --db check)
SQLITE_URI_REFUSED = "SQLite URI mode (?uri=true) is not supported: give the database file's path"


def _home_path(database: str) -> Path | None:
    """A SQLite URL's path with a leading ``~`` or ``~user`` expanded; None when that user is unknown."""
    try:
        return Path(database).expanduser()
    except RuntimeError:  # "Could not determine home directory."
        return None


def sqlite_uri(url: URL) -> bool:
    """True for a SQLite URL in sqlite3's URI mode (``sqlite:///file:x.db?uri=true``)."""
    return str(url.query.get("uri", "")).lower() in ("true", "1")


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names, ``~`` expanded (None for other backends, in-memory, URI mode, or a
    path under the home folder of an unknown user, the last two of which opening the store refuses)."""
    try:
        parsed = make_url(url)
    except NOT_A_URL:
        return None
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return None if sqlite_uri(parsed) else _home_path(parsed.database)  # (an unknown ~user: parse_url refuses it)


def _secret_key(key: str) -> bool:
    """Whether a URL query parameter carries a secret: libpq takes ``password`` and ``sslpassword`` there."""
    name = key.lower()
    return any(word in name for word in ("password", "passwd", "secret", "token"))


def url_secrets(url: str) -> list[str]:
    """The secrets a database URL holds: its password and the values of its secret query parameters."""
    try:
        parsed = make_url(url)
    except NOT_A_URL:
        return []
    found = [str(parsed.password)] if parsed.password else []
    for key, value in parsed.query.items():
        if _secret_key(key):
            found.extend(v for v in ((value,) if isinstance(value, str) else value) if v)
    return found


def mask_url(url: str) -> str:
    """The URL with any password (in its userinfo or a secret query parameter) replaced by ***."""
    try:
        parsed = make_url(url)
    except NOT_A_URL:
        return "<unparseable URL>"
    hidden = {key: "***" for key in parsed.query if _secret_key(key)}
    rendered = parsed.update_query_dict(hidden).render_as_string(hide_password=True)
    return rendered.replace("=%2A%2A%2A", "=***")  # the query's *** as the userinfo's, not percent-encoded


class Database:
    """One engine, its dialect, and transactions with retries."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.engine = create_db_engine(config)
        self.dialect = Dialect(self.engine.dialect.name)
        self._pid = os.getpid()
        #: transactions retried after a transient error, since this Database was made
        self.retries = 0
        #: called with the error before each retry (observability; tests count retries with it)
        self.on_retry: Callable[[BaseException | None], None] | None = None
        #: set by ``close``: SQLAlchemy reconnects on use after ``dispose``, so a call that outlived the
        #: close (a service's straggling request) reopened connections nobody would close again
        self.closed = False

    def check_open(self) -> None:
        """StoreClosed once ``close`` ran."""
        if self.closed:
            raise StoreClosed(f"the store is closed: {mask_url(self.config.url)} is not connected to again")

    def _check_fork(self) -> None:
        # A pool inherited across fork() shares sockets with the parent: drop it, never use it.
        if os.getpid() != self._pid:
            self.engine.dispose(close=False)
            self._pid = os.getpid()

    def _retrying(self, attempts: int) -> Retrying:
        return Retrying(
            retry=retry_if_exception_type(TransientStoreError),
            stop=stop_after_attempt(attempts),
            wait=_wait,
            before_sleep=lambda state: self._retried(state.outcome.exception() if state.outcome else None),
            reraise=True,
        )

    @staticmethod
    def _first_wait() -> float:
        """The pause before the first retry: what tenacity's wait gives its first attempt."""
        return _JITTER.uniform(0, 0.005)

    @contextmanager
    def _connected(self) -> Iterator[Connection]:
        """A pooled connection; a driver error raised while it is held leaves as this library's."""
        self.check_open()
        self._check_fork()
        try:
            with self.engine.connect() as conn:
                try:
                    # Again once connected: a close between the check above and the connect disposed of
                    # the pool this connection is not in.
                    self.check_open()
                    yield conn
                finally:
                    if self.closed:  # closed meanwhile: the connection is closed, never pooled again
                        conn.invalidate()
        except DBAPIError as e:
            raise self.translate(e) from e
        except SQLAlchemyError as e:
            raise StoreUnavailable(f"database error: {e.__class__.__name__}: {e}") from e

    @contextmanager
    def _statement(self) -> Iterator[Connection]:
        # No transaction at all, for ONE statement (atomic, and a consistent snapshot by itself, on
        # both backends): no BEGIN/COMMIT round trips on PostgreSQL. Nothing may be executed through
        # SQLAlchemy here (it would autobegin); hot.run executes on the driver's cursor. psycopg's
        # autocommit attribute is client-side on an idle connection, and put back before the pool
        # takes the connection again.
        with self._connected() as conn:
            if self.dialect.is_sqlite:
                yield conn  # sqlite3 opens no transaction for a SELECT
                return
            driver: Any = conn.connection.driver_connection
            try:
                driver.autocommit = True
                yield conn
            finally:
                _reset_autocommit(conn, driver)

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[Connection]:
        # Per-transaction overhead is paid by every turn, several times (bench/README.md): no
        # execution_options() branch per call and no isolation-level round trips. SQLite: the begin
        # listener reads the write flag from the connection's info. PostgreSQL: psycopg puts the
        # isolation level and READ ONLY into the BEGIN it sends anyway; set on a connection outside a
        # transaction, both are client-side attributes only.
        with self._connected() as conn:
            if self.dialect.is_sqlite:
                conn.info["ts_write"] = write
                try:
                    with conn.begin():
                        yield conn
                finally:
                    conn.info["ts_write"] = False  # the pooled connection's next user decides again
            elif write:
                pg: Any = conn.connection.driver_connection
                if pg.autocommit:  # never write statement by statement (a leaked read mode)
                    pg.autocommit = False
                with conn.begin():
                    yield conn
            else:
                driver: Any = conn.connection.driver_connection
                # One snapshot for every statement of a read (a page is consistent).
                driver.isolation_level, driver.read_only = _REPEATABLE_READ, True
                try:
                    with conn.begin():
                        yield conn
                finally:
                    _reset_read_only(conn, driver)

    def translate(self, error: DBAPIError) -> StoreUnavailable | SchemaNotCurrent:
        """The one translation of a driver error into this library's tree."""
        detail = str(error.orig).strip().splitlines()[0] if error.orig is not None else str(error)
        if self.dialect.is_transient(error):
            if getattr(error.orig, "pgconn", None) is not None and getattr(error.orig, "sqlstate", None) is None:
                # A failed connection attempt (psycopg attaches its pgconn to those alone, with no
                # SQLSTATE): retried, as the server may be starting or out of connection slots, but a
                # wrong database or role name fails the same way, so the message does not call it passing.
                return TransientStoreError(f"cannot connect to the database: {detail}")
            return TransientStoreError(f"transient database error: {detail}")
        if self.dialect.is_storage_full(error):
            return StorageFull(f"database storage is full: {detail}")
        if self.dialect.is_permission_denied(error):
            return PermissionDenied(f"database permission denied: {detail}")
        if self._file_refused(error):
            return PermissionDenied(
                f"database permission denied: {detail} (the file or its folder is not readable and writable "
                "by this process)"
            )
        if self.dialect.is_missing_table(error):
            # Not an outage: the database holds no store (or not all of one). Opened with create=False,
            # nothing checked the schema before this first use.
            return SchemaNotCurrent(
                f"the database holds no transcript-store schema, or not all of it ({detail}): run "
                "`transcript-store init --db URL` (or, in Python, TranscriptStore.upgrade_url(url))"
            )
        return StoreUnavailable(f"database error: {detail}")

    def _file_refused(self, error: DBAPIError) -> bool:
        """SQLITE_CANTOPEN because the file (or, for one not there yet, its folder) is not readable and
        writable to this process: a permission, told apart from other reasons by asking the system."""
        code = getattr(error.orig, "sqlite_errorcode", None)
        if not self.dialect.is_sqlite or code is None or (code & 0xFF) != _SQLITE_CANTOPEN:
            return False
        path = sqlite_file(self.config.url)
        if path is None:
            return False
        try:
            if path.exists():
                return not os.access(path, os.R_OK | os.W_OK)
            return path.parent.is_dir() and not os.access(path.parent, os.W_OK | os.X_OK)
        except OSError:  # a folder on the way this process may not enter
            return False

    def _run(self, fn: Callable[[Connection], T], write: bool, statement: bool = False) -> T:
        # The first attempt runs bare: building tenacity's Retrying and its attempt state costs more
        # than an empty SQLite transaction, and almost every transaction succeeds at once. A transient
        # failure hands over to tenacity (waits, stop) for the remaining attempts.
        def scope() -> AbstractContextManager[Connection]:
            return self._statement() if statement else self._transaction(write)

        try:
            with scope() as conn:
                return fn(conn)
        except TransientStoreError as e:
            if self.config.retry_attempts <= 1:
                raise
            self._retried(e)
        time.sleep(self._first_wait())
        for attempt in self._retrying(self.config.retry_attempts - 1):
            with attempt, scope() as conn:
                return fn(conn)
        raise AssertionError("unreachable")  # pragma: no cover

    def _retried(self, error: BaseException | None) -> None:
        self.retries += 1
        if self.on_retry is not None:
            self.on_retry(error)

    def write(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one write transaction, retried whole on transient errors."""
        return self._run(fn, True)

    def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one read-only snapshot, retried whole on transient errors."""
        return self._run(fn, False)

    def statement(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn``, which executes ONE statement on the driver's cursor (``hot.run``), outside any
        transaction (autocommit: a write commits with it); retried whole on transient errors, so the
        statement must be idempotent."""
        return self._run(fn, False, statement=True)

    def analyze(self, tables: tuple[str, ...]) -> None:
        """Refresh the planner statistics of some tables (PostgreSQL; SQLite plans need none here)."""
        if self.dialect.is_sqlite:
            return
        names = ", ".join(t for t in tables if t.isidentifier())
        self.write(lambda conn: conn.exec_driver_sql(f"ANALYZE {names}"))

    def analyze_unanalyzed(self, tables: tuple[str, ...]) -> bool:
        """ANALYZE those of some tables PostgreSQL holds no planner statistics for (never analyzed: a new
        deployment, autovacuum off or behind); whether one was. One catalog read when all have them;
        nothing on SQLite."""
        if self.dialect.is_sqlite:
            return False
        names = [t for t in tables if t.isidentifier()]

        def bare(conn: Connection) -> list[str]:
            query = text(
                "SELECT t FROM unnest(CAST(:names AS text[])) AS t WHERE NOT EXISTS "
                "(SELECT 1 FROM pg_stats s WHERE s.schemaname = current_schema() AND s.tablename = t)"
            )
            return [str(t) for (t,) in conn.execute(query, {"names": names})]

        missing = self.read(bare)
        if missing:
            self.analyze(tuple(missing))
        return bool(missing)

    def dispose(self) -> None:
        """Close every pooled connection (the next call connects again)."""
        self.engine.dispose()

    def close(self) -> None:
        """Close every pooled connection for good: a later call raises StoreClosed and connects to nothing,
        one still running closes its connection as it ends."""
        self.closed = True
        self.engine.dispose()

    def settings(self) -> dict[str, Any]:
        """The backend settings that matter for durability and concurrency."""

        def probe(conn: Connection) -> dict[str, Any]:
            if self.dialect.is_sqlite:
                return {
                    "backend": "sqlite",
                    "sqlite_version": sqlite3.sqlite_version,
                    "journal_mode": conn.exec_driver_sql("PRAGMA journal_mode").scalar(),
                    "synchronous": {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(
                        int(conn.exec_driver_sql("PRAGMA synchronous").scalar() or 0)
                    ),
                    "busy_timeout_ms": conn.exec_driver_sql("PRAGMA busy_timeout").scalar(),
                    "foreign_keys": bool(conn.exec_driver_sql("PRAGMA foreign_keys").scalar()),
                }
            return {
                "backend": "postgresql",
                "server_version": conn.exec_driver_sql("SHOW server_version").scalar(),
                "synchronous_commit": conn.exec_driver_sql("SHOW synchronous_commit").scalar(),
                "default_transaction_isolation": conn.exec_driver_sql(
                    "SHOW default_transaction_isolation"
                ).scalar(),
                # NULL (None) on a server without the setting, rather than an error
                "plan_cache_mode": conn.exec_driver_sql("SELECT current_setting('plan_cache_mode', true)").scalar(),
                "prepared_statements": _prepared_statements(conn),
                "id_order": _pg_id_order(conn),
                **({"warning": warning} if (warning := pooler_warning(self.config)) is not None else {}),
            }

        return self.read(probe)


def pooler_warning(config: StoreConfig) -> str | None:
    """What ``doctor`` warns of when prepared statements are off but every connection still runs
    ``PG_SESSION_SETTINGS``, else None (a SQLite store too: it runs no SET).

    Prepared statements are turned off for a pooler in transaction mode, which hands a client another server
    connection at each transaction. The SET, run once as a connection opens (autocommit, a transaction of its
    own), lands on the server connection the pooler lends for it and stays there when the pooler hands that
    connection to its next client (PgBouncer resets server connections only in session mode): other
    applications sharing the pool plan their statements generic, while the store's own transactions run on
    server connections with or without it. And with nothing prepared it saves nothing even without a pooler:
    each statement is parsed and planned at every run all the same, forced to a generic plan (its parameters
    unknown: ``$1`` in the plan) instead of one for its values."""
    if not config.url.startswith("postgresql") or config.pg_prepared_statements or not config.pg_generic_plans:
        return None
    return (
        "prepared statements are off (TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS=0, for a pooler in transaction "
        f"mode) but every connection still runs {PG_SESSION_SETTINGS!r}: behind such a pooler it lands on "
        "whichever server connection the pooler lends as the store connects and stays there for the pooler's "
        "other clients, while the store's own transactions run on connections with or without it (and with "
        "nothing prepared it plans every statement at every run all the same, generic). Set "
        "TRANSCRIPT_STORE_PG_GENERIC_PLANS=0 too (ALTER ROLE ... SET plan_cache_mode sets it for the store's "
        "role instead)"
    )


def _prepared_statements(conn: Connection) -> str:
    """Whether psycopg prepares the store's statements on this connection (``pg_prepared_statements``)."""
    threshold = getattr(conn.connection.driver_connection, "prepare_threshold", None)
    return "off" if threshold is None else f"after {threshold} runs of a statement on a connection"


#: ids that sort one way by code point and another by the usual linguistic collations
_ORDER_PROBE = ("B", "_x", "a", "\u00e4")


def _pg_id_order(conn: Connection) -> str:
    """How the database orders ids (its default collation): code point order as SQLite, or not.

    Listings ordered and paged by id (``list_sessions``, the outbox's sessions, an engine's receipt
    pages by advancement key) follow the database's collation: created with a linguistic one
    (``en_US.UTF-8``, an ICU locale), they list the same ids in another order than SQLite, and an
    ``after`` id starts a page elsewhere. Told by sorting probe ids
    rather than by the collation's name (an ICU database names a libc one too)."""
    values = ", ".join(f"('{v}')" for v in _ORDER_PROBE)
    got = [r[0] for r in conn.exec_driver_sql(f"SELECT v FROM (VALUES {values}) AS t(v) ORDER BY v")]
    if got == sorted(_ORDER_PROBE):
        return "code point (as SQLite)"
    # Whole rows as JSON: the ICU locale's column is daticulocale in PostgreSQL 15-16, datlocale from 17.
    row = conn.exec_driver_sql("SELECT to_jsonb(d) FROM pg_database AS d WHERE datname = current_database()").scalar()
    info = row if isinstance(row, dict) else {}
    icu = info.get("datlocale") or info.get("daticulocale") if info.get("datlocprovider") == "i" else None
    name = f"ICU {icu}" if icu else info.get("datcollate", "?")
    return (f"the database's collation ({name}), not SQLite's code point order: ids list in another order"
            " (a database created with LC_COLLATE C and the libc provider lists them as SQLite)")
