"""``python -m bench``: run the benchmarks, print the Markdown table, write JSON lines."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy

from .context import Context, Counts, log
from .disk import bench_disk
from .reads import bench_closed_range, bench_read_delta
from .report import Figure, table, write_jsonl
from .targets import PG_ADMIN, TARGETS, Lab, Target, pg_admin_shown, pg_available
from .workers import bench_workers
from .writes import bench_commit_turn, bench_host_turn

Bench = Callable[[Context, Target], list[Figure]]

READ_SQLITE = Target("sqlite", "SQLite WAL", "sqlite", "NORMAL")

#: name -> (function, targets). Reads and sizes do not depend on the durability setting: SQLite once.
BENCHES: dict[str, tuple[Bench, tuple[Target, ...]]] = {
    "commit_turn": (bench_commit_turn, TARGETS),
    "host_turn": (bench_host_turn, TARGETS),
    "read_delta": (bench_read_delta, (READ_SQLITE, TARGETS[2])),
    "closed_range": (bench_closed_range, (READ_SQLITE, TARGETS[2])),
    "disk": (bench_disk, (READ_SQLITE, TARGETS[2])),
    "workers": (bench_workers, (TARGETS[2],)),
}
RESULTS = Path(__file__).resolve().parent / "results"


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m bench", description="transcript-store benchmarks, as ratios to raw drivers"
    )
    p.add_argument("--quick", action="store_true", help="small counts: a smoke test under a minute")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help=f"run only these benchmarks (repeat or comma-separate): {', '.join(BENCHES)}",
    )
    p.add_argument("--backend", choices=("sqlite", "postgresql"), help="run one backend only")
    p.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")
    p.add_argument("--tmpdir", help="where the SQLite files go (default: the system temp dir)")
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of the JSON lines (default bench/results)")
    args = p.parse_args(argv)
    if args.tmpdir is not None and not Path(args.tmpdir).is_dir():
        p.error(f"--tmpdir {args.tmpdir}: no such folder")
    only = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    unknown = [n for n in only if n not in BENCHES]
    if unknown:
        p.error(f"unknown benchmark {', '.join(unknown)}; one of {', '.join(BENCHES)}")
    # Always in the documented order, whatever order they were named in: closed_range appends turns to
    # the long transcripts read_delta reads at their tail, so it must come after it.
    args.only = [n for n in BENCHES if n in only] if only else list(BENCHES)
    return args


def machine(pg_settings: dict[str, str] | None, tmpdir: str | None = None) -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kb = 0
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(mem_kb / 1024 / 1024, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        # the server's version and the settings that decide what a commit costs there
        "postgresql": pg_settings,
        "sqlite_filesystem": _filesystem(tmpdir or tempfile.gettempdir()),
        "sqlalchemy": sqlalchemy.__version__,
        "psycopg": psycopg.__version__,
        "git_commit": commit,
        "load_average_start": os.getloadavg(),
    }


#: what a PostgreSQL commit costs depends on these (the raw baseline runs on the same server)
_PG_SETTINGS = ("server_version", "fsync", "synchronous_commit", "full_page_writes", "wal_sync_method", "autovacuum")


def _pg_settings() -> dict[str, str] | None:
    try:
        with psycopg.connect(PG_ADMIN, connect_timeout=5) as conn:
            rows = {name: conn.execute(f"SHOW {name}").fetchone() for name in _PG_SETTINGS}
            return {name: str(row[0]) for name, row in rows.items() if row is not None}
    except psycopg.Error:
        return None


def _filesystem(path: str) -> str | None:
    """The filesystem type under ``path`` (from /proc/mounts: the longest mount point above it)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    real = os.path.realpath(path)
    above = [m for m in mounts if len(m) == 2 and (real == m[0] or real.startswith(m[0].rstrip("/") + "/"))]
    return max(above, key=lambda m: len(m[0]))[1] if above else None


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the lab's finally: databases dropped


def main(argv: list[str] | None = None) -> int:
    """Run; 0 unless a benchmark crashed (a missed target is a figure, never a failure)."""
    args = parse(argv)
    signal.signal(signal.SIGTERM, _terminate)
    counts = Counts.quick() if args.quick else Counts.full()
    backends = [args.backend] if args.backend else ["sqlite", "postgresql"]
    pg_problem = pg_available() if "postgresql" in backends else None
    if pg_problem is not None:
        banner = "!" * 78
        where = pg_admin_shown()
        log(f"{banner}\nPostgreSQL unreachable at {where} ({pg_problem}): ITS FIGURES ARE SKIPPED.\n{banner}")
        backends.remove("postgresql")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    header: dict[str, Any] = {
        "started": stamp,
        "quick": args.quick,
        "seed": args.seed,
        "only": args.only,
        "backends": backends,
        "counts": counts.__dict__,
        "machine": machine(_pg_settings() if "postgresql" in backends else None, args.tmpdir),
    }
    figures: list[Figure] = []
    crashed: list[str] = []
    started = time.perf_counter()
    with Lab(args.tmpdir) as lab:
        ctx = Context(lab, counts, args.seed, args.quick)
        for name in args.only:
            fn, targets = BENCHES[name]
            for target in targets:
                if target.backend not in backends:
                    continue
                log(f"{name} on {target.label} ...")
                began = time.perf_counter()
                try:
                    figures.extend(fn(ctx, target))
                except Exception:
                    crashed.append(f"{name}[{target.name}]")
                    traceback.print_exc()
                log(f"  ({time.perf_counter() - began:.1f}s)")
    header["seconds"] = round(time.perf_counter() - started, 1)
    header["machine"]["load_average_end"] = os.getloadavg()
    header["crashed"] = crashed
    out = args.results / f"{stamp}.jsonl"
    write_jsonl(out, header, figures)
    print(table(figures))
    met = [f for f in figures if f.met is not None]
    load = (header["machine"]["load_average_start"][0], header["machine"]["load_average_end"][0])
    print(
        f"\n{sum(1 for f in met if f.met)}/{len(met)} targets met; {header['seconds']}s; "
        f"load average {load[0]:.1f} -> {load[1]:.1f}; JSON lines: {out}"
    )
    if crashed:
        print(f"CRASHED: {', '.join(crashed)}", file=sys.stderr)
        return 1
    return 0
