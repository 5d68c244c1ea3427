"""The HTTP service's and the host's hardening (session 44), on both backends.

1. A host's compaction (``compaction.record_host_compaction``, the service's ``host_compaction``) took a
   summary of any size up to the request model's 4,000,000 characters, whatever the store's payload cap
   (an entry over it is ``PayloadTooLarge``), and stored it twice in the engine state (the pointer, and a
   copy under ``host_compaction`` that is read only once a later compaction names the host's by digest).
2. ``doctor`` said nothing of prepared statements off (a transaction-mode pooler) with the per-connection
   ``SET plan_cache_mode`` still on, which such a pooler leaves on whichever server connection it lent.
3. The host quarantined an engine for the process when its call failed with the store's database (a
   missing table: ``SchemaNotCurrent``; any other ``StoreUnavailable``), not the engine's own fault.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from conftest import PG_ADMIN
from hosting import RecordingModel
from service_process import ServiceProcess
from sqlalchemy import select
from test_pgbouncer_s43 import _missing, _program, start_bouncer

from transcript_store import StoreConfig, TranscriptStore, compaction
from transcript_store.errors import PayloadTooLarge, SchemaNotCurrent
from transcript_store.host import HostRuntime
from transcript_store.registry import EngineRegistry
from transcript_store.schema import engine_state
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

SCOPE = "scope-a"
CAP = 4096


def _state_values(store: TranscriptStore, sid: str) -> list[tuple[str, str]]:
    """The session's engine-state rows: (key, stored JSON text)."""
    return store.read(lambda c: [
        (str(r.key), str(r.value)) for r in c.conn.execute(
            select(engine_state.c.key, engine_state.c.value).where(
                engine_state.c.scope == SCOPE, engine_state.c.session_id == sid
            )
        )
    ])


def _record(store: TranscriptStore, sid: str, summary: str, position: int = 0, kept: str = "h0") -> Any:
    return store.write(lambda c: compaction.record_host_compaction(
        c, SCOPE, sid, summary=summary, first_kept_position=position, first_kept_entry_id=kept
    ))


def test_a_host_compaction_over_the_payload_cap_is_refused_and_writes_nothing(store_url: str) -> None:
    store = TranscriptStore(config=StoreConfig(url=store_url, max_payload_bytes=CAP))
    try:
        sid = store.create_session(SCOPE).session_id
        # Measured as stored (UTF-8), as an entry's payload is: 3,000 characters of two bytes each.
        with pytest.raises(PayloadTooLarge, match=f"cap of {CAP}"):
            _record(store, sid, "\u00e9" * 3000)
        assert _state_values(store, sid) == []
        assert compaction.load_pointer(store, SCOPE, sid) is None
        _record(store, sid, "x" * (CAP - 100))  # under the cap: taken
        assert compaction.load_pointer(store, SCOPE, sid)["summary"] == "x" * (CAP - 100)  # type: ignore[index]
    finally:
        store.close()


def test_a_host_compaction_is_stored_once_until_a_built_in_one_names_it(store: TranscriptStore) -> None:
    """The host's summary lives in the pointer; its copy is written only when a built-in compaction replaces
    the pointer with one that names the host's by digest (what ``_host_under_standing`` falls back to)."""
    sid = store.create_session(SCOPE).session_id
    long = " and so on" * 40
    for i in range(10):
        store.append(SCOPE, sid, {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}{long}"},
                     entry_id=f"h{i}")
    summary = "the host's own summary " + uuid.uuid4().hex
    _record(store, sid, summary, position=2, kept="h2")
    holding = [k for k, v in _state_values(store, sid) if summary in v]
    assert holding == [compaction.STATE_KEY]  # was: also under host_compaction, a second copy
    done = compaction.compact_session(store, SCOPE, sid, summarizer=ExtractiveSummarizer(),
                                      estimator=RoughEstimator(), keep_last=2, force=True)
    assert done.compacted
    rows = dict(_state_values(store, sid))
    assert json.loads(rows[compaction.HOST_KEY])["summary"] == summary  # the pointer names it by digest now
    stored = json.loads(rows[compaction.STATE_KEY])
    assert stored[compaction.HOST_UNDER]["summary_sha256"] == compaction._digest(summary)


@pytest.fixture
def http_server(store_url: str, tmp_path: Path) -> Any:
    with ServiceProcess(store_url, {"token-a-0123456789abcdef": SCOPE}, tmp_path / "serve.log",
                        env={"TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES": str(CAP)}) as proc:
        yield proc


def test_the_service_answers_413_for_a_host_summary_over_the_cap(http_server: ServiceProcess, store_url: str) -> None:
    token = "token-a-0123456789abcdef"
    status, data = http_server.call("POST", "/v1/sessions", token, {})
    assert status == 200, data
    sid = data["session_id"]
    path = f"/v1/engines/legacy/sessions/{sid}/host_compaction"
    status, data = http_server.call("POST", path, token,
                                    {"summary": "\u00e9" * 3000, "first_kept_position": 0, "first_kept_entry_id": "h0"})
    assert status == 413 and data["error"]["code"] == "payload_too_large", data
    store = TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False))
    try:
        assert [k for k, _ in _state_values(store, sid)] == []
    finally:
        store.close()
    status, data = http_server.call("POST", path, token,
                                    {"summary": "short", "first_kept_position": 0, "first_kept_entry_id": "h0"})
    assert status == 200, data


# ------------------------------------------------------------------------------------ doctor and the pooler


def _doctor(url: str, env: dict[str, str]) -> tuple[int, str]:
    from transcript_store.cli import cli

    result = CliRunner().invoke(cli, ["doctor", "--db", url], env={"TRANSCRIPT_STORE_CONFIG": "", **env})
    return result.exit_code, result.output


@pytest.mark.parametrize(("prepared", "generic", "warned"), [
    ("0", "1", True), ("0", "0", False), ("1", "1", False), ("1", "0", False),
])
def test_doctor_warns_of_the_per_connection_set_with_prepared_statements_off(
    store_url: str, prepared: str, generic: str, warned: bool
) -> None:
    code, out = _doctor(store_url, {"TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS": prepared,
                                    "TRANSCRIPT_STORE_PG_GENERIC_PLANS": generic})
    assert code == 0, out
    hit = [line for line in out.splitlines() if line.startswith("warning:") and "plan_cache_mode" in line]
    # Only PostgreSQL's connections run the SET: a SQLite store has nothing to warn of.
    expected = warned and store_url.startswith("postgresql")
    assert bool(hit) == expected, out
    if expected:
        assert "TRANSCRIPT_STORE_PG_GENERIC_PLANS=0" in hit[0] and "transaction" in hit[0]
    store = TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False,
                                               pg_prepared_statements=prepared == "1",
                                               pg_generic_plans=generic == "1"))
    try:
        assert ("warning" in store.db.settings()) == expected
    finally:
        store.close()


# ------------------------------------------------------------------------------------ quarantine


def _host(store: TranscriptStore) -> HostRuntime:
    return HostRuntime(store, load_settings(config_path=None, engine="lossless"), RecordingModel(),
                       registry=EngineRegistry(), summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())


def test_an_engine_whose_table_is_missing_is_not_quarantined(store: TranscriptStore) -> None:
    """The lossless engine's table renamed away (a real failure of the store's database, SchemaNotCurrent):
    the turn fails or runs on legacy, the engine is not isolated, and once the table is back it runs again."""
    sid = store.create_session(SCOPE).session_id
    host = _host(store)
    try:
        assert host.run_turn(SCOPE, sid, "first", turn_id="t1").engine_id == "lossless"
        store.write(lambda c: c.conn.exec_driver_sql("ALTER TABLE ts_lcm_messages RENAME TO ts_lcm_away"))
        try:
            out = host.run_turn(SCOPE, sid, "second", turn_id="t2")
            # Its assemble failed with the store's typed error: that turn ran on legacy, which needs no such table.
            assert out.engine_id == "legacy" and SchemaNotCurrent.__name__ in (out.degraded_reason or ""), out
            assert "lossless" not in host.quarantined  # was: quarantined for the life of the process
            with pytest.raises(SchemaNotCurrent):  # no legacy to fall back to: the typed error, to the caller
                host.compact(SCOPE, sid)
            assert "lossless" not in host.quarantined
        finally:
            store.write(lambda c: c.conn.exec_driver_sql("ALTER TABLE ts_lcm_away RENAME TO ts_lcm_messages"))
        out = host.run_turn(SCOPE, sid, "third", turn_id="t3")
        assert out.engine_id == "lossless" and out.degraded_reason is None, out
    finally:
        host.dispose()


def test_the_per_connection_set_leaks_to_the_poolers_other_clients(
    request: pytest.FixtureRequest, store_url: str, backend: str, tmp_path: Path
) -> None:
    """What doctor warns of, through a real PgBouncer in transaction mode (one server connection): the
    store's SET at its connect lands on the server connection the pooler lends for it, and stays there for
    the pooler's next client, which did not ask for it. Off (``pg_generic_plans=False``), nothing is left."""
    if backend == "sqlite":
        return  # no pooler, no SET
    if _program() is None:
        _missing(request, "the pgbouncer program is not installed")
    dbname = store_url.rsplit("/", 1)[1]
    bouncer = start_bouncer(tmp_path / "pgbouncer", 1, dbname)
    try:
        url = bouncer.url(store_url)
        server = psycopg.conninfo.conninfo_to_dict(PG_ADMIN)
        found = []
        for generic in (False, True):
            store = TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False, pool_size=1,
                                                       pg_prepared_statements=False, pg_generic_plans=generic))
            try:
                store.list_sessions(SCOPE)  # connects (and SETs, when on)
                with psycopg.connect(host="127.0.0.1", port=bouncer.port, user=server.get("user", "postgres"),
                                     dbname=dbname, autocommit=True) as other:
                    found.append(other.execute("SHOW plan_cache_mode").fetchone()[0])  # type: ignore[index]
            finally:
                store.close()
        assert found == ["auto", "force_generic_plan"]
    finally:
        bouncer.stop()


@pytest.mark.parametrize("bug", ["constraint", "syntax"])
def test_an_engines_own_sql_bug_still_quarantines_it(store: TranscriptStore, bug: str) -> None:
    """A database's failure is not the engine's (above), but an engine whose own statement is wrong (a
    constraint it breaks, SQL the database cannot parse) fails the same way every turn: that is the
    engine's fault, and it is isolated as DESIGN.md's quarantine says, not tried turn after turn."""
    from hosting import CountingEngine

    class Buggy(CountingEngine):
        def assemble(self, **kw: Any) -> Any:
            def run(c: Any) -> None:
                if bug == "syntax":
                    c.conn.exec_driver_sql("SELEC 1")
                else:  # a key it inserts twice
                    c.conn.exec_driver_sql("CREATE TEMPORARY TABLE IF NOT EXISTS buggy_t (k INTEGER PRIMARY KEY)")
                    c.conn.exec_driver_sql("INSERT INTO buggy_t VALUES (1)")
                    c.conn.exec_driver_sql("INSERT INTO buggy_t VALUES (1)")
            store.write(run)

    registry = EngineRegistry()
    registry.register_factory("buggy", lambda ctx: Buggy(ctx, "buggy"))
    host = HostRuntime(store, load_settings(config_path=None, engine="buggy"), RecordingModel(), registry=registry,
                       summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())
    sid = store.create_session(SCOPE).session_id
    try:
        out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
        assert out.engine_id == "legacy", out
        assert host.quarantined["buggy"][0] == "assemble"
    finally:
        host.dispose()
