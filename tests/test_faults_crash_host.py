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

import time
from pathlib import Path
from typing import Any

import pytest
from test_faults_crash import check_kills, run_campaign
from workers.fault_worker import read_acks, report, sqlite_integrity
from workers.host_fault_worker import FAULT_POINTS, WORKER, recover_and_verify


def host_campaign(request: pytest.FixtureRequest, url: str, backend: str, tmp: Path, kills: int, slots: int,
                  seconds: float) -> dict[str, Any]:
    """The campaign, the recovery and every check; reports and returns the figures."""
    started = time.monotonic()
    run = run_campaign(url, tmp, kills, slots, seconds, command=(str(WORKER),), prefix="h")
    assert not run["errors"], "\n".join(run["errors"])
    integrity = sqlite_integrity(url)  # the files as the killed processes left them
    acks = read_acks(tmp / "acks")
    assert len(list((tmp / "acks").glob("*.log"))) == run["children"], "a worker without its acknowledgement log"
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
    check_kills(run)
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
