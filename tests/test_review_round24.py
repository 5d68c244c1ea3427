"""Findings of the twenty-fourth review round (hostile input against the public API, a new user's walk
through the README).

Each test failed before its fix.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import module_store_fixtures, user
from test_compaction_focus import everything
from test_host import make_host

from transcript_store import InvalidInput, TranscriptStore, UnknownSession
from transcript_store.turns import Turns

S = "round-24"
E = "engine-1"

shared_url, store, sid = module_store_fixtures(S, "round-24")


class LyingStr(str):
    """A str whose ``encode`` hides a lone surrogate."""

    def encode(self, *_a: Any, **_k: Any) -> bytes:  # type: ignore[override]
        return b"x"


class LyingInt(int):
    """An int whose ``bit_length`` hides its 5,000 digits."""

    def bit_length(self) -> int:
        return 1


@pytest.mark.parametrize(
    "call",
    [
        lambda s, sid: s.append(S, sid, kind="custom", payload={"k": LyingStr("\ud800")}),
        lambda s, sid: s.append(S, sid, {"role": "user", "content": "x", "k": LyingStr("\ud800")}),
        lambda s, sid: s.append(S, sid, {"role": "user", "content": "x", "n": LyingInt(10**5000)}),
        lambda s, sid: s.append(S, sid, kind="custom", payload={"n": LyingInt(10**5000)}),
    ],
    ids=["payload-str", "message-str", "message-int", "payload-int"],
)
def test_str_and_int_subclasses_cannot_hide_what_json_cannot_carry(store: TranscriptStore, sid: str, call: Any) -> None:
    """The check called the value's own ``encode`` / ``bit_length``: a subclass overriding them passed,
    and the JSON writer raised a bare UnicodeEncodeError or ValueError."""
    before = everything(store)
    with pytest.raises(InvalidInput):
        call(store, sid)
    assert everything(store) == before


@pytest.mark.parametrize("owner", ["a\x1b[31mb", "line\nbreak", "del\x7f", "nel\x85"])
def test_a_lease_owner_with_control_characters_is_refused(store: TranscriptStore, sid: str, owner: str) -> None:
    """The message said "no control characters"; only NUL and lone surrogates were refused, and an
    owner with a terminal escape was written to the outbox (and printed by `outbox status`)."""
    before = everything(store)
    with pytest.raises(InvalidInput, match="control characters"):
        Turns(store).admit(S, sid, user("q"), turn_id="t1", engine_id=E, owner=owner)
    assert everything(store) == before


@pytest.mark.parametrize("turn_id", ["", 0, []])
def test_run_turn_refuses_an_empty_turn_id(store: TranscriptStore, sid: str, turn_id: Any) -> None:
    """``if turn_id:`` took "" (or 0, []) for "none given" and drew a new id: the same call made again,
    a retry by its caller's account, stored a second turn."""
    host, _ = make_host(store)
    before = everything(store)
    with pytest.raises(InvalidInput, match="turn_id"):
        host.run_turn(S, sid, "hello", turn_id=turn_id)
    assert everything(store) == before
    host.dispose()


def test_receipts_and_recover_refuse_an_unknown_or_foreign_session(store: TranscriptStore, sid: str) -> None:
    """Both answered empty for a session the scope does not hold, where every other session call
    raises UnknownSession."""
    turns = Turns(store)
    assert turns.receipts(S, sid) == []  # the session's own (empty) ledger
    for scope, session in (("another-scope", sid), (S, "no-such-session")):
        with pytest.raises(UnknownSession):
            turns.receipts(scope, session)
        with pytest.raises(UnknownSession):
            turns.recover(scope, session, E, lambda _engine: None)
    report = turns.recover(S, sid, E, lambda _engine: None)
    assert report.discarded == [] and report.queued == []
