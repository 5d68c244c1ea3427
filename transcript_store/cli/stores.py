"""The store --db names: its URL checked, a file that holds no store refused untouched, sessions looked up."""

from __future__ import annotations

import os
import re
import shlex
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import click
from sqlalchemy.engine import URL

from .. import migrate
from ..db import mask_url, parse_url, sqlite_file
from ..errors import InvalidInput, SchemaNotCurrent, UnknownSession
from ..models import SessionInfo
from ..showing import ENDED_NAMED
from ..store import TranscriptStore
from .options import EXIT_USAGE, URL_ENV, CommandError, State, state


def _no_store_file(path: Path) -> str | None:
    """Why a SQLite file holds no store without opening it (None: it may hold one)."""
    if not path.exists():
        return "the file does not exist"
    # A zero-byte file is an empty database to sqlite3, which writes a header into it on the first
    # connection (the WAL mode): a read would change the file it was pointed at.
    if path.is_file() and path.stat().st_size == 0:
        return "the file is empty"
    return _not_a_store_database(path) if path.is_file() else None


#: the first 16 bytes of every SQLite database file
_SQLITE_MAGIC = b"SQLite format 3\x00"
#: why a file holds no store when it is no SQLite database at all, and what to do: not `init`, which refuses it
_NOT_SQLITE = "the file is not a SQLite database"
_NOT_SQLITE_ADVICE = "it cannot hold one; give the path of a store or of a file to create"


def _no_store_advice(why: str) -> str:
    """What to do about a SQLite file that holds no store for ``why``: `init`, unless it could not make one."""
    return _NOT_SQLITE_ADVICE if why == _NOT_SQLITE else run_advice("init")


def run_advice(command: str, url: str | None = None) -> str:
    """"run `transcript-store COMMAND ...`" for the store this command was given (``url``: by default the one
    --db or TRANSCRIPT_STORE_URL named), with its ``--db`` (shell-quoted, password masked) when one was named.
    Without it, the advice as printed ran on another database, the default one: `init` made a store in
    ./transcripts.db and the refusal stood."""
    if url is None:
        ctx = click.get_current_context(silent=True)
        st = ctx.find_object(State) if ctx is not None else None
        url = st.db if st is not None and st.db is not None else os.environ.get(URL_ENV)
    if not url:  # (an empty TRANSCRIPT_STORE_URL is unset: the default store, which `init` alone opens)
        return f"run `transcript-store {command}`"
    return f"run `transcript-store {command} --db {shlex.quote(mask_url(url))}`"


#: the library's advice in a SchemaNotCurrent (it knows no command line: "URL" stands for the database)
_LIBRARY_ADVICE = re.compile(
    r"run `transcript-store (init|upgrade) --db URL`(?: \(or, in Python, TranscriptStore\.upgrade_url\(url\)\))?"
)


def cli_advice(text: str, url: str | None = None) -> str:
    """A library error's text with its advice as the command line to run on ``url`` (None: as run_advice's):
    chat, sessions import, serve and gateway refused an empty PostgreSQL database with "run `transcript-store
    init --db URL`", and a Python call to make."""
    return _LIBRARY_ADVICE.sub(lambda m: run_advice(m.group(1), url), text)


def _refuse_non_sqlite_file(url: str) -> None:
    """SchemaNotCurrent for a SQLite URL naming a file that is not a SQLite database: a command that would
    create a store there got sqlite3's "file is not a database" at its first statement, an outage (5)."""
    path = sqlite_file(url)
    if path is not None and _not_sqlite(path):
        raise SchemaNotCurrent(f"no store at {mask_url(url)} ({_NOT_SQLITE}): {_NOT_SQLITE_ADVICE}")


def _not_sqlite(path: Path) -> bool:
    """Whether ``path`` is a non-empty file that does not start as a SQLite database does."""
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return False
        with path.open("rb") as f:
            return not f.read(len(_SQLITE_MAGIC)).startswith(_SQLITE_MAGIC)
    except OSError:
        return False  # the store's own open reports it


def _not_a_store_database(path: Path) -> str | None:
    """Why a non-empty file holds no store, judged without changing it (None: it may hold one).

    Opening it as the store does would switch another program's database to WAL mode (a store's
    connections set it) before the schema check refused it. A store's file is in WAL mode, where that
    setting changes nothing, so only a file in rollback-journal mode is looked into, read-only.
    """
    try:
        with path.open("rb") as f:
            header = f.read(100)
    except OSError:
        return None  # the store's own open reports it
    if len(header) < 100 or not header.startswith(_SQLITE_MAGIC):
        return _NOT_SQLITE
    if header[18] == 2 or header[19] == 2:  # WAL mode: may be a store
        return None
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            found = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version'"
            ).fetchone()
    except sqlite3.Error:
        return None  # locked, a hot journal to roll back...: the store's own open decides
    return None if found is not None else "the database holds no transcript-store schema"


def open_store(*, create: bool = False, check_schema: bool = True) -> TranscriptStore:
    """The store named by --db; ``create`` allows a new SQLite store, ``check_schema`` refuses old ones.

    Without ``create`` a SQLite file that holds no store (missing, empty, or a database without the
    store's schema: another program's, given by mistake) is refused as no store yet, untouched: a SQLite
    store migrates itself on open, which would create one in it. So is a PostgreSQL database without the
    schema: with TRANSCRIPT_STORE_AUTO_UPGRADE=1 its migration on open would create one too.
    """
    config = state().store_config()
    make_url_or_usage(config.url)  # a bad URL is a usage error before its file is looked at
    url = mask_url(config.url)
    path = sqlite_file(config.url)
    # TRANSCRIPT_STORE_AUTO_UPGRADE=0 turns migrating on open off: a creating command that relies on it
    # then refuses a file without a store as the others do, before connecting (which switched another
    # program's database to WAL, or left a new, empty file behind its refusal). init and upgrade
    # (``check_schema=False``) migrate themselves: the setting is not theirs.
    create = create and (config.auto_upgrade is not False or not check_schema)
    why = _no_store_file(path) if path is not None and not create else None
    if why is not None:
        # (a file that is no SQLite database at all is not for init either: it refuses it, exit 4 again)
        raise SchemaNotCurrent(f"no store at {url} ({why}): {_no_store_advice(why)}")
    if create:
        _refuse_non_sqlite_file(config.url)
    try:
        store = TranscriptStore(config=config, create=False)
    except InvalidInput as e:  # only the URL is validated before the first connection
        raise CommandError(f"{url_source()}: {e}", EXIT_USAGE) from e
    if not check_schema:
        return store
    try:
        if not create and store.current_revision() is None:
            raise SchemaNotCurrent(
                f"no store at {url} (the database holds no transcript-store schema): {run_advice('init')}"
            )
        store.ensure_current()
    except BaseException:
        store.close()
        raise
    return store


@contextmanager
def store_session(*, create: bool = False, check_schema: bool = True) -> Iterator[TranscriptStore]:
    """An open store, closed afterwards."""
    store = open_store(create=create, check_schema=check_schema)
    try:
        yield store
    finally:
        store.close()


def find_session(store: TranscriptStore, scope: str, ref: str) -> SessionInfo:
    """A session by id, else by its session key; UnknownSession when neither names one."""
    try:
        return store.get_session(scope, ref)
    except UnknownSession:
        by_key = store.find_session(scope, ref)
        if by_key is not None:
            return by_key
        ended = store.ended_sessions(scope, ref, limit=ENDED_NAMED)
        if not ended:
            raise
        raise UnknownSession(scope, ref, [s.session_id for s in ended]) from None


def schema_state(revision: str | None, head: str) -> str:
    """``current``, ``none`` (no schema), ``behind`` or ``ahead`` (newer than this library)."""
    if revision == head:
        return "current"
    if revision is None:
        return "none"
    return "behind" if revision in migrate.known_revisions() else "ahead"


def schema_advice(state_now: str) -> str:
    """What to do about a schema in ``state_now`` (``none``, ``behind`` or ``ahead``)."""
    if state_now == "ahead":
        return "upgrade the library"
    return run_advice("init" if state_now == "none" else "upgrade")


def make_url_or_usage(url: str) -> URL:
    """The parsed --db value; a URL no store accepts is a usage error, named by where it came from."""
    try:
        parsed = parse_url(url)
    except InvalidInput as e:
        raise CommandError(f"{url_source()}: {e}", EXIT_USAGE) from None
    path = sqlite_file(url)
    if path is not None and path.is_dir():
        # sqlite3 answers "unable to open database file", which read as a database down (exit 5).
        raise CommandError(f"{url_source()}: {mask_url(url)} names a directory: give the path of a store's "
                           "file (or of one to create)", EXIT_USAGE)
    if path is not None and path.exists() and not path.is_file():
        # A device or a FIFO (/dev/null): sqlite3's "disk I/O error" read as a database down (exit 5), and
        # a read command advised `init` on it, which then failed so.
        raise CommandError(f"{url_source()}: {mask_url(url)} names no regular file (a device, a FIFO or a "
                           "socket): give the path of a store's file (or of one to create)", EXIT_USAGE)
    above = next((p for p in path.parents if p.exists()), None) if path is not None else None
    if above is not None and not above.is_dir():
        # A path under a file: "cannot create the directory" read as a database down (exit 5).
        raise CommandError(f"{url_source()}: {mask_url(url)}: {above} is not a directory: give the path of a "
                           "store's file (or of one to create)", EXIT_USAGE)
    return parsed


def url_source() -> str:
    """Where the store's URL came from, as an error names it: --db, else TRANSCRIPT_STORE_URL."""
    ctx = click.get_current_context(silent=True)
    st = ctx.find_object(State) if ctx is not None else None
    # "is None", not "not st.db": an empty --db is the URL used (and refused), not the variable's
    if (st is None or st.db is None) and os.environ.get(URL_ENV):
        return URL_ENV
    return "--db"
