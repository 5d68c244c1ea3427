"""The host's budget and compaction follow-ups, over both backends: what is left of the review's findings.

The findings themselves (the engine's system-prompt addition reserved, PromptTooLarge before the
admission, a pre-prompt compaction's session_target followed, compactions to the prompt's budget) are
pinned in test_host.py and test_service.py; these are the gaps they left.
"""

from __future__ import annotations

from typing import Any

import pytest
from hosting import CountingEngine
from test_host import SCOPE, make_host

from transcript_store import TranscriptStore
from transcript_store.engine import AssembleResult, CompactResult, EngineContext, SessionTarget
from transcript_store.errors import InvalidInput
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(SCOPE, session_id="sess", session_key="agent:main:test").session_id


class _Rotating(CountingEngine):
    """Owns compaction; its pre-prompt compaction ends the session and names a successor, ``sess-2``."""

    rotated = False

    def assemble(self, **kw: Any) -> AssembleResult:
        window = super().assemble(**kw).messages[-2:]
        tokens = 100 if self.rotated else 5000
        return AssembleResult(messages=window, estimated_tokens=tokens, prompt_authority="preassembly_may_overflow")

    def compact(self, **kw: Any) -> CompactResult:
        self.calls.append(("compact", kw))
        if self.rotated:
            return CompactResult(ok=True, compacted=False, reason="already rotated")
        self.store.end_session(SCOPE, kw["session_id"])
        new = self.store.create_session(SCOPE, session_id="sess-2", session_key="agent:main:test")
        self.rotated = True
        target = SessionTarget(scope=SCOPE, session_id=new.session_id, session_key=new.session_key)
        return CompactResult(ok=True, compacted=True, session_target=target)


def test_a_retry_of_a_turn_committed_before_its_session_rotated_is_a_duplicate(
    store: TranscriptStore, sid: str
) -> None:
    """A turn whose own pre-prompt compaction named a successor commits where it was admitted; the same
    turn id presented again is that turn ("duplicate", no model call), not a new turn in the successor
    (it ran again there: a second model call and a second receipt of one logical turn)."""
    host, model = make_host(store, "rot", {"rot": lambda ctx: _Rotating(ctx, "rot", owns_compaction=True)},
                            token_budget=4000)
    first = host.run_turn(SCOPE, sid, "before", turn_id="t1")
    assert (first.session_id, first.commit_status) == (sid, "committed")
    again = host.run_turn(SCOPE, sid, "before", turn_id="t1")
    assert (again.session_id, again.commit_status) == (sid, "duplicate")
    assert again.messages == first.messages and len(model.requests) == 1
    assert store.get_session(SCOPE, "sess-2").entry_count == 0
    assert [r.advancement_key for r in Turns(store).receipts(SCOPE, "sess-2", "rot")] == []
    # A new turn runs on the successor, as before.
    second = host.run_turn(SCOPE, sid, "after", turn_id="t2")
    assert (second.session_id, second.commit_status) == ("sess-2", "committed")


@pytest.mark.parametrize("bad", ["t\ud800x", "t\x00x", "t" * 5000, 7])
def test_a_bad_turn_id_is_refused_before_the_retry_lookup_once_the_session_has_a_successor(
    store: TranscriptStore, sid: str, bad: Any
) -> None:
    """The retry lookup reads the sessions on the way by turn id before the admission checks it: a lone
    surrogate reached the driver (UnicodeEncodeError, untyped), a NUL PostgreSQL (StoreUnavailable)."""
    host, model = make_host(store, "rot", {"rot": lambda ctx: _Rotating(ctx, "rot", owns_compaction=True)},
                            token_budget=4000)
    host.run_turn(SCOPE, sid, "before", turn_id="t1")
    counts = (store.get_session(SCOPE, sid).entry_count, store.get_session(SCOPE, "sess-2").entry_count)
    with pytest.raises(InvalidInput, match="turn_id"):
        host.run_turn(SCOPE, sid, "again", turn_id=bad)
    assert (store.get_session(SCOPE, sid).entry_count, store.get_session(SCOPE, "sess-2").entry_count) == counts
    assert len(model.requests) == 1


def test_a_successor_in_another_scope_is_refused_even_under_the_same_id(store: TranscriptStore, sid: str) -> None:
    """A target in another scope named like the session was taken as "no change", silently."""
    host, _ = make_host(store)
    for target in (SessionTarget(scope="other", session_id=sid), SessionTarget(scope="other", session_id="x")):
        with pytest.raises(InvalidInput, match="same scope"):
            host.follow(SCOPE, sid, target)
    assert host.resolve_session(SCOPE, sid) == sid


def test_a_session_rotated_back_to_is_the_one_in_use(store: TranscriptStore, sid: str) -> None:
    """sess -> sess-2, then sess-2 -> sess: new turns, from either id, run in sess (the chain had a cycle,
    and the retry lookup and resolve_session walked it to different ends)."""
    host, _ = make_host(store)
    store.create_session(SCOPE, session_id="sess-2")
    host.follow(SCOPE, sid, SessionTarget(scope=SCOPE, session_id="sess-2"))
    host.follow(SCOPE, "sess-2", SessionTarget(scope=SCOPE, session_id=sid))
    for start in (sid, "sess-2"):
        assert host.resolve_session(SCOPE, start) == sid
        assert host.run_turn(SCOPE, start, "hi", turn_id=f"from-{start}").session_id == sid
        assert host.run_turn(SCOPE, start, "hi").session_id == sid


def test_a_retry_of_a_turn_that_failed_after_its_session_rotated_runs_on_the_successor(
    store: TranscriptStore, sid: str
) -> None:
    """OpenClaw: the successor is the session "the next retry or turn must use". A turn that failed after
    its pre-prompt compaction rotated the session left nothing live behind (its intent is discarded): its
    retry runs on the successor."""
    host, model = make_host(store, "rot", {"rot": lambda ctx: _Rotating(ctx, "rot", owns_compaction=True)},
                            token_budget=4000)
    model.fail_next.append(RuntimeError("provider down"))
    with pytest.raises(RuntimeError, match="provider down"):
        host.run_turn(SCOPE, sid, "before", turn_id="t1")
    out = host.run_turn(SCOPE, sid, "before", turn_id="t1")
    assert (out.session_id, out.commit_status) == ("sess-2", "committed")
    assert [r.advancement_key for r in Turns(store).receipts(SCOPE, sid, "rot")] == []


class _AddingEngine(CountingEngine):
    """Fills the budget it is given and adds a long system-prompt addition; maintain records its budgets."""

    addition = "Recall what was said before you answer; the summaries hold the rest. " * 30
    maintained: list[tuple[int | None, int | None]]

    def assemble(self, **kw: Any) -> AssembleResult:
        seen = super().assemble(**kw).messages
        est = RoughEstimator()
        shown: list[dict[str, Any]] = []
        for m in reversed(seen):
            if est.count_messages([m, *shown]) > kw["token_budget"]:
                break
            shown.insert(0, m)
        return AssembleResult(
            messages=shown, estimated_tokens=est.count_messages(shown), system_prompt_addition=self.addition
        )

    def maintain(self, **kw: Any) -> None:
        self.maintained = [
            *getattr(self, "maintained", []),
            (kw["runtime_context"].budget, kw["runtime_settings"].limits.prompt_token_budget),
        ]


def test_after_the_addition_is_reserved_the_runtime_context_has_the_same_budget(
    store: TranscriptStore, sid: str
) -> None:
    """Once the engine was asked again with its addition reserved, maintain's runtime_settings say that
    budget, and so must its runtime_context, whose budget a delegated built-in compaction works to (it
    kept the budget without the addition: a compaction to more than the assembly could then take)."""
    store.append_many(
        SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 200}}
                     for i in range(40)]
    )
    engines: dict[str, _AddingEngine] = {}

    def factory(ctx: EngineContext) -> _AddingEngine:
        return engines.setdefault("add", _AddingEngine(ctx, "add", owns_compaction=True))

    host, _ = make_host(store, "add", {"add": factory}, token_budget=3000, max_output_tokens=200)
    host.run_turn(SCOPE, sid, "hello")
    asked = [kw["token_budget"] for name, kw in engines["add"].calls if name == "assemble"]
    assert len(asked) == 2 and asked[1] < asked[0]
    assert engines["add"].maintained == [(asked[1], asked[1])]


class _HugeAddition(_AddingEngine):
    """Its system-prompt addition alone is larger than the whole prompt budget."""

    addition = "Always recall every summary before answering. " * 2000


def test_an_addition_alone_over_the_budget_degrades_the_turn_to_legacy(store: TranscriptStore, sid: str) -> None:
    """An engine whose addition alone exceeds the prompt's budget: the turn runs on the legacy path and
    says why (the request was fitted instead: every message of the engine's context dropped, the history
    lost for the turn, and the addition still over the budget, with only a log line)."""
    store.append_many(SCOPE, sid, [{"message": {"role": "user", "content": "remember: the code is 4417"}},
                                   {"message": {"role": "assistant", "content": "noted"}}])
    host, model = make_host(store, "add", {"add": lambda ctx: _HugeAddition(ctx, "add", owns_compaction=True)},
                            token_budget=3000, max_output_tokens=200)
    out = host.run_turn(SCOPE, sid, "what is the code?")
    assert out.commit_status == "committed" and out.engine_id == "legacy"
    assert out.degraded_reason is not None and "system-prompt addition of engine add alone" in out.degraded_reason
    sent = model.requests[-1]
    assert any("4417" in str(m.get("content")) for m in sent)  # the history reached the model
    assert not any(_HugeAddition.addition[:40] in str(m.get("content")) for m in sent)


class _GrowingAddition(_AddingEngine):
    """A modest addition at first; asked again with it reserved, one larger than the whole budget."""

    asked = 0

    def assemble(self, **kw: Any) -> AssembleResult:
        self.asked += 1
        result = super().assemble(**kw)
        addition = "Recall. " * (300 if self.asked % 2 == 1 else 3000)
        return result.model_copy(update={"system_prompt_addition": addition})


def test_a_second_addition_alone_over_the_budget_degrades_the_turn_too(store: TranscriptStore, sid: str) -> None:
    """The check held for the first answer only: an engine asked again whose addition then outgrew the
    budget had its request sent over the budget, on the engine, with a log line."""
    store.append_many(SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant",
                                                "content": "word " * 200}} for i in range(20)])
    host, model = make_host(store, "g", {"g": lambda ctx: _GrowingAddition(ctx, "g", owns_compaction=True)},
                            token_budget=2000, max_output_tokens=200)
    out = host.run_turn(SCOPE, sid, "hello")
    assert out.engine_id == "legacy" and out.degraded_reason is not None
    assert "system-prompt addition of engine g alone" in out.degraded_reason
    assert not any("Recall. Recall." in str(m.get("content")) for m in model.requests[-1])
