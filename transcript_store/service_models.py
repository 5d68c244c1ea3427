"""The HTTP service's request and response shapes; the records themselves are the library's models.

Requests forbid unknown fields (a typo is an error, not a silent default), except entry references,
which accept a whole anchor (the library's, or a host's) and read only ``entry_id`` and ``position``.
Their own fields are strict: a value of another JSON type is refused, not coerced (``"force": "false"``,
``"token_budget": true``); the library's models inside them read as the library does: an anchor (a
``fence``) strictly too, ``"seq": "1"`` refused, append items as ``AppendItem`` reads them.
Ids are checked by the store (``check_id``) when used, so every refusal carries the store's message.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .engine import MAX_TOKENS, BootstrapResult, EngineInfo
from .fences import MAX_TURN_EVENTS
from .ledger import Receipt
from .models import Anchor, Entry, SessionInfo
from .reads import MAX_BYTES, MAX_MESSAGES
from .store import AppendItem

MAX_ITEMS = 10_000
#: the longest host cursor an import page may carry (an opaque token of the host's; OpenClaw's are short)
MAX_HOST_CURSOR_CHARS = 4096
_BAD_CURSOR_CHAR = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
Message = dict[str, Any]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorDetail(BaseModel):
    """What went wrong: a stable ``code``, a human ``message``, and extras for some codes."""

    code: str
    message: str
    reason: str | None = None
    correlation_id: str | None = None


class ErrorBody(BaseModel):
    """Every error response: ``{"error": {"code": ..., "message": ...}}``."""

    error: ErrorDetail


class WhoAmI(BaseModel):
    """The scope the presented token maps to."""

    scope: str


# ---------------------------------------------------------------------------------------------- sessions


class OpenSession(_Request):
    """Create a session by id, or open the active session holding a key (created when there is none)."""

    session_id: str | None = None
    session_key: str | None = None
    rebind_key: bool = Field(
        False,
        description="end another active session holding session_key, so this session can take it; needs both "
        "session_id and session_key (422 otherwise)",
    )

    @model_validator(mode="after")
    def _rebind_acts(self) -> OpenSession:
        problem = rebind_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self


def rebind_problem(req: OpenSession) -> str | None:
    """Why ``req``'s ``rebind_key`` cannot act, or None: it moves ``session_key`` to ``session_id``, so
    without both it did nothing (a create by key answered the key's holder, unrebound) and is refused."""
    if not req.rebind_key or (req.session_id is not None and req.session_key is not None):
        return None
    missing = " and ".join(name for name in ("session_id", "session_key") if getattr(req, name) is None)
    return f"rebind_key moves session_key to the session of session_id: it needs both, this request has no {missing}"


class SessionList(BaseModel):
    """Sessions of the caller's scope."""

    sessions: list[SessionInfo]


class DeltaRequest(_Request):
    """A visible-delta read: the page after ``cursor`` (None: from the start), before ``fence`` if given."""

    cursor: str | None = None
    max_messages: int = Field(1000, ge=1, le=MAX_MESSAGES)
    max_bytes: int = Field(1_000_000, ge=1, le=MAX_BYTES)
    fence: Anchor | None = None


class AppendRequest(_Request):
    """Entries appended at the head as one chain, in one transaction."""

    items: list[AppendItem] = Field(min_length=1, max_length=MAX_ITEMS)


class EntryList(BaseModel):
    """Stored entries, in the order asked."""

    entries: list[Entry]


class AdmitRequest(_Request):
    """The user message of logical turn ``turn_id``; the same turn again returns the same admission."""

    message: Message
    turn_id: str
    entry_id: str | None = None


# ---------------------------------------------------------------------------------------------- engines


class EngineSummary(BaseModel):
    """A registered engine: where it comes from, and why it cannot load if it cannot."""

    id: str
    source: str
    error: str | None = None


class EngineList(BaseModel):
    """Every engine the service can run."""

    engines: list[EngineSummary]


class EngineDescription(BaseModel):
    """An engine's declarations (compaction ownership, transcript semantics, maintenance mode, ...)."""

    id: str
    info: EngineInfo
    durable: bool = Field(description="declares both transcript semantics and implements commit_turn")


class ServiceLimits(BaseModel):
    """What this service accepts, in bytes (read-only; clients size what they send by it)."""

    max_entry_bytes: int = Field(description="one stored entry's JSON (the store's max_payload_bytes)")
    max_turn_bytes: int = Field(description="one turn's closed range: its entries' JSON summed")
    max_body_bytes: int = Field(description="one request body (serve --max-body)")


class EngineDescriptionWithLimits(EngineDescription):
    """An engine's declarations and the service's limits on what its sessions take."""

    limits: ServiceLimits


class HostEntry(_Request):
    """One visible host message with the host's stable entry id."""

    entry_id: str
    message: Message


class ImportPage(_Request):
    """One page of the host's visible transcript, read from ``cursor`` (None: the start)."""

    cursor: str | None = Field(None, max_length=MAX_HOST_CURSOR_CHARS)
    next_cursor: str | None = Field(
        None, max_length=MAX_HOST_CURSOR_CHARS, description="the host's cursor after this page"
    )
    entries: list[HostEntry] = Field(default_factory=list, max_length=MAX_ITEMS)

    @field_validator("cursor", "next_cursor")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        # Stored as engine state and echoed on every call: no NUL (PostgreSQL's text cannot hold it),
        # control characters or lone surrogates.
        if value is not None and _BAD_CURSOR_CHAR.search(value):
            raise ValueError("a host cursor must not contain NUL, control characters or lone surrogates")
        return value


class BootstrapRequest(_Request):
    """Import one host page (if given); on ``done``, run the engine's bootstrap over the mirror."""

    page: ImportPage | None = None
    done: bool = True


class BootstrapState(BaseModel):
    """Where the next import page resumes (the host cursor and position), and the mirror's size."""

    cursor: str | None
    position: int
    visible_count: int


class BootstrapResponse(BaseModel):
    """What a bootstrap call imported, the resume point after it, and the engine's own result."""

    imported: int = 0
    matched: int = 0
    rewound: bool = False
    cursor: str | None
    position: int
    visible_count: int
    result: BootstrapResult | None = None


class AssembleRequest(_Request):
    """Assemble the model's context; the service's budget applies when ``token_budget`` is omitted."""

    token_budget: int | None = Field(None, ge=1, le=MAX_TOKENS)
    fence: Anchor | None = None
    available_tools: list[str] = Field(default_factory=list, max_length=1000)
    prompt: Message | str | None = None


class CompactRequest(_Request):
    """Run the engine's compaction (``force``: at least one step even under the threshold; ``fence``: the
    admission of a turn still running, which the engine's import before the compaction stops at)."""

    force: bool = True
    focus: str | None = Field(None, max_length=10_000)
    token_budget: int | None = Field(None, ge=1, le=MAX_TOKENS)
    fence: Anchor | None = None


class HostCompactionRequest(_Request):
    """A compaction the host made of its own transcript (one the engine delegated to it): its summary and
    the first message it kept, by the host's visible position and entry id."""

    summary: str = Field(max_length=4_000_000)
    first_kept_position: int = Field(ge=0, le=2**31 - 1)
    first_kept_entry_id: str | None = Field(
        None, description="the host's id of the first kept message; only a reset that kept none may leave it out"
    )
    reset: bool = Field(
        False,
        description="a reset of the host's context (OpenClaw's /new or /reset in the same transcript): no summary, "
        "the context starts again at first_kept_position",
    )
    compacted_ms: int | None = Field(
        None, ge=0, le=2**53 - 1,
        description="when the host made it, for one found in its transcript later: a newer compaction stays",
    )
    compacted_at_count: int | None = Field(
        None, ge=0, le=2**31 - 1,
        description="how many of the host's visible messages preceded it, for one found in its transcript "
        "later: a compaction in force made further on stays (compared by that, not across two clocks)",
    )


class HostCompactionResponse(BaseModel):
    """What the engine will show: the summary in front of the messages from ``first_kept_position`` on."""

    first_kept_position: int
    visible_count: int


class MaintainRequest(_Request):
    """Run the engine's maintenance pass, against ``token_budget`` when given."""

    token_budget: int | None = Field(
        None, ge=1, le=MAX_TOKENS,
        description="the host's prompt token budget, as assemble takes it: an engine that compacts in its "
        "maintenance (lossless) compacts against it; without it, against the last assemble budget this "
        "service process saw for the session, else the service's own budget",
    )


class EntryRef(BaseModel):
    """An entry of a turn: its id, and its visible position when the service must mirror it."""

    model_config = ConfigDict(extra="ignore", strict=True)
    entry_id: str
    position: int | None = Field(None, ge=0, le=2**31 - 1)


class CommitTurnRequest(_Request):
    """One accepted turn, admission through terminal inclusive, keyed by its advancement key."""

    advancement_key: str
    admission: EntryRef
    terminal: EntryRef
    # As many as the store takes in one turn (OpenClaw closes turns of as many events): 10,000 refused longer
    # tool loops the store would have committed.
    messages: list[Message] = Field(min_length=1, max_length=MAX_TURN_EVENTS)
    is_heartbeat: bool = False
    session_target: dict[str, Any] | None = Field(
        None, description="the host's session identity of the turn; its session_id must name this session"
    )


class CommitTurnResponse(BaseModel):
    """``committed`` the first time, ``duplicate`` on every identical replay; the receipt and anchors."""

    status: Literal["committed", "duplicate"]
    receipt: Receipt
    admission: Anchor
    terminal: Anchor


class ReceiptList(BaseModel):
    """A page of the engine's ledger for one session, in advancement-key order; ``next``: pass it as ``after`` for
    the next page, null on the last one."""

    receipts: list[Receipt]
    next: str | None
