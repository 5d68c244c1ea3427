"""Fault campaign: the PostgreSQL server itself crashes, under a multi-process load of full turns.

A private cluster (``initdb`` in a temporary folder, its own port; the shared server is never touched)
serves the load while the test stops it with ``pg_ctl stop -m immediate`` (every backend killed at once,
no checkpoint: the next start replays the WAL, as after a power cut) and starts it again, several times.
Whatever a worker's call was doing at that instant goes with its connection, a COMMIT that landed with
its answer included: the store retries the whole transaction; a call the outage outlasts gives up with
``StoreUnavailable`` and its worker goes on as a gateway does (the session's unfinished turn again).
After the last restart: every acknowledged turn is committed exactly once, no turn is partial, every
engine state equals its receipts (``verify_turns``), and ``pg_amcheck`` finds every table and index whole
(data checksums on).

Without PostgreSQL's server programs (``initdb``, ``pg_ctl``) the test skips loudly; with CI=true it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import under_ci
from workers.fault_worker import WORKER, clean_env, read_acks, report, verify_turns
from workers.turn_worker import replies

from transcript_store import TranscriptStore


def server_programs() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: Debian keeps them off PATH, one folder per major version."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    if found:
        return found[-1].parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


class Cluster:
    """A throwaway PostgreSQL cluster: its own data folder, socket folder and TCP port on 127.0.0.1."""

    def __init__(self, bindir: Path, folder: Path, port: int, as_user: str | None) -> None:
        self.bindir, self.folder, self.port, self.as_user = bindir, folder, port, as_user
        self.data = folder / "data"
        self.crashes = 0

    def _run(self, program: str, *args: str, timeout: float = 120.0) -> None:
        # initdb and the server refuse to run as root: as root, they run as the postgres account.
        command = [str(self.bindir / program), *args]
        if self.as_user is not None:
            command = ["runuser", "-u", self.as_user, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=self.folder)
        if done.returncode != 0:
            server_log = self.folder / "server.log"
            log = server_log.read_text(errors="replace")[-3000:] if server_log.exists() else ""
            raise AssertionError(f"{program} {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}\n{log}")

    def init(self) -> None:
        """initdb with data checksums (a torn page after a crash would fail its read), trust on 127.0.0.1."""
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--data-checksums", "--no-sync")

    def start(self) -> None:
        """Start the server and wait until it accepts connections (after a crash: once the WAL is replayed)."""
        options = (f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=on"
                   " -c synchronous_commit=on -c full_page_writes=on -c shared_buffers=16MB -c max_connections=40"
                   " -c recovery_init_sync_method=syncfs")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "server.log"), "-o", options, "-w",
                  "-t", "60", "start")

    def crash(self) -> None:
        """Stop the server the hard way: SIGQUIT to every process, no checkpoint, no goodbye to clients."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        self.crashes += 1

    def amcheck(self, dbname: str) -> subprocess.CompletedProcess[str]:
        """pg_amcheck of one database: every heap page (checksums included) and every B-tree index, with
        each index checked against its table's rows."""
        return subprocess.run(
            [str(self.bindir / "pg_amcheck"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
             "--install-missing", "--heapallindexed", "--parent-check", dbname],
            capture_output=True, text=True, timeout=300,
        )

    def url(self, dbname: str) -> str:
        """A store URL of one database of this cluster."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{dbname}"

    def admin(self, sql: str) -> None:
        """Run one statement on the cluster's postgres database, autocommit."""
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(sql)


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: the server binds it again at every restart, and
    a port from that range could meanwhile be taken as the local end of some process's outgoing
    connection (the reconnecting workers make hundreds)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1025, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A private cluster for this test, removed after it."""
    bindir = server_programs()
    as_user: str | None = None
    problem = None if bindir is not None else "PostgreSQL's server programs (pg_ctl, initdb) are not installed"
    if problem is None and os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
            as_user = "postgres"
        except KeyError:
            problem = "running as root, and there is no postgres account to run initdb as"
    if problem is not None:
        if under_ci():
            pytest.fail(f"CI=true: {problem}")
        sys.stderr.write(f"\n!!! SKIPPED the server-crash test: {problem} !!!\n")
        pytest.skip(problem)
    assert bindir is not None
    folder = Path(tempfile.mkdtemp(prefix="ts_pgcrash_"))
    if as_user is not None:
        account = pwd.getpwnam(as_user)
        os.chown(folder, account.pw_uid, account.pw_gid)
    os.chmod(folder, 0o700)
    made = Cluster(bindir, folder, _free_port(), as_user)
    try:
        made.init()
        made.start()
        yield made
    finally:
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):  # not running: nothing to stop
            made._run("pg_ctl", "-D", str(made.data), "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


class Crasher(threading.Thread):
    """Crashes the cluster ``count`` times, each after 0.3-1 s of load, and starts it again after an outage
    of up to 1.5 s (the restart's WAL replay on top)."""

    def __init__(self, cluster: Cluster, seed: int, count: int) -> None:
        super().__init__(daemon=True)
        self.cluster, self.rng, self.count = cluster, random.Random(seed), count
        self.error: BaseException | None = None
        self.down_seconds = 0.0
        self.stop = threading.Event()  # a failed test's cleanup: no crash (nor restart) after it

    def run(self) -> None:
        """Crash and restart ``count`` times; the server is up when this returns (or ``error`` says why not)."""
        try:
            for _ in range(self.count):
                if self.stop.wait(self.rng.uniform(0.3, 1.0)):
                    return
                began = time.monotonic()
                self.cluster.crash()
                time.sleep(self.rng.uniform(0.0, 1.5))  # down: connects refused, then "starting up"
                self.cluster.start()
                self.down_seconds += time.monotonic() - began
        except BaseException as e:  # reported by the test
            self.error = e


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a load's process group (the load and its children) unless it has ended, and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def server_crashes(
    request: pytest.FixtureRequest, cluster: Cluster, tmp_path: Path, children: int, seconds: float, crashes: int
) -> None:
    """Run ``children`` turn workers for ``seconds`` while the cluster crashes ``crashes`` times, then check
    every turn."""
    seed = random.randrange(2**31)
    dbname = "ts_crash"
    cluster.admin(f"CREATE DATABASE {dbname}")
    url = cluster.url(dbname)
    TranscriptStore.upgrade_url(url)
    args = [
        sys.executable, str(WORKER), "load", "--kind", "turns", "--outages", "--url", url, "--seed", str(seed),
        "--children", str(children), "--sessions", "3", "--seconds", str(seconds), "--out", str(tmp_path),
        "--prefix", "c",
    ]
    started = time.monotonic()
    crasher = Crasher(cluster, seed, crashes)
    with open(tmp_path / "load.err", "w") as err:
        # Its own process group: whatever fails here, the load and its forked children are killed with it.
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=clean_env(),
                                start_new_session=True)
        watchdog = threading.Timer(seconds + 300, _kill_group, (proc,))
        watchdog.start()
        try:
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline() or "{}")
            crasher.start()
            out = proc.stdout.read()
            proc.wait(timeout=seconds + 300)
            crasher.join(timeout=60 * crashes)
        finally:
            watchdog.cancel()
            _kill_group(proc)
            crasher.stop.set()
            if crasher.is_alive():
                crasher.join(timeout=120)  # a crash under way restarts the server first
    log = (tmp_path / "load.err").read_text()
    assert crasher.error is None, repr(crasher.error)
    assert not crasher.is_alive(), "the cluster did not come back"
    assert ready.get("ready") == children, log[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0 and result["failed"] == [], log[-4000:]
    loads = [json.loads((tmp_path / f"load-{i}.json").read_text()) for i in range(children)]
    sessions = [sid for load in loads for sid in load["sessions"]]
    acks = read_acks(tmp_path / "acks")
    totals = verify_turns(url, sessions, acks=acks, expected_replies=replies)
    told = sum(x.get("fast", 0) + x.get("queued", 0) for x in loads)
    given_up = sum(x.get("unavailable", 0) for x in loads)
    # Every turn a worker was told was accepted or committed is one committed turn (verify_turns); a
    # completion whose COMMIT landed while its caller gave up is committed too, untold: at most one a call
    # that gave up.
    assert told <= totals["turns"] <= told + given_up, (totals, told, given_up)
    amcheck = cluster.amcheck(dbname)
    figures = {
        "server_crashes": cluster.crashes, "seconds_down": round(crasher.down_seconds, 1), "processes": children,
        "turns_run": sum(x["turns"] for x in loads), "turns_committed": totals["turns"],
        "calls_given_up": given_up, "retries": sum(x["retries"] for x in loads),
        "recovered_by_final_pass": totals["recovered"], "seed": seed,
        "seconds": round(time.monotonic() - started, 1),
    }
    report(request, "postgresql", figures)
    assert amcheck.returncode == 0, f"pg_amcheck after the crashes:\n{amcheck.stdout[-3000:]}{amcheck.stderr[-3000:]}"
    assert cluster.crashes == crashes and figures["retries"] > 0, figures
    assert totals["turns"] > 0, figures


def test_server_crashes_every_acknowledged_turn_exactly_once(
    request: pytest.FixtureRequest, cluster: Cluster, tmp_path: Path
) -> None:
    server_crashes(request, cluster, tmp_path, children=3, seconds=10.0, crashes=3)


@pytest.mark.slow
def test_server_crashes_every_acknowledged_turn_exactly_once_at_scale(
    request: pytest.FixtureRequest, cluster: Cluster, tmp_path: Path
) -> None:
    server_crashes(request, cluster, tmp_path, children=4, seconds=60.0, crashes=20)
