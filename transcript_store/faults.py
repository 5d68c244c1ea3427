"""Injectable fault points for crash and fault tests (inert unless TRANSCRIPT_STORE_FAULTS is set).

``TRANSCRIPT_STORE_FAULTS="commit.after_receipt=0.05,admit.after_entry=0.02"`` makes each named point
kill its own process with SIGKILL with that probability (a name alone: 1); ``*=p`` applies to every point.
The seed comes from TRANSCRIPT_STORE_FAULT_SEED (else the pid). Production code pays one dict lookup per point.

A malformed value is InvalidInput naming the variable and the value (``check_env``, which the settings'
checks run before a command does any work; else at the first point passed). It was a ValueError out of
the first fault point, inside a turn, or taken as something else: a probability that is not a decimal
number from 0 to 1 (``nan`` never fired, ``2`` always did), a name that is not dotted identifiers
(``admit.before=0,5`` named a point ``5``, at 1), a seed that is not an integer as written (``INTEGER_RULE``).
A point's name is not checked against ``POINTS``: engines pass their own (``lossless.compact.mid_write``),
and a plugin may too; a name no code passes is inert.
"""

from __future__ import annotations

import math
import os
import random
import re
import signal

from .config import INTEGER_RULE, INTEGER_TEXT
from .errors import InvalidInput

FAULTS_VAR = "TRANSCRIPT_STORE_FAULTS"
SEED_VAR = "TRANSCRIPT_STORE_FAULT_SEED"
#: a point's name: dotted identifiers (``admit.after_entry``), or ``*`` for every point
_NAME = re.compile(r"\*|[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
#: a probability as written: ASCII digits with an optional fraction and exponent (``float`` also took
#: ``nan``, ``inf``, ``1_0`` and other scripts' digits)
_PROBABILITY = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")

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


def parse_rates(spec: str) -> dict[str, float]:
    """The probability of each point a TRANSCRIPT_STORE_FAULTS value names; InvalidInput when it is malformed."""
    rates: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, raw = (x.strip() for x in part.partition("="))
        if not _NAME.fullmatch(name):
            raise InvalidInput(f"invalid {FAULTS_VAR}={spec!r}: {part!r} names no fault point (name=probability, "
                               "a name being dotted identifiers, or * for every point)")
        if name in rates:  # which of the two was meant cannot be told: the last one silently won
            raise InvalidInput(f"invalid {FAULTS_VAR}={spec!r}: {name!r} is named twice")
        rate = float(raw) if _PROBABILITY.fullmatch(raw) else math.nan
        if not eq:
            rate = 1.0
        elif not 0.0 <= rate <= 1.0:  # nan (not a number as written) compares false
            raise InvalidInput(f"invalid {FAULTS_VAR}={spec!r}: the probability of {name!r} is {raw!r}; it must "
                               "be a decimal number from 0 to 1")
        rates[name] = rate
    return rates


def parse_seed(raw: str | None) -> int | None:
    """The seed a TRANSCRIPT_STORE_FAULT_SEED value gives (None: unset or empty); InvalidInput when malformed."""
    if raw is None or raw == "":
        return None
    if not INTEGER_TEXT.fullmatch(raw):
        raise InvalidInput(f"invalid {SEED_VAR}={raw!r}: {INTEGER_RULE}")
    return int(raw)


def check_env() -> None:
    """Refuse a malformed TRANSCRIPT_STORE_FAULTS or TRANSCRIPT_STORE_FAULT_SEED (InvalidInput) before any work."""
    parse_rates(os.environ.get(FAULTS_VAR, ""))
    parse_seed(os.environ.get(SEED_VAR))


def _load() -> dict[str, float]:
    global _rates, _rng
    rates = parse_rates(os.environ.get(FAULTS_VAR, ""))
    seed = parse_seed(os.environ.get(SEED_VAR))
    _rng = random.Random(os.getpid() if seed is None else seed)
    _rates = rates
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
