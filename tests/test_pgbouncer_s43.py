"""PostgreSQL behind a real PgBouncer in *transaction* pool mode.

Such a pooler hands a client another server connection at each transaction. psycopg prepares a statement run
five times on its connection under a name of its own (``_pg3_0``, ...), and PgBouncer before 1.21 passes that
through: the next transaction's server connection lacks the statement ("prepared statement "_pg3_0" does not
exist") or holds another client's of the same name ("already exists"), a ``StoreUnavailable`` that no retry
cures. ``pg_prepared_statements=False`` (``TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS=0``) prepares nothing.

Each test starts its own ``pgbouncer`` (Debian's package; ``make pgbouncer`` installs it) on a free port, with
its own ini file in a temporary folder, and stops it after. Without the program a local run skips LOUDLY;
with CI=true it is a failure.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from conftest import PG_ADMIN, _admin_exec, banner, pg_url, under_ci
from hosting import RecordingModel
from workers.turn_worker import ENGINE, SCOPE, counting_engine, replies, user_message

from transcript_store import DeltaPage, InvalidInput, StoreConfig, StoreUnavailable, TranscriptStore
from transcript_store.host import HostRuntime
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

#: the program, where Debian's package puts it (/usr/sbin is not on every user's PATH)
PROGRAM_PLACES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")


def _program() -> str | None:
    return shutil.which("pgbouncer") or next((p for p in PROGRAM_PLACES if os.access(p, os.X_OK)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _missing(request: pytest.FixtureRequest, problem: str) -> None:
    """Fail under CI; else skip with a banner no one can miss (the pooler would go untested)."""
    if under_ci():
        pytest.fail(f"CI=true and {problem}: the pooler tests cannot run (`make pgbouncer` installs it)")
    message = f"THE PGBOUNCER TESTS ARE SKIPPED: {problem} (`make pgbouncer` installs it)"
    banner(request, message)
    sys.stderr.write(f"\n!!! {message} !!!\n")
    pytest.skip(message)


@dataclass
class Bouncer:
    """A running pgbouncer of this test: its port, and the URL of a database behind it."""

    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def url(self, direct_url: str) -> str:
        """``direct_url`` (a database on the test server) through this pooler."""
        user, rest = direct_url.split("://", 1)[1].split("@", 1)
        return f"postgresql+psycopg://{user}@127.0.0.1:{self.port}/{rest.split('/', 1)[1]}"

    def stop(self) -> None:
        """Stop it (SIGTERM: at once), closing its server connections."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_bouncer(folder: Path, pool_size: int, dbname: str) -> Bouncer:
    """A pgbouncer in transaction mode in front of the test server, ``pool_size`` server connections per
    database and user, answering once it connects ``dbname``."""
    program = _program()
    assert program is not None
    server = psycopg.conninfo.conninfo_to_dict(PG_ADMIN)
    host, port, user = server.get("host", "127.0.0.1"), server.get("port", "5432"), server.get("user", "postgres")
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)  # readable by the account it runs as, when started as root
    (folder / "users.txt").write_text(f'"{user}" ""\n', encoding="utf-8")
    for attempt in range(3):
        listen = _free_port()
        ini = folder / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host={host} port={port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
            f"pool_mode = transaction\ndefault_pool_size = {pool_size}\nmax_client_conn = 200\n",
            encoding="utf-8",
        )
        for f in folder.iterdir():
            os.chmod(f, 0o644)
        # PgBouncer refuses to run as root ("should not run as root"): as postgres (or nobody) then.
        as_user: list[str] = []
        if os.geteuid() == 0:
            names = [n for n in ("postgres", "nobody") if _account(n)]
            assert names, "running as root, and there is neither a postgres nor a nobody account to run pgbouncer as"
            as_user = ["-u", names[0]]
        log = folder / f"pgbouncer-{attempt}.log"
        with log.open("wb") as out:
            process = subprocess.Popen([program, *as_user, str(ini)], stdout=out, stderr=subprocess.STDOUT)
        bouncer = Bouncer(listen, process, log)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with psycopg.connect(host="127.0.0.1", port=listen, user=user, dbname=dbname, connect_timeout=2,
                                     autocommit=True) as conn:
                    conn.execute("SELECT 1")
                return bouncer
            except psycopg.OperationalError:
                time.sleep(0.05)
        bouncer.stop()
        if attempt == 2 or "Address already in use" not in log.read_text(errors="replace"):
            pytest.fail(f"pgbouncer did not start:\n{log.read_text(errors='replace')[-3000:]}")
    raise AssertionError("unreachable")


def _account(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.fixture
def bouncer_program(request: pytest.FixtureRequest, backend: str) -> str | None:
    """The pgbouncer program (PostgreSQL only); a loud skip locally, a failure under CI, when it is missing."""
    if backend == "sqlite":
        return None
    program = _program()
    if program is None:
        _missing(request, "the pgbouncer program is not installed")
    return program


# ------------------------------------------------------------------------------------------------- work


TURNS = 8


def store_work(url: str, sid: str, *, prepared: bool, errors: list[str]) -> None:
    """A gateway worker's turns in its own store: admission, completion (fast path, or queued and drained),
    an append after each turn, and a delta read following its cursor. Anything that fails goes to
    ``errors``; the delta reads must see every entry the session holds."""
    # As the README says to run behind such a pooler: the per-connection SET off too (with prepared statements
    # off it plans nothing once; through the pooler it would stay on a server connection for its other clients).
    config = StoreConfig(url=url, auto_upgrade=False, pool_size=2, pg_prepared_statements=prepared,
                         pg_generic_plans=prepared)
    try:
        with TranscriptStore(config=config) as store:
            turns = Turns(store)
            store.create_session(SCOPE, session_id=sid)
            cursor: str | None = None
            seen: list[str] = []
            for n in range(TURNS):
                turn_id = f"{sid}.t{n}"
                turns.admit(SCOPE, sid, user_message(turn_id), turn_id=turn_id, engine_id=ENGINE)
                fast = n % 3 != 2
                done = turns.complete(SCOPE, sid, turn_id, replies(turn_id), counting_engine if fast else None)
                if done.fast_path_error is not None:  # said in the log only: the turn waits for a drain
                    errors.append(f"{turn_id}: fast path: {done.fast_path_error}")
                if not fast:
                    turns.drain(lambda _engine: counting_engine, scope=SCOPE, session_id=sid)
                store.append(SCOPE, sid, {"role": "user", "content": f"note {n}"}, entry_id=f"{turn_id}.note")
                page = store.read_visible_delta(SCOPE, sid, cursor)
                assert isinstance(page, DeltaPage), page
                seen += [e.entry_id for e in page.entries]
                cursor = page.cursor
            assert seen == [e.entry_id for e in store.read_visible(SCOPE, sid)]
            receipts = turns.receipts(SCOPE, sid, ENGINE)
            assert [r.advancement_key for r in receipts] == [f"{sid}.t{n}" for n in range(TURNS)]
    except Exception as e:  # every thread's failure, each said: not the first one's alone
        errors.append(f"{sid}: {type(e).__name__}: {e}")


def host_work(url: str, sid: str, *, prepared: bool, errors: list[str]) -> None:
    """Whole logical turns of a ``HostRuntime`` on the lossless engine (its own statements: the import at a
    commit, assembly, maintenance) in its own store; each must commit on the engine, none quarantine it."""
    config = StoreConfig(url=url, auto_upgrade=False, pool_size=2, pg_prepared_statements=prepared,
                         pg_generic_plans=prepared)
    try:
        with TranscriptStore(config=config) as store:
            host = HostRuntime(store, load_settings(config_path=None, engine="lossless"), RecordingModel(),
                               registry=EngineRegistry(), summarizer=ExtractiveSummarizer(),
                               estimator=RoughEstimator())
            try:
                store.create_session(SCOPE, session_id=sid)
                for n in range(TURNS):
                    out = host.run_turn(SCOPE, sid, f"question {n}", turn_id=f"{sid}.t{n}")
                    if (out.engine_id, out.commit_status) != ("lossless", "committed"):
                        errors.append(f"{sid}.t{n}: {out.engine_id} {out.commit_status} {out.degraded_reason}")
                if host.quarantined:
                    errors.append(f"{sid}: quarantined {sorted(host.quarantined)}")
            finally:
                host.dispose()
    except Exception as e:
        errors.append(f"{sid}: {type(e).__name__}: {e}")


def run_workers(url: str, workers: int, *, prepared: bool) -> list[str]:
    """``workers`` threads doing ``store_work`` and ``workers`` doing ``host_work``, each with its own store
    (two pooled connections)."""
    errors: list[str] = []
    threads = [threading.Thread(target=work, args=(url, f"{name}{i}"), kwargs={"prepared": prepared,
                                                                              "errors": errors})
               for i in range(workers) for work, name in ((store_work, "w"), (host_work, "h"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    return errors


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "not-prepared"])
def test_two_stores_on_one_server_connection(
    bouncer_program: str | None, store_url: str, backend: str, tmp_path: Path, prepared: bool
) -> None:
    """Two stores behind one server connection (``default_pool_size = 1``) read the same delta page eight
    times each: with prepared statements both name theirs ``_pg3_0`` on that connection, and the second is
    refused ("already exists"); with ``pg_prepared_statements=False`` both read. The failing half shows the
    test reaches the problem the setting is for. SQLite has no pooler: the setting changes nothing there."""
    url = store_url
    bouncer = None
    if backend == "postgresql":
        bouncer = start_bouncer(tmp_path / "pgbouncer", 1, store_url.rsplit("/", 1)[1])
        url = bouncer.url(store_url)
    try:
        stores = [TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False, pool_size=1,
                                                     pg_prepared_statements=prepared)) for _ in range(2)]
        try:
            stores[0].create_session(SCOPE, session_id="s")
            stores[0].append_many(SCOPE, "s", replies("s.t0"))
            failures: list[str] = []
            for store in stores:
                for _ in range(8):
                    try:
                        page = store.read_visible_delta(SCOPE, "s")
                    except StoreUnavailable as e:
                        failures.append(str(e))
                        break
                    assert isinstance(page, DeltaPage) and page.entries
            settings = stores[0].db.settings()
        finally:
            for store in stores:
                store.close()
    finally:
        if bouncer is not None:
            bouncer.stop()
    if backend == "sqlite":
        assert failures == [] and "prepared_statements" not in settings
    elif prepared:
        assert failures and "prepared statement" in failures[0], failures
        assert settings["prepared_statements"] == "after 5 runs of a statement on a connection"
    else:
        assert failures == []
        assert settings["prepared_statements"] == "off"


def test_turns_reads_and_appends_through_a_transaction_pooler(
    bouncer_program: str | None, store_url: str, backend: str, tmp_path: Path
) -> None:
    """Six workers, each with its own store of two connections, behind two server connections: turns on the
    fast path and through the drain, appends and delta reads all land and read back, and a host's turns
    commit on the lossless engine, with
    ``pg_prepared_statements=False`` and ``pg_generic_plans=False``, as the README says to run there."""
    url = store_url
    bouncer = None
    if backend == "postgresql":
        bouncer = start_bouncer(tmp_path / "pgbouncer", 2, store_url.rsplit("/", 1)[1])
        url = bouncer.url(store_url)
    try:
        errors = run_workers(url, 3, prepared=False)
    finally:
        if bouncer is not None:
            bouncer.stop()
    assert errors == []


def test_init_and_upgrade_through_a_transaction_pooler(
    backend: str, bouncer_program: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``init`` and ``upgrade`` are one transaction (their advisory lock is the transaction's), so they may go
    through the pooler too, with the setting in the environment as the CLI reads it: an empty database is made
    a store through it, then used through it."""
    monkeypatch.setenv("TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS", "0")
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
        assert TranscriptStore.upgrade_url(url) == TranscriptStore.upgrade_url(url)
        return
    name = f"ts_pgb_{os.getpid()}_{time.monotonic_ns() % 10**9}"
    _admin_exec(f"CREATE DATABASE {name}")
    bouncer = start_bouncer(tmp_path / "pgbouncer", 2, name)
    try:
        url = bouncer.url(pg_url(name))
        head = TranscriptStore.upgrade_url(url)
        assert TranscriptStore.upgrade_url(url) == head  # the second finds the schema current
        with TranscriptStore(url) as store:
            assert store.config.pg_prepared_statements is False
            assert store.current_revision() == head
            store.create_session(SCOPE, session_id="s")
            for n in range(8):
                store.append(SCOPE, "s", {"role": "user", "content": f"m{n}"})
                assert len(store.read_visible(SCOPE, "s")) == n + 1
    finally:
        bouncer.stop()
        _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


# -------------------------------------------------------------------------------------------- settings


def test_the_setting_reads_its_environment_variable_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default; the boolean words of the other settings, another word refused naming the variable."""
    monkeypatch.delenv("TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS", raising=False)
    assert StoreConfig.from_env().pg_prepared_statements is True
    for word, expected in [("0", False), ("off", False), ("No", False), ("1", True), ("ON", True)]:
        monkeypatch.setenv("TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS", word)
        assert StoreConfig.from_env().pg_prepared_statements is expected, word
        assert StoreConfig.from_env(pg_prepared_statements=not expected).pg_prepared_statements is (not expected)
    for word in ("maybe", "2", "none"):
        monkeypatch.setenv("TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS", word)
        with pytest.raises(InvalidInput, match="TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS"):
            StoreConfig.from_env()


def test_psycopgs_prepare_threshold_in_the_url_names_the_setting() -> None:
    """libpq knows no ``prepare_threshold``: the URL is refused before connecting, with the setting to use."""
    with pytest.raises(InvalidInput, match="TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS=0"):
        TranscriptStore("postgresql://postgres@127.0.0.1:1/x?prepare_threshold=0")
