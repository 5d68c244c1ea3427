"""Full-text search folds case by one rule on both backends, and its spans point into the original text.

The rule (engines/lossless/search.py): a character matches another when both fold to the same one code
point: its simple case folding (``casefold()`` when that is one code point, else ``lower()`` when that
is one, else itself), U+FFFE and U+FFFF as U+FFFD. So İ (U+0130, whose lower case is two code points)
matches only itself, the Kelvin sign matches k, ß matches ẞ but not "ss", and the three Greek sigmas
match each other. Each backend folded its own way: PostgreSQL's ILIKE by the database's lower()
(C.UTF-8: İ is i, a final sigma is not a sigma), SQLite's trigram index by its own (older) table, and
terms under a trigram by GLOB classes of lower/upper/title forms (a long s is not an s). And a span was
an index into ``content.lower()``, which is longer than the content for every İ before the match.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import module_store_fixtures
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.lossless import LosslessEngine
from engines.lossless import search as search_module
from engines.lossless.tables import message_id, messages
from transcript_store import TranscriptStore
from transcript_store.core import Core
from transcript_store.engine import EngineContext
from transcript_store.models import ClosedRange
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-lsu"

TEXTS = [
    "İstanbul trip",  # U+0130: lower() is "i̇", two code points
    "ISTANBUL airport",
    "istanbul tea",
    "\u0131l\u0131k su",  # dotless i
    "300 \u212a kelvin sign",
    "ten kilometers",
    "Straße in Berlin",
    "STRASSE caps",
    "GROẞE STRAẞE",  # capital sharp s
    "ΟΔΟΣ upper",
    "οδος final",
    "οδοσ medial",
    "5 µs micro sign",
    "5 μs greek mu",
    "\u017ftop long s",
    "\u212b angstrom sign",
    "Å ring",
    "ᏣᎳᎩ cherokee",
    "ꮳꮃꭹ cherokee small",
    "ᲒᲐᲛᲐᲠᲯᲝᲑᲐ mtavruli",
    "გამარჯობა mkhedruli",
    "𐐀𐐁𐐂 deseret",
    "𐐨𐐩𐐪 deseret small",
    "𐒰𐒱𐒲 osage",
    "𐓘𐓙𐓚 osage small",
    "mark \ufffd here",
    "mark \ufffe there",
    "東京都 tokyo",
    "при" + "\u1c80" + "ет old rounded ve",  # U+1C80 folds to в: SQLite's tokenizer does not fold it
    "ПРИВЕТ мир",
    "стол и стул",
    "пос" + "\u1c84" + "тоталитарный",  # U+1C84 (tall te) folds to т
    "ǄEMAL ǅemal ǆemal",
    "ŉ ǰ ﬁ ΐ e\u0301 [Σ] ^ß a-Σ \\ẞ %ς_ *\u017f?",
]

PATTERNS = [
    "istanbul",
    "İstanbul",
    "İSTANBUL",
    "ISTANBUL",
    "i\u0307stanbul",
    "\u0131l\u0131k",
    "ILIK",
    "\u212a",
    "k",
    "300 k",
    "\u212a kelvin",
    "straße",
    "STRAẞE",
    "strasse",
    "ß",
    "ẞ",
    "ße",
    "οδος",
    "ΟΔΟΣ",
    "οδοσ",
    "ς",
    "\u03c3",
    "Σ",
    "δος",
    "µs",
    "μs",
    "\u039cS",
    "µ",
    "stop",
    "\u017ft",
    "\u017ftop",
    "STOP",
    "Å",
    "å",
    "\u212b",
    "ꮳꮃꭹ",
    "ᏣᎳᎩ",
    "ᏣᎳ",
    "ꮳꮃ",
    "ᲒᲐᲛ",
    "გამ",
    "ᲒᲐᲛᲐᲠᲯᲝᲑᲐ",
    "გა",
    "𐐨𐐩𐐪",
    "𐐀𐐁",
    "𐐨",
    "𐓘𐓙𐓚",
    "𐒰𐒱",
    "𐒰",
    "\ufffd",
    "\ufffe",
    "mark \uffff",
    "東京",
    "привет",
    "ПРИ" + "\u1c80" + "ет",
    "стол",
    "СТОЛ И",
    "ПОСТТОТАЛИТАРНЫЙ",
    "東京都",
    "ǅemal",
    "ǆ",
    "ǅ",
    "ŉ",
    "ǰ",
    "ﬁ",
    "fi",
    "ΐ",
    "e\u0301",
    "[\u03c3]",
    "^SS",
    "^ß",
    "a-ς",
    "\\ß",
    "%Σ_",
    "*s?",
    "\u017f?",
    "ǰ ﬁ ΐ",
]


def fold(text: str) -> str:
    """The documented rule, written again here: one code point for one code point."""
    out = []
    for ch in text:
        if ch in "\ufffe\uffff":
            out.append("\ufffd")
            continue
        f = ch.casefold()
        if len(f) != 1:
            f = ch.lower()
        out.append(f if len(f) == 1 else ch)
    return "".join(out)


shared_url, store, sid = module_store_fixtures(A, "lossless_search_unicode")


def make_engine(store: TranscriptStore) -> LosslessEngine:
    ctx = EngineContext(store=store, config={}, summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())
    return LosslessEngine(ctx)


def turn(store: TranscriptStore, engine: LosslessEngine, sid: str, turn_id: str, *replies: str) -> None:
    """Admit, append and commit one finished turn."""
    admission = store.admit(A, sid, {"role": "user", "content": f"question {turn_id}"}, turn_id=turn_id)
    appended = store.append_many(A, sid, [{"message": {"role": "assistant", "content": t}} for t in replies])
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    store.write(
        lambda c: engine.commit_turn(
            tx=c, advancement_key=turn_id, admission=admission.anchor, terminal=terminal, messages=closed.messages
        )
    )


def call(engine: LosslessEngine, sid: str, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(engine.handle_tool_call("lcm_grep", args, scope=A, session_id=sid))
    return out


def contents(store: TranscriptStore, sid: str) -> dict[int, str]:
    """Every message of the session by ordinal."""

    def run(c: Core) -> dict[int, str]:
        q = messages.select().where(messages.c.scope == A, messages.c.session_id == sid)
        return {r.ordinal: r.content for r in c.conn.execute(q)}

    return store.read(run)


def expected(by_ordinal: dict[int, str], pattern: str) -> list[int]:
    """The ordinals the rule finds for ``pattern``, newest first."""
    terms = [fold(t) for t in pattern.split()]
    return sorted((o for o, text in by_ordinal.items() if all(t in fold(text) for t in terms)), reverse=True)


def hits(store: TranscriptStore, sid: str, pattern: str) -> list[search_module.Hit]:
    return store.read(
        lambda c: search_module.grep(
            c, A, sid, pattern, mode="full_text", kinds=("message",), sort="recency", limit=200
        )
    )


@pytest.fixture(scope="module")
def corpus(store: TranscriptStore) -> Iterator[tuple[LosslessEngine, str, dict[int, str]]]:
    session = store.create_session(A, session_id=f"u-{uuid.uuid4().hex[:8]}").session_id
    engine = make_engine(store)
    turn(store, engine, session, "t1", *TEXTS)
    yield engine, session, contents(store, session)


@pytest.mark.parametrize("pattern", PATTERNS, ids=[ascii(p) for p in PATTERNS])
def test_both_backends_fold_case_by_the_documented_rule(
    store: TranscriptStore, corpus: tuple[LosslessEngine, str, dict[int, str]], pattern: str
) -> None:
    """The same hits, in the same order, on SQLite and PostgreSQL: the rule's, for every sort and limit."""
    engine, session, by_ordinal = corpus
    want = [message_id(o) for o in expected(by_ordinal, pattern)]
    out = call(engine, session, {"pattern": pattern, "search_in": "messages", "limit": 200})
    assert "error" not in out, out
    assert [r["id"] for r in out["results"]] == want, (pattern, [r["snippet"] for r in out["results"]])
    ranked = call(engine, session, {"pattern": pattern, "search_in": "messages", "limit": 200, "sort": "relevance"})
    assert sorted(r["id"] for r in ranked["results"]) == sorted(want)
    for limit in (1, 2):  # a smaller page is a prefix of a larger one
        page = call(engine, session, {"pattern": pattern, "search_in": "messages", "limit": limit})
        assert [r["id"] for r in page["results"]] == want[:limit]


@pytest.mark.parametrize("pattern", PATTERNS, ids=[ascii(p) for p in PATTERNS])
def test_a_span_is_the_first_match_in_the_original_text(
    store: TranscriptStore, corpus: tuple[LosslessEngine, str, dict[int, str]], pattern: str
) -> None:
    _, session, by_ordinal = corpus
    term = pattern.split()[0]
    found = hits(store, session, pattern)
    assert [h.ref for h in found] == expected(by_ordinal, pattern)
    for h in found:
        assert h.span is not None
        start, end = h.span
        assert fold(h.content[start:end]) == fold(term), (h.content, h.span)
        assert start == fold(h.content).find(fold(term))


def test_a_snippet_shows_the_match_when_lowercasing_lengthens_the_text(store: TranscriptStore, sid: str) -> None:
    """``content.lower()`` is one code point longer for every İ: the span was shifted by as many, and the
    snippet of a match after 200 of them showed the text 200 characters later (here: nothing of it)."""
    engine = make_engine(store)
    text = "İ" * 200 + " filler" * 5 + " the NEEDLE is here " + "tail " * 4
    turn(store, engine, sid, "t1", text)
    out = call(engine, sid, {"pattern": "needle", "search_in": "messages"})
    assert out["count"] == 1
    assert "NEEDLE is here" in out["results"][0]["snippet"], out
    (hit,) = hits(store, sid, "needle")
    assert hit.span is not None and text[hit.span[0] : hit.span[1]] == "NEEDLE"
    (hit,) = hits(store, sid, "İİ the needle")  # the span is the first term's
    assert hit.span == (0, 2)
    (hit,) = hits(store, sid, "is")
    assert hit.span is not None and text[hit.span[0] : hit.span[1]] == "is"


@pytest.mark.parametrize(
    "pattern",
    [
        "é" * 1000,
        "ς" * 1000,
        "İ" * 1000,
        "Σ" * 999,
        "ﬁ" * 500 + " " + "ß" * 499,
        " ".join(["ſΣ"] * 32),
        "\u0345" * 300,
        "𐐀" * 1000,
        "東" * 1000,
        "a\u0301" * 500,
    ],
    ids=[
        "e-acute",
        "final-sigma",
        "dotted-I",
        "capital-sigma",
        "ligature-fi",
        "terms",
        "ypogegrammeni",
        "deseret",
        "cjk",
        "combining",
    ],
)
def test_long_terms_of_folding_characters_answer_not_raise(store: TranscriptStore, sid: str, pattern: str) -> None:
    """The longest patterns the tool takes, of characters whose folding is special: an answer, not an error."""
    engine = make_engine(store)
    turn(store, engine, sid, "t1", pattern.upper(), pattern.lower(), pattern, "other")
    by_ordinal = contents(store, sid)
    out = call(engine, sid, {"pattern": pattern, "search_in": "messages", "limit": 200})
    assert "error" not in out, out
    assert [r["id"] for r in out["results"]] == [message_id(o) for o in expected(by_ordinal, pattern)]


#: letters that fold specially (dotless i, long s, the sigmas, micro and mu...), the ones around them
ALPHABET = [*"iIİ\u0131kK\u212asS\u017fßẞ\u03c3ςΣµμ\u039c\u03bf\u039fδΔ東京 aé\ufffd\ufffe", "ss", "İs", "ΟΣ", "στ"]


def test_full_text_agrees_with_the_rule(corpus: tuple[LosslessEngine, str, dict[int, str]]) -> None:
    engine, session, by_ordinal = corpus

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=6).map("".join).filter(str.strip))
    def run(pattern: str) -> None:
        out = call(engine, session, {"pattern": pattern, "search_in": "messages", "limit": 200})
        assert [r["id"] for r in out["results"]] == [message_id(o) for o in expected(by_ordinal, pattern)], pattern

    run()


@pytest.mark.parametrize(
    "term", ["needle", "Straße", "ΟΔΟΣ", "привет", "стол", "посттоталитарный", "東京都", "İstanbul", "გამარჯობა"]
)
def test_sqlite_words_keep_the_trigram_index(term: str) -> None:
    """Every word of a common script still makes an FTS5 query (no scan of the session's rows), though
    the tokenizer's table does not fold some forms of its letters (в and U+1C80, т and U+1C84...)."""
    match = search_module._fts5_match([term])
    assert match is not None and len(match) >= len(term), match
