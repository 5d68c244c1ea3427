"""The engine-side commit ledger: ``commit_turn`` as ONE atomic, idempotent write (atomic-idempotent-v1).

The receipt row is the idempotency: its primary key is (session, advancement key, engine) and it is
inserted before anything else is written, so two racing commits of one key serialize on that key;
the loser finds the winner's receipt. The canonical payload hash turns a reused key with other content into
``AdvancementKeyCollision`` instead of a silent no-op. The engine's own state rides in the same
transaction (``apply``), so after a crash the receipt, the messages and the engine state agree.

A turn is committed under one key: its admitted entry's logical turn id. An entry admitted without one
(appended, or mirrored from a host's transcript) takes the first key it is committed under as its turn
id, in the commit's transaction; another key for it, or a key that is another entry's turn id, is
``TurnKeyConflict`` (else one turn under two keys would reach the engine twice).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from sqlalchemy import Select, String, and_, bindparam, func, literal_column, or_, select, text, true, update
from sqlalchemy.sql.selectable import TextualSelect

from . import faults
from .core import (
    ENTRY_COLUMNS,
    MAX_ID_CHARS,
    Core,
    by_session,
    check_anchor,
    check_id,
    decode_stored,
    now_us,
    same_json,
    session_params,
    stored_text,
)
from .errors import AdvancementKeyCollision, InvalidInput, PayloadTooLarge, TurnKeyConflict, UnknownSession
from .fences import MAX_TURN_BYTES, MAX_TURN_EVENTS, of_another_incarnation
from .models import Admission, Anchor, canonical_json, validate_message
from .schema import engine_state, entries, receipts, sessions, turn_messages

# The statements of every commit are built once (see core.py, "hot statements": building a statement
# costs more CPU than executing it from SQLAlchemy's compiled cache).
#: the ledger's own references into the transcript, not fields of the Receipt
_REFERENCES = ("admission_seq", "terminal_seq", "message_seqs")


def _entry_id_of(stored: Any, seq: Any) -> Any:
    """A receipt's anchor entry id: the stored one (a receipt from before revision 0017), else the id of
    the entry at its seq, one probe of the entries' primary key (entries are immutable).

    Shaped as ``core._ENTRY_BY_SEQ``, the first entry from that seq on in seq order under a LIMIT: with an
    equality on the seq, on PostgreSQL tables never analyzed, the planner took the entry-id index (the
    same two leading columns) and filtered the session's entries on the seq (2,005 rows removed at 2,000
    entries, per receipt read); only the primary key gives that order without a sort."""
    at = (
        select(entries.c.entry_id)
        .where(
            entries.c.scope == receipts.c.scope, entries.c.session_id == receipts.c.session_id,
            entries.c.seq >= seq, entries.c.seq <= seq,
        )
        .order_by(entries.c.seq)
        .limit(literal_column("1"))
    )
    return func.coalesce(stored, at.scalar_subquery()).label(stored.name)


#: the Receipt's fields, as every read of the ledger selects them
_RECEIPT_COLUMNS = [
    _entry_id_of(c, receipts.c.admission_seq) if c.name == "admission_entry_id"
    else _entry_id_of(c, receipts.c.terminal_seq) if c.name == "terminal_entry_id"
    else c
    for c in receipts.c
    if c.name not in _REFERENCES
]
_RECEIPT = select(*_RECEIPT_COLUMNS).where(
    by_session(receipts),
    receipts.c.engine_id == bindparam("b_engine"),
    receipts.c.advancement_key == bindparam("b_key"),
)
_RECEIPTS_FOR_KEY = select(*_RECEIPT_COLUMNS).where(
    by_session(receipts), receipts.c.advancement_key == bindparam("b_key")
)
_MESSAGE_SEQS = select(receipts.c.message_seqs, receipts.c.admission_seq, receipts.c.terminal_seq).where(
    by_session(receipts),
    receipts.c.engine_id == bindparam("b_engine"),
    receipts.c.advancement_key == bindparam("b_key"),
)
# The entries a turn can be made of: its messages are a parent chain from the terminal back to the
# admission, and a child always has a larger raw seq than its parent, so the chain lies in this range
# (which holds nothing else unless another branch was written into the session during the turn).
#
# Every read of a seq range is in seq order: on PostgreSQL tables never analyzed (a new deployment,
# autovacuum off or behind) the entry-id index (same two leading columns) looked as cheap as the
# primary key for a range of seqs, and the planner walked the session's whole entry-id range filtering
# on the seq (1,998 rows removed for a 2-message turn at 2,000 entries). In seq order only the primary
# key needs no sort. tests/test_pg_plans.py checks every statement of a commit that way.
_RANGE_ROWS = (
    select(*ENTRY_COLUMNS)
    .where(by_session(entries), entries.c.seq >= bindparam("b_from"), entries.c.seq <= bindparam("b_to"))
    .order_by(entries.c.seq)
)
# The same range, locking the session's row in the same statement (when the transaction does not hold
# it yet: a commit_turn of its own): one round trip instead of two. The outer join returns one row
# of NULLs for an existing session with no entry in the range, and nothing for an unknown session.
# On PostgreSQL the range is a LATERAL subquery in seq order under a written-out LIMIT (the range
# check caps it at MAX_TURN_EVENTS + 1 rows): a plain outer join left the planner free to take the
# entry-id index and filter the session's entries on the seq (see _RANGE_ROWS); a LIMIT keeps the
# subquery from being pulled up into the join. SQLite, which has no LATERAL, looks the key up anyway.
def _range_rows_locking(lateral: bool) -> Select[Any]:
    session_columns = (
        sessions.c.session_key.label("s_session_key"),
        sessions.c.generation.label("s_generation"),
        sessions.c.incarnation.label("s_incarnation"),
        sessions.c.created_us.label("s_created_us"),
    )
    if not lateral:
        in_range = and_(
            entries.c.scope == sessions.c.scope,
            entries.c.session_id == sessions.c.session_id,
            entries.c.seq >= bindparam("b_from"),
            entries.c.seq <= bindparam("b_to"),
        )
        joined = sessions.outerjoin(entries, in_range)
        return select(*ENTRY_COLUMNS, *session_columns).select_from(joined).where(by_session(sessions)).with_for_update(
            of=sessions
        )
    rng = (
        select(*ENTRY_COLUMNS)
        .where(
            entries.c.scope == sessions.c.scope,
            entries.c.session_id == sessions.c.session_id,
            entries.c.seq >= bindparam("b_from"),
            entries.c.seq <= bindparam("b_to"),
        )
        .order_by(entries.c.seq)
        .limit(literal_column(str(MAX_TURN_EVENTS + 1)))
        .lateral("rng")
    )
    columns = [rng.c[c.key] for c in ENTRY_COLUMNS]
    return (
        select(*columns, *session_columns)
        .select_from(sessions.outerjoin(rng, true()))
        .where(by_session(sessions))
        .with_for_update(of=sessions)
    )


#: PostgreSQL -> the locking range read
_RANGE_ROWS_LOCKING = {pg: _range_rows_locking(lateral=pg) for pg in (False, True)}
# Binding an admitted entry without a logical turn id to the key it is first committed under.
_TURN_ENTRY = select(entries.c.seq).where(by_session(entries), entries.c.turn_id == bindparam("b_key"))
# Both unique keys of the entry: whichever index the planner picks, the lookup is all index condition
# (with the seq alone, on tables never analyzed, it took the entry-id index and filtered on the seq).
_ONE_ENTRY = and_(by_session(entries), entries.c.seq == bindparam("b_seq"), entries.c.entry_id == bindparam("b_entry"))
_CLAIM_TURN = update(entries).where(_ONE_ENTRY, entries.c.turn_id.is_(None)).values(turn_id=bindparam("b_key"))
_TURN_ID_AT = select(entries.c.turn_id).where(_ONE_ENTRY)
# The last admission bound to a key before an entry being bound to one, and the seqs its receipts hold:
# whether that entry is already one of their messages. Only that admission's turn can: a committed
# range holds no other bound admission (``_check_range``), so an earlier turn's range ends before it.
# With statistics the planner walks the primary key back from the entry (a few rows in a session of
# turns) or reads the partial turn-id index (a mirror's long stretches of entries without turn ids);
# on PostgreSQL tables never analyzed it may read all of the session's bound admissions (one per turn).
# Not a forced backward walk: that read a mirror's whole imported history (5,215 rows at 5,000). Not an
# index of the bound admissions in seq order either (one probe): measured, its entry a turn took the
# bytes a message on PostgreSQL from 1.30x to 1.305x raw (issue 7's target is 1.3x), for a walk that is
# long only once, at the first commit after a long stretch without turn ids.
_LAST_BOUND = (
    select(entries.c.turn_id)
    .where(
        by_session(entries),
        entries.c.seq >= bindparam("b_from"),
        entries.c.seq < bindparam("b_to"),
        entries.c.turn_id.is_not(None),
    )
    .order_by(entries.c.seq.desc())
    .limit(literal_column("1"))
)
_HELD_SEQS = select(receipts.c.message_seqs, receipts.c.admission_seq, receipts.c.terminal_seq).where(
    by_session(receipts), receipts.c.advancement_key == bindparam("b_key")
)
_RANGE_PAYLOADS = (
    select(entries.c.seq, entries.c.payload)
    .where(by_session(entries), entries.c.seq >= bindparam("b_from"), entries.c.seq <= bindparam("b_to"))
    .order_by(entries.c.seq)  # in seq order: the primary key (see _RANGE_ROWS)
)
_STATE = select(engine_state.c.value).where(
    by_session(engine_state),
    engine_state.c.engine_id == bindparam("b_engine"),
    engine_state.c.key == bindparam("b_key"),
)
#: dialect name -> INSERT .. ON CONFLICT DO NOTHING RETURNING of a receipt
_INSERT_RECEIPT: dict[str, Any] = {}


class Receipt(BaseModel):
    """One ledger row: what was committed under an advancement key."""

    model_config = ConfigDict(frozen=True)
    scope: str
    session_id: str
    engine_id: str
    advancement_key: str
    payload_hash: str
    admission_entry_id: str
    terminal_entry_id: str
    message_count: int
    is_heartbeat: bool
    committed_us: int


class ReceiptPage(BaseModel):
    """Up to ``limit`` receipts of one engine in a session, in advancement-key order; ``next``: the cursor
    of the last one when more may follow (pass it as ``after``), None on the last page."""

    model_config = ConfigDict(frozen=True)
    receipts: list[Receipt]
    next: str | None


class CommitResult(BaseModel):
    """``committed`` on the first write of a key, ``duplicate`` on every identical replay."""

    model_config = ConfigDict(frozen=True)
    status: Literal["committed", "duplicate"]
    receipt: Receipt


@dataclass(frozen=True)
class TurnPayload:
    """A validated turn, ready to commit: everything the hash covers."""

    engine_id: str
    advancement_key: str
    admission: Anchor
    terminal: Anchor
    messages: tuple[dict[str, Any], ...]
    is_heartbeat: bool
    payload_hash: str

    @property
    def scope(self) -> str:
        """The scope of the turn's session."""
        return self.admission.scope

    @property
    def session_id(self) -> str:
        """The turn's session."""
        return self.admission.session_id


#: Engine state hook: runs inside the commit transaction, only when the turn is newly committed.
ApplyTurn = Callable[[Core, TurnPayload], None]


def prepare_turn(
    engine_id: str,
    advancement_key: str,
    admission: Admission | Anchor,
    terminal: Anchor,
    messages: Sequence[dict[str, Any]],
    *,
    is_heartbeat: bool = False,
    messages_validated: bool = False,
) -> TurnPayload:
    """Validate a turn and compute its canonical hash; raises before anything is written.

    ``messages_validated=True`` only for messages read back from this store's transcript (a closed
    range): each was validated when it was appended, so only the turn's shape is checked here (a host
    turn validated every message three times before: on append, here, and in the commit's check).
    """
    check_id("engine_id", engine_id)
    check_id("advancement_key", advancement_key)
    if not isinstance(messages_validated, bool):
        raise InvalidInput("messages_validated must be a bool")
    turn_id: object = advancement_key
    if isinstance(admission, Admission):
        # ``getattr``: one made by ``model_construct`` may lack either field (InvalidInput, not AttributeError).
        given, turn_id = getattr(admission, "anchor", None), getattr(admission, "turn_id", None)
        check_id("admission.turn_id", turn_id)
    elif isinstance(admission, Anchor):
        given = admission
    else:
        raise InvalidInput("admission must be an Admission or its Anchor")
    anchor = check_anchor("admission", given)
    if turn_id != advancement_key:
        # The admitted entry is another logical turn's: the conflict the ledger finds for a bare anchor
        # (TurnKeyConflict), found here before anything is read.
        raise TurnKeyConflict(advancement_key, anchor.entry_id, str(turn_id))
    check_anchor("terminal", terminal)
    identity = ("scope", "session_id", "session_key", "generation")
    if any(getattr(anchor, k) != getattr(terminal, k) for k in identity):
        raise InvalidInput("admission and terminal anchors name different sessions or generations")
    if anchor.position is None or terminal.position is None or terminal.position < anchor.position:
        raise InvalidInput("terminal must be a visible message at or after the admission")
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidInput("messages must be a list of chat messages")
    expected = terminal.position - anchor.position + 1
    if len(messages) != expected:
        raise InvalidInput(f"the turn range holds {expected} messages, got {len(messages)}")
    # ``stored``: a turn's messages are its transcript entries (the commit compares them), which a store
    # from before the Chat Completions rules may hold in forms those rules refuse.
    checked = tuple(messages) if messages_validated else tuple(validate_message(m, stored=True) for m in messages)
    if checked[0].get("role") != "user":
        raise InvalidInput("the first message of a turn is the admitted user message")
    if not isinstance(is_heartbeat, bool):
        raise InvalidInput("is_heartbeat must be a bool")
    # Runtime facts (times, attempt numbers, which worker) stay out: a replay must hash the same.
    hashed = {
        "scope": anchor.scope,
        "session_id": anchor.session_id,
        "session_key": anchor.session_key,
        "admission": [anchor.entry_id, anchor.seq, anchor.position],
        "terminal": [terminal.entry_id, terminal.seq, terminal.position],
        "messages": list(checked),
        "is_heartbeat": is_heartbeat,
    }
    digest = hashlib.sha256(canonical_json(hashed).encode("utf-8")).hexdigest()
    return TurnPayload(engine_id, advancement_key, anchor, terminal, checked, is_heartbeat, digest)


def commit_turn_in(core: Core, turn: TurnPayload, apply: ApplyTurn | None = None) -> CommitResult:
    """Commit ``turn`` inside the open transaction of ``core`` (see module doc)."""
    # The range check comes first and the receipt is read only when the key turns out to be taken (the
    # insert conflicts) or the check fails: a first commit, the common case, does not read the ledger.
    # A replay of a committed turn passes the same check (entries are immutable) and then conflicts, so
    # it costs what a first commit costs, session lock included (a retry, not the common case). The
    # check is skipped only for the very payload object this transaction built from the closed range
    # it read (the fast completion, ``Core.note_checked``): a payload derived from it is checked.
    unbound = False  # the admitted entry has no logical turn id yet: this key becomes it
    try:
        seqs = core.checked_seqs(turn) if core.holds_lock(turn.scope, turn.session_id) else None
        if seqs is None:
            seqs, unbound = _check_range(core, turn)
    except (InvalidInput, TurnKeyConflict):
        # A committed key answers as committed: another payload under it is a collision; the same one
        # a duplicate, also where the turn is bound to another key (committed before keys were bound).
        existing = _receipt(core, turn)
        if existing is None:
            raise
        return _replay(turn, existing)
    ts = now_us()
    values = _receipt_values(turn, ts)
    # RETURNING, not rowcount: SQLAlchemy does not keep an INSERT's rowcount (psycopg reports -1).
    stmt = _INSERT_RECEIPT.get(core.dialect.name)
    if stmt is None:
        stmt = core.dialect.insert(receipts).on_conflict_do_nothing().returning(receipts.c.advancement_key)
        _INSERT_RECEIPT[core.dialect.name] = stmt
    row = {**values, "payload_hash": bytes.fromhex(turn.payload_hash), **_references(seqs)}
    inserted = core.run(stmt, row).first() is not None  # the hash is stored as its 32 bytes
    if not inserted:
        # A concurrent commit of the same key won the insert; it is committed now (READ COMMITTED).
        winner = _receipt(core, turn)
        if winner is None:  # pragma: no cover - only if the winner rolled back between the two statements
            raise AdvancementKeyCollision(turn.advancement_key)
        return _replay(turn, winner)
    if unbound:
        adm = turn.admission
        at = session_params(turn.scope, turn.session_id, b_seq=adm.seq, b_entry=adm.entry_id)
        if core.run(_CLAIM_TURN, {**at, "b_key": turn.advancement_key}).rowcount != 1:
            # Another commit bound the entry after this one read it (PostgreSQL: the range was read
            # with the rows as they were before the session's lock was granted): its key holds.
            bound = core.run(_TURN_ID_AT, at).scalar()
            raise TurnKeyConflict(turn.advancement_key, turn.admission.entry_id, bound)
    faults.point("commit.after_receipt")
    if apply is not None:
        # A retry of the transaction after an uncertain COMMIT finds this receipt (its commit time) when
        # the write landed: then, and only then, the hooks ``apply`` leaves are that retry's to run.
        core.landed_if(lambda c: _stands(c, values))
        apply(core, turn)
    faults.point("commit.after_apply")
    return _committed(values)


def _stands(core: Core, values: dict[str, Any]) -> bool:
    """Whether the receipt a commit wrote (``_receipt_values``) is stored, as written (its commit time)."""
    found = get_receipt(core, values["scope"], values["session_id"], values["engine_id"], values["advancement_key"])
    return found is not None and found.committed_us == values["committed_us"] and (
        found.payload_hash == values["payload_hash"]
    )


def _receipt_values(turn: TurnPayload, committed_us: int) -> dict[str, Any]:
    """The receipt's fields (the hash as its hex) of a turn committed at ``committed_us``."""
    return {
        "scope": turn.scope,
        "session_id": turn.session_id,
        "engine_id": turn.engine_id,
        "advancement_key": turn.advancement_key,
        "payload_hash": turn.payload_hash,
        "admission_entry_id": turn.admission.entry_id,
        "terminal_entry_id": turn.terminal.entry_id,
        "message_count": len(turn.messages),
        "is_heartbeat": turn.is_heartbeat,
        "committed_us": committed_us,
    }


def _references(seqs: Sequence[int]) -> dict[str, Any]:
    """The stored columns of a receipt that reference its messages' entries (raw seqs, ascending: the
    admission's first, the terminal's last): the anchors' seqs, and the seqs between them only when some
    seq of the range is not one of the turn's messages (an event or another branch inside the turn)."""
    first, last = seqs[0], seqs[-1]
    listed = None if last - first + 1 == len(seqs) else ",".join(map(str, seqs))
    return {
        "admission_seq": first, "terminal_seq": last, "message_seqs": listed,
        "admission_entry_id": None, "terminal_entry_id": None,  # the seqs name them (_entry_id_of)
    }


def _seqs_of(row: Any) -> list[int] | None:
    """The raw seqs of a stored receipt's messages (columns ``message_seqs``, ``admission_seq``,
    ``terminal_seq``); None for a receipt from before revision 0005, whose messages the ledger copied."""
    if row.message_seqs is not None:
        return [int(x) for x in row.message_seqs.split(",")] if row.message_seqs else []
    if row.admission_seq is not None:
        return list(range(int(row.admission_seq), int(row.terminal_seq) + 1))
    return None


def _committed(values: dict[str, Any]) -> CommitResult:
    """The result of a first commit: the receipt as written (``_receipt_values``), not read back."""
    return CommitResult.model_construct(status="committed", receipt=Receipt.model_construct(**values))


# A first commit_turn of its own, as ONE statement outside any transaction. On PostgreSQL that is one
# round trip instead of BEGIN, the range read, the insert and COMMIT (bench/README.md, "Profiling" 24);
# on SQLite it is SQLite's own implicit transaction instead of SQLAlchemy's, and the range compared in
# SQL instead of decoded and compared in Python ("Profiling" 25). It inserts the receipt only when the
# stored range is, beyond doubt, the turn: every entry of the seq range is a message on the active
# path, at consecutive depths (so they are the parent chain from the admission to the terminal), each
# stored text equal to the message's, the anchors matching (the session's key, generation and
# incarnation too), the first a user message admitted under this key as its logical turn id, and no
# other entry of the range admitted as a logical turn (another turn's messages). That is a
# subset of what ``_check_range`` accepts; anything else (a replay, a collision, a range with events or
# branches, a text stored in another spelling, an admission without a turn id, an anchor without an
# incarnation, an unknown session) inserts nothing and ``commit_turn`` takes the transactional path,
# which decides. The session's row is locked for the statement (PostgreSQL), so commits of a session
# still serialize; a SQLite write statement outside a transaction takes the database's write lock when
# it starts, as BEGIN IMMEDIATE does.
#
# Shaped on PostgreSQL for tables never analyzed: the range is read in seq order under a written-out
# LIMIT (the primary key, and a subquery the planner cannot pull up into the aggregate; see _RANGE_ROWS),
# and the path's seq at each entry's depth is a lookup by the path's primary key per row. A LEFT JOIN to
# the path walked the session's whole path for each entry (3,997 rows removed for a 2-message turn at
# 2,000 entries). Every entry must be on the path at consecutive depths, so the span of the entries'
# depths is the path's. SQLite keeps the join, which it runs as a key lookup per entry.
@functools.cache  # one statement per (message count, backend), each expected text its own bind (below)
def _one_statement_commit(count: int, sqlite: bool) -> TextualSelect:
    expected = " ".join(f"WHEN {i} THEN CAST(:b_t{i} AS TEXT)" for i in range(count))
    if sqlite:  # SQLite looks the path's key up for the join (and the join is ~10 us cheaper there)
        on_path, span = "p.depth IS NOT NULL", "max(p.depth) - min(p.depth)"
        source = """FROM ts_entries e
    LEFT JOIN ts_active_path p
        ON p.scope = e.scope AND p.session_id = e.session_id AND p.depth = e.depth AND p.seq = e.seq
    WHERE e.scope = :b_scope AND e.session_id = :b_session
      AND e.seq BETWEEN CAST(:b_from AS BIGINT) AND CAST(:b_to AS BIGINT)"""
    else:
        on_path, span = "e.path_seq = e.seq", "max(e.depth) - min(e.depth)"
        source = f"""FROM (
        SELECT x.*, (
            SELECT p.seq FROM ts_active_path p
            WHERE p.scope = x.scope AND p.session_id = x.session_id AND p.depth = x.depth
        ) AS path_seq
        FROM ts_entries x
        WHERE x.scope = :b_scope AND x.session_id = :b_session
          AND x.seq BETWEEN CAST(:b_from AS BIGINT) AND CAST(:b_to AS BIGINT)
        ORDER BY x.seq
        LIMIT {_ONE_STATEMENT_MAX}
    ) e"""
    lock = "" if sqlite else "FOR UPDATE"
    same = "IS" if sqlite else "IS NOT DISTINCT FROM"  # NULL-safe equality (SQLite < 3.39 lacks the latter)
    return text(
        f"""
WITH s AS (
    SELECT scope, session_id FROM ts_sessions
    WHERE scope = :b_scope AND session_id = :b_session
      AND session_key {same} CAST(:b_session_key AS TEXT) AND generation = CAST(:b_generation AS INTEGER)
      AND incarnation = CAST(:b_incarnation AS BIGINT)
    {lock}
), a AS (
    SELECT count(*) AS n_rows,
           sum(CASE WHEN e.kind = 'message' AND {on_path}
                     AND e.payload = CASE e.seq - CAST(:b_from AS BIGINT) {expected} END
                    THEN 1 ELSE 0 END) AS n_same,
           {span} AS span,
           sum(CASE WHEN e.seq = CAST(:b_from AS BIGINT) AND e.entry_id = CAST(:b_adm_id AS TEXT)
                     AND e.parent_id {same} CAST(:b_adm_parent AS TEXT)
                     AND e.position = CAST(:b_adm_position AS INTEGER) AND e.role = 'user'
                     AND e.turn_id = CAST(:b_key AS TEXT)
                    THEN 1 ELSE 0 END) AS n_admission,
           sum(CASE WHEN e.seq = CAST(:b_to AS BIGINT) AND e.entry_id = CAST(:b_term_id AS TEXT)
                     AND e.parent_id {same} CAST(:b_term_parent AS TEXT)
                     AND e.position = CAST(:b_term_position AS INTEGER)
                    THEN 1 ELSE 0 END) AS n_terminal,
           sum(CASE WHEN e.seq > CAST(:b_from AS BIGINT) AND e.turn_id IS NOT NULL THEN 1 ELSE 0 END) AS n_other
    {source}
)
INSERT INTO ts_receipts (
    scope, session_id, advancement_key, engine_id, committed_us, message_count, admission_seq, terminal_seq,
    is_heartbeat, payload_hash
)
SELECT s.scope, s.session_id, :b_key, :b_engine, :b_ts, a.n_rows, CAST(:b_from AS INTEGER),
       CAST(:b_to AS INTEGER), :b_heartbeat, :b_hash
FROM s, a
WHERE a.n_rows = CAST(:b_count AS INTEGER) AND a.n_same = a.n_rows AND a.span = a.n_rows - 1
  AND a.n_admission = 1 AND a.n_terminal = 1 AND a.n_other = 0
ON CONFLICT DO NOTHING
RETURNING advancement_key
"""
    ).columns(advancement_key=String)


# Each expected text is its own bind, not one text[] parameter: psycopg escapes an array's elements one
# by one with a regex, ~60 us for a turn's four messages.
#: turns with more messages than this take the transaction (one statement per count is compiled once)
_ONE_STATEMENT_MAX = 32


def commit_turn_statement(core: Core, turn: TurnPayload, attempts: list[Receipt] | None = None) -> CommitResult | None:
    """``commit_turn`` of a first commit as one statement (outside a transaction), or None: not
    committed by it, and the transactional path must decide (see _one_statement_commit).

    ``attempts`` gets the receipt this statement would have written when it raises on PostgreSQL: the
    statement commits on its own, so when its answer is lost (a dropped connection) the caller's retry
    can still tell the receipt it finds for its own commit. Only then: a statement that answered
    without a row did not commit, and an attempt recorded for it could match another caller's receipt
    written in the same microsecond (16 processes released at once did: two "committed" for one key).
    SQLite runs in the process: a statement that raised wrote nothing.
    """
    adm, term = turn.admission, turn.terminal
    count = len(turn.messages)
    if term.seq - adm.seq + 1 != count or count > _ONE_STATEMENT_MAX:
        return None  # events or branches inside the turn, or a long one: the full check
    if adm.incarnation is None or term.incarnation != adm.incarnation:
        # An anchor without an incarnation is honoured only by a session from before them, and a terminal
        # of another incarnation never: ``foreign_incarnation`` decides that in the transaction.
        return None
    texts = [stored_text(m) for m in turn.messages]
    if sum(map(len, texts)) * 4 > MAX_TURN_BYTES:
        return None  # perhaps over the turn's byte cap (4 bytes a character at most): the full check
    stmt = _one_statement_commit(count, core.dialect.is_sqlite)
    ts = now_us()
    params = session_params(
        turn.scope, turn.session_id,
        b_from=adm.seq, b_to=term.seq, b_key=turn.advancement_key, b_engine=turn.engine_id, b_ts=ts,
        b_count=count, b_heartbeat=turn.is_heartbeat, b_hash=bytes.fromhex(turn.payload_hash),
        b_session_key=adm.session_key, b_generation=adm.generation, b_incarnation=adm.incarnation,
        b_adm_id=adm.entry_id, b_term_id=term.entry_id,
        b_adm_parent=adm.parent_id, b_adm_position=adm.position, b_term_parent=term.parent_id,
        b_term_position=term.position, **{f"b_t{i}": text for i, text in enumerate(texts)},
    )
    values = _receipt_values(turn, ts)
    try:
        row = core.run(stmt, params).first()
    except BaseException:
        if attempts is not None and not core.dialect.is_sqlite:
            attempts.append(Receipt.model_construct(**values))  # it may have committed: its answer was lost
        raise
    return None if row is None else _committed(values)


def _replay(turn: TurnPayload, existing: Receipt) -> CommitResult:
    if existing.payload_hash != turn.payload_hash:
        raise AdvancementKeyCollision(turn.advancement_key)
    return CommitResult.model_construct(status="duplicate", receipt=existing)


def _receipt(core: Core, turn: TurnPayload) -> Receipt | None:
    return get_receipt(core, turn.scope, turn.session_id, turn.engine_id, turn.advancement_key)


def _check_range(core: Core, turn: TurnPayload) -> tuple[list[int], bool]:
    """Check the turn against the transcript; returns the raw seqs of its message entries, and
    whether the admitted entry has no logical turn id yet (the commit binds it to its key).

    The ledger references these entries instead of copying them, so a commit must BE the transcript's
    closed range: the anchors match their stored entries and the session's key and generation (a
    forged or foreign one is refused, not receipted), the terminal descends from the admission, the
    first message is the admitted user message and every message equals its entry.
    """
    # Lock the session row: commits of one session serialize (PostgreSQL; SQLite writers already do),
    # so an engine's read-modify-write of its state in ``apply`` never loses a concurrent turn's update.
    # The range read takes the lock itself unless the transaction holds it (the fast completion appended).
    adm, term = turn.admission, turn.terminal
    if not 0 <= term.seq - adm.seq <= MAX_TURN_EVENTS:
        # Checked before any row is read: a forged seq must not make the range scan a whole session.
        if not core.lock_session(turn.scope, turn.session_id):
            raise UnknownSession(turn.scope, turn.session_id)
        raise InvalidInput(f"the terminal must follow the admission by at most {MAX_TURN_EVENTS} entries")
    params = session_params(turn.scope, turn.session_id, b_from=adm.seq, b_to=term.seq)
    if core.holds_lock(turn.scope, turn.session_id):
        rows = core.run(_RANGE_ROWS, params).all()
        sess = core.require_session(turn.scope, turn.session_id)
        key, generation, incarnation, created_us = sess.session_key, sess.generation, sess.incarnation, sess.created_us
    else:
        rows = core.run(_RANGE_ROWS_LOCKING[not core.dialect.is_sqlite], params).all()
        if not rows:
            raise UnknownSession(turn.scope, turn.session_id)
        core.note_locked(turn.scope, turn.session_id)
        head = rows[0]
        key, generation, incarnation, created_us = (
            head.s_session_key, head.s_generation, head.s_incarnation, head.s_created_us
        )
        rows = [r for r in rows if r.entry_id is not None]
    # The anchors name the session's key and generation too, and the hash covers the key: a receipt
    # under another key or generation than the session's would stand forever against the genuine turn.
    if (adm.session_key, adm.generation) != (key, generation):
        raise InvalidInput(
            f"the anchors name session key {adm.session_key!r} and generation {adm.generation}; the session "
            f"has {key!r} and {generation}"
        )
    if of_another_incarnation(incarnation, created_us, adm, term):
        # Anchors of an earlier session under this id (deleted, then created or imported again): its
        # entries may look the same, but the turn was never this session's.
        raise InvalidInput("the anchors are of an earlier session under this id")
    by_id = {r.entry_id: r for r in rows}
    first = by_id.get(adm.entry_id)
    if first is None or first.kind != "message" or first.role != "user":
        raise InvalidInput(f"admitted entry {adm.entry_id!r} is not a user message of this session")
    for anchor in (adm, term):
        stored = by_id.get(anchor.entry_id)
        if stored is None or (stored.seq, stored.parent_id, stored.position) != (
            anchor.seq, anchor.parent_id, anchor.position
        ):
            raise InvalidInput(f"anchor of entry {anchor.entry_id!r} does not match the stored entry")
    chain = [by_id[term.entry_id]]
    while chain[-1].entry_id != adm.entry_id:
        parent = by_id.get(chain[-1].parent_id)
        if parent is None:
            raise InvalidInput("the terminal entry does not descend from the admitted entry")
        chain.append(parent)
    # What the closed range refuses (fences.read_closed_range), commit_turn refuses too: a receipt for a
    # turn no read of it would return stood against the turn for ever (a drain blocks it, a host never
    # delivers it). The chain is the terminal's ancestors up to the admission, so it is on the active
    # path exactly when the terminal is.
    if len(chain) > MAX_TURN_EVENTS:
        raise InvalidInput(f"the turn holds {len(chain)} entries, over {MAX_TURN_EVENTS}")
    size = sum(int(r.size_bytes) for r in chain)
    if size > MAX_TURN_BYTES:
        raise PayloadTooLarge(f"the turn is {size} bytes, over the cap of {MAX_TURN_BYTES}")
    assert term.position is not None  # matched its stored message entry above
    if core.path_seq_at_position(turn.scope, turn.session_id, term.position) != term.seq:
        raise InvalidInput("the turn is not on the session's active branch (it was branched away)")
    # A user message admitted as another logical turn inside the range: that turn's messages would reach
    # the engine twice, once under each key (a review found both receipted). Its own turn owns them.
    other = next((r for r in chain if r.entry_id != adm.entry_id and r.turn_id is not None), None)
    if other is not None:
        raise InvalidInput(
            f"the turn range holds entry {other.entry_id!r}, the admission of another logical turn "
            f"({other.turn_id!r}): a turn ends before the next one is admitted"
        )
    found = [r for r in reversed(chain) if r.kind == "message"]
    if len(found) != len(turn.messages):
        raise InvalidInput(f"the turn range holds {len(found)} messages, got {len(turn.messages)}")
    # Decoding the stored text and comparing is a third of the cost of serializing the message to
    # compare texts (bench/README.md, "Profiling" 16). Compared as JSON, not with ``==``: 1, 1.0 and
    # True are equal in Python, and a turn receipted with the caller's 1.0 for the entry's 1 hashed
    # otherwise than its drained delivery, which then collided with it for ever.
    for i, (row, message) in enumerate(zip(found, turn.messages, strict=True)):
        if not same_json(decode_stored(row.payload), message):
            if i == 0:
                raise InvalidInput("the first message differs from the admitted user message")
            raise InvalidInput(f"message {i} of the turn differs from its transcript entry {row.entry_id!r}")
    unbound = first.turn_id is None
    if unbound:
        # Bound by the commit (after its receipt is in): unless the key is another entry's turn id.
        taken = core.run(_TURN_ENTRY, session_params(turn.scope, turn.session_id, b_key=turn.advancement_key))
        if taken.first() is not None:
            raise TurnKeyConflict(turn.advancement_key, adm.entry_id, None)
        # Nor inside a turn already committed: an entry without a turn id may be a message of another
        # turn's range (a user message appended during it), and the engine took it with that turn.
        # Such a range starts at the last admission bound to a key before it (``_LAST_BOUND``).
        near = session_params(turn.scope, turn.session_id, b_from=max(0, adm.seq - MAX_TURN_EVENTS), b_to=adm.seq)
        key = core.run(_LAST_BOUND, near).scalar()
        held: list[Any] = [] if key is None else core.run(
            _HELD_SEQS, session_params(turn.scope, turn.session_id, b_key=key)
        ).all()
        if any(adm.seq in (_seqs_of(row) or ()) for row in held):
            raise InvalidInput(
                f"admitted entry {adm.entry_id!r} is a message of turn {key!r}, committed already: "
                "a turn ends before the next one is admitted"
            )
    elif first.turn_id != turn.advancement_key:
        raise TurnKeyConflict(turn.advancement_key, adm.entry_id, first.turn_id)
    return [r.seq for r in found], unbound


# ---------------------------------------------------------------------------------------------- reads


def get_receipt(core: Core, scope: str, session_id: str, engine_id: str, advancement_key: str) -> Receipt | None:
    """One receipt, or None."""
    params = session_params(scope, session_id, b_engine=engine_id, b_key=advancement_key)
    row = core.run(_RECEIPT, params).first()
    return None if row is None else _receipt_of(row)


def receipts_for_key(core: Core, scope: str, session_id: str, advancement_key: str) -> list[Receipt]:
    """Every engine's receipt of one advancement key (a logical turn) in a session."""
    rows = core.run(_RECEIPTS_FOR_KEY, session_params(scope, session_id, b_key=advancement_key)).all()
    return [_receipt_of(r) for r in rows]


def list_receipts(core: Core, scope: str, session_id: str, engine_id: str | None = None) -> list[Receipt]:
    """Every receipt of a session (optionally of one engine), oldest commit first."""
    q = select(*_RECEIPT_COLUMNS).where(receipts.c.scope == scope, receipts.c.session_id == session_id)
    if engine_id is not None:
        q = q.where(receipts.c.engine_id == engine_id)
    rows = core.conn.execute(q.order_by(receipts.c.committed_us, receipts.c.advancement_key)).all()
    return [_receipt_of(r) for r in rows]


#: receipts a page holds unless asked for fewer, and at most
DEFAULT_RECEIPTS_PAGE = 1000
MAX_RECEIPTS_PAGE = 10_000
# A page is a range of the primary key (scope, session, advancement key, engine) after the cursor's key,
# in key order: no index of its own. One in commit order was tried (revision 0014 of an earlier draft):
# each commit then wrote a second index entry, ~18 bytes a message on PostgreSQL (full turns 1.30x ->
# 1.31x raw, over issue 7's 1.3x), for a listing only operators read. Key order also never misses a
# receipt committed while a reader pages with a commit time before its cursor. One row past the page
# tells whether another follows.
_RECEIPTS_AFTER = (
    select(*_RECEIPT_COLUMNS)
    .where(
        by_session(receipts),
        receipts.c.engine_id == bindparam("b_engine"),
        receipts.c.advancement_key > bindparam("b_key"),
    )
    .order_by(receipts.c.advancement_key)
    .limit(bindparam("b_limit"))
)
_RECEIPTS_FIRST = (
    select(*_RECEIPT_COLUMNS)
    .where(by_session(receipts), receipts.c.engine_id == bindparam("b_engine"))
    .order_by(receipts.c.advancement_key)
    .limit(bindparam("b_limit"))
)
#: the longest receipt cursor: an advancement key
RECEIPT_CURSOR_CHARS = MAX_ID_CHARS


def receipt_cursor(receipt: Receipt) -> str:
    """The ``after`` cursor of a receipt: its advancement key, its place in the listing."""
    return receipt.advancement_key


def parse_receipt_cursor(after: str) -> str:
    """The advancement key a receipt cursor names; InvalidInput for anything else."""
    if not isinstance(after, str):
        raise InvalidInput(f"after must be a string, not {type(after).__name__}")
    check_id("after (an advancement key)", after)
    return after


def check_page_limit(limit: object) -> int:
    """A receipt page's size, 1..MAX_RECEIPTS_PAGE; InvalidInput for anything else."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_RECEIPTS_PAGE:
        raise InvalidInput(f"limit must be an integer in 1..{MAX_RECEIPTS_PAGE}, got {limit!r}")
    return limit


def receipts_page(
    core: Core, scope: str, session_id: str, engine_id: str, *, after: str | None = None,
    limit: int = DEFAULT_RECEIPTS_PAGE,
) -> ReceiptPage:
    """One engine's receipts of a session whose advancement key sorts after ``after`` (None: from the first),
    in key order, at most ``limit``: a range of the primary key, whatever the ledger's length."""
    limit = check_page_limit(limit)
    params = session_params(scope, session_id, b_engine=engine_id, b_limit=limit + 1)
    if after is None:
        rows = core.run(_RECEIPTS_FIRST, params).all()
    else:
        rows = core.run(_RECEIPTS_AFTER, {**params, "b_key": parse_receipt_cursor(after)}).all()
    page = [_receipt_of(r) for r in rows[:limit]]
    return ReceiptPage.model_construct(receipts=page, next=receipt_cursor(page[-1]) if len(rows) > limit else None)


def _receipt_of(row: Any) -> Receipt:
    """A stored receipt row as the API's Receipt (the hash is stored as bytes, spoken as hex)."""
    values = row._asdict()
    stored = values["payload_hash"]
    # SQLite keeps whatever a writer gives: a process of a release before revision 0006 still running
    # after the upgrade writes the hash as its hex text, which is what the API speaks anyway.
    values["payload_hash"] = stored.lower() if isinstance(stored, str) else bytes(stored).hex()
    return Receipt.model_construct(**values)


def committed_messages(
    core: Core, scope: str, session_id: str, engine_id: str, advancement_key: str
) -> list[dict[str, Any]]:
    """The messages of one receipt, in order ([] when there is no such receipt)."""
    params = session_params(scope, session_id, b_engine=engine_id, b_key=advancement_key)
    found = core.run(_MESSAGE_SEQS, params).first()
    if found is None:
        return []
    seqs = _seqs_of(found)
    if seqs is not None:
        if not seqs:
            return []
        # The turn's entries lie in one seq range (bounded by MAX_TURN_EVENTS at commit): one statement.
        params = session_params(scope, session_id, b_from=min(seqs), b_to=max(seqs))
        payload = {r.seq: r.payload for r in core.run(_RANGE_PAYLOADS, params)}
        return [decode_stored(payload[q]) for q in seqs]
    # A receipt from before revision 0005: the ledger kept its own copy.
    copies = core.conn.execute(
        select(turn_messages.c.payload)
        .where(
            turn_messages.c.scope == scope,
            turn_messages.c.session_id == session_id,
            turn_messages.c.engine_id == engine_id,
            turn_messages.c.advancement_key == advancement_key,
        )
        .order_by(turn_messages.c.idx)
    ).all()
    return [decode_stored(r.payload) for r in copies]


def count_turn_messages(core: Core, scope: str, session_id: str, engine_id: str) -> int:
    """How many messages an engine's receipts of a session hold (copies from before 0005 included)."""
    referenced = select(func.coalesce(func.sum(receipts.c.message_count), 0)).where(
        receipts.c.scope == scope,
        receipts.c.session_id == session_id,
        receipts.c.engine_id == engine_id,
        or_(receipts.c.admission_seq.is_not(None), receipts.c.message_seqs.is_not(None)),
    )
    copied = select(func.count()).where(
        turn_messages.c.scope == scope,
        turn_messages.c.session_id == session_id,
        turn_messages.c.engine_id == engine_id,
    )
    return int(core.conn.execute(referenced).scalar_one()) + int(core.conn.execute(copied).scalar_one())


# ---------------------------------------------------------------------------------------------- engine state


def get_state(core: Core, scope: str, session_id: str, engine_id: str, key: str) -> Any:
    """A JSON value of an engine's per-session state, or None."""
    value = core.run(_STATE, session_params(scope, session_id, b_engine=engine_id, b_key=key)).scalar()
    return None if value is None else json.loads(value)


def put_state(core: Core, scope: str, session_id: str, engine_id: str, key: str, value: Any) -> None:
    """Upsert a JSON value of an engine's per-session state (inside the caller's transaction)."""
    text = canonical_json(value)
    stmt = core.dialect.insert(engine_state).values(
        scope=scope, session_id=session_id, engine_id=engine_id, key=key, value=text, updated_us=now_us()
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["scope", "session_id", "engine_id", "key"],
        set_={"value": text, "updated_us": now_us()},
    )
    core.conn.execute(stmt)
