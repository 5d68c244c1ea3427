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
from .report import Figure
from .targets import Database, Target


def bench_disk(ctx: Context, target: Target) -> list[Figure]:
    """(5) Bytes per message, transcript only and full turns, vs the raw table holding the same rows."""
    n = ctx.counts.disk_messages
    plans = plan_turns(ctx.workload(5), n // 4, "d")
    empty = ctx.lab.database(target, "diskempty")
    raw = empty.raw()
    raw_empty = raw.table_bytes()
    raw.close()
    ours_empty, _ = _our_bytes(empty)
    base = {"ours_empty_schema_bytes": ours_empty, "raw_empty_table_bytes": raw_empty}

    db = ctx.lab.database(target, "disk")
    store = db.store()
    try:
        create_sessions(store, plans)
        for sid, messages in _by_session(plans).items():
            bulk_append(store, sid, messages)
    finally:
        store.close()
    figures = [_figure(db, target, f"transcript only ({n:,} messages)", plans, ours_empty, raw_empty, base)]

    full = plans
    db = ctx.lab.database(target, "diskturns")
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
    label = f"full turns incl. outbox + ledger ({len(full) * 4:,} messages)"
    figures.append(_figure(db, target, label, full, ours_empty, raw_empty, base))
    return figures


def _by_session(plans: list[Plan]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for p in plans:
        out.setdefault(p.session_id, []).extend(p.turn.messages)
    return out


def _figure(
    db: Database, target: Target, label: str, plans: list[Plan], ours_empty: int, raw_empty: int, base: dict[str, int]
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
    return Figure("disk", target.name, f"bytes/message, {label}", "B", ours / n, raw_bytes / n, "<=", 1.3, extra)


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
