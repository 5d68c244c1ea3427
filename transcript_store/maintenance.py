"""Deferred engine maintenance: ``maintain`` of engines that declare ``turn_maintenance_mode="background"``.

OpenClaw runs such an engine's ``maintain`` after a turn as deferred work, not holding up the response
(the turn has committed and its reply is out). The host runtime hands it to one daemon thread per
runtime: a session whose maintenance is already waiting is not queued twice (the pass reads the
session as it is when it runs, so one pass covers every turn before it), passes run one at a time in
the order they were first asked for, and a failing pass is the engine's failure like any other (the
runner hands it to the host, which quarantines the engine between turns) and never reaches a turn.

The thread starts with the first pass asked for and ends after half a minute with nothing to do, or at
``close``, which lets what is waiting finish first (bounded by its timeout). In a child after
``fork()`` the queue starts afresh: the parent's thread is not there, and its lock may have been held.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: how long the thread waits with nothing to do before it ends (a later pass starts another)
IDLE_SECONDS = 30.0

#: (engine id, scope, session id)
Key = tuple[str, str, str]
#: runs one pass: the key and the parameters its latest request carried
Runner = Callable[[Key, dict[str, Any]], None]


class BackgroundMaintenance:
    """A coalescing queue of maintenance passes and the one thread that runs them."""

    def __init__(self, run: Runner) -> None:
        self._run_one = run
        #: passes run since this queue was made (observability; tests read it)
        self.runs = 0
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._waiting: OrderedDict[Key, dict[str, Any]] = OrderedDict()
        self._busy = False
        self._running: Key | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def _own(self) -> None:
        if os.getpid() != self._pid:  # a child after fork(): nothing of the parent's queue is ours
            closed = self._closed
            self._start()
            self._closed = closed  # but a queue closed before the fork stays closed

    def schedule(self, key: Key, params: dict[str, Any]) -> None:
        """Ask for a pass of ``key`` with ``params`` (a pass already waiting takes the newer parameters)."""
        self._own()
        with self._cond:
            if self._closed:
                return
            self._waiting[key] = params
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="transcript-store-maintain", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> int:
        """Passes waiting or running now."""
        self._own()
        with self._cond:
            return len(self._waiting) + int(self._busy)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no pass is waiting or running; False when ``timeout`` ran out first."""
        self._own()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._waiting or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float = 10.0) -> str | None:
        """Let the waiting passes finish (at most ``timeout`` seconds), then end the thread; later
        requests are dropped. The engine id of a pass still running then (None: none is): its engine
        must not be disposed under it."""
        self._own()
        finished = self.wait(timeout)
        with self._cond:
            self._closed = True
            dropped = len(self._waiting)
            self._waiting.clear()
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if not finished:
            log.warning("background maintenance still running at close; %d waiting pass(es) dropped", dropped)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)
        with self._cond:
            return self._running[0] if self._running is not None and self._busy else None

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                idle_until = time.monotonic() + IDLE_SECONDS
                while not self._waiting:
                    left = idle_until - time.monotonic()
                    if self._closed or self._thread is not me or left <= 0:
                        if self._thread is me:
                            self._thread = None  # the next request starts a new one
                        return
                    self._cond.wait(left)
                key, params = self._waiting.popitem(last=False)
                self._busy = True
                self._running = key
            try:
                self._run_one(key, params)
            except Exception as e:  # the runner reports engine failures; this is the last line only
                log.warning("background maintenance of %s/%s by %s failed: %s", key[1], key[2], key[0], e)
            finally:
                with self._cond:
                    self._busy = False
                    self._running = None
                    self.runs += 1
                    self._cond.notify_all()
