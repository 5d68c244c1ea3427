"""A hostile review of the lossless engine's recall tools (lcm_grep, lcm_describe, lcm_expand), both backends.

The model writes a call's name and arguments: any JSON. The contract checked here:

- any name and any arguments answer a JSON object, ``{"error": ...}`` when refused, never an exception
  (the host would quarantine the engine for the process);
- a refused call writes nothing, not even a pending reset (the arguments are checked before any read);
- full text is what the docs say on both backends: every term occurs, case-insensitively, as a
  substring (PostgreSQL's word index found "foo s" for ``foo's``);
- a page of hits has one order, the same on both backends and for every limit (ties were the
  database's to break, by backend-specific scores);
- ids of another session or scope, or of nothing, answer "no such id" and show nothing of theirs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import regex
from conftest import module_store_fixtures
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from workers.fault_worker import table_rows

from engines.lossless import LosslessEngine, ingest
from engines.lossless.tables import message_id, messages, summaries, summary_id
from transcript_store import TranscriptStore
from transcript_store.core import MAX_INT
from transcript_store.engine import EngineContext
from transcript_store.models import ClosedRange
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A, B = "scope-lr", "scope-lr-b"
#: compacts a 30-turn chat into leaves and condensed summaries that share their newest leaf's last message
SMALL = {"context_window": 1500, "fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
         "condensed_summary_tokens": 160, "condense_fanin": 3}
TOOLS = ["lcm_grep", "lcm_describe", "lcm_expand"]
#: JSON values of every type, and the strings a tool argument is most likely to trip on
JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
    st.sampled_from(["sum_1", "sum_4", "msg_0", "msg_11", "regex", "full_text", "all", "messages", "summaries",
                     "relevance", "recency", "(a|aa)+$", "[[x]", "\x00", "\ud800", "sum_", "msg_-1", "sum_1 ",
                     "%", "_", "\\", '"', "NEAR(a b)", "content:x", "a & !b", "x" * 1001, 2**31, -(2**63)]),
)
JSON = st.recursive(JSON_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=6)
ARGS = st.one_of(JSON, st.dictionaries(
    st.sampled_from(["pattern", "mode", "search_in", "sort", "limit", "id", "offset", "extra"]), JSON, max_size=5))


shared_url, store, sid = module_store_fixtures(A, "lossless_review")


def make_engine(store: TranscriptStore, config: dict[str, Any] | None = None) -> LosslessEngine:
    return LosslessEngine(EngineContext(store=store, config=config or {}, summarizer=ExtractiveSummarizer(),
                                        estimator=RoughEstimator()))


def turn(store: TranscriptStore, engine: LosslessEngine, sid: str, turn_id: str, *replies: str,
         scope: str = A) -> list[str]:
    """Admit, append and commit one finished turn; its entry ids."""
    admission = store.admit(scope, sid, {"role": "user", "content": f"question {turn_id}"}, turn_id=turn_id)
    texts = replies or (f"answer {turn_id} " + "detail " * 30,)
    appended = store.append_many(scope, sid, [{"message": {"role": "assistant", "content": t}} for t in texts])
    terminal = store.anchor(scope, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    store.write(lambda c: engine.commit_turn(
        tx=c, advancement_key=turn_id, admission=admission.anchor, terminal=terminal, messages=closed.messages
    ))
    return [admission.anchor.entry_id, *(a.entry_id for a in appended)]


def call(engine: LosslessEngine, sid: str, name: Any, args: Any, scope: str = A) -> dict[str, Any]:
    out = json.loads(engine.handle_tool_call(name, args, scope=scope, session_id=sid))
    assert isinstance(out, dict)
    if "error" in out:
        assert set(out) == {"error"} and isinstance(out["error"], str), out
    return out


def chat(store: TranscriptStore, engine: LosslessEngine, sid: str, turns: int = 14) -> None:
    for n in range(turns):
        turn(store, engine, sid, f"t{n}")
        engine.maintain(scope=A, session_id=sid)
    engine.compact(scope=A, session_id=sid, force=True)


@pytest.fixture(scope="module")
def compacted(store: TranscriptStore) -> Iterator[tuple[LosslessEngine, str]]:
    """One compacted chat per backend, for the tests that only read (never written after it is built)."""
    session = store.create_session(A, session_id=f"c-{uuid.uuid4().hex[:8]}").session_id
    engine = make_engine(store, SMALL)
    chat(store, engine, session, 30)
    yield engine, session


def lower(text: str) -> str:
    """Case folding letter by letter, as ILIKE and the trigram tokenizer do (str.lower() makes a final Σ ς)."""
    return "".join(ch.lower() for ch in text)


def rows(store: TranscriptStore, sid: str) -> list[tuple[str, int, int, str]]:
    """(kind, ref, recency, content) of every message and summary of a session."""

    def run(c: Any) -> list[tuple[str, int, int, str]]:
        m = c.conn.execute(select(messages.c.ordinal, messages.c.content)
                           .where(messages.c.scope == A, messages.c.session_id == sid)).all()
        s = c.conn.execute(select(summaries.c.summary_seq, summaries.c.latest_ordinal, summaries.c.content)
                           .where(summaries.c.scope == A, summaries.c.session_id == sid)).all()
        return [("message", r.ordinal, r.ordinal, r.content) for r in m] + \
               [("summary", r.summary_seq, r.latest_ordinal, r.content) for r in s]

    return store.read(run)


def ref_id(kind: str, ref: int) -> str:
    return message_id(ref) if kind == "message" else summary_id(ref)


# ---------------------------------------------------------------------------------------------- types


@pytest.mark.parametrize("value", [["all"], {"all": 1}, [], {}, 1, True, 1.5, "ALL", "all "])
@pytest.mark.parametrize("name", ["search_in", "mode", "sort"])
def test_a_choice_of_any_json_type_is_refused_not_raised(
    compacted: tuple[LosslessEngine, str], name: str, value: Any
) -> None:
    """search_in was looked up in a dict: a list or an object raised TypeError (unhashable) out of the tool."""
    engine, session = compacted
    out = call(engine, session, "lcm_grep", {"pattern": "detail", name: value})
    assert out == {"error": out["error"]} and name in out["error"], out


@pytest.mark.parametrize("name", [["lcm_grep"], {"lcm_grep": 1}, None, 3, True, "LCM_GREP", "lcm_grep\x00"])
def test_a_tool_name_of_any_json_type_is_unknown(compacted: tuple[LosslessEngine, str], name: Any) -> None:
    engine, session = compacted
    out = call(engine, session, name, {"pattern": "detail"})
    assert out["error"].startswith("unknown tool"), out


def test_any_call_answers_json_and_writes_nothing(
    store: TranscriptStore, compacted: tuple[LosslessEngine, str]
) -> None:
    """Hypothesis draws the name and arguments: every call answers a JSON object (an error or a result
    of its tool), none raises, and none writes."""
    engine, session = compacted
    before = table_rows(store, A)

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(name=st.one_of(st.sampled_from(TOOLS), JSON), args=ARGS)
    def run(name: Any, args: Any) -> None:
        out = call(engine, session, name, args)
        if "error" not in out:
            assert name in TOOLS and isinstance(args, dict)
            assert ("results" in out) if name == "lcm_grep" else ("items" in out or "kind" in out)

    run()
    assert table_rows(store, A) == before


# ---------------------------------------------------------------------------------------------- refusals


def test_a_refused_call_writes_nothing_even_with_a_reset_pending(store: TranscriptStore, sid: str) -> None:
    """A rewrite leaves a reset pending, which a recall tool applies before it answers; a call refused
    for its arguments applied it too (a write, and the session's lock) before the handler refused."""
    engine = make_engine(store, SMALL)
    entries = [turn(store, engine, sid, f"t{n}") for n in range(6)]
    store.rewrite_entries(A, sid, [{"entry_id": entries[1][1], "message": {"role": "assistant", "content": "[x]"}}])
    assert store.read(lambda c: ingest.reset_pending(c, A, sid))
    before = table_rows(store, A)
    refused = [
        ("lcm_grep", {"pattern": 5}), ("lcm_grep", {"pattern": "  "}), ("lcm_grep", {"pattern": "x\x00"}),
        ("lcm_grep", {"pattern": "(", "mode": "regex"}), ("lcm_grep", {"pattern": "(a{1000}){1000}", "mode": "regex"}),
        ("lcm_grep", {"pattern": "x", "limit": "5"}), ("lcm_grep", {"pattern": "x", "sort": "best"}),
        ("lcm_describe", {"id": 7}), ("lcm_describe", {}), ("lcm_describe", {"id": "x" * 256}),
        ("lcm_expand", {"id": "msg_0", "limit": True}), ("lcm_expand", {"id": "msg_0", "offset": 1.5}),
        ("lcm_expand", {"id": "msg_\ud800"}), ("lcm_nope", {}), ("lcm_grep", ["x"]),
    ]
    for name, args in refused:
        assert set(call(engine, sid, name, args)) == {"error"}, (name, args)
    assert table_rows(store, A) == before
    assert store.read(lambda c: ingest.reset_pending(c, A, sid))
    assert call(engine, sid, "lcm_grep", {"pattern": "answer t1"})["count"] == 0  # a valid call applies it
    assert not store.read(lambda c: ingest.reset_pending(c, A, sid))


# ---------------------------------------------------------------------------------------------- full text

TEXTS = ["foo s here", "foo's there", "a-b c", "[x] y", "x alone", "50% off", "a_b", "back\\slash", "ÉTÉ déjà",
         "漢字 かな", 'say "hi"', "NEAR(a b)", "col:umn x", "*star*", "Σοφία", "plain words only"]
ALPHABET = [*"abxyo sfé'-[]%_\\\"*:()ÉΣσ漢", "foo", "here", "NEAR", "AND", "OR", "NOT", "^", "+"]


@pytest.fixture(scope="module")
def corpus(store: TranscriptStore) -> Iterator[tuple[LosslessEngine, str, dict[str, str]]]:
    session = store.create_session(A, session_id=f"f-{uuid.uuid4().hex[:8]}").session_id
    engine = make_engine(store)
    turn(store, engine, session, "t1", *TEXTS)
    yield engine, session, {ref_id(k, r): text for k, r, _, text in rows(store, session)}


def expected(by_id: dict[str, str], pattern: str) -> list[str]:
    found = [i for i, text in by_id.items() if all(lower(t) in lower(text) for t in pattern.split())]
    return sorted(found, key=lambda i: -int(i[4:]))


@pytest.mark.parametrize("pattern", ["foo's", "[x", "x]", "50%", "a_b", "\\", '"hi"', "NEAR(a", "col:umn", "*star",
                                     "ét", "ÉTÉ DÉJÀ", "σοφ", "字 か", "a-b", "b-a", "AND", "s'", "(a b)"])
def test_full_text_finds_substrings_only(corpus: tuple[LosslessEngine, str, dict[str, str]], pattern: str) -> None:
    """PostgreSQL's word index decided alone: "foo's" found "foo s here", "[x" found "x alone"."""
    engine, session, by_id = corpus
    out = call(engine, session, "lcm_grep", {"pattern": pattern, "search_in": "messages", "limit": 200})
    assert [r["id"] for r in out["results"]] == expected(by_id, pattern), out


def test_full_text_agrees_with_its_definition(corpus: tuple[LosslessEngine, str, dict[str, str]]) -> None:
    engine, session, by_id = corpus

    @settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=6).map("".join).filter(str.strip))
    def run(pattern: str) -> None:
        for sort in ("recency", "relevance"):
            out = call(engine, session, "lcm_grep", {"pattern": pattern, "search_in": "messages", "limit": 200,
                                                     "sort": sort})
            want = expected(by_id, pattern)
            got = [r["id"] for r in out["results"]]
            assert (got if sort == "recency" else sorted(got, key=lambda i: -int(i[4:]))) == want, (pattern, sort)

    run()


# ---------------------------------------------------------------------------------------------- order


def test_a_page_of_hits_has_one_order(store: TranscriptStore, compacted: tuple[LosslessEngine, str]) -> None:
    """A condensed summary shares its newest child's recency (and a summary its last message's): the
    order of such ties was the database's, and full text broke them by a backend's own score, so the top
    hit of limit=1 was not the first of limit=3, and a regex scanned summaries by id, not recency."""
    engine, session = compacted
    everything = rows(store, session)
    summary_recency = [r for k, _, r, _ in everything if k == "summary"]
    assert len(summary_recency) > len(set(summary_recency))  # the premise: tied summaries
    assert {r for k, _, r, _ in everything if k == "message"} & set(summary_recency)  # and a message tied

    def reference(pattern: str, mode: str, relevance: bool, kinds: tuple[str, ...]) -> list[str]:
        if mode == "regex":
            score = [len(regex.findall(pattern, text)) for _, _, _, text in everything]
        else:
            score = [int(all(lower(t) in lower(text) for t in pattern.split())) for _, _, _, text in everything]
        hits = [(k, ref, rec, n) for (k, ref, rec, _), n in zip(everything, score, strict=True) if n and k in kinds]
        key = (lambda h: (-h[3], -h[2], h[0], -h[1])) if relevance else (lambda h: (-h[2], h[0], -h[1]))
        return [ref_id(k, ref) for k, ref, _, _ in sorted(hits, key=key)]

    for search_in, kinds in (("summaries", ("summary",)), ("all", ("message", "summary"))):
        for mode, pattern in (("full_text", "summary"), ("full_text", "detail"), ("regex", "Summary"),
                              ("regex", "detail")):
            for sort in ("recency", "relevance") if mode == "regex" else ("recency",):
                want = reference(pattern, mode, sort == "relevance", kinds)
                assert len(want) > 3
                for limit in (1, 2, 3, 5, 200):
                    args = {"pattern": pattern, "mode": mode, "search_in": search_in, "sort": sort, "limit": limit}
                    got = [r["id"] for r in call(engine, session, "lcm_grep", args)["results"]]
                    assert got == want[:limit], (args, got, want)


# ---------------------------------------------------------------------------------------------- numbers


def test_limits_and_offsets_are_clamped_or_refused(compacted: tuple[LosslessEngine, str]) -> None:
    engine, session = compacted
    for limit, count in ((-5, 1), (0, 1), (1, 1), (10**30, None), (MAX_INT + 1, None)):
        out = call(engine, session, "lcm_grep", {"pattern": "detail", "limit": limit})
        assert out["count"] == count if count is not None else 1 < out["count"] <= 200, (limit, out)
    for bad in (True, False, 1.0, float("nan"), float("inf"), "3", [3], {"n": 3}):
        assert "limit" in call(engine, session, "lcm_grep", {"pattern": "detail", "limit": bad})["error"]
        assert "offset" in call(engine, session, "lcm_expand", {"id": "sum_1", "offset": bad})["error"]
    top = [s for s in (f"sum_{n}" for n in range(1, 10))
           if call(engine, session, "lcm_describe", {"id": s}).get("kind") == "condensed"]
    assert top
    for ident in (top[0], "sum_1"):
        seen: list[str] = []
        offset: Any = 0
        while offset is not None:
            page = call(engine, session, "lcm_expand", {"id": ident, "offset": offset, "limit": 1})
            seen += [i["id"] for i in page["items"]]
            offset = page["next_offset"]
        assert seen and len(seen) == len(set(seen)) == page["total"]
        out = call(engine, session, "lcm_expand", {"id": ident, "offset": page["total"], "limit": 10**30})
        assert out["items"] == [] and out["next_offset"] is None and out["offset"] == page["total"]
        # Past the end, negative or past the INTEGER columns: refused, never moved to an offset not asked for.
        for far in (page["total"] + 1, MAX_INT, MAX_INT + 1, 10**30, -3):
            out = call(engine, session, "lcm_expand", {"id": ident, "offset": far, "limit": 10**30})
            assert "offset" in out["error"], out


def test_null_for_an_optional_argument_is_its_default(compacted: tuple[LosslessEngine, str]) -> None:
    """Models in strict function-calling mode send every property, null for those they leave out: a null
    limit, mode, search_in, sort or offset was refused, and the model's recall failed."""
    engine, session = compacted
    nulls = {"mode": None, "search_in": None, "sort": None, "limit": None}
    assert call(engine, session, "lcm_grep", {"pattern": "detail", **nulls}) == \
        call(engine, session, "lcm_grep", {"pattern": "detail"})
    assert call(engine, session, "lcm_expand", {"id": "sum_1", "offset": None, "limit": None}) == \
        call(engine, session, "lcm_expand", {"id": "sum_1"})
    assert "pattern" in call(engine, session, "lcm_grep", {"pattern": None})["error"]  # required stays required
    assert "id" in call(engine, session, "lcm_expand", {"id": None})["error"]


def test_a_regex_warning_raised_as_an_error_is_a_refusal(
    compacted: tuple[LosslessEngine, str], recwarn: pytest.WarningsRecorder
) -> None:
    """A host running with warnings as errors got the parser's FutureWarning ("possible nested set") of
    "[[a]" out of the tool as an exception: the engine was quarantined for the process."""
    import warnings

    engine, session = compacted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = call(engine, session, "lcm_grep", {"pattern": "[[a]", "mode": "regex"})
    assert "regular expression" in out["error"], out


# ---------------------------------------------------------------------------------------------- isolation


def test_ids_of_another_session_or_scope_show_nothing(store: TranscriptStore, sid: str) -> None:
    """Entry ids, sum_N and msg_N of another session (of this scope, or under the same session id in
    another scope) answer "no such id" or this session's own rows; a search never finds their text; a
    session or scope that does not exist answers the same, and nothing is written."""
    engine = make_engine(store, SMALL)
    other = store.create_session(A, session_id=f"o-{uuid.uuid4().hex[:8]}").session_id
    store.create_session(B, session_id=other)  # the same session id in another scope
    owners: dict[tuple[str, str], tuple[str, list[str]]] = {(A, sid): ("PLAIN", []), (A, other): ("KUMQUAT", []),
                                                            (B, other): ("BEEHIVE", [])}
    for n in range(8):
        for (scope, session), (word, ids) in owners.items():
            ids += turn(store, engine, session, f"t{n}", f"{word}-{n} " + "private " * 30, scope=scope)
    for scope, session in owners:
        engine.compact(scope=scope, session_id=session, force=True)
    before = table_rows(store)
    viewers = [*owners, (A, "no-such-session"), ("no-such-scope", other)]
    for scope, session in viewers:
        own = owners.get((scope, session), ("", []))[0]
        for (o_scope, o_session), (word, ids) in owners.items():
            if (o_scope, o_session) == (scope, session):
                continue
            for mode in ("full_text", "regex"):
                out = call(engine, session, "lcm_grep", {"pattern": word, "mode": mode}, scope=scope)
                assert out["count"] == 0, (scope, session, word, out)
            for ident in [*ids, *(f"sum_{n}" for n in range(6)), *(f"msg_{n}" for n in (0, 5, 20))]:
                for name in ("lcm_describe", "lcm_expand"):
                    out = call(engine, session, name, {"id": ident, "limit": 200}, scope=scope)
                    assert word not in json.dumps(out, ensure_ascii=False), (scope, session, name, ident)
                    if ident in ids or not own:
                        assert "error" in out, (scope, session, name, ident, out)
        if own:
            assert call(engine, session, "lcm_grep", {"pattern": own}, scope=scope)["count"] > 0
    assert table_rows(store) == before
