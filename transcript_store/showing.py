"""What `sessions show` reads and prints: a session and its entries from ONE snapshot, a page at a time.

The session was looked up in one read and its entries read in others (``--all``: one per 10,000
entries), so a write landing in between printed a header of one moment over entries of another, or
pages of two branches. Everything here runs inside the caller's read transaction. The JSON document is
written a page at a time, the same bytes ``json.dumps(document, indent=2)`` gives: built whole, it took
about 10 KB of memory per entry (810 MB of RSS for 80,000 entries of 1 KB, 77 MB now).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from sqlalchemy.engine import Row

from . import transfer
from .core import Core, entry_from_row, session_info
from .errors import UnknownSession
from .models import Entry, SessionInfo

#: the ended sessions an unknown session key's error names (the latest ended)
ENDED_NAMED = 3


def session_in(c: Core, scope: str, ref: str) -> Row[Any]:
    """The session ``ref`` names, an id else a session key, in the caller's transaction; UnknownSession."""
    row = c.session_row(scope, ref)
    if row is None:
        row = c.find_session_by_key(scope, ref)
    if row is None:
        ended = c.ended_sessions_by_key(scope, ref, ENDED_NAMED)
        raise UnknownSession(scope, ref, [s.session_id for s in ended])
    return row


def entry_pages(c: Core, scope: str, session_id: str, *, every: bool) -> Iterator[list[Entry]]:
    """The visible entries (``every``: every stored one, marked active or not) in order, a page at a time,
    each as long as the export's byte budget holds by the entries' stored sizes (read first)."""
    # Pages for the payload cap's worst case (16 entries at 4 MiB) took 375 reads for 6,000 small
    # entries, about 5,000 for 80,000: a page now holds what the stored sizes let it, as an export's.
    if every:
        for stored in transfer.row_pages(c, scope, session_id):
            yield [entry_from_row(r, a) for r, a in stored]
        return
    visible = transfer.sized_pages(
        c,
        lambda after, limit: c.visible_sizes(scope, session_id, after, limit),
        lambda after, limit: c.visible_rows(scope, session_id, after, None, limit),
        lambda row: int(row.position),  # a visible entry has a position: the next page starts after it
    )
    for rows in visible:
        yield [entry_from_row(r, True) for r in rows]


def _dumps(value: Any, ascii_only: bool = False) -> str:
    return json.dumps(value, indent=2, ensure_ascii=ascii_only, default=str)


def document_chunks(
    session: dict[str, Any], pages: Iterable[list[dict[str, Any]]], *, ascii_only: bool = False
) -> Iterator[str]:
    """``json.dumps({"session": session, "entries": [...]}, indent=2, ensure_ascii=ascii_only)`` and a line
    break, in pieces.

    An entry of the list is its own indented dump shifted two levels: JSON text holds a line break only
    between tokens (one in a string is escaped), so shifting every line is exact."""
    head = _dumps({"session": session}, ascii_only)
    yield head[: -len("\n}")] + ',\n  "entries": ['
    count = 0
    for page in pages:
        if page:
            text = ",\n    ".join(_dumps(e, ascii_only).replace("\n", "\n    ") for e in page)
            yield (",\n    " if count else "\n    ") + text
            count += len(page)
    yield ("\n  ]" if count else "]") + "\n}\n"


def write_json_in(
    c: Core, scope: str, ref: str, out: BinaryIO, *, every: bool, encoding: str, errors: str,
    ascii_only: bool = False,
) -> SessionInfo:
    """Write the JSON document of the session ``ref`` names to the seekable ``out`` (emptied first: a
    read retried after a transient error writes it again), encoded as given (``ascii_only``: non-ASCII
    characters as ``\\u`` escapes); returns the session."""
    out.seek(0)
    out.truncate()
    info = session_info(session_in(c, scope, ref))
    encoder = codecs.getincrementalencoder(encoding)(errors)
    pages = ([e.model_dump(mode="json") for e in p] for p in entry_pages(c, scope, info.session_id, every=every))
    for chunk in document_chunks(info.model_dump(mode="json"), pages, ascii_only=ascii_only):
        out.write(encoder.encode(chunk))
    out.write(encoder.encode("", final=True))
    return info


def read_all_in(c: Core, scope: str, ref: str, *, every: bool) -> tuple[SessionInfo, list[Entry]]:
    """The session ``ref`` names and its entries (every stored one with ``every``), in the caller's snapshot."""
    info = session_info(session_in(c, scope, ref))
    return info, [e for page in entry_pages(c, scope, info.session_id, every=every) for e in page]
