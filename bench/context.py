"""What every benchmark receives: the lab, the options, the counts, and shared long transcripts."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from .drivers import SCOPE, bulk_append
from .targets import Database, Lab, Target
from .workload import Workload


@dataclass(frozen=True)
class Counts:
    """How much each benchmark does (``--quick``: a smoke test under a minute)."""

    commit_turns: int
    host_turns: int
    blocks: int
    lengths: tuple[int, ...]
    reads: int
    range_turns: int
    disk_messages: int
    worker_seconds: float
    worker_blocks: int

    @classmethod
    def full(cls) -> Counts:
        """The real run: a few minutes on two cores."""
        return cls(600, 240, 3, (100, 10_000, 100_000), 1000, 12, 10_000, 6.0, 2)

    @classmethod
    def quick(cls) -> Counts:
        """A smoke test."""
        return cls(40, 16, 2, (100, 1_000, 4_000), 100, 4, 1_000, 1.5, 1)


@dataclass
class Context:
    """One run of the benchmarks."""

    lab: Lab
    counts: Counts
    seed: int
    quick: bool
    _long: dict[str, Database] = field(default_factory=dict)

    def workload(self, salt: int) -> Workload:
        """A seeded workload (the same salt gives the same turns in every run)."""
        return Workload(self.seed * 1000 + salt)

    def long_transcripts(self, target: Target) -> Database:
        """A database holding one session per length, in ours and in the raw table (built once per run).

        Ours is loaded through the public ``append_many`` in batches of 2,000 messages; the raw table by
        ``executemany`` (SQLite) or ``COPY`` (PostgreSQL). Loading is setup: never timed. PostgreSQL is
        ANALYZEd during and after the load (see ``Database.analyze``).
        """
        if target.name not in self._long:
            db = self.lab.database(target, "long")
            store, raw = db.store(), db.raw()
            try:
                for length in self.counts.lengths:
                    messages = self.workload(length).messages(length)
                    sid = session_for(length)
                    store.create_session(SCOPE, session_id=sid, session_key=f"agent:bench:{sid}")
                    started = time.perf_counter()
                    bulk_append(store, sid, messages, every_4_batches=db.analyze)
                    took = time.perf_counter() - started
                    raw.bulk_load(sid, messages)
                    db.analyze()
                    log(f"  loaded {length:,} messages into {target.label} in {took:.1f}s ({length / took:,.0f}/s)")
            finally:
                store.close()
                raw.close()
            self._long[target.name] = db
        return self._long[target.name]


def session_for(length: int) -> str:
    """The session of the long transcript of ``length`` messages."""
    return f"long-{length}"


def log(text: str) -> None:
    """Progress goes to stderr; stdout holds the table."""
    print(text, file=sys.stderr, flush=True)
