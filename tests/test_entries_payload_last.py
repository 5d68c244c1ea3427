"""Revision 0018: on SQLite the entries' payload is their last column, so a statement reading sizes, keys
or times never walks a large payload's overflow pages to reach them. Across 0018 both ways every row,
rowid and index stays; on PostgreSQL it changes nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sqlalchemy import text
from test_migrations import _content, _differences, _downgrade

from transcript_store import DeltaPage, StoreConfig, TranscriptStore, migrate
from transcript_store.db import Database, sqlite_file

A = "scope-a"
BIG = "x" * 300_000  # far past a 4 KiB page: most of it in overflow pages


def _columns(db: Database) -> list[str]:
    with db.engine.connect() as conn:
        if db.dialect.is_sqlite:
            return [str(r[1]) for r in conn.execute(text("PRAGMA table_info(ts_entries)"))]
        return [str(r[0]) for r in conn.execute(text(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'ts_entries'::regclass AND attnum > 0"
            " AND NOT attisdropped ORDER BY attnum"
        ))]


def _indexes(db: Database) -> list[tuple[str, str]]:
    with db.engine.connect() as conn:
        if db.dialect.is_sqlite:
            rows = conn.execute(text(
                "SELECT name, coalesce(sql, '') FROM sqlite_master WHERE type = 'index' AND tbl_name = 'ts_entries'"
            ))
        else:
            rows = conn.execute(text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'ts_entries'"))
        return sorted((str(a), str(b)) for a, b in rows)


def _rowids(db: Database) -> list[tuple[object, str, int]]:
    """SQLite's rowids of the entries (PostgreSQL's physical row ids are no part of the contract)."""
    rowid = "rowid" if db.dialect.is_sqlite else "NULL"
    with db.engine.connect() as conn:
        return [(r[0], str(r[1]), int(r[2])) for r in conn.execute(
            text(f"SELECT {rowid}, session_id, seq FROM ts_entries ORDER BY session_id, seq")
        )]


def test_a_new_sqlite_store_keeps_every_column_ahead_of_the_payload(store_url: str, backend: str) -> None:
    """What a column added later by ALTER TABLE would break: on SQLite it lands after the payload."""
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        columns = _columns(store.db)
    if backend == "sqlite":
        assert columns[-1] == "payload", columns
    else:  # PostgreSQL keeps 0001's order: a large payload is stored out of line there
        assert columns.index("payload") == 10, columns
    assert sorted(columns) == sorted([
        "scope", "session_id", "seq", "entry_id", "parent_id", "depth", "position", "generation", "kind", "role",
        "payload", "size_bytes", "idempotency_key", "turn_id", "created_us",
    ])


def test_0018_both_ways_keeps_every_row_rowid_and_index(store_url: str, backend: str) -> None:
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        store.create_session(A, session_id="s1")
        made = store.append_many(A, "s1", [
            {"message": {"role": "user", "content": "q"}, "idempotency_key": "k1"},
            {"message": {"role": "assistant", "content": BIG}},
            {"message": {"role": "user", "content": "again"}},
        ])
        store.admit(A, "s1", {"role": "user", "content": "turn"}, turn_id="t1")
        store.branch(A, "s1", made[1].entry_id)  # an entry off the active branch too
        store.append(A, "s1", {"role": "user", "content": "other branch"})
        first = store.read_visible_delta(A, "s1", None, max_messages=2)
        assert isinstance(first, DeltaPage)
    db = Database(StoreConfig(url=store_url))
    try:
        at_head, indexes, rowids = _content(db), _indexes(db), _rowids(db)
        _downgrade(db, "0017")
        assert migrate.current_revision(db) == "0017"
        if backend == "sqlite":
            assert _columns(db)[10] == "payload" and _columns(db)[-1] == "created_us"
        assert _content(db) | {"alembic_version": at_head["alembic_version"]} == at_head
        assert _indexes(db) == indexes and _rowids(db) == rowids
        migrate.upgrade(db)
        assert _columns(db)[-1 if backend == "sqlite" else 10] == "payload"
        assert _content(db) == at_head and _indexes(db) == indexes and _rowids(db) == rowids
        assert _differences(db) == []
    finally:
        db.dispose()
    if backend == "sqlite":
        path = sqlite_file(store_url)
        assert path is not None
        with sqlite3.connect(Path(path)) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        # The cursor issued before reads on; idempotency keys and turn ids still find their entries.
        nxt = store.read_visible_delta(A, "s1", first.cursor)
        assert isinstance(nxt, DeltaPage) and [e.message["content"] for e in nxt.entries] == ["other branch"]
        again = store.append(A, "s1", {"role": "user", "content": "q"}, idempotency_key="k1")
        assert again.entry_id == made[0].entry_id
        assert [e.message["content"] for e in store.read_visible(A, "s1")][-1] == "other branch"
