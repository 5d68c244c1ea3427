"""Fault campaign, part 7: a soak. Worker processes run a mixed load for a minute per backend (full turns
with recovery, admission, completion on the fast path or queued for the drain, then the engine's
incremental delta reads and a closed-range read of the turn) on sessions that grow all along.
Measured per worker: RSS, turn latency and read latency by quarter of the run. Asserted against drift
between the second quarter and the last: median RSS grows by at most 4 MiB (seen: about 1), p95 turn
latency within 2x + 5 ms and p95 read latency within 2x + 1 ms (on two shared cores p95 moves by half
between two quarters of the same code; a leak or a read that grows with the session moves it far more).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from workers.fault_worker import WORKER, clean_env, report

SECONDS = 60.0
CHILDREN = 2
#: the most a worker's median RSS may grow from the second quarter to the last (a relative bound of 15%
#: let ~8 MiB through: 3-6 KB leaked per turn)
RSS_GROWTH_MAX = 4 * 2**20


def quarter(points: list[Any], q: int, seconds: float) -> list[Any]:
    """The points of quarter ``q`` (1..4) of a run, by their elapsed time (first field)."""
    lo, hi = seconds * (q - 1) / 4, seconds * q / 4
    return [p for p in points if lo <= p[0] < hi]


def p95(values: list[float]) -> float:
    """The 95th percentile (the maximum of fewer than 20 values)."""
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 20 else max(values)


@pytest.mark.slow
def test_soak_memory_and_latency_stay_flat(
    request: pytest.FixtureRequest, store_url: str, backend: str, tmp_path: Path
) -> None:
    seed = random.randrange(2**31)
    args = [sys.executable, str(WORKER), "load", "--kind", "soak", "--url", store_url, "--seed", str(seed),
            "--children", str(CHILDREN), "--seconds", str(SECONDS), "--out", str(tmp_path), "--prefix", "soak"]
    started = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, env=clean_env(), timeout=SECONDS + 600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["failed"] == [], done.stderr[-4000:]
    figures: dict[str, Any] = {"seconds": SECONDS, "workers": CHILDREN, "seed": seed, "turns": 0}
    drift = []
    for i in range(CHILDREN):
        load = json.loads((tmp_path / f"load-{i}.json").read_text())
        figures["turns"] += load["turns"]
        rss = [statistics.median(r for _, r in quarter(load["rss"], q, SECONDS)) for q in (2, 4)]
        lat = [p95([t for _, t, _ in quarter(load["samples"], q, SECONDS)]) for q in (2, 4)]
        reads = [p95([r for _, _, r in quarter(load["samples"], q, SECONDS)]) for q in (2, 4)]
        figures[f"worker{i}"] = {
            "rss_mib_q2": round(rss[0] / 2**20, 1), "rss_mib_q4": round(rss[1] / 2**20, 1),
            "turn_p95_ms_q2": round(lat[0] * 1000, 1), "turn_p95_ms_q4": round(lat[1] * 1000, 1),
            "read_p95_ms_q2": round(reads[0] * 1000, 1), "read_p95_ms_q4": round(reads[1] * 1000, 1),
            "retries": load["retries"],
        }
        drift.append((i, rss, lat, reads))
    figures["wall_seconds"] = round(time.monotonic() - started, 1)
    report(request, backend, figures)
    for i, rss, lat, reads in drift:
        assert rss[1] <= rss[0] + RSS_GROWTH_MAX, f"worker {i}: RSS grew from {rss[0]} to {rss[1]} bytes"
        assert lat[1] <= lat[0] * 2.0 + 0.005, f"worker {i}: p95 turn latency drifted from {lat[0]} to {lat[1]} s"
        # Reads write nothing and wait for no fsync: their bound needs no room for the disk's latency (at
        # 2x + 5 ms, a read p95 of 0.4 ms could grow 14-fold and pass).
        assert reads[1] <= reads[0] * 2.0 + 0.001, f"worker {i}: p95 read latency went {reads[0]} -> {reads[1]} s"
