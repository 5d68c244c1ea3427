"""Review of revision 0017 (receipts name their anchors by raw seq), as a user with a large ledger meets it:
what the upgrade and the downgrade cost the stored receipts, on both backends."""

from __future__ import annotations

from typing import Any

from alembic import command
from sqlalchemy import event, text

from transcript_store import StoreConfig, TranscriptStore, migrate
from transcript_store.db import Database

A = "scope-a"
#: receipts of the ledger under test, each a turn of four messages
TURNS = 600


def _downgrade(db: Database, revision: str) -> None:
    cfg = migrate.alembic_config()
    with db.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def _a_ledger_at_0016(store_url: str) -> Database:
    """A session of ``TURNS`` turns of four messages at revision 0016, each with its receipt as 0016 wrote
    it (both entry ids, the seq list), written in bulk (the migration reads nothing else)."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        sid = store.create_session(A, session_id="s1").session_id
    db = Database(StoreConfig(url=store_url))
    _downgrade(db, "0016")
    entries = [
        {"s": sid, "q": q, "e": f"entry-{q:018d}", "k": "message", "r": "user" if q % 4 == 0 else "assistant"}
        for q in range(TURNS * 4)
    ]
    receipts = [
        {"s": sid, "key": f"turn-{t:06d}", "h": bytes(32), "a": f"entry-{4 * t:018d}",
         "t": f"entry-{4 * t + 3:018d}", "l": ",".join(str(4 * t + i) for i in range(4))}
        for t in range(TURNS)
    ]
    with db.engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO ts_entries (scope, session_id, seq, entry_id, parent_id, depth, position, generation,"
            " kind, role, payload, size_bytes, created_us)"
            " VALUES ('scope-a', :s, :q, :e, NULL, :q, :q, 0, :k, :r, '{}', 2, 0)"
        ), entries)
        conn.execute(text(
            "INSERT INTO ts_receipts (scope, session_id, advancement_key, engine_id, committed_us, message_count,"
            " is_heartbeat, payload_hash, admission_entry_id, terminal_entry_id, message_seqs)"
            " VALUES ('scope-a', :s, :key, 'e', 0, 4, false, :h, :a, :t, :l)"
        ), receipts)
    return db


def _receipt_writes(db: Database) -> tuple[list[int], Any]:
    """The rows each UPDATE of ``ts_receipts`` writes, as they run; and the listener to remove."""
    written: list[int] = []

    def after(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE TS_RECEIPTS"):
            written.append(cursor.rowcount)

    event.listen(db.engine, "after_cursor_execute", after)
    return written, after


def _heap_pages(db: Database) -> int | None:
    """PostgreSQL: the pages of ts_receipts' heap (old row versions included); None on SQLite."""
    if db.engine.dialect.name != "postgresql":
        return None
    with db.engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_relation_size('ts_receipts') / 8192")).scalar_one())


def test_0017_rewrites_each_stored_receipt_once_each_way(store_url: str) -> None:
    """The upgrade converts every stored receipt in ONE rewrite of it, and so does the downgrade. It took
    four (the seqs, each id, the list, one UPDATE each): on PostgreSQL every UPDATE leaves the old row
    version behind, and in one transaction none of them can be pruned, so ts_receipts of 100,000 receipts
    went from 15.7 MB to 71.5 MB of heap (4.5x) in 10 s, for a revision whose point is a receipt's bytes,
    and the space returns to the file system only with VACUUM FULL. One rewrite: at most twice the heap."""
    db = _a_ledger_at_0016(store_url)
    try:
        before = _heap_pages(db)
        written, listener = _receipt_writes(db)
        try:
            migrate.upgrade(db)
            up = list(written)
            written.clear()
            after = _heap_pages(db)
            _downgrade(db, "0016")
            down = list(written)
        finally:
            event.remove(db.engine, "after_cursor_execute", listener)
        assert sum(up) == TURNS, up  # each receipt written once by the upgrade
        assert sum(down) == TURNS, down  # and once by the downgrade
        if before is not None:
            assert after is not None and after <= 2 * before, (before, after)
        with db.engine.connect() as conn:  # the downgrade gave back the rows 0016 wrote
            rows = conn.execute(text(
                "SELECT admission_entry_id, terminal_entry_id, message_seqs FROM ts_receipts"
                " WHERE advancement_key = 'turn-000007'"
            )).one()
        assert tuple(rows) == ("entry-000000000000000028", "entry-000000000000000031", "28,29,30,31")
        migrate.upgrade(db)
        with db.engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT admission_seq, terminal_seq, admission_entry_id, terminal_entry_id, message_seqs"
                " FROM ts_receipts WHERE advancement_key = 'turn-000007'"
            )).one()
        assert tuple(rows) == (28, 31, None, None, None)
    finally:
        db.dispose()
