"""Review of session 42's lossless and Hermes changes: defects found, each test failing before its fix.

Each test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from conftest import module_store_fixtures, tool_round

from engines.lossless import LosslessEngine
from transcript_store import TranscriptStore
from transcript_store.hermes.messages import clean, fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hosting import compacted_lossless
from hosting import store_writes as writes
from test_hermes_adapter import conversation, make

A = "scope-review42"
shared_url, store, sid = module_store_fixtures(A, "review_s42")


def lossless(store: TranscriptStore, sid: str, history: list[dict[str, Any]], piece: int = 200) -> LosslessEngine:
    """A lossless engine over ``history`` (``expand_max_chars``: ``piece``), compacted (its older messages
    under a leaf)."""
    engine: LosslessEngine = compacted_lossless(store, A, sid, history, piece)
    return engine


def answer(engine: LosslessEngine, sid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(engine.handle_tool_call(name, args, scope=A, session_id=sid))
    assert "error" not in out, out
    return out


def test_a_nul_character_in_a_source_message_leaves_its_leaf_expandable(store: TranscriptStore, sid: str) -> None:
    """A tool output with a NUL character (a binary file read as text) is stored, its JSON escaping it as
    ``\\u0000``. lcm_expand of its leaf read the tool_call_id through PostgreSQL's JSON, which cannot turn
    ``\\u0000`` into text: the whole page failed ("database error"), where it read the row in Python before;
    expanding the message itself failed so too."""
    binary = "PK\x03\x04\x00\x00header\x00" * 30
    history = [{"role": "user", "content": "read the archive"}, *tool_round("call-bin", binary),
               {"role": "user", "content": "and say \x00 hi"}, *tool_round("call-two", "plain"),
               *[{"role": "assistant", "content": f"reply {n} " * 20} for n in range(3)]]
    engine = lossless(store, sid, history)
    leaf = answer(engine, sid, "lcm_describe", {"id": "msg_2"})["summarized_in"][-1]
    items = {item["id"]: item for item in answer(engine, sid, "lcm_expand", {"id": leaf})["items"]}
    assert items["msg_2"]["tool_call_id"] == "call-bin" and items["msg_2"]["truncated"] is True
    assert items["msg_3"].get("tool_call_id") is None and "hi" in items["msg_3"]["content"]
    assert items["msg_5"]["tool_call_id"] == "call-two"
    piece = answer(engine, sid, "lcm_expand", {"id": "msg_2", "offset": 10})
    assert piece["items"][0]["tool_call_id"] == "call-bin"
    assert piece["total_chars"] == len(binary)


def test_an_expand_max_chars_past_an_integer_expands_whole_texts(store: TranscriptStore, sid: str) -> None:
    """``expand_max_chars`` set past 2**31 (meant as "never cut"): PostgreSQL has no ``substr`` of a bigint,
    and lcm_expand of a leaf failed as "database error" where it read whole rows before (and the expansion
    of a message failed so too)."""
    output = "line of output " * 400
    history = [{"role": "user", "content": "run it"}, *tool_round("call-long", output),
               *[{"role": "assistant", "content": f"reply {n} " * 20} for n in range(3)]]
    engine = lossless(store, sid, history, piece=10**10)
    leaf = answer(engine, sid, "lcm_describe", {"id": "msg_2"})["summarized_in"][-1]
    items = {item["id"]: item for item in answer(engine, sid, "lcm_expand", {"id": leaf})["items"]}
    assert (items["msg_2"]["content"], items["msg_2"]["truncated"]) == (output, False)
    assert answer(engine, sid, "lcm_expand", {"id": "msg_2"})["items"][0]["content"] == output


# ------------------------------------------------------------------------ Hermes: the saved spelling

def pictured(tag: str, turns: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(a live list whose user messages carry an image each, the same list as Hermes' database hands it
    back: each image as ``[screenshot]`` after the text, a ``timestamp`` on the user message)."""
    live = conversation(tag, turns)
    saved = copy.deepcopy(live)
    for i, m in enumerate(live):
        if m["role"] == "user":
            text = m["content"]
            live[i] = {"role": "user", "content": [{"type": "text", "text": text},
                                                   {"type": "image_url", "image_url": {"url": "data:,"}}]}
            saved[i] = {"role": "user", "content": text + "\n[screenshot]", "timestamp": 1700000000.0 + i}
    return live, saved


def shown(engine: Any, hermes_session: str) -> list[str]:
    rt = engine.runtime()
    sid = engine._store_session(rt, hermes_session)
    return [fingerprint([clean(e.message)]) for e in rt.store.read_visible(engine.scope, sid)
            if e.kind == "message" and isinstance(e.message, dict)]


def test_a_history_in_the_saved_spelling_takes_no_write_transaction_each_time(
    store_url: str, tmp_path: Path
) -> None:
    """The gateway's history is Hermes' database's (each image as ``[screenshot]``): stored once live, the
    same history again (a recall tool call or a request stores it first; nothing new in it) took a write
    transaction each time, read the stored row of every such message in it and checked the form of
    every message after the first: a write lock per call that wrote nothing (at 2,000 messages with 300
    images, 40 ms a call where the live list takes 20). The stored messages are learned once."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("gw")
    live, saved = pictured("gw", 30)
    engine.on_turn_complete(copy.deepcopy(live), session_id="gw")
    count = writes(engine)
    for _ in range(4):
        engine.on_turn_complete(copy.deepcopy(saved), session_id="gw")
    assert count[0] <= 1, f"{count[0]} write transactions for a list holding nothing new"
    later = [*saved, {"role": "user", "content": "gw next"}, {"role": "assistant", "content": "gw answered"}]
    engine.on_turn_complete(copy.deepcopy(later), session_id="gw")
    engine.on_turn_complete(copy.deepcopy(later), session_id="gw")
    assert count[0] <= 2
    expected = [fingerprint([clean(m)]) for m in [*live, *later[-2:]]]
    assert shown(engine, "gw") == expected
    assert len(engine.stored_messages("gw")) == len(expected), "messages were written again"
    engine.close()


def test_a_learned_spelling_stands_for_its_stored_message_only(store_url: str, tmp_path: Path) -> None:
    """Once a saved spelling is learned, a list holding it where the transcript holds another message (an
    edit of that message, stored live) is no copy of the transcript: it branches there, stored as it is."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("gx")
    live, saved = pictured("gx", 6)
    engine.on_turn_complete(copy.deepcopy(live), session_id="gx")
    engine.on_turn_complete(copy.deepcopy(saved), session_id="gx")  # learned
    at = max(i for i, m in enumerate(live) if m["role"] == "user")
    edited = [*copy.deepcopy(live[:at]), {"role": "user", "content": "gx another question, edited"}]
    engine.on_turn_complete(copy.deepcopy(edited), session_id="gx")
    assert shown(engine, "gx") == [fingerprint([clean(m)]) for m in edited]
    engine.on_turn_complete(copy.deepcopy(saved[: at + 1]), session_id="gx")
    assert shown(engine, "gx") == [fingerprint([clean(m)]) for m in [*live[:at], saved[at]]]
    engine.close()


def test_a_saved_list_starting_later_keeps_its_message_where_its_place_is_unknown() -> None:
    """``as_shown`` compares a message the saved list does not hold as it is with the next message of the
    list shown. A saved list that starts later than the transcript (a compacted view: our summary, then
    the tail) compared its first such message with the transcript's first message: an image the user had
    sent with the same words at the start took the place of the one in the tail (the answer to the
    second image stood after the first). Where the place is unknown the message stays as saved."""
    from transcript_store.hermes.context import ACK_MESSAGE
    from transcript_store.hermes.spelling import as_shown

    def image(url: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": "and this one?"},
                                            {"type": "image_url", "image_url": {"url": url}}]}

    ref = [image("data:a"), {"role": "assistant", "content": "a cat"}, image("data:b"),
           {"role": "assistant", "content": "a dog"}]
    as_saved = {"role": "user", "content": "and this one?\n[screenshot]"}
    view = [{"role": "assistant", "content": ACK_MESSAGE}]  # a compacted view's acknowledgement: ours
    tail = [as_saved, {"role": "assistant", "content": "a dog"}]
    for saved in ([*view, *tail], [{"role": "user", "content": "something else"}, *tail]):
        assert as_shown(copy.deepcopy(saved), ref)[-2] == as_saved, saved
    # From the start, or right after a message found, its place is known: the live message.
    whole = [as_saved, {"role": "assistant", "content": "a cat"}, as_saved, {"role": "assistant", "content": "a dog"}]
    assert as_shown(whole, ref) == ref


def test_a_learned_spelling_names_the_text_sent(store_url: str, tmp_path: Path) -> None:
    """A message Hermes saved as a cleaned text with the text sent in ``api_content`` (the gateway's
    ``persist_user_message``) is the stored one by its ``api_content``, which its digest leaves out: a
    later list holding the same text sent as another (an edit) is not the stored message."""
    engine = make(tmp_path, db_url=store_url)
    engine.on_session_start("ga")
    first = [{"role": "user", "content": "ga question [from the web chat]"},
             {"role": "assistant", "content": "ga answer"}]
    engine.on_turn_complete(copy.deepcopy(first), session_id="ga")
    saved = [{"role": "user", "content": "ga question", "api_content": "ga question [from the web chat]"}, first[1]]
    engine.on_turn_complete(copy.deepcopy(saved), session_id="ga")  # learned
    engine.on_turn_complete(copy.deepcopy(saved), session_id="ga")
    assert shown(engine, "ga") == [fingerprint([clean(m)]) for m in first]
    other = [{"role": "user", "content": "ga question", "api_content": "ga question [from the phone]"}]
    engine.on_turn_complete(copy.deepcopy(other), session_id="ga")
    assert shown(engine, "ga") == [fingerprint([clean(m)]) for m in other]
    engine.close()


def test_a_content_part_typed_oddly_is_compared_not_raised_on() -> None:
    """A content part whose type is a list or an object (the store keeps such a message in another form,
    as its JSON): ``as_saved`` looked the type up in a set and raised TypeError, so ``as_shown`` with a
    live list holding it raised, and the session switch or interrupted turn storing from Hermes' database
    stored nothing."""
    from transcript_store.hermes.spelling import as_saved, as_shown

    odd = {"role": "user", "content": [{"type": ["image"], "text": "x"}, {"type": {"a": 1}},
                                       {"type": "text", "text": "y"}]}
    assert as_saved(odd) == {"role": "user", "content": "y"}
    saved = [{"role": "assistant", "content": "an answer"}]
    assert as_shown(saved, [odd, {"role": "assistant", "content": "an answer"}]) == saved
    assert as_shown([{"role": "user", "content": "z"}], [odd]) == [{"role": "user", "content": "z"}]
