"""Fork-server workers of the fault campaign (tests/test_faults_*.py), and the campaign's shared checks.

Importing this library costs about 1.4 s of CPU per process; a campaign of a thousand SIGKILLs cannot
pay that per kill. So one *zygote* process imports everything once and then ``fork()``s short-lived
children, real processes that open their own store, run real turns and die by SIGKILL. The zygote
holds no database connection when it forks (it warms up on a store it closes again).

Modes (``python tests/workers/fault_worker.py MODE --url URL ...``), each printing one JSON line:

- ``campaign``: fork children one after another on this slot's sessions, each killed either by the
  zygote at a random instant after it is ready, or by a fault point of TRANSCRIPT_STORE_FAULTS (one
  point at a high rate, or every point at a low one), until ``--kills`` SIGKILLs have landed. A child
  records where it was (the last fault point it passed) in a small trace file the zygote reads, and
  every acknowledgement it was given (turn admitted, accepted, committed) in a log of its own under
  ``--acks``, which the checks hold the recovered store to.
- ``storm``: fork ``--children`` children, release them at once, and let each present every
  advancement key of a plan file to ``Turns.commit_turn``, all in the same order and waiting for one
  another before each key (so that they present each key together); each child reports its statuses
  and when it presented each key.
- ``load``: fork ``--children`` children running full turns on their own sessions for ``--seconds``
  (``--kind turns``: the gateway turn of turn_worker.py; ``--kind soak``: a turn plus the reads an
  engine makes, with latencies and RSS sampled over time). The zygote prints ``ready`` once every
  child is, so a test can start killing connections.

The checks at the end (``verify_turns``, ``sqlite_integrity``, ``report``) are imported by the tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import random
import signal
import sqlite3
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `workers.turn_worker`, as the tests import it

from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url
from workers.turn_worker import (
    ENGINE,
    SCOPE,
    Ack,
    count_turn,
    counting_engine,
    replies,
    run_turn,
    user_message,
)

from transcript_store import Admission, Anchor, ClosedRange, StoreConfig, StoreUnavailable, TranscriptStore, faults
from transcript_store.core import Core
from transcript_store.ledger import (
    CommitResult,
    TurnPayload,
    commit_turn_in,
    committed_messages,
    count_turn_messages,
    get_state,
    put_state,
)
from transcript_store.outbox import OutboxConfig
from transcript_store.turns import Turns

#: every fault point a campaign child can die at (the library's, plus the counting engine's own)
FAULT_POINTS = (*faults.POINTS, "engine.apply")
#: where a child's trace can say it was that is no fault point: a kill by a fault point never lands there
TRACE_MARKS = ("never", "start", "turn.begin", "compact.begin")
TRACE_BYTES = 256
#: the acknowledgements a campaign child logs (see ``turn_worker.run_turn``)
ACKS = ("admitted", "accepted", "committed", "stored")
#: this script, for the tests that start it
WORKER = Path(__file__).resolve()


def clean_env() -> dict[str, str]:
    """The environment without any TRANSCRIPT_STORE_* setting (no inherited fault spec)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}


def open_store(url: str) -> TranscriptStore:
    """A store on an existing, migrated database."""
    return TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))


def count_retries(store: TranscriptStore, counter: list[int]) -> None:
    """Count every transient-error retry of this store's transactions in ``counter[0]``."""

    def bump(_error: BaseException) -> None:
        counter[0] += 1

    store.db.on_retry = bump


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def warm_up(url: str) -> None:
    """Load every module and cache a child needs, then close every connection before forking."""
    store = open_store(url)
    store.close()


def _exit_child(code: int) -> NoReturn:
    # Never run the zygote's atexit handlers or flush its buffers from a child.
    os._exit(code)


# ---------------------------------------------------------------------------------------------- campaign


class _Trace:
    """Where a campaign child is: last fault point passed, turns finished, retries; pwrite, no buffering."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.point = "start"
        self.turns = 0
        self.retries = [0]

    def write(self) -> None:
        """Overwrite the trace record in place (one pwrite: visible to the zygote even after SIGKILL)."""
        text = f"{self.point};{self.turns};{self.retries[0]}".encode()
        os.pwrite(self.fd, text.ljust(TRACE_BYTES), 0)

    @staticmethod
    def read(path: Path) -> tuple[str, int, int]:
        """The last point, turns and retries a child recorded."""
        raw = path.read_bytes()[:TRACE_BYTES].decode(errors="replace").strip()
        point, turns, retries = ([*raw.split(";"), "0", "0"])[:3] if raw else ("never", "0", "0")
        return point, int(turns or 0), int(retries or 0)


def ack_log(fd: int) -> Ack:
    """An ``Ack`` that appends one line per acknowledgement to ``fd`` (opened with O_APPEND).

    One write() per line, no fsync: the child is SIGKILLed, not the machine, and what a returned write()
    handed to the kernel (its page cache) outlives the process.
    """

    def ack(what: str, session_id: str, turn_id: str) -> None:
        os.write(fd, f"{what} {session_id} {turn_id}\n".encode())

    return ack


def read_acks(directory: Path) -> list[tuple[str, str, str]]:
    """Every (acknowledgement, session, turn) the campaign children logged, by file name: each slot's
    children in the order they ran (a slot runs one child at a time, on sessions of its own)."""
    out: list[tuple[str, str, str]] = []
    for path in sorted(directory.glob("*.log")):
        raw = path.read_text(encoding="utf-8")
        assert raw == "" or raw.endswith("\n"), f"torn acknowledgement line in {path}: {raw[-200:]!r}"
        for line in raw.splitlines():
            what, session_id, turn_id = line.split(" ")
            assert what in ACKS, f"unknown acknowledgement in {path}: {line!r}"
            out.append((what, session_id, turn_id))
    return out


def warm_store(url: str, session_id: str) -> TranscriptStore:
    """A store whose engine has run a few turns (SQLAlchemy's compiled cache is per engine, and a cold one
    costs a new process ~100 ms), with every connection closed again so that children can fork from it:
    each child's first use opens its own connections (``Database`` drops a pool inherited across fork)."""
    store = open_store(url)
    store.create_session(SCOPE, session_id=session_id)
    turns = Turns(store, OutboxConfig(turn_lease_seconds=0.0, delivery_lease_seconds=0.0))
    rng = random.Random(0)
    for _ in range(4):
        run_turn(turns, session_id, rng, argparse.Namespace(fail_rate=0.5, abort_rate=0.0), Counter())
    store.db.engine.dispose()
    return store


def campaign_child(
    store: TranscriptStore, sessions: list[str], spec: str | None, seed: int, trace_fd: int, ack_fd: int,
    ready_fd: int,
) -> NoReturn:
    """Run gateway turns until a fault point or the zygote kills this process; log each acknowledgement."""
    code = 0
    try:
        os.environ.pop("TRANSCRIPT_STORE_FAULTS", None)
        if spec is not None:
            os.environ["TRANSCRIPT_STORE_FAULTS"] = spec
            os.environ["TRANSCRIPT_STORE_FAULT_SEED"] = str(seed)
        faults.reset()
        trace = _Trace(trace_fd)
        real_point = faults.point

        def traced(name: str) -> None:
            trace.point = name
            trace.write()
            real_point(name)

        faults.point = traced  # type: ignore[assignment]
        trace.write()
        count_retries(store, trace.retries)
        turns = Turns(store, OutboxConfig(turn_lease_seconds=0.0, delivery_lease_seconds=0.0))
        for sid in sessions:
            store.create_session(SCOPE, session_id=sid)
        os.write(ready_fd, b"r")
        os.close(ready_fd)
        rng = random.Random(seed)
        args = argparse.Namespace(fail_rate=0.2, abort_rate=0.1)
        stats: dict[str, int] = Counter()
        ack = ack_log(ack_fd)
        # A child killed by a fault point runs at most this many turns (one that survives them finishes).
        for _ in range(60 if spec is not None else 1_000_000):
            trace.point = "turn.begin"
            trace.write()
            run_turn(turns, rng.choice(sessions), rng, args, stats, ack)
            trace.turns += 1
            trace.write()
        store.close()
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        code = 1
    _exit_child(code)


def _wait(pid: int, timeout: float) -> int:
    """waitpid with a deadline: a hung child is killed and reported as such (status -1)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1
        time.sleep(0.002)


def main_campaign(args: argparse.Namespace) -> dict[str, Any]:
    """Fork, kill and reap campaign children until ``--kills`` SIGKILLs landed (or ``--seconds`` passed)."""
    store = warm_store(args.url, f"{args.prefix}warm")
    rng = random.Random(args.seed)
    trace_path = Path(args.trace)
    acks = Path(args.acks)
    deadline = time.monotonic() + args.seconds
    out: dict[str, Any] = {
        "kills": 0, "parent_kills": 0, "point_kills": 0, "finished": 0, "children": 0, "turns": 0,
        "retries": 0, "killed_at": Counter(), "errors": [], "sessions": [f"{args.prefix}warm"],
    }
    single = 0
    while out["kills"] < args.kills and time.monotonic() < deadline and len(out["errors"]) < 3:
        n = out["children"]
        out["children"] += 1
        group = n // args.children_per_session
        sessions = [f"{args.prefix}{group}a", f"{args.prefix}{group}b"]
        if sessions[0] not in out["sessions"]:
            out["sessions"].extend(sessions)
        by_parent, spec = kill_plan(rng, FAULT_POINTS, args.slot + single)
        single += spec is not None and not spec.startswith("*")
        fd = os.open(trace_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        # One log per child, created here (a child killed before its first line still has one); the
        # names sort in the order the children ran.
        ack_path = acks / f"{args.slot:02d}-{n:06d}.log"
        ack_fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        ready_r, ready_w = os.pipe()
        child_seed = rng.randrange(2**31)
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            campaign_child(store, sessions, spec, child_seed, fd, ack_fd, ready_w)
        os.close(ready_w)
        os.close(fd)
        os.close(ack_fd)
        reap(pid, ready_r, by_parent and rng.uniform(0.0, args.max_delay), trace_path, out, f"child {n} ({spec})")
    return out


def kill_plan(rng: random.Random, points: Sequence[str], turn: int) -> tuple[bool, str | None]:
    """How the next campaign child dies: killed by the zygote (True, no spec) 40% of the time, else by a
    fault point: every point at a low rate, or one point at a high one (round-robin by ``turn``, so that
    each of them gets its kills)."""
    if rng.random() < 0.4:
        return True, None
    if rng.random() < 0.35:
        return False, "*=0.03"
    return False, f"{points[turn % len(points)]}=0.35"


def reap(pid: int, ready_r: int, delay: float | bool, trace_path: Path, out: dict[str, Any], label: str) -> None:
    """Kill a campaign child after ``delay`` once it is ready (``delay`` False: it dies at a fault point or
    finishes), reap it and count how it ended and where it was (its trace) into ``out``."""
    by_parent = delay is not False
    if by_parent and os.read(ready_r, 1):  # b"" when the child died before it was ready
        time.sleep(float(delay))
        os.kill(pid, signal.SIGKILL)  # it cannot have exited: it runs turns until killed
    status = _wait(pid, 120.0)
    os.close(ready_r)  # only now: a child writing "ready" to a closed pipe would die of EPIPE
    point, turns, retries = _Trace.read(trace_path)
    out["turns"] += turns
    out["retries"] += retries
    if status != -1 and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        out["kills"] += 1
        out["parent_kills" if by_parent else "point_kills"] += 1
        out["killed_at"][point if not by_parent else f"parent@{point}"] += 1
    elif status != -1 and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        out["finished"] += 1
    else:
        out["errors"].append(f"{label} ended with status {status} at {point}")


# ---------------------------------------------------------------------------------------------- storm


def storm_child(
    url: str, plan: list[dict[str, Any]], result: Path, ready_fd: int, go_fd: int, barrier: Barrier,
    apply: bool = True,
) -> NoReturn:
    """Wait for the go byte, then present every key of the plan once, in the plan's order, all together.

    Every child gets the same order, and waits at ``barrier`` for all the others before each key: the
    same order alone does not keep them together (on SQLite the child that won the write lock ran
    through the next keys while the others slept in the busy handler, and most keys met one process).
    Each presentation's window (``time.monotonic()`` before and after the call: CLOCK_MONOTONIC, one
    clock for every process of the machine) is reported, so that the test can check they overlapped.
    """
    code = 0
    try:
        store = open_store(url)
        retries = [0]
        count_retries(store, retries)
        turns = Turns(store)
        os.write(ready_fd, b"r")
        if os.read(go_fd, 1) != b"g":
            raise SystemExit("no go signal")
        statuses: dict[str, str] = {}
        windows: dict[str, tuple[float, float]] = {}
        for turn in plan:
            admission = Admission.model_validate(turn["admission"])
            terminal = Anchor.model_validate(turn["terminal"])
            barrier.wait(timeout=60.0)  # broken (and this child failed) if another one died
            began = time.monotonic()
            # apply: the engine's own state in the commit's transaction (commit_turn_in); without, the
            # ledger's one statement outside a transaction, the usual path (ledger.commit_turn)
            done = turns.commit_turn(ENGINE, admission.turn_id, admission, terminal, turn["messages"],
                                     apply=count_turn if apply else None)
            windows[admission.turn_id] = (began, time.monotonic())
            statuses[admission.turn_id] = done.status
        store.close()
        result.write_text(json.dumps({"statuses": statuses, "windows": windows, "retries": retries[0]}))
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        code = 1
    _exit_child(code)


def main_storm(args: argparse.Namespace) -> dict[str, Any]:
    """Fork the storm's children, release them with one write (then a barrier before each key), reap them."""
    warm_up(args.url)
    plan = json.loads(Path(args.plan).read_text())
    random.Random(args.seed).shuffle(plan)  # one order for every child: a different one per run
    out_dir = Path(args.out)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    # Semaphores in shared memory, inherited by os.fork() (the fork context unlinks their names at once).
    barrier = multiprocessing.get_context("fork").Barrier(args.children)
    pids = []
    for i in range(args.children):
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(go_w)
            storm_child(args.url, plan, out_dir / f"storm-{i}.json", ready_w, go_r, barrier, args.apply == "count")
        pids.append(pid)
    os.close(ready_w)
    os.close(go_r)
    ready = 0
    while ready < args.children:
        got = os.read(ready_r, args.children)
        if not got:
            break
        ready += len(got)
    os.write(go_w, b"g" * args.children)  # one write: every child wakes on the same pipe at once
    started = time.monotonic()
    statuses = [_wait(pid, 300.0) for pid in pids]
    failed = [i for i, s in enumerate(statuses) if s == -1 or not os.WIFEXITED(s) or os.WEXITSTATUS(s) != 0]
    return {"ready": ready, "failed": failed, "seconds": round(time.monotonic() - started, 2)}


# ---------------------------------------------------------------------------------------------- load


def light_engine(c: Core, turn: TurnPayload) -> CommitResult:
    """A ledger commit with an O(1) engine state (a counter): the soak measures the store, not the engine."""

    def apply(c2: Core, t: TurnPayload) -> None:
        n = get_state(c2, t.scope, t.session_id, t.engine_id, "turns") or 0
        put_state(c2, t.scope, t.session_id, t.engine_id, "turns", n + 1)

    return commit_turn_in(c, turn, apply)


def soak_child(store: TranscriptStore, sessions: list[str], seconds: float, seed: int) -> dict[str, Any]:
    """Turns and the reads an engine makes, on sessions this child owns; latencies and RSS over time."""
    turns = Turns(store, OutboxConfig(turn_lease_seconds=30.0, delivery_lease_seconds=5.0))
    rng = random.Random(seed)
    cursors: dict[str, str | None] = dict.fromkeys(sessions)
    counters = dict.fromkeys(sessions, 0)
    samples: list[tuple[float, float, float]] = []  # (elapsed, turn seconds, read seconds)
    rss: list[tuple[float, int]] = []
    started = time.monotonic()
    last_rss = -1.0
    while (elapsed := time.monotonic() - started) < seconds:
        sid = rng.choice(sessions)
        turn_id = f"{sid}.t{counters[sid]}"
        counters[sid] += 1
        t0 = time.perf_counter()
        turns.recover(SCOPE, sid, ENGINE, lambda _e: light_engine)
        admission, _ = turns.admit(SCOPE, sid, user_message(turn_id), turn_id=turn_id, engine_id=ENGINE)
        queued = rng.random() < 0.1  # now and then the slow path: the next recovery drains it
        done = turns.complete(SCOPE, sid, turn_id, replies(turn_id), None if queued else light_engine)
        t1 = time.perf_counter()
        while True:  # the engine's incremental view: 20-message pages after its cursor
            page = store.read_visible_delta(SCOPE, sid, cursors[sid], max_messages=20)
            if page.kind != "page":
                raise AssertionError(f"soak cursor got {page!r}")
            cursors[sid] = page.cursor
            if not page.has_more:
                break
        closed = store.read_closed_range(admission, done.terminal)
        if not isinstance(closed, ClosedRange) or (done.commit is None) != queued:
            raise AssertionError(f"soak turn {turn_id} did not complete as asked: {closed!r} {done!r}")
        samples.append((round(elapsed, 3), t1 - t0, time.perf_counter() - t1))
        if elapsed - last_rss >= 0.5:
            rss.append((round(elapsed, 3), rss_bytes()))
            last_rss = elapsed
    return {"samples": samples, "rss": rss, "turns": sum(counters.values())}


def turns_child(
    store: TranscriptStore, sessions: list[str], seconds: float, seed: int, ack: Ack | None = None,
    outages: bool = False,
) -> dict[str, Any]:
    """Gateway turns (turn_worker.run_turn: flaky engine, aborts, queued completions) for ``seconds``;
    each acknowledgement a call returned is told to ``ack`` (the checks hold the store to them: a write
    reported done and then lost would otherwise look like an attempt that never completed).

    ``outages``: the database may be down for longer than the store's retries last (a server restart);
    a call that gives up with ``StoreUnavailable`` is counted in ``unavailable`` and the worker goes on
    as a gateway would, its next turn of that session the unfinished one again (``next_turn``)."""
    turns = Turns(store, OutboxConfig(turn_lease_seconds=30.0, delivery_lease_seconds=1.0))
    rng = random.Random(seed)
    args = argparse.Namespace(fail_rate=0.1, abort_rate=0.05)
    stats: dict[str, int] = Counter()
    started = time.monotonic()
    n = 0
    while time.monotonic() - started < seconds:
        try:
            run_turn(turns, rng.choice(sessions), rng, args, stats, ack)
        except StoreUnavailable:
            if not outages:
                raise
            stats["unavailable"] += 1
            time.sleep(0.1)
        n += 1
    return {"turns": n, **stats}


def load_child(args: argparse.Namespace, index: int, ready_fd: int, go_fd: int) -> NoReturn:
    """Open a store, create this child's sessions, wait for go, run the load, write its figures."""
    code = 0
    try:
        store = open_store(args.url)
        retries = [0]
        count_retries(store, retries)
        sessions = [f"{args.prefix}{index}{c}" for c in "abcdefgh"[: args.sessions]]
        for sid in sessions:
            store.create_session(SCOPE, session_id=sid)
        os.write(ready_fd, b"r")
        if os.read(go_fd, 1) != b"g":
            raise SystemExit("no go signal")
        seed = args.seed * 1000 + index
        if args.kind == "soak":
            result = soak_child(store, sessions, args.seconds, seed)
        else:  # its acknowledgements in acks/<index>.log (``read_acks``)
            (Path(args.out) / "acks").mkdir(exist_ok=True)
            fd = os.open(Path(args.out) / "acks" / f"{index}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                result = turns_child(store, sessions, args.seconds, seed, ack_log(fd), args.outages)
            finally:
                os.close(fd)
        store.close()
        result.update(retries=retries[0], sessions=sessions, pid=os.getpid())
        (Path(args.out) / f"load-{index}.json").write_text(json.dumps(result))
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        code = 1
    _exit_child(code)


def main_load(args: argparse.Namespace) -> dict[str, Any]:
    """Fork the load's children, print ``ready`` with their pids, release them, and reap them."""
    warm_up(args.url)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pids = []
    for i in range(args.children):
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(go_w)
            load_child(args, i, ready_w, go_r)
        pids.append(pid)
    os.close(ready_w)
    os.close(go_r)
    ready = 0
    while ready < args.children and (got := os.read(ready_r, args.children)):
        ready += len(got)
    print(json.dumps({"ready": ready, "pids": pids}), flush=True)
    os.write(go_w, b"g" * args.children)
    statuses = [_wait(pid, args.seconds + 300.0) for pid in pids]
    failed = [i for i, s in enumerate(statuses) if s == -1 or not os.WIFEXITED(s) or os.WEXITSTATUS(s) != 0]
    return {"failed": failed}


# ---------------------------------------------------------------------------------------------- checks


def verify_turns(
    url: str,
    sessions: list[str],
    acks: Sequence[tuple[str, str, str]] | None = None,
    expected_replies: Callable[[str], list[dict[str, Any]]] | None = None,
) -> dict[str, int]:
    """Recover every session, then check each invariant of a faulted run; returns what it committed.

    Zero lost accepted turns (each has a receipt; with ``acks``, the (acknowledgement, session, turn)
    lines the workers logged, every turn a worker was told was accepted or committed is committed once),
    zero duplicates (one receipt, one engine count and one set of ledger messages per turn), zero
    partial turns (a turn's replies exist all or none, as one contiguous range after its admission,
    ending with its answer, every tool call with its result; with ``expected_replies``, the replies the
    worker wrote for that turn id, all of them), and the engine's state equal to its receipts.
    """
    store = open_store(url)
    try:
        turns = Turns(store, OutboxConfig(turn_lease_seconds=0.0, delivery_lease_seconds=0.0))
        totals = Counter({"turns": 0, "messages": 0, "unaccepted": 0, "recovered": 0, "degraded": 0})
        for sid in sessions:
            report = turns.recover(SCOPE, sid, ENGINE, lambda _e: counting_engine)
            assert not report.must_degrade, (sid, report)
            totals["recovered"] += report.drain.delivered
        left = [(i.session_id, i.turn_id, i.state) for i in turns.intents(SCOPE, limit=10_000)]
        assert left == [], f"accepted turns left undelivered: {left[:5]}"
        by_session: dict[str, list[tuple[str, str]]] = {}
        for what, sid, turn_id in acks or ():
            by_session.setdefault(sid, []).append((what, turn_id))
        unchecked = set(by_session) - set(sessions)
        assert not unchecked, f"acknowledged turns of sessions that are not checked: {sorted(unchecked)[:5]}"
        for sid in sessions:
            seen = _verify_session(store, turns, sid, totals, expected_replies)
            if acks is not None:
                _verify_acks(seen, by_session.get(sid, []), totals)
        return dict(totals)
    finally:
        store.close()


def _turn_kind(turn_id: str) -> str:
    """``t`` for a turn of the engine (``<session>.t<n>``), ``d`` for a degraded one run without the outbox."""
    return turn_id.rsplit(".", 1)[-1][:1]


def _replies_of(store: TranscriptStore, sid: str) -> tuple[list[Any], dict[str, list[Any]]]:
    """A session's admissions (user entries of a turn) and each turn's reply entries, in order."""
    entries = store.list_entries(SCOPE, sid, limit=10_000)
    assert len(entries) < 10_000, "session too long for one listing: rotate sessions sooner"
    by_turn: dict[str, list[Any]] = {}
    admitted: list[Any] = []
    for e in entries:
        if e.role == "user" and e.turn_id is not None:
            admitted.append(e)
        elif "." in e.entry_id and ".r" in e.entry_id:
            by_turn.setdefault(e.entry_id.rsplit(".r", 1)[0], []).append(e)
    return admitted, by_turn


def _check_replies(
    key: str, admission: Any, reply: list[Any], expected_replies: Callable[[str], list[dict[str, Any]]] | None
) -> None:
    """All or nothing: a turn with replies has every one of them, right after its admission, ending with
    its answer, and (when the writer derives them from the turn id) exactly those it wrote."""
    assert [e.entry_id for e in reply] == [f"{key}.r{i}" for i in range(len(reply))], f"partial turn {key}"
    assert [e.seq for e in reply] == list(range(admission.seq + 1, admission.seq + 1 + len(reply))), key
    messages = [e.message for e in reply]
    if expected_replies is not None:
        # The ids above only show that the replies that exist are a prefix; this shows it is all of them.
        wrote = [r["message"] for r in expected_replies(key)]
        assert len(messages) == len(wrote), f"partial turn {key}: {len(messages)} of its {len(wrote)} replies"
        assert messages == wrote, f"the replies of turn {key} are not those its worker wrote"
    last, answer = messages[-1], f"answer of {key}"  # what turn_worker (and test_faults_disk, padded) writes
    assert last.get("role") == "assistant" and not last.get("tool_calls"), f"turn {key} ends with {last!r}"
    content = str(last.get("content"))
    assert content == answer or content.startswith(f"{answer} "), f"turn {key} ends without its answer: {last!r}"
    calls: list[str] = []
    for m in messages:
        if m.get("role") == "tool":
            assert m.get("tool_call_id") in calls, f"turn {key}: a tool result before or without its call: {m!r}"
            calls.remove(m["tool_call_id"])
        calls += [c["id"] for c in m.get("tool_calls") or ()]
    assert not calls, f"turn {key}: tool calls without their result: {calls}"


@dataclass
class _Session:
    """What the checks of one session read: its admissions, each turn's replies, the engine's view."""

    admitted: list[Any]
    by_turn: dict[str, list[Any]]
    receipts: set[str]
    order: list[str]


def _verify_session(
    store: TranscriptStore, turns: Turns, sid: str, totals: Counter[str],
    expected_replies: Callable[[str], list[dict[str, Any]]] | None,
) -> _Session:
    admitted, by_turn = _replies_of(store, sid)
    engine_turns = [e for e in admitted if _turn_kind(str(e.turn_id)) == "t"]
    accepted = [e for e in engine_turns if str(e.turn_id) in by_turn]
    totals["unaccepted"] += len(engine_turns) - len(accepted)
    receipts = {r.advancement_key: r for r in turns.receipts(SCOPE, sid, ENGINE)}
    assert sorted(receipts) == sorted(str(e.turn_id) for e in accepted), "receipts != accepted turns"

    def engine_view(c: Core) -> tuple[Any, Any, int]:
        return (
            get_state(c, SCOPE, sid, ENGINE, "turns"),
            get_state(c, SCOPE, sid, ENGINE, "order"),
            count_turn_messages(c, SCOPE, sid, ENGINE),
        )

    counter, order, ledger_messages = store.read(engine_view)
    assert (counter or 0) == len(receipts), "engine counter disagrees with the receipts"
    assert (order or []) == [e.turn_id for e in accepted], "the engine saw turns twice or out of admission order"
    total = 0
    for admission in accepted:
        key = str(admission.turn_id)
        reply = by_turn[key]
        _check_replies(key, admission, reply, expected_replies)
        receipt = receipts[key]
        assert (receipt.admission_entry_id, receipt.terminal_entry_id) == (admission.entry_id, reply[-1].entry_id)
        closed = store.read_closed_range(
            store.anchor(SCOPE, sid, admission.entry_id), store.anchor(SCOPE, sid, reply[-1].entry_id)
        )
        assert isinstance(closed, ClosedRange), (key, closed)
        stored = store.read(lambda c, k=key: committed_messages(c, SCOPE, sid, ENGINE, k))
        assert stored == closed.messages and receipt.message_count == len(stored), f"ledger of {key} differs"
        total += receipt.message_count
    # A degraded turn (run_turn's degrade: no outbox, no engine) writes its replies in one append too:
    # they obey the same all-or-nothing rule. One killed between its admission and that append has none.
    for admission in admitted:
        key = str(admission.turn_id)
        if _turn_kind(key) == "d" and key in by_turn:
            _check_replies(key, admission, by_turn[key], expected_replies)
            totals["degraded"] += 1
    for key in set(by_turn) - {str(e.turn_id) for e in admitted}:
        raise AssertionError(f"replies of turn {key} without its admission")
    assert ledger_messages == total, "ledger messages without a receipt"
    totals["turns"] += len(receipts)
    totals["messages"] += total
    return _Session(admitted, by_turn, set(receipts), list(order or []))


def _verify_acks(session: _Session, acks: list[tuple[str, str]], totals: Counter[str]) -> None:
    """Every acknowledgement a worker was given holds after the crashes: an acknowledged admission
    exists, an acknowledged acceptance or commit is committed exactly once, and stored replies exist.
    ``acks`` are in the order the workers got them (one worker at a time per session); ``session`` is
    what ``_verify_session`` read of the recovered store."""
    admissions = {str(e.turn_id) for e in session.admitted}
    receipts, by_turn = session.receipts, session.by_turn
    seen = Counter(session.order)
    told: dict[str, str] = {}
    for what, key in acks:
        # A worker retries (admits again) only a turn whose acceptance it cannot find: after it was told
        # the turn was accepted, that means the acknowledged write was lost, even if the retry then landed.
        assert what != "admitted" or told.get(key, "admitted") == "admitted", (
            f"turn {key} admitted again after the worker was told it was {told[key]}: that write was lost"
        )
        told[key] = "committed" if what == "committed" or told.get(key) == "committed" else what
    lost = sorted(k for k, what in told.items() if k not in admissions)
    assert not lost, f"acknowledged admissions lost: {lost[:5]}"
    for key, what in told.items():
        if what in ("accepted", "committed"):
            assert key in receipts and seen[key] == 1, (
                f"turn {key} was acknowledged {what} but is not committed exactly once "
                f"(receipt: {key in receipts}, engine saw it {seen[key]} times)"
            )
        elif what == "stored":
            assert key in by_turn, f"the replies of degraded turn {key} were acknowledged, then lost"
    totals["acked_admitted"] += len(told)
    totals["acked_accepted"] += sum(what in ("accepted", "committed") for what in told.values())
    totals["acked_committed"] += sum(what == "committed" for what in told.values())
    totals["acked_stored"] += sum(what == "stored" for what in told.values())


def table_rows(
    store: TranscriptStore, scope: str | None = None, names: list[str] | None = None
) -> dict[str, list[str]]:
    """Every row of every table of the store's database (of one scope, when given), sorted: its checksum."""
    with store.db.engine.connect() as conn:
        names = names or sorted(inspect(conn).get_table_names())
        out: dict[str, list[str]] = {}
        for name in names:
            result = conn.execute(text(f'SELECT * FROM "{name}"'))
            keys = list(result.keys())
            rows = [dict(zip(keys, r, strict=True)) for r in result]
            if scope is not None:
                rows = [r for r in rows if r.get("scope", scope) == scope]
            out[name] = sorted(repr(sorted(r.items())) for r in rows)
        conn.rollback()
    return out


def sqlite_integrity(url: str) -> str:
    """``PRAGMA integrity_check`` (and the foreign-key check) of a SQLite store; '' for PostgreSQL."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return ""
    with sqlite3.connect(str(parsed.database)) as conn:
        result = conn.execute("PRAGMA integrity_check").fetchall()
        assert result == [("ok",)], result
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    conn.close()
    return "ok"


def report(request: Any, backend: str, figures: dict[str, Any]) -> Path:
    """Report a fault test's figures whatever the capture mode: a line on the terminal, a JSON line in
    ``<pytest basetemp>/fault_campaign.jsonl`` (and in $FAULT_CAMPAIGN_REPORT when set: pytest keeps
    only its last three basetemps), and a ``fault_figures`` user property (JUnit XML)."""
    line = json.dumps({"test": request.node.name, "backend": backend, **figures}, sort_keys=True)
    path = Path(request.getfixturevalue("tmp_path_factory").getbasetemp()) / "fault_campaign.jsonl"
    for target in filter(None, (path, os.environ.get("FAULT_CAMPAIGN_REPORT"))):
        with open(target, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    request.node.user_properties.append(("fault_figures", line))
    terminal = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if terminal is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # what capsys.disabled() does: past -s or not
            terminal.ensure_newline()
            terminal.write_line(f"[fault campaign] {line}")
    return path


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    """Run one mode and print its JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("campaign", "storm", "load"))
    parser.add_argument("--url", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slot", type=int, default=0)
    parser.add_argument("--prefix", default="w")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-delay", type=float, default=0.08)
    parser.add_argument("--children-per-session", type=int, default=25)
    parser.add_argument("--children", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=2, help="sessions per load child (1..8)")
    parser.add_argument("--kind", choices=("turns", "soak"), default="turns")
    parser.add_argument("--trace", default="")
    parser.add_argument("--acks", default="", help="campaign: the directory of the children's acknowledgement logs")
    parser.add_argument("--plan", default="")
    parser.add_argument("--apply", choices=("count", "none"), default="count", help="storm: the engine's apply")
    parser.add_argument("--out", default="")
    parser.add_argument("--outages", action="store_true", help="load: go on after StoreUnavailable (server restarts)")
    args = parser.parse_args()
    logging.getLogger("transcript_store").setLevel(logging.CRITICAL)
    run = {"campaign": main_campaign, "storm": main_storm, "load": main_load}[args.mode]
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
