"""Quarantine: an engine that raised is isolated for the rest of the process, and the store knows."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select

from . import identity
from .core import Core, from_us, now_us
from .errors import InvalidInput
from .schema import quarantine

log = logging.getLogger("transcript_store.quarantine")


@dataclass(frozen=True)
class QuarantineRecord:
    """One engine isolated by one process."""

    engine_id: str
    process: str
    operation: str
    reason: str
    created_at: datetime
    #: the process runs on this machine now
    alive: bool
    #: the host name the record's process ran on (None: an identity that cannot be read)
    host: str | None = None
    #: written on another host, or under this host name in another pid namespace or boot: whether its
    #: process lives cannot be checked here (``alive`` is False for that reason alone, not because it is
    #: known dead)
    elsewhere: bool = False


#: the longest operation name a quarantine record holds (its column)
MAX_OPERATION_CHARS = 64
#: how long a record of a process that is not alive here is kept and shown (``[turn]
#: quarantine_record_seconds``): a week; a live process writes its records again well before that
RECORD_SECONDS = 7 * 24 * 3600.0
#: the bounds of that setting: an hour (a gateway run reads its dead workers' records at its end) to a year
MIN_RECORD_SECONDS = 3600.0
MAX_RECORD_SECONDS = 366 * 24 * 3600.0


def _check_age(max_age_seconds: float) -> int:
    """The cutoff in microseconds of records older than ``max_age_seconds``; InvalidInput out of bounds."""
    if not MIN_RECORD_SECONDS <= max_age_seconds <= MAX_RECORD_SECONDS:  # NaN too
        raise InvalidInput(
            f"max_age_seconds must be {MIN_RECORD_SECONDS:g} to {MAX_RECORD_SECONDS:g}, got {max_age_seconds!r}"
        )
    return now_us() - int(max_age_seconds * 1_000_000)


def record(core: Core, engine_id: str, operation: str, reason: str, *,
           max_age_seconds: float = RECORD_SECONDS) -> None:
    """Write (or refresh) this process's quarantine record of an engine, pruning expired records."""
    cutoff = _check_age(max_age_seconds)
    process = str(identity.current())
    _prune(core, cutoff)
    core.conn.execute(delete(quarantine).where(quarantine.c.engine_id == engine_id, quarantine.c.process == process))
    core.conn.execute(
        quarantine.insert().values(
            engine_id=engine_id, process=process, operation=operation, reason=reason[:4000], created_us=now_us()
        )
    )


def prune(core: Core, *, max_age_seconds: float = RECORD_SECONDS) -> int:
    """Delete the records older than ``max_age_seconds`` of processes not alive here; how many."""
    return _prune(core, _check_age(max_age_seconds))


def _prune(core: Core, cutoff: int) -> int:
    """Delete the records written before ``cutoff`` (µs) whose process is not alive on this machine.

    Quarantines are rare, so each record written prunes the old ones (as a session's delete prunes the
    tombstones): the table holds a week of dead processes' records, not every one ever written. A
    record of a live process here is kept at any age (its quarantine still holds); one of another
    host cannot be checked, and is kept while its process writes it again (``HostRuntime`` does,
    after a turn, once half the age has passed)."""
    old = core.conn.execute(
        select(quarantine.c.engine_id, quarantine.c.process).where(quarantine.c.created_us < cutoff)
    ).all()
    gone = 0
    for engine_id, process in old:
        who = identity.ProcessIdentity.parse(process)
        if who is not None and who.is_alive_here():
            continue
        gone += core.conn.execute(
            delete(quarantine).where(
                quarantine.c.engine_id == engine_id, quarantine.c.process == process,
                quarantine.c.created_us < cutoff,
            )
        ).rowcount
    return gone


def records(core: Core, *, live_only: bool = True, max_age_seconds: float = RECORD_SECONDS) -> list[QuarantineRecord]:
    """Quarantine records; by default those of processes alive on this machine, and those of other hosts
    (or pid namespaces) written within ``max_age_seconds`` (their processes cannot be checked from here)."""
    cutoff = _check_age(max_age_seconds)
    here, key = socket.gethostname(), identity.machine_key()
    out = []
    for row in core.conn.execute(select(quarantine).order_by(quarantine.c.created_us)):
        who = identity.ProcessIdentity.parse(row.process)
        alive = who is not None and who.is_alive_here()
        # Another host, or this host name's other pid namespace (a container given the same name) or an
        # earlier boot: its pids are not this machine's to check, so neither live nor dead here. So is a
        # keyed record read by a process without a key (no /proc): ``is_alive_here`` cannot check it.
        elsewhere = who is not None and (who.host != here or (who.machine is not None and who.machine != key))
        if alive or not live_only or (elsewhere and row.created_us >= cutoff):
            out.append(
                QuarantineRecord(
                    row.engine_id, row.process, row.operation, row.reason, from_us(row.created_us), alive,
                    who.host if who is not None else None, elsewhere,
                )
            )
    return out
