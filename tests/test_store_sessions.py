"""Sessions and scopes: identity, session keys, scope isolation, and the schema a store opens on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from transcript_store import (
    Anchor,
    IdempotencyConflict,
    InvalidInput,
    SchemaNotCurrent,
    SessionKeyConflict,
    SessionReplaced,
    StoreConfig,
    TranscriptStore,
    UnknownSession,
)
from transcript_store.migrate import head_revision

A, B = "scope-a", "scope-b"
KEY = "agent:main:telegram:42"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------------------------------------- identity


def test_create_session_generates_an_id_and_starts_empty(store: TranscriptStore) -> None:
    info = store.create_session(A)
    assert info.session_id
    assert info.scope == A
    assert info.session_key is None
    assert (info.generation, info.head_entry_id, info.entry_count, info.visible_count) == (0, None, 0, 0)
    assert info.active is True
    assert info.created_at.tzinfo is not None
    assert store.create_session(A).session_id != info.session_id
    assert store.get_session(A, info.session_id) == info


def test_create_session_with_same_id_and_key_is_idempotent(store: TranscriptStore) -> None:
    first = store.create_session(A, session_id="s1", session_key=KEY)
    store.append(A, "s1", user("hi"))
    again = store.create_session(A, session_id="s1", session_key=KEY)
    assert again.session_id == "s1"
    assert again.entry_count == 1
    assert again.created_at == first.created_at
    assert [s.session_id for s in store.list_sessions(A)] == ["s1"]


def test_create_session_with_same_id_and_other_key_conflicts(store: TranscriptStore) -> None:
    store.create_session(A, session_id="s1", session_key=KEY)
    with pytest.raises(IdempotencyConflict):
        store.create_session(A, session_id="s1", session_key="other")
    with pytest.raises(IdempotencyConflict):
        store.create_session(A, session_id="s1")
    assert store.get_session(A, "s1").session_key == KEY


def test_one_active_session_per_scope_and_key(store: TranscriptStore) -> None:
    store.create_session(A, session_id="s1", session_key=KEY)
    with pytest.raises(SessionKeyConflict):
        store.create_session(A, session_id="s2", session_key=KEY)
    with pytest.raises(UnknownSession):
        store.get_session(A, "s2")
    # The same key in another scope is another namespace.
    assert store.create_session(B, session_id="s2", session_key=KEY).scope == B
    # Sessions without a key never conflict.
    store.create_session(A, session_id="s3")
    store.create_session(A, session_id="s4")


def test_end_session_frees_the_key_and_keeps_the_entries(store: TranscriptStore) -> None:
    store.create_session(A, session_id="s1", session_key=KEY)
    store.append(A, "s1", user("old"))
    ended = store.end_session(A, "s1")
    assert ended.active is False
    assert store.find_session(A, KEY) is None
    successor = store.create_session(A, session_id="s2", session_key=KEY)
    assert successor.active is True
    assert store.find_session(A, KEY) == store.get_session(A, "s2")
    assert store.open_session(A, KEY).session_id == "s2"
    # The ended session still reads; its key is not active any more.
    assert [e.message for e in store.read_visible(A, "s1")] == [user("old")]
    with pytest.raises(SessionKeyConflict):
        store.create_session(A, session_id="s3", session_key=KEY)


def test_open_session_returns_the_active_holder_or_creates_one(store: TranscriptStore) -> None:
    first = store.open_session(A, KEY)
    assert first.session_key == KEY
    assert store.open_session(A, KEY).session_id == first.session_id
    assert store.find_session(A, KEY) == first
    assert store.find_session(A, "nobody") is None
    other = store.open_session(B, KEY)
    assert other.session_id != first.session_id and other.scope == B


def test_list_sessions_pages_in_id_order_within_the_scope(store: TranscriptStore) -> None:
    for sid in ("c", "a", "b", "d"):
        store.create_session(A, session_id=sid)
    store.create_session(B, session_id="zz")
    assert [s.session_id for s in store.list_sessions(A)] == ["a", "b", "c", "d"]
    assert [s.session_id for s in store.list_sessions(A, limit=2)] == ["a", "b"]
    assert [s.session_id for s in store.list_sessions(A, after="b", limit=2)] == ["c", "d"]
    assert [s.session_id for s in store.list_sessions(B)] == ["zz"]
    for bad in (0, 10_001, -1, True):
        with pytest.raises(ValueError):
            store.list_sessions(A, limit=bad)


def test_delete_session_removes_it_and_its_entries(store: TranscriptStore) -> None:
    store.create_session(A, session_id="s1", session_key=KEY)
    store.append(A, "s1", user("bye"))
    store.create_session(A, session_id="keep")
    store.append(A, "keep", user("stay"))
    store.delete_session(A, "s1")
    with pytest.raises(UnknownSession):
        store.get_session(A, "s1")
    assert store.find_session(A, KEY) is None
    fresh = store.create_session(A, session_id="s1", session_key=KEY)
    assert fresh.entry_count == 0 and store.read_visible(A, "s1") == []
    assert [e.message for e in store.read_visible(A, "keep")] == [user("stay")]


def test_delete_session_of_an_incarnation_spares_a_session_made_again(store: TranscriptStore) -> None:
    """``incarnation`` deletes the session a caller looked up, or nothing: a session deleted and made again
    under the id since is another's, refused as unknown (SessionReplaced) and left whole."""
    looked_up = store.create_session(A, session_id="s1", session_key=KEY)
    store.append(A, "s1", user("old"))
    store.delete_session(A, "s1")
    store.create_session(A, session_id="s1", session_key=KEY)
    store.append(A, "s1", user("new"))
    with pytest.raises(SessionReplaced) as refused:
        store.delete_session(A, "s1", incarnation=looked_up.incarnation)
    assert isinstance(refused.value, UnknownSession) and "made again" in str(refused.value)
    assert [e.message for e in store.read_visible(A, "s1")] == [user("new")]
    for bad in (True, "1", 1.0, -1, 2**63, 2**70):
        with pytest.raises(InvalidInput):
            store.delete_session(A, "s1", incarnation=bad)  # type: ignore[arg-type]
    now = store.get_session(A, "s1")
    deleted = store.delete_session(A, "s1", incarnation=now.incarnation)
    assert deleted.incarnation == now.incarnation and deleted.entry_count == 1
    with pytest.raises(UnknownSession):
        store.get_session(A, "s1")


def test_session_bytes_sums_every_stored_entry(store: TranscriptStore) -> None:
    store.create_session(A, session_id="s1")
    assert store.session_bytes(A, "s1") == 0
    entries = [store.append(A, "s1", user("a")), store.append(A, "s1", kind="custom", payload={"x": 1})]
    store.branch(A, "s1", None)
    entries.append(store.append(A, "s1", user("off the first branch")))
    assert store.session_bytes(A, "s1") == sum(e.size_bytes for e in entries)


# ---------------------------------------------------------------------------------------------- scopes

Op = Callable[[TranscriptStore, str, str, dict[str, Any]], Any]


def _forged(anchor: Anchor, scope: str) -> Anchor:
    return anchor.model_copy(update={"scope": scope})


SCOPED_OPS: dict[str, Op] = {
    "get_session": lambda s, sc, sid, f: s.get_session(sc, sid),
    "session_bytes": lambda s, sc, sid, f: s.session_bytes(sc, sid),
    "end_session": lambda s, sc, sid, f: s.end_session(sc, sid),
    "delete_session": lambda s, sc, sid, f: s.delete_session(sc, sid),
    "append": lambda s, sc, sid, f: s.append(sc, sid, user("intruder")),
    "append_idempotent": lambda s, sc, sid, f: s.append(sc, sid, user("x"), idempotency_key="k1"),
    "append_same_entry_id": lambda s, sc, sid, f: s.append(sc, sid, user("first"), entry_id=f["first"]),
    "append_event": lambda s, sc, sid, f: s.append(sc, sid, kind="metadata", payload={"a": 1}),
    "append_many": lambda s, sc, sid, f: s.append_many(sc, sid, [{"message": user("x")}]),
    "admit": lambda s, sc, sid, f: s.admit(sc, sid, user("turn"), turn_id="t1"),
    "anchor": lambda s, sc, sid, f: s.anchor(sc, sid, f["first"]),
    "read_visible_delta": lambda s, sc, sid, f: s.read_visible_delta(sc, sid),
    "read_visible_delta_cursor": lambda s, sc, sid, f: s.read_visible_delta(sc, sid, f["cursor"]),
    "read_visible_delta_fence": lambda s, sc, sid, f: s.read_visible_delta(sc, sid, fence=f["fence"]),
    "read_visible": lambda s, sc, sid, f: s.read_visible(sc, sid),
    "read_visible_fence": lambda s, sc, sid, f: s.read_visible(sc, sid, fence=f["fence"]),
    "get_entries": lambda s, sc, sid, f: s.get_entries(sc, sid, [f["first"]]),
    "list_entries": lambda s, sc, sid, f: s.list_entries(sc, sid),
    "branch": lambda s, sc, sid, f: s.branch(sc, sid, f["first"]),
    "branch_none": lambda s, sc, sid, f: s.branch(sc, sid, None),
    "rewrite_entries": lambda s, sc, sid, f: s.rewrite_entries(
        sc, sid, [{"entry_id": f["first"], "message": user("changed")}]
    ),
    "read_closed_range": lambda s, sc, sid, f: s.read_closed_range(f["fence"], f["terminal"]),
}


def _outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        result = fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return "ok", repr(result)


def test_another_scopes_session_behaves_exactly_like_an_unknown_one(store: TranscriptStore) -> None:
    store.create_session(A, session_id="s1", session_key=KEY)
    first = store.append(A, "s1", user("secret"), idempotency_key="k1")
    admission = store.admit(A, "s1", user("turn"), turn_id="t1")
    reply = store.append(A, "s1", assistant("reply"))
    cursor = store.read_visible_delta(A, "s1").cursor  # type: ignore[union-attr]
    before = (store.list_entries(A, "s1"), store.get_session(A, "s1"))
    # Every id, cursor and anchor of scope A's session, presented under scope B.
    forged = {
        "first": first.entry_id,
        "cursor": cursor,
        "fence": _forged(admission.anchor, B),
        "terminal": _forged(store.anchor(A, "s1", reply.entry_id), B),
    }
    seen_from_b = {}
    for name, op in SCOPED_OPS.items():
        seen_from_b[name] = _outcome(lambda op=op: op(store, B, "s1", forged))
        assert seen_from_b[name][0] != "ok" or "secret" not in seen_from_b[name][1], name
        assert (store.list_entries(A, "s1"), store.get_session(A, "s1")) == before, name
    assert store.list_sessions(B) == []
    # Now make s1 truly unknown: scope B must have seen exactly that.
    store.delete_session(A, "s1")
    for name, op in SCOPED_OPS.items():
        assert _outcome(lambda op=op: op(store, B, "s1", forged)) == seen_from_b[name], name


def test_keys_and_ids_of_another_scope_are_not_visible(store: TranscriptStore) -> None:
    store.create_session(A, session_id="s1", session_key=KEY)
    assert store.find_session(B, KEY) is None
    # Creating the same id and key in scope B neither conflicts nor returns scope A's session.
    mine = store.create_session(B, session_id="s1", session_key=KEY)
    assert mine.scope == B and mine.entry_count == 0
    store.append(A, "s1", user("a's"))
    assert store.read_visible(B, "s1") == []
    store.append(B, "s1", user("b's"))
    assert [e.message for e in store.read_visible(A, "s1")] == [user("a's")]
    assert [e.message for e in store.read_visible(B, "s1")] == [user("b's")]
    store.delete_session(B, "s1")
    assert [e.message for e in store.read_visible(A, "s1")] == [user("a's")]


# ---------------------------------------------------------------------------------------------- schema


def test_a_fresh_sqlite_path_is_created_at_head(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "fresh.db"
    with TranscriptStore(f"sqlite:///{path}") as s:
        assert s.current_revision() == head_revision()
        assert s.backend == "sqlite"
        s.create_session(A, session_id="s1")
    # Reopening an existing, current file keeps its data.
    with TranscriptStore(f"sqlite:///{path}") as s:
        assert s.get_session(A, "s1").session_id == "s1"


def test_sqlite_without_auto_upgrade_refuses_an_empty_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    with pytest.raises(SchemaNotCurrent):
        TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))
    assert TranscriptStore.upgrade_url(url) == head_revision()
    with TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False)) as s:
        assert s.current_revision() == head_revision()


def test_a_schema_newer_than_the_library_is_refused(store_url: str) -> None:
    TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)).close()
    raw = TranscriptStore(store_url, create=False)
    with raw.db.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'ffff_from_the_future'"))
    raw.close()
    for auto in (False, True):
        with pytest.raises(SchemaNotCurrent, match="newer"):
            TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=auto))


def test_postgresql_without_schema_is_refused_until_upgraded(request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("pg_template")  # skips (loudly) when PostgreSQL is unreachable
    from conftest import PG_ADMIN, RUN_ID, pg_url

    name = f"ts_empty_{RUN_ID}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    try:
        url = pg_url(name)
        for config in (StoreConfig(url=url), StoreConfig(url=url, auto_upgrade=False)):
            with pytest.raises(SchemaNotCurrent, match="none"):
                TranscriptStore(config=config)
        # Refusing did not create anything.
        with psycopg.connect(PG_ADMIN, dbname=name, autocommit=True) as conn:
            tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()
            assert tables == (0,)
        assert TranscriptStore.upgrade_url(url) == head_revision()
        with TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False)) as s:
            assert s.backend == "postgresql"
            assert s.current_revision() == head_revision()
            s.create_session(A, session_id="s1")
            assert s.get_session(A, "s1").generation == 0
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_large_import_refreshes_postgresql_statistics(store: TranscriptStore, backend: str) -> None:
    """Before its first ANALYZE, PostgreSQL plans a long session's reads with a filter scan (bench/README.md)."""
    from transcript_store.store import ANALYZE_AFTER_IMPORT

    sid = store.create_session("scope-a", session_id="big").session_id
    n = ANALYZE_AFTER_IMPORT
    store.append_many("scope-a", sid, [{"message": {"role": "user", "content": f"m{i}"}} for i in range(n)])
    header, records = store.export_session("scope-a", sid)
    store.delete_session("scope-a", sid)
    if backend == "postgresql":
        store.db.write(lambda conn: conn.exec_driver_sql("SELECT pg_stat_reset()"))
    store.import_session("scope-a", header, records)
    assert store.get_session("scope-a", sid).visible_count == n
    if backend == "postgresql":

        def analyzed(conn: Any) -> Any:
            return conn.exec_driver_sql(
                "SELECT last_analyze IS NOT NULL FROM pg_stat_user_tables WHERE relname = 'ts_entries'"
            ).scalar()

        assert store.db.read(analyzed) is True


def test_concurrent_open_session_of_one_key_all_get_the_one_session(store: TranscriptStore) -> None:
    """Workers opening the same key at once (the host, the service and Hermes all do) each get the
    session one of them created, never SessionKeyConflict: on PostgreSQL the losing inserts wait for
    the winner and then find its row."""
    import threading

    keys = [f"agent:main:race:{k}" for k in range(12)]
    results: dict[str, list[str]] = {k: [] for k in keys}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        try:
            for key in keys:
                barrier.wait(timeout=30)
                results[key].append(store.open_session(A, key).session_id)
        except BaseException as e:  # reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for key, ids in results.items():
        assert len(ids) == 4 and len(set(ids)) == 1, (key, ids)
        assert store.find_session(A, key).session_id == ids[0]
    assert len(store.list_sessions(A, limit=100)) == len(keys)


def test_open_session_whose_racing_holder_ended_at_once_creates_one(
    store: TranscriptStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving the threads above rarely hit: the lookup finds no holder, another open creates
    one (the insert conflicts), and it is ended before the second lookup. That raised SessionKeyConflict
    from a call documented to find or create. The lookup is steered to stand for the first two steps."""
    from transcript_store.core import Core

    if store.db.dialect.is_sqlite:
        pytest.skip("SQLite runs one writer at a time: no holder can be ended inside the open")
    holder = store.open_session(A, KEY)
    real = Core.find_session_by_key
    calls = [0]

    def lookup(self: Core, scope: str, key: str) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return None  # before the holder's commit
        if calls[0] == 2:
            store.end_session(A, holder.session_id)  # another connection ends it meanwhile
        return real(self, scope, key)

    monkeypatch.setattr(Core, "find_session_by_key", lookup)
    opened = store.open_session(A, KEY)
    monkeypatch.undo()
    assert opened.session_id != holder.session_id and opened.active
    assert store.find_session(A, KEY) == opened
