"""Race tests with real processes: workers presenting the same advancement keys at once, and workers
draining the same outbox at once. On PostgreSQL they really run concurrently; on SQLite they serialize
on the write lock. Either way: each key committed once, every other presentation a duplicate, nothing
written twice, and the engine's state equals the receipts.

``make test`` races 4 processes, ``make test-slow`` 8 (CI time: each process is a Python start-up and a
store opening on two busy cores; 4 already race on PostgreSQL and queue on SQLite's write lock).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from workers.turn_worker import ENGINE, SCOPE, replies, user_message

from transcript_store import ClosedRange, StoreConfig, TranscriptStore
from transcript_store.core import Core
from transcript_store.ledger import committed_messages, count_turn_messages, get_state
from transcript_store.turns import Turns

WORKER = Path(__file__).parent / "workers" / "turn_worker.py"
#: processes per race: the short tier's, then the slow tier's
PROCESSES = [4, pytest.param(8, marks=pytest.mark.slow)]


def run_workers(mode: str, url: str, tmp: Path, extra: list[str], processes: int) -> list[dict[str, Any]]:
    """Start ``processes`` workers, release them together once all are ready, return their reports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    procs = []
    for i in range(processes):
        err = open(tmp / f"{mode}-{i}.err", "w")  # noqa: SIM115 - closed below, after the process exits
        args = [sys.executable, str(WORKER), mode, "--url", url, "--seed", str(i), *extra]
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        procs.append((proc, err))
    for i, (proc, err) in enumerate(procs):
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            proc.wait(timeout=60)
            err.close()
            pytest.fail(f"worker {i} died before ready:\n{(tmp / f'{mode}-{i}.err').read_text()[-4000:]}")
    for proc, _ in procs:  # the go signal, as close together as the pipes allow
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    reports = []
    for i, (proc, err) in enumerate(procs):
        out, _ = proc.communicate(timeout=120)
        err.close()
        assert proc.returncode == 0, (tmp / f"{mode}-{i}.err").read_text()[-4000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def open_store(url: str) -> TranscriptStore:
    return TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))


def engine_state(store: TranscriptStore, sid: str) -> tuple[Any, list[str], int]:
    def run(c: Core) -> tuple[Any, list[str], int]:
        order = get_state(c, SCOPE, sid, ENGINE, "order") or []
        return get_state(c, SCOPE, sid, ENGINE, "turns"), order, count_turn_messages(c, SCOPE, sid, ENGINE)

    return store.read(run)


@pytest.mark.parametrize("processes", PROCESSES)
def test_same_advancement_keys_from_many_processes(store_url: str, tmp_path: Path, processes: int) -> None:
    store = open_store(store_url)
    plan: list[dict[str, Any]] = []
    sessions = ["r1", "r2"]
    try:
        for sid in sessions:
            store.create_session(SCOPE, session_id=sid)
            for n in range(6):
                turn_id = f"{sid}.t{n}"
                admission = store.admit(SCOPE, sid, user_message(turn_id), turn_id=turn_id)
                appended = store.append_many(SCOPE, sid, replies(turn_id, random.Random(n)))
                terminal = store.anchor(SCOPE, sid, appended[-1].entry_id)
                closed = store.read_closed_range(admission, terminal)
                assert isinstance(closed, ClosedRange)
                plan.append({
                    "admission": admission.model_dump(mode="json"),
                    "terminal": terminal.model_dump(mode="json"),
                    "messages": closed.messages,
                })
        (tmp_path / "plan.json").write_text(json.dumps(plan))

        reports = run_workers("commit", store_url, tmp_path, ["--plan", str(tmp_path / "plan.json")], processes)

        keys = [p["admission"]["turn_id"] for p in plan]
        statuses = {k: Counter(r["statuses"][k] for r in reports) for k in keys}
        for key, seen in statuses.items():
            assert seen == Counter({"committed": 1, "duplicate": processes - 1}), (key, seen)
        turns = Turns(store)
        for sid in sessions:
            receipts = turns.receipts(SCOPE, sid, ENGINE)
            expected = [p for p in plan if p["admission"]["anchor"]["session_id"] == sid]
            assert sorted(r.advancement_key for r in receipts) == sorted(p["admission"]["turn_id"] for p in expected)
            counter, order, messages = engine_state(store, sid)
            assert counter == len(expected) and sorted(order) == sorted(r.advancement_key for r in receipts)
            assert messages == sum(len(p["messages"]) for p in expected)  # zero duplicate ledger messages
            for p in expected:
                key = p["admission"]["turn_id"]
                assert store.read(lambda c, k=key, s=sid: committed_messages(c, SCOPE, s, ENGINE, k)) == p["messages"]
    finally:
        store.close()


@pytest.mark.parametrize("processes", PROCESSES)
def test_many_processes_drain_the_same_outbox(store_url: str, tmp_path: Path, processes: int) -> None:
    store = open_store(store_url)
    sessions = [f"d{i}" for i in range(4)]
    try:
        turns = Turns(store)
        expected: dict[str, list[str]] = {}
        for sid in sessions:
            store.create_session(SCOPE, session_id=sid)
            for n in range(6):
                turn_id = f"{sid}.t{n}"
                turns.admit(SCOPE, sid, user_message(turn_id), turn_id=turn_id, engine_id=ENGINE)
                done = turns.complete(SCOPE, sid, turn_id, replies(turn_id, random.Random(n)), None)
                assert done.intent.state == "accepted"
                expected.setdefault(sid, []).append(turn_id)
        total = sum(len(v) for v in expected.values())

        reports = run_workers("drain", store_url, tmp_path, ["--delivery-lease", "60"], processes)

        committed = [k for r in reports for k in r["committed"]]
        duplicates = [k for r in reports for k in r["duplicates"]]
        assert sorted(committed) == sorted(k for v in expected.values() for k in v), "each turn committed once"
        assert duplicates == [], "a live delivery claim was delivered twice"
        assert len(committed) == total and turns.intents(SCOPE) == []
        for sid, keys in expected.items():
            receipts = turns.receipts(SCOPE, sid, ENGINE)
            assert sorted(r.advancement_key for r in receipts) == sorted(keys)
            counter, order, messages = engine_state(store, sid)
            assert counter == len(keys) and order == keys  # strict admission order per session
            assert messages == sum(r.message_count for r in receipts)
    finally:
        store.close()
