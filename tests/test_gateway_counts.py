"""Findings of the gateway review, second round: the report's degraded count taken from the workers' answers
(a worker killed after degrading its turn answered nothing), a library call that set the process's logging
level (two runs in two threads restored it out of order), and a dispatcher that scanned every session for
each turn it sent.

The first two run real worker processes; the dispatcher's work is counted with in-process workers (threads
on real pipes), so a run of hundreds of sessions takes a fraction of a second.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import threading
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from transcript_store import gateway
from transcript_store.gateway import GatewayOptions, GatewayReport, Job, _dispatch, run_gateway

QUIET = Console(quiet=True)


def _row(report: GatewayReport, what: str) -> list[str]:
    """The cells of the first row of the rendered report whose label starts with ``what``."""
    out = StringIO()
    report.render(Console(file=out, width=200, markup=False, highlight=False))
    for line in out.getvalue().splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 2 and cells[1].startswith(what):
            return cells[1:-1]
    raise AssertionError(f"no row {what!r} in:\n{out.getvalue()}")


# ---------------------------------------------------------------------------------------------- 1: counts


DIES_BEFORE_ANSWERING = """
import os, signal
from multiprocessing.connection import Connection

from engines.legacy import LegacyEngine

MARKS = {marks!r}
TEST_PROCESS = {test_pid}
_send = Connection.send


def send(self, obj):
    # The worker's first answer to the dispatcher: its turn is committed (on legacy), and the worker dies
    # before the answer leaves (an OOM kill, a node lost, a kill from elsewhere between commit and reply).
    # The test's process imports this plugin too (the registry checks it): there it changes nothing, or a
    # later test's pipe there died with it (FileNotFoundError once this test's folder was removed).
    if os.getpid() == TEST_PROCESS:
        return _send(self, obj)
    if isinstance(obj, tuple) and obj[0] == "ok" and not os.path.exists(os.path.join(MARKS, "died")):
        open(os.path.join(MARKS, "died"), "w").write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return _send(self, obj)


Connection.send = send


class Engine(LegacyEngine):
    info = LegacyEngine.info.model_copy(update={{"id": "failing", "name": "failing"}})

    def assemble(self, **kw):
        raise RuntimeError("cannot assemble")  # every turn degrades to legacy, turn-locally


def create_engine(ctx):
    return Engine(ctx)
"""


def test_a_turn_degraded_by_a_worker_that_died_before_answering_is_counted_from_the_store(
    store_url: str, tmp_path: Path
) -> None:
    """A worker that degraded its turn to legacy, committed it and died before its answer reported
    nothing; the turn's retry learnt "duplicate" (no degradation, no reason): the report counted one
    degraded turn of two, from the answers, while the store holds both on legacy, not on the engine of
    the run."""
    folder = tmp_path / "plugins" / "failing"
    folder.mkdir(parents=True)
    (folder / "plugin.yaml").write_text("name: failing\nversion: 1.0\nentry: create_engine\n")
    (folder / "__init__.py").write_text(DIES_BEFORE_ANSWERING.format(marks=str(tmp_path), test_pid=os.getpid()))
    config = tmp_path / "transcript-store.toml"
    config.write_text('[engine]\nplugin_dirs = ["plugins"]\n')
    report = run_gateway(GatewayOptions(db_url=store_url, engine="failing", config_path=str(config), workers=1,
                                        sessions=1, turns=2, faults=False, progress=False), QUIET)
    assert (tmp_path / "died").exists()
    [problem] = report.problems  # the death, not planned: the run fails for it, and only for it
    assert "died unexpectedly (exit code -9 running turn" in problem
    assert report.committed == 2 and report.retried_dispatches == 1 and report.duplicates_absorbed == 1
    # The table's degraded turns are the store's; the workers' word is a row of its own, labelled so.
    assert _row(report, "degraded turns") == ["degraded turns (held by another engine)", "2", "store"]
    assert _row(report, "degraded turns the workers reported") == ["degraded turns the workers reported", "1",
                                                                   "workers"]
    assert _row(report, "duplicates absorbed")[2] == "workers"
    assert report.degraded_turns == 2 and report.turns_by_engine == {"legacy": 2}
    assert sum(report.degraded.values()) == 1  # the dead worker's degradation: never answered
    assert report.to_dict()["degraded_turns"] == 2


# ---------------------------------------------------------------------------------------------- 2: logging


def _logging_state() -> tuple[Any, ...]:
    root, lib = logging.getLogger(), logging.getLogger("transcript_store")
    return root.level, list(root.handlers), list(root.filters), lib.level, list(lib.handlers), list(lib.filters)


@pytest.fixture
def lib_level() -> Iterator[int]:
    """The package logger at a level of the embedding application's own (restored after the test)."""
    lib = logging.getLogger("transcript_store")
    before = lib.level
    lib.setLevel(logging.INFO)
    yield logging.INFO
    lib.setLevel(before)


def _watching_dispatch(monkeypatch: pytest.MonkeyPatch, seen: dict[str, tuple[Any, ...]],
                       before_run: dict[str, threading.Event] | None = None) -> None:
    """Wrap the run's dispatcher: note the logging state it runs under (per thread); with ``before_run``,
    wait in it for the event named by the thread's name."""
    inner = gateway._dispatch

    def watching(*args: Any) -> Any:
        name = threading.current_thread().name
        seen[name] = _logging_state()
        if before_run is not None:
            before_run[f"{name}-in"].set()
            assert before_run[f"{name}-go"].wait(timeout=120)
        return inner(*args)

    monkeypatch.setattr(gateway, "_dispatch", watching)


def test_a_library_run_leaves_the_process_logging_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lib_level: int
) -> None:
    """run_gateway set the package logger's level to ERROR for its run: an embedding application lost
    its own transcript_store records (of its other threads) while a run lasted."""
    before = _logging_state()
    seen: dict[str, tuple[Any, ...]] = {}
    _watching_dispatch(monkeypatch, seen)
    report = run_gateway(GatewayOptions(db_url=f"sqlite:///{tmp_path / 'g.db'}", engine="legacy", workers=1,
                                        sessions=2, turns=1, faults=False, progress=False), QUIET)
    assert report.ok, report.problems
    assert list(seen.values()) == [before], "the run changed the process's logging while it ran"
    assert _logging_state() == before
    # The same run, on its configured engine, counts no degraded turn (CI time: one run for both checks).
    assert report.degraded_turns == 0 and report.turns_by_engine == {"legacy": 2}
    assert _row(report, "turns committed") == ["turns committed to the engine", "2", "store"]


def test_the_gateway_command_quiets_the_library_for_its_run_only(tmp_path: Path, lib_level: int) -> None:
    """The command sets the package logger to ERROR for its run (the faults are on purpose) and gives
    the level back after it: run inside another program's process (click's runner, a test) it left
    every later warning of the library unlogged."""
    from click.testing import CliRunner

    from transcript_store.cli import cli

    result = CliRunner().invoke(cli, ["gateway", "--workers", "1", "--sessions", "1", "--turns", "1",
                                      "--no-faults", "--db", f"sqlite:///{tmp_path / 'g.db'}"])
    assert result.exit_code == 0, result.output
    assert logging.getLogger("transcript_store").level == lib_level


def test_two_runs_in_two_threads_leave_the_logging_level_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lib_level: int
) -> None:
    """Each run saved the level it found and restored it at its end: a run started while another ran
    saved the other's ERROR, ended last, and left the package logger at ERROR for good."""
    events = {f"{n}-{e}": threading.Event() for n in ("first", "second") for e in ("in", "go")}
    events["second-go"].set()
    seen: dict[str, tuple[Any, ...]] = {}
    _watching_dispatch(monkeypatch, seen, events)
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            url = f"sqlite:///{tmp_path / f'{name}.db'}"
            report = run_gateway(GatewayOptions(db_url=url, workers=1, sessions=1, turns=1, faults=False,
                                                progress=False), QUIET)
            assert report.ok, report.problems
        except BaseException as e:  # reported below
            errors.append(e)

    first = threading.Thread(target=run, args=("first",), name="first")
    second = threading.Thread(target=run, args=("second",), name="second")
    first.start()
    assert events["first-in"].wait(timeout=120)
    second.start()  # while the first run is in its dispatcher
    assert events["second-in"].wait(timeout=120)
    events["first-go"].set()  # the first run ends before the second
    first.join(timeout=120)
    second.join(timeout=120)
    assert not errors, errors
    assert logging.getLogger("transcript_store").level == lib_level
    assert {s[3] for s in seen.values()} == {lib_level}


# ---------------------------------------------------------------------------------------------- 3: dispatch


class _CountingPlan(dict[str, list[Job]]):
    """A plan that counts the dispatcher's reads of it: each session it iterates over or looks up."""

    reads = 0

    def __iter__(self) -> Iterator[str]:
        for key in super().__iter__():
            self.reads += 1
            yield key

    def keys(self) -> Any:
        return iter(self)

    def values(self) -> Any:
        for value in super().values():
            self.reads += 1
            yield value

    def items(self) -> Any:
        for item in super().items():
            self.reads += 1
            yield item

    def __getitem__(self, key: str) -> list[Job]:
        self.reads += 1
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.reads += 1
        return super().get(key, default)


class _ThreadProc:
    """A worker "process" that is a thread of this one, answering each job at once, on a real pipe."""

    def __init__(self, conn: Any, log: list[tuple[str, str]], lock: threading.Lock) -> None:
        self._r, self._w = os.pipe()
        self.sentinel = self._r  # readable once the thread ended, as a process's sentinel
        self.exitcode: int | None = None
        self._thread = threading.Thread(target=self._serve, args=(conn, log, lock), daemon=True)
        self._thread.start()

    def _serve(self, conn: Any, log: list[tuple[str, str]], lock: threading.Lock) -> None:
        try:
            conn.send(("ready", 60.0))
            while (job := conn.recv()) is not None:
                with lock:
                    log.append(("sent", job.turn_id))
                answer = {"status": "committed", "engine": "legacy", "degraded": None, "attempts": 1}
                with lock:  # before the answer: the dispatcher may send the session's next turn at once
                    log.append(("done", job.turn_id))
                conn.send(("ok", answer))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            self.exitcode = 0
            os.write(self._w, b"x")

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def kill(self) -> None:
        raise AssertionError("nothing in this run is killed")

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if not self._thread.is_alive() and self._w >= 0:
            os.close(self._r)
            os.close(self._w)
            self._w = -1


def _thread_workers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Replace the dispatcher's worker processes by threads; the log of what they were sent and answered."""
    log: list[tuple[str, str]] = []
    lock = threading.Lock()

    class ThreadWorker(gateway._Worker):
        def __init__(self, ctx: Any, options: GatewayOptions, url: str) -> None:
            self.conn, child = mp.Pipe()
            self.proc = _ThreadProc(child, log, lock)  # type: ignore[assignment]
            self.ready = False
            self.turn_seconds = 0.0
            self.job = None
            self.kill_at = None
            self.hung_at = 0.0
            self.start_by = time.monotonic() + 60

    monkeypatch.setattr(gateway, "_Worker", ThreadWorker)
    return log


def test_dispatching_a_turn_does_not_scan_every_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each dispatch looked for the first session with a turn left and none in flight by going over the
    whole plan from its start (every idle worker, at every wake, once all sessions were in flight or done):
    O(sessions) per turn, quadratic in a run's sessions. The dispatcher now reads the plan O(1) times
    per turn, with the same order: a session's turns in order, one at a time."""
    log = _thread_workers(monkeypatch)
    sessions, turns = 300, 2
    plan = _CountingPlan({f"s-{i}": [Job(f"s-{i}", f"s-{i}:turn-{t}", "hello") for t in range(turns)]
                          for i in range(sessions)})
    options = GatewayOptions(db_url="sqlite:///unused.db", workers=4, sessions=sessions, turns=turns, faults=False,
                             progress=False)
    report = GatewayReport(url="sqlite:///unused.db", engine="legacy", workers=4, planned_turns=sessions * turns)
    outcomes = _dispatch(options, "sqlite:///unused.db", plan, report, random.Random(1), QUIET)
    assert len(outcomes) == sessions * turns and not report.problems
    # A few reads per session to set up, a few per turn dispatched: the old scan made ~45,000 here.
    assert plan.reads <= 4 * (sessions + sessions * turns), plan.reads
    in_flight: set[str] = set()
    sent: dict[str, list[str]] = {}
    for what, turn_id in log:
        session = turn_id.split(":")[0]
        if what == "sent":
            assert session not in in_flight, f"two turns of {session} in flight"
            in_flight.add(session)
            sent.setdefault(session, []).append(turn_id)
        else:
            in_flight.discard(session)
    assert sent == {sid: [j.turn_id for j in jobs] for sid, jobs in plan.items()}


def _first_ready(plan: dict[str, list[Job]], next_index: dict[str, int], in_flight: set[str]) -> Job | None:
    """The assignment rule, as the scan wrote it: the first session in plan order with a turn left and
    none in flight."""
    for sid, jobs in plan.items():
        if sid not in in_flight and next_index[sid] < len(jobs):
            return jobs[next_index[sid]]
    return None


@pytest.mark.parametrize("seed", range(20))
def test_the_queue_assigns_as_the_scan_did(seed: int) -> None:
    """Random takes, answers, retries and refused sends: the queue hands out the job the scan would have."""
    rng = random.Random(seed)
    plan = {f"s-{i}": [Job(f"s-{i}", f"s-{i}:turn-{t}", "hi") for t in range(rng.randrange(0, 4))]
            for i in range(rng.randrange(1, 12))}
    queue = gateway._Queue(plan)
    next_index = dict.fromkeys(plan, 0)
    in_flight: dict[str, Job] = {}
    for _ in range(200):
        op = rng.random()
        if op < 0.5 or not in_flight:
            expected = _first_ready(plan, next_index, set(in_flight))
            job = queue.take()
            assert job is expected
            if job is not None:
                in_flight[job.session_id] = job
            continue
        job = in_flight.pop(rng.choice(sorted(in_flight)))
        if op < 0.8:  # answered, or given up
            queue.done(job)
            next_index[job.session_id] += 1
        else:  # not sent, or sent again after a death
            queue.put_back(job)
    assert queue.take() is _first_ready(plan, next_index, set(in_flight))


# ---------------------------------------------------------------------------------------------- the title


@pytest.mark.parametrize(("workers", "said"), [(1, "1 worker,"), (2, "2 workers,"), (64, "64 workers,")])
def test_the_report_title_counts_its_workers_in_the_singular_or_the_plural(workers: int, said: str) -> None:
    report = GatewayReport(url="sqlite:///x.db", engine="legacy", workers=workers, planned_turns=1)
    out = StringIO()
    report.render(Console(file=out, width=200, markup=False, highlight=False))
    title = out.getvalue().splitlines()[0]
    assert f"gateway run: {said} engine legacy" in title, title
