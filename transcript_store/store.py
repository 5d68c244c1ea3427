"""TranscriptStore: the public API, one transaction per call over the backend-neutral core."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

from pydantic import ConfigDict, Field
from sqlalchemy import Connection

from . import fences, migrate, mirror, paths, reads
from .config import StoreConfig
from .core import (
    MAX_INCARNATION,
    MAX_INT,
    Core,
    NewEntry,
    check_anchor,
    check_id,
    entry_from_row,
    new_id,
    prepare_entry,
    session_info,
)
from .db import Database, mask_url
from .errors import (
    InvalidInput,
    InvalidMessage,
    SessionKeyConflict,
    SessionReplaced,
    TransientStoreError,
    UnknownEntry,
    UnknownSession,
)
from .models import (
    Admission,
    Anchor,
    ClosedRangeResult,
    DeltaResult,
    Entry,
    EntryKind,
    Replacement,
    RewriteResult,
    SessionInfo,
)
from .shapes import Shape

T = TypeVar("T")


class AppendItem(Shape):
    """One entry of an ``append_many`` call."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: EntryKind = "message"
    message: dict[str, Any] | None = None
    payload: dict[str, Any] | None = None
    # Strict ids: lax mode would turn b"id" into "id", an id that ``append`` itself refuses.
    entry_id: str | None = Field(None, strict=True)
    idempotency_key: str | None = Field(None, strict=True)


log = logging.getLogger("transcript_store.store")

#: PostgreSQL plans a session's reads badly until its tables were analyzed once (bench/README.md,
#: "Profiling" 7): an import at least this large refreshes the statistics right away, instead of
#: leaving the first reads to wait for autovacuum.
ANALYZE_AFTER_IMPORT = 5_000


def _moved_already(c: Core, scope: str, session_id: str, entry_id: str | None, last_seq: int) -> bool:
    """Whether a branch to ``entry_id`` is in place, with only entries written after seq ``last_seq``
    (the session's last seq when the branch ran) following it on the active path."""
    if entry_id is None:
        depth = 0
    else:
        found = c.entries_with_path(scope, session_id, [entry_id]).get(entry_id)
        if found is None or found.ts_path_seq != found.seq:
            return False
        depth = found.depth + 1
    return all(r.seq > last_seq for r in c.path_rows(scope, session_id, depth, None))


def replaced(c: Core, scope: str, session_id: str, incarnation: int | None) -> bool:
    """Whether the session an earlier attempt of this call wrote to (of ``incarnation``, as its anchors
    carry it: always set on the ones it made) is gone: deleted since, perhaps made again under its id
    (another incarnation, someone else's session)."""
    row = c.session_row(scope, session_id)
    return row is None or row.incarnation != incarnation


def landed_since(c: Core, scope: str, session_id: str, made: SessionInfo) -> bool:
    """Whether an earlier attempt of a create, which answered ``made``, landed and its session was ended or
    deleted since (the tombstone of its incarnation): its retry then answers ``made``, never makes the
    session again. False: the session is there, active, as made; or the attempt never landed.

    The row is locked (PostgreSQL): a delete committing between this read and the retry's create would
    leave the create's insert nothing to conflict with, and it would make the session again. Locked, the
    delete waits for the retry, or the retry for it (and then finds its tombstone)."""
    row = c.session_row(scope, session_id, lock=True)
    if row is not None and row.incarnation == made.incarnation:
        return not row.active
    return c.deleted(scope, session_id, made.incarnation)


class TranscriptStore:
    """A durable conversation-transcript store on SQLite (default) or PostgreSQL.

    Every method names the scope; a session of another scope is indistinguishable from an unknown one.
    Every write is one transaction, retried whole on transient errors, and refused with a typed error
    before anything is written when its input is invalid.
    """

    def __init__(
        self, url: str | None = None, *, config: StoreConfig | None = None, create: bool = True
    ) -> None:
        """Open a store; a fresh SQLite path is created at the newest schema revision.

        ``create=True`` runs ``ensure_current`` now: a schema behind is migrated or refused with
        ``SchemaNotCurrent`` as ``auto_upgrade`` says (unset: SQLite migrated, PostgreSQL refused).
        ``create=False`` neither reads nor migrates the schema (the caller migrates, ``upgrade``): a SQLite
        path that is not there is still made (its folders now, an empty database file at the first call),
        and the first call on a database without the store's schema raises ``SchemaNotCurrent``.
        """
        # Checked here: anything else reached the database layer as AttributeError or TypeError.
        if config is not None and not isinstance(config, StoreConfig):
            raise InvalidInput(f"config must be a StoreConfig, not {type(config).__name__}")
        if not isinstance(create, bool):
            raise InvalidInput(f"create must be a bool, not {type(create).__name__}")
        if config is None:
            config = StoreConfig.from_env(url=url)
        else:
            # Built again, even without a url: a config made by model_construct or model_copy(update=...)
            # skipped validation, and its bad value (a url of None, a max_payload_bytes of "x") failed in
            # the driver or in an append with TypeError instead of InvalidInput. ``dict``, not
            # model_dump: the serializer warns about exactly those values.
            config = StoreConfig(**{**dict(config), **({"url": url} if url is not None else {})})
        self.config = config
        self.db = Database(config)
        #: set by ``close``: what runs on its own behind the store (a host's lease renewals) stops then
        self.closed = False
        if create:
            try:
                self.ensure_current()
            except BaseException:
                self.db.dispose()
                raise

    # ------------------------------------------------------------------------------------ lifecycle

    @classmethod
    def upgrade_url(cls, url: str) -> str:
        """Migrate the database at ``url`` to the newest revision; returns the revision."""
        # Checked here: ``from_env`` ignores a None override, and None migrated (or created) the database of
        # TRANSCRIPT_STORE_URL or ./transcripts.db instead of refusing the call.
        if not isinstance(url, str):
            raise InvalidInput(f"url must be a database URL, not {type(url).__name__}")
        db = Database(StoreConfig.from_env(url=url))
        try:
            return migrate.upgrade(db)
        finally:
            db.dispose()

    def ensure_current(self) -> None:
        """Refuse a schema that is not at head (``SchemaNotCurrent``), or migrate it when the config allows
        (``auto_upgrade``; unset: yes for SQLite, no for PostgreSQL)."""
        self.db.check_open()  # migrations connect through the engine itself, not through ``Database``
        auto = self.config.auto_upgrade if self.config.auto_upgrade is not None else self.db.dialect.is_sqlite
        migrate.ensure_current(self.db, auto_upgrade=auto)

    def upgrade(self) -> str:
        """Migrate this store's database to the newest revision; returns the revision."""
        self.db.check_open()
        return migrate.upgrade(self.db)

    def current_revision(self) -> str | None:
        """The schema revision of the database."""
        self.db.check_open()
        return migrate.current_revision(self.db)

    @property
    def url(self) -> str:
        """The database URL, password masked."""
        return mask_url(self.config.url)

    @property
    def backend(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self.db.dialect.name

    def close(self) -> None:
        """Release every connection, and end the lease renewals of turns still held on this store; any
        later call raises StoreClosed (a call still running ends with its connection closed)."""
        self.closed = True
        self.db.close()

    def __enter__(self) -> TranscriptStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def write(self, fn: Callable[[Core], T]) -> T:
        """Run ``fn`` on the core inside ONE write transaction (retried whole: keep it re-runnable); then
        the ``Core.after_commit`` hooks of the attempt whose write stands (one that raises is logged: the
        write stands all the same)."""
        ran: list[Core] = []  # the attempts whose ``fn`` ran to its end (their COMMIT was sent)

        def attempt(conn: Connection) -> T:
            core = Core(conn, self.db.dialect, self.config)
            result = fn(core)
            earlier = ran[-1] if ran else None
            if (
                earlier is not None and earlier.committed_hooks and not core.committed_hooks
                and earlier.landed_checks and all(check(core) for check in earlier.landed_checks)
            ):
                # This attempt did nothing of its own: it found the earlier one's write, whose COMMIT
                # landed though the connection dropped with its answer. Told by that attempt's own
                # checks, never by this one having no hooks: a COMMIT that did not land, the work done
                # since by another writer (a duplicate), leaves a retry without hooks too.
                core.adopt(earlier)
            ran.append(core)
            return result

        result = self.db.write(attempt)
        for hook in ran[-1].committed_hooks:
            try:
                hook()
            except Exception:
                # The write stands: raised here, its caller would take it for failed and make it again.
                log.exception("an after_commit hook failed; the write it followed stands")
        return result

    def read(self, fn: Callable[[Core], T]) -> T:
        """Run ``fn`` on the core inside one read-only snapshot."""
        return self.db.read(lambda conn: fn(Core(conn, self.db.dialect, self.config)))

    def statement(self, fn: Callable[[Core], T]) -> T:
        """Run ``fn``, which executes ONE statement through the core's ``run``, outside any transaction
        (``Database.statement``: atomic by itself, retried whole, so it must be idempotent). ``fn`` may
        run a second one whose answer stands alone (a delta page of a branched session: the first
        statement's rows are dropped), never one that needs the first's snapshot."""
        return self.db.statement(lambda conn: fn(Core(conn, self.db.dialect, self.config)))

    # ------------------------------------------------------------------------------------ sessions

    def create_session(
        self, scope: str, *, session_id: str | None = None, session_key: str | None = None
    ) -> SessionInfo:
        """Create a session (id generated when omitted); the same id and key again is a no-op."""
        check_id("scope", scope, new=True)
        check_id("session_id", session_id, optional=True, new=True)
        check_id("session_key", session_key, optional=True, new=True)
        sid = session_id or new_id()
        landed: list[SessionInfo] = []  # the session as an attempt that ran to its end answered it

        def run(c: Core) -> SessionInfo:
            if landed and landed_since(c, scope, sid, landed[0]):
                # An earlier attempt created it (or found it) and only its COMMIT was uncertain: ended,
                # or deleted (perhaps made again), since, by someone who found it. Answered ended, or
                # made again, it is an answer no order of the calls gives. (Gone without a tombstone of
                # its incarnation, or another's, it is a COMMIT that did not land: the row decides.)
                return landed[0]
            landed[:] = [c.create_session(scope, sid, session_key)]
            return landed[0]

        return self.write(run)

    def open_session(self, scope: str, session_key: str) -> SessionInfo:
        """The active session holding ``session_key``, created when there is none."""
        check_id("scope", scope, new=True)
        check_id("session_key", session_key, new=True)
        sid = new_id()
        landed: list[SessionInfo] = []  # the session an attempt created, under this call's own id

        def run(c: Core) -> SessionInfo:
            if landed and landed_since(c, scope, sid, landed[0]):
                # An earlier attempt created it and only its COMMIT was uncertain: ended (or deleted,
                # perhaps made again) since, by someone who found it. It is this call's answer, as it was
                # made: created again, or returned ended, it is an answer no order of the calls gives.
                return landed[0]
            row = c.find_session_by_key(scope, session_key)
            if row is not None:
                return session_info(row)
            try:
                landed[:] = [c.create_session(scope, sid, session_key)]
                return landed[0]
            except SessionKeyConflict:
                # Another open_session of the key created it after the lookup (on PostgreSQL the insert
                # waited for it and did nothing): that session is the answer, as if it had been first.
                row = c.find_session_by_key(scope, session_key)
                if row is None:
                    # ... and ended since (PostgreSQL: this transaction reads each statement's latest
                    # commits): the key is free again. The whole transaction runs again and creates it.
                    raise TransientStoreError(f"the holder of key {session_key!r} ended while it was opened") from None
                return session_info(row)

        return self.write(run)

    def get_session(self, scope: str, session_id: str) -> SessionInfo:
        """The session, or UnknownSession."""
        self._ids(scope, session_id)
        return self.read(lambda c: session_info(c.require_session(scope, session_id)))

    def find_session(self, scope: str, session_key: str) -> SessionInfo | None:
        """The active session holding ``session_key`` in the scope, or None."""
        check_id("scope", scope)
        check_id("session_key", session_key)

        def run(c: Core) -> SessionInfo | None:
            row = c.find_session_by_key(scope, session_key)
            return session_info(row) if row is not None else None

        return self.read(run)

    def ended_sessions(self, scope: str, session_key: str, *, limit: int = 5) -> list[SessionInfo]:
        """Up to ``limit`` (1..100) ended sessions of the scope that held ``session_key``, latest ended first."""
        check_id("scope", scope)
        check_id("session_key", session_key)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100:
            raise InvalidInput(f"limit must be an integer from 1 to 100, not {limit!r}")
        return self.read(lambda c: c.ended_sessions_by_key(scope, session_key, limit))

    def list_sessions(self, scope: str, *, after: str | None = None, limit: int = 100) -> list[SessionInfo]:
        """Sessions of the scope in id order, ``limit`` (1..10000) after ``after``."""
        check_id("scope", scope)
        check_id("after", after, optional=True)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise InvalidInput(f"limit must be an integer in 1..10000, got {limit!r}")
        return self.read(lambda c: c.list_sessions(scope, after, limit))

    def session_bytes(self, scope: str, session_id: str) -> int:
        """Total payload bytes of every stored entry of the session."""
        self._ids(scope, session_id)
        return self.read(lambda c: (c.require_session(scope, session_id), c.session_bytes(scope, session_id))[1])

    def end_session(self, scope: str, session_id: str) -> SessionInfo:
        """Mark the session inactive (its key is free for a successor); its entries stay."""
        self._ids(scope, session_id)
        landed: list[SessionInfo] = []  # what an attempt that ran to its end left

        def run(c: Core) -> SessionInfo:
            if landed and replaced(c, scope, session_id, landed[0].incarnation):
                # An earlier attempt ended the session and only its COMMIT was uncertain: it was
                # deleted since, perhaps made again under the id (someone else's, left active).
                return landed[0]
            info = c.end_session(scope, session_id)
            landed[:] = [info]
            return info

        return self.write(run)

    def delete_session(self, scope: str, session_id: str, *, incarnation: int | None = None) -> SessionInfo:
        """Delete the session and every entry of it, for good; returns it as it was when deleted.

        ``incarnation`` (a ``SessionInfo``'s, from an earlier lookup) deletes that session only: one
        deleted and made again under the id since raises SessionReplaced and stays whole."""
        self._ids(scope, session_id)
        # In the column's range, as an anchor's (check_anchor): -1 or 2**70 was answered SessionReplaced,
        # "deleted and made again since", of a session that was neither.
        if incarnation is not None and (
            isinstance(incarnation, bool) or not isinstance(incarnation, int) or not 0 <= incarnation <= MAX_INCARNATION
        ):
            raise InvalidInput(f"incarnation must be None or an integer in 0..{MAX_INCARNATION}, got {incarnation!r}")
        landed: list[SessionInfo] = []  # the session an attempt deleted

        def run(c: Core) -> SessionInfo:
            if landed and replaced(c, scope, session_id, landed[0].incarnation):
                # An earlier attempt ran to its end and only its COMMIT was uncertain: the session
                # it deleted is gone (a session made since under the same id is someone else's).
                return landed[0]
            info = session_info(c.require_session(scope, session_id, lock=True))
            if incarnation is not None and info.incarnation != incarnation:
                raise SessionReplaced(scope, session_id)
            c.delete_session(scope, session_id)
            landed[:] = [info]
            return info

        return self.write(run)

    # ------------------------------------------------------------------------------------ appends

    def append(
        self,
        scope: str,
        session_id: str,
        message: dict[str, Any] | None = None,
        *,
        kind: EntryKind = "message",
        payload: dict[str, Any] | None = None,
        entry_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> Entry:
        """Append one entry at the head; the same idempotency key again returns the stored entry."""
        self._ids(scope, session_id)
        item = prepare_entry(
            self.config, kind=kind, message=message, payload=payload, entry_id=entry_id,
            idempotency_key=idempotency_key,
        )
        return self._append(scope, session_id, [item])[0]

    def append_many(self, scope: str, session_id: str, items: Sequence[AppendItem | dict[str, Any]]) -> list[Entry]:
        """Append several entries as one chain in one transaction."""
        self._ids(scope, session_id)
        prepared = self.prepare(items)
        return self._append(scope, session_id, prepared)

    def _append(
        self,
        scope: str,
        session_id: str,
        items: list[NewEntry],
        check: Callable[[Core, Any, list[Entry]], None] | None = None,
    ) -> list[Entry]:
        """``append_many``'s transaction; ``check(c, session row as locked, entries)`` runs after the append in
        it and may raise to write nothing (the service's Idempotency-Key shape check)."""
        landed: list[tuple[int, list[Entry]]] = []  # the incarnation an attempt appended to, and what

        def run(c: Core) -> list[Entry]:
            if landed and replaced(c, scope, session_id, landed[0][0]):
                # An earlier attempt ran to its end and only its COMMIT was uncertain; its session was
                # deleted since, perhaps made again under the id: the keys that find a retry's own write
                # are not in that one, and appending there would write into someone else's transcript.
                return landed[0][1]
            sess, out = c.append_to_session(scope, session_id, items)
            if check is not None:
                check(c, sess, out)
            landed[:] = [(int(sess.incarnation), out)]
            return out

        return self.write(run)

    def prepare(self, items: Sequence[AppendItem | dict[str, Any]]) -> list[NewEntry]:
        """Validate and serialize entries ahead of a transaction."""
        if isinstance(items, str | bytes) or not isinstance(items, Sequence):
            raise InvalidInput("items must be a list of entries")
        out = []
        for raw in items:
            item = raw if isinstance(raw, AppendItem) else _append_item(raw)
            out.append(
                prepare_entry(
                    self.config, kind=item.kind, message=item.message, payload=item.payload,
                    entry_id=item.entry_id, idempotency_key=item.idempotency_key,
                )
            )
        return out

    def admit(
        self, scope: str, session_id: str, message: dict[str, Any], *, turn_id: str, entry_id: str | None = None
    ) -> Admission:
        """Append the user message of logical turn ``turn_id``; the same turn again: same admission."""
        self._ids(scope, session_id)
        item = self.prepare_admission(message, turn_id=turn_id, entry_id=entry_id)
        landed: list[Admission] = []

        def run(c: Core) -> Admission:
            if landed and replaced(c, scope, session_id, landed[0].anchor.incarnation):
                return landed[0]  # as ``append``: never admitted again into a session made since
            landed[:] = [admit_in(c, scope, session_id, item)]
            return landed[0]

        return self.write(run)

    def prepare_admission(
        self, message: dict[str, Any], *, turn_id: str, entry_id: str | None = None
    ) -> NewEntry:
        """Validate an admission's user message ahead of a transaction."""
        check_id("turn_id", turn_id)
        item = prepare_entry(self.config, message=message, entry_id=entry_id, turn_id=turn_id)
        if item.role != "user":
            raise InvalidMessage("an admission is a user message")
        return item

    # ------------------------------------------------------------------------------------ reads

    def anchor(self, scope: str, session_id: str, entry_id: str) -> Anchor:
        """The anchor of an entry, in the session's current generation."""
        self._ids(scope, session_id)
        check_id("entry_id", entry_id)

        def run(c: Core) -> Anchor:
            sess = c.require_session(scope, session_id)
            return c.anchor_for(sess, c.entry_row(scope, session_id, entry_id))

        return self.read(run)

    def read_visible_delta(
        self,
        scope: str,
        session_id: str,
        cursor: str | None = None,
        *,
        max_messages: int = 1000,
        max_bytes: int = 1_000_000,
        fence: Anchor | None = None,
    ) -> DeltaResult:
        """Visible messages after ``cursor``: a page, a reset (re-read from its cursor) or missing (no such
        session; with a ``fence``, ReadFenceError "missing", as ``read_visible`` raises). A page without entries
        whose ``required_bytes`` is set holds back a next message over ``max_bytes``: read again with that many."""
        self._ids(scope, session_id)
        reads.check_limits(max_messages, max_bytes)
        if cursor is not None and not isinstance(cursor, str):
            raise InvalidInput("cursor must be a string or None")
        if fence is not None:
            check_anchor("fence", fence)
        else:
            # Most pages are one statement: read without a transaction (one round trip on PostgreSQL);
            # a cursor whose anchor moved is told apart in a snapshot (reads.NeedsSnapshot).
            try:
                return self.statement(
                    lambda c: reads.read_visible_delta(
                        c, scope, session_id, cursor, max_messages, max_bytes, None, snapshot=False
                    )
                )
            except reads.NeedsSnapshot:
                pass
        return self.read(
            lambda c: reads.read_visible_delta(c, scope, session_id, cursor, max_messages, max_bytes, fence)
        )

    def read_visible(self, scope: str, session_id: str, *, fence: Anchor | None = None) -> list[Entry]:
        """The whole visible transcript (before the fence, when given)."""
        self._ids(scope, session_id)
        if fence is not None:
            check_anchor("fence", fence)

        def run(c: Core) -> list[Entry]:
            before = None
            if fence is not None:
                fences.check_fence(c, scope, session_id, fence)
                before = fence.position
            else:
                c.require_session(scope, session_id)
            return [entry_from_row(r, True) for r in c.visible_rows(scope, session_id, -1, before, None)]

        return self.read(run)

    def get_entries(self, scope: str, session_id: str, entry_ids: Sequence[str]) -> list[Entry]:
        """Entries by id (any branch, any kind), in the order asked; unknown ids raise UnknownEntry."""
        self._ids(scope, session_id)
        if isinstance(entry_ids, str) or not isinstance(entry_ids, Sequence) or len(entry_ids) > 10_000:
            raise InvalidInput("entry_ids must be a list of at most 10000 ids")
        for eid in entry_ids:
            check_id("entry_id", eid)

        def run(c: Core) -> list[Entry]:
            c.require_session(scope, session_id)
            rows = c.entry_rows(scope, session_id, list(entry_ids))
            missing = [eid for eid in entry_ids if eid not in rows]
            if missing:
                raise UnknownEntry(f"no entry {missing[0]!r} in session {session_id!r}")
            return [entry_from_row(rows[e], c.on_active_path(scope, session_id, rows[e])) for e in entry_ids]

        return self.read(run)

    def list_entries(
        self, scope: str, session_id: str, *, after_seq: int = -1, limit: int = 1000
    ) -> list[Entry]:
        """Every stored entry (off-branch and non-message ones too) in raw seq order."""
        self._ids(scope, session_id)
        if isinstance(after_seq, bool) or not isinstance(after_seq, int) or not -1 <= after_seq <= MAX_INT:
            raise InvalidInput(f"after_seq must be an integer in -1..{MAX_INT}, got {after_seq!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise InvalidInput(f"limit must be an integer in 1..10000, got {limit!r}")

        def run(c: Core) -> list[Entry]:
            c.require_session(scope, session_id)
            return [entry_from_row(r, a) for r, a in c.all_rows(scope, session_id, after_seq, limit)]

        return self.read(run)

    def read_closed_range(self, admission: Anchor | Admission, terminal: Anchor) -> ClosedRangeResult:
        """The visible messages of a finished turn (admission..terminal), or a typed failure."""
        # ``getattr``: an Admission made by ``model_construct`` may have no anchor at all (InvalidInput then).
        first = check_anchor(
            "admission", getattr(admission, "anchor", None) if isinstance(admission, Admission) else admission
        )
        check_anchor("terminal", terminal)
        return self.read(lambda c: fences.read_closed_range(c, first, terminal))

    # ------------------------------------------------------------------------------------ moves

    def branch(self, scope: str, session_id: str, entry_id: str | None) -> SessionInfo:
        """Move the active head to ``entry_id`` (None: empty path); later appends go there."""
        self._ids(scope, session_id)
        check_id("entry_id", entry_id, optional=True)
        landed: list[SessionInfo] = []  # the session as an attempt left it (its last seq: a move writes no entry)

        def run(c: Core) -> SessionInfo:
            if landed:
                row = c.session_row(scope, session_id)
                if row is None or row.incarnation != landed[0].incarnation:
                    # An earlier attempt ran to its end and only its COMMIT was uncertain; the session it
                    # moved was deleted since, perhaps made again under the id: never move that one.
                    return landed[0]
                if _moved_already(c, scope, session_id, entry_id, landed[0].entry_count - 1):
                    # An earlier attempt ran to its end and only its COMMIT was uncertain: what follows
                    # the entry on the path now was appended since, by writers that saw the move (moving
                    # again would take their entries off the visible transcript).
                    return session_info(row)
            # Through the mirror: a host transcript import's resume point the move went under is reset.
            info = mirror.branch(c, scope, session_id, entry_id)
            landed[:] = [info]
            return info

        return self.write(run)

    def rewrite_entries(
        self,
        scope: str,
        session_id: str,
        replacements: Sequence[Replacement | dict[str, Any]],
        *,
        allowed_rewrite_suffix_entry_ids: Sequence[str] | None = None,
    ) -> RewriteResult:
        """Replace messages by branching and re-appending the suffix; the generation rotates."""
        self._ids(scope, session_id)
        reps = paths.validate_replacements(replacements)
        prepared = [prepare_entry(self.config, message=r.message) for r in reps]
        allowed = None
        if allowed_rewrite_suffix_entry_ids is not None:
            ids = allowed_rewrite_suffix_entry_ids
            if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
                raise InvalidInput("allowed_rewrite_suffix_entry_ids must be a list of entry ids")
            for eid in ids:
                check_id("allowed_rewrite_suffix_entry_ids[]", eid)
            allowed = set(ids)
        pool = paths.IdPool()
        landed: list[tuple[int, RewriteResult]] = []  # the incarnation an attempt rewrote, and its result

        def run(c: Core) -> RewriteResult:
            pool.rewind()  # a retried attempt writes the very entry ids the earlier one drew
            if landed and replaced(c, scope, session_id, landed[0][0]):
                # The session the earlier attempt rewrote was deleted since, perhaps made again under
                # the id (someone else's): its COMMIT was only uncertain, never rewrite that one.
                return landed[0][1]
            if landed and landed[0][1].changed and pool.drawn and c.entry_rows(scope, session_id, pool.drawn[:1]):
                # The earlier attempt's entries exist: its COMMIT went through, report its result.
                return landed[0][1]
            result = paths.rewrite_entries(c, scope, session_id, reps, prepared, allowed, pool)
            landed[:] = [(int(c.require_session(scope, session_id).incarnation), result)]
            return result

        return self.write(run)

    # ------------------------------------------------------------------------------------ helpers

    @staticmethod
    def _ids(scope: str, session_id: str) -> None:
        check_id("scope", scope)
        check_id("session_id", session_id)

    # ------------------------------------------------------------------------------------ transfer

    def export_session(self, scope: str, session_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The session's header and every entry as lossless JSON records, from one snapshot."""
        from . import transfer

        self._ids(scope, session_id)
        return self.read(lambda c: transfer.export_in(c, scope, session_id))

    def import_session(
        self,
        scope: str,
        header: dict[str, Any],
        entries: Sequence[dict[str, Any]],
        *,
        session_id: str | None = None,
        session_key: str | None = None,
        keyless: bool = False,
    ) -> SessionInfo:
        """Recreate an exported session (same entries, tree and head) in one transaction; never overwrites.

        ``session_id``/``session_key`` name the copy instead of the header's; ``keyless``: it has no key."""
        from . import transfer

        plan = transfer.plan_import(
            self.config, scope, header, entries, session_id=session_id, session_key=session_key, keyless=keyless
        )
        return transfer.write_import(self, plan)


def admit_in(c: Core, scope: str, session_id: str, item: NewEntry) -> Admission:
    """Admit inside an open transaction (the turn runner adds its outbox row to the same one)."""
    return admit_and_tell(c, scope, session_id, item)[0]


def admit_and_tell(c: Core, scope: str, session_id: str, item: NewEntry) -> tuple[Admission, bool, bool]:
    """``admit_in``, also telling whether entries follow the admitted one and whether it was stored
    already (an admission replayed)."""
    sess, appended = c.append_to_session(scope, session_id, [item])
    entry = appended[0]
    assert item.turn_id is not None
    # The appended Entry carries every field of its row that an anchor takes: no second lookup.
    admission = Admission.model_construct(anchor=c.anchor_for(sess, entry), turn_id=item.turn_id)
    # ``sess`` is the row as locked, before this append: a new entry's seq is past its last_seq.
    return admission, entry.seq < sess.last_seq, entry.seq <= sess.last_seq


def _append_item(raw: Any) -> AppendItem:
    from pydantic import ValidationError

    if not isinstance(raw, dict):
        raise InvalidInput("each item must be a dict or AppendItem")
    try:
        return AppendItem.model_validate(raw)
    except ValidationError as e:
        raise InvalidInput(f"invalid append item: {e.errors()[0]['msg']}") from None


__all__ = ["AppendItem", "TranscriptStore", "UnknownSession"]
