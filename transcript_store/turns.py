"""Turn commits over a store: the ledger's commit_turn, the outbox's transitions, drain and recovery.

The common case costs two transactions per turn: ``admit`` (user entry + admitted intent, and the
engine's pre-turn reads when it can do them there: ``within``) and ``complete`` (reply entries +
acceptance + closed-range read + the engine's commit_turn + intent deleted), when the engine's ledger
lives in the same database. If that transaction fails (the engine
raised, a conflict), it rolls back whole and ``complete`` falls back to the slow path: reply entries
and acceptance in their own transaction, delivery by ``drain``. An accepted turn is never lost to an
engine failure.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Row

from . import faults, identity, outbox
from .core import BAD_ID_CHAR, Core, NewEntry, check_anchor, check_id, foreign_incarnation, now_us
from .db import UNSENDABLE
from .errors import (
    IdempotencyConflict,
    InvalidInput,
    OutboxCollision,
    PayloadTooLarge,
    StoreUnavailable,
    TranscriptStoreError,
    TurnBranchedAway,
    describe,
)
from .fences import MAX_TURN_BYTES
from .leases import LeaseKeeper
from .ledger import (
    DEFAULT_RECEIPTS_PAGE,
    ApplyTurn,
    CommitResult,
    Receipt,
    ReceiptPage,
    TurnPayload,
    check_page_limit,
    commit_turn_in,
    commit_turn_statement,
    get_receipt,
    list_receipts,
    parse_receipt_cursor,
    prepare_turn,
    receipts_page,
)
from .models import Admission, Anchor, Entry
from .outbox import DrainReport, IntentPage, OutboxConfig, TurnIntent
from .store import AppendItem, TranscriptStore, admit_and_tell, replaced

log = logging.getLogger("transcript_store.turns")

#: Delivers one ready intent to its engine inside the given transaction (fast path) or on its own.
CommitIn = Callable[[Core, TurnPayload], CommitResult]
MAX_DRAIN = outbox.MAX_DRAIN  # where the CLI and callers have imported it from


@dataclass
class RecoveryReport:
    """What the pre-turn recovery of one session found and did."""

    discarded: list[str] = field(default_factory=list)
    drain: DrainReport = field(default_factory=DrainReport)
    #: turns of the session still queued for the engine recovery ran for (what ``must_degrade`` reads)
    pending: list[str] = field(default_factory=list)
    #: every turn of the session still in the outbox, of any engine (admitted, accepted or ready: not blocked)
    queued: list[str] = field(default_factory=list)
    #: admitted turns of the session (any engine) whose worker still runs them: a new turn is refused
    #: (``SessionBusy``) until they end
    running: list[str] = field(default_factory=list)

    @property
    def must_degrade(self) -> bool:
        """True when an earlier turn is still pending: this turn must not reach the engine first."""
        return bool(self.pending)


@dataclass
class CompletionResult:
    """How a turn completed: on the fast path (``commit`` set) or queued for the drain."""

    intent: TurnIntent
    terminal: Anchor
    commit: CommitResult | None
    fast_path_error: str | None = None


#: the stored size of the smallest message a turn can complete with (``{"role":"user","content":""}``)
SMALLEST_REPLY_BYTES = len('{"role":"user","content":""}')


def turn_payload(intent: TurnIntent) -> TurnPayload:
    """The ledger payload of a ready intent (its messages are the closed range it captured)."""
    if intent.state != "ready" or intent.terminal is None or intent.messages is None:
        raise InvalidInput(f"intent {intent.turn_id!r} is {intent.state}, not ready")
    return prepare_turn(
        intent.engine_id, intent.turn_id, intent.admission, intent.terminal, intent.messages,
        is_heartbeat=intent.is_heartbeat, messages_validated=True,
    )


class Turns:
    """The turn-commit API of one store (ledger + outbox)."""

    def __init__(self, store: TranscriptStore, config: OutboxConfig | None = None) -> None:
        """Bind to a store; ``config`` sets leases and the drain limit."""
        # Checked here: anything else bound silently, and every method then raised AttributeError.
        if not isinstance(store, TranscriptStore):
            raise InvalidInput(f"Turns needs a TranscriptStore, not {type(store).__name__}")
        if config is not None and not isinstance(config, OutboxConfig):
            raise InvalidInput(f"config must be an OutboxConfig, not {type(config).__name__}")
        self.store = store
        self.config = config or OutboxConfig()
        self._claims: LeaseKeeper | None = None  # renews drain claims during deliveries (PostgreSQL)

    # ------------------------------------------------------------------------------------ ledger

    def commit_turn(
        self,
        engine_id: str,
        advancement_key: str,
        admission: Admission | Anchor,
        terminal: Anchor,
        messages: Sequence[dict[str, Any]],
        *,
        is_heartbeat: bool = False,
        apply: ApplyTurn | None = None,
    ) -> CommitResult:
        """ONE atomic idempotent write: ``committed``, ``duplicate``, or AdvancementKeyCollision."""
        check_id("engine_id", engine_id, new=True)
        check_id("advancement_key", advancement_key, new=True)
        turn = prepare_turn(engine_id, advancement_key, admission, terminal, messages, is_heartbeat=is_heartbeat)
        _check_callable("apply", apply, optional=True)
        # Both ways below are retried whole on a lost connection. When an attempt's commit landed but
        # its answer was lost, the retry finds the receipt that attempt wrote: that is this call's own
        # commit, not a replay, and it answers ``committed``. The receipt's commit time (microseconds,
        # fresh per attempt) tells it from another caller's commit of the same key.
        mine: list[Receipt] = []

        def own(result: CommitResult | None) -> CommitResult | None:
            if result is None:
                return None
            if result.status == "committed":
                mine.append(result.receipt)  # compared only on a duplicate: nothing more per commit
            elif any(r.model_dump() == result.receipt.model_dump() for r in mine):
                return CommitResult.model_construct(status="committed", receipt=result.receipt)
            return result

        if apply is None:
            # A first commit is usually one statement outside any transaction; whatever it does not commit
            # (a replay, a collision, anything it cannot prove) the transaction below decides.
            done = self.store.statement(lambda c: own(commit_turn_statement(c, turn, mine)))
            if done is not None:
                return done
        result = self.store.write(lambda c: own(commit_turn_in(c, turn, apply)))
        assert result is not None
        return result

    def receipts(self, scope: str, session_id: str, engine_id: str | None = None) -> list[Receipt]:
        """The ledger of a session (``UnknownSession`` for one the scope does not hold)."""
        self.store._ids(scope, session_id)
        check_id("engine_id", engine_id, optional=True)

        def read(c: Core) -> list[Receipt]:
            c.require_session(scope, session_id)  # an empty ledger, not an unknown session's "nothing"
            return list_receipts(c, scope, session_id, engine_id)

        return self.store.read(read)

    def receipts_page(
        self, scope: str, session_id: str, engine_id: str, *, after: str | None = None,
        limit: int = DEFAULT_RECEIPTS_PAGE,
    ) -> ReceiptPage:
        """One engine's ledger of a session a page at a time: at most ``limit`` (1..10000) receipts in
        advancement-key order, after the cursor ``after`` (a page's ``next``; None: from the first receipt)."""
        self.store._ids(scope, session_id)
        check_id("engine_id", engine_id)
        check_page_limit(limit)
        if after is not None:
            parse_receipt_cursor(after)  # refused before the session is looked at

        def read(c: Core) -> ReceiptPage:
            c.require_session(scope, session_id)
            return receipts_page(c, scope, session_id, engine_id, after=after, limit=limit)

        return self.store.read(read)

    # ------------------------------------------------------------------------------------ outbox

    def admit(
        self,
        scope: str,
        session_id: str,
        message: dict[str, Any],
        *,
        turn_id: str,
        engine_id: str,
        is_heartbeat: bool = False,
        owner: str | None = None,
        taken_over: list[outbox.AdmittedLease] | None = None,
    ) -> tuple[Admission, TurnIntent]:
        """Admit the user message and write the admitted intent, in one transaction.

        One turn at a time per session: ``SessionBusy`` while another turn of the session is admitted
        and its worker lives (one whose worker is gone is discarded first); ``TurnOvertaken`` when this
        turn id's stored admission is to run again but a later turn's admission follows it;
        ``OutboxCollision`` when the ledger holds its receipt already (nothing to run again).

        ``owner`` names this attempt in the intent's lease (``new_owner()`` when not given); an admitted
        intent of the same turn id is taken over by it. ``discard(..., owner=)`` then deletes the intent
        only while this attempt still holds it. The lease taken over from a live attempt is put in
        ``taken_over`` (a list, emptied first), for ``hand_back`` should this attempt fail; when the
        attempt holding the turn is gone (a retry that died), the most recent live attempt retries took
        it from, if any. The intent keeps the lease of every such live attempt meanwhile (at most
        ``outbox.MAX_DISPLACED``: one more is ``SessionBusy``), each renewed by its worker: the turn is not
        abandoned while any of them lives (``outbox.AdmittedLease.abandoned``).
        """
        if taken_over is not None and not isinstance(taken_over, list):
            raise InvalidInput("taken_over must be a list (it receives the lease taken over)")
        try:
            result = self._admit(
                scope, session_id, message, turn_id, engine_id, is_heartbeat, only_if_clear=False, owner=owner,
                taken_over=taken_over,
            )
        except BaseException:
            # Refused (SessionBusy, TurnOvertaken, OutboxCollision, ...): the take-over its transaction made
            # rolled back with it, and a lease left here would tell the caller of one that never happened.
            if taken_over is not None:
                taken_over.clear()
            raise
        assert result is not None
        return result

    def admit_if_clear(
        self,
        scope: str,
        session_id: str,
        message: dict[str, Any],
        *,
        turn_id: str,
        engine_id: str,
        is_heartbeat: bool = False,
        within: Callable[[Core, Admission], None] | None = None,
        owner: str | None = None,
    ) -> tuple[Admission, TurnIntent] | None:
        """``admit``, in the same one transaction as the check that no recovery is needed first.

        None (nothing written) when the session's outbox holds a non-blocked intent or the turn id is
        already known to the outbox or the ledger: the caller runs ``recover`` and ``admit``. The
        check runs after the append has locked the session, so two admissions racing on PostgreSQL
        cannot both find the session clear. ``TurnOvertaken`` as for ``admit``. This is
        the common case of a turn costing one transaction before the model call, instead of the
        recovery snapshot, the retry lookup and the admission (bench/README.md).

        ``within(core, admission)`` runs last in that transaction, with the session locked: the
        host's pre-turn reads (the engine's assembly reads) see the transcript before the admitted
        entry without a snapshot of their own (a fence this transaction appended needs no check; one
        it found already stored, a retried turn id, is checked like any other). It may run more than
        once (the transaction is retried whole on a transient error): only its last run belongs to
        the transaction that returns. An error it raises rolls the admission back.
        """
        _check_callable("within", within, optional=True)
        return self._admit(
            scope, session_id, message, turn_id, engine_id, is_heartbeat, only_if_clear=True, within=within,
            owner=owner,
        )

    def _admit(
        self,
        scope: str,
        session_id: str,
        message: dict[str, Any],
        turn_id: str,
        engine_id: str,
        is_heartbeat: bool,
        *,
        only_if_clear: bool,
        within: Callable[[Core, Admission], None] | None = None,
        owner: str | None = None,
        taken_over: list[outbox.AdmittedLease] | None = None,
    ) -> tuple[Admission, TurnIntent] | None:
        self.store._ids(scope, session_id)
        check_id("engine_id", engine_id, new=True)
        if not isinstance(is_heartbeat, bool):
            raise InvalidInput("is_heartbeat must be a bool")
        owner = new_owner() if owner is None else _check_owner(owner)
        item = self.store.prepare_admission(message, turn_id=turn_id)
        if item.size_bytes + SMALLEST_REPLY_BYTES > MAX_TURN_BYTES:
            # Under a max_payload_bytes above the turn's cap, such an admission was taken and its turn
            # could never complete (every reply: PayloadTooLarge), holding the session busy meanwhile.
            # Not only at the cap itself: a user message a few bytes under it leaves no room for the
            # smallest reply either.
            raise PayloadTooLarge(
                f"turn {turn_id!r}: its user message is {item.size_bytes} bytes, which leaves no room for a "
                f"reply under the turn's cap of {MAX_TURN_BYTES}"
            )
        landed: list[tuple[Admission, TurnIntent]] = []
        took: list[outbox.AdmittedLease] = []  # the lease the attempt that ran to its end took over

        def run(c: Core) -> tuple[Admission, TurnIntent] | None:
            if landed and replaced(c, scope, session_id, landed[0][0].anchor.incarnation):
                # An earlier attempt ran to its end and only its COMMIT was uncertain; the session was
                # deleted since, perhaps made again under the id: the turn is never admitted into that one
                # (its completion finds the intent gone with the session it was admitted in).
                return landed[0]
            faults.point("admit.before")
            # The session is locked by the append: the checks below cannot race another admission.
            admission, followed, stored = admit_and_tell(c, scope, session_id, item)
            if only_if_clear and not outbox.turn_is_clear(c, scope, session_id, turn_id):
                raise _NotClear
            faults.point("admit.after_entry")
            if not only_if_clear:  # (clear: the outbox holds no other running turn)
                outbox.claim_session(c, scope, session_id, turn_id)
            intent = outbox.record_admitted(
                c, admission, engine_id, lease_seconds=self.config.turn_lease_seconds,
                is_heartbeat=is_heartbeat, owner=owner, taken_over=taken_over, took_before=took,
            )
            if stored and intent.state == "admitted":
                # A stored admission that is to run (again): was it overtaken by a later turn, or
                # delivered already (its terminal may be the admission itself: nothing follows it)?
                # An accepted one is answered as it is: its range was closed before the later turn.
                if followed:
                    outbox.check_not_overtaken(c, admission)
                outbox.check_not_committed(c, admission)
            if within is not None:
                within(c, admission)
            landed[:] = [(admission, intent)]
            took[:] = taken_over or ()
            return admission, intent

        try:
            result = self.store.write(run)
        except _NotClear:  # the append rolled back with the transaction: nothing was written
            return None
        faults.point("admit.after_commit")
        return result

    def discard(self, scope: str, session_id: str, turn_id: str, *, owner: str | None = None) -> bool:
        """A failed, aborted or errored attempt: delete its admitted intent (nothing else).

        With ``owner`` (the attempt's, as admitted), only while that attempt still holds the intent's
        lease: a retry that took the turn over since (another worker, another thread) keeps running, and
        this attempt leaves the intent's list of attempts retries took it from (the turn is never handed
        back to an attempt that is over). Nor while an attempt this one took the turn from still lives:
        the turn goes to the most recent of those instead, as ``hand_back`` gives it (False).

        Retried after an uncertain COMMIT: an intent of the turn other than the one this discard deleted
        (told by its creation time as read from the row, never against this machine's clock) is another
        admission's (the turn admitted again after this discard landed), never deleted, and the answer is
        True; so is an intent gone before the retry, whether or not this discard had landed (recovery may
        have discarded it: nothing tells which).
        """
        _check_turn(self.store, scope, session_id, turn_id)
        if owner is not None:
            _check_owner(owner)
        # The ``created_us`` of the intent the attempt that ran to its end deleted (empty: it deleted none).
        # A retry tells that intent from another admission's of the turn by this value read back from the
        # row, never by comparing it with this machine's clock: the intent was written by the admitting
        # worker, perhaps on another machine whose clock is seconds off (a retry then deleted a running
        # turn admitted again by a machine behind, or spared the intent of one ahead and called it gone).
        deleted_at: list[int] = []

        def run(c: Core) -> bool:
            row = outbox.get_row(c, scope, session_id, turn_id, lock=True)
            if deleted_at and (row is None or row.created_us != deleted_at[0]):
                # A retry after an uncertain COMMIT: the intent the earlier attempt deleted is gone, so that
                # COMMIT landed, and an intent of the turn found now is another admission's (the turn
                # admitted again since), never touched. (One gone is taken for this discard's, though
                # recovery may have discarded it while this COMMIT did not land: nothing tells which.)
                return True
            # A first run, or the earlier COMMIT did not land (its intent stands): decided afresh. A retry of
            # the turn that took the intent over meanwhile keeps it (nothing of ``owner``'s in it: False).
            deleted_at.clear()
            if row is None:
                return False
            if owner is None:
                deleted = outbox.discard(c, scope, session_id, turn_id)
            else:
                deleted = outbox.discard_owned(
                    c, scope, session_id, turn_id, owner, self.config.turn_lease_seconds
                ) == "discarded"
            if deleted:
                deleted_at.append(int(row.created_us))
            return deleted

        return self.store.write(run)

    def hand_back(self, scope: str, session_id: str, turn_id: str, *, owner: str, lease: outbox.AdmittedLease) -> bool:
        """A failing retry gives the turn it took over (``admit(..., taken_over=)``) back to the attempt
        it took it from, which may still be running, instead of discarding it; only while ``owner``
        still holds it. The intent decides which attempt: the most recent live one of those retries took
        the turn from, which is ``lease``'s unless that attempt ended since (it left the list) or its
        worker is gone (an earlier live one's then). False: not handed back (discarded when none of those
        attempts lives; when ``owner`` no longer holds the turn, it only leaves that list).

        Retried after an uncertain COMMIT, it answers True when it finds the turn no longer ``owner``'s
        or gone, as its hand-back that landed leaves it. A turn gone before the retry is ambiguous: the
        hand-back landed and the attempt it went to ended the turn, or it did not land and the turn was
        ended otherwise meanwhile (recovery discarded it once every lease ran out, its session was
        deleted); the store keeps nothing of a deleted intent to tell which, and the answer is True."""
        _check_turn(self.store, scope, session_id, turn_id)
        _check_owner(owner)
        if not isinstance(lease, outbox.AdmittedLease) or lease.turn_id != turn_id:
            raise InvalidInput("lease must be the AdmittedLease this turn's admission took over")
        # Its fields reach arithmetic and the row as they are: a lease built by hand is checked like one
        # read from the store (an owner as admit takes it, or None; an expiry a BIGINT holds, or None).
        if lease.owner is not None:
            _check_owner(lease.owner)
        expires = lease.expires_us
        if expires is not None and (isinstance(expires, bool) or not isinstance(expires, int)
                                    or not 0 <= expires < 2**63):
            raise InvalidInput(f"lease.expires_us must be None or an integer in 0..2**63-1, got {expires!r}")
        landed: list[bool] = []
        seconds = self.config.turn_lease_seconds

        def run(c: Core) -> bool:
            outcome = outbox.give_up(c, scope, session_id, turn_id, owner, seconds)
            # A retry after an uncertain COMMIT finds nothing of ``owner``'s in the turn ("none"): it was
            # handed back, whatever became of it since (the attempt it went to completed or discarded
            # it, or the session was deleted, perhaps made again under the id). A turn that still names
            # ``owner``, as its holder or in its list of attempts retries took it from, tells the earlier
            # COMMIT did not land (a hand-back takes ``owner`` off both): this attempt's outcome stands
            # then ("discarded", "left": not handed back).
            handed = outcome == "handed" or (outcome == "none" and bool(landed) and landed[0])
            landed[:] = [handed]
            return handed

        return self.store.write(run)

    def block(self, scope: str, session_id: str, turn_id: str, reason: str) -> TurnIntent:
        """Block a queued turn by hand, so that its engine's later turns of the session go on (see
        ``outbox.block``); the turn never reaches that engine. UnknownTurn when there is no such row."""
        _check_turn(self.store, scope, session_id, turn_id)
        if not isinstance(reason, str) or not reason.strip():
            raise InvalidInput("a reason is required to block a turn by hand")
        reason = " ".join(reason.split())
        if len(reason) > outbox.MAX_BLOCK_REASON:
            raise InvalidInput(f"the reason must be at most {outbox.MAX_BLOCK_REASON} characters")
        if UNSENDABLE.search(reason) is not None:
            # Said apart from the length: a short reason with a stray byte was told it was too long.
            raise InvalidInput("the reason must not contain NUL or lone surrogates")
        self.store.get_session(scope, session_id)  # UnknownSession first, as every call of a session
        landed: list[TurnIntent] = []

        def run(c: Core) -> TurnIntent:
            if landed and _gone(c, landed[0].admission.anchor):
                # An earlier attempt ran to its end and only its COMMIT was uncertain; the session was
                # deleted since (the retry found no row: UnknownTurn, for a block that landed).
                return landed[0]
            landed[:] = [outbox.block(c, scope, session_id, turn_id, reason)]
            return landed[0]

        return self.store.write(run)

    def accept(self, scope: str, session_id: str, turn_id: str, terminal: Anchor) -> TurnIntent:
        """Record the host's acceptance of the turn (admitted -> accepted) in its own transaction.

        ``UnknownTurn`` when the outbox holds no intent of the turn (``UnknownSession`` when the session is
        not there either); an ``OutboxCollision`` still, which was raised for it before."""
        _check_turn(self.store, scope, session_id, turn_id)
        check_anchor("terminal", terminal)
        landed: list[TurnIntent] = []

        def run(c: Core) -> TurnIntent:
            if landed and (_gone(c, terminal) or _accepted_as(c, landed[0], terminal)):
                # An earlier attempt ran to its end and only its COMMIT was uncertain: a drain delivered
                # the turn since (its receipt names the terminal), or the session was deleted, perhaps made
                # again under the id. The retry found no intent: UnknownTurn, for an acceptance that landed.
                return landed[0]
            landed[:] = [outbox.accept(c, scope, session_id, turn_id, terminal)]
            return landed[0]

        return self.store.write(run)

    def complete(
        self,
        scope: str,
        session_id: str,
        turn_id: str,
        replies: Sequence[AppendItem | dict[str, Any]],
        commit_in: CommitIn | None,
    ) -> CompletionResult:
        """Append the replies and accept the turn; commit it in the same transaction when possible.

        ``UnknownTurn`` (an ``OutboxCollision``, as before) when the outbox holds no intent of the turn:
        nothing is written."""
        _check_turn(self.store, scope, session_id, turn_id)
        _check_callable("commit_in", commit_in, optional=True)
        items = self.store.prepare(replies)
        if not items or items[-1].kind != "message":
            raise InvalidInput("a turn completes with at least one reply message, the terminal last")
        self._check_turn_size(scope, session_id, turn_id, items)
        landed: list[CompletionResult] = []

        def gone(c: Core, landed: list[CompletionResult] = landed) -> bool:
            # Whether an earlier attempt ran to its end and its COMMIT, only uncertain, landed. The session
            # it completed the turn in was deleted since, perhaps made again under the id: the replies never
            # go there (the retry found no intent in it: UnknownTurn, for a completion that had landed).
            # Or the turn's row holds that attempt's terminal, or its receipt does (a drain delivered it
            # since): the retry built the terminal's anchor again in a generation a rewrite rotated since
            # ("already accepted with another terminal"), or found no row (UnknownTurn).
            if not landed:
                return False
            return replaced(c, scope, session_id, landed[0].terminal.incarnation) or _accepted_as(
                c, landed[0].intent, landed[0].terminal
            )

        if commit_in is not None:
            refused: list[TranscriptStoreError] = []  # the acceptance's own refusal, in the attempt that raised

            def fast(c: Core) -> CompletionResult:
                refused.clear()  # the write may be retried whole: only the attempt that raised counts
                if gone(c):
                    return landed[0]
                done = self._complete_fast(c, scope, session_id, turn_id, items, commit_in, refused)
                landed[:] = [done]
                return done

            try:
                return self.store.write(fast)
            except OutboxCollision:
                # An uncertain commit: an attempt ran to its end, its COMMIT was lost with the connection,
                # and the retry finds the intent already delivered. If the ledger holds that attempt's
                # very payload, the turn is done: report it instead of a collision with itself.
                if landed and self._committed(landed[0]):
                    return landed[0]
                raise
            except TurnBranchedAway:
                raise  # the slow path would refuse it the same way
            except Exception as e:  # the engine raised or the commit conflicted: take the slow path
                if refused and e is refused[0]:
                    # Refused by the append and acceptance checks, before the engine was reached (an unknown
                    # session, a reply naming an entry written before the admission): the slow path runs
                    # the very same checks and would refuse it the same way. Nothing was written or queued.
                    log.info("completion of turn %s refused, nothing written or queued: %s", turn_id, describe(e))
                    raise
                return self._complete_slow(scope, session_id, turn_id, items, gone, describe(e))

        def accept(c: Core) -> CompletionResult:
            if gone(c):
                return landed[0]
            intent, terminal = self._accept_with(c, scope, session_id, turn_id, items)
            landed[:] = [CompletionResult(intent, terminal, None)]
            return landed[0]

        return self.store.write(accept)

    def _complete_slow(
        self, scope: str, session_id: str, turn_id: str, items: list[NewEntry],
        gone: Callable[[Core, list[CompletionResult]], bool], error: str,
    ) -> CompletionResult:
        """The fast completion failed (``error``): append the replies and accept the turn in a transaction
        of their own, queued for the drain."""
        queued: list[CompletionResult] = []  # the slow path's own: a fast attempt's never landed

        def slow(c: Core) -> CompletionResult:
            if gone(c, queued):  # as ``accept``: the acceptance landed, only its COMMIT was lost
                return queued[0]
            intent, terminal = self._accept_with(c, scope, session_id, turn_id, items)
            queued[:] = [CompletionResult(intent, terminal, None, fast_path_error=error)]
            return queued[0]

        try:
            done = self.store.write(slow)
        except Exception as e:
            # Said only now: the log said "queueing it" of turns the slow path then refused too.
            log.warning("fast completion of turn %s failed (%s), and queueing it failed too: %s", turn_id, error,
                        describe(e))
            raise
        log.warning("fast completion of turn %s failed, queued for the drain: %s", turn_id, error)
        return done

    def _check_turn_size(self, scope: str, session_id: str, turn_id: str, items: list[NewEntry]) -> None:
        """PayloadTooLarge, before anything is written, for replies that would make the turn's closed
        range larger than MAX_TURN_BYTES: accepted, it would be blocked ``too_large`` at once and never
        reach its engine. Only replies within one entry's cap of the limit read the admitted entry."""
        total = sum(i.size_bytes for i in items)
        if total <= MAX_TURN_BYTES - self.store.config.max_payload_bytes:
            return  # whatever the admitted entry's size (at most one entry's cap), the turn fits

        def admitted_size(c: Core) -> int:
            row = outbox.get_row(c, scope, session_id, turn_id)
            if row is None:
                return 0  # no intent: the completion refuses it (UnknownTurn)
            entry_id = Admission.model_validate_json(row.admission).anchor.entry_id
            found = c.entry_rows(scope, session_id, [entry_id]).get(entry_id)
            return int(found.size_bytes) if found is not None else 0

        size = total + self.store.read(admitted_size)
        if size > MAX_TURN_BYTES:
            raise PayloadTooLarge(
                f"turn {turn_id!r} would be {size} bytes with its replies, over the cap of {MAX_TURN_BYTES}"
            )

    def _committed(self, done: CompletionResult) -> bool:
        """Whether the ledger holds the commit a fast completion reported (same key, same payload)."""
        if done.commit is None:
            return False
        receipt = done.commit.receipt
        stored = self.store.read(
            lambda c: get_receipt(c, receipt.scope, receipt.session_id, receipt.engine_id, receipt.advancement_key)
        )
        return stored is not None and stored.payload_hash == receipt.payload_hash

    @staticmethod
    def _accept_with(
        c: Core, scope: str, session_id: str, turn_id: str, items: list[NewEntry]
    ) -> tuple[TurnIntent, Anchor]:
        intent, terminal, fresh, _, _, _ = Turns._append_and_check(c, scope, session_id, turn_id, items)
        if fresh:
            outbox.persist_accept(c, scope, session_id, turn_id, terminal)
        faults.point("complete.after_accept")
        return intent, terminal

    @staticmethod
    def _append_and_check(
        c: Core, scope: str, session_id: str, turn_id: str, items: list[NewEntry], *, with_head: bool = False
    ) -> tuple[TurnIntent, Anchor, bool, bool, Row[Any], list[Entry]]:
        """Append the replies and check the acceptance: (intent, terminal, whether new, whether an
        earlier intent of its engine is queued, locked session row, the appended entries)."""
        sess, appended = c.append_to_session(scope, session_id, items, with_head=with_head)
        faults.point("complete.after_replies")
        terminal = c.anchor_for(sess, appended[-1])  # the Entry holds its row's anchor fields
        intent, fresh, earlier = outbox.check_accept(c, scope, session_id, turn_id, terminal)
        admitted = intent.admission.anchor
        # Something was written after the admitted entry (events), or the head moved off it (another
        # writer branched the session mid-turn): the replies went where the head is, which descends from
        # the admission only if it is still on the active path. Otherwise the turn would be accepted
        # with an answer on a branch that lacks its question, and blocked at once. (A rewrite moves the
        # generation and keeps the question, rewritten, where it was: the reply belongs there, and the
        # turn is blocked ``stale`` for its engine, as before.)
        if (
            fresh
            and appended[0].parent_id != admitted.entry_id
            and c.branched_away(scope, session_id, admitted.seq, int(sess.generation))
        ):
            raise TurnBranchedAway(session_id, turn_id)
        stale = next((e for e in appended if e.seq <= admitted.seq), None)
        if stale is not None:
            # A reply whose entry id or idempotency key names an entry the turn did not write (an
            # earlier turn's reply under the same key): it is not appended again, so the turn would be
            # accepted without it, or with an earlier entry as its terminal and blocked at the drain.
            raise IdempotencyConflict(
                f"a reply of turn {turn_id!r} names entry {stale.entry_id!r}, written before its admission"
            )
        return intent, terminal, fresh, earlier, sess, appended

    def _complete_fast(
        self, c: Core, scope: str, session_id: str, turn_id: str, items: list[NewEntry], commit_in: CommitIn,
        refused: list[TranscriptStoreError],
    ) -> CompletionResult:
        # The row goes admitted -> deleted inside this one transaction when the commit succeeds, so the
        # intermediate states (accepted, ready) are not written: nobody else could ever see them. If
        # the turn cannot be committed here, they are written before the transaction ends.
        try:
            intent, terminal, fresh, earlier, sess, appended = self._append_and_check(
                c, scope, session_id, turn_id, items, with_head=True
            )
        except TranscriptStoreError as e:
            # The slow path runs these same checks: their typed refusal (not a database outage, which a
            # second transaction may outlive) is certain, and ``complete`` raises it without that path.
            if not isinstance(e, StoreUnavailable):
                refused[:] = [e]
            raise
        faults.point("complete.after_accept")
        if earlier:
            # An earlier turn of this engine is queued: never overtake it. The drain delivers both.
            if fresh:
                outbox.persist_accept(c, scope, session_id, turn_id, terminal)
            return CompletionResult(intent, terminal, None)
        ready, closed = outbox.capture_range(c, intent, persist=False, session=sess, appended=appended)
        if ready.state != "ready" or closed is None:
            if fresh:
                outbox.persist_accept(c, scope, session_id, turn_id, terminal)
            intent = outbox.capture(c, intent)  # blocked (written), or still accepted
            return CompletionResult(intent, terminal, None)
        # This transaction just read the closed range (holding the session lock): an engine committing
        # this very payload through commit_turn_in does not read the same rows again.
        payload = turn_payload(ready)
        c.note_checked(payload, [e.seq for e in closed.entries])
        result = commit_in(c, payload)
        _check_result(result)
        outbox.delete_turn(c, scope, session_id, turn_id)
        faults.point("complete.after_commit")
        return CompletionResult(ready, terminal, result)

    # ------------------------------------------------------------------------------------ drain

    def drain(
        self,
        commit_in: Callable[[str], CommitIn | None],
        *,
        scope: str | None = None,
        session_id: str | None = None,
        limit: int | None = None,
        on_committed: Callable[[TurnIntent, CommitResult], None] | None = None,
    ) -> DrainReport:
        """Deliver ready intents to their engines' commit_turn, in strict per-session order.

        ``commit_in(engine_id)`` gives the engine's in-transaction commit (or None: the engine is not
        available, its rows wait). A failure keeps the row queued and stops its session for this drain.

        ``blocked`` counts the rows this drain blocked. A claim retried after an uncertain COMMIT counts
        the blocks of its earlier attempt that landed (told by the time written with each), never
        another drain's; a row gone before the retry (its session deleted) is not counted, whether or
        not its block had landed (nothing tells which).
        """
        _check_callable("commit_in", commit_in)
        check_id("scope", scope, optional=True)
        check_id("session_id", session_id, optional=True)
        limit = self.config.drain_limit if limit is None else limit
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_DRAIN:
            raise InvalidInput(f"limit must be None or an integer in 1..{MAX_DRAIN}, got {limit!r}")
        _check_callable("on_committed", on_committed, optional=True)
        # One owner per drain call: a claim retried after an uncertain commit recognises its own lease
        # (instead of waiting for it to expire), and two drains of one process never share a claim.
        owner = f"{identity.current()}/{secrets.token_hex(4)}"
        report = DrainReport()
        groups = self.store.read(lambda c: outbox.drainable_groups(c, scope, session_id))
        stopped: set[outbox.Group] = set()
        while report.delivered + len(report.failed) < limit:
            progressed = False
            for group in groups:
                if group in stopped or report.delivered + len(report.failed) >= limit:
                    continue
                delivered = self._deliver_one(group, owner, commit_in, report, on_committed)
                if delivered:
                    progressed = True
                else:
                    stopped.add(group)
            if not progressed:
                break
        report.stopped_sessions = sorted(set(report.stopped_sessions))
        return report

    def _deliver_one(
        self,
        group: outbox.Group,
        owner: str,
        commit_in: Callable[[str], CommitIn | None],
        report: DrainReport,
        on_committed: Callable[[TurnIntent, CommitResult], None] | None,
    ) -> bool:
        blocked: list[tuple[str, int]] = []

        def claim(c: Core) -> TurnIntent | str:
            earlier = blocked[:]  # the write may be retried whole: count only the attempt that commits
            blocked.clear()
            claimed = outbox.claim_head(c, group, owner, self.config.delivery_lease_seconds, blocked)
            # ... or, after an uncertain COMMIT, the earlier attempt's blocks that landed: this one finds
            # those rows blocked already, off the queue, and blocks nothing. A row blocked at another
            # time was blocked by another drain (the earlier COMMIT did not land): not this one's. A row
            # gone since (its session deleted) is not counted: whether its block landed is not known.
            mine = {t for t, _ in blocked}
            blocked.extend((t, at) for t, at in earlier if t not in mine and _blocked(c, group, t, at))
            return claimed

        claimed = self.store.write(claim)
        report.blocked += len(blocked)
        if isinstance(claimed, str):
            if claimed != "empty":
                report.stopped_sessions.append(group[1])
            return False
        intent = claimed
        faults.point("drain.after_claim")
        # The claim is renewed while the engine's commit runs (it may call a model): on PostgreSQL another
        # drain would take an expired claim over and run the same commit again. On SQLite the delivery
        # holds the write lock, so no drain can claim meanwhile, and a renewal could not be written.
        claims = None
        if not self.store.db.dialect.is_sqlite:
            claims = self._claims = self._claims or LeaseKeeper(self.store)
            claims.hold(intent.scope, intent.session_id, intent.turn_id, self.config.delivery_lease_seconds,
                        owner, claim=True)
        tried: list[TurnPayload] = []  # the payload, once the delivery is tried (its engine was found)
        try:
            landed: list[CommitResult] = []

            def run(c: Core) -> CommitResult:
                result = deliver(c, payload)
                _check_result(result)
                if not outbox.complete(c, intent.scope, intent.session_id, intent.turn_id, owner):
                    if landed and result.status == "duplicate" and _delivered(c, intent):
                        # A retry after an uncertain COMMIT: the run before it reached its end and its
                        # commit landed (the ledger holds this very payload, the row is gone). It is
                        # that delivery, not a claim lost to another drain.
                        return landed[0]
                    raise _ClaimLost  # rolls the engine's commit back with it
                faults.point("drain.after_commit")
                landed[:] = [result]
                return result

            try:
                # The engine lookup fails like a delivery: the row stays queued, its claim released. Inside
                # the ``finally``: a lookup that failed (and a failure the store could not record then) left
                # the claim renewed by the keeper for as long as the process lived, the row "leased" to
                # every other drain.
                found = commit_in(intent.engine_id)
                if found is None:
                    raise _EngineUnavailable
                deliver = found
                payload = turn_payload(intent)
                tried.append(payload)
                result = self.store.write(run)
            finally:
                if claims is not None:
                    claims.release(intent.scope, intent.session_id, intent.turn_id, owner)
        except _ClaimLost:
            # The claim outlived its lease and the row changed hands meanwhile: blocked by hand, or
            # delivered by another drain (whose commit holds). This delivery is undone, not failed.
            log.warning("turn %s (session %s) changed hands during its delivery: rolled back", intent.turn_id,
                        intent.session_id)
            report.stopped_sessions.append(intent.session_id)
            return False
        except Exception as e:
            error = str(e) if isinstance(e, _EngineUnavailable) else describe(e)
            at = now_us()
            settled = bool(tried) and self.store.write(
                lambda c: _other_version(c, group, intent, owner, tried[0], error, at)
            )
            if settled:
                report.blocked += 1  # settled: its engine holds the turn as another version; the group goes on
                return True
            report.stopped_sessions.append(intent.session_id)
            if not self.store.write(lambda c: outbox.record_failure(c, intent, owner, error, at)):
                # The row is no longer this claim's: deleted with its session meanwhile (the turn ran
                # again in a session created under the id), or taken over. Nothing of it stays queued:
                # not a failed delivery (the CLI said "their rows stay queued" of a row that was gone).
                log.warning("turn %s (session %s) left the outbox during its delivery (%s)", intent.turn_id,
                            intent.session_id, error)
                return False
            log.warning("delivery of turn %s (session %s) failed: %s", intent.turn_id, intent.session_id, error)
            report.failed.append((intent.session_id, intent.turn_id, error))
            return False
        except BaseException as e:
            # Interrupted (KeyboardInterrupt, SystemExit in a worker thread): the delivery rolled back.
            # Release the claim on the way out, or a process that lives on would hold the session's
            # deliveries for the claim's whole lease; the interruption goes on up whatever happens here.
            error = f"interrupted: {type(e).__name__}"
            try:
                at = now_us()
                self.store.write(lambda c: outbox.record_failure(c, intent, owner, error, at))
            except Exception as failed:  # the store is unreachable: the claim's lease frees it
                log.warning("turn %s: could not release its drain claim: %s", intent.turn_id, describe(failed))
            raise
        if result.status == "committed":
            report.committed += 1
            report.committed_turns.append((intent.session_id, intent.turn_id))
        else:
            report.duplicates += 1
        if on_committed is not None:
            try:
                on_committed(intent, result)
            except Exception as e:  # best effort: an observer never requeues a delivered turn
                log.warning("on_committed observer failed for turn %s: %s", intent.turn_id, e)
        return True

    def recover(
        self, scope: str, session_id: str, engine_id: str, commit_in: Callable[[str], CommitIn | None]
    ) -> RecoveryReport:
        """Before a turn: discard abandoned admitted intents, capture accepted ones, drain ready ones.

        The report's ``discarded`` turns are those this call discarded. A discard retried after an uncertain
        COMMIT that finds the turn's intent gone counts it, though another recovery may have discarded it
        while this COMMIT did not land (nothing tells which)."""
        self.store._ids(scope, session_id)
        check_id("engine_id", engine_id)
        _check_callable("commit_in", commit_in)
        report = RecoveryReport()

        def look(c: Core) -> tuple[list[outbox.AdmittedLease], list[outbox.Group], list[TurnIntent]]:
            # An unknown session (or another scope's) is refused, as every session call refuses it; an
            # empty report said "nothing to recover". (Not the host's turn path: it recovers only when
            # its admission was refused.)
            c.require_session(scope, session_id)
            return (
                outbox.abandoned_admitted(c, scope, session_id),
                outbox.drainable_groups(c, scope, session_id),
                outbox.pending(c, scope, session_id),
            )

        def tell(pending: list[TurnIntent]) -> None:
            report.pending = [i.turn_id for i in pending if i.engine_id == engine_id]
            report.queued = [i.turn_id for i in pending]
            report.running = [i.turn_id for i in pending if i.state == "admitted"]

        # Every turn runs this first; almost always there is nothing to recover. One snapshot answers
        # all three questions then, instead of three read transactions (see bench/README.md).
        expired, groups, pending = self.store.read(look)
        if not expired and not groups:
            tell(pending)
            return report
        for lease in expired:
            # The ``created_us`` of the intent the attempt that ran to its end deleted, as read back from the
            # row (see ``discard``: never compared with this machine's clock, the admitting worker's may be
            # seconds off this one's).
            deleted_at: list[int] = []

            def discard(c: Core, lease: outbox.AdmittedLease = lease, deleted_at: list[int] = deleted_at) -> bool:
                row = outbox.get_row(c, scope, session_id, lease.turn_id, lock=True)
                if deleted_at and (row is None or row.created_us != deleted_at[0]):
                    # A retry after an uncertain COMMIT: the intent the run before it deleted is gone (that
                    # COMMIT landed), and one of the turn found now is another admission's (the turn admitted
                    # again since), never touched. (One gone is taken for this discard's, though another
                    # recovery may have discarded it while this COMMIT did not land.) The intent still
                    # there (the COMMIT did not land) is decided afresh: a turn taken over meanwhile keeps it.
                    return True
                deleted_at.clear()
                if row is None or not outbox.discard_abandoned(c, scope, session_id, lease):
                    return False
                deleted_at.append(int(row.created_us))
                return True

            if self.store.write(discard):
                log.warning("recovery found no host acceptance for turn %s (session %s): discarded",
                            lease.turn_id, session_id)
                report.discarded.append(lease.turn_id)
        report.drain = self.drain(commit_in, scope=scope, session_id=session_id, limit=10_000)
        tell(self.store.read(lambda c: outbox.pending(c, scope, session_id)))
        return report

    def intents(self, scope: str | None = None, limit: int = outbox.DEFAULT_INTENTS_PAGE) -> list[TurnIntent]:
        """Every outbox row (pending, blocked, in progress), the first ``limit`` (1..10000) by scope, session
        and enqueue order; ``intents_page`` reads on past them."""
        check_id("scope", scope, optional=True)
        outbox.check_intents_limit(limit)
        return self.store.read(lambda c: outbox.list_intents(c, scope, limit))

    def intents_page(
        self, scope: str | None = None, *, after: str | None = None, limit: int = outbox.DEFAULT_INTENTS_PAGE
    ) -> IntentPage:
        """The outbox a page at a time, in the order of ``intents``: at most ``limit`` (1..10000) rows after the
        cursor ``after`` (a page's ``next``; None: from the first row), of one scope or (None) every scope."""
        check_id("scope", scope, optional=True)
        outbox.check_intents_limit(limit)
        place = None if after is None else outbox.parse_intent_cursor(after, scope)
        return self.store.read(lambda c: outbox.intents_page(c, scope, after=place, limit=limit))

    def intent(self, scope: str, session_id: str, turn_id: str) -> TurnIntent | None:
        """One outbox row, or None (``UnknownSession`` for a session the scope does not hold)."""
        _check_turn(self.store, scope, session_id, turn_id)

        def read(c: Core) -> TurnIntent | None:
            c.require_session(scope, session_id)  # "no such intent" only of a session that is there
            return outbox.get_intent(c, scope, session_id, turn_id)

        return self.store.read(read)


class _NotClear(Exception):
    """``admit_if_clear`` found recovery or a retry to handle first: roll the admission back."""


class _ClaimLost(Exception):
    """A delivery's claim was no longer its own when it committed (see ``_deliver_one``)."""


class _EngineUnavailable(Exception):
    def __init__(self) -> None:
        super().__init__("engine unavailable")


def _accepted_as(c: Core, intent: TurnIntent, terminal: Anchor) -> bool:
    """Whether the turn of ``intent`` was accepted with ``terminal``: its outbox row holds that terminal, or
    (delivered since) its engine's receipt names it."""
    row = outbox.get_row(c, intent.scope, intent.session_id, intent.turn_id)
    if row is not None:
        return row.terminal is not None and outbox.same_anchor(Anchor.model_validate_json(row.terminal), terminal)
    receipt = get_receipt(c, intent.scope, intent.session_id, intent.engine_id, intent.turn_id)
    return receipt is not None and receipt.terminal_entry_id == terminal.entry_id


def _delivered(c: Core, intent: TurnIntent) -> bool:
    """Whether a ready intent was delivered: its row is gone (the ledger holds its payload: the caller's
    commit just answered ``duplicate``)."""
    return outbox.get_row(c, intent.scope, intent.session_id, intent.turn_id) is None


def _gone(c: Core, anchor: Anchor) -> bool:
    """Whether the session of an anchor is gone: deleted, perhaps made again under its id."""
    row = c.session_row(anchor.scope, anchor.session_id)
    return row is None or foreign_incarnation(anchor.incarnation, row.incarnation, row.created_us)


def _other_version(
    c: Core, group: outbox.Group, intent: TurnIntent, owner: str, payload: TurnPayload, error: str, at: int
) -> bool:
    """Whether a failed delivery's row was blocked because its engine's ledger holds the turn as another
    version (``outbox.block_other_version``); also when retried after that block's uncertain COMMIT."""
    return outbox.block_other_version(c, intent, owner, payload.payload_hash, error, at) or _blocked(
        c, group, intent.turn_id, at
    )


def _blocked(c: Core, group: outbox.Group, turn_id: str, at: int) -> bool:
    """Whether the turn's row of the group (scope, session, engine) is blocked, by the block written at ``at``."""
    row = outbox.get_row(c, group[0], group[1], turn_id)
    return row is not None and row.state == "blocked" and row.engine_id == group[2] and row.updated_us == at


def new_owner() -> str:
    """A lease owner for one attempt of a turn: this process's identity and a token of the attempt.

    Recovery tells a dead worker by the identity (``outbox.abandoned``); the token tells two attempts of
    one process apart (threads of a gateway), so that a failing attempt discards only its own intent.
    """
    return f"{identity.current()}/{secrets.token_hex(4)}"


def _check_owner(owner: object) -> str:
    # Control characters as ids refuse them (C0, DEL, C1: an owner is printed by `outbox status`), and
    # lone surrogates; the message said so, and only NUL and surrogates were refused.
    if not isinstance(owner, str) or not 1 <= len(owner) <= outbox.MAX_OWNER or BAD_ID_CHAR.search(owner):
        raise InvalidInput(f"a lease owner is a string of 1..{outbox.MAX_OWNER} characters, no control characters")
    return owner


def _check_turn(store: TranscriptStore, scope: str, session_id: str, turn_id: str) -> None:
    store._ids(scope, session_id)
    check_id("turn_id", turn_id)


def _check_callable(what: str, value: object, *, optional: bool = False) -> None:
    if not (callable(value) or (optional and value is None)):
        raise InvalidInput(f"{what} must be callable{' or None' if optional else ''}, not {type(value).__name__}")


def _check_result(result: object) -> None:
    if not isinstance(result, CommitResult) or result.status not in ("committed", "duplicate"):
        raise TranscriptStoreError(f"invalid commit_turn result: {result!r}")
