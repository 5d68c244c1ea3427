"""Moving the active branch: branch to another entry, and branch-and-reappend rewrites."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Row, insert, update

from .core import Core, NewEntry, check_id, new_id, now_us, same_stored_text, session_info
from .errors import InvalidInput, UnknownEntry
from .models import Replacement, RewriteResult, SessionInfo, validate_message
from .schema import entries, sessions


def branch(core: Core, scope: str, session_id: str, entry_id: str | None) -> SessionInfo:
    """Move the head to ``entry_id`` (None: before the first entry); nothing is deleted."""
    sess = core.require_session(scope, session_id, lock=True)
    if entry_id is None:
        chain: list[Row[Any]] = []
        keep_depth = 0
    else:
        target = core.entry_row(scope, session_id, entry_id)
        chain, keep_depth = _chain_to_active_path(core, scope, session_id, target)
    core.replace_path_from(scope, session_id, keep_depth, chain)
    head = chain[-1] if chain else (
        core.path_rows(scope, session_id, keep_depth - 1, keep_depth - 1)[0] if keep_depth > 0 else None
    )
    core.conn.execute(
        update(sessions)
        .where(sessions.c.scope == scope, sessions.c.session_id == session_id)
        .values(
            head_seq=head.seq if head is not None else None,
            head_entry_id=head.entry_id if head is not None else None,
            path_length=head.depth + 1 if head is not None else 0,
            visible_count=core.visible_count(scope, session_id),
            updated_us=now_us(),
        )
    )
    del sess
    return session_info(core.require_session(scope, session_id))


def _chain_to_active_path(
    core: Core, scope: str, session_id: str, target: Row[Any]
) -> tuple[list[Row[Any]], int]:
    """The ancestors of target (itself included) that are off the active path, root first."""
    chain: list[Row[Any]] = []
    row: Row[Any] | None = target
    while row is not None and not core.on_active_path(scope, session_id, row):
        chain.append(row)
        if row.parent_id is None:
            row = None
            break
        row = core.entry_row(scope, session_id, row.parent_id)
    chain.reverse()
    # Everything at or below the target's depth that is on the path stays up to the fork point.
    keep_depth = chain[0].depth if chain else target.depth + 1
    return chain, keep_depth


class IdPool:
    """Entry ids for the entries a write makes, the same ones again when the write is retried.

    A retry after an uncertain COMMIT can then tell whether the earlier attempt landed: its entries
    exist under these very ids.
    """

    def __init__(self) -> None:
        self.drawn: list[str] = []
        self._next = 0

    def rewind(self) -> None:
        """Start a (re)try: hand out the ids drawn so far again, in the same order."""
        self._next = 0

    def take(self) -> str:
        """The next id."""
        if self._next == len(self.drawn):
            self.drawn.append(new_id())
        self._next += 1
        return self.drawn[self._next - 1]


def rewrite_entries(
    core: Core,
    scope: str,
    session_id: str,
    replacements: Sequence[Replacement],
    prepared: Sequence[NewEntry],
    allowed_suffix: set[str] | None,
    ids: IdPool | None = None,
) -> RewriteResult:
    """Branch at the first replaced entry and re-append it and everything after it."""
    ids = ids or IdPool()
    sess = core.require_session(scope, session_id, lock=True)
    wanted = {r.entry_id: p for r, p in zip(replacements, prepared, strict=True)}
    found = core.entry_rows(scope, session_id, list(wanted))
    unchanged = RewriteResult.model_construct(
        changed=False, bytes_freed=0, rewritten_entries=0, reason=None, generation=sess.generation
    )
    missing = [eid for eid in wanted if eid not in found]
    if missing:
        raise UnknownEntry(f"no entry {missing[0]!r} in session {session_id!r}")
    for row in found.values():
        if row.kind != "message":
            return unchanged.model_copy(update={"reason": f"not_a_message: {row.entry_id}"})
        if not core.on_active_path(scope, session_id, row):
            return unchanged.model_copy(update={"reason": f"not_active: {row.entry_id}"})
    first_depth = min(r.depth for r in found.values())
    suffix = core.path_rows(scope, session_id, first_depth, None)
    if allowed_suffix is not None:
        outside = [r.entry_id for r in suffix if r.entry_id not in allowed_suffix]
        if outside:
            return unchanged.model_copy(
                update={"reason": f"suffix_not_allowed: {len(outside)} active entries, first {outside[0]}"}
            )
    # The same message with its keys in another order is unchanged too, as an append's idempotency check
    # takes it: a rewrite of it would rotate the generation and reset every reader for nothing.
    if all(same_stored_text(wanted[eid].payload_json, found[eid].payload) for eid in wanted):
        return unchanged.model_copy(update={"reason": "unchanged"})
    generation = sess.generation + 1
    seq = sess.last_seq
    parent_id = suffix[0].parent_id
    ts = now_us()
    new_rows: list[dict[str, Any]] = []
    freed = 0
    for row in suffix:
        seq += 1
        rep = wanted.get(row.entry_id)
        if rep is not None:
            freed += row.size_bytes - rep.size_bytes
        entry_id = ids.take()
        new_rows.append(
            {
                "scope": scope,
                "session_id": session_id,
                "seq": seq,
                "entry_id": entry_id,
                "parent_id": parent_id,
                "depth": row.depth,
                "position": row.position,
                "generation": generation,
                "kind": row.kind,
                "role": rep.role if rep is not None else row.role,
                "payload": rep.payload_json if rep is not None else row.payload,
                "size_bytes": rep.size_bytes if rep is not None else row.size_bytes,
                "idempotency_key": None,
                "turn_id": None,
                "created_us": ts,
            }
        )
        parent_id = entry_id
    core.conn.execute(insert(entries), new_rows)
    core.replace_path_from(scope, session_id, first_depth, [_Row(r) for r in new_rows])
    last = new_rows[-1]
    core.conn.execute(
        update(sessions)
        .where(sessions.c.scope == scope, sessions.c.session_id == session_id)
        .values(
            generation=generation,
            last_seq=seq,
            head_seq=last["seq"],
            head_entry_id=last["entry_id"],
            path_length=last["depth"] + 1,
            updated_us=ts,
        )
    )
    return RewriteResult.model_construct(
        changed=True, bytes_freed=freed, rewritten_entries=len(new_rows), reason=None, generation=generation
    )


class _Row:
    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


def validate_replacements(replacements: Sequence[Any]) -> list[Replacement]:
    """Replacements as models; duplicates and empties are refused."""
    if isinstance(replacements, str | bytes) or not isinstance(replacements, Sequence) or not replacements:
        raise InvalidInput("replacements must be a non-empty list of {entry_id, message}")
    out = [_replacement(r.model_dump() if isinstance(r, Replacement) else r) for r in replacements]
    ids = [r.entry_id for r in out]
    if len(set(ids)) != len(ids):
        raise InvalidInput("an entry is replaced twice in one rewrite")
    return out


def _replacement(value: Any) -> Replacement:
    if not isinstance(value, dict) or set(value) != {"entry_id", "message"}:
        raise InvalidInput("a replacement must be a dict with exactly entry_id and message")
    check_id("entry_id", value["entry_id"])
    return Replacement.model_construct(entry_id=value["entry_id"], message=validate_message(value["message"]))
