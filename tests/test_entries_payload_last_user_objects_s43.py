"""Revision 0018 both ways keeps an operator's own view of the entries and trigger on them working.

SQLite's table rename (3.26 and later) rewrites every view naming the renamed table: 0018 renamed ``ts_entries``
to the old copy it then dropped, so such a view named a table that no longer existed, and every later
``ALTER TABLE`` of the file (0018's own downgrade among them) failed on it; a trigger on the table went with
the old copy. PostgreSQL's table is not rebuilt: there both survive as they are."""

from __future__ import annotations

from sqlalchemy import text
from test_migrations import _downgrade

from transcript_store import StoreConfig, TranscriptStore, migrate
from transcript_store.db import Database

A = "scope-a"

SQLITE_TRIGGER = (
    "CREATE TRIGGER my_audit AFTER INSERT ON ts_entries BEGIN INSERT INTO my_audit VALUES (new.entry_id); END",
)
PG_TRIGGER = (
    "CREATE FUNCTION my_audit_fn() RETURNS trigger LANGUAGE plpgsql AS"
    " $$BEGIN INSERT INTO my_audit VALUES (NEW.entry_id); RETURN NEW; END$$",
    "CREATE TRIGGER my_audit AFTER INSERT ON ts_entries FOR EACH ROW EXECUTE FUNCTION my_audit_fn()",
)


def _sizes(db: Database) -> list[tuple[str, int]]:
    with db.engine.connect() as conn:
        return [(str(a), int(b)) for a, b in conn.execute(text("SELECT session_id, n FROM my_sizes ORDER BY 1"))]


def _audited(db: Database) -> list[str]:
    with db.engine.connect() as conn:
        return sorted(str(r[0]) for r in conn.execute(text("SELECT entry_id FROM my_audit")))


def test_0018_keeps_an_operators_view_and_trigger_on_the_entries(store_url: str, backend: str) -> None:
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        store.create_session(A, session_id="s1")
        store.append(A, "s1", {"role": "user", "content": "q" * 5000}, entry_id="e1")
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, "0017")
        with db.engine.begin() as conn:
            conn.execute(text(
                "CREATE VIEW my_sizes AS SELECT session_id, sum(size_bytes) AS n FROM ts_entries GROUP BY session_id"
            ))
            conn.execute(text("CREATE TABLE my_audit (entry_id VARCHAR(255))"))
            for sql in SQLITE_TRIGGER if backend == "sqlite" else PG_TRIGGER:
                conn.execute(text(sql))
        sizes = _sizes(db)
        assert sizes and sizes[0][0] == "s1"
        for _ in range(2):
            migrate.upgrade(db)
            assert migrate.current_revision(db) == "0018"
            assert _sizes(db) == sizes
            assert _audited(db) == []  # the copy fired no trigger
            _downgrade(db, "0017")  # an ALTER TABLE of the file again: the view must still parse
            assert _sizes(db) == sizes and _audited(db) == []
        migrate.upgrade(db)
    finally:
        db.dispose()
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        store.append(A, "s1", {"role": "user", "content": "again"}, entry_id="e2")
    db = Database(StoreConfig(url=store_url))
    try:
        assert _audited(db) == ["e2"]  # the trigger is on the table again, once
        assert _sizes(db)[0][1] > sizes[0][1]
    finally:
        db.dispose()
