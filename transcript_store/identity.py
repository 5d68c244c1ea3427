"""Who this process is: pid + start time + a random token, for leases and quarantine records."""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessIdentity:
    """A process identity that a reused pid cannot impersonate."""

    host: str
    pid: int
    start_time: float
    token: str

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}:{int(self.start_time)}:{self.token}"

    @classmethod
    def parse(cls, text: str) -> ProcessIdentity | None:
        """The identity encoded by ``str(identity)``, or None."""
        parts = text.rsplit(":", 3)
        if len(parts) != 4:
            return None
        try:
            return cls(parts[0], int(parts[1]), float(parts[2]), parts[3])
        except ValueError:
            return None

    def is_alive_here(self) -> bool:
        """Whether this identity names a live process on this machine (False when unknown)."""
        if self.host != socket.gethostname():
            return False
        start = process_start_time(self.pid)
        return start is not None and abs(start - self.start_time) < 2

    def is_dead_here(self) -> bool:
        """Whether this identity names a process of this machine that is gone (False when unknown)."""
        return self.host == socket.gethostname() and not self.is_alive_here()


def process_start_time(pid: int) -> float | None:
    """Wall-clock start time of a live process (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    started_after_boot = int(fields[19]) / ticks
    return time.time() - uptime + started_after_boot


_current: ProcessIdentity | None = None


def current() -> ProcessIdentity:
    """This process's identity (a fresh one after fork)."""
    global _current
    if _current is None or _current.pid != os.getpid():
        pid = os.getpid()
        _current = ProcessIdentity(
            socket.gethostname(), pid, process_start_time(pid) or time.time(), secrets.token_hex(4)
        )
    return _current
