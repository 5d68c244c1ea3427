"""The migrations are the schema: at head they produce schema.py's tables on both backends, and the
ledger's revisions (0005: receipts reference the transcript; 0006: the hash as 32 bytes) go down and up
again without losing a committed turn's messages or its hash, 0007 (the session's incarnation) keeps
every row of every table and every cursor issued before it, 0008 (the lossless engine's word index
over the start of a text, PostgreSQL) keeps every engine row searchable, 0011 forgets the engine
rows an earlier release's reset kept, and 0015 adds the deleted sessions' tombstones to a store that deleted
some, granted as the sessions are; an upgrade SIGKILLed midway leaves the store at its revision with
every row, and processes opening an old store at once all open it, one migrating."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from conftest import assistant, user
from sqlalchemy import Select, Table, select, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.exc import IntegrityError

from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from engines.lossless.tables import messages, summaries, summary_children, summary_sources
from transcript_store import (
    Admission,
    Anchor,
    ClosedRange,
    DeltaPage,
    SchemaNotCurrent,
    StoreConfig,
    TranscriptStore,
    TurnKeyConflict,
    migrate,
)
from transcript_store.core import Core
from transcript_store.cursors import CursorState
from transcript_store.db import Database
from transcript_store.engine import EngineContext
from transcript_store.ledger import CommitResult, committed_messages, count_turn_messages
from transcript_store.schema import metadata
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator
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


def test_head_is_the_newest_migration_script() -> None:
    """``migrate.HEAD``, what opening a store compares against without Alembic, is Alembic's head: a new
    revision that left it behind would let a store one revision old open as current."""
    assert migrate.head_revision() == migrate.HEAD


def test_opening_a_store_at_head_imports_no_alembic_and_one_behind_is_still_refused(store_url: str) -> None:
    code = (
        "import sys\n"
        "from transcript_store import StoreConfig, TranscriptStore\n"
        f"TranscriptStore(config=StoreConfig(url={store_url!r}, auto_upgrade=False)).close()\n"
        "print('alembic' in sys.modules)\n"
    )
    opened = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert opened.returncode == 0 and opened.stdout.strip() == "False", opened.stderr
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, "0014")
    finally:
        db.dispose()
    with pytest.raises(SchemaNotCurrent, match="at revision 0014"):
        TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False))


def _refuses_a_session_without_incarnation(db: Database) -> None:
    """A session written without an incarnation (as a process of a release before 0007 writes it) is
    refused on both backends (NOT NULL; on SQLite, whose added column needs a default, a trigger)."""
    with pytest.raises(IntegrityError), db.engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO ts_sessions (scope, session_id, active, generation, last_seq, path_length, "
            "visible_count, created_us, updated_us) VALUES ('scope-a', 'old', true, 0, -1, 0, 0, 1, 1)"
        ))


def _one_committed_turn(store_url: str) -> tuple[Admission, Anchor, list[dict[str, Any]], CommitResult]:
    """Session s1 with turn t1 (a question and an answer) committed by engine "e"."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        sid = store.create_session(A, session_id="s1").session_id
        turns = Turns(store)
        admission, _ = turns.admit(A, sid, user("q"), turn_id="t1", engine_id="e")
        done = turns.complete(A, sid, "t1", [{"message": assistant("a")}], None)
        messages = [user("q"), assistant("a")]
        return admission, done.terminal, messages, turns.commit_turn("e", "t1", admission, done.terminal, messages)


def test_the_ledger_revision_goes_down_and_up_with_every_committed_message(store_url: str) -> None:
    _one_committed_turn(store_url)
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


def test_the_compact_receipts_revision_keeps_every_hash(store_url: str) -> None:
    admission, terminal, messages, first = _one_committed_turn(store_url)
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, "0005")
        with db.engine.connect() as conn:
            # Before 0006 the hash was its 64 hex characters.
            assert conn.execute(text("SELECT payload_hash FROM ts_receipts")).scalar_one() == first.receipt.payload_hash
        migrate.upgrade(db)
        assert _differences(db) == []
        with db.engine.connect() as conn:
            stored = conn.execute(text("SELECT payload_hash FROM ts_receipts")).scalar_one()
            assert bytes(stored) == bytes.fromhex(first.receipt.payload_hash)
    finally:
        db.dispose()
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        # The receipt reads back whole, and a replay of the same turn is still a duplicate.
        assert Turns(store).receipts(A, "s1") == [first.receipt]
        again = Turns(store).commit_turn("e", "t1", admission, terminal, messages)
        assert again.status == "duplicate" and again.receipt == first.receipt


def test_the_session_incarnation_revision_keeps_every_row_and_every_cursor(store_url: str) -> None:
    """0007 adds ts_sessions.incarnation. On SQLite ts_sessions is every other table's parent: a table
    rebuild there would delete every child row through ON DELETE CASCADE; nothing may go. Sessions
    from before keep their creation time as their incarnation, so the cursors engines hold still read."""
    admission, terminal, messages, _first = _one_committed_turn(store_url)
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        store.create_session(A, session_id="s0")
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, "0006")
        with db.engine.begin() as conn:
            # s0 as imported with a creation time of exactly 1970-01-01T00:00:00Z (allowed).
            conn.execute(text("UPDATE ts_sessions SET created_us = 0 WHERE session_id = 's0'"))
            counts = {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in _TABLES}
            created = conn.execute(text("SELECT created_us FROM ts_sessions WHERE session_id = 's1'")).scalar_one()
        assert counts == {"ts_sessions": 2, "ts_entries": 2, "ts_active_path": 2, "ts_receipts": 1}
        migrate.upgrade(db)
        assert _differences(db) == []
        with db.engine.connect() as conn:
            assert {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in _TABLES} == counts
        # A session written without an incarnation (a process of an older release) is refused on both
        # backends (NOT NULL; on SQLite, whose added column needs a default, a trigger), not stored as 0.
        _refuses_a_session_without_incarnation(db)
    finally:
        db.dispose()
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        assert store.get_session(A, "s1").incarnation == created
        assert store.get_session(A, "s0").incarnation == 1  # 0 is a cursor's "no session"
        assert [s.session_id for s in store.list_sessions(A)] == ["s0", "s1"]
        # A cursor as the store issued it before the upgrade (after the question; the creation time
        # as the incarnation) is honoured: the page after it, not a reset.
        before = CursorState(A, "s1", 0, admission.anchor.seq, 0, created).encode()
        page = store.read_visible_delta(A, "s1", before)
        assert isinstance(page, DeltaPage) and [e.message for e in page.entries] == [assistant("a")]
        assert Turns(store).commit_turn("e", "t1", admission, terminal, messages).status == "duplicate"
        # Sessions made from now on draw their incarnation, whatever the clock says.
        fresh = store.create_session(A, session_id="s2")
        assert 0 < fresh.incarnation < 2**53  # exact as a JSON number in JavaScript too
        assert fresh.incarnation != int(fresh.created_at.timestamp() * 1_000_000)


_TABLES = ("ts_sessions", "ts_entries", "ts_active_path", "ts_receipts")


def test_the_word_index_revision_keeps_every_lossless_row_searchable(store_url: str) -> None:
    """0008 adds the lossless engine's word-vector columns again over the first 100,000 characters of a
    text (PostgreSQL; nothing on SQLite): rows written before it stay, and stay searchable, both ways."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        engine = LosslessEngine(EngineContext(store=store, config={}, summarizer=ExtractiveSummarizer(),
                                              estimator=RoughEstimator()))
        sid = store.create_session(A, session_id="s1").session_id
        admission = store.admit(A, sid, user("where is the kiwi orchard"), turn_id="t1")
        last = store.append(A, sid, assistant("behind the melon field"))
        terminal = store.anchor(A, sid, last.entry_id)
        store.write(lambda c: engine.commit_turn(tx=c, advancement_key="t1", admission=admission.anchor,
                                                 terminal=terminal, messages=[user("where is the kiwi orchard"),
                                                                              assistant("behind the melon field")]))

        def found(word: str) -> int:
            out = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": word}, scope=A, session_id=sid))
            return int(out["count"])

        assert (found("kiwi"), found("melon")) == (1, 1)
        db = Database(StoreConfig(url=store_url))
        try:
            for revision in ("0007", None):
                if revision is None:
                    migrate.upgrade(db)
                else:
                    _downgrade(db, revision)
                with db.engine.connect() as conn:
                    assert conn.execute(text("SELECT count(*) FROM ts_lcm_messages")).scalar_one() == 2
                    if not db.dialect.is_sqlite:
                        expression = conn.execute(text(
                            "SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d JOIN pg_attribute a"
                            " ON a.attrelid = d.adrelid AND a.attnum = d.adnum"
                            " WHERE d.adrelid = 'ts_lcm_messages'::regclass AND a.attname = 'search_tsv'"
                        )).scalar_one()
                        assert ("100000" in expression) == (revision is None), expression
                if revision is None:  # (this release reads SQLite's index of 0012 and the column of 0016)
                    assert (found("kiwi"), found("melon")) == (1, 1)
                elif not db.dialect.is_sqlite:  # the word vector of 0007 finds them as that release searched
                    with db.engine.connect() as conn:
                        assert [conn.execute(text(
                            "SELECT count(*) FROM ts_lcm_messages WHERE search_tsv @@ plainto_tsquery('simple', :w)"
                        ), {"w": w}).scalar_one() for w in ("kiwi", "melon")] == [1, 1]
        finally:
            db.dispose()


def test_stores_migrated_by_earlier_versions_of_two_revisions_upgrade_to_the_same_schema(store_url: str) -> None:
    """0002 gained ts_receipts_key and 0007 its SQLite trigger and its 0 -> 1 fill after stores had run
    them: a store without that index failed 0005 ("no such index"), and one from the first 0007 kept a
    session with incarnation 0 and no trigger. Both upgrade to the head's schema now."""
    _one_committed_turn(store_url)
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, "0004")
        with db.engine.begin() as conn:
            conn.execute(text("DROP INDEX ts_receipts_key"))  # as 366c9a8's 0002 left it
        migrate.upgrade(db, "0008")
        with db.engine.begin() as conn:  # as the first 0007 left it
            conn.execute(text("UPDATE ts_sessions SET incarnation = 0 WHERE session_id = 's1'"))
            if db.dialect.is_sqlite:
                conn.execute(text("DROP TRIGGER ts_sessions_incarnation_required"))
        migrate.upgrade(db)
        assert migrate.current_revision(db) == migrate.head_revision() and _differences(db) == []
        with db.engine.connect() as conn:
            assert conn.execute(text("SELECT incarnation FROM ts_sessions WHERE session_id = 's1'")).scalar_one() == 1
        _refuses_a_session_without_incarnation(db)
    finally:
        db.dispose()


@contextmanager
def _a_role_over_a_store_at(store_url: str, revision: str) -> Iterator[tuple[Database, str]]:
    """A PostgreSQL store taken down to ``revision`` and the name for a new role, dropped with its grants after."""
    if store_url.startswith("sqlite"):
        pytest.skip("SQLite has no roles or grants")
    role = f"ts_app_{uuid.uuid4().hex[:8]}"
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, revision)
        yield db, role
    finally:
        with db.engine.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
        db.dispose()


def _holds(db: Database, role: str, table: str, privileges: tuple[str, ...]) -> list[bool]:
    """Whether ``role`` holds each of ``privileges`` on ``table``."""
    with db.engine.connect() as conn:
        return [bool(conn.execute(text(f"SELECT has_table_privilege('{role}', '{table}', '{p}')")).scalar_one())
                for p in privileges]


def test_the_receipts_rebuild_keeps_the_grants_of_an_application_role(store_url: str) -> None:
    """0006 builds ts_receipts again; on PostgreSQL the old table's grants went with it, so workers
    running as a role that may only read and write rows had every commit refused after the upgrade."""
    with _a_role_over_a_store_at(store_url, "0005") as (db, role):
        with db.engine.begin() as conn:
            conn.execute(text(f"CREATE ROLE {role}"))
            conn.execute(text(f"GRANT SELECT, INSERT, DELETE ON ts_receipts TO {role}"))
            conn.execute(text(f"GRANT UPDATE ON ts_receipts TO {role} WITH GRANT OPTION"))
        migrate.upgrade(db)
        held = _holds(db, role, "ts_receipts", ("SELECT", "INSERT", "DELETE", "UPDATE", "TRUNCATE"))
        assert held == [True] * 4 + [False]
        with_grant_option = _holds(db, role, "ts_receipts", ("UPDATE WITH GRANT OPTION", "INSERT WITH GRANT OPTION"))
        assert with_grant_option == [True, False]  # UPDATE's grant option kept, none added to INSERT


def test_the_tombstone_revision_grants_its_table_as_the_sessions_are(store_url: str) -> None:
    """0015 adds ``ts_deleted_sessions``, which every ``delete_session`` writes: on PostgreSQL a worker role
    granted only row access to the store's tables would have every delete refused after the upgrade
    ("permission denied for table ts_deleted_sessions"). The table is granted what ``ts_sessions`` is, and
    such a role deletes (and its tombstone keeps a retried create from making the session again)."""
    from sqlalchemy.engine import make_url

    with _a_role_over_a_store_at(store_url, "0014") as (db, role):
        with db.engine.begin() as conn:
            conn.execute(text(f"CREATE ROLE {role} LOGIN"))
            for table in sa_inspect(conn).get_table_names():
                if table.startswith("ts_"):
                    conn.execute(text(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}"))
            conn.execute(text(f"GRANT SELECT ON alembic_version TO {role}"))  # the revision check on open
        migrate.upgrade(db)
        granted = _holds(db, role, "ts_deleted_sessions", ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE"))
        assert granted == [True] * 4 + [False]
        as_role = make_url(store_url).set(username=role, password=None).render_as_string(hide_password=False)
        with TranscriptStore(config=StoreConfig(url=as_role, auto_upgrade=False)) as worker:
            made = worker.create_session(A, session_id="g1")
            worker.append(A, "g1", user("q"))
            assert worker.delete_session(A, "g1").incarnation == made.incarnation
            assert worker.list_sessions(A) == []


def test_entries_committed_before_keys_were_bound_take_their_key(store_url: str) -> None:
    """0010: a turn of an appended message committed before this release is bound to its key, so it
    cannot be committed again under another one; its replay is still a duplicate."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        sid = store.create_session(A, session_id="s1").session_id
        first = store.append(A, sid, user("appended"))
        last = store.append(A, sid, assistant("reply"))
        turn = (store.anchor(A, sid, first.entry_id), store.anchor(A, sid, last.entry_id),
                [user("appended"), assistant("reply")])
        turns = Turns(store)
        assert turns.commit_turn("e", "k1", *turn).status == "committed"
        db = Database(StoreConfig(url=store_url))
        try:
            _downgrade(db, "0009")
            with db.engine.begin() as conn:  # as a release before this one left it
                conn.execute(text("UPDATE ts_entries SET turn_id = NULL"))
            migrate.upgrade(db)
        finally:
            db.dispose()
        assert turns.commit_turn("e", "k1", *turn).status == "duplicate"
        with pytest.raises(TurnKeyConflict):
            turns.commit_turn("e", "k2", *turn)
        assert [r.advancement_key for r in turns.receipts(A, sid)] == ["k1"]


def _small_lossless(store: TranscriptStore) -> LosslessEngine:
    """A lossless engine with a small window, so that a few turns compact into summaries of two depths."""
    return LosslessEngine(EngineContext(
        store=store, config={"context_window": 400, "fresh_tail_messages": 2, "leaf_chunk_messages": 4,
                             "condense_fanin": 2},
        summarizer=ExtractiveSummarizer(), estimator=RoughEstimator()))


def _lossless_turn(store: TranscriptStore, engine: LosslessEngine, sid: str, i: int, question: str) -> None:
    """Turn ``t{i}`` (the question, a 20-word answer) admitted, committed to ``engine``, then compacted."""
    admission = store.admit(A, sid, user(question), turn_id=f"t{i}")
    last = store.append(A, sid, assistant(f"answer {i} " + "words " * 20))
    terminal = store.anchor(A, sid, last.entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    store.write(lambda c: engine.commit_turn(tx=c, advancement_key=f"t{i}", admission=admission.anchor,
                                             terminal=terminal, messages=closed.messages))
    engine.compact(scope=A, session_id=sid, force=True)


def test_what_an_earlier_release_kept_after_a_reset_is_forgotten(store_url: str) -> None:
    """0011: before 0bafff9 a reset emptied the context and kept every engine row, so the original of a
    redacted message (and the summaries made from it) stayed findable by the recall tools after the
    upgrade, and stayed so until the session's next branch or rewrite. The upgrade forgets them; the
    context, and what it covers, stays as it was."""
    legacy_tables = (messages, summaries, summary_sources, summary_children)
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        engine = _small_lossless(store)
        sid = store.create_session(A, session_id="s1").session_id

        def turn(i: int, question: str) -> None:
            _lossless_turn(store, engine, sid, i, question)

        def found(pattern: str) -> int:
            out = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": pattern}, scope=A, session_id=sid))
            return int(out["count"])

        for i in range(8):
            turn(i, "the zucchini secret " * 5 if i == 2 else f"question {i} " + "words " * 20)
        before = {t.name: store.read(lambda c, t=t: c.conn.execute(_earlier(t)).all()) for t in legacy_tables}
        secret = next(e for e in store.read_visible(A, sid) if "zucchini" in str(e.message["content"]))
        store.rewrite_entries(A, sid, [{"entry_id": secret.entry_id, "message": user("[redacted]")}])
        turn(8, "after the redaction " + "words " * 20)
        assert found("zucchini") == 0
        context = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=4000).messages
        db = Database(StoreConfig(url=store_url))
        try:
            _downgrade(db, "0010")
            with db.engine.begin() as conn:  # as an earlier release's reset left them: every row kept
                for table in legacy_tables:
                    now = conn.execute(_earlier(table)).all()
                    # A summary has one parent: one the reset gave back and compaction condensed since keeps it.
                    parented = {row.child_seq for row in now} if table is summary_children else set()
                    gone = [r._asdict() for r in before[table.name]
                            if r not in now and getattr(r, "child_seq", None) not in parented]
                    if gone:
                        conn.execute(table.insert(), gone)
            # (this release reads SQLite's search index of 0012 and the column of 0016: the rows are counted
            # where an earlier release's search finds them; test_lossless_search_scoped.py checks 0012)
            where = "ts_lcm_search" if db.dialect.is_sqlite else "ts_lcm_messages"
            assert store.read(lambda c: c.conn.execute(
                text(f"SELECT count(*) FROM {where} WHERE content LIKE '%zucchini%'")).scalar_one()) > 0
            assert store.read(lambda c: audit(c, A, sid)).problems
            migrate.upgrade(db)
        finally:
            db.dispose()
        assert found("zucchini") == 0 and found("redaction") == 1
        assert store.read(lambda c: audit(c, A, sid)).problems == []
        assert engine.assemble(scope=A, session_id=sid, fence=None, token_budget=4000).messages == context


def select_all(table: Table) -> Select[Any]:
    """Every row of a lossless table (every column but PostgreSQL's generated search column), in key order."""
    return select(table).order_by(*table.primary_key.columns)


def _earlier(table: Table) -> Select[Any]:
    """``select_all`` of the columns an earlier release's table had (not ``hidden``, which 0016 adds to the
    engine's messages: the server's default fills it in the rows written back below it)."""
    return select(*[c for c in table.c if c.name != "hidden"]).order_by(*table.primary_key.columns)


def _index_condition(db: Database, table: str, name: str) -> str | None:
    """An index's definition on either backend ("" for an index without a WHERE), None when absent."""
    with db.engine.connect() as conn:
        if db.dialect.is_sqlite:
            sql = conn.execute(text("SELECT sql FROM sqlite_master WHERE type = 'index' AND name = :n"), {"n": name})
        else:
            sql = conn.execute(text("SELECT indexdef FROM pg_indexes WHERE tablename = :t AND indexname = :n"),
                               {"t": table, "n": name})
        found = sql.scalar()
    return None if found is None else found.partition(" WHERE ")[2].strip("() ")


def test_the_queue_index_revision_keeps_every_row(store_url: str) -> None:
    """0014 builds the outbox queue indexes without blocked rows, under a store with turns committed,
    blocked, queued and running: every row stays, the indexes are schema.py's, and the turns go on (the
    queued one is delivered, a bare anchor is committed past the bound admissions); down to 0013 and up
    again the same."""
    from workers.turn_worker import counting_engine

    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        sid = store.create_session(A, session_id="s1").session_id
        turns = Turns(store)
        for i in range(3):
            turns.admit(A, sid, user(f"q{i}"), turn_id=f"t{i}", engine_id="e")
            turns.complete(A, sid, f"t{i}", [{"message": assistant(f"a{i}")}], counting_engine if i == 0 else None)
        turns.block(A, sid, "t1", "refused")  # t1 blocked, t2 queued (accepted)
        turns.admit(A, sid, user("q3"), turn_id="t3", engine_id="e")  # running
        tables = (*_TABLES, "ts_outbox")

        def counts(db: Database) -> dict[str, int]:
            with db.engine.connect() as conn:
                return {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in tables}

        db = Database(StoreConfig(url=store_url))
        try:
            before = counts(db)
            assert before["ts_outbox"] == 3 and before["ts_receipts"] == 1
            for _ in range(2):  # 0013 -> 0014 twice: the round trip leaves it as it was
                _downgrade(db, "0013")
                assert _index_condition(db, "ts_outbox", "ts_outbox_order") == ""
                assert counts(db) == before
                migrate.upgrade(db)
                assert _differences(db) == [] and counts(db) == before
                for name in ("ts_outbox_order", "ts_outbox_state"):
                    assert "blocked" in str(_index_condition(db, "ts_outbox", name)), name
        finally:
            db.dispose()
        assert [(i.turn_id, i.state) for i in turns.intents(A)] == [("t1", "blocked"), ("t2", "accepted"),
                                                                     ("t3", "admitted")]
        assert turns.drain(lambda engine_id: counting_engine if engine_id == "e" else None).committed == 1
        turns.complete(A, sid, "t3", [{"message": assistant("a3")}], counting_engine)
        bare = store.append_many(A, sid, [{"message": user("bare q")}, {"message": assistant("bare a")}])
        adm, term = (store.anchor(A, sid, e.entry_id) for e in bare)
        assert turns.commit_turn("e", "k-bare", adm, term, [user("bare q"), assistant("bare a")]).status == "committed"
        assert [r.advancement_key for r in turns.receipts(A, sid, "e")] == ["t0", "t2", "t3", "k-bare"]


def test_the_tombstone_revision_upgrades_a_store_that_deleted_sessions(store_url: str) -> None:
    """0015 adds ``ts_deleted_sessions`` (empty) to a store at 0014 whose sessions were created and deleted
    there: every row stays, the schema is schema.py's, deletes from then on leave a tombstone, and a
    retry of a create whose COMMIT was lost answers the session it made instead of making it again. Down
    to 0014 (the table dropped) and up again the same."""
    from test_session_lifecycle_review import commit_lost_then

    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        for sid in ("s1", "s2"):
            store.create_session(A, session_id=sid)
            store.append(A, sid, user(f"q {sid}"))
        store.delete_session(A, "s2")  # its tombstone goes with the table, as if deleted at 0014
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, "0014")
        before = _content(db)
        assert "ts_deleted_sessions" not in before
        for _ in range(2):
            migrate.upgrade(db)
            after = _content(db)
            assert _differences(db) == [] and after.pop("ts_deleted_sessions") == []
            assert after.pop("alembic_version") == [f"['{migrate.HEAD}']"]
            assert before.pop("alembic_version") == ["['0014']"]
            assert after == before
            _downgrade(db, "0014")
            before = _content(db)
        migrate.upgrade(db)
    finally:
        db.dispose()
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store, \
            TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as other:
        gone = store.delete_session(A, "s1")
        tombstones = text("SELECT session_id, incarnation FROM ts_deleted_sessions")
        rows = store.read(lambda c: c.conn.execute(tombstones).all())
        assert [tuple(r) for r in rows] == [("s1", gone.incarnation)]
        with commit_lost_then(store, lambda: other.delete_session(A, "s3")):
            made = store.create_session(A, session_id="s3")
        assert made.session_id == "s3" and [s.session_id for s in other.list_sessions(A)] == []


def _a_store_with_every_kind_of_row(store_url: str) -> tuple[Any, ...]:
    """Sessions s1 (a committed turn), s2 (lossless turns, compacted, then branched: summaries, context,
    engine rows) and s3 (outbox rows blocked, accepted and admitted; engine state), a keyed session.
    Returns s1's turn (admission, terminal, messages, its commit's result)."""
    from workers.turn_worker import counting_engine

    committed = _one_committed_turn(store_url)
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        engine = _small_lossless(store)
        sid = store.create_session(A, session_id="s2").session_id

        def turn(i: int) -> None:
            _lossless_turn(store, engine, sid, i, f"question {i} " + "words " * 20)

        for i in range(6):
            turn(i)
        store.branch(A, sid, store.read_visible(A, sid)[5].entry_id)
        turn(6)
        turns = Turns(store)
        sid = store.create_session(A, session_id="s3").session_id
        for i in range(3):
            turns.admit(A, sid, user(f"q{i}"), turn_id=f"t{i}", engine_id="e")
            turns.complete(A, sid, f"t{i}", [{"message": assistant(f"a{i}")}], counting_engine if i == 0 else None)
        turns.block(A, sid, "t1", "refused")
        turns.admit(A, sid, user("q3"), turn_id="t3", engine_id="e")
        store.append(A, store.create_session(A, session_id="s4", session_key="key-4").session_id, user("keyed"))
        return committed


def _content(db: Database) -> dict[str, list[str]]:
    """Every row of every table of the store (the engine's search index but as its rows' text), in order."""
    out: dict[str, list[str]] = {}
    with db.engine.connect() as conn:
        names = [t for t in sa_inspect(conn).get_table_names() if t.startswith(("ts_", "alembic"))]
        for name in sorted(n for n in names if not n.startswith("ts_lcm_search")):
            # By name: a revision may store the same columns in another order (0018 on SQLite).
            columns = sorted(c["name"] for c in sa_inspect(conn).get_columns(name) if c["name"] != "search_tsv")
            rows = conn.execute(text(f"SELECT {', '.join(columns)} FROM {name}")).all()
            out[name] = sorted(repr([bytes(v) if isinstance(v, memoryview) else v for v in row]) for row in rows)
    return out


_MIGRATE_WORKER = Path(__file__).parent / "workers" / "migrate_worker.py"


#: the points an upgrade is killed at, one real process each
KILL_POINTS = [
    "version_num='0005'",  # SQLite: after 0005's rebuild of ts_receipts (a DROP TABLE), before its commit
    "DROP TABLE ts_receipts_0005",  # in the middle of 0006's rebuild
    "version_num='0012'",  # SQLite: after 0012 dropped and rebuilt the engine's search index
    "terminal_seq INTEGER",  # inside 0017: its columns added (SQLite: the table rebuilt), no receipt converted
    "UPDATE ts_receipts SET admission_seq",  # after 0017's conversion of the stored receipts (one UPDATE)
    "version_num='0017'",  # 0017's version row (SQLite: its commit still to come)
    "version_num='0018'",  # the last migration's version row, the commit still to come
]
#: statements only SQLite's upgrade runs
SQLITE_KILL_POINTS = [
    "INSERT INTO ts_entries (rowid,",  # inside 0018: the entries copied into the new table, the old one kept
    "CREATE UNIQUE INDEX ts_entries_turn_id",  # inside 0018: the old table dropped, its last index made again
]


def test_an_upgrade_killed_midway_leaves_the_store_as_it_was(store_url: str) -> None:
    """An upgrade from 0004 SIGKILLed at a point inside it (a real process): the store is still at 0004
    with every row as it was (on SQLite too, whose DDL runs in the upgrade's one transaction), and the
    next upgrade finishes with the rows an upgrade that was never killed leaves: receipts still answer
    ``duplicate``, a cursor issued before still reads on (an empty page, not a reset).

    Every kill point on one store: each kill leaves it at 0004 with the rows it had (checked), the very
    start the next kill needs, so the store, its downgrade and the finishing upgrade are made once."""
    admission, terminal, messages, first = _a_store_with_every_kind_of_row(store_url)
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, "0004")
        old = _content(db)
        migrate.upgrade(db)
        upgraded = _content(db)
        # A cursor issued after an upgrade from 0004 (the incarnation is then the creation time): the
        # upgrade done again after the kill must give the session the same, or the cursor reads a reset.
        with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
            page = store.read_visible_delta(A, "s2", None)
            assert isinstance(page, DeltaPage)
            cursor = page.cursor
        _downgrade(db, "0004")
        assert _content(db) == old
        db.dispose()
        sqlite = store_url.startswith("sqlite")
        for statement in KILL_POINTS + (SQLITE_KILL_POINTS if sqlite else []):
            killed = subprocess.run([sys.executable, str(_MIGRATE_WORKER), "kill", store_url, statement, "1"],
                                    capture_output=True, text=True, timeout=120)
            assert killed.returncode == -signal.SIGKILL, (statement, killed.stdout, killed.stderr)
            assert migrate.current_revision(db) == "0004" and _content(db) == old, statement
        assert migrate.upgrade_from(db) == ("0004", migrate.head_revision())
        assert _content(db) == upgraded and _differences(db) == []
    finally:
        db.dispose()
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        assert [(i.turn_id, i.state) for i in Turns(store).intents(A) if i.session_id == "s3"] == [
            ("t1", "blocked"), ("t2", "accepted"), ("t3", "admitted")]
        again = Turns(store).commit_turn("e", "t1", admission, terminal, messages)
        assert again.status == "duplicate" and again.receipt == first.receipt
        page = store.read_visible_delta(A, "s2", cursor)
        assert isinstance(page, DeltaPage) and page.entries == [] and page.cursor == cursor


def test_processes_opening_an_old_sqlite_store_at_once_all_open_it_and_one_migrates(
    store_url: str, backend: str
) -> None:
    """Three applications opening a store at 0004 at the same moment, each migrating on open (SQLite's
    default; PostgreSQL's when TRANSCRIPT_STORE_AUTO_UPGRADE=1): all open it at head, one migrates."""
    _a_store_with_every_kind_of_row(store_url)
    db = Database(StoreConfig(url=store_url))
    try:
        _downgrade(db, "0004")
    finally:
        db.dispose()
    env = {**os.environ, "TRANSCRIPT_STORE_AUTO_UPGRADE": "1" if backend == "postgresql" else ""}
    start = time.time() + 2
    procs = [subprocess.Popen([sys.executable, str(_MIGRATE_WORKER), "open", store_url, str(start)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    reports = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    assert [(r["revision"], r["sessions"]) for r in reports] == [(migrate.head_revision(), 4)] * 3
    assert sorted(r["migrated"] > 0 for r in reports) == [False, False, True], reports


@pytest.mark.parametrize(
    ("statement", "error"),
    [("INSERT INTO alembic_version (version_num) VALUES ('0014')", "several revisions"),
     ("DELETE FROM alembic_version", "records no revision")],
    ids=["several-revisions", "no-revision"],
)
def test_a_version_table_not_holding_one_revision_is_schema_not_current(
    store_url: str, statement: str, error: str
) -> None:
    """Opening a store skips Alembic at head (``migrate._at_head``) and leaves any other version table to
    Alembic's path. Several revisions were Alembic's own CommandError (untyped, from the store's constructor,
    ``current_revision`` and ``upgrade``); a store's tables with none recorded (the table emptied by hand, a
    restore that left its row out) were taken for an empty database: auto-upgrade ran every migration from
    the first and failed on "table ts_sessions already exists", and without it the error said to run
    ``init``, which failed the same way."""
    db = Database(StoreConfig(url=store_url))
    try:
        with db.engine.begin() as conn:
            conn.execute(text(statement))
        for auto_upgrade in (False, True):
            with pytest.raises(SchemaNotCurrent, match=error):
                TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=auto_upgrade))
        with pytest.raises(SchemaNotCurrent, match=error):
            migrate.current_revision(db)
        with pytest.raises(SchemaNotCurrent, match=error):
            migrate.upgrade(db)
        with db.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM ts_sessions")).scalar_one() == 0
    finally:
        db.dispose()
