"""``lcm_expand`` of a message reads the piece it returns, not the whole row, and refuses an offset out of
range, on both backends.

It read the whole stored row (the text and the message's JSON, parsed) for every piece of
``expand_max_chars`` characters it returned, and moved a negative offset to 0 and a huge one to the end:
the answer named an offset other than the one asked for. The pieces are now cut by the database
(``substr``, ``length``: characters, as Python counts them, non-BMP ones included), and must be the
very pieces the whole row gave.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import module_store_fixtures, tool_round
from sqlalchemy import select

from engines.lossless import LosslessEngine
from engines.lossless import tools as tools_module
from engines.lossless.tables import messages
from transcript_store import TranscriptStore
from transcript_store.core import MAX_INT
from transcript_store.engine import EngineContext
from transcript_store.models import ClosedRange
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-expand5"
PIECE = 100  # the smallest expand_max_chars
#: text with 2-, 3- and 4-byte UTF-8 characters, combining marks and a ZWJ emoji sequence
TEXTS = {
    "ascii": "".join(f"line {n:03d}\n" for n in range(70)),
    "emoji": "😀🎉👩‍👩‍👧 mixed é ü 中文 " * 40 + "𝄞 end 🏁",
    "all_astral": "🙂" * 333,
    "combining": "e\u0301a\u0308" * 120 + "Z",
    "short": "hé 😀",
    "exact": "€" * (2 * PIECE),
}

shared_url, store, sid = module_store_fixtures(A, "lossless_expand5")


def make_engine(store: TranscriptStore) -> LosslessEngine:
    ctx = EngineContext(store=store, config={"expand_max_chars": PIECE}, summarizer=ExtractiveSummarizer(),
                        estimator=RoughEstimator())
    return LosslessEngine(ctx)


def commit(
    store: TranscriptStore, engine: LosslessEngine, sid: str, turn_id: str, replies: list[dict[str, Any]],
    asks: str = "",
) -> None:
    """Admit ``turn_id`` (its question ``question <turn_id>`` and ``asks``), append ``replies`` and commit the turn."""
    admission = store.admit(A, sid, {"role": "user", "content": f"question {turn_id}{asks}"}, turn_id=turn_id)
    appended = store.append_many(A, sid, [{"message": m} for m in replies])
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    store.write(lambda c: engine.commit_turn(tx=c, advancement_key=turn_id, admission=admission.anchor,
                                             terminal=terminal, messages=closed.messages))


def call(engine: LosslessEngine, sid: str, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(engine.handle_tool_call("lcm_expand", args, scope=A, session_id=sid))
    return out


def before_fix(row: Any, ident: str, offset: int) -> dict[str, Any]:
    """What ``lcm_expand`` answered from the whole row (the earlier code), for an offset within the text."""
    total = len(row.content)
    text = row.content[offset:] if offset else row.content
    content, cut = (text, False) if len(text) <= PIECE else (text[:PIECE] + "…", True)
    item = {"id": ident, "kind": "message", "entry_id": row.entry_id, "role": row.role}
    call_id = json.loads(row.message).get("tool_call_id")
    if call_id:
        item["tool_call_id"] = str(call_id)[:255] + ("…" if len(str(call_id)) > 255 else "")
    item.update(content=content, truncated=cut)
    done = min(total, offset + PIECE)
    return {"id": ident, "kind": "message", "total_chars": total, "offset": offset, "items": [item],
            "next_offset": done if done < total else None}


def seeded(store: TranscriptStore, sid: str) -> tuple[LosslessEngine, dict[str, Any]]:
    """An engine over a session holding each of TEXTS (one as a tool result with a long call id); the
    stored rows by message id."""
    engine = make_engine(store)
    commit(store, engine, sid, "t0", [{"role": "assistant", "content": t} for t in TEXTS.values()])
    commit(store, engine, sid, "t1", tool_round("call-" + "ü" * 300, TEXTS["emoji"]))
    rows = store.read(lambda c: list(c.conn.execute(select(messages).where(messages.c.session_id == sid))))
    return engine, {f"msg_{r.ordinal}": r for r in rows}


def offsets(total: int) -> list[int]:
    """Offsets at the edges of pieces and of the text, and a few in between."""
    picked = {0, 1, PIECE - 1, PIECE, PIECE + 1, total // 2, total - 1, total - PIECE, total - PIECE - 1, total}
    return sorted(o for o in picked if 0 <= o <= total)


def test_every_piece_is_the_one_the_whole_row_gave(store: TranscriptStore, sid: str) -> None:
    engine, rows = seeded(store, sid)
    assert any(json.loads(r.message).get("tool_call_id") for r in rows.values())
    for ident, row in rows.items():
        for offset in offsets(len(row.content)):
            assert call(engine, sid, {"id": ident, "offset": offset}) == before_fix(row, ident, offset), (ident, offset)
        # by its entry id too, and reading on from next_offset gives the whole text back
        pieces, offset = [], 0
        while offset is not None:
            page = call(engine, sid, {"id": row.entry_id, "offset": offset})
            assert page == before_fix(row, ident, offset)
            pieces.append(page["items"][0]["content"].removesuffix("…") if page["items"][0]["truncated"]
                          else page["items"][0]["content"])
            offset = page["next_offset"]
        assert "".join(pieces) == row.content


def test_a_piece_reads_no_more_than_the_piece(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the database sends for a piece of a long message is about the piece, not the message (it was
    the 1.2 MB text and its JSON for each piece of 100 characters)."""
    engine, rows = seeded(store, sid)
    long_text = "ü😀" * 200_000  # 400,000 characters, 1.2 MB of UTF-8
    commit(store, engine, sid, "t2", [{"role": "assistant", "content": long_text}])
    ident = f"msg_{len(rows) + 1}"  # t2's question, then the reply
    sent: list[int] = []
    original = tools_module._find_message

    def measured(*args: Any, **kwargs: Any) -> Any:
        row = original(*args, **kwargs)
        sent.append(sum(len(str(value)) for value in row))
        return row

    monkeypatch.setattr(tools_module, "_find_message", measured)
    page = call(engine, sid, {"id": ident, "offset": 300_001})
    assert page["total_chars"] == len(long_text)
    assert page["items"][0]["content"] == long_text[300_001:300_001 + PIECE] + "…"
    assert sent and max(sent) < 3 * PIECE, sent


@pytest.mark.parametrize("offset", [-1, -(10**30), MAX_INT + 1, 10**30])
def test_an_offset_out_of_range_is_refused_not_moved(store: TranscriptStore, sid: str, offset: int) -> None:
    """A negative or huge offset was moved to 0 or to MAX_INT and answered as if asked."""
    engine, _ = seeded(store, sid)
    for ident in ("msg_1", "sum_1"):
        out = call(engine, sid, {"id": ident, "offset": offset})
        assert "offset" in out.get("error", ""), out


def test_an_offset_past_the_end_is_refused_and_the_end_is_answered(store: TranscriptStore, sid: str) -> None:
    """An offset past a message's end answered an empty piece as if there were text there; now it is an
    error naming the message's length. Its length itself is the end: no text, no next_offset."""
    engine, rows = seeded(store, sid)
    for ident, row in rows.items():
        total = len(row.content)
        end = call(engine, sid, {"id": ident, "offset": total})
        assert end["items"][0]["content"] == "" and end["next_offset"] is None and end["offset"] == total
        for past in (total + 1, total + PIECE, MAX_INT):
            out = call(engine, sid, {"id": ident, "offset": past})
            assert out == {"error": f"offset {past} is past the end of {ident}: it has {total} characters "
                                    f"(offsets 0 to {total})"}, out


def test_an_offset_past_a_summarys_end_is_refused(store: TranscriptStore, sid: str) -> None:
    """The same for a summary's children or source messages: past their count was an empty page."""
    engine = make_engine(store)
    for n in range(8):
        commit(store, engine, sid, f"t{n}", [{"role": "assistant", "content": f"answer {n} " * 40}])
    engine.compact(scope=A, session_id=sid, force=True, token_budget=300)
    first = call(engine, sid, {"id": "sum_1"})
    total = first["total"]
    assert total > 0 and call(engine, sid, {"id": "sum_1", "offset": total})["items"] == []
    out = call(engine, sid, {"id": "sum_1", "offset": total + 1})
    assert out == {"error": f"offset {total + 1} is past the end of sum_1: it has {total} source messages "
                            f"(offsets 0 to {total})"}, out
