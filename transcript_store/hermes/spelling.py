"""A message as hermes-agent's session database hands it back: the same message in its saved spelling.

hermes-agent 0.19.0 does not save every message as its live list holds it. It saves a message with content
parts (an image the user sent, a multimodal tool result) as their text (``[screenshot]`` for an image), and
reloads a user or assistant text through ``sanitize_context`` (a ``<memory-context>`` block or tag taken
out, the text stripped), keeping the text it sent in the row's ``api_content`` when that differs (the live
text; for the current turn's user message, its text with the memory or plugin context Hermes added to
it, the live message carrying the same ``api_content``). Stored as read, the saved spelling replaced the
live message in the visible transcript: the live one left the active branch, and every message after it
was written again after it."""

from __future__ import annotations

import bisect
import contextlib
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from .context import is_context_message
from .messages import clean, fingerprint

#: the content part types hermes-agent saves as ``[screenshot]`` (its ``_flush_messages_to_session_db``)
IMAGE_PARTS = frozenset({"image", "image_url", "input_image"})
_SANITIZERS: list[Callable[[str], str] | None] = []


def _sanitizer() -> Callable[[str], str] | None:
    """hermes-agent's ``sanitize_context`` (looked up once; None: not importable, no Hermes here)."""
    if not _SANITIZERS:
        found = None
        with contextlib.suppress(Exception):
            found = importlib.import_module("agent.memory_manager").sanitize_context
        _SANITIZERS.append(found if callable(found) else None)
    return _SANITIZERS[0]


def as_saved(message: dict[str, Any]) -> dict[str, Any] | None:
    """A cleaned live message as hermes-agent's session database hands it back (None: as it is): content
    parts as their text, a user or assistant text through ``sanitize_context`` and stripped."""
    content = message.get("content")
    text: Any = content
    if isinstance(content, list):
        parts = []
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(kind, str) and kind in IMAGE_PARTS:  # a list for a type: no TypeError
                parts.append("[screenshot]")
        text = "\n".join(parts)  # none: no content, which ``clean`` makes an empty text
    sanitize = _sanitizer()
    if message.get("role") in ("user", "assistant") and isinstance(text, str) and sanitize is not None:
        with contextlib.suppress(Exception):
            text = str(sanitize(text)).strip()
    return None if text == content else {**message, "content": text}


def restored(saved: dict[str, Any]) -> dict[str, Any] | None:
    """A saved user or assistant message with the text Hermes sent in its place (``api_content``: the live
    text when Hermes' reload would change it, or when the database saved a text other than the one sent);
    None: it holds none."""
    sent = saved.get("api_content")
    if saved.get("role") not in ("user", "assistant") or not isinstance(sent, str) or not sent:
        return None
    if sent == saved.get("content"):
        return None
    return {**{k: v for k, v in saved.items() if k != "api_content"}, "content": sent}


def noted(live: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Whether the user message ``saved`` is the user message ``live`` without the note Hermes put before
    its text for the model alone (hermes-agent 0.19.0's ``persist_user_message``: the gateway's timestamp
    and recovery notes, the CLI's voice, ``/model`` and skills notes, each ``[...]`` and whitespace before
    the text). Hermes puts the clean text into its own list at the turn's end, without the text sent beside
    it: a conversation stored earlier in the turn (a recall tool, a compaction) holds the text sent."""
    sent, text = live.get("content"), saved.get("content")
    if live.get("role") != "user" or saved.get("role") != "user" or not isinstance(sent, str):
        return False
    if not isinstance(text, str) or not text.strip() or len(sent) <= len(text) or not sent.endswith(text):
        return False
    note = sent[: -len(text)]
    if not (note[-1].isspace() and note.startswith("[") and note.rstrip().endswith("]")):
        return False
    return fingerprint([{**live, "content": text}]) == fingerprint([saved])


def spelled(live: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Whether ``saved`` (a cleaned message of Hermes' database) is the cleaned live message ``live`` in
    Hermes' saved spelling (or as it is)."""
    have = fingerprint([saved])
    if fingerprint([live]) == have:
        return True
    form = as_saved(live)
    if form is not None and fingerprint([form]) == have:
        return True
    back = restored(saved)
    return (back is not None and fingerprint([back]) == fingerprint([live])) or noted(live, saved)


def _conversation(message: Any) -> bool:
    """A conversation message (no system prompt, none of ours)."""
    return isinstance(message, dict) and message.get("role") != "system" and not is_context_message(message)


def as_shown(saved: list[Any], shown: Sequence[Any]) -> list[Any]:
    """``saved`` (what Hermes' database saved of a conversation) with each message that is a message of
    ``shown`` (the stored transcript, or a list Hermes held) in its saved spelling (``spelled``) replaced
    by that message, found in order: where ``shown`` goes on past what the saved list has matched so far.

    A message of ``shown`` the saved list holds as it is anchors the walk (the first copy after where it
    stands); one it does not hold is compared, as spelled, with the next message of ``shown`` only, and
    only where the walk stands anchored: right after a message found, or at the start of both lists.
    After a message found nowhere, or a message of ours (a compacted view's summary: the saved list goes
    on from some later place of ``shown``), the next message of ``shown`` is not its place: an image the
    user sent again with the same words took the first one's place (and so the answer to it).
    Such a message stays as saved; the store's alignment compares it at its place (``_write_in``)."""
    ref = [clean(m) for m in shown if _conversation(m)]
    if not ref:
        return saved
    at: dict[str, list[int]] = {}
    for n, m in enumerate(ref):
        at.setdefault(fingerprint([m]), []).append(n)
    out = list(saved)
    j, anchored = 0, True
    for i, m in enumerate(saved):
        if not _conversation(m):
            if isinstance(m, dict) and is_context_message(m):
                anchored = False
            continue
        own = clean(m)
        spots = at.get(fingerprint([own]), [])
        k = bisect.bisect_left(spots, j)
        if k < len(spots):
            j, anchored = spots[k] + 1, True
        elif anchored and j < len(ref) and spelled(ref[j], own):
            out[i], j = ref[j], j + 1
        else:
            anchored = False
    return out


def saved_keys(rows: Sequence[Any]) -> tuple[list[str], dict[str, str]]:
    """(the fingerprints of the conversation messages of Hermes' database's ``rows``, in order; the
    fingerprint of each one's ``restored`` form -> its own)."""
    own: list[str] = []
    back: dict[str, str] = {}
    for m in rows:
        if not _conversation(m):
            continue
        row = clean(m)
        own.append(fingerprint([row]))
        form = restored(row)
        if form is not None:
            back.setdefault(fingerprint([form]), own[-1])
    return own, back


def live_keys(message: dict[str, Any], back: dict[str, str]) -> list[str]:
    """The fingerprints a row of Hermes' database holding the live message ``message`` (cleaned) may have:
    its own, its saved spelling's, the one of a row whose sent text is its text (``saved_keys``)."""
    own = fingerprint([message])
    keys = [own]
    form = as_saved(message)
    if form is not None:
        keys.append(fingerprint([form]))
    if own in back:
        keys.append(back[own])
    return keys
