"""The current-turn fence and closed-range reads of finished turns.

A fence is the admission anchor of the turn being run. Every read made for that turn sees exactly the
visible prefix before the admitted entry, and re-validates the anchor first: if the admitted entry
is no longer the same visible user message, the read raises instead of returning another prefix.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Row

from .core import Core, check_anchor, entry_from_row, foreign_incarnation, head_view
from .errors import InvalidInput, ReadFenceError
from .models import Anchor, ClosedRange, ClosedRangeFailure, ClosedRangeResult, Entry

MAX_TURN_EVENTS = 20_000
MAX_TURN_BYTES = 8 * 1024 * 1024


def check_fence(core: Core, scope: str, session_id: str, fence: Anchor, sess: Any = None) -> Any:
    """Validate a fence for a read of (scope, session); return the session row or raise.

    ``sess``: the session's row (or what the read fetched of it: its generation, session_key and
    incarnation), when the read already has it from this transaction.

    A fence taken in an earlier incarnation of the session (deleted, then created or imported again
    under the same id) is refused as ``scope``: it belongs to another session, as a cursor of an earlier
    incarnation is another session's (``scope_mismatch``), however alike the new session's entry is.
    A fence without an incarnation (made before anchors carried one) is honoured only by a session that
    existed then (``core.foreign_incarnation``).
    """
    check_anchor("fence", fence)
    if fence.scope != scope or fence.session_id != session_id:
        raise ReadFenceError("scope", "the fence belongs to another scope or session")
    if sess is None:
        sess = core.session_row(scope, session_id)
    if sess is None:
        raise ReadFenceError("missing", "the session is gone")
    if of_another_incarnation(sess.incarnation, sess.created_us, fence):
        raise ReadFenceError("scope", "the fence belongs to an earlier session under this id")
    rows = core.entries_with_path(scope, session_id, [fence.entry_id])
    row = rows.get(fence.entry_id)
    if row is None:
        raise ReadFenceError("missing", f"admitted entry {fence.entry_id} does not exist")
    if sess.generation != fence.generation:
        raise ReadFenceError("rewritten", f"generation {fence.generation} is now {sess.generation}")
    if sess.session_key != fence.session_key:
        raise ReadFenceError("rewritten", f"session key {fence.session_key!r} is now {sess.session_key!r}")
    if row.seq != fence.seq or row.parent_id != fence.parent_id or row.position != fence.position:
        raise ReadFenceError("moved", "the admitted entry's seq, parent or position changed")
    if row.ts_path_seq != row.seq:
        raise ReadFenceError("missing", "the admitted entry left the active branch")
    if row.kind != "message" or row.role != "user":
        raise ReadFenceError("not_user", "the admitted entry is not a user message")
    return sess


def read_closed_range(
    core: Core, admission: Anchor, terminal: Anchor, session: Row[Any] | None = None
) -> ClosedRangeResult:
    """The visible messages admission..terminal inclusive, or why they cannot be read.

    ``session``: the session's row as this transaction holds it locked (the fast completion has it from
    its append), instead of reading it again.

    Anchors that disagree on the session (scope, id, key) or were taken in different incarnations of it
    are ``session_rebound``. Anchors of one session taken in different generations (the transcript was
    replaced or rewritten during the turn) are ``stale``, as a turn both of whose anchors are of an
    earlier generation is. Anchors of an earlier incarnation than the session under their id now
    (deleted, then created or imported again) are ``stale``, as anchors of a session that is gone or of
    another scope's session are, however alike the new session's entries are. An anchor without an
    incarnation (made before anchors carried one) is honoured only by a session that existed then.
    """
    if not isinstance(admission, Anchor) or not isinstance(terminal, Anchor):
        raise InvalidInput("a closed range takes two anchors")
    identity = ("scope", "session_id", "session_key")
    if any(getattr(admission, k) != getattr(terminal, k) for k in identity) or not _same_incarnation(
        admission, terminal
    ):
        return ClosedRangeFailure(reason="session_rebound", detail="the anchors disagree on session identity")
    if admission.generation != terminal.generation:
        return ClosedRangeFailure(reason="stale", detail="the session moved to another generation during the turn")
    scope, session_id = admission.scope, admission.session_id
    sess = session if session is not None else core.session_row(scope, session_id)
    if sess is None:
        return ClosedRangeFailure(reason="stale", detail="the session is gone")
    if of_another_incarnation(sess.incarnation, sess.created_us, admission, terminal):
        return ClosedRangeFailure(reason="stale", detail="the anchors are of an earlier session under this id")
    if sess.generation != admission.generation or sess.session_key != admission.session_key:
        return ClosedRangeFailure(reason="stale", detail="the session moved to another generation")
    rows = core.entries_with_path(scope, session_id, [admission.entry_id, terminal.entry_id])
    for anchor in (admission, terminal):
        row = rows.get(anchor.entry_id)
        if row is None or not _matches(row, anchor):
            return ClosedRangeFailure(reason="stale", detail=f"anchor {anchor.entry_id} no longer matches")
    first, last = rows[admission.entry_id], rows[terminal.entry_id]
    if first.position is None or last.position is None:
        raise InvalidInput("closed-range anchors must be message entries")
    if last.depth < first.depth:
        return ClosedRangeFailure(reason="non_descendant", detail="the terminal precedes the admission")
    if last.depth - first.depth + 1 > MAX_TURN_EVENTS:
        return ClosedRangeFailure(reason="too_large", detail=f"over {MAX_TURN_EVENTS} events")
    if not (first.ts_path_seq == first.seq and last.ts_path_seq == last.seq):
        # Both anchors still match, but the turn is not (wholly) on the active branch: either the
        # terminal sits on another branch than the admission, or the whole turn was branched away.
        if not _off_path_descends(core, scope, session_id, first, last):
            return ClosedRangeFailure(reason="non_descendant", detail="the terminal is on another branch")
        return ClosedRangeFailure(reason="stale", detail="the turn left the active branch")
    chain = core.path_rows(scope, session_id, first.depth, last.depth)
    if not _descends(chain, first.entry_id, last.entry_id):
        return ClosedRangeFailure(reason="non_descendant", detail="parent links do not reach the admission")
    size = sum(r.size_bytes for r in chain)
    if size > MAX_TURN_BYTES:
        return ClosedRangeFailure(reason="too_large", detail=f"{size} bytes, over {MAX_TURN_BYTES}")
    messages = [entry_from_row(r, active=True) for r in chain if r.kind == "message"]
    if len(messages) != last.position - first.position + 1:
        return ClosedRangeFailure(reason="stale", detail="message count disagrees with the positions")
    return ClosedRange(entries=messages, serialized_bytes=sum(m.size_bytes for m in messages))


def closed_range_of_append(
    admission: Anchor, terminal: Anchor, session: Row[Any], appended: list[Entry]
) -> ClosedRange | None:
    """The closed range of a turn whose replies this transaction appended right after its admission,
    without reading it back; None when that is not the case (the caller reads it: ``read_closed_range``).

    ``session`` is the session's row as the append locked it, read ``with_head``; ``appended`` what the
    append returned, the terminal last. The range is then the head the append started from (the
    admitted entry: still the session's head, so on the active path) and the appended entries, which
    this transaction wrote as its children: what ``read_closed_range`` would read, entry for entry.
    """
    if not appended or appended[-1].entry_id != terminal.entry_id:
        return None
    identity = ("scope", "session_id", "session_key", "generation")
    if any(getattr(admission, k) != getattr(terminal, k) for k in identity):
        return None
    if session.generation != admission.generation or session.session_key != admission.session_key:
        return None
    if of_another_incarnation(session.incarnation, session.created_us, admission, terminal):
        return None
    head = head_view(session)
    if head is None or head.entry_id != admission.entry_id or not _matches(head, admission):
        return None
    if head.kind != "message" or head.position is None or admission.position is None or terminal.position is None:
        return None
    # Every appended entry must be new (an item that already existed, on a retry, was not written as a
    # child of this head) and the next in the chain.
    parent, seq = head.entry_id, session.last_seq
    for entry in appended:
        seq += 1
        if entry.seq != seq or entry.parent_id != parent or not entry.active:
            return None
        parent = entry.entry_id
    if len(appended) + 1 > MAX_TURN_EVENTS:
        return None
    messages = [entry_from_row(head, active=True), *(e for e in appended if e.kind == "message")]
    if sum(e.size_bytes for e in appended) + head.size_bytes > MAX_TURN_BYTES:
        return None
    if len(messages) != terminal.position - admission.position + 1:
        return None
    return ClosedRange(entries=messages, serialized_bytes=sum(m.size_bytes for m in messages))


def of_another_incarnation(incarnation: int, created_us: int, *anchors: Anchor) -> bool:
    """Whether any anchor names another incarnation of its session (``incarnation``, created at
    ``created_us``) than this one. An anchor without an incarnation (made before anchors carried one)
    can only be of a session that existed then: for any other it is of an earlier session under the id."""
    return any(foreign_incarnation(a.incarnation, incarnation, created_us) for a in anchors)


def _same_incarnation(a: Anchor, b: Anchor) -> bool:
    """Whether two anchors may be of one session incarnation (one without an incarnation always may)."""
    return a.incarnation is None or b.incarnation is None or a.incarnation == b.incarnation


def _matches(row: Row[Any], anchor: Anchor) -> bool:
    return bool(
        row.seq == anchor.seq
        and row.parent_id == anchor.parent_id
        and row.position == anchor.position
        and row.idempotency_key == anchor.idempotency_key
    )


def _off_path_descends(core: Core, scope: str, session_id: str, first: Row[Any], last: Row[Any]) -> bool:
    """Walk stored parent links from the terminal up to the admission's depth (at most the turn's length)."""
    row: Row[Any] | None = last
    seen: set[str] = set()
    for _ in range(last.depth - first.depth):
        if row is None or row.parent_id is None or row.entry_id in seen:
            return False
        seen.add(row.entry_id)
        row = core.entry_rows(scope, session_id, [row.parent_id]).get(row.parent_id)
    return row is not None and row.entry_id == first.entry_id


def _descends(chain: list[Row[Any]], admission_id: str, terminal_id: str) -> bool:
    """Walk parent links from the terminal; position order alone never proves descent."""
    by_id = {r.entry_id: r for r in chain}
    seen: set[str] = set()
    current: str | None = terminal_id
    while current is not None and current not in seen:
        if current == admission_id:
            return True
        seen.add(current)
        row = by_id.get(current)
        current = row.parent_id if row is not None else None
    return False
