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


def test_a_page_of_large_hits_holds_only_their_snippets(store: TranscriptStore, sid: str) -> None:
    """A full-text page of large tool outputs reads each hit's text up to its head, and keeps only the
    piece its snippet shows: the whole text of every hit came back (50 outputs of 4 MB matching a
    common word: 207 MB on SQLite, 382 MB on PostgreSQL, for an answer of 14 KB)."""
    engine = make_engine(store)
    big = "error: disk full\n" + "lorem ipsum " * 40_000  # 480,000 characters each
    turn(store, engine, sid, "t1", big, big + " end", big + " end of it")
    hits = store.read(lambda c: search_module.grep(
        c, A, sid, "ERROR", mode="full_text", kinds=("message",), sort="recency", limit=20
    ))
    assert len(hits) == 3
    assert all(len(h.content) <= search_module.SNIPPET_WIDTH + 1 for h in hits), [len(h.content) for h in hits]
    out = call(engine, sid, "lcm_grep", {"pattern": "ERROR", "mode": "full_text"})
    assert {h["snippet"] for h in out["results"]} == {search_module.snippet(big, _find(big, "ERROR"))}


def test_a_snippet_is_the_whole_texts_wherever_its_match_lies(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Matches before, across and past the head a search reads, and past several reads on (small sizes
    here): each hit's snippet is the one its whole text gives, on both backends, the relevance sort too."""
    monkeypatch.setattr(search_module, "FIND_CHUNK", 16)
    monkeypatch.setattr(search_module, "FIND_READ", 7)
    texts = []
    for n, at in enumerate((0, 1, 5, 80, 81, 160, 170, 175, 176, 177, 178, 190, 250, 400, 1_000)):
        word = ("NEEDLE", "neeDle", "NEẞDLE")[n % 3] if n % 5 else "ne\u212aedle"
        texts.append("ß" * (at % 7) + "x" * (at - at % 7) + word + f" {n} " + "y" * (n * 37))
    engine = make_engine(store)
    turn(store, engine, sid, "t1", *texts)
    for pattern in ("needle", "NEẞDLE", "ne\u212aedle"):
        expected = {t: search_module.snippet(t, _find(t, pattern)) for t in texts if _find(t, pattern) is not None}
        for sort in ("recency", "relevance"):
            out = call(engine, sid, "lcm_grep", {"pattern": pattern, "mode": "full_text", "search_in": "messages",
                                                 "sort": sort, "limit": 200})
            got = {h["snippet"] for h in out["results"] if h["role"] == "assistant"}
            assert got == set(expected.values()), (pattern, sort, got ^ set(expected.values()))
