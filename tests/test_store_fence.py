"""The current-turn fence `before-current-turn-entry-v1`: every read of a turn sees the prefix before it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import make_legacy

from engines.legacy import LegacyEngine
from transcript_store import (
    CURRENT_TURN_FENCE,
    Admission,
    Anchor,
    DeltaMissing,
    DeltaPage,
    Entry,
    InvalidInput,
    ReadFenceError,
    TranscriptStore,
)
from transcript_store.cursors import CursorState
from transcript_store.engine import EngineContext

A, B = "scope-a", "scope-b"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def page_of(result: Any) -> DeltaPage:
    assert isinstance(result, DeltaPage), result
    return result


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(A, session_id="s1", session_key="k").session_id


def history(store: TranscriptStore, sid: str, n: int) -> list[Entry]:
    made = []
    for i in range(n):
        made.append(store.append(A, sid, (user if i % 2 == 0 else assistant)(f"m{i}")))
        store.append(A, sid, kind="custom", payload={"i": i})
    return made


def turn(store: TranscriptStore, sid: str, n_before: int = 5) -> tuple[list[Entry], Admission]:
    """History, then an admitted turn with its reply already appended."""
    before = history(store, sid, n_before)
    adm = store.admit(A, sid, user("the question"), turn_id="turn-1")
    store.append(A, sid, kind="metadata", payload={"model": "x"})
    store.append(A, sid, assistant("the answer"))
    return before, adm


def expect_fence_error(reason: str, *calls: Any) -> None:
    for call in calls:
        with pytest.raises(ReadFenceError) as info:
            call()
        assert info.value.reason == reason, info.value


def test_the_fence_is_named() -> None:
    assert CURRENT_TURN_FENCE == "before-current-turn-entry-v1"


def test_a_fenced_read_sees_exactly_the_prefix_before_the_admitted_entry(store: TranscriptStore, sid: str) -> None:
    before, adm = turn(store, sid)
    ids = [e.entry_id for e in before]
    assert [e.entry_id for e in store.read_visible(A, sid, fence=adm.fence)] == ids
    page = page_of(store.read_visible_delta(A, sid, fence=adm.fence))
    assert [e.entry_id for e in page.entries] == ids and page.has_more is False
    # Unfenced, the admitted message and the reply are there.
    assert len(store.read_visible(A, sid)) == len(ids) + 2


def test_fenced_pages_chain_up_to_the_fence_and_stop(store: TranscriptStore, sid: str) -> None:
    before, adm = turn(store, sid, n_before=7)
    seen: list[str] = []
    cursor = None
    while True:
        page = page_of(store.read_visible_delta(A, sid, cursor, max_messages=2, fence=adm.fence))
        seen += [e.entry_id for e in page.entries]
        cursor = page.cursor
        if not page.has_more:
            break
    assert seen == [e.entry_id for e in before]
    # At the fence: an empty page, again and again (a retry of the turn), never the admitted entry.
    for _ in range(2):
        again = page_of(store.read_visible_delta(A, sid, cursor, fence=adm.fence))
        assert (again.entries, again.has_more, again.cursor) == ([], False, cursor)
    # The same cursor unfenced moves on to the turn itself.
    rest = page_of(store.read_visible_delta(A, sid, cursor))
    assert [e.message for e in rest.entries] == [user("the question"), assistant("the answer")]


def test_a_cursor_past_the_fence_raises_crossed(store: TranscriptStore, sid: str) -> None:
    _, adm = turn(store, sid, n_before=3)
    at_admission = page_of(store.read_visible_delta(A, sid, max_messages=4)).cursor
    past = page_of(store.read_visible_delta(A, sid)).cursor
    for cursor in (at_admission, past):
        expect_fence_error("crossed", lambda c=cursor: store.read_visible_delta(A, sid, c, fence=adm.fence))
    # Crossed is not a reset: the cursor stays good for unfenced reads.
    assert page_of(store.read_visible_delta(A, sid, at_admission)).entries[0].message == assistant("the answer")


def test_an_admission_at_position_zero_fences_everything(store: TranscriptStore, sid: str) -> None:
    store.append(A, sid, kind="metadata", payload={})
    adm = store.admit(A, sid, user("first"), turn_id="t0")
    assert adm.fence.position == 0
    assert store.read_visible(A, sid, fence=adm.fence) == []
    page = page_of(store.read_visible_delta(A, sid, fence=adm.fence))
    assert page.entries == [] and page.has_more is False


def test_max_bytes_and_required_bytes_respect_the_fence(store: TranscriptStore, sid: str) -> None:
    big = store.append(A, sid, user("x" * 400))
    adm = store.admit(A, sid, user("q"), turn_id="t")
    stuck = page_of(store.read_visible_delta(A, sid, max_bytes=50, fence=adm.fence))
    assert stuck.entries == [] and stuck.required_bytes == big.size_bytes
    # Only the admitted message remains after `big`: fenced, nothing is left to require bytes for.
    done = page_of(store.read_visible_delta(A, sid, max_bytes=big.size_bytes, fence=adm.fence))
    after = page_of(store.read_visible_delta(A, sid, done.cursor, max_bytes=1, fence=adm.fence))
    assert (after.entries, after.required_bytes, after.has_more) == ([], None, False)


def test_retries_of_the_turn_keep_the_same_fence(store: TranscriptStore, sid: str) -> None:
    before, adm = turn(store, sid)
    store.append(A, sid, user("the next turn"))
    again = store.admit(A, sid, user("the question"), turn_id="turn-1")
    assert again.fence == adm.fence
    assert [e.entry_id for e in store.read_visible(A, sid, fence=again.fence)] == [e.entry_id for e in before]


# ---------------------------------------------------------------------------------------------- reasons


def fenced_reads(store: TranscriptStore, scope: str, sid: str, fence: Anchor) -> list[Any]:
    return [
        lambda: store.read_visible(scope, sid, fence=fence),
        lambda: store.read_visible_delta(scope, sid, fence=fence),
        lambda: store.read_visible_delta(
            scope, sid, CursorState(scope, sid, 0, -1, -1, store.get_session(scope, sid).incarnation).encode(),
            fence=fence,
        ),
    ]


def test_rewritten_when_the_generation_rotated(store: TranscriptStore, sid: str) -> None:
    before, adm = turn(store, sid)
    assert store.rewrite_entries(A, sid, [{"entry_id": before[1].entry_id, "message": assistant("edit")}]).changed
    expect_fence_error("rewritten", *fenced_reads(store, A, sid, adm.fence))
    # The fence is checked before the cursor: an unusable fence is never hidden behind a reset.
    expect_fence_error("rewritten", lambda: store.read_visible_delta(A, sid, "garbage", fence=adm.fence))


def test_a_fence_naming_another_session_key_says_so(store: TranscriptStore, sid: str) -> None:
    """Only the key differs: the error said "generation 0 is now 0"."""
    _, adm = turn(store, sid)
    fence = adm.fence.model_copy(update={"session_key": "another-key"})
    for call in fenced_reads(store, A, sid, fence):
        with pytest.raises(ReadFenceError) as info:
            call()
        assert info.value.reason == "rewritten" and "another-key" in str(info.value), info.value


def test_rewritten_when_the_admitted_entry_itself_was_rewritten(store: TranscriptStore, sid: str) -> None:
    _, adm = turn(store, sid)
    store.rewrite_entries(A, sid, [{"entry_id": adm.fence.entry_id, "message": user("edited question")}])
    expect_fence_error("rewritten", *fenced_reads(store, A, sid, adm.fence))


def test_missing_when_the_admitted_entry_left_the_active_branch(store: TranscriptStore, sid: str) -> None:
    before, adm = turn(store, sid)
    store.branch(A, sid, before[-1].entry_id)
    store.append(A, sid, user("another question"))
    expect_fence_error("missing", *fenced_reads(store, A, sid, adm.fence))
    # Back on the branch, the fence holds again (the generation did not rotate).
    store.branch(A, sid, adm.fence.entry_id)
    assert len(store.read_visible(A, sid, fence=adm.fence)) == len(before)


def test_missing_when_the_admitted_entry_or_session_does_not_exist(store: TranscriptStore, sid: str) -> None:
    _, adm = turn(store, sid)
    ghost = adm.fence.model_copy(update={"entry_id": "no-such-entry"})
    expect_fence_error("missing", *fenced_reads(store, A, sid, ghost))
    # The session is gone: every fenced read raises "missing", a delta read too (a DeltaMissing read as
    # "rebuild from scratch", and an engine assembled the turn from nothing); unfenced, it is DeltaMissing.
    store.delete_session(A, sid)
    expect_fence_error("missing", lambda: store.read_visible(A, sid, fence=adm.fence))
    expect_fence_error("missing", lambda: store.read_visible_delta(A, sid, fence=adm.fence))
    cursor = CursorState(A, sid, 0, -1, -1, adm.fence.incarnation).encode()
    expect_fence_error("missing", lambda: store.read_visible_delta(A, sid, cursor, fence=adm.fence))
    assert isinstance(store.read_visible_delta(A, sid), DeltaMissing)
    # Another scope's fence is still "scope", whether or not the session exists.
    expect_fence_error("scope", lambda: store.read_visible_delta(B, sid, fence=adm.fence))


def test_a_fenced_assembly_of_a_deleted_session_raises_not_an_empty_context(store: TranscriptStore, sid: str) -> None:
    """The legacy engine read a fenced DeltaMissing as "rebuild from scratch" and assembled the turn from no
    messages at all; the README's example engine read again for ever."""
    engine = LegacyEngine(EngineContext(store=store))
    before, adm = turn(store, sid)
    assert len(engine.assemble(scope=A, session_id=sid, fence=adm.fence, token_budget=10_000).messages) == len(before)
    store.delete_session(A, sid)
    for _ in range(2):  # the projection it holds, and after it was dropped
        expect_fence_error(
            "missing", lambda: engine.assemble(scope=A, session_id=sid, fence=adm.fence, token_budget=10_000)
        )


def test_moved_when_the_anchor_disagrees_with_the_entry(store: TranscriptStore, sid: str) -> None:
    before, adm = turn(store, sid)
    for field, wrong in (("seq", adm.fence.seq + 1), ("parent_id", before[0].entry_id), ("position", 0)):
        expect_fence_error("moved", *fenced_reads(store, A, sid, adm.fence.model_copy(update={field: wrong})))


def test_not_user_when_the_fence_is_not_a_user_message(store: TranscriptStore, sid: str) -> None:
    before, _ = turn(store, sid)
    reply = before[1]
    assert reply.role == "assistant"
    event = store.list_entries(A, sid)[1]
    assert event.kind == "custom"
    for entry in (reply, event):
        fence = store.anchor(A, sid, entry.entry_id)
        expect_fence_error("not_user", *fenced_reads(store, A, sid, fence))


def test_scope_when_the_fence_belongs_elsewhere(store: TranscriptStore, sid: str) -> None:
    _, adm = turn(store, sid)
    store.create_session(A, session_id="s2")
    store.create_session(B, session_id=sid, session_key="k")
    store.append(B, sid, user("b's own"))
    expect_fence_error("scope", *fenced_reads(store, A, "s2", adm.fence))
    expect_fence_error("scope", *fenced_reads(store, B, sid, adm.fence))
    # Same for a session that does not exist at all: nothing about it leaks either way.
    expect_fence_error("scope", lambda: store.read_visible(A, "nope", fence=adm.fence))
    expect_fence_error("scope", lambda: store.read_visible_delta(A, "nope", fence=adm.fence))


def contents(entries: list[Entry]) -> list[Any]:
    return [e.message["content"] if e.message is not None else None for e in entries]


def reimported(store: TranscriptStore, sid: str) -> Admission:
    """The reviewer's scenario: a turn admitted, the session exported, deleted and imported again under
    the same id from the export with its system message edited. Returns the old admission."""
    store.append(A, sid, {"role": "system", "content": "ORIGINAL system prompt"})
    store.append(A, sid, user("earlier"))
    adm = store.admit(A, sid, user("question"), turn_id="t1")
    assert contents(store.read_visible(A, sid, fence=adm.fence)) == ["ORIGINAL system prompt", "earlier"]
    header, records = store.export_session(A, sid)
    store.delete_session(A, sid)
    records[0]["message"]["content"] = "RESTORED, different system prompt"
    del records[0]["size_bytes"]  # edited by hand: its size is computed on import
    store.import_session(A, header, records)
    return adm


def test_scope_when_the_fence_is_of_an_earlier_incarnation_of_the_session(store: TranscriptStore, sid: str) -> None:
    """A fence taken before the session was deleted and imported again is another session's: the new
    session's entry matches it field for field (ids, seqs, positions, generation) but its prefix differs."""
    adm = reimported(store, sid)
    now = store.anchor(A, sid, adm.fence.entry_id)
    assert now.incarnation == store.get_session(A, sid).incarnation != adm.fence.incarnation
    assert now.model_copy(update={"incarnation": adm.fence.incarnation}) == adm.fence
    expect_fence_error("scope", *fenced_reads(store, A, sid, adm.fence))
    # The new session's own anchor of the same entry reads the new prefix.
    new = ["RESTORED, different system prompt", "earlier"]
    assert contents(store.read_visible(A, sid, fence=now)) == new
    assert contents(page_of(store.read_visible_delta(A, sid, fence=now)).entries) == new


def test_anchors_carry_the_sessions_incarnation(store: TranscriptStore, sid: str) -> None:
    _, adm = turn(store, sid)
    incarnation = store.get_session(A, sid).incarnation
    assert adm.fence.incarnation == incarnation and incarnation > 0
    assert store.anchor(A, sid, adm.fence.entry_id).incarnation == incarnation
    assert store.admit(A, sid, user("the question"), turn_id="turn-1").fence.incarnation == incarnation


def test_a_fence_without_an_incarnation_is_still_honoured(store: TranscriptStore, sid: str) -> None:
    """Anchors made before they carried an incarnation (an outbox row written before the upgrade) are
    honoured by a session that existed then: read as JSON without the field, or with it set to None,
    they fence as before. A session created since can never have made one: there it is refused."""
    before, adm = turn(store, sid)
    ids = [e.entry_id for e in before]
    old = adm.fence.model_copy(update={"incarnation": None})
    expect_fence_error("scope", *fenced_reads(store, A, sid, old))
    make_legacy(store, A, sid)
    dumped = json.loads(adm.fence.model_dump_json())
    del dumped["incarnation"]
    assert Anchor.model_validate_json(json.dumps(dumped)) == old
    admission = json.loads(adm.model_dump_json())
    del admission["anchor"]["incarnation"]
    assert Admission.model_validate_json(json.dumps(admission)).fence == old
    assert Anchor.model_validate_json(adm.fence.model_dump_json()) == adm.fence  # and with it
    for fence in (old, Anchor.model_validate_json(json.dumps(dumped))):
        assert [e.entry_id for e in store.read_visible(A, sid, fence=fence)] == ids
        assert [e.entry_id for e in page_of(store.read_visible_delta(A, sid, fence=fence)).entries] == ids
    # Every other check still applies to it.
    store.rewrite_entries(A, sid, [{"entry_id": before[1].entry_id, "message": assistant("edit")}])
    expect_fence_error("rewritten", *fenced_reads(store, A, sid, old))


def test_a_fences_incarnation_is_none_or_a_non_negative_integer(store: TranscriptStore, sid: str) -> None:
    _, adm = turn(store, sid)
    for bad in (-1, 2**63, True, "1", 1.5):
        fence = adm.fence.model_copy(update={"incarnation": bad})
        with pytest.raises(InvalidInput):
            store.read_visible(A, sid, fence=fence)
        with pytest.raises(InvalidInput):
            store.read_visible_delta(A, sid, fence=fence)
    # Well-formed but another incarnation's (0 is no session's): another session's fence.
    for other in (0, 2**63 - 1):
        expect_fence_error("scope", *fenced_reads(store, A, sid, adm.fence.model_copy(update={"incarnation": other})))


def test_a_fence_must_be_an_anchor(store: TranscriptStore, sid: str) -> None:
    _, adm = turn(store, sid)
    for bad in (adm.fence.model_dump(), adm.fence.entry_id):
        with pytest.raises(InvalidInput):
            store.read_visible(A, sid, fence=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            store.read_visible_delta(A, sid, fence=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("forged", ["session_key", "incarnation"])
def test_a_fence_read_in_its_own_admission_is_refused_as_it_is_anywhere_else(
    store: TranscriptStore, forged: str
) -> None:
    """A fenced read inside the admission that appended the fence's entry skips the fence's check
    (``Core.appended_here``). It compared the entry's place and incarnation, not the fence's session key,
    and took a fence without an incarnation for this one's: a fence naming the just-appended entry under
    another session key (or without the incarnation of a session made since anchors carried one) was
    honoured there, though every other read refuses it (``rewritten``, ``scope``)."""
    from transcript_store import reads
    from transcript_store.turns import Turns

    sid = f"own-{forged}"
    store.create_session("scope-a", session_id=sid, session_key=f"agent:{sid}")
    store.append("scope-a", sid, {"role": "user", "content": "before"})
    change = {"session_key": "agent:another"} if forged == "session_key" else {"incarnation": None}
    reason = "rewritten" if forged == "session_key" else "scope"
    seen: list[str] = []

    def within(c: Any, admission: Any) -> None:
        fence = admission.anchor.model_copy(update=change)
        with pytest.raises(ReadFenceError) as refused:
            reads.read_visible_delta(c, "scope-a", sid, None, 100, 1 << 20, fence)
        seen.append(refused.value.reason)
        # The very fence the admission made is still trusted without a check of its own.
        assert c.appended_here(admission.anchor) and not c.appended_here(fence)
        page = reads.read_visible_delta(c, "scope-a", sid, None, 100, 1 << 20, admission.anchor)
        assert [e.message["content"] for e in page.entries] == ["before"]  # type: ignore[union-attr]

    admitted = Turns(store).admit_if_clear(
        "scope-a", sid, {"role": "user", "content": "q"}, turn_id="t1", engine_id="e", within=within
    )
    assert admitted is not None and seen == [reason]
    fence = admitted[0].anchor.model_copy(update=change)
    with pytest.raises(ReadFenceError) as outside:
        store.read_visible_delta("scope-a", sid, None, fence=fence)
    assert outside.value.reason == reason
