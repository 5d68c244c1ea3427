"""Who this process is: pid, start time, a random token and its machine, for leases and quarantine records."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessIdentity:
    """A process identity that a reused pid cannot impersonate."""

    host: str
    pid: int
    start_time: float
    token: str
    #: this machine's boot, pid namespace and host name, hashed (None: not known, e.g. without /proc)
    machine: str | None = None
    #: the process's start in clock ticks after boot (immune to wall-clock steps; None: not known)
    start_ticks: int | None = None

    def __str__(self) -> str:
        tail = self.token if self.machine is None else f"{self.token}.{self.machine}.{self.start_ticks}"
        return f"{self.host}:{self.pid}:{int(self.start_time)}:{tail}"

    @classmethod
    def parse(cls, text: str) -> ProcessIdentity | None:
        """The identity encoded by ``str(identity)``, or None."""
        parts = text.rsplit(":", 3)
        if len(parts) != 4:
            return None
        token, machine, ticks = parts[3], None, None
        if token.count(".") == 2:  # token.machine.start_ticks (identities since the lease checks)
            token, machine, raw_ticks = token.split(".")
            try:
                ticks = int(raw_ticks)
            except ValueError:
                machine = None
        try:
            return cls(parts[0], int(parts[1]), float(parts[2]), token, machine, ticks)
        except ValueError:
            return None

    def is_alive_here(self) -> bool:
        """Whether this identity names a live process on this machine (False when unknown).

        By the process's start in clock ticks after boot where the identity has it (the same evidence as
        ``is_dead_here``): a wall-clock start derived again now moves with the clock, and a clock stepped
        by more than the tolerance (NTP, a virtual machine resumed after a pause) made every live process
        look gone (seen: a test run's quarantine records vanished mid-run). Older identities, without
        ticks, are compared by wall-clock start time.
        """
        if self.host != socket.gethostname():
            return False
        if self.machine is not None and self.start_ticks is not None:
            if self.machine != machine_key():
                return False
            state, ticks = _stat(self.pid)
            return ticks == self.start_ticks and state not in _GONE_STATES
        start = process_start_time(self.pid)
        return start is not None and abs(start - self.start_time) < 2

    def is_dead_here(self) -> bool:
        """Whether this identity names a process of this machine that is gone, on positive evidence only.

        Same boot, pid namespace and host name as this process (else: unknown, False), and then either
        no process has the pid (``kill(pid, 0)``: no such process) or the one that has it started at
        another clock tick (the pid was reused). A process that exists but cannot be signalled or
        inspected is not dead. Neither is a zombie alive: killed or exited, it keeps its pid and start until
        its parent reaps it (a host that forks workers may reap them late), but it runs no more.
        """
        if self.machine is None or self.start_ticks is None or self.machine != machine_key():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # PermissionError: it exists, under another user
            return False
        state, ticks = _stat(self.pid)
        return ticks is not None and (ticks != self.start_ticks or state in _GONE_STATES)


#: /proc states of a process that runs no more: a zombie (not reaped yet), dead
_GONE_STATES = frozenset({"Z", "X", "x"})


def _stat(pid: int) -> tuple[str | None, int | None]:
    """A process's state letter and its start in clock ticks after boot (Linux /proc), or Nones."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ")"
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None, None


def process_start_ticks(pid: int) -> int | None:
    """A live process's start, in clock ticks after boot (Linux /proc), or None."""
    return _stat(pid)[1]


def process_start_time(pid: int) -> float | None:
    """Wall-clock start time of a live process (Linux /proc), or None."""
    ticks = process_start_ticks(pid)
    try:
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    if ticks is None:
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


_machine: tuple[int, str | None] | None = None


def machine_key() -> str | None:
    """This machine's boot, pid namespace and host name, hashed: processes with the same key can see
    each other's pids (Linux /proc; None elsewhere)."""
    global _machine
    if _machine is None or _machine[0] != os.getpid():
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                boot = f.read().strip()
            namespace = os.readlink("/proc/self/ns/pid")
        except OSError:
            key = None
        else:
            seen = f"{socket.gethostname()}|{boot}|{namespace}".encode()
            key = hashlib.blake2b(seen, digest_size=6).hexdigest()
        _machine = (os.getpid(), key)
    return _machine[1]


_current: ProcessIdentity | None = None
#: threads starting a process's first turns at once must agree on one identity (a lease's owner)
_lock = threading.Lock()


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork)


def current() -> ProcessIdentity:
    """This process's identity (a fresh one after fork)."""
    global _current
    found = _current
    pid = os.getpid()
    if found is not None and found.pid == pid:
        return found
    with _lock:
        if _current is None or _current.pid != pid:
            ticks = process_start_ticks(pid)
            machine = machine_key() if ticks is not None else None
            _current = ProcessIdentity(
                socket.gethostname(), pid, process_start_time(pid) or time.time(), secrets.token_hex(4),
                machine, ticks if machine is not None else None,
            )
        return _current
