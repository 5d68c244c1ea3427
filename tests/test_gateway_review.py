"""Findings of the gateway review: workers that die outside the planned faults, a dispatcher and a report
that miscounted them, two runs of one seed sharing their sessions, rates and seeds taken unchecked, a check
that never looked past the planned turns, and workers outliving their dispatcher.

Real worker processes, real SQLite files and the real PostgreSQL; the misbehaving engines are plugins,
loaded by the workers as any engine is.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from test_cli import _script_mode, run  # noqa: F401 (autouse: honours the subprocess mode of CI)

from transcript_store import InvalidInput, StoreConfig, TranscriptStore, TranscriptStoreError, gateway, quarantine
from transcript_store.errors import ModelTimeout
from transcript_store.gateway import (
    GatewayOptions,
    GatewayReport,
    Job,
    _dispatch,
    _FaultyModel,
    _finish,
    _run_job,
    run_gateway,
)
from transcript_store.host import HostRuntime, TurnFailed
from transcript_store.model import LocalResponder
from transcript_store.settings import load_settings

CLI = [sys.executable, "-m", "transcript_store"]
QUIET = Console(quiet=True)


def _plugin(tmp_path: Path, engine_id: str, body: str) -> str:
    """A plugin engine (the legacy engine with ``body`` as the start of its assemble); its settings file."""
    folder = tmp_path / "plugins" / engine_id
    folder.mkdir(parents=True)
    (folder / "plugin.yaml").write_text(f"name: {engine_id}\nversion: 1.0\nentry: create_engine\n")
    indented = "\n".join(f"        {line}" if line else "" for line in body.strip().splitlines())
    (folder / "__init__.py").write_text(
        "import os, threading, time\n"
        "from engines.legacy import LegacyEngine\n"
        "from transcript_store.ledger import receipts_for_key\n"
        f"MARKS = {str(tmp_path)!r}\n\n\n"
        "def mark(name):\n"
        "    open(os.path.join(MARKS, name), 'w').write(str(os.getpid()))\n\n\n"
        "def wait_for(name):\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not os.path.exists(os.path.join(MARKS, name)) and time.monotonic() < deadline:\n"
        "        time.sleep(0.02)\n\n\n"
        "class Engine(LegacyEngine):\n"
        f"    info = LegacyEngine.info.model_copy(update={{'id': {engine_id!r}, 'name': {engine_id!r}}})\n\n"
        "    def assemble(self, **kw):\n"
        f"{indented}\n"
        "        return super().assemble(**kw)\n\n\n"
        "def create_engine(ctx):\n"
        "    return Engine(ctx)\n"
    )
    config = tmp_path / "transcript-store.toml"
    config.write_text('[engine]\nplugin_dirs = ["plugins"]\n')
    return str(config)


def _options(store_url: str, config: str | None, engine: str, **more: Any) -> GatewayOptions:
    values: dict[str, Any] = {"workers": 1, "sessions": 1, "turns": 1, "faults": False, "progress": False}
    values.update(more)
    return GatewayOptions(db_url=store_url, engine=engine, config_path=config, **values)


# ---------------------------------------------------------------------------------------------- option bounds


def test_the_help_names_the_seed_a_run_takes_by_default() -> None:
    """``gateway --help`` said "[default: the gateway's]" for --seed: which seed that was, the user could
    not tell, nor so run a default run's workload again with the seed given."""
    done = subprocess.run([*CLI, "gateway", "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert f"Seed of the workload and the faults [default: {GatewayOptions().seed}]." in done.stdout


@pytest.mark.parametrize(
    "bad",
    [
        {"kill_rate": math.nan},
        {"timeout_rate": math.nan},
        {"rewrite_rate": math.inf},
        {"kill_rate": -0.1},
        {"timeout_rate": 1.5},
        {"kill_rate": True},
        {"kill_rate": "0.1"},
        {"kill_rate": 0.6, "timeout_rate": 0.3, "rewrite_rate": 0.3},
        {"seed": 1.5},
        {"seed": "7"},
        {"scope": ""},
        {"scope": "bad\x00scope"},
        {"model_url": "ftp://models.example/v1"},
    ],
)
def test_rates_and_seeds_past_their_bounds_are_refused(tmp_path: Path, bad: dict[str, Any]) -> None:
    """A NaN rate compared false with every roll: the run injected no fault of that kind and still
    reported a passed check of "a run with faults"; a negative one the same, rates adding up past 1
    starved the later kinds. Refused, as a count past its bound is, before anything is written."""
    url = f"sqlite:///{tmp_path / 'g.db'}"
    with pytest.raises(InvalidInput):
        GatewayOptions(db_url=url, **bad).check()
    with pytest.raises(InvalidInput):
        run_gateway(GatewayOptions(db_url=url, progress=False, **bad), QUIET)
    assert not (tmp_path / "g.db").exists()
    GatewayOptions(db_url=url, kill_rate=0.0, timeout_rate=0.0, rewrite_rate=1.0, seed=-(2**70)).check()


def test_a_model_url_no_worker_can_use_is_refused_before_the_runs_sessions(store_url: str) -> None:
    """Checked only in the workers, which refused every job: the run raised once its sessions were made
    (an unusable worker), leaving them in the store; the CLI checked it first, the library did not."""
    with pytest.raises(InvalidInput):
        run_gateway(GatewayOptions(db_url=store_url, workers=1, sessions=2, turns=1, progress=False,
                                   model_url="ftp://models.example/v1"), QUIET)
    with TranscriptStore(store_url) as store:
        assert store.list_sessions(gateway.GATEWAY_SCOPE) == []


# ---------------------------------------------------------------------------------------------- worker deaths


ONCE = """
if not os.path.exists(os.path.join(MARKS, "died")):
    mark("died")
    os._exit(0)
"""


def test_a_worker_that_dies_on_its_own_is_a_problem_not_a_planned_kill(store_url: str, tmp_path: Path) -> None:
    """An engine ending its worker's process (exit code 0, no fault planned: --no-faults) was counted as
    one of the run's SIGKILLs, its turn silently sent again, and the run reported a passed check."""
    config = _plugin(tmp_path, "once", ONCE)
    report = run_gateway(_options(store_url, config, "once"), QUIET)
    assert not report.ok, "an unplanned worker death passed the check"
    assert report.kills == 0
    assert report.unexpected_exits == 1
    assert len(report.problems) == 1 and "died unexpectedly (exit code 0 running turn" in report.problems[0]
    assert report.committed == 1 and report.retried_dispatches == 1  # its retry ran the turn, once


IDLE_DEATH = """
if kw["session_id"] == "s-a":
    wait_for("b0-started")  # so that another worker runs s-b meanwhile
    scope = kw["scope"]

    def die_when_idle():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not self.store.read(
            lambda c: receipts_for_key(c, scope, "s-a", "s-a:turn-0")
        ):
            time.sleep(0.02)
        # Its answer sent, it waits for a job (s-a has none left, s-b's is running): its main thread is in
        # the worker's conn.recv(). A fixed 0.5 s was too short on a loaded machine: it died mid-answer.
        while time.monotonic() < deadline and not waiting_for_a_job():
            time.sleep(0.02)
        mark("a-dead")
        os._exit(0)

    threading.Thread(target=die_when_idle, daemon=True).start()
elif not os.path.exists(os.path.join(MARKS, "b0-started")):
    mark("b0-started")
    wait_for("a-dead")
    # A's process is gone before this turn answers: still alive, it would be sent s-b's next turn.
    a_pid = int(open(os.path.join(MARKS, "a-dead")).read())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not gone(a_pid):
        time.sleep(0.02)
"""

IDLE_HELPERS = """
import sys


def waiting_for_a_job():
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_back is not None and frame.f_back.f_code.co_name != "_worker_main":
        frame = frame.f_back
    return frame is not None and frame.f_back is not None and frame.f_code.co_name == "recv"


def gone(pid):
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: a moment for its exit
        time.sleep(0.3)
        return True
    return state in ("Z", "X")
"""


def test_a_worker_that_dies_between_two_turns_is_replaced(store_url: str, tmp_path: Path) -> None:
    """A worker that died while idle (an engine's thread, the OOM killer, an operator's kill) was given
    the next job anyway: BrokenPipeError out of the dispatcher, and the run ended with a traceback."""
    config = _plugin(tmp_path, "idle", IDLE_DEATH)
    init = tmp_path / "plugins" / "idle" / "__init__.py"
    init.write_text(init.read_text() + IDLE_HELPERS)
    options = _options(store_url, config, "idle", workers=2, sessions=2, turns=2)
    plan = {
        "s-a": [Job("s-a", "s-a:turn-0", "hello from a")],
        "s-b": [Job("s-b", "s-b:turn-0", "hello from b"), Job("s-b", "s-b:turn-1", "again from b")],
    }
    processes: set[str] = set()
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        for sid in plan:
            store.create_session(options.scope, session_id=sid)
        report = GatewayReport(url=store_url, engine="idle", workers=2, planned_turns=3)
        outcomes = _dispatch(options, store_url, plan, report, random.Random(1), QUIET, processes)
        assert not mp.active_children()
        _finish(store, options, "idle", plan, outcomes, report, processes)
    assert report.committed == 3 and report.kills == 0
    assert report.unexpected_exits == 1
    assert len(report.problems) == 1 and "died unexpectedly (exit code 0 between two turns)" in report.problems[0]


def test_workers_that_keep_dying_stop_the_run(store_url: str, tmp_path: Path) -> None:
    """Workers that all die (an engine ending its process on every turn; a library caller's script without
    ``if __name__ == "__main__"``, whose every spawned worker dies before it starts): each turn was sent
    six times, each time to a freshly spawned worker, a whole run's worth of spawns before any report."""
    config = _plugin(tmp_path, "doomed", "mark(f'ran-{os.getpid()}')\nos._exit(0)")
    with pytest.raises(TranscriptStoreError, match="gateway workers keep dying: 3 in a row"):
        run_gateway(_options(store_url, config, "doomed", workers=3, sessions=3), QUIET)
    assert not mp.active_children()
    assert len(list(tmp_path.glob("ran-*"))) == 3  # three deaths, then the run stopped


HANG = """
if not os.path.exists(os.path.join(MARKS, "hung")):
    mark("hung")
    time.sleep(60)  # a deadlock, a call with no timeout of its own
"""


def test_a_hung_worker_is_killed_and_its_turn_sent_again(store_url: str, tmp_path: Path) -> None:
    """A worker stuck in its turn (an engine's deadlock, a call with no timeout) held the dispatcher for
    ever: it waited for that worker's answer, 5 s at a time. Past the turn's max_turn_seconds (its lease is
    not renewed any more: the store holds it abandoned) the worker is SIGKILLed and the turn sent again."""
    config = _plugin(tmp_path, "hang", HANG)
    with open(config, "a") as f:
        f.write("[turn]\nmax_turn_seconds = 1\n")
    started = time.monotonic()
    report = run_gateway(_options(store_url, config, "hang"), QUIET)
    assert not report.ok, "a hung worker passed the check"
    assert time.monotonic() - started < 45
    assert report.unexpected_exits == 1 and report.kills == 0
    [problem] = report.problems
    assert "turn-0 attempt 0 ran past max_turn_seconds (1 s): its worker was SIGKILLed" in problem
    assert report.committed == 1 and report.retried_dispatches == 1


def test_a_turn_given_up_counts_only_the_dispatches_that_happened(store_url: str, tmp_path: Path) -> None:
    """A turn refused on every attempt (a request that cannot fit the token budget) goes out six times:
    five re-dispatches, which the report counted as six."""
    config = tmp_path / "tiny.toml"
    config.write_text("[turn]\ntoken_budget = 256\nmax_output_tokens = 255\n")
    report = run_gateway(_options(store_url, str(config), "legacy"), QUIET)
    assert not report.ok
    raised = [p for p in report.problems if "raised PromptTooLarge" in p]
    assert len(raised) == 6 and report.problems[-1].endswith("gave up after 6 dispatches")
    assert report.retried_dispatches == 5
    assert report.admitted == 0 and report.committed == 0


@pytest.mark.parametrize("config", ["max_sessions = 0", "keep_last = 0", "keep_lst = 2"])
def test_run_gateway_refuses_a_bad_legacy_config_before_it_makes_a_session(store_url: str, tmp_path: Path,
                                                                             config: str) -> None:
    """Called as a library, the gateway checks [engine.config.legacy] (every worker's fallback) before it
    writes: it made the run's sessions and spawned workers that each failed building their host."""
    settings = tmp_path / "bad-legacy.toml"
    settings.write_text(f"[engine.config.legacy]\n{config}\n")
    with pytest.raises(InvalidInput, match="legacy config"):
        run_gateway(_options(store_url, str(settings), "legacy"), QUIET)
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        assert store.list_sessions(gateway.GATEWAY_SCOPE) == []


# ---------------------------------------------------------------------------------------------- the checks


def test_two_runs_of_one_seed_in_the_same_second_keep_apart(store_url: str) -> None:
    """The run id was the clock's second and a number from the seeded workload: two runs of one seed
    started in the same second (two `make run`s, two CI jobs on one PostgreSQL) took the same sessions (a
    create of an existing id and key is a no-op), and each checked the other's turns as its own."""
    reports: list[GatewayReport] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            reports.append(run_gateway(_options(store_url, None, "legacy", seed=3), QUIET))
        except BaseException as e:  # reported by the test below
            errors.append(e)

    time.sleep(1.02 - time.time() % 1)  # both start early in one second of the clock
    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        sessions = store.list_sessions("gateway")
    assert len(sessions) == 2, [s.session_id for s in sessions]
    for report in reports:
        assert report.ok, report.problems
        assert report.committed == 1 and report.duplicates_absorbed == 0


def test_a_receipt_of_no_planned_turn_fails_the_check(store_url: str) -> None:
    """The report's "nothing else reached the engine" was never checked: a turn committed in one of the
    run's sessions under a key that is none of its turns passed unseen."""
    options = GatewayOptions(db_url=store_url, engine="legacy", progress=False)
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        store.create_session(options.scope, session_id="s-1")
        host = HostRuntime(store, load_settings(None, engine="legacy"), LocalResponder())
        host.run_turn(options.scope, "s-1", "planned turn", turn_id="s-1:turn-0")
        host.run_turn(options.scope, "s-1", "a turn nobody planned", turn_id="stray")
        host.dispose()
        plan = {"s-1": [Job("s-1", "s-1:turn-0", "planned turn")]}
        report = GatewayReport(url=store_url, engine="legacy", workers=1, planned_turns=1)
        _finish(store, options, "legacy", plan, {"s-1:turn-0": {"status": "committed"}}, report, set())
    assert report.committed == 1
    [problem] = report.problems
    assert "'stray' reached the engine but is none of the run's turns" in problem


def test_a_recovery_pass_that_fails_still_disposes_of_its_host(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's recovery pass disposed of its host runtime (its engines, its quarantine records) only
    when every session recovered: one failing (the database gone meanwhile) left it undisposed, in the
    process of a library caller of run_gateway."""
    from transcript_store.errors import StoreUnavailable
    from transcript_store.turns import Turns

    def recover(self: Turns, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("the database went away")

    disposed: list[HostRuntime] = []
    dispose = HostRuntime.dispose

    def spy(self: HostRuntime) -> None:
        disposed.append(self)
        dispose(self)

    monkeypatch.setattr(Turns, "recover", recover)
    monkeypatch.setattr(HostRuntime, "dispose", spy)
    options = GatewayOptions(db_url=store_url, engine="legacy", progress=False)
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        store.create_session(options.scope, session_id="s-1")
        plan = {"s-1": [Job("s-1", "s-1:turn-0", "a turn")]}
        report = GatewayReport(url=store_url, engine="legacy", workers=1, planned_turns=1)
        with pytest.raises(StoreUnavailable, match="went away"):
            _finish(store, options, "legacy", plan, {}, report, set())
    assert len(disposed) == 1


# ---------------------------------------------------------------------------------------------- the dispatcher's end


def _dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


#: the body of engine "slow"'s assemble: it says it is busy, then never ends
SLOW = "mark('busy')\ntime.sleep(60)"


@contextlib.contextmanager
def _slow_run(tmp_path: Path, config: str, db_url: str) -> Iterator[tuple[subprocess.Popen[bytes], int, Path, Path]]:
    """A one-turn gateway run on engine "slow" (``SLOW``) once its worker is busy in the engine's assemble,
    which never ends: the dispatcher, the worker's pid, the run's stdout and stderr files. Both processes
    are gone after it."""
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("TRANSCRIPT_STORE_CONFIG", None)
    args = ["--config", config, "--db", db_url, "gateway", "--engine", "slow"]
    args += ["--workers", "1", "--sessions", "1", "--turns", "1", "--no-faults"]
    # Files, not pipes: an orphaned worker holds the pipes it inherited open after the dispatcher is gone.
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as out_file, err.open("w") as err_file:
        proc = subprocess.Popen(
            [*CLI, *args], cwd=tmp_path, env=env, stdout=out_file, stderr=err_file, start_new_session=True
        )
    worker = None
    try:
        worker = _busy_worker(tmp_path, proc, err)
        yield proc, worker, out, err
    finally:
        _stop(proc, worker)


def _busy_worker(tmp_path: Path, proc: subprocess.Popen[bytes], err: Path) -> int:
    """The pid of the run's worker once it is busy in engine "slow"'s assemble (90 s at most)."""
    busy = tmp_path / "busy"
    deadline = time.monotonic() + 90
    while not (busy.exists() and busy.read_text()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert busy.exists(), err.read_text()
    return int(busy.read_text())


def _stop(proc: subprocess.Popen[bytes], worker: int | None) -> None:
    """Kill the run's dispatcher and its worker where either is still there."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if worker is not None and not _dead(worker):
        os.kill(worker, signal.SIGKILL)


def _ended(worker: int) -> bool:
    """Whether the worker is gone within 15 s (the event itself ends the wait: no idle cost)."""
    deadline = time.monotonic() + 15
    while not _dead(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _dead(worker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "Ctrl-C"])
def test_the_dispatchers_end_ends_its_workers(tmp_path: Path, how: str) -> None:
    """The dispatcher terminated (SIGTERM) or killed left its busy workers running as orphans, going on
    with their turns (and committing them) after the run was gone; Ctrl-C printed each worker's own
    KeyboardInterrupt traceback. The workers end with the dispatcher, quietly."""
    config = _plugin(tmp_path, "slow", SLOW)
    with _slow_run(tmp_path, config, f"sqlite:///{tmp_path / 'g.db'}") as (proc, worker, _out, err):
        time.sleep(0.2)
        if how == "Ctrl-C":
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
        else:
            os.kill(proc.pid, getattr(signal, how))
        proc.wait(timeout=30)
        assert _ended(worker), f"worker {worker} outlived its dispatcher ({how})"
        assert proc.returncode != 0
        assert "Traceback" not in err.read_text(), err.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("backend", ["sqlite"])  # the dispatcher's signal handling: no store in it (CI time)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_a_sigterm_at_a_terminal_gives_the_cursor_back(store_url: str, tmp_path: Path, signum: int) -> None:
    """SIGTERM (or SIGHUP, the terminal gone) ended the dispatcher where it stood: on a terminal the progress
    display never closed, the cursor left hidden (rich's ESC[?25l with no ESC[?25h after it), and its workers
    were not stopped by it (on Linux the kernel kills them; elsewhere they went on). It ends the run as
    Ctrl-C does (the display closed, the workers stopped), then the process as the signal would (143, 129)."""
    import pty

    config = _plugin(tmp_path, "slow", SLOW)
    env = {**os.environ, "COLUMNS": "200", "TERM": "xterm"}
    env.pop("TRANSCRIPT_STORE_CONFIG", None)
    args = ["--config", config, "--db", store_url, "gateway", "--engine", "slow"]
    args += ["--workers", "1", "--sessions", "1", "--turns", "1", "--no-faults"]
    master, slave = pty.openpty()
    err = tmp_path / "err.txt"
    with err.open("w") as err_file:
        proc = subprocess.Popen([*CLI, *args], cwd=tmp_path, env=env, stdout=slave, stderr=err_file,
                                start_new_session=True, preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL))
    os.close(slave)
    shown = bytearray()

    def read_terminal() -> None:
        with contextlib.suppress(OSError):  # EIO once every writer of the terminal is gone
            while chunk := os.read(master, 65536):
                shown.extend(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    worker = None
    try:
        worker = _busy_worker(tmp_path, proc, err)
        assert b"\x1b[?25l" in shown  # the progress display is up
        os.kill(proc.pid, signum)
        proc.wait(timeout=30)
        reader.join(timeout=10)
        assert proc.returncode == -signum, (proc.returncode, err.read_text())
        assert shown.rfind(b"\x1b[?25h") > shown.rfind(b"\x1b[?25l"), bytes(shown[-200:])
        assert "Traceback" not in err.read_text(), err.read_text()
        assert _ended(worker)
    finally:
        _stop(proc, worker)
        os.close(master)


def test_an_interrupted_runs_turn_in_flight_is_finished_by_outbox_recover(store_url: str, tmp_path: Path) -> None:
    """README: an interrupted run prints no report (Ctrl-C: "error: interrupted", exit 130), and the turn its
    worker was running stays admitted in the run's own session, which no later run looks at:
    ``outbox recover --scope gateway`` finishes it (its worker is gone: discarded at once)."""
    config = _plugin(tmp_path, "slow", SLOW)
    with _slow_run(tmp_path, config, store_url) as (proc, worker, out, err):
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal: the whole foreground group
        proc.wait(timeout=30)
        assert proc.returncode == 130 and err.read_text().strip().endswith("error: interrupted"), err.read_text()
        assert "exactly-once" not in out.read_text()
        assert _ended(worker)

    def outbox(*more: str) -> str:
        # In this process (CI time: a process start each): the run's own processes are gone, nothing of
        # theirs is in the command's way.
        return run("--config", config, "--db", store_url, "outbox", *more, "--scope", "gateway", cwd=tmp_path).stdout

    assert outbox("status").strip().endswith("1 admitted")
    assert "discarded 1" in outbox("recover")
    assert outbox("status").strip() == "the outbox is empty"


STUCK_IMPORT = """
import os, time
MARKS = {marks!r}
if not os.path.exists(os.path.join(MARKS, "stuck")):
    open(os.path.join(MARKS, "stuck"), "w").write(str(os.getpid()))
    time.sleep(300)  # a database that never answers, an import that never returns
"""


@pytest.mark.parametrize("backend", ["sqlite"])  # the dispatcher's start-up bound: no store in it (CI time)
def test_a_worker_stuck_starting_is_killed_and_replaced(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that never said "ready" (stuck in a plugin's import, or opening its store) held the run
    for ever: the dispatcher only watched it. Past the start-up bound it is SIGKILLed and replaced."""
    config = _plugin(tmp_path, "slowstart", "pass")
    init = tmp_path / "plugins" / "slowstart" / "__init__.py"
    init.write_text(STUCK_IMPORT.format(marks=str(tmp_path)) + init.read_text())
    monkeypatch.setattr(gateway, "STARTUP_SECONDS", 1.0, raising=False)
    made: list[Any] = []
    stuck = tmp_path / "stuck"

    class Worker(gateway._Worker):
        """The first worker's 1 s bound runs from when it is stuck (its plugin's import wrote "stuck"), not
        from its spawn: on a loaded machine its start up to there (spawn, imports, opening its store) took
        longer than a bound of 8 s from its spawn, it was killed before it got stuck, and its replacement
        got stuck instead (killed after 120 s: two deaths, a run of 136 s). Its healthy replacement gets a
        generous bound."""

        def __init__(self, *args: Any) -> None:
            self.first = not made
            made.append(self)
            super().__init__(*args)
            self.start_by = time.monotonic() + 120  # the first's bound until it is stuck, however slow

        @property
        def start_by(self) -> float:
            """When, not ready yet, it counts as stuck starting: the dispatcher reads it on each wake."""
            if self.first and stuck.exists():  # its mtime, on this process's monotonic clock
                return time.monotonic() - (time.time() - stuck.stat().st_mtime) + 1.0
            return self.bound

        @start_by.setter
        def start_by(self, value: float) -> None:
            self.bound = value

    monkeypatch.setattr(gateway, "_Worker", Worker)
    started = time.monotonic()
    report = run_gateway(_options(store_url, config, "slowstart"), QUIET)
    assert time.monotonic() - started < 200  # the stuck worker (300 s) was not waited for
    assert (tmp_path / "stuck").exists()
    assert not report.ok and report.unexpected_exits == 1 and report.committed == 1
    [problem] = report.problems
    assert "a worker did not start within 1 s: SIGKILLed" in problem
    assert len(made) == 2 and made[0].proc.exitcode == -signal.SIGKILL  # the stuck one, killed
    assert not mp.active_children()


# ---------------------------------------------------------------------------------------------- the report's counts


BROKEN = """
mark(f"in-{os.getpid()}")
deadline = time.monotonic() + 30
while time.monotonic() < deadline and len([n for n in os.listdir(MARKS) if n.startswith("in-")]) < 2:
    time.sleep(0.02)  # both workers meet the engine
wait_for("foreign")
raise RuntimeError("always broken")
"""


def test_the_report_counts_the_engines_this_run_quarantined(store_url: str, tmp_path: Path) -> None:
    """"engines quarantined by this run" summed quarantine records written since the run started: one per
    engine per worker process, and those of any other process meanwhile. One broken engine met by both
    workers, while this process quarantined an engine of its own, was reported as 3 engines."""
    config = _plugin(tmp_path, "broken", BROKEN)

    def quarantine_elsewhere() -> None:  # once both workers are in the engine, before it raises
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(list(tmp_path.glob("in-*"))) < 2:
            time.sleep(0.02)
        with TranscriptStore(config=StoreConfig(url=store_url)) as other:
            other.write(lambda c: quarantine.record(c, "elsewhere", "assemble", "not this run's"))
        (tmp_path / "foreign").write_text("")

    thread = threading.Thread(target=quarantine_elsewhere)
    thread.start()
    try:
        report = run_gateway(_options(store_url, config, "broken", workers=2, sessions=2), QUIET)
    finally:
        thread.join(timeout=60)
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        held = store.read(lambda c: quarantine.records(c, live_only=False))
    assert sorted(r.engine_id for r in held) == ["broken", "broken", "elsewhere"]
    assert report.quarantines == 1
    assert report.ok, report.problems
    assert report.committed == 2 and report.turns_by_engine == {"legacy": 2}


def test_a_turn_failed_by_its_planned_timeout_is_sent_again_not_a_problem(store_url: str, tmp_path: Path) -> None:
    """With the valid setting [turn] max_attempts = 1 the host retries nothing: each provider timeout the
    job injected failed its turn (TurnFailed), and the run reported it as a problem: its exactly-once
    check failed on its own faults. Such a turn is sent again (without the fault) and must commit once."""
    config = tmp_path / "once.toml"
    config.write_text("[turn]\nmax_attempts = 1\n")
    faulty = {"faults": True, "kill_rate": 0.0, "rewrite_rate": 0.0, "timeout_rate": 1.0}
    report = run_gateway(_options(store_url, str(config), "legacy", sessions=2, turns=2, **faulty), QUIET)
    assert report.ok, report.problems
    assert report.provider_timeouts == 4 and report.retried_dispatches == 4
    assert report.committed == 4 and report.duplicates_absorbed == 0


class _TimingOutHost:
    """A host whose turn calls the model (the worker's, which may inject its timeout) and then fails, as
    HostRuntime fails a turn whose last attempt timed out: TurnFailed from the timeout."""

    before_assemble = None

    def __init__(self, model: _FaultyModel) -> None:
        self.model = model

    def run_turn(self, scope: str, session_id: str, text: str, *, turn_id: str) -> Any:
        try:
            self.model.complete([{"role": "user", "content": text}])
            raise ModelTimeout("the provider itself timed out")
        except ModelTimeout as e:
            raise TurnFailed(f"turn {turn_id} failed after 1 attempts: {e}") from e


@pytest.mark.parametrize(("fault", "kind"), [("timeout", "fault"), (None, "error")])
def test_only_the_injected_timeout_is_the_jobs_own_fault(fault: str | None, kind: str) -> None:
    """A turn failed by the timeout the job injected is its fault; one failed by a provider's own timeout
    (the same type, the same kind of message) is a problem of the run, as before."""
    model = _FaultyModel(LocalResponder())
    job = Job("s-1", "s-1:turn-0", "hello", fault)
    answer, _ = _run_job(_TimingOutHost(model), None, model, GatewayOptions(), job)
    assert answer == kind
    assert model.injected is None and model.timeouts == 0


def test_a_planned_rewrite_lands_once_when_its_turn_degrades(store: TranscriptStore) -> None:
    """The rewrite fault runs between admission and assembly; on a durable engine the broken fence degrades
    the turn, and its legacy attempt ran the hook again: a second rewrite per planned one (the report
    counted one), landing on an older reply (the stale admission's seq): two replies redacted, not one."""
    scope = gateway.GATEWAY_SCOPE
    sid = store.create_session(scope, session_id="rewritten").session_id
    model = _FaultyModel(LocalResponder())
    host = HostRuntime(store, load_settings(engine="lossless"), model)
    try:
        for t in range(2):
            assert _run_job(host, store, model, GatewayOptions(), Job(sid, f"t{t}", f"turn {t}"))[0] == "ok"
        generation = store.get_session(scope, sid).generation
        kind, data = _run_job(host, store, model, GatewayOptions(), Job(sid, "t2", "turn 2", "rewrite"))
        assert kind == "ok" and str(data["degraded"]).startswith("read fence"), data
        assert store.get_session(scope, sid).generation == generation + 1  # one rewrite
        contents = [str((e.message or {}).get("content")) for e in store.read_visible(scope, sid)]
        [redacted] = [c for c in contents if c.startswith("[redacted by maintenance]")]
        assert '"turn 1"' in redacted  # the reply before the turn's admission, and only it
    finally:
        host.dispose()
