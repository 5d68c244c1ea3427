"""Messages an earlier release stored and today's Chat Completions rules refuse (an empty tool_calls or
content list, a function message without a name, a tool call of another type, an image_url part without
its url): a store keeps holding them after an upgrade, so an export of it imports again and a turn of
them commits; a new append of one is still refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import user
from sqlalchemy import update

from transcript_store import ClosedRange, InvalidMessage, TranscriptStore
from transcript_store.schema import entries
from transcript_store.turns import Turns

A = "scope-a"
B = "scope-b"


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    """A fresh session of scope A."""
    return store.create_session(A, session_id="s1").session_id

EARLIER: list[dict[str, Any]] = [
    {"role": "assistant", "content": "calling nothing", "tool_calls": []},
    {"role": "assistant", "content": []},
    {"role": "function", "content": "result of an unnamed function"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "custom", "function": {"name": "f", "arguments": "{}"}}],
    },
    {"role": "assistant", "content": [{"type": "image_url", "image_url": {}}]},
]


def _stored_by_an_earlier_release(store: TranscriptStore, sid: str) -> list[str]:
    """A turn of ``EARLIER`` replies written as the earlier release wrote them (the entries' text by SQL
    over valid placeholders): their entry ids."""
    placeholder = {"message": {"role": "assistant", "content": "x"}}
    added = store.append_many(A, sid, [{"message": user("q")}] + [placeholder] * len(EARLIER))
    with store.db.engine.begin() as conn:
        for entry, message in zip(added[1:], EARLIER, strict=True):
            text = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
            conn.execute(
                update(entries)
                .where(entries.c.scope == A, entries.c.session_id == sid, entries.c.entry_id == entry.entry_id)
                .values(payload=text, size_bytes=len(text.encode("utf-8")), role=message["role"])
            )
    return [e.entry_id for e in added]


@pytest.mark.parametrize("message", EARLIER, ids=["empty-tool-calls", "empty-content", "unnamed-function",
                                                  "custom-call", "image-without-url"])
def test_a_new_message_in_an_earlier_form_is_still_refused(store: TranscriptStore, sid: str, message: Any) -> None:
    """The relaxation is for what a store holds, not for new appends."""
    with pytest.raises(InvalidMessage):
        store.append(A, sid, message=message)


def test_an_export_holding_earlier_forms_imports_again(store: TranscriptStore, sid: str) -> None:
    """An export made after the upgrade of a store whose session holds them was refused by the import
    ('tool_calls: List should have at least 1 item'): the backup of such a session could not be restored."""
    _stored_by_an_earlier_release(store, sid)
    header, records = store.export_session(A, sid)
    assert [r["message"] for r in records[1:]] == EARLIER
    store.import_session(B, header, records)
    assert store.export_session(B, sid)[1] == records
    # A message in no form any release stored is still refused by the import.
    forged = [dict(r) for r in records]
    forged[1] = {**forged[1], "message": {"role": "tool", "content": "no call id"}}
    forged[1]["size_bytes"] = len(json.dumps(forged[1]["message"], separators=(",", ":")).encode())
    with pytest.raises(InvalidMessage):
        store.import_session("scope-c", header, forged)


def test_a_turn_of_earlier_forms_commits(store: TranscriptStore, sid: str) -> None:
    """commit_turn validated the turn's messages by today's rules before comparing them with the
    transcript: a turn an earlier release stored could not be committed by an engine after the upgrade."""
    ids = _stored_by_an_earlier_release(store, sid)
    admission, terminal = store.anchor(A, sid, ids[0]), store.anchor(A, sid, ids[-1])
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange) and closed.messages[1:] == EARLIER
    turns = Turns(store)
    assert turns.commit_turn("e", "k1", admission, terminal, closed.messages).status == "committed"
    assert turns.commit_turn("e", "k1", admission, terminal, closed.messages).status == "duplicate"
