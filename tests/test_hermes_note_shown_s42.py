"""The list a turn hook passes, as the adapter notes it for ``unretried`` (``_note_shown``).

``on_turn_complete`` fingerprinted every message of the list twice a turn: once to note it, once to align it
with the transcript (12 ms and 21 ms at 2,000 messages). It is noted now by the fingerprints the alignment
computes of the copies it stores. What is noted must not change: the list as Hermes holds it at that turn,
each message read again every turn (Hermes changes messages in place: ``_db_persisted``, ``api_content``,
a merged user message), whatever the list holds. Each test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hermes_adapter import conversation, make

from transcript_store.hermes.sessions import shown_digests


def deep(levels: int) -> dict[str, Any]:
    """A tool result whose content part nests ``levels`` deep (past Python's recursion limit: copied by
    ``bounded``, not ``copy.deepcopy``)."""
    inner: Any = "bottom"
    for _ in range(levels):
        inner = {"k": inner}
    return {"role": "tool", "tool_call_id": "call_deep", "content": [{"type": "text", "text": "deep", "x": inner}]}


def varied(tag: str) -> list[dict[str, Any]]:
    """A list of what Hermes' lists hold: a system prompt, marks of its own, ``api_content``, content parts,
    a tool round, a text with a lone surrogate, non-dict items."""
    call = {"id": f"call_{tag}", "type": "function", "function": {"name": "lookup", "arguments": {"q": tag}}}
    return [
        {"role": "system", "content": "you are helpful"},
        {"role": "user", "content": f"{tag} hello", "api_content": f"{tag} hello\n\n<memory-context>x</memory-context>",
         "_db_persisted": True},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": None},
        {"role": "tool", "tool_call_id": f"call_{tag}", "name": "lookup",
         "content": [{"type": "text", "text": "seen"}, {"type": "image_url", "image_url": {"url": "data:,"}}]},
        {"role": "assistant", "content": f"{tag} it is \ud800 done  ", "finish_reason": "stop"},
        "not a message",  # type: ignore[list-item]
    ]


def noted(engine: Any, session: str) -> tuple[str, ...] | None:
    return engine._shown_of(session)  # type: ignore[no-any-return]


def test_the_list_noted_is_the_list_hermes_holds_at_each_turn(store_url: str, tmp_path: Path) -> None:
    """Turn after turn, the noted list is the digests of the list as it is then, a message changed in
    place since the turn before read as it is now."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s1")
    msgs: list[Any] = [*varied("a"), *conversation("note", 4)]
    engine.on_turn_complete(msgs, session_id="s1")
    assert noted(engine, "s1") == shown_digests(msgs)
    before = shown_digests(msgs)
    msgs[1]["content"] = "a hello, edited in place"  # Hermes changes a message it holds
    msgs[4]["content"] += " and more"
    msgs[3]["_db_persisted"] = True  # a mark of its own: not part of the message
    msgs.extend(varied("b"))
    engine.on_turn_complete(msgs, session_id="s1")
    assert noted(engine, "s1") == shown_digests(msgs)
    assert noted(engine, "s1")[:3] != before[:3]  # type: ignore[index]
    engine.on_turn_complete(msgs, session_id="s1")  # nothing new: the same
    assert noted(engine, "s1") == shown_digests(msgs)
    engine.close()


def test_a_message_nested_past_the_recursion_limit_is_noted_as_before(store_url: str, tmp_path: Path) -> None:
    """A message ``copy.deepcopy`` cannot copy (stored as ``bounded`` makes it): noted with the digest
    the list's own message has."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("s2")
    msgs = [{"role": "user", "content": "deep one"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_deep", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        deep(sys.getrecursionlimit() + 100), {"role": "assistant", "content": "deep done"}]
    engine.on_turn_complete(msgs, session_id="s2")
    assert noted(engine, "s2") == shown_digests(msgs)
    engine.close()


def test_a_compacted_view_is_noted_whole(store_url: str, tmp_path: Path) -> None:
    """A list starting with a compaction's answer (aligned after its candidate: the alignment fingerprints
    its tail only) is noted whole, as before; another session's list notes nothing."""
    engine = make(tmp_path, db_url=store_url, context_length=8000, threshold_percent=0.5)
    engine.on_session_start("s3")
    convo = conversation("view", 12)
    view = engine.compress(convo, session_id="s3")
    assert len(view) < len(convo), "the case did not arise: nothing compacted"
    later = [*view, {"role": "user", "content": "after the view"}, {"role": "assistant", "content": "answered"}]
    engine.on_turn_complete(later, session_id="s3")
    assert noted(engine, "s3") == shown_digests(later)
    engine.on_turn_complete(conversation("other", 2), session_id="elsewhere")
    assert noted(engine, "s3") == shown_digests(later)
    engine.close()
