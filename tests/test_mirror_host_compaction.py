"""Which compaction the mirror's session shows when the host (OpenClaw) records its own, on both backends.

What a review of ``record_host_compaction`` found (each test failed before the fix):

1. A compaction found later in the host's transcript was compared with the one in force by time: the
   host's ``compacted_ms`` (the OpenClaw machine's clock) against when the service recorded or made its
   own (the service's clock). A host clock an hour ahead put an older compaction back in place of the
   service's newer one; an hour behind, a newer one was refused. Now they are compared by where in the
   conversation each was made (how many messages preceded it), the host's clock deciding only between
   two of the host's made at the same point.
2. A host compaction whose first kept message is on the part two branches share stood after the host
   switched to the other branch, where OpenClaw's context does not hold it (its entry is on the branch
   it was made on). Now it stands only while the mirror's branch holds the last message it was made
   after.
3. The same host compaction told again without saying where it was made (no ``compacted_at_count``)
   replaced the built-in compaction made after it (whose pointer carried only a reset): the context grew
   back by all the built-in one had summarised. Now the built-in one's pointer names the host's under it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import module_store_fixtures
from mirror_helpers import A, a, commit, hosted, legacy_service, page, shown, turn_request, u, visible

from transcript_store import TranscriptStore, compaction
from transcript_store.errors import InvalidInput, MirrorConflict
from transcript_store.service import Service
from transcript_store.service_models import AssembleRequest, CompactRequest, HostCompactionRequest

shared_url, store, sid = module_store_fixtures(A, "mirror_host_compaction")
HEAD = "[Summary of the earlier conversation]\n"
HOUR_MS = 3_600_000


@pytest.fixture(scope="module")
def service(store: TranscriptStore) -> Iterator[Service]:
    yield from legacy_service(store)


def record(svc: Service, session_id: str, summary: str, position: int, kept: str, **found: int) -> int:
    """Record a host compaction; the first kept position the engine shows."""
    req = HostCompactionRequest(summary=summary, first_kept_position=position, first_kept_entry_id=kept, **found)
    return svc.host_compaction(A, "legacy", session_id, req).first_kept_position


def conversation(n: int) -> list[tuple[str, dict[str, Any]]]:
    """``n`` host messages h0.. (user, assistant, ...)."""
    return [(f"h{i}", u(f"m{i}") if i % 2 == 0 else a(f"m{i}")) for i in range(n)]


#: long enough that a summary shrinks the context (the legacy engine's and the built-in compaction)
LONG = " and so on" * 40


def long_talk(n: int) -> list[tuple[str, dict[str, Any]]]:
    """``n`` long host messages h0.. (m0.., user and assistant in turn)."""
    return [(f"h{i}", u(f"m{i}{LONG}") if i % 2 == 0 else a(f"m{i}{LONG}")) for i in range(n)]


def test_an_older_host_compaction_from_a_clock_ahead_leaves_the_service_newer_one(service: Service, sid: str) -> None:
    msgs = long_talk(10)
    page(service.store, sid, None, "c1", hosted(*msgs[:6]))
    now = int(time.time() * 1000)
    # OpenClaw compacted when it held 6 messages, its machine's clock an hour ahead of the service's.
    older = {"compacted_ms": now + HOUR_MS, "compacted_at_count": 6}
    assert record(service, sid, "the host's", 2, "h2", **older) == 2
    page(service.store, sid, "c1", "c2", hosted(*msgs[6:]))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted  # at 10 messages
    newer = shown(service, sid)
    assert newer[0] != f"{HEAD}the host's"
    # A new plugin process finds OpenClaw's older compaction again: the service's stays (was: put back).
    record(service, sid, "the host's", 2, "h2", **older)
    assert shown(service, sid) == newer


def test_a_host_compaction_told_again_without_where_leaves_the_built_in_one_made_after_it(
    service: Service, sid: str
) -> None:
    # A client that does not say where the host's compaction was made (no compacted_at_count, no
    # compacted_ms: an older plugin, a plain HTTP client) tells it again at every bootstrap of a new process.
    # The built-in compaction made after it had replaced its pointer (carrying only a reset), so it was not
    # recognised: recorded anew, and the context grew back by all the built-in one had summarised.
    msgs = long_talk(12)
    page(service.store, sid, None, "c1", hosted(*msgs[:6]))
    assert record(service, sid, "the host's", 2, "h2") == 2
    page(service.store, sid, "c1", "c2", hosted(*msgs[6:10]))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted  # at 10 messages
    newer, at = shown(service, sid), kept_at(service, sid)
    assert newer[0] != f"{HEAD}the host's" and at > 2
    assert record(service, sid, "the host's", 2, "h2") == at  # was: 2
    assert shown(service, sid) == newer
    # So after a second built-in compaction made after the first.
    page(service.store, sid, "c2", "c3", hosted(*msgs[10:]))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted
    newest = shown(service, sid)
    record(service, sid, "the host's", 2, "h2")
    assert shown(service, sid) == newest
    # A new compaction of the host's (another summary, or another first kept message) still replaces it.
    assert record(service, sid, "the host's, later", 10, "h10") == 10
    assert shown(service, sid)[0] == f"{HEAD}the host's, later"
    assert record(service, sid, "the host's, later", 11, "h11") == 11
    assert shown(service, sid) == [f"{HEAD}the host's, later", f"m11{LONG}"]



def test_a_host_compaction_told_again_without_where_leaves_a_reset_made_after_it(service: Service, sid: str) -> None:
    # The host compacted, then reset the session (/new): a client that does not say where its compaction was
    # made telling it again (a plain HTTP client re-sending what it sent before) replaced the reset, and
    # every assembly returned the conversation before the reset again.
    msgs = long_talk(16)
    page(service.store, sid, None, "c1", hosted(*msgs[:6]))
    assert record(service, sid, "the host's", 2, "h2") == 2
    assert reset(service, sid, 6, 6) == 6
    page(service.store, sid, "c1", "c2", hosted(*msgs[6:]))
    after_reset = shown(service, sid)
    assert after_reset == [f"m{i}{LONG}" for i in range(6, 16)]
    assert record(service, sid, "the host's", 2, "h2") == 6  # was: 2, the reset gone
    assert shown(service, sid) == after_reset
    # So under a built-in compaction made after the reset.
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted
    compacted = shown(service, sid)
    record(service, sid, "the host's", 2, "h2")
    assert shown(service, sid) == compacted and not any("m0" in str(m) for m in compacted)

def kept_at(svc: Service, session_id: str) -> int:
    """The first kept position of the session's compaction pointer in force."""
    pointer = compaction.load_pointer(svc.store, A, session_id)
    assert pointer is not None
    return int(pointer["first_kept_position"])


def test_a_newer_host_compaction_from_a_clock_behind_replaces_the_service_older_one(
    service: Service, sid: str
) -> None:
    msgs = long_talk(12)
    page(service.store, sid, None, "c1", hosted(*msgs[:8]))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted  # at 8 messages
    page(service.store, sid, "c1", "c2", hosted(*msgs[8:]))
    # OpenClaw compacted after the 12th message, its machine's clock an hour behind the service's.
    late = {"compacted_ms": int(time.time() * 1000) - HOUR_MS, "compacted_at_count": 12}
    assert record(service, sid, "the host's, later", 10, "h10", **late) == 10  # was: 2 (the service's kept)
    assert shown(service, sid)[0] == f"{HEAD}the host's, later"
    # Two of the host's made at the same point: the host's own clock tells them apart.
    same = {"compacted_ms": late["compacted_ms"] + 1, "compacted_at_count": 12}
    assert record(service, sid, "the host's, again", 10, "h10", **same) == 10
    assert shown(service, sid)[0] == f"{HEAD}the host's, again"
    record(service, sid, "the host's, before", 10, "h10", **{**same, "compacted_ms": same["compacted_ms"] - 5})
    assert shown(service, sid)[0] == f"{HEAD}the host's, again"


def test_a_host_compaction_stands_only_on_the_branch_it_was_made_on(service: Service, sid: str) -> None:
    s = service.store
    shared = conversation(4)
    branch_a = [*shared, ("h4a", u("m4a")), ("h5a", a("m5a"))]
    branch_b = [*shared, ("h4b", u("m4b")), ("h5b", a("m5b"))]
    page(s, sid, None, "c1", hosted(*branch_a))
    # OpenClaw compacted on branch A, keeping from h2 (on the shared part).
    assert record(service, sid, "on branch A", 2, "h2") == 2
    assert shown(service, sid) == [f"{HEAD}on branch A", "m2", "m3", "m4a", "m5a"]
    # The host switches to branch B (its import branches the mirror): OpenClaw's context there has no
    # compaction (was: the summary of branch A in front of B's messages).
    assert page(s, sid, None, "c2", hosted(*branch_b)).rewound
    assert shown(service, sid) == ["m0", "m1", "m2", "m3", "m4b", "m5b"]
    # A compaction OpenClaw made on branch B, found later, is recorded over A's (made at 6 messages too).
    now = int(time.time() * 1000)
    assert record(service, sid, "on branch B", 2, "h2", compacted_ms=now - HOUR_MS, compacted_at_count=6) == 2
    assert shown(service, sid) == [f"{HEAD}on branch B", "m2", "m3", "m4b", "m5b"]
    # Back on branch A: B's compaction does not stand there either.
    assert page(s, sid, None, "c3", hosted(*branch_a)).rewound
    assert shown(service, sid) == ["m0", "m1", "m2", "m3", "m4a", "m5a"]


def reset(svc: Service, session_id: str, position: int, count: int, kept: str | None = None) -> int:
    """Record a host reset (OpenClaw's /new or /reset in the same transcript) made after ``count`` messages,
    its context starting again at ``position``; the first kept position the engine shows."""
    req = HostCompactionRequest(
        summary="", first_kept_position=position, first_kept_entry_id=kept, reset=True, compacted_at_count=count
    )
    return svc.host_compaction(A, "legacy", session_id, req).first_kept_position


def test_a_host_reset_starts_the_context_again_and_ends_the_compaction_before_it(service: Service, sid: str) -> None:
    # OpenClaw's reset kept in the same transcript (a `reset` entry) starts its context again after it; the
    # messages before it stay visible in the host's transcript (and so in the mirror). The plugin had no way
    # to say so: the pre-reset messages, and the service's compaction of them, stayed in every assemble.
    s = service.store
    msgs = long_talk(14)
    page(s, sid, None, "c1", hosted(*msgs[:8]))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted  # at 8 messages
    # The host resets after those 8 (the compaction made at the same point is older than the reset): the
    # next turn's message is not written yet, so the reset names no first kept message.
    assert reset(service, sid, 8, 8) == 8
    assert shown(service, sid) == []
    page(s, sid, "c1", "c2", hosted(*msgs[8:10]))
    assert shown(service, sid) == [f"m8{LONG}", f"m9{LONG}"]
    # The service's own compaction after the reset summarises only what followed it (was: all 10).
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).reason == "nothing old enough to compact"
    # OpenClaw compacts after the reset: recorded over it; the reset found again later leaves it in place.
    assert record(service, sid, "after the reset", 9, "h9", compacted_at_count=10) == 9
    assert shown(service, sid) == [f"{HEAD}after the reset", f"m9{LONG}"]
    assert reset(service, sid, 8, 8) == 9
    # A second reset keeping a tail before it (firstKeptEntryId): the context is that tail and what follows.
    page(s, sid, "c2", "c3", hosted(*msgs[10:]))
    assert reset(service, sid, 13, 14, kept="h13") == 13
    assert shown(service, sid) == [f"m13{LONG}"]


def test_a_host_reset_stands_only_on_the_branch_it_was_made_on(service: Service, sid: str) -> None:
    s = service.store
    shared = conversation(4)
    page(s, sid, None, "c1", hosted(*shared, ("h4a", u("m4a")), ("h5a", a("m5a"))))
    assert reset(service, sid, 6, 6) == 6
    page(s, sid, "c1", "c2", hosted(("h6", u("m6"))))
    assert shown(service, sid) == ["m6"]
    # The mirror moves to another branch without the message the reset was made after: no reset there.
    assert page(s, sid, None, "c3", hosted(*shared, ("h4b", u("m4b")), ("h5b", a("m5b")), ("h6b", u("m6b")))).rewound
    assert shown(service, sid) == ["m0", "m1", "m2", "m3", "m4b", "m5b", "m6b"]



def test_a_host_reset_stays_when_a_compaction_made_after_it_leaves_the_branch(service: Service, sid: str) -> None:
    # A compaction made after a reset replaced its pointer: when the mirror then left the branch the
    # compaction was made on (but not the reset's), nothing stood, and the messages before the reset came back.
    s = service.store
    msgs = long_talk(16)
    page(s, sid, None, "c1", hosted(*msgs[:6]))
    assert reset(service, sid, 6, 6) == 6
    page(s, sid, "c1", "c2", hosted(*msgs[6:10]))
    assert record(service, sid, "after the reset", 8, "h8", compacted_at_count=10) == 8
    assert shown(service, sid) == [f"{HEAD}after the reset", f"m8{LONG}", f"m9{LONG}"]
    # The host regenerates its last reply: the compaction, made after h9, is not on the new branch; the
    # reset, made after h5, is.
    assert page(s, sid, None, "c3", hosted(*msgs[:9], ("h9b", a("m9b")))).rewound
    assert shown(service, sid) == [f"m6{LONG}", f"m7{LONG}", f"m8{LONG}", "m9b"]  # was: m0 .. m9b
    # The built-in compaction there summarises only what followed the reset, and keeps the reset under it:
    # on a branch without its first kept message the reset still stands.
    page(s, sid, "c3", "c4", hosted(*msgs[10:]))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted
    assert shown(service, sid)[1:] == [f"m{i}{LONG}" for i in range(10, 16)]
    assert page(s, sid, None, "c5", hosted(*msgs[:9], ("h9b", a("m9b")), ("h10b", u("m10b")))).rewound
    assert shown(service, sid) == [f"m6{LONG}", f"m7{LONG}", f"m8{LONG}", "m9b", "m10b"]  # was: m0 .. m10b


def test_the_same_reset_made_again_on_another_branch_stands_there(service: Service, sid: str) -> None:
    # A reset has no summary, so two of them at the same position are alike: one made on a branch after the
    # mirror left the branch of the first (a regenerated reply, then /new) was taken for the first told
    # again and changed nothing, and the pointer named the branch left: the pre-reset messages came back.
    s = service.store
    shared = conversation(4)
    page(s, sid, None, "c1", hosted(*shared, ("h4a", u("m4a")), ("h5a", a("m5a"))))
    assert reset(service, sid, 6, 6) == 6
    assert shown(service, sid) == []
    assert page(s, sid, None, "c2", hosted(*shared, ("h4b", u("m4b")), ("h5b", a("m5b")))).rewound
    assert shown(service, sid) == ["m0", "m1", "m2", "m3", "m4b", "m5b"]
    assert reset(service, sid, 6, 6) == 6
    assert shown(service, sid) == []  # was: the six messages before the reset on branch B
    page(s, sid, "c2", "c3", hosted(("h6", u("m6"))))
    assert shown(service, sid) == ["m6"]


def test_a_host_reset_that_kept_a_tail_dates_the_replies_whose_prefix_it_dropped(service: Service, sid: str) -> None:
    # The replies of the tail a reset keeps were signed after the messages before them, which the reset
    # drops: assemble answered compacted_at_ms null for a reset (it shows no summary), so a host replayed
    # their signed thinking after a prefix that is gone. One that kept nothing before it shows only what
    # followed it: nothing to date.
    page(service.store, sid, None, "c1", hosted(*conversation(4)))
    assert reset(service, sid, 4, 4) == 4
    assert service.assemble(A, "legacy", sid, AssembleRequest(token_budget=100_000)).compacted_at_ms is None
    page(service.store, sid, "c1", "c2", hosted(("h4", u("m4")), ("h5", a("m5"))))
    before = int(time.time() * 1000)
    assert reset(service, sid, 4, 6, kept="h4") == 4
    out = service.assemble(A, "legacy", sid, AssembleRequest(token_budget=100_000))
    assert [m["content"] for m in out.messages] == ["m4", "m5"]
    assert out.compacted_at_ms is not None and out.compacted_at_ms >= before  # was: None

@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"summary": "a summary", "first_kept_position": 0, "first_kept_entry_id": "h0", "reset": True}, "no summary"),
        ({"summary": "a summary", "first_kept_position": 0}, "first kept message"),
        ({"summary": "", "first_kept_position": 1, "reset": True, "compacted_at_count": 2}, "first kept message"),
        ({"summary": "", "first_kept_position": 0, "first_kept_entry_id": "h0"}, "needs its summary"),
    ],
)
def test_a_host_reset_or_compaction_that_does_not_say_where_is_refused(
    service: Service, sid: str, fields: dict[str, Any], why: str
) -> None:
    page(service.store, sid, None, "c1", hosted(*conversation(2)))
    with pytest.raises(InvalidInput, match=why):
        service.host_compaction(A, "legacy", sid, HostCompactionRequest(**fields))


def test_a_host_reset_with_a_blank_summary_is_refused(service: Service, sid: str) -> None:
    # A reset carries no summary: one of spaces was taken as empty by the check, stored, and shown as a
    # blank "[Summary of the earlier conversation]" message in front of the context after the reset.
    page(service.store, sid, None, "c1", hosted(*conversation(4)))
    req = HostCompactionRequest(summary="  \n", first_kept_position=4, reset=True, compacted_at_count=4)
    with pytest.raises(InvalidInput, match="no summary"):
        service.host_compaction(A, "legacy", sid, req)
    assert shown(service, sid) == ["m0", "m1", "m2", "m3"]


def test_a_host_compaction_made_past_the_mirror_or_before_its_first_kept_message_is_refused(
    service: Service, sid: str
) -> None:
    # compacted_at_count past the mirror's end was stored as where the compaction was made, naming no last
    # message (so it stood on every branch) and further on than any compaction found later: every one of
    # them was refused from then on. One made before its own first kept message says two things at once.
    page(service.store, sid, None, "c1", hosted(*conversation(6)))
    with pytest.raises(MirrorConflict, match="behind"):
        record(service, sid, "too far", 2, "h2", compacted_at_count=2**31 - 1)
    with pytest.raises(InvalidInput, match="compacted_at_count"):
        record(service, sid, "kept after it", 4, "h4", compacted_at_count=3)
    assert shown(service, sid) == ["m0", "m1", "m2", "m3", "m4", "m5"]
    # A compaction found later, made after the six messages, is recorded (was: refused as older).
    assert record(service, sid, "the host's", 4, "h4", compacted_at_count=6) == 4
    assert shown(service, sid) == [f"{HEAD}the host's", "m4", "m5"]


def test_a_host_reset_told_again_leaves_the_compaction_made_after_it(service: Service, sid: str) -> None:
    # A reset is told again by every new plugin process that reads the host's transcript from its start. The
    # built-in compaction made after it (before another message) carries it under its pointer, made at the
    # same point: the reset told again was taken for a newer one and put in its place, and the context grew
    # back by all that compaction had summarised (its time renewed too).
    msgs = long_talk(12)
    page(service.store, sid, None, "c1", hosted(*msgs))
    assert reset(service, sid, 2, 12, kept="h2") == 2  # the reset kept a tail of 10 messages
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted
    compacted = shown(service, sid)
    assert compacted[0].startswith(HEAD) and f"m2{LONG}" not in compacted
    assert reset(service, sid, 2, 12, kept="h2") == len(msgs) - len(compacted) + 1
    assert shown(service, sid) == compacted
    # Told by a plugin before compacted_at_count (nothing says where it was made): the same.
    req = HostCompactionRequest(summary="", first_kept_position=2, first_kept_entry_id="h2", reset=True)
    service.host_compaction(A, "legacy", sid, req)
    assert shown(service, sid) == compacted


def derived_after_reset(service: Service, sid: str, summary: str, reset: bool) -> list[tuple[str, dict[str, Any]]]:
    """A host's reset (or compaction) inside a turn that kept only that turn's message, named h4: an id the
    mirror holds off its branch, so that the message is mirrored under one derived from it. The host's
    messages after it, as (host id, message)."""
    s = service.store
    msgs = long_talk(16)
    page(s, sid, None, "c1", hosted(*msgs[:6]))
    # The host rewrote its transcript from h4 on: h4 and h5 stay stored, off the mirror's branch.
    assert page(s, sid, None, "c2", hosted(*msgs[:4], ("h4b", u("m4b")), ("h5b", a("m5b")))).rewound
    req = HostCompactionRequest(summary=summary, first_kept_position=6, first_kept_entry_id="h4", reset=reset,
                                compacted_at_count=6)
    assert service.host_compaction(A, "legacy", sid, req).first_kept_position == 6
    # The host commits that turn (h4 and h7), then the plugin imports what follows.
    after = [("h4", msgs[6][1]), *msgs[7:]]
    assert commit(service, sid, turn_request("k1", 6, [m for _, m in after[:2]], ("h4", "h7"))).status == "committed"
    page(s, sid, "c2", "c3", hosted(*after))
    assert visible(s, sid)[6][0] != "h4"  # mirrored under an id derived from the host's
    return after


def test_the_built_in_compaction_starts_at_a_host_reset_whose_message_is_mirrored_under_a_derived_id(
    service: Service, sid: str
) -> None:
    # The reset stands there by its position (its message fits the host's id), but the compaction looked its
    # first kept message up by id only: not found, it wrote nothing while the reset stood (before that, it
    # summarised from the first message and lost the reset).
    after = derived_after_reset(service, sid, "", reset=True)
    assert shown(service, sid) == [m["content"] for _, m in after]
    # Read up to a fence at the reset's message, nothing stands before the reset: nothing to compact.
    s, rt = service.store, service.runtime
    fence = s.anchor(A, sid, visible(s, sid)[6][0])
    before = compaction.load_pointer(s, A, sid)
    out = compaction.compact_session(s, A, sid, summarizer=rt.summarizer, estimator=rt.estimator, fence=fence,
                                     keep_last=2, force=True)
    assert not out.compacted and out.reason == "nothing old enough to compact"
    assert compaction.load_pointer(s, A, sid) == before
    out = service.compact(A, "legacy", sid, CompactRequest(force=True))
    assert out.compacted, out.reason  # was: "the host's reset is not among the messages read"
    compacted = shown(service, sid)
    assert compacted[0].startswith(f"{HEAD}Summary of 4 messages")  # m6 .. m9, what followed the reset
    assert "m5b" not in compacted[0] and "m4b" not in compacted[0]
    assert compacted[1:] == [m["content"] for _, m in after[4:]]
    # The reset stays under the compaction: on a branch without the compaction it still stands.
    pointer = compaction.load_pointer(s, A, sid)
    assert pointer is not None and pointer[compaction.RESET_UNDER]["first_kept_position"] == 6
    assert page(s, sid, None, "c4", hosted(*visible(s, sid)[:9], ("h9b", a("m9b")))).rewound
    assert shown(service, sid) == [m["content"] for _, m in after[:3]] + ["m9b"]


def test_the_built_in_compaction_carries_on_a_host_compaction_whose_message_is_mirrored_under_a_derived_id(
    service: Service, sid: str
) -> None:
    # Not found by id, the host's compaction was dropped: its summary not carried on, and the messages it had
    # summarised summarised again from the first.
    after = derived_after_reset(service, sid, "the host's", reset=False)
    assert shown(service, sid) == [f"{HEAD}the host's"] + [m["content"] for _, m in after]
    out = service.compact(A, "legacy", sid, CompactRequest(force=True))
    assert out.compacted, out.reason
    compacted = shown(service, sid)
    assert compacted[0].startswith(f"{HEAD}Summary of 4 messages")  # was: of 10, from m0
    assert "Earlier: the host's" in compacted[0] and "m5b" not in compacted[0]
    assert compacted[1:] == [m["content"] for _, m in after[4:]]


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "compaction"])
@pytest.mark.parametrize("found", [{"compacted_at_count": 6}, {}], ids=["at-count", "no-count"])
def test_a_host_reset_or_compaction_on_a_message_mirrored_under_a_derived_id_told_again_changes_nothing(
    service: Service, sid: str, reset: bool, found: dict[str, int]
) -> None:
    # Told again (a plugin's new process reads the host's transcript from its start), its first kept message
    # is below the mirror's end now, held under the id derived from the host's: the stored pointer, which
    # names the host's id, was not taken for it, and the repeat was recorded anew (a new time: every reply
    # since lost its signed thinking).
    summary = "" if reset else "the host's"
    after = derived_after_reset(service, sid, summary, reset=reset)
    s = service.store
    before = compaction.load_pointer(s, A, sid)
    assert before is not None and before["first_kept_entry_id"] == "h4"
    time.sleep(0.002)  # a pointer recorded anew would be dated later
    req = HostCompactionRequest(summary=summary, first_kept_position=6, first_kept_entry_id="h4", reset=reset,
                                **found)
    assert service.host_compaction(A, "legacy", sid, req).first_kept_position == 6
    assert compaction.load_pointer(s, A, sid) == before
    assert shown(service, sid) == ([] if reset else [f"{HEAD}the host's"]) + [m["content"] for _, m in after]


@pytest.mark.parametrize("found", [{"compacted_at_count": 6}, {}], ids=["at-count", "no-count"])
def test_a_host_reset_on_a_message_mirrored_under_a_derived_id_told_again_leaves_the_compaction_made_after_it(
    service: Service, sid: str, found: dict[str, int]
) -> None:
    # The reset under the built-in compaction made after it names the host's id: not taken for the one told
    # again, the repeat (without compacted_at_count) replaced that compaction, and the context grew back by all
    # it had summarised.
    derived_after_reset(service, sid, "", reset=True)
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted
    s = service.store
    compacted, before = shown(service, sid), compaction.load_pointer(s, A, sid)
    assert before is not None and before[compaction.RESET_UNDER]["first_kept_entry_id"] == "h4"
    req = HostCompactionRequest(summary="", first_kept_position=6, first_kept_entry_id="h4", reset=True, **found)
    assert service.host_compaction(A, "legacy", sid, req).first_kept_position == before["first_kept_position"]
    assert compaction.load_pointer(s, A, sid) == before
    assert shown(service, sid) == compacted
