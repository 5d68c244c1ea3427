"""Messages the store refuses as they are (their shape, the cap) in a form it takes, and alignment."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from ..core import NewEntry, new_id
from ..errors import InvalidInput
from ..models import compact_json, validate_message
from ..store import AppendItem, TranscriptStore
from .messages import _json_text, fingerprint

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
