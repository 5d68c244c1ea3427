"""The legacy engine's assembly and compaction around the built-in and the host's compaction pointers, on
both backends (a review of the default engine's compaction paths).

1. A compaction the host (OpenClaw) recorded whose first kept message is its first visible one
   (``first_kept_position: 0``) was never shown by ``assemble`` (only a summary in front of a later
   position was), while the built-in compaction counted it (``tokens_before``) and folded it into the
   next summary: the model never saw what OpenClaw's own context holds, and a compaction counted tokens
   the model was not sent. Now the summary stands in front of position 0 as in front of any other.
2. The overflow recovery's compaction of a turn on the legacy engine (``LegacyEngine.compact``, which
   declared no ``fence``) read past the turn's fence: it counted the turn's own admitted message among
   the ``keep_last`` kept verbatim, so one message fewer of the conversation was kept, and named it in the
   pointer. Now it takes the fence, as the compaction before the prompt does.
3. A summary a little smaller than the assembly's budget left the newest messages no room: the model got
   the summary alone, without the turn just before its prompt, where a smaller budget (the summary over
   it, cut to half) showed them. A summary that crowds out every message is now cut to half the budget
   as one over it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from conftest import module_store_fixtures
from fake_openai import FakeOpenAI, Fault
from mirror_helpers import A, a, hosted, legacy_service, page, shown, u

from engines.legacy import LegacyEngine
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.host import HostRuntime
from transcript_store.model import OpenAIChatModel
from transcript_store.service import Service
from transcript_store.service_models import AssembleRequest, HostCompactionRequest
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

shared_url, store, sid = module_store_fixtures(A, "legacy_compaction_s43")
HEAD = "[Summary of the earlier conversation]\n"
OVERFLOW = Fault(status=400, code="context_length_exceeded", message="maximum context length is 8192 tokens")


@pytest.fixture(scope="module")
def service(store: TranscriptStore) -> Iterator[Service]:
    yield from legacy_service(store)


def test_a_host_compaction_keeping_the_first_message_is_shown(service: Service, sid: str) -> None:
    page(service.store, sid, None, "c1", hosted(("h0", u("m0")), ("h1", a("m1")), ("h2", u("m2"))))
    req = HostCompactionRequest(summary="what came before", first_kept_position=0, first_kept_entry_id="h0")
    service.host_compaction(A, "legacy", sid, req)
    # OpenClaw's own context: its summary, then every message from the first it kept.
    assert shown(service, sid) == [f"{HEAD}what came before", "m0", "m1", "m2"]
    out = service.assemble(A, "legacy", sid, AssembleRequest(token_budget=100_000))
    assert out.compacted_at_ms is not None  # a summary is shown: the context was compacted


def overflow_host(store: TranscriptStore, server: FakeOpenAI, keep_last: int) -> HostRuntime:
    """A host on the legacy engine over ``server`` (a fake OpenAI-compatible provider)."""
    settings = load_settings(
        config_path=None, engine="legacy", token_budget=32000, max_output_tokens=200,
        engine_config={"legacy": {"keep_last": keep_last}},
    )
    return HostRuntime(store, settings, OpenAIChatModel(server.base_url, "fake-model", timeout=10),
                       summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())


def test_the_overflow_compaction_of_a_turn_on_legacy_reads_before_its_fence(store: TranscriptStore, sid: str) -> None:
    talk = "tell me more about this " * 20
    said = [u(f"q{i}: {talk}") if i % 2 == 0 else a(f"r{i}: {talk}") for i in range(12)]
    store.append_many(A, sid, [{"message": m} for m in said])
    with FakeOpenAI() as server:
        host = overflow_host(store, server, keep_last=2)
        try:
            server.queue(OVERFLOW)
            outcome = host.run_turn(A, sid, "and now?", turn_id="t-over")
        finally:
            host.dispose()
        assert outcome.commit_status == "committed"
        refused, retried = [r.body["messages"] for r in server.requests if r.method == "POST"][:2]
    assert len(str(retried)) < len(str(refused))  # compacted, then retried
    # The compaction inside the turn read only the transcript before the turn's admitted message (its
    # fence): the last keep_last messages before it stay verbatim. Unfenced, it counted the admitted
    # message among them and summarised the question before it.
    [marker] = [e for e in store.list_entries(A, sid) if e.kind == "compaction"]
    assert outcome.admission is not None
    admitted = outcome.admission.anchor
    assert admitted.position == 12
    kept = store.get_entries(A, sid, [marker.payload["first_kept_entry_id"]])[0]
    assert kept.position == 10
    assert [m.get("content") for m in retried][-3:] == [f"q10: {talk}", f"r11: {talk}", "and now?"]


class Fixed:
    """A summarizer that answers one fixed summary."""

    def __init__(self, text: str) -> None:
        self.text = text

    def summarize(self, messages: Sequence[dict[str, Any]], **_: Any) -> str:
        return self.text


def test_a_summary_that_crowds_out_the_newest_turn_is_cut_for_it(store: TranscriptStore, sid: str) -> None:
    talk = "x " * 300
    old = [u(f"m{i} {talk}") if i % 2 == 0 else a(f"m{i} {talk}") for i in range(20)]
    store.append_many(A, sid, [{"message": m} for m in [*old, u("latest question"), a("latest answer")]])
    eng = LegacyEngine(EngineContext(store=store, config={"keep_last": 2}, summarizer=Fixed("word " * 380),
                                     estimator=RoughEstimator()))
    assert eng.compact(scope=A, session_id=sid, force=True).compacted
    summary = eng.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000).messages[0]
    whole = RoughEstimator().count_messages([summary])
    for budget in range(whole // 2 + 40, whole + 40, 8):
        out = eng.assemble(scope=A, session_id=sid, fence=None, token_budget=budget)
        assert out.estimated_tokens <= budget
        # The newest turn is always there: a summary just under the budget left it no room, and the model got
        # the summary alone, where a budget a little smaller (the summary over it, cut to half) showed it.
        assert [m["content"] for m in out.messages][-2:] == ["latest question", "latest answer"], budget
        assert out.messages[0]["content"].startswith(HEAD)
