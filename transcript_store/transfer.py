"""Session export and import: one session as lossless JSON records, and its re-creation in one transaction.

An export is a header record (the session's identity and head) followed by one record per stored entry
in raw seq order: every branch, every kind, with the fields that make the tree (entry id, parent id,
seq, position, generation), the keys that make retries idempotent (idempotency key, turn id) and each
entry's size (the UTF-8 bytes of its stored text).
An import validates all of it before the transaction (a dense seq, parents that exist and came earlier,
positions that count the message ancestors, active flags that are exactly the path to the head, every
payload through the same checks as an append, each declared size_bytes equal to the size of the text
the entry is stored as (a record without one, edited by hand, gets its size computed), generations as
the store writes them, turn ids only on user messages, times as ISO 8601 texts with at most
microseconds) and then writes the session, its entries and its active path in ONE transaction, or
nothing. Generations as the store writes them: a session starts in generation 0
and only a rewrite moves it, by one, re-appending entries in the new generation; so along seq the
entries' generations start at 0 and never go back, each step up is one, and the header's generation is
the last entry's (0 for a session without entries). Whatever an import refuses is an ``InvalidInput``
naming the record and the field (an existing session or key: ``IdempotencyConflict`` or
``SessionKeyConflict``), and nothing is written.

An export carries the transcript only: no turn intents (the outbox), no receipts (the ledger) and no
engine state. An imported session is therefore new to the host and to every engine, even under the
source's scope and id: engines read it from its first entry, as a session they never saw. A turn that
was admitted in the source but not answered when it was exported (its user message has a turn id and
nothing follows it) has no intent in the copy: retried under its turn id there, it runs and commits as
usual (if a new turn goes first instead, the unanswered one is ``TurnOvertaken``). A turn whose reply
the source holds (committed, or accepted and not yet delivered to its engine) is not known as done in
the copy: retried under its turn id there, it runs again and a second reply is appended (unless a later
turn followed it: ``TurnOvertaken``), where the source answers ``duplicate``. So export a session while
no turn of it runs, and do not retry the source's turns on a copy.
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy import insert
from sqlalchemy.engine import Row

from .config import StoreConfig
from .core import (
    MAX_INT,
    Core,
    NewEntry,
    check_id,
    entry_values,
    new_incarnation,
    prepare_entry,
    session_info,
)
from .errors import IdempotencyConflict, InvalidInput, SessionKeyConflict, TranscriptStoreError
from .models import SessionInfo
from .schema import active_path, entries, sessions

if TYPE_CHECKING:
    from .store import TranscriptStore

log = logging.getLogger("transcript_store.transfer")

FORMAT = "transcript-store.session.v1"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_LAST = datetime.max.replace(tzinfo=UTC)
_BATCH = 500
_Item = TypeVar("_Item")
#: The most stored bytes (the entries' ``size_bytes``) one page of an export holds, unless its one entry
#: is larger. A page costs 2.5 to 3.5 times its stored bytes of Python memory (rows, records, lines):
#: with 256 KiB pages the export of 4,000 entries of 2 KiB (9.3 MB) peaked past a quarter of its size.
#: Small as it is, a page of 2 KiB entries is 64 of them, and its two statements cost less than encoding it.
_EXPORT_PAGE_BYTES = 128 * 1024
#: The most entries one page of an export holds, however small they are.
_EXPORT_PAGE_ROWS = 2_000
#: The fewest stored sizes read ahead after the first page: pages of one large entry each share a read.
_EXPORT_SIZES_AHEAD = 32
#: the shape of a time an export holds: ISO 8601 date and time, at most microseconds, an optional offset
#: (its absence is refused with its own message after parsing)
_STAMP = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d{1,6})?)?(?:[Zz]|[+-]\d{2}(?::?\d{2})?)?")


def iso_us(us: int) -> str:
    """Stored microseconds as an exact ISO 8601 UTC timestamp."""
    return (_EPOCH + timedelta(microseconds=us)).isoformat(timespec="microseconds")


def us_from_iso(value: datetime) -> int:
    """An aware datetime as exact microseconds since the epoch."""
    return (value - _EPOCH) // timedelta(microseconds=1)


class _Record(BaseModel):
    # Strict: lax mode would turn "3" into 3 or 1 into True, and an import must not guess.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @field_validator("created_at", "updated_at", mode="before", check_fields=False)
    @classmethod
    def _stamp_text(cls, value: Any) -> Any:
        # The times are parsed in lax mode (a text is no datetime in strict mode), which also takes a
        # number, a numeric text or bytes for Unix seconds or milliseconds (a guess), and cuts a
        # seventh fractional digit off: only an ISO 8601 text (or a datetime) is a time here.
        if isinstance(value, datetime):
            return value
        if not isinstance(value, str) or _STAMP.fullmatch(value) is None:
            raise ValueError(
                "must be an ISO 8601 date and time with at most 6 fractional digits and a UTC offset, "
                "like 2024-01-31T12:00:00.000000+00:00"
            )
        return value


class SessionHeader(_Record):
    """The first record of an export: the session's identity, head and counts."""

    format: str
    scope: str
    session_id: str
    session_key: str | None
    active: bool
    # Below the INTEGER columns' top: a rewrite adds one to the generation, and a stored value past
    # 2**31-1 is out of range on PostgreSQL and refused by every fence on SQLite.
    generation: int = Field(ge=0, lt=MAX_INT)
    head_entry_id: str | None
    entry_count: int = Field(ge=0, le=MAX_INT)
    visible_count: int = Field(ge=0, le=MAX_INT)
    created_at: datetime = Field(strict=False)
    updated_at: datetime = Field(strict=False)


class EntryRecord(_Record):
    """One stored entry, every field (``size_bytes``: the UTF-8 bytes of its stored text, checked on import
    when given; a record edited by hand may leave it out)."""

    entry_id: str
    parent_id: str | None
    seq: int = Field(ge=0, le=MAX_INT)
    kind: str
    role: str | None
    message: dict[str, Any] | None
    payload: dict[str, Any] | None
    position: int | None = Field(ge=0, le=MAX_INT)
    generation: int = Field(ge=0, le=MAX_INT)
    size_bytes: int | None = Field(default=None, ge=0, le=MAX_INT)
    idempotency_key: str | None
    turn_id: str | None
    created_at: datetime = Field(strict=False)
    active: bool


def _parse(model: type[_Record], raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise InvalidInput(f"{where} must be a JSON object")
    try:
        record = model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "record"
        raise InvalidInput(f"{where}: {field}: {first['msg']}") from None
    for name in ("created_at", "updated_at"):
        stamp = getattr(record, name, None)
        if stamp is not None and stamp.tzinfo is None:
            raise InvalidInput(f"{where}: {name} must carry a UTC offset")
        if stamp is not None and stamp > _LAST:
            # Stored as microseconds, read back as a datetime: past year 9999 in UTC no datetime holds
            # it, and every later read of the session would fail.
            raise InvalidInput(f"{where}: {name} must not be after 9999-12-31T23:59:59.999999Z")
        if stamp is not None and stamp < _EPOCH:
            # Every time this store writes is a non-negative count of microseconds since the epoch; an
            # import is held to the same (until revision 0007 the creation time was also the session's
            # incarnation, which cursors check as a non-negative number).
            raise InvalidInput(f"{where}: {name} must not be before 1970-01-01T00:00:00Z")
    return record


# ---------------------------------------------------------------------------------------------- export


def export_in(core: Core, scope: str, session_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and entry records of one session, read in one snapshot."""
    header = _export_header(core, scope, session_id)
    return header, [record for page in _export_pages(core, scope, session_id) for record in page]


def write_export_in(core: Core, scope: str, session_id: str, out: BinaryIO) -> int:
    """Write the session's export (its JSON lines, UTF-8) to the seekable ``out`` from the caller's
    snapshot, a page at a time; returns the number of entries.

    ``out`` is emptied first: a read retried after a transient error writes the file again from the
    start. Memory holds one page, not the session (building every line first took about 5 times the
    export's size: 900 MB for a 190 MB export)."""
    out.seek(0)
    out.truncate()
    out.write(export_line(_export_header(core, scope, session_id)))
    count = 0
    for page in _export_pages(core, scope, session_id):
        out.write(b"".join(export_line(record) for record in page))
        count += len(page)
    return count


def export_line(record: dict[str, Any]) -> bytes:
    """One line of an export: compact JSON, UTF-8 whatever the locale (lossless), and its line break."""
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")


def _export_header(core: Core, scope: str, session_id: str) -> dict[str, Any]:
    sess = core.require_session(scope, session_id)
    return {
        "format": FORMAT,
        "scope": sess.scope,
        "session_id": sess.session_id,
        "session_key": sess.session_key,
        "active": bool(sess.active),
        "generation": sess.generation,
        "head_entry_id": sess.head_entry_id,
        "entry_count": sess.last_seq + 1,
        "visible_count": sess.visible_count,
        "created_at": iso_us(sess.created_us),
        "updated_at": iso_us(sess.updated_us),
    }


def _export_pages(core: Core, scope: str, session_id: str) -> Iterator[list[dict[str, Any]]]:
    """The session's entry records in seq order, a page at a time (``row_pages``)."""
    for page in row_pages(core, scope, session_id):
        yield [_entry_record(row, active) for row, active in page]


def row_pages(core: Core, scope: str, session_id: str) -> Iterator[list[tuple[Row[Any], bool]]]:
    """Every stored entry's row and active flag in seq order, a page at a time: as many entries as the byte
    budget holds by their stored sizes (at least one, so an entry larger than the budget goes alone)."""
    # Bounded by the stored sizes, read first, not by the payload cap's worst case: 64 MiB pages of 16
    # entries at the 4 MiB cap took 5,002 statements for a session of 80,000 small entries, 105 now
    # (PostgreSQL: 5.4 s, now 4.3 s).
    return sized_pages(
        core,
        lambda after, limit: core.entry_sizes(scope, session_id, after, limit),
        lambda after, limit: core.all_rows(scope, session_id, after, limit),
        lambda item: int(item[0].seq),
    )


def sized_pages(
    core: Core,
    sizes: Callable[[int, int], Sequence[int]],
    rows: Callable[[int, int], Sequence[_Item]],
    key: Callable[[_Item], int],
) -> Iterator[list[_Item]]:
    """Pages of ``rows(after, limit)`` (in the order of their ``key``, from -1 on) as long as the byte budget
    holds by ``sizes(after, limit)``, the stored sizes of the same items read first (at least one a page)."""
    # The first look ahead is what the cap's worst case allows (at least one entry), then twice the last
    # page, and at least _EXPORT_SIZES_AHEAD.
    ahead = max(1, min(_EXPORT_PAGE_ROWS, _EXPORT_PAGE_BYTES // core.config.max_payload_bytes))
    after = -1
    known: list[int] = []  # the stored sizes of the items after ``after``, as read ahead
    last = False  # ``known`` runs to the last item
    while True:
        take = _within_budget(known)
        if take == len(known) and not last:
            # Where this page ends is past the sizes known: read them again from here, further ahead.
            # Pages of one entry larger than half the budget are decided by the sizes already read: read
            # again for every page, a session of 70 KB entries took two statements an entry (4,000 of
            # them on PostgreSQL: 4.6 s, 3.9 s now, 2.5 s with the cap's worst case of 16 a page).
            known = list(sizes(after, ahead))
            last = len(known) < ahead
            take = _within_budget(known)
        if take == 0:
            return
        page = list(rows(after, take))
        yield page
        if last and take == len(known):
            return  # the last entries
        after = key(page[-1])
        del known[:take]
        # Not the whole 2,000 ahead each time: on SQLite, reading an entry's size walks the overflow
        # pages of its text (the column comes after it), so every size read past the page's end is a
        # second read of that text; twice the last page keeps them to about one page's worth. Entries
        # that large are read ahead a few dozen at a time, each size once.
        ahead = min(_EXPORT_PAGE_ROWS, max(2 * take, _EXPORT_SIZES_AHEAD))


def _within_budget(sizes: Sequence[int]) -> int:
    """How many of the first entries of these stored sizes a page holds (at least one when any)."""
    total = 0
    for count, size in enumerate(sizes):
        total += size
        if total > _EXPORT_PAGE_BYTES:
            return max(1, count)
    return len(sizes)


def _entry_record(row: Any, active: bool) -> dict[str, Any]:
    # The same fields as an Entry, with created_at as exact microseconds text for a lossless round trip.
    return {**entry_values(row, active), "created_at": iso_us(row.created_us)}


# ---------------------------------------------------------------------------------------------- import


#: The most stored bytes one INSERT of an import's entries carries (besides at most _BATCH rows; at least
#: one row): what memory holds of the entries while the transaction writes them.
_IMPORT_BATCH_BYTES = 512 * 1024
#: An entry row's columns as an import spools them: one JSON array a line, then the stored text's
#: ``size_bytes`` of UTF-8 as they are (escaping them again for JSON cost more than checking the entry).
#: The scope and session are the plan's.
_SPOOLED = ("seq", "entry_id", "parent_id", "depth", "position", "generation", "kind", "role", "size_bytes",
            "idempotency_key", "turn_id", "created_us")


@dataclass(frozen=True)
class ImportPlan:
    """A validated import: the session's row, its entry rows and its active path, computed before the
    transaction. ``entry_batches()`` gives the entry rows from the first each time it is called, so a
    transaction retried after a transient error writes them all again."""

    session: dict[str, Any]
    entry_count: int
    entry_batches: Callable[[], Iterator[list[dict[str, Any]]]]
    #: the seqs of the active path, root to head (an entry's depth is its index), and their positions
    #: (-1: no message)
    path_seqs: Sequence[int]
    path_positions: Sequence[int]

    def path_batches(self) -> Iterator[list[dict[str, Any]]]:
        """The rows of the active path, root to head, a batch at a time."""
        scope, sid = self.session["scope"], self.session["session_id"]
        for start in range(0, len(self.path_seqs), _BATCH):
            yield [
                {"scope": scope, "session_id": sid, "depth": depth, "seq": self.path_seqs[depth],
                 "position": None if self.path_positions[depth] < 0 else self.path_positions[depth]}
                for depth in range(start, min(start + _BATCH, len(self.path_seqs)))
            ]


def plan_import(
    config: StoreConfig,
    scope: str,
    header: Any,
    records: Sequence[Any],
    *,
    session_id: str | None = None,
    session_key: str | None = None,
    keyless: bool = False,
) -> ImportPlan:
    """Validate an export completely; raises InvalidInput (nothing written) on the first problem.

    ``session_id``/``session_key``: the copy's, instead of the header's; ``keyless``: the copy has no key."""
    head, sid, key = _check_header(scope, header, session_id, session_key, keyless)
    if isinstance(records, str | bytes) or not isinstance(records, Sequence):
        raise InvalidInput("entries must be a list of entry records")
    if len(records) != head.entry_count:
        raise InvalidInput(f"header says {head.entry_count} entries, the export has {len(records)}")
    tree = _Tree(config, scope, sid, head)
    rows = [tree.add(raw) for raw in records]
    return tree.plan(key, lambda: (rows[start : start + _BATCH] for start in range(0, len(rows), _BATCH)))


def plan_import_stream(
    config: StoreConfig,
    scope: str,
    header: Any,
    records: Iterable[Any],
    spool: BinaryIO,
    *,
    session_id: str | None = None,
    session_key: str | None = None,
    keyless: bool = False,
) -> ImportPlan:
    """Validate an export read a record at a time as ``plan_import`` does, its checked entry rows written
    to ``spool`` (a temporary file, emptied first) and read back from it by the plan: memory holds the few
    facts per entry the checks of the whole export need, not the entries.

    Holding every record, then every row took about 6 times the export's size (640 MB of RSS for a
    100 MB export of 50,000 entries). Spooling the rows, not reading the export twice, writes exactly
    what was checked, even from stdin or a file changed meanwhile, and checks each entry once."""
    head, sid, key = _check_header(scope, header, session_id, session_key, keyless)
    tree = _Tree(config, scope, sid, head)
    records = iter(records)  # one iterator: the records past the count are counted from where it stopped
    spool.seek(0)
    spool.truncate()
    for raw in records:
        if len(tree) == head.entry_count:  # one too many: the rest is counted, not checked
            try:
                more = 1 + sum(1 for _ in records)
            except InvalidInput:
                # A later line is no record (an export appended to another, cut short): this one, past the
                # count, is the first problem in file order, not that line (whose error was given instead).
                raise InvalidInput(f"header says {head.entry_count} entries, the export has more") from None
            raise InvalidInput(f"header says {head.entry_count} entries, the export has {len(tree) + more}")
        row = tree.add(raw)
        fields = json.dumps([row[name] for name in _SPOOLED], ensure_ascii=False, separators=(",", ":"))
        spool.write(fields.encode("utf-8", "surrogatepass") + b"\n" + row["payload"].encode("utf-8"))
    if len(tree) != head.entry_count:
        raise InvalidInput(f"header says {head.entry_count} entries, the export has {len(tree)}")
    spool.flush()
    return tree.plan(key, lambda: _spooled_batches(spool, scope, sid))


def _spooled_batches(spool: BinaryIO, scope: str, sid: str) -> Iterator[list[dict[str, Any]]]:
    """The entry rows ``plan_import_stream`` spooled, from the first, in batches of at most _BATCH rows
    and _IMPORT_BATCH_BYTES of stored text (or one larger row alone)."""
    spool.seek(0)
    batch: list[dict[str, Any]] = []
    size = 0
    while line := spool.readline():
        row = dict(zip(_SPOOLED, json.loads(line.decode("utf-8", "surrogatepass")), strict=True))
        row["payload"] = spool.read(row["size_bytes"]).decode("utf-8")
        batch.append({"scope": scope, "session_id": sid, **row})
        size += row["size_bytes"]
        if len(batch) == _BATCH or size >= _IMPORT_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _check_header(
    scope: str, header: Any, session_id: str | None, session_key: str | None, keyless: bool
) -> tuple[SessionHeader, str, str | None]:
    """The export's header checked, and the session id and key the import writes."""
    check_id("scope", scope, new=True)
    head = _parse(SessionHeader, header, "header")
    if head.format != FORMAT:
        raise InvalidInput(f"header: format {head.format!r} is not {FORMAT!r}")
    # The header's own ids, used or not (an import names its scope, and may name a new id and key): ids
    # the store held, so ids as every call takes them (not held to MAX_ID_BYTES, as a new id is).
    check_id("header: scope", head.scope)
    check_id("header: session_id", head.session_id)
    check_id("header: session_key", head.session_key, optional=True)
    if not isinstance(keyless, bool):  # a truthy "no" (or 1) imported the copy without its key
        raise InvalidInput(f"keyless must be true or false, not {type(keyless).__name__}")
    if keyless and session_key is not None:
        raise InvalidInput("an import is either keyless or under a session_key, not both")
    sid = session_id if session_id is not None else head.session_id
    key = None if keyless else session_key if session_key is not None else head.session_key
    # A new session's id and key, named as the header's field when they are the header's: so an import's
    # every refusal names its record (the CLI adds the line), and one of an id an earlier release stored
    # (1-255 characters, but over MAX_ID_BYTES) says the import takes another.
    for what, given, value in (("session_id", session_id, sid), ("session_key", session_key, key)):
        try:
            check_id(what, value, optional=True, new=True)
        except InvalidInput as e:
            if given is not None:
                raise
            raise InvalidInput(f"header: {e} for a new session; import it under another {what}") from None
    return head, sid, key


class _Tree:
    """The checks of an import's entries, fed one record at a time in seq order: every entry validated as
    an append would be, with the tree's shape and the generations checked. Per entry it keeps only what
    the checks of the whole export need (its seq by id, parent, depth, messages through it, position,
    active flag, keys), never the entry."""

    def __init__(self, config: StoreConfig, scope: str, sid: str, head: SessionHeader) -> None:
        self.config, self.scope, self.sid, self.head = config, scope, sid, head
        self.seq_of: dict[str, int] = {}
        self.parents = array("q")  # the parent's seq, -1 for a root
        self.depths = array("q")
        self.through = array("q")  # the messages on the path root -> entry, the entry included
        self.positions = array("q")  # -1: no message
        self.active = bytearray()
        self.keys: set[str] = set()
        self.turns: set[str] = set()
        self.last_generation: int | None = None

    def __len__(self) -> int:
        return len(self.parents)

    def add(self, raw: Any) -> dict[str, Any]:
        """Check the next entry record (as read from JSON) and return its row."""
        i = len(self.parents)
        rec = _parse(EntryRecord, raw, f"entry {i}")
        where = f"entry {i} ({rec.entry_id!r})"
        if rec.seq != i:
            raise InvalidInput(f"{where}: seq {rec.seq}, expected {i} (entries are dense, in raw seq order)")
        new = self._checked(rec, where)
        parent = -1
        if rec.parent_id is not None:
            parent = self.seq_of.get(rec.parent_id, -1)
            if parent < 0:
                raise InvalidInput(f"{where}: parent {rec.parent_id!r} is not an earlier entry")
        depth = 0 if parent < 0 else self.depths[parent] + 1
        messages_before = 0 if parent < 0 else self.through[parent]
        position = messages_before if rec.kind == "message" else None
        if rec.position != position:
            raise InvalidInput(f"{where}: position {rec.position}, the tree gives {position}")
        self.seq_of[rec.entry_id] = i
        self.parents.append(parent)
        self.depths.append(depth)
        self.through.append(messages_before + (rec.kind == "message"))
        self.positions.append(-1 if position is None else position)
        self.active.append(rec.active)
        self.last_generation = rec.generation
        return {
            "scope": self.scope,
            "session_id": self.sid,
            "seq": rec.seq,
            "entry_id": rec.entry_id,
            "parent_id": rec.parent_id,
            "depth": depth,
            "position": position,
            "generation": rec.generation,
            "kind": new.kind,
            "role": new.role,
            "payload": new.payload_json,
            "size_bytes": new.size_bytes,
            "idempotency_key": rec.idempotency_key,
            "turn_id": rec.turn_id,
            "created_us": us_from_iso(rec.created_at),
        }

    def _checked(self, rec: EntryRecord, where: str) -> NewEntry:
        """The entry prepared as an append would be, its fields checked against the entries before it."""
        new = _prepare(self.config, rec, where)
        if new.kind != "message" and rec.payload is None:
            # An append takes no payload for {} (prepare_entry's default), but the store always exports the
            # object it stored: a null here is no export of this store, and taking it for {} would be a guess.
            raise InvalidInput(f"{where}: payload must be an object for a {new.kind!r} entry, not null")
        if rec.size_bytes is not None and rec.size_bytes != new.size_bytes:
            # The size is declared, so it is checked: a file whose sizes disagree with its contents is not
            # what it says it is (edited or cut), and the store keeps sizes for byte budgets and caps.
            what = "message" if new.kind == "message" else "payload"
            raise InvalidInput(
                f"{where}: size_bytes {rec.size_bytes}, but its {what} is {new.size_bytes} bytes as stored "
                "(compact JSON in UTF-8)"
            )
        if rec.entry_id in self.seq_of:
            raise InvalidInput(f"{where}: entry_id appears twice")
        if new.role != rec.role:
            raise InvalidInput(f"{where}: role {rec.role!r} does not match the message")
        _unique(self.keys, rec.idempotency_key, f"{where}: idempotency_key appears twice")
        _unique(self.turns, rec.turn_id, f"{where}: turn_id appears twice")
        if rec.turn_id is not None and new.role != "user":
            # The store gives a logical turn id only to an admitted user message (``admit``, or a commit
            # binding its admission): anywhere else it names no turn, and every admission of it would be
            # refused as an IdempotencyConflict.
            what = f"a message of role {new.role!r}" if new.kind == "message" else f"a {new.kind!r} entry"
            raise InvalidInput(f"{where}: turn_id {rec.turn_id!r} on {what}; only a user message has one")
        if rec.generation > self.head.generation:
            raise InvalidInput(f"{where}: generation {rec.generation} is after the session's {self.head.generation}")
        _check_generation(where, rec.generation, self.last_generation)
        return new

    def plan(self, key: str | None, entry_batches: Callable[[], Iterator[list[dict[str, Any]]]]) -> ImportPlan:
        """The plan of the checked entries, once the checks of the whole export pass."""
        head = self.head
        last = self.last_generation if self.last_generation is not None else 0
        if head.generation != last:
            # Only a rewrite moves the session's generation, and it writes its entries in the new one.
            has = f"the last entry's is {last}" if len(self) else "the session has no entries, so it is in 0"
            raise InvalidInput(
                f"header: generation {head.generation}, but {has} (only a rewrite moves it, with entries)"
            )
        path = self._active_path()
        positions = array("q", (self.positions[seq] for seq in path))
        visible = sum(1 for p in positions if p >= 0)
        if visible != head.visible_count:
            raise InvalidInput(f"header says {head.visible_count} visible messages, the active path has {visible}")
        session = {
            "scope": self.scope,
            "session_id": self.sid,
            "session_key": key,
            "active": head.active,
            "generation": head.generation,
            "last_seq": len(self) - 1,
            "head_seq": path[-1] if path else None,
            "head_entry_id": head.head_entry_id,
            "path_length": len(path),
            "visible_count": visible,
            "created_us": us_from_iso(head.created_at),
            "updated_us": us_from_iso(head.updated_at),
            # A new incarnation, not the export's: two imports of one export are two sessions for cursors.
            "incarnation": new_incarnation(),
        }
        return ImportPlan(session, len(self), entry_batches, path, positions)

    def _active_path(self) -> array[int]:
        """The seqs root -> head; the records' active flags must name exactly these."""
        path = array("q")
        head_id = self.head.head_entry_id
        if head_id is not None:
            seq = self.seq_of.get(head_id, -1)
            if seq < 0:
                raise InvalidInput(f"header: head_entry_id {head_id!r} is not an entry of the export")
            while seq >= 0:
                path.append(seq)
                seq = self.parents[seq]
            path.reverse()
        on_path = bytearray(len(self))
        for seq in path:
            on_path[seq] = 1
        if on_path != self.active:
            i = next(i for i, (a, b) in enumerate(zip(on_path, self.active, strict=True)) if a != b)
            entry_id = next(e for e, seq in self.seq_of.items() if seq == i)
            state = "active but off" if self.active[i] else "not active but on"
            raise InvalidInput(f"entry {i} ({entry_id!r}) is marked {state} the path to the head")
        return path


def _check_generation(where: str, generation: int, previous: int | None) -> None:
    """An entry's generation after the one before it in seq (None: the first entry), as the store writes them."""
    if previous is None:
        if generation != 0:
            raise InvalidInput(
                f"{where}: generation {generation} on the first entry; a session starts in generation 0 "
                "(a rewrite needs an entry to rewrite)"
            )
    elif generation < previous:
        raise InvalidInput(f"{where}: generation {generation} goes back from {previous} (never along seq)")
    elif generation > previous + 1:
        raise InvalidInput(f"{where}: generation {generation} skips from {previous} (a rewrite adds one)")


def _prepare(config: StoreConfig, rec: EntryRecord, where: str) -> NewEntry:
    try:
        return prepare_entry(
            config,
            kind=rec.kind,
            message=rec.message,
            payload=rec.payload,
            entry_id=rec.entry_id,
            idempotency_key=rec.idempotency_key,
            turn_id=rec.turn_id,
            stored=True,  # an export of a store: what an earlier release stored imports again
        )
    except InvalidInput as e:
        raise type(e)(f"{where}: {e}") from None


def _unique(seen: set[str], value: str | None, message: str) -> None:
    if value is None:
        return
    if value in seen:
        raise InvalidInput(message)
    seen.add(value)


def import_in(core: Core, plan: ImportPlan) -> SessionInfo:
    """Write a validated import in the caller's transaction; an existing session is refused.

    A plan is for one import (``TranscriptStore.import_session`` makes one per call): the session it
    finds under its own incarnation is taken for this import's earlier attempt, not refused.
    """
    scope, sid = plan.session["scope"], plan.session["session_id"]
    # The primary key is the refusal: no read-then-insert race between two importers.
    stmt = core.dialect.insert(sessions).values(**plan.session).on_conflict_do_nothing()
    # RETURNING, not rowcount: psycopg reports -1 for an INSERT ... ON CONFLICT DO NOTHING here.
    if core.conn.execute(stmt.returning(sessions.c.session_id)).first() is None:
        existing = core.session_row(scope, sid)
        if existing is not None and existing.incarnation == plan.session["incarnation"]:
            # This very import, by an earlier attempt whose COMMIT was uncertain: the incarnation was
            # drawn once, before the first attempt, so no other session has it. It landed whole.
            return session_info(existing)
        if existing is not None:
            raise IdempotencyConflict(f"session {sid!r} already exists in scope {scope!r}; import never overwrites")
        raise SessionKeyConflict(
            f"an active session in scope {scope!r} already has key {plan.session['session_key']!r}"
        )
    for batch in plan.entry_batches():
        core.conn.execute(insert(entries), batch)
    for batch in plan.path_batches():
        core.conn.execute(insert(active_path), batch)
    return session_info(core.require_session(scope, sid))


def write_import(store: TranscriptStore, plan: ImportPlan) -> SessionInfo:
    """Write a plan of ``plan_import`` in one transaction of ``store``, then refresh the statistics of a
    large import (as ``TranscriptStore.import_session`` does after planning).

    Planning needs only the store's config, not the store: a caller that must not open, create or migrate
    a database for an import that is refused (the CLI, whose store opens with ``create``) plans first.
    """
    from .store import ANALYZE_AFTER_IMPORT, landed_since

    scope, sid = plan.session["scope"], plan.session["session_id"]
    landed: list[SessionInfo] = []  # the session as an attempt that ran to its end imported it

    def run(c: Core) -> SessionInfo:
        if landed and landed_since(c, scope, sid, landed[0]):
            # An earlier attempt imported it and only its COMMIT was uncertain: ended, or deleted (perhaps
            # made again), since. Imported again, it is a session its deleter saw go. (Still there, as
            # imported, ``import_in`` answers it.)
            return landed[0]
        landed[:] = [import_in(c, plan)]
        return landed[0]

    info = store.write(run)
    if plan.entry_count >= ANALYZE_AFTER_IMPORT:
        try:
            store.db.analyze(("ts_entries", "ts_active_path"))
        except TranscriptStoreError as e:  # the import landed; fresher statistics are a bonus
            log.warning("ANALYZE after importing %d entries failed: %s", plan.entry_count, e)
    return info


__all__ = [
    "FORMAT",
    "EntryRecord",
    "ImportPlan",
    "SessionHeader",
    "export_in",
    "export_line",
    "import_in",
    "plan_import",
    "plan_import_stream",
    "row_pages",
    "sized_pages",
    "write_export_in",
    "write_import",
]
