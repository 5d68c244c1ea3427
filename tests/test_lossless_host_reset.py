"""A host's reset reaches the lossless engine (an engine that owns compaction), on both backends.

OpenClaw's /new, /reset and idle or daily resets of a session that keeps its transcript append a `reset`
entry: its context starts again after it, while the visible messages the mirror imports still hold
everything before it. The plugin told only an engine that does not own compaction (legacy) through
``host_compaction``; the service recorded it for any engine, and lossless ignored it: every assembly after
a /new returned the earlier conversation (and the summaries of it) in front of the new one. Now lossless
assembles from the reset's first kept message on, compacts only what follows it, and keeps every message
stored and searchable (lossless: nothing is deleted). A reset stands only on the branch it was made on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import module_store_fixtures, tool_round
from mirror_helpers import A, a, hosted, page, u

from engines.lossless.audit import audit
from transcript_store import TranscriptStore, compaction
from transcript_store.errors import InvalidInput
from transcript_store.service import Service
from transcript_store.service_models import AssembleRequest, CompactRequest, HostCompactionRequest
from transcript_store.settings import load_settings

shared_url, store, sid = module_store_fixtures(A, "lossless_host_reset")
LONG = " and so on" * 40


@pytest.fixture(scope="module")
def service(store: TranscriptStore) -> Iterator[Service]:
    svc = Service(store, load_settings(config_path=None, engine="lossless"))
    yield svc
    svc.runtime.dispose()  # not close(): the module's store outlives it


def shown(svc: Service, session_id: str) -> str:
    """What the lossless engine assembles, as one text."""
    out = svc.assemble(A, "lossless", session_id, AssembleRequest(token_budget=100_000))
    return "\n".join(json.dumps(m["content"]) for m in out.messages)


def reset(svc: Service, session_id: str, position: int, count: int, kept: str | None = None) -> int:
    """Record a host reset made after ``count`` messages, its context starting again at ``position``."""
    req = HostCompactionRequest(
        summary="", first_kept_position=position, first_kept_entry_id=kept, reset=True, compacted_at_count=count
    )
    return svc.host_compaction(A, "lossless", session_id, req).first_kept_position


def talk(word: str, first: int, n: int) -> list[tuple[str, dict[str, Any]]]:
    """``n`` long host messages h<first>.. whose text names ``word``."""
    return [(f"h{i}", u(f"{word}{i}{LONG}") if i % 2 == 0 else a(f"{word}{i}{LONG}")) for i in range(first, first + n)]


def grep(svc: Service, session_id: str, pattern: str) -> str:
    """lcm_grep's answer."""
    return str(svc.runtime.engine("lossless")[0].handle_tool_call("lcm_grep", {"pattern": pattern}, scope=A,
                                                              session_id=session_id))


def test_a_host_reset_starts_the_lossless_context_again_and_keeps_what_preceded_it(service: Service, sid: str) -> None:
    s = service.store
    page(s, sid, None, "c1", hosted(*talk("alpha", 0, 12)))
    assert service.compact(A, "lossless", sid, CompactRequest(force=True)).compacted
    before = shown(service, sid)
    assert "Summary" in before and "alpha11" in before
    # OpenClaw's /new after those 12 messages (its next message not written yet).
    assert reset(service, sid, 12, 12) == 12
    assert shown(service, sid) == ""
    page(s, sid, "c1", "c2", hosted(*talk("beta", 12, 12)))
    after = shown(service, sid)
    assert "beta12" in after and "beta23" in after and "alpha" not in after
    # Compaction after the reset summarises only what followed it.
    assert service.compact(A, "lossless", sid, CompactRequest(force=True)).compacted
    after = shown(service, sid)
    assert "Summary" in after and "alpha" not in after and "beta23" in after
    # Nothing is deleted: the recall tools still find what preceded the reset.
    assert "msg_3" in grep(service, sid, "alpha3")
    # A reset keeping a tail before it (firstKeptEntryId): that tail, then what follows.
    page(s, sid, "c2", "c3", hosted(*talk("gamma", 24, 2)))
    assert reset(service, sid, 25, 26, kept="h25") == 25
    assert json.loads(shown(service, sid)) == f"gamma25{LONG}"


def test_a_host_reset_stands_on_the_lossless_engine_only_on_its_branch(service: Service, sid: str) -> None:
    s = service.store
    shared = talk("alpha", 0, 4)
    page(s, sid, None, "c1", hosted(*shared, ("h4a", u("left4")), ("h5a", a("left5"))))
    assert reset(service, sid, 6, 6) == 6
    page(s, sid, "c1", "c2", hosted(("h6", u("after6"))))
    assert json.loads(shown(service, sid)) == "after6"
    # The mirror moves to another branch without the message the reset was made after: no reset there.
    other = [("h4b", u("right4")), ("h5b", a("right5")), ("h6b", u("right6"))]
    assert page(s, sid, None, "c3", hosted(*shared, *other)).rewound
    text = shown(service, sid)
    assert all(w in text for w in ("alpha0", "alpha3", "right4", "right6")) and "left4" not in text


def test_a_built_in_compaction_after_a_host_reset_never_brings_back_what_preceded_it(
    service: Service, sid: str
) -> None:
    # A compaction that is not the engine's (the built-in one a turn degraded to legacy runs, or OpenClaw's
    # own, reported after the reset) replaced the reset's pointer: the reset was gone, and every assembly
    # returned the conversation before it again.
    s = service.store
    page(s, sid, None, "c1", hosted(*talk("alpha", 0, 12)))
    assert reset(service, sid, 12, 12) == 12
    page(s, sid, "c1", "c2", hosted(*talk("beta", 12, 12)))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted
    after = shown(service, sid)
    assert "beta23" in after and "alpha" not in after  # was: alpha0..alpha11 in front again
    page(s, sid, "c2", "c3", hosted(*talk("gamma", 24, 4)))
    req = HostCompactionRequest(summary="the host's", first_kept_position=26, first_kept_entry_id="h26",
                                compacted_at_count=28)
    assert service.host_compaction(A, "legacy", sid, req).first_kept_position == 26
    after = shown(service, sid)
    assert "gamma27" in after and "alpha" not in after  # was: alpha0..alpha11 in front again
    # The engine's own compaction plans on what follows the reset too.
    assert service.compact(A, "lossless", sid, CompactRequest(force=True)).compacted
    assert "alpha" not in shown(service, sid)
    # Stored and searchable all the same.
    assert "msg_3" in grep(service, sid, "alpha3")


def test_a_host_reset_stays_when_a_compaction_made_after_it_leaves_the_branch(service: Service, sid: str) -> None:
    s = service.store
    before, after = talk("alpha", 0, 6), talk("beta", 6, 6)
    page(s, sid, None, "c1", hosted(*before))
    assert reset(service, sid, 6, 6) == 6
    page(s, sid, "c1", "c2", hosted(*after))
    req = HostCompactionRequest(summary="the host's", first_kept_position=10, first_kept_entry_id="h10",
                                compacted_at_count=12)
    assert service.host_compaction(A, "legacy", sid, req).first_kept_position == 10
    # The host branches at its last message (a regenerated reply): the compaction, made after h11, is not
    # on the new branch; the reset, made after h5, is.
    assert page(s, sid, None, "c3", hosted(*before, *after[:-1], ("h11b", a("again")))).rewound
    text = shown(service, sid)
    assert "beta6" in text and "again" in text and "alpha" not in text  # was: alpha0..alpha5 in front again


def test_the_view_total_after_a_host_reset_counts_only_what_follows_it(service: Service, sid: str) -> None:
    # The total that decides whether maintenance compacts counted the context before the reset, which no
    # assembly returns any more: every pass after a /new in a long session ran a compaction check (the
    # whole context list loaded and planned on) for nothing.
    s = service.store
    page(s, sid, None, "c1", hosted(*talk("alpha", 0, 24)))
    assert reset(service, sid, 24, 24) == 24
    page(s, sid, "c1", "c2", hosted(*talk("beta", 24, 2)))
    out = service.assemble(A, "lossless", sid, AssembleRequest(token_budget=1_000))
    assert out.estimated_tokens < 750 and "alpha" not in json.dumps(out.messages)
    # Under the threshold by the view's total: no compaction check (was: "under the threshold (... tokens)").
    assert service.maintain(A, "lossless", sid).reason == "under the threshold"
    # Over it after the reset (imported by an assembly under its budget): maintenance compacts what followed it.
    page(s, sid, "c2", "c3", hosted(*talk("gamma", 26, 6)))
    assert 750 < service.assemble(A, "lossless", sid, AssembleRequest(token_budget=1_000)).estimated_tokens <= 1_000
    assert service.maintain(A, "lossless", sid).changed
    assert "alpha" not in shown(service, sid)


def test_a_host_compaction_with_a_summary_is_refused_by_an_engine_that_owns_compaction(
    service: Service, sid: str
) -> None:
    page(service.store, sid, None, "c1", hosted(*talk("alpha", 0, 2)))
    req = HostCompactionRequest(summary="a summary", first_kept_position=1, first_kept_entry_id="h1")
    with pytest.raises(InvalidInput, match="owns compaction"):
        service.host_compaction(A, "lossless", sid, req)


def test_a_compaction_that_does_not_read_the_reset_it_stands_on_writes_nothing(service: Service, sid: str) -> None:
    # A compaction planned on messages that end before the host's reset (read up to a turn's fence, or the
    # branch moved between its two reads) found neither its pointer's start nor the reset's among them and
    # summarised from the first message with no reset under its pointer: the reset was lost, and every
    # later assembly returned the conversation before it again.
    s = service.store
    page(s, sid, None, "c1", hosted(*talk("alpha", 0, 12)))
    assert reset(service, sid, 10, 12, kept="h10") == 10
    rt = service.runtime
    out = compaction.compact_session(s, A, sid, summarizer=rt.summarizer, estimator=rt.estimator,
                                     fence=s.anchor(A, sid, "h8"), keep_last=2, force=True)
    assert not out.compacted and "reset" in out.reason
    assert compaction.load_pointer(s, A, sid)["reset"]
    text = shown(service, sid)
    assert "alpha10" in text and "alpha9" not in text and "Summary" not in text


def test_a_host_reset_keeping_a_tail_from_inside_a_tool_round_never_starts_with_a_result(
    service: Service, sid: str
) -> None:
    # A reset whose first kept message was a tool result (the host kept its tail from inside a round):
    # lossless assembled that result first, without the call before it, a request the Chat Completions
    # API refuses. Legacy skips such results; so does lossless now, and they stay stored and searchable.
    call, result = tool_round("c1", "zebrafish result")
    page(service.store, sid, None, "c1", hosted(("h0", u("question")), ("h1", call), ("h2", result),
                                                ("h3", a("answered")), ("h4", u("next"))))
    assert reset(service, sid, 2, 5, kept="h2") == 2
    for engine in ("lossless", "legacy"):
        out = service.assemble(A, engine, sid, AssembleRequest(token_budget=100_000))
        assert [m["content"] for m in out.messages] == ["answered", "next"], engine
    assert "msg_2" in grep(service, sid, "zebrafish")
    assert service.compact(A, "lossless", sid, CompactRequest(force=True)).ok
    after = service.assemble(A, "lossless", sid, AssembleRequest(token_budget=100_000)).messages
    assert after and after[0]["role"] != "tool"
    assert service.store.read(lambda c: audit(c, A, sid)).problems == []


def test_lcm_describe_after_a_host_reset_says_what_precedes_it_is_not_in_context(service: Service, sid: str) -> None:
    # What precedes a host's reset stays in the engine's context list, but no assembly shows it:
    # lcm_describe answered a message and a summary from before the reset "in_context": true (and itself
    # as its context holder), so the model took for shown what it had to expand to see.
    s = service.store
    page(s, sid, None, "c1", hosted(*talk("alpha", 0, 12)))
    assert service.compact(A, "lossless", sid, CompactRequest(force=True)).compacted
    assert reset(service, sid, 12, 12) == 12
    page(s, sid, "c1", "c2", hosted(*talk("beta", 12, 2)))
    assert "alpha" not in shown(service, sid)
    engine = service.runtime.engine("lossless")[0]

    def describe(ident: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(engine.handle_tool_call("lcm_describe", {"id": ident}, scope=A,
                                                                  session_id=sid))
        return out

    for before in ("msg_0", "msg_11", "sum_1"):
        out = describe(before)
        assert (out["in_context"], out["context_holder"]) == (False, None), out
    assert (describe("msg_12")["in_context"], describe("msg_12")["context_holder"]) == (True, "msg_12")
