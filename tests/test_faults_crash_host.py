"""Fault campaign, part 1 through the host: SIGKILL while ``HostRuntime.run_turn`` drives full turns on
the bundled engines (legacy and lossless), at random instants and at the fault points of admission,
acceptance, commit, the lossless engine's compaction and a turn's return (its worker dies before it
answers, and the turn is sent again). Then a new gateway's recovery (each
unfinished turn sent again, one new turn per session) and every invariant: zero lost acknowledged
turns, zero duplicates, zero partial turns, the ledger equal to its receipts, each lossless session's
summary DAG consistent and its messages the transcript's, every SQLite file passing its integrity
check. The worker is tests/workers/host_fault_worker.py; the default tier lands a few kills per
backend, the slow tier (``make test-slow``) a thousand.
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
from workers.fault_worker import clean_env, read_acks, report, sqlite_integrity
from workers.host_fault_worker import FAULT_POINTS, WORKER, recover_and_verify


def run_campaign(url: str, tmp: Path, kills: int, slots: int, seconds: float) -> dict[str, Any]:
    """``slots`` zygotes at once, each on sessions of its own, until ``kills`` SIGKILLs have landed."""
    seed = random.randrange(2**31)
    (tmp / "acks").mkdir()
    procs = []
    for slot in range(slots):
        args = [
            sys.executable, str(WORKER), "--url", url, "--seed", str(seed + slot), "--slot", str(slot),
            "--prefix", f"h{slot}.", "--kills", str(-(-kills // slots)), "--seconds", str(seconds),
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
            for key in ("kills", "parent_kills", "point_kills", "finished", "children", "turns", "retries", "resent"):
                merged[key] = merged.get(key, 0) + result[key]
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


def host_campaign(request: pytest.FixtureRequest, url: str, backend: str, tmp: Path, kills: int, slots: int,
                  seconds: float) -> dict[str, Any]:
    """The campaign, the recovery and every check; reports and returns the figures."""
    started = time.monotonic()
    run = run_campaign(url, tmp, kills, slots, seconds)
    assert not run["errors"], "\n".join(run["errors"])
    integrity = sqlite_integrity(url)  # the files as the killed processes left them
    acks = read_acks(tmp / "acks")
    totals = recover_and_verify(url, run["sessions"], acks)
    sqlite_integrity(url)
    figures = {
        "kills": run["kills"], "parent_kills": run["parent_kills"], "point_kills": run["point_kills"],
        "workers": run["children"], "finished_workers": run["finished"], "turns_run": run["turns"],
        "turns_committed": totals["turns_committed"], "committed_on_legacy": totals["committed_on_legacy"],
        "committed_on_lossless": totals["committed_on_lossless"],
        "lossless_summaries": totals["lossless_summaries"], "resent_by_recovery": totals["resent_by_recovery"],
        "resent_after_kill": run["resent"], "turns_unaccepted": totals["unaccepted"],
        "turns_acknowledged_accepted": totals["acked_accepted"], "retries": run["retries"],
        "integrity_check": integrity or "n/a", "seed": run["seed"], "seconds": round(time.monotonic() - started, 1),
        "killed_at": dict(sorted(run["killed_at"].items())),
    }
    report(request, backend, figures)
    assert run["kills"] >= kills, figures
    assert totals["acked_accepted"] > 0 and totals["lossless_summaries"] > 0, figures
    return figures


def test_sigkill_campaign_through_the_host(request: pytest.FixtureRequest, store_url: str, backend: str,
                                          tmp_path: Path) -> None:
    host_campaign(request, store_url, backend, tmp_path, kills=12, slots=2, seconds=90)


@pytest.mark.slow
def test_sigkill_campaign_through_the_host_1000_kills(request: pytest.FixtureRequest, store_url: str, backend: str,
                                                      tmp_path: Path) -> None:
    figures = host_campaign(request, store_url, backend, tmp_path, kills=1000, slots=4, seconds=600)
    killed_at = {k for k in figures["killed_at"] if not k.startswith("parent@")}
    assert set(FAULT_POINTS) <= killed_at, f"fault points that never killed: {set(FAULT_POINTS) - killed_at}"
