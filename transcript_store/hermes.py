"""Any transcript-store engine as a Hermes Agent ``ContextEngine`` (imports ``agent.context_engine`` lazily).

How the adapter maps Hermes onto the store:

- Scope ``hermes`` (configurable); one store session per Hermes conversation lineage, opened by the
  Hermes session id as its session key.
- Every Hermes message except the leading system prompt is appended once, with the idempotency key
  ``sha256(store session | ordinal | canonical message)``; the ordinal is the message's index in the
  uncompressed conversation. Re-sending the same list (``compress``, ``on_session_end``,
  ``on_turn_complete``, a retry after a host timeout) stores nothing new.
- The host's list is aligned with the store session's visible transcript in order, message by message
  compared by ``identity`` (a reloaded conversation is the same one): only its longest common prefix
  is skipped. A list that differs after that (an undo, an edit, a regenerated reply)
  branches the session after the last message both agree on and appends the rest, as the OpenClaw
  mirror does (``mirror.align``): nothing is deleted, the visible transcript becomes the host's list.
  Once the session has off-branch entries, a key also names the seq the write follows, so that it can
  never name an off-branch entry at the same ordinal.
- A message the store refuses as it is (its shape, its size) is stored in a form it takes, its text or
  JSON kept (``storable``; a tool round's calls and call ids kept as they are where the store takes
  them, ``in_round``), and the host's list is aligned by that form: one such message never blocks
  the rest of the conversation. Over the store's cap, a tool round's message keeps its calls or call
  id too: its text and its calls' arguments are cut to a share of the cap, an argument to a marked
  JSON stand-in (``cut_round``). A message nested past Python's recursion limit is copied and written
  without recursion (``detached``, ``deep_json``).
- ``compress`` aims below Hermes' trigger: three quarters of it, less the system prompt and tools (what
  Hermes' count of the request exceeds the messages by). The fresh tail (the current user message and
  the pending exchange) is kept verbatim whatever the budget; the engine's context gets the rest. A
  list the engine cannot shorten (an answer no smaller than it), or our own answer sent back, comes back
  unchanged and is not counted.
- ``compress`` compacts in the engine, assembles its context, and records the answer as an unreferenced
  *candidate* (a metadata entry keyed by the answer's hash). A later call whose messages start with a
  candidate proves the host took it: the candidate is adopted (lineage, ordinals of what follows) and only
  then may ``select_context`` show the compacted view. A pass the host discarded after a timeout changes
  nothing the session shows; the originals are already stored, so nothing is ever lost.
- Deep-copy / pickle safe: the store, the engine and every lock live in a runtime opened lazily per
  copy; ``__deepcopy__`` / ``__getstate__`` drop it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import json
import logging
import math
import os
import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, get_args

from . import bundled, paths
from .compaction import SUMMARY_HEAD
from .core import Core, NewEntry, entry_from_row, new_id
from .engine import EngineContext
from .errors import EngineContractError, InvalidInput, SessionKeyConflict, UnknownSession, describe
from .models import MAX_JSON_DEPTH, Role, compact_json, validate_message
from .registry import EngineRegistry
from .settings import PLUGIN_DIRS_ENV
from .store import AppendItem, TranscriptStore, replaced
from .tokens import RoughEstimator

log = logging.getLogger("transcript_store.hermes")

DEFAULT_SCOPE = "hermes"
INDEX_KEY = "_hermes_candidates"
CANDIDATE = "hermes-candidate"
#: an index entry linking a Hermes session id to the store session of its lineage (a rotation)
ALIAS = "hermes-alias"
ADOPTED = "hermes-adopted"
DEFAULT_THRESHOLD = 0.75
PLUGIN_NAME = "transcript-store"
PLUGIN_DIR = "transcript_store_hermes"
TEMPLATE_DIR = bundled.integration("hermes", "plugin")
MIN_CONTEXT_LENGTH = 64000

_SURROGATES = re.compile(r"[\ud800-\udfff]")
_RUNTIME_LOCK = threading.Lock()  # module level: never part of an engine's copied state
#: configuration -> the runtime its engine copies share. hermes-agent deep-copies the engine for every
#: agent and never closes one; a runtime per copy held a pool of its own (on PostgreSQL a server
#: connection each until garbage-collected, and the gateway caches 128 agents against a server's
#: default of 100 connections) and caches of its own that told copies of one process different things.
_SHARED_RUNTIMES: dict[str, _Runtime] = {}
#: the engine copy whose agent made this thread's latest model call (``mark_turn``): hermes-agent's
#: ``post_llm_call`` plugin hook, run in the same thread at the end of the turn, names no agent
_TURN = threading.local()
#: Hermes session id -> the engine copy last bound to it with a session database (``bind_session_state``):
#: the ``on_session_end`` plugin hook (``end_turn``) names the session only
_BOUND: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
#: Hermes session id -> the engine copy last told it (``bind_session_state``, ``on_session_start``), with a
#: session database or without: ``end_turn`` stores an unfinished turn of an agent without one through it
_LIVE: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


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


#: what starts the text a message the store refuses in any other form is kept as (``storable``)
KEPT_AS_JSON = "[transcript-store: a message the store cannot take as it is, kept as its JSON]"
#: the roles a message kept as text keeps (any other one, or none, is a user message's)
TEXT_ROLES = frozenset({"system", "developer", "user", "assistant"})


def storable(
    message: dict[str, Any], cap: int, *, keep_round: bool = True
) -> tuple[dict[str, Any], str | None]:
    """(a cleaned message in a form the store takes, why it is not the message itself: None when it is).

    What the store refuses by its shape (no or an unknown role, a tool result without its call's id, a
    malformed part or tool call) becomes a text message holding its JSON, with its role when a text
    message may have it (``KEPT_AS_JSON``); an assistant message's tool calls and a tool result's call
    id stay as they are where the store takes them (``in_round``; not with ``keep_round`` False, the
    form earlier releases stored). Over ``cap`` bytes, its text is cut, or its tool calls' arguments
    stood in for (``cut_to``, ``cut_round``). One such message
    refused by the store blocked every later store of the conversation, and ``compress`` handed the
    list back uncompressed for the rest of it. The form depends on the message (and the cap) only:
    the same list is aligned with what was stored the same way on every call."""
    form, why, _text = checked(message, cap, keep_round=keep_round)
    return form, why


#: what ``checked`` says of a message: (its storable form, why that is not the message, the message's
#: JSON text as the store writes it when the message is stored as it is)
Checked = tuple[dict[str, Any], str | None, str | None]


def checked(message: dict[str, Any], cap: int, *, keep_round: bool = True) -> Checked:
    """``storable``, with the message's JSON text as the store writes it when it is storable as it is
    (validated, at most ``cap`` bytes): its entry is made of it (``new_entry``), not checked again."""
    why = None
    try:
        validate_message(message)
    except InvalidInput as e:
        why = str(e)
        message = (in_round(message) if keep_round else None) or as_text(message)
    text = compact_json(message)
    size = len(text.encode("utf-8"))
    if size <= cap:
        return message, why, text if why is None else None
    return cut_to(message, size, cap, keep_round=keep_round), f"{size} bytes, over the store's cap of {cap}", None


def new_entry(store: TranscriptStore, message: dict[str, Any], key: str, seen: Checked | None) -> NewEntry:
    """The entry appending ``message`` under ``key``: made of the text ``checked`` wrote of this very
    message when it found it storable as it is (the store's ``prepare`` validated and wrote every new
    message a second time, the same checks), else prepared by the store."""
    if seen is not None and seen[0] is message and seen[1] is None and seen[2] is not None:
        return NewEntry(new_id(), "message", message["role"], seen[2], len(seen[2].encode("utf-8")), key)
    return store.prepare([AppendItem(message=message, idempotency_key=key)])[0]


def as_text(message: dict[str, Any]) -> dict[str, Any]:
    """A text message holding a message's JSON, its role kept when a text message may have it."""
    role = message.get("role")
    text = f"{KEPT_AS_JSON}\n{compact_json(message, sort_keys=True)}"
    return {"role": role if role in TEXT_ROLES else "user", "content": text}


def in_round(message: dict[str, Any]) -> dict[str, Any] | None:
    """A refused assistant message with tool calls, or tool result with a call id, as a text message
    holding the JSON of the rest of it, its tool calls or call id kept as they are (None: the store
    refuses that form too, or the message is neither).

    Kept whole as text (``as_text``), an assistant message lost its tool calls, and a tool result its
    call id: the round's other messages stayed stored but were orphans that every assembled context
    (``valid_sequence``) left out."""
    role = message.get("role")
    key = "tool_calls" if role == "assistant" else "tool_call_id" if role == "tool" else None
    if key is None or not message.get(key):
        return None
    rest = {k: v for k, v in message.items() if k != key}
    form = {"role": role, "content": f"{KEPT_AS_JSON}\n{compact_json(rest, sort_keys=True)}", key: message[key]}
    try:
        validate_message(form)
    except InvalidInput:
        return None
    return form


#: the characters a cut leaves out beyond what the cap asks for (the mark's escaped newline, margin)
CUT_SLACK = 16


def cut_to(message: dict[str, Any], size: int, cap: int, *, keep_round: bool = True) -> dict[str, Any]:
    """A storable message of ``size`` bytes cut to ``cap``: the end of its text (a tool result keeps its
    call id); where its bulk is elsewhere, a tool round's message keeps its tool calls or call id
    (``cut_round``: the bulk of its arguments or of the text of its JSON cut); else the end of the text
    of its JSON (the form of earlier releases with ``keep_round`` False). Marked."""
    content = message.get("content")
    over = size - cap
    mark = cut_mark(size, cap)
    if not isinstance(content, str) or len(content) < over + len(mark) + CUT_SLACK:
        form = cut_round(message, size, cap) if keep_round else None
        if form is not None:
            return form
        message = as_text(message)
        content = message["content"]
        over = len(compact_json(message).encode("utf-8")) - cap
    # Each character is a byte of JSON at least: this many fewer leave room for the mark (one escape).
    keep = max(0, len(content) - over - len(mark) - CUT_SLACK)
    return {**message, "content": content[:keep] + mark}


def cut_mark(size: int, cap: int) -> str:
    """What ends the text of a message cut to the store's cap."""
    return f"\n[... cut by transcript-store: the message was {size} bytes, over the cap of {cap}]"


#: the key of the JSON object a tool call's arguments are stood in for by (``stand_in``), saying so
CUT_ARGUMENTS_KEY = "transcript_store"


def json_size(text: str) -> int:
    """The bytes ``text`` takes as a JSON string in a message as the store writes it (``compact_json``)."""
    return len(compact_json(text).encode("utf-8"))


def stand_in(arguments: str, cap: int) -> Callable[[int], str]:
    """The stand-in of a tool call's arguments keeping their first ``k`` characters, by ``k``: a JSON
    object, as a provider parses arguments, saying they were cut, their size and sha256 (Hermes' session
    database keeps them whole) and holding their prefix (``prefix``)."""
    raw = arguments.encode("utf-8", "surrogatepass")
    head = {
        CUT_ARGUMENTS_KEY: f"cut by transcript-store: these arguments were {len(raw)} bytes, over their share "
                           f"of the store's cap of {cap} bytes a message; prefix: their start, sha256: their digest",
        "bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    return lambda k: _json_text({**head, "prefix": arguments[:k]})


def fit(make: Callable[[int], str], length: int, room: int) -> str | None:
    """``make(k)`` for the largest ``k`` up to ``length`` whose JSON takes at most ``room`` bytes (None: not
    even ``make(0)`` fits). Each character kept is one byte of JSON at least, so ``k`` starts at the room
    ``make(0)`` leaves and shrinks in proportion to the excess."""
    least = json_size(make(0))
    if least > room:
        return None
    k = min(length, room - least)
    while k > 0:
        text = make(k)
        size = json_size(text)
        if size <= room:
            return text
        k = min(k - 1, k * (room - least) // (size - least))
    return make(0)


#: a text of a message a cut may shorten: (where it is, its text, its form keeping the first k characters)
Cuttable = tuple[tuple[Any, ...], str, Callable[[int], str]]


def cuttables(message: dict[str, Any], mark: str, cap: int) -> list[Cuttable]:
    """The texts of ``message`` a cut may shorten: its text (``mark`` at its end) and each tool call's
    arguments (stood in for, ``stand_in``)."""
    out: list[Cuttable] = []
    content = message.get("content")
    if isinstance(content, str):
        out.append((("content",), content, lambda k: content[:k] + mark))
    calls = message.get("tool_calls")
    places: list[tuple[tuple[Any, ...], Any]] = [
        (("tool_calls", n, "function"), c.get("function")) for n, c in enumerate(calls) if isinstance(c, dict)
    ] if isinstance(calls, list) else []
    places.append((("function_call",), message.get("function_call")))
    for path, fn in places:
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            out.append(((*path, "arguments"), fn["arguments"], stand_in(fn["arguments"], cap)))
    return out


def cut_round(message: dict[str, Any], size: int, cap: int) -> dict[str, Any] | None:
    """A tool round's message of ``size`` bytes over ``cap`` with its tool calls or call id kept as they
    are, where the bulk of it is not its text: its texts cut to a share of the cap each (``share``), an
    argument over its share stood in for (``stand_in``); failing that, its ``in_round`` form (the rest
    as the text of its JSON) so cut. None: neither fits (a message of thousands of tool calls).

    Cut as the text of its JSON (``as_text``), an assistant message over the cap by its tool calls'
    arguments (a file written whole) lost its tool calls: each result of the round was an orphan
    that every assembled context left out."""
    if not (message.get("tool_calls") or message.get("tool_call_id") or message.get("function_call")):
        return None
    mark = cut_mark(size, cap)  # the size of the message as the host sent it, whatever the form
    for form in (message, in_round(message)):
        if form is None:
            continue
        cut = share(form, size if form is message else len(compact_json(form).encode("utf-8")), cap, mark)
        if cut is not None and len(compact_json(cut).encode("utf-8")) <= cap:
            return cut
    return None


def share(message: dict[str, Any], size: int, cap: int, mark: str) -> dict[str, Any] | None:
    """``message`` of ``size`` bytes with its texts (``cuttables``) cut to fit ``cap``: each text longer
    than the one limit that makes them fit is cut to it (a text kept whole when under it), so many
    small tool calls keep most of each and one huge one leaves the others whole. None: not even every
    text cut to nothing fits."""
    texts = [(path, text, make, json_size(text), json_size(make(0)))
             for path, text, make in cuttables(message, mark, cap)]
    texts = [t for t in texts if t[4] < t[3]]  # a stand-in no smaller than the text saves nothing
    budget = cap - (size - sum(t[3] for t in texts))

    def total(limit: int) -> int:
        return sum(full if full <= limit else max(least, limit) for _p, _t, _m, full, least in texts)

    if not texts or total(0) > budget:
        return None
    low, high = 0, max(t[3] for t in texts)
    while low < high:  # the largest limit whose total fits
        mid = (low + high + 1) // 2
        low, high = (mid, high) if total(mid) <= budget else (low, mid - 1)
    out = dict(message)
    for key in ("tool_calls", "function_call"):  # copied where a stand-in goes (their strings are shared)
        if key in out:
            out[key] = copy.deepcopy(out[key])
    for path, text, make, full, least in texts:
        if full > low:
            cut = fit(make, len(text), max(least, low))
            if cut is None:
                return None
            place: Any = out
            for step in path[:-1]:
                place = place[step]
            place[path[-1]] = cut
    return out


def storable_tail(
    host: Sequence[dict[str, Any]], digests: Sequence[str], stored: Sequence[str], start: int | None, cap: int,
    seen: dict[int, Checked] | None = None,
) -> tuple[list[dict[str, Any]], list[str], dict[int, str]]:
    """(messages, their digests, why each changed one changed): the host's list with every message from
    where it leaves the stored transcript (``align``) in the form the store takes (``storable``).

    A message kept in another form is stored in it, so the host's list is aligned by that form: its
    original would never match the stored entry, and every call branched the session and stored the
    rest again. Only what follows the agreed prefix is checked (new messages, in the common case), once
    per message of ``host`` given the same ``seen`` (what ``checked`` said of each, by its index)."""
    out, fps = list(host), list(digests)
    why: dict[int, str] = {}
    seen = {} if seen is None else seen
    i = align(stored, fps, start)[0]
    while i < len(out):
        if i not in seen:
            seen[i] = checked(out[i], cap)
        form, reason, _text = seen[i]
        if reason is None:
            i += 1
            continue
        original, (out[i], fps[i], why[i]) = out[i], (form, fingerprint([form]), reason)
        skipped, kept = align(stored, fps, start)
        if skipped == i and kept < len(stored):
            # Not the stored message here: perhaps the form releases before ``in_round`` stored.
            earlier = storable(original, cap, keep_round=False)[0]
            if fingerprint([earlier]) == stored[kept]:
                out[i], fps[i] = earlier, stored[kept]
                skipped = align(stored, fps, start)[0]
        # Stored in this form before, the list may go on agreeing with the transcript after it.
        i = max(i + 1, skipped)
    return out, fps, why


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


def split_system(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(leading system messages, the rest)."""
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    return list(messages[:n]), list(messages[n:])


def with_addition(system: Sequence[dict[str, Any]], addition: str | None) -> list[dict[str, Any]]:
    """A copy of the leading system messages with an engine's system-prompt addition after the first one's
    text (once: not again when it is there already; nowhere without a text system prompt)."""
    head = copy.deepcopy(list(system))
    if addition and head and isinstance(head[0].get("content"), str) and addition not in head[0]["content"]:
        head[0]["content"] = f"{head[0]['content']}\n\n{addition}"
    return head


MEMORY_HEAD = "What the memory provider recalled before this compaction:"
#: a memory provider's text beyond this is cut (hermes-agent's own sanitizer caps it first when present)
MAX_MEMORY_CHARS = 8000


def memory_block(memory_context: Any) -> str | None:
    """A memory provider's pre-compaction text as the handoff carries it, or None when there is none.

    hermes-agent passes ``compress`` what its memory provider returned just before compaction and asks
    summarizing engines to carry it in their handoff; it goes where the engine's system-prompt addition
    goes (``place_addition``), after it. hermes-agent's ``sanitize_memory_context`` (redaction, length)
    is applied when it is importable; otherwise the text is stripped and cut at MAX_MEMORY_CHARS.
    """
    if not isinstance(memory_context, str) or not memory_context.strip():
        return None
    text = memory_context.strip()
    with contextlib.suppress(Exception):  # an older hermes-agent, or none (the stand-in base)
        text = str(importlib.import_module("agent.context_engine").sanitize_memory_context(text)).strip()
    if len(text) > MAX_MEMORY_CHARS:
        text = text[:MAX_MEMORY_CHARS] + "\n[... cut]"
    return f"{MEMORY_HEAD}\n{text}" if text else None


def addition_of(assembled: Any, memory: str | None) -> str | None:
    """The engine's system-prompt addition, followed by the memory provider's block when there is one."""
    parts = [p for p in (getattr(assembled, "system_prompt_addition", None), memory) if isinstance(p, str) and p]
    return "\n\n".join(parts) if parts else None


def place_addition(
    system: Sequence[dict[str, Any]], answer: list[dict[str, Any]], addition: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system messages, answer) with an engine's system-prompt addition where the model will see it, once.

    After the system prompt's text when the list has one (``with_addition``). hermes-agent passes
    ``compress`` the conversation without its system prompt (it builds that itself for each request),
    so there the addition ends our context block, the answer's first message: put on a system prompt
    the list does not hold, it reached no request. Nowhere when the answer has no block either.
    """
    if not addition:
        return list(system), answer
    if system and isinstance(system[0].get("content"), str):
        return with_addition(system, addition), answer
    first = answer[0] if answer else None
    if first is None or first.get("role") != "user" or not is_context_message(first):
        return list(system), answer
    content = first.get("content")
    if not isinstance(content, str) or addition in content:
        return list(system), answer
    return list(system), [{**first, "content": f"{content}\n\n{addition}"}, *answer[1:]]


_CHAT_ROLES = frozenset(get_args(Role))


def checked_assembly(answer: Any) -> Any:
    """An engine's ``assemble`` answer when each of its messages has a chat role, as the host checks its
    engines' (``host._assembled``); else EngineContractError, which the callers here log and answer
    without the engine's context. A message without one was sent on in Hermes' request, which the
    provider refused."""
    for message in getattr(answer, "messages", None) or []:
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _CHAT_ROLES:
            raise EngineContractError(f"the engine assembled a message without a chat role: {role!r}")
    return answer


def valid_sequence(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with no split tool pair: orphan tool results dropped, unanswered tool calls removed."""
    out: list[dict[str, Any]] = []
    i = 0
    msgs = list(messages)
    while i < len(msgs):
        m = msgs[i]
        if m.get("role") == "tool":
            i += 1  # a result whose call is not right before it
            continue
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if not calls:
            out.append(m)
            i += 1
            continue
        j = i + 1
        results: list[dict[str, Any]] = []
        while j < len(msgs) and msgs[j].get("role") == "tool":
            results.append(msgs[j])
            j += 1
        wanted = {c.get("id") for c in calls if isinstance(c, dict)}
        answered = {r.get("tool_call_id") for r in results}
        if wanted <= answered:
            out.append(m)
            out.extend(r for r in results if r.get("tool_call_id") in wanted)
        elif m.get("content"):
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
        i = j
    return out


CONTEXT_MARKER = "[transcript-store context]"
ACK = "Understood: earlier turns are condensed above; I will use the recall tools for details."


ACK_MESSAGE = f"{CONTEXT_MARKER} {ACK}"


# The heads of the summaries engines render: legacy's fixed line, lossless' id line
# (engines/lossless/context.py render_summary). Matched whole, not by a prefix a user could type:
# a user message that merely starts with "[Summary" or with our marker is the user's, and stored.
_LOSSLESS_HEAD = re.compile(
    r"\[Summary sum_\d+ \| (?:leaf|condensed) depth \d+ \| \d+ messages msg_\d+\.\.msg_\d+"
    r" \| details: lcm_expand sum_\d+\]\n"
)


def _is_summary_text(text: str) -> bool:
    """Whether ``text`` starts with the head of a summary an engine rendered."""
    return text.startswith(SUMMARY_HEAD) or _LOSSLESS_HEAD.match(text) is not None


def is_context_message(message: dict[str, Any]) -> bool:
    """Whether a message is one the adapter produced (a summary block or its acknowledgement).

    Told by shape, not by a prefix: the block is the marker on a line of its own followed by a rendered
    summary head, the acknowledgement is exactly ``ACK_MESSAGE``. An assistant message that only starts
    with the acknowledgement is not ours: Hermes merges consecutive assistant messages, and a reply
    merged into it is the host's, to be stored. A message the user typed with our marker in front
    (pasted from a log, say) is the user's.
    """
    content = message.get("content")
    if message.get("_transcript_store_context"):
        return True
    if not isinstance(content, str):
        return False
    role = message.get("role")
    if role == "assistant":
        return content == ACK_MESSAGE
    if role != "user":
        return False
    head = CONTEXT_MARKER + "\n"
    if content.startswith(head):
        return _is_summary_text(content[len(head):])
    return _LOSSLESS_HEAD.match(content) is not None  # a lossless summary sent unmerged


def is_summary(message: dict[str, Any]) -> bool:
    """Whether a message is an engine's summary (lossless ``[Summary sum_N | ...]``, legacy ``[Summary of ...]``)."""
    content = message.get("content")
    return message.get("role") == "user" and isinstance(content, str) and _is_summary_text(content)


def merge_context(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading summary messages as ONE marked user message (plus an acknowledgement before a user turn).

    Hermes merges consecutive user messages before sending; one block keeps our answer byte-stable.
    """
    msgs = list(messages)
    n = 0
    while n < len(msgs) and is_summary(msgs[n]):
        n += 1
    if n == 0:
        return msgs
    text = "\n\n".join(str(m.get("content") or "") for m in msgs[:n])
    out = [{"role": "user", "content": f"{CONTEXT_MARKER}\n{text}"}]
    rest = msgs[n:]
    if not rest or rest[0].get("role") in ("user", "tool"):
        out.append({"role": "assistant", "content": ACK_MESSAGE})
    return out + rest


#: how hermes-agent's user-role scaffolding starts (as its ``_SYNTHETIC_USER_PREFIXES``, which tells human
#: intent from them the same way): its ``[System: ...]`` recovery notes, the todo snapshot it appends after
#: a compaction (its ``_todo_snapshot_synthetic`` flag is not saved: a list reloaded from the session
#: database has it bare) and a background process's notification, sent as a turn's user message
HOST_SCAFFOLDING = (
    "[System:",
    "[Your active task list was preserved across context compression]",
    "[IMPORTANT: Background process ",
)


def is_user_turn(message: dict[str, Any]) -> bool:
    """Whether a message is a turn the user typed: a user message with text that is neither ours nor
    Hermes' scaffolding (flagged ``_..._synthetic``, or starting as one of ``HOST_SCAFFOLDING``)."""
    if message.get("role") != "user" or is_context_message(message):
        return False
    if any(str(k).endswith("_synthetic") and v for k, v in message.items()):
        return False
    content = message.get("content")
    if isinstance(content, list):  # a multimodal turn: its text parts (an image alone is the user's too)
        texts = [str(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = "\n".join(texts) if texts else None
    return not (isinstance(content, str) and content.strip().startswith(HOST_SCAFFOLDING))


def fresh_tail(body: Sequence[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the current user message, the pending exchange): what ``compress`` keeps verbatim, whatever the budget.

    The current user message is the last turn the user typed; the pending exchange is what follows the
    last assistant message after it, that message included (a tool call and its results, which Hermes
    needs to continue the turn), or, before any reply, whatever follows the user message. Both are copies
    that keep Hermes' flags (``host_copy``); None / [] when the host's list has no such message.
    """
    at = next((i for i in range(len(body) - 1, -1, -1) if is_user_turn(body[i])), -1)
    last = next(
        (i for i in range(len(body) - 1, at, -1)
         if body[i].get("role") == "assistant" and not is_context_message(body[i])),
        at + 1,
    )
    pending = [host_copy(m) for m in body[last:] if not is_context_message(m)]
    return (host_copy(body[at]) if at >= 0 else None), pending


def with_fresh_tail(
    assembled: Sequence[dict[str, Any]], current: dict[str, Any] | None, pending: list[dict[str, Any]],
    cap: int | None = None,
) -> list[dict[str, Any]]:
    """The engine's context with the fresh tail verbatim: the answer's body (see ``fresh_tail``).

    The pending exchange ends the list (the engine's copies of it are dropped). The current user message
    stays where the engine kept it; summarised or cut away by the engine, it goes right after the
    summaries: an engine summarises and cuts oldest first, so what it kept raw came after it. ``cap``:
    the store's, with which a message the store refused as it is was stored in another form
    (``storable``), the engine's copy of it.
    """
    # By identity, not the exact JSON: the engine's copy is the form first stored, and Hermes may hold
    # the same message reloaded from its session database (a timestamp added, texts stripped); compared
    # whole, the current turn went in twice and moved (a review found it).
    def same(m: dict[str, Any]) -> str:
        return canonical(identity(clean(m)))

    def forms(m: dict[str, Any]) -> set[str]:
        # Both forms of a message stored in another one: the answer held its stored copy (the text of
        # its JSON, a cut tool result of megabytes) besides the message itself.
        if cap is None:
            return {same(m)}
        m = clean(m)
        return {same(m), same(storable(m, cap)[0]), same(storable(m, cap, keep_round=False)[0])}

    own = {f for m in pending for f in forms(m)}
    context = valid_sequence(copy.deepcopy(list(assembled)))
    while context and same(context[-1]) in own:  # the engine's copies are its newest messages
        context.pop()
    if current is not None and not forms(current) & {same(m) for m in context}:
        n = 0
        while n < len(context) and is_summary(context[n]):
            n += 1
        context.insert(n, copy.deepcopy(current))
    # One merge over the whole list: the acknowledgement goes in only before a user or tool message,
    # never before an assistant message Hermes would merge it with.
    return merge_context(context + copy.deepcopy(pending))


def is_valid_sequence(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether an OpenAI message list has every tool result right after its call and every call answered."""
    # The roles first: valid_sequence reads every item as a dict (an AttributeError on anything else).
    return all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool", "developer") for m in messages
    ) and list(messages) == valid_sequence(messages)


def resolve_threshold(model: str, thresholds: dict[str, Any] | None, default: float) -> float:
    """The threshold of the longest key of ``thresholds`` contained in ``model`` (else ``default``)."""
    best: tuple[int, float] | None = None
    # Keys YAML reads as numbers (``3.5: 0.7``) are model name parts too; values that are no positive
    # finite number are skipped, as is a map that is no mapping.
    items = thresholds.items() if isinstance(thresholds, dict) else ()
    for raw, value in items:
        key = "" if raw is None else str(raw)
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if not math.isfinite(number) or number <= 0:
            continue
        if key and key.lower() in str(model or "").lower() and (best is None or len(key) > best[0]):
            best = (len(key), number)
    return best[1] if best is not None else default


#: the share of the window the trigger is when a threshold would reach the whole window (hermes-agent's
#: built-in compressor, ``_MIN_CTX_TRIGGER_RATIO``, does the same for its own)
MIN_CTX_TRIGGER_RATIO = 0.85


def threshold_tokens(context_length: int, threshold: float) -> int:
    """The trigger in tokens: ``threshold`` is a fraction of the window, or a token count when > 1 (0 for
    no finite number or none above 0, at least 1 for a positive one); one that reaches the window is
    MIN_CTX_TRIGGER_RATIO of it.

    A trigger at or over the window never fires: the provider refuses the request first. A token count
    meets a smaller window when Hermes learns one (a provider's "maximum context length is N", a
    ``/model`` switch, a fallback model), and Hermes then sent every request that grew back over the
    window for the provider to refuse before it compressed."""
    try:
        threshold = float(threshold)
    except (TypeError, ValueError):
        return 0
    if not math.isfinite(threshold):
        return 0
    tokens = int(threshold) if threshold > 1 else int(context_length * threshold)
    if threshold > 0 and context_length > 0:
        # A positive fraction under one token of the window is the smallest trigger: 0 means none, and
        # compression was off for a threshold asking for it almost at once.
        tokens = max(1, tokens)
    if context_length > 0 and tokens >= context_length:
        return max(1, min(int(context_length * MIN_CTX_TRIGGER_RATIO), context_length - 1))
    return tokens


def as_int(value: Any) -> int:
    """A token count from a host's usage value (0 for anything that is no finite number)."""
    try:
        number = float(value or 0)
    except (TypeError, ValueError):
        return 0
    return int(number) if math.isfinite(number) else 0


@dataclass
class _Candidate:
    """A compress answer the host may or may not have taken.

    ``head``, ``last`` and ``last_len`` are set when the answer ends with a user message (a compaction at
    the start of a turn): the fingerprints of the answer without it and of it alone, and the length of its
    stripped text. Hermes merges the user message it appends after an answer (its todo snapshot) into
    that one before the next request (``repair_message_sequence``): the answer comes back with its last
    message longer, and is told by these (``merged_into``)."""

    fp: str
    length: int
    store_session: str
    next_ordinal: int
    head: str | None = None
    last: str | None = None
    last_len: int = 0
    of: str | None = None  # ``before_last``: the fingerprint of the whole answer (not written to the index)

    def merged_into(self, cleaned: Sequence[dict[str, Any]]) -> bool:
        """Whether ``cleaned`` (at least ``length`` clean messages) starts with this answer whose last
        message Hermes merged a following user message into (its text, a blank line, the rest)."""
        if self.head is None or self.last is None or self.length < 2 or len(cleaned) < self.length:
            return False
        m = cleaned[self.length - 1]
        text = m.get("content")
        if m.get("role") != "user" or not isinstance(text, str):
            return False
        text = text.strip()
        rest = text[self.last_len:]
        if "\n\n" not in rest[: len(rest) - len(rest.lstrip())]:
            return False
        own = {**m, "content": text[: self.last_len]}
        return fingerprint([own]) == self.last and fingerprint(list(cleaned[: self.length - 1])) == self.head

    def before_last(self) -> _Candidate:
        """The answer without its last message, which the host's list holds changed (an edit of it): a
        candidate of its own (``head`` its fingerprint), adopted in place of the whole answer."""
        return _Candidate(self.head or "", self.length - 1, self.store_session, self.next_ordinal - 1, of=self.fp)


@dataclass(frozen=True)
class _Visible:
    """A store session's visible transcript as ingest last saw it (what host lists are aligned with)."""

    head: str | None  # the session's head entry then: unchanged head, unchanged transcript
    generation: int
    digests: tuple[str, ...]
    entry_ids: tuple[str, ...]
    seqs: tuple[int, ...]
    #: the session's incarnation: one deleted and made again under its id (someone else's session, its
    #: own head, generation 0 and seqs from 0) is read afresh, never aligned by this cache
    incarnation: int = 0


EMPTY = _Visible(None, -1, (), (), ())


#: the share of Hermes' trigger a compress answer aims at (with the system prompt and tools): the next
#: turns grow it back to the trigger, and Hermes' estimate, ours and the provider's count differ
COMPRESS_TARGET = 0.75
#: the least room a compress answer leaves the engine's context (its summaries) beside the fresh tail
MIN_CONTEXT = 1000
#: the measures of what Hermes' requests carry besides their messages that ``request_overhead`` is the
#: median of (system prompt, tool schemas: ``compress_target``)
OVERHEAD_SAMPLES = 9
#: assemblies asked for to make room for an engine's system-prompt addition (compress)
FIT_ATTEMPTS = 3


def align(stored: Sequence[str], host: Sequence[str], start: int | None) -> tuple[int, int]:
    """(host messages already stored, visible messages to keep): where the host's list leaves the transcript.

    ``start`` is the visible position the host's list begins at (0; after a taken compaction, the
    candidate's next ordinal), None for a compacted view without a known candidate.
    """
    skip = 0
    if start is None:
        # A compacted view we hold no candidate for: its tail is the end of what was stored, so it is
        # anchored at the latest copy of its first stored message; messages before that one are the
        # view's own (repaired) copies, not new ones. Nothing found: all of it follows the transcript.
        latest = {d: i for i, d in enumerate(stored)}
        found = next((k for k, d in enumerate(host) if d in latest), None)
        skip, start = (0, len(stored)) if found is None else (found, latest[host[found]])
    start = min(start, len(stored))
    n = 0
    while skip + n < len(host) and start + n < len(stored) and host[skip + n] == stored[start + n]:
        n += 1
    return skip + n, start + n


@dataclass(frozen=True)
class _Selection:
    """One session's last ``select_context`` answer, kept so that each call gets a list of its own.

    The body (the engine's context: the store's messages and summaries, JSON by construction) is kept
    as its JSON text: parsing it again is a full copy at a third of ``copy.deepcopy``'s cost. The system
    messages (and Hermes' prefill messages after them) are the request's own, a few, deep-copied."""

    key: str
    system: list[dict[str, Any]]
    body: str | None

    def messages(self) -> list[dict[str, Any]] | None:
        """A fresh copy of the selection (None: the request stays as it is)."""
        if self.body is None:
            return None
        body: list[dict[str, Any]] = json.loads(self.body)
        return copy.deepcopy(self.system) + body


@dataclass
class _Runtime:
    """Everything that must not be copied: store, engine, locks, caches."""

    store: TranscriptStore
    engine: Any
    lock: threading.RLock = field(default_factory=threading.RLock)
    session_locks: dict[str, threading.Lock] = field(default_factory=dict)
    #: answer fingerprint -> store session -> candidate (two lineages may get the same answer), newest last
    candidates: dict[str, dict[str, _Candidate]] = field(default_factory=dict)
    adopted: dict[str, str] = field(default_factory=dict)  # store session -> adopted fp
    pending: dict[str, str] = field(default_factory=dict)  # store session -> newest unadopted fp
    aliases: dict[str, str] = field(default_factory=dict)  # hermes session -> store session
    #: store session -> (request key, system messages, the selected body as JSON or None): handed out as
    #: fresh copies only (``_Selection``), never the cached objects a caller could change
    selections: dict[str, _Selection] = field(default_factory=dict)
    visible: dict[str, _Visible] = field(default_factory=dict)  # store session -> its visible transcript
    warned: set[str] = field(default_factory=set)  # user turns whose fresh tail alone was at the trigger
    index_seq: int = -1  # the candidate index is read up to here
    loaded: bool = False
    key: str = ""  # its configuration, in ``_SHARED_RUNTIMES``
    factory: Any = None  # the summarizer factory, kept alive while its id is part of ``key``
    users: int = 0  # the engine copies using it (guarded by ``_RUNTIME_LOCK``)

    def session_lock(self, store_session: str) -> threading.Lock:
        """The lock serializing ingestion into one store session."""
        with self.lock:
            return self.session_locks.setdefault(store_session, threading.Lock())


def with_incoming(conversation: list[dict[str, Any]], incoming: Any) -> list[dict[str, Any]]:
    """The conversation with the turn's incoming message at its end when its current turn (what follows its
    last reply without tool calls) does not hold it: ``select_context``'s host may pass the new user
    message beside the conversation rather than in it."""
    if not isinstance(incoming, dict):
        return conversation
    start = next(
        (i + 1 for i in range(len(conversation) - 1, -1, -1)
         if conversation[i].get("role") == "assistant" and not conversation[i].get("tool_calls")),
        0,
    )
    own = canonical(identity(clean(incoming)))
    if any(canonical(identity(clean(m))) == own for m in conversation[start:]):
        return conversation
    return [*conversation, incoming]


def prefill_count(request: Sequence[dict[str, Any]], conversation: Sequence[dict[str, Any]]) -> int:
    """How many messages the request holds between its system prompt and the conversation: hermes-agent's
    ``prefill_messages`` (few-shot examples from its config), which it puts there in every request and
    never into the conversation. The request's extra leading messages when the rest holds the
    conversation's roles in order; 0 when it cannot tell."""
    _system, sent = split_system(list(request))
    _system, held = split_system(list(conversation))
    k = len(sent) - len(held)
    if k > 0 and all(a.get("role") == b.get("role") for a, b in zip(sent[k:], held, strict=True)):
        return k
    return 0


def as_sent(
    selected: list[dict[str, Any]], request: Sequence[dict[str, Any]], conversation: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A selection with each message as this request sends it: the request's own copy when it holds the
    message, else the stored message as Hermes' request build makes one of it (``request_copy``: its
    ``api_content``, Hermes' record of the bytes it sent, as its content, without the keys that build pops).

    The selection is assembled from what is stored, the conversation's clean messages. hermes-agent sends
    the current user message with its memory provider's prefetch and ``pre_llm_call`` plugin context
    appended, in the request only (the conversation keeps the clean text, the sent one as ``api_content``,
    which it pops from every outgoing message and replays for earlier turns): rebuilt from the store, the
    selection dropped that context from the turn, sent a key no provider knows, and changed the bytes of
    earlier turns, each request's cached prefix with them. A request message is paired with the
    conversation message at its place when both lists hold the same roles in the same order (the
    request's copy of the current turn differs by its injected text); any other by its identity.
    """
    _system, sent = split_system(list(request))
    _system, held = split_system(list(conversation))

    def key(m: dict[str, Any]) -> str:
        return canonical(identity(clean(m)))

    wire = {key(m): m for m in sent}
    if len(sent) == len(held) and all(a.get("role") == b.get("role") for a, b in zip(sent, held, strict=True)):
        wire.update({key(c): r for c, r in zip(held, sent, strict=True)})
    # Hermes gives every assistant message a reasoning_content exactly when its provider requires one
    pad = any(m.get("role") == "assistant" and "reasoning_content" in m for m in sent)
    out: list[dict[str, Any]] = []
    for m in selected:
        own = wire.get(key(m)) if not is_context_message(m) else None
        out.append(copy.deepcopy(own) if own is not None else request_copy(m, pad=pad))
    return out


def request_copy(message: dict[str, Any], *, pad: bool) -> dict[str, Any]:
    """A stored message as hermes-agent's request build makes the message it sends of a conversation message
    (``agent/conversation_loop.py``, the ``api_messages`` loop, and its ``copy_reasoning_content_for_api``):
    its ``api_content`` as its content, ``reasoning`` and ``finish_reason`` popped (strict providers such as
    Mistral refuse them), and ``reasoning_content`` on an assistant message only when the provider requires
    one (``pad``: DeepSeek, Kimi, MiMo thinking models; strict providers refuse it): the stored one (an
    empty one as a space), else the ``reasoning`` text when the message has no tool calls, else a space.
    The rest (``timestamp``, ``tool_name``, ``codex_*``) is its transport's to strip, as from its own messages
    (the contract runs ``select_context`` before every request sanitizer).
    """
    out = dict(message)
    api = out.pop("api_content", None)
    if isinstance(api, str) and api and out.get("role") in ("user", "assistant"):
        out["content"] = api
    reasoning = out.pop("reasoning", None)
    out.pop("finish_reason", None)
    if out.get("role") != "assistant":
        return out
    stored = out.pop("reasoning_content", None)
    if not pad:
        return out
    if isinstance(stored, str):
        out["reasoning_content"] = stored or " "
    elif isinstance(reasoning, str) and reasoning and not out.get("tool_calls"):
        out["reasoning_content"] = reasoning
    else:  # another provider's thoughts behind a tool call are not passed on (Hermes' #15748)
        out["reasoning_content"] = " "
    return out


def settled(messages: Any) -> list[dict[str, Any]]:
    """The messages of a list before its pending tool round (the last assistant message with tool calls,
    when only tool results follow it): what ``handle_tool_call`` stores of the live conversation. Stored
    with it, the recall tool's own call was its newest hit, and every later search found the earlier
    searches first."""
    if not isinstance(messages, list):
        return []
    items = [m for m in messages if isinstance(m, dict)]
    for at in range(len(items) - 1, -1, -1):
        m = items[at]
        if m.get("role") == "tool":
            continue
        return items[:at] if m.get("role") == "assistant" and m.get("tool_calls") else items
    return items


def _branch_parent(session_db: Any, session_id: str) -> str | None:
    """The session ``session_id`` is a ``/branch`` of, as hermes-agent's session database records it (its
    ``_branched_from`` mark, or a parent that ended as ``branched``); None when it is none or cannot tell."""
    try:
        row = session_db.get_session(session_id) if session_db is not None else None
        if not isinstance(row, dict):
            return None
        config = row.get("model_config") or "{}"
        config = json.loads(config) if isinstance(config, str) else config
        marked = config.get("_branched_from") if isinstance(config, dict) else None
        parent_id = row.get("parent_session_id")
        if isinstance(marked, str) and marked:
            return marked
        if marked:
            return parent_id if isinstance(parent_id, str) and parent_id else None
        parent = session_db.get_session(parent_id) if parent_id else None
        return parent_id if isinstance(parent, dict) and parent.get("end_reason") == "branched" else None
    except Exception:
        return None


def saved_conversation(session_db: Any, hermes_session: str) -> Any:
    """What Hermes' session database saved of a conversation, as Hermes replays it: with
    ``repair_alternation`` (what its gateway and ``/resume`` load), so consecutive user messages come
    merged, as ``repair_message_sequence`` merged them in the live list before the request.

    The turn after an interrupted one merges the interrupted user message and its own into one in the
    live list (what the turn hook stores) while the database keeps the two rows: read as saved, the
    list differed from the transcript there, and each later store of it (``end_turn``, a switch)
    branched the session and stored the rest of the conversation again. An older hermes-agent without
    the parameter is read as saved."""
    read = session_db.get_messages_as_conversation
    try:
        return read(hermes_session, repair_alternation=True)
    except TypeError:  # no such parameter
        return read(hermes_session)


def _remember_candidate(rt: _Runtime, cand: _Candidate) -> None:
    """Index a candidate by its answer and lineage, as the newest of its answer (call holding ``rt.lock``)."""
    by = rt.candidates.setdefault(cand.fp, {})
    by.pop(cand.store_session, None)
    by[cand.store_session] = cand


class TranscriptStoreEngineMixin:
    """The adapter logic; ``engine_class()`` combines it with Hermes' ``ContextEngine`` base."""

    last_prompt_tokens: int = 0
    last_completion_tokens: int = 0
    last_total_tokens: int = 0
    threshold_tokens: int = 0
    context_length: int = 0
    compression_count: int = 0
    request_overhead: int = 0

    def __init__(
        self,
        *,
        engine: str = "lossless",
        db_url: str | None = None,
        scope: str = DEFAULT_SCOPE,
        context_length: int = 128000,
        threshold_percent: float = DEFAULT_THRESHOLD,
        engine_config: dict[str, Any] | None = None,
        summarizer_factory: Callable[[], Any] | None = None,
        model_thresholds: dict[str, Any] | None = None,
        plugin_dirs: Sequence[str] | None = None,
    ) -> None:
        """Configure the adapter; nothing is opened until the first call that needs the store."""
        self.engine_id = engine
        # Engine plugin folders besides entry points (those of TRANSCRIPT_STORE_PLUGIN_DIRS are added
        # when the runtime opens): an engine ``hermes install`` found in one must load here too.
        self.plugin_dirs: list[str] = [str(d) for d in plugin_dirs or ()]
        self.db_url = db_url
        self.scope = scope
        self.engine_config = dict(engine_config or {})
        self.summarizer_factory = summarizer_factory
        self.threshold_percent = threshold_percent
        self.model_thresholds: dict[str, Any] = dict(model_thresholds or {})
        self.model = ""
        self.session_id: str | None = None
        #: Hermes session ids this agent switched to by ``/branch`` (``bind_session_state``): their first
        #: list starts with the parent's compress answer, and forks its lineage instead of joining it
        self.branches: set[str] = set()
        self.last_prompt_tokens = 0
        self.last_completion_tokens = 0
        self.last_total_tokens = 0
        self.compression_count = 0
        self.request_overhead = 0  # what Hermes' requests carry besides the messages (compress_target)
        self._overheads: list[int] = []  # its last measures
        self.context_length = int(context_length)
        self.threshold_tokens = threshold_tokens(self.context_length, threshold_percent)
        self._rt: _Runtime | None = None
        self._session_db: Any = None  # Hermes' session database (``bind_session_state``), never copied

    # ------------------------------------------------------------------------------------ copies

    def __getstate__(self) -> dict[str, Any]:
        """The plain configuration and counters: no store, engine, connection or lock."""
        state = dict(self.__dict__)
        state["_rt"] = None
        state["_session_db"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a copy; its runtime opens lazily."""
        self.__dict__.update(state)
        self._rt = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy with its own lazily opened runtime."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = None if k in ("_rt", "_session_db") else copy.deepcopy(v, memo)
        return new

    # ------------------------------------------------------------------------------------ runtime

    @property
    def name(self) -> str:
        """The engine name Hermes selects with ``context.engine``."""
        return self.engine_id

    def database_url(self) -> str:
        """The store URL: the configured one, else $TRANSCRIPT_STORE_URL, else $HERMES_HOME/transcript-store.db."""
        if self.db_url:
            return self.db_url
        env = os.environ.get("TRANSCRIPT_STORE_URL")
        if env:
            return env
        home = Path(os.environ.get("HERMES_HOME") or Path.home() / ".hermes")
        home.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{home / 'transcript-store.db'}"

    def runtime(self) -> _Runtime:
        """The store and engine of this copy, opened on first use and shared with every copy of the same
        configuration in the process (thread-safe)."""
        rt = self._rt
        if rt is not None:
            return rt
        with _RUNTIME_LOCK:
            if self._rt is None:
                url = self.database_url()
                env_dirs = [d for d in os.environ.get(PLUGIN_DIRS_ENV, "").split(os.pathsep) if d]
                dirs = [*getattr(self, "plugin_dirs", []), *env_dirs]
                factory = self.summarizer_factory
                key = json.dumps(
                    [url, self.engine_id, self.scope, self.engine_config, dirs, id(factory) if factory else None],
                    sort_keys=True, default=repr,
                )
                rt = _SHARED_RUNTIMES.get(key)
                if rt is None:
                    store = TranscriptStore(url)
                    try:
                        summarizer = factory() if factory else None
                        ctx = EngineContext(store=store, config=self.engine_config, summarizer=summarizer)
                        engine, _info = EngineRegistry(dirs).create(self.engine_id, ctx)
                    except BaseException:
                        store.close()
                        raise
                    rt = _Runtime(store=store, engine=engine, key=key, factory=factory)
                    _SHARED_RUNTIMES[key] = rt
                rt.users += 1
                self._rt = rt
            return self._rt

    def close(self) -> None:
        """Release this copy's runtime; the store closes with the last copy using it (it reopens on the
        next use)."""
        with _RUNTIME_LOCK:
            rt, self._rt = self._rt, None
            if rt is None:
                return
            rt.users -= 1
            last = rt.users <= 0
            if last and _SHARED_RUNTIMES.get(rt.key) is rt:
                del _SHARED_RUNTIMES[rt.key]
        if last:
            rt.store.close()

    # ------------------------------------------------------------------------------------ ingestion

    def _load_candidates(self, rt: _Runtime, *, refresh: bool = False) -> None:
        """Read the durable candidate index once per runtime (``refresh``: what was added since)."""
        if rt.loaded and not refresh:
            return
        index = rt.store.open_session(self.scope, INDEX_KEY)
        with rt.lock:
            after = rt.index_seq
        while True:
            page = rt.store.list_entries(self.scope, index.session_id, after_seq=after, limit=1000)
            with rt.lock:
                for e in page:
                    p = e.payload or {}
                    if e.kind == "metadata" and p.get("type") == CANDIDATE:
                        _remember_candidate(rt, _Candidate(
                            p["fp"], p["length"], p["store_session"], p["next_ordinal"],
                            p.get("head"), p.get("last"), int(p.get("last_len") or 0),
                        ))
                    elif e.kind == "metadata" and p.get("type") == ALIAS:
                        rt.aliases[p["hermes_session"]] = p["store_session"]
                    after = e.seq
                rt.index_seq = max(rt.index_seq, after)
            if len(page) < 1000:
                break
        rt.loaded = True

    def _store_session(self, rt: _Runtime, hermes_session: str | None) -> str:
        """The store session of a Hermes session (its lineage when a candidate linked it)."""
        key = hermes_session or self.session_id or "default"
        self._load_candidates(rt)  # the durable aliases come with the index (once per process)
        with rt.lock:
            if key in rt.aliases:
                return rt.aliases[key]
        sid = rt.store.open_session(self.scope, key).session_id
        with rt.lock:
            return rt.aliases.setdefault(key, sid)

    def _match(
        self, rt: _Runtime, body: list[dict[str, Any]], hermes_session: str | None = None, *, refresh: bool = False
    ) -> _Candidate | None:
        """The longest candidate the message list starts with; of an answer two lineages got, the one of
        ``hermes_session``'s lineage when it is one of them, else the newest."""
        self._load_candidates(rt, refresh=refresh)
        with rt.lock:
            lengths = sorted(
                {c.length for by in rt.candidates.values() for c in by.values() if c.length <= len(body)},
                reverse=True,
            )
            # the answers ending with a user message Hermes may have merged its next one into, by length
            mergeable: dict[int, list[tuple[str, _Candidate]]] = {}
            for by in rt.candidates.values():
                for k, c in by.items():
                    if c.head is not None and c.length <= len(body):
                        mergeable.setdefault(c.length, []).append((k, c))
        # Fingerprinted without the host's bookkeeping, as the answer was (``_record_candidate``): Hermes
        # marks every message it saved to its session database (``_db_persisted``), so the answer it took
        # comes back marked, and a raw fingerprint never matched: no candidate adopted, no lineage.
        cleaned = [clean(m) for m in body[: lengths[0]]] if lengths else []
        for n in lengths:
            found: dict[str, _Candidate] = {}
            # (The second is how releases before message identities fingerprinted an answer: a candidate
            # they recorded is still recognised after an upgrade.)
            for fp in (fingerprint(cleaned[:n]), digest(canonical(cleaned[:n]))):
                with rt.lock:
                    found.update({k: c for k, c in rt.candidates.get(fp, {}).items() if c.length == n})
            if not found:
                # Hermes merged the user message it appended after the answer into the answer's last one:
                # the answer up to that message, which the list holds edited (stored as an edit of it).
                for k, c in mergeable.get(n, ()):
                    if c.merged_into(cleaned):
                        found[k] = c.before_last()
                        # a /branch forked from it holds that shorter answer as its own candidate
                        with rt.lock:
                            forks = dict(rt.candidates.get(c.head or "", {}))
                        found.update({f: fc for f, fc in forks.items() if fc.length == n - 1})
            if found:
                mine = self._lineage(rt, hermes_session) if len(found) > 1 else None
                return found[mine] if mine in found else list(found.values())[-1]
        return None

    def _lineage(self, rt: _Runtime, hermes_session: str | None) -> str | None:
        """The store session a Hermes session is known to continue, without opening one."""
        key = hermes_session or self.session_id or "default"
        with rt.lock:
            if key in rt.aliases:
                return rt.aliases[key]
        info = rt.store.find_session(self.scope, key)
        return info.session_id if info is not None else None

    def _visible_in(self, c: Core, rt: _Runtime, store_session: str) -> tuple[Any, _Visible]:
        """The session's row, locked, and its visible transcript (the cache, brought up to date)."""
        sess = c.require_session(self.scope, store_session, lock=True)
        with rt.lock:
            known = rt.visible.get(store_session, EMPTY)
        same = known.incarnation == sess.incarnation and known.generation == sess.generation
        if same and known.head == sess.head_entry_id:
            return sess, known
        # Another writer moved the head. Appends after our last message keep the cached part; a
        # branch or a rewrite below it does not, and the whole transcript is read again.
        keep = known if same else EMPTY
        if keep.seqs and c.path_seq_at_position(self.scope, store_session, len(keep.seqs) - 1) != keep.seqs[-1]:
            keep = EMPTY
        entries = [
            entry_from_row(r, True)
            for r in c.visible_rows(self.scope, store_session, len(keep.seqs) - 1, None, None)
        ]
        return sess, _Visible(
            sess.head_entry_id,
            sess.generation,
            keep.digests + tuple(fingerprint([e.message or {}]) for e in entries),
            keep.entry_ids + tuple(e.entry_id for e in entries),
            keep.seqs + tuple(e.seq for e in entries),
            int(sess.incarnation),
        )

    def _write_in(
        self, c: Core, rt: _Runtime, store_session: str, host: list[dict[str, Any]], digests: list[str],
        start: int | None, follow: bool = False, seen: dict[int, Checked] | None = None,
    ) -> _Visible:
        """Make the visible transcript follow the host's list (one transaction, the session locked).

        A list that is the start of the transcript moves nothing (a hook may send an older copy), unless
        ``follow``: ``compress`` gets the list Hermes goes on with, and what the transcript holds after
        its end (a turn ``/undo`` took back; the tail ``/compress here`` holds back and appends again)
        leaves the active branch, or the answer brought it back (a review saw an undone turn sent to
        the model again). ``seen``: what ``checked`` said of the host's messages (``storable_tail``)."""
        sess, vis = self._visible_in(c, rt, store_session)
        seen = {} if seen is None else seen
        cap = rt.store.config.max_payload_bytes
        host, digests, changed = storable_tail(host, digests, vis.digests, start, cap, seen)
        skipped, kept = align(vis.digests, digests, start)
        rest = host[skipped:]
        for i in sorted(k for k in changed if k >= skipped):
            log.warning("transcript-store: a message of store session %s is stored in another form (%s)",
                        store_session, changed[i])
        if not rest:
            if not follow or kept == 0 or kept == len(vis.entry_ids):
                return vis  # a list we hold all of (or a stale prefix of it): nothing moves
            head = vis.entry_ids[kept - 1]
            paths.branch(c, self.scope, store_session, head)
            return replace(vis, head=head, digests=vis.digests[:kept], entry_ids=vis.entry_ids[:kept],
                           seqs=vis.seqs[:kept])
        # Off-branch entries may hold the same message at the same ordinal: a key naming the seq this
        # write follows can never find one of them (it would be "already stored", silently).
        forked = kept < len(vis.entry_ids) or sess.path_length < sess.last_seq + 1
        if kept < len(vis.entry_ids):
            # The host's list differs from here on: branch after the last message both agree on.
            paths.branch(c, self.scope, store_session, vis.entry_ids[kept - 1] if kept else None)
        after_seq = int(sess.last_seq) if forked else None
        items = [
            new_entry(rt.store, m, message_key(store_session, kept + k, m, after_seq), seen.get(skipped + k))
            for k, m in enumerate(rest)
        ]
        entries = c.append(self.scope, store_session, items)
        return replace(
            vis,
            head=entries[-1].entry_id,  # the head now; neither a branch nor an append rotates the generation
            digests=vis.digests[:kept] + tuple(digests[skipped:]),
            entry_ids=vis.entry_ids[:kept] + tuple(e.entry_id for e in entries),
            seqs=vis.seqs[:kept] + tuple(e.seq for e in entries),
        )

    def ingest(
        self, messages: Sequence[dict[str, Any]], hermes_session: str | None = None, *, follow: bool = False
    ) -> tuple[str, int]:
        """Store the conversation's messages once each; (store session, visible messages in the lineage).
        ``follow``: the list is the conversation itself, shorter than the transcript too (``_write_in``).

        Our own context messages (summaries) are never stored. The rest is aligned in order with the
        session's visible transcript: the longest common prefix is skipped and everything after the
        first difference is written (see the module doc), each with the idempotency key (session,
        ordinal, canonical message). The common case, the stored list plus new messages, reads nothing
        but the session's row and writes only the new messages.
        """
        try:
            return self._ingest(messages, hermes_session, follow=follow)
        except UnknownSession as e:
            # The store session this runtime followed was deleted (``sessions delete``): every later call
            # failed on it until a restart, which opens the Hermes session by its key anew, and compress
            # left the conversation uncompressed meanwhile. Forgotten, it is opened as a restart opens it.
            rt = self.runtime()
            self._load_candidates(rt, refresh=True)  # first: a refresh must not bring its candidates back
            if not self._forget(rt, e.session_id):
                raise
            return self._ingest(messages, hermes_session, follow=follow)

    @staticmethod
    def _forget(rt: _Runtime, store_session: str) -> bool:
        """Drop what the runtime holds of a store session found deleted; whether it held anything of it."""
        with rt.lock:
            keys = [k for k, sid in rt.aliases.items() if sid == store_session]
            answers = [fp for fp, by in rt.candidates.items() if store_session in by]
            held = bool(keys or answers) or store_session in rt.visible
            for k in keys:
                del rt.aliases[k]
            for cache in (rt.visible, rt.adopted, rt.pending, rt.selections):
                cache.pop(store_session, None)
            for fp in answers:  # a compacted view of it is taken for the start of a new session's list
                del rt.candidates[fp][store_session]
                if not rt.candidates[fp]:
                    del rt.candidates[fp]
        return held

    def _ingest(
        self, messages: Sequence[dict[str, Any]], hermes_session: str | None = None, *, follow: bool = False
    ) -> tuple[str, int]:
        """``ingest``, once."""
        rt = self.runtime()
        _system, body = split_system([m for m in messages if isinstance(m, dict)])
        compacted = any(is_context_message(m) for m in body)
        # A compacted view whose candidate another runtime recorded after our index was read.
        cand = self._match(rt, body, hermes_session) or (
            self._match(rt, body, hermes_session, refresh=True) if compacted else None
        )
        start: int | None = 0
        key = hermes_session or self.session_id or "default"
        if cand is not None and key in getattr(self, "branches", ()) and self._lineage(rt, key) is None:
            cand = self._fork(rt, key, cand)
        if cand is not None:
            store_session = cand.store_session
            with rt.lock:
                rt.aliases[hermes_session or self.session_id or "default"] = store_session
                newly = rt.adopted.get(store_session) != cand.fp
            if newly:
                self._adopt(rt, cand)
            # The candidate stands for the transcript up to its next ordinal: what follows it in the
            # host's list follows that position (its copies of the fresh tail are not compared).
            start, body = cand.next_ordinal, body[cand.length:]
        else:
            store_session = self._store_session(rt, hermes_session)
            if compacted:
                start = None
        host = [clean(m) for m in body if not is_context_message(m)]
        digests = [fingerprint([m]) for m in host]
        seen: dict[int, Checked] = {}  # each new message is checked once, whatever the attempts
        with rt.session_lock(store_session):
            with rt.lock:
                known = rt.visible.get(store_session)
            if known is not None:
                cap = rt.store.config.max_payload_bytes
                fps = storable_tail(host, digests, known.digests, start, cap, seen)[1]
                skipped, kept = align(known.digests, fps, start)
                if skipped == len(host) and (not follow or kept in (0, len(known.entry_ids))):
                    # Nothing new against the cache: one read of the session's head proves it current.
                    info = rt.store.get_session(self.scope, store_session)
                    if (info.head_entry_id, info.generation, info.incarnation) == (
                        known.head, known.generation, known.incarnation
                    ):
                        return store_session, len(known.entry_ids)
            landed: list[_Visible] = []  # what an attempt that ran to its end left (its incarnation with it)

            def run(c: Core) -> _Visible:
                if landed and replaced(c, self.scope, store_session, landed[0].incarnation):
                    # An earlier attempt ran to its end and only its COMMIT was uncertain; the store
                    # session it wrote was deleted since, perhaps made again under its id (someone
                    # else's transcript): aligned with that one, the list went into it. Its own answer.
                    return landed[0]
                landed[:] = [self._write_in(c, rt, store_session, host, digests, start, follow, seen)]
                return landed[0]

            vis = rt.store.write(run)
            with rt.lock:  # only after the commit: a retried transaction starts from the same cache
                rt.visible[store_session] = vis
        return store_session, len(vis.entry_ids)

    def _adopt(self, rt: _Runtime, cand: _Candidate) -> None:
        """The host took a compress answer: record it (idempotently) and make the compacted view visible."""
        rt.store.append(
            self.scope, cand.store_session, kind="metadata",
            payload={"type": ADOPTED, "fp": cand.fp}, idempotency_key="adopt-" + cand.fp,
        )
        with rt.lock:
            rt.adopted[cand.store_session] = cand.fp
            if rt.pending.get(cand.store_session) in {cand.fp, cand.of} - {None}:
                del rt.pending[cand.store_session]

    def _fork(self, rt: _Runtime, key: str, cand: _Candidate) -> _Candidate:
        """A ``/branch`` of a compacted conversation: a store session of its own for ``key``, holding a
        copy of the parent lineage's transcript up to the answer, and the answer as its own candidate.

        The branch's list starts with the parent's compress answer; matched, it made the branch join the
        parent's store session: its turns went into the parent's, and each switch between the two
        branched that session again (and the recall tools of one found the other's turns).

        One transaction: the session, the copy and the candidate land together or not at all. Made in
        steps, a fork failing after the session was made (the copy or the candidate's record refused)
        left a session for ``key``; the next call took that for the branch's lineage, forked no more,
        and the branch joined the parent's again. A retry (its COMMIT's answer lost, or a fork of the
        same branch by another process) finds its own rows by their keys."""

        def session_of(c: Core, session_key: str) -> str:
            row = c.find_session_by_key(self.scope, session_key)
            if row is None:
                try:
                    return c.create_session(self.scope, new_id(), session_key).session_id
                except SessionKeyConflict:  # made by another writer after the lookup (PostgreSQL waited)
                    row = c.find_session_by_key(self.scope, session_key)
                    if row is None:
                        raise
            return str(row.session_id)

        def run(c: Core) -> _Candidate:
            own = session_of(c, key)
            c.require_session(self.scope, cand.store_session)
            parent = [
                entry_from_row(r, True)
                for r in c.visible_rows(self.scope, cand.store_session, -1, cand.next_ordinal, None)
            ]
            items = rt.store.prepare([
                AppendItem(message=e.message, idempotency_key=message_key(own, k, e.message or {}))
                for k, e in enumerate(parent)
            ])
            for at in range(0, len(items), 500):  # a long transcript in statements of a bounded size
                c.append(self.scope, own, items[at : at + 500])
            forked = replace(cand, store_session=own)
            c.append(self.scope, session_of(c, INDEX_KEY), rt.store.prepare([self._candidate_item(forked)]))
            return forked

        forked = rt.store.write(run)
        self._remember(rt, forked)
        with rt.lock:
            rt.aliases[key] = forked.store_session
        return forked

    def _record_candidate(self, rt: _Runtime, body: list[dict[str, Any]], store_session: str, n: int) -> None:
        """Write a compress answer as an unreferenced candidate (durable, idempotent)."""
        cleaned = [clean(m) for m in body]
        cand = _Candidate(fingerprint(cleaned), len(cleaned), store_session, n)
        last = cleaned[-1] if cleaned else {}
        if len(cleaned) >= 2 and last.get("role") == "user" and isinstance(last.get("content"), str):
            cand = replace(cand, head=fingerprint(cleaned[:-1]), last=fingerprint([last]),
                           last_len=len(last["content"].strip()))
        self._record(rt, cand)

    @staticmethod
    def _candidate_item(cand: _Candidate) -> AppendItem:
        """The index entry recording a candidate (idempotent by its answer and lineage)."""
        return AppendItem(
            kind="metadata",
            payload={"type": CANDIDATE, "fp": cand.fp, "length": cand.length,
                     "store_session": cand.store_session, "next_ordinal": cand.next_ordinal,
                     **({"head": cand.head, "last": cand.last, "last_len": cand.last_len} if cand.head else {})},
            # Keyed by the lineage too: two conversations can get the same answer (a conversation run
            # again, a scripted one), and a key of the answer alone refused the second one's record
            # (IdempotencyConflict: its compress failed, three times, and left it uncompressed).
            idempotency_key="cand-" + digest(cand.fp, cand.store_session),
        )

    def _record(self, rt: _Runtime, cand: _Candidate) -> None:
        """Write a candidate to the index (durable, idempotent) and remember it."""
        index = rt.store.open_session(self.scope, INDEX_KEY)
        rt.store.append_many(self.scope, index.session_id, [self._candidate_item(cand)])
        self._remember(rt, cand)

    @staticmethod
    def _remember(rt: _Runtime, cand: _Candidate) -> None:
        """Know a recorded candidate in this runtime (the newest unadopted one of its lineage)."""
        with rt.lock:
            _remember_candidate(rt, cand)
            if rt.adopted.get(cand.store_session) != cand.fp:
                rt.pending[cand.store_session] = cand.fp

    # ------------------------------------------------------------------------------------ ContextEngine

    def update_from_response(self, usage: dict[str, Any]) -> None:
        """Record the token counts of the last API response."""
        self._mark_turn()
        if not isinstance(usage, dict):
            return
        prompt = as_int(usage.get("prompt_tokens") or usage.get("input_tokens"))
        completion = as_int(usage.get("completion_tokens") or usage.get("output_tokens"))
        self.last_prompt_tokens = prompt
        self.last_completion_tokens = completion
        self.last_total_tokens = as_int(usage.get("total_tokens")) or prompt + completion

    def _tell_thread(self) -> None:
        """Name this copy as the one last told its agent's session in this thread (``end_turn``): Hermes
        builds an agent, binding its copy, in the thread that runs it (the background review's, too)."""
        with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced: no hook
            _TURN.told = weakref.ref(self)

    def _mark_turn(self) -> None:
        """Name this copy as the engine of the turn running on this thread (see ``observe_turn``)."""
        with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced: no hook
            _TURN.engine = weakref.ref(self)

    def should_compress(self, prompt_tokens: int | None = None) -> bool:
        """Whether the prompt reached the threshold."""
        self._mark_turn()
        # A count that is no number (a string, a dict) is read as a host's usage value is: never a
        # TypeError into Hermes' turn loop.
        tokens = as_int(self.last_prompt_tokens if prompt_tokens is None else prompt_tokens)
        return self.threshold_tokens > 0 and tokens >= self.threshold_tokens

    def should_compress_preflight(self, messages: list[dict[str, Any]]) -> bool:
        """A cheap estimate of the messages against the threshold."""
        try:
            return self.should_compress(RoughEstimator().count_messages(messages))
        except Exception:
            return False

    def compress(
        self,
        messages: list[dict[str, Any]],
        current_tokens: int | None = None,
        focus_topic: str | None = None,
        force: bool = False,
        session_id: str | None = None,
        memory_context: str = "",
        **_kwargs: Any,
    ) -> list[dict[str, Any]]:
        """Store the conversation, compact in the engine, answer below the trigger with the fresh tail kept.

        The answer is the system prompt, the engine's context and the fresh tail (``fresh_tail``),
        aimed at ``compress_target`` tokens. The input list itself comes back (no progress, not counted)
        when nothing changes: our last answer sent back with nothing new, or an engine that cannot
        make it shorter.
        """
        try:
            snapshot = detached(list(messages))
        except Exception:  # not a list of messages: nothing to store or compact
            log.exception("transcript-store: compress got no message list; leaving it unchanged")
            return messages
        try:
            memory = memory_block(memory_context)
            return self._compress(snapshot, current_tokens, focus_topic, force, session_id, memory)
        except Exception:  # never an untyped error into Hermes: the originals are stored or still the host's
            log.exception("transcript-store: compress failed; leaving the conversation uncompressed")
            return snapshot

    def _compress(
        self, snapshot: list[Any], current_tokens: int | None, focus_topic: str | None, force: bool,
        session_id: str | None, memory: str | None = None,
    ) -> list[dict[str, Any]]:
        """``compress`` on the host's copied list (which it returns when nothing changes)."""
        messages = [m for m in snapshot if isinstance(m, dict)]  # anything else is no message of ours
        try:
            rt = self.runtime()
            store_session, n = self.ingest(messages, session_id, follow=True)
        except Exception:
            log.exception("transcript-store: storing the conversation failed; leaving it uncompressed")
            return snapshot
        system, body = split_system(messages)
        current, pending = fresh_tail(body)
        if current is None and not pending:
            return snapshot  # nothing but our own context messages
        if not force and self._is_our_answer(rt, body, session_id):
            # Hermes asks again with our last answer and nothing new (it retries up to three times a
            # request): compacting again could only squeeze the summaries, a summarizer call each time.
            return snapshot
        estimator = RoughEstimator()
        room = self.compress_target(messages, current_tokens) - estimator.count_messages(system)
        tail = estimator.count_messages(([current] if current else []) + pending)
        if tail + MIN_CONTEXT > room:
            self._warn_tail_over(rt, store_session, current or pending[0], tail, room)
        # The engine compacts and assembles to what the answer may take: its copies of the fresh tail
        # are in it, and its summaries get MIN_CONTEXT at least, however large the tail.
        budget = max(room, tail + MIN_CONTEXT)
        assembled = self._compact_and_assemble(rt, store_session, budget, focus_topic, force)
        if assembled is None or not assembled.messages:
            return snapshot
        fit = self._fit_addition(
            rt, store_session, system, budget, tail + MIN_CONTEXT, current, pending, assembled, memory
        )
        if fit is None:
            answer = with_fresh_tail(assembled.messages, current, pending, rt.store.config.max_payload_bytes)
        else:
            assembled, answer = fit
        head, answer = place_addition(system, answer, addition_of(assembled, memory))
        if canonical([clean(m) for m in answer]) == canonical([clean(m) for m in body]):
            return snapshot  # the engine could not make it shorter: Hermes sees no progress and stops
        if estimator.count_messages(head + answer) >= estimator.count_messages(messages):
            # The fresh tail is kept verbatim beside the engine's context, and the engine may have
            # summarized its own copy of it (the current user message, raw in its last compaction as its
            # newest message, is an older one now): the summary came in addition to the message, and a
            # compress inside a turn over the trigger answered "done" with the request grown (~9,070 to
            # ~10,730 tokens), a compaction counted, for nothing. Not smaller is no progress.
            return snapshot
        self._record_candidate(rt, answer, store_session, n)
        self.compression_count += 1
        return head + answer

    def _fit_addition(
        self, rt: _Runtime, store_session: str, system: list[dict[str, Any]], budget: int, floor: int,
        current: dict[str, Any] | None, pending: list[dict[str, Any]], assembled: Any, memory: str | None = None,
    ) -> tuple[Any, list[dict[str, Any]]] | None:
        """The assembly again, and its answer, with the engine's system-prompt addition reserved when the
        answer and the addition are over ``budget`` (None: the first assembly stands).

        The addition joins the system prompt or our context block (``place_addition``), which ``budget``
        did not leave room for, and is known only once the engine has assembled: an engine that fills its
        budget put the answer over the aim by its addition. It is asked again for its budget less what the
        answer is over by (not below ``floor``: the fresh tail and the least context), at most
        ``FIT_ATTEMPTS`` times (a smaller assembly can leave out a fresh-tail message the answer then adds
        back); no compaction again.
        """
        est = RoughEstimator()
        fit: tuple[Any, list[dict[str, Any]]] | None = None
        answer = with_fresh_tail(assembled.messages, current, pending, rt.store.config.max_payload_bytes)
        asked = budget
        for _ in range(FIT_ATTEMPTS):
            head, placed = place_addition(system, answer, addition_of(assembled, memory))
            extra = est.count_messages(head + placed) - est.count_messages(system + answer)
            over = est.count_messages(answer) + extra - budget
            smaller = max(asked - over, floor)
            if extra <= 0 or over <= 0 or smaller >= asked:
                break  # the common case: no addition, or room for it; or nothing smaller to ask for
            try:
                again = checked_assembly(rt.engine.assemble(scope=self.scope, session_id=store_session,
                                                             fence=None, token_budget=smaller))
            except Exception:
                log.exception("transcript-store: assembling with the system-prompt addition reserved failed")
                break
            if again is None or not getattr(again, "messages", None):
                break
            cap = rt.store.config.max_payload_bytes
            assembled, answer, asked = again, with_fresh_tail(again.messages, current, pending, cap), smaller
            fit = (assembled, answer)
        return fit

    def _trigger(self) -> int:
        """Hermes' compression trigger in tokens (the window when no threshold is set)."""
        return self.threshold_tokens if self.threshold_tokens > 0 else self.context_length

    def compress_target(self, messages: Sequence[dict[str, Any]], current_tokens: int | None = None) -> int:
        """The tokens a compress answer aims at: COMPRESS_TARGET of the trigger, less what Hermes' request
        carries besides the messages (system prompt, tool schemas).

        That part is what ``current_tokens`` (Hermes' count of the whole request) exceeds the messages by.
        ``request_overhead`` is the lower median of the last ``OVERHEAD_SAMPLES`` such measures, for the
        calls that pass no count (``/compress``): one measure is off either way now and then, and kept
        as the largest ever seen, one was enough for the agent's life. A count of the previous request
        (Hermes' check after a tool round passes ``last_prompt_tokens``) is set against the messages that
        request held: the list before its pending tool round. ``/compress here N`` passes the whole history's count with
        its head only, the held-back tail taken for overhead (a review saw the target fall from ~21,500
        to 411 tokens, every later answer squeezed to the minimum).
        """
        # Read as should_compress reads a count (a numeric text, an infinity, an object): raised here, it
        # left the list uncompressed where should_compress had just said to compress it.
        tokens = as_int(current_tokens)
        if tokens > 0:
            counted = list(messages)
            if tokens == as_int(self.last_prompt_tokens):
                # Hermes' check after a tool round passes the provider's count of the request that asked
                # for the tools: the round (the call and its results) was not in it. Measured against the
                # whole list, a large result cancelled the system prompt and tools out (0 where they were
                # ~4,000 tokens), and where that check is the one that fires (the provider counts more
                # than Hermes' rough estimate, as for CJK text) every measure was such a one.
                counted = settled(counted)
            measured = tokens - RoughEstimator().count_messages(counted)
            seen = [*getattr(self, "_overheads", []), max(0, measured)][-OVERHEAD_SAMPLES:]
            self._overheads = seen
            self.request_overhead = sorted(seen)[(len(seen) - 1) // 2]
        return int(self._trigger() * COMPRESS_TARGET) - self.request_overhead

    def _is_our_answer(self, rt: _Runtime, body: list[dict[str, Any]], hermes_session: str | None = None) -> bool:
        """Whether the host's list is exactly a compress answer (a candidate), with nothing after it."""
        cand = self._match(rt, body, hermes_session)
        return cand is not None and cand.length == len(body)

    def _warn_tail_over(
        self, rt: _Runtime, store_session: str, first: dict[str, Any], tokens: int, room: int
    ) -> None:
        """Say once per user turn that its fresh tail leaves the engine's context too little room."""
        key = digest(store_session, canonical(first))
        with rt.lock:
            if key in rt.warned:
                return
            if len(rt.warned) >= 4096:  # a long-lived gateway: forget old turns rather than grow for ever
                rt.warned.clear()
            rt.warned.add(key)
        log.warning(
            "transcript-store: the current turn's fresh tail (%d tokens) leaves the summaries less than %d "
            "of the %d tokens compress aims at (%d%% of the %d-token trigger, less ~%d for the system "
            "prompt and tools); it is kept whole, so the answer may stay over the trigger until the next "
            "user message (Hermes then compresses once a request and gets its answer back unchanged)",
            tokens, MIN_CONTEXT, room, int(COMPRESS_TARGET * 100), self._trigger(), self.request_overhead,
        )

    def _compact_and_assemble(
        self, rt: _Runtime, store_session: str, budget: int, focus: str | None, force: bool
    ) -> Any:
        """The engine's context after its compaction to ``budget`` tokens (None: assembling failed)."""
        try:
            boot = getattr(rt.engine, "bootstrap", None)
            if callable(boot):  # import what was just stored, so the compaction sees all of it
                boot(scope=self.scope, session_id=store_session, fence=None)
            result = rt.engine.compact(
                scope=self.scope, session_id=store_session, force=force, focus=focus, token_budget=budget
            )
            if not getattr(result, "ok", True):
                log.warning("transcript-store compaction: %s (nothing lost)", getattr(result, "reason", ""))
        except Exception as e:  # a failing summarizer loses nothing: the originals are stored
            log.warning("transcript-store compaction failed: %s (nothing lost)", e)
        try:
            return checked_assembly(
                rt.engine.assemble(scope=self.scope, session_id=store_session, fence=None, token_budget=budget)
            )
        except Exception:
            log.exception("transcript-store: assembling failed; leaving the conversation uncompressed")
            return None

    def on_session_start(self, session_id: str, **kwargs: Any) -> None:
        """Remember the Hermes session id (the store session opens lazily); a compaction boundary that
        moves to a new id (``boundary_reason="compression"``, ``old_session_id``) continues the old id's
        store session under the new one."""
        self.session_id = session_id
        if isinstance(session_id, str) and session_id:
            self._tell_thread()
            with _RUNTIME_LOCK:  # the new id's unfinished turns, too (``end_turn``)
                _LIVE[session_id] = self
                if self._bound_db() is not None:
                    _BOUND[session_id] = self
        old = kwargs.get("old_session_id")
        if kwargs.get("boundary_reason") != "compression" or not isinstance(old, str) or not old:
            return
        if not isinstance(session_id, str) or not session_id or old == session_id:
            return  # in place: the same id, the same store session
        # Without this, the turns after a rotation (below the trigger: no compress, whose adopted
        # candidate would link the new id) ran their recall tools in a new, empty store session.
        try:
            rt = self.runtime()
            lineage = self._store_session(rt, old)
            # Durable, in the candidates' index: a process restarted under the new id (Hermes resumes
            # it from its session database, no boundary told again) continues the lineage too.
            index = rt.store.open_session(self.scope, INDEX_KEY)
            rt.store.append(
                self.scope, index.session_id, kind="metadata",
                payload={"type": ALIAS, "hermes_session": session_id, "store_session": lineage},
                idempotency_key="alias-" + digest(canonical([session_id, lineage])),
            )
            with rt.lock:
                rt.aliases[session_id] = lineage
        except Exception:  # never an error into Hermes: the next compress links the lineage too
            log.exception("transcript-store: could not continue session %s under %s", old, session_id)

    def on_session_end(self, session_id: str, messages: list[dict[str, Any]]) -> None:
        """Store whatever of the conversation is not stored yet (idempotent)."""
        try:
            if messages:
                self.ingest(detached(list(messages)), session_id or None)
        except Exception:
            log.exception("transcript-store: storing the conversation at session end failed")

    def bind_session_state(self, session_db: Any = None, session_id: str = "", **_kwargs: Any) -> None:
        """Follow the agent's session id: hermes-agent calls this at agent start and when ``/new``,
        ``/resume`` or ``/branch`` switch the id without a session-start hook (its session database is
        not used: the store holds the transcript)."""
        # Without it the adapter kept the old id after a switch: the next conversation was aligned with
        # the old one's store session (branched onto its transcript) and the new id's stayed empty.
        if not isinstance(session_id, str) or not session_id:
            return
        self._tell_thread()
        with _RUNTIME_LOCK:
            _LIVE[session_id] = self
            if session_db is not None:
                self._session_db = session_db
                _BOUND[session_id] = self
        previous = self.session_id
        if previous == session_id:
            return
        # Hermes ends the conversation it leaves (on_session_end) on /new, not on /resume or /branch:
        # what it saved of that one since our last call is stored now, from its database.
        if previous:
            self._store_saved(session_db, previous)
        # A /branch is told here with the id it switches from (the CLI) or, in the gateway, which builds
        # a new agent for the branch, with none: the session database's mark says it is one either way
        # (unmarked in the gateway, the branch joined the parent's store session).
        parent = _branch_parent(session_db, session_id)
        if parent is not None:
            if not isinstance(getattr(self, "branches", None), set):
                self.branches = set()
            self.branches.add(session_id)
            if parent != previous and self._unstored(session_id):
                # The gateway left the parent without a hook: store what it saved, once (before the
                # branch has a store session; the gateway binds a new agent at every turn).
                self._store_saved(session_db, parent)
        self.session_id = session_id

    def _bound_db(self) -> Any:
        """Hermes' session database given by ``bind_session_state`` (None: none yet)."""
        return getattr(self, "_session_db", None)

    def _unstored(self, hermes_session: str) -> bool:
        """Whether no store session holds ``hermes_session`` yet (False when the store cannot tell)."""
        try:
            return self._lineage(self.runtime(), hermes_session) is None
        except Exception:
            log.exception("transcript-store: could not look up session %s", hermes_session)
            return False

    def _store_saved(self, session_db: Any, hermes_session: str) -> None:
        """Store what Hermes' session database saved of a conversation (never raises into Hermes)."""
        try:
            saved = saved_conversation(session_db, hermes_session) if session_db is not None else None
            if isinstance(saved, list) and saved:
                self.ingest(detached([m for m in saved if isinstance(m, dict)]), hermes_session)
        except Exception:
            log.exception("transcript-store: storing conversation %s at a session switch failed", hermes_session)

    def on_session_reset(self) -> None:
        """Reset the token counters."""
        self.last_prompt_tokens = 0
        self.last_completion_tokens = 0
        self.last_total_tokens = 0
        self.compression_count = 0

    def update_model(
        self,
        model: str,
        context_length: int,
        base_url: str = "",
        api_key: str = "",
        provider: str = "",
        **kwargs: Any,
    ) -> None:
        """A new model: its context window and threshold (``model_thresholds``: longest substring match)."""
        self.model = str(model or "")
        if as_int(context_length) > 0:
            self.context_length = as_int(context_length)
        pct = resolve_threshold(self.model, getattr(self, "model_thresholds", None), self.threshold_percent)
        self.threshold_tokens = threshold_tokens(self.context_length, pct)

    def get_tool_schemas(self) -> list[dict[str, Any]]:
        """The engine's recall tools (lossless: lcm_grep, lcm_describe, lcm_expand) in Hermes' format."""
        try:
            engine = self.runtime().engine
            fn = getattr(engine, "get_tool_schemas", None)
            raw = fn() if callable(fn) else []
        except Exception:
            log.exception("transcript-store: tool schemas unavailable")
            return []
        return [s.get("function", s) if isinstance(s, dict) else s for s in raw]

    def handle_tool_call(self, name: str, args: dict[str, Any], **kwargs: Any) -> str:
        """Run a recall tool on the current session; errors come back as JSON."""
        try:
            rt = self.runtime()
            fn = getattr(rt.engine, "handle_tool_call", None)
            if not callable(fn):
                return json.dumps({"error": f"Unknown tool: {name}"})
            if isinstance(args, str):
                args = json.loads(args or "{}")
            hermes_session = kwargs.get("session_id") or self.session_id
            live = settled(kwargs.get("messages"))
            if live:
                # hermes-agent passes the conversation in memory ("for live ingestion"): stored first, a
                # recall tool finds this conversation's turns before its first compaction too.
                try:
                    self.ingest(detached(live), hermes_session)
                except Exception:
                    log.exception("transcript-store: storing the live conversation for a tool call failed")
            store_session = self._store_session(rt, hermes_session)
            boot = getattr(rt.engine, "bootstrap", None)
            if callable(boot):
                # The engine imports what is stored and it has not seen (by on_session_end, on_turn_complete,
                # this call): without it, its recall tools searched only what a compress had imported.
                try:
                    boot(scope=self.scope, session_id=store_session, fence=None)
                except Exception:
                    log.exception("transcript-store: the engine's import before a tool call failed")
            return str(fn(name, args, scope=self.scope, session_id=store_session))
        except Exception as e:
            return json.dumps({"error": describe(e)})

    def get_status(self) -> dict[str, Any]:
        """Token counters, threshold and the store in use."""
        # Hermes sets last_prompt_tokens to -1 after a compression ("unknown until the next call"):
        # reported as 0, never a negative usage.
        prompt = max(0, as_int(self.last_prompt_tokens))
        return {
            "engine": self.engine_id,
            "last_prompt_tokens": prompt,
            "threshold_tokens": self.threshold_tokens,
            "context_length": self.context_length,
            "compression_count": self.compression_count,
            "usage_percent": (
                min(100, prompt / self.context_length * 100) if self.context_length else 0
            ),
            "store": self.scope,
        }

    # ------------------------------------------------------------------------------------ newer verbs

    def select_context(
        self,
        request_messages: Any,
        *,
        conversation_messages: Any = None,
        incoming_message: Any = None,
        budget_tokens: int = 0,
        **_kwargs: Any,
    ) -> list[dict[str, Any]] | None:
        """This request's context: None (unchanged) unless it is over budget and an adopted compaction exists."""
        try:
            if not isinstance(request_messages, list) or not request_messages:
                return None
            if not all(isinstance(m, dict) for m in request_messages):
                return None
            rt = self.runtime()
            if isinstance(conversation_messages, list):
                source = with_incoming([m for m in conversation_messages if isinstance(m, dict)], incoming_message)
            else:
                source = request_messages  # the request holds the incoming message itself
            store_session, _n = self.ingest(detached(source), _kwargs.get("session_id"))
            if not budget_tokens:
                return None
            est = RoughEstimator()
            system, rest = split_system(request_messages)
            # Hermes' prefill messages stay where it put them, in every request it sends
            k = prefill_count(request_messages, source) if isinstance(conversation_messages, list) else 0
            head = [*system, *rest[:k]]
            # The budget is the model's whole window (Hermes passes ``context_length``), and the request
            # carries its tool schemas besides these messages: the head goes out with the engine's context,
            # the schemas with both (``beside``). Left out, a request that fit by its messages went out
            # over the window by the schemas, and a selection filled the window less the head only.
            beside = self._beside_messages(est.count_messages(head))
            estimate = est.count_messages(request_messages) - est.count_messages(head) + beside
            if estimate <= budget_tokens:
                return None
            with rt.lock:
                pending = store_session in rt.pending
                adopted = store_session in rt.adopted
            if pending or not adopted:
                return None  # nothing compacted for this session that the host has taken
            key = digest(canonical(request_messages), str(budget_tokens), str(beside))
            with rt.lock:
                cached = rt.selections.get(store_session)
            if cached is not None and cached.key == key:
                return cached.messages()  # the caller's own copy: it may change it as it likes
            room = max(MIN_CONTEXT, int(budget_tokens) - beside)
            assembled = checked_assembly(
                rt.engine.assemble(scope=self.scope, session_id=store_session, fence=None, token_budget=room)
            )
            selected = merge_context(valid_sequence(copy.deepcopy(assembled.messages)))
            body = as_sent(selected, [*system, *rest[k:]], source)
            kept = _Selection(key, copy.deepcopy(head), json.dumps(body) if body else None)
            with rt.lock:
                rt.selections[store_session] = kept
            return kept.messages()
        except RecursionError:
            # A message nested past Python's recursion limit (counting its tool call's arguments, the
            # selection's key): the traceback was thousands of lines, at every request of the session.
            log.warning("transcript-store select_context: a message of the request is nested too deep to "
                        "count (RecursionError); request unchanged")
            return None
        except Exception:
            log.exception("transcript-store select_context failed; request unchanged")
            return None

    def _beside_messages(self, head: int) -> int:
        """What a request carries besides its conversation, in tokens: its ``head`` (system prompt and
        prefill messages, counted) and its tool schemas, which no message holds. Those are Hermes' own
        count (``request_overhead``: what its count of a request exceeded the conversation by, its
        system prompt included, which hermes-agent passes ``compress`` without), else at least the
        engine's own recall tools, which every request carries (``own_tool_tokens``)."""
        return max(head + self.own_tool_tokens(), as_int(getattr(self, "request_overhead", 0)))

    def own_tool_tokens(self) -> int:
        """The engine's recall tools as Hermes sends them with every request (OpenAI function schemas), in
        tokens (counted once per copy)."""
        known = getattr(self, "_own_tools", None)
        if isinstance(known, int):
            return known
        schemas = self.get_tool_schemas()
        tokens = RoughEstimator().count_text(canonical([{"type": "function", "function": s} for s in schemas]))
        if schemas:  # none: the engine may not be open yet; counted again next time
            self._own_tools = tokens
        return tokens

    def on_turn_complete(self, messages: Any, usage: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Store the finished turn's messages once each (read-only on ``messages``)."""
        try:
            if isinstance(usage, dict):
                self.update_from_response(usage)
            if isinstance(messages, list) and messages:
                self.ingest(detached([m for m in messages if isinstance(m, dict)]), kwargs.get("session_id"))
        except Exception:
            log.exception("transcript-store on_turn_complete failed")

    # ------------------------------------------------------------------------------------ inspection

    def stored_messages(self, hermes_session: str | None = None) -> list[dict[str, Any]]:
        """Every message entry of the session's store lineage, in store order."""
        rt = self.runtime()
        store_session = self._store_session(rt, hermes_session)
        out: list[dict[str, Any]] = []
        after = -1
        while True:
            page = rt.store.list_entries(self.scope, store_session, after_seq=after, limit=1000)
            out.extend(e.message for e in page if e.kind == "message" and e.message is not None)
            if len(page) < 1000:
                return out
            after = page[-1].seq


def observe_turn(**kwargs: Any) -> None:
    """hermes-agent's ``post_llm_call`` plugin hook: store the finished turn through the engine copy of the
    agent that ran it (``on_turn_complete``), never raising into Hermes.

    hermes-agent 0.19.0 calls no context-engine method with the conversation after a turn, and its cron
    jobs and ``delegate_task`` subagents end with ``AIAgent.close()``, which calls no ``on_session_end``:
    their turns reached the store only when a compress or a recall tool ran first. The hook fires at the
    end of every turn with a reply (not an interrupted one), in the thread that made the turn's model
    calls, which marked the copy (``update_from_response``, ``should_compress``). A copy bound to
    another session id is not the turn's (Hermes' background review reuses the parent's id on an
    agent of its own: its review prompt is no turn of the conversation) and stores nothing.
    """
    ref = getattr(_TURN, "engine", None)
    _TURN.engine = None
    _TURN.live = None  # the turn finished: ``end_turn`` has nothing of it to store
    engine = ref() if isinstance(ref, weakref.ref) else None
    session_id = kwargs.get("session_id")
    history = kwargs.get("conversation_history")
    if engine is None or not isinstance(session_id, str) or not session_id or session_id != engine.session_id:
        return
    if isinstance(history, list) and history:
        engine.on_turn_complete(history, session_id=session_id)


def note_turn(**kwargs: Any) -> None:
    """hermes-agent's ``pre_llm_call`` plugin hook: keep the live conversation of the turn running on this
    thread (a reference to the list Hermes passes at the turn's start, its user message in it), for
    ``end_turn`` to store should the turn end unfinished; never raising into Hermes.

    An agent without a session database (a cron job, a ``delegate_task`` subagent, a program embedding
    ``AIAgent``) saves nothing ``end_turn`` could read, and Hermes' ``on_session_end`` hook passes no
    messages: a turn interrupted before its reply reached the store only with the agent's next turn,
    and with none (the agent closed after it) never. Not ``pre_api_request``, which would add the tool
    rounds of an interrupted turn: registered, it makes Hermes serialize every request whole for it."""
    session_id = kwargs.get("session_id")
    history = kwargs.get("conversation_history")
    if isinstance(session_id, str) and session_id and isinstance(history, list):
        _TURN.live = (session_id, history)


def end_turn(**kwargs: Any) -> None:
    """hermes-agent's ``on_session_end`` plugin hook, which ends every ``run_conversation``: after a turn
    interrupted or left unfinished, store what Hermes saved of the conversation in its session database,
    through the engine copy bound to its session id; never raising into Hermes.

    Such a turn fires no ``post_llm_call`` (``observe_turn``): its user message reached the store only with
    the conversation's next turn, compaction or session end, and for a cron job or a subagent (closed
    after its one run, or interrupted with its parent) never. Hermes saves the turn (its user message at
    the turn's start, the rest at its end) before it fires the hook, in every agent that has a session
    database; the read is the saved conversation, so the hook of an agent that saves nothing (Hermes'
    background review, which runs under its parent's id) stores nothing of its own. An agent without a
    session database has the live list its turn passed ``note_turn`` in this thread stored instead,
    through its engine copy (the one this thread's model calls marked, else the one last told a session
    in this thread, else the one following the id; none when that copy follows another id: another
    agent's turn). A finished turn was stored by ``observe_turn`` and reads nothing here.
    """
    live = getattr(_TURN, "live", None)
    ref = getattr(_TURN, "engine", None)
    _TURN.live = _TURN.engine = None  # the turn ended: nothing of it is kept for a later one
    if not kwargs.get("interrupted") and kwargs.get("completed", True):
        return
    session_id = kwargs.get("session_id")
    if not isinstance(session_id, str) or not session_id:
        return
    with _RUNTIME_LOCK:
        engine = _BOUND.get(session_id)
    db = engine._bound_db() if engine is not None else None
    if engine is not None and db is not None and engine.session_id == session_id:
        engine._store_saved(db, session_id)
        return
    # No session database: the live conversation this thread's turn passed its hooks (``note_turn``).
    if not isinstance(live, tuple) or live[0] != session_id:
        return
    marked = ref() if isinstance(ref, weakref.ref) else None
    if marked is None:
        # No model call of this turn answered (it failed or was interrupted before one did): the copy
        # last told a session in this thread is its agent's. Following another id, the turn is another
        # agent's: the background review, built in its own thread under an id of its own, runs under its
        # parent's id, and its harness prompt went into the parent's store session.
        told = getattr(_TURN, "told", None)
        marked = told() if isinstance(told, weakref.ref) else None
    with _RUNTIME_LOCK:
        engine = marked if marked is not None else _LIVE.get(session_id)
    # A copy following another id made this thread's model calls: another agent's turn (Hermes'
    # background review runs under its parent's id, its engine copy under an id of its own).
    if engine is None or engine.session_id != session_id or engine._bound_db() is not None:
        return
    engine.on_turn_complete(live[1], session_id=session_id)


class _StandInContextEngine:
    """Used only when ``agent.context_engine`` is not importable (unit tests without hermes-agent)."""


_CLASSES: dict[bool, type] = {}


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600, an existing file's mode too): the
    plugin's settings hold the database URL, password included, and the engine's configuration."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def settings_json(settings: Mapping[str, Any]) -> str:
    """The text of the plugin's settings.json; InvalidInput naming the first value JSON cannot hold."""
    try:
        return json.dumps(settings, indent=2) + "\n"
    except (TypeError, ValueError):
        pass
    # A TOML settings file holds dates and times, which JSON does not: said before anything is written
    # (a plugin whose settings.json is missing runs on the default engine and database inside Hermes).
    from .errors import InvalidInput

    for name, value in settings.items():
        inner = value.items() if isinstance(value, Mapping) else [(None, value)]
        for key, item in inner:
            try:
                json.dumps(item)
            except (TypeError, ValueError):
                where = name if key is None else f"{name}.{key}"
                what = type(item).__name__
                raise InvalidInput(f"{where}: a {what} value, which settings.json (JSON) cannot hold") from None
    raise InvalidInput("the settings cannot be written as JSON")


def engine_class(*, allow_stand_in: bool = False) -> type:
    """The adapter class subclassing Hermes' ``ContextEngine`` (a stand-in base only when allowed)."""
    with _RUNTIME_LOCK:
        try:
            from agent.context_engine import ContextEngine as base  # type: ignore[import-not-found]

            real = True
        except ImportError:
            if not allow_stand_in:
                raise
            base, real = _StandInContextEngine, False
        if real not in _CLASSES:
            cls_name = "TranscriptStoreContextEngine" if real else "TranscriptStoreContextEngineStandIn"
            cls = type(
                cls_name,
                (TranscriptStoreEngineMixin, base),
                {"__module__": __name__, "__doc__": "A transcript-store engine as a Hermes ContextEngine."},
            )
            # The host identity-checks hooks against the ABC; ours are the mixin's, so they run.
            _CLASSES[real] = cls
            globals()[cls_name] = cls  # importable by name: pickling works
        return _CLASSES[real]


def create_engine(*, allow_stand_in: bool = False, **kwargs: Any) -> Any:
    """An adapter instance (see ``TranscriptStoreEngineMixin.__init__`` for the arguments)."""
    return engine_class(allow_stand_in=allow_stand_in)(**kwargs)


# ---------------------------------------------------------------------------------------------- install


def config_snippet(engine: str = "lossless", context_length: int = 128000) -> dict[str, Any]:
    """The config.yaml keys that enable the plugin and select the engine."""
    return {
        "plugins": {"enabled": [PLUGIN_NAME]},
        "context": {"engine": engine},
        "model": {"context_length": max(MIN_CONTEXT_LENGTH, context_length)},
    }


def install_plugin(home: str | Path, *, engine: str = "lossless", db_url: str | None = None,
                   merge_config: bool = False, threshold: float | None = None,
                   scope: str | None = None, plugin_dirs: Sequence[str] = (),
                   engine_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write the plugin into ``home``/plugins/<dir>/ (and optionally merge config.yaml); what was done.

    ``engine_config``: the engine's settings (``[engine.config.<engine>]`` of transcript-store's own
    settings file), carried into settings.json so that the engine runs with them inside Hermes too."""
    import yaml

    home = Path(home).expanduser()
    if not (TEMPLATE_DIR / "plugin.yaml").is_file():
        from .errors import InvalidInput

        raise InvalidInput(f"no Hermes plugin template at {TEMPLATE_DIR} (this installation lacks the bundled plugin)")
    target = home / "plugins" / PLUGIN_DIR
    manifest = (TEMPLATE_DIR / "plugin.yaml").read_text(encoding="utf-8")
    init = (TEMPLATE_DIR / "__init__.py").read_text(encoding="utf-8")
    if db_url is None:
        db_url = f"sqlite:///{home.resolve() / 'transcript-store.db'}"
    settings: dict[str, Any] = {"engine": engine, "db_url": db_url}
    if scope is not None:
        settings["scope"] = scope
    if threshold is not None:
        settings["threshold_percent"] = threshold
    if plugin_dirs:  # absolute: Hermes may start anywhere
        settings["plugin_dirs"] = [str(Path(d).expanduser().resolve()) for d in plugin_dirs]
    if engine_config:
        settings["engine_config"] = dict(engine_config)
    text = settings_json(settings)  # refused before the plugin's folder and files are written
    target.mkdir(parents=True, exist_ok=True)
    (target / "plugin.yaml").write_text(manifest, encoding="utf-8")
    (target / "__init__.py").write_text(init, encoding="utf-8")
    _write_private(target / "settings.json", text)
    snippet = config_snippet(engine)
    config_path = home / "config.yaml"
    if merge_config:
        loaded = yaml.safe_load(config_path.read_text(encoding="utf-8")) if config_path.exists() else None
        data: dict[str, Any] = loaded if isinstance(loaded, dict) else {}
        plugins: dict[str, Any] = data["plugins"] if isinstance(data.get("plugins"), dict) else {}
        enabled: list[Any] = plugins["enabled"] if isinstance(plugins.get("enabled"), list) else []
        if PLUGIN_NAME not in enabled:
            enabled.append(PLUGIN_NAME)
        plugins["enabled"] = enabled
        data["plugins"] = plugins
        context: dict[str, Any] = data["context"] if isinstance(data.get("context"), dict) else {}
        context["engine"] = engine
        data["context"] = context
        given_model = data.get("model")
        if isinstance(given_model, str) and given_model.strip():
            # Hermes' short form, the model's name alone, which it reads as ``{"default": name}``: replaced by
            # the context length alone, the model chosen was lost and Hermes ran on its default one.
            given_model = {"default": given_model}
        model: dict[str, Any] = given_model if isinstance(given_model, dict) else {}
        # A context length already set is kept (raised to Hermes' minimum); none yet: the snippet's.
        given = int(model.get("context_length") or 0)
        model["context_length"] = max(MIN_CONTEXT_LENGTH, given) if given else snippet["model"]["context_length"]
        data["model"] = model
        config_path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return {"plugin_dir": str(target), "config": snippet, "config_path": str(config_path), "merged": merge_config}
