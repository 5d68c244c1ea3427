"""lcm_grep ``sort=relevance`` on SQLite: a hit's score is how often its terms occur in its own text.

The score was FTS5's ``highlight()`` of the hit, less the hit's length, taken for one character a
place where a phrase occurs. The trigram tokenizer's phrases overlap in a repeated text, and
highlight() then copies the rest of the text again at each overlapping match ('aaaa' and "aaa":
'[aaa]a[aaa]'): one laugh "hahaha..." outscored five separate "haha" 141 to 5, and the work grew with
the cube of the run (4,000 "A" of a base64 blob took seconds, 40,000 never finished), on a search the
model runs. The score now counts each term's matches by the search's rule (``fold``), left to right
and apart (``str.count``), in the first SCORE_MAX_TEXT characters of the hit: one pass over them.
PostgreSQL ranks by ts_rank, as before.
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_lossless_tools import A, call, make_engine, turn

from engines.lossless import search as search_module
from engines.lossless.search import fold
from transcript_store import StoreConfig, TranscriptStore
from transcript_store.core import Core


@pytest.fixture(scope="module")
def store(sqlite_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TranscriptStore]:
    """One SQLite store for the module (the score under test is SQLite's; PostgreSQL's is ts_rank)."""
    path = tmp_path_factory.mktemp("lossless_relevance") / "store.db"
    shutil.copyfile(sqlite_template, path)
    s = TranscriptStore(config=StoreConfig(url=f"sqlite:///{path}", auto_upgrade=False))
    yield s
    s.close()


@pytest.fixture
def sid(store: TranscriptStore, request: pytest.FixtureRequest) -> str:
    return store.create_session(A, session_id=f"s-{request.node.name[:40]}").session_id


def ranked(store: TranscriptStore, sid: str, pattern: str, limit: int = 200) -> list[tuple[int, float]]:
    """(ordinal, score) of the message hits of a relevance search, in order."""
    found = store.read(lambda c: search_module.grep(c, A, sid, pattern, mode="full_text", kinds=("message",),
                                                    sort="relevance", limit=limit))
    return [(h.ref, h.score) for h in found]


def scores(store: TranscriptStore, sid: str, pattern: str) -> dict[int, float]:
    return dict(ranked(store, sid, pattern))


def on_driver(store: TranscriptStore, fn: Callable[[Core, sqlite3.Connection], Any]) -> Any:
    """``fn`` in a read transaction, with the transaction's sqlite3 connection."""
    def run(c: Core) -> Any:
        raw = c.conn.connection.driver_connection
        assert isinstance(raw, sqlite3.Connection)
        return fn(c, raw)

    return store.read(run)


# ---------------------------------------------------------------------------------------------- cost


def test_a_repeated_character_is_one_pass_over_the_text(store: TranscriptStore, sid: str) -> None:
    """A run of one character (a base64 blob of zeros, a "=====" rule) scores its matches counted apart,
    and the score reads each candidate's text once, up to SCORE_MAX_TEXT characters: bounded whatever
    the text holds. (The score was highlight()'s length less the text's: cubic in the run.)"""
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "A" * 2_000)  # msg_1: highlight() built some 2 MB of it, a score of 2,000,995
    assert scores(store, sid, "AAA") == {1: 666}
    turn(store, engine, sid, "t2", "A" * 40_000, "data: " + "A" * 1_000_000, "=" * 5_000 + " rule", "xAAAx AAA")
    # msg_3: 40,000 "A"; msg_4: the score reads its first SCORE_MAX_TEXT characters; msg_6: two apart
    reads: list[int] = []

    def spied(c: Core, raw: sqlite3.Connection) -> tuple[list[tuple[int, float]], dict[str, int], float]:
        def spy(content: object, *args: object) -> int:
            reads.append(len(content) if isinstance(content, str) else -1)
            return search_module.occurrences(content, *args)

        # The first relevance search on a connection registers the function there; the spy replaces it.
        search_module.grep(c, A, sid, "AAA", mode="full_text", kinds=("message",), sort="relevance", limit=1)
        raw.create_function(search_module.SCORE_FUNCTION, -1, spy, deterministic=True)
        steps = {"recency": 0, "relevance": 0}
        elapsed = 0.0
        try:
            for sort in steps:
                def step(sort: str = sort) -> int:
                    steps[sort] += 1
                    return 0

                raw.set_progress_handler(step, 1)
                started = time.monotonic()
                found = search_module.grep(c, A, sid, "AAA", mode="full_text", kinds=("message",),
                                           sort=sort,  # type: ignore[arg-type]
                                           limit=200)
                elapsed = time.monotonic() - started
                raw.set_progress_handler(None, 1)
        finally:
            raw.set_progress_handler(None, 1)
            raw.create_function(search_module.SCORE_FUNCTION, -1, search_module.occurrences, deterministic=True)
        return [(h.ref, h.score) for h in found], steps, elapsed

    found, steps, elapsed = on_driver(store, spied)
    assert found == [(4, (search_module.SCORE_MAX_TEXT - 6) // 3), (3, 13_333), (1, 666), (6, 2)]
    # The score reads each candidate's text once, up to SCORE_MAX_TEXT characters, and takes no VM steps
    # of its own: the relevance search's are the recency search's, and its sort's few (the steps are
    # mostly FTS5's reads of the index, some 1,900 for the million "A").
    assert sorted(reads) == sorted([2_000, 40_000, search_module.SCORE_MAX_TEXT, len("xAAAx AAA")])
    assert steps["relevance"] <= steps["recency"] + 20, steps
    assert elapsed < 5, elapsed  # milliseconds here; a guard only, the bounds above are what is tested
    assert scores(store, sid, "=====") == {5: 1_000}
    assert scores(store, sid, "==") == {5: 2_500}  # no trigram: the session's rows are scanned, and scored
    out = call(engine, sid, "lcm_grep", {"pattern": "aaaa", "sort": "relevance", "search_in": "messages"})
    assert [(r["id"], r["score"]) for r in out["results"]] == [
        ("msg_4", (search_module.SCORE_MAX_TEXT - 6) // 4), ("msg_3", 10_000), ("msg_1", 500)]


# ---------------------------------------------------------------------------------------------- meaning


def test_matches_count_left_to_right_and_apart(store: TranscriptStore, sid: str) -> None:
    """A term's matches are counted apart, each after the previous one ends: a run of n characters of
    "ha" holds n // 4 "haha". Five separate "haha" outrank a run of 16 or 18 characters (4), and a run
    of 24 (6) outranks them; equal scores come newest first, and a smaller page is a prefix."""
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "haha. haha, haha; haha! haha?", "ha" * 8, "ha" * 12, "ha" * 9, "hahaha",
         "HaHa hAhA")
    want = [(3, 6), (1, 5), (4, 4), (2, 4), (6, 2), (5, 1)]
    assert ranked(store, sid, "haha") == want
    for limit in (1, 3, 4):
        assert ranked(store, sid, "haha", limit) == want[:limit]
    out = call(engine, sid, "lcm_grep", {"pattern": "haha", "sort": "relevance", "search_in": "messages"})
    assert [(r["id"], r["score"]) for r in out["results"]] == [(f"msg_{o}", s) for o, s in want]
    # Each term counts its own matches, added up (a term given twice counts twice).
    assert scores(store, sid, "ha haha") == {1: 15, 2: 12, 3: 18, 4: 13, 5: 4, 6: 6}
    assert scores(store, sid, "haha haha") == {o: 2 * s for o, s in want}


def test_terms_count_by_the_search_rule(store: TranscriptStore, sid: str) -> None:
    """A match is the search's, code point by code point (the module doc): the Greek sigmas, the Kelvin
    sign, ß and ẞ (never "ss"), İ only itself. The score folds a text the way ``fold`` does, whose fast
    way (``str.casefold``, where every fold is one code point) is the rule's table everywhere."""
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "ΣΟΦΙΑ σοφια Σοφια σοφιας", "straße STRAẞE strasse Straße", "İstanbul istanbul",
         "\u212aelvin kelvin KELVIN", "Ab\ufffe ab\uffff ab\ufffd")
    assert scores(store, sid, "σοφια") == {1: 4}
    assert scores(store, sid, "ΣΟΦΙΑΣ") == {1: 1}  # the final ς matches Σ
    assert scores(store, sid, "STRASSE") == {2: 1}
    assert scores(store, sid, "straße") == {2: 3}
    assert scores(store, sid, "İstanbul") == {3: 1}
    assert scores(store, sid, "istanbul") == {3: 1}
    assert scores(store, sid, "kelvin") == {4: 3}
    assert scores(store, sid, "ab\ufffd") == {5: 3}  # U+FFFE and U+FFFF count as U+FFFD
    # Terms under a trigram (the session's rows scanned) count the same way.
    assert scores(store, sid, "ς") == {1: 5}
    assert scores(store, sid, "ß") == {2: 3}
    assert scores(store, sid, "İ") == {3: 1}
    assert scores(store, sid, "\u212a") == {4: 3}  # the Kelvin sign: K, k and itself
    # fold's fast way and the rule's table agree on every code point, alone and in texts of each path.
    table = search_module._folding()[0]
    everything = "".join(map(chr, range(sys.maxunicode + 1)))
    assert fold(everything) == everything.translate(table)
    for base in range(0, sys.maxunicode + 1, 128):
        piece = everything[base: base + 128]
        assert fold(piece) == piece.translate(table), hex(base)
        assert all(fold(ch) == ch.translate(table) for ch in piece), hex(base)
    assert fold("ΟΔΟΣ ΟΔΟΣ.") == "οδοσ οδοσ." and fold("σοφός") == "σοφόσ"  # lower() would end words in ς


def test_cjk_and_query_syntax_terms_rank_by_their_count(store: TranscriptStore, sid: str) -> None:
    """Terms of two CJK characters (no trigram: the rows are scanned) are scored too (they all scored 0),
    and FTS5's syntax in a term is text: quotes, *, ^, OR, NEAR count as the characters they are."""
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "部署部署部署", "部署 ok", "我们部署了\uff0c再部署", '"x" and "x" and "x"',
         "a*b a*b axb", "^start ^start", "OR or Or oR", "NEAR(a b) NEAR(a b)", "東京の天気 東京")
    assert ranked(store, sid, "部署") == [(1, 3), (3, 2), (2, 1)]
    assert ranked(store, sid, "東京") == [(9, 2)]
    assert ranked(store, sid, "東京の天気") == [(9, 1)]
    assert ranked(store, sid, '"x"') == [(4, 3)]
    assert ranked(store, sid, "a*b") == [(5, 2)]
    assert ranked(store, sid, "^start") == [(6, 2)]
    assert ranked(store, sid, "OR") == [(0, 30), (7, 4)]  # the question: "question t1 " + "words " * 30
    assert ranked(store, sid, "NEAR(a") == [(8, 2)]
    assert ranked(store, sid, "部署 ok") == [(2, 2)]
