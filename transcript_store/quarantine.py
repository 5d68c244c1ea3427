"""Quarantine: an engine that raised is isolated for the rest of the process, and the store knows."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select

from . import identity
from .core import Core, from_us, now_us
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
    alive: bool


#: the longest operation name a quarantine record holds (its column)
MAX_OPERATION_CHARS = 64


def record(core: Core, engine_id: str, operation: str, reason: str) -> None:
    """Write (or refresh) this process's quarantine record of an engine."""
    process = str(identity.current())
    core.conn.execute(delete(quarantine).where(quarantine.c.engine_id == engine_id, quarantine.c.process == process))
    core.conn.execute(
        quarantine.insert().values(
            engine_id=engine_id, process=process, operation=operation, reason=reason[:4000], created_us=now_us()
        )
    )


def records(core: Core, *, live_only: bool = True) -> list[QuarantineRecord]:
    """Quarantine records; by default only those of processes still alive on this machine."""
    out = []
    for row in core.conn.execute(select(quarantine).order_by(quarantine.c.created_us)):
        who = identity.ProcessIdentity.parse(row.process)
        alive = who is not None and who.is_alive_here()
        if alive or not live_only:
            out.append(
                QuarantineRecord(row.engine_id, row.process, row.operation, row.reason, from_us(row.created_us), alive)
            )
    return out
