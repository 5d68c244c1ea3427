"""The Hermes adapter against hostile input: what a host (or a user's paste) can put in a message list.

Runs under plain pytest with the stand-in base class, as tests/test_hermes_adapter.py does.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import pickle
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from test_hermes_adapter import conversation

from transcript_store.compaction import summary_message
from transcript_store.hermes import (
    as_text,
    create_engine,
    is_context_message,
    is_valid_sequence,
    merge_context,
    resolve_threshold,
    storable,
)
from transcript_store.models import validate_message
from transcript_store.tokens import RoughEstimator


def make(db_url: str, **kwargs: Any) -> Any:
    kwargs.setdefault("context_length", 64000)
    kwargs.setdefault("threshold_percent", 2000)
    return create_engine(allow_stand_in=True, db_url=db_url, **kwargs)


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


def stored(engine: Any, session: str) -> list[str]:
    return [json.dumps(m, sort_keys=True) for m in engine.stored_messages(session)]


def test_compress_given_non_messages_never_raises_and_stores_the_messages(tmp_path: Path) -> None:
    """A list holding non-dicts raised AttributeError into Hermes (split_system called .get on them)."""
    engine = make(sqlite_url(tmp_path))
    engine.on_session_start("s1")
    convo = conversation("nd", 8)
    for hostile in ([*convo, "junk", 5, None], ["junk", *convo], [*convo[:3], None, *convo[3:]]):
        out = engine.compress(copy.deepcopy(hostile))
        assert isinstance(out, list)
    rows = stored(engine, "s1")
    assert len(rows) == len(convo) == len(set(rows))
    assert engine.compress(None) is None  # no list at all: handed back, never an exception


ODD_VALUES: dict[str, dict[str, Any]] = {
    "lone-surrogate": {"role": "user", "content": "pasted \ud800 text"},
    "surrogate-pair": {"role": "user", "content": "emoji \ud83d\ude00 as a pair"},
    "nul": {"role": "user", "content": "a\x00b"},
    "set": {"role": "user", "content": "x", "meta": {1, 2}},
    "bytes": {"role": "user", "content": b"raw bytes"},
    "nan": {"role": "user", "content": "x", "score": float("nan")},
    "int-key": {"role": "user", "content": "x", 1: "numbered"},
    "surrogate-key": {"role": "user", "content": "x", "pasted \udc80 key": "v"},
    "refusal": {"role": "assistant", "content": None, "refusal": "I cannot help with that."},
    "reasoning-only": {"role": "assistant", "content": None, "reasoning": "thought, said nothing"},
    "tuple-parts": {"role": "user", "content": ({"type": "text", "text": "t"},)},
    # Shapes the store refuses as they are (each one blocked every later store of the conversation):
    "no-role": {"content": "a message without a role"},
    "unknown-role": {"role": "critic", "content": "an unknown role"},
    "object-content": {"role": "user", "content": {"text": "an object", "n": 1}},
    "number-content": {"role": "user", "content": 42},
    "string-parts": {"role": "user", "content": ["parts", "as plain strings"]},
    "tool-without-call-id": {"role": "tool", "content": "a result answering no call"},
    "object-arguments": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_obj", "type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]},
    "too-deep": {"role": "user", "content": "deep", "meta": functools.reduce(lambda v, _: {"k": v}, range(80), {})},
    "oversized": {"role": "tool", "tool_call_id": "call_big", "content": "big " * 80_000},
    "oversized-parts": {"role": "user", "content": [{"type": "text", "text": "big " * 80_000}]},
}

#: the store's cap while ODD_VALUES are stored: their oversized ones (320 KB) are over it. Cutting is the
#: same at any cap, and 4.8 MB over the default cap of 4 MiB cost seconds of CPU a case: that size, at
#: the default cap, is in the slow tier (AT_DEFAULT_CAP).
SMALL_CAP = 256 * 1024
AT_DEFAULT_CAP: dict[str, dict[str, Any]] = {
    "oversized-default-cap": {"role": "tool", "tool_call_id": "call_big", "content": "big " * 1_200_000},
    "oversized-parts-default-cap": {"role": "user", "content": [{"type": "text", "text": "big " * 1_200_000}]},
}

#: what of each refused shape must still be in the store (its text or its JSON)
KEPT: dict[str, str] = {
    "no-role": "a message without a role",
    "unknown-role": "an unknown role",
    "object-content": "an object",
    "number-content": "42",
    "string-parts": "as plain strings",
    "tool-without-call-id": "a result answering no call",
    "object-arguments": "call_obj",
    "too-deep": "deep",
    "oversized": "big big",
    "oversized-parts": "big big",
    "oversized-default-cap": "big big",
    "oversized-parts-default-cap": "big big",
}


def odd_value(case: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The value of ``case`` of ODD_VALUES (under SMALL_CAP, set here) or AT_DEFAULT_CAP."""
    if case in AT_DEFAULT_CAP:
        return AT_DEFAULT_CAP[case]
    monkeypatch.setenv("TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES", str(SMALL_CAP))
    return ODD_VALUES[case]


SLOW_ODD = [pytest.param(case, marks=pytest.mark.slow) for case in AT_DEFAULT_CAP]


@pytest.mark.parametrize("case", [*sorted(ODD_VALUES), *SLOW_ODD])
def test_one_odd_value_does_not_make_the_whole_conversation_unstorable(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One message the store cannot take as it is (a lone surrogate from a paste, a set, bytes, NaN, a
    non-string key) failed every ingest: nothing of the session was stored, on every later call too."""
    odd = odd_value(case, monkeypatch)
    engine = make(sqlite_url(tmp_path))
    engine.on_session_start("s1")
    convo = conversation("odd", 6)
    messages = [*convo, copy.deepcopy(odd), {"role": "assistant", "content": "after the odd one"}]
    engine.on_turn_complete(copy.deepcopy(messages))
    engine.on_turn_complete(copy.deepcopy(messages))  # again: nothing twice
    out = engine.compress(copy.deepcopy(messages))
    engine.on_session_end("s1", copy.deepcopy(messages))
    rows = stored(engine, "s1")
    assert len(rows) == len(messages) == len(set(rows)), rows[-3:]
    for m in convo:
        assert json.dumps(m, sort_keys=True) in rows
    assert isinstance(out, list) and all(isinstance(m, dict) for m in out)
    assert engine.compression_count == 1 and len(out) < len(messages)  # compacted, not handed back
    json.dumps(engine.stored_messages("s1"), allow_nan=False).encode("utf-8")  # plain JSON, valid UTF-8
    if case in KEPT:
        assert KEPT[case] in rows[len(convo)]
        assert json.loads(rows[-1]) == messages[-1]  # what follows it is stored as it is
    # The conversation goes on after the compaction: the answer taken, a turn added, stored once.
    later = [*out, {"role": "user", "content": "the next turn"}, {"role": "assistant", "content": "its answer"}]
    engine.on_turn_complete(copy.deepcopy(later))
    engine.on_turn_complete(copy.deepcopy(later))
    rows = stored(engine, "s1")
    assert len(rows) == len(messages) + 2 == len(set(rows)), rows[-3:]


@pytest.mark.parametrize("cap", ["small", pytest.param("default", marks=pytest.mark.slow)])
def test_odd_values_on_every_backend(store_url: str, cap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the configured backend (PostgreSQL's jsonb is stricter than SQLite)."""
    cases = list(ODD_VALUES) if cap == "small" else list(AT_DEFAULT_CAP)
    values = {case: odd_value(case, monkeypatch) for case in cases}
    engine = make(store_url)
    convo = conversation("pg", 3)
    for case, odd in values.items():
        messages = [*convo, copy.deepcopy(odd)]
        engine.on_turn_complete(copy.deepcopy(messages), session_id=case)
        engine.compress(copy.deepcopy(messages), session_id=case)
        rows = stored(engine, case)
        assert len(rows) == len(messages) == len(set(rows)), case
        if case in KEPT:
            assert KEPT[case] in rows[-1], case
    engine.close()


def test_odd_usage_and_model_values_never_raise(tmp_path: Path) -> None:
    """update_from_response and update_model raised ValueError / TypeError / OverflowError into Hermes on
    odd usage values or a model_thresholds map with numeric keys (YAML ``3.5: 0.7``) or an infinite value."""
    engine = make(sqlite_url(tmp_path), threshold_percent=0.5)
    for usage in ({"prompt_tokens": "abc"}, {"prompt_tokens": {"x": 1}}, {"prompt_tokens": float("inf")},
                  {"prompt_tokens": None, "total_tokens": None}):
        engine.update_from_response(usage)
        assert isinstance(engine.last_prompt_tokens, int) and isinstance(engine.last_total_tokens, int)
    engine.update_from_response({"prompt_tokens": "120", "completion_tokens": 3.0})
    assert (engine.last_prompt_tokens, engine.last_total_tokens) == (120, 123)
    engine.model_thresholds = {3.5: 0.7, None: 0.1, "": 0.9, "gpt": "nan"}
    engine.update_model("gpt-3.5-turbo", 100000)
    assert engine.threshold_tokens == 70000  # the numeric key is a model name part, the longest match
    engine.model_thresholds = {"gpt": float("inf")}
    engine.update_model("gpt-4", 100000)
    assert engine.threshold_tokens == 50000  # no finite threshold: the configured one
    engine.model_thresholds = {"gpt": -1}
    engine.update_model("gpt-4", 100000)
    assert engine.threshold_tokens == 50000
    engine.model_thresholds = ["gpt"]  # not a map: ignored
    engine.update_model(None, "80000")
    assert engine.context_length == 80000 and engine.threshold_tokens == 40000
    assert resolve_threshold("m", {"m": math.nan}, 0.5) == 0.5
    status = engine.get_status()
    assert status["threshold_tokens"] == 40000 and 0 <= status["usage_percent"] <= 100


def test_concurrent_sessions_with_copies_taken_mid_use(store_url: str) -> None:
    """Passes of several sessions on one instance, on several threads, while the host deep-copies and
    pickles it: every message stored once per session, no session's message in another, valid answers."""
    engine = make(store_url)
    n = 4
    convos = {f"sess{i}": conversation(f"t{i}x", 8) for i in range(n)}
    barrier = threading.Barrier(n + 1)
    results: dict[str, list[dict[str, Any]]] = {}
    errors: list[BaseException] = []

    def run(session: str) -> None:
        barrier.wait()
        try:
            for k in range(2):
                out = engine.compress(copy.deepcopy(convos[session]), session_id=session)
                results[session] = out
                engine.on_turn_complete([*out, {"role": "user", "content": f"{session} more {k}"}],
                                        session_id=session)
        except BaseException as e:  # reported below
            errors.append(e)

    def copier() -> None:
        barrier.wait()
        try:
            for _ in range(20):
                assert copy.deepcopy(engine)._rt is None
                assert pickle.loads(pickle.dumps(engine))._rt is None
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in convos] + [threading.Thread(target=copier)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for session, convo in convos.items():
        assert is_valid_sequence(results[session])
        rows = stored(engine, session)
        assert len(rows) == len(convo) + 2 == len(set(rows))
        assert all(json.dumps(m, sort_keys=True) in rows for m in convo)
        tag = session.replace("sess", "t")
        assert all(f"{tag}x" in r for r in rows if "question" in r or "answer" in r)
    engine.close()


class _SetsAnAttributeWhenCopied:
    """A configuration value whose copy adds an attribute to the engine: what another thread's first compress
    (``_last_summary_error``, ``_own_tools``...) does while the host deep-copies the engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self.engine.__dict__["attribute_set_meanwhile"] = True
        return "copied"


def test_a_deep_copy_while_another_thread_sets_a_new_attribute_copies_a_snapshot(tmp_path: Path) -> None:
    """The copy iterates a snapshot of the engine's attributes: one added meanwhile (an attribute first set by a
    concurrent compress) made ``copy.deepcopy`` raise "dictionary changed size during iteration"."""
    engine = make(sqlite_url(tmp_path))
    engine.engine_config = {"value": _SetsAnAttributeWhenCopied(engine)}
    copied = copy.deepcopy(engine)
    assert copied.engine_config == {"value": "copied"}
    assert copied._rt is None and engine.attribute_set_meanwhile is True


def test_a_list_hermes_sanitized_later_aligns_with_what_was_stored(tmp_path: Path) -> None:
    """Hermes replaces each surrogate code point with U+FFFD in place when a request fails on one: the
    stored message is the same, so its sanitized list neither branches nor stores anything again."""
    import re

    engine = make(sqlite_url(tmp_path))
    engine.on_session_start("s1")
    messages = [*conversation("san", 3), {"role": "user", "content": "pair \ud83d\ude00 lone \udc00 end"}]
    engine.on_turn_complete(copy.deepcopy(messages))
    sanitized = copy.deepcopy(messages)
    sanitized[-1]["content"] = re.sub(r"[\ud800-\udfff]", "\ufffd", sanitized[-1]["content"])
    engine.on_turn_complete([*sanitized, {"role": "assistant", "content": "reply"}])
    rows = stored(engine, "s1")
    assert len(rows) == len(messages) + 1 == len(set(rows))


LOOKALIKES = [
    "[transcript-store context] what does this line in my log mean?",
    "[transcript-store context]\nnot a summary, a paste",
    "[Summary sum_3 please: the last three points]",
    "[Summary of the earlier conversation] - my own heading",
    "[Summary] of my day",
]


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
def test_a_user_message_that_looks_like_ours_is_stored(store_url: str, engine_id: str) -> None:
    """A user message starting with our marker or with "[Summary sum_" was taken for the adapter's own
    context and never stored: the user's words lost, and "[Summary..." ones merged into the summaries."""
    engine = make(store_url, engine=engine_id)
    engine.on_session_start("s1")
    messages = conversation("look", 8)
    for i, text in enumerate(LOOKALIKES):
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": f"reply {i}"}]
    engine.on_turn_complete(copy.deepcopy(messages))
    out = engine.compress(copy.deepcopy(messages))  # the answer carries our real context block
    assert is_valid_sequence(out)
    ours = [m for m in out if is_context_message(m)]
    assert [m["role"] for m in ours] == ["user", "assistant"]  # the block (engine's rendering) and the ack
    # The host takes the answer and goes on: what it adds (a look-alike again) is stored, ours is not.
    later = [*out, {"role": "user", "content": LOOKALIKES[0] + " (again)"}, {"role": "assistant", "content": "ok"}]
    engine.on_turn_complete(copy.deepcopy(later))
    rows = stored(engine, "s1")
    assert len(rows) == len(set(rows)) == len(messages) + 2
    for text in [*LOOKALIKES, LOOKALIKES[0] + " (again)"]:
        assert json.dumps({"role": "user", "content": text}, sort_keys=True) in rows
    assert not any(is_context_message(m) for m in engine.stored_messages("s1"))
    # A look-alike right after the summaries stays a message of its own, not part of the block.
    for text in LOOKALIKES:
        own = {"role": "user", "content": text}
        merged = merge_context([summary_message("what came before"), own])
        assert len(merged) == 3 and merged[-1] == own and is_context_message(merged[0])


def test_get_status_takes_a_missing_prompt_count(tmp_path: Path) -> None:
    """Hermes may leave last_prompt_tokens None (or a float); get_status raised TypeError on None."""
    engine = make(sqlite_url(tmp_path))
    for value in (None, 12.7, "34", float("nan"), -1):
        engine.last_prompt_tokens = value
        status = engine.get_status()
        assert isinstance(status["last_prompt_tokens"], int) and status["last_prompt_tokens"] >= 0


def test_a_caller_mutating_the_selected_context_leaves_the_next_selection_whole(tmp_path: Path) -> None:
    """``select_context`` returned the adapter's cached list itself, the same object at every call while
    nothing changed: a host that appended to it, cut it, or edited a message in place (a cache marker,
    a sanitized content) changed what the next request of the session was given. Every call now gets a
    list of its own, equal to the first."""
    engine = make(sqlite_url(tmp_path))
    engine.on_session_start("s1")
    system = {"role": "system", "content": "You are a test agent."}
    convo = conversation("sel", 10)
    out = engine.compress([system, *convo])
    taken = [*out, {"role": "user", "content": "sel next"}]
    budget = RoughEstimator().count_messages(taken) - 100
    first = engine.select_context(taken, budget_tokens=budget)
    assert isinstance(first, list) and first
    pristine = copy.deepcopy(first)
    for hostile in (first, engine.select_context(taken, budget_tokens=budget)):
        assert hostile == pristine
        hostile[0]["content"] += " and a cache marker"
        hostile[-1]["content"] = "sanitized"
        hostile.append({"role": "user", "content": "appended by the host"})
        del hostile[1]
        again = engine.select_context(taken, budget_tokens=budget)
        assert again == pristine and again is not hostile


def test_is_valid_sequence_answers_false_for_items_that_are_no_messages() -> None:
    """A list holding a non-dict raised AttributeError (valid_sequence read each item with .get) where the
    answer is False: it is no OpenAI message list."""
    for hostile in ([{"role": "user", "content": "hi"}, "junk"], [None], [5, {"role": "user", "content": "x"}]):
        assert is_valid_sequence(hostile) is False
    assert is_valid_sequence([{"role": "user", "content": "hi"}]) is True


@pytest.mark.parametrize("tokens", ["20000", math.inf, {"x": 1}, [1]])
def test_compress_reads_an_odd_token_count_as_should_compress_does(tmp_path: Path, tokens: Any) -> None:
    """``should_compress`` reads a count that is no number as a usage value is, but ``compress`` compared it
    with 0 (TypeError) or made an int of it (OverflowError): the list came back uncompressed, logged only,
    after should_compress had said to compress it."""
    engine = make(sqlite_url(tmp_path))
    engine.on_session_start("s1")
    convo = conversation("tok", 12)
    out = engine.compress(copy.deepcopy(convo), current_tokens=tokens)
    assert engine.compression_count == 1 and len(out) < len(convo) and is_valid_sequence(out)


@pytest.mark.parametrize("case", ["no-role", "tool-without-call-id", "oversized", *SLOW_ODD[:1]])
def test_a_refused_message_in_the_fresh_tail_is_in_the_answer_once(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fresh tail comes back verbatim beside the engine's context, which holds the message as stored:
    a message stored in another form (its JSON as text, a cut tool result) was in the answer twice, and
    a tool result of megabytes made the answer no smaller than the list (handed back, uncompressed)."""
    odd = copy.deepcopy(odd_value(case, monkeypatch))
    engine = make(sqlite_url(tmp_path))
    engine.on_session_start("s1")
    call = {"id": "call_big", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [*conversation("tail", 8), {"role": "user", "content": "now"},
                {"role": "assistant", "content": None, "tool_calls": [call]}, odd]
    out = engine.compress(copy.deepcopy(messages))
    assert engine.compression_count == 1 and len(out) < len(messages)
    assert out[-1] == odd and out[-2]["tool_calls"] == [call]
    assert not any(KEPT[case] in json.dumps(m) for m in out[:-1])  # not its stored copy besides
    later = [*out, {"role": "assistant", "content": "done"}]
    engine.on_turn_complete(copy.deepcopy(later))
    engine.on_turn_complete(copy.deepcopy(later))
    rows = stored(engine, "s1")
    assert len(rows) == len(messages) + 1 == len(set(rows))


def past_recursion_limit(leaf: Any, wrap: Any) -> Any:
    """``leaf`` wrapped (``wrap``) five times Python's recursion limit deep, built without recursion."""
    return functools.reduce(lambda v, _: wrap(v), range(5 * sys.getrecursionlimit()), leaf)


def deep_round(case: str) -> list[dict[str, Any]]:
    """A tool round or turn with one message nested past Python's recursion limit (made afresh: the test
    cannot ``copy.deepcopy`` it either)."""
    deep = past_recursion_limit({"q": "deepest value"}, lambda v: {"k": v})
    call = {"id": "call_deep", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    if case == "deep-arguments":
        call["function"]["arguments"] = deep
    user: dict[str, Any] = {"role": "user", "content": "look it up"}
    if case == "deep-field":
        user["meta"] = deep
    if case == "deep-parts":
        user["content"] = past_recursion_limit(["deepest value"], lambda v: [v])
    if case == "deep-host-flag":
        user["_host_flag"] = deep
    return [user, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_deep", "content": "deep result"},
            {"role": "assistant", "content": "after the deep one"}]


@pytest.mark.parametrize("case", ["deep-field", "deep-arguments", "deep-parts", "deep-host-flag"])
def test_a_message_nested_past_the_recursion_limit_is_stored_and_compacted(
    store_url: str, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Nested past Python's recursion limit (a tool call's arguments, a field, a content list), a message
    made ``copy.deepcopy`` and json.dumps raise RecursionError: compress handed the list back uncompressed
    and stored nothing, on every later call too. Stored with what is past 64 levels as its JSON text."""
    engine = make(store_url)
    engine.on_session_start("s1")
    convo = conversation("deep", 6)

    def messages() -> list[dict[str, Any]]:
        return [*copy.deepcopy(convo), *deep_round(case)]

    engine.on_turn_complete(messages())
    engine.on_turn_complete(messages())  # again: nothing twice
    out = engine.compress(messages())
    engine.on_session_end("s1", messages())
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    total = len(messages())
    rows = stored(engine, "s1")
    assert len(rows) == total == len(set(rows)), rows[-4:]
    assert all(json.dumps(m, sort_keys=True) in rows for m in convo)
    held = rows[len(convo) + (1 if case == "deep-arguments" else 0)]
    if case != "deep-host-flag":  # host bookkeeping is not stored
        assert "deepest value" in held
    assert engine.compression_count == 1 and len(out) < total and is_valid_sequence(out)
    json.dumps(out)  # what Hermes goes on with is nested no deeper than JSON writes
    # The conversation goes on after the compaction: the answer taken, a turn added, stored once.
    later = [*out, {"role": "user", "content": "the next turn"}, {"role": "assistant", "content": "its answer"}]
    engine.on_turn_complete(copy.deepcopy(later))
    engine.on_turn_complete(copy.deepcopy(later))
    assert len(stored(engine, "s1")) == total + 2
    engine.close()


@pytest.mark.parametrize("case", ["deep-field", "deep-arguments", "deep-parts", "deep-host-flag"])
@pytest.mark.parametrize("compacted", [False, True])
def test_select_context_of_a_request_nested_past_the_recursion_limit_warns_in_one_line(
    tmp_path: Path, case: str, compacted: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A request holding a message nested past Python's recursion limit, with a budget: ``select_context``
    logged a RecursionError's whole traceback (thousands of frames' lines, at every request of the
    session). It is a one-line warning now, and the request goes out unchanged (None)."""
    engine = make(sqlite_url(tmp_path))
    engine.on_session_start("s1")
    convo = conversation("deep", 10)
    request = [*(engine.compress(copy.deepcopy(convo)) if compacted else convo), *deep_round(case)]
    assert not compacted or engine.compression_count == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="transcript_store"):
        assert engine.select_context(request, budget_tokens=50) is None
    assert not [r for r in caplog.records if r.exc_info or r.exc_text], [r.getMessage()[:200] for r in caplog.records]
    assert all("\n" not in r.getMessage() and len(r.getMessage()) < 500 for r in caplog.records)
    if compacted or case == "deep-arguments":  # the key of a selection, or the count of the tool call's arguments
        assert any("nested too deep" in r.getMessage() for r in caplog.records)
    engine.close()


ROUND_CALL = {"id": "call_odd", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
#: a tool round with one message the store refuses by a shape that is not its tool calls or call id
ODD_ROUNDS: dict[str, list[dict[str, Any]]] = {
    "assistant-string-parts": [
        {"role": "assistant", "content": ["thinking", "aloud"], "tool_calls": [ROUND_CALL]},
        {"role": "tool", "tool_call_id": "call_odd", "content": "THE RESULT"}],
    "assistant-number-name": [
        {"role": "assistant", "content": "calling", "name": 7, "tool_calls": [ROUND_CALL]},
        {"role": "tool", "tool_call_id": "call_odd", "content": "THE RESULT"}],
    "tool-string-parts": [
        {"role": "assistant", "content": None, "tool_calls": [ROUND_CALL]},
        {"role": "tool", "tool_call_id": "call_odd", "content": ["THE RESULT", "in strings"]}],
}


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
@pytest.mark.parametrize("case", sorted(ODD_ROUNDS))
def test_a_refused_message_of_a_tool_round_keeps_the_round_in_context(
    store_url: str, engine_id: str, case: str
) -> None:
    """An assistant message refused by its shape was stored as the text of its JSON, its tool calls
    with it (a tool result likewise lost its call id): the round's other messages stayed stored, but
    as orphans every assembled context left out. The tool calls and call id stay as they are."""
    engine = make(store_url, engine=engine_id)
    engine.on_session_start("s1")
    odd = ODD_ROUNDS[case]
    messages = [*conversation("round", 8), {"role": "user", "content": "go"}, *copy.deepcopy(odd),
                {"role": "assistant", "content": "done"}, {"role": "user", "content": "now"}]
    engine.on_turn_complete(copy.deepcopy(messages))
    out = engine.compress(copy.deepcopy(messages))
    engine.on_session_end("s1", copy.deepcopy(messages))  # again: nothing twice
    rows = stored(engine, "s1")
    assert len(rows) == len(messages) == len(set(rows))
    assert engine.compression_count == 1 and len(out) < len(messages) and is_valid_sequence(out)
    at = next(i for i, m in enumerate(out) if m.get("tool_calls"))
    assert out[at]["tool_calls"] == [ROUND_CALL]
    assert out[at + 1]["role"] == "tool" and out[at + 1]["tool_call_id"] == "call_odd"
    assert "THE RESULT" in out[at + 1]["content"] and out[at + 2:] == messages[-2:]
    held = json.dumps(out[at : at + 2])
    assert ("thinking" in held) if case == "assistant-string-parts" else ("in strings" in held or "7" in held)


def test_a_round_stored_in_the_earlier_whole_text_form_still_aligns(store_url: str) -> None:
    """Releases before kept a refused assistant message whole as text (its tool calls in the text): a
    conversation stored so goes on aligning with it, not branched and stored again after the upgrade."""
    engine = make(store_url)
    engine.on_session_start("s1")
    odd = ODD_ROUNDS["assistant-string-parts"]
    earlier = as_text(odd[0])  # what an earlier release stored for it
    head = [*conversation("old", 4), {"role": "user", "content": "go"}]
    engine.on_turn_complete([*copy.deepcopy(head), earlier, copy.deepcopy(odd[1])])
    before = stored(engine, "s1")
    messages = [*head, *copy.deepcopy(odd), {"role": "assistant", "content": "done"}]
    engine.on_turn_complete(copy.deepcopy(messages))
    engine.on_turn_complete(copy.deepcopy(messages))
    assert stored(engine, "s1") == [*before, json.dumps(messages[-1], sort_keys=True)]
    # The same round as the pending exchange: the answer holds Hermes' copy, not the stored one besides.
    out = engine.compress([*copy.deepcopy(head), *copy.deepcopy(odd)])
    assert engine.compression_count == 1 and out[-2:] == odd
    assert not any("kept as its JSON" in json.dumps(m) for m in out[:-2])


def test_each_new_message_is_validated_once(store_url: str) -> None:
    """A new message was validated (and written as JSON) three times per store: by the check against the
    cached transcript, by the check in the write's transaction, and by the store's ``prepare``. Counted
    by profiling the calls, nothing replaced; what is stored is the same."""
    engine = make(store_url)
    engine.on_session_start("s1")
    convo = conversation("once", 4)
    engine.on_turn_complete(copy.deepcopy(convo))
    more = [{"role": "user", "content": "one more"}, {"role": "assistant", "content": "and its answer"}]
    calls: list[str] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code is validate_message.__code__:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        engine.on_turn_complete(copy.deepcopy([*convo, *more]))
    finally:
        sys.setprofile(None)
    assert len(calls) == len(more)
    assert stored(engine, "s1")[-2:] == [json.dumps(m, sort_keys=True) for m in more]
    engine.close()


def big_call(call_id: str, size: int, name: str = "write_file") -> dict[str, Any]:
    """A tool call whose ``arguments`` (JSON, as OpenAI sends them) are about ``size`` bytes."""
    arguments = json.dumps({"path": f"{call_id}.txt", "content": "a line of \"text\" é\n" * (size // 24)})
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def results(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": c["id"], "content": f"{c['id']} done"} for c in calls]


KIB = 1024
#: (the store's cap, the tool calls of one assistant message over it, the message's text)
OVERSIZED_CALLS: dict[str, tuple[int, list[dict[str, Any]], str | None]] = {
    # OpenAI's default: a 5 MB write_file call over the store's default cap of 4 MiB (slow tier: seconds
    # of CPU per case); the same shape over a cap of 256 KiB in make test
    "one-huge-call": (4096 * KIB, [big_call("call_huge", 5_000_000)], None),
    "one-huge-call-small-cap": (256 * KIB, [big_call("call_huge", 320 * KIB)], None),
    "huge-among-small": (256 * KIB, [big_call("call_a", 300), big_call("call_big", 600 * KIB),
                                     big_call("call_c", 2 * KIB)], "writing three files"),
    "many-small-calls": (256 * KIB, [big_call(f"call_{n}", 2 * KIB) for n in range(200)], None),
    "huge-text-and-call": (256 * KIB, [big_call("call_t", 300 * KIB)], "long preamble " * 12_000),
    "huge-reasoning": (256 * KIB, [big_call("call_r", 100)], None),
}


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case == "one-huge-call" else case
                                  for case in sorted(OVERSIZED_CALLS)])
def test_an_assistant_message_over_the_cap_keeps_its_tool_calls(
    store_url: str, engine_id: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An assistant message over the store's cap by its tool calls' arguments was stored as the text of
    its JSON, cut: its tool calls lost, each result of the round was an orphan that every assembled
    context left out. The tool calls stay (ids, names), each argument over its share of the cap replaced
    by a marked JSON stand-in (its size, digest and prefix), the message under the cap."""
    cap, calls, text = OVERSIZED_CALLS[case]
    monkeypatch.setenv("TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES", str(cap))
    engine = make(store_url, engine=engine_id)
    engine.on_session_start("s1")
    big: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": copy.deepcopy(calls)}
    if case == "huge-reasoning":
        big["reasoning_content"] = "thinking " * 40_000
    assert len(json.dumps(big).encode("utf-8")) > cap
    head = [*conversation("big", 8), {"role": "user", "content": "write them"}]
    messages = [*head, big, *results(calls), {"role": "assistant", "content": "all written"},
                {"role": "user", "content": "thanks"}]
    engine.on_turn_complete(copy.deepcopy(messages))
    engine.on_turn_complete(copy.deepcopy(messages))  # again: nothing twice
    rt = engine.runtime()
    store_session = engine._store_session(rt, "s1")
    whole = rt.engine.assemble(scope="hermes", session_id=store_session, fence=None, token_budget=10**8)
    round_ids = [[c["id"] for c in m["tool_calls"]] for m in whole.messages if m.get("tool_calls")]
    assert [c["id"] for c in calls] in round_ids  # the round is in the engine's context, paired
    out = engine.compress(copy.deepcopy(messages))
    engine.on_session_end("s1", copy.deepcopy(messages))
    rows = engine.stored_messages("s1")
    assert len(rows) == len(messages) == len({json.dumps(r, sort_keys=True) for r in rows})
    held = rows[len(head)]
    assert len(json.dumps(held, ensure_ascii=False, separators=(",", ":")).encode("utf-8")) <= cap
    assert [(c["id"], c["function"]["name"]) for c in held["tool_calls"]] == [
        (c["id"], c["function"]["name"]) for c in calls]
    cut = 0
    for mine, theirs in zip(held["tool_calls"], calls, strict=True):
        arguments = json.loads(mine["function"]["arguments"])  # still JSON, as a provider parses it
        if mine == theirs:
            continue
        cut += 1
        original = theirs["function"]["arguments"]
        assert "cut by transcript-store" in arguments["transcript_store"]
        assert arguments["bytes"] == len(original.encode("utf-8"))
        assert arguments["sha256"] == hashlib.sha256(original.encode("utf-8")).hexdigest()
        assert original.startswith(arguments["prefix"]) and arguments["prefix"]
    if case == "huge-among-small":  # the huge one cut, the others whole
        assert cut == 1 and held["tool_calls"][0] == calls[0] and held["tool_calls"][2] == calls[2]
    elif case == "many-small-calls":  # each cut to the same share, none dropped
        assert cut == len(calls)
    elif case == "huge-reasoning":  # the bulk is no text of its own: the rest kept as its JSON, cut
        assert cut == 0 and held["content"].startswith("[transcript-store: a message the store cannot take")
        assert "thinking thinking" in held["content"] and "cut by transcript-store" in held["content"]
    else:
        assert cut == 1
    if case == "huge-text-and-call":  # the text cut besides the arguments, marked
        assert held["content"].startswith("long preamble") and "cut by transcript-store" in held["content"]
    assert rows[len(head) + 1 : len(head) + 1 + len(calls)] == results(calls)
    assert is_valid_sequence(rows)  # every result right after its call: none left out of a context
    assert engine.compression_count == 1 and is_valid_sequence(out)
    later = [*out, {"role": "assistant", "content": "you are welcome"}]
    engine.on_turn_complete(copy.deepcopy(later))
    engine.on_turn_complete(copy.deepcopy(later))
    assert len(engine.stored_messages("s1")) == len(messages) + 1
    engine.close()


#: a tool round over the store's cap of 64 KiB by what is not a text of its own: parts
PARTS_ROUNDS: dict[str, list[dict[str, Any]]] = {
    "assistant-parts": [
        {"role": "assistant", "content": [{"type": "text", "text": "planning " * 10_000}], "tool_calls": [ROUND_CALL]},
        {"role": "tool", "tool_call_id": "call_odd", "content": "THE RESULT"}],
    "tool-parts": [
        {"role": "assistant", "content": None, "tool_calls": [ROUND_CALL]},
        {"role": "tool", "tool_call_id": "call_odd", "content": [{"type": "text", "text": "THE RESULT " * 10_000}]}],
}


@pytest.mark.parametrize("case", sorted(PARTS_ROUNDS))
def test_a_round_message_over_the_cap_by_its_parts_keeps_the_round(
    store_url: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message of a tool round over the cap whose bulk is a content list was stored as the text of its
    JSON, cut, its tool calls or call id in the text: the round's other message an orphan. Its tool
    calls or call id stay, the rest is the text of its JSON, cut."""
    monkeypatch.setenv("TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES", str(64 * KIB))
    engine = make(store_url)
    engine.on_session_start("s1")
    head = [*conversation("parts", 4), {"role": "user", "content": "go"}]
    messages = [*head, *copy.deepcopy(PARTS_ROUNDS[case]), {"role": "assistant", "content": "done"}]
    engine.on_turn_complete(copy.deepcopy(messages))
    engine.on_turn_complete(copy.deepcopy(messages))
    rows = engine.stored_messages("s1")
    assert len(rows) == len(messages) and is_valid_sequence(rows)
    held = rows[len(head) + (0 if case == "assistant-parts" else 1)]
    assert held.get("tool_calls", [ROUND_CALL]) == [ROUND_CALL] and held.get("tool_call_id", "call_odd") == "call_odd"
    assert ("planning planning" if case == "assistant-parts" else "THE RESULT THE RESULT") in held["content"]
    assert held["content"].endswith(f"over the cap of {64 * KIB}]")
    engine.close()


def test_a_round_cut_as_text_by_an_earlier_release_still_aligns(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Releases before cut an assistant message over the cap by its arguments as the text of its JSON: a
    conversation stored so goes on aligning with it, not branched and stored again after the upgrade."""
    monkeypatch.setenv("TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES", str(64 * KIB))
    engine = make(store_url)
    engine.on_session_start("s1")
    calls = [big_call("call_old", 100 * KIB)]
    big = {"role": "assistant", "content": None, "tool_calls": calls}
    earlier = storable(copy.deepcopy(big), 64 * KIB, keep_round=False)[0]  # what an earlier release stored
    assert "tool_calls" not in earlier
    head = [*conversation("old", 4), {"role": "user", "content": "go"}]
    engine.on_turn_complete([*copy.deepcopy(head), earlier, *results(calls)])
    before = stored(engine, "s1")
    messages = [*head, copy.deepcopy(big), *results(calls), {"role": "assistant", "content": "done"}]
    engine.on_turn_complete(copy.deepcopy(messages))
    engine.on_turn_complete(copy.deepcopy(messages))
    assert stored(engine, "s1") == [*before, json.dumps(messages[-1], sort_keys=True)]
    engine.close()


@pytest.mark.parametrize("cap", [2 * KIB, 3 * KIB + 7, 16 * KIB, 64 * KIB])
@pytest.mark.parametrize("text", ["ascii", "escapes", "wide"])
def test_stood_in_arguments_keep_the_cap_whatever_their_characters(cap: int, text: str) -> None:
    """Each character of an argument takes one to seven bytes of the stored message's JSON (escaped
    twice: in the arguments' JSON, and as a string of the message's): the cut form is under the cap in
    every case, its arguments JSON, the tool calls as they were but their arguments."""
    unit = {"ascii": "plain words ", "escapes": '"\\\n\x00\t', "wide": "é中😀"}[text]
    calls = [{"id": f"call_{n}", "type": "function",
              "function": {"name": "write", "arguments": json.dumps({"text": unit * (n * 3000 + 10)})}}
             for n in range(4)]
    message = {"role": "assistant", "content": "calling " * 20, "tool_calls": calls}
    form, why = storable(message, cap)
    assert why is not None and form["tool_calls"] != calls
    assert len(json.dumps(form, ensure_ascii=False, separators=(",", ":")).encode("utf-8")) <= cap
    validate_message(form)
    for mine, theirs in zip(form["tool_calls"], calls, strict=True):
        assert {**mine, "function": {}} == {**theirs, "function": {}}
        assert mine["function"]["name"] == theirs["function"]["name"]
        json.loads(mine["function"]["arguments"])
    assert storable(copy.deepcopy(message), cap)[0] == form  # the form depends on the message and the cap only


def test_a_message_of_more_tool_calls_than_the_cap_holds_is_kept_as_text() -> None:
    """Not even a stand-in for each argument fits: the message is the text of its JSON, cut, as before
    (its results stay stored; a context leaves them out)."""
    calls = [{"id": f"call_{n:05}", "type": "function", "function": {"name": "noop", "arguments": "{}"}}
             for n in range(2000)]
    form, why = storable({"role": "assistant", "content": None, "tool_calls": calls}, 64 * KIB)
    assert why is not None and "tool_calls" not in form and "cut by transcript-store" in form["content"]
