"""The older OpenAI function-calling format, on every backend: an assistant's ``function_call`` and the
``role: "function"`` message that answers it (by ``name``) stay together as a tool call and its results
do: in the host's request, in both engines' assembly, in the fresh tail, in summaries, in compaction and
after a branch. Each place only paired ``tool_calls`` with ``tool`` results before: a function result
could open a context without its call, a call be summarized without its result (which then followed the
summary raw), or a request carry a call no result answers; chat APIs refuse such a request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import module_store_fixtures
from test_host import make_host

from engines.legacy import LegacyEngine
from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.errors import InvalidMessage
from transcript_store.host import UNANSWERED_TOOL_CALL, pair_tool_calls
from transcript_store.summarize import ExtractiveSummarizer, render_transcript
from transcript_store.tokens import RoughEstimator

SCOPE = "function-pairs"
shared_url, store, sid = module_store_fixtures(SCOPE, "function_pairs")


def call(name: str, text: str = "") -> dict[str, Any]:
    """An assistant's older-format function call (content set: the store wants content or tool_calls)."""
    return {"role": "assistant", "content": text, "function_call": {"name": name, "arguments": '{"q":"x"}'}}


def result(name: str, text: str) -> dict[str, Any]:
    return {"role": "function", "name": name, "content": text}


def say(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": text}


def rounds(n: int, size: int = 30) -> list[dict[str, Any]]:
    """``n`` exchanges, each a question, a function call, its (growing) result and an answer."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        out += [say("user", f"q{i} " + "ask " * size), call(f"f{i}"),
                result(f"f{i}", f"r{i} " + "data " * size * (1 + i)), say("assistant", f"a{i}")]
    return out


def check_pairs(messages: Sequence[dict[str, Any]]) -> None:
    """Every function result right after the call it answers, every function call answered right after it."""
    for i, m in enumerate(messages):
        if m.get("role") == "function":
            before = messages[i - 1] if i else {}
            called = (before.get("function_call") or {}).get("name")
            assert called == m.get("name"), f"orphaned result at {i}: {messages}"
        if m.get("function_call"):
            after = messages[i + 1] if i + 1 < len(messages) else {}
            assert after.get("role") == "function", f"unanswered call at {i}: {messages}"


def legacy(store: TranscriptStore, **config: Any) -> LegacyEngine:
    return LegacyEngine(EngineContext(store=store, config=config, summarizer=ExtractiveSummarizer(),
                                      estimator=RoughEstimator()))


def lossless(store: TranscriptStore, **config: Any) -> LosslessEngine:
    return LosslessEngine(EngineContext(store=store, config=config, summarizer=ExtractiveSummarizer(),
                                        estimator=RoughEstimator()))


# ---------------------------------------------------------------------------------------------- store


def test_a_function_call_without_content_is_a_message(store: TranscriptStore, sid: str) -> None:
    """The older format's reply is ``content: null`` with a ``function_call``, which the Chat Completions
    API takes back: it was refused ("needs 'content' or 'tool_calls'"), and its arguments were not
    counted in the request's tokens."""
    bare = {"role": "assistant", "content": None, "function_call": {"name": "lookup", "arguments": "{}"}}
    entry = store.append(SCOPE, sid, bare)
    assert store.read_visible(SCOPE, sid)[-1].entry_id == entry.entry_id
    for bad in ({"role": "assistant", "content": None, "function_call": {"arguments": "{}"}},
                {"role": "assistant", "content": None, "function_call": "lookup"}):
        with pytest.raises(InvalidMessage):
            store.append(SCOPE, sid, bad)
    est = RoughEstimator()
    long = {**bare, "function_call": {"name": "lookup", "arguments": json.dumps({"q": "word " * 400})}}
    assert est.count_messages([long]) > est.count_messages([bare]) + 400


# ---------------------------------------------------------------------------------------------- host


def test_the_request_answers_a_function_call_and_drops_a_stray_function_result() -> None:
    """``pair_tool_calls`` gave an unanswered function call no stand-in and let a function result that
    answers no call through (it paired tool_calls with tool results only)."""
    sent = pair_tool_calls([say("user", "q"), call("f"), say("user", "again"), result("g", "stray"),
                            call("h"), result("h", "ok"), say("assistant", "done")])
    assert sent == [say("user", "q"), call("f"), {"role": "function", "name": "f", "content": UNANSWERED_TOOL_CALL},
                    say("user", "again"), call("h"), result("h", "ok"), say("assistant", "done")]


@pytest.mark.parametrize("engine", ["legacy", "lossless"])
def test_a_branch_onto_a_function_call_still_sends_a_request_chat_apis_take(
    store: TranscriptStore, sid: str, engine: str
) -> None:
    """Branched onto the assistant's function call (its result left behind), then a stray function result
    appended: every request of the host pairs them, and the transcript is not touched."""
    entries = store.append_many(SCOPE, sid, [{"message": m} for m in rounds(2)])
    store.branch(SCOPE, sid, entries[5].entry_id)  # the second round's call
    host, model = make_host(store, engine)
    try:
        host.run_turn(SCOPE, sid, "and now?", turn_id="t1")
        store.append(SCOPE, sid, result("nobody", "stray"))
        host.run_turn(SCOPE, sid, "once more", turn_id="t2")
    finally:
        host.dispose()
    for request in model.requests:
        check_pairs(request)
    first = next(r for r in model.requests if r[-1].get("content") == "and now?")
    at = next(i for i, m in enumerate(first) if m.get("function_call", {}).get("name") == "f1")
    assert first[at + 1] == {"role": "function", "name": "f1", "content": UNANSWERED_TOOL_CALL}
    assert not any(m.get("name") == "nobody" for r in model.requests for m in r)
    assert not any(m.get("content") == UNANSWERED_TOOL_CALL for e in store.read_visible(SCOPE, sid)
                   for m in [e.message or {}])


# ---------------------------------------------------------------------------------------------- legacy


def test_legacy_assembly_never_opens_on_a_function_result(store: TranscriptStore, sid: str) -> None:
    """The newest messages that fit began on a function result whose call did not fit."""
    store.append_many(SCOPE, sid, [{"message": m} for m in rounds(5)])
    eng = legacy(store)
    for budget in range(20, 1200, 7):
        out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=budget)
        assert out.estimated_tokens <= budget
        check_pairs(out.messages)


def test_legacy_compaction_keeps_a_function_call_with_its_result(store: TranscriptStore, sid: str) -> None:
    """The last ``keep_last`` began on the function result: the call was summarized, its result kept raw."""
    for keep in range(1, 8):
        session = store.create_session(SCOPE, session_id=f"{sid}-keep{keep}").session_id
        store.append_many(SCOPE, session, [{"message": m} for m in rounds(4)])
        eng = legacy(store, keep_last=keep)
        assert eng.compact(scope=SCOPE, session_id=session, force=True).compacted
        check_pairs(eng.assemble(scope=SCOPE, session_id=session, fence=None, token_budget=10**6).messages)


# ---------------------------------------------------------------------------------------------- lossless


def test_lossless_assembly_and_summaries_never_split_a_function_call(store: TranscriptStore, sid: str) -> None:
    """A function call and its result were two units: fitting the budget, the fresh tail and the leaf
    chunks could cut between them."""
    eng = lossless(store, fresh_tail_messages=3, leaf_chunk_messages=3, leaf_summary_tokens=60)
    for i in range(8):
        store.append_many(SCOPE, sid, [{"message": m} for m in rounds(1, 20 + 7 * i)])
        eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=100_000)
        eng.compact(scope=SCOPE, session_id=sid, force=True, token_budget=1500)
    for budget in range(40, 2000, 23):
        check_pairs(eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=budget).messages)
    assert store.read(lambda c: audit(c, SCOPE, sid)).problems == []
    eng.dispose()


def test_lossless_never_summarizes_a_function_call_waiting_for_its_result(store: TranscriptStore, sid: str) -> None:
    """A transcript ending in a function call (fresh tail 0): the call was summarized, and its result,
    appended next, followed the summary raw."""
    eng = lossless(store, fresh_tail_messages=0, leaf_summary_tokens=60)
    store.append_many(SCOPE, sid, [{"message": say("user", "please look up the weather " * 20)},
                                   {"message": say("assistant", "I will look it up now. " * 20)},
                                   {"message": call("weather", "looking " * 20)}])
    eng.bootstrap(scope=SCOPE, session_id=sid, fence=None)
    assert eng.compact(scope=SCOPE, session_id=sid, force=True, token_budget=2000).compacted
    store.append_many(SCOPE, sid, [{"message": result("weather", "sunny, 21 C")},
                                   {"message": say("assistant", "Sunny.")}])
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=2000).messages
    check_pairs(out)
    assert result("weather", "sunny, 21 C") in out
    eng.dispose()


def test_lossless_branching_back_never_leaves_a_function_result_without_its_call(
    store: TranscriptStore, sid: str
) -> None:
    """A side path went on from the function call without its result; compacted there, a summary ended
    on the call. Branched back to the path where the result follows, the summary was kept and the result
    imported raw after it."""
    e = store.append_many(SCOPE, sid, [
        {"message": say("user", "look it up " + "word " * 200)}, {"message": call("lookup", "calling")},
        {"message": result("lookup", "the result " + "data " * 40)}, {"message": say("assistant", "found")},
    ])
    store.branch(SCOPE, sid, e[1].entry_id)
    store.append_many(SCOPE, sid, [{"message": say(r, f"side {n} " + "text " * 30)}
                                   for n in range(4) for r in ("user", "assistant")])
    eng = lossless(store, fresh_tail_messages=2, leaf_chunk_messages=2)
    eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=8000)
    assert eng.compact(scope=SCOPE, session_id=sid, force=True).compacted
    store.branch(SCOPE, sid, e[3].entry_id)
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=8000).messages
    check_pairs(out)
    text = json.dumps(out)
    assert "the result" in text and "found" in text and "side 0" not in text
    eng.dispose()


# ---------------------------------------------------------------------------------------------- text shown


def test_summaries_and_search_show_an_older_format_function_call(store: TranscriptStore, sid: str) -> None:
    """A ``function_call``'s name and arguments were in no summary (a content-less call was "(no text)")
    and no search (``searchable_text`` read ``tool_calls`` only), and its result was shown as a message."""
    bare = {"role": "assistant", "content": None,
            "function_call": {"name": "find_flight", "arguments": '{"to": "Reykjavik"}'}}
    answer = {"role": "function", "name": "find_flight", "content": "FI 615 departs 07:40"}
    messages = [say("user", "book me something north"), bare, answer]
    summary = ExtractiveSummarizer().summarize(messages)
    assert 'find_flight({"to": "Reykjavik"})' in summary and "(no text)" not in summary, summary
    assert "function find_flight -> FI 615" in summary, summary
    shown = render_transcript(messages)
    assert '(calls find_flight with {"to": "Reykjavik"})' in shown and "[function result: find_flight]" in shown
    store.append_many(SCOPE, sid, [{"message": m} for m in messages])
    eng = lossless(store)
    eng.bootstrap(scope=SCOPE, session_id=sid, fence=None)
    found = json.loads(eng.handle_tool_call("lcm_grep", {"pattern": "Reykjavik"}, scope=SCOPE, session_id=sid))
    assert found["count"] == 1, found  # the call's arguments, in no message's content
    eng.dispose()
