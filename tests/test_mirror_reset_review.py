"""A review of the host's resets and compactions on the mirror (OpenClaw), on both backends.

Each test failed before its fix, but the one guarding the order of a fallback (``..._wins_when_...``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import module_store_fixtures
from mirror_helpers import A, a, hosted, legacy_service, page, shown, u

from transcript_store import TranscriptStore, compaction
from transcript_store.errors import InvalidInput
from transcript_store.service import Service
from transcript_store.service_models import CompactRequest, HostCompactionRequest

shared_url, store, sid = module_store_fixtures(A, "mirror_reset_review")
HEAD = "[Summary of the earlier conversation]\n"
LONG = " and so on" * 40
HOUR_MS = 3_600_000


@pytest.fixture(scope="module")
def service(store: TranscriptStore) -> Iterator[Service]:
    yield from legacy_service(store)


def long_talk(n: int) -> list[tuple[str, dict[str, Any]]]:
    """``n`` long host messages h0.. (m0.., user and assistant in turn)."""
    return [(f"h{i}", u(f"m{i}{LONG}") if i % 2 == 0 else a(f"m{i}{LONG}")) for i in range(n)]


def reset(svc: Service, session_id: str, position: int, count: int, kept: str | None = None) -> int:
    """Record a host reset made after ``count`` messages, its context starting again at ``position``."""
    req = HostCompactionRequest(
        summary="", first_kept_position=position, first_kept_entry_id=kept, reset=True, compacted_at_count=count
    )
    return svc.host_compaction(A, "legacy", session_id, req).first_kept_position


def record(svc: Service, session_id: str, summary: str, position: int, kept: str, **found: int) -> int:
    """Record a host compaction; the first kept position the engine shows."""
    req = HostCompactionRequest(summary=summary, first_kept_position=position, first_kept_entry_id=kept, **found)
    return svc.host_compaction(A, "legacy", session_id, req).first_kept_position


def test_a_host_compaction_keeping_messages_before_the_reset_in_force_does_not_bring_them_back(
    service: Service, sid: str
) -> None:
    s = service.store
    msgs = long_talk(10)
    page(s, sid, None, "c1", hosted(*msgs[:6]))
    assert reset(service, sid, 6, 6) == 6
    page(s, sid, "c1", "c2", hosted(*msgs[6:10]))
    assert shown(service, sid) == [f"m{i}{LONG}" for i in range(6, 10)]
    # A compaction the host made before the reset, found later (a new plugin process reads the transcript
    # from its start) by a host whose clock is ahead of the service's, or told as made after the reset: it
    # keeps messages the context after the reset does not hold. Recorded, it stood over the reset, and the
    # conversation before the reset came back (the summary and m2..m5).
    assert record(service, sid, "before the reset", 2, "h2", compacted_ms=(time.time_ns() // 10**6) + HOUR_MS) == 6
    assert shown(service, sid) == [f"m{i}{LONG}" for i in range(6, 10)]
    assert record(service, sid, "before the reset", 2, "h2", compacted_at_count=10) == 6
    assert shown(service, sid) == [f"m{i}{LONG}" for i in range(6, 10)]
    # Nor does the built-in compaction summarise them: it starts at the reset.
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).reason == "nothing old enough to compact"


@pytest.mark.parametrize(
    ("summary", "kept"),
    [("a summary", "h\x002"), ("a summary", "h\x1f2"), ("a \ud800 summary", "h2"), ("a summary", "")],
    ids=["nul-id", "control-id", "lone-surrogate-summary", "empty-id"],
)
def test_a_malformed_host_compaction_is_refused_typed_and_changes_nothing(
    service: Service, sid: str, summary: str, kept: str
) -> None:
    # Called as a library (or through the service with a request built by model_construct, which skips
    # validation): a lone surrogate in the summary raised UnicodeEncodeError from the driver; an entry id
    # with a NUL was stored in the pointer at the mirror's end (the position nothing is checked against),
    # and every later read of it (each assemble) was a database error on PostgreSQL, none on SQLite.
    s = service.store
    page(s, sid, None, "c1", hosted(*long_talk(2)))
    with pytest.raises(InvalidInput):
        s.write(
            lambda c: compaction.record_host_compaction(
                c, A, sid, summary=summary, first_kept_position=2, first_kept_entry_id=kept
            )
        )
    req = HostCompactionRequest.model_construct(
        summary=summary, first_kept_position=2, first_kept_entry_id=kept, reset=False, compacted_ms=None,
        compacted_at_count=None,
    )
    with pytest.raises(InvalidInput):
        service.host_compaction(A, "legacy", sid, req)
    assert s.read(lambda c: compaction.pointer_in(c, A, sid)) is None
    assert shown(service, sid) == [f"m{i}{LONG}" for i in range(2)]


def test_a_host_compaction_stays_when_a_built_in_one_made_after_it_leaves_the_branch(
    service: Service, sid: str
) -> None:
    # As a host's reset stays (test_mirror_host_compaction): the host's compaction is on the branch the
    # mirror is on, but only the built-in compaction's pointer was kept, and the context starts at m0 again.
    s = service.store
    msgs = long_talk(16)
    page(s, sid, None, "c1", hosted(*msgs[:10]))
    assert record(service, sid, "the host's", 6, "h6", compacted_at_count=10) == 6
    assert shown(service, sid)[0] == f"{HEAD}the host's"
    page(s, sid, "c1", "c2", hosted(*msgs[10:16]))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted  # at 16 messages
    # The host edits h10: the built-in compaction (first kept h10) leaves the branch; the host's (made after
    # h9) stays on it.
    assert page(s, sid, None, "c3", hosted(*msgs[:10], ("h10b", u("m10b")))).rewound
    got = shown(service, sid)
    assert got[0] == f"{HEAD}the host's", got[:2]


def test_a_host_reset_found_after_a_built_in_compaction_made_further_on_ends_it(service: Service, sid: str) -> None:
    # The plugin tells a reset when it reads it in the host's transcript: the service's own compaction may
    # have run first, further on, summarising the conversation before the reset. Taken for the newer one
    # (made after more messages), it stayed, and the context showed the pre-reset conversation again.
    s = service.store
    msgs = long_talk(20)
    page(s, sid, None, "c1", hosted(*msgs[:16]))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted  # at 16, summarising m0..m9
    assert reset(service, sid, 12, 12) == 12  # was: 10 (the built-in compaction's)
    assert shown(service, sid) == [f"m{i}{LONG}" for i in range(12, 16)]
    # A built-in compaction made after the reset (it knows it) is newer than the reset told again.
    page(s, sid, "c1", "c2", hosted(*msgs[16:]))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted  # summarising m12, m13
    after = shown(service, sid)
    assert after[0].startswith(HEAD) and after[1:] == [f"m{i}{LONG}" for i in range(14, 20)]
    assert reset(service, sid, 12, 12) == 14
    assert shown(service, sid) == after
    # An older reset (before the one in force) found later changes nothing either.
    assert reset(service, sid, 6, 6) == 14
    assert shown(service, sid) == after


def test_a_host_reset_found_after_the_host_compaction_made_after_it_stays_under_it(service: Service, sid: str) -> None:
    # The host compacted after its reset (keeping only what followed it), and the plugin told the reset only
    # later: the compaction, made further on, stayed, but the reset was not kept under it (as one told first
    # is). When the host then regenerated its last reply, the compaction left the mirror's branch and the
    # reset, which stands there, was gone: the context was the whole conversation from m0 again.
    s = service.store
    msgs = long_talk(16)
    page(s, sid, None, "c1", hosted(*msgs[:16]))
    assert record(service, sid, "after the reset", 13, "h13", compacted_at_count=16) == 13
    assert reset(service, sid, 12, 12) == 13
    assert shown(service, sid) == [f"{HEAD}after the reset", f"m13{LONG}", f"m14{LONG}", f"m15{LONG}"]
    assert reset(service, sid, 12, 12) == 13  # told again: the same
    assert page(s, sid, None, "c3", hosted(*msgs[:15], ("h15b", a("m15b")))).rewound
    assert shown(service, sid) == [f"m{i}{LONG}" for i in range(12, 15)] + ["m15b"]  # was: m0 .. m15b


def test_a_reset_made_after_the_host_compaction_wins_when_the_built_in_one_after_both_leaves_the_branch(
    service: Service, sid: str
) -> None:
    # The host's compaction (made after h9), then its reset (after h11), then the built-in compaction: that
    # one leaving the branch, the newer of the two under it stands: the reset, never the host's compaction
    # (which would show the conversation before the reset again).
    s = service.store
    msgs = long_talk(20)
    page(s, sid, None, "c1", hosted(*msgs[:10]))
    assert record(service, sid, "the host's", 6, "h6", compacted_at_count=10) == 6
    page(s, sid, "c1", "c2", hosted(*msgs[10:12]))
    assert reset(service, sid, 12, 12) == 12
    page(s, sid, "c2", "c3", hosted(*msgs[12:20]))
    assert service.compact(A, "legacy", sid, CompactRequest(force=True)).compacted  # first kept: h14
    assert page(s, sid, None, "c4", hosted(*msgs[:14], ("h14b", u("m14b")))).rewound
    assert shown(service, sid) == [f"m{i}{LONG}" for i in range(12, 14)] + ["m14b"]
