"""Alembic underneath: the only way the schema changes, on both backends."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.exc import DBAPIError

from .db import Database
from .errors import SchemaNotCurrent

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config() -> Config:
    """An Alembic config pointing at the packaged migrations."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def head_revision() -> str:
    """The newest revision this library knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(db: Database) -> str | None:
    """The revision the database is at (None: no schema yet)."""
    try:
        with db.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except DBAPIError as e:
        raise db.translate(e) from e


def upgrade(db: Database, revision: str = "head") -> str:
    """Migrate the database to ``revision``; a failed migration leaves no half-applied step."""
    cfg = alembic_config()
    try:
        with db.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    except DBAPIError as e:
        raise db.translate(e) from e
    return current_revision(db) or ""


def ensure_current(db: Database, auto_upgrade: bool) -> None:
    """Refuse a schema that is not at head, or migrate it when allowed."""
    current = current_revision(db)
    head = head_revision()
    if current == head:
        return
    known = {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current is not None and current not in known:
        raise SchemaNotCurrent(
            f"database schema is at revision {current}, newer than this library ({head}); upgrade the library"
        )
    if auto_upgrade:
        upgrade(db)
        return
    raise SchemaNotCurrent(
        f"database schema is at revision {current or 'none'}, this library needs {head}: "
        "run `transcript-store upgrade --db URL` (or, in Python, TranscriptStore.upgrade_url(url))"
    )
