"""Mirroring a host's own transcript into the store: imported pages and committed turns, by position.

A host that keeps its own transcript (OpenClaw) hands over its visible messages in active order, each
with the host's stable entry id: the pages of a bootstrap import, or the range of one accepted turn.
Visible position p of the host is visible position p of the mirror. A message already mirrored at its
position (the same entry id, or the same message) is skipped, so every page and every turn can be sent
again; the first one that differs means the host's transcript moved under the mirror, which then
branches there (nothing is deleted) and appends the host's version. A range that starts past the
mirror's end is refused (``behind``): the caller imports first. The import's resume point (the host's
opaque cursor and the position after it) is engine state written in the same transaction.

An entry id names one host message: a range that names one id at two positions is refused
(``InvalidInput``), and so is one that names, at a later position, a message the mirror holds on its
active branch at an earlier one (``MirrorConflict``: ``turn_mismatch`` for a turn, ``cursor`` for a
page): appending it again under a fresh id would show that message twice. A turn's admission and
terminal match by entry id alone, since the engine's receipt names them and a replay is checked
against those names.

Concurrent calls on one session (two gateway processes, a retry racing its original) run one after
the other: each locks the session's row before it reads the mirror (SQLite: every writer's BEGIN
IMMEDIATE; PostgreSQL: SELECT ... FOR UPDATE, after which each READ COMMITTED statement sees what the
call it waited for committed). The second call therefore aligns against the first one's result:
the same range matches (one copy, no branch); a conflicting range at the same position branches
exactly once, after the last message both agree on, and the later call's messages are the active
branch (the earlier ones stay stored, off it). A replayed turn key never reaches the mirror: the
ledger answers it (``service.commit_turn``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import fences, paths
from .config import StoreConfig
from .core import Core, NewEntry, decode_stored, prepare_entry, same_json
from .errors import InvalidInput, MirrorConflict
from .ledger import get_state, put_state
from .models import Anchor, ClosedRange

STATE_OWNER = "service.import"
STATE_KEY = "cursor"


@dataclass(frozen=True)
class HostMessage:
    """One visible host message: its host entry id (None when the host did not name it) and message."""

    entry_id: str | None
    message: dict[str, Any]


@dataclass(frozen=True)
class Alignment:
    """What aligning a range did: messages appended, already there, and whether the mirror branched."""

    imported: int
    matched: int
    rewound: bool


@dataclass(frozen=True)
class ImportState:
    """Where the next import page of a session resumes: the host cursor and the position after it."""

    cursor: str | None
    position: int


def import_state(core: Core, scope: str, session_id: str) -> ImportState:
    """The recorded resume point of a session's import (the start when there is none)."""
    raw = get_state(core, scope, session_id, STATE_OWNER, STATE_KEY)
    if not isinstance(raw, dict):
        return ImportState(None, 0)
    cursor = raw.get("cursor")
    position = raw.get("position")
    return ImportState(cursor if isinstance(cursor, str) else None, position if isinstance(position, int) else 0)


def import_page(
    core: Core,
    config: StoreConfig,
    scope: str,
    session_id: str,
    *,
    cursor: str | None,
    next_cursor: str | None,
    messages: Sequence[HostMessage],
) -> tuple[Alignment, ImportState]:
    """Mirror one host page read from ``cursor`` (None: the start) and record ``next_cursor`` after it."""
    core.require_session(scope, session_id, lock=True)
    state = import_state(core, scope, session_id)
    if cursor is None:
        start = 0
    elif cursor == state.cursor:
        start = state.position
    else:
        # Another importer moved on (or the state was reset): reading on from here could skip or repeat.
        raise MirrorConflict("cursor", "the page was read from a cursor this mirror does not hold; re-read the state")
    alignment = align(core, config, scope, session_id, start, messages)
    after = ImportState(next_cursor, start + len(messages))
    put_state(core, scope, session_id, STATE_OWNER, STATE_KEY, {"cursor": after.cursor, "position": after.position})
    return alignment, after


def align(
    core: Core,
    config: StoreConfig,
    scope: str,
    session_id: str,
    start: int,
    messages: Sequence[HostMessage],
    *,
    turn: bool = False,
) -> Alignment:
    """Make visible positions start.. of the mirror hold ``messages`` (see module doc).

    ``turn``: the range of one turn: its named messages (the admission and the terminal) match by
    entry id alone, and a message mirrored elsewhere is ``turn_mismatch`` (else ``cursor``).
    """
    sess = core.require_session(scope, session_id, lock=True)
    visible = int(sess.visible_count)
    if start > visible:
        raise MirrorConflict("behind", f"the range starts at position {start}; the mirror holds {visible} messages")
    # Validate and serialize everything before the first write: invalid input writes nothing.
    prepared = [_prepare(config, m) for m in messages]
    seen: set[str] = set()
    for m in messages:
        if m.entry_id in seen:
            # One host message at two positions: the second copy was appended under a fresh id (a message
            # shown twice) when the first was already mirrored, and refused by the append when it was not.
            raise InvalidInput(f"the range names entry id {m.entry_id!r} at two positions")
        if m.entry_id is not None:
            seen.add(m.entry_id)
    end = min(start + len(messages), visible)
    stored = core.visible_rows(scope, session_id, start - 1, end, None) if end > start else []
    matched = 0
    for row, host in zip(stored, messages, strict=False):
        if row.entry_id != host.entry_id and (
            # A turn's receipt names its admission and terminal: matched as another entry with the same
            # message, the receipt named that one, and every replay of the turn was a key collision.
            (turn and host.entry_id is not None)
            # JSON equality, not ``==`` (1, 1.0 and True are three texts: core.same_json).
            or not same_json(decode_stored(row.payload), host.message)
        ):
            break
        matched += 1
    keep = start + matched  # the mirror's positions below this one stay on its active branch
    rest = prepared[matched:]
    taken = core.entry_rows(scope, session_id, [n.entry_id for n in rest]) if rest else {}
    for i, n in enumerate(rest):
        found = taken.get(n.entry_id)
        if found is not None and found.position is not None and found.position < keep and core.on_active_path(
            scope, session_id, found
        ):
            # The host names, at position keep + i, a message the mirror shows at an earlier position that
            # stays: the range does not line up with the mirror (an overlapping page, a turn sent with a
            # stale position). A fresh id would show that message twice.
            raise MirrorConflict(
                "turn_mismatch" if turn else "cursor",
                f"entry {n.entry_id!r} is mirrored at position {found.position}; the range puts it at {keep + i}",
            )
    rewound = False
    if keep < visible and matched < len(messages):
        # The host's transcript differs from here on: branch after the last message both agree on.
        before = keep - 1
        branch_to = None if before < 0 else _entry_id_at(core, scope, session_id, before)
        paths.branch(core, scope, session_id, branch_to)
        rewound = True
    if rest:
        # An id the host reuses after a rewrite names an off-branch entry here: append under a fresh id.
        rest = [
            prepare_entry(config, message=messages[matched + i].message) if n.entry_id in taken else n
            for i, n in enumerate(rest)
        ]
        core.append(scope, session_id, rest)
    return Alignment(imported=len(rest), matched=matched, rewound=rewound)


def mirror_turn(
    core: Core,
    config: StoreConfig,
    scope: str,
    session_id: str,
    *,
    admission: tuple[str, int | None],
    terminal: tuple[str, int | None],
    messages: Sequence[dict[str, Any]],
) -> tuple[Anchor, Anchor, list[dict[str, Any]]]:
    """Mirror one accepted host turn (admission..terminal) and return its anchors and stored messages."""
    if not messages:
        raise MirrorConflict("turn_mismatch", "a turn has at least its admitted message")
    (adm_id, adm_pos), (term_id, term_pos) = admission, terminal
    sess = core.require_session(scope, session_id, lock=True)
    rows = core.entry_rows(scope, session_id, [adm_id, term_id])
    start = adm_pos
    if start is None:
        found = rows.get(adm_id)
        start = found.position if found is not None and found.position is not None else int(sess.visible_count)
    if term_pos is not None and term_pos - start + 1 != len(messages):
        raise MirrorConflict("turn_mismatch", f"positions {start}..{term_pos} do not hold {len(messages)} messages")
    if (adm_id == term_id) != (len(messages) == 1):
        # One message is both ends of its turn; two are two entries. Else the receipt names another
        # terminal (or admission) than the request, and every replay of the turn is a key collision.
        raise MirrorConflict("turn_mismatch", f"{len(messages)} message(s) from entry {adm_id!r} to {term_id!r}")
    ids: list[str | None] = [None] * len(messages)
    ids[-1] = term_id
    ids[0] = adm_id
    hosted = [HostMessage(i, m) for i, m in zip(ids, messages, strict=True)]
    done = align(core, config, scope, session_id, start, hosted, turn=True)
    if done.rewound and import_state(core, scope, session_id).position > start + done.matched:
        # The import's resume point lies past where the host's transcript just moved: its cursor was read
        # from a transcript the mirror no longer shows (resuming there would skip or repeat, or start
        # past the mirror's end: ``behind`` to the very import meant to catch up). The next import
        # starts again from the host's beginning and matches what is already mirrored.
        put_state(core, scope, session_id, STATE_OWNER, STATE_KEY, {"cursor": None, "position": 0})
    sess = core.require_session(scope, session_id)
    first = _anchor_at(core, sess, start)
    last = _anchor_at(core, sess, start + len(messages) - 1)
    closed = fences.read_closed_range(core, first, last)
    if not isinstance(closed, ClosedRange) or not same_json(closed.messages, list(messages)):
        raise MirrorConflict("turn_mismatch", "the mirrored range differs from the turn's messages")
    return first, last, closed.messages


def _prepare(config: StoreConfig, host: HostMessage) -> NewEntry:
    return prepare_entry(config, message=host.message, entry_id=host.entry_id)


def _entry_id_at(core: Core, scope: str, session_id: str, position: int) -> str:
    seq = core.path_seq_at_position(scope, session_id, position)
    row = None if seq is None else core.entry_by_seq(scope, session_id, seq)
    if row is None:  # pragma: no cover - positions below the visible count always exist
        raise MirrorConflict("behind", f"no visible message at position {position}")
    return str(row.entry_id)


def _anchor_at(core: Core, sess: Any, position: int) -> Anchor:
    seq = core.path_seq_at_position(sess.scope, sess.session_id, position)
    row = None if seq is None else core.entry_by_seq(sess.scope, sess.session_id, seq)
    if row is None:  # pragma: no cover - align() just made the position exist
        raise MirrorConflict("behind", f"no visible message at position {position}")
    return core.anchor_for(sess, row)
