"""Every error the library raises, in one tree.

Driver errors never escape: the dialect layer translates them here, once, with ``raise ... from e``.
Transient errors (serialization failures, deadlocks, dropped connections, a busy SQLite file) are
retried around the whole transaction; every other error is final and nothing was written.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Literal

FenceReason = Literal["missing", "rewritten", "moved", "not_user", "scope", "crossed"]


#: characters of an error's description kept in logs, outbox rows, quarantine records and tool results
DESCRIBE_LIMIT = 1000


def describe(error: BaseException, limit: int = DESCRIBE_LIMIT) -> str:
    """``Type: message`` of an error, one line, bounded; a driver error (SQLAlchemy's) without its SQL
    and parameters, which hold whatever the statement wrote (messages, megabytes of tool output)."""
    orig = getattr(error, "orig", None)
    shown = orig if isinstance(orig, BaseException) else error
    lines = str(shown).strip().splitlines()
    text = f"{type(shown).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    # Storable as it is (quarantine reasons, an intent's last error): PostgreSQL's text takes no NUL,
    # and neither backend's driver encodes a lone surrogate; both are spelled as escapes instead.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    return text if len(text) <= limit else text[: limit - 14] + " ... (cut)"


class TranscriptStoreError(Exception):
    """Base class of every error raised by transcript-store."""


class InvalidInput(TranscriptStoreError, ValueError):
    """A caller's argument was refused before anything was written."""


class InvalidMessage(InvalidInput):
    """A message is not a valid OpenAI chat-format message."""


class PayloadTooLarge(InvalidInput):
    """A payload is larger than the store's configured cap."""


class PromptTooLarge(InvalidInput):
    """A turn's request cannot fit the token budget even with no context at all: the system prompt, the
    user message and the tools' schemas (``tokens``) and the reply's ``max_output_tokens`` are over
    ``token_budget``. No engine can help (compaction never shortens the message being sent): refused
    before the admission, so nothing was written and the session is not held."""

    def __init__(self, tokens: int, max_output_tokens: int, token_budget: int) -> None:
        super().__init__(
            f"the request needs {tokens} tokens before any context (system prompt, user message, tool schemas)"
            f" and {max_output_tokens} for the reply: over the token budget of {token_budget}; shorten the"
            " message or raise the budget"
        )
        self.tokens = tokens
        self.max_output_tokens = max_output_tokens
        self.budget = token_budget


class UnknownSession(TranscriptStoreError, LookupError):
    """No such session in this scope (a session of another scope looks exactly like this)."""

    def __init__(self, scope: str, session_id: str, ended: Sequence[str] = ()) -> None:
        # ``ended``: the ids of ended sessions that held ``session_id`` as their key (a key names only its
        # active session; `sessions list` shows the ended ones): the way to them, rather than a bare "unknown".
        note = (
            f": no active session holds that key; ended sessions that held it (latest first): "
            f"{', '.join(repr(i) for i in ended)}; name one by its id"
            if ended else ""
        )
        super().__init__(f"unknown session {session_id!r} in scope {scope!r}{note}")
        self.scope = scope
        self.session_id = session_id


class SessionReplaced(UnknownSession):
    """The session looked up is gone: deleted, and another made under its id since (another incarnation).
    Unknown, as the session the caller meant no longer exists; nothing was changed."""

    def __init__(self, scope: str, session_id: str) -> None:
        TranscriptStoreError.__init__(
            self,
            f"session {session_id!r} in scope {scope!r} was deleted and made again since it was looked up"
            " (another incarnation): nothing changed",
        )
        self.scope = scope
        self.session_id = session_id


class SessionDeleted(UnknownSession):
    """The session an earlier attempt of this request made was deleted since (its tombstone is kept): the
    retry answers that instead of making the session again (an ``Idempotency-Key``'s retry)."""

    def __init__(self, scope: str, session_id: str, request: str) -> None:
        TranscriptStoreError.__init__(
            self,
            f"session {session_id!r} in scope {scope!r}, which {request} made, was deleted since: not made again",
        )
        self.scope = scope
        self.session_id = session_id


class UnknownEntry(TranscriptStoreError, LookupError):
    """No such entry in this session."""


class SessionKeyConflict(TranscriptStoreError):
    """Another active session in the scope already holds this session key."""


class IdempotencyConflict(TranscriptStoreError):
    """An idempotency key, entry id or logical turn id was reused with different content."""


class ReadFenceError(TranscriptStoreError):
    """A fenced read cannot honour `before-current-turn-entry-v1`; ``reason`` says why."""

    def __init__(self, reason: FenceReason, detail: str = "") -> None:
        super().__init__(f"read fence cannot be honoured: {reason}" + (f" ({detail})" if detail else ""))
        self.reason: FenceReason = reason
        self.detail = detail


class AdvancementKeyCollision(TranscriptStoreError):
    """An advancement key was committed before with a different payload."""

    def __init__(self, key: str) -> None:
        super().__init__(f"context-engine advancement key collision: {key}")
        self.key = key


class TurnKeyConflict(AdvancementKeyCollision):
    """The admitted entry belongs to another logical turn: commit it under that turn's key.

    An entry admitted with a logical turn id is committed under that id; an entry appended without
    one is bound to the first key it is committed under. A turn committed under two keys would reach
    an engine twice.
    """

    def __init__(self, key: str, entry_id: str, turn_key: str | None) -> None:
        TranscriptStoreError.__init__(
            self,
            f"advancement key {key!r} cannot commit entry {entry_id!r}: "
            + (f"it is the admission of logical turn {turn_key!r}" if turn_key is not None
               else "the key is another entry's logical turn id"),
        )
        self.key = key
        self.entry_id = entry_id
        self.turn_key = turn_key


MirrorReason = Literal["behind", "cursor", "turn_mismatch"]


class MirrorConflict(TranscriptStoreError):
    """A host transcript mirror cannot take a page or turn as given; ``reason`` says what to do.

    ``behind``: the mirror has not seen the host transcript this range follows: it starts past the
    mirror's end, or (a turn) a turn admitted after this one's admission is mirrored already, so this
    one is late or the host went back before it (import the host transcript first: a resume point past
    this turn's admission is reset by the refusal, so that import reads the host from its start; a
    stale turn stays refused);
    ``cursor``: the page was read from a host cursor the mirror no longer holds (re-read the state);
    ``turn_mismatch``: the stored range differs from the turn's messages.
    """

    def __init__(self, reason: MirrorReason, detail: str = "") -> None:
        super().__init__(f"host transcript mirror: {reason}" + (f" ({detail})" if detail else ""))
        self.reason: MirrorReason = reason
        self.detail = detail


class OutboxCollision(TranscriptStoreError):
    """A turn intent was rewritten with another payload, owner or an illegal transition."""


class UnknownTurn(OutboxCollision, LookupError):
    """No outbox row of this logical turn in this session: every call of the turn-commit API that needs one
    (``Turns.accept``, ``complete``, ``block``) raises this. An ``OutboxCollision`` too (accepting a turn
    that has no intent is an illegal transition), which ``accept`` and ``complete`` raised before.
    ``HostRuntime.run_turn`` never passes it on: a turn it ran whose intent was discarded meanwhile did
    exist, and fails with a plain ``OutboxCollision`` (or ``TurnOvertaken``) saying so."""

    def __init__(self, session_id: str, turn_id: str, detail: str = "") -> None:
        super().__init__(f"no turn intent {turn_id!r} in session {session_id!r}" + (f": {detail}" if detail else ""))
        self.session_id = session_id
        self.turn_id = turn_id


class SessionBusy(TranscriptStoreError):
    """Another logical turn of the session is admitted and still running (its worker's lease is live),
    or this very turn is, by an attempt on another engine (``turn_id`` names it then).

    A session runs one turn at a time: admitting a second one before the first is completed or
    discarded would put the second turn's messages inside the first one's range. Nothing was written;
    retry once that turn ends, or after ``lease_expires_at`` (when its worker has died, recovery
    discards it then). A ``lease_expires_at`` already past means every attempt of that turn is gone
    by now: retry at once. None: the turn holds no lease to wait for.
    """

    def __init__(self, session_id: str, turn_id: str, lease_expires_at: datetime | None) -> None:
        super().__init__(f"session {session_id!r} is running turn {turn_id!r}; one turn at a time")
        self.session_id = session_id
        self.turn_id = turn_id
        self.lease_expires_at = lease_expires_at


class TurnOvertaken(TranscriptStoreError):
    """A logical turn whose admission a later turn has followed: it can no longer complete.

    Raised for a retried turn id, and by the host runtime for a running turn whose intent was discarded
    while it ran (its worker looked dead past its lease) once another turn was admitted. Its reply would
    land after the later turn's messages, and its range would hold them a second time. Nothing of this
    attempt was written; present the user message again under a new turn id.
    """

    def __init__(self, turn_id: str, later_turn_id: str) -> None:
        super().__init__(f"turn {turn_id!r} was overtaken by turn {later_turn_id!r}; admit it under a new turn id")
        self.turn_id = turn_id
        self.later_turn_id = later_turn_id


class TurnBranchedAway(InvalidInput):
    """The turn's admitted user message left the session's active branch while the turn ran (a branch or a
    rewrite by another writer): its replies have no place on the branch and are not written.

    Raised by ``Turns.complete`` (and so by ``HostRuntime.run_turn``, which discards the turn's intent)
    with nothing written, as ``Turns.accept`` refuses a terminal not descending from the admission.
    Present the message again on the branch as it is now.
    """

    def __init__(self, session_id: str, turn_id: str) -> None:
        super().__init__(
            f"turn {turn_id!r} of session {session_id!r}: its admitted message left the active branch while "
            "it ran; its replies were not written"
        )
        self.session_id = session_id
        self.turn_id = turn_id


class TurnFailed(TranscriptStoreError):
    """A logical turn failed on every attempt; its intent was discarded and no engine advanced (unless
    the call took the turn over from an earlier attempt still running: handed back to it, as said).

    Raised by ``HostRuntime.run_turn``.
    """


class SchemaNotCurrent(TranscriptStoreError):
    """The database schema is behind (or ahead of) this library; run the upgrade."""


class StoreUnavailable(TranscriptStoreError):
    """The database could not be reached or refused the operation for a non-logical reason."""


class StorageFull(StoreUnavailable):
    """The database ran out of disk space (SQLITE_FULL, PostgreSQL 53100): the write was rolled back whole.

    Not transient: retrying cannot help until space is freed; after that, writes succeed again.
    """


class PermissionDenied(StoreUnavailable):
    """The database refused the operation to this role (PostgreSQL insufficient_privilege, 42501): a grant
    is missing; or, on SQLite, the database file (its -wal or -shm file, or its folder) is not readable
    and writable by this process. Nothing was written.

    Not transient, and no outage: retrying cannot help until the role is granted the privilege (the
    message names the object) or the file made writable. A StoreUnavailable still, for callers that
    handle every database refusal.
    """


class StoreClosed(StoreUnavailable):
    """The store was closed (``TranscriptStore.close``, a service's close): nothing was read or written,
    and no connection was opened. A call still running when the store closed ends with its connection
    closed, not pooled again.

    Not transient: only a new ``TranscriptStore`` serves again. A StoreUnavailable still (a service
    answers it 503 ``store_unavailable``).
    """


class TransientStoreError(StoreUnavailable):
    """A transient database error (40001, 40P01, a lost connection, SQLite busy); safe to retry."""


class EngineError(TranscriptStoreError):
    """A context engine is missing, invalid, quarantined or failed a lifecycle call."""


class UnknownEngine(EngineError, LookupError):
    """No engine with this id is registered."""


class EngineContractError(EngineError):
    """An engine failed contract validation at load time."""


class HostRequirementError(EngineError):
    """The selected engine needs a host capability this host lacks; the operation fails closed."""


class EngineSwitchError(EngineError):
    """A turn that has started tried to switch engines."""


class ModelError(TranscriptStoreError):
    """A model provider call failed; ``status`` is the HTTP status when there was one, ``code`` the
    provider's error code (an OpenAI-style answer's ``error.code``, e.g. ``context_length_exceeded``)."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ModelTimeout(ModelError):
    """A model provider call timed out; the host answers by retrying the same logical turn."""


class SummarizerError(TranscriptStoreError):
    """A summarizer failed: an HTTP or network error, or an empty summary."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TokenizerUnavailable(TranscriptStoreError, ImportError):
    """The exact tokenizer was asked for but ``tiktoken`` or its encoding file is not available."""
