"""``lcm_expand`` reads a summary's own text past ``expand_max_chars``, a piece at a time, on both backends.

A message's text could be read in pieces from a character ``offset``; a summary's text was only ever shown
cut to ``expand_max_chars`` (as an item of its parent's expansion), and the rest of it could not be read at
all. ``text: true`` now reads a summary's text with the same ``offset`` and the same answer as a message's.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import module_store_fixtures
from sqlalchemy import select
from test_lossless_expand_review5 import PIECE, A, call, commit, make_engine  # scope A: its helpers' scope

from engines.lossless import LosslessEngine
from engines.lossless import tools as tools_module
from engines.lossless.tables import summaries
from transcript_store import TranscriptStore
from transcript_store.core import MAX_INT

shared_url, store, sid = module_store_fixtures(A, "lossless_expand_s44")


def summarized(store: TranscriptStore, sid: str) -> tuple[LosslessEngine, dict[str, Any]]:
    """An engine over a session compacted into summaries longer than a piece; the stored rows by id."""
    engine = make_engine(store)
    for n in range(12):
        words = " ".join(f"pear{n}x{k}" for k in range(40))
        commit(store, engine, sid, f"t{n}", [{"role": "assistant", "content": f"Answer {n} lists {words}. " * 4}],
               " asks about apples")
    engine.compact(scope=A, session_id=sid, force=True, token_budget=4000)
    rows = store.read(lambda c: list(c.conn.execute(select(summaries).where(summaries.c.session_id == sid))))
    assert rows
    return engine, {f"sum_{r.summary_seq}": r for r in rows}


def test_a_summarys_text_is_read_in_pieces(store: TranscriptStore, sid: str) -> None:
    """First piece, a middle piece, the last piece, the end itself, and every piece joined: the whole text."""
    engine, rows = summarized(store, sid)
    ident, row = max(rows.items(), key=lambda r: len(r[1].content))
    text = row.content
    total = len(text)
    assert total > 3 * PIECE, total
    covers = [f"msg_{row.earliest_ordinal}", f"msg_{row.latest_ordinal}"]

    def expected(offset: int) -> dict[str, Any]:
        piece = text[offset:offset + PIECE]
        cut = total - offset > PIECE
        done = min(total, offset + PIECE)
        return {"id": ident, "kind": row.kind, "total_chars": total, "offset": offset,
                "items": [{"id": ident, "kind": row.kind, "depth": row.depth, "covers": covers,
                           "message_count": row.message_count, "content": piece + ("…" if cut else ""),
                           "truncated": cut}],
                "next_offset": done if done < total else None}

    first = call(engine, sid, {"id": ident, "text": True})
    assert first == expected(0)
    assert first["items"][0]["content"] == text[:PIECE] + "…" and first["next_offset"] == PIECE
    middle = PIECE + 7
    assert call(engine, sid, {"id": ident, "text": True, "offset": middle}) == expected(middle)
    last = call(engine, sid, {"id": ident, "text": True, "offset": total - 5})
    assert last == expected(total - 5) and last["next_offset"] is None
    assert last["items"][0] == {**expected(total - 5)["items"][0], "content": text[-5:], "truncated": False}
    end = call(engine, sid, {"id": ident, "text": True, "offset": total})
    assert end["items"][0]["content"] == "" and end["next_offset"] is None and end["offset"] == total
    pieces, offset = [], 0
    while offset is not None:
        page = call(engine, sid, {"id": ident, "text": True, "offset": offset})
        item = page["items"][0]
        pieces.append(item["content"].removesuffix("…") if item["truncated"] else item["content"])
        offset = page["next_offset"]
    assert "".join(pieces) == text
    # null is the default (strict function-calling sends every property): the children or sources, as before
    assert call(engine, sid, {"id": ident, "text": None}) == call(engine, sid, {"id": ident})
    assert call(engine, sid, {"id": ident, "text": False}) == call(engine, sid, {"id": ident})


def test_an_offset_past_a_summarys_text_is_a_clear_answer(store: TranscriptStore, sid: str) -> None:
    engine, rows = summarized(store, sid)
    for ident, row in rows.items():
        total = len(row.content)
        for past in (total + 1, total + PIECE, MAX_INT):
            out = call(engine, sid, {"id": ident, "text": True, "offset": past})
            assert out == {"error": f"offset {past} is past the end of {ident}: it has {total} characters "
                                    f"(offsets 0 to {total})"}, out


@pytest.mark.parametrize("value", [1, "yes", [], {}])
def test_text_must_be_a_boolean(store: TranscriptStore, sid: str, value: Any) -> None:
    engine, _ = summarized(store, sid)
    assert call(engine, sid, {"id": "sum_1", "text": value}) == {"error": "text must be true or false"}


def test_text_of_a_message_is_its_text(store: TranscriptStore, sid: str) -> None:
    """A message's expansion is its text already: ``text`` changes nothing there."""
    engine, _ = summarized(store, sid)
    assert call(engine, sid, {"id": "msg_1", "text": True, "offset": 3}) == call(engine, sid, {"id": "msg_1",
                                                                                            "offset": 3})


def test_the_schema_offers_text() -> None:
    expand = next(s for s in tools_module.schemas() if s["function"]["name"] == "lcm_expand")["function"]
    assert expand["parameters"]["properties"]["text"]["type"] == "boolean"
    assert "text" in expand["description"]
