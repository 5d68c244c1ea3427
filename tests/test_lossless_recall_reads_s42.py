"""``lcm_describe`` of a message and ``lcm_expand`` of a leaf read what they show, not whole rows, on both
backends.

Describing a message read its whole row, the text and the message's JSON, to show 240 characters of it:
for a tool output of 5 MB, 15 MB in Python and 30 ms on SQLite, 44 ms on PostgreSQL (15 and 8 ms now,
measured on a shared machine). Expanding a leaf read every source's whole row and parsed its JSON in Python
to show ``expand_max_chars`` of each: a page of 200 outputs of 4 MB was 1.6 GB. The database now cuts the
text (``substr``, code points on both backends, as Python slices) and reads the ``tool_call_id``; the
answers are the very ones the whole rows gave. (Expanding a message already read its piece alone; the
database still reads the text to count its characters for ``total_chars``.)
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from typing import Any

from conftest import module_store_fixtures, tool_round
from hosting import compacted_lossless
from sqlalchemy import select

from engines.lossless import LosslessEngine
from engines.lossless.search import snippet
from engines.lossless.tables import messages
from transcript_store import TranscriptStore

A = "scope-reads"
PIECE = 500  # expand_max_chars
#: a tool output of ~2 million characters, two- and four-byte UTF-8 ones among them
BIG = "row é 😀 data\n" * 150_000

shared_url, store, sid = module_store_fixtures(A, "recall_reads")


def call(engine: LosslessEngine, sid: str, name: str, args: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The tool's answer, and the most memory Python held at once while it ran (bytes)."""
    tracemalloc.start()
    try:
        out = engine.handle_tool_call(name, args, scope=A, session_id=sid)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    answer: dict[str, Any] = json.loads(out)
    assert "error" not in answer, answer
    return answer, peak


def stored(store: TranscriptStore, sid: str, ordinal: int) -> Any:
    m = messages.c
    return store.read(lambda c: c.conn.execute(
        select(m.content, m.message).where(m.scope == A, m.session_id == sid, m.ordinal == ordinal)
    ).one())


def test_describe_and_expand_read_the_piece_they_show(store: TranscriptStore, sid: str) -> None:
    history = [{"role": "user", "content": "fetch the export"}, *tool_round("call-big", BIG),
               {"role": "user", "content": "and a short one"}, *tool_round("call-small", "tiny output"),
               *[{"role": "assistant", "content": f"reply {n} " * 20} for n in range(4)]]
    engine = compacted_lossless(store, A, sid, history, PIECE)
    big = stored(store, sid, 2)
    assert big.content == BIG and len(big.message) > len(BIG)
    small: Callable[[int], bool] = lambda peak: peak < len(BIG) // 4  # noqa: E731 - the whole text is 4x that

    described, peak = call(engine, sid, "lcm_describe", {"id": "msg_2"})
    assert small(peak), peak
    assert described["preview"] == snippet(BIG, None, 240) and described["preview"].endswith("…")
    assert (described["role"], described["kind"]) == ("tool", "message") and described["summarized_in"]
    short, _ = call(engine, sid, "lcm_describe", {"id": "msg_0"})
    assert short["preview"] == "fetch the export"  # a text shorter than the preview: no mark

    leaf = described["summarized_in"][-1]
    expanded, peak = call(engine, sid, "lcm_expand", {"id": leaf})
    assert small(peak), peak
    items = {item["id"]: item for item in expanded["items"]}
    assert items["msg_2"]["content"] == BIG[:PIECE] + "…" and items["msg_2"]["truncated"] is True
    assert items["msg_2"]["tool_call_id"] == "call-big"
    # The others as the whole rows give them: the text whole when it fits, the tool_call_id of a result only.
    for ordinal in range(len(history)):
        item = items.get(f"msg_{ordinal}")
        if item is None or ordinal == 2:
            continue
        row = stored(store, sid, ordinal)
        assert (item["content"], item["truncated"]) == (row.content, False)
        assert item.get("tool_call_id") == json.loads(row.message).get("tool_call_id")

    piece, peak = call(engine, sid, "lcm_expand", {"id": "msg_2", "offset": len(BIG) - 3})
    assert small(peak), peak
    assert piece["total_chars"] == len(BIG) and piece["items"][0]["content"] == BIG[-3:]
