"""Injectable fault points for crash and fault tests (inert unless TRANSCRIPT_STORE_FAULTS is set).

``TRANSCRIPT_STORE_FAULTS="commit.after_receipt=0.05,admit.after_entry=0.02"`` makes each named point
kill its own process with SIGKILL with that probability; ``*=p`` applies to every point. The seed
comes from TRANSCRIPT_STORE_FAULT_SEED (else the pid). Production code pays one dict lookup per point.
"""

from __future__ import annotations

import os
import random
import signal

POINTS = (
    "admit.before",
    "admit.after_entry",
    "admit.after_commit",
    "complete.after_replies",
    "complete.after_accept",
    "commit.after_receipt",
    "commit.after_apply",
    "complete.after_commit",
    "drain.after_claim",
    "drain.after_commit",
)

_rates: dict[str, float] | None = None
_rng: random.Random | None = None
_armed: set[str] = set()


def _load() -> dict[str, float]:
    global _rates, _rng
    spec = os.environ.get("TRANSCRIPT_STORE_FAULTS", "")
    rates: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rate = part.partition("=")
        rates[name.strip()] = float(rate or "1")
    _rates = rates
    _rng = random.Random(int(os.environ.get("TRANSCRIPT_STORE_FAULT_SEED", os.getpid())))
    return rates


def point(name: str) -> None:
    """Maybe SIGKILL this process here (only when fault injection is configured or the point is armed)."""
    if name in _armed:
        os.kill(os.getpid(), signal.SIGKILL)
    rates = _rates if _rates is not None else _load()
    if not rates:
        return
    rate = rates.get(name, rates.get("*", 0.0))
    if rate > 0 and _rng is not None and _rng.random() < rate:
        os.kill(os.getpid(), signal.SIGKILL)


def arm(name: str) -> None:
    """Make the next pass through ``name`` kill this process (a one-shot, for drivers like the gateway)."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}")
    _armed.add(name)


def disarm() -> None:
    """Forget every armed point."""
    _armed.clear()


def reset() -> None:
    """Re-read the environment (tests that change it in-process) and disarm every point."""
    global _rates
    _rates = None
    _armed.clear()
