"""The main job: a real multi-worker gateway run with faults injected on purpose, and its report.

N worker processes take turns of several conversations from the dispatcher (one turn per session in
flight, in order), and run each through the host runtime: admit, assemble with the configured
engine, call the model, commit. Faults on purpose: workers SIGKILLed mid-turn (at named fault points
and at random instants), provider timeouts that make the host retry the same logical turn, and a
transcript rewrite between admission and assembly that forces a turn-local degradation. A killed
turn is dispatched again with the same logical turn id. At the end a recovery pass runs and the
report checks, from the store alone, that every accepted turn reached the engine exactly once.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import random
import shlex
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from . import faults
from .config import DEFAULT_URL
from .core import from_us, now_us
from .db import mask_url
from .errors import InvalidInput, ModelTimeout, TranscriptStoreError, describe
from .models import Admission
from .terminal import show_process_output, shown, shown_log_handler

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
    seed: int = 7
    scope: str = GATEWAY_SCOPE
    config_path: str | None = None
    progress: bool = True
    kill_rate: float = 0.12
    timeout_rate: float = 0.1
    rewrite_rate: float = 0.06

    def check(self) -> None:
        """Refuse counts past a run's bounds (InvalidInput), before anything starts."""
        for name, bound in (("workers", MAX_WORKERS), ("sessions", MAX_SESSIONS), ("turns", MAX_TURNS)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
                raise InvalidInput(f"{name} must be an integer in 1..{bound}, got {value!r}")
        if self.sessions * self.turns > MAX_RUN_TURNS:
            raise InvalidInput(
                f"{self.sessions} sessions x {self.turns} turns is {self.sessions * self.turns} turns: "
                f"at most {MAX_RUN_TURNS} turns in a run"
            )


@dataclass
class Job:
    """One logical turn to run, and the fault to inject into this attempt."""

    session_id: str
    turn_id: str
    text: str
    fault: str | None = None
    attempt: int = 0


@dataclass
class GatewayReport:
    """What happened, measured from the store after recovery."""

    url: str
    engine: str
    workers: int
    planned_turns: int
    scope: str = GATEWAY_SCOPE
    admitted: int = 0
    accepted: int = 0
    committed: int = 0
    blocked: int = 0
    duplicates_absorbed: int = 0
    degraded: dict[str, int] = field(default_factory=dict)
    quarantines: int = 0
    recovered_intents: int = 0
    kills: int = 0
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
        """Print the report as a table and the exactly-once verdict.

        Degraded reasons and problems quote engines' errors: shown escaped, as Text (never read as rich
        markup, which a caller's console may parse), so the terminal reads them and obeys none of them.
        """
        table = Table(title=Text(shown(f"gateway run: {self.workers} workers, engine {self.engine}, {self.url}")))
        table.add_column("what")
        table.add_column("count", justify="right")
        rows = [
            ("turns planned", self.planned_turns),
            ("turns admitted", self.admitted),
            ("turns accepted", self.accepted),
            ("turns committed to the engine", self.committed),
            ("turns blocked (kept as evidence)", self.blocked),
            ("duplicates absorbed by the ledger", self.duplicates_absorbed),
            ("degraded turns", sum(self.degraded.values())),
            ("engines quarantined by this run", self.quarantines),
            ("recovered intents", self.recovered_intents),
            ("workers killed (SIGKILL)", self.kills),
            ("provider timeouts (retried)", self.provider_timeouts),
            ("transcript rewrites", self.rewrites),
            ("turns dispatched again", self.retried_dispatches),
        ]
        for what, count in rows:
            table.add_row(what, str(count))
        console.print(table)
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

    def complete(self, messages: Sequence[dict[str, Any]], tools: Any = None, **kw: Any) -> Any:
        if self.timeouts > 0:
            self.timeouts -= 1
            raise ModelTimeout("injected provider timeout")
        return self.inner.complete(messages, tools, **kw)


def _worker_main(conn: Connection, options: GatewayOptions, url: str) -> None:
    """A worker process: its own store and host runtime; runs jobs until told to stop."""
    from .host import HostRuntime
    from .model import model_from_settings
    from .settings import load_settings
    from .store import TranscriptStore

    # A spawned process configures no logging: its records (an engine's error quoted in a quarantine's)
    # reached stderr through logging's last resort, raw. The faults are on purpose: their warnings would
    # drown the progress bar; the report counts them.
    logging.basicConfig(level=logging.WARNING, handlers=[shown_log_handler()])
    logging.getLogger("transcript_store").setLevel(logging.ERROR)
    # An engine's print() or warnings.warn() quotes stored text as freely as its log records do.
    show_process_output()
    try:
        store = TranscriptStore(url)
        settings = load_settings(options.config_path, engine=options.engine)
        model = _FaultyModel(model_from_settings(options.model_url, options.model, options.api_key))
        host = HostRuntime(store, settings, model)
    except TranscriptStoreError as e:
        # A configuration the dispatcher let through: one line to it for every job, never a traceback.
        _refuse_jobs(conn, f"{type(e).__name__}: {' '.join(str(e).split())}")
        return
    while True:
        job: Job | None = conn.recv()
        if job is None:
            break
        host.before_assemble = None
        if job.fault and job.fault.startswith("kill:"):
            faults.arm(job.fault.split(":", 1)[1])
        elif job.fault == "timeout":
            model.timeouts = 1
        elif job.fault == "rewrite":
            host.before_assemble = _rewrite_previous_reply(store)
        try:
            out = host.run_turn(options.scope, job.session_id, job.text, turn_id=job.turn_id)
            conn.send(
                (
                    "ok",
                    {
                        "status": out.commit_status,
                        "engine": out.engine_id,
                        "degraded": out.degraded_reason,
                        "attempts": out.attempts,
                    },
                )
            )
        except Exception as e:
            conn.send(("error", describe(e)))
        finally:
            faults.disarm()
            model.timeouts = 0
    host.dispose()  # deferred maintenance finishes (bounded) before the worker ends
    store.close()


def _refuse_jobs(conn: Connection, problem: str) -> None:
    """A worker that could not start: answer every job with why, until told to stop."""
    with contextlib.suppress(EOFError, OSError):  # the dispatcher is gone: nothing left to answer
        while conn.recv() is not None:
            conn.send(("unusable", problem))


def _rewrite_previous_reply(store: Any) -> Any:
    """A maintenance-style rewrite between admission and assembly: the fence cannot be honoured."""

    def hook(scope: str, session_id: str, admission: Admission) -> None:
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
        self.proc = ctx.Process(target=_worker_main, args=(child, options, url), daemon=True)
        self.proc.start()
        child.close()
        self.job: Job | None = None
        self.kill_at: float | None = None


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
    """Run the gateway (see module doc) and return its report."""
    from .config import StoreConfig
    from .settings import load_settings
    from .store import TranscriptStore

    options.check()
    console = console or Console()
    started, started_us = time.monotonic(), now_us()
    lib_log = logging.getLogger("transcript_store")
    level = lib_log.level
    lib_log.setLevel(logging.ERROR)  # the faults are on purpose; the report counts them
    try:
        config = StoreConfig.from_env(url=options.db_url)
        engine = load_settings(options.config_path, engine=options.engine).engine  # refused before any write
        store = TranscriptStore(config=config)
        url = config.url
        rng = random.Random(options.seed)
        run_id = f"{int(time.time())}-{rng.randrange(1 << 30):x}"
        session_ids = [
            store.create_session(
                options.scope, session_id=f"run-{run_id}-conv-{i}", session_key=f"gateway:{run_id}:{i}"
            ).session_id
            for i in range(options.sessions)
        ]
        plan = _plan(options, session_ids, rng)
        report = GatewayReport(
            url=mask_url(url), engine=engine, workers=options.workers, planned_turns=options.sessions * options.turns,
            scope=options.scope,
        )
        outcomes = _dispatch(options, url, plan, report, rng, console)
        _finish(store, options, engine, plan, outcomes, report, started_us)
        report.seconds = time.monotonic() - started
        store.close()
        return report
    finally:
        lib_log.setLevel(level)


def _dispatch(
    options: GatewayOptions,
    url: str,
    plan: dict[str, list[Job]],
    report: GatewayReport,
    rng: random.Random,
    console: Console,
) -> dict[str, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    workers = [_Worker(ctx, options, url) for _ in range(options.workers)]
    next_index = dict.fromkeys(plan, 0)
    in_flight: set[str] = set()
    outcomes: dict[str, dict[str, Any]] = {}
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
    try:
        with progress:
            task = progress.add_task("turns", total=total)
            while len(outcomes) < total:
                for w in workers:
                    if w.job is None:
                        _assign(w, plan, next_index, in_flight, rng, report)
                _wait_some(workers, ctx, options, url, plan, next_index, in_flight, outcomes, report, progress, task)
    finally:
        for w in workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                w.conn.send(None)
            w.proc.join(timeout=10)
            if w.proc.is_alive():
                w.proc.kill()
    return outcomes


def _assign(
    w: _Worker,
    plan: dict[str, list[Job]],
    next_index: dict[str, int],
    in_flight: set[str],
    rng: random.Random,
    report: GatewayReport,
) -> None:
    for sid, jobs in plan.items():
        if sid in in_flight or next_index[sid] >= len(jobs):
            continue
        job = jobs[next_index[sid]]
        in_flight.add(sid)
        w.job = job
        w.kill_at = None
        if job.fault == "kill_random":
            w.kill_at = time.monotonic() + rng.uniform(0.0, 0.08)
        elif job.fault == "timeout":
            report.provider_timeouts += 1
        elif job.fault == "rewrite":
            report.rewrites += 1
        w.conn.send(job)
        return


def _wait_some(
    workers: list[_Worker],
    ctx: Any,
    options: GatewayOptions,
    url: str,
    plan: dict[str, list[Job]],
    next_index: dict[str, int],
    in_flight: set[str],
    outcomes: dict[str, dict[str, Any]],
    report: GatewayReport,
    progress: Progress,
    task: Any,
) -> None:
    busy = [w for w in workers if w.job is not None]
    deadlines = [w.kill_at for w in busy if w.kill_at is not None]
    timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 5.0
    ready = wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=timeout)
    now = time.monotonic()
    for i, w in enumerate(workers):
        if w.job is None:
            continue
        if w.kill_at is not None and now >= w.kill_at and w.proc.is_alive() and w.conn not in ready:
            w.proc.kill()  # SIGKILL at a random instant of the turn
            w.proc.join()
        if w.conn in ready and w.conn.poll():
            try:
                kind, data = w.conn.recv()
            except (EOFError, OSError):
                kind, data = "died", None
        elif not w.proc.is_alive():
            kind, data = "died", None
        else:
            continue
        job = w.job
        w.job = None
        if kind == "unusable":  # the worker could not start: every dispatch would fail the same way
            raise TranscriptStoreError(f"a gateway worker could not start: {data}")
        if kind == "ok":
            outcomes[job.turn_id] = data
            if data["status"] == "duplicate":
                report.duplicates_absorbed += 1
            if data["degraded"]:
                report.degraded[data["degraded"]] = report.degraded.get(data["degraded"], 0) + 1
            in_flight.discard(job.session_id)
            next_index[job.session_id] += 1
            progress.advance(task)
            continue
        if kind == "died":
            report.kills += 1
            w.proc.join()
            workers[i] = _Worker(ctx, options, url)
        else:
            report.problems.append(f"turn {job.turn_id} attempt {job.attempt} raised {data}")
        # The same logical turn goes out again, without the injected fault this time.
        report.retried_dispatches += 1
        job.fault, job.attempt = None, job.attempt + 1
        if job.attempt > 5:
            report.problems.append(f"turn {job.turn_id} gave up after {job.attempt} dispatches")
            outcomes[job.turn_id] = {"status": "failed"}
            in_flight.discard(job.session_id)
            next_index[job.session_id] += 1
            progress.advance(task)
        else:
            in_flight.discard(job.session_id)


def _finish(
    store: Any,
    options: GatewayOptions,
    engine: str,
    plan: dict[str, list[Job]],
    outcomes: dict[str, dict[str, Any]],
    report: GatewayReport,
    started_us: int,
) -> None:
    """Recovery pass, then the exactly-once check from the store alone."""
    from .host import HostRuntime
    from .ledger import committed_messages, receipts_for_key
    from .model import LocalResponder
    from .outbox import get_intent
    from .quarantine import records
    from .settings import load_settings

    host = HostRuntime(store, load_settings(options.config_path, engine=options.engine), LocalResponder())
    for sid in plan:
        rec = host.turns.recover(options.scope, sid, engine, host.commit_in)
        report.recovered_intents += len(rec.discarded) + rec.drain.delivered + rec.drain.blocked
        report.duplicates_absorbed += rec.drain.duplicates
    host.dispose()  # writes its quarantine records; its engines are not needed any more
    # This run's quarantines only (its workers are gone, hence not live_only): a record written (or
    # refreshed) since it started; older ones belong to earlier runs or other commands.
    since = from_us(started_us)
    report.quarantines = sum(r.created_at >= since for r in store.read(lambda c: records(c, live_only=False)))
    scope = options.scope
    for sid, jobs in plan.items():
        admitted = {e.turn_id: e for e in _all_entries(store, scope, sid) if e.turn_id}
        for job in jobs:
            tid = job.turn_id
            found = store.read(lambda c, t=tid, s=sid: receipts_for_key(c, scope, s, t))
            intent = store.read(lambda c, t=tid, s=sid: get_intent(c, scope, s, t))
            if tid in admitted:
                report.admitted += 1
            if len(found) > 1:
                report.problems.append(f"turn {tid} committed {len(found)} times")
            if found:
                report.accepted += 1
                report.committed += 1
                r = found[0]
                msgs = store.read(lambda c, r=r, s=sid: committed_messages(c, scope, s, r.engine_id, r.advancement_key))
                entry = admitted.get(tid)
                if len(msgs) != r.message_count or entry is None or msgs[0] != entry.message:
                    report.problems.append(f"turn {tid}: ledger messages disagree with the transcript")
            elif intent is not None and intent.state == "blocked":
                report.accepted += 1
                report.blocked += 1
            elif outcomes.get(tid, {}).get("status") not in ("failed",):
                state = intent.state if intent else "no intent"
                report.problems.append(f"turn {tid} finished but is neither committed nor blocked ({state})")


def _all_entries(store: Any, scope: str, session_id: str) -> list[Any]:
    out: list[Any] = []
    after = -1
    while True:
        page = store.list_entries(scope, session_id, after_seq=after, limit=1000)
        out.extend(page)
        if len(page) < 1000:
            return out
        after = page[-1].seq
