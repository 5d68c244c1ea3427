"""The migrations are the schema: at head they produce schema.py's tables on both backends, and the
ledger's revision (0005, receipts reference the transcript) goes down and up again without losing a
committed turn's messages."""

from __future__ import annotations

from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from conftest import assistant, user

from transcript_store import StoreConfig, TranscriptStore, migrate
from transcript_store.core import Core
from transcript_store.db import Database
from transcript_store.ledger import committed_messages, count_turn_messages
from transcript_store.schema import metadata
from transcript_store.turns import Turns

A = "scope-a"


def _downgrade(db: Database, revision: str) -> None:
    cfg = migrate.alembic_config()
    with db.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def _differences(db: Database) -> list[Any]:
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    # The lossless engine's tables (revision 0004) are its own metadata's, not schema.py's.
    return [d for d in diff if "ts_lcm_" not in str(d)]


def test_the_migrated_schema_is_schema_py(store_url: str) -> None:
    db = Database(StoreConfig(url=store_url))
    try:
        assert migrate.current_revision(db) == migrate.head_revision()
        assert _differences(db) == []
    finally:
        db.dispose()


def test_the_ledger_revision_goes_down_and_up_with_every_committed_message(store_url: str) -> None:
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        sid = store.create_session(A, session_id="s1").session_id
        turns = Turns(store)
        admission, _ = turns.admit(A, sid, user("q"), turn_id="t1", engine_id="e")
        done = turns.complete(A, sid, "t1", [{"message": assistant("a")}], None)
        turns.commit_turn("e", "t1", admission, done.terminal, [user("q"), assistant("a")])
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, "0004")
        assert migrate.current_revision(db) == "0004"
        migrate.upgrade(db)
        assert _differences(db) == []
    finally:
        db.dispose()
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:

        def look(c: Core) -> tuple[Any, int]:
            return committed_messages(c, A, "s1", "e", "t1"), count_turn_messages(c, A, "s1", "e")

        # After the round trip the turn's messages are the copy the downgrade wrote back.
        assert store.read(look) == ([user("q"), assistant("a")], 2)
