"""Fault campaign, part 2: connections that die.

- Uncertain commits (both backends): a write transaction commits, then its caller sees the connection
  drop, as when a server dies between COMMIT and its reply. The store retries the whole transaction;
  ids and keys are fixed before it, so the retry finds its own earlier write. Every turn must still
  reach the engine exactly once, and no call may fail because it collided with itself.
- Killed connections (PostgreSQL): ``pg_terminate_backend`` on random store connections (their
  ``application_name`` starts with ``transcript-store:``) while several processes run full turns.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import PG_ADMIN
from sqlalchemy import Connection
from sqlalchemy.engine import make_url
from workers.fault_worker import WORKER, clean_env, count_retries, open_store, read_acks, report, verify_turns
from workers.turn_worker import replies, run_turn

from transcript_store import IdempotencyConflict, TransientStoreError, UnknownSession
from transcript_store.turns import Turns

TURNS = 30


def lose_commits(store: Any, lost: Callable[[], bool]) -> None:
    """After each write transaction that committed, ``lost()`` decides whether its connection "drops"."""
    real = store.db._transaction

    @contextmanager
    def lossy(write: bool) -> Iterator[Connection]:
        with real(write) as conn:
            yield conn
        if write and lost():  # reached only when the transaction committed
            raise TransientStoreError("injected: connection lost after COMMIT (the commit landed)")

    store.db._transaction = lossy


def test_uncertain_commits_reach_the_engine_exactly_once(
    request: pytest.FixtureRequest, store_url: str, backend: str
) -> None:
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    store = open_store(store_url)
    injected = [0]

    def lose() -> bool:
        if rng.random() < 0.3:
            injected[0] += 1
            return True
        return False

    lose_commits(store, lose)
    retries = [0]
    count_retries(store, retries)
    turns = Turns(store)  # the production leases: a lost claim would hold its turn for a minute
    resolved = [0]
    committed = turns._committed

    def counting_committed(done: Any) -> bool:
        landed = committed(done)
        resolved[0] += landed
        return landed

    turns._committed = counting_committed  # type: ignore[method-assign]
    sessions = ["u1", "u2"]
    stats: Counter[str] = Counter()
    started = time.monotonic()
    try:
        for sid in sessions:
            store.create_session("crash-scope", session_id=sid)
        args = argparse.Namespace(fail_rate=0.15, abort_rate=0.1)
        acks: list[tuple[str, str, str]] = []
        for _ in range(TURNS):
            run_turn(turns, rng.choice(sessions), rng, args, stats, lambda *told: acks.append(told))
    finally:
        store.close()
    totals = verify_turns(store_url, sessions, acks=acks, expected_replies=replies)
    assert totals["turns"] == stats["fast"] + stats["queued"], (totals, stats)
    report(request, backend, {
        "turns_run": TURNS, "turns_committed": totals["turns"], "uncertain_commits": injected[0],
        "retries": retries[0], "uncertain_completions_resolved": resolved[0], "seed": seed,
        "seconds": round(time.monotonic() - started, 1),
    })
    assert injected[0] > 0 and retries[0] >= injected[0]
    assert totals["turns"] > 0


def test_uncertain_commits_of_rewrites_discards_and_deletes_answer_what_happened(store_url: str) -> None:
    """A retry after a lost COMMIT reports the write that landed, instead of "nothing to do", "unknown"
    or "already exists"."""
    store = open_store(store_url)
    lose = [0]
    between: list[Callable[[], object]] = []  # run after the next commit, before it is reported lost

    def next_commit_lost() -> bool:
        if between:
            saved, lose[0] = lose[0], -(10**6)  # the interloper's own commits are not lost
            try:
                between.pop()()
            finally:
                lose[0] = saved
        lose[0] -= 1
        return lose[0] >= 0

    lose_commits(store, next_commit_lost)
    scope, sid = "crash-scope", "u1"
    try:
        store.create_session(scope, session_id=sid)
        made = store.append_many(scope, sid, [{"message": {"role": "user", "content": f"m{i}"}} for i in range(3)])
        lose[0] = 1
        result = store.rewrite_entries(scope, sid, [{"entry_id": made[1].entry_id,
                                                     "message": {"role": "user", "content": "edited"}}])
        assert (result.changed, result.rewritten_entries, result.generation) == (True, 2, 1), result
        assert [e.message["content"] for e in store.read_visible(scope, sid)] == ["m0", "edited", "m2"]
        assert len(store.list_entries(scope, sid)) == 5  # rewritten once, not twice

        turns = Turns(store)
        turns.admit(scope, sid, {"role": "user", "content": "q"}, turn_id="t1", engine_id="e")
        lose[0] = 1
        assert turns.discard(scope, sid, "t1") is True
        assert turns.intent(scope, sid, "t1") is None
        assert turns.discard(scope, sid, "t1") is False  # a new call finds nothing to discard

        header, records = store.export_session(scope, sid)
        lose[0] = 1
        store.delete_session(scope, sid)  # no UnknownSession from the retry of its own delete
        with pytest.raises(UnknownSession):
            store.get_session(scope, sid)
        with pytest.raises(UnknownSession):
            store.delete_session(scope, sid)  # a new call: the session is unknown

        lose[0] = 1
        imported = store.import_session(scope, header, records)  # no "already exists" from its own retry
        assert imported == store.get_session(scope, sid)
        assert [e.entry_id for e in store.list_entries(scope, sid)] == [r["entry_id"] for r in records]
        with pytest.raises(IdempotencyConflict):
            store.import_session(scope, header, records)  # a new call: the session exists

        # A delete whose COMMIT is lost, and before its retry another import of the same export (the
        # same creation time, another incarnation): the retry must not delete that new session.
        between.append(lambda: store.import_session(scope, header, records))
        lose[0] = 1
        store.delete_session(scope, sid)
        again = store.get_session(scope, sid)
        assert again.incarnation != imported.incarnation and again.created_at == imported.created_at

        # A branch whose COMMIT is lost, and before its retry another writer appends after the entry it
        # moved to (and is told so): the retry must not take that append off the visible transcript.
        made = store.append_many(scope, sid, [{"message": {"role": "user", "content": f"b{i}"}} for i in range(3)])
        reply = {"role": "assistant", "content": "after the move"}
        between.append(lambda: store.append(scope, sid, reply))
        lose[0] = 1
        store.branch(scope, sid, made[0].entry_id)
        shown = [e.message["content"] for e in store.read_visible(scope, sid)]
        assert shown[-2:] == ["b0", "after the move"], shown

        # An end_session whose COMMIT is lost, and before its retry the session is deleted and another
        # made under its id: the retry must not end that one.
        store.create_session(scope, session_id="u3", session_key="chat:1")

        def replace() -> None:
            store.delete_session(scope, "u3")
            store.create_session(scope, session_id="u3", session_key="chat:2")

        between.append(replace)
        lose[0] = 1
        ended = store.end_session(scope, "u3")
        assert not ended.active and ended.session_key == "chat:1"
        successor = store.find_session(scope, "chat:2")
        assert successor is not None and successor.active and successor.incarnation != ended.incarnation
    finally:
        store.close()


# ---------------------------------------------------------------------------------------------- killed


class Killer(threading.Thread):
    """Terminates a random store connection of one database every 50-250 ms."""

    def __init__(self, dbname: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.dbname = dbname
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.kills = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        """Kill until stopped; an error is kept for the test to report."""
        try:
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                while not self.stop.wait(self.rng.uniform(0.05, 0.25)):
                    pids = [r[0] for r in conn.execute(
                        "SELECT pid FROM pg_stat_activity WHERE datname = %s"
                        " AND application_name LIKE 'transcript-store:%%' AND pid <> pg_backend_pid()",
                        (self.dbname,),
                    )]
                    if pids:
                        row = conn.execute("SELECT pg_terminate_backend(%s)", (self.rng.choice(pids),)).fetchone()
                        self.kills += bool(row and row[0])
        except BaseException as e:  # reported by the test
            self.error = e


def killed_connections(request: pytest.FixtureRequest, url: str, tmp: Path, children: int, seconds: float) -> None:
    """Run ``children`` turn workers for ``seconds`` under the Killer, then check every turn and report."""
    seed = random.randrange(2**31)
    args = [
        sys.executable, str(WORKER), "load", "--kind", "turns", "--url", url, "--seed", str(seed),
        "--children", str(children), "--sessions", "4", "--seconds", str(seconds), "--out", str(tmp),
        "--prefix", "k",
    ]
    started = time.monotonic()
    with open(tmp / "load.err", "w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=clean_env())
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline() or "{}")
        killer = Killer(str(make_url(url).database), seed)
        killer.start()
        out = proc.stdout.read()
        proc.wait(timeout=seconds + 300)
        killer.stop.set()
        killer.join(timeout=30)
    log = (tmp / "load.err").read_text()
    assert killer.error is None, repr(killer.error)
    assert ready.get("ready") == children, log[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0 and result["failed"] == [], log[-4000:]
    loads = [json.loads((tmp / f"load-{i}.json").read_text()) for i in range(children)]
    sessions = [sid for load in loads for sid in load["sessions"]]
    acks = read_acks(tmp / "acks")
    totals = verify_turns(url, sessions, acks=acks, expected_replies=replies)
    # Every turn a worker was told was accepted or committed is one committed turn, and no other turn is.
    told = sum(x.get("fast", 0) + x.get("queued", 0) for x in loads)
    assert totals["turns"] == told == sum(what in ("accepted", "committed") for what, _s, _t in acks), (totals, told)
    figures = {
        "connections_killed": killer.kills, "processes": children, "turns_run": sum(x["turns"] for x in loads),
        "turns_committed": totals["turns"], "turns_unaccepted": totals["unaccepted"],
        "retries": sum(x["retries"] for x in loads), "recovered_by_final_pass": totals["recovered"],
        "seed": seed, "seconds": round(time.monotonic() - started, 1),
    }
    report(request, "postgresql", figures)
    assert killer.kills > 0 and figures["retries"] > 0, figures
    assert totals["turns"] > 0, figures


@pytest.mark.parametrize("backend", ["postgresql"])
def test_killed_connections_every_turn_exactly_once(
    request: pytest.FixtureRequest, store_url: str, tmp_path: Path
) -> None:
    killed_connections(request, store_url, tmp_path, children=3, seconds=4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgresql"])
def test_killed_connections_every_turn_exactly_once_at_scale(
    request: pytest.FixtureRequest, store_url: str, tmp_path: Path
) -> None:
    killed_connections(request, store_url, tmp_path, children=4, seconds=45)
