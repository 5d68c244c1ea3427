"""Where a benchmark runs: a backend at one durability, with a fresh database for ours and for raw.

``Lab`` owns every resource of a run: a temporary folder of SQLite files and the throwaway PostgreSQL
databases ``bench_<random>_*``, dropped when the lab closes, whatever happened (``python -m bench``
turns SIGTERM into an exception so that ``finally`` runs).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from transcript_store import StoreConfig, TranscriptStore
from transcript_store.db import mask_url

from .raw import RawSqlite, RawStore

PG_ADMIN = os.environ.get(
    "BENCH_PG", os.environ.get("TRANSCRIPT_STORE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
)


@dataclass(frozen=True)
class Target:
    """One backend at one durability setting."""

    name: str  # sqlite-full | sqlite-normal | postgresql
    label: str
    backend: str  # sqlite | postgresql
    synchronous: str | None  # FULL | NORMAL on SQLite


TARGETS = (
    Target("sqlite-full", "SQLite WAL FULL", "sqlite", "FULL"),
    Target("sqlite-normal", "SQLite WAL NORMAL", "sqlite", "NORMAL"),
    Target("postgresql", "PostgreSQL", "postgresql", None),
)


@dataclass
class Database:
    """A fresh, migrated database for ours and a raw table beside it, same durability."""

    target: Target
    url: str
    raw_dsn: str  # SQLite file path, or a libpq DSN
    pg_name: str | None = None

    def config(self, **overrides: Any) -> StoreConfig:
        """The store config at the target's durability."""
        values: dict[str, Any] = {"url": self.url, "auto_upgrade": False}
        if self.target.synchronous is not None:
            values["sqlite_synchronous"] = self.target.synchronous
        values.update(overrides)
        return StoreConfig(**values)

    def store(self) -> TranscriptStore:
        """A store on this database."""
        return TranscriptStore(config=self.config())

    def raw(self) -> RawStore:
        """A raw-driver connection to the baseline's table, same durability."""
        if self.target.backend == "sqlite":
            return RawSqlite(self.raw_dsn, self.target.synchronous or "FULL")
        from .raw import RawPostgres

        return RawPostgres(self.raw_dsn)

    def analyze(self) -> None:
        """PostgreSQL: ANALYZE every table, as autovacuum would have by the time a session is that long.

        Before the first ANALYZE the planner believes the tables are empty and reads a long session
        through the (scope, session_id) prefix of the primary key with a filter: an entry-id lookup or
        a delta page then scans the whole session (bench/README.md, "Profiling"). SQLite needs nothing.
        """
        if self.target.backend == "postgresql":
            with psycopg.connect(self.raw_dsn, autocommit=True) as conn:
                conn.execute("ANALYZE")

    @property
    def sqlite_path(self) -> Path:
        """The SQLite file of ours."""
        return Path(self.url.removeprefix("sqlite:///"))


class Lab:
    """Creates databases and cleans every one of them up."""

    def __init__(self, tmpdir: str | None = None) -> None:
        self.run_id = uuid.uuid4().hex[:8]
        self.dir = Path(tempfile.mkdtemp(prefix=f"bench-{self.run_id}-", dir=tmpdir))
        self._pg_created: list[str] = []
        self._sqlite_template: Path | None = None
        self._pg_template: str | None = None
        self._count = 0

    # ------------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Drop every PostgreSQL database of this run and delete the SQLite folder."""
        errors = []
        for name in reversed(self._pg_created):
            try:
                _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            except psycopg.Error as e:  # keep dropping the others
                errors.append(f"{name}: {e}")
        self._pg_created.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise RuntimeError("could not drop " + "; ".join(errors))

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ databases

    def database(self, target: Target, tag: str) -> Database:
        """A fresh migrated database of ``target`` (ours) and an empty raw table (raw)."""
        self._count += 1
        if target.backend == "sqlite":
            path = self.dir / f"{self._count:02d}-{tag}-{target.name}.db"
            shutil.copyfile(self._sqlite_tmpl(), path)
            raw_path = self.dir / f"{self._count:02d}-{tag}-{target.name}-raw.db"
            return Database(target, f"sqlite:///{path}", str(raw_path))
        name = f"bench_{self.run_id}_{self._count:02d}_{tag}"[:63]
        self._pg_created.append(name)
        _admin(f'CREATE DATABASE "{name}" TEMPLATE "{self._pg_tmpl()}"')
        return Database(target, pg_url(name), pg_dsn(name), pg_name=name)

    def _sqlite_tmpl(self) -> Path:
        if self._sqlite_template is None:
            path = self.dir / "template.db"
            TranscriptStore(f"sqlite:///{path}").close()
            with contextlib.closing(sqlite3.connect(path)) as conn:  # fold the WAL in: copy one plain file
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._sqlite_template = path
        return self._sqlite_template

    def _pg_tmpl(self) -> str:
        if self._pg_template is None:
            name = f"bench_{self.run_id}_template"
            self._pg_created.insert(0, name)
            _admin(f'CREATE DATABASE "{name}"')
            TranscriptStore.upgrade_url(pg_url(name))
            self._pg_template = name
        return self._pg_template


def pg_admin_shown() -> str:
    """``PG_ADMIN`` as it may be printed: a password (URL userinfo, ``password=``) masked."""
    if "://" in PG_ADMIN:
        return mask_url(PG_ADMIN)
    try:
        params = psycopg.conninfo.conninfo_to_dict(PG_ADMIN)
    except psycopg.Error:
        return "<unparseable BENCH_PG>"
    return psycopg.conninfo.make_conninfo("", **{k: "***" if k == "password" else v for k, v in params.items()})


def pg_available() -> str | None:
    """None when the PostgreSQL server answers, else why not."""
    try:
        with psycopg.connect(PG_ADMIN, connect_timeout=5, autocommit=True) as conn:
            conn.execute("SELECT 1")
        return None
    except psycopg.Error as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def pg_dsn(dbname: str) -> str:
    """A libpq DSN for a database on the benchmark server."""
    return psycopg.conninfo.make_conninfo(PG_ADMIN, dbname=dbname)


def pg_url(dbname: str) -> str:
    """A SQLAlchemy URL for a database on the benchmark server."""
    info = psycopg.conninfo.conninfo_to_dict(PG_ADMIN)
    user, host, port = info.get("user", "postgres"), info.get("host", "127.0.0.1"), info.get("port", "5432")
    password = f":{info['password']}" if info.get("password") else ""
    return f"postgresql+psycopg://{user}{password}@{host}:{port}/{dbname}"


def _admin(sql: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql)
