"""Hostile review of the legacy engine's assembly and the built-in compaction, on every backend.

What the model is shown must be right whatever the budget, the summarizer, the branches and the
races: never over budget, never a message twice or missing, never a tool result without its call,
never a redacted message; failures are typed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import module_store_fixtures

from engines.legacy import LegacyEngine
from transcript_store import StoreConfig, TranscriptStore, compaction, reads
from transcript_store.engine import EngineContext
from transcript_store.tokens import RoughEstimator

SCOPE = "hostile-legacy"
shared_url, store, sid = module_store_fixtures(SCOPE, "legacy_hostile")


class Joining:
    """A summarizer whose summary is the previous one and every content it was given, joined (so a test
    sees exactly what a summary covers), or a fixed answer."""

    def __init__(self, answer: object = "join") -> None:
        self.answer = answer
        self.calls: list[tuple[list[dict[str, Any]], str | None]] = []

    def summarize(self, messages: Sequence[dict[str, Any]], *, previous_summary: str | None = None,
                  focus: str | None = None, level: str = "normal", max_tokens: int = 1024) -> object:
        self.calls.append((list(messages), previous_summary))
        if self.answer != "join":
            return self.answer
        parts = ([previous_summary] if previous_summary else []) + [str(m.get("content")) for m in messages]
        return " ".join(parts)


def engine(store: TranscriptStore, summarizer: Any = None, **config: Any) -> LegacyEngine:
    return LegacyEngine(EngineContext(store=store, config=config, summarizer=summarizer or Joining(),
                                      estimator=RoughEstimator()))


def say(i: int) -> dict[str, Any]:
    return {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i:03d}"}


def fill(store: TranscriptStore, sid: str, n: int, start: int = 0) -> None:
    store.append_many(SCOPE, sid, [{"message": say(i)} for i in range(start, start + n)])


def contents(messages: Sequence[dict[str, Any]]) -> list[Any]:
    return [m.get("content") for m in messages]


def check_context(messages: Sequence[dict[str, Any]]) -> None:
    """No message twice, and every tool result right after its call (or another result of that call)."""
    verbatim = [m for m in messages if not str(m.get("content", "")).startswith("[Summary")]
    seen = [repr(m) for m in verbatim]
    assert len(seen) == len(set(seen)), "a message twice"
    open_calls: set[str] = set()
    for m in messages:
        if m.get("role") == "tool":
            assert m.get("tool_call_id") in open_calls, f"orphaned tool result {m}"
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            open_calls = {c["id"] for c in m["tool_calls"]}
        else:
            open_calls = set()


# ------------------------------------------------------------------------------------------ budgets


def test_a_summary_larger_than_the_budget_never_goes_over_it(store: TranscriptStore, sid: str) -> None:
    """A summary that shrank the transcript but is larger than the assembly's budget: the context
    stays within the budget (it was the summary alone, over budget)."""
    store.append_many(SCOPE, sid, [{"message": {"role": "user", "content": f"{i} " + "x " * 400}} for i in range(20)])
    fill(store, sid, 4)
    big = "word " * 400  # ~500 tokens: less than the 20 messages it replaces, more than a small budget
    eng = engine(store, Joining(big), keep_last=2)
    assert eng.compact(scope=SCOPE, session_id=sid, force=True).compacted
    est = RoughEstimator()
    for budget in (1, 5, 50, 200, 1000, 5000, 10**6):
        out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=budget)
        assert out.estimated_tokens <= budget, budget
        assert est.count_messages(out.messages) <= budget or not out.messages, budget
        check_context(out.messages)
        if budget >= 200:  # the summary (cut and marked under 500) and the newest messages in the rest
            assert out.messages[0]["content"].startswith("[Summary")
            assert ("[… cut to" in out.messages[0]["content"]) == (budget < 500)
            assert contents(out.messages)[-1] == "m003"


def test_tool_rounds_are_never_split_at_any_budget(store: TranscriptStore, sid: str) -> None:
    items: list[dict[str, Any]] = []
    for i in range(6):
        items.append({"message": {"role": "user", "content": f"q{i}"}})
        call = [{"id": f"c{i}{k}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for k in "ab"]
        items.append({"message": {"role": "assistant", "content": None, "tool_calls": call}})
        items += [{"message": {"role": "tool", "tool_call_id": f"c{i}{k}", "content": "r" * (5 + 30 * i)}}
                  for k in "ab"]
        items.append({"message": {"role": "assistant", "content": f"a{i}"}})
    store.append_many(SCOPE, sid, items)
    eng = engine(store)
    for budget in range(1, 400, 3):
        out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=budget)
        assert out.estimated_tokens <= budget
        check_context(out.messages)


# ------------------------------------------------------------------------------------------ summaries


@pytest.mark.parametrize("answer", ["", "   \n\t "])
def test_an_empty_summary_is_a_failure_not_a_compaction(store: TranscriptStore, sid: str, answer: str) -> None:
    """An empty summary in place of the older messages would drop them from every context."""
    fill(store, sid, 30)
    eng = engine(store, Joining(answer))
    result = eng.compact(scope=SCOPE, session_id=sid, force=True)
    assert not result.compacted and not result.ok
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    assert contents(out.messages) == [f"m{i:03d}" for i in range(30)]


@pytest.mark.parametrize("answer", [None, 5, b"bytes", ["a"], {"text": "x"}])
def test_a_non_text_summary_is_a_failure(store: TranscriptStore, sid: str, answer: object) -> None:
    fill(store, sid, 30)
    eng = engine(store, Joining(answer))
    result = eng.compact(scope=SCOPE, session_id=sid, force=True)
    assert not result.compacted and not result.ok


def test_a_summarizer_raising_anything_is_a_failed_compaction(store: TranscriptStore, sid: str) -> None:
    """A pluggable summarizer's own bug (KeyError, RuntimeError) is a failed compaction, never an
    untyped error out of ``compact`` (nothing changes, the raw messages stay)."""
    fill(store, sid, 30)

    class Broken:
        def summarize(self, *_a: Any, **_k: Any) -> str:
            raise KeyError("choices")

    eng = engine(store, Broken())
    result = eng.compact(scope=SCOPE, session_id=sid, force=True)
    assert not result.ok and not result.compacted and "summarizer failed" in (result.reason or "")
    assert compaction.load_pointer(store, SCOPE, sid) is None


# ------------------------------------------------------------------------------------------ paths


def visible_ids(store: TranscriptStore, sid: str) -> list[str]:
    return [e.entry_id for e in store.read_visible(SCOPE, sid)]


def test_repeated_compactions_show_each_message_once(store: TranscriptStore, sid: str) -> None:
    """Summary of summaries: after every compaction the context is the latest summary + exactly the
    messages from its first kept entry, and the summary covers exactly the messages before it."""
    summarizer = Joining()
    eng = engine(store, summarizer, keep_last=3)
    for round_ in range(5):
        fill(store, sid, 7, start=7 * round_)
        assert eng.compact(scope=SCOPE, session_id=sid, force=True).compacted
        out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
        pointer = compaction.load_pointer(store, SCOPE, sid)
        assert pointer is not None
        k = pointer["first_kept_position"]
        n = 7 * (round_ + 1)
        assert contents(out.messages[1:]) == [f"m{i:03d}" for i in range(k, n)]
        assert out.messages[0]["content"].split() [-k:] == [f"m{i:03d}" for i in range(k)]
        assert len(out.messages[0]["content"].split()) == k + 5  # the header, once; each message once


def test_keep_last_larger_than_the_transcript(store: TranscriptStore, sid: str) -> None:
    fill(store, sid, 5)
    eng = engine(store, keep_last=50)
    result = eng.compact(scope=SCOPE, session_id=sid, force=True)
    assert not result.compacted and result.ok
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    assert contents(out.messages) == [f"m{i:03d}" for i in range(5)]


def test_unfinished_tool_round_stays_whole_across_the_cut(store: TranscriptStore, sid: str) -> None:
    fill(store, sid, 10)
    call = [{"id": f"k{k}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for k in range(3)]
    store.append_many(SCOPE, sid, [{"message": {"role": "assistant", "content": None, "tool_calls": call}}]
                      + [{"message": {"role": "tool", "tool_call_id": f"k{k}", "content": "r"}} for k in range(3)])
    for keep in (1, 2, 3, 4):
        eng = engine(store, keep_last=keep)
        eng.compact(scope=SCOPE, session_id=sid, force=True)
        out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
        check_context(out.messages)
        assert out.messages[-4].get("tool_calls")


@pytest.mark.parametrize("where", ["before", "after"])
def test_rewrite_after_compaction_follows_the_active_path(store: TranscriptStore, sid: str, where: str) -> None:
    """A redaction before the first kept entry, or after it: the redacted text is in no context."""
    fill(store, sid, 20)
    eng = engine(store, keep_last=6)
    assert eng.compact(scope=SCOPE, session_id=sid, force=True).compacted
    eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    ids = visible_ids(store, sid)
    target = 3 if where == "before" else 17
    store.rewrite_entries(SCOPE, sid, [{"entry_id": ids[target], "message": {"role": "assistant",
                                                                            "content": "REDACTED"}}])
    for budget in (10**6, 60):
        out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=budget)
        text = " ".join(str(c) for c in contents(out.messages))
        assert f"m{target:03d}" not in text
        check_context(out.messages)
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    verbatim = [c for c in contents(out.messages) if not str(c).startswith("[Summary")]
    summary = " ".join(str(c) for c in contents(out.messages) if str(c).startswith("[Summary"))
    for i in range(20):
        shown = (f"m{i:03d}" in verbatim) + (f"m{i:03d}" in summary.split())
        assert shown == (0 if i == target else 1), i


def test_branch_before_the_first_kept_entry_drops_the_summary(store: TranscriptStore, sid: str) -> None:
    fill(store, sid, 20)
    eng = engine(store, keep_last=4)
    assert eng.compact(scope=SCOPE, session_id=sid, force=True).compacted
    fill(store, sid, 6, start=20)
    assert eng.compact(scope=SCOPE, session_id=sid, force=True).compacted
    eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    ids = visible_ids(store, sid)
    store.branch(SCOPE, sid, ids[9])  # before both first kept entries
    fill(store, sid, 2, start=100)
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    assert contents(out.messages) == [f"m{i:03d}" for i in range(10)] + ["m100", "m101"]
    assert compaction.load_pointer(store, SCOPE, sid) is None
    # and a compaction of the new branch covers only it
    assert eng.compact(scope=SCOPE, session_id=sid, force=True).compacted
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    summary = out.messages[0]["content"].split()
    assert "m007" in summary and not any(f"m{i:03d}" in summary for i in range(8, 30))


def test_branch_back_onto_the_summarized_path_keeps_it_consistent(store: TranscriptStore, sid: str) -> None:
    fill(store, sid, 20)
    eng = engine(store, keep_last=4)
    assert eng.compact(scope=SCOPE, session_id=sid, force=True).compacted
    ids = visible_ids(store, sid)
    store.branch(SCOPE, sid, ids[5])
    fill(store, sid, 3, start=200)
    eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    store.branch(SCOPE, sid, ids[19])  # back to the old head: the pointer's first kept is on the path again
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    assert contents(out.messages[1:]) == [f"m{i:03d}" for i in range(16, 20)]
    check_context(out.messages)


def test_a_fenced_compaction_under_a_later_pointer_covers_nothing_twice(store: TranscriptStore, sid: str) -> None:
    """The pointer's first kept entry is after the fence: its summary covers messages the fenced
    compaction keeps verbatim, so it must not be carried into the new summary. At the fence, its summary
    is all there is before it: nothing is left to compact (summarised again from the first without it, the
    newest messages it stood for came back verbatim)."""
    fill(store, sid, 11)
    summarizer = Joining()
    eng = engine(store, summarizer, keep_last=1)
    assert eng.compact(scope=SCOPE, session_id=sid, force=True).compacted  # first kept: m010 (a user message)
    ids = visible_ids(store, sid)
    before = compaction.load_pointer(store, SCOPE, sid)
    at = compaction.compact_session(store, SCOPE, sid, summarizer=summarizer, estimator=RoughEstimator(),
                                    fence=store.anchor(SCOPE, sid, ids[10]), keep_last=2, force=True)
    assert not at.compacted and at.reason == "nothing old enough to compact"
    assert compaction.load_pointer(store, SCOPE, sid) == before
    fence = store.anchor(SCOPE, sid, ids[8])  # (a user message)
    result = compaction.compact_session(store, SCOPE, sid, summarizer=summarizer, estimator=RoughEstimator(),
                                        fence=fence, keep_last=2, force=True)
    assert result.compacted
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    summary = out.messages[0]["content"].split()
    verbatim = contents(out.messages[1:])
    assert verbatim == [f"m{i:03d}" for i in range(6, 11)]
    for i in range(11):
        assert (f"m{i:03d}" in summary) + (f"m{i:03d}" in verbatim) == 1, (i, summary)


# ------------------------------------------------------------------------------------------ races


def test_threads_assembling_one_session_see_each_message_once(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One engine, two threads assembling the same session at once (the service runs requests on
    threads): both read the page after the same cursor, and the shared projection took it twice."""
    fill(store, sid, 30)
    eng = engine(store)
    meet = threading.Barrier(2)
    original = reads.read_visible_delta

    def meeting(*args: Any, **kwargs: Any) -> Any:  # both threads have read before either takes its page
        result = original(*args, **kwargs)
        with contextlib.suppress(threading.BrokenBarrierError):
            meet.wait(timeout=1)
        return result

    monkeypatch.setattr(reads, "read_visible_delta", meeting)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
            assert contents(out.messages) == [f"m{i:03d}" for i in range(30)]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    assert not errors, errors[0]
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    assert contents(out.messages) == [f"m{i:03d}" for i in range(30)]


def test_racing_compactions_from_two_stores_leave_one_consistent_context(
    store: TranscriptStore, sid: str, shared_url: str
) -> None:
    fill(store, sid, 40)
    other = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False))
    try:
        barrier = threading.Barrier(2)

        class Slow(Joining):
            def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> object:
                barrier.wait(timeout=10)
                return super().summarize(messages, **kw)

        a, b = engine(store, Slow(), keep_last=5), engine(other, Slow(), keep_last=9)
        results: list[Any] = []
        threads = [threading.Thread(target=lambda e=e: results.append(e.compact(scope=SCOPE, session_id=sid,
                                                                                 force=True))) for e in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 2
        for e in (a, b, engine(store)):
            out = e.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
            summary = out.messages[0]["content"].split()
            verbatim = contents(out.messages[1:])
            for i in range(40):
                assert (f"m{i:03d}" in summary) + (f"m{i:03d}" in verbatim) == 1, i
    finally:
        other.close()


def test_a_compaction_planned_before_another_was_written_does_not_replace_it(
    store: TranscriptStore, sid: str, shared_url: str
) -> None:
    """A read 12 messages and summarized slowly; meanwhile 8 more came and B compacted all 20. A wrote
    last and its pointer (first kept: m006) replaced B's (m014): the context less compacted than it
    was, B's summary lost from it. A compaction now writes only over the state it was planned on."""
    fill(store, sid, 12)
    other = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False))
    a_in, b_done = threading.Event(), threading.Event()

    class Waiting(Joining):
        def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> object:
            a_in.set()
            assert b_done.wait(timeout=10)
            return super().summarize(messages, **kw)

    try:
        results: list[Any] = []
        a = threading.Thread(target=lambda: results.append(
            engine(store, Waiting(), keep_last=6).compact(scope=SCOPE, session_id=sid, force=True)))
        a.start()
        assert a_in.wait(timeout=10)
        fill(store, sid, 8, start=12)
        b = engine(other, keep_last=6).compact(scope=SCOPE, session_id=sid, force=True)
        assert b.compacted
        b_done.set()
        a.join()
        assert results and not results[0].compacted and "first" in str(results[0].reason)
        pointer = compaction.load_pointer(store, SCOPE, sid)
        assert pointer is not None and pointer["first_kept_entry_id"] == visible_ids(store, sid)[14]
        out = engine(store).assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
        assert contents(out.messages[1:]) == [f"m{i:03d}" for i in range(14, 20)]
    finally:
        b_done.set()
        other.close()


def test_a_redaction_while_the_summarizer_runs_never_reaches_the_context(store: TranscriptStore, sid: str) -> None:
    fill(store, sid, 20)
    ids = visible_ids(store, sid)

    class Redacting(Joining):
        def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> object:
            store.rewrite_entries(SCOPE, sid, [{"entry_id": ids[2], "message": {"role": "user", "content": "X"}}])
            return super().summarize(messages, **kw)

    eng = engine(store, Redacting())
    eng.compact(scope=SCOPE, session_id=sid, force=True)
    out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    assert "m002" not in " ".join(str(c) for c in contents(out.messages))
    assert len(out.messages) == 20


def test_rows_read_per_assembly_stay_constant_after_compactions(store: TranscriptStore, sid: str) -> None:
    fill(store, sid, 50)
    eng = engine(store, keep_last=4)
    eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
    costs = []
    for round_ in range(6):
        fill(store, sid, 2, start=50 + 2 * round_)
        if round_ % 2:
            assert eng.compact(scope=SCOPE, session_id=sid, force=True).compacted
        before = eng.rows_read
        out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
        costs.append(eng.rows_read - before)
        assert contents(out.messages)[-1] == f"m{51 + 2 * round_:03d}"
    assert costs == [2] * 6


# ------------------------------------------------------------------------------------------ sizes


def test_compaction_of_many_messages_under_a_small_payload_cap(shared_url: str) -> None:
    """The compaction entry listed every summarized entry id: past the store's payload cap (4 MiB by
    default: ~100,000 messages never compacted, e.g. imported; far fewer under a smaller cap) every
    compaction of the session raised PayloadTooLarge, for good. A summary itself over the cap is a
    failed compaction, not an error."""
    small = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False, max_payload_bytes=1024))
    try:
        sid = small.create_session(SCOPE).session_id
        fill(small, sid, 80)
        eng = engine(small, Joining("short summary"), keep_last=4)
        result = eng.compact(scope=SCOPE, session_id=sid, force=True)
        assert result.ok and result.compacted
        out = eng.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
        assert contents(out.messages[1:]) == [f"m{i:03d}" for i in range(76, 80)]
        marker = [e for e in small.list_entries(SCOPE, sid) if e.kind == "compaction"][-1]
        assert marker.payload["first_kept_entry_id"] == visible_ids(small, sid)[76]
        fill(small, sid, 400, start=80)
        huge = engine(small, Joining("y " * 2000), keep_last=4)
        result = huge.compact(scope=SCOPE, session_id=sid, force=True)
        assert not result.ok and not result.compacted and "summar" in (result.reason or "")
        out = huge.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=10**6)
        assert out.messages[0]["content"].endswith("short summary") and len(out.messages) == 1 + 404
    finally:
        small.close()


def test_a_legacy_summary_written_before_compacted_at_ms_existed_still_says_when(store_url: str) -> None:
    """The legacy engine's compaction pointer written by a release before ``compacted_at_ms`` (no
    ``created_ms`` in it): ``assemble`` showed its summary and answered ``compacted_at_ms`` null, "nothing
    compacted", so a host kept the signed thinking of the replies the summary replaced the prefix of (the
    provider refuses those: the session's every request failed after the upgrade)."""
    import time

    from conftest import user

    from transcript_store.compaction import STATE_KEY, STATE_OWNER, compact_session
    from transcript_store.core import Core
    from transcript_store.ledger import get_state, put_state
    from transcript_store.summarize import ExtractiveSummarizer

    with TranscriptStore(store_url) as store:
        store.create_session(SCOPE, session_id="old")
        store.append_many(SCOPE, "old", [{"message": user(f"message {i} " + "words " * 40)} for i in range(8)])
        before = int(time.time() * 1000)
        assert compact_session(store, SCOPE, "old", summarizer=ExtractiveSummarizer(), estimator=RoughEstimator(),
                               keep_last=2, force=True).compacted

        def as_released_before(c: Core) -> None:
            pointer = get_state(c, SCOPE, "old", STATE_OWNER, STATE_KEY)
            put_state(c, SCOPE, "old", STATE_OWNER, STATE_KEY, {k: v for k, v in pointer.items() if k != "created_ms"})

        store.write(as_released_before)
        shown = LegacyEngine(EngineContext(store=store, config={})).assemble(
            scope=SCOPE, session_id="old", messages=[], token_budget=100_000, fence=None
        )
        assert "summary" in str(shown.messages[0]["content"]).lower()
        assert shown.compacted_at_ms is not None
        assert before <= shown.compacted_at_ms <= int(time.time() * 1000) + 1
