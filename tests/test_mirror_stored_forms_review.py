"""A host's compaction over a mirror holding messages the store took under other rules, on both backends.

What a review of the mirror against exports found (the test failed before the fix): taking a stored
message for a host's message by the id derived from it (``mirror.host_id_fits``) validated that stored
message again as a new append, under today's rules and payload cap. A message an earlier release stored
(an import of its export brings such forms again: README, "entry") or one over a cap lowered since made
the host's compaction of the session fail with that message's ``InvalidMessage`` (400) or
``PayloadTooLarge`` (413), for ever, though the request itself was good.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import module_store_fixtures
from mirror_helpers import A, a, hosted, legacy_service, page, u, visible

from transcript_store import StoreConfig, TranscriptStore
from transcript_store.core import stored_text
from transcript_store.errors import InvalidMessage, MirrorConflict, PayloadTooLarge
from transcript_store.mirror import _derived_id
from transcript_store.service import Service
from transcript_store.service_models import HostCompactionRequest

shared_url, store, sid = module_store_fixtures(A, "mirror_stored_forms")

#: an assistant message an earlier release stored (an empty tool_calls list), which an append refuses now
EARLIER = {"role": "assistant", "content": "thinking", "tool_calls": []}


@pytest.fixture(scope="module")
def service(store: TranscriptStore) -> Iterator[Service]:
    yield from legacy_service(store)


def _imported_mirror(store: TranscriptStore, session_id: str) -> None:
    """A mirrored session as an export brings it: h0, a turn's middle message (its id derived from none,
    as the mirror stores one) in the earlier form, then h2."""
    scratch = f"{session_id}-scratch"
    store.create_session(A, session_id=scratch)
    page(store, scratch, None, "c1", hosted(("h0", u("q")), (None, a("thinking")), ("h2", u("next"))))
    header, records = store.export_session(A, scratch)
    middle = _derived_id(None, "h0", stored_text(EARLIER))
    edited: list[dict[str, Any]] = [dict(r) for r in records]
    edited[1].update(message=EARLIER, entry_id=middle)
    del edited[1]["size_bytes"]  # edited by hand: its size is computed
    edited[2]["parent_id"] = middle
    store.import_session(A, header, edited, session_id=session_id)
    assert [m for _, m in visible(store, session_id)] == [u("q"), EARLIER, u("next")]


def test_a_host_compaction_keeping_a_message_stored_under_earlier_rules(
    service: Service, store: TranscriptStore
) -> None:
    _imported_mirror(store, "earlier")
    req = HostCompactionRequest(summary="the host's", first_kept_position=1, first_kept_entry_id="h1")
    # The turn's middle message is taken by its position (its host id was never named): recorded (was:
    # InvalidMessage about the stored message, "tool_calls: ... at least 1 item").
    assert service.host_compaction(A, "legacy", "earlier", req).first_kept_position == 1


def test_a_host_compaction_keeping_a_message_over_a_cap_lowered_since(shared_url: str, store: TranscriptStore) -> None:
    big = a("x" * 5000)
    store.create_session(A, session_id="capped")
    page(store, "capped", None, "c1", hosted(("h0", u("q")), (None, big), ("h2", u("next"))))
    lowered = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False, max_payload_bytes=4096))
    try:
        for svc in legacy_service(lowered):
            req = HostCompactionRequest(summary="the host's", first_kept_position=1, first_kept_entry_id="h1")
            # Was PayloadTooLarge: the stored message, not the request, is over today's cap.
            assert svc.host_compaction(A, "legacy", "capped", req).first_kept_position == 1
            # A position holding another host message than the one named is still refused (409 behind).
            other = HostCompactionRequest(summary="s", first_kept_position=0, first_kept_entry_id="h9")
            with pytest.raises(MirrorConflict, match="not the host"):
                svc.host_compaction(A, "legacy", "capped", other)
    finally:
        lowered.close()


def test_a_page_sent_again_over_a_message_stored_under_earlier_rules(store: TranscriptStore) -> None:
    # The host's transcript holds the message as an earlier release mirrored it; an import from the host's
    # beginning (after a reset of the resume point, a new plugin process) sends it again.
    _imported_mirror(store, "again")
    before = visible(store, "again")
    again = hosted(("h0", u("q")), ("h1", EARLIER), ("h2", u("next")))
    # Matched where it stands (was: InvalidMessage, every import of the session refused for ever).
    assert page(store, "again", None, "c1", again).matched == 3
    assert visible(store, "again") == before
    # As a new message it is a new append, and refused as one: nothing written.
    with pytest.raises(InvalidMessage, match="tool_calls"):
        page(store, "again", "c1", "c2", hosted(("h3", u("more")), ("h4", EARLIER)))
    assert visible(store, "again") == before


def test_a_page_sent_again_over_a_message_over_a_cap_lowered_since(shared_url: str, store: TranscriptStore) -> None:
    big = a("y" * 5000)
    store.create_session(A, session_id="capped-page")
    page(store, "capped-page", None, "c1", hosted(("h0", u("q")), ("h1", big)))
    lowered = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False, max_payload_bytes=4096))
    try:
        before = visible(lowered, "capped-page")
        assert page(lowered, "capped-page", None, "c1", hosted(("h0", u("q")), ("h1", big))).matched == 2
        with pytest.raises(PayloadTooLarge):
            page(lowered, "capped-page", "c1", "c2", hosted(("h2", u("q2")), ("h3", a("z" * 5000))))
        assert visible(lowered, "capped-page") == before
    finally:
        lowered.close()
