"""Visible-delta reads: a page of visible messages after a cursor, or a reset, or missing (unfenced only)."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from .core import Core, entry_from_row, foreign_incarnation
from .cursors import CursorState, decode_cursor, start_cursor
from .errors import InvalidInput, ReadFenceError
from .fences import check_fence
from .models import Anchor, DeltaMissing, DeltaPage, DeltaReset, DeltaResult, Entry

MAX_MESSAGES = 10_000
MAX_BYTES = 64 * 1024 * 1024


def check_limits(max_messages: int, max_bytes: int) -> None:
    """Out-of-range limits are refused (InvalidInput), not clamped."""
    for name, value, top in (("max_messages", max_messages, MAX_MESSAGES), ("max_bytes", max_bytes, MAX_BYTES)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise InvalidInput(f"{name} must be an integer in 1..{top}, got {value!r}")


class NeedsSnapshot(Exception):
    """A statement-only delta read found it needs more than its one statement: read in a snapshot."""


def read_visible_delta(
    core: Core,
    scope: str,
    session_id: str,
    cursor: str | None,
    max_messages: int,
    max_bytes: int,
    fence: Anchor | None,
    *,
    snapshot: bool = True,
) -> DeltaResult:
    """One page of visible messages after ``cursor`` (see TranscriptStore.read_visible_delta).

    A fence this very transaction appended, holding the session's lock (an admission reading its own
    pre-turn transcript: ``Core.appended_here``), needs no check of its own; any other is checked.
    ``snapshot=False``: ``core`` runs outside a transaction, where only the one statement of the page
    is consistent; whatever would need another statement (checking a fence, telling why a cursor's
    anchor moved) raises NeedsSnapshot instead, and the caller reads again in a snapshot.
    """
    decoded = None if cursor is None else decode_cursor(cursor)
    # The session, the seq at the cursor's position and the page after it come back in ONE statement
    # (core.delta_page_rows; for a session that has branched, the first read of it in a process takes
    # a second, self-contained one): on PostgreSQL every statement is a round trip (bench/README.md). The page
    # is read from the position the cursor claims; if the cursor turns out not to hold, it is dropped.
    claimed = decoded is not None and decoded.scope == scope and decoded.session_id == session_id
    after = decoded.last_position if claimed and decoded is not None else -1
    # The seq the cursor claims for that position (the linear page reads after it; checked below).
    after_seq = decoded.last_seq if claimed and decoded is not None and after >= 0 else -1
    fence_written = (
        fence is not None and fence.scope == scope and fence.session_id == session_id and core.appended_here(fence)
    )
    if fence is not None and not fence_written and not snapshot:
        raise NeedsSnapshot
    before = fence.position if fence is not None else None  # a fence without one fails its check below
    before_seq = fence.seq if fence is not None else None
    head, found = core.delta_page_rows(
        scope, session_id, after, before, max_messages + 1, max_bytes, after_seq, before_seq
    )
    if head is None:
        if fence is not None:
            # A fenced read is a read for a turn: its session gone, the admitted entry is gone with it,
            # and the read raises as ``read_visible`` does (check_fence). A DeltaMissing here read as
            # "rebuild from scratch" to an engine, which then assembled the turn from nothing (the
            # legacy engine) or read again for ever (the README's example engine).
            if fence.scope != scope or fence.session_id != session_id:
                raise ReadFenceError("scope", "the fence belongs to another scope or session")
            raise ReadFenceError("missing", "the session is gone")
        return DeltaMissing()
    sess = _SessionHead(head.s_generation, head.s_session_key, head.s_incarnation, head.s_created_us)
    if fence is not None and not fence_written:
        check_fence(core, scope, session_id, fence, sess)
    incarnation = sess.incarnation

    def fresh() -> str:  # the reset cursor, encoded only when a reset is returned
        return start_cursor(scope, session_id, sess.generation, incarnation)

    if cursor is None:
        state = CursorState(scope, session_id, sess.generation, -1, -1, incarnation)
    else:
        if decoded is None:
            return DeltaReset(cursor=fresh(), reason="invalid_cursor")
        # (A format-1 cursor does not say which incarnation it was issued for: see foreign_incarnation.)
        if not claimed or foreign_incarnation(decoded.incarnation, incarnation, sess.created_us):
            # Another scope's or session's cursor, or one of an earlier session under this id.
            return DeltaReset(cursor=fresh(), reason="scope_mismatch")
        if decoded.generation != sess.generation:
            return DeltaReset(cursor=fresh(), reason="generation_mismatch")
        # A format-1 cursor held here is of this very session (checked above): every cursor handed
        # back from here on, an empty page's too, is format 2 and says so (cursors.py).
        state = decoded if decoded.incarnation is not None else replace(decoded, incarnation=incarnation)
    if state.last_position >= 0 and head.s_at_seq != state.last_seq:
        if not snapshot:
            raise NeedsSnapshot
        row = core.entry_by_seq(scope, session_id, state.last_seq)
        on_path = row is not None and core.on_active_path(scope, session_id, row)
        return DeltaReset(cursor=fresh(), reason="anchor_moved" if on_path else "anchor_missing")
    if fence is not None:
        assert fence.position is not None
        if state.last_position >= fence.position:
            raise ReadFenceError("crossed", "the cursor is already past the admitted entry")
    # One row more than the page tells has_more without a second query. The statement already stopped
    # at the first row over max_bytes and left its payload out (core._bytes_bounded): the cut below is
    # the same sum, and that row is never made an Entry.
    page: list[Entry] = []
    used = 0
    for row in found[:max_messages]:
        if used + row.size_bytes > max_bytes:
            break
        page.append(entry_from_row(row, active=True))
        used += row.size_bytes
    if not page and found:
        return DeltaPage(
            entries=[], cursor=state.encode(), has_more=True, serialized_bytes=0, required_bytes=found[0].size_bytes
        )
    if page:
        last = page[-1]
        assert last.position is not None
        state = CursorState(scope, session_id, sess.generation, last.seq, last.position, incarnation)
    return DeltaPage(
        entries=page, cursor=state.encode(), has_more=len(found) > len(page), serialized_bytes=used
    )


class _SessionHead(NamedTuple):
    """What a delta read needs of the session's row (check_fence reads the same attributes)."""

    generation: int
    session_key: str | None
    incarnation: int
    created_us: int
