"""Keeping a running turn's worker lease alive while its model and tools run (a heartbeat).

A session runs one turn at a time, and a turn whose worker lease ran out is taken for abandoned and
discarded by the session's next admission (``outbox.claim_session``). A live worker must therefore
renew its lease for as long as the turn runs, including during a single model call longer than the
lease (a slow provider, a reasoning model): otherwise a second message to the session would discard
the running turn, and the turn's replies would be refused when it completes.

One daemon thread per keeper renews every turn it holds once a third of its lease has passed since
the lease was last set, so a lease is never older than half its length while its worker lives; a
worker that dies stops renewing with it, and a turn held longer than its ``max_seconds`` (a tool that
never returns) stops being renewed, so the session is not held forever by a live but stuck process.
A renewal that fails because a retry of the turn took it over keeps the hold (renewed again a third
of a lease later): a retry that fails hands the turn back to the attempt it took it from (``Turns.
hand_back``), whose lease must then be kept alive again. Meanwhile that attempt's lease is renewed where
the intent keeps the leases of every live attempt retries took the turn from (``displaced_leases``), so
the turn is not abandoned should the retries die; once the lease of the attempt holding it is abandoned,
the most recent live of those attempts takes the turn back at its renewal (``outbox.renewal``). A hold
is dropped when its turn is gone (discarded or completed), at ``release``, and past its
``max_seconds``. A turn whose row another transaction holds locked (PostgreSQL) is skipped, not waited
for, and tried again at the next look.

A drain's claim of a ready row is held the same way while the row is delivered (``claim=True``), on
PostgreSQL: an engine's commit longer than ``delivery_lease_seconds`` (a summarizing engine calling
its model) was taken over by another drain, which ran the engine's commit again while the first one's
rolled back. On SQLite a delivery holds the database's write lock, so no other drain claims meanwhile.

Holding and releasing a turn is a dict operation under a lock: a turn shorter than a third of its
lease (almost all of them) writes nothing and starts no thread of its own. The thread starts on the
first hold and ends after half a minute with nothing to hold, or at ``close``; in a child after
``fork()`` the keeper starts afresh (the parent's thread is not there, its lock may have been held).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from sqlalchemy import bindparam, select

from . import outbox
from .core import Core, by_session, session_params
from .errors import InvalidInput
from .schema import outbox as outbox_table
from .store import TranscriptStore

log = logging.getLogger(__name__)

#: the longest the thread sleeps between looks at its turns, whatever their leases (seconds)
MAX_TICK = 30.0

# The turn's outbox row, locked unless another transaction holds it (PostgreSQL): see ``_renewal``.
_LOCK_IF_FREE = (
    select(outbox_table.c.turn_id)
    .where(by_session(outbox_table), outbox_table.c.turn_id == bindparam("b_turn"))
    .with_for_update(skip_locked=True)
)


@dataclass
class _Held:
    lease: float  # seconds
    owner: str  # the lease owner the admission wrote (renewal matches it)
    set_at: float  # time.monotonic() when the lease was last set
    until: float  # time.monotonic() after which it is not renewed any more
    thread: int  # the thread that holds it (its attempt's): ``release`` without an owner releases its own
    taken: bool = False  # its last renewal found the turn taken over by another attempt (warned once)
    claim: bool = False  # a drain's claim of a ready row (``outbox.renew_claim``), not a running turn


class LeaseKeeper:
    """Renews the worker leases of the turns a host is running, from one background thread."""

    def __init__(self, store: TranscriptStore) -> None:
        self.store = store
        #: renewals written since this keeper was made (observability; tests read it)
        self.renewals = 0
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        # (scope, session_id, turn_id, owner): two attempts of a turn (a retry that took it over, the one
        # it took it from) each hold their own; only the one owning the lease now renews it.
        self._held: dict[tuple[str, str, str, str], _Held] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick = MAX_TICK  # how long the thread sleeps now

    def _own(self) -> None:
        if os.getpid() != self._pid:  # a child after fork(): nothing of the parent's keeper is ours
            self._start()

    def hold(
        self, scope: str, session_id: str, turn_id: str, lease_seconds: float, owner: str,
        max_seconds: float | None = None, *, claim: bool = False,
    ) -> None:
        """Keep renewing this turn's lease (just set by its admission, to ``owner``) until ``release``,
        for at most ``max_seconds`` from now (None: as long as it is held).

        One hold per turn and owner: an earlier attempt whose lease a retry took over keeps its own
        hold (its renewals fail, harmlessly, until the retry hands the turn back or it is released).
        ``claim``: the lease is a drain's claim of the turn's ready row, renewed while it is delivered."""
        if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, int | float):
            raise InvalidInput(f"lease_seconds must be a number of seconds, got {lease_seconds!r}")
        # 0 up to a year, as OutboxConfig takes a lease: a negative or NaN one was taken without a word and
        # never renewed (the turn then lost to the session's next admission while its worker ran on).
        if not 0 <= lease_seconds <= outbox.MAX_LEASE_SECONDS:  # (a longer one could not be stored)
            raise InvalidInput(
                f"lease_seconds must be a number of seconds in 0..{outbox.MAX_LEASE_SECONDS:g}, got {lease_seconds!r}"
            )
        if not isinstance(owner, str) or not owner:
            # The renewal matches the row's owner: None or another type never matched, and the hold was
            # dropped at its first renewal as if the turn were gone.
            raise InvalidInput(f"owner must be the lease owner the admission wrote (a string), got {owner!r}")
        if max_seconds is not None and (
            isinstance(max_seconds, bool) or not isinstance(max_seconds, int | float) or not max_seconds >= 0
        ):
            raise InvalidInput(f"max_seconds must be None or a number of seconds >= 0, got {max_seconds!r}")
        if lease_seconds == 0:  # a zero lease: nothing to keep
            return
        now = time.monotonic()
        until = now + max_seconds if max_seconds is not None else float("inf")
        held = _Held(float(lease_seconds), owner, now, until, threading.get_ident(), claim=claim)
        self._own()
        with self._lock:
            self._held[(scope, session_id, turn_id, owner)] = held
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="transcript-store-leases", daemon=True)
                self._thread.start()
            elif held.lease / 6 < self._tick:
                self._wake.set()  # a shorter lease than the thread sleeps for: look again sooner

    def release(self, scope: str, session_id: str, turn_id: str, owner: str | None = None) -> None:
        """Stop renewing this turn's lease (the turn is completing, or its attempt ended): the renewal
        ``owner`` holds, or without one, the one the calling thread holds (its attempt's).

        Never another attempt's: a retry of the turn (another thread) may have taken its lease over
        meanwhile, and is running on; releasing its renewal would let its lease run out while it runs.
        """
        self._own()
        me = threading.get_ident()
        with self._lock:
            for key in [k for k, h in self._held.items() if k[:3] == (scope, session_id, turn_id)]:
                if key[3] == owner if owner is not None else self._held[key].thread == me:
                    del self._held[key]

    def holds(self, scope: str, session_id: str, turn_id: str) -> bool:
        """Whether this keeper is renewing the turn's lease (for any of its attempts)."""
        self._own()
        with self._lock:
            return any(k[:3] == (scope, session_id, turn_id) for k in self._held)

    def close(self) -> None:
        """Stop renewing every turn and end the thread (a later ``hold`` starts a new one)."""
        self._own()
        with self._lock:
            self._held.clear()
            thread, self._thread = self._thread, None
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def _run(self) -> None:
        me = threading.current_thread()
        idle_since: float | None = None
        while True:
            self._wake.clear()  # before looking: a hold from here on wakes the wait below at once
            with self._lock:
                if self._thread is not me:
                    return  # closed (or replaced): a later hold starts another thread
                if self.store.closed:
                    # Its store was closed with turns still held (their worker gave up, a test ended):
                    # renewing would open connections again, to a database that may be gone by now.
                    self._held.clear()
                    self._thread = None
                    return
                now = time.monotonic()
                for key in [k for k, h in self._held.items() if now >= h.until]:
                    del self._held[key]
                    log.warning("turn %s: held past its time limit; its lease is no longer renewed", key[2])
                due = [(k, h) for k, h in self._held.items() if now - h.set_at >= h.lease / 3]
                leases = [h.lease for h in self._held.values()]
                if leases:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since > MAX_TICK:
                    self._thread = None  # the next hold starts a new one
                    return
                # Looking every sixth of the shortest lease renews each at most half a lease after it was set.
                self._tick = min([lease / 6 for lease in leases] + [MAX_TICK])
            for key, held in due:
                self._renew(key, held)
            self._wake.wait(self._tick)

    @staticmethod
    def _renewal(c: Core, key: tuple[str, str, str, str], held: _Held) -> outbox.RenewalOutcome | None:
        """Renew the lease in this transaction; None: its row is locked by another transaction (skipped).

        One thread renews every held lease, one after another: a renewal waiting on a row lock (the
        turn's completion, an admission looking at it, a worker stuck mid-transaction) would leave every
        other lease unrenewed for as long, and a live turn's lease would run out. So on PostgreSQL the
        row is locked first with SKIP LOCKED, which never waits; a row that is there but locked is left
        for the next look (a sixth of a lease later), never taken for a lost lease. On SQLite there are
        no row locks: a write waits on the database's one write lock, which every renewal needs alike.
        """
        scope, session_id, turn_id, owner = key
        params = session_params(scope, session_id, b_turn=turn_id)
        if (
            not c.dialect.is_sqlite
            and c.run(_LOCK_IF_FREE, params).first() is None
            and outbox.get_row(c, scope, session_id, turn_id) is not None
        ):
            return None
        renew = outbox.renew_claim if held.claim else outbox.renewal
        return renew(c, scope, session_id, turn_id, owner, held.lease)

    def _renew(self, key: tuple[str, str, str, str], held: _Held) -> None:
        turn_id = key[2]
        started = time.monotonic()
        try:
            outcome = self.store.write(lambda c: self._renewal(c, key, held))
        except Exception as e:  # the store is unreachable for now: try again at the next look
            log.warning("turn %s: could not renew its lease (%s: %s); retrying", turn_id, type(e).__name__, e)
            return
        with self._lock:
            if self._held.get(key) is not held:
                return  # released meanwhile (the turn is completing: its intent may be gone already)
            if outcome is None:
                return  # its row is locked: still due, so tried again at the next look
            held.set_at = started  # renewed, or tried: the next try a third of a lease later
            if outcome == "renewed":
                if held.taken:
                    held.taken = False
                    log.warning("turn %s: handed back to this attempt; its lease is renewed again", turn_id)
                self.renewals += 1
                return
            if outcome == "taken over":
                # Kept: a retry of the turn holds it now, and gives it back should it fail.
                if not held.taken:
                    held.taken = True
                    log.warning("turn %s: its lease was taken over by a retry of the turn; renewed again "
                                "should the retry hand it back", turn_id)
                return
            # Warned before the turn is dropped, under the lock: whoever sees it no longer held (holds())
            # can already find the warning (a test polling holds() read the log before it was written).
            log.warning("turn %s: its lease could not be renewed (the turn was discarded or completed by "
                        "another attempt meanwhile)", turn_id)
            del self._held[key]
