"""The host-side turn outbox: one durable intent per logical turn, drained in order into commit_turn.

States: ``admitted`` (user entry admitted, provider call dispatched) -> ``accepted`` (terminal anchor
recorded) -> ``ready`` (closed range read, messages captured) or ``blocked`` (the range can never be
read: kept as audit evidence). Failed attempts delete their admitted intent: admission alone never
advances an engine. A session runs one turn at a time: a turn is admitted only while no other turn of
the session is admitted (``SessionBusy``), so no turn's range ever holds another turn's messages.
Delivery is at-least-once (a lease with expiry per claimed row, so a crashed worker's claim is taken
over); the ledger's idempotency makes the effect exactly-once.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from sqlalchemy import (
    ColumnElement,
    Row,
    bindparam,
    delete,
    literal,
    literal_column,
    select,
    tuple_,
    union_all,
    update,
)

from . import identity
from .core import (
    MAX_ID_CHARS,
    MAX_INT,
    Core,
    by_session,
    check_id,
    foreign_incarnation,
    from_us,
    now_us,
    session_params,
)
from .errors import (
    InvalidInput,
    OutboxCollision,
    SessionBusy,
    TransientStoreError,
    TurnOvertaken,
    UnknownSession,
    UnknownTurn,
)
from .fences import closed_range_of_append, read_closed_range
from .ledger import CommitResult, get_receipt
from .models import Admission, Anchor, ClosedRange, ClosedRangeResult, Entry
from .schema import entries, outbox, receipts

log = logging.getLogger("transcript_store.outbox")

IntentState = Literal["admitted", "accepted", "ready", "blocked"]


class TurnIntent(BaseModel):
    """One outbox row."""

    model_config = ConfigDict(frozen=True)
    scope: str
    session_id: str
    turn_id: str
    engine_id: str
    state: IntentState
    enqueue_seq: int
    admission: Admission
    terminal: Anchor | None
    messages: list[dict[str, Any]] | None
    is_heartbeat: bool
    block_reason: str | None
    attempt_count: int
    last_error: str | None
    last_attempt_at: datetime | None
    lease_owner: str | None
    lease_expires_at: datetime | None


#: the longest lease OutboxConfig accepts (seconds): a year
MAX_LEASE_SECONDS = 365 * 24 * 3600.0
#: The most rows one drain call may deliver (``drain_limit`` and ``drain(limit=)`` alike).
MAX_DRAIN = 1_000_000


@dataclass(frozen=True)
class OutboxConfig:
    """Lease timeouts (seconds). A crashed worker blocks nothing longer than its lease."""

    #: How long an admitted turn belongs to its worker (model call included) before recovery may discard it.
    turn_lease_seconds: float = 300.0
    #: How long a drain claim holds a ready row while it is delivered to the engine.
    delivery_lease_seconds: float = 60.0
    #: Rows delivered per drain call, round-robin one per session per round.
    drain_limit: int = 16

    def __post_init__(self) -> None:
        for name in ("turn_lease_seconds", "delivery_lease_seconds"):
            value = getattr(self, name)
            # A lease is stored as microseconds in a 64-bit column: a finite number of seconds, up to a year.
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_LEASE_SECONDS:
                raise InvalidInput(f"{name} must be a number of seconds in 0..{MAX_LEASE_SECONDS:g}, got {value!r}")
        limit = self.drain_limit
        # Bounded as drain(limit=) is: a larger one was taken here and refused by every drain() after.
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_DRAIN:
            raise InvalidInput(f"drain_limit must be an integer in 1..{MAX_DRAIN}, got {limit!r}")


def _intent(core: Core, row: Row[Any]) -> TurnIntent:
    admission = Admission.model_validate_json(row.admission)
    terminal = None if row.terminal is None else Anchor.model_validate_json(row.terminal)
    if admission.anchor.incarnation is None or (terminal is not None and terminal.incarnation is None):
        # Written by a release whose anchors carried no incarnation, some of which already gave new
        # sessions random ones (which honour no anchor without one). An outbox row goes with its
        # session (ON DELETE CASCADE), so it is of the session's present incarnation: say so.
        sess = core.session_row(row.scope, row.session_id)
        if sess is not None:
            fill = {"incarnation": sess.incarnation}
            if admission.anchor.incarnation is None:
                admission = admission.model_copy(update={"anchor": admission.anchor.model_copy(update=fill)})
            if terminal is not None and terminal.incarnation is None:
                terminal = terminal.model_copy(update=fill)
    return TurnIntent.model_construct(
        scope=row.scope,
        session_id=row.session_id,
        turn_id=row.turn_id,
        engine_id=row.engine_id,
        state=row.state,
        enqueue_seq=row.enqueue_seq,
        admission=admission,
        terminal=terminal,
        messages=None if row.messages is None else json.loads(row.messages),
        is_heartbeat=bool(row.is_heartbeat),
        block_reason=row.block_reason,
        attempt_count=row.attempt_count,
        last_error=row.last_error,
        last_attempt_at=None if row.last_attempt_us is None else from_us(row.last_attempt_us),
        lease_owner=row.lease_owner,
        lease_expires_at=None if row.lease_expires_us is None else from_us(row.lease_expires_us),
    )


def _intent_of(values: dict[str, Any], admission: Admission) -> TurnIntent:
    """The intent of a row just inserted from ``values`` (no JSON to parse back)."""
    return TurnIntent.model_construct(
        scope=values["scope"],
        session_id=values["session_id"],
        turn_id=values["turn_id"],
        engine_id=values["engine_id"],
        state="admitted",
        enqueue_seq=values["enqueue_seq"],
        admission=admission,
        terminal=None,
        messages=None,
        is_heartbeat=values["is_heartbeat"],
        block_reason=None,
        attempt_count=0,
        last_error=None,
        last_attempt_at=None,
        lease_owner=values["lease_owner"],
        lease_expires_at=from_us(values["lease_expires_us"]),
    )


def _key(scope: str, session_id: str, turn_id: str) -> Any:
    return (outbox.c.scope == scope) & (outbox.c.session_id == session_id) & (outbox.c.turn_id == turn_id)


def _queued(table: Any) -> ColumnElement[bool]:
    """``state <> 'blocked'`` of ``table`` (the outbox or an alias of it), the constant written out.

    The queue indexes hold no blocked row (schema.py, revision 0014), and a statement reads them only
    when it says so as such: SQLite takes a partial index only for a WHERE clause holding its condition
    term for term, and PostgreSQL proves nothing from a parameter."""
    queued: ColumnElement[bool] = table.c.state != literal_column("'blocked'")
    return queued


# The statements every turn runs are built once (see core.py, "hot statements": building a statement
# costs more CPU than executing it from SQLAlchemy's compiled cache).
_BY_TURN = by_session(outbox) & (outbox.c.turn_id == bindparam("b_turn"))
_GET_ROW = select(outbox).where(_BY_TURN)
_GET_ROW_LOCKED = _GET_ROW.with_for_update()
_ACCEPT = (
    update(outbox)
    .where(_BY_TURN)
    .values(
        state="accepted", terminal=bindparam("b_terminal"), lease_owner=None, lease_expires_us=None,
        displaced_leases=None, updated_us=bindparam("b_ts"),
    )
)
_MARK_READY = update(outbox).where(_BY_TURN).values(
    state="ready", messages=bindparam("b_messages"), updated_us=bindparam("b_ts")
)
_COMPLETE = delete(outbox).where(_BY_TURN, outbox.c.state == "ready")
_COMPLETE_OWNED = _COMPLETE.where(outbox.c.lease_owner == bindparam("b_owner"))
# The fast completion's acceptance check and its "is an earlier turn of this engine queued?" in one
# statement (a round trip on PostgreSQL, and a turn runs ~20): only the turn's own row is locked; the
# earlier rows are only looked at (locking them would make a completion wait for a drain that is
# delivering one of them, for nothing: the answer is the same either way).
_earlier = outbox.alias("earlier")
_EARLIER_PENDING = (
    select(literal(1))
    .where(
        _earlier.c.scope == outbox.c.scope,
        _earlier.c.session_id == outbox.c.session_id,
        _earlier.c.engine_id == outbox.c.engine_id,
        _queued(_earlier),
        _earlier.c.enqueue_seq < outbox.c.enqueue_seq,
    )
    .exists()
    .label("earlier_pending")
)
_GET_ROW_FOR_ACCEPT = select(outbox, _EARLIER_PENDING).where(_BY_TURN)
_GET_ROW_FOR_ACCEPT_LOCKED = _GET_ROW_FOR_ACCEPT.with_for_update(of=outbox)
_PENDING = select(outbox).where(by_session(outbox), _queued(outbox)).order_by(outbox.c.enqueue_seq)
_PENDING_OF_ENGINE = _PENDING.where(outbox.c.engine_id == bindparam("b_engine"))
# (Every statement below saying ``_queued`` besides a state reads the queue index by it: see ``_queued``.)
_ADMITTED = (
    select(outbox.c.turn_id, outbox.c.lease_owner, outbox.c.lease_expires_us, outbox.c.displaced_leases)
    .where(by_session(outbox), outbox.c.state == "admitted", _queued(outbox))
    .order_by(outbox.c.enqueue_seq)
)
_ADMITTED_OTHERS = _ADMITTED.where(outbox.c.turn_id != bindparam("b_turn"))
# Locked (PostgreSQL): a renewal by a live worker cannot land between the look and the discard.
_ADMITTED_OTHERS_LOCKED = _ADMITTED_OTHERS.with_for_update()
# A primary-key range scan from the admitted entry: empty when nothing was appended after it.
_LATER_ADMISSION = (
    select(entries.c.turn_id)
    .where(
        by_session(entries), entries.c.seq > bindparam("b_seq"), entries.c.turn_id.is_not(None),
        entries.c.turn_id != bindparam("b_turn"),
    )
    .order_by(entries.c.seq)
    .limit(1)
)
_RECEIPT_OF_TURN = (
    select(receipts.c.engine_id).where(by_session(receipts), receipts.c.advancement_key == bindparam("b_turn")).limit(1)
)
#: dialect name -> INSERT .. ON CONFLICT DO NOTHING RETURNING of an admitted intent
_INSERT_ADMITTED: dict[str, Any] = {}
_DELETE_TURN = delete(outbox).where(_BY_TURN)
_DELETE_ADMITTED = _DELETE_TURN.where(outbox.c.state == "admitted")
_UPDATE_ADMITTED = update(outbox).where(_BY_TURN, outbox.c.state == "admitted")
_DELETE_OWNED = _DELETE_ADMITTED.where(outbox.c.lease_owner == bindparam("b_owner"))
# A failed attempt's discard of a turn no retry took from a live attempt (the common failure: one statement).
_DELETE_OWNED_ALONE = _DELETE_OWNED.where(outbox.c.displaced_leases.is_(None))
# Only the very leases recovery judged abandoned: a retry that took the turn over since has another one,
# and a displaced attempt that renewed its lease since (every renewal rewrites the list) lives.
_DELETE_ABANDONED = _DELETE_ADMITTED.where(
    outbox.c.lease_owner == bindparam("b_owner"),
    outbox.c.lease_expires_us.is_not_distinct_from(bindparam("b_expires")),
    outbox.c.displaced_leases.is_not_distinct_from(bindparam("b_displaced")),
)
# What a new turn must know of its session's outbox and ledger before it is admitted, in ONE statement
# (a round trip on PostgreSQL): every non-blocked intent, and any row or receipt of this very turn id.
# Apart, not as one OR: the queued rows through the queue index, the turn's own row by its key (both,
# when it is queued: only whether any row comes matters), never the session's blocked rows.
_TURN_PRECHECK = union_all(
    select(literal("intent").label("kind"), outbox.c.turn_id.label("ref")).where(by_session(outbox), _queued(outbox)),
    select(literal("intent").label("kind"), outbox.c.turn_id.label("ref")).where(_BY_TURN),
    select(literal("receipt").label("kind"), receipts.c.engine_id.label("ref")).where(
        by_session(receipts), receipts.c.advancement_key == bindparam("b_turn")
    ),
)


def _turn_params(scope: str, session_id: str, turn_id: str, **more: Any) -> dict[str, Any]:
    return session_params(scope, session_id, b_turn=turn_id, **more)


def _gone_here(owner: str) -> bool:
    """Whether the process a lease owner names is provably gone from this machine (an owner is the
    process's identity, and since attempts and claims carry one, "/" and a token of its own)."""
    who = identity.ProcessIdentity.parse(owner.split("/", 1)[0])
    if who is None or not 0 < who.pid < 2**31:  # no pid a process can have here (a caller's own owner)
        return False
    try:
        return who.is_dead_here()
    except (OverflowError, ValueError):  # unknown is not dead
        return False


def abandoned(lease_owner: str | None, lease_expires_us: int | None, now: int) -> bool:
    """Whether a lease's worker is gone: the lease expired, or its process left this machine.

    An admitted turn is abandoned when its lease is and so is the lease of every attempt retries took it
    over from (``AdmittedLease.abandoned``)."""
    if lease_expires_us is None or lease_expires_us < now:
        return True
    return bool(lease_owner) and _gone_here(str(lease_owner))


#: The most displaced attempts an admitted turn remembers (``displaced_leases``): a retry that would make
#: it one more live attempt to remember is ``SessionBusy`` (sixteen attempts of one turn running at once).
MAX_DISPLACED = 16

#: one displaced attempt's lease: (owner, expires_us)
Lease = tuple[str, int]


#: the latest lease expiry a displaced entry may name: the end of year 9999 (``from_us`` makes a datetime)
_MAX_EXPIRES_US = 253_402_300_799_000_000


def parse_displaced(text: str | None) -> list[Lease]:
    """The displaced attempts' leases of a row's ``displaced_leases``, oldest first (a malformed item,
    which this module never writes, is left out)."""
    if not text:
        return []
    # This module writes at most MAX_DISPLACED flat items; anything longer or deeper was not written here.
    # With room for a release that escaped every owner's characters (``\uXXXX``, 12 characters for one
    # outside the BMP): an item, escaped, is at most 12 * MAX_OWNER characters of owner and 64 of the rest.
    # A cap of an item's plain size ignored the list once five owners of 128 non-ASCII characters had been
    # escaped, and the turn was taken for abandoned while those attempts lived (discarded, another turn
    # admitted).
    if len(text) > (MAX_DISPLACED + 1) * (12 * MAX_OWNER + 64):
        log.warning("an outbox row's displaced_leases is too long to be this module's: ignored")
        return []
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        log.warning("an outbox row's displaced_leases is not JSON: ignored")
        return []
    leases: list[Lease] = []
    for item in items if isinstance(items, list) else []:
        owner, expires = (item.get("owner"), item.get("expires_us")) if isinstance(item, dict) else (None, None)
        # An owner the lease column holds, an expiry a stored time can be (a datetime, a BIGINT).
        if (
            isinstance(owner, str) and 0 < len(owner) <= MAX_OWNER
            and isinstance(expires, int) and not isinstance(expires, bool) and 0 <= expires <= _MAX_EXPIRES_US
        ):
            leases.append((owner, expires))
    return leases


def _dump_displaced(leases: list[Lease]) -> str | None:
    """``displaced_leases`` of a list (None: no attempt displaced); owners as they are, not escaped."""
    if not leases:
        return None
    items = [{"owner": o, "expires_us": e} for o, e in leases]
    return json.dumps(items, separators=(",", ":"), ensure_ascii=False)


def _live(leases: list[Lease], now: int, *, without: str | None = None) -> list[Lease]:
    """The leases of ``leases`` that are not abandoned, but ``without``'s: what is written back (pruned)."""
    return [(o, e) for o, e in leases if o != without and not abandoned(o, e, now)]


def claim_session(core: Core, scope: str, session_id: str, turn_id: str) -> None:
    """Make ``turn_id`` the session's only running turn, with the session locked (one statement).

    Another admitted turn whose worker lives: ``SessionBusy``. One whose worker is gone is discarded
    here, as recovery would (no acceptance was recorded for it, so it never reaches an engine).
    """
    now = now_us()
    # The rows are locked as they are read: a worker's renewal committed between this look and the
    # discard below (its lease seen expired, then renewed) was deleted with the turn all the same,
    # while its keeper had been told the lease was renewed.
    q = _ADMITTED_OTHERS if core.dialect.is_sqlite else _ADMITTED_OTHERS_LOCKED
    for row in core.run(q, _turn_params(scope, session_id, turn_id)).all():
        lease = AdmittedLease.of(row)
        if not lease.abandoned(now):
            raise SessionBusy(session_id, row.turn_id, lease.busy_until())
        core.run(_DELETE_ADMITTED, _turn_params(scope, session_id, row.turn_id))
        log.warning("turn %s of session %s was abandoned by its worker: discarded before turn %s",
                    row.turn_id, session_id, turn_id)


def check_not_overtaken(core: Core, admission: Admission) -> None:
    """Refuse to continue an admission that a later turn's admission follows (``TurnOvertaken``)."""
    a = admission.anchor
    later = core.run(_LATER_ADMISSION, _turn_params(a.scope, a.session_id, admission.turn_id, b_seq=a.seq)).first()
    if later is not None:
        raise TurnOvertaken(admission.turn_id, later.turn_id)


def check_not_committed(core: Core, admission: Admission) -> None:
    """Refuse to run again a turn the ledger holds a receipt of (``OutboxCollision``): it reached an
    engine, and its intent was deleted then; admitted again, its second replies would land in the
    transcript and its commit collide with the receipt on every drain, holding the session's queue."""
    a = admission.anchor
    found = core.run(_RECEIPT_OF_TURN, _turn_params(a.scope, a.session_id, admission.turn_id)).first()
    if found is not None:
        raise OutboxCollision(f"turn {admission.turn_id!r} was already committed (engine {found.engine_id!r})")


def get_row(core: Core, scope: str, session_id: str, turn_id: str, *, lock: bool = False) -> Row[Any] | None:
    """The raw outbox row of a turn (locked FOR UPDATE on PostgreSQL when asked)."""
    q = _GET_ROW_LOCKED if lock and not core.dialect.is_sqlite else _GET_ROW
    return core.run(q, _turn_params(scope, session_id, turn_id)).first()


def get_intent(core: Core, scope: str, session_id: str, turn_id: str) -> TurnIntent | None:
    """The intent of a turn, or None."""
    row = get_row(core, scope, session_id, turn_id)
    return None if row is None else _intent(core, row)


def record_admitted(
    core: Core,
    admission: Admission,
    engine_id: str,
    *,
    lease_seconds: float,
    is_heartbeat: bool = False,
    owner: str | None = None,
    taken_over: list[AdmittedLease] | None = None,
    took_before: Sequence[AdmittedLease] = (),
) -> TurnIntent:
    """Write the admitted intent (same transaction as the admission); identical again is a no-op.

    An admitted intent of the same turn is taken over by ``owner`` (a retry of the turn); the lease it
    took, when that attempt's worker was alive, is put in ``taken_over`` (emptied first) so that a
    retry which fails can give the turn back (``hand_back``) instead of discarding it.

    ``took_before``: what an earlier run of this transaction that ran to its end put in ``taken_over``.
    A rerun that finds the turn held by ``owner`` already finds that run's take-over, whose COMMIT
    landed though its answer was lost (``owner`` names one attempt): it reports that lease again."""
    a = admission.anchor
    ts = now_us()
    if taken_over is not None:
        taken_over.clear()  # the transaction may run again whole: only its last run counts
    owner = owner or str(identity.current())
    text = admission.model_dump_json()
    values = {
        "scope": a.scope,
        "session_id": a.session_id,
        "turn_id": admission.turn_id,
        "engine_id": engine_id,
        "state": "admitted",
        "enqueue_seq": a.seq,
        "admission": text,
        "terminal": None,
        "messages": None,
        "is_heartbeat": is_heartbeat,
        "block_reason": None,
        "attempt_count": 0,
        "last_error": None,
        "last_attempt_us": None,
        "lease_owner": owner,
        "lease_expires_us": ts + int(lease_seconds * 1_000_000),
        "created_us": ts,
        "updated_us": ts,
    }
    # RETURNING, not rowcount: SQLAlchemy does not keep an INSERT's rowcount (psycopg reports -1).
    stmt = _INSERT_ADMITTED.get(core.dialect.name)
    if stmt is None:
        stmt = core.dialect.insert(outbox).on_conflict_do_nothing().returning(outbox.c.turn_id)
        _INSERT_ADMITTED[core.dialect.name] = stmt
    inserted = core.run(stmt, values).first() is not None
    if inserted:
        # The row is what was just written: no statement to read it back.
        return _intent_of(values, admission)
    row = get_row(core, a.scope, a.session_id, admission.turn_id, lock=True)
    if row is None:
        # Deleted since the INSERT met it (PostgreSQL's ON CONFLICT DO NOTHING does not lock the row it
        # conflicts with: a discard of the attempt it belonged to committed meanwhile). The transaction
        # is run again whole, and inserts then.
        raise TransientStoreError(f"turn {admission.turn_id!r}: its intent was deleted while it was admitted again")
    if row.engine_id != engine_id:
        raise OutboxCollision(f"turn {admission.turn_id!r} is owned by engine {row.engine_id!r}, not {engine_id!r}")
    if Admission.model_validate_json(row.admission).anchor.entry_id != a.entry_id:
        raise OutboxCollision(f"turn {admission.turn_id!r} was admitted with another entry")
    if row.state == "admitted":
        # A retry of the same logical turn takes the lease over (the earlier attempt failed or died).
        kept: dict[str, Any] = {}
        if row.lease_owner != owner:
            kept["displaced_leases"] = _dump_displaced(_take_over(row, owner, ts, taken_over))
        elif taken_over is not None:
            taken_over.extend(took_before)
        core.conn.execute(
            update(outbox)
            .where(_key(a.scope, a.session_id, admission.turn_id))
            .values(lease_owner=owner, lease_expires_us=values["lease_expires_us"], updated_us=ts, **kept)
        )
        row = get_row(core, a.scope, a.session_id, admission.turn_id)
        assert row is not None
    return _intent(core, row)


def _take_over(row: Row[Any], owner: str, now: int, taken_over: list[AdmittedLease] | None) -> list[Lease]:
    """The displaced attempts an admitted turn keeps once a retry (``owner``) takes it over: the live ones
    it kept (``owner``'s own entry left out: it holds the turn now), and the attempt holding it, if alive,
    the most recent. Each may still complete the turn, and the turn is not abandoned while one of their
    workers lives; a failing retry hands the turn to the most recent live one (``hand_back``).

    The lease this retry took the turn from goes to ``taken_over``: the holder's, or, when the holder is
    gone (a retry that died), the most recent live displaced attempt's. More than ``MAX_DISPLACED`` live
    attempts to keep: ``SessionBusy`` (nothing is written: the transaction rolls back)."""
    kept = _live(parse_displaced(row.displaced_leases), now, without=owner)
    if row.lease_owner is not None and not abandoned(row.lease_owner, row.lease_expires_us, now):
        kept.append((row.lease_owner, row.lease_expires_us))
    if len(kept) > MAX_DISPLACED:
        lease = AdmittedLease(row.turn_id, row.lease_owner, row.lease_expires_us, row.displaced_leases)
        raise SessionBusy(row.session_id, row.turn_id, lease.busy_until())
    if taken_over is not None and kept:
        taken_over.append(AdmittedLease(row.turn_id, kept[-1][0], kept[-1][1]))
    return kept


def accept(core: Core, scope: str, session_id: str, turn_id: str, terminal: Anchor) -> TurnIntent:
    """admitted -> accepted with the terminal anchor; the same acceptance again is a no-op."""
    intent, fresh, _ = check_accept(core, scope, session_id, turn_id, terminal)
    if fresh:
        # A terminal the caller built (the fast completion's comes from its own append): it must name
        # a stored message of the session as it is now, descending from the admitted entry, or the
        # acceptance would stand only to be blocked at the drain, and the genuine terminal could never
        # be accepted after it.
        sess = core.session_row(scope, session_id)
        if sess is None:
            raise UnknownSession(scope, session_id)
        if foreign_incarnation(terminal.incarnation, sess.incarnation, sess.created_us):
            raise InvalidInput("the terminal anchor is of another session under this id (its incarnation)")
        if (terminal.session_key, terminal.generation) != (sess.session_key, sess.generation):
            raise InvalidInput(
                f"the terminal anchor is not of the session as it is now (key {terminal.session_key!r}, "
                f"generation {terminal.generation}; the session has {sess.session_key!r}, {sess.generation})"
            )
        row = core.entry_rows(scope, session_id, [terminal.entry_id]).get(terminal.entry_id)
        if row is None or row.kind != "message" or (row.seq, row.parent_id, row.position, row.idempotency_key) != (
            terminal.seq, terminal.parent_id, terminal.position, terminal.idempotency_key
        ):
            raise InvalidInput(f"the terminal anchor names no stored message as it is: {terminal.entry_id!r}")
        if row.seq < intent.admission.anchor.seq:
            # Written before the admitted entry, so not its descendant (a child's seq is its parent's
            # and more): the range would be ``non_descendant`` and the turn blocked at the drain.
            raise InvalidInput(f"the terminal anchor precedes the admitted entry: {terminal.entry_id!r}")
        if intent.admission.anchor.generation == sess.generation:
            # (An admission of an earlier generation is a rewrite during the turn: the drain blocks it
            # ``stale``, as the host's own completion would be.)
            check = read_closed_range(core, intent.admission.anchor, terminal, sess)
            if not isinstance(check, ClosedRange) and check.reason == "non_descendant":
                raise InvalidInput(
                    f"the terminal anchor does not descend from the admitted entry ({check.detail}): "
                    f"{terminal.entry_id!r}"
                )
        persist_accept(core, scope, session_id, turn_id, terminal)
    return intent


def check_accept(
    core: Core, scope: str, session_id: str, turn_id: str, terminal: Anchor
) -> tuple[TurnIntent, bool, bool]:
    """Lock and check the row for ``accept``: (the accepted intent, whether the acceptance is new,
    whether an earlier non-blocked intent of the same engine waits in the session's outbox).

    Writes nothing: the fast completion deletes the row in the same transaction, so it never writes
    an acceptance nobody else could see; ``persist_accept`` writes it when it is needed after all.
    """
    q = _GET_ROW_FOR_ACCEPT if core.dialect.is_sqlite else _GET_ROW_FOR_ACCEPT_LOCKED
    row = core.run(q, _turn_params(scope, session_id, turn_id)).first()
    if row is None:
        if core.session_row(scope, session_id) is None:  # (only on the way to an error: off the hot path)
            raise UnknownSession(scope, session_id)
        raise UnknownTurn(session_id, turn_id, "it has no admitted intent to accept")
    admission = Admission.model_validate_json(row.admission)
    identity_fields = ("scope", "session_id", "session_key")
    if any(getattr(terminal, k) != getattr(admission.anchor, k) for k in identity_fields):
        raise InvalidInput("the terminal anchor names another session than the admission")
    if row.state != "admitted":
        if row.terminal is not None and same_anchor(Anchor.model_validate_json(row.terminal), terminal):
            return _intent(core, row), False, bool(row.earlier_pending)
        raise OutboxCollision(f"turn {turn_id!r} was already accepted with another terminal")
    # The row as _ACCEPT leaves it, without reading it back (a statement, a round trip, per turn).
    accepted = {"state": "accepted", "terminal": terminal, "lease_owner": None, "lease_expires_at": None}
    return _intent(core, row).model_copy(update=accepted), True, bool(row.earlier_pending)


def same_anchor(a: Anchor, b: Anchor) -> bool:
    """Equal anchors; one without an incarnation (stored before anchors had one, or sent by an older
    client) is compared on everything else."""
    if a.incarnation is None or b.incarnation is None:
        return a.model_copy(update={"incarnation": None}) == b.model_copy(update={"incarnation": None})
    return a == b


def persist_accept(core: Core, scope: str, session_id: str, turn_id: str, terminal: Anchor) -> None:
    """Write the acceptance of an admitted intent (see ``accept``)."""
    text = terminal.model_dump_json()
    core.run(_ACCEPT, _turn_params(scope, session_id, turn_id, b_terminal=text, b_ts=now_us()))


def capture(core: Core, intent: TurnIntent, *, at: int | None = None) -> TurnIntent:
    """accepted -> ready (closed range captured) or blocked; stays accepted if the projection is unavailable.

    ``at``: the time written with the row (``now_us()`` when not given)."""
    return capture_range(core, intent, at=at)[0]


def capture_range(
    core: Core,
    intent: TurnIntent,
    *,
    persist: bool = True,
    session: Row[Any] | None = None,
    appended: list[Entry] | None = None,
    at: int | None = None,
) -> tuple[TurnIntent, ClosedRange | None]:
    """``capture``, also returning the closed range it read (None when it read none).

    ``persist=False`` (the fast completion): a captured range is returned, not written; a range that
    cannot be captured returns the intent unchanged, for the caller to take the persisted way.
    ``session``: the session's row as this transaction holds it locked (see ``read_closed_range``);
    with ``appended``, what this transaction just appended to it (see ``closed_range_of_append``).
    ``at``: the time written with the row, ready or blocked (``now_us()`` when not given).
    """
    if intent.state != "accepted" or intent.terminal is None:
        return intent, None
    result: ClosedRangeResult | None = None
    if session is not None and appended is not None:
        result = closed_range_of_append(intent.admission.anchor, intent.terminal, session, appended)
    if result is None:
        result = read_closed_range(core, intent.admission.anchor, intent.terminal, session)
    ts = now_us() if at is None else at
    if isinstance(result, ClosedRange):
        other = _other_turn_in(result)
        if other is not None:
            # Another logical turn was admitted inside this one (``TranscriptStore.admit`` is not held
            # back by a running turn): its messages are its own turn's, and this range would deliver
            # them to the engine a second time. ``commit_turn`` refuses such a range too.
            if not persist:
                return intent, None
            return _block(core, intent, _overlap_reason(other), ts), None
        messages = result.messages
        if persist:
            params = _turn_params(
                intent.scope, intent.session_id, intent.turn_id, b_messages=json.dumps(messages), b_ts=ts
            )
            core.run(_MARK_READY, params)
        return intent.model_copy(update={"state": "ready", "messages": messages}), result
    if result.reason == "projection_unavailable" or not persist:
        return intent, None
    return _block_range(core, intent, result, ts), None


def _other_turn_in(closed: ClosedRange) -> Entry | None:
    """The first message of a closed range after its admission that is another turn's admission."""
    return next((e for e in closed.entries[1:] if e.turn_id is not None), None)


def _overlap_reason(other: Entry) -> str:
    """The block reason of a turn whose range holds ``other``, another turn's admission."""
    return f"overlapping_turn: the turn's range holds entry {other.entry_id!r}, the admission of turn {other.turn_id!r}"


def _block_range(core: Core, intent: TurnIntent, failure: Any, at: int) -> TurnIntent:
    """Block a queued row whose closed range cannot be read (a ``ClosedRangeFailure``); the blocked intent."""
    return _block(core, intent, f"{failure.reason}: {failure.detail}" if failure.detail else failure.reason, at)


def _block(core: Core, intent: TurnIntent, reason: str, at: int) -> TurnIntent:
    """Block a queued row for ``reason`` at ``at`` (its ``updated_us``); the blocked intent."""
    key = _key(intent.scope, intent.session_id, intent.turn_id)
    core.conn.execute(update(outbox).where(key).values(state="blocked", block_reason=reason, updated_us=at))
    log.warning("turn %s of session %s blocked: %s", intent.turn_id, intent.session_id, reason)
    return intent.model_copy(update={"state": "blocked", "block_reason": reason})


def discard(
    core: Core, scope: str, session_id: str, turn_id: str, owner: str | None = None, lease_seconds: float = 0.0
) -> bool:
    """Delete an intent that is still only admitted (a failed, aborted or errored attempt); with ``owner``,
    only while that attempt holds its lease (a retry may have taken the turn over since) and no attempt
    a retry took the turn from lives: the turn goes to the most recent live one then, and an attempt a
    retry took the turn from leaves the list of them (``give_up``; False: nothing deleted)."""
    if owner is None:
        return core.run(_DELETE_ADMITTED, _turn_params(scope, session_id, turn_id)).rowcount == 1
    return discard_owned(core, scope, session_id, turn_id, owner, lease_seconds) == "discarded"


def discard_owned(
    core: Core, scope: str, session_id: str, turn_id: str, owner: str, lease_seconds: float
) -> GiveUp:
    """``discard`` with an owner, telling what became of the turn (``give_up``'s outcomes)."""
    # The common failure (no retry took the turn from anyone): one statement.
    if core.run(_DELETE_OWNED_ALONE, _turn_params(scope, session_id, turn_id, b_owner=owner)).rowcount == 1:
        return "discarded"
    return give_up(core, scope, session_id, turn_id, owner, lease_seconds)


def renew_lease(core: Core, scope: str, session_id: str, turn_id: str, owner: str, lease_seconds: float) -> bool:
    """Extend a running turn's worker lease from now (False: the turn is no longer this owner's)."""
    ts = now_us()
    q = _UPDATE_ADMITTED.where(outbox.c.lease_owner == owner)
    return core.conn.execute(
        q.values(lease_expires_us=ts + int(lease_seconds * 1_000_000), updated_us=ts),
        _turn_params(scope, session_id, turn_id),
    ).rowcount == 1


RenewalOutcome = Literal["renewed", "taken over", "gone"]


def renewal(core: Core, scope: str, session_id: str, turn_id: str, owner: str, lease_seconds: float) -> RenewalOutcome:
    """``renew_lease``, telling a turn another attempt holds now ("taken over": it may be handed back)
    from one that is no longer running at all ("gone": discarded, or completed).

    An attempt a retry took the turn over from renews its lease where the intent keeps it
    (``displaced_leases``): the turn is not abandoned while it runs. Once the attempt holding the turn is
    gone (a retry that died without handing it back: its lease ran out, or its process left this
    machine), the most recent live displaced attempt takes the turn back ("renewed"); an older one keeps
    renewing its own lease meanwhile, and takes the turn back in turn should that one be gone too."""
    if renew_lease(core, scope, session_id, turn_id, owner, lease_seconds):
        return "renewed"
    row = get_row(core, scope, session_id, turn_id, lock=True)
    if row is None or row.state != "admitted":
        return "gone"
    leases = parse_displaced(row.displaced_leases)
    if all(o != owner for o, _ in leases):
        return "taken over"
    ts = now_us()
    expires = ts + int(lease_seconds * 1_000_000)
    # This attempt's own lease is renewed even if it ran out meanwhile (as ``renew_lease`` renews a
    # holder's): its worker is alive, since it renews. The other abandoned ones are pruned.
    kept = [(o, expires if o == owner else e) for o, e in leases if o == owner or not abandoned(o, e, ts)]
    # Written only over the row as read (on PostgreSQL it is locked besides): a retry that took the turn
    # over, a hand-back or another attempt's renewal since would be undone.
    q = _UPDATE_ADMITTED.where(
        outbox.c.lease_owner == row.lease_owner,
        outbox.c.lease_expires_us.is_not_distinct_from(row.lease_expires_us),
        outbox.c.displaced_leases == row.displaced_leases,
    )
    params = _turn_params(scope, session_id, turn_id)
    if kept[-1][0] == owner and abandoned(row.lease_owner, row.lease_expires_us, ts):
        back = {"lease_owner": owner, "lease_expires_us": expires, "displaced_leases": _dump_displaced(kept[:-1])}
        if core.conn.execute(q.values(updated_us=ts, **back), params).rowcount:
            log.warning("turn %s of session %s: the attempt that took it over is gone; taken back by %s",
                        turn_id, session_id, owner)
            return "renewed"
        return "taken over"
    core.conn.execute(q.values(displaced_leases=_dump_displaced(kept), updated_us=ts), params)
    return "taken over"


def renew_claim(
    core: Core, scope: str, session_id: str, turn_id: str, owner: str, lease_seconds: float
) -> RenewalOutcome:
    """Extend a drain's claim of a ready row from now, while its delivery runs ("gone": the claim
    changed hands or the row was completed or blocked; a claim is never handed back)."""
    ts = now_us()
    q = update(outbox).where(_BY_TURN, outbox.c.state == "ready", outbox.c.lease_owner == owner)
    renewed = core.conn.execute(
        q.values(lease_expires_us=ts + int(lease_seconds * 1_000_000), updated_us=ts),
        _turn_params(scope, session_id, turn_id),
    ).rowcount == 1
    return "renewed" if renewed else "gone"


GiveUp = Literal["handed", "discarded", "left", "none"]


def give_up(core: Core, scope: str, session_id: str, turn_id: str, owner: str, lease_seconds: float) -> GiveUp:
    """The attempt ``owner`` ended without completing its turn: what becomes of the turn's intent.

    While ``owner`` holds the turn, it goes to the most recent live attempt a retry took it from (the
    intent's ``displaced_leases``): that attempt may still be running (a retry is presented when the
    first worker only looks slow), and its work is the turn's ("handed"; its lease runs at least
    ``lease_seconds`` from now, renewed by its keeper within that time if its worker lives). With none
    alive (an attempt that ended left the list; one whose worker is gone is pruned), the intent is
    deleted ("discarded"). An attempt a retry took the turn from leaves the list ("left"): the turn must
    never be handed to an attempt that is over. "none": no admitted intent, or nothing of ``owner``'s."""
    row = get_row(core, scope, session_id, turn_id, lock=True)
    if row is None or row.state != "admitted":
        return "none"
    ts = now_us()
    leases = parse_displaced(row.displaced_leases)
    kept = _live(leases, ts, without=owner)
    params = _turn_params(scope, session_id, turn_id, b_owner=owner)
    if row.lease_owner != owner:
        if all(o != owner for o, _ in leases):
            return "none"
        q = _UPDATE_ADMITTED.where(
            outbox.c.lease_owner == row.lease_owner, outbox.c.displaced_leases == row.displaced_leases
        )
        core.conn.execute(q.values(displaced_leases=_dump_displaced(kept), updated_us=ts), params)
        return "left"
    if not kept:
        core.run(_DELETE_OWNED, params)
        return "discarded"
    to_owner, to_expires = kept[-1]
    expires = max(to_expires, ts + int(lease_seconds * 1_000_000))
    q = _UPDATE_ADMITTED.where(outbox.c.lease_owner == owner).values(
        lease_owner=to_owner, lease_expires_us=expires, displaced_leases=_dump_displaced(kept[:-1]), updated_us=ts
    )
    core.conn.execute(q, params)
    return "handed"


def hand_back(core: Core, scope: str, session_id: str, turn_id: str, owner: str, lease_seconds: float) -> bool:
    """Give a turn that ``owner`` took over to the most recent live attempt it was taken from (see
    ``give_up``), only while ``owner`` holds it. False: not handed (discarded when none of those attempts
    lives; left when ``owner`` no longer holds it)."""
    return give_up(core, scope, session_id, turn_id, owner, lease_seconds) == "handed"


def reassign(
    core: Core, scope: str, session_id: str, turn_id: str, engine_id: str, owner: str | None = None
) -> bool:
    """Hand a still only admitted turn to another engine (the host's turn-local degradation), keeping
    its admission and so the session: discarding and admitting again would let another turn in.

    With ``owner``, only while that attempt holds the turn: a retry that took it over (another worker,
    another thread) is running on its engine, and is ``SessionBusy`` for this one. Unless that retry is
    gone and ``owner`` is the most recent live attempt it was taken from: the turn is ``owner``'s again
    (as its keeper's next renewal would make it), and reassigned. False: no admitted intent (the next
    admission writes one)."""
    row = get_row(core, scope, session_id, turn_id, lock=True)
    if row is None or row.state != "admitted":
        return False
    ts = now_us()
    back: dict[str, Any] = {}
    if owner is not None and row.lease_owner != owner:
        live = _live(parse_displaced(row.displaced_leases), ts)
        if not (live and live[-1][0] == owner and abandoned(row.lease_owner, row.lease_expires_us, ts)):
            raise SessionBusy(session_id, turn_id, AdmittedLease.of(row).busy_until())
        back = {"lease_owner": owner, "lease_expires_us": live[-1][1], "displaced_leases": _dump_displaced(live[:-1])}
    q = _UPDATE_ADMITTED.values(engine_id=engine_id, updated_us=ts, **back)
    return core.conn.execute(q, _turn_params(scope, session_id, turn_id)).rowcount == 1


def discard_abandoned(core: Core, scope: str, session_id: str, lease: AdmittedLease) -> bool:
    """Recovery's discard of an abandoned admitted intent: only while it still holds the leases that
    recovery saw (a retrying worker may have taken the turn over since, with a lease of its own; the
    attempt a retry took it from may have renewed its lease since)."""
    params = _turn_params(
        scope, session_id, lease.turn_id, b_owner=lease.owner, b_expires=lease.expires_us, b_displaced=lease.displaced
    )
    return core.run(_DELETE_ABANDONED, params).rowcount == 1


def discard_unless_running(core: Core, scope: str, session_id: str, turn_id: str) -> AdmittedLease | None:
    """Discard a turn's admitted intent whose workers are gone (``AdmittedLease.abandoned``); the lease of
    one whose worker lives is returned instead, and nothing written. None: discarded, or no admitted intent."""
    row = get_row(core, scope, session_id, turn_id, lock=True)
    if row is None or row.state != "admitted":
        return None
    lease = AdmittedLease.of(row)
    if not lease.abandoned(now_us()):
        return lease
    discard_abandoned(core, scope, session_id, lease)
    return None


def complete(core: Core, scope: str, session_id: str, turn_id: str, owner: str | None = None) -> bool:
    """Delete a delivered intent (only the lease owner's claim, when an owner is given)."""
    q = _COMPLETE if owner is None else _COMPLETE_OWNED
    return core.run(q, _turn_params(scope, session_id, turn_id, b_owner=owner)).rowcount == 1


def delete_turn(core: Core, scope: str, session_id: str, turn_id: str) -> bool:
    """Delete a turn's row whatever its state (the fast completion, which holds the row's lock)."""
    return core.run(_DELETE_TURN, _turn_params(scope, session_id, turn_id)).rowcount == 1


def turn_is_clear(core: Core, scope: str, session_id: str, turn_id: str) -> bool:
    """True when a new turn can be admitted without recovery first (the common case, one statement).

    Clear: the session's outbox holds no intent but blocked ones (nothing to discard, capture, drain
    or wait for), and neither the outbox nor the ledger knows this turn id (not a retry).
    """
    return core.run(_TURN_PRECHECK, _turn_params(scope, session_id, turn_id)).first() is None


def pending(core: Core, scope: str, session_id: str, engine_id: str | None = None) -> list[TurnIntent]:
    """Every non-blocked intent of a session (of one engine, when given), in enqueue order."""
    q = _PENDING if engine_id is None else _PENDING_OF_ENGINE
    return [_intent(core, r) for r in core.run(q, session_params(scope, session_id, b_engine=engine_id))]


#: an intent's place in the listing: (scope, session, enqueue seq, turn); a page's ``next`` encodes it
IntentKey = tuple[str, str, int, str]
#: intents a page holds unless asked for fewer, and at most
DEFAULT_INTENTS_PAGE = 1000
MAX_INTENTS_PAGE = 10_000
#: Format 2 names the listing the cursor was issued by: "scope" (of the place's own scope) or "all" (of every
#: scope). Format 1 (``tsi1.``) did not, so one listing's cursor was taken by the other; it named no stable
#: format (README: an opaque cursor), and is refused as a cursor of no known listing: start it again.
_INTENT_CURSOR = "tsi2."
_INTENT_CURSOR_V1 = "tsi1."
_LISTINGS = ("scope", "all")
# The longest cursor a page gives: three ids of at most MAX_ID_CHARS characters, each at most 12 characters of
# ASCII JSON (one past the BMP is a surrogate pair of escapes; ids an earlier release stored may pass the
# 640-byte limit of new ones), the listing and a seq, in base64 (4 characters per 3 bytes). 8 * MAX_ID_CHARS
# refused the cursor of long non-ASCII ids.
_MAX_CURSOR_CHARS = len(_INTENT_CURSOR) + 4 * -(
    -(3 * (12 * MAX_ID_CHARS + 2) + len(str(MAX_INT)) + max(len(x) + 3 for x in _LISTINGS) + 5) // 3
)


class IntentPage(BaseModel):
    """Up to ``limit`` outbox rows in listing order (scope, session, enqueue order); ``next``: the cursor of
    the last one when more may follow (pass it as ``after``), None on the last page."""

    model_config = ConfigDict(frozen=True)
    intents: list[TurnIntent]
    next: str | None


def _listing(scope: str | None) -> str:
    return "all" if scope is None else "scope"


def intent_cursor(intent: TurnIntent, scope: str | None) -> str:
    """The ``after`` cursor of an intent in the listing of ``scope`` (None: of every scope): its place there,
    an opaque token that names that listing."""
    return _encode_place(_listing(scope), [intent.scope, intent.session_id, intent.enqueue_seq, intent.turn_id])


def _encode_place(listing: str, key: list[object]) -> str:
    body = json.dumps([listing, *key], separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return _INTENT_CURSOR + base64.urlsafe_b64encode(body).decode("ascii").rstrip("=")


def parse_intent_cursor(after: object, scope: str | None) -> IntentKey:
    """The place an intent cursor of the listing of ``scope`` (None: of every scope) names; InvalidInput for
    anything that is not one a page of that very listing gave."""
    if not isinstance(after, str):
        raise InvalidInput(f"after must be a string, not {type(after).__name__}")
    if after.startswith(_INTENT_CURSOR_V1):
        raise InvalidInput("after is an intent cursor of an earlier release, which named no listing: "
                           "start the listing again (after=None)")
    bad = InvalidInput("after is not an intent cursor (pass a page's next)")
    if not after.startswith(_INTENT_CURSOR) or len(after) > _MAX_CURSOR_CHARS:
        raise bad
    body = after[len(_INTENT_CURSOR):]
    try:
        key = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("ascii"))
    except (ValueError, binascii.Error):
        raise bad from None
    if not (isinstance(key, list) and len(key) == 5 and key[0] in _LISTINGS and isinstance(key[3], int)
            and not isinstance(key[3], bool) and 0 <= key[3] <= MAX_INT):
        raise bad
    listing, place_scope, session_id, seq, turn_id = key
    for what, value in (("scope", place_scope), ("session_id", session_id), ("turn_id", turn_id)):
        check_id(f"after's {what}", value)
    if _encode_place(listing, [place_scope, session_id, seq, turn_id]) != after:
        raise bad  # one token per place: only the canonical one a page gave
    if listing != _listing(scope):
        theirs, ours = ("one scope's", "every scope's") if scope is None else ("every scope's", "one scope's")
        raise InvalidInput(f"after is a cursor of {theirs} listing, not of {ours}")
    if scope is not None and place_scope != scope:
        raise InvalidInput("after is a cursor of another scope's listing")
    parsed: IntentKey = (place_scope, session_id, seq, turn_id)
    return parsed


def check_intents_limit(limit: object) -> int:
    """An intent listing's size, 1..MAX_INTENTS_PAGE; InvalidInput for anything else."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_INTENTS_PAGE:
        raise InvalidInput(f"limit must be an integer in 1..{MAX_INTENTS_PAGE}, got {limit!r}")
    return limit


def list_intents(
    core: Core, scope: str | None = None, limit: int = DEFAULT_INTENTS_PAGE, *, after: IntentKey | None = None
) -> list[TurnIntent]:
    """Every intent (all states), by scope, session and enqueue order (the turn id breaks a tie); those after
    the listing place ``after`` only."""
    q = select(outbox)
    if scope is not None:
        q = q.where(outbox.c.scope == scope)
    if after is not None:
        # Keyset: each page starts where the last one ended, whatever rows come and go meanwhile (an
        # operator's listing, off every turn's path: no index of its own, the key's session prefix).
        place = tuple_(outbox.c.scope, outbox.c.session_id, outbox.c.enqueue_seq, outbox.c.turn_id)
        q = q.where(place > tuple_(*(literal(v) for v in after)))
    q = q.order_by(outbox.c.scope, outbox.c.session_id, outbox.c.enqueue_seq, outbox.c.turn_id).limit(limit)
    return [_intent(core, r) for r in core.conn.execute(q)]


def intents_page(
    core: Core, scope: str | None = None, *, after: IntentKey | None = None, limit: int = DEFAULT_INTENTS_PAGE
) -> IntentPage:
    """A page of ``list_intents``: at most ``limit`` intents after ``after``, and the cursor of the next."""
    rows = list_intents(core, scope, limit + 1, after=after)
    page = rows[:limit]
    return IntentPage.model_construct(intents=page, next=intent_cursor(page[-1], scope) if len(rows) > limit else None)


# ---------------------------------------------------------------------------------------------- drain

Deliver = Callable[[TurnIntent], CommitResult]
Observer = Callable[[TurnIntent, CommitResult], None]


@dataclass
class DrainReport:
    """What one drain did."""

    committed: int = 0
    duplicates: int = 0
    blocked: int = 0
    failed: list[tuple[str, str, str]] = field(default_factory=list)  # (session, turn, error)
    #: (session, turn) of each row this drain committed (status ``committed``, not ``duplicate``)
    committed_turns: list[tuple[str, str]] = field(default_factory=list)
    stopped_sessions: list[str] = field(default_factory=list)

    @property
    def delivered(self) -> int:
        """Rows completed (committed or duplicate)."""
        return self.committed + self.duplicates


Group = tuple[str, str, str]  # scope, session, engine


def drainable_groups(core: Core, scope: str | None, session_id: str | None) -> list[Group]:
    """(scope, session, engine) groups with accepted or ready rows."""
    q = select(outbox.c.scope, outbox.c.session_id, outbox.c.engine_id).where(
        outbox.c.state.in_(("accepted", "ready")), _queued(outbox)
    )
    if scope is not None:
        q = q.where(outbox.c.scope == scope)
    if session_id is not None:
        q = q.where(outbox.c.session_id == session_id)
    return sorted({(r.scope, r.session_id, r.engine_id) for r in core.conn.execute(q.distinct())})


def claim_head(
    core: Core, group: Group, owner: str, lease_seconds: float, blocked: list[tuple[str, int]] | None = None
) -> TurnIntent | str:
    """Claim the head row of a group for delivery, or say why the group cannot advance now.

    Each row it blocks on the way goes to ``blocked``: (turn id, the ``updated_us`` written with the
    block, drawn in this transaction), which tells a retry its own landed block from another drain's."""
    scope, session_id, engine_id = group
    while True:
        head = core.conn.execute(
            select(outbox)
            .where(
                outbox.c.scope == scope,
                outbox.c.session_id == session_id,
                outbox.c.engine_id == engine_id,
                _queued(outbox),
            )
            .order_by(outbox.c.enqueue_seq)
            .limit(1)
        ).first()
        if head is None:
            return "empty"
        if head.state == "admitted":
            return "in_progress"
        q = select(outbox).where(_key(scope, session_id, head.turn_id))
        if not core.dialect.is_sqlite:
            # Never skip to the next row: a locked head means "someone is on this session now".
            q = q.with_for_update(skip_locked=True)
        row = core.conn.execute(q).first()
        if row is None:
            return "locked"
        if row.state == "blocked":  # blocked (by hand) since the head was read: never claimed
            continue
        # A drain claim's owner is "<process identity>/<token>": a claim of a process gone from this
        # machine is free at once, as an admitted turn's lease is (``abandoned``), not a lease later.
        # (An accepted row holds no claim: acceptance clears the lease.)
        ts = now_us()
        live = row.lease_expires_us is not None and row.lease_expires_us > ts
        other = row.lease_owner is not None and row.lease_owner != owner
        if other and live and not _gone_here(row.lease_owner):
            return "leased"
        intent = _intent(core, row)
        if intent.state == "accepted":
            intent = capture(core, intent, at=ts)
            if intent.state == "accepted":
                return "projection_unavailable"
        elif intent.terminal is not None:
            # Captured by an earlier drain whose delivery failed: the transcript may have changed since
            # (rewritten, branched away), and the ledger then refuses the turn at every delivery, holding
            # the engine's later turns of the session back for good. It is checked again as an accepted
            # row is, and blocked for the same reasons (a drain, not the fast completion: off the hot path).
            check = read_closed_range(core, intent.admission.anchor, intent.terminal)
            if not isinstance(check, ClosedRange) and check.reason != "projection_unavailable":
                intent = _block_range(core, intent, check, ts)
            elif isinstance(check, ClosedRange) and (other := _other_turn_in(check)) is not None:
                # A message of its range was admitted (bound to a key) as another turn since it was
                # captured: the ledger refuses it at every delivery, as in ``capture_range``.
                intent = _block(core, intent, _overlap_reason(other), ts)
        if intent.state == "blocked":
            if blocked is not None:
                blocked.append((intent.turn_id, ts))
            continue
        expires = ts + int(lease_seconds * 1_000_000)
        core.conn.execute(
            update(outbox)
            .where(_key(scope, session_id, head.turn_id))
            .values(lease_owner=owner, lease_expires_us=expires, last_attempt_us=ts, updated_us=ts)
        )
        return intent.model_copy(update={"lease_owner": owner, "lease_expires_at": from_us(expires)})


#: most characters of an operator's reason kept with a row blocked by hand
MAX_BLOCK_REASON = 500
#: the longest lease owner (the column's width)
MAX_OWNER = 128


def block(core: Core, scope: str, session_id: str, turn_id: str, reason: str) -> TurnIntent:
    """Block a queued turn by hand: never delivered; the turns after it of its engine go on.

    For a turn its engine can never take (every delivery fails the same way), which would otherwise
    hold the later turns of that engine and session back for good. Only accepted or ready rows that
    no drain is delivering right now; blocking a blocked row again changes nothing.
    """
    row = get_row(core, scope, session_id, turn_id, lock=True)
    if row is None:
        raise UnknownTurn(session_id, turn_id)
    intent = _intent(core, row)
    if intent.state == "blocked":
        return intent
    if intent.state == "admitted":
        raise InvalidInput(f"turn {turn_id!r} is still running (admitted): it completes or is discarded")
    ts = now_us()
    # A claim of a process provably gone from this machine is no delivery (a drain takes it over at once,
    # ``claim_head``): the turn an operator blocks is often the one whose delivery kills the drain.
    live = row.lease_owner is not None and row.lease_expires_us is not None and row.lease_expires_us > ts
    if live and not _gone_here(row.lease_owner):
        raise InvalidInput(f"turn {turn_id!r} is being delivered now (claimed by {row.lease_owner}); try again")
    why = f"blocked by hand: {reason}"
    core.conn.execute(
        update(outbox)
        .where(_key(scope, session_id, turn_id))
        .values(state="blocked", block_reason=why, lease_owner=None, lease_expires_us=None, updated_us=ts)
    )
    log.warning("turn %s of session %s blocked by hand: %s", turn_id, session_id, reason)
    return intent.model_copy(update={"state": "blocked", "block_reason": why, "lease_owner": None,
                                     "lease_expires_at": None})


def record_failure(core: Core, intent: TurnIntent, owner: str, error: str, at: int) -> bool:
    """Keep a failed row queued: attempt_count + 1, the error, the claim released (False: the row is no
    longer this claim's: gone with its session, or taken over).

    ``at`` (``now_us()``, drawn before the transaction) is the failure's time: a retry after an uncertain
    COMMIT finds the claim released by its own earlier attempt, and tells that record by it (True)."""
    done = core.conn.execute(
        update(outbox)
        .where(_key(intent.scope, intent.session_id, intent.turn_id), outbox.c.lease_owner == owner)
        .values(
            attempt_count=outbox.c.attempt_count + 1,
            last_error=error[:2000],
            last_attempt_us=at,
            lease_owner=None,
            lease_expires_us=None,
            updated_us=at,
        )
    )
    if done.rowcount == 1:
        return True
    row = get_row(core, intent.scope, intent.session_id, intent.turn_id)
    return row is not None and row.lease_owner is None and row.last_attempt_us == at and row.last_error == error[:2000]


def block_other_version(core: Core, intent: TurnIntent, owner: str, payload_hash: str, error: str, at: int) -> bool:
    """After a failed delivery: block the claimed row when its engine's ledger holds its key committed
    with another payload (True), else write nothing (False: a failure like any other).

    ``commit_turn`` called directly for a queued turn's key, with another version of the turn (another
    terminal, a heartbeat), receipts that version: the turn reached the engine once, as that version.
    The queued version then collides with the receipt at every delivery; retried, it held the engine's
    later turns of the session back for good (until ``outbox block``). It is settled here instead, in a
    terminal state that is counted (``DrainReport.blocked``) and shown (``outbox status``), never dropped.
    Read only on a failed delivery: a delivery that succeeds reads no receipt for it."""
    receipt = get_receipt(core, intent.scope, intent.session_id, intent.engine_id, intent.turn_id)
    if receipt is None or receipt.payload_hash == payload_hash:
        return False
    theirs = _version(receipt.terminal_entry_id, receipt.message_count, receipt.is_heartbeat)
    terminal = intent.terminal.entry_id if intent.terminal else None
    ours = _version(terminal, len(intent.messages or ()), intent.is_heartbeat)
    reason = (f"committed_other_version: engine {intent.engine_id!r} committed turn {intent.turn_id!r} as another "
              f"version ({theirs}); this one ({ours}) can never be delivered")
    done = core.conn.execute(
        update(outbox)
        .where(_key(intent.scope, intent.session_id, intent.turn_id), outbox.c.lease_owner == owner)
        .values(
            state="blocked", block_reason=reason, attempt_count=outbox.c.attempt_count + 1, last_error=error[:2000],
            last_attempt_us=at, lease_owner=None, lease_expires_us=None, updated_us=at,
        )
    )
    if done.rowcount != 1:
        return False  # no longer this claim's: ``record_failure`` tells what became of it
    log.warning("turn %s of session %s blocked: %s", intent.turn_id, intent.session_id, reason)
    return True


def _version(terminal_id: str | None, count: int, heartbeat: bool) -> str:
    """A version of a turn, as a block reason names it."""
    return f"terminal {terminal_id!r}, {count} messages, heartbeat {heartbeat}"


@dataclass(frozen=True)
class AdmittedLease:
    """An admitted intent's worker lease, as recovery read it."""

    turn_id: str
    owner: str | None
    expires_us: int | None
    #: the row's ``displaced_leases`` as read (see ``_take_over``): the leases of the live attempts retries
    #: took the turn over from, JSON; None when no attempt was displaced
    displaced: str | None = None

    @classmethod
    def of(cls, row: Row[Any]) -> AdmittedLease:
        """The leases of an outbox row (``_ADMITTED``'s columns, or the whole row)."""
        return cls(row.turn_id, row.lease_owner, row.lease_expires_us, row.displaced_leases)

    def displaced_leases(self) -> list[Lease]:
        """The displaced attempts' leases, (owner, expires_us), oldest first."""
        return parse_displaced(self.displaced)

    def abandoned(self, now: int) -> bool:
        """Whether the turn's workers are all gone: its holder's, and every displaced attempt's."""
        return abandoned(self.owner, self.expires_us, now) and all(
            abandoned(o, e, now) for o, e in self.displaced_leases()
        )

    def busy_until(self) -> datetime | None:
        """When the last of its live leases runs out (what ``SessionBusy`` tells), or None."""
        now = now_us()
        leases = [(self.owner, self.expires_us), *self.displaced_leases()]
        ends = [e for o, e in leases if e is not None and not abandoned(o, e, now)]
        ends = ends or [e for _, e in leases if e is not None]
        return from_us(max(ends)) if ends else None


def busy_until(core: Core, scope: str, session_id: str, turn_id: str) -> datetime | None:
    """When the last live lease of a turn's admitted intent runs out (``AdmittedLease.busy_until``), or None."""
    row = get_row(core, scope, session_id, turn_id)
    return None if row is None or row.state != "admitted" else AdmittedLease.of(row).busy_until()


def abandoned_admitted(core: Core, scope: str, session_id: str) -> list[AdmittedLease]:
    """Admitted-only intents of a session whose workers are all gone (``AdmittedLease.abandoned``), in
    enqueue order."""
    now = now_us()
    leases = [AdmittedLease.of(r) for r in core.run(_ADMITTED, session_params(scope, session_id)).all()]
    return [lease for lease in leases if lease.abandoned(now)]
