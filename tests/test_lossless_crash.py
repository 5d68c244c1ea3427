"""SIGKILL during compaction, with real processes, on both backends: the summary DAG stays consistent.

A worker (tests/workers/lossless_worker.py churn) commits turns and forces compactions in a loop. It
dies two ways: fault points kill it in the middle of a compaction's transaction (after the summaries
and sources are inserted, before the context list and view are updated), and the parent SIGKILLs it at
random instants. After every death the audit must find nothing wrong: no context item pointing to a
missing summary, no message both summarized in context and in the raw tail, counters that agree with
the rows; at the end every visible message is reachable from the context list.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import func, select
from workers.lossless_worker import SCOPE, churn_engine, commit_one_turn

from engines.lossless.audit import audit
from engines.lossless.tables import summaries
from transcript_store import TranscriptStore

WORKER = Path(__file__).parent / "workers" / "lossless_worker.py"
LIVES = 4
FAULTS = "lossless.compact.mid_write=0.08,lossless.compact.before_view=0.08,commit.after_apply=0.03"


def live_once(url: str, session_id: str, life: int, rng: random.Random) -> tuple[str, int]:
    """One worker lifetime: returns how it died and how many operations it finished."""
    env = {**os.environ, "TRANSCRIPT_STORE_FAULTS": FAULTS, "TRANSCRIPT_STORE_FAULT_SEED": str(1000 + life)}
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "churn", "--url", url, "--session", session_id, "--seed", str(life)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    assert ready.strip() == "ready", proc.stderr.read() if proc.stderr else ready
    time.sleep(rng.uniform(0.1, 0.6))
    how = "fault point" if proc.poll() is not None else "parent"
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err
    done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return how, len(done)


def test_sigkill_during_compaction_leaves_a_consistent_dag(store_url: str, store: TranscriptStore) -> None:
    sid = store.create_session(SCOPE, session_id="crashy").session_id
    engine = churn_engine(store)
    rng = random.Random(20261201)
    for i in range(12):  # some history first, so the very first compactions have work
        commit_one_turn(store, engine, sid, f"seed-{i}", rng)
    deaths = []
    for life in range(LIVES):
        deaths.append(live_once(store_url, sid, life, rng))
        result = store.read(lambda c: audit(c, SCOPE, sid))
        assert result.problems == [], (life, deaths, result.problems)
    assert sum(n for _how, n in deaths) > 0, deaths
    # Catch up with every admitted message (a worker may have died between an admission and its commit).
    final = engine.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=100_000)
    assert final.messages
    result = store.read(lambda c: audit(c, SCOPE, sid))
    assert result.problems == []
    assert result.covered_entry_ids == {e.entry_id for e in store.read_visible(SCOPE, sid)}
    made = store.read(lambda c: c.conn.execute(
        select(func.count()).select_from(summaries).where(summaries.c.session_id == sid)).scalar_one())
    assert made > 0
