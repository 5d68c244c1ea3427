"""The main job: a real multi-worker gateway run with faults injected on purpose, and its report.

N worker processes take turns of several conversations from the dispatcher (one turn per session in
flight, in order), and run each through the host runtime: admit, assemble with the configured
engine, call the model, commit. Faults on purpose: workers SIGKILLed mid-turn (at named fault points
and at random instants), provider timeouts that make the host retry the same logical turn, and a
transcript rewrite between admission and assembly that forces a turn-local degradation. A killed
turn is dispatched again with the same logical turn id. At the end a recovery pass runs and the
report checks, from the store alone, that every accepted turn reached the engine exactly once.

The report's turn counts (admitted, accepted, committed, blocked, the engine that holds each turn,
degraded turns) are read from the store: a worker killed after its turn answers nothing, and a worker's
answer is never proof. What the store cannot know (why a turn degraded, a replay absorbed as a duplicate)
is the workers' word, and the report says so. ``run_gateway`` leaves the process's logging alone (it is
the embedding application's); the CLI quiets the library's records for its run.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import multiprocessing as mp
import os
import random
import secrets
import shlex
import signal
import sys
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from . import faults, identity
from .config import DEFAULT_URL
from .core import check_id
from .db import mask_url
from .errors import InvalidInput, ModelTimeout, TranscriptStoreError, describe
from .models import Admission
from .terminal import show_process_output, shown, shown_log_handler

if TYPE_CHECKING:  # rich is the dispatcher's: a worker process (and the CLI's other commands) never imports it
    from rich.console import Console
    from rich.progress import Progress

#: The scope of the gateway's sessions unless --scope / TRANSCRIPT_STORE_SCOPE names another: its
#: conversations stay apart from the CLI's own (``default``).
GATEWAY_SCOPE = "gateway"
#: A run's bounds: each worker is a process (a few dozen fill any machine), and the plan of every turn is
#: made up front, so a mistyped count spawned a million processes or allocated a billion turns first.
MAX_WORKERS = 64
MAX_SESSIONS = 1000
MAX_TURNS = 1000
#: sessions x turns
MAX_RUN_TURNS = 100_000
#: the seed of the workload and its faults unless --seed gives another
DEFAULT_SEED = 7
#: dispatches of one logical turn before the run gives it up
MAX_DISPATCHES = 6
#: workers that die in a row, unplanned, with no turn answered in between: the run stops (a worker that
#: cannot even start, an engine that ends its process on every turn) instead of respawning them for ever
MAX_DEATHS_IN_A_ROW = 3
#: how long the workers of a finished run get to end on their own (deferred maintenance is bounded by 10 s)
STOP_SECONDS = 15.0
#: a turn still running this long after its settings' max_turn_seconds (when its lease stopped being
#: renewed: the store holds it abandoned) is a hung worker: SIGKILLed, and its turn sent again
TURN_GRACE_SECONDS = 1.0
#: how long a worker may take to start (import, open its store, load its engines) before it says "ready":
#: one stuck there (a database that never answers, a plugin's import that never returns) held the run
STARTUP_SECONDS = 120.0

TOPICS = (
    "the weather in Lisbon",
    "sorting algorithms",
    "a pasta recipe",
    "the history of tea",
    "prime numbers",
    "packing for a hike",
    "learning Portuguese",
    "SQLite durability",
)
KILL_POINTS = (
    "admit.after_entry",
    "admit.after_commit",
    "complete.after_replies",
    "complete.after_accept",
    "commit.after_receipt",
    "commit.after_apply",
    "complete.after_commit",
)


@dataclass
class GatewayOptions:
    """How the gateway run is shaped."""

    db_url: str | None = None
    workers: int = 4
    sessions: int = 6
    turns: int = 5
    engine: str | None = None
    model_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    faults: bool = True
    seed: int = DEFAULT_SEED
    scope: str = GATEWAY_SCOPE
    config_path: str | None = None
    progress: bool = True
    kill_rate: float = 0.12
    timeout_rate: float = 0.1
    rewrite_rate: float = 0.06
    #: engines whose failure to load the caller has reported already (the CLI's start-up warning): the workers
    #: do not print their own records of quarantining one after its factory failed (one a worker, each
    #: respawn again); the report's degraded reasons still say it, and every other record is printed
    reported_unusable: tuple[str, ...] = ()

    def check(self) -> None:
        """Refuse counts past a run's bounds, a bad scope or model URL (InvalidInput), before anything starts."""
        for name, bound in (("workers", MAX_WORKERS), ("sessions", MAX_SESSIONS), ("turns", MAX_TURNS)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
                raise InvalidInput(f"{name} must be an integer in 1..{bound}, got {value!r}")
        if self.sessions * self.turns > MAX_RUN_TURNS:
            raise InvalidInput(
                f"{self.sessions} sessions x {self.turns} turns is {self.sessions * self.turns} turns: "
                f"at most {MAX_RUN_TURNS} turns in a run"
            )
        # A rate is a share of the turns: NaN compared false with every roll and silently injected
        # nothing, a negative one nothing, and rates adding up past 1 starved the later kinds of fault.
        rates = []
        for name in ("kill_rate", "timeout_rate", "rewrite_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise InvalidInput(f"{name} must be a number in 0..1, got {value!r}")
            rates.append(float(value))
        if math.fsum(rates) > 1.0:
            raise InvalidInput(f"kill_rate + timeout_rate + rewrite_rate must be at most 1, got {math.fsum(rates)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidInput(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.reported_unusable, list | tuple) or not all(
            isinstance(e, str) for e in self.reported_unusable
        ):
            raise InvalidInput(f"reported_unusable must be a list of engine ids, got {self.reported_unusable!r}")
        # Checked where they are used, these were refused only after the store was opened (a SQLite file
        # created) and the run's sessions made: the scope by the first of them, the model URL by every
        # worker, each refusing every job.
        check_id("scope", self.scope, new=True)
        from .model import model_from_settings

        model_from_settings(self.model_url, self.model, self.api_key)


@dataclass
class Job:
    """One logical turn to run, and the fault to inject into this attempt."""

    session_id: str
    turn_id: str
    text: str
    fault: str | None = None
    attempt: int = 0
    #: the fault the plan made for the turn (``fault`` is cleared when the turn goes out again)
    planned: str | None = None

    def __post_init__(self) -> None:
        if self.planned is None:
            self.planned = self.fault


@dataclass
class GatewayReport:
    """What happened: the turns measured from the store after recovery, the faults counted by the
    dispatcher, and (labelled so) what only the workers could say."""

    url: str
    engine: str
    workers: int
    planned_turns: int
    scope: str = GATEWAY_SCOPE
    admitted: int = 0
    accepted: int = 0
    committed: int = 0
    blocked: int = 0
    #: accepted turns (committed or blocked) by the engine that holds them: its receipt's, or its blocked
    #: intent's (from the store)
    turns_by_engine: dict[str, int] = field(default_factory=dict)
    #: accepted turns held by another engine than the configured one: a turn-local degradation to legacy
    #: (from the store; a degradation on a configured legacy engine leaves no such trace)
    degraded_turns: int = 0
    #: replays the ledger answered "duplicate", as the workers answered (the store keeps no count of
    #: them), and those the recovery pass met
    duplicates_absorbed: int = 0
    #: why turns degraded, as the workers answered: the store keeps no reason, and a worker killed after
    #: degrading its turn answered nothing (its retry learns "duplicate"), so they may be fewer
    degraded: dict[str, int] = field(default_factory=dict)
    #: distinct engines quarantined by this run: the workers' from the store (the quarantine records of their
    #: process identities, one per engine and worker), and the recovery pass's own
    quarantines: int = 0
    recovered_intents: int = 0
    kills: int = 0
    #: workers that died without a planned kill (an exit of their own, a signal from elsewhere)
    unexpected_exits: int = 0
    provider_timeouts: int = 0
    rewrites: int = 0
    retried_dispatches: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every accepted turn reached the engine exactly once and nothing else did."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (for --json)."""
        return {**asdict(self), "ok": self.ok}

    def inspect_command(self) -> str:
        """The command that lists this run's sessions (its scope, and its store unless the default one)."""
        command = f"transcript-store sessions list --scope {shlex.quote(self.scope)}"
        if self.url != mask_url(DEFAULT_URL):
            command += f" --db {shlex.quote(self.url)}"
        return command

    def render(self, console: Console) -> None:
        """Print the report as a table (each count with where it comes from) and the exactly-once verdict.

        Degraded reasons and problems quote engines' errors: shown escaped, as Text (never read as rich
        markup, which a caller's console may parse), so the terminal reads them and obeys none of them.
        """
        from rich.table import Table
        from rich.text import Text

        workers = f"{self.workers} worker{'' if self.workers == 1 else 's'}"  # "1 workers" read as a typo
        table = Table(title=Text(shown(f"gateway run: {workers}, engine {self.engine}, {self.url}")))
        table.add_column("what")
        table.add_column("count", justify="right")
        table.add_column("from")
        rows = [
            ("turns planned", self.planned_turns, "plan"),
            ("turns admitted", self.admitted, "store"),
            ("turns accepted", self.accepted, "store"),
            ("turns committed to the engine", self.committed, "store"),
            ("turns blocked (kept as evidence)", self.blocked, "store"),
            ("degraded turns (held by another engine)", self.degraded_turns, "store"),
            ("degraded turns the workers reported", sum(self.degraded.values()), "workers"),
            ("duplicates absorbed by the ledger", self.duplicates_absorbed, "workers"),
            ("engines quarantined by this run", self.quarantines, "store"),
            ("recovered intents", self.recovered_intents, "recovery"),
            ("workers killed (SIGKILL)", self.kills, "dispatcher"),
            ("workers that died unexpectedly", self.unexpected_exits, "dispatcher"),
            ("provider timeouts (retried)", self.provider_timeouts, "dispatcher"),
            ("transcript rewrites", self.rewrites, "dispatcher"),
            ("turns dispatched again", self.retried_dispatches, "dispatcher"),
        ]
        for what, count, source in rows:
            table.add_row(what, str(count), source)
        console.print(table)
        if self.turns_by_engine:
            held = ", ".join(f"{engine} {count}" for engine, count in sorted(self.turns_by_engine.items()))
            console.print(Text(shown(f"  accepted turns by engine (store): {held}", one_line=True)))
        if self.degraded:
            console.print(Text("  why turns degraded, as workers answered (one killed after its turn answers none):"))
        for reason, count in sorted(self.degraded.items()):
            console.print(Text(f"  degraded x{count}: {shown(reason, one_line=True)}"))
        console.print(f"  {self.seconds:.1f} s")
        # One line whatever the width (the terminal may wrap it): a command split in two cannot be pasted.
        console.print(Text(shown(f"  sessions in scope {self.scope!r}: {self.inspect_command()}")), soft_wrap=True)
        if self.ok:
            console.print(
                Text("exactly-once check passed:", style="bold green"), "every accepted turn is in the engine once"
            )
        else:
            console.print(Text("exactly-once check FAILED:", style="bold red"))
            for p in self.problems:
                console.print(Text(f"  - {shown(p, one_line=True)}"))


# ---------------------------------------------------------------------------------------------- worker


class _FaultyModel:
    """Wraps the model: raises ModelTimeout on the next ``timeouts`` calls (a slow provider)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", "model")
        self.timeouts = 0
        #: the timeout it raised last (the job's own fault: a turn failed by it is no problem of the run)
        self.injected: ModelTimeout | None = None

    def complete(self, messages: Sequence[dict[str, Any]], tools: Any = None, **kw: Any) -> Any:
        if self.timeouts > 0:
            self.timeouts -= 1
            self.injected = ModelTimeout("injected provider timeout")
            raise self.injected
        return self.inner.complete(messages, tools, **kw)


class _NotReportedAgain(logging.Filter):
    """Drops a worker's record of quarantining an engine after its factory failed, when the run's caller has
    reported that engine as unable to load (``GatewayOptions.reported_unusable``): the run said it once."""

    def __init__(self, engines: Sequence[str]) -> None:
        super().__init__()
        self.engines = frozenset(engines)

    def filter(self, record: logging.LogRecord) -> bool:
        from .host import QUARANTINE_RECORD

        engine_id, operation = getattr(record, QUARANTINE_RECORD, (None, None))
        return not (operation == "factory" and engine_id in self.engines)


def _worker_main(conn: Connection, options: GatewayOptions, url: str, dispatcher_pid: int | None = None) -> None:
    """A worker process: its own store and host runtime; says "ready", then runs jobs until told to stop."""
    # Ctrl-C reaches the whole process group: the dispatcher stops the workers (each printed a traceback of
    # its own KeyboardInterrupt), and a worker never outlives it to go on running turns.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_dispatcher(dispatcher_pid)
    from .host import HostRuntime
    from .model import model_from_settings
    from .settings import load_settings
    from .store import TranscriptStore

    # A spawned process configures no logging: its records (an engine's error quoted in a quarantine's)
    # reached stderr through logging's last resort, raw. The faults are on purpose: their warnings would
    # drown the progress bar; the report counts them.
    handler = shown_log_handler()
    if options.reported_unusable:
        handler.addFilter(_NotReportedAgain(options.reported_unusable))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("transcript_store").setLevel(logging.ERROR)
    # An engine's print() or warnings.warn() quotes stored text as freely as its log records do.
    show_process_output()
    # Who it is, before anything can quarantine an engine: the report counts the engines quarantined by
    # this run's processes, and a quarantine record names its process only.
    with contextlib.suppress(EOFError, OSError):
        conn.send(("process", str(identity.current())))
    try:
        store = TranscriptStore(url)
        settings = load_settings(options.config_path, engine=options.engine)
        model = _FaultyModel(model_from_settings(options.model_url, options.model, options.api_key))
        host = HostRuntime(store, settings, model)
    except Exception as e:
        # A configuration the dispatcher let through: one line to it, never a traceback.
        _refuse_jobs(conn, f"{type(e).__name__}: {' '.join(str(e).split())}")
        return
    # The dispatcher starts a job's clock (a kill at a random instant of the turn) when it sends the job:
    # sent to a worker still importing, that instant fell before the turn had even started.
    with contextlib.suppress(EOFError, OSError):  # EOF / a broken pipe: the dispatcher is gone
        conn.send(("ready", settings.max_turn_seconds))
        while True:
            job: Job | None = conn.recv()
            if job is None:
                break
            conn.send(_run_job(host, store, model, options, job))
    host.dispose()  # deferred maintenance finishes (bounded) before the worker ends
    store.close()


def _run_job(host: Any, store: Any, model: _FaultyModel, options: GatewayOptions, job: Job) -> tuple[str, Any]:
    """Run one job in a worker (with its fault armed): the answer to send to the dispatcher."""
    host.before_assemble = None
    if job.fault and job.fault.startswith("kill:"):
        faults.arm(job.fault.split(":", 1)[1])
    elif job.fault == "timeout":
        model.timeouts = 1
    elif job.fault == "rewrite":
        host.before_assemble = _rewrite_previous_reply(store)
    try:
        out = host.run_turn(options.scope, job.session_id, job.text, turn_id=job.turn_id)
        return (
            "ok",
            {
                "status": out.commit_status,
                "engine": out.engine_id,
                "degraded": out.degraded_reason,
                "attempts": out.attempts,
            },
        )
    except Exception as e:
        # The planned provider timeout failed the turn (the settings allow one attempt: [turn]
        # max_attempts = 1): the job's own fault, not a problem of the run. The host raises TurnFailed from
        # the timeout; this very one, not one like it, is the injected one.
        if model.injected is not None and e.__cause__ is model.injected:
            return ("fault", describe(e))
        return ("error", describe(e))
    finally:
        faults.disarm()
        model.timeouts = 0
        model.injected = None


def _die_with_dispatcher(dispatcher_pid: int | None) -> None:
    """Make the kernel SIGKILL this worker when the dispatcher dies (Linux: a SIGTERM, a SIGKILL or a crash
    of the dispatcher left its workers running their turns, and committing them, as orphans).

    Elsewhere a worker ends when it next reads from the dispatcher (EOF), after its current turn."""
    if dispatcher_pid is None:
        return
    if sys.platform.startswith("linux"):
        import ctypes  # here: the CLI imports this module for its limits

        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != dispatcher_pid:  # it died before that
        os._exit(0)


def _refuse_jobs(conn: Connection, problem: str) -> None:
    """A worker that could not start: says why instead of "ready", and answers every job the same way."""
    with contextlib.suppress(EOFError, OSError):  # the dispatcher is gone: nothing left to answer
        conn.send(("unusable", problem))
        while conn.recv() is not None:
            conn.send(("unusable", problem))


def _rewrite_previous_reply(store: Any) -> Any:
    """A maintenance-style rewrite between admission and assembly: the fence cannot be honoured.

    Once per job: the host runs its seam before every attempt's assembly, and the degraded attempt that
    follows the broken fence ran it again: a second rewrite per planned one (the report counted one),
    on an older reply (that attempt's admission is the stale one, before the first rewrite's copies)."""
    landed: list[bool] = []

    def hook(scope: str, session_id: str, admission: Admission) -> None:
        if landed:
            return
        landed.append(True)
        visible = store.read_visible(scope, session_id)
        replies = [e for e in visible if e.role == "assistant" and e.seq < admission.anchor.seq]
        if replies:
            target = replies[-1]
            content = f"[redacted by maintenance] {str((target.message or {}).get('content') or '')[:40]}"
            store.rewrite_entries(
                scope, session_id, [{"entry_id": target.entry_id, "message": {"role": "assistant", "content": content}}]
            )

    return hook


# ---------------------------------------------------------------------------------------------- dispatcher


class _Worker:
    def __init__(self, ctx: Any, options: GatewayOptions, url: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, options, url, os.getpid()), daemon=True)
        # A spawned worker imports the console script and the library (about a second) before it can
        # ignore SIGINT itself: a Ctrl-C then (workers are respawned all the run) printed its traceback.
        # Ignored while it starts, SIGINT stays ignored in the worker (an ignored signal stays ignored
        # across the exec, and Python keeps it so; a blocked one does not: spawn resets the mask). The dispatcher
        # misses a Ctrl-C only inside the fork and exec themselves, milliseconds.
        try:
            before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread: the caller's own signal handling stands
            before = None
        try:
            self.proc.start()
        finally:
            if before is not None:
                signal.signal(signal.SIGINT, before)
        child.close()
        self.ready = False  # its "ready" came: its store and host are up, a job sent now starts at once
        self.turn_seconds = 0.0  # its settings' max_turn_seconds (in its "ready")
        self.job: Job | None = None
        self.kill_at: float | None = None
        self.hung_at = 0.0  # when its job, still running, is past its max_turn_seconds
        self.start_by = time.monotonic() + STARTUP_SECONDS  # when, not ready yet, it is stuck starting

    def end(self) -> None:
        """SIGKILL it unless it has ended already; reap it (a zombie's pid still looks alive to the
        recovery pass, which then left its intent alone); close the dispatcher's end of its pipe."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()


def _plan(options: GatewayOptions, session_ids: list[str], rng: random.Random) -> dict[str, list[Job]]:
    plan: dict[str, list[Job]] = {}
    for s_index, sid in enumerate(session_ids):
        jobs = []
        for t in range(options.turns):
            topic = TOPICS[(s_index + t) % len(TOPICS)]
            verb = "look up" if (s_index + t) % 3 == 0 else "tell me about"
            fault = None
            if options.faults:
                roll = rng.random()
                if roll < options.kill_rate * 0.6:
                    fault = f"kill:{rng.choice(KILL_POINTS)}"
                elif roll < options.kill_rate:
                    fault = "kill_random"
                elif roll < options.kill_rate + options.timeout_rate:
                    fault = "timeout"
                elif t >= 1 and roll < options.kill_rate + options.timeout_rate + options.rewrite_rate:
                    fault = "rewrite"
            jobs.append(Job(sid, f"{sid}:turn-{t}", f"Turn {t}: please {verb} {topic}.", fault))
        plan[sid] = jobs
    return plan


def run_gateway(options: GatewayOptions, console: Console | None = None) -> GatewayReport:
    """Run the gateway (see module doc) and return its report; the process's logging is left alone."""
    from rich.console import Console

    from .compaction import check_legacy_config
    from .config import StoreConfig
    from .host import LEGACY
    from .settings import load_settings
    from .store import TranscriptStore

    options.check()
    console = console or Console()
    started = time.monotonic()
    # No logging level set here, not even for the run: logging is the embedding application's, process-wide
    # (two runs in two threads restored each other's level out of order). The CLI, which owns its process,
    # quiets the library's records of the faults on purpose; the workers (processes of their own) do too.
    store = None
    try:
        config = StoreConfig.from_env(url=options.db_url)
        settings = load_settings(options.config_path, engine=options.engine)  # refused before any write
        # The fallback's [engine.config.legacy] as every worker's host checks it when it is built: refused
        # here, before the store is created and the run's sessions made, not by each worker at its start.
        check_legacy_config(settings.engine_config.get(LEGACY, {}))
        engine = settings.engine
        store = TranscriptStore(config=config)
        url = config.url
        rng = random.Random(options.seed)
        # The seed makes the workload and its faults, never the run's identity: two runs of one seed in the
        # same second (two `make run`s, two CI jobs on one PostgreSQL) took the same session ids, and as
        # creating an existing session (same id, same key) is a no-op, the second run "checked" the
        # first run's turns (every one a duplicate) and reported them as its own.
        run_id = f"{int(time.time())}-{rng.randrange(1 << 30):x}{secrets.token_hex(4)}"
        session_ids = []
        for i in range(options.sessions):
            info = store.create_session(
                options.scope, session_id=f"run-{run_id}-conv-{i}", session_key=f"gateway:{run_id}:{i}"
            )
            if info.entry_count:  # all the same: the checks below count only what this run wrote
                raise TranscriptStoreError(f"session {info.session_id!r} of this run exists already")
            session_ids.append(info.session_id)
        plan = _plan(options, session_ids, rng)
        report = GatewayReport(
            url=mask_url(url), engine=engine, workers=options.workers, planned_turns=options.sessions * options.turns,
            scope=options.scope,
        )
        processes: set[str] = set()
        outcomes = _dispatch(options, url, plan, report, rng, console, processes)
        _finish(store, options, engine, plan, outcomes, report, processes)
        report.seconds = time.monotonic() - started
        return report
    finally:
        if store is not None:
            store.close()


@contextlib.contextmanager
def sigterm_ends_the_run() -> Iterator[None]:
    """For a command that owns its process (the CLI's ``gateway``; ``sessions export -o``, whose part file it
    removes; ``chat``, whose turn it discards): a SIGTERM or a SIGHUP (its terminal closed, its SSH connection
    dropped) ends the run as Ctrl-C does, then the process as that signal would (status 143, or 129, in a
    shell).

    Python's default SIGTERM or SIGHUP ended the dispatcher where it stood: its workers died with it (the
    kernel kills them; elsewhere than on Linux they went on), but on a terminal the progress display never
    closed, leaving the cursor hidden. Raised as KeyboardInterrupt, it runs the interrupted run's ``finally``
    blocks: the workers SIGKILLed and reaped, the display closed, the store closed. A second such signal
    meanwhile ends the process at once. A signal the process was started ignoring (``nohup`` ignores SIGHUP)
    stays ignored. Outside the main thread (no signal handler can be set there) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = (signal.SIGTERM, signal.SIGHUP)
    terminated: list[int] = []

    def interrupt(signum: int, frame: Any) -> None:
        for signum_ in handled:
            signal.signal(signum_, signal.SIG_DFL)
        terminated.append(signum)
        raise KeyboardInterrupt

    found = {signum: signal.getsignal(signum) for signum in wanted}
    handled = [signum for signum, before in found.items() if before != signal.SIG_IGN]
    for signum in handled:
        signal.signal(signum, interrupt)
    try:
        yield
    finally:
        for signum in handled:
            signal.signal(signum, found[signum])
        if terminated:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            signal.signal(terminated[0], signal.SIG_DFL)
            os.kill(os.getpid(), terminated[0])


def _dispatch(
    options: GatewayOptions,
    url: str,
    plan: dict[str, list[Job]],
    report: GatewayReport,
    rng: random.Random,
    console: Console,
    processes: set[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run the plan's turns on the workers; each turn's answer. The workers' process identities are
    added to ``processes`` (the quarantine records the run's report counts)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    processes = set() if processes is None else processes
    ctx = mp.get_context("spawn")
    workers: list[_Worker] = []
    queue = _Queue(plan)
    outcomes: dict[str, dict[str, Any]] = {}
    deaths = [0]  # unplanned deaths in a row, with no turn answered in between
    total = sum(len(j) for j in plan.values())
    progress = Progress(
        TextColumn("turns"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not options.progress,
        transient=False,
    )
    finished = False
    try:
        # Inside the try: an interrupt while they start ends those started already.
        for _ in range(options.workers):
            workers.append(_Worker(ctx, options, url))
        with progress:
            task = progress.add_task("turns", total=total)
            while len(outcomes) < total:
                for i, w in enumerate(workers):
                    if not w.ready or w.job is not None:
                        continue
                    if w.proc.is_alive() and _assign(w, queue, rng, report):
                        continue
                    # Died between two jobs (seen dead, or its job could not be sent): given the next job
                    # anyway, it was a BrokenPipeError out of the whole run.
                    w.end()
                    exitcode = w.proc.exitcode
                    _unexpected(report, deaths, f"a worker died unexpectedly (exit code {exitcode} between two turns)")
                    workers[i] = _Worker(ctx, options, url)
                _wait_some(workers, ctx, options, url, queue, outcomes, report, progress, task, deaths, processes)
        finished = True
    finally:
        _stop(workers, graceful=finished)
    return outcomes


def _stop(workers: list[_Worker], *, graceful: bool) -> None:
    """End every worker. A finished run tells them to stop and waits (bounded, all at once: not 10 s per
    worker); an interrupted one (Ctrl-C, an error) SIGKILLs them at once: their turns are mid-flight, as
    a kill leaves them, and the store's recovery is built for exactly that."""
    if graceful:
        # One not ready yet (a replacement still starting) ran nothing: no waiting for its start-up.
        running = [w for w in workers if w.ready]
        for w in running:
            with contextlib.suppress(OSError):
                w.conn.send(None)
        deadline = time.monotonic() + STOP_SECONDS
        for w in running:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for w in workers:
        w.end()


def _unexpected(report: GatewayReport, deaths: list[int], problem: str) -> None:
    """A worker died without a planned kill (or hung, and was killed): a problem of the run, never one of
    its kills. Too many in a row with no turn answered (workers that cannot start, an engine ending its
    process on every turn): the run stops, instead of spawning workers up to MAX_DISPATCHES times per turn."""
    report.unexpected_exits += 1
    report.problems.append(problem)
    deaths[0] += 1
    if deaths[0] >= MAX_DEATHS_IN_A_ROW:
        raise TranscriptStoreError(f"gateway workers keep dying: {deaths[0]} in a row with no turn answered; {problem}")


class _Queue:
    """The plan's turns waiting to be dispatched: a session's turns in order, one in flight at a time, and
    the next job always from the first session in plan order that has a turn left and none in flight.

    The sessions ready to send are a heap of their plan positions: O(log sessions) per dispatch. Scanning
    every session for the first ready one made a run of S sessions cost O(S) per turn dispatched (and per
    idle worker woken once all were in flight): quadratic in a run of a thousand sessions.
    """

    def __init__(self, plan: dict[str, list[Job]]) -> None:
        self._jobs = list(plan.values())
        self._position = {sid: i for i, sid in enumerate(plan)}
        self._next = [0] * len(self._jobs)  # per session: the index of its next turn
        self._ready = [i for i, jobs in enumerate(self._jobs) if jobs]  # in order: a heap already

    def take(self) -> Job | None:
        """The next job to send, its session now in flight; None while every session left has one in flight."""
        if not self._ready:
            return None
        i = heapq.heappop(self._ready)
        return self._jobs[i][self._next[i]]

    def put_back(self, job: Job) -> None:
        """A job taken and not sent, or to be sent again: its session is ready again, at the same turn."""
        heapq.heappush(self._ready, self._position[job.session_id])

    def done(self, job: Job) -> None:
        """A job finished (answered, or given up): its session's next turn, if any, is ready."""
        i = self._position[job.session_id]
        self._next[i] += 1
        if self._next[i] < len(self._jobs[i]):
            heapq.heappush(self._ready, i)


def _assign(w: _Worker, queue: _Queue, rng: random.Random, report: GatewayReport) -> bool:
    """Send ``w`` the next turn of a session with none in flight (if any); False if it could not be sent."""
    job = queue.take()
    if job is None:
        return True
    try:
        w.conn.send(job)
    except OSError:  # BrokenPipeError: the worker is gone; the turn stays where it was, not in flight
        queue.put_back(job)
        return False
    w.job = job
    w.kill_at = None
    w.hung_at = time.monotonic() + w.turn_seconds + TURN_GRACE_SECONDS
    if job.fault == "kill_random":
        w.kill_at = time.monotonic() + rng.uniform(0.0, 0.08)
    elif job.fault == "timeout":
        report.provider_timeouts += 1
    elif job.fault == "rewrite":
        report.rewrites += 1
    return True


def _planned_kill(job: Job, exitcode: int | None) -> bool:
    """Whether a worker that died running ``job`` died of the kill planned for it."""
    return exitcode == -signal.SIGKILL and job.fault is not None and job.fault.startswith("kill")


def _wait_some(
    workers: list[_Worker],
    ctx: Any,
    options: GatewayOptions,
    url: str,
    queue: _Queue,
    outcomes: dict[str, dict[str, Any]],
    report: GatewayReport,
    progress: Progress,
    task: Any,
    deaths: list[int],
    processes: set[str],
) -> None:
    """Wait for a worker's message or death (or a kill's instant), and act on each that came."""
    watched = [w for w in workers if w.job is not None or not w.ready]
    busy = [w for w in watched if w.job is not None]
    deadlines = [w.kill_at for w in busy if w.kill_at is not None] + [w.hung_at for w in busy]
    deadlines += [w.start_by for w in watched if not w.ready]
    timeout = min(5.0, max(0.0, min(deadlines) - time.monotonic())) if deadlines else 5.0
    wait([w.conn for w in watched] + [w.proc.sentinel for w in watched], timeout=timeout)
    now = time.monotonic()
    for i, w in enumerate(workers):
        if w.ready and w.job is None:
            continue
        kind: str
        data: Any
        killed = hung = stuck = False
        if not w.ready and w.proc.is_alive() and not w.conn.poll() and now >= w.start_by:
            stuck = True
            w.proc.kill()
            w.proc.join()
        if w.job is not None and w.proc.is_alive() and not w.conn.poll():
            if w.kill_at is not None and now >= w.kill_at:
                killed = True  # SIGKILL at a random instant of the turn
            elif now >= w.hung_at:
                hung = True  # no engine, model or store call is bounded by anything else here
            if killed or hung:
                w.proc.kill()
                w.proc.join()
        if killed or hung or stuck:
            kind, data = "died", None  # whatever it sent meanwhile: the job goes out again
        elif w.conn.poll():  # a message, or EOF
            try:
                kind, data = w.conn.recv()
            except (EOFError, OSError):
                kind, data = "died", None
        elif not w.proc.is_alive():
            kind, data = "died", None
        else:
            continue
        if kind == "unusable":  # the worker could not start: every dispatch would fail the same way
            raise TranscriptStoreError(f"a gateway worker could not start: {data}")
        if kind == "process":  # its identity, sent first
            processes.add(str(data))
            continue
        if kind == "ready":
            w.ready, w.turn_seconds = True, float(data)
            continue
        job = w.job
        w.job = None
        if kind == "died":
            w.end()
            if job is not None and not hung and _planned_kill(job, w.proc.exitcode):
                report.kills += 1
            elif hung and job is not None:
                problem = f"turn {job.turn_id} attempt {job.attempt} ran past max_turn_seconds ({w.turn_seconds:g} s)"
                _unexpected(report, deaths, f"{problem}: its worker was SIGKILLed")
            elif stuck:
                _unexpected(report, deaths, f"a worker did not start within {STARTUP_SECONDS:g} s: SIGKILLed")
            else:
                when = f"running turn {job.turn_id} attempt {job.attempt}" if job else "before it was ready"
                _unexpected(report, deaths, f"a worker died unexpectedly (exit code {w.proc.exitcode} {when})")
            workers[i] = _Worker(ctx, options, url)
            if job is None:
                continue
        else:
            deaths[0] = 0  # a turn answered: the workers can run turns
        if job is None:  # an answer with no job asked: nothing of the plan is waiting for it
            continue
        if kind == "ok":
            outcomes[job.turn_id] = data
            if data["status"] == "duplicate":
                report.duplicates_absorbed += 1
            if data["degraded"]:
                report.degraded[data["degraded"]] = report.degraded.get(data["degraded"], 0) + 1
            queue.done(job)
            progress.advance(task)
            continue
        if kind not in ("died", "fault"):  # a "fault": the planned timeout failed it (max_attempts = 1)
            report.problems.append(f"turn {job.turn_id} attempt {job.attempt} raised {data}")
        # The same logical turn goes out again, without the injected fault this time.
        job.fault, job.attempt = None, job.attempt + 1
        if job.attempt >= MAX_DISPATCHES:
            report.problems.append(f"turn {job.turn_id} gave up after {job.attempt} dispatches")
            outcomes[job.turn_id] = {"status": "failed"}
            queue.done(job)
            progress.advance(task)
        else:
            queue.put_back(job)
            report.retried_dispatches += 1  # only a dispatch that happens: a turn given up goes out no more


def _finish(
    store: Any,
    options: GatewayOptions,
    engine: str,
    plan: dict[str, list[Job]],
    outcomes: dict[str, dict[str, Any]],
    report: GatewayReport,
    processes: Collection[str],
) -> None:
    """Recovery pass, then the exactly-once check from the store alone; ``processes``: the identities of
    the run's worker processes."""
    from .host import HostRuntime
    from .model import LocalResponder
    from .quarantine import records
    from .settings import load_settings

    host = HostRuntime(store, load_settings(options.config_path, engine=options.engine), LocalResponder())
    try:
        for sid in plan:
            rec = host.turns.recover(options.scope, sid, engine, host.commit_in)
            report.recovered_intents += len(rec.discarded) + rec.drain.delivered + rec.drain.blocked
            report.duplicates_absorbed += rec.drain.duplicates
    finally:
        # Writes its quarantine records, and disposes of the engines it made: a recovery that failed
        # (the database gone meanwhile) left them undisposed, in the process of a library caller.
        host.dispose()
    # Engines, not records: a record is one engine in one process, so one broken engine met by every
    # worker was counted once per worker. And this run's only: its workers' records (they are gone, hence
    # not live_only; no other process has their identities), and the recovery pass's own quarantines, never
    # a record another process wrote meanwhile (this one's other work, another command on the database).
    ours = set(processes)
    engines = {r.engine_id for r in store.read(lambda c: records(c, live_only=False)) if r.process in ours}
    report.quarantines = len(engines | set(host.quarantined))
    for sid, jobs in plan.items():
        _check_session(store, options.scope, sid, jobs, engine, outcomes, report)


def _check_session(
    store: Any, scope: str, sid: str, jobs: list[Job], engine: str, outcomes: dict[str, dict[str, Any]],
    report: GatewayReport,
) -> None:
    """Count one session's turns from the store and check each accepted one is in its engine once, whole,
    and in admission order (per engine: each engine's commits follow the admissions)."""
    from .ledger import list_receipts
    from .outbox import get_intent

    entries = _all_entries(store, scope, sid)
    admitted = {e.turn_id: e for e in entries if e.turn_id}
    # A turn's replies are appended with its acceptance, each the child of the one before: a reply (any
    # message but a user's) under a receipt's terminal entry is the same turn going on past its receipt.
    continued = {e.parent_id for e in entries if e.kind == "message" and e.role != "user"}
    by_key: dict[str, list[Any]] = {}
    for r in store.read(lambda c: list_receipts(c, scope, sid)):
        by_key.setdefault(r.advancement_key, []).append(r)
    planned = {job.turn_id for job in jobs}
    # "Nothing else reached the engine": a receipt in the run's sessions under a key that is none of
    # its turns was never looked at.
    for key in sorted(set(by_key) - planned):
        report.problems.append(f"session {sid}: {key!r} reached the engine but is none of the run's turns")
    for i, job in enumerate(jobs):
        tid = job.turn_id
        found = by_key.get(tid, [])
        intent = None if found else store.read(lambda c, t=tid: get_intent(c, scope, sid, t))
        if tid in admitted:
            report.admitted += 1
        if len(found) > 1:
            report.problems.append(f"turn {tid} committed {len(found)} times")
        if found:
            report.accepted += 1
            report.committed += 1
            _held_by(report, engine, found[0].engine_id)
            for r in found:
                problem = _receipt_problem(store, r, admitted.get(tid), continued)
                if problem is not None:
                    report.problems.append(f"turn {tid}: {problem}")
        elif intent is not None and intent.state == "blocked":
            report.accepted += 1
            report.blocked += 1
            _held_by(report, engine, intent.engine_id)
            # What blocks a turn of this run is a planned rewrite: its own turn's range goes stale (and an
            # earlier turn still queued then). Any other block is a turn kept from its engine unexplained.
            if not any(later.planned == "rewrite" for later in jobs[i:]):
                report.problems.append(
                    f"turn {tid} is blocked ({intent.block_reason}) and no planned rewrite explains it"
                )
        elif outcomes.get(tid, {}).get("status") not in ("failed",):
            state = intent.state if intent else "no intent"
            report.problems.append(f"turn {tid} finished but is neither committed nor blocked ({state})")
    _check_order(sid, [r for found in by_key.values() for r in found], {e.entry_id: e.seq for e in entries}, report)


def _receipt_problem(store: Any, receipt: Any, entry: Any, continued: set[str | None]) -> str | None:
    """What makes ``receipt`` no whole commit of its turn (admitted as ``entry``): None when it is one."""
    from .ledger import committed_messages

    r = receipt
    try:
        msgs = store.read(lambda c: committed_messages(c, r.scope, r.session_id, r.engine_id, r.advancement_key))
    except KeyError:  # a raw seq the receipt references is no entry of the transcript any more
        return f"a message its receipt on {r.engine_id} references is gone from the transcript"
    if entry is None or r.admission_entry_id != entry.entry_id or len(msgs) != r.message_count or not msgs \
            or msgs[0] != entry.message:
        return "ledger messages disagree with the transcript"
    if r.terminal_entry_id in continued:
        return f"its receipt on {r.engine_id} ends before its reply does: part of the turn reached the engine"
    return None


def _check_order(sid: str, receipts: list[Any], seqs: dict[str, int], report: GatewayReport) -> None:
    """Each engine took the session's turns in admission order: its receipts, by their admission's seq,
    were committed one after the other (commit times never going back)."""
    by_engine: dict[str, list[Any]] = {}
    for r in receipts:
        if r.admission_entry_id in seqs:  # one that is not: reported as disagreeing with the transcript
            by_engine.setdefault(r.engine_id, []).append(r)
    for engine_id, held in by_engine.items():
        held.sort(key=lambda r: seqs[r.admission_entry_id])
        for before, after in itertools.pairwise(held):
            if before.committed_us > after.committed_us:
                report.problems.append(
                    f"session {sid}: turn {before.advancement_key} reached {engine_id} after turn "
                    f"{after.advancement_key}, admitted after it"
                )


def _held_by(report: GatewayReport, configured: str, engine_id: str) -> None:
    """Count an accepted turn under the engine the store says holds it; another than the configured one
    is a degraded turn, whatever its worker answered (or did not: killed after its commit)."""
    report.turns_by_engine[engine_id] = report.turns_by_engine.get(engine_id, 0) + 1
    if engine_id != configured:
        report.degraded_turns += 1


def _all_entries(store: Any, scope: str, session_id: str) -> list[Any]:
    out: list[Any] = []
    after = -1
    while True:
        page = store.list_entries(scope, session_id, after_seq=after, limit=1000)
        out.extend(page)
        if len(page) < 1000:
            return out
        after = page[-1].seq
