"""The built-in summarising compaction (the legacy path), shared by the legacy engine and the host.

One summary of the older visible messages; the recent ones stay untouched (the last ``keep_last``
messages and any unfinished tool-call/result pair). The summary is written through the store as a
``compaction`` entry, so the originals stay stored and recoverable, and its pointer (summary + first
kept entry) is saved in engine state in the same transaction.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select

from . import mirror
from .config import StoreConfig
from .core import Core, check_id, now_us, prepare_entry, stored_text
from .engine import CompactResult, check_call, check_flag, check_focus, check_token_budget
from .errors import InvalidInput, MirrorConflict, PayloadTooLarge, SummarizerError
from .ledger import get_state, put_state
from .models import RESULT_ROLES, Anchor, Entry, out_of_context
from .schema import engine_state
from .summarize import SummaryBackoff, summary_text

STATE_OWNER = "runtime"
STATE_KEY = "compaction"
#: recent messages a compaction never summarizes, unless ``[engine.config.legacy] keep_last`` says otherwise
KEEP_LAST = 6


def load_pointer(store: Any, scope: str, session_id: str) -> dict[str, Any] | None:
    """The latest compaction pointer of a session if its first kept entry is still active."""
    result: dict[str, Any] | None = store.read(lambda c: pointer_in(c, scope, session_id))
    return result


#: the key of a compaction's pointer that holds the host's reset it was made after (``reset_under``)
RESET_UNDER = "reset_under"


def reset_under(pointer: dict[str, Any] | None) -> dict[str, Any] | None:
    """The host's reset a pointer in force starts its context after: the pointer itself when it is one, else
    the reset the compaction was made after (carried in its pointer), else None."""
    if pointer is None:
        return None
    if pointer.get("reset"):
        return {k: v for k, v in pointer.items() if k != RESET_UNDER}
    under = pointer.get(RESET_UNDER)
    return under if isinstance(under, dict) else None


def _carried(pointer: dict[str, Any] | None) -> dict[str, Any]:
    """What a new compaction's pointer carries of the one in force: the host's reset under it, if any.

    A reset is a boundary no later compaction undoes: the built-in compaction (a turn degraded to legacy)
    or the host's (reported after the reset) summarises only what followed it, but its pointer replaced
    the reset's, and an engine that owns compaction (lossless, which reads only the reset: ``reset_in``)
    assembled everything before the reset again; so did the legacy engine once the compaction left the
    mirror's branch and the reset had not."""
    under = reset_under(pointer)
    return {RESET_UNDER: under} if under is not None else {}


#: the key of a built-in compaction's or a host reset's pointer that names the host's compaction it was made
#: after (``host_under``)
HOST_UNDER = "host_under"


def host_under(pointer: dict[str, Any] | None) -> dict[str, Any] | None:
    """The host's compaction (not a reset) a pointer in force was made after: the pointer itself when it is
    one, else the one a built-in compaction's or a host reset's pointer names (by its summary's digest), else
    None."""
    if pointer is None:
        return None
    if pointer.get("source") == "host" and not pointer.get("reset"):
        return pointer
    under = pointer.get(HOST_UNDER)  # a built-in compaction's, or a host's reset's
    return under if isinstance(under, dict) else None


def _named(pointer: dict[str, Any] | None) -> dict[str, Any]:
    """What a built-in compaction's pointer names of the one in force: the host's compaction under it, if any.

    The host does not know of the built-in compaction: the compaction it finds newest in its transcript is
    still its own, which a plugin tells again at every bootstrap of a new process, without saying where it
    was made when it is an older one (or a plain HTTP client). Not recognised under the pointer that
    replaced it, it was recorded anew, and the context grew back by all the built-in one had summarised.
    The summary is named by its digest: the pointer is read with every assembly."""
    under = host_under(pointer)
    if under is None:
        return {}
    if under is not pointer:  # named under the built-in compaction in force: carried on
        return {HOST_UNDER: under}
    return {
        HOST_UNDER: {
            "source": "host",
            "summary_sha256": _digest(str(under["summary"])),
            "first_kept_entry_id": under["first_kept_entry_id"],
            "first_kept_position": under["first_kept_position"],
        }
    }


def _digest(summary: str) -> str:
    """A summary's sha256 hex digest (a lone surrogate hashes as its code point, never raises)."""
    return hashlib.sha256(summary.encode("utf-8", "surrogatepass")).hexdigest()


def _summarises(told: dict[str, Any], summary: str) -> bool:
    """Whether a pointer's summary (or a host's compaction named under one, by its digest) is ``summary``."""
    digest = told.get("summary_sha256")
    return digest == _digest(summary) if isinstance(digest, str) else told.get("summary") == summary


def pointer_in(c: Core, scope: str, session_id: str) -> dict[str, Any] | None:
    """``load_pointer`` inside an open transaction (the legacy engine reads it with its delta).

    The stored pointer's entries and its reset's are looked up together (one query, as for a pointer
    alone). A compaction that stands with a reset that does not (a branch between the two) keeps its
    summary without the reset; one that does not stand leaves its reset, when that stands on its own."""
    stored = get_state(c, scope, session_id, STATE_OWNER, STATE_KEY)
    if not isinstance(stored, dict):
        return None
    found, under, rows = _looked_up(c, scope, session_id, stored)
    if found is None:
        reset = None if under is None else _standing(c, scope, session_id, under, rows)
        host = _host_under_standing(c, scope, session_id, stored)
        if host is None or (reset is not None and reset.get("made_at_count", 0) >= host.get("made_at_count", 0)):
            return reset
        return host
    if under is not None and not _made_on_path(under, rows):
        found = {k: v for k, v in found.items() if k != RESET_UNDER}
    return found


#: the engine-state key of the host's compaction (not a reset) that a pointer names by digest (``host_under``),
#: in full: what that pointer falls back to when it no longer stands. Written when such a pointer replaces the
#: host's (``_keep_host``), not with every host compaction (whose pointer holds the summary itself); a store
#: written before holds the host's last one here too, which changes nothing (the digest tells which it is)
HOST_KEY = "host_compaction"


def _host_under_standing(c: Core, scope: str, session_id: str, stored: dict[str, Any]) -> dict[str, Any] | None:
    """The host's compaction a pointer that no longer stands names (``host_under``), when it stands itself.

    A built-in compaction (or a reset) made after the host's names it by its summary's digest only; once that
    pointer left the mirror's branch (an edit of the host's below its first kept message) while the host's
    compaction did not, nothing stood and the context grew back by all the host's had summarised. Read only
    then: the host's pointer is kept whole under its own key from when it was replaced (``_keep_host``)."""
    named = stored.get(HOST_UNDER)
    if not isinstance(named, dict) or (stored.get("source") == "host" and not stored.get("reset")):
        return None
    host = get_state(c, scope, session_id, STATE_OWNER, HOST_KEY)
    if (
        not isinstance(host, dict)
        or not isinstance(host.get("summary"), str)
        or not _summarises(named, host["summary"])
        or host.get("first_kept_entry_id") != named.get("first_kept_entry_id")
        or host.get("first_kept_position") != named.get("first_kept_position")
    ):
        return None
    found, under, rows = _looked_up(c, scope, session_id, host)
    if found is not None and under is not None and not _made_on_path(under, rows):
        found = {k: v for k, v in found.items() if k != RESET_UNDER}
    return found


def _looked_up(
    c: Core, scope: str, session_id: str, pointer: dict[str, Any]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any]]:
    """A pointer as it stands (``_standing``), the reset it carries (``RESET_UNDER``) and the rows of both's
    entries, looked up in one query."""
    under = pointer.get(RESET_UNDER)
    under = under if isinstance(under, dict) else None
    ids = list(dict.fromkeys(_entry_ids(pointer) + (_entry_ids(under) if under is not None else [])))
    rows = c.entries_with_path(scope, session_id, ids) if ids else {}
    return _standing(c, scope, session_id, pointer, rows), under, rows


def _entry_ids(pointer: dict[str, Any]) -> list[str]:
    """The entries ``_standing`` looks up for a pointer: its first kept one, and the last one a host's was
    made after."""
    seen = pointer.get("seen_entry_id") if pointer.get("source") == "host" else None
    return [i for i in (pointer.get("first_kept_entry_id"), seen) if isinstance(i, str)]


def _made_on_path(pointer: dict[str, Any], rows: dict[str, Any]) -> bool:
    """Whether the last message a host's pointer was made after is on the active path where it was."""
    seen = pointer.get("seen_entry_id")
    made = pointer.get("made_at_count", 0)
    return not isinstance(seen, str) or (isinstance(made, int) and _at_on_path(rows.get(seen), made - 1))


def _standing(
    c: Core, scope: str, session_id: str, pointer: dict[str, Any], rows: dict[str, Any]
) -> dict[str, Any] | None:
    """The pointer (dated) if it stands on the mirror's branch, else None; ``rows``: its ``_entry_ids``."""
    kept = pointer["first_kept_entry_id"]
    at = pointer["first_kept_position"]
    # A host's compaction is an entry on the branch it was made on (OpenClaw's transcript is a tree): on
    # another branch sharing its first kept message the host's context does not hold it. It stands while
    # the mirror's branch holds the last message it was made after.
    seen = pointer.get("seen_entry_id") if pointer.get("source") == "host" else None
    if isinstance(seen, str) and not _at_on_path(rows.get(seen), pointer.get("made_at_count", 0) - 1):
        return None
    if kept is None:
        # A host's reset that kept none of the messages before it (record_host_compaction): its context
        # starts after the last message it was made after, which the branch still holds (above).
        sess = c.session_row(scope, session_id)
        return _dated(c, scope, session_id, pointer) if sess is not None and at <= int(sess.visible_count) else None
    row = rows.get(kept)
    if _at_on_path(row, at):
        return _dated(c, scope, session_id, pointer)
    if pointer.get("source") != "host":
        return None
    # A host's compaction that kept only the turn it ran in (record_host_compaction) names the host's id of
    # a message the mirror did not hold yet: until the host commits it, the summary is all there is before
    # it; then the mirror holds it at that position under the host's id, or under one derived from it (the
    # host's id was taken by a message off the active branch), which the pointer does not name.
    sess = c.session_row(scope, session_id)
    visible = -1 if sess is None else int(sess.visible_count)
    if visible == at:
        return pointer
    if at > visible:
        return None
    seq = c.path_seq_at_position(scope, session_id, at)
    row = None if seq is None else c.entry_by_seq(scope, session_id, seq)
    if row is None or not mirror.host_id_fits(c.config, kept, row, unnamed=False):
        return None
    return _dated(c, scope, session_id, pointer)


def reset_in(c: Core, scope: str, session_id: str) -> int | None:
    """The visible position a host's reset standing on the mirror's branch starts its context again at
    (``record_host_compaction``), else None: how an engine that owns compaction (lossless) is told."""
    reset = reset_under(pointer_in(c, scope, session_id))
    return int(reset["first_kept_position"]) if reset is not None else None


def _at_on_path(row: Any, position: int) -> bool:
    """Whether an entry row (from ``entries_with_path``) is at ``position`` on the active path now."""
    return row is not None and row.position == position and row.ts_path_seq == row.seq


def _made_at(c: Core, scope: str, session_id: str, count: int) -> dict[str, Any]:
    """Where a compaction was made: after ``count`` visible messages, the last of them (the mirror's entry at
    ``count - 1``, when the mirror holds it) named, so that the branch it was made on can be told."""
    sess = c.require_session(scope, session_id)
    if count <= 0 or count > int(sess.visible_count):
        return {"made_at_count": count}
    seq = c.path_seq_at_position(scope, session_id, count - 1)
    row = None if seq is None else c.entry_by_seq(scope, session_id, seq)
    return {"made_at_count": count, **({"seen_entry_id": str(row.entry_id)} if row is not None else {})}


def _standing_is_newer(
    c: Core,
    scope: str,
    session_id: str,
    standing: dict[str, Any],
    compacted_ms: int | None,
    count: int | None,
    reset: bool = False,
) -> bool:
    """Whether the compaction in force (``standing``) was made after one the host found in its transcript
    later, made after ``count`` of its visible messages (at ``compacted_ms`` by the host's clock).

    Compared by where in the conversation each was made, not by time: the host's clock and the service's
    differ (an hour ahead put an older compaction back, an hour behind refused a newer one). Made at the
    same point, two of the host's are told apart by the host's own clock; otherwise the one in force stays.
    One made on another branch (its last message off the mirror's branch) is not newer: the host's is of
    the branch it is on now. Without ``count`` (a plugin before it), or a pointer without ``made_at_count``
    (one written before it), only times are left: the host's against the one in force (the host's, else
    when the service made or recorded it), across the two clocks."""
    made_ms = standing.get("host_ms") if standing.get("source") == "host" else None
    made_ms = made_ms if isinstance(made_ms, int) else None
    made_count = standing.get("made_at_count")
    if count is None or not isinstance(made_count, int):
        made = made_ms if made_ms is not None else standing.get("created_ms")
        return isinstance(made, int) and compacted_ms is not None and made > compacted_ms
    seen = standing.get("seen_entry_id")
    if isinstance(seen, str):
        row = c.entries_with_path(scope, session_id, [seen]).get(seen)
        if not _at_on_path(row, made_count - 1):
            return False
    if reset and standing.get("source") != "host":
        # A built-in compaction made further on that does not stand on this reset (or a later one) did not
        # know of it: it summarised the conversation before the reset, and kept in force, it showed that
        # again (the plugin tells a reset when it reads it in the host's transcript, maybe after the
        # service compacted). The reset is a boundary no compaction that did not read it undoes.
        under = standing.get(RESET_UNDER)
        known = under.get("made_at_count") if isinstance(under, dict) else None
        if not isinstance(known, int) or known < count:
            return False
    if made_count != count:
        return made_count > count
    if reset:
        # A host's reset made after as many messages as the compaction in force ends the context that
        # compaction summarised (the host's context starts again at the reset): it is the newer boundary.
        return False
    if made_ms is not None and compacted_ms is not None:
        return made_ms > compacted_ms
    return True


def _dated(c: Core, scope: str, session_id: str, pointer: dict[str, Any]) -> dict[str, Any]:
    """The pointer with its ``created_ms``: a pointer written before it had one is dated by its state row's
    last write (a pointer is written only by a compaction), read only for such a pointer. Without it the
    legacy engine showed the summary and answered ``compacted_at_ms`` null, "nothing compacted"."""
    if isinstance(pointer.get("created_ms"), int):
        return pointer
    written = c.conn.execute(
        select(engine_state.c.updated_us).where(
            engine_state.c.scope == scope, engine_state.c.session_id == session_id,
            engine_state.c.engine_id == STATE_OWNER, engine_state.c.key == STATE_KEY,
        )
    ).scalar()
    return pointer if written is None else {**pointer, "created_ms": int(written) // 1000}


def record_host_compaction(
    c: Core,
    scope: str,
    session_id: str,
    *,
    summary: str,
    first_kept_position: int,
    first_kept_entry_id: str | None,
    compacted_ms: int | None = None,
    compacted_at_count: int | None = None,
    reset: bool = False,
) -> dict[str, Any]:
    """Record a compaction a host made of its own transcript (OpenClaw's, which an engine that does not own
    compaction delegates to it) as the session's pointer, in the caller's write transaction.

    The host keeps every message where it was (its compaction is a marker, not a rewrite), so the mirror
    does too: the pointer says which visible position the summary stands in front of. A position past the
    mirror's end is ``MirrorConflict("behind")`` (import first); the mirror's end itself names the message
    the host is about to commit (a compaction inside a turn that kept only that turn). Below it, the
    mirror's message there must be the host's (its id, one derived from it, or a turn's middle message,
    which the mirror holds without the host's id): another one is ``MirrorConflict("behind")`` too (the
    host's transcript moved under the mirror: import first). The same compaction recorded again (same
    summary and first kept message) changes nothing while it is in force, its time included.
    ``compacted_ms``: when the host made it, and ``compacted_at_count``: how many of the host's visible
    messages preceded it (a compaction found in its transcript later, not one made just now: more than the
    mirror holds is ``MirrorConflict("behind")``, fewer than ``first_kept_position`` ``InvalidInput``); the
    session's compaction still in force that is newer (``_standing_is_newer``: by where in the conversation each was
    made) stays, and is what is returned. The pointer notes where the compaction was made (``_made_at``;
    one made just now: after the mirror's last message), which decides the branch it stands on
    (``pointer_in``).

    ``reset``: the host reset its context in the same transcript (OpenClaw's /new, /reset, an idle or daily
    reset): no summary, its context starts again at ``first_kept_position`` (the messages after the reset,
    or a tail before it the reset kept). A reset that kept none of the messages before it names no first
    kept message (``first_kept_entry_id`` None; the host may not have written the next one yet): it stands
    while the mirror's branch holds the last message it was made after (``compacted_at_count`` of them,
    which is then its position). A compaction in force made at the same point is older than the reset.
    """
    if not isinstance(reset, bool):
        raise InvalidInput(f"reset must be true or false, got {reset!r}")
    if reset and summary != "":
        # (One of blanks was shown as an empty summary message in front of the context after the reset.)
        raise InvalidInput("a host reset carries no summary (an empty one)")
    if not reset and (not isinstance(summary, str) or not summary.strip()):
        raise InvalidInput("a host compaction needs its summary")
    if not summary.isascii():
        try:
            summary.encode("utf-8")
        except UnicodeEncodeError:
            # (Refused by the driver, as an untyped UnicodeEncodeError, when the pointer was written.)
            raise InvalidInput("a host compaction's summary must not contain lone surrogates") from None
    # Checked as the service checks it: a NUL stored in the pointer was sent with every later read of it (each
    # assemble), which PostgreSQL refuses (StoreUnavailable, for good) where SQLite found nothing.
    check_id("first_kept_entry_id", first_kept_entry_id, optional=True)
    if first_kept_entry_id is None and not (reset and compacted_at_count == first_kept_position):
        raise InvalidInput(
            "a host compaction needs its first kept message (only a reset that kept none, at compacted_at_count, "
            "names none)"
        )
    sess = c.require_session(scope, session_id, lock=True)
    visible = int(sess.visible_count)
    if isinstance(first_kept_position, bool) or not isinstance(first_kept_position, int) or first_kept_position < 0:
        raise InvalidInput(f"first_kept_position must be a position, got {first_kept_position!r}")
    if first_kept_position > visible:
        raise MirrorConflict(
            "behind", f"the first kept message is at position {first_kept_position}; the mirror holds {visible}"
        )
    if compacted_ms is not None and (isinstance(compacted_ms, bool) or not isinstance(compacted_ms, int)):
        raise InvalidInput(f"compacted_ms must be a time in milliseconds, got {compacted_ms!r}")
    if compacted_at_count is not None and (
        isinstance(compacted_at_count, bool) or not isinstance(compacted_at_count, int) or compacted_at_count < 0
    ):
        raise InvalidInput(f"compacted_at_count must be a count of messages, got {compacted_at_count!r}")
    if compacted_at_count is not None and compacted_at_count > visible:
        # Stored, it named no last message (it stood on every branch) and was further on than any compaction
        # found later: each of them was refused from then on.
        raise MirrorConflict(
            "behind", f"the compaction was made after {compacted_at_count} messages; the mirror holds {visible}"
        )
    if compacted_at_count is not None and first_kept_position > compacted_at_count:
        raise InvalidInput(
            f"compacted_at_count {compacted_at_count} is before the first kept message (position "
            f"{first_kept_position}): a compaction keeps messages made before it"
        )
    kept, row = first_kept_entry_id, None
    if first_kept_position < visible and first_kept_entry_id is not None:
        seq = c.path_seq_at_position(scope, session_id, first_kept_position)
        row = None if seq is None else c.entry_by_seq(scope, session_id, seq)
        if row is None:  # pragma: no cover - positions below the visible count always exist
            raise MirrorConflict("behind", f"no visible message at position {first_kept_position}")
        if not mirror.host_id_fits(c.config, first_kept_entry_id, row, unnamed=True):
            # Taken by position alone, the summary stood in front of a message the host never kept.
            raise MirrorConflict(
                "behind",
                f"position {first_kept_position} holds entry {row.entry_id!r}, not the host's "
                f"{first_kept_entry_id!r}: the host's transcript moved under the mirror",
            )
        kept = str(row.entry_id)
    standing = pointer_in(c, scope, session_id)
    # A reset told again may stand under a compaction made after it (``reset_under``), at the same point
    # when no message came between: taken for a newer reset, it replaced that compaction, and the context
    # grew back by all it had summarised. So may a compaction of the host's, under a built-in one made after it
    # (``host_under``).
    told = reset_under(standing) if reset else host_under(standing)
    if (
        standing is not None
        and told is not None
        and told.get("source") == "host"
        and _summarises(told, summary)
        and told.get("first_kept_position") == first_kept_position
        and bool(told.get("reset")) == reset
        and _keeps_the_same(c.config, told, kept, first_kept_entry_id, row)
    ):
        # The same compaction told again (a plugin finds it in the host's transcript at every bootstrap of
        # a new process): it keeps the time it was recorded at, which decides the replies whose signed
        # thinking predates it. Recorded anew, every reply since the compaction lost its thinking. One not
        # in force (made on a branch the mirror left) is not that one: an alike one made on this branch
        # (resets, which have no summary, are all alike at a position) changed nothing and never stood.
        return dict(standing)
    boundary = reset_under(standing)
    if standing is not None and boundary is not None and first_kept_position < int(boundary["first_kept_position"]):
        # The host's context after the reset in force does not hold the messages before the reset's first
        # kept one: a compaction (or reset) keeping one of them was made before that reset (found later
        # without saying so, or with a clock ahead). Recorded, its pointer carried the reset under it but
        # stood in front of its own first kept message, and the conversation before the reset came back.
        return dict(standing)
    found_later = compacted_ms is not None or compacted_at_count is not None
    newer = (
        standing is not None
        and found_later
        and _standing_is_newer(c, scope, session_id, standing, compacted_ms, compacted_at_count, reset)
    )
    if newer and not reset:
        # An older compaction a plugin finds in the host's transcript (a new process reads it from its
        # start) put back in place of a newer one: its summary covered less, and the context grew back by
        # what the newer one had compacted.
        return dict(standing)  # type: ignore[arg-type]
    # The store's payload cap, measured as an entry's is (its JSON text in UTF-8): the pointer holding the summary
    # is read with every assembly, and a summary of millions of characters went in whatever the cap. Checked
    # only here, where it would be written: one stored before (an older release, a cap lowered since) is told
    # again at every bootstrap of a new process, and refused above the returns, every such bootstrap failed.
    size = len(stored_text(summary).encode("utf-8"))
    if size > c.config.max_payload_bytes:
        raise PayloadTooLarge(
            f"a host compaction's summary is {size} bytes, over the cap of {c.config.max_payload_bytes}"
        )
    pointer = {
        "summary": summary,
        "first_kept_entry_id": kept,
        "first_kept_position": first_kept_position,
        "created_ms": now_us() // 1000,
        "source": "host",
        **({"reset": True} if reset else {}),
        **({"host_ms": compacted_ms} if compacted_ms is not None else {}),
        **_made_at(c, scope, session_id, visible if compacted_at_count is None else compacted_at_count),
        # (A reset is the newest boundary itself: it carries none. It names the host's compaction it was made
        # after, as a built-in compaction does: told again, that one is older than the reset.)
        **(_named(standing) if reset else _carried(standing)),
    }
    if newer:
        # A reset found after a compaction the host made further on (which knew of it) stays under that
        # compaction, as one told first is carried (``_carried``): left out, the compaction's pointer was all
        # there was, and once it left the mirror's branch (where the reset stands) the conversation before
        # the reset came back.
        assert standing is not None
        under = reset_under(standing)
        known = under.get("made_at_count") if under is not None else None
        if standing.get("reset") or (isinstance(known, int) and known >= pointer["made_at_count"]):
            return dict(standing)
        carrying = {**standing, RESET_UNDER: pointer}
        put_state(c, scope, session_id, STATE_OWNER, STATE_KEY, carrying)
        return carrying
    if reset:
        _keep_host(c, scope, session_id, get_state(c, scope, session_id, STATE_OWNER, STATE_KEY), pointer)
    put_state(c, scope, session_id, STATE_OWNER, STATE_KEY, pointer)
    return pointer


def _keep_host(c: Core, scope: str, session_id: str, replaced: Any, pointer: dict[str, Any]) -> None:
    """Keep the host's compaction a new pointer replaces under ``HOST_KEY`` when the new one names it by digest
    (``_named``), for ``_host_under_standing`` to fall back to.

    Written then only: while the host's compaction is the pointer, the pointer holds its summary, and a copy
    written with every host compaction stored each summary twice."""
    named = pointer.get(HOST_UNDER)
    if (
        isinstance(replaced, dict)
        and replaced.get("source") == "host"
        and not replaced.get("reset")
        and isinstance(named, dict)
        and isinstance(replaced.get("summary"), str)
        and isinstance(named.get("summary_sha256"), str)
        and _summarises(named, replaced["summary"])
        and named.get("first_kept_entry_id") == replaced.get("first_kept_entry_id")
    ):
        put_state(c, scope, session_id, STATE_OWNER, HOST_KEY, replaced)


def _keeps_the_same(
    config: StoreConfig, told: dict[str, Any], kept: str | None, host_id: str | None, row: Any
) -> bool:
    """Whether a pointer at the position of a compaction told now names its first kept message: the mirror's
    entry ``kept`` there, or the host's id ``host_id`` of it when the mirror's entry there (``row``) is held
    under an id derived from the host's, as ``_standing`` takes it."""
    named = told.get("first_kept_entry_id")
    if named == kept:
        return True
    # Recorded when the mirror did not hold that message yet, the pointer names the host's id; committed
    # since, the message may be mirrored under an id derived from it (the host's id names a message off the
    # active branch). Not taken for the same, the one told again was recorded anew: a new time, which lost
    # every reply since its signed thinking, or a reset put in place of the compaction made after it. A
    # message derived from no host id (a turn's middle one) is not where such a pointer stands (``_standing``).
    if host_id is None or named != host_id or row is None:
        return False
    return mirror.host_id_fits(config, host_id, row, unnamed=False)


def split_point(entries: Sequence[Entry], keep_last: int) -> int:
    """Index of the first kept entry: the last ``keep_last`` messages the model is shown (hidden ones not
    counted), never splitting a tool call from its result."""
    # Counted among the kept, hidden messages (never shown, never summarised) took the place of the shown ones:
    # a hidden exchange at the end left the model none verbatim after the summary.
    cut, kept = len(entries), 0
    while cut > 0 and kept < keep_last:
        cut -= 1
        kept += not out_of_context(entries[cut].message or {})
    # Move the cut earlier while it would orphan tool (or function) results from the call that made them:
    # while the first kept message the model is shown is a result. A hidden message (``out_of_context``)
    # between a call and its result is not where the kept part may begin either: cut there, the call was
    # summarised and its result kept.
    while 0 < cut < len(entries) and _opens_on_a_result(entries, cut):
        cut -= 1
    return cut


def _opens_on_a_result(entries: Sequence[Entry], at: int) -> bool:
    """Whether the first message from ``entries[at]`` on that is not hidden is a tool (or function) result."""
    for e in entries[at:]:
        message = e.message or {}
        if not out_of_context(message):
            return message.get("role") in RESULT_ROLES
    return False


def _start(config: StoreConfig, pointer: dict[str, Any] | None, visible: Sequence[Entry]) -> int | None:
    """Where the messages a compaction may summarise start among ``visible``: at the pointer's first kept
    one (0 without a pointer; ``len(visible)`` when it stands right after them); None when that is not
    among them."""
    if pointer is None:
        return 0
    at = int(pointer["first_kept_position"])
    kept = pointer["first_kept_entry_id"]
    if kept is None:
        # A host's reset that kept nothing before it: the messages from its position on are what is left.
        return at if at <= len(visible) else None
    found = next((i for i, e in enumerate(visible) if e.entry_id == kept), None)
    if found is None and at == len(visible):
        # The pointer stands (``pointer_in``) in front of the message right after those read: a host's
        # compaction that kept only the turn it ran in (a message the mirror does not hold yet, or the
        # running turn's admitted one, behind the fence), or one made over the admitted message. Its summary
        # is all there is before it, as the assembly shows it: nothing older is left to compact. Not found,
        # the messages its summary stood for were summarised again from the first without it, and the
        # newest of them shown again.
        return at
    if found is not None or pointer.get("source") != "host" or at >= len(visible):
        return found
    # A host's compaction (or reset) that kept only the turn it ran in names the host's id of that turn's
    # message, which the mirror may hold under an id derived from it (``_standing`` takes it there by its
    # position): looked up by id alone, a reset standing on it was never found and the compaction wrote
    # nothing while it stood; a compaction's summary was not carried on. Never past the messages read.
    return at if mirror.entry_fits(config, kept, visible[at], unnamed=False) else None


SUMMARY_HEAD = "[Summary of the earlier conversation]\n"


def summary_message(summary: str) -> dict[str, Any]:
    """The message the model sees in place of the summarized history."""
    return {"role": "user", "content": SUMMARY_HEAD + summary}


def check_keep_last(value: object, where: str = "") -> int:
    """``keep_last`` as compaction takes it: an integer of at least 1, never a bool, a float or a string
    (``int()`` would turn "12" and 2.5 into counts nobody wrote); InvalidInput otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInput(f"{where}keep_last must be an integer of at least 1, got {value!r}")
    return value


#: the legacy engine's ``[engine.config.legacy]`` keys
LEGACY_KEYS = ("keep_last", "max_sessions")
#: the legacy engine's projections kept, unless ``[engine.config.legacy] max_sessions`` says otherwise
MAX_SESSIONS = 256


def check_legacy_config(config: Mapping[str, Any]) -> tuple[int, int]:
    """``[engine.config.legacy]`` checked whole, as the legacy engine and the host take it: its
    ``(keep_last, max_sessions)``; InvalidInput naming the first unknown key or bad count."""
    # One check for both: the legacy engine is every host's fallback and never quarantined, so a mistake
    # here found only by its factory at the first turn failed every turn of a chat or serve that started.
    unknown = sorted(set(config) - set(LEGACY_KEYS))
    if unknown:
        raise InvalidInput(f"legacy config: unknown key {unknown[0]!r} (expected {', '.join(LEGACY_KEYS)})")
    keep_last = check_keep_last(config.get("keep_last", KEEP_LAST), "legacy config: ")
    max_sessions = config.get("max_sessions", MAX_SESSIONS)
    if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
        raise InvalidInput(f"legacy config: max_sessions must be an integer of at least 1, got {max_sessions!r}")
    return keep_last, max_sessions


def compact_session(
    store: Any,
    scope: str,
    session_id: str,
    *,
    summarizer: Any,
    estimator: Any,
    fence: Anchor | None = None,
    keep_last: int = KEEP_LAST,
    focus: str | None = None,
    force: bool = False,
    token_budget: int | None = None,
    backoff: SummaryBackoff | None = None,
) -> CompactResult:
    """Summarize the older visible messages of a session (see module doc); InvalidInput for bad arguments,
    before anything is read or written. With ``backoff``, an automatic compaction (not ``force``) of a
    session whose summarizer failed lately is skipped (ok False, nothing called or written), and the
    summarizer's outcome is recorded in it."""
    # Checked here, not only by the legacy engine's compact: an engine delegating to the runtime (and any
    # library caller) reaches this directly, and a force of "no" forced a compaction, a string budget or a
    # lone surrogate in the scope raised TypeError or UnicodeEncodeError.
    check_call(scope, session_id, fence=fence)
    check_flag("force", force)
    check_focus(focus)
    check_token_budget(token_budget, optional=True)
    if not callable(getattr(summarizer, "summarize", None)):
        raise InvalidInput(f"summarizer must have a summarize method, not be {type(summarizer).__name__}")
    if not callable(getattr(estimator, "count_messages", None)):
        raise InvalidInput(f"estimator must have a count_messages method, not be {type(estimator).__name__}")
    check_keep_last(keep_last)
    # The state as read (valid or not) is what the write compares against, in the session of the
    # incarnation read with it: see run() below.
    state, pointer, incarnation = store.read(
        lambda c: (
            get_state(c, scope, session_id, STATE_OWNER, STATE_KEY),
            pointer_in(c, scope, session_id),
            getattr(c.session_row(scope, session_id), "incarnation", None),
        )
    )
    visible: list[Entry] = store.read_visible(scope, session_id, fence=fence)
    start = _start(store.config, pointer, visible)
    if start is None:
        # The pointer's first kept entry is not among these messages (after the fence, or the path moved
        # between the two reads): its summary covers messages this compaction would keep verbatim (or
        # that left the path), so it is not carried on. What follows a host's reset under it is what is
        # left, else the messages are summarized again from the first.
        pointer = reset_under(pointer)
        start = _start(store.config, pointer, visible)  # 0 without a reset
        if start is None:
            # The reset stands but is not among these messages either: summarising from the first would
            # write a pointer without it, and the conversation before the reset would come back.
            return CompactResult(
                ok=True,
                compacted=False,
                reason="the host's reset is not among the messages read (at or after the fence, or the branch "
                "moved); nothing was written",
            )
    live = visible[start:]
    # What the host keeps out of the model's context is neither counted nor summarized (a hidden prompt
    # written into a summary reached the model at every later turn).
    shown = [e.message for e in live if e.message and not out_of_context(e.message)]
    previous = (pointer["summary"] or None) if pointer else None  # a host's reset has none
    before_msgs = ([summary_message(previous)] if previous else []) + shown
    tokens_before = int(estimator.count_messages(before_msgs))
    if not force and token_budget is not None and tokens_before <= token_budget:
        return CompactResult(ok=True, compacted=False, reason="under budget", tokens_before=tokens_before)
    cut = split_point(live, keep_last)
    older = [e.message for e in live[:cut] if e.message and not out_of_context(e.message)]
    if cut == 0 or not older:
        return CompactResult(
            ok=True, compacted=False, reason="nothing old enough to compact", tokens_before=tokens_before
        )
    key = (scope, session_id)
    paused = backoff.paused(key) if backoff is not None and not force else None
    if paused is not None:
        # The summarizer failed lately: tried at every turn over the threshold, a down summary model cost each
        # its whole timeout. The raw messages stay, as after the failure itself.
        return CompactResult(ok=False, compacted=False, reason=paused, tokens_before=tokens_before)
    try:
        summary = summary_text(summarizer.summarize(older, previous_summary=previous, focus=focus))
        if not summary:
            # An empty summary in place of the older messages would drop them from every context.
            raise SummarizerError("the summarizer returned an empty summary")
    except Exception as e:
        # A failing summarizer never loses messages: nothing changes, the raw messages stay. A pluggable
        # summarizer's own bug is a failed compaction too, never an untyped error.
        failure = f"summarizer failed: {e}" if isinstance(e, SummarizerError) else (
            f"summarizer failed: {type(e).__name__}: {e}"
        )
        if backoff is not None:
            backoff.failed(key, failure)
        return CompactResult(ok=False, compacted=False, reason=failure, tokens_before=tokens_before)
    if backoff is not None:
        backoff.succeeded(key)
    kept = live[cut]
    after_msgs = [summary_message(summary)] + [
        e.message for e in live[cut:] if e.message and not out_of_context(e.message)
    ]
    tokens_after = int(estimator.count_messages(after_msgs))
    if tokens_after >= tokens_before:
        return CompactResult(
            ok=True,
            compacted=False,
            reason="summary did not shrink the context",
            tokens_before=tokens_before,
            tokens_after=tokens_before,
        )
    payload: dict[str, Any] = {
        "summary": summary,
        "first_kept_entry_id": kept.entry_id,
        "summarized_entry_ids": [e.entry_id for e in live[:cut]],
        "tokens_before": tokens_before,
        "tokens_after": tokens_after,
        "focus": focus,
    }
    try:
        marker = prepare_entry(store.config, kind="compaction", payload=payload)
    except PayloadTooLarge:
        # Every summarized id over the store's payload cap (a long session never compacted, a small cap):
        # the first one and how many instead (they are the path's messages before the first kept one).
        del payload["summarized_entry_ids"]
        payload["summarized_from_entry_id"] = live[0].entry_id
        payload["summarized_count"] = cut
        try:
            marker = prepare_entry(store.config, kind="compaction", payload=payload)
        except PayloadTooLarge as e:
            return CompactResult(
                ok=False,
                compacted=False,
                reason=f"the compaction entry (summary, focus) is too large to store: {e}",
                tokens_before=tokens_before,
            )
    new_pointer = {
        "summary": summary,
        "first_kept_entry_id": kept.entry_id,
        "first_kept_position": kept.position,
        "marker_entry_id": marker.entry_id,
        "created_ms": now_us() // 1000,
        # Where it was made (after the last message it read), for a host's compaction found later
        # (record_host_compaction): compared by that, not across the host's and the service's clocks.
        "made_at_count": len(visible),
        "seen_entry_id": visible[-1].entry_id,
        **_carried(pointer),
        **_named(pointer),
    }

    landed: list[bool] = []  # an attempt ran to its end

    def run(c: Core) -> str | None:
        # Compare and set under the session's row lock: a compaction that wrote since our read (another
        # thread or worker, over a longer transcript, say) stands; ours, planned on the older state,
        # would put a less compacted pointer back in its place.
        sess = c.session_row(scope, session_id, lock=True)  # None: no such session any more (append raises)
        if sess is None or sess.incarnation != incarnation:
            if landed:
                # An earlier attempt ran to its end and only its COMMIT was uncertain; the session was
                # deleted since, perhaps made again under the id: that compaction, never one in this one.
                return None
            if sess is not None:
                # Deleted and made again under the id since the read: the new session's pointer (none,
                # say) may well be the one read, but the summary is of another conversation.
                return "the session was deleted and made again while it was summarized; nothing was written"
        current = get_state(c, scope, session_id, STATE_OWNER, STATE_KEY) if sess is not None else state
        if current != state and current != new_pointer:
            # (This very pointer, its marker's id drawn before the transaction, is an earlier attempt's,
            # whose COMMIT landed and was reported lost. The retry is that compaction, not a later one.)
            return "another compaction of the session was written first; its summary stands"
        if current != state:
            return None
        if sess is not None and not _at_on_path(
            c.entries_with_path(scope, session_id, [kept.entry_id]).get(kept.entry_id),
            -1 if kept.position is None else kept.position,  # (a visible message always has one)
        ):
            # The first kept message left the active path while it was summarized (another client moved
            # the head back: an edit, a branch). Written, the pointer stood nowhere, and the one in force
            # (still standing) was gone with it: the context grew back by all that one had summarized.
            return "the transcript moved while it was summarized (a branch or an edit); nothing was written"
        c.append(scope, session_id, [marker])
        _keep_host(c, scope, session_id, current, new_pointer)
        put_state(c, scope, session_id, STATE_OWNER, STATE_KEY, new_pointer)
        landed[:] = [True]
        return None

    refused = store.write(run)
    if refused is not None:
        return CompactResult(ok=True, compacted=False, reason=refused, tokens_before=tokens_before)
    return CompactResult(ok=True, compacted=True, tokens_before=tokens_before, tokens_after=tokens_after)
