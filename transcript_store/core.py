"""The backend-neutral core: every store operation on one open transaction.

``TranscriptStore`` wraps each call in a transaction with retries; the turn machinery runs several of
these operations inside ONE transaction (append the reply, accept, read the closed range, commit the
turn). Nothing here knows which backend it runs on, except through ``Dialect``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import secrets
import string
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    Row,
    Select,
    Text,
    and_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    insert,
    literal_column,
    null,
    or_,
    select,
    text,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.selectable import CompoundSelect, TextualSelect

from . import hot
from .config import StoreConfig
from .db import Dialect
from .errors import (
    IdempotencyConflict,
    InvalidInput,
    PayloadTooLarge,
    SessionKeyConflict,
    TransientStoreError,
    UnknownEntry,
    UnknownSession,
)
from .hot import HotResult
from .models import (
    ENTRY_KINDS,
    Anchor,
    Entry,
    SessionInfo,
    compact_json,
    validate_event_payload,
    validate_message,
)
from .schema import active_path, deleted_sessions, entries, sessions

MAX_ID_CHARS = 255
#: How long a deleted session's tombstone is kept (``Core.delete_session``): a week, far past the retries
#: of any one call (a retry runs inside the call whose attempt it repeats: 12 attempts by default, each
#: waiting at most the busy timeout, 10 s by default, and 0.5 s between them).
TOMBSTONE_SECONDS = 7 * 24 * 3600
#: An id's UTF-8 bytes: a PostgreSQL B-tree index row holds at most 2,704 bytes, and one row holds up to
#: four ids (a receipt's scope, session, key and engine): 255 astral characters (1,020 bytes) each did
#: not fit, and a write failed as a database error on PostgreSQL where SQLite took it.
MAX_ID_BYTES = 640
#: control characters (C0, DEL, C1), NUL and lone surrogates; one regex search, not a loop per character
BAD_ID_CHAR = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def now_us() -> int:
    """Wall-clock microseconds (for created_at only: ordering is always by seq)."""
    return time.time_ns() // 1000


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def from_us(us: int) -> datetime:
    """A UTC datetime from stored microseconds, exactly (integer arithmetic: through float seconds, a time
    after about 2242 came back a microsecond off, and the last microsecond of 9999 as year 10000)."""
    return _EPOCH + timedelta(microseconds=us)


#: the id alphabet: letters and digits only, so an id never starts with "-" (a CLI option) or needs
#: quoting in a URL, a file name or a shell
_ID_ALPHABET = string.digits + string.ascii_letters
#: 62**22 > 2**128: every id carries 128 random bits (a random UUID's 32 hex characters carry 122)
_ID_CHARS = 22


def new_id() -> str:
    """A fresh random id for sessions, entries and turns: 128 random bits in 22 letters and digits."""
    # An id is stored in its row, its parent's pointer, its unique index and a receipt's references:
    # 22 characters instead of a UUID's 32 hex ones is 10 bytes off each of those (bench/README.md,
    # Profiling 37), with at least a random UUID's randomness.
    return _id_of(secrets.token_bytes(16))


def derived_id(name: str) -> str:
    """The id ``name`` always gives (an id of ``new_id``'s shape, from 128 bits of its SHA-256): a retry
    naming the same request finds what the first attempt made."""
    return _id_of(hashlib.sha256(name.encode("utf-8", "surrogatepass")).digest()[:16])


def _id_of(bits: bytes) -> str:
    """128 bits as an id: 22 letters and digits."""
    n = int.from_bytes(bits, "big")
    out = []
    for _ in range(_ID_CHARS):
        n, digit = divmod(n, 62)
        out.append(_ID_ALPHABET[digit])
    return "".join(out)


def new_incarnation() -> int:
    """A fresh session incarnation: a random 53-bit number, never 0 (which a cursor uses for "none")."""
    # Below 2**53: SessionInfo goes out as JSON (the HTTP service), and JavaScript's numbers are exact
    # only that far. Two creations of one session id draw the same with a chance of 1 in 9e15.
    return secrets.randbelow(2**53 - 1) + 1


def foreign_incarnation(token: int | None, incarnation: int, created_us: int) -> bool:
    """Whether a cursor or anchor naming ``token`` as its session's incarnation is of another session
    under the id than the one whose incarnation is ``incarnation`` (created at ``created_us``).

    A token without one (a format-1 cursor, an anchor made before anchors carried it) can only be of a
    session that existed before sessions had incarnations of their own: schema revision 0007 gave those
    their creation time, and a session made since draws a random one."""
    if token is not None:
        return token != incarnation
    return incarnation != (created_us if created_us > 0 else 1)


def check_id(what: str, value: object, *, optional: bool = False, new: bool = False) -> None:
    """Refuse ids that are empty, too long, not text, or with control characters; ``new``: an id being given
    to a new session, entry, turn or key, which must also fit MAX_ID_BYTES (an id stored by a release
    without that limit can still be named everywhere else: read, written to, drained, deleted)."""
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, not {type(value).__name__}")
    if not value or len(value) > MAX_ID_CHARS:
        raise InvalidInput(f"{what} must be 1..{MAX_ID_CHARS} characters")
    # C0, DEL and C1 (U+0080..U+009F: NEL, CSI, ...) are all control characters: none belongs in an id.
    if BAD_ID_CHAR.search(value) is not None:
        raise InvalidInput(f"{what} must not contain control characters, NUL or lone surrogates")
    if new and len(value) * 4 > MAX_ID_BYTES and len(value.encode("utf-8")) > MAX_ID_BYTES:
        raise InvalidInput(f"{what} must be at most {MAX_ID_BYTES} bytes in UTF-8")


#: the largest seq, position or generation a column holds (32-bit INTEGER on PostgreSQL)
MAX_INT = 2**31 - 1
#: the largest session incarnation a column holds (BIGINT)
MAX_INCARNATION = 2**63 - 1


def check_anchor(what: str, anchor: object) -> Anchor:
    """Refuse anything but a well-formed Anchor: ids as ``check_id`` takes them, numbers in column range.

    Anchors come back from callers (fences, closed ranges, commits) and may have been built with
    ``model_construct`` / ``model_copy``, which skip validation: a NUL or a lone surrogate in an id
    would otherwise reach the driver and surface as a database error instead of a refusal.
    """
    if not isinstance(anchor, Anchor):
        raise InvalidInput(f"{what} must be an Anchor, not {type(anchor).__name__}")
    for name in ("scope", "session_id", "entry_id"):
        check_id(f"{what}.{name}", getattr(anchor, name, None))
    for name in ("session_key", "parent_id", "idempotency_key"):
        check_id(f"{what}.{name}", getattr(anchor, name, None), optional=True)
    for name in ("generation", "seq", "position"):
        value = getattr(anchor, name, None)
        if name == "position" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
            raise InvalidInput(f"{what}.{name} must be an integer in 0..{MAX_INT}")
    incarnation = getattr(anchor, "incarnation", None)  # None: an anchor from before the field, unchecked
    if incarnation is not None and (
        isinstance(incarnation, bool) or not isinstance(incarnation, int) or not 0 <= incarnation <= MAX_INCARNATION
    ):
        raise InvalidInput(f"{what}.incarnation must be None or an integer in 0..{MAX_INCARNATION}")
    return anchor


@dataclass(frozen=True)
class NewEntry:
    """An entry validated and serialized before the transaction (so retries redo no work)."""

    entry_id: str
    kind: str
    role: str | None
    payload_json: str
    size_bytes: int
    idempotency_key: str | None = None
    turn_id: str | None = None


def prepare_entry(
    config: StoreConfig,
    *,
    kind: str = "message",
    message: Any = None,
    payload: Any = None,
    entry_id: str | None = None,
    idempotency_key: str | None = None,
    turn_id: str | None = None,
    stored: bool = False,
) -> NewEntry:
    """Validate and serialize one entry; raises before anything is written (``stored``: an entry a
    store held, imported: its message is also taken under earlier releases' rules)."""
    if kind not in ENTRY_KINDS:
        raise InvalidInput(f"unknown entry kind {kind!r}; one of {', '.join(ENTRY_KINDS)}")
    check_id("entry_id", entry_id, optional=True, new=True)
    check_id("idempotency_key", idempotency_key, optional=True, new=True)
    check_id("turn_id", turn_id, optional=True, new=True)
    if kind == "message":
        if payload is not None:
            raise InvalidInput("a message entry takes `message`, not `payload`")
        body = validate_message(message, stored=stored)
        role: str | None = body["role"]
    else:
        if message is not None:
            raise InvalidInput(f"a {kind} entry takes `payload`, not `message`")
        body = validate_event_payload(payload if payload is not None else {})
        role = None
    try:
        text = stored_text(body)
        size = len(text.encode("utf-8"))
    except (ValueError, TypeError, RecursionError) as e:  # UnicodeError is a ValueError
        # What the checks above let through and JSON cannot write (a container subclass whose items
        # differ from what it holds): refused like any other value JSON cannot carry.
        raise InvalidInput(f"payload cannot be written as JSON: {type(e).__name__}") from None
    if size > config.max_payload_bytes:
        raise PayloadTooLarge(f"entry payload is {size} bytes, over the cap of {config.max_payload_bytes}")
    return NewEntry(entry_id or new_id(), kind, role, text, size, idempotency_key, turn_id)


def stored_text(body: Any) -> str:
    """The text an entry's payload is stored as (compact JSON, UTF-8 as is)."""
    # NUL (U+0000) is escaped by JSON as \u0000, so it round-trips losslessly on both backends.
    return compact_json(body)


ENTRY_COLUMNS = (
    entries.c.seq,
    entries.c.entry_id,
    entries.c.parent_id,
    entries.c.depth,
    entries.c.position,
    entries.c.generation,
    entries.c.kind,
    entries.c.role,
    entries.c.payload,
    entries.c.size_bytes,
    entries.c.idempotency_key,
    entries.c.turn_id,
    entries.c.created_us,
)


# ---------------------------------------------------------------------------------------------- hot statements
# The statements of the turn path are built ONCE, with bind parameters, not per call. Profiling
# (bench/README.md, "Profiling") showed that building a SQLAlchemy statement and its cache key
# costs about three times as much CPU as executing it from the compiled cache: ~150 us against
# ~40 us per lookup, on a path that runs dozens of lookups per turn. They stay plain Core SQL,
# the same on both backends. Bind names carry a ``b_`` prefix: SQLAlchemy reserves column names for
# the SET/VALUES clauses of UPDATE and INSERT.


def by_session(table: Any) -> Any:
    """``scope = :b_scope AND session_id = :b_session`` for a table keyed by session."""
    return and_(table.c.scope == bindparam("b_scope"), table.c.session_id == bindparam("b_session"))


def session_params(scope: str, session_id: str, **more: Any) -> dict[str, Any]:
    """The bind parameters of a statement built on ``by_session``."""
    return {"b_scope": scope, "b_session": session_id, **more}


#: ids per IN list (SQLite allows 32,766 bound parameters per statement; stay far below)
_IN_CHUNK = 1000
_SESSION_ROW = select(sessions).where(by_session(sessions))
# The active session of a key, by the partial key index. Its condition is the index's own predicate,
# the bare column (``active`` is NOT NULL: the same rows as ``active IS TRUE``): neither backend proves
# the predicate from what SQLAlchemy renders for a boolean (PostgreSQL ``active IS true``, SQLite
# ``active IS 1`` or ``active = 1``), and both read the scope's sessions by the primary key and filtered
# them on the key instead (PostgreSQL never analyzed: 500 rows removed at 500 sessions), on every open
# of a session by key.
_BY_KEY = select(sessions).where(
    sessions.c.scope == bindparam("b_scope"), sessions.c.session_key == bindparam("b_key"), text("ts_sessions.active")
)
_SESSION_ROW_LOCKED = _SESSION_ROW.with_for_update()
# The same row with its head entry's columns as ``h_*`` (NULL for an empty session), for the fast
# completion: the closed range of a turn whose replies are appended right after its admission is that
# head and the appended entries, so it need not read them back (``fences.closed_range_of_append``).
# After a lock wait on PostgreSQL the h_* columns may be the previous head's: ``head_view`` checks.
# The head is a LATERAL subquery on PostgreSQL: its seq comes from the session row, and with a plain
# outer join the planner, on tables never analyzed, scanned the whole session's entries and filtered
# them on the seq (EXPLAIN ANALYZE: 2,999 rows removed, 1.9 ms at 3,000 entries, a cost growing with
# the transcript). A LATERAL subquery that cannot be pulled up into the join (its LIMIT) is run per
# session row with the seq as an index condition of the primary key. SQLite, which has no LATERAL,
# looks the primary key up for the plain join.
def _session_with_head(lateral: bool) -> Select[Any]:
    on_head = and_(
        entries.c.scope == sessions.c.scope,
        entries.c.session_id == sessions.c.session_id,
        entries.c.seq == sessions.c.head_seq,
    )
    if not lateral:
        heads = [c.label(f"h_{c.key}") for c in ENTRY_COLUMNS]
        return select(sessions, *heads).select_from(sessions.outerjoin(entries, on_head)).where(by_session(sessions))
    # Both unique keys of the head: whichever index the planner picks, the lookup is all index
    # condition (with the seq alone it picked the entry-id index and filtered on the seq).
    by_both = and_(on_head, entries.c.entry_id == sessions.c.head_entry_id)
    head = select(*ENTRY_COLUMNS).where(by_both).limit(1).lateral("head")  # LIMIT: not pulled up into a join
    heads = [head.c[c.key].label(f"h_{c.key}") for c in ENTRY_COLUMNS]
    return select(sessions, *heads).select_from(sessions.outerjoin(head, true())).where(by_session(sessions))


_SESSION_WITH_HEAD = _session_with_head(lateral=False)
_SESSION_WITH_HEAD_LOCKED = _session_with_head(lateral=True).with_for_update(of=sessions)

# An append's lock also answers "is any item already stored?" (by entry id, idempotency key or turn
# id), so that the common case, nothing stored, skips the lookups: one statement, one round trip on
# PostgreSQL, instead of two (bench/README.md, "Profiling" 30). On PostgreSQL a lock that had to wait
# returns the session row as the writer it waited for left it, while the EXISTS below saw the
# statement's earlier snapshot; ``snap_last_seq`` (last_seq in that snapshot) tells: every write of an
# entry moves last_seq, so when the two differ the answer may be stale and the lookups run as before.
_PROBE_MAX = 8


@functools.cache
def _probe_statement(with_head: bool, lock: bool, kinds: tuple[tuple[bool, bool], ...]) -> Select[Any]:
    known = entries.alias("known")
    snap = sessions.alias("snap")
    # One EXISTS per key, each an equality on that key's unique index: an IN list or an OR inside one
    # EXISTS left PostgreSQL, on tables never analyzed, filtering the session's entries instead.
    in_session = and_(known.c.scope == bindparam("b_scope"), known.c.session_id == bindparam("b_session"))
    conditions: list[Any] = []
    for i, (keyed, turn) in enumerate(kinds):
        keys = [known.c.entry_id == bindparam(f"b_known{i}")]
        if keyed:
            keys.append(known.c.idempotency_key == bindparam(f"b_idem{i}"))
        if turn:
            keys.append(known.c.turn_id == bindparam(f"b_turn{i}"))
        conditions.extend(exists().where(in_session, key) for key in keys)
    snap_seq = (
        select(snap.c.last_seq)
        .where(snap.c.scope == bindparam("b_scope"), snap.c.session_id == bindparam("b_session"))
        .scalar_subquery()
    )
    base = _session_with_head(lateral=lock) if with_head else _SESSION_ROW
    q = base.add_columns(or_(*conditions).label("known"), snap_seq.label("snap_last_seq"))
    return q.with_for_update(of=sessions) if lock else q


_ENTRY_ROWS = select(*ENTRY_COLUMNS).where(
    by_session(entries), entries.c.entry_id.in_(bindparam("b_ids", expanding=True))
)


def _entry_rows_of_array() -> Select[Any]:
    """PostgreSQL: the entries of an array of ids (``b_ids``), one lookup by the entry-id index each.

    An IN list (``= ANY``) was, on tables never analyzed, a filter over the session's entries (5,988
    rows removed for 12 ids at 6,000 entries, 4.2 ms; with statistics 0.21 ms); a LATERAL lookup per
    id removes none (0.08 ms; 0.13 ms with statistics). See bench/README.md, "Profiling" 36.
    """
    ids = func.unnest(cast(bindparam("b_ids"), ARRAY(Text))).table_valued("id").render_derived(name="ids")
    entry = (
        select(*ENTRY_COLUMNS)
        .where(by_session(entries), entries.c.entry_id == ids.c.id)
        .limit(literal_column("1"))
        .lateral("entry")
    )
    return select(*[entry.c[c.key] for c in ENTRY_COLUMNS]).select_from(ids.join(entry, true()))


_ENTRY_ROWS_OF_ARRAY = _entry_rows_of_array()
# The session's idempotency keys from ``b_first`` to ``b_last`` (both starting with ``b_prefix``), in the
# key's own index order, so LIMIT stops the walk: by code point (SQLite, a C collation) every key in the
# range starts with the prefix. A linguistic collation may order other keys among them (one ignoring
# punctuation at first); they are compared with the prefix exactly (as a substring, as LIKE is
# case-insensitive on SQLite and needs its wildcards escaped) and left out.
_KEYS_BETWEEN = (
    select(entries.c.idempotency_key)
    .where(
        by_session(entries),
        entries.c.idempotency_key >= bindparam("b_first", type_=entries.c.idempotency_key.type),
        entries.c.idempotency_key <= bindparam("b_last", type_=entries.c.idempotency_key.type),
        func.substr(entries.c.idempotency_key, 1, bindparam("b_len", type_=Integer))
        == bindparam("b_prefix", type_=Text),
    )
    .order_by(entries.c.idempotency_key)
    .limit(bindparam("b_limit", type_=Integer))
)
#: lookups of up to this many ids use a statement with that many plain binds (see ``hot``)
_SMALL_IN = 8


def _by_ids(columns: Sequence[Any], n: int, pg: bool) -> Any:
    """The entries of ``n`` ids (binds ``b_id0``...) of a session, with ``columns``.

    On PostgreSQL two or more ids are one equality lookup each, in a UNION ALL: on tables never
    analyzed the planner read an IN list (``= ANY``) as a filter over the session's whole range of the
    entry-id index (5,998 rows removed for 2 ids at 6,000 entries; bench/README.md, "Profiling" 36).
    A repeated id comes back once per time it is named: the callers key the rows by entry id.
    """
    ids: list[Any] = [bindparam(f"b_id{i}") for i in range(n)]
    if n == 1 or not pg:
        return select(*columns).where(by_session(entries), entries.c.entry_id.in_(ids))
    return union_all(*(select(*columns).where(by_session(entries), entries.c.entry_id == b) for b in ids))


#: (number of ids, PostgreSQL) -> the entries of that many ids
_ENTRY_ROWS_OF = {(n, pg): _by_ids(ENTRY_COLUMNS, n, pg) for n in range(1, _SMALL_IN + 1) for pg in (False, True)}


# An entry together with the seq the active path holds at its depth: "is it on the active path" in
# the same statement as the entry itself (fences and closed ranges ask both, on every turn).
_PATH_SEQ_OF_ENTRY = (
    select(active_path.c.seq)
    .where(
        active_path.c.scope == entries.c.scope,
        active_path.c.session_id == entries.c.session_id,
        active_path.c.depth == entries.c.depth,
    )
    .correlate(entries)
    .scalar_subquery()
    .label("ts_path_seq")
)
#: (number of ids, PostgreSQL) -> the entries of up to four ids with the active path's seq at their depth (a
#: compaction's pointer names two, and two more for the host's reset it was made after)
_ENTRIES_WITH_PATH_OF = {
    (n, pg): _by_ids([*ENTRY_COLUMNS, _PATH_SEQ_OF_ENTRY], n, pg) for n in range(1, 5) for pg in (False, True)
}
# Every stored entry after a seq, with the path's seq at its depth (a correlated lookup per entry by
# the path's primary key: an outer join to the path scanned the session's path for every entry on
# tables never analyzed, 23,990 rows removed for 4 entries at 6,000; "Profiling" 36).
_ALL_ROWS = (
    select(*ENTRY_COLUMNS, _PATH_SEQ_OF_ENTRY)
    .where(by_session(entries), entries.c.seq > bindparam("b_after_seq", type_=Integer))
    .order_by(entries.c.seq)
    .limit(bindparam("b_limit", type_=Integer))
)

# The stored sizes of the entries after a seq, in seq order: an export reads them before a page of rows,
# to make the page as long as its byte budget allows (transfer._export_pages).
_ENTRY_SIZES = (
    select(entries.c.size_bytes)
    .where(by_session(entries), entries.c.seq > bindparam("b_after_seq", type_=Integer))
    .order_by(entries.c.seq)
    .limit(bindparam("b_limit", type_=Integer))
)


_PATH_SEQ_AT_DEPTH = select(active_path.c.seq).where(
    by_session(active_path), active_path.c.depth == bindparam("b_depth")
)
_PATH_SEQ_AT_POSITION = select(active_path.c.seq).where(
    by_session(active_path), active_path.c.position == bindparam("b_position")
)
# One entry by its seq, as the first of the session's entries from that seq on in seq order (only the
# primary key needs no sort for it), under a written-out LIMIT 1. With an equality on the seq, on
# PostgreSQL tables never analyzed, the entry-id index (same two leading columns) looked as cheap as the
# primary key, and the planner took it and filtered the session's entries on the seq (2,005 rows removed
# at 2,000 entries, twice per mirrored turn; see _path_with_entries).
_ENTRY_BY_SEQ = (
    select(*ENTRY_COLUMNS)
    .where(by_session(entries), entries.c.seq >= bindparam("b_seq"), entries.c.seq <= bindparam("b_seq"))
    .order_by(entries.c.seq)
    .limit(literal_column("1"))
)
_INSERT_ENTRIES = insert(entries)
_INSERT_PATH = insert(active_path)
_ADVANCE_HEAD = (
    update(sessions)
    .where(by_session(sessions))
    .values(
        last_seq=bindparam("b_last_seq"),
        head_seq=bindparam("b_head_seq"),
        head_entry_id=bindparam("b_head_entry_id"),
        path_length=bindparam("b_path_length"),
        visible_count=bindparam("b_visible_count"),
        updated_us=bindparam("b_updated_us"),
    )
)

# An append's three writes (its entries, their active-path rows, the session's new head) as ONE
# statement on PostgreSQL: data-modifying CTEs, one round trip instead of three, twice per host turn
# (bench/README.md, "Profiling" 28). One statement per row count, each value its own bind; a longer
# append (bulk loads) keeps the three statements, whose executemany psycopg pipelines. SQLite has no
# round trips to save and no INSERT in a WITH.
_APPEND_COLUMNS = tuple(c.key for c in entries.columns)
_ONE_STATEMENT_APPEND_MAX = 16


@functools.cache
def _one_statement_append(count: int) -> TextualSelect:
    def row(i: int) -> str:
        values = (":b_scope", ":b_session", *(f":e{i}_{c}" for c in _APPEND_COLUMNS[2:]))
        return "(" + ", ".join(values) + ")"

    rows = ", ".join(row(i) for i in range(count))
    path = ", ".join(f"(:b_scope, :b_session, :e{i}_depth, :e{i}_seq, :e{i}_position)" for i in range(count))
    return text(
        f"""
WITH new_entries AS (
    INSERT INTO ts_entries ({", ".join(_APPEND_COLUMNS)}) VALUES {rows}
), new_path AS (
    INSERT INTO ts_active_path (scope, session_id, depth, seq, position) VALUES {path}
)
UPDATE ts_sessions
SET last_seq = :b_last_seq, head_seq = :b_head_seq, head_entry_id = :b_head_entry_id,
    path_length = :b_path_length, visible_count = :b_visible_count, updated_us = :b_updated_us
WHERE scope = :b_scope AND session_id = :b_session
RETURNING last_seq
"""
    ).columns(last_seq=Integer)


_PATH_JOIN = active_path.join(
    entries,
    and_(
        entries.c.scope == active_path.c.scope,
        entries.c.session_id == active_path.c.session_id,
        entries.c.seq == active_path.c.seq,
    ),
)


# The active path's rows with their entries. On PostgreSQL each entry is a LATERAL lookup by its
# primary key: with the plain join, on tables never analyzed (a new deployment, autovacuum off or
# behind), the planner scanned the session's whole primary-key range for every path row and filtered
# it on the seq (EXPLAIN ANALYZE of a 20-message page at 6,000 entries: 119,790 rows removed, 39 ms;
# bench/README.md, "Profiling" 36). A LATERAL subquery that cannot be pulled up into the join (its
# LIMIT) runs per path row with the seq as an index condition, whatever the statistics say; the head
# lookup does the same (_session_with_head). SQLite, which has no LATERAL, looks the key up anyway.
def _path_with_entries(lateral: bool) -> tuple[Any, list[Any]]:
    """(FROM clause, entry columns) of the active path joined to its entries."""
    if not lateral:
        return _PATH_JOIN, list(ENTRY_COLUMNS)
    # The first entry at or after the path row's seq in seq order, which is the entry of that seq
    # (the join's ON checks it). Not an equality on the seq: without statistics the entry-id index
    # (same two leading columns) looked as cheap as the primary key for it, and the planner took it
    # and filtered on the seq (2,286 rows removed a row at 6,000 entries). In seq order from a lower
    # bound only the primary key needs no sort.
    entry = (
        select(*ENTRY_COLUMNS)
        .where(
            entries.c.scope == active_path.c.scope,
            entries.c.session_id == active_path.c.session_id,
            entries.c.seq >= active_path.c.seq,
            entries.c.seq <= active_path.c.seq,
        )
        .order_by(entries.c.seq)
        .limit(literal_column("1"))  # written out: a generic plan takes a bound LIMIT for 10% of the rows
        .lateral("entry")
    )
    return active_path.join(entry, entry.c.seq == active_path.c.seq), [entry.c[c.key] for c in ENTRY_COLUMNS]


def _visible_rows_statement(bounded: bool, limited: bool, lateral: bool) -> Select[Any]:
    path, columns = _path_with_entries(lateral)
    q = (
        select(*columns)
        .select_from(path)
        .where(by_session(active_path), active_path.c.position > bindparam("b_after"))
        .order_by(active_path.c.position)
    )
    if bounded:
        q = q.where(active_path.c.position < bindparam("b_before"))
    if limited:
        q = q.limit(bindparam("b_limit", type_=Integer))
    return q


#: (bounded above, limited, PostgreSQL) -> the visible rows after a position
_VISIBLE_ROWS = {
    (b, lim, lat): _visible_rows_statement(b, lim, lat) for b in (False, True) for lim in (False, True)
    for lat in (False, True)
}


def _visible_sizes_statement(lateral: bool) -> Select[Any]:
    # The stored sizes of the visible messages after a position, in position order, through the same
    # join as their rows (_visible_rows_statement): a page of them is bounded by their sizes first.
    path, columns = _path_with_entries(lateral)
    size = next(c for c in columns if c.key == "size_bytes")
    return (
        select(size)
        .select_from(path)
        .where(by_session(active_path), active_path.c.position > bindparam("b_after"))
        .order_by(active_path.c.position)
        .limit(bindparam("b_limit", type_=Integer))
    )


#: PostgreSQL -> the stored sizes of the visible messages after a position
_VISIBLE_SIZES = {lat: _visible_sizes_statement(lat) for lat in (False, True)}


# A delta page is bounded by its bytes (max_bytes) as well as its messages, and the bound holds for
# what the statement LOADS, not only for what the read hands back: each row carries the running sum
# of the stored sizes up to it (a window over the page's order), rows past the first one over the
# bound are not returned, and that first one comes without its payload (its size alone tells the
# caller's required_bytes). Cut in Python after the fetch, a page of max_messages=1,000 over
# messages of 4 MiB loaded ~4 GB for a 1 MB answer, and a default read of a session of 50 KB tool
# outputs 50 MB for every 1 MB page. On PostgreSQL a payload not returned is never detoasted (the
# window passes its TOAST pointer along). SQLite copies every column of a window's input into a
# temporary table, overflow pages and all, so there the window runs over the rows' sizes and
# rowids only, and the payloads are looked up by rowid for the rows returned.
#: SQLite's rowid of an entry (only SQLite's statements name it)
_ENTRY_ROWID = literal_column(f"{entries.name}.rowid", Integer)


def _bytes_bounded(rows: Select[Any], order: Any, size: Any, rowid: Any | None) -> Any:
    """The page ``rows`` (ENTRY_COLUMNS ordered by ``order``, limited) cut by ``b_max_bytes`` as a
    subquery of ENTRY_COLUMNS; with ``rowid`` (SQLite), the payloads are fetched after the cut."""
    limit = bindparam("b_max_bytes", type_=Integer)
    run = func.sum(size).over(order_by=order, rows=(None, 0)).label("b_run")
    if rowid is None:
        sized = rows.add_columns(run).subquery("sized")
        columns = [sized.c[c.key] for c in ENTRY_COLUMNS]
        source: Any = sized
    else:
        sized = rows.with_only_columns(size, rowid.label("b_rowid"), run).subquery("sized")
        columns = list(ENTRY_COLUMNS)
        source = sized.join(entries, rowid == sized.c.b_rowid)
    at = next(i for i, c in enumerate(ENTRY_COLUMNS) if c.key == "payload")
    columns[at] = case((sized.c.b_run <= limit, columns[at]), else_=null()).label("payload")
    # the rows that fit, and the first one that does not (has_more; its size is required_bytes)
    cut = sized.c.b_run - sized.c.size_bytes <= limit
    return select(*columns).select_from(source).where(cut).subquery("page")


def _delta_page_statement(bounded: bool, lateral: bool) -> CompoundSelect[Any]:
    # A delta page in ONE statement: first the session's row (what the read needs of it, prefixed s_,
    # and the raw seq at the cursor's position; its entry columns NULL), then the page after that
    # position (one row per entry, its s_ columns NULL); no row at all when the session does not
    # exist. A single statement is a consistent snapshot by itself on both backends, so a read that
    # needs nothing else runs without a transaction: one round trip on PostgreSQL instead of BEGIN,
    # the session, the page and COMMIT (bench/README.md, "Profiling" 23).
    # A UNION ALL, not the session row joined to the page: the join repeated the session's columns
    # on every row and had SQLite materialize the page before joining it ("Profiling" 34). No ORDER
    # BY: SQLite would copy the payloads into a temporary B-tree to sort what the index search
    # already produced in order; delta_page_rows sorts the few rows.
    rows = _visible_rows_statement(bounded, True, lateral)
    size = rows.selected_columns.size_bytes
    return _session_and_page(_bytes_bounded(rows, active_path.c.position, size, None if lateral else _ENTRY_ROWID))


def _session_and_page(page: Any, *more: Any) -> CompoundSelect[Any]:
    """The session's row (``s_`` columns and ``more``, its entry columns NULL) UNION ALL the page's rows
    (their ``s_`` columns NULL): a delta page's one statement."""
    head_columns = [
        sessions.c.generation.label("s_generation"),
        sessions.c.session_key.label("s_session_key"),
        sessions.c.incarnation.label("s_incarnation"),
        sessions.c.created_us.label("s_created_us"),
        _PATH_SEQ_AT_POSITION.scalar_subquery().label("s_at_seq"),
        *more,
    ]
    head = select(
        *head_columns,
        # typed: PostgreSQL takes a UNION column's type from its first branch
        *(cast(null(), c.type).label(c.key) for c in ENTRY_COLUMNS),
    ).where(by_session(sessions))
    return union_all(head, select(*(null() for _ in head_columns), *page.c))


#: (bounded above, PostgreSQL) -> a delta page's statement
_DELTA_PAGE = {(b, lat): _delta_page_statement(b, lat) for b in (False, True) for lat in (False, True)}


def _linear_delta_page_statement(bounded: bool, pg: bool) -> CompoundSelect[Any]:
    # The same page for a session whose every entry is on its active path (it never branched nor was
    # rewritten: path_length = last_seq + 1, which the head row reports as s_linear): then the
    # visible messages after the cursor are the message entries after its seq, in seq order, and
    # the page is one primary-key range scan of the entries, as a plain table's tail read is,
    # instead of the active path's rows and an entry lookup for each (PostgreSQL, the statement alone:
    # 0.269 -> 0.220 ms at 100,000 messages; bench/README.md, "Profiling" 39). Where s_linear is false, the
    # page is not used and delta_page_rows reads the path statement instead. Two statements chosen in
    # Python, not one with both pages behind conditions on the session's row: that one was slower
    # than the path page alone (PostgreSQL planned and started both).
    # The scan ends at the seq of the window's last message, found through the path's position index
    # (one probe): without it, events after the page's messages (a tail of non-message entries, or a
    # session of events only) were walked and filtered out on every read, 20,000 of them in 2 ms.
    window = [
        by_session(active_path),
        active_path.c.position > bindparam("b_after"),
        # Added in Python and capped (``b_upto``): in SQL, a cursor's position near the top of the
        # INTEGER range plus the limit overflowed on PostgreSQL ("integer out of range").
        active_path.c.position <= bindparam("b_upto"),
    ]
    if bounded:
        window.append(active_path.c.position < bindparam("b_before"))
    last = (
        select(active_path.c.seq).where(*window).order_by(active_path.c.position.desc()).limit(literal_column("1"))
    )
    q = (
        select(*ENTRY_COLUMNS)
        .where(
            by_session(entries),
            entries.c.seq > bindparam("b_after_seq"),
            entries.c.seq <= last.scalar_subquery(),
            entries.c.position.is_not(None),
        )
        .order_by(entries.c.seq)
        .limit(bindparam("b_limit", type_=Integer))
    )
    if bounded:  # the fence's seq bounds the scan too (its position alone would be a filter)
        q = q.where(entries.c.seq < bindparam("b_before_seq"), entries.c.position < bindparam("b_before"))
    linear = (sessions.c.path_length == sessions.c.last_seq + 1).label("s_linear")
    page = _bytes_bounded(q, entries.c.seq, entries.c.size_bytes, None if pg else _ENTRY_ROWID)
    return _session_and_page(page, linear)


#: (bounded above, PostgreSQL) -> a delta page's statement for a session without branches (see above)
_LINEAR_DELTA_PAGE = {(b, pg): _linear_delta_page_statement(b, pg) for b in (False, True) for pg in (False, True)}


#: every RecentKeys, to give each a fresh lock in a forked child (held weakly)
_RENEW_AT_FORK: weakref.WeakSet[RecentKeys] = weakref.WeakSet()


def _renew_locks_in_child() -> None:
    for keys in list(_RENEW_AT_FORK):
        keys._new_lock()


os.register_at_fork(after_in_child=_renew_locks_in_child)


class RecentKeys:
    """A bounded set of keys, the least recently touched dropped first, shared by threads.

    Each operation holds a lock: a look followed by a touch is two steps, and another thread's add may
    drop the key between them (a KeyError out of the touch). CPython with the GIL happens not to switch
    threads there today; a free-threaded build may at any point. Nothing slow runs under the lock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()
        # A thread of the parent may hold the lock at a fork(): the child would wait on it forever. One
        # hook for every instance, which holds them weakly (a hook per instance would keep each alive).
        _RENEW_AT_FORK.add(self)

    def _new_lock(self) -> None:
        self._lock = threading.Lock()

    def touch(self, key: Hashable) -> bool:
        """Whether ``key`` is in the set; if it is, it is now the most recent."""
        with self._lock:
            if key not in self._keys:
                return False
            self._keys.move_to_end(key)
            return True

    def add(self, key: Hashable) -> None:
        """Put ``key`` in as the most recent, dropping the least recent beyond the limit."""
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self.limit:
                self._keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self._keys)


#: (store URL, scope, session id) of sessions a delta read found branched: their pages are read with
#: the path statement straight away. A hint only (a session deleted and created again under the same
#: id is read the longer way until it drops out); bounded. Process-wide, so shared by every thread.
_BRANCHED = RecentKeys(10_000)
#: psycopg's ``pq.TransactionStatus.INERROR`` (libpq's PQTRANS_INERROR), without importing psycopg here
_PG_INERROR = 3


def _position_of(row: Row[Any]) -> int:
    return int(row.position)


def _existing_statement(keyed: bool, turn: bool, pg: bool) -> Any:
    keys = [entries.c.entry_id == bindparam("b_entry")]
    if keyed:
        keys.append(entries.c.idempotency_key == bindparam("b_idem"))
    if turn:
        keys.append(entries.c.turn_id == bindparam("b_turn"))
    if pg and len(keys) > 1:
        # One equality per key, each on its unique index: PostgreSQL read the OR, on tables never
        # analyzed, as a filter over the session's entries ("Profiling" 36). An entry named by two
        # keys comes back twice (existing_row keeps one).
        return union_all(*(select(*ENTRY_COLUMNS).where(by_session(entries), key) for key in keys))
    return select(*ENTRY_COLUMNS).where(by_session(entries), or_(*keys))


#: (has idempotency key, has turn id, PostgreSQL) -> the lookup of an appended item's existing entry
_EXISTING = {
    (k, t, pg): _existing_statement(k, t, pg) for k in (False, True) for t in (False, True) for pg in (False, True)
}
def _path_rows_statement(bounded: bool, lateral: bool) -> Select[Any]:
    path, columns = _path_with_entries(lateral)
    q = (
        select(*columns)
        .select_from(path)
        .where(by_session(active_path), active_path.c.depth >= bindparam("b_from"))
        .order_by(active_path.c.depth)
    )
    return q.where(active_path.c.depth <= bindparam("b_to")) if bounded else q


#: (bounded above, PostgreSQL) -> the active path's entries from a depth
_PATH_ROWS = {(b, lat): _path_rows_statement(b, lat) for b in (False, True) for lat in (False, True)}


def entry_from_row(row: Any, active: bool) -> Entry:
    """An Entry from a trusted row (no re-validation on the read path)."""
    values = entry_values(row, active)
    return _construct_entry(values) if _FAST_ENTRY else Entry.model_construct(**values)


# The C scanner json.loads ends in (it resets its per-call state itself).
_scan_json = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def decode_stored(text: str) -> Any:
    """The value of a stored payload text: ``json.loads(text)``, ~1.8 us an entry faster.

    Every entry payload the store reads back is decoded here (pages, ranges, the commit check, the
    replay and idempotency comparisons); a page decodes 20. ``json.loads`` wraps the scanner in
    three Python calls and two regex matches for surrounding whitespace, which a stored text
    (compact JSON this store wrote) never has (bench/README.md, "Profiling" 34). Anything else
    (whitespace, trailing text, an invalid document) goes to ``json.loads``, which decodes or raises
    exactly as before.
    """
    try:
        value, end = _scan_json(text, 0)
    except (StopIteration, ValueError, TypeError):
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


def same_json(a: Any, b: Any) -> bool:
    """Whether two JSON values are the same JSON: ``==``, except that a bool, an integer and a float are
    never equal to one another, nor 0.0 to -0.0 (JSON writes each its own way, and a turn's hash with it)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and len(a) == len(b) and all(k in b and same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(same_json, a, b))
    if isinstance(a, int | float) or isinstance(b, int | float):
        return _number_text(a) == _number_text(b)
    return bool(a == b)


def same_stored_text(a: str, b: str) -> bool:
    """Whether two stored texts hold the same JSON (equal texts, or equal as ``same_json`` when decoded)."""
    return a == b or same_json(decode_stored(a), decode_stored(b))


def _number_text(value: Any) -> str | None:
    """How JSON writes a number (a bool is ``True``/``False`` here); None for anything else."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return int.__repr__(value)
    return float.__repr__(value) if isinstance(value, float) else None


def entry_values(row: Any, active: bool) -> dict[str, Any]:
    """The fields of an Entry from a trusted row, as a dict."""
    body = decode_stored(row.payload)
    is_message = row.kind == "message"
    return {
        "entry_id": row.entry_id,
        "parent_id": row.parent_id,
        "seq": row.seq,
        "kind": row.kind,
        "role": row.role,
        "message": body if is_message else None,
        "payload": None if is_message else body,
        "position": row.position,
        "generation": row.generation,
        "size_bytes": row.size_bytes,
        "idempotency_key": row.idempotency_key,
        "turn_id": row.turn_id,
        "created_at": from_us(row.created_us),
        "active": active,
    }


_set = object.__setattr__


def _construct_entry(values: dict[str, Any]) -> Entry:
    """``Entry.model_construct(**values)`` for a complete set of fields, without its per-field loop.

    Every page, closed range and projection rebuild makes one Entry per row, and model_construct's
    walk over the 14 fields (aliases, defaults) was ~13 us of a ~20 us row in the profile of a delta
    read (bench/README.md, "Profiling"). ``_FAST_ENTRY`` checks once, at import, that this gives the
    very object model_construct gives; if a pydantic release changes that, model_construct is used.
    """
    entry = Entry.__new__(Entry)
    _set(entry, "__dict__", values)
    _set(entry, "__pydantic_fields_set__", set(values))
    _set(entry, "__pydantic_extra__", None)
    _set(entry, "__pydantic_private__", None)
    return entry


def session_info(row: Row[Any]) -> SessionInfo:
    """A SessionInfo from a sessions row."""
    return SessionInfo.model_construct(
        scope=row.scope,
        session_id=row.session_id,
        session_key=row.session_key,
        generation=row.generation,
        head_entry_id=row.head_entry_id,
        entry_count=row.last_seq + 1,
        visible_count=row.visible_count,
        active=bool(row.active),
        created_at=from_us(row.created_us),
        updated_at=from_us(row.updated_us),
        incarnation=row.incarnation,
    )


class Core:
    """Store operations on one open connection/transaction."""

    def __init__(self, conn: Connection, dialect: Dialect, config: StoreConfig) -> None:
        self.conn = conn
        self.dialect = dialect
        self.config = config
        #: sessions whose row this transaction holds locked (a Core lives for one transaction)
        self._locked: set[tuple[str, str]] = set()
        #: id(payload) -> (payload, raw seqs): turn payloads built from a closed range this transaction read
        self._checked: dict[int, tuple[object, list[int]]] = {}
        #: (scope, session, entry id) -> (seq, parent, position, generation, incarnation, session key) of the
        #: user messages this transaction appended (the fences it may trust without a check)
        self._appended: dict[tuple[str, str, str], tuple[int, str | None, int | None, int, int, str | None]] = {}
        #: what to tell the process once this transaction's write stands (``after_commit``)
        self.committed_hooks: list[Callable[[], None]] = []
        #: how a retry of this write finds, in its own transaction, that this attempt's write stands
        #: (``landed_if``)
        self.landed_checks: list[Callable[[Core], bool]] = []

    def after_commit(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once this write transaction committed (``TranscriptStore.write``), never for an
        attempt rolled back or retried: process-local state (a counter, a cache) set inside the
        transaction would describe a write that did not happen, or count a retried one twice.

        A retry that writes nothing of its own (it found this attempt's write, whose COMMIT landed though
        its answer was lost) runs this attempt's hooks only when every ``landed_if`` check of this attempt
        holds in the retry's transaction: without one, a COMMIT that did not land is never told from one
        that did, and the hooks do not run. A hook that raises is logged, not raised: the write stands."""
        self.committed_hooks.append(hook)

    def landed_if(self, check: Callable[[Core], bool]) -> None:
        """Tell a retry of this write how to find this attempt's write: ``check(retry's core)`` is True
        only when it stands (``after_commit``)."""
        self.landed_checks.append(check)

    def adopt(self, earlier: Core) -> None:
        """Take an earlier attempt's ``after_commit`` hooks and ``landed_if`` checks as this attempt's own:
        this attempt found that one's write standing (``TranscriptStore.write``)."""
        self.committed_hooks.extend(earlier.committed_hooks)
        self.landed_checks.extend(earlier.landed_checks)

    def run(self, stmt: Any, params: Any = None) -> HotResult:
        """Execute a module-level prebuilt statement through ``hot`` (the turn path's runner)."""
        return hot.run(self.conn, stmt, params)

    # ------------------------------------------------------------------------------------ sessions

    def session_row(
        self, scope: str, session_id: str, *, lock: bool = False, with_head: bool = False
    ) -> Row[Any] | None:
        """The session's row, or None; ``lock`` serializes writers of this session (PostgreSQL);
        ``with_head`` adds the head entry's columns as ``h_<column>`` (see ``head_view``)."""
        if with_head:
            q = _SESSION_WITH_HEAD_LOCKED if lock and not self.dialect.is_sqlite else _SESSION_WITH_HEAD
        else:
            q = _SESSION_ROW_LOCKED if lock and not self.dialect.is_sqlite else _SESSION_ROW
        row = self.run(q, session_params(scope, session_id)).first()
        if lock and row is not None:
            self._locked.add((scope, session_id))
        return row

    def _lock_for_append(
        self, scope: str, session_id: str, items: Sequence[NewEntry], with_head: bool
    ) -> tuple[Row[Any], bool]:
        """The session's row, locked, and whether none of ``items`` can be stored already (see
        ``_probe_statement``; False means "look them up")."""
        kinds = tuple((i.idempotency_key is not None, i.turn_id is not None) for i in items)
        # A statement per shape, compiled once and kept: only the shapes of a turn (an admission: one
        # keyed item; replies: up to _PROBE_MAX plain ones), so the kept statements stay few.
        if not (len(kinds) == 1 or (1 < len(kinds) <= _PROBE_MAX and not any(map(any, kinds)))):
            return self.require_session(scope, session_id, lock=True, with_head=with_head), False
        q = _probe_statement(with_head, not self.dialect.is_sqlite, kinds)
        params = session_params(scope, session_id)
        for i, item in enumerate(items):
            params[f"b_known{i}"] = item.entry_id
            if item.idempotency_key is not None:
                params[f"b_idem{i}"] = item.idempotency_key
            if item.turn_id is not None:
                params[f"b_turn{i}"] = item.turn_id
        row = self.run(q, params).first()
        if row is None:
            raise UnknownSession(scope, session_id)
        self._locked.add((scope, session_id))
        return row, not row.known and row.snap_last_seq == row.last_seq

    def holds_lock(self, scope: str, session_id: str) -> bool:
        """Whether this transaction already holds the session's row lock."""
        return (scope, session_id) in self._locked

    def note_locked(self, scope: str, session_id: str) -> None:
        """Record that the caller's own statement locked the session's row (FOR UPDATE OF ts_sessions)."""
        self._locked.add((scope, session_id))

    def appended_here(self, anchor: Anchor) -> bool:
        """Whether this transaction appended ``anchor``'s entry, at that place, holding the session's lock
        (an admission reading its own pre-turn transcript: the fence needs no check of its own).

        Not true of an entry an idempotent append found already stored (a retried turn id). Nor can another
        turn's append pass for this one's: a Core is one attempt of one transaction (a retry starts afresh),
        it records only the entries it inserted, and the entry's seq is unique in the session. Every field
        ``fences.check_fence`` compares with the session is compared here too, so that a fence trusted here
        is one the check would pass: the session key (fixed for an incarnation: a fence under another key
        was never made of this entry) and the incarnation (a fence without one, made before anchors carried
        it, is checked: only a session that existed then honours it).
        """
        key = (anchor.scope, anchor.session_id)
        placed = self._appended.get((anchor.scope, anchor.session_id, anchor.entry_id))
        if key not in self._locked or placed is None or anchor.incarnation is None:
            return False
        return placed == (
            anchor.seq, anchor.parent_id, anchor.position, anchor.generation, anchor.incarnation, anchor.session_key
        )

    def transaction_failed(self) -> bool:
        """Whether a statement of this transaction failed (PostgreSQL: it can only roll back now)."""
        driver: Any = self.conn.connection.driver_connection
        if self.dialect.is_sqlite:
            return not driver.in_transaction  # SQLite rolled it back itself (disk full, I/O error)
        return bool(driver.info.transaction_status == _PG_INERROR)

    def _forget_appended(self, scope: str, session_id: str) -> None:
        for key in [k for k in self._appended if k[:2] == (scope, session_id)]:
            del self._appended[key]

    def note_checked(self, payload: object, seqs: list[int]) -> None:
        """Record that this transaction built ``payload`` from the closed range it read (its raw seqs)."""
        self._checked[id(payload)] = (payload, seqs)

    def checked_seqs(self, payload: object) -> list[int] | None:
        """The raw seqs recorded for this very payload object by ``note_checked``, or None."""
        found = self._checked.get(id(payload))
        return found[1] if found is not None and found[0] is payload else None

    def lock_session(self, scope: str, session_id: str) -> bool:
        """Lock the session's row for the rest of this transaction; False if there is no such session.

        Once locked (by this call, ``append`` or any ``lock=True`` lookup), it stays locked until the
        transaction ends: no second statement (the fast completion appends, then commits the turn).
        """
        if (scope, session_id) in self._locked:
            return True
        return self.session_row(scope, session_id, lock=True) is not None

    def delta_page_rows(
        self,
        scope: str,
        session_id: str,
        position: int,
        before_position: int | None,
        limit: int,
        max_bytes: int,
        after_seq: int = -1,
        before_seq: int | None = None,
    ) -> tuple[Row[Any] | None, list[Row[Any]]]:
        """The session's row (``s_`` columns: generation, key, creation; ``s_at_seq``, the raw seq at
        ``position``), None when there is no such session, and up to ``limit`` visible message rows
        after ``position`` (before ``before_position``) in position order; in one statement (two when
        the session has branched: see ``_linear_delta_page_statement``).

        ``after_seq`` is the raw seq the caller holds for ``position`` (a cursor's): the rows are only
        the page after ``position`` when ``s_at_seq`` equals it, and the caller must drop them otherwise.
        ``before_seq`` is the seq of the entry at ``before_position`` (a fence's, which the caller checks).
        The rows stop at the first whose stored sizes up to it add up to more than ``max_bytes``; that
        one comes without its payload (None): see ``_bytes_bounded``.
        """
        params = session_params(
            scope, session_id, b_position=position, b_after=position, b_before=before_position, b_limit=limit,
            b_after_seq=after_seq, b_before_seq=before_seq, b_upto=min(position + limit, MAX_INT),
            b_max_bytes=max_bytes,
        )
        bounded = before_position is not None
        key = (self.config.url, scope, session_id)
        if not _BRANCHED.touch(key) and (not bounded or before_seq is not None):
            head, page = self._page_rows(_LINEAR_DELTA_PAGE[(bounded, not self.dialect.is_sqlite)], params)
            if head is None or head.s_linear:
                return head, page
            _BRANCHED.add(key)
        return self._page_rows(_DELTA_PAGE[(bounded, not self.dialect.is_sqlite)], params)

    def _page_rows(self, statement: Any, params: dict[str, Any]) -> tuple[Row[Any] | None, list[Row[Any]]]:
        head = None
        page = []
        for row in self.run(statement, params):
            if row.s_generation is not None:  # the session's row: a session always has a generation
                head = row
            else:
                page.append(row)
        if head is None:
            return None, []
        if len(page) > 1:  # the order a UNION yields is not promised
            page.sort(key=_position_of)
        return head, page

    def require_session(
        self, scope: str, session_id: str, *, lock: bool = False, with_head: bool = False
    ) -> Row[Any]:
        """The session's row, or UnknownSession (whether it is unknown or another scope's)."""
        row = self.session_row(scope, session_id, lock=lock, with_head=with_head)
        if row is None:
            raise UnknownSession(scope, session_id)
        return row

    def create_session(self, scope: str, session_id: str, session_key: str | None) -> SessionInfo:
        """Create a session; the same id with the same key again returns the existing one."""
        ts = now_us()
        stmt = (
            self.dialect.insert(sessions)
            .values(
                scope=scope,
                session_id=session_id,
                session_key=session_key,
                active=True,
                generation=0,
                last_seq=-1,
                head_seq=None,
                head_entry_id=None,
                path_length=0,
                visible_count=0,
                created_us=ts,
                updated_us=ts,
                incarnation=new_incarnation(),
            )
            .on_conflict_do_nothing()
        )
        # Whether this insert or an earlier one made the row does not matter: the row decides.
        self.conn.execute(stmt)
        row = self.session_row(scope, session_id)
        if row is not None:
            if row.session_key != session_key:
                raise IdempotencyConflict(
                    f"session {session_id!r} already exists with another session key"
                )
            return session_info(row)
        if session_key is None or self.find_session_by_key(scope, session_key) is None:
            # The insert did nothing for a row that is gone now: the session of this id (or the key's
            # holder), deleted or ended by another writer between the two statements (PostgreSQL: each
            # READ COMMITTED statement sees the latest commits). Nothing holds the id or key any more:
            # the whole transaction runs again and creates it.
            raise TransientStoreError(f"the session {session_id!r} or the holder of its key ended while it was created")
        raise SessionKeyConflict(f"an active session in scope {scope!r} already has key {session_key!r}")

    def find_session_by_key(self, scope: str, session_key: str) -> Row[Any] | None:
        """The active session holding ``session_key`` in the scope, or None."""
        return self.conn.execute(_BY_KEY, {"b_scope": scope, "b_key": session_key}).first()

    def ended_sessions_by_key(self, scope: str, session_key: str, limit: int) -> list[SessionInfo]:
        """Up to ``limit`` ended sessions of the scope that held ``session_key``, the latest ended first
        (no index: an error path's scan of the scope's sessions)."""
        q = select(sessions).where(
            sessions.c.scope == scope, sessions.c.session_key == session_key, sessions.c.active.is_(False)
        )
        rows = self.conn.execute(q.order_by(sessions.c.updated_us.desc(), sessions.c.session_id).limit(limit)).all()
        return [session_info(r) for r in rows]

    def list_sessions(self, scope: str, after: str | None, limit: int) -> list[SessionInfo]:
        """Sessions of the scope ordered by id, after ``after``."""
        q = select(sessions).where(sessions.c.scope == scope)
        if after is not None:
            q = q.where(sessions.c.session_id > after)
        rows = self.conn.execute(q.order_by(sessions.c.session_id).limit(limit)).all()
        return [session_info(r) for r in rows]

    def session_bytes(self, scope: str, session_id: str) -> int:
        """Total payload bytes of every stored entry of the session."""
        q = select(func.coalesce(func.sum(entries.c.size_bytes), 0)).where(
            entries.c.scope == scope, entries.c.session_id == session_id
        )
        return int(self.conn.execute(q).scalar_one())

    def end_session(self, scope: str, session_id: str) -> SessionInfo:
        """Mark the session inactive, freeing its session key for a successor."""
        self.require_session(scope, session_id, lock=True)
        self.conn.execute(
            update(sessions)
            .where(sessions.c.scope == scope, sessions.c.session_id == session_id)
            .values(active=False, updated_us=now_us())
        )
        return session_info(self.require_session(scope, session_id))

    def delete_session(self, scope: str, session_id: str) -> None:
        """Delete the session and everything keyed by it (cascades), leaving a tombstone of its incarnation
        (``deleted``) and pruning the tombstones past ``TOMBSTONE_SECONDS``."""
        row = self.require_session(scope, session_id, lock=True)
        self._locked.discard((scope, session_id))
        ts = now_us()
        # Deletes are rare, so this is where the tombstones stay bounded: each delete removes the old ones
        # through the age index (every row is pruned once, by some later delete).
        expired = deleted_sessions.c.deleted_us < ts - TOMBSTONE_SECONDS * 1_000_000
        self.conn.execute(delete(deleted_sessions).where(expired))
        self.conn.execute(
            self.dialect.insert(deleted_sessions)
            .values(scope=scope, session_id=session_id, incarnation=row.incarnation, deleted_us=ts)
            .on_conflict_do_nothing()
        )
        self._forget_appended(scope, session_id)
        # Explicit deletes: SQLite cascades only with foreign_keys on, and order keeps PG lock-light.
        for table in (active_path, entries):
            self.conn.execute(delete(table).where(table.c.scope == scope, table.c.session_id == session_id))
        self.conn.execute(
            delete(sessions).where(sessions.c.scope == scope, sessions.c.session_id == session_id)
        )

    def deleted(self, scope: str, session_id: str, incarnation: int | None) -> bool:
        """Whether the session of ``incarnation`` (None: of any) under this id was deleted (its tombstone is kept).

        For a retry of a create whose COMMIT was uncertain: its own incarnation here means the create
        landed and was deleted since; none means it never landed (or it was deleted longer ago than any
        retry runs). A random incarnation is never another session's. Any incarnation is for an id that
        names one request only (an ``Idempotency-Key``'s): any session made under it was that request's."""
        q: Select[Any] = select(literal_column("1")).where(
            deleted_sessions.c.scope == scope, deleted_sessions.c.session_id == session_id
        )
        if incarnation is not None:
            q = q.where(deleted_sessions.c.incarnation == incarnation)
        return self.conn.execute(q.limit(1)).first() is not None

    # ------------------------------------------------------------------------------------ appends

    def _existing(
        self, scope: str, session_id: str, new: NewEntry, by_id: dict[str, Row[Any]] | None = None
    ) -> Row[Any] | None:
        if by_id is not None and new.idempotency_key is None and new.turn_id is None:
            # Keyed by entry_id alone (unique): the batched lookup of ``append`` already holds the answer.
            rows: Sequence[Row[Any]] = [by_id[new.entry_id]] if new.entry_id in by_id else []
        else:
            # OR of equalities, one item at a time: SQLite plans it as a MULTI-INDEX OR over the three
            # unique indexes; an OR of IN lists would make it scan the whole session instead.
            q = _EXISTING[(new.idempotency_key is not None, new.turn_id is not None, not self.dialect.is_sqlite)]
            params = session_params(
                scope, session_id, b_entry=new.entry_id, b_idem=new.idempotency_key, b_turn=new.turn_id
            )
            rows = list({r.seq: r for r in self.run(q, params)}.values())  # one row per entry
        if not rows:
            return None
        if len(rows) > 1:
            raise IdempotencyConflict("entry_id, idempotency_key and turn_id name different entries")
        row = rows[0]
        if row.kind != new.kind or not same_stored_text(row.payload, new.payload_json):
            raise IdempotencyConflict(f"{self._key_name(row, new)} already names an entry with other content")
        if (new.turn_id is not None and row.turn_id != new.turn_id) or (
            new.idempotency_key is not None and row.idempotency_key != new.idempotency_key
        ):
            raise IdempotencyConflict(f"{self._key_name(row, new)} already names another entry")
        return row

    @staticmethod
    def _key_name(row: Row[Any], new: NewEntry) -> str:
        if new.turn_id is not None and row.turn_id == new.turn_id:
            return f"turn_id {new.turn_id!r}"
        if new.idempotency_key is not None and row.idempotency_key == new.idempotency_key:
            return f"idempotency_key {new.idempotency_key!r}"
        return f"entry_id {new.entry_id!r}"

    def append(self, scope: str, session_id: str, items: Sequence[NewEntry]) -> list[Entry]:
        """Append entries at the head, in order; an item whose key exists returns the stored one."""
        return self.append_to_session(scope, session_id, items)[1]

    def append_to_session(
        self, scope: str, session_id: str, items: Sequence[NewEntry], *, with_head: bool = False
    ) -> tuple[Row[Any], list[Entry]]:
        """``append``, also returning the session row as it was locked (its identity fields hold;
        ``with_head``: with the columns of the head entry it appended to, see ``head_view``)."""
        sess, none_stored = self._lock_for_append(scope, session_id, items, with_head)
        seq, depth, visible = sess.last_seq, sess.path_length, sess.visible_count
        head_id, head_seq = sess.head_entry_id, sess.head_seq
        generation = sess.generation
        ts = now_us()
        out: list[Entry] = []
        new_rows: list[dict[str, Any]] = []
        path_rows: list[dict[str, Any]] = []
        new_ids: set[str] = set()
        new_keys: set[str] = set()
        # Items keyed by entry_id alone (replies, bulk appends) are looked up in one batched query,
        # not one query each: a 2,000-item append_many made 2,000 round trips before.
        plain = [i.entry_id for i in items if i.idempotency_key is None and i.turn_id is None]
        by_id = {} if none_stored else self.entry_rows(scope, session_id, plain)
        for item in items:
            existing = None if none_stored else self._existing(scope, session_id, item, by_id)
            if existing is None and item.entry_id in new_ids:
                raise IdempotencyConflict(f"entry_id {item.entry_id!r} appears twice in one append")
            if existing is None and item.idempotency_key is not None:
                # Else the second row's insert hits the key's unique index: a database error.
                if item.idempotency_key in new_keys:
                    raise IdempotencyConflict(f"idempotency_key {item.idempotency_key!r} appears twice in one append")
                new_keys.add(item.idempotency_key)
            if existing is not None:
                out.append(entry_from_row(existing, active=self.on_active_path(scope, session_id, existing)))
                continue
            seq += 1
            position = visible if item.kind == "message" else None
            row = {
                "scope": scope,
                "session_id": session_id,
                "seq": seq,
                "entry_id": item.entry_id,
                "parent_id": head_id,
                "depth": depth,
                "position": position,
                "generation": generation,
                "kind": item.kind,
                "role": item.role,
                "payload": item.payload_json,
                "size_bytes": item.size_bytes,
                "idempotency_key": item.idempotency_key,
                "turn_id": item.turn_id,
                "created_us": ts,
            }
            new_rows.append(row)
            new_ids.add(item.entry_id)
            path_rows.append(
                {"scope": scope, "session_id": session_id, "depth": depth, "seq": seq, "position": position}
            )
            out.append(entry_from_row(_RowView(row), active=True))
            head_id, head_seq = item.entry_id, seq
            depth += 1
            if position is not None:
                visible += 1
        if new_rows:
            head = session_params(
                scope, session_id, b_last_seq=seq, b_head_seq=head_seq, b_head_entry_id=head_id,
                b_path_length=depth, b_visible_count=visible, b_updated_us=ts,
            )
            if not self.dialect.is_sqlite and len(new_rows) <= _ONE_STATEMENT_APPEND_MAX:
                for i, r in enumerate(new_rows):
                    head.update({f"e{i}_{c}": r[c] for c in _APPEND_COLUMNS[2:]})
                self.run(_one_statement_append(len(new_rows)), head)
            else:
                self.run(_INSERT_ENTRIES, new_rows)
                self.run(_INSERT_PATH, path_rows)
                self.run(_ADVANCE_HEAD, head)
            for r in new_rows:
                if r["kind"] == "message" and r["role"] == "user":
                    placed = (
                        r["seq"], r["parent_id"], r["position"], r["generation"], sess.incarnation, sess.session_key
                    )
                    self._appended[(scope, session_id, r["entry_id"])] = placed
        return sess, out

    # ------------------------------------------------------------------------------------ lookups

    def entry_rows(self, scope: str, session_id: str, entry_ids: Sequence[str]) -> dict[str, Row[Any]]:
        """Rows of the named entries that exist in the session, by entry id."""
        if not entry_ids:
            return {}
        out: dict[str, Row[Any]] = {}
        if len(entry_ids) <= _SMALL_IN:
            params = session_params(scope, session_id, **{f"b_id{i}": e for i, e in enumerate(entry_ids)})
            q = _ENTRY_ROWS_OF[(len(entry_ids), not self.dialect.is_sqlite)]
            return {r.entry_id: r for r in self.run(q, params)}
        for at in range(0, len(entry_ids), _IN_CHUNK):
            params = session_params(scope, session_id, b_ids=list(entry_ids[at : at + _IN_CHUNK]))
            if self.dialect.is_sqlite:
                # (untyped: SQLAlchemy 2.1 types a row by its columns, 2.0 by one tuple type)
                rows: Any = self.conn.execute(_ENTRY_ROWS, params)
                out.update((r.entry_id, r) for r in rows)
            else:  # a repeated id comes back once per time it is named: the dict keeps one
                out.update((r.entry_id, r) for r in self.run(_ENTRY_ROWS_OF_ARRAY, params))
        return out

    def keys_between(self, scope: str, session_id: str, first: str, last: str, prefix: str, limit: int) -> list[str]:
        """Up to ``limit`` of the session's idempotency keys from ``first`` to ``last`` starting with ``prefix``
        (which both start with), in order: a walk of the key's index over that range only."""
        params = session_params(scope, session_id, b_first=first, b_last=last, b_len=len(prefix), b_prefix=prefix,
                                b_limit=limit)
        return [str(r.idempotency_key) for r in self.run(_KEYS_BETWEEN, params)]

    def entries_with_path(self, scope: str, session_id: str, entry_ids: Sequence[str]) -> dict[str, Row[Any]]:
        """Rows of up to four named entries with ``ts_path_seq``: the active path's seq at their depth.

        ``row.ts_path_seq == row.seq`` says the entry is on the active path now (``on_active_path``).
        """
        ids = list(dict.fromkeys(entry_ids))
        params = session_params(scope, session_id, **{f"b_id{i}": e for i, e in enumerate(ids)})
        return {r.entry_id: r for r in self.run(_ENTRIES_WITH_PATH_OF[(len(ids), not self.dialect.is_sqlite)], params)}

    def entry_row(self, scope: str, session_id: str, entry_id: str) -> Row[Any]:
        """One entry's row, or UnknownEntry."""
        row = self.entry_rows(scope, session_id, [entry_id]).get(entry_id)
        if row is None:
            raise UnknownEntry(f"no entry {entry_id!r} in session {session_id!r}")
        return row

    def on_active_path(self, scope: str, session_id: str, row: Any) -> bool:
        """Whether the entry row is on the session's active path now."""
        params = session_params(scope, session_id, b_depth=row.depth)
        return bool(self.run(_PATH_SEQ_AT_DEPTH, params).scalar() == row.seq)

    def branched_away(self, scope: str, session_id: str, seq: int, generation: int) -> bool:
        """Whether the entry at raw ``seq`` left the active path by a branch: off the path, and written in
        the session's current ``generation`` (a rewrite since would have rotated it, and keeps a copy of
        the entry where it was: that is no branch)."""
        row = self.entry_by_seq(scope, session_id, seq)
        return row is not None and int(row.generation) == generation and not self.on_active_path(scope, session_id, row)

    def anchor_for(self, sess: Row[Any], row: Any) -> Anchor:
        """The anchor of an entry row, taken in the session's current generation and incarnation."""
        return Anchor.model_construct(
            scope=sess.scope,
            session_id=sess.session_id,
            session_key=sess.session_key,
            generation=sess.generation,
            entry_id=row.entry_id,
            seq=row.seq,
            parent_id=row.parent_id,
            position=row.position,
            idempotency_key=row.idempotency_key,
            incarnation=sess.incarnation,
        )

    def visible_rows(
        self, scope: str, session_id: str, after_position: int, before_position: int | None, limit: int | None
    ) -> list[Row[Any]]:
        """Active-path message rows with after < position < before, in position order."""
        q = _VISIBLE_ROWS[(before_position is not None, limit is not None, not self.dialect.is_sqlite)]
        params = session_params(scope, session_id, b_after=after_position, b_before=before_position, b_limit=limit)
        return self.run(q, params).all()

    def path_rows(self, scope: str, session_id: str, from_depth: int, to_depth: int | None) -> list[Row[Any]]:
        """Active-path entries (messages and events) with from_depth <= depth <= to_depth."""
        q = _PATH_ROWS[(to_depth is not None, not self.dialect.is_sqlite)]
        params = session_params(scope, session_id, b_from=from_depth, b_to=to_depth)
        return self.run(q, params).all()

    def path_seq_at_position(self, scope: str, session_id: str, position: int) -> int | None:
        """The raw seq of the visible message at an active position, or None."""
        seq = self.run(_PATH_SEQ_AT_POSITION, session_params(scope, session_id, b_position=position)).scalar()
        return None if seq is None else int(seq)

    def entry_by_seq(self, scope: str, session_id: str, seq: int) -> Row[Any] | None:
        """One entry by raw seq."""
        return self.run(_ENTRY_BY_SEQ, session_params(scope, session_id, b_seq=seq)).first()

    def all_rows(self, scope: str, session_id: str, after_seq: int, limit: int) -> list[tuple[Row[Any], bool]]:
        """Every stored entry (any branch, any kind) in raw seq order, with its active flag."""
        params = session_params(scope, session_id, b_after_seq=after_seq, b_limit=limit)
        return [(r, r.ts_path_seq == r.seq) for r in self.run(_ALL_ROWS, params)]

    def entry_sizes(self, scope: str, session_id: str, after_seq: int, limit: int) -> list[int]:
        """The stored sizes (``size_bytes``) of at most ``limit`` entries after ``after_seq``, in raw seq order."""
        params = session_params(scope, session_id, b_after_seq=after_seq, b_limit=limit)
        return [r.size_bytes for r in self.run(_ENTRY_SIZES, params)]

    def visible_sizes(self, scope: str, session_id: str, after_position: int, limit: int) -> list[int]:
        """The stored sizes of at most ``limit`` visible messages after ``after_position``, in position order."""
        params = session_params(scope, session_id, b_after=after_position, b_limit=limit)
        return [int(r[0]) for r in self.run(_VISIBLE_SIZES[not self.dialect.is_sqlite], params)]

    # ------------------------------------------------------------------------------------ path moves

    def replace_path_from(self, scope: str, session_id: str, depth: int, rows: Sequence[Any]) -> None:
        """Make ``rows`` (a chain, in depth order starting at ``depth``) the active path's tail."""
        self._forget_appended(scope, session_id)  # what was appended may be off the path now
        self.conn.execute(
            delete(active_path).where(
                active_path.c.scope == scope,
                active_path.c.session_id == session_id,
                active_path.c.depth >= depth,
            )
        )
        if rows:
            self.conn.execute(
                insert(active_path),
                [
                    {
                        "scope": scope,
                        "session_id": session_id,
                        "depth": r.depth,
                        "seq": r.seq,
                        "position": r.position,
                    }
                    for r in rows
                ],
            )

    def visible_count(self, scope: str, session_id: str) -> int:
        """Number of visible messages on the active path (from the materialized projection)."""
        # The last position, by a backward probe of the position index under a written-out LIMIT: on
        # tables never analyzed PostgreSQL answered max(position) by reading the session's whole path
        # (2,000 rows at 2,000 messages, on every branch and rewrite).
        q = (
            select(active_path.c.position)
            .where(
                active_path.c.scope == scope,
                active_path.c.session_id == session_id,
                active_path.c.position.is_not(None),
            )
            .order_by(active_path.c.position.desc())
            .limit(literal_column("1"))
        )
        top = self.conn.execute(q).scalar()
        return 0 if top is None else int(top) + 1


class _RowView:
    """Attribute access over a dict, so freshly inserted rows reuse ``entry_from_row``."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


def head_view(sess: Row[Any]) -> Any:
    """The head entry of a session row read ``with_head``, as an entry row, or None (no head, or not
    the head the row names).

    On PostgreSQL a lock that waited for another writer returns the session row as that writer left
    it, while the head columns were read in the statement's earlier snapshot: they may describe the
    previous head. Only a head whose seq and entry id are the row's own is returned.
    """
    if sess.h_seq is None or sess.h_seq != sess.head_seq or sess.h_entry_id != sess.head_entry_id:
        return None
    return _RowView({c.key: getattr(sess, f"h_{c.key}") for c in ENTRY_COLUMNS})


def _fast_entry_matches() -> bool:
    """Whether ``_construct_entry`` builds exactly what ``Entry.model_construct`` builds (see there)."""
    sample = _RowView(
        {
            "entry_id": "e", "parent_id": None, "seq": 1, "kind": "message", "role": "user",
            "payload": '{"role":"user","content":"x"}', "position": 0, "generation": 0, "size_bytes": 29,
            "idempotency_key": None, "turn_id": "t", "created_us": 1,
        }
    )
    values = entry_values(sample, True)
    slow = Entry.model_construct(**values)
    fast = _construct_entry(dict(values))
    state = ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
    return (
        set(slow.__dict__) == set(Entry.model_fields)
        and all(getattr(slow, a, None) == getattr(fast, a, None) for a in state)
        and slow == fast
    )


_FAST_ENTRY = _fast_entry_matches()
