"""The legacy engine's assembly and compaction around the built-in and the host's compaction pointers, on
both backends (a review of the default engine's compaction paths).

1. A compaction the host (OpenClaw) recorded whose first kept message is its first visible one
   (``first_kept_position: 0``) was never shown by ``assemble`` (only a summary in front of a later
   position was), while the built-in compaction counted it (``tokens_before``) and folded it into the
   next summary: the model never saw what OpenClaw's own context holds, and a compaction counted tokens
   the model was not sent. Now the summary stands in front of position 0 as in front of any other.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import module_store_fixtures
from mirror_helpers import A, a, hosted, legacy_service, page, shown, u

from transcript_store import TranscriptStore
from transcript_store.service import Service
from transcript_store.service_models import AssembleRequest, HostCompactionRequest

shared_url, store, sid = module_store_fixtures(A, "legacy_compaction_s43")
HEAD = "[Summary of the earlier conversation]\n"


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

