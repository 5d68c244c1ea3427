"""The host transcript mirror after branches: off-branch host ids, late turns, and the import's resume point.

What a second review of ``transcript_store.mirror`` found, on both backends (each test failed before
the fix; see each docstring for what it did then):

1. A range naming host ids the mirror holds off its active branch (a host that went back to an
   earlier branch, or reuses ids after a rewrite) was appended under fresh random ids: the same
   entries stored again on every such delivery, and a turn's receipt naming a random id, so every
   replay of the turn was an advancement-key collision. Now an off-branch entry that is the host's
   message at that place (same parent, same message) is put back on the branch, and a message that
   must be new gets an id derived from the host id, its parent and its content: a replay finds it.
2. A turn arriving late, after a turn admitted after it had been committed further on, branched the
   mirror back to itself (last commit wins), taking the later turn off the branch. Now it is refused
   (``behind``: import the host transcript first); a host that really went back imports and commits.
3. ``Service.bootstrap`` answered with a resume point read in a second transaction, after another
   writer could have moved it. Now the answer is what the page's own transaction left.
4. ``TranscriptStore.branch`` below the import's resume point left it past the mirror's end (every
   next page ``behind``), or, after appends restored the count, resuming after the store's own
   messages. Now such a branch resets it to the host's start, and a resume point past the mirror's
   end reads as the start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from conftest import module_store_fixtures
from mirror_helpers import A, a, commit, every_entry, hosted, legacy_service, page, state_of, turn_request, u, visible

from transcript_store import TranscriptStore
from transcript_store.core import Core, prepare_entry
from transcript_store.errors import MirrorConflict, TurnKeyConflict
from transcript_store.ledger import put_state
from transcript_store.mirror import STATE_KEY, STATE_OWNER, HostMessage, align, import_page
from transcript_store.models import ClosedRange
from transcript_store.service import Service
from transcript_store.service_models import BootstrapRequest

shared_url, store, sid = module_store_fixtures(A, "mirror_resume")
T = TypeVar("T")


@pytest.fixture(scope="module")
def service(store: TranscriptStore) -> Iterator[Service]:
    yield from legacy_service(store)


def receipt_keys(svc: Service, session_id: str) -> list[str]:
    return [r.advancement_key for r in svc.receipts(A, "legacy", session_id).receipts]


def host_messages(n: int) -> list[HostMessage]:
    return hosted(*((f"h{i}", u(f"m{i}") if i % 2 == 0 else a(f"m{i}")) for i in range(n)))


# ---------------------------------------------------------------------------------------------- 1. off-branch ids


def test_a_turn_reusing_off_branch_ids_replays_as_a_duplicate(service: Service, sid: str) -> None:
    """The host reuses the ids of a turn it rewrote away (h1, h2: now off the mirror's branch) for a
    new turn with other messages. It was appended under random ids and its receipt named those, so
    the host's replay after an uncertain commit (the same request) was an advancement-key collision,
    and the same range aligned again branched and appended another copy. Now the new messages get
    ids derived from the host's: the replay is a duplicate, aligning again matches, one copy each."""
    s = service.store
    assert commit(service, sid, turn_request("k1", 0, [u("q1"), a("r1")], ("h1", "h2"))).status == "committed"
    assert page(s, sid, None, "c1", hosted(("p0", u("rewritten")))).rewound  # h1, h2 off the branch
    req = turn_request("k2", 1, [u("q2"), a("r2")], ("h1", "h2"))
    first = commit(service, sid, req)
    assert first.status == "committed"
    stored = every_entry(s, sid)
    again = commit(service, sid, req)  # was: AdvancementKeyCollision
    assert again.status == "duplicate" and again.receipt == first.receipt
    assert (again.admission, again.terminal) == (first.admission, first.terminal)
    turn = hosted(("h1", u("q2")), ("h2", a("r2")))
    done = s.write(lambda c: align(c, s.config, A, sid, 1, turn, turn=True))
    assert (done.imported, done.matched, done.rewound) == (0, 2, False)  # was: (2, 0, True), a third copy
    assert every_entry(s, sid) == stored and len(stored) == 2 + 1 + 2
    assert [m for _, m in visible(s, sid)] == [u("rewritten"), u("q2"), a("r2")]


def test_a_branch_the_host_went_back_to_is_restored_not_stored_again(service: Service, sid: str) -> None:
    """Two rival turns at position 1 (the later one, kB, is the mirror's branch); the host's
    transcript is kA's branch after all, and its import says so. kA's entries (the admission, a tool
    call the turn did not name, the terminal) were appended again under random ids: three more
    entries, and kA's receipt naming entries off the branch. Now they are put back on it."""
    s = service.store
    page(s, sid, None, "c1", hosted(("h0", u("hello"))))
    ka = turn_request("kA", 1, [u("qA"), a("calling"), a("rA")], ("xa", "ya"))
    assert commit(service, sid, ka).status == "committed"
    assert commit(service, sid, turn_request("kB", 1, [u("qB"), a("rB")], ("xb", "yb"))).status == "committed"
    stored = {e for e, _, _ in every_entry(s, sid)}
    done = page(s, sid, None, "c4", hosted(("h0", u("hello")), ("xa", u("qA")), ("xm", a("calling")), ("ya", a("rA"))))
    assert (done.imported, done.matched, done.rewound) == (3, 1, True)
    assert {e for e, _, _ in every_entry(s, sid)} == stored  # was: three more entries
    shown = visible(s, sid)
    assert [m for _, m in shown] == [u("hello"), u("qA"), a("calling"), a("rA")]
    assert [e for e, _ in shown][:2] == ["h0", "xa"] and shown[3][0] == "ya"
    replay = commit(service, sid, ka)
    assert replay.status == "duplicate"
    assert isinstance(s.read_closed_range(replay.admission, replay.terminal), ClosedRange)  # on the branch again


def test_a_turn_over_its_imported_entries_off_the_branch_is_restored(service: Service, sid: str) -> None:
    """The import put a turn's messages in the mirror (the plugin imports up to a turn before
    committing it), each under the host's id; a rival turn then took them off the branch. The turn
    itself names only its ends: its middle message is matched through the terminal's parents. It was
    appended again under random ids (three copies); now the imported entries are back, committed."""
    s = service.store
    page(s, sid, None, "c4", hosted(("h0", u("hello")), ("hu", u("q")), ("hm", a("calling")), ("ha", a("r"))))
    assert commit(service, sid, turn_request("kB", 1, [u("qB"), a("rB")], ("xb", "yb"))).status == "committed"
    stored = every_entry(s, sid)
    done = commit(service, sid, turn_request("k1", 1, [u("q"), a("calling"), a("r")], ("hu", "ha")))
    assert done.status == "committed" and (done.admission.entry_id, done.terminal.entry_id) == ("hu", "ha")
    assert {e for e, _, _ in every_entry(s, sid)} == {e for e, _, _ in stored}  # was: three more entries
    assert [e for e, _ in visible(s, sid)] == ["h0", "hu", "hm", "ha"]


def test_an_off_branch_turn_under_another_key_is_a_turn_key_conflict(service: Service, sid: str) -> None:
    """The entries of turn kA, off the branch, sent as the turn of another key: it was committed
    again under fresh copies (one host turn reaching the engine twice). Its entries are kA's: the
    ledger's TurnKeyConflict, and nothing written."""
    s = service.store
    assert commit(service, sid, turn_request("kA", 0, [u("qA"), a("rA")], ("xa", "ya"))).status == "committed"
    assert commit(service, sid, turn_request("kB", 0, [u("qB"), a("rB")], ("xb", "yb"))).status == "committed"
    stored = every_entry(s, sid)
    with pytest.raises(TurnKeyConflict):
        commit(service, sid, turn_request("kC", 0, [u("qA"), a("rA")], ("xa", "ya")))
    assert every_entry(s, sid) == stored and receipt_keys(service, sid) == ["kA", "kB"]


def test_a_host_naming_an_id_the_mirror_derives_is_refused(service: Service, sid: str) -> None:
    """A host that names an entry with the id the mirror derives for a turn's unnamed middle message
    (the same message, elsewhere): the turn would have hung its terminal after that entry, off its own
    admission. Refused (``turn_mismatch``) before anything is written."""
    from transcript_store.mirror import _derived_id  # the mirror's id scheme (this test forges one)

    s = service.store
    middle = prepare_entry(s.config, message=a("calling")).payload_json
    forged = _derived_id(None, "hu", middle)
    page(s, sid, None, "c2", hosted(("x0", u("zero")), (forged, a("calling"))))
    stored = every_entry(s, sid)
    with pytest.raises(MirrorConflict) as refused:
        commit(service, sid, turn_request("k1", 2, [u("q"), a("calling"), a("r")], ("hu", "ha")))
    assert refused.value.reason == "turn_mismatch"
    assert every_entry(s, sid) == stored and receipt_keys(service, sid) == []


# ---------------------------------------------------------------------------------------------- 2. late turns


def test_a_late_turn_does_not_branch_away_a_later_one(service: Service, sid: str) -> None:
    """kB (positions 0..1) and then kC (2..3) are committed; kA, which the host sent before them for
    positions 0..1, arrives last. It branched the mirror back to itself (kB and kC off the branch).
    Now it is ``behind``, on every try, and nothing is written. A turn at the last turn's position (a
    regenerate, shorter or not) still replaces it."""
    s = service.store
    assert commit(service, sid, turn_request("kB", 0, [u("qB"), a("rB")], ("xb", "yb"))).status == "committed"
    kc = turn_request("kC", 2, [u("qC"), a("tool"), a("rC")], ("xc", "yc"))
    assert commit(service, sid, kc).status == "committed"
    stored = every_entry(s, sid)
    late = turn_request("kA", 0, [u("qA"), a("rA")], ("xa", "ya"))
    for _ in range(2):
        with pytest.raises(MirrorConflict) as refused:  # was: committed, the mirror showing kA alone
            commit(service, sid, late)
        assert refused.value.reason == "behind"
    assert every_entry(s, sid) == stored and receipt_keys(service, sid) == ["kB", "kC"]
    assert [e for e, _ in visible(s, sid)][:2] == ["xb", "yb"]
    again = commit(service, sid, turn_request("kC2", 2, [u("qC2"), a("rC2")], ("xc2", "yc2")))
    assert again.status == "committed"
    assert [e for e, _ in visible(s, sid)] == ["xb", "yb", "xc2", "yc2"]


def test_a_host_that_went_back_imports_then_commits(service: Service, sid: str) -> None:
    """The host went back to position 2 and edited there: the turn is ``behind`` (a later turn is
    mirrored past it), the plugin imports the host's transcript from the resume point (the import
    moves the mirror), and the same turn then commits."""
    s = service.store
    page(s, sid, None, "c2", host_messages(2))
    assert commit(service, sid, turn_request("k1", 2, [u("q1"), a("r1")], ("x1", "y1"))).status == "committed"
    assert commit(service, sid, turn_request("k2", 4, [u("q2"), a("r2")], ("x2", "y2"))).status == "committed"
    edit = turn_request("k3", 2, [u("edited"), a("again")], ("e1", "e2"))
    with pytest.raises(MirrorConflict) as refused:
        commit(service, sid, edit)
    assert refused.value.reason == "behind"
    done = page(s, sid, "c2", "c4", hosted(("e1", u("edited")), ("e2", a("again"))))
    assert (done.imported, done.matched, done.rewound) == (2, 0, True)
    assert commit(service, sid, edit).status == "committed"
    assert [e for e, _ in visible(s, sid)] == ["h0", "h1", "e1", "e2"]


# ---------------------------------------------------------------------------------------------- 3. bootstrap


def test_bootstrap_answers_with_the_state_its_page_left(service: Service, sid: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Another importer writes the next page right after this page's transaction commits. The answer
    was read in a second transaction and told that importer's resume point (c4, 4 messages) as this
    page's; it is what this page's own transaction left (c2, 2)."""
    s = service.store
    real = s.write
    intruded: list[bool] = []

    def write_then_intrude(fn: Callable[[Core], T]) -> T:
        out = real(fn)
        if not intruded:
            intruded.append(True)
            real(lambda c: import_page(c, s.config, A, sid, cursor="c2", next_cursor="c4",
                                       messages=host_messages(4)[2:]))
        return out

    monkeypatch.setattr(s, "write", write_then_intrude)
    req = BootstrapRequest.model_validate({"done": False, "page": {
        "cursor": None, "next_cursor": "c2",
        "entries": [{"entry_id": h.entry_id, "message": h.message} for h in host_messages(2)],
    }})
    answer = service.bootstrap(A, "legacy", sid, req)
    assert intruded
    assert (answer.imported, answer.cursor, answer.position, answer.visible_count) == (2, "c2", 2, 2)
    assert state_of(s, sid) == ("c4", 4)  # the other importer's page landed after it


# ---------------------------------------------------------------------------------------------- 4. store.branch


def test_a_store_branch_below_the_resume_point_resets_it(store: TranscriptStore, sid: str) -> None:
    """Five host messages imported (c5, 5); the store's own branch keeps two. The resume point stayed
    (c5, 5), past the mirror's end: the next page was ``behind``, on every try. Now it is the start;
    the importer re-reads it and re-imports, which puts the three back (no copies) and goes on."""
    host = host_messages(6)
    page(store, sid, None, "c5", host[:5])
    store.branch(A, sid, "h1")
    assert state_of(store, sid) == (None, 0)
    with pytest.raises(MirrorConflict) as refused:
        page(store, sid, "c5", "c6", host[5:])
    assert refused.value.reason == "cursor"  # was: behind
    done = page(store, sid, None, "c6", host)
    assert (done.matched, done.imported, done.rewound) == (2, 4, False)
    assert [e for e, _ in visible(store, sid)] == [f"h{i}" for i in range(6)]
    assert len(every_entry(store, sid)) == 6 and state_of(store, sid) == ("c6", 6)


def test_a_store_branch_then_appends_past_the_resume_point_still_resets_it(store: TranscriptStore, sid: str) -> None:
    """The store branches back to position 1 and appends three messages of its own: the mirror holds
    five again, but not the host's. The resume point (c5, 5) then put the host's next page after the
    store's own messages; now the branch reset it, and that page is refused (``cursor``)."""
    host = host_messages(6)
    page(store, sid, None, "c5", host[:5])
    store.branch(A, sid, "h1")
    store.append_many(A, sid, [{"message": u(f"own {i}")} for i in range(3)])
    assert state_of(store, sid) == (None, 0)  # was: ("c5", 5)
    with pytest.raises(MirrorConflict) as refused:
        page(store, sid, "c5", "c6", host[5:])
    assert refused.value.reason == "cursor"
    assert [m for _, m in visible(store, sid)][2:] == [u(f"own {i}") for i in range(3)]


def test_a_store_branch_that_keeps_the_imported_positions_keeps_the_resume_point(service: Service, sid: str) -> None:
    """A branch that leaves every imported position as it was (back to the import's end, after a
    turn) leaves the resume point; one below it resets it."""
    s = service.store
    page(s, sid, None, "c2", host_messages(2))
    assert commit(service, sid, turn_request("k1", 2, [u("q"), a("r")], ("qu", "qa"))).status == "committed"
    s.branch(A, sid, "h1")
    assert state_of(s, sid) == ("c2", 2)
    s.branch(A, sid, "qa")
    assert state_of(s, sid) == ("c2", 2)
    s.branch(A, sid, None)
    assert state_of(s, sid) == (None, 0)


def test_a_resume_point_past_the_mirror_reads_as_the_start(service: Service, sid: str) -> None:
    """A resume point already past the mirror's end (left by a branch before this fix, or by a path
    move outside the store's branch call) reads as the host's start: it was told as it is, and every
    page sent from it was ``behind``."""
    s = service.store
    page(s, sid, None, "c1", host_messages(1))
    s.write(lambda c: put_state(c, A, sid, STATE_OWNER, STATE_KEY, {"cursor": "c9", "position": 9}))
    assert state_of(s, sid) == (None, 0)
    told = service.bootstrap_state(A, "legacy", sid)
    assert (told.cursor, told.position, told.visible_count) == (None, 0, 1)
    done = page(s, sid, None, "c2", host_messages(2))
    assert (done.matched, done.imported) == (1, 1) and state_of(s, sid) == ("c2", 2)
