"""The host transcript mirror and a committed turn's messages named again at a later position (session 44),
on both backends.

Since the mirror told a host's reused id from an overlap by comparing the stored text, a turn's admission
or terminal that the turn's commit stored otherwise than the host's import spells it (the plugin cuts a
commit to the turn cap, not an import) was appended a second time at a later position (a stale turn, an
overlapping page): the message shown twice. A turn's messages match by entry id alone
(integrations/openclaw/README.md), so such a range is refused again, nothing written."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import module_store_fixtures
from mirror_helpers import A, a, commit, every_entry, hosted, legacy_service, page, state_of, turn_request, u, visible

from transcript_store import TranscriptStore
from transcript_store.errors import MirrorConflict
from transcript_store.service import Service

shared_url, store, sid = module_store_fixtures(A, "mirror_turn_ids_s44")

FULL = "the whole question, as the host's transcript holds it"
CUT = "the whole [... 40 characters cut by transcript-store ...]"


@pytest.fixture(scope="module")
def service(store: TranscriptStore) -> Iterator[Service]:
    yield from legacy_service(store)


def test_a_stale_turn_spelling_an_imported_message_otherwise_is_refused(service: Service, sid: str) -> None:
    """The import holds host message x whole at 0; the turn admitting x arrives with a stale position (2)
    and x cut, as the plugin cuts a commit. It was appended under an id derived from x (x shown twice, and
    committed to the engine); it is ``turn_mismatch`` again, nothing written."""
    page(service.store, sid, None, "c1", hosted(("x", u(FULL)), ("b", a("yo"))))
    before = every_entry(service.store, sid)
    with pytest.raises(MirrorConflict) as refused:
        commit(service, sid, turn_request("k1", 2, [u(CUT), a("reply")], ("x", "t")))
    assert refused.value.reason == "turn_mismatch"
    assert "'x'" in str(refused.value) and "position 0" in str(refused.value)
    assert every_entry(service.store, sid) == before
    assert [m for _, m in visible(service.store, sid)] == [u(FULL), a("yo")]


@pytest.mark.parametrize("named", ["admission", "terminal"])
def test_a_page_naming_a_committed_turns_message_again_later_is_refused(
    service: Service, sid: str, named: str
) -> None:
    """A turn committed x..t at 0..1 with one of them cut; the import matches both by id at 0..1 (whole),
    then an overlapping page names that one again at 2, whole. It was appended (shown twice: the text the
    commit stored differs); it is ``cursor`` again, nothing written, the resume point kept."""
    q, r = (u(CUT), a("reply")) if named == "admission" else (u("q"), a(CUT))
    assert commit(service, sid, turn_request("k1", 0, [q, r], ("x", "t"))).status == "committed"
    whole = hosted(("x", u(FULL) if named == "admission" else q), ("t", a(FULL) if named == "terminal" else r))
    assert page(service.store, sid, None, "c1", whole).imported == 0
    before = every_entry(service.store, sid)
    again = whole[0] if named == "admission" else whole[1]
    with pytest.raises(MirrorConflict) as refused:
        page(service.store, sid, "c1", "c2", [again])
    assert refused.value.reason == "cursor"
    assert f"{again.entry_id!r}" in str(refused.value) and "position 2" in str(refused.value)
    assert every_entry(service.store, sid) == before and state_of(service.store, sid) == ("c1", 2)
    assert [m for _, m in visible(service.store, sid)] == [q, r]


def test_an_imported_id_reused_for_another_message_still_imports(service: Service, sid: str) -> None:
    """What session 44 allowed stays: an id the import (no turn) holds at 0, reused by the host for another
    message on a later page, is mirrored under a derived id, once."""
    page(service.store, sid, None, "c1", hosted(("x", u("hi")), ("b", a("yo"))))
    assert page(service.store, sid, "c1", "c2", hosted(("x", u("other")))).imported == 1
    assert [m for _, m in visible(service.store, sid)] == [u("hi"), a("yo"), u("other")]
