"""Mirroring a host's own transcript into the store: imported pages and committed turns, by position.

A host that keeps its own transcript (OpenClaw) hands over its visible messages in active order, each
with the host's stable entry id: the pages of a bootstrap import, or the range of one accepted turn.
Visible position p of the host is visible position p of the mirror. A message already mirrored at its
position (the same entry id, or the same message) is skipped, so every page and every turn can be sent
again; the first one that differs means the host's transcript moved under the mirror, which then
branches there (nothing is deleted) and appends the host's version. A range that starts past the
mirror's end is refused (``behind``): the caller imports first. The import's resume point (the host's
opaque cursor and the position after it) is engine state written in the same transaction.

What the mirror puts after the last message both agree on is keyed, never drawn at random, so that
the same range sent again finds what it stored (a turn's receipt names those entries). Each message
hangs after a parent, and is there the entry of its host id when that id is free or already names
this message after this parent; else (the host reuses an id the mirror holds for another message or
place, after a rewrite of its own) the entry of an id derived from the host id, the parent and the
message; a message without a host id (a turn's middle) likewise by parent and message. Such an entry
found off the active branch (the host went back to a branch the mirror had left) is put back on it,
not stored again; so is a turn's middle message imported under its host id, found through the
terminal's parents.

An entry id names one host message: a range that names one id at two positions is refused
(``InvalidInput``), and so is one that names, at a later position, the same message the mirror holds
under that id on its active branch before the range (``MirrorConflict``: ``turn_mismatch`` for a turn,
``cursor`` for a page, naming the id and both positions): an overlapping page or a stale turn, and
appending it again under a fresh id would show that message twice. An id the host reused for another
message, or one the mirror holds at a position inside the range, matched there by its text to a
message the host now names otherwise, is no overlap: the message goes under an id derived from it, as
any reused id (refused, every import of such a host failed the same way, from its beginning too). The
same message is told by its text, but for a turn's named messages and those a committed turn names
(its admission or terminal): a commit and an import may store one message differently (the plugin cuts
a commit to the turn cap), so under its id it is that message whatever its text, and named again at a
later position it is refused. A turn's admission and
terminal match by entry id (or the id derived for it there) alone, since the engine's receipt names
them and a replay is checked against those names.

Concurrent calls on one session (two gateway processes, a retry racing its original) run one after
the other: each locks the session's row before it reads the mirror (SQLite: every writer's BEGIN
IMMEDIATE; PostgreSQL: SELECT ... FOR UPDATE, after which each READ COMMITTED statement sees what the
call it waited for committed). The second call therefore aligns against the first one's result:
the same range matches (one copy, no branch); a conflicting range at the same position branches
exactly once, after the last message both agree on, and the later call's messages are the active
branch (the earlier ones stay stored, off it). But a turn never branches away a turn admitted after
its own admission: the mirror holds one mirrored past it, so this turn arrives late (the host has
moved on since it was sent) or the host went back before it; either way ``behind``: an import brings
the host's transcript (a page may branch anywhere), and a turn the host holds then commits. A
replayed turn key never reaches the mirror: the ledger answers it (``service.commit_turn``).

Every branch the mirror or the store makes (``branch``) keeps the resume point true: when it changes
a position below it, the next import starts again from the host's beginning and matches what is
mirrored; a resume point past the mirror's end (left by a path move outside ``branch``) reads so too,
and the next turn or branch resets it for good (else the mirror, grown past it again, revived it). A
turn refused ``behind`` with the resume point past its admission resets it too (``reopen_import``, in
a transaction of its own): the import its caller runs before retrying must reach the admission.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from . import fences, paths
from .config import StoreConfig
from .core import Core, NewEntry, decode_stored, new_id, prepare_entry, same_json, same_stored_text, stored_text
from .errors import InvalidInput, InvalidMessage, MirrorConflict, MirrorReason, PayloadTooLarge
from .ledger import get_state, list_receipts, put_state
from .models import Anchor, ClosedRange, ClosedRangeFailure, Entry, SessionInfo, validate_message

STATE_OWNER = "service.import"
STATE_KEY = "cursor"
#: a derived entry id looks like one ``core.new_id`` draws: 22 letters and digits (128 bits of a SHA-256)
_ID_ALPHABET = string.digits + string.ascii_letters
_ID_CHARS = 22


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
    """The recorded resume point of a session's import (the start when there is none, or it is past the end)."""
    state = _stored_state(core, scope, session_id)
    if state.position > int(core.require_session(scope, session_id).visible_count):
        # Past the mirror's end (a path move outside ``branch``): every page from it would be ``behind``.
        return ImportState(None, 0)
    return state


def _stored_state(core: Core, scope: str, session_id: str) -> ImportState:
    raw = get_state(core, scope, session_id, STATE_OWNER, STATE_KEY)
    if not isinstance(raw, dict):
        return ImportState(None, 0)
    cursor = raw.get("cursor")
    position = raw.get("position")
    return ImportState(cursor if isinstance(cursor, str) else None, position if isinstance(position, int) else 0)


def _settled_state(core: Core, scope: str, session_id: str, visible: int) -> ImportState:
    """``import_state`` for a writer that grows the mirror or moves its path (holding the session's lock):
    a resume point stored past the mirror's end is reset for good, not only read as the start.

    Read as the start only, it stood in the ledger as it was: once turns (or the store's own appends
    after a ``branch``) had grown the mirror past it again, it read as true, and the next import
    resumed from a host cursor of another transcript, after messages the host never sent from it.
    """
    state = _stored_state(core, scope, session_id)
    if state.position <= visible:
        return state
    _restart_import(core, scope, session_id)
    return ImportState(None, 0)


def _restart_import(core: Core, scope: str, session_id: str) -> None:
    """Make the next import start from the host's beginning (it matches what is mirrored)."""
    put_state(core, scope, session_id, STATE_OWNER, STATE_KEY, {"cursor": None, "position": 0})


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


def branch(core: Core, scope: str, session_id: str, entry_id: str | None) -> SessionInfo:
    """Move the head to ``entry_id`` (``paths.branch``), resetting a resume point the move went under."""
    sess = core.require_session(scope, session_id, lock=True)
    state = _settled_state(core, scope, session_id, int(sess.visible_count))
    last = state.position - 1  # the last imported position; the entry there fixes every one before it
    held = core.path_seq_at_position(scope, session_id, last) if last >= 0 else None
    info = paths.branch(core, scope, session_id, entry_id)
    if last >= 0 and core.path_seq_at_position(scope, session_id, last) != held:
        # The host's cursor was read from a transcript the mirror no longer shows there: resuming at it
        # would skip or repeat, or put the host's next messages after others. The next import starts
        # again from the host's beginning and matches (or puts back) what is already mirrored.
        _restart_import(core, scope, session_id)
    return info


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
    entry id alone, a message mirrored elsewhere is ``turn_mismatch`` (else ``cursor``), and a turn
    admitted after this one's admission is never branched away (``behind``).
    """
    sess = core.require_session(scope, session_id, lock=True)
    visible = int(sess.visible_count)
    if start > visible:
        raise MirrorConflict("behind", f"the range starts at position {start}; the mirror holds {visible} messages")
    reason: MirrorReason = "turn_mismatch" if turn else "cursor"
    # Validate and serialize everything before the first write: invalid input writes nothing. A message
    # only an earlier release stored, or one over the payload cap, may be one the mirror holds: refused
    # only when it would be appended (``refusals``).
    prepared, refusals = [], []
    for m in messages:
        new, refusal = _prepare(config, m)
        prepared.append(new)
        refusals.append(refusal)
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
    for row, host, new in zip(stored, messages, prepared, strict=False):
        if not _matches(row, host, new, turn):
            break
        matched += 1
    keep = start + matched  # the mirror's positions below this one stay on its active branch
    rest = list(zip(messages[matched:], prepared[matched:], strict=True))
    named = [h.entry_id for h, _ in rest if h.entry_id is not None]
    taken = core.entry_rows(scope, session_id, named) if named else {}
    for i, (host, new) in enumerate(rest):
        found = None if host.entry_id is None else taken.get(host.entry_id)
        if found is not None and _shown_twice(core, scope, session_id, start, keep, found, new, turn=turn):
            # The host names, at position keep + i, the message the mirror shows under that id at an earlier
            # position that stays: the range does not line up with the mirror (an overlapping page, a turn
            # sent with a stale position). A fresh id would show that message twice.
            advice = (
                "the turn's positions are stale" if turn else "re-read the resume point and send the page after it"
            )
            raise MirrorConflict(
                reason,
                f"entry {host.entry_id!r} is mirrored at position {found.position}; the range puts the same "
                f"message at position {keep + i} ({advice}; a host must not name two of its messages by one id)",
            )
    rewound = keep < visible and matched < len(messages)
    if rewound and turn:
        _refuse_late(core, scope, session_id, start, keep)
    if not rest:
        return Alignment(imported=0, matched=matched, rewound=False)
    # The host's transcript differs from here on: its messages hang after the last one both agree on.
    parent = sess.head_entry_id
    if rewound:
        parent = _entry_id_at(core, scope, session_id, keep - 1) if keep > 0 else None
    reused, placed = _place(core, scope, session_id, parent, rest, taken, turn=turn, reason=reason)
    refused = next((r for r in refusals[matched + reused :] if r is not None), None)
    if refused is not None:
        raise refused  # a new append of it, refused as ``append`` refuses it: nothing written
    if reused:
        branch(core, scope, session_id, placed[reused - 1].entry_id)  # back on the branch, with its ancestors
    elif rewound:
        branch(core, scope, session_id, parent)
    if reused < len(placed):
        core.append(scope, session_id, placed[reused:])
    return Alignment(imported=len(rest), matched=matched, rewound=rewound)


def _shown_twice(
    core: Core, scope: str, session_id: str, start: int, keep: int, found: Any, new: NewEntry, *, turn: bool
) -> bool:
    """Whether appending a range's message named by an id the mirror holds as ``found`` shows one message twice.

    Only the same message, held on the active branch at a position the range keeps, before the range: a
    host that reused the id for another message (after a rewrite of its own), or whose message at that
    position (inside the range) now has another id, is mirrored under an id derived from it (``_place``).
    Refused either way, such a host's every import failed, from its beginning too, for ever. A turn's
    named message, or one a committed turn names, is the same message by its id alone (``_matches``)."""
    if found.position is None or found.position >= keep:
        return False
    if found.position >= start:
        # Matched by its text to the host's message there, whose id is another (a range names one id once).
        return False
    if not core.on_active_path(scope, session_id, found):
        return False
    # A turn's commit and the host's import may store one message differently (the plugin cuts a commit
    # to the turn cap, not an import): by its text, a stale turn's message, or an overlapping page's
    # message a committed turn holds, read as another message and was appended a second time.
    return turn or same_stored_text(found.payload, new.payload_json) or _turn_names(core, scope, session_id, found)


def _turn_names(core: Core, scope: str, session_id: str, row: Any) -> bool:
    """Whether a committed turn names a stored entry row as its admission or terminal."""
    if row.turn_id is not None:
        return True  # bound to its turn's key at the commit (the admission)
    # Only when its text differs from a page's message under its id: the session's receipts, read once.
    return any(r.terminal_entry_id == row.entry_id for r in list_receipts(core, scope, session_id))


def names(config: StoreConfig, host_id: str, row: Any, message: dict[str, Any]) -> bool:
    """Whether a stored entry row is where the mirror keeps host message ``host_id`` (its id, or one derived)."""
    if row.entry_id == host_id:
        return True
    return bool(row.entry_id == _derived_id(host_id, row.parent_id, stored_text(message)))


def host_id_fits(config: StoreConfig, host_id: str, row: Any, *, unnamed: bool) -> bool:
    """Whether a stored message row can be host message ``host_id``: it is stored under that id or one
    derived from it (``names``), or (``unnamed``) under an id derived from none: a turn's middle message,
    whose host id the turn did not name, so that its position is all that says which host message it is."""
    if row.kind != "message":
        return False
    if row.entry_id == host_id:
        return True
    return _derived_from(config, host_id, row.entry_id, row.parent_id, decode_stored(row.payload), unnamed)


def entry_fits(config: StoreConfig, host_id: str, entry: Entry, *, unnamed: bool) -> bool:
    """``host_id_fits`` for an entry read back (``read_visible``), whose message is decoded already."""
    if entry.kind != "message":
        return False
    if entry.entry_id == host_id:
        return True
    return _derived_from(config, host_id, entry.entry_id, entry.parent_id, entry.message, unnamed)


def _derived_from(
    config: StoreConfig, host_id: str, entry_id: str, parent_id: str | None, message: Any, unnamed: bool
) -> bool:
    """Whether ``entry_id`` is the id derived for ``message`` after ``parent_id`` from ``host_id`` (or none)."""
    # The text the message is stored as, as the append that stored it wrote it: not validated again as a
    # new append. A message an earlier release stored (imported again from its export) or one over a
    # payload cap lowered since is no new message, and refusing it failed the host's compaction for ever.
    payload = stored_text(message)
    ids = (host_id, None) if unnamed else (host_id,)
    return any(entry_id == _derived_id(i, parent_id, payload) for i in ids)


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
    _settled_state(core, scope, session_id, int(sess.visible_count))
    start = _turn_start(core, scope, session_id, adm_id, adm_pos)
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
    # A branch here resets the import's resume point when it lies past the turn (``branch``).
    align(core, config, scope, session_id, start, hosted, turn=True)
    sess = core.require_session(scope, session_id)
    first = _anchor_at(core, sess, start)
    last = _anchor_at(core, sess, start + len(messages) - 1)
    closed = fences.read_closed_range(core, first, last)
    if isinstance(closed, ClosedRangeFailure) and closed.reason == "too_large":
        # The messages are the host's and mirrored as they are: the turn is too large to commit, not a
        # mismatch (the service answers 413 with the limit it advertises, nothing written).
        raise PayloadTooLarge(f"the turn is too large to commit: {closed.detail}")
    if not isinstance(closed, ClosedRange) or not same_json(closed.messages, list(messages)):
        raise MirrorConflict("turn_mismatch", "the mirrored range differs from the turn's messages")
    return first, last, closed.messages


def reopen_import(core: Core, scope: str, session_id: str, admission: tuple[str, int | None]) -> bool:
    """After a turn was refused ``behind``: reset a resume point past its admission; whether it did.

    The resume point says the host's messages up to it are the mirror's; a turn admitted below it that
    the mirror refused says otherwise at its admission (the host went back and edited, or the turn is
    stale). The plugin's import before its retry reads from the resume point only up to the turn's
    end: from a point past the admission it read nothing, and the retry was ``behind`` again, for ever.
    From the host's beginning it matches what is mirrored and branches where the host went back; a
    stale turn stays refused (it costs that import one read of the host's transcript).
    """
    core.require_session(scope, session_id, lock=True)
    start = _turn_start(core, scope, session_id, *admission)
    if import_state(core, scope, session_id).position <= start:
        return False
    _restart_import(core, scope, session_id)
    return True


def _turn_start(core: Core, scope: str, session_id: str, adm_id: str, adm_pos: int | None) -> int:
    """A turn's admission position: the host's, else where the admission is mirrored, else the end (the
    caller holds the session's lock)."""
    if adm_pos is not None:
        return adm_pos
    found = core.entry_rows(scope, session_id, [adm_id]).get(adm_id)
    if found is not None and found.position is not None:
        return int(found.position)
    return int(core.require_session(scope, session_id).visible_count)


def _prepare(config: StoreConfig, host: HostMessage) -> tuple[NewEntry, InvalidInput | None]:
    """The host message as an entry, and why an append refuses it (None: it does not).

    A form only an earlier release stored, or a message over the payload cap (lowered since), is matched
    against what the mirror holds as it is stored (a store holds them, and the host sends them again on
    every import from its beginning): refused only as a new append."""
    try:
        return prepare_entry(config, message=host.message, entry_id=host.entry_id), None
    except (InvalidMessage, PayloadTooLarge) as e:
        refusal = e
    try:
        body = validate_message(host.message, stored=True)
        text = stored_text(body)
    except (InvalidInput, ValueError, TypeError, RecursionError):
        raise refusal from None
    return NewEntry(host.entry_id or new_id(), "message", body["role"], text, len(text.encode("utf-8"))), refusal


def _matches(row: Any, host: HostMessage, new: NewEntry, turn: bool) -> bool:
    """Whether the mirrored row at a position is the host's message there."""
    if row.entry_id == host.entry_id:
        # By id alone, content aside: a turn's commit and a later import may store one message of a huge
        # turn differently (the plugin cuts a commit to the turn cap, not an import: its messages.js), and
        # comparing content here branched the mirror off the message the turn's receipt names. A host
        # message rewritten in place under its own id is therefore not mirrored (integrations/openclaw).
        return True
    if turn and host.entry_id is not None:
        # A turn's receipt names its admission and terminal: matched as another entry with the same
        # message, the receipt named that one, and every replay of the turn was a key collision.
        return bool(row.entry_id == _derived_id(host.entry_id, row.parent_id, new.payload_json))
    # JSON equality, not ``==`` (1, 1.0 and True are three texts: core.same_json).
    return same_json(decode_stored(row.payload), host.message)


def _derived_id(host_id: str | None, parent_id: str | None, payload_json: str) -> str:
    """The entry id of a host message (``host_id`` None: unnamed) after ``parent_id``, when not its host id."""
    # Ids and the parent hold no control characters (core.check_id): U+001F separates them unambiguously,
    # and an empty host id (never a valid one) stands for none.
    text = "\x1f".join(("mirror-v1", host_id or "", parent_id or "", payload_json))
    n = int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:16], "big")
    out = []
    for _ in range(_ID_CHARS):
        n, digit = divmod(n, 62)
        out.append(_ID_ALPHABET[digit])
    return "".join(out)


def _same_entry(row: Any, parent: str | None, new: NewEntry) -> bool:
    """Whether a stored row is this message after this parent (one that can go back on the branch there)."""
    return bool(row.kind == "message" and row.parent_id == parent and same_stored_text(row.payload, new.payload_json))


def _place(
    core: Core,
    scope: str,
    session_id: str,
    parent: str | None,
    rest: list[tuple[HostMessage, NewEntry]],
    taken: dict[str, Any],
    *,
    turn: bool,
    reason: MirrorReason,
) -> tuple[int, list[NewEntry]]:
    """The entries ``rest`` is after ``parent`` (module doc): how many of the first exist already, and all."""
    placed: list[NewEntry] = []
    middles: dict[int, Any] | None = None  # a turn's entries by index in ``rest``, through the terminal's parents
    for i, (host, new) in enumerate(rest):
        found = _existing(core, scope, session_id, parent, host, new, taken, turn=turn, reason=reason)
        if found is None and turn and host.entry_id is None:
            middles = _through_terminal(core, scope, session_id, rest, taken) if middles is None else middles
            hint = middles.get(i)
            found = hint if hint is not None and _same_entry(hint, parent, new) else None
        if found is None:
            break
        placed.append(replace(new, entry_id=str(found.entry_id)))
        parent = str(found.entry_id)
    reused = len(placed)
    derived: list[str] = []
    for host, new in rest[reused:]:
        if host.entry_id is not None and host.entry_id not in taken:
            entry_id = host.entry_id
        else:
            entry_id = _derived_id(host.entry_id, parent, new.payload_json)
            derived.append(entry_id)
        placed.append(replace(new, entry_id=entry_id))
        parent = entry_id
    # The first new entry's id was looked up above (and found free), the others hang after new entries:
    # an id derived for one exists only when a host named an entry so (computing this module's ids). The
    # append would take that entry for this message and break the chain: refused, nothing written.
    clash = core.entry_rows(scope, session_id, derived) if derived else {}
    if clash:
        raise MirrorConflict(reason, f"entry id {next(iter(clash))!r} names another message of this session")
    return reused, placed


def _existing(
    core: Core,
    scope: str,
    session_id: str,
    parent: str | None,
    host: HostMessage,
    new: NewEntry,
    taken: dict[str, Any],
    *,
    turn: bool,
    reason: MirrorReason,
) -> Any:
    """The stored entry the host's message is after ``parent``, or None when it is a new one."""
    candidates: list[str] = []
    if host.entry_id is not None:
        row = taken.get(host.entry_id)
        if row is not None and _same_entry(row, parent, new):
            return row
        if row is not None:
            candidates.append(_derived_id(host.entry_id, parent, new.payload_json))
    if host.entry_id is None or not turn:
        # A page's message may be mirrored as a turn's middle, which the turn did not name.
        candidates.append(_derived_id(None, parent, new.payload_json))
    rows = core.entry_rows(scope, session_id, candidates) if candidates else {}
    for entry_id in candidates:
        row = rows.get(entry_id)
        if row is not None and not _same_entry(row, parent, new):
            raise MirrorConflict(reason, f"entry id {entry_id!r} names another message of this session")
        if row is not None:
            return row
    return None


def _through_terminal(
    core: Core, scope: str, session_id: str, rest: list[tuple[HostMessage, NewEntry]], taken: dict[str, Any]
) -> dict[int, Any]:
    """A turn's stored entries by index in ``rest``: its terminal's row and that row's parents."""
    terminal = rest[-1][0].entry_id
    row = None if terminal is None else taken.get(terminal)
    out: dict[int, Any] = {}
    for i in range(len(rest) - 1, -1, -1):
        if row is None:
            break
        out[i] = row
        parent_id = row.parent_id
        row = None if parent_id is None else core.entry_rows(scope, session_id, [parent_id]).get(parent_id)
    return out


def _refuse_late(core: Core, scope: str, session_id: str, start: int, keep: int) -> None:
    """``behind`` when the branch at ``keep`` would take off a turn admitted after position ``start``."""
    # A turn's admitted entry carries its turn id (the ledger binds it at the commit). The rows read are
    # the ones the branch takes off the path anyway: O(that tail), like the branch itself.
    for row in core.visible_rows(scope, session_id, max(keep, start + 1) - 1, None, None):
        if row.turn_id is not None:
            raise MirrorConflict(
                "behind",
                f"a turn admitted at position {row.position} is mirrored past this turn's admission at {start}: "
                "the host has moved on since this turn was sent, or went back before it (import first)",
            )


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
