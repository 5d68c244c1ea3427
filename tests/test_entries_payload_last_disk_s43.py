"""Revision 0018's disk need, as the README states it: on SQLite the copy of ``ts_entries`` goes through the WAL
and then into the file, so the upgrade needs about twice the table's size in free disk space (three times
where SQLite zeroes freed pages, ``secure_delete``, as Debian's build does), not the table's size once; on
PostgreSQL it rewrites nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sqlalchemy import text
from test_migrations import _downgrade

from transcript_store import StoreConfig, TranscriptStore, migrate
from transcript_store.db import Database, sqlite_file

A = "scope-a"
BIG = "x" * 200_000  # most of each payload in overflow pages, as the entries 0018 is for


def _size(path: Path) -> int:
    """The file and its WAL, in bytes."""
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def test_0018_needs_the_disk_the_readme_says(store_url: str, backend: str) -> None:
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        store.create_session(A, session_id="s1")
        for _ in range(5):
            store.append_many(A, "s1", [{"message": {"role": "user", "content": BIG}} for _ in range(8)])
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, "0017")
        if backend == "postgresql":
            def node() -> int:
                with db.engine.connect() as conn:
                    return int(conn.execute(text("SELECT pg_relation_filenode('ts_entries')")).scalar_one())

            before = node()
            migrate.upgrade(db)
            assert node() == before  # the table is not rewritten there
            return
        path = Path(str(sqlite_file(store_url)))
        db.dispose()
        with sqlite3.connect(path) as conn:  # the old table alone in a compact file, no WAL: the baseline
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            secure = bool(conn.execute("PRAGMA secure_delete").fetchone()[0])
        conn.close()
        table = _size(path)  # ~8 MB of payloads: nearly all of it ts_entries
        migrate.upgrade(db)
        with db.engine.connect() as conn:  # the commit's own checkpoint, made sure of
            conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
        # Still open: the WAL keeps its size until the next write resets it, and the file has taken the
        # checkpointed copy, so both together are what the upgrade held on disk at its peak.
        extra = _size(path) - table
        assert extra > 1.5 * table, (extra, table, secure)
        assert extra < 3.3 * table, (extra, table, secure)
    finally:
        db.dispose()
