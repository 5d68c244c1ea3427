"""Pydantic shapes of everything the store takes and returns.

Messages are OpenAI chat-format dicts. They are validated here and stored exactly as given: unknown
keys are preserved, not dropped. Shapes the store builds itself from rows it trusts are made with
``model_construct`` on the hot paths (validation is for input, not for our own output).
"""

from __future__ import annotations

import json
import math
import sys
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import InvalidInput, InvalidMessage
from .shapes import Shape

EntryKind = Literal["message", "custom", "metadata", "compaction"]
ENTRY_KINDS: tuple[str, ...] = ("message", "custom", "metadata", "compaction")
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
ResetReason = Literal[
    "invalid_cursor", "scope_mismatch", "generation_mismatch", "anchor_missing", "anchor_moved"
]
ClosedRangeFailureReason = Literal[
    "stale", "non_descendant", "session_rebound", "too_large", "projection_unavailable"
]

CURRENT_TURN_FENCE = "before-current-turn-entry-v1"
TURN_ADVANCEMENT_IDEMPOTENCY = "atomic-idempotent-v1"


class _Frozen(Shape):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------------------------------------- messages


class FunctionCall(BaseModel):
    """The function part of an assistant tool call."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message (a function call: the only kind with a ``function``)."""

    model_config = ConfigDict(extra="allow")
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    """One part of a multi-part content list (text, image_url, input_audio, ...)."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(min_length=1)

    @model_validator(mode="after")
    def _text_has_text(self) -> ContentPart:
        _check_text_part(self)
        if self.type == "image_url":
            image = getattr(self, "image_url", None)
            if not isinstance(image, dict) or not isinstance(image.get("url"), str) or not image["url"]:
                raise ValueError("an image_url content part needs an 'image_url' object with a 'url'")
        return self


class ChatMessage(BaseModel):
    """An OpenAI chat-format message; unknown keys are kept."""

    model_config = ConfigDict(extra="allow")
    role: Role
    # Empty lists are refused as the Chat Completions API refuses them (stored, one such message made
    # every later request of the session fail): a content list holds a part, a tool_calls list a call.
    content: str | Annotated[list[ContentPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, min_length=1)
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _role_rules(self) -> ChatMessage:
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs 'name'")
        _check_roles(self)
        return self


#: the roles of a message that answers an assistant's call: ``tool`` answers one of its ``tool_calls``
#: (by ``tool_call_id``), ``function`` its older-format ``function_call`` (by ``name``: that format has no id)
RESULT_ROLES = frozenset({"tool", "function"})


def calls_made(message: dict[str, Any] | None) -> list[Any]:
    """The keys of the calls an assistant message waits on: each tool call's id, and ("function", name)
    for an older-format ``function_call``; none for any other message."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return []
    calls = message.get("tool_calls")
    out: list[Any] = []
    if isinstance(calls, list):
        out = [c["id"] for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str)]
    legacy = message.get("function_call")
    if isinstance(legacy, dict) and isinstance(legacy.get("name"), str):
        out.append(("function", legacy["name"]))
    return out


def functions_called(message: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, arguments as text) of each call a message makes: its ``tool_calls`` and an older-format
    ``function_call``, in that order (what summaries and search show of the calls)."""
    calls = [c.get("function") for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    legacy = message.get("function_call")
    out = []
    for function in [*calls, legacy]:
        if isinstance(function, dict):
            arguments = function.get("arguments")
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, sort_keys=True)
            out.append((str(function.get("name")), text))
    return out


def call_answered(message: dict[str, Any] | None) -> Any:
    """The key (as ``calls_made`` gives it) of the call a result message answers; None for another message."""
    if not isinstance(message, dict):
        return None
    role = message.get("role")
    if role == "tool":
        return message.get("tool_call_id")
    if role == "function":
        return ("function", message.get("name"))
    return None


#: the keys under which a host's plugin keeps its own message in the stored one: OpenClaw's
#: (integrations/openclaw/src/messages.js: ORIGINAL, and LEAN's ``message`` for one over the entry cap)
_HOST_MESSAGE_KEYS = ("openclaw", "openclaw_lean")


def out_of_context(message: Any) -> bool:
    """Whether the host keeps a stored message out of the model's context: OpenClaw's ``excludeFromContext``
    (a context-free command and its reply, a hidden consult prompt) on the host message its plugin keeps
    in the stored one. Engines neither show, count nor summarize such a message; it stays stored."""
    if not isinstance(message, dict):
        return False
    for key in _HOST_MESSAGE_KEYS:
        host = message.get(key)
        if isinstance(host, dict) and key == "openclaw_lean":
            host = host.get("message")
        if isinstance(host, dict) and host.get("excludeFromContext") is True:
            return True
    return False


def _check_text_part(part: Any) -> None:
    """A text content part carries its text (the rule of every release)."""
    if part.type == "text" and not isinstance(getattr(part, "text", None), str):
        raise ValueError("a text content part needs a string 'text'")


def _check_roles(message: Any) -> None:
    """The role rules of every release: a tool message's call id, tool calls on assistants only, content."""
    if message.role == "tool" and not message.tool_call_id:
        raise ValueError("a tool message needs 'tool_call_id'")
    if message.role != "assistant" and message.tool_calls is not None:
        raise ValueError("only assistant messages carry 'tool_calls'")
    if message.content is None and message.role != "assistant":
        raise ValueError(f"a {message.role} message needs 'content'")
    if message.role == "assistant" and message.content is None and not message.tool_calls:
        # The older function-calling format answers with ``content: null`` and a ``function_call``
        # ({name, arguments}), which the Chat Completions API still takes back.
        call = getattr(message, "function_call", None)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise ValueError("an assistant message needs 'content', 'tool_calls' or a 'function_call' with a name")


#: the deepest level a payload's values may sit at (the payload itself is level 0)
MAX_JSON_DEPTH = 64


def _check_json_value(value: Any, depth: int = 0) -> None:
    """Refuse what JSON or UTF-8 cannot carry losslessly (NaN, lone surrogates, odd types)."""
    if depth > MAX_JSON_DEPTH:
        raise InvalidInput(f"payload nested deeper than {MAX_JSON_DEPTH} levels")
    # The base types' own methods, never the value's: a str or int subclass may override ``encode`` or
    # ``bit_length`` (the check passed, and the JSON writer, which reads the value itself, raised a bare
    # UnicodeEncodeError or ValueError).
    if isinstance(value, str):
        try:
            str.encode(value, "utf-8")
        except UnicodeEncodeError as e:
            raise InvalidInput("payload contains a lone surrogate (not valid Unicode)") from e
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        # JSON writes an integer in decimal, which Python refuses past sys.get_int_max_str_digits()
        # (4,300 by default; 0 is no limit) with a bare ValueError. Fewer than 3 bits per allowed digit
        # is always fewer digits than allowed (a decimal digit is 3.32 bits): no conversion needed.
        limit = sys.get_int_max_str_digits()
        if limit and int.bit_length(value) >= 3 * limit:
            try:
                int.__repr__(value)
            except ValueError:
                raise InvalidInput("payload contains an integer with too many digits to write as JSON") from None
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput("payload contains a non-finite number")
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidInput("payload object keys must be strings")
            _check_json_value(k, depth + 1)
            _check_json_value(v, depth + 1)
    elif isinstance(value, list | tuple):
        for v in value:
            _check_json_value(v, depth + 1)
    else:
        raise InvalidInput(f"payload contains a non-JSON value of type {type(value).__name__}")


def check_json(value: Any) -> None:
    """InvalidInput unless ``value`` is JSON that UTF-8 carries losslessly (no NaN, lone surrogates, odd
    types, nesting past 64 levels)."""
    _check_json_value(value)


class _EarlierToolCall(BaseModel):
    """A tool call as releases before the Chat Completions rules stored it (any type)."""

    model_config = ConfigDict(extra="allow")
    id: str = Field(min_length=1)
    type: str = "function"
    function: FunctionCall


class _EarlierContentPart(BaseModel):
    """A content part as earlier releases stored it (an image_url part without its url)."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(min_length=1)

    @model_validator(mode="after")
    def _text_has_text(self) -> _EarlierContentPart:
        _check_text_part(self)
        return self


class _EarlierChatMessage(BaseModel):
    """A chat message as earlier releases stored it: empty content and tool_calls lists, a function
    message without a name, a tool call of another type and an image_url part without a url were valid."""

    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[_EarlierContentPart] | None = None
    name: str | None = None
    tool_calls: list[_EarlierToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _role_rules(self) -> _EarlierChatMessage:
        _check_roles(self)
        return self


def validate_message(message: Any, *, stored: bool = False) -> dict[str, Any]:
    """Validate one OpenAI chat message and return it as a plain dict, extras preserved.

    ``stored``: a message a store may already hold (an export's entry being imported, a turn's message
    checked against its transcript entry) is also taken under the rules of earlier releases, which
    stored some forms the Chat Completions API refuses (``_EarlierChatMessage``): refused now, a
    session exported before an upgrade could not be imported after it, nor its turns committed.
    """
    if isinstance(message, ChatMessage):
        message = message.model_dump(exclude_none=True)
    if not isinstance(message, dict):
        raise InvalidMessage(f"a message must be a dict, not {type(message).__name__}")
    _check_json_value(message)
    try:
        ChatMessage.model_validate(message)
    except ValidationError as e:
        if stored:
            try:
                _EarlierChatMessage.model_validate(message)
                return message
            except ValidationError:
                pass  # refused under both rules: the current rules say why
        errors = e.errors()
        # Of a union's alternatives (content: a string or a list of parts) the one the value is of says
        # what is wrong ("an image_url part needs ..."), not "Input should be a valid string".
        first = next((x for x in errors if x["type"] not in _TYPE_MISMATCH), errors[0])
        where = ".".join(str(p) for p in first["loc"] if not _union_member(p)) or "message"
        raise InvalidMessage(f"invalid message: {where}: {first['msg']}") from None
    return message


#: pydantic's error types for a value of another type (an alternative of a union the value is not of)
_TYPE_MISMATCH = frozenset({"string_type", "list_type", "dict_type", "model_type", "model_attributes_type"})


def _union_member(part: object) -> bool:
    """Whether a pydantic error location part names a union alternative (``str``, ``list[...]``), not a
    field or an index."""
    return isinstance(part, str) and (part == "str" or "[" in part)


def validate_event_payload(payload: Any) -> dict[str, Any]:
    """Validate the JSON payload of a non-message event."""
    if not isinstance(payload, dict):
        raise InvalidInput(f"an event payload must be a dict, not {type(payload).__name__}")
    _check_json_value(payload)
    return payload


def compact_json(value: Any, *, sort_keys: bool = False) -> str:
    """``json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False, sort_keys=...)``.

    The same text and the same errors, ~1/3 faster for ASCII text: every appended payload is encoded
    here and every turn's canonical text for its hash (bench/README.md, "Profiling" 35). json.dumps
    builds a JSONEncoder per call, and with ensure_ascii=False escapes strings with the slower of
    ``_json``'s two C escapers. The ASCII escaper writes exactly the same text unless the value holds a
    character it must escape as ``\\uXXXX`` (anything from U+007F up, or a control character), so
    its text is kept unless it contains a backslash-u; else the value is encoded again the other way.
    """
    if _C_JSON is None:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False, sort_keys=sort_keys)
    make, default, ascii_escape, utf8_escape = _C_JSON
    # A new encoder per call: its markers dict (the cycle check) is per call, as json.dumps's is.
    text = "".join(make({}, default, ascii_escape, None, ":", ",", sort_keys, False, False)(value, 0))
    if "\\u" not in text:
        return text
    return "".join(make({}, default, utf8_escape, None, ":", ",", sort_keys, False, False)(value, 0))


def _c_json() -> tuple[Any, Any, Any, Any] | None:
    """``_json``'s encoder and escapers, if this Python has them and they encode as json.dumps does."""
    import json.encoder as std

    make: Any = getattr(std, "c_make_encoder", None)
    ascii_escape: Any = getattr(std, "c_encode_basestring_ascii", None)
    utf8_escape: Any = getattr(std, "c_encode_basestring", None)
    if make is None or ascii_escape is None or utf8_escape is None:
        return None
    default = json.JSONEncoder().default
    sample = {"b": [1, 2.5, -0.0, 10**20, True, None, "\\u00e9 \x7f\x1f\n\"é\U0001f600"], "a": {"z": "", "y": []}}
    try:
        for sort_keys in (False, True):
            expected = json.dumps(sample, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys)
            for escape in (ascii_escape, utf8_escape):
                text = "".join(make({}, default, escape, None, ":", ",", sort_keys, False, False)(sample, 0))
                if json.loads(text) != sample:
                    return None
            if text != expected:  # the UTF-8 escaper's text: json.dumps's own
                return None
    except Exception:  # a Python whose private encoder takes other arguments: json.dumps it is
        return None
    return make, default, ascii_escape, utf8_escape


_C_JSON = _c_json()


def canonical_json(value: Any) -> str:
    """The one canonical JSON text used for hashing (sorted keys, no spaces, UTF-8)."""
    return compact_json(value, sort_keys=True)


# ---------------------------------------------------------------------------------------------- records


class SessionInfo(_Frozen):
    """One session as the store sees it now."""

    scope: str
    session_id: str
    session_key: str | None
    generation: int
    head_entry_id: str | None
    entry_count: int
    visible_count: int
    active: bool
    created_at: datetime
    updated_at: datetime
    #: which creation of this session id this is (random, fresh on every create and import; the
    #: creation time in microseconds for sessions made before revision 0007): a session deleted and
    #: created or imported again under the same id is another incarnation, and cursors of the earlier
    #: one are not honoured on it
    incarnation: int = 0


class Anchor(_Frozen):
    """Immutable identity of one entry: where it was, in which generation, after which parent.

    Strict: a number is an ``int`` (a JSON integer), an id a ``str``. Coerced, ``seq="1"`` or
    ``generation=True`` made an anchor of the entry the caller never named (``True`` is 1), and a
    fence sent over HTTP as ``{"seq": "3"}`` was honoured as ``3``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    scope: str
    session_id: str
    session_key: str | None
    generation: int
    entry_id: str
    seq: int
    parent_id: str | None
    position: int | None
    idempotency_key: str | None = None
    #: the incarnation of the session it was taken in (``SessionInfo.incarnation``): a session deleted
    #: and created or imported again under the same id may hold an entry with the very same ids, seqs
    #: and positions, and an anchor of the earlier one must not match it. None: an anchor made before
    #: this field existed (stored in an outbox row, sent by an older client), then not checked. Not
    #: part of a turn's hash (``ledger.prepare_turn`` hashes named fields only).
    incarnation: int | None = None


class Admission(_Frozen):
    """The receipt of admitting a user message for one logical turn."""

    anchor: Anchor
    turn_id: str

    @property
    def fence(self) -> Anchor:
        """The anchor every pre-turn read of this turn is fenced before."""
        return self.anchor


class Entry(_Frozen):
    """One stored entry: a message or a non-message event."""

    entry_id: str
    parent_id: str | None
    seq: int
    kind: EntryKind
    role: str | None
    message: dict[str, Any] | None
    payload: dict[str, Any] | None
    position: int | None
    generation: int
    size_bytes: int
    idempotency_key: str | None
    turn_id: str | None
    created_at: datetime
    active: bool = True


class DeltaPage(_Frozen):
    """Visible messages after a cursor, and the cursor after them."""

    kind: Literal["page"] = "page"
    entries: list[Entry]
    cursor: str
    has_more: bool
    serialized_bytes: int
    required_bytes: int | None = None


class DeltaReset(_Frozen):
    """The cursor's ground moved: drop the projection and re-read from ``cursor``."""

    kind: Literal["reset"] = "reset"
    cursor: str
    reason: ResetReason


class DeltaMissing(_Frozen):
    """The session does not exist in this scope."""

    kind: Literal["missing"] = "missing"


DeltaResult = DeltaPage | DeltaReset | DeltaMissing


class Replacement(_Frozen):
    """One entry to rewrite and its new message."""

    entry_id: str
    message: dict[str, Any]


class RewriteResult(_Frozen):
    """What a rewrite pass did."""

    changed: bool
    bytes_freed: int
    rewritten_entries: int
    reason: str | None
    generation: int


class ClosedRange(_Frozen):
    """The visible messages of a finished turn, admission through terminal inclusive."""

    status: Literal["ok"] = "ok"
    entries: list[Entry]
    serialized_bytes: int

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The OpenAI messages of the range, in order."""
        return [e.message for e in self.entries if e.message is not None]


class ClosedRangeFailure(_Frozen):
    """Why a closed range could not be read."""

    status: Literal["failed"] = "failed"
    reason: ClosedRangeFailureReason
    detail: str = ""


ClosedRangeResult = ClosedRange | ClosedRangeFailure
