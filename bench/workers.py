"""Benchmark 6: four worker processes on PostgreSQL, each on its own sessions, all at once.

Every worker is a fresh (spawned) process: it opens its store or raw connection, creates its sessions,
warms up, waits at a barrier, then runs turns for a fixed time. The aggregate rate is the sum of the
workers' rates (they start together at the barrier and run for the same time).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import time
from typing import Any

from .context import Context, log
from .report import Figure
from .targets import Target

WORKERS = 4
#: sessions pre-created per worker and second of run (more than a worker of ours can use: no creation
#: while timed; a worker that runs out stops the benchmark instead of reporting a shorter run)
SESSIONS_PER_SECOND = 40


def worker(
    kind: str, url: str, dsn: str, index: int, block: int, seed: int, seconds: float, barrier: Any, results: Any
) -> None:
    """One worker process: ``kind`` is ``ours`` (host runtime turns) or ``raw`` (psycopg inserts)."""
    from transcript_store import StoreConfig, TranscriptStore

    from .drivers import TURNS_PER_SESSION, HostDriver, Plan, create_sessions, raw_op
    from .raw import RawPostgres
    from .workload import Workload

    setup_started = time.perf_counter()
    workload = Workload(seed)
    pool = [workload.turn() for _ in range(64)]
    prefix = f"w{kind[0]}{block}-{index}"

    def plan(i: int) -> Plan:
        session, k = divmod(i, TURNS_PER_SESSION)
        return Plan(f"{prefix}-s{session:05d}", f"{prefix}-t{i:07d}", k * 4, pool[i % len(pool)])

    sessions = int(seconds * SESSIONS_PER_SECOND) + 2
    if kind == "ours":
        store = TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))
        create_sessions(store, [plan(i * TURNS_PER_SESSION) for i in range(sessions)])
        driver = HostDriver(store)

        def op(i: int) -> None:
            driver.script(plan(i))()
    else:
        raw = RawPostgres(dsn)

        def op(i: int) -> None:
            raw_op(raw, plan(i))()

    # Raw's table needs no session row: its workers are never limited (a raw worker runs ~7x as many
    # turns as ours, and a limit sized for ours stopped them after a third of the time).
    limit = sessions * TURNS_PER_SESSION if kind == "ours" else sys.maxsize
    for i in range(TURNS_PER_SESSION):  # warm-up: the first session
        op(i)
    setup = time.perf_counter() - setup_started
    barrier.wait(timeout=300)  # a sibling that died before the barrier breaks it: no one hangs
    started, cpu = time.perf_counter(), time.process_time()
    i = TURNS_PER_SESSION
    while time.perf_counter() - started < seconds and i < limit:
        op(i)
        i += 1
    elapsed = time.perf_counter() - started
    if i >= limit:
        raise RuntimeError(f"{kind} worker {index} ran out of sessions after {elapsed:.2f} of {seconds} s")
    results.put((kind, index, i - TURNS_PER_SESSION, elapsed, time.process_time() - cpu, setup))


def _run(kind: str, url: str, dsn: str, block: int, seed: int, seconds: float) -> tuple[float, float, float]:
    """Aggregate turns/s, CPU seconds per turn, and the slowest worker's setup time."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(WORKERS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(kind, url, dsn, i, block, seed + i, seconds, barrier, results))
        for i in range(WORKERS)
    ]
    for p in procs:
        p.start()
    got: list[tuple[str, int, int, float, float, float]] = []
    deadline = time.monotonic() + seconds + 300
    try:
        while len(got) < len(procs) and time.monotonic() < deadline:
            try:
                got.append(results.get(timeout=1))
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and results.empty():
                    break  # a worker died without reporting: do not wait for it
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed or len(got) < len(procs):
        raise RuntimeError(f"{kind} workers: {len(got)}/{len(procs)} reported, exit codes {failed}")
    rate = sum(g[2] / g[3] for g in got)
    cpu = sum(g[4] for g in got) / max(1, sum(g[2] for g in got))
    return rate, cpu, max(g[5] for g in got)


def bench_workers(ctx: Context, target: Target) -> list[Figure]:
    """(6) Aggregate full turns/s of 4 processes vs 4 raw processes, alternating blocks."""
    db = ctx.lab.database(target, "workers")
    db.raw().close()  # create the raw table once, before the workers race to
    seconds = ctx.counts.worker_seconds
    ours_rates, raw_rates, ours_cpu, raw_cpu, setups = [], [], [], [], []
    for block in range(ctx.counts.worker_blocks):
        rate, cpu, setup = _run("raw", db.url, db.raw_dsn, block, ctx.seed * 100 + 60, seconds)
        raw_rates.append(rate)
        raw_cpu.append(cpu)
        setups.append(setup)
        rate, cpu, setup = _run("ours", db.url, db.raw_dsn, block, ctx.seed * 100 + 60, seconds)
        ours_rates.append(rate)
        ours_cpu.append(cpu)
        setups.append(setup)
        log(f"  workers [{target.name}] block {block}: ours {ours_rates[-1]:,.0f}/s, raw {raw_rates[-1]:,.0f}/s")
    ours = sum(ours_rates) / len(ours_rates)
    raw = sum(raw_rates) / len(raw_rates)
    extra = {
        "workers": WORKERS,
        "seconds_per_block": seconds,
        "blocks": ctx.counts.worker_blocks,
        "ours_blocks": ours_rates,
        "raw_blocks": raw_rates,
        "ours_cpu_ms_per_turn": 1000 * sum(ours_cpu) / len(ours_cpu),
        "raw_cpu_ms_per_turn": 1000 * sum(raw_cpu) / len(raw_cpu),
        "slowest_worker_setup_s": setups,
    }
    return [
        Figure(
            "workers",
            target.name,
            f"{WORKERS} processes: aggregate full turns/s",
            "turns/s",
            ours,
            raw,
            ">=",
            0.6,
            extra,
        )
    ]
