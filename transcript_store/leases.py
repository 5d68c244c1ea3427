"""Keeping a running turn's worker lease alive while its model and tools run (a heartbeat).

A session runs one turn at a time, and a turn whose worker lease ran out is taken for abandoned and
discarded by the session's next admission (``outbox.claim_session``). A live worker must therefore
renew its lease for as long as the turn runs, including during a single model call longer than the
lease (a slow provider, a reasoning model): otherwise a second message to the session would discard
the running turn, and the turn's replies would be refused when it completes.

One daemon thread per keeper renews every turn it holds once a third of its lease has passed since
the lease was last set, so a lease is never older than half its length while its worker lives; a
worker that dies stops renewing with it. Holding and releasing a turn is a dict operation under a
lock: a turn shorter than a third of its lease (almost all of them) writes nothing and starts no
thread of its own. The thread starts on the first hold and ends after half a minute with nothing
to hold; a keeper used again after ``fork()`` starts a thread of its own in the child.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from . import identity, outbox
from .store import TranscriptStore

log = logging.getLogger(__name__)

#: the longest the thread sleeps between looks at its turns, whatever their leases (seconds)
MAX_TICK = 30.0


@dataclass
class _Held:
    lease: float  # seconds
    set_at: float  # time.monotonic() when the lease was last set


class LeaseKeeper:
    """Renews the worker leases of the turns a host is running, from one background thread."""

    def __init__(self, store: TranscriptStore) -> None:
        self.store = store
        #: renewals written since this keeper was made (observability; tests read it)
        self.renewals = 0
        self._start()

    def _start(self) -> None:
        # Also in a child after fork(): the parent's thread is not there, and its lock may have been
        # held by that thread at the fork.
        self._pid = os.getpid()
        self._held: dict[tuple[str, str, str], _Held] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick = MAX_TICK  # how long the thread sleeps now

    def hold(self, scope: str, session_id: str, turn_id: str, lease_seconds: float) -> None:
        """Keep renewing this turn's lease (just set by its admission) until ``release``."""
        if not lease_seconds > 0:  # a zero lease: nothing to keep (and NaN is refused by the config)
            return
        if os.getpid() != self._pid:
            self._start()
        held = _Held(float(lease_seconds), time.monotonic())
        with self._lock:
            self._held[(scope, session_id, turn_id)] = held
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="transcript-store-leases", daemon=True)
                self._thread.start()
            elif held.lease / 6 < self._tick:
                self._wake.set()  # a shorter lease than the thread sleeps for: look again sooner

    def release(self, scope: str, session_id: str, turn_id: str) -> None:
        """Stop renewing this turn's lease (the turn is completing, or its attempt ended)."""
        with self._lock:
            self._held.pop((scope, session_id, turn_id), None)

    def holds(self, scope: str, session_id: str, turn_id: str) -> bool:
        """Whether this keeper is renewing the turn's lease."""
        with self._lock:
            return (scope, session_id, turn_id) in self._held

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            self._wake.clear()  # before looking: a hold from here on wakes the wait below at once
            with self._lock:
                due = [(k, h) for k, h in self._held.items() if time.monotonic() - h.set_at >= h.lease / 3]
                leases = [h.lease for h in self._held.values()]
                if leases:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > MAX_TICK:
                    self._thread = None  # the next hold starts a new one
                    return
                # Looking every sixth of the shortest lease renews each at most half a lease after it was set.
                self._tick = min([lease / 6 for lease in leases] + [MAX_TICK])
            for key, held in due:
                self._renew(key, held)
            self._wake.wait(self._tick)

    def _renew(self, key: tuple[str, str, str], held: _Held) -> None:
        scope, session_id, turn_id = key
        owner = str(identity.current())  # the admission's lease owner: this process (Turns.admit)
        started = time.monotonic()
        try:
            renewed = self.store.write(lambda c: outbox.renew_lease(c, scope, session_id, turn_id, owner, held.lease))
        except Exception as e:  # the store is unreachable for now: try again at the next look
            log.warning("turn %s: could not renew its lease (%s: %s); retrying", turn_id, type(e).__name__, e)
            return
        with self._lock:
            if self._held.get(key) is not held:
                return  # released meanwhile (the turn is completing: its intent may be gone already)
            if renewed:
                held.set_at = started
                self.renewals += 1
                return
            del self._held[key]
        log.warning("turn %s: its lease could not be renewed (discarded or taken over meanwhile)", turn_id)
