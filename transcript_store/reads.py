"""Visible-delta reads: a page of visible messages after a cursor, or a reset, or missing."""

from __future__ import annotations

from .core import Core, entry_from_row
from .cursors import CursorState, decode_cursor, start_cursor
from .errors import ReadFenceError
from .fences import check_fence
from .models import Anchor, DeltaMissing, DeltaPage, DeltaReset, DeltaResult, Entry

MAX_MESSAGES = 10_000
MAX_BYTES = 64 * 1024 * 1024


def check_limits(max_messages: int, max_bytes: int) -> None:
    """Out-of-range limits are a ValueError, not a clamp."""
    for name, value, top in (("max_messages", max_messages, MAX_MESSAGES), ("max_bytes", max_bytes, MAX_BYTES)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise ValueError(f"{name} must be an integer in 1..{top}, got {value!r}")


def read_visible_delta(
    core: Core,
    scope: str,
    session_id: str,
    cursor: str | None,
    max_messages: int,
    max_bytes: int,
    fence: Anchor | None,
    *,
    fence_written: bool = False,
) -> DeltaResult:
    """One page of visible messages after ``cursor`` (see TranscriptStore.read_visible_delta).

    ``fence_written``: the caller appended the fence's entry in this very transaction and holds the
    session's lock (an admission's own pre-turn read), so the fence needs no check of its own.
    """
    decoded = None if cursor is None else decode_cursor(cursor)
    # The session and the seq at the cursor's position come back in one statement: on PostgreSQL every
    # statement is a round trip, and a page read is only a handful of them (bench/README.md).
    probe = decoded.last_position if decoded is not None else -1
    sess, at_position = core.session_row_and_path_seq(scope, session_id, probe)
    if sess is None:
        if fence is not None and (fence.scope != scope or fence.session_id != session_id):
            raise ReadFenceError("scope", "the fence belongs to another scope or session")
        return DeltaMissing()
    if fence is not None and not fence_written:
        check_fence(core, scope, session_id, fence, sess)
    incarnation = sess.created_us

    def fresh() -> str:  # the reset cursor, encoded only when a reset is returned
        return start_cursor(scope, session_id, sess.generation, incarnation)

    if cursor is None:
        state = CursorState(scope, session_id, sess.generation, -1, -1, incarnation)
    else:
        if decoded is None:
            return DeltaReset(cursor=fresh(), reason="invalid_cursor")
        if (
            decoded.scope != scope
            or decoded.session_id != session_id
            or (decoded.incarnation is not None and decoded.incarnation != incarnation)
        ):
            # Another scope's or session's cursor, or one of an earlier session under this id (a
            # format-1 cursor does not say which incarnation it was issued for).
            return DeltaReset(cursor=fresh(), reason="scope_mismatch")
        if decoded.generation != sess.generation:
            return DeltaReset(cursor=fresh(), reason="generation_mismatch")
        state = decoded
    if state.last_position >= 0 and at_position != state.last_seq:
        row = core.entry_by_seq(scope, session_id, state.last_seq)
        on_path = row is not None and core.on_active_path(scope, session_id, row)
        return DeltaReset(cursor=fresh(), reason="anchor_moved" if on_path else "anchor_missing")
    before = None
    if fence is not None:
        assert fence.position is not None
        if state.last_position >= fence.position:
            raise ReadFenceError("crossed", "the cursor is already past the admitted entry")
        before = fence.position
    # One row more than the page tells has_more without a second query.
    rows = core.visible_rows(scope, session_id, state.last_position, before, max_messages + 1)
    page: list[Entry] = []
    used = 0
    for row in rows[:max_messages]:
        if used + row.size_bytes > max_bytes:
            break
        page.append(entry_from_row(row, active=True))
        used += row.size_bytes
    if not page and rows:
        return DeltaPage(
            entries=[], cursor=cursor or state.encode(), has_more=True, serialized_bytes=0,
            required_bytes=rows[0].size_bytes,
        )
    if page:
        last = page[-1]
        assert last.position is not None
        state = CursorState(scope, session_id, sess.generation, last.seq, last.position, incarnation)
    return DeltaPage(
        entries=page, cursor=state.encode(), has_more=len(rows) > len(page), serialized_bytes=used
    )
