"""Transcript cursors: opaque, canonical, versioned tokens of a reader's position.

A cursor names the scope, session and generation it was issued for, the session's incarnation
(``SessionInfo.incarnation``: a session deleted and created or imported again under the same id is
another session, and an old cursor must not be honoured on it), and the last visible message it
covered (raw seq and active position; -1/-1 before the first). Format 2 (``tsc2.``) added the incarnation. Format-1
tokens (``tsc1.``, issued before) are still read, without the incarnation check, so that cursors
engines keep in their own tables survive the upgrade; every cursor the store issues is format 2.

It is an encoding, not a secret: a forged cursor that decodes can only point at entries of the caller's
own session, and the reader re-validates it against the active path on every read. Anything that is
not the byte-exact canonical encoding is refused as ``invalid_cursor``.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from .core import MAX_ID_CHARS

PREFIX = "tsc2."
VERSION = 2
_PREFIX_V1 = "tsc1."
_MAX_INT = 2**31 - 1
_MAX_INCARNATION = 2**63 - 1  # a BIGINT


@dataclass(frozen=True)
class CursorState:
    """A decoded cursor."""

    scope: str
    session_id: str
    generation: int
    last_seq: int
    last_position: int
    #: the session's incarnation (``SessionInfo.incarnation``); 0 matches no session; None: a format-1
    #: token, which did not carry it
    incarnation: int | None = 0

    def encode(self) -> str:
        """The canonical token for this state (remembered, so that decoding it again is a lookup)."""
        token = _token(self)
        if len(token) <= _ISSUED_MAX_CHARS and _valid(self):
            if len(_ISSUED) >= _ISSUED_MAX:
                _ISSUED.clear()
            _ISSUED[token] = self
        return token


def _token(state: CursorState) -> str:
    fields: list[object] = [state.scope, state.session_id, state.generation, state.last_seq, state.last_position]
    if state.incarnation is None:
        prefix, fields = _PREFIX_V1, [1, *fields]
    else:
        prefix, fields = PREFIX, [VERSION, *fields[:3], state.incarnation, *fields[3:]]
    body = json.dumps(fields, separators=(",", ":"), ensure_ascii=True)
    return prefix + base64.urlsafe_b64encode(body.encode("ascii")).decode("ascii").rstrip("=")


def _valid(state: CursorState) -> bool:
    """What decoding checks of a state's values (types and ranges)."""
    ints: tuple[object, ...] = (state.generation, state.last_seq, state.last_position)
    if state.incarnation is not None:
        ints += (state.incarnation,)
    if not (isinstance(state.scope, str) and isinstance(state.session_id, str)):
        return False
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ints):
        return False
    if state.generation < 0 or not -1 <= state.last_seq <= _MAX_INT or not -1 <= state.last_position <= _MAX_INT:
        return False
    if state.incarnation is not None and not 0 <= state.incarnation <= _MAX_INCARNATION:
        return False
    return (state.last_seq == -1) == (state.last_position == -1)


#: Tokens this process issued, with their state. A reader presents the cursor of its previous page,
#: which this process issued when the same worker serves it (a long-lived host, an engine in the
#: host's process): decoding it is then a lookup instead of base64, JSON, the checks and a
#: re-encoding (~15 us of a ~450 us PostgreSQL delta page: bench/README.md, "Profiling" 33). Only
#: what ``encode`` produced for a state that decoding accepts is kept, so an entry is its token's
#: canonical decoding; decoding a presented token does not add it. Bounded: at most 4,096 tokens of
#: at most 512 characters (a few MB), emptied when full.
_ISSUED: dict[str, CursorState] = {}
_ISSUED_MAX = 4096
_ISSUED_MAX_CHARS = 512


# The longest cursor the store can issue: two ids of MAX_ID_CHARS astral characters (each escaped to
# 12 ASCII characters by JSON). Anything longer cannot be canonical; anything shorter must be allowed,
# or a session with long non-ASCII ids would get a reset on every read, for ever.
_LONGEST_ID = "\U0010ffff" * MAX_ID_CHARS
MAX_CURSOR_CHARS = len(
    CursorState(_LONGEST_ID, _LONGEST_ID, _MAX_INT, _MAX_INT, _MAX_INT, _MAX_INCARNATION).encode()
)


def start_cursor(scope: str, session_id: str, generation: int, incarnation: int) -> str:
    """The cursor before the first visible message of a generation of one session incarnation."""
    return CursorState(scope, session_id, generation, -1, -1, incarnation).encode()


def decode_cursor(token: object) -> CursorState | None:
    """The state of a canonical cursor, or None for anything else."""
    if type(token) is str:  # a str subclass could compare equal to a token it is not
        issued = _ISSUED.get(token)
        if issued is not None:
            return issued
    if not isinstance(token, str) or len(token) > MAX_CURSOR_CHARS:
        return None
    if token.startswith(PREFIX):
        version, size = VERSION, 7
    elif token.startswith(_PREFIX_V1):
        version, size = 1, 6
    else:
        return None
    raw = token[len(PREFIX) :]
    try:
        body = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
        value = json.loads(body.decode("ascii"))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    if not (isinstance(value, list) and len(value) == size and value[0] == version):
        return None
    if version == 1:
        value = [*value[:4], None, *value[4:]]
    _, scope, session_id, generation, incarnation, last_seq, last_position = value
    state = CursorState(scope, session_id, generation, last_seq, last_position, incarnation)
    # Byte-exact canonical form only: re-encoding must give back the very same token.
    return state if _valid(state) and _token(state) == token else None
