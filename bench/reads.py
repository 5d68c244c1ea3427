"""Benchmarks 3 and 4: delta pages at three transcript lengths, and what a turn's reads cost."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import event

from engines.legacy import LegacyEngine
from transcript_store import AppendItem, ClosedRange, DeltaPage, TranscriptStore
from transcript_store.cursors import CursorState
from transcript_store.engine import EngineContext
from transcript_store.models import DeltaResult
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

from .context import Context, log, session_for
from .drivers import SCOPE, RowCounter
from .report import Figure
from .targets import Target
from .timing import Timer
from .workload import Turn

PAGE = 20
#: cursors rotate over this many pages at the tail, so a read is not always the very same rows
TAIL_PAGES = 8
#: the host's default assembly budget (token_budget - max_output_tokens)
ASSEMBLY_BUDGET = 32_000 - 1024
#: turns whose legacy assembly is measured, per length: the legacy engine's assembly costs CPU in
#: proportion to the visible transcript (token counting in ``_fit``: seconds a turn at 100,000 messages),
#: so measuring it on every turn would dominate the run. Its rows read are what this benchmark checks.
ASSEMBLY_TURNS = 3


@dataclass
class _Length:
    """The timed reads of one transcript length, and their timers."""

    length: int
    ours_ops: list[Callable[[], object]]
    raw_ops: list[Callable[[], object]]
    decoded_ops: list[Callable[[], object]]
    bare_ops: list[Callable[[], object]]
    ours: Timer = field(default_factory=Timer)
    raw: Timer = field(default_factory=Timer)
    decoded: Timer = field(default_factory=Timer)
    bare: Timer = field(default_factory=Timer)


def bench_read_delta(ctx: Context, target: Target) -> list[Figure]:
    """(3) ``read_visible_delta`` of a 20-message page near the tail, vs the raw indexed tail read."""
    db = ctx.long_transcripts(target)
    store, raw = db.store(), db.raw()
    bare: _BareDriver | None = None
    figures: list[Figure] = []
    try:
        bare = _BareDriver(store)
        runs = [_read_ops(ctx, store, raw, bare, length) for length in ctx.counts.lengths]
        for run in runs:  # warm-up: connections, prepared statements, caches
            Timer().run(run.ours_ops[:50] + run.raw_ops[:50] + run.decoded_ops[:50] + run.bare_ops[:50])
        # The lengths take turns inside every block (the second block in reverse order), so a drift of
        # the machine over the run (a checkpoint after the bulk load, a VM changing speed) is spread
        # over every length instead of landing on the first one measured: the growth target compares
        # two lengths.
        half = ctx.counts.reads // 2
        for block in range(2):
            for run in runs if block == 0 else runs[::-1]:
                part = slice(block * half, (block + 1) * half)
                run.raw.run(run.raw_ops[part])
                run.decoded.run(run.decoded_ops[part])
                run.bare.run(run.bare_ops[part])
                run.ours.run(run.ours_ops[part])
        p50: dict[int, float] = {}
        raw_p50: dict[int, float] = {}
        for run in runs:
            length = run.length
            ours, rawst = run.ours.stats(), run.raw.stats()
            p50[length], raw_p50[length] = ours.p50, rawst.p50
            log(
                f"  read_delta [{target.name}] @{length:,}: "
                f"ours p50 {ours.p50 * 1e3:.3f} ms, raw {rawst.p50 * 1e3:.3f} ms"
            )
            longest = length == ctx.counts.lengths[-1]
            extra = {"length": length, "ours_cpu_ms_per_read": 1000 * run.ours.cpu / ours.count}
            figures.append(
                Figure(
                    "read_delta",
                    target.name,
                    f"p50 @{length:,}",
                    "ms",
                    ours.p50 * 1e3,
                    rawst.p50 * 1e3,
                    "<=" if longest else None,
                    2.0 if longest else None,
                    extra,
                )
            )
            figures.append(
                Figure("read_delta", target.name, f"p95 @{length:,}", "ms", ours.p95 * 1e3, rawst.p95 * 1e3)
            )
            if longest:
                figures.append(
                    Figure(
                        "read_delta",
                        target.name,
                        f"floor: raw read + json.loads of its {PAGE} payloads, p50 @{length:,}",
                        "ms",
                        run.decoded.stats().p50 * 1e3,
                        rawst.p50 * 1e3,
                    )
                )
                figures.append(
                    Figure(
                        "read_delta",
                        target.name,
                        f"this store's page statement on the bare driver + json.loads, p50 @{length:,}",
                        "ms",
                        run.bare.stats().p50 * 1e3,
                        rawst.p50 * 1e3,
                        extra={"cpu_ms_per_read": 1000 * run.bare.cpu / run.bare.stats().count},
                    )
                )
        short, long_ = ctx.counts.lengths[0], ctx.counts.lengths[-1]
        figures.append(
            Figure(
                "read_delta",
                target.name,
                f"p50 @{long_:,} vs ours @{short:,} (raw column: ours @{short:,})",
                "ms",
                p50[long_] * 1e3,
                p50[short] * 1e3,
                "<=",
                1.2,
                {"raw_growth": raw_p50[long_] / raw_p50[short]},
            )
        )
        return figures
    finally:
        if bare is not None:
            bare.close()
        store.close()
        raw.close()


def _read_ops(ctx: Context, store: TranscriptStore, raw: Any, bare: _BareDriver, length: int) -> _Length:
    """The reads of one length: ours, raw's tail read, raw's read decoded, our statement bare."""
    sid = session_for(length)
    info = store.get_session(SCOPE, sid)
    generation, incarnation = info.generation, info.incarnation
    # Cursors after positions length-1-20k: built from the entries' own seq/position, as a reader
    # that had walked the transcript would hold them (walking 100,000 messages is not the point).
    starts = [length - 1 - PAGE * (k + 1) for k in range(min(TAIL_PAGES, (length - 1) // PAGE))]
    cursors = []
    for at in starts:
        entry = store.list_entries(SCOPE, sid, after_seq=at - 1, limit=1)[0]
        assert entry.position is not None
        cursors.append(CursorState(SCOPE, sid, generation, entry.seq, entry.position, incarnation).encode())

    def ours_op(cursor: str) -> Callable[[], object]:
        def run() -> object:
            page = store.read_visible_delta(SCOPE, sid, cursor, max_messages=PAGE)
            if not isinstance(page, DeltaPage) or len(page.entries) != PAGE:
                raise RuntimeError(f"unexpected delta result {type(page).__name__}")
            return page

        return run

    def raw_read(at: int) -> Callable[[], object]:
        return lambda: raw.tail_read(sid, at, PAGE)

    def raw_decoded(at: int) -> Callable[[], object]:
        # The floor of a reader that returns messages: the raw read, its payloads decoded.
        return lambda: [json.loads(row[2]) for row in raw.tail_read(sid, at, PAGE)]

    n = ctx.counts.reads
    statements = [page_statement(store, SCOPE, sid, c, PAGE)[:2] for c in cursors]
    return _Length(
        length,
        [ours_op(cursors[i % len(cursors)]) for i in range(n)],
        [raw_read(starts[i % len(starts)]) for i in range(n)],
        [raw_decoded(starts[i % len(starts)]) for i in range(n)],
        [bare.op(*statements[i % len(statements)]) for i in range(n)],
    )


def page_statement(
    store: TranscriptStore, scope: str, session_id: str, cursor: str, max_messages: int
) -> tuple[str, Any, DeltaResult]:
    """The SQL and parameters an unfenced delta page read sends to the driver (it is one statement),
    and what the read returned (tests/test_pg_plans.py explains the same statement)."""
    sent: list[tuple[str, Any]] = []

    def listen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        sent.append((statement, parameters))

    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        result = store.read_visible_delta(scope, session_id, cursor, max_messages=max_messages)
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    if len(sent) != 1:
        raise RuntimeError(f"a delta page read sent {len(sent)} statements, not one")
    return sent[0][0], sent[0][1], result


class _BareDriver:
    """This store's own page statement run straight on a pooled driver connection, outside any
    transaction, and its payloads decoded: what the read costs before any of the library's Python
    (pool checkout, cursor checks, rows, Entry objects). Against raw's tail read it is the cost of the
    schema's statement (the active-path join and the page's columns), not of the code around it."""

    def __init__(self, store: TranscriptStore) -> None:
        self._pooled = store.db.engine.raw_connection()
        driver: Any = self._pooled.driver_connection
        self.driver = driver
        self._pg = store.backend == "postgresql"
        self._autocommit = driver.autocommit if self._pg else None
        if self._pg:
            self.driver.autocommit = True

    def op(self, sql: str, params: Any) -> Callable[[], object]:
        """One timed read: execute, fetch, decode the payload column."""
        driver = self.driver
        payload: list[int] = []

        def run() -> object:
            cur = driver.execute(sql, params)
            if not payload:
                payload.append([d[0] for d in cur.description].index("payload"))
            at = payload[0]
            # the session's own row comes with the page, its payload NULL (core._delta_page_statement)
            return [json.loads(row[at]) for row in cur.fetchall() if row[at] is not None]

        return run

    def close(self) -> None:
        """Give the connection back to the pool as it was lent (or drop it, if it cannot be)."""
        try:
            if self._pg:
                self.driver.autocommit = self._autocommit
        except Exception:  # not idle after a failed read: never hand it out again
            self._pooled.invalidate()
        finally:
            self._pooled.close()


def bench_closed_range(ctx: Context, target: Target) -> list[Figure]:
    """(4) Rows a turn's reads and writes touch at every length: closed range, legacy assembly, appends."""
    db = ctx.long_transcripts(target)
    store = db.store()
    counter = RowCounter(store)
    engine = LegacyEngine(EngineContext(store=store, summarizer=ExtractiveSummarizer(), estimator=RoughEstimator()))
    per_length: dict[int, dict[str, list[float]]] = {}
    try:
        for length in ctx.counts.lengths:
            sid = session_for(length)
            workload = ctx.workload(40 + length)
            engine.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=ASSEMBLY_BUDGET)  # warm projection
            samples: dict[str, list[float]] = {}
            for k in range(ctx.counts.range_turns + 1):
                found = _one_turn(store, counter, engine, sid, workload.turn(), f"range-{length}-{k}", k)
                for key, value in found.items():
                    if k >= (2 if key.startswith("assembly") else 1):
                        samples.setdefault(key, []).append(value)
            per_length[length] = samples
            log(
                f"  closed_range [{target.name}] @{length:,}: range rows {samples['range_rows'][-1]:.0f}, "
                f"assembly rows_read {samples['assembly_rows_read'][-1]:.0f}, "
                f"assembly p50 {statistics.median(samples['assembly_s']) * 1e3:.1f} ms"
            )
    finally:
        store.close()
    return _range_figures(target, per_length)


def _one_turn(
    store: TranscriptStore, counter: RowCounter, engine: LegacyEngine, sid: str, turn: Turn, turn_id: str, k: int
) -> dict[str, float]:
    """Admit, assemble (first turns only), append the replies, read the closed range; what each cost.

    The assembly of turn 0 follows the unfenced warm-up, so the engine reads the admitted message
    itself unfenced (it is already past the fence) and turn 1 reads only the replies: from turn 2 on,
    each assembly reads exactly the previous turn. Those two are not counted.
    """
    found: dict[str, float] = {}
    timer = Timer()
    counter.take()
    with timer.time():
        admission = store.admit(SCOPE, sid, turn.user, turn_id=turn_id)
    admitted = counter.take()
    if k <= ASSEMBLY_TURNS + 1:  # consecutive turns: each assembly reads exactly one earlier turn's delta
        before = engine.rows_read
        counter.take()
        with timer.time():
            engine.assemble(scope=SCOPE, session_id=sid, fence=admission.anchor, token_budget=ASSEMBLY_BUDGET)
        fetched = counter.take()
        found.update(
            assembly_rows_read=engine.rows_read - before,
            assembly_rows=fetched["rows"],
            assembly_statements=fetched["statements"],
            assembly_s=timer.latencies[-1],
        )
    with timer.time():
        entries = store.append_many(SCOPE, sid, [AppendItem(message=m) for m in turn.replies])
    writes = counter.take()
    found.update(
        write_rows=admitted["rows"] + writes["rows"], write_statements=admitted["statements"] + writes["statements"]
    )
    found["write_s"] = timer.latencies[0] + timer.latencies[-1]
    terminal = store.anchor(SCOPE, sid, entries[-1].entry_id)
    counter.take()
    with timer.time():
        result = store.read_closed_range(admission, terminal)
    closed = counter.take()
    if not isinstance(result, ClosedRange) or len(result.entries) != 4:
        raise RuntimeError(f"closed range of turn {turn_id}: {result!r}")
    found.update(range_rows=closed["rows"], range_statements=closed["statements"], range_s=timer.latencies[-1])
    return found


def _range_figures(target: Target, per_length: dict[int, dict[str, list[float]]]) -> list[Figure]:
    """One row per count: ours = the largest count at any length, raw column = the smallest (equal: met)."""
    lengths = sorted(per_length)
    at = " / ".join(f"{n:,}" for n in lengths)
    figures = []
    rows = (
        ("range_rows", "closed-range rows fetched/turn", "rows"),
        ("range_statements", "closed-range statements/turn", "statements"),
        ("assembly_rows_read", "legacy assembly rows_read/turn", "rows"),
        ("assembly_rows", "legacy assembly rows fetched/turn", "rows"),
        ("assembly_statements", "legacy assembly statements/turn", "statements"),
        ("write_rows", "admission + replies rows fetched/turn", "rows"),
        ("write_statements", "admission + replies statements/turn", "statements"),
    )
    for key, label, unit in rows:
        values = {n: per_length[n][key] for n in lengths}
        shown = " / ".join(f"{max(v):.0f}" for v in values.values())
        figures.append(
            Figure(
                "closed_range",
                target.name,
                f"{label} at {at}: {shown} (max vs min)",
                unit,
                max(max(v) for v in values.values()),
                min(min(v) for v in values.values()),
                "==",
                1.0,
                {"samples": {str(n): v for n, v in values.items()}},
            )
        )
    short, long_ = lengths[0], lengths[-1]
    for key, label in (
        ("range_s", "closed-range p50"),
        ("write_s", "admission + replies p50"),
        ("assembly_s", "legacy assembly p50"),
    ):
        p50 = {n: statistics.median(per_length[n][key]) for n in lengths}
        figures.append(
            Figure(
                "closed_range",
                target.name,
                f"{label} @{long_:,} (raw column: ours @{short:,})",
                "ms",
                p50[long_] * 1e3,
                p50[short] * 1e3,
                extra={"p50_s": {str(n): v for n, v in p50.items()}},
            )
        )
    return figures
