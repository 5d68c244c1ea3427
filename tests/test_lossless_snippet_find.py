"""The match a full-text hit's snippet shows is looked for a chunk of the hit's text at a time.

``_find`` folded the whole text of every hit of a page to place the first match of the first term:
linear in the hit's size and uncapped, some 50 ns a character when the text holds a character that
folds to several (ß: ``fold`` takes its table then), 0.2 s per 4 MB tool output of a page whose match
is near the start. It now folds FIND_CHUNK characters at a time (overlapping by the term's length less
one) and stops at the first match: the same place, at the cost of the text up to it.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import module_store_fixtures
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lossless_tools import A, call, make_engine, turn

from engines.lossless import search as search_module
from engines.lossless.search import _find, fold
from transcript_store import TranscriptStore

shared_url, store, sid = module_store_fixtures(A, "lossless_snippet_find")

_TEXT = st.text(alphabet="aAbBßSsİiKkK\u212a\ufb00f ", max_size=40)


@settings(max_examples=300, deadline=None)
@given(content=_TEXT, term=st.text(alphabet="aAbsSßİiKkf", min_size=1, max_size=4), chunk=st.integers(1, 9))
def test_a_chunked_look_finds_what_a_whole_fold_finds(content: str, term: str, chunk: int) -> None:
    """At every chunk size, a match across a chunk's border included, the first match is the one a fold
    of the whole text finds."""
    at = fold(content).find(fold(term))
    expected = (at, at + len(term)) if at >= 0 else None
    saved = search_module.FIND_CHUNK
    search_module.FIND_CHUNK = chunk
    try:
        assert _find(content, term) == expected
    finally:
        search_module.FIND_CHUNK = saved


def test_the_snippet_of_a_huge_hit_folds_only_up_to_its_match(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3 MB reply whose term is near its start (a text with ß: the slow fold): the look for the
    snippet's match folds one chunk, not the 3 MB; the snippet shows the match; a match near the end is
    found too (every chunk folded then, once)."""
    near = "Straße Nummer 42 needle " + "ß" * 1_500_000
    far = "ß" * 1_500_000 + " the haystack ends here"
    engine = make_engine(store)
    turn(store, engine, sid, "t1", near, far)
    folded: list[int] = []
    real = search_module.fold

    def counting(text: str) -> str:
        folded.append(len(text))
        return real(text)

    monkeypatch.setattr(search_module, "fold", counting)
    out: dict[str, Any] = call(engine, sid, "lcm_grep", {"pattern": "needle", "mode": "full_text",
                                                         "sort": "recency"})
    assert [h["snippet"] for h in out["results"] if "needle" in h["snippet"]], out
    assert max(folded) <= search_module.FIND_CHUNK + len("needle"), max(folded)
    out = call(engine, sid, "lcm_grep", {"pattern": "haystack", "mode": "full_text", "sort": "recency"})
    assert [h["snippet"] for h in out["results"] if "haystack" in h["snippet"]], out
