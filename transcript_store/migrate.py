"""Alembic underneath: the only way the schema changes, on both backends.

Alembic is imported by the functions that use it, not by this module: importing it (and reading the
migration scripts) is ~0.13 s, a fifth of a CLI command's or gateway worker's start, and opening a store
that is already at ``HEAD``, the common case, needs neither (``ensure_current``, ``current_revision``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, inspect
from sqlalchemy.exc import DBAPIError

from .db import Database
from .errors import SchemaNotCurrent

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
#: the newest revision in ``migrations/versions``; a test holds it to Alembic's own answer (``head_revision``)
HEAD = "0018"


def alembic_config() -> Config:
    """An Alembic config pointing at the packaged migrations."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def head_revision() -> str:
    """The newest revision this library knows."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(db: Database) -> str | None:
    """The revision the database is at (None: no schema yet)."""
    recorded = _recorded(db)
    if recorded is not None and len(recorded) == 1:
        # the common case, read without importing Alembic (~60 ms of each CLI command's start); anything else
        # (no version table, none or several rows) is Alembic's path below, which says what is wrong
        return recorded[0]
    # One read transaction, retried on transient errors as every read: every store's open reads the
    # revision, and a service or worker started while its database restarted (or another process held a
    # SQLite store's lock past the busy timeout) failed at once, its retries unused.
    return db.read(_revision_in)


def _revision_in(conn: Connection) -> str | None:
    """The revision ``conn``'s database records: SchemaNotCurrent when it records several (``_at_head`` leaves
    them to this path; Alembic's own answer is a CommandError, untyped)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.util import CommandError

    try:
        current = MigrationContext.configure(conn).get_current_revision()
    except CommandError as e:
        raise SchemaNotCurrent(
            "the database's alembic_version table holds several revisions, where a store's holds one: repair it"
        ) from e
    if current is None and inspect(conn).has_table("ts_sessions"):
        # A store's tables with no revision recorded (the version table emptied by hand, a restore that left
        # its row out) are not an empty database: migrating from the first revision fails on tables that
        # exist, and which revision they are at is a guess.
        raise SchemaNotCurrent(
            "the database holds transcript-store's tables but its alembic_version table records no revision: "
            "repair it (record the revision the tables are at), or use another database"
        )
    return current


#: PostgreSQL: upgrades of one database queue on this transaction-scoped advisory lock
_MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(hashtext('transcript-store schema migration'))"


def known_revisions() -> set[str]:
    """Every revision this library's migrations know."""
    from alembic.script import ScriptDirectory

    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def _newer(current: str | None) -> SchemaNotCurrent | None:
    """The error for a database at a revision this library does not know (a newer library's), or None."""
    if current is None or current in known_revisions():
        return None
    return SchemaNotCurrent(
        f"database schema is at revision {current}, newer than this library ({head_revision()}); "
        "upgrade the library"
    )


def upgrade(db: Database, revision: str = "head") -> str:
    """Migrate the database to ``revision`` (see ``upgrade_from``); returns the revision it is at."""
    return upgrade_from(db, revision)[1]


def upgrade_from(db: Database, revision: str = "head") -> tuple[str | None, str]:
    """Migrate the database to ``revision``; returns (the revision it was at, the one it is at).

    A failed migration leaves no half-applied step.

    One write transaction (SQLite: ``BEGIN IMMEDIATE``, so that processes opening a store at once wait
    for each other instead of failing on the lock), retried whole on transient errors; on PostgreSQL
    concurrent upgrades queue on an advisory lock, and each reads the revision only once it holds it,
    so the second finds the work done. A database newer than this library is ``SchemaNotCurrent``.
    """
    from alembic import command

    cfg = alembic_config()

    def run(conn: Connection) -> str | None:
        if not db.dialect.is_sqlite:
            conn.exec_driver_sql(_MIGRATION_LOCK)
        before = _revision_in(conn)
        newer = _newer(before)
        if newer is not None:
            raise newer
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
        return before

    before = db.write(run)  # driver errors leave it translated, as from every transaction
    return before, current_revision(db) or ""


def _at_head(db: Database) -> bool:
    """Whether the database's one recorded revision is ``HEAD``, read without Alembic. Anything else (no
    version table, a failure to read, several rows) is False, for ``ensure_current``'s Alembic path to say."""
    return _recorded(db) == [HEAD]


def _recorded(db: Database) -> list[str] | None:
    """The revisions the database's version table holds, read without Alembic; None when it cannot be read
    (no such table, or any other failure: the callers' Alembic path then reads and reports it)."""
    try:
        with db.engine.connect() as conn:
            return [str(row[0]) for row in conn.exec_driver_sql("SELECT version_num FROM alembic_version")]
    except DBAPIError:
        return None


def ensure_current(db: Database, auto_upgrade: bool) -> None:
    """Refuse a schema that is not at head, or migrate it when allowed."""
    if _at_head(db):
        return
    current = current_revision(db)
    head = head_revision()
    if current == head:
        return
    newer = _newer(current)
    if newer is not None:
        raise newer
    if auto_upgrade:
        upgrade(db)
        return
    # An empty database (PostgreSQL: a store is never created on open there) is made a store by init;
    # upgrade migrates an existing store only, and would refuse it.
    command_line = "upgrade" if current else "init"
    raise SchemaNotCurrent(
        f"database schema is at revision {current or 'none'}, this library needs {head}: "
        f"run `transcript-store {command_line} --db URL` (or, in Python, TranscriptStore.upgrade_url(url))"
    )
