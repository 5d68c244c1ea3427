"""Benchmark 5: bytes on disk per message after 10,000 messages, ours vs the raw table.

Two shapes of ours, both of the same 10,000 messages: the transcript alone (appended with
``append_many``) and full turns (admission + completion with the legacy engine's commit: transcript,
outbox and ledger; a quarter of the messages until round 2, which left each table's partly filled last
pages weighing four times as much per message). SQLite is measured after VACUUM (file size; dbstat
gives the split per table); PostgreSQL after VACUUM FULL as pg_total_relation_size (heap + TOAST +
indexes) summed over the store's tables. Both sides are measured net of their empty schema (ours: every
table and index of a freshly migrated database; raw: the empty table): what the messages cost.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from typing import Any

import psycopg

from transcript_store import AppendItem
from transcript_store.turns import Turns

from .context import Context, log
from .drivers import SCOPE, HostDriver, Plan, bulk_append, create_sessions, plan_turns
from .raw import TABLE as RAW_TABLE
from .report import Figure
from .targets import Database, Target


def bench_disk(ctx: Context, target: Target) -> list[Figure]:
    """(5) Bytes per message, transcript only and full turns, vs the raw table holding the same rows.

    On PostgreSQL twice: with the payload columns of both sides stored PLAIN (no compression: the
    target's figures) and with PostgreSQL's default storage (reported, no target). By default a row
    is compressed once it passes ~2 KB, and ours, carrying ~150 bytes more per row than raw's, passes
    it first: with this workload's very compressible text 1,077 of our 10,000 payloads were compressed
    against raw's 497, which took ~50 bytes a message off ours and none off raw's. PLAIN on both sides
    compares what the schemas store, not where a threshold falls.
    """
    figures = []
    for plain in (True, False) if target.backend == "postgresql" else (None,):
        figures.extend(_disk(ctx, target, plain))
    return figures


def _disk(ctx: Context, target: Target, plain: bool | None) -> list[Figure]:
    """Both shapes at one PostgreSQL storage setting (``plain``; None on SQLite, which never compresses)."""
    n = ctx.counts.disk_messages
    plans = plan_turns(ctx.workload(5), n // 4, "d")
    empty = ctx.lab.database(target, "diskempty")
    if plain:
        # The empty schema at the storage the loaded one has: a table whose text columns are all PLAIN
        # loses its TOAST table (and that table's index) when VACUUM FULL rewrites it, so an empty schema
        # measured at the default storage was 8 KiB a table larger than the PLAIN one it is taken from,
        # and each side's figure came out that much too small (ours, with more tables, by more).
        _store_plain(empty)
    raw = empty.raw()
    raw_empty = raw.table_bytes()
    raw.close()
    ours_empty, _ = _our_bytes(empty)
    base: dict[str, Any] = {"ours_empty_schema_bytes": ours_empty, "raw_empty_table_bytes": raw_empty}
    suffix, goal = "", 1.3
    if plain is not None:
        base["payload_storage"] = "plain" if plain else "default"
        if not plain:
            suffix, goal = ", PostgreSQL's default storage (compressed above ~2 KB a row; no target)", 0.0

    db = ctx.lab.database(target, "disk")
    if plain:
        _store_plain(db)
    store = db.store()
    try:
        create_sessions(store, plans)
        for sid, messages in _by_session(plans).items():
            bulk_append(store, sid, messages)
    finally:
        store.close()
    label = f"transcript only ({n:,} messages){suffix}"
    figures = [_figure(db, target, label, plans, ours_empty, raw_empty, base, goal)]

    full = plans
    db = ctx.lab.database(target, "diskturns")
    if plain:
        _store_plain(db)
    store = db.store()
    try:
        create_sessions(store, full)
        commit_in = HostDriver(store).host.commit_in("legacy")
        turns = Turns(store)
        for p in full:
            turns.admit(SCOPE, p.session_id, p.turn.user, turn_id=p.turn_id, engine_id="legacy")
            replies = [AppendItem(message=m) for m in p.turn.replies]
            if turns.complete(SCOPE, p.session_id, p.turn_id, replies, commit_in).commit is None:
                raise RuntimeError(f"turn {p.turn_id} was not committed on the fast path")
    finally:
        store.close()
    label = f"full turns incl. outbox + ledger ({len(full) * 4:,} messages){suffix}"
    figures.append(_figure(db, target, label, full, ours_empty, raw_empty, base, goal))
    return figures


def _store_plain(db: Database) -> None:
    """PostgreSQL: store every text column of ours and raw's payload uncompressed and inline (PLAIN),
    before any row is written (a column's storage applies to the rows written after it is set)."""
    db.raw().close()  # creates raw's table
    with psycopg.connect(db.raw_dsn, autocommit=True) as conn:
        columns = conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public' "
            "AND data_type IN ('text', 'character varying', 'bytea') "
            "AND (table_name LIKE %s OR table_name = %s)",
            ("ts\\_%", RAW_TABLE),
        ).fetchall()
        for table_name, column in columns:
            conn.execute(f'ALTER TABLE "{table_name}" ALTER COLUMN "{column}" SET STORAGE PLAIN')


def _by_session(plans: list[Plan]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for p in plans:
        out.setdefault(p.session_id, []).extend(p.turn.messages)
    return out


def _figure(
    db: Database,
    target: Target,
    label: str,
    plans: list[Plan],
    ours_empty: int,
    raw_empty: int,
    base: dict[str, Any],
    goal: float,
) -> Figure:
    """Load the same messages into the raw table of ``db``, measure both, net of the empty schema."""
    raw = db.raw()
    for sid, messages in _by_session(plans).items():
        raw.bulk_load(sid, messages)
    raw_bytes = raw.table_bytes() - raw_empty
    raw.close()
    total, split = _our_bytes(db)
    ours = total - ours_empty
    n = len(plans) * 4
    log(f"  disk [{target.name}] {label}: ours {ours / n:,.0f} B/msg, raw {raw_bytes / n:,.0f} B/msg")
    extra = {**base, "ours_bytes": ours, "ours_total_bytes": total, "raw_bytes": raw_bytes, "split": split}
    op = "<=" if goal else None
    return Figure("disk", target.name, f"bytes/message, {label}", "B", ours / n, raw_bytes / n, op, goal or None, extra)


def _our_bytes(db: Database) -> tuple[int, dict[str, int]]:
    """Total bytes of the store's tables and the split per table (indexes and TOAST included)."""
    if db.target.backend == "sqlite":
        path = db.sqlite_path
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            rows = conn.execute(
                "SELECT coalesce(m.tbl_name, d.name), sum(d.pgsize) FROM dbstat d "
                "LEFT JOIN sqlite_schema m ON m.name = d.name GROUP BY 1"
            ).fetchall()
        split = {str(name): int(size) for name, size in rows if str(name) != "bench_raw_messages"}
        raw_pages = sum(int(size) for name, size in rows if str(name) == "bench_raw_messages")
        return os.path.getsize(path) - raw_pages, split
    with psycopg.connect(db.raw_dsn, autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE 'ts\\_%'"
            ).fetchall()
        ]
        out: dict[str, int] = {}
        for name in tables:
            conn.execute(f'VACUUM FULL "{name}"')
            row = conn.execute("SELECT pg_total_relation_size(%s)", (name,)).fetchone()
            assert row is not None
            out[name] = int(row[0])
    return sum(out.values()), out
