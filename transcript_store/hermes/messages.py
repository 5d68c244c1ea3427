"""Hermes messages as the store keeps them: plain JSON, cleaned, their identity, digests and keys."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from ..models import MAX_JSON_DEPTH

_SURROGATES = re.compile(r"[\ud800-\udfff]")


def jsonable(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON the store accepts: keys as strings, tuples and sets as lists, surrogate code
    points as U+FFFD (as Hermes' ``_sanitize_surrogates``: a list it sanitized later still aligns),
    non-finite numbers and other objects as their ``str`` (as ``canonical`` writes them), a container
    with items at ``depth`` MAX_JSON_DEPTH (``value`` is at ``depth``) as its JSON text. Plain JSON the
    store takes comes back equal, so its keys and digests are unchanged."""
    if depth >= MAX_JSON_DEPTH and isinstance(value, (dict, list, tuple, set, frozenset)) and value:
        # Its items would sit past the store's nesting limit, which refused the whole message (and so
        # every later store of the conversation): its text keeps all of it, one level deep.
        try:
            text = canonical(value)
        except RecursionError:  # nested past Python's recursion limit too: json.dumps cannot write it
            text = deep_json(value)
        return jsonable(text)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:  # each surrogate code point as U+FFFD, as Hermes' own sanitizer does
            return _SURROGATES.sub("\ufffd", value)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {jsonable(k) if isinstance(k, str) else str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return [jsonable(v, depth + 1) for v in sorted(value, key=repr)]
    return jsonable(str(value))


class _Piece:
    """Text ``deep_json`` writes between a container's items, or after them (closing ``ident``'s)."""

    __slots__ = ("ident", "text")

    def __init__(self, text: str, ident: int | None = None) -> None:
        self.text, self.ident = text, ident


def _key_text(key: Any) -> str:
    """A dict key as json.dumps writes it (a key of another type as its ``str``)."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (int, float)):
        return json.dumps(key)
    return str(key)


def deep_json(value: Any) -> str:
    """``canonical(value)`` without recursion, for a value nested past Python's recursion limit (json.dumps
    and copy.deepcopy raise RecursionError on it): the same text for plain JSON. Keys that do not sort
    among themselves are sorted by their text; a container holding itself raises ValueError, as in
    json.dumps."""
    out: list[str] = []
    stack: list[Any] = [value]
    open_ids: set[int] = set()  # the containers being written: one met again holds itself
    while stack:
        item = stack.pop()
        if isinstance(item, _Piece):
            out.append(item.text)
            open_ids.discard(item.ident if item.ident is not None else -1)
            continue
        if isinstance(item, (dict, list, tuple)) and item:
            if id(item) in open_ids:
                raise ValueError("Circular reference detected")
            open_ids.add(id(item))
            if isinstance(item, dict):
                pairs = [(_key_text(k), v) for k, v in _sorted_items(item)]
                first, close = "{", "}"
                inner: list[Any] = []
                for n, (k, v) in enumerate(pairs):
                    inner += [_Piece(("," if n else "") + json.dumps(k, ensure_ascii=False) + ":"), v]
            else:
                first, close = "[", "]"
                inner = []
                for n, v in enumerate(item):
                    inner += [_Piece(","), v] if n else [v]
            out.append(first)
            stack.append(_Piece(close, id(item)))
            stack.extend(reversed(inner))
            continue
        if isinstance(item, (dict, list, tuple)):
            out.append("{}" if isinstance(item, dict) else "[]")
            continue
        try:
            out.append(json.dumps(item, ensure_ascii=False, default=str))
        except RecursionError:  # a leaf nested in itself past the limit (a frozenset of frozensets)
            out.append(json.dumps(f"<a {type(item).__name__} nested too deep to write>"))
    return "".join(out)


def _sorted_items(value: dict[Any, Any]) -> list[tuple[Any, Any]]:
    """A dict's items sorted by key, as json.dumps' ``sort_keys`` sorts them (by their text when the keys
    do not sort among themselves)."""
    try:
        return sorted(value.items(), key=lambda kv: kv[0])
    except TypeError:
        return sorted(value.items(), key=lambda kv: _key_text(kv[0]))


def bounded(value: Any, depth: int = 0) -> Any:
    """A deep copy of ``value`` (at ``depth``) with each non-empty container whose items would sit past
    MAX_JSON_DEPTH as its JSON text (``deep_json``), as ``jsonable`` writes it: for a message
    ``copy.deepcopy`` cannot copy (nested past Python's recursion limit), and what it means is kept."""
    if depth >= MAX_JSON_DEPTH and isinstance(value, (dict, list, tuple, set, frozenset)) and value:
        try:
            return canonical(value)
        except RecursionError:
            return deep_json(value)
    if isinstance(value, dict):
        return {k: bounded(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [bounded(v, depth + 1) for v in value]
    try:
        return copy.deepcopy(value)
    except RecursionError:  # a leaf nested in itself (a frozenset of frozensets): its text
        return deep_json(value)


def detached(items: Sequence[Any]) -> list[Any]:
    """Deep copies of a host's items, the store's and compaction's own (``copy.deepcopy``); an item nested
    past Python's recursion limit ``bounded``. Copied whole, one such message raised RecursionError,
    and compress handed the list back uncompressed, storing nothing, for the rest of the conversation."""
    out: list[Any] = []
    for item in items:
        try:
            out.append(copy.deepcopy(item))
        except RecursionError:
            out.append(bounded(item))
    return out


def canonical(message: Any) -> str:
    """A message as canonical JSON (sorted keys, no whitespace); ``jsonable`` first when it has keys that do
    not sort (mixed types)."""
    try:
        return json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    except TypeError:
        return json.dumps(jsonable(message), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(*parts: str) -> str:
    """A short sha256 hex digest of the parts (a lone surrogate hashes as its code point, never raises)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()[:40]


def clean(message: dict[str, Any]) -> dict[str, Any]:
    """The message without host bookkeeping (keys starting with ``_``, e.g. Hermes' ``_db_persisted``),
    as plain JSON (``jsonable``): one odd value must not make the whole conversation unstorable. Empty
    lists the store refuses (as the Chat Completions API does) become what they mean: no tool calls
    (Hermes replays a ``tool_calls`` column it cannot parse as ``[]``), an empty text; so does a missing
    text where nothing else is said (a ``refusal``). A tool call's arguments given as an object become
    its JSON text, as OpenAI sends them, and so does a content that is neither a text nor a list of
    parts (an object, a number): both forms the store refuses."""
    # The keys as ``jsonable`` writes nested ones: a lone surrogate in a top-level key failed every ingest.
    out = {jsonable(str(k)): jsonable(v, 1) for k, v in message.items() if not str(k).startswith("_")}
    content = out.get("content")
    if content is not None and not isinstance(content, (str, list)):
        out["content"] = _json_text(content)
    calls = out.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and fn.get("arguments") is not None and not isinstance(fn["arguments"], str):
            fn["arguments"] = _json_text(fn["arguments"])
    if out.get("tool_calls") == []:
        del out["tool_calls"]
        if out.get("content") is None:
            out["content"] = ""
    if out.get("content") == []:
        out["content"] = ""
    if out.get("content") is None and out.get("role") in ("user", "assistant", "tool") and not (
        out.get("tool_calls") or out.get("function_call")
    ):
        # No text is an empty one (an assistant's refusal, a reply of reasoning only): the store refuses a
        # message without content, and one such message failed every later ingest of the conversation.
        out["content"] = ""
    return out


def _json_text(value: Any) -> str:
    """A plain JSON value (``jsonable``'s) as its compact JSON text, its keys in their order."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


#: hermes-agent's mark on a message it saved to its session database: never on a message compress hands
#: back (its own compressor strips it: a marked copy is skipped when Hermes saves the compacted list)
PERSISTED_MARK = "_db_persisted"


def host_copy(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of a message ``compress`` hands back verbatim: ``clean``, with the host's own flags put back
    but ``PERSISTED_MARK``. Hermes tells its ephemeral messages by their flags
    (``_empty_recovery_synthetic``, ``_thinking_prefill``, ``_..._synthetic`` nudges) and pops them when
    the real reply comes; a copy without them stayed in the conversation for good."""
    out = clean(message)
    out.update({
        str(k): copy.deepcopy(v) for k, v in message.items() if str(k).startswith("_") and k != PERSISTED_MARK
    })
    return out


#: what hermes-agent adds to, or drops from, a message between the live list and the same message reloaded
#: from its session database: bookkeeping, not the conversation (``identity`` leaves them out)
HOST_KEYS = frozenset({
    "timestamp", "tool_name", "finish_reason", "reasoning", "reasoning_content", "reasoning_details",
    "codex_reasoning_items", "codex_message_items", "message_id", "observed", "api_content",
    "effect_disposition",
})


def identity(message: dict[str, Any]) -> dict[str, Any]:
    """What makes a cleaned message the same message when Hermes sends it again: every field but Hermes'
    bookkeeping (``HOST_KEYS``), ``None`` values, a tool result's ``name``; a text content without its
    surrounding whitespace; tool calls by id, function name and arguments.

    A conversation Hermes reloads from its session database (the gateway rebuilds it for every turn,
    ``/resume`` too) is not byte-identical to the live list it saved: user messages gain a
    ``timestamp``, tool results carry ``tool_name`` where they had ``name``, a ``reasoning: None`` is
    gone, texts are stripped. Compared whole, the first such message branched the session and stored
    the rest of the conversation a second time; the stored message keeps the form first seen. Any other
    field (a user message's ``name``, images) is compared: an edit of it is an edit. A change of the
    whitespace around a text alone is not one (Hermes strips it on reload).
    """
    tool = message.get("role") == "tool"
    out: dict[str, Any] = {}
    for key, value in message.items():
        if value is None or key in HOST_KEYS or (tool and key == "name"):
            continue
        if key == "content" and isinstance(value, str):
            value = value.strip()
            if not value:
                continue
        elif key == "tool_calls":
            if not value:
                continue
            value = [_call_identity(c) for c in value] if isinstance(value, list) else value
        out[key] = value
    return out


def _call_identity(call: Any) -> Any:
    """A tool call's id, function name and arguments (its ``type`` and host keys left out)."""
    if not isinstance(call, dict):
        return call
    fn = call.get("function")
    if isinstance(fn, dict):
        fn = {"name": fn.get("name"), "arguments": fn.get("arguments")}
    return {"id": call.get("id"), "function": fn}


def fingerprint(messages: Sequence[dict[str, Any]]) -> str:
    """The digest of cleaned messages' identities (one message: ``fingerprint([m])``)."""
    return digest(canonical([identity(m) for m in messages]))


def message_key(store_session: str, ordinal: int, message: dict[str, Any], after_seq: int | None = None) -> str:
    """The idempotency key of one Hermes message: (store session, ordinal, canonical message[, after_seq])."""
    parts = [store_session, str(ordinal), canonical(message)]
    if after_seq is not None:
        parts.append(str(after_seq))
    return "hm-" + digest(*parts)
