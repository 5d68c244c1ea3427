"""Importing visible transcript messages into the engine's tables, through the transcript cursor API.

Everything here runs inside the caller's write transaction, so the imported rows, the context items
and the view (cursor, counters) always agree. The entry id is the idempotency of an import: an entry
already ingested is never inserted twice. A cursor reset (a branch or a rewrite moved the active
path) keeps the context items that are still true and forgets the rest (``reset``); the import then
goes on from where the paths diverge, reusing the messages still stored.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import insert

from transcript_store.core import Core, now_us
from transcript_store.model import message_text
from transcript_store.models import (
    Anchor,
    DeltaMissing,
    DeltaPage,
    DeltaReset,
    Entry,
    functions_called,
    out_of_context,
)
from transcript_store.reads import read_visible_delta
from transcript_store.tokens import TokenEstimator

from .config import LosslessConfig
from .reset import keep_true_prefix
from .tables import View, context_items, messages, rows_of


@dataclass
class ImportResult:
    """What one import call did: messages made visible, whether more pages wait, whether it rebuilt."""

    imported: int = 0
    more: bool = False
    rebuilt: bool = False
    missing: bool = False
    #: the view as this import saved it (None: unchanged), which a retry after an uncertain COMMIT finds
    saved: dict[str, Any] | None = None
    #: (ordinal, created_us) of the first message row this import stored (None: it stored none): a retry
    #: after an uncertain COMMIT finds that row if, and only if, this import landed (``import_landed``)
    inserted: tuple[int, int] | None = None


def column_text(text: str) -> str:
    """Text for one of the engine's own text columns: PostgreSQL's text cannot hold U+0000, which a message
    may (a binary tool output), so it is shown as U+FFFD there. The transcript keeps the message exactly
    (its stored JSON escapes the character), and so does the engine's copy of it (``message``, JSON too)."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def searchable_text(message: dict[str, Any]) -> str:
    """The text search sees for a message: its content plus the tool calls it made (names and arguments)."""
    parts = [message_text(message)]
    parts += [f"{name}({arguments})" for name, arguments in functions_called(message)]
    if isinstance(message.get("name"), str):
        parts.append(message["name"])
    return column_text("\n".join(p for p in parts if p))


def import_pages(
    core: Core,
    scope: str,
    session_id: str,
    *,
    config: LosslessConfig,
    estimator: TokenEstimator,
    fence: Anchor | None,
    until: int | None = None,
    max_pages: int | None = None,
) -> ImportResult:
    """Import visible messages after the view's cursor: before ``fence``, through position ``until``.

    Pages honour ``required_bytes`` (a message larger than a page enlarges the next page) and resets
    (``reset.keep_true_prefix``). ``max_pages`` bounds the work of one transaction; ``more`` says whether to call again.
    """
    result = ImportResult()
    sess = core.session_row(scope, session_id, lock=True)
    if sess is None:
        result.missing = True
        return result
    view = View.load(core, scope, session_id)
    loaded = asdict(view)
    max_bytes, pages, ts = config.page_bytes, 0, now_us()
    while True:
        limit = config.page_messages
        # The view's position counts only in the session's generation (or from the very start); with
        # any other cursor the read below answers a reset, whatever the limit.
        checking = False
        if until is not None and (view.cursor is None or view.generation == sess.generation):
            # A view already at ``until`` holds the turn only if its path is still the active one: a
            # branch moves the path without rotating the generation. A one-message read from its cursor
            # tells (a reset when the path moved). Rare: a commit normally follows an assemble that
            # stopped before the turn, and reads anyway; the common path gains no statement.
            checking = view.position >= until
            limit = max(1, min(limit, until - view.position))
        page = read_visible_delta(core, scope, session_id, view.cursor, limit, max_bytes, fence)
        if isinstance(page, DeltaMissing):  # pragma: no cover - the session row is locked above
            result.missing = True
            return result
        if isinstance(page, DeltaReset):
            keep_true_prefix(core, scope, session_id, view, sess, page.cursor)
            result.rebuilt = True
            continue
        assert isinstance(page, DeltaPage)
        if checking:
            break  # the cursor holds: the view's path runs through ``until``, the turn included
        if page.required_bytes is not None:
            max_bytes = page.required_bytes  # one message is larger than a page: enlarge this page
            continue
        max_bytes = config.page_bytes
        result.imported += ingest_entries(core, scope, session_id, view, page.entries, estimator, at=ts)
        view.cursor, view.generation = page.cursor, sess.generation
        if page.entries:
            view.position = int(page.entries[-1].position or 0)
        pages += 1
        if not page.has_more:
            break
        if max_pages is not None and pages >= max_pages:
            result.more = True
            break
    if asdict(view) != loaded:
        view.save(core, scope, session_id)
        result.saved = asdict(view)
    if view.next_ordinal > loaded["next_ordinal"]:
        result.inserted = (loaded["next_ordinal"], ts)
    return result


def import_landed(core: Core, scope: str, session_id: str, earlier: ImportResult) -> bool:
    """Whether an earlier attempt's import (``import_pages``), whose COMMIT was uncertain, landed.

    Told by the first message row it stored (its ordinal and time), never by the view alone: another
    importer that imported the same messages since leaves the view as that attempt would have, and one
    that imported more moves it past. An import that stored no message row (it only listed again
    messages stored before, or only moved its cursor) is told by the view being as it saved it: another
    importer doing the same between the attempts is taken for the earlier attempt then."""
    if earlier.saved is None:
        return False
    if earlier.inserted is not None:
        ordinal, at = earlier.inserted
        m = messages.c
        rows = rows_of(core, scope, session_id, m.ordinal, [ordinal], (m.created_us,))
        return bool(rows) and rows[0].created_us == at
    return asdict(View.load(core, scope, session_id)) == earlier.saved


def reset_pending(core: Core, scope: str, session_id: str) -> bool:
    """True when the active path moved under the view (a branch or rewrite since the last import): a
    one-message read from the view's cursor answers a reset. The recall tools ask before they answer,
    so that what left the active path is never found between the move and the next import."""
    return _pending_reset(core, scope, session_id, View.load(core, scope, session_id)) is not None


def apply_reset(core: Core, scope: str, session_id: str) -> None:
    """Apply a pending reset (``reset.keep_true_prefix``) without importing anything: a plain import
    here could cross a running turn's fence. In the caller's write transaction."""
    sess = core.session_row(scope, session_id, lock=True)
    if sess is None:
        return
    view = View.load(core, scope, session_id)
    reset = _pending_reset(core, scope, session_id, view)
    if reset is not None:
        keep_true_prefix(core, scope, session_id, view, sess, reset.cursor)
        view.save(core, scope, session_id)


def _pending_reset(core: Core, scope: str, session_id: str, view: View) -> DeltaReset | None:
    """The reset a one-message read from the view's cursor answers, or None (no cursor yet, or a page)."""
    if view.cursor is None:
        return None
    page = read_visible_delta(core, scope, session_id, view.cursor, 1, 1 << 30, None)
    return page if isinstance(page, DeltaReset) else None


def ingest_entries(
    core: Core,
    scope: str,
    session_id: str,
    view: View,
    entries: Sequence[Entry],
    estimator: TokenEstimator,
    *,
    at: int | None = None,
) -> int:
    """Store the entries' messages (once per entry id) and append each to the context list; returns how many.

    ``at``: the ``created_us`` of the message rows it stores (``now_us()`` when not given)."""
    if not entries:
        return 0
    known = _known(core, scope, session_id, [e.entry_id for e in entries])
    new_rows: list[dict[str, Any]] = []
    new_items: list[dict[str, Any]] = []
    ts = now_us() if at is None else at
    for entry in entries:
        message = entry.message or {}
        if entry.entry_id in known:
            ordinal, tokens, visible = known[entry.entry_id]
            if visible:
                continue  # already in the context list: nothing to do
        else:
            # A message the host keeps out of the model's context is stored and listed (the list stays
            # whole) but costs nothing (it took the budget of the messages shown), and is marked hidden:
            # the recall tools never find or open it (a tool's answer is model context too).
            hidden = out_of_context(message)
            tokens = 0 if hidden else int(estimator.count_messages([message]))
            ordinal = view.next_ordinal
            view.next_ordinal += 1
            new_rows.append(
                {
                    "scope": scope,
                    "session_id": session_id,
                    "ordinal": ordinal,
                    "entry_id": entry.entry_id,
                    "generation": entry.generation,
                    "position": int(entry.position or 0),
                    "role": str(message.get("role", "")),
                    "content": searchable_text(message),
                    "message": json.dumps(message, ensure_ascii=False, separators=(",", ":")),
                    "tokens": tokens,
                    "created_us": ts,
                    "hidden": hidden,
                }
            )
        new_items.append(
            {"scope": scope, "session_id": session_id, "item_ordinal": view.next_item, "message_ordinal": ordinal}
        )
        view.next_item += 1
        view.tokens += tokens
    if new_rows:
        core.conn.execute(insert(messages), new_rows)
    if new_items:
        core.conn.execute(insert(context_items), new_items)
    return len(new_items)


def _known(core: Core, scope: str, session_id: str, entry_ids: list[str]) -> dict[str, tuple[int, int, bool]]:
    """entry id -> (ordinal, tokens, in the context list) for the entries already ingested."""
    m, ci = messages.c, context_items.c
    rows = rows_of(core, scope, session_id, m.entry_id, entry_ids, (m.entry_id, m.ordinal, m.tokens))
    if not rows:
        return {}  # the common case: a page of new messages costs one lookup per entry
    listed = rows_of(core, scope, session_id, ci.message_ordinal, [r.ordinal for r in rows], (ci.message_ordinal,))
    in_context = {r.message_ordinal for r in listed}
    return {r.entry_id: (r.ordinal, r.tokens, r.ordinal in in_context) for r in rows}
