"""Receipts reference their turn's entries by raw seq (revision 0017): the anchors' seqs, and the list of
the messages' seqs only when the range holds something else. What they answer is unchanged: the anchors'
entry ids, the turn's messages, ``duplicate`` for a replay; on both commit paths, and across 0017 both
ways, for receipts of every form a store can hold. And what 0017 costs a large ledger's stored receipts
(a review's finding: one rewrite of each, not four)."""

from __future__ import annotations

from typing import Any

from alembic import command
from conftest import assistant, user
from sqlalchemy import event, text

from transcript_store import ClosedRange, StoreConfig, TranscriptStore, migrate
from transcript_store.db import Database
from transcript_store.ledger import committed_messages, get_receipt
from transcript_store.turns import Turns

A = "scope-a"
E = "engine-1"
#: a receipt's references into the transcript as stored since 0017, and as 0016 stored them
_STORED = "advancement_key, admission_seq, terminal_seq, message_seqs, admission_entry_id, terminal_entry_id"
_STORED_0016 = "advancement_key, message_seqs, admission_entry_id, terminal_entry_id"


def _turn(store: TranscriptStore, sid: str, key: str, *, gap: bool = False) -> tuple[Any, Any, list[Any]]:
    """An admitted and answered turn (a tool-free reply of two messages; ``gap``: a metadata entry between
    them, so its messages' seqs have a gap), with its closed range's messages."""
    admission = store.admit(A, sid, user(f"question {key}"), turn_id=key)
    store.append(A, sid, assistant(f"thinking {key}"))
    if gap:
        store.append(A, sid, kind="metadata", payload={"note": f"inside {key}"})
    last = store.append(A, sid, assistant(f"answer {key}"))
    terminal = store.anchor(A, sid, last.entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    return admission, terminal, closed.messages


def _answers(store: TranscriptStore, sid: str, keys: list[str]) -> list[Any]:
    """What the ledger answers for each key: the receipt's fields and the turn's messages."""
    def read(c: Any) -> list[Any]:
        out = []
        for key in keys:
            receipt = get_receipt(c, A, sid, E, key)
            assert receipt is not None, key
            out.append((receipt.model_dump(), committed_messages(c, A, sid, E, key)))
        return out
    return store.read(read)


def _stored(db: Database, columns: str = _STORED) -> list[tuple[Any, ...]]:
    with db.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(f"SELECT {columns} FROM ts_receipts ORDER BY advancement_key"))]


def _downgrade(db: Database, revision: str) -> None:
    cfg = migrate.alembic_config()
    with db.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def test_a_receipt_stores_seqs_not_ids_and_lists_them_only_for_a_range_with_gaps(store: TranscriptStore) -> None:
    """One commit on each path (one statement, transaction) and one turn with an event inside: the stored
    row holds the anchors' seqs, no entry ids, the list only for the gapped turn; the receipt still names
    the anchors' entry ids, its messages are the turn's, and a replay is a duplicate."""
    sid = store.create_session(A, session_id="s1").session_id
    turns = Turns(store)
    plain = _turn(store, sid, "k1")
    assert turns.commit_turn(E, "k1", *plain).status == "committed"  # one statement
    applied = _turn(store, sid, "k2")
    assert turns.commit_turn(E, "k2", *applied, apply=lambda *_: None).status == "committed"  # transaction
    gapped = _turn(store, sid, "k3", gap=True)
    assert turns.commit_turn(E, "k3", *gapped).status == "committed"  # the transaction decides
    seqs = {e.entry_id: e.seq for e in store.list_entries(A, sid)}

    def at(turn: tuple[Any, Any, list[Any]]) -> tuple[int, int]:
        return seqs[turn[0].anchor.entry_id], seqs[turn[1].entry_id]

    db = store.db
    k3 = at(gapped)
    assert _stored(db) == [
        ("k1", *at(plain), None, None, None),
        ("k2", *at(applied), None, None, None),
        ("k3", *k3, f"{k3[0]},{k3[0] + 1},{k3[1]}", None, None),  # the event's seq between is not listed
    ]
    answers = _answers(store, sid, ["k1", "k2", "k3"])
    for (receipt, messages), turn in zip(answers, (plain, applied, gapped), strict=True):
        ids = (receipt["admission_entry_id"], receipt["terminal_entry_id"])
        assert ids == (turn[0].anchor.entry_id, turn[1].entry_id)
        assert messages == turn[2] and receipt["message_count"] == 3
    for key, turn in (("k1", plain), ("k2", applied), ("k3", gapped)):
        replay = turns.commit_turn(E, key, *turn)
        assert replay.status == "duplicate" and replay.receipt.model_dump() == answers[int(key[1]) - 1][0]


def test_receipts_of_every_form_cross_revision_0017_both_ways_and_answer_the_same(store_url: str) -> None:
    """Receipts written at 0016 (ids and a seq list: a plain turn, a turn with an event inside; a pre-0005
    one with copies is 0005's own test) are converted by the upgrade (seqs, no ids, no list for a range)
    and answer exactly as before; one whose stored id is not its entry's keeps it; a receipt an earlier
    release's process writes after the upgrade (ids and a list, no seqs) is read too; and the downgrade
    gives back the rows 0016 had."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        sid = store.create_session(A, session_id="s1").session_id
        turns = Turns(store)
        plain, gapped, odd = _turn(store, sid, "k1"), _turn(store, sid, "k2", gap=True), _turn(store, sid, "k3")
        for key, turn in (("k1", plain), ("k2", gapped), ("k3", odd)):
            assert turns.commit_turn(E, key, *turn).status == "committed"
        answers = _answers(store, sid, ["k1", "k2", "k3"])
        db = Database(StoreConfig(url=store_url))
        try:
            _downgrade(db, "0016")
            old = _stored(db, _STORED_0016)
            seqs = {e.entry_id: e.seq for e in store.list_entries(A, sid)}
            # As 0016 wrote them: both ids, every message's seq.
            k1 = [seqs[plain[0].anchor.entry_id], seqs[plain[1].entry_id]]
            assert old[0] == ("k1", f"{k1[0]},{k1[0] + 1},{k1[1]}", plain[0].anchor.entry_id, plain[1].entry_id)
            with db.engine.begin() as conn:  # a stored id that is not the entry's (by hand): the upgrade keeps it
                conn.execute(text("UPDATE ts_receipts SET terminal_entry_id = 'by-hand' WHERE advancement_key = 'k3'"))
            migrate.upgrade(db)
            k2 = [seqs[gapped[0].anchor.entry_id], seqs[gapped[1].entry_id]]
            k3 = [seqs[odd[0].anchor.entry_id], seqs[odd[1].entry_id]]
            assert _stored(db) == [
                ("k1", *k1, None, None, None),
                ("k2", *k2, old[1][1], None, None),
                ("k3", *k3, None, None, "by-hand"),
            ]
            assert _answers(store, sid, ["k1", "k2"]) == answers[:2]
            assert _answers(store, sid, ["k3"])[0][0]["terminal_entry_id"] == "by-hand"
            with db.engine.begin() as conn:
                conn.execute(text("UPDATE ts_receipts SET terminal_entry_id = NULL WHERE advancement_key = 'k3'"))
                # What a process of the release before 0017, still running, writes: ids and the list.
                conn.execute(text(
                    "UPDATE ts_receipts SET admission_seq = NULL, terminal_seq = NULL, message_seqs = :l,"
                    " admission_entry_id = :a, terminal_entry_id = :t WHERE advancement_key = 'k1'"
                ), {"l": old[0][1], "a": old[0][2], "t": old[0][3]})
            assert _answers(store, sid, ["k1", "k2", "k3"]) == answers
            for key, turn in (("k1", plain), ("k2", gapped), ("k3", odd)):
                assert turns.commit_turn(E, key, *turn).status == "duplicate"
            _downgrade(db, "0016")
            assert _stored(db, _STORED_0016) == old
            migrate.upgrade(db)
        finally:
            db.dispose()
        assert _answers(store, sid, ["k1", "k2", "k3"]) == answers


# ---------------------------------------------------------------------------------------------- a large ledger
#: receipts of the ledger under test, each a turn of four messages
TURNS = 600


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
