"""Fault campaign, part 1: SIGKILL. Worker processes driving full turns are killed at random instants
and inside admission, acceptance, drain and commit (the fault points), then one recovery pass, then
every invariant: zero lost accepted turns, zero duplicates, zero partial turns, every engine state
equal to its receipts, and every SQLite file passing ``PRAGMA integrity_check``. "Lost" is judged against
what the workers were told, not only against what the database kept: each worker logs every turn it was
told was admitted, accepted or committed (an append-only file per worker), and each of those must hold
after recovery. "Partial" is judged against the replies the worker wrote, a function of the turn id.

Kills are cheap because the workers are forked from a warmed-up zygote (tests/workers/fault_worker.py):
the default tier lands a handful per backend, the slow tier (``make test-slow``) at least 1,000.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from workers.fault_worker import (
    FAULT_POINTS,
    TRACE_MARKS,
    WORKER,
    clean_env,
    read_acks,
    report,
    sqlite_integrity,
    verify_turns,
)
from workers.turn_worker import replies


def run_campaign(url: str, tmp: Path, kills: int, slots: int, seconds: float, *,
                 command: tuple[str, ...] = (str(WORKER), "campaign"), prefix: str = "w") -> dict[str, Any]:
    """Run ``slots`` zygotes at once (``command``: a campaign worker), each on its own sessions, until
    ``kills`` SIGKILLs have landed; their figures added up (every count of their JSON lines)."""
    seed = random.randrange(2**31)
    per_slot = -(-kills // slots)
    (tmp / "acks").mkdir()
    procs = []
    for slot in range(slots):
        args = [
            sys.executable, *command, "--url", url, "--seed", str(seed + slot), "--slot", str(slot),
            "--prefix", f"{prefix}{slot}.", "--kills", str(per_slot), "--seconds", str(seconds),
            "--trace", str(tmp / f"trace-{slot}"), "--acks", str(tmp / "acks"),
        ]
        err = open(tmp / f"campaign-{slot}.err", "w")  # noqa: SIM115 - closed once the zygote exits
        procs.append((subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=clean_env(),
                                       start_new_session=True), err))
    merged: dict[str, Any] = {"seed": seed, "killed_at": Counter(), "sessions": [], "errors": []}
    try:
        for slot, (proc, err) in enumerate(procs):
            out, _ = proc.communicate(timeout=seconds + 300)
            err.close()
            log = (tmp / f"campaign-{slot}.err").read_text()
            assert proc.returncode == 0 and out.strip(), f"zygote {slot} exited {proc.returncode}:\n{log[-4000:]}"
            result = json.loads(out.strip().splitlines()[-1])
            for key, value in result.items():
                if isinstance(value, int):
                    merged[key] = merged.get(key, 0) + value
            merged["killed_at"].update(result["killed_at"])
            merged["sessions"] += result["sessions"]
            merged["errors"] += [f"slot {slot}: {e}" for e in result["errors"]]
            merged["errors"] += [log[-4000:]] if result["errors"] else []
    finally:  # a failed or hung zygote: the others (and their children) must not run on against a database
        for proc, err in procs:  # about to be dropped: each zygote leads a process group of its own
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            err.close()
    return merged


def check_kills(run: dict[str, Any]) -> None:
    """Both kinds of SIGKILL landed, and each kill a fault point made is counted where it was made: at a
    fault point, never at one of the trace's own marks (that would be a SIGKILL from elsewhere, or a
    point that killed before it was traced, counted as a kill "inside" the named points)."""
    assert run["point_kills"] > 0 and run["parent_kills"] > 0, run["killed_at"]
    by_point = {k: n for k, n in run["killed_at"].items() if not k.startswith("parent@")}
    assert sum(by_point.values()) == run["point_kills"], run["killed_at"]
    assert not set(by_point) & set(TRACE_MARKS), f"kills counted at a fault point outside any: {by_point}"


def crash_campaign(request: pytest.FixtureRequest, url: str, backend: str, tmp: Path, kills: int,
                   slots: int, seconds: float) -> dict[str, Any]:
    """The campaign, the recovery pass and every check; reports and returns the figures."""
    started = time.monotonic()
    run = run_campaign(url, tmp, kills, slots, seconds)
    assert not run["errors"], "\n".join(run["errors"])
    campaign_seconds = time.monotonic() - started
    integrity = sqlite_integrity(url)  # before recovery: the files as the killed processes left them
    acks = read_acks(tmp / "acks")
    assert len(list((tmp / "acks").glob("*.log"))) == run["children"], "a worker without its acknowledgement log"
    totals = verify_turns(url, run["sessions"], acks, expected_replies=replies)
    sqlite_integrity(url)
    figures = {
        "kills": run["kills"], "parent_kills": run["parent_kills"], "point_kills": run["point_kills"],
        "workers": run["children"], "finished_workers": run["finished"], "turns_run": run["turns"],
        "turns_committed": totals["turns"], "turns_unaccepted": totals["unaccepted"],
        "turns_acknowledged_accepted": totals["acked_accepted"],
        "turns_acknowledged_committed": totals["acked_committed"], "degraded_turns": totals["degraded"],
        "recovered_by_final_pass": totals["recovered"], "retries": run["retries"],
        "integrity_check": integrity or "n/a", "seed": run["seed"],
        "campaign_seconds": round(campaign_seconds, 1), "seconds": round(time.monotonic() - started, 1),
        "killed_at": dict(sorted(run["killed_at"].items())),
    }
    report(request, backend, figures)
    assert run["kills"] >= kills, figures
    check_kills(run)
    assert totals["turns"] > 0 and totals["acked_accepted"] > 0, figures
    return figures


def test_sigkill_campaign(request: pytest.FixtureRequest, store_url: str, backend: str, tmp_path: Path) -> None:
    crash_campaign(request, store_url, backend, tmp_path, kills=16, slots=2, seconds=60)


@pytest.mark.slow
def test_sigkill_campaign_1000_kills(request: pytest.FixtureRequest, store_url: str, backend: str,
                                     tmp_path: Path) -> None:
    figures = crash_campaign(request, store_url, backend, tmp_path, kills=1000, slots=4, seconds=420)
    killed_at = {k for k in figures["killed_at"] if not k.startswith("parent@")}
    assert set(FAULT_POINTS) <= killed_at, f"fault points that never killed: {set(FAULT_POINTS) - killed_at}"


def test_check_kills_refuses_a_kill_counted_outside_the_fault_points() -> None:
    """The check itself: a point kill whose trace shows a mark (no fault point), or none of one kind."""
    good = {"point_kills": 2, "parent_kills": 1, "killed_at": Counter({"admit.before": 2, "parent@turn.begin": 1})}
    check_kills(good)
    for bad in (
        {**good, "killed_at": Counter({"admit.before": 1, "turn.begin": 1, "parent@turn.begin": 1})},
        {**good, "point_kills": 3},
        {**good, "parent_kills": 0, "killed_at": Counter({"admit.before": 2})},
    ):
        with pytest.raises(AssertionError):
            check_kills(bad)
