"""Full-text search reads its own session's rows, whatever the rest of the store holds (revision 0012).

SQLite's search index is one FTS5 table for every scope and session. Until 0012 its rowids came from
one store-wide sequence, so a search ran its MATCH over the whole index and then kept its session's
rows: a grep in a session of 50 messages read (and ranked with bm25, and threw away) every matching
row of every other session and scope. Now a row's rowid is its session's slot, its kind's half of
the slot and its ordinal or seq, and the search bounds its MATCH to that range. A score reads the
hit's own row only (bm25 counted each phrase's rows in the whole table). The upgrade builds the index
again from the engine's tables: a store keeps every hit, in the same recency order.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import event, text

from engines.lossless import LosslessEngine
from engines.lossless import search as search_module
from engines.lossless.search import Hit
from engines.lossless.tables import messages
from transcript_store import StoreConfig, TranscriptStore, migrate
from transcript_store.core import Core
from transcript_store.db import Database
from transcript_store.engine import EngineContext
from transcript_store.errors import TranscriptStoreError
from transcript_store.models import ClosedRange
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-lss-a"
B = "scope-lss-b"
#: a small window, so that a few turns compact; 800 rather than 400: a window's summary budgets follow it
#: (``config.summary_caps``), and at 400 a leaf (50 tokens) kept no line of its messages to be found
COMPACTING = {"context_window": 800, "fresh_tail_messages": 2, "leaf_chunk_messages": 4, "condense_fanin": 2}
#: (pattern, sort) pairs every comparison searches, over messages and summaries
SEARCHES = [(p, s) for p in ("deploy", "kiwi orchard", "answer", "ΣΟΦΙΑ", "question 1", "summary of", "sum_", "zz",
                             "melon") for s in ("recency", "relevance")]
#: revision 0012's rowids: a session's slot * SLOT_ROWS, plus its kind's start, plus the ordinal or seq
SLOT_ROWS = 2**32
KIND_ROWS = {"message": 0, "summary": 2**31}


def make_engine(store: TranscriptStore, config: dict[str, Any] | None = None) -> LosslessEngine:
    """A lossless engine over ``store`` with the extractive summarizer."""
    return LosslessEngine(EngineContext(store=store, config=config or {}, summarizer=ExtractiveSummarizer(),
                                        estimator=RoughEstimator()))


def turn(store: TranscriptStore, engine: LosslessEngine, scope: str, sid: str, turn_id: str, question: str,
         *replies: str) -> None:
    """Admit ``question``, append ``replies`` and commit the turn to ``engine``."""
    admission = store.admit(scope, sid, {"role": "user", "content": question}, turn_id=turn_id)
    appended = store.append_many(scope, sid, [{"message": {"role": "assistant", "content": r}} for r in replies])
    terminal = store.anchor(scope, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    store.write(lambda c: engine.commit_turn(tx=c, advancement_key=turn_id, admission=admission.anchor,
                                             terminal=terminal, messages=closed.messages))


def grep(engine: LosslessEngine, scope: str, sid: str, pattern: str, **args: Any) -> dict[str, Any]:
    """lcm_grep's answer."""
    out: dict[str, Any] = json.loads(engine.handle_tool_call(
        "lcm_grep", {"pattern": pattern, "limit": 200, **args}, scope=scope, session_id=sid))
    assert "error" not in out, out
    return out


def hits(store: TranscriptStore, scope: str, sid: str, pattern: str, sort: str) -> list[tuple[str, int, str]]:
    """The full-text hits of a search over messages and summaries: (kind, ref, snippet), in order."""
    found: list[Hit] = store.read(lambda c: search_module.grep(
        c, scope, sid, pattern, mode="full_text", kinds=("message", "summary"), sort=sort,  # type: ignore[arg-type]
        limit=200))
    return [(h.kind, h.ref, search_module.snippet(h.content, h.span, offset=h.offset)) for h in found]


def fill(store: TranscriptStore, scope: str, sid: str, rows: int, words: str) -> None:
    """``rows`` engine messages in a new session, written straight into the engine's table (the search
    index follows through its triggers, as for the engine's own inserts)."""
    store.create_session(scope, session_id=sid)
    store.write(lambda c: c.conn.execute(messages.insert(), [
        {"scope": scope, "session_id": sid, "ordinal": n, "entry_id": f"e{n}", "generation": 0, "position": n,
         "role": "assistant", "content": f"{words} {n}", "message": "{}", "tokens": 5, "created_us": 0}
        for n in range(rows)]))


def sqlite_index(store: TranscriptStore) -> tuple[set[int], set[int]]:
    """SQLite: the rowids of the search index, and those the engine's rows should have there."""
    def run(c: Core) -> tuple[set[int], set[int]]:
        indexed = set(c.conn.execute(text("SELECT rowid FROM ts_lcm_search")).scalars())
        wanted = set(c.conn.execute(text(
            f"SELECT s.slot * {SLOT_ROWS} + {KIND_ROWS['message']} + m.ordinal FROM ts_lcm_messages m"
            " JOIN ts_lcm_search_slots s ON s.scope = m.scope AND s.session_id = m.session_id"
            f" UNION ALL SELECT s.slot * {SLOT_ROWS} + {KIND_ROWS['summary']} + m.summary_seq FROM ts_lcm_summaries m"
            " JOIN ts_lcm_search_slots s ON s.scope = m.scope AND s.session_id = m.session_id")).scalars())
        rows = c.conn.execute(text("SELECT (SELECT count(*) FROM ts_lcm_messages)"
                                   " + (SELECT count(*) FROM ts_lcm_summaries)")).scalar_one()
        assert len(wanted) == rows  # every engine row has its session's slot
        return indexed, wanted

    return store.read(run)


def check_index(store: TranscriptStore) -> None:
    """SQLite: the index holds exactly the engine's rows, at their rowids, and a slot for each session
    with engine rows, no other."""
    if store.backend != "sqlite":
        return
    indexed, wanted = sqlite_index(store)
    assert indexed == wanted
    sessions = store.read(lambda c: c.conn.execute(text(
        "SELECT count(*) FROM ts_lcm_search_slots s WHERE NOT EXISTS (SELECT 1 FROM ts_lcm_messages m"
        " WHERE m.scope = s.scope AND m.session_id = s.session_id) AND NOT EXISTS (SELECT 1 FROM ts_lcm_summaries m"
        " WHERE m.scope = s.scope AND m.session_id = s.session_id)")).scalar_one())
    assert sessions == 0


# ---------------------------------------------------------------------------------------------- cost


def vm_steps(store: TranscriptStore, search: Callable[[Core], Any]) -> tuple[int, Any]:
    """The SQLite virtual machine's steps while ``search`` runs (its progress handler, called at every
    step; FTS5's reads of its index pages take steps too), and what it returned: a count of the rows
    and pages the statements visit, not a time."""
    steps = [0]

    def step() -> int:
        steps[0] += 1
        return 0

    def run(c: Core) -> Any:
        raw = c.conn.connection.driver_connection
        assert isinstance(raw, sqlite3.Connection)
        raw.set_progress_handler(step, 1)
        try:
            return search(c)
        finally:
            raw.set_progress_handler(None, 1)

    found = store.read(run)
    return steps[0], found


def sqlite_store(template: Path, tmp_path: Path, name: str) -> TranscriptStore:
    """A fresh, migrated SQLite store."""
    path = tmp_path / f"{name}.db"
    shutil.copyfile(template, path)
    return TranscriptStore(config=StoreConfig(url=f"sqlite:///{path}", auto_upgrade=False))


def add_summary(store: TranscriptStore, scope: str, sid: str, seq: int, content: str) -> None:
    """A leaf summary row over ordinals 0..3, written straight into the engine's table (search reads it)."""
    store.write(lambda c: c.conn.execute(text(
        "INSERT INTO ts_lcm_summaries (scope, session_id, summary_seq, kind, depth, level, tokens, source_tokens,"
        " earliest_ordinal, latest_ordinal, message_count, content, created_us)"
        " VALUES (:scope, :sid, :seq, 'leaf', 0, 'normal', 5, 50, 0, 3, 4, :content, 0)"),
        {"scope": scope, "sid": sid, "seq": seq, "content": content}))


def small_session(store: TranscriptStore) -> None:
    """Session "small" of scope A: 20 messages, 10 of them with "deployment", and one summary with it."""
    engine = make_engine(store)
    store.create_session(A, session_id="small")
    for n in range(10):
        turn(store, engine, A, "small", f"t{n}", f"question {n} about the deployment", f"answer {n}")
    add_summary(store, A, "small", 1, "the deployment so far")


def test_a_search_reads_its_own_sessions_rows_only(sqlite_template: Path, tmp_path: Path) -> None:
    """A session's search takes the steps it takes in a store of its own (a few more to seek in a larger
    index) in a store where 3,000 rows of other sessions match too (a session of the same id in
    another scope, and sessions of the same scope written before and after it): before 0012 each of
    them was a row the search read."""
    alone = sqlite_store(sqlite_template, tmp_path, "alone")
    crowded = sqlite_store(sqlite_template, tmp_path, "crowded")
    try:
        small_session(alone)
        fill(crowded, A, "before", 1000, "the deployment of before")
        fill(crowded, B, "small", 1000, "the deployment in scope b")  # the same session id, another scope
        small_session(crowded)
        fill(crowded, A, "after", 1000, "the deployment of after")
        for store in (alone, crowded):
            # One b-tree each (FTS5 merges its segments): the steps count rows read, not how the writes
            # happened to split an index into segments (each is a seek more, a few dozen steps).
            store.write(lambda c: c.conn.execute(text("INSERT INTO ts_lcm_search (ts_lcm_search) VALUES ('optimize')")))
        for sort in ("recency", "relevance"):
            for kinds in (("message",), ("summary",), ("message", "summary")):
                def search(c: Core, sort: str = sort, kinds: Any = kinds) -> list[tuple[str, int, float]]:
                    found = search_module.grep(c, A, "small", "deployment", mode="full_text", kinds=kinds,
                                               sort=sort, limit=200)  # type: ignore[arg-type]
                    return [(h.kind, h.ref, h.score) for h in found]

                steps_alone, found_alone = vm_steps(alone, search)
                steps_crowded, found_crowded = vm_steps(crowded, search)
                # Each row of another session the search read took some 6 steps: the 3,000 of them, about
                # 19,000 a kind before 0012. Now the seeks of a larger index: a few dozen.
                assert steps_crowded - steps_alone < 150 * len(kinds), (sort, kinds, steps_alone, steps_crowded)
                assert found_crowded == found_alone  # the same hits, in the same order, with the same scores
                assert len(found_alone) == 10 * ("message" in kinds) + ("summary" in kinds)
        check_index(crowded)
    finally:
        alone.close()
        crowded.close()


def test_a_search_bounds_its_match_to_the_sessions_rowids(sqlite_template: Path, tmp_path: Path) -> None:
    """The plan: the session's slot by its key, then the FTS5 index with MATCH and both rowid bounds
    (``M1><``: FTS5 iterates the doclists between them only), then each hit's row by its key."""
    store = sqlite_store(sqlite_template, tmp_path, "plan")
    try:
        small_session(store)
        captured: list[tuple[str, Any]] = []

        def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_args: Any) -> None:
            if "MATCH" in statement:
                captured.append((statement, parameters))

        def run(c: Core) -> list[str]:
            event.listen(store.db.engine, "before_cursor_execute", capture)
            try:
                search_module.grep(c, A, "small", "deployment", mode="full_text", kinds=("message",),
                                   sort="recency", limit=5)
            finally:
                event.remove(store.db.engine, "before_cursor_execute", capture)
            (sql, params), = captured
            return [row[-1] for row in c.conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params).all()]

        plan = store.read(run)
        assert plan[0].startswith("SEARCH s USING") and "scope=? AND session_id=?" in plan[0], plan
        assert plan[1] == "SCAN ts_lcm_search VIRTUAL TABLE INDEX 0:M1><", plan
        assert plan[2].startswith("SEARCH t USING") and "ordinal=?" in plan[2], plan
    finally:
        store.close()


# ---------------------------------------------------------------------------------------------- meaning


def test_a_hits_score_reads_its_own_row_only(store_url: str) -> None:
    """A relevance score does not move when other sessions' rows are written (bm25 counted each
    phrase's rows over the whole index: every scope's text moved every other scope's scores)."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        engine = make_engine(store)
        store.create_session(A, session_id="s")
        turn(store, engine, A, "s", "t1", "apple apple apple banana kiwi", "apple cherry kiwi melon",
             "a kiwi alone")

        def ranked(pattern: str) -> list[tuple[int, float]]:
            found = store.read(lambda c: search_module.grep(c, A, "s", pattern, mode="full_text", kinds=("message",),
                                                            sort="relevance", limit=200))
            return [(h.ref, h.score) for h in found]  # the score itself (the tool rounds it to 6 places)

        before = {p: ranked(p) for p in ("apple", "kiwi", "apple kiwi")}
        assert [ref for ref, _ in before["apple"]] == [0, 1] and before["apple"][0][1] > before["apple"][1][1] > 0
        fill(store, B, "s", 300, "kiwi kiwi apple")
        fill(store, A, "other", 300, "apple orchard")
        assert {p: ranked(p) for p in before} == before


def test_scopes_with_the_same_session_ids_stay_apart(store_url: str) -> None:
    """Two scopes, the same session id, the same ordinals and summary seqs: each finds its own rows."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        engines = {scope: make_engine(store, COMPACTING) for scope in (A, B)}
        for scope in (A, B):
            store.create_session(scope, session_id="shared")
            for n in range(6):
                turn(store, engines[scope], scope, "shared", f"t{n}", f"{scope} question {n} " + "words " * 20,
                     f"{scope} answer {n} " + "words " * 20)
            engines[scope].compact(scope=scope, session_id="shared", force=True)
        for scope, other in ((A, B), (B, A)):
            for search_in in ("messages", "summaries"):
                out = grep(engines[scope], scope, "shared", "question", search_in=search_in)
                assert out["count"] > 0, (scope, search_in)
                assert all(other not in r["snippet"] for r in out["results"]), out
            assert grep(engines[scope], scope, "shared", other)["count"] == 0
        check_index(store)


def test_forgotten_and_deleted_rows_leave_the_search(store_url: str) -> None:
    """A redaction forgets the original (its reset deletes its rows), a deleted session's rows go with
    it, and a session created again under its id starts with nothing found."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        engine = make_engine(store, COMPACTING)
        for sid in ("kept", "gone"):
            store.create_session(A, session_id=sid)
            for n in range(6):
                turn(store, engine, A, sid, f"t{n}", ("the zucchini secret " if n == 1 else f"question {n} ") * 5,
                     f"answer {n} " + "words " * 20)
            engine.compact(scope=A, session_id=sid, force=True)
            assert grep(engine, A, sid, "zucchini", search_in="all")["count"] > 0
        secret = next(e for e in store.read_visible(A, "kept") if "zucchini" in str((e.message or {}).get("content")))
        store.rewrite_entries(A, "kept", [{"entry_id": secret.entry_id, "message": {"role": "user",
                                                                                     "content": "[redacted]"}}])
        assert grep(engine, A, "kept", "zucchini", search_in="all")["count"] == 0
        engine.assemble(scope=A, session_id="kept", fence=None, token_budget=4000)  # imports the redacted path
        assert grep(engine, A, "kept", "zucchini", search_in="all")["count"] == 0
        assert grep(engine, A, "kept", "redacted")["count"] == 1 and grep(engine, A, "kept", "question 4")["count"] == 1
        check_index(store)
        store.delete_session(A, "gone")
        check_index(store)
        store.create_session(A, session_id="gone")
        assert grep(engine, A, "gone", "question", search_in="all")["count"] == 0
        turn(store, engine, A, "gone", "t9", "a new question", "a new answer")
        assert [r["snippet"] for r in grep(engine, A, "gone", "question")["results"]] == ["a new question"]
        assert grep(engine, A, "kept", "a new question")["count"] == 0
        check_index(store)


def test_a_row_outside_its_slot_is_refused(store_url: str) -> None:
    """An ordinal or seq outside 0..2**31-1 would land in another kind's or session's range: the trigger
    refuses it (the engine never writes one; PostgreSQL has no such range)."""
    if not store_url.startswith("sqlite"):
        pytest.skip("SQLite's search index only")
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        store.create_session(A, session_id="s")
        for ordinal in (-1, 2**31):
            def insert(c: Core, ordinal: int = ordinal) -> None:
                c.conn.execute(messages.insert(), {
                    "scope": A, "session_id": "s", "ordinal": ordinal, "entry_id": "e", "generation": 0,
                    "position": 0, "role": "user", "content": "x", "message": "{}", "tokens": 1, "created_us": 0})

            with pytest.raises(TranscriptStoreError, match="outside the search index range"):
                store.write(insert)
        check_index(store)


def test_slots_reach_the_largest_rowid_and_then_take_a_free_one(store_url: str) -> None:
    """A session in the last slot (2**31 - 1) is searched up to rowid 2**63 - 1; a new session then
    takes the first free slot, not one past the largest (which the slot CHECK refuses)."""
    if not store_url.startswith("sqlite"):
        pytest.skip("SQLite's search index only")
    last = 2**31 - 1

    def slots(c: Core) -> dict[str, int]:
        return {r.session_id: r.slot for r in c.conn.execute(text("SELECT slot, session_id FROM ts_lcm_search_slots"))}

    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        store.create_session(A, session_id="top")
        store.write(lambda c: c.conn.execute(text(
            f"INSERT INTO ts_lcm_search_slots (slot, scope, session_id) VALUES ({last}, '{A}', 'top')")))
        fill(store, A, "first", 3, "needle first")
        fill(store, A, "second", 3, "needle second")
        store.write(lambda c: c.conn.execute(messages.insert(), [
            {"scope": A, "session_id": "top", "ordinal": o, "entry_id": f"e{o}", "generation": 0, "position": 0,
             "role": "user", "content": f"needle top {o}", "message": "{}", "tokens": 1, "created_us": 0}
            for o in (0, 2**31 - 1)]))
        add_summary(store, A, "top", 2**31 - 1, "needle summary at the very end")
        assert store.read(slots) == {"top": last, "first": 1, "second": 2}
        largest = store.read(lambda c: c.conn.execute(text("SELECT max(rowid) FROM ts_lcm_search")).scalar_one())
        assert largest == 2**63 - 1
        assert [(k, ref) for k, ref, _ in hits(store, A, "top", "needle", "recency")] == [
            ("message", 2**31 - 1), ("summary", 2**31 - 1), ("message", 0)]
        assert len(hits(store, A, "first", "needle", "relevance")) == 3
        check_index(store)
        store.delete_session(A, "first")
        fill(store, A, "third", 1, "needle third")
        assert store.read(slots) == {"top": last, "third": 1, "second": 2}
        store.delete_session(A, "top")
        fill(store, A, "fourth", 1, "needle fourth")
        assert store.read(slots) == {"third": 1, "second": 2, "fourth": 3}
        assert [content for *_, content in hits(store, A, "fourth", "needle", "recency")] == ["needle fourth 0"]
        check_index(store)


# ---------------------------------------------------------------------------------------------- migration


def _downgrade(db: Database, revision: str) -> None:
    cfg = migrate.alembic_config()
    with db.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


@contextmanager
def hidden_column(db: Database) -> Iterator[None]:
    """A store taken below 0016 with the column 0016 adds (``ts_lcm_messages.hidden``), which this release's
    engine writes and its search reads, for as long as the test writes and searches as an earlier release
    did; it goes again before an upgrade adds it."""
    with db.engine.begin() as conn:
        conn.execute(text("ALTER TABLE ts_lcm_messages ADD COLUMN hidden BOOLEAN NOT NULL DEFAULT false"))
    yield
    with db.engine.begin() as conn:
        conn.execute(text("ALTER TABLE ts_lcm_messages DROP COLUMN hidden"))


@contextmanager
def receipts_of_this_release(db: Database) -> Iterator[None]:
    """A store taken below 0017 with the receipt columns 0017 gives ``ts_receipts``, which this release's
    ledger writes, for as long as the test writes as an earlier release did: 0017's own upgrade and, after,
    its own downgrade, which leaves the receipts as an earlier release's ledger wrote them."""
    path = migrate.MIGRATIONS_DIR / "versions" / "0017_receipt_seqs.py"
    spec = importlib.util.spec_from_file_location("revision_0017_under_test", path)
    assert spec is not None and spec.loader is not None
    revision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(revision)

    def run(step: Callable[[], None]) -> None:
        with db.engine.begin() as conn, Operations.context(MigrationContext.configure(conn)):
            step()

    run(revision.upgrade)
    yield
    run(revision.downgrade)


Found = list[tuple[str, int, str]]


def old_layout_hits(store: TranscriptStore, scope: str, sid: str, pattern: str, sort: str) -> Found:
    """The hits a release before 0012 found in its layout (SQLite: the store-wide map, bm25), by its own
    query (``search._full_text`` of that release, its helpers this release's); on PostgreSQL, whose
    search 0012 leaves alone, this release's."""
    if store.backend != "sqlite":
        return hits(store, scope, sid, pattern, sort)
    terms = pattern.split()
    found: list[tuple[str, int, str, float, int]] = []
    for kind, (table, key) in search_module._SOURCES.items():
        match = search_module._fts5_match(terms)
        params: dict[str, Any] = {"scope": scope, "session_id": sid, "match": match, "head": 10**9}
        params.update({f"g{n}": search_module._glob(t) for n, t in enumerate(terms)})
        sql = (
            f"SELECT {search_module._columns(kind)}, -bm25(ts_lcm_search) AS score FROM ts_lcm_search"
            " CROSS JOIN ts_lcm_search_map AS map ON map.id = ts_lcm_search.rowid"
            f" CROSS JOIN {table.name} AS t ON t.scope = map.scope AND t.session_id = map.session_id"
            f" AND t.{key} = map.ref WHERE ts_lcm_search MATCH :match AND map.scope = :scope"
            f" AND map.session_id = :session_id AND map.kind = '{kind}'"
        ) if match is not None else (
            f"SELECT {search_module._columns(kind)}, 0.0 AS score FROM {table.name} AS t"
            " WHERE t.scope = :scope AND t.session_id = :session_id"
        )
        sql += "".join(f" AND t.content GLOB :g{n}" for n in range(len(terms)))

        def run(c: Core, sql: str = sql, params: dict[str, Any] = params) -> Any:
            return c.conn.execute(text(sql), params).all()

        rows = store.read(run)
        found += [(kind, r.ref, search_module.snippet(r.content, search_module._find(r.content, terms[0])), r.score,
                   r.recency) for r in rows]

    def order(h: tuple[str, int, str, float, int]) -> tuple[Any, ...]:  # search._relevance, search._recency
        return (-h[3], -h[4], h[0], -h[1]) if sort == "relevance" else (-h[4], h[0], -h[1])

    return [(kind, ref, content) for kind, ref, content, _, _ in sorted(found, key=order)]


def test_the_upgrade_keeps_every_hit_of_a_store_written_before_it(store_url: str) -> None:
    """A store written at 0011 (two scopes, the same session id, summaries, a redaction's forgotten
    rows) finds after the upgrade what it found before: the same hits, the same recency order (the
    relevance order is this release's: row-local scores); downgrading builds the old index again."""
    db = Database(StoreConfig(url=store_url))
    # Opened at the head (a store checks its schema when it opens), then taken down to 0011.
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        try:
            _downgrade(db, "0011")
            engines = {scope: make_engine(store, COMPACTING) for scope in (A, B)}

            def everything() -> dict[tuple[str, str, str], Found]:
                return {(scope, p, s): hits(store, scope, "s", p, s) for scope in (A, B) for p, s in SEARCHES}

            def old_layout() -> dict[tuple[str, str, str], Found]:
                with hidden_column(db):
                    return {(scope, p, s): old_layout_hits(store, scope, "s", p, s)
                            for scope in (A, B) for p, s in SEARCHES}

            with hidden_column(db), receipts_of_this_release(db):
                for scope in (A, B):
                    store.create_session(scope, session_id="s")
                    for n in range(8):
                        turn(store, engines[scope], scope, "s", f"t{n}",
                             f"Question {n} of {scope}: kiwi orchard deploy " + "words " * 15,
                             f"Answer {n}: ΣΟΦΙΑ melon " * (n % 3 + 1) + "detail " * 15)
                        engines[scope].compact(scope=scope, session_id="s", force=True)
                secret = next(e for e in store.read_visible(A, "s")
                              if "Question 2" in str((e.message or {}).get("content")))
                store.rewrite_entries(A, "s", [{"entry_id": secret.entry_id,
                                                "message": {"role": "user", "content": "[redacted] zz"}}])
                turn(store, engines[A], A, "s", "t9", "after the redaction", "zz top")
            before = old_layout()
            assert sum(map(len, before.values())) > 100 and any(k == "summary" for h in before.values() for k, *_ in h)
            migrate.upgrade(db)
            after = everything()
            check_index(store)
            for search, found in before.items():
                if search[2] == "recency" or store.backend != "sqlite":
                    assert after[search] == found, search
                else:
                    assert sorted(after[search]) == sorted(found), search
            _downgrade(db, "0011")
            assert old_layout() == before
            migrate.upgrade(db)
            assert everything() == after
            check_index(store)
        finally:
            db.dispose()
