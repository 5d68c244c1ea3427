"""The raw-driver baselines: Python's sqlite3 and psycopg 3 writing the same rows, no ORM, no checks.

One table, keyed like the store's entries table by (session, seq), holding the same JSON text per
message. A turn is one transaction with one ``executemany``. The tail read is the indexed
``SELECT ... WHERE session_id = ? AND seq > ? ORDER BY seq LIMIT 20``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Sequence
from typing import Any, Protocol

import psycopg

from .workload import serialize

TABLE = "bench_raw_messages"
DDL = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (session_id TEXT NOT NULL, seq INTEGER NOT NULL, role TEXT NOT NULL, "
    "payload TEXT NOT NULL, PRIMARY KEY (session_id, seq))"
)
INSERT_SQLITE = f"INSERT INTO {TABLE} (session_id, seq, role, payload) VALUES (?, ?, ?, ?)"
INSERT_PG = f"INSERT INTO {TABLE} (session_id, seq, role, payload) VALUES (%s, %s, %s, %s)"
TAIL_SQLITE = f"SELECT seq, role, payload FROM {TABLE} WHERE session_id = ? AND seq > ? ORDER BY seq LIMIT ?"
TAIL_PG = f"SELECT seq, role, payload FROM {TABLE} WHERE session_id = %s AND seq > %s ORDER BY seq LIMIT %s"


def rows_of(session_id: str, first_seq: int, messages: Sequence[dict[str, Any]]) -> list[tuple[str, int, str, str]]:
    """The raw rows of some messages (the JSON text is what the store keeps too)."""
    return [(session_id, first_seq + i, m["role"], serialize(m)) for i, m in enumerate(messages)]


class RawStore(Protocol):
    """What every baseline offers."""

    def insert_turn(self, session_id: str, first_seq: int, messages: Sequence[dict[str, Any]]) -> None:
        """The messages in one transaction (serialization included, as a user would have to)."""

    def bulk_load(self, session_id: str, messages: Sequence[dict[str, Any]]) -> None:
        """Many messages quickly (untimed setup)."""

    def tail_read(self, session_id: str, after_seq: int, limit: int) -> list[Any]:
        """The indexed page read."""

    def table_bytes(self) -> int:
        """Bytes on disk of the raw table with its index (SQLite: whole file after VACUUM)."""

    def close(self) -> None:
        """Close the connection."""


class RawSqlite:
    """sqlite3, WAL, the given synchronous setting; ``with conn:`` is the transaction."""

    def __init__(self, path: str, synchronous: str) -> None:
        self.path = path
        self.conn = sqlite3.connect(path, timeout=30)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute(f"PRAGMA synchronous = {synchronous}")
        self.conn.execute(DDL)

    def insert_turn(self, session_id: str, first_seq: int, messages: Sequence[dict[str, Any]]) -> None:
        with self.conn:
            self.conn.executemany(INSERT_SQLITE, rows_of(session_id, first_seq, messages))

    def bulk_load(self, session_id: str, messages: Sequence[dict[str, Any]]) -> None:
        with self.conn:
            self.conn.executemany(INSERT_SQLITE, rows_of(session_id, 0, messages))

    def tail_read(self, session_id: str, after_seq: int, limit: int) -> list[Any]:
        return self.conn.execute(TAIL_SQLITE, (session_id, after_seq, limit)).fetchall()

    def table_bytes(self) -> int:
        self.conn.execute("VACUUM")
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return os.path.getsize(self.path)

    def close(self) -> None:
        self.conn.close()


class RawPostgres:
    """psycopg 3, autocommit connection, ``conn.transaction()`` per turn (server durability defaults)."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute(DDL)

    def insert_turn(self, session_id: str, first_seq: int, messages: Sequence[dict[str, Any]]) -> None:
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.executemany(INSERT_PG, rows_of(session_id, first_seq, messages))

    def bulk_load(self, session_id: str, messages: Sequence[dict[str, Any]]) -> None:
        with self.conn.cursor() as cur, cur.copy(f"COPY {TABLE} (session_id, seq, role, payload) FROM STDIN") as cp:
            for row in rows_of(session_id, 0, messages):
                cp.write_row(row)

    def tail_read(self, session_id: str, after_seq: int, limit: int) -> list[Any]:
        return self.conn.execute(TAIL_PG, (session_id, after_seq, limit)).fetchall()

    def table_bytes(self) -> int:
        # VACUUM FULL on both sides: the steady-state size, no dead tuples or half-empty pages.
        self.conn.execute(f"VACUUM FULL {TABLE}")
        row = self.conn.execute(f"SELECT pg_total_relation_size('{TABLE}')").fetchone()
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        with contextlib.suppress(psycopg.Error):
            self.conn.close()
