"""Clocks and statistics: per-operation latencies from ``perf_counter_ns``, throughput from wall time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Stats:
    """Latencies (seconds) of ``count`` operations that took ``wall`` seconds back to back."""

    count: int
    wall: float
    p50: float
    p95: float
    mean: float

    @property
    def per_second(self) -> float:
        """Operations per second of wall time."""
        return self.count / self.wall if self.wall > 0 else 0.0

    @classmethod
    def of(cls, latencies: list[float], wall: float | None = None) -> Stats:
        """Statistics of some latencies; wall defaults to their sum."""
        ordered = sorted(latencies)
        n = len(ordered)
        return cls(
            count=n,
            wall=sum(ordered) if wall is None else wall,
            p50=statistics.median(ordered),
            p95=ordered[min(n - 1, max(0, round(0.95 * n) - 1))],
            mean=statistics.fmean(ordered),
        )


class Timer:
    """Accumulates latencies of timed blocks."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.wall = 0.0
        self.cpu = 0.0  # this process's CPU seconds over the timed runs (the database server's are not in it)

    @contextmanager
    def time(self) -> Iterator[None]:
        """Time one operation."""
        start = time.perf_counter_ns()
        yield
        elapsed = (time.perf_counter_ns() - start) / 1e9
        self.latencies.append(elapsed)
        self.wall += elapsed

    def run(self, ops: list[Callable[[], object]]) -> None:
        """Run operations back to back, each timed (the garbage collector stays on: it is a real cost)."""
        cpu = time.process_time()
        for op in ops:
            with self.time():
                op()
        self.cpu += time.process_time() - cpu

    def stats(self) -> Stats:
        """Statistics so far."""
        return Stats.of(self.latencies, self.wall)


def alternate(blocks: int, raw: Callable[[int], None], ours: Callable[[int], None]) -> None:
    """Run raw and ours in alternating blocks (raw first, then ours, ``blocks`` times each).

    Disks and caches drift over a run; alternating spreads that drift over both sides instead of
    charging it to whichever ran second.
    """
    for block in range(blocks):
        raw(block)
        ours(block)
