"""Benchmarks 1 and 2: commit_turn into the ledger, and a full durable turn through the host runtime."""

from __future__ import annotations

from collections.abc import Callable

from transcript_store.ledger import prepare_turn
from transcript_store.turns import Turns

from .context import Context, log
from .drivers import Finished, HostDriver, Plan, RowCounter, create_sessions, finish_turns, plan_turns, raw_op
from .raw import RawStore
from .report import Figure
from .targets import Target
from .timing import Timer, alternate


def _compare(
    ctx: Context, bench: str, target: Target, raw_ops: list[Callable[[], object]], ours_ops: list[Callable[[], object]]
) -> tuple[Timer, Timer]:
    """Time raw and ours in alternating blocks."""
    blocks = ctx.counts.blocks
    per = len(ours_ops) // blocks
    raw_t, ours_t = Timer(), Timer()
    alternate(
        blocks,
        lambda b: raw_t.run(raw_ops[b * per : (b + 1) * per]),
        lambda b: ours_t.run(ours_ops[b * per : (b + 1) * per]),
    )
    log(f"  {bench} [{target.name}]: ours {ours_t.stats().per_second:,.0f}/s, raw {raw_t.stats().per_second:,.0f}/s")
    return raw_t, ours_t


def _turn_figures(
    bench: str, target: Target, goal: float, raw_t: Timer, ours_t: Timer, extra: dict[str, object]
) -> list[Figure]:
    ours, raw = ours_t.stats(), raw_t.stats()
    cpu = {
        "ours_cpu_ms_per_turn": 1000 * ours_t.cpu / max(1, ours.count),
        "raw_cpu_ms_per_turn": 1000 * raw_t.cpu / max(1, raw.count),
        "turns": ours.count,
    }
    return [
        Figure(bench, target.name, "turns/s", "turns/s", ours.per_second, raw.per_second, ">=", goal, {**cpu, **extra}),
        Figure(bench, target.name, "p50 latency", "ms", ours.p50 * 1e3, raw.p50 * 1e3),
        Figure(bench, target.name, "p95 latency", "ms", ours.p95 * 1e3, raw.p95 * 1e3),
    ]


def bench_commit_turn(ctx: Context, target: Target) -> list[Figure]:
    """(1) ``Turns.commit_turn`` of a finished turn (already in the transcript): one transaction."""
    db = ctx.lab.database(target, "commit")
    store, raw = db.store(), db.raw()
    try:
        turns = Turns(store)
        warm = plan_turns(ctx.workload(11), 8, "cw")
        plans = plan_turns(ctx.workload(1), ctx.counts.commit_turns, "c")
        create_sessions(store, warm + plans)
        finished = finish_turns(store, warm + plans)

        def commit(f: Finished) -> Callable[[], object]:
            def run() -> object:
                result = turns.commit_turn("legacy", f.plan.turn_id, f.admission, f.terminal, f.plan.turn.messages)
                if result.status != "committed":
                    raise RuntimeError(f"commit_turn of {f.plan.turn_id} was {result.status}")
                return result

            return run

        ops = [commit(f) for f in finished]
        raw_ops: list[Callable[[], object]] = [raw_op(raw, p) for p in warm + plans]
        Timer().run(raw_ops[: len(warm)] + ops[: len(warm)])  # warm-up: connections, caches, compiled SQL
        raw_t, ours_t = _compare(ctx, "commit_turn", target, raw_ops[len(warm) :], ops[len(warm) :])
        # The floor of any commit that validates and hashes the turn: prepare_turn of the same turns,
        # timed alone (no database), added to raw's transaction.
        def prepare(f: Finished) -> Callable[[], object]:
            return lambda: prepare_turn("legacy", f.plan.turn_id, f.admission, f.terminal, f.plan.turn.messages)

        prep_t = Timer()
        prep_t.run([prepare(f) for f in finished[len(warm) :]])
        counter = RowCounter(store)
        extra_plans = plan_turns(ctx.workload(12), 4, "cx")
        create_sessions(store, extra_plans)
        for f in finish_turns(store, extra_plans):
            counter.take()
            commit(f)()
        per_turn = counter.take()
        figures = _turn_figures(
            "commit_turn", target, 0.8, raw_t, ours_t, {"last_turn_" + k: v for k, v in per_turn.items()}
        )
        prep_mean, raw_mean = prep_t.stats().mean, raw_t.stats().mean
        figures.append(
            Figure(
                "commit_turn",
                target.name,
                "floor: raw + validating and hashing the turn (prepare_turn timed alone): turns/s",
                "turns/s",
                1 / (raw_mean + prep_mean),
                1 / raw_mean,
                extra={"prepare_turn_us": prep_mean * 1e6, "raw_turn_us": raw_mean * 1e6},
            )
        )
        return figures
    finally:
        store.close()
        raw.close()


def bench_host_turn(ctx: Context, target: Target) -> list[Figure]:
    """(2) A full durable turn through the host runtime, legacy engine, instant model."""
    db = ctx.lab.database(target, "host")
    store, raw = db.store(), db.raw()
    try:
        driver = HostDriver(store)
        warm = plan_turns(ctx.workload(21), 8, "hw")
        plans = plan_turns(ctx.workload(2), ctx.counts.host_turns, "h")
        create_sessions(store, warm + plans)
        ops = [driver.script(p) for p in warm + plans]
        raw_ops: list[Callable[[], object]] = [raw_op(raw, p) for p in warm + plans]
        Timer().run(raw_ops[: len(warm)] + ops[: len(warm)])
        raw_t, ours_t = _compare(ctx, "host_turn", target, raw_ops[len(warm) :], ops[len(warm) :])
        # One more session's turns with a row counter attached: what a turn costs in round trips.
        counter = RowCounter(store)
        extra = plan_turns(ctx.workload(22), 4, "hx")
        create_sessions(store, extra)
        counts = []
        for p in extra:
            counter.take()
            driver.script(p)()
            counts.append(counter.take())
        last = counts[-1]
        figures = _turn_figures(
            "host_turn", target, 0.4, raw_t, ours_t, {"last_turn_" + k: v for k, v in last.items()}
        )
        figures.append(_two_transactions(ctx, target, raw))
        return figures
    finally:
        store.close()
        raw.close()


def _two_transactions(ctx: Context, target: Target, raw: RawStore) -> Figure:
    """The floor of the design's durability: raw writing a turn's rows in the two transactions a durable
    turn needs (the user row is durable before the model is called; the replies after it), against raw's
    one, on fresh sessions, in alternating blocks."""
    plans = plan_turns(ctx.workload(23), 16 * ctx.counts.host_turns, "h2")  # raw is cheap: more turns, less noise
    halves = plans[0::2], plans[1::2]
    one: list[Callable[[], object]] = [raw_op(raw, p) for p in halves[0]]

    def two(p: Plan) -> Callable[[], object]:
        def run() -> None:
            raw.insert_turn(p.session_id, p.first_seq, p.turn.messages[:1])
            raw.insert_turn(p.session_id, p.first_seq + 1, p.turn.messages[1:])

        return run

    one_t, two_t = _compare(ctx, "host_turn floor", target, one, [two(p) for p in halves[1]])
    return Figure(
        "host_turn",
        target.name,
        "floor: raw in two transactions (user row, then the replies): turns/s",
        "turns/s",
        two_t.stats().per_second,
        one_t.stats().per_second,
    )
