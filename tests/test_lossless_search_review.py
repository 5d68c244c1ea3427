"""lcm_grep under a review's findings: what a search holds, and PostgreSQL servers set up otherwise.

- A regex was compiled twice a call and kept in the ``regex`` module's cache (500 patterns, a large one
  100+ MiB, for the life of the process); ``\\X`` and loops weighed one literal in the size bound.
- A regex search read whole rows (a tool result of MiBs) to search their first REGEX_MAX_TEXT
  characters, and ``sort=relevance`` kept every matching row's text to the end, whatever ``limit``.
- PostgreSQL's prefilter for CJK was an ILIKE with each cased character as ``_``: under an ICU locale
  whose lower() lengthens a character (Lithuanian: Ì is three code points) it refused a match.
- ``ESCAPE '\\'`` is an unterminated literal under ``standard_conforming_strings = off``: the search
  raised StoreUnavailable and the host quarantined the engine.
"""

from __future__ import annotations

import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import regex
from conftest import _admin_exec, fresh_url, module_store_fixtures, pg_url
from test_lossless_tools import A, call, make_engine, turn

from engines.lossless import search as search_module
from engines.lossless.search import REGEX_MAX_TEXT, expanded_size, snippet
from transcript_store import StoreConfig, TranscriptStore

shared_url, store, sid = module_store_fixtures(A, "lossless_search_review")


def grep(engine: Any, sid: str, pattern: str, **args: Any) -> dict[str, Any]:
    return call(engine, sid, "lcm_grep", {"pattern": pattern, "search_in": "messages", **args})


# ---------------------------------------------------------------------------------------------- 1: compile


def test_a_regex_is_cached_nowhere(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "the order 1234-5678 shipped")
    pattern = rf"\d{{4}}-\d{{4}}|{uuid.uuid4().hex}"  # a pattern no other test compiled
    out = grep(engine, sid, pattern, mode="regex")
    assert out["count"] == 1 and "1234-5678" in out["results"][0]["snippet"], out
    assert not any(key[0] == pattern for key in regex._main._cache), "kept in the regex module's cache"


def test_a_regex_is_compiled_once_a_call(store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "the order 1234-5678 shipped")
    pattern = r"\d{4}-\d{4}"
    compiles: list[str] = []
    real = regex.compile

    def counting(p: Any, *a: Any, **k: Any) -> Any:
        compiles.append(p)
        return real(p, *a, **k)

    monkeypatch.setattr(regex, "compile", counting)
    for _ in range(2):
        out = grep(engine, sid, pattern, mode="regex")
        assert out["count"] == 1 and "1234-5678" in out["results"][0]["snippet"], out
    assert compiles.count(pattern) == 2  # the check's compile is the grep's
    # Called directly, the search compiles the pattern itself.
    hits = store.read(lambda c: search_module.grep(c, A, sid, pattern, mode="regex", kinds=("message",),
                                                   sort="recency", limit=5))
    assert [h.ref for h in hits] == [1] and compiles.count(pattern) == 3


def test_graphemes_and_loops_weigh_what_they_cost_compiled(store: TranscriptStore, sid: str) -> None:
    """(?:\\X?){99990} counted 99,990 items and compiled to 170 MiB: \\X is 5 items now, a loop 3 times."""
    engine = make_engine(store)
    turn(store, engine, sid, "t1", "héllo wörld")
    for pattern in (r"(?:\X?){99990}", r"(?:\X++){99999}", r"(?:x?){40000}", r"((((((((((x)))))))))){10000}",
                    r"(?:(?=x)){40000}"):
        out = grep(engine, sid, pattern, mode="regex")
        assert out.get("error", "").startswith("regular expression too large"), (pattern, out)
    for pattern in (r"\X{3}", r"(?:\X?){1000}", r"x{99990}", r"(?:o\X){2}", r"(\w+) (\w+)"):
        assert "error" not in grep(engine, sid, pattern, mode="regex"), pattern
    assert expanded_size(r"\X") == 5 and expanded_size(r"x?") == 3 and expanded_size(r"(?=x)") == 3
    assert expanded_size(r"((x))") == 4 and expanded_size(r"\\X") == 2  # an escaped backslash, then X


# ---------------------------------------------------------------------------------------------- 2: rows read


def test_a_regex_reads_rows_up_to_their_searched_prefix(store: TranscriptStore, sid: str) -> None:
    """Rows of 2 MiB matched at their start: a search held every one whole (relevance keeps each hit to the
    end), though it searches the first REGEX_MAX_TEXT characters only."""
    engine = make_engine(store)
    rows = 6
    body = "x" * 2_000_000
    for n in range(rows):
        turn(store, engine, sid, f"t{n}", f"needle {n} " + body)
    for sort in ("relevance", "recency"):
        tracemalloc.start()
        try:
            out = grep(engine, sid, r"needle \d", mode="regex", sort=sort, limit=1)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert out["count"] == 1 and out["results"][0]["snippet"].startswith(f"needle {rows - 1} xxx"), out
        assert peak < rows * len(body) // 4, (sort, peak)


def test_a_match_at_the_end_of_the_prefix_shows_the_snippet_of_the_whole_text(
    store: TranscriptStore, sid: str
) -> None:
    """The searched prefix ends inside a long text: the snippet around a match there reads on past it and
    ends with "…" as the whole text's does; a match past the prefix is not found (as before)."""
    engine = make_engine(store)
    near_end = "a b " * ((REGEX_MAX_TEXT - 10) // 4) + "NEEDLE" + " tail words" * 40
    exact_end = "c" * (REGEX_MAX_TEXT - 6) + "NEEDLE"  # the whole text: no "…" after
    past = "d" * REGEX_MAX_TEXT + " NEEDLE"
    turn(store, engine, sid, "t1", near_end, exact_end, past)
    for sort in ("recency", "relevance"):
        out = grep(engine, sid, "NEEDLE", mode="regex", sort=sort, limit=200)
        got = {r["id"]: r["snippet"] for r in out["results"]}
        want = {}
        for text, ident in ((near_end, "msg_1"), (exact_end, "msg_2")):
            at = text.index("NEEDLE")
            want[ident] = snippet(text, (at, at + 6))
        assert got == want, (sort, got)
    assert got["msg_1"].endswith("…") and not got["msg_2"].endswith("…")
    hits = store.read(lambda c: search_module.grep(c, A, sid, "NEEDLE", mode="regex", kinds=("message",),
                                                   sort="recency", limit=10))
    at = near_end.index("NEEDLE")
    assert [(h.ref, h.span) for h in hits] == [(2, (REGEX_MAX_TEXT - 6, REGEX_MAX_TEXT)), (1, (at, at + 6))]


def test_a_bounded_page_is_the_best_of_every_match(store: TranscriptStore, sid: str) -> None:
    """The heap keeps the best ``limit``: the same page as sorting every hit, for either order."""
    engine = make_engine(store)
    texts = [f"row {n} " + "hit " * (n * 7 % 5) for n in range(40)]
    turn(store, engine, sid, "t1", *texts)
    scored = [(t.count("hit"), n + 1) for n, t in enumerate(texts) if "hit" in t]
    by_relevance = [f"msg_{o}" for _, o in sorted(scored, key=lambda s: (-s[0], -s[1]))]
    by_recency = [f"msg_{o}" for _, o in sorted(scored, key=lambda s: -s[1])]
    for limit in (1, 3, 7, 200):
        for sort, want in (("relevance", by_relevance), ("recency", by_recency)):
            for search_in in ("messages", "all"):
                out = call(engine, sid, "lcm_grep", {"pattern": "hit", "mode": "regex", "sort": sort,
                                                     "limit": limit, "search_in": search_in})
                assert [r["id"] for r in out["results"]] == want[:limit], (sort, limit, search_in)


# ---------------------------------------------------------------------------------------------- PostgreSQL


def _skip_sqlite(shared_url: str) -> None:
    if shared_url.startswith("sqlite"):
        pytest.skip("PostgreSQL only: SQLite has no server collation or string-literal setting")


@pytest.fixture
def icu_lt_store(shared_url: str) -> Iterator[TranscriptStore]:
    """A store in a throwaway database whose default collation is ICU's Lithuanian."""
    _skip_sqlite(shared_url)
    name = f"ts_icu_{uuid.uuid4().hex[:12]}"
    try:
        _admin_exec(
            f"CREATE DATABASE {name} TEMPLATE template0 ENCODING 'UTF8' LOCALE_PROVIDER icu ICU_LOCALE 'lt'"
            " LOCALE 'C.UTF-8'"
        )
    except psycopg.Error as e:
        pytest.skip(f"the server cannot create an ICU database: {e}")
    try:
        TranscriptStore.upgrade_url(pg_url(name))
        s = TranscriptStore(config=StoreConfig(url=pg_url(name), auto_upgrade=False))
        try:
            yield s
        finally:
            s.close()
    finally:
        _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_cjk_search_under_an_icu_locale_whose_lower_lengthens(icu_lt_store: TranscriptStore) -> None:
    store = icu_lt_store
    session = store.create_session(A, session_id="s-icu").session_id
    engine = make_engine(store)
    turn(store, engine, session, "t1", "中文字Ì中文字 and plain", "中文字X中文字")
    with store.db.engine.connect() as conn:
        assert len(conn.exec_driver_sql("SELECT lower('Ì')").scalar()) == 3  # the premise
    cases = (("中文字ì中文字", 1), ("中文字Ì中文字", 1), ("中文字x中文字", 1), ("中文字", 2), ("中文字i中文字", 0))
    for pattern, count in cases:
        out = grep(engine, session, pattern)
        assert out["count"] == count, (pattern, out)
    assert search_module._pg_like("中文字ìÌx中文字") == "%中文字%中文字%"


@pytest.fixture
def non_conforming_store(
    shared_url: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[TranscriptStore]:
    """A store in a throwaway database whose sessions have standard_conforming_strings off."""
    _skip_sqlite(shared_url)
    for url in fresh_url("postgresql", request, tmp_path):
        _admin_exec(f"ALTER DATABASE {url.rsplit('/', 1)[1]} SET standard_conforming_strings = off")
        s = TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))
        try:
            yield s
        finally:
            s.close()


def test_cjk_search_with_standard_conforming_strings_off(non_conforming_store: TranscriptStore) -> None:
    store = non_conforming_store
    session = store.create_session(A, session_id="s-scs").session_id
    engine = make_engine(store)
    turn(store, engine, session, "t1", "中文字テスト", r"中文字!%_\テスト")
    with store.db.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW standard_conforming_strings").scalar() == "off"  # the premise
    for pattern, count in (("中文字", 2), ("中文字テスト", 1), (r"字!%_\テ", 1), ("字!%", 1), ("字!!", 0), ("字%", 0)):
        out = grep(engine, session, pattern)
        assert out.get("count") == count, (pattern, out)


def test_like_wildcards_and_the_escape_character_are_literal(store: TranscriptStore, sid: str) -> None:
    """``!`` escapes the LIKE patterns now: it, ``%``, ``_`` and ``\\`` in a CJK term match only themselves."""
    engine = make_engine(store)
    turn(store, engine, sid, "t1", r"中文字!%_\テスト", "中文字a%b_テスト", "中文字テスト")
    for pattern, count in ((r"字!%_\テ", 1), ("字!%", 1), ("中文字!", 1), ("字%", 0), ("中文字_", 0), ("中文字", 3),
                           ("字a%b_テ", 1), ("字A%B_テ", 1), ("字!!", 0)):
        out = grep(engine, sid, pattern)
        assert out.get("count") == count, (pattern, out)
    assert search_module._pg_like(r"中文字!%_\テ") == r"%中文字!!!%!_\テ%"
