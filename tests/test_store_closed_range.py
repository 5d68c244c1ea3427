"""Closed-range reads of finished turns: admission through terminal inclusive, or a typed failure."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from conftest import make_legacy
from sqlalchemy import update

import transcript_store.core as core
import transcript_store.fences as fences
from transcript_store import (
    Admission,
    Anchor,
    ClosedRange,
    ClosedRangeFailure,
    Entry,
    InvalidInput,
    TranscriptStore,
)
from transcript_store.ledger import prepare_turn
from transcript_store.models import canonical_json
from transcript_store.schema import entries

A, B = "scope-a", "scope-b"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(A, session_id="s1", session_key="k").session_id


def finished_turn(store: TranscriptStore, sid: str, turn_id: str = "t1") -> tuple[Admission, list[Entry], Anchor]:
    """An admitted turn with tool use, an event and a final answer; returns its messages too."""
    adm = store.admit(A, sid, user(f"question {turn_id}"), turn_id=turn_id)
    call = store.append(A, sid, {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    })
    store.append(A, sid, kind="custom", payload={"progress": 1})
    tool = store.append(A, sid, {"role": "tool", "tool_call_id": "c1", "content": "result"})
    store.append(A, sid, kind="metadata", payload={"usage": 10})
    final = store.append(A, sid, assistant(f"answer {turn_id}"))
    admitted = store.get_entries(A, sid, [adm.anchor.entry_id])[0]
    return adm, [admitted, call, tool, final], store.anchor(A, sid, final.entry_id)


def ok(result: Any) -> ClosedRange:
    assert isinstance(result, ClosedRange), result
    return result


def failed(result: Any, reason: str) -> ClosedRangeFailure:
    assert isinstance(result, ClosedRangeFailure), result
    assert result.reason == reason, result
    return result


def test_a_closed_range_is_the_turns_messages_inclusive(store: TranscriptStore, sid: str) -> None:
    store.append(A, sid, user("history"))
    store.append(A, sid, assistant("more history"))
    adm, messages, terminal = finished_turn(store, sid)
    result = ok(store.read_closed_range(adm, terminal))
    assert result.status == "ok"
    assert [e.entry_id for e in result.entries] == [e.entry_id for e in messages]
    assert result.messages == [e.message for e in messages]
    assert all(e.kind == "message" and e.active for e in result.entries)
    assert len(result.entries) == terminal.position - adm.anchor.position + 1  # type: ignore[operator]
    assert result.serialized_bytes == sum(e.size_bytes for e in messages)
    # The admission's anchor works as well as the admission itself.
    assert ok(store.read_closed_range(adm.anchor, terminal)) == result
    # Later turns do not change a finished turn's range.
    store.append(A, sid, user("later"))
    assert ok(store.read_closed_range(adm, terminal)) == result


def test_a_one_message_range_and_a_later_turn(store: TranscriptStore, sid: str) -> None:
    adm = store.admit(A, sid, user("only"), turn_id="t")
    result = ok(store.read_closed_range(adm, adm.anchor))
    assert result.messages == [user("only")]
    # A later turn reads only its own range.
    adm2, messages2, terminal2 = finished_turn(store, sid, "t2")
    assert [e.entry_id for e in ok(store.read_closed_range(adm2, terminal2)).entries] == [
        e.entry_id for e in messages2
    ]


# ---------------------------------------------------------------------------------------------- stale


def test_stale_after_a_rewrite(store: TranscriptStore, sid: str) -> None:
    first = store.append(A, sid, user("history"))
    adm, _, terminal = finished_turn(store, sid)
    store.rewrite_entries(A, sid, [{"entry_id": first.entry_id, "message": user("edited history")}])
    failed(store.read_closed_range(adm, terminal), "stale")


def test_stale_when_the_turn_left_the_active_branch(store: TranscriptStore, sid: str) -> None:
    base = store.append(A, sid, user("history"))
    adm, messages, terminal = finished_turn(store, sid)
    # Terminal branched away (a regenerate of the final answer): the range is gone.
    store.branch(A, sid, messages[2].entry_id)
    store.append(A, sid, assistant("regenerated answer"))
    failed(store.read_closed_range(adm, terminal), "stale")
    # The whole turn branched away.
    store.branch(A, sid, base.entry_id)
    failed(store.read_closed_range(adm, terminal), "stale")
    # Back on its branch, the range reads again.
    store.branch(A, sid, terminal.entry_id)
    ok(store.read_closed_range(adm, terminal))


ANCHOR_DAMAGE: list[tuple[str, str, Any]] = [
    ("admission", "seq", 99),
    ("admission", "parent_id", "someone-else"),
    ("admission", "position", 7),
    ("terminal", "seq", 0),
    ("terminal", "idempotency_key", "k"),
    ("terminal", "entry_id", "no-such-entry"),
    ("both", "generation", 3),
]


def test_stale_when_an_anchor_does_not_match_exactly(store: TranscriptStore, sid: str) -> None:
    adm, _, terminal = finished_turn(store, sid)
    for which, field, value in ANCHOR_DAMAGE:
        first, last = adm.anchor, terminal
        if which in ("admission", "both"):
            first = first.model_copy(update={field: value})
        if which in ("terminal", "both"):
            last = last.model_copy(update={field: value})
        failed(store.read_closed_range(first, last), "stale")


def test_anchors_of_an_unknown_session_or_another_scope_are_stale(store: TranscriptStore, sid: str) -> None:
    adm, _, terminal = finished_turn(store, sid)
    store.create_session(B, session_id=sid, session_key="k")
    for scope, session_id in ((B, sid), (A, "nope")):
        update_ = {"scope": scope, "session_id": session_id}
        result = store.read_closed_range(adm.anchor.model_copy(update=update_), terminal.model_copy(update=update_))
        failed(result, "stale")
    store.delete_session(A, sid)
    failed(store.read_closed_range(adm, terminal), "stale")


# ---------------------------------------------------------------------------------------------- non_descendant


def test_non_descendant_when_the_terminal_precedes_the_admission(store: TranscriptStore, sid: str) -> None:
    earlier = store.append(A, sid, assistant("before the turn"))
    adm, _, _ = finished_turn(store, sid)
    failed(store.read_closed_range(adm, store.anchor(A, sid, earlier.entry_id)), "non_descendant")


def test_non_descendant_when_the_terminal_is_on_another_branch(store: TranscriptStore, sid: str) -> None:
    base = [store.append(A, sid, user("h0")), store.append(A, sid, assistant("h1"))]
    # A turn on one branch, answered with a long reply chain (higher positions than the admission) ...
    store.admit(A, sid, user("first try"), turn_id="t1")
    tail = [store.append(A, sid, assistant(f"a{i}")) for i in range(3)]
    terminal = store.anchor(A, sid, tail[-1].entry_id)
    # ... then an edit of the question on a sibling branch, admitted as another turn.
    store.branch(A, sid, base[-1].entry_id)
    adm2 = store.admit(A, sid, user("second try"), turn_id="t2")
    assert terminal.position > adm2.anchor.position  # type: ignore[operator]
    # Position order never proves descent: the terminal is not reached from the admission.
    failed(store.read_closed_range(adm2, terminal), "non_descendant")


def _corrupt(store: TranscriptStore, sid: str, entry_id: str, **values: Any) -> None:
    with store.db.engine.begin() as conn:
        conn.execute(
            update(entries)
            .where(entries.c.scope == A, entries.c.session_id == sid, entries.c.entry_id == entry_id)
            .values(**values)
        )


def test_damaged_parent_links_terminate_as_non_descendant(store: TranscriptStore) -> None:
    for damage in ("self-parent", "cycle", "broken-chain"):
        for on_branch in (True, False):
            sid = store.create_session(A, session_id=f"{damage}-{on_branch}").session_id
            root = store.append(A, sid, user("history"))
            adm = store.admit(A, sid, user("q"), turn_id="t")
            m1 = store.append(A, sid, assistant("a1"))
            m2 = store.append(A, sid, assistant("a2"))
            terminal = store.anchor(A, sid, store.append(A, sid, assistant("a3")).entry_id)
            if damage == "self-parent":
                _corrupt(store, sid, m2.entry_id, parent_id=m2.entry_id)
            elif damage == "cycle":
                _corrupt(store, sid, m1.entry_id, parent_id=m2.entry_id)
            else:
                _corrupt(store, sid, m2.entry_id, parent_id="ghost")
            if not on_branch:
                store.branch(A, sid, root.entry_id)  # the walk then runs over stored parent links
            failed(store.read_closed_range(adm, terminal), "non_descendant")


def test_a_projection_that_disagrees_with_the_positions_fails(store: TranscriptStore, sid: str) -> None:
    adm = store.admit(A, sid, user("q"), turn_id="t")
    middle = store.append(A, sid, assistant("a1"))
    terminal = store.anchor(A, sid, store.append(A, sid, assistant("a2")).entry_id)
    _corrupt(store, sid, middle.entry_id, kind="custom")
    result = store.read_closed_range(adm, terminal)
    assert isinstance(result, ClosedRangeFailure) and result.reason in ("stale", "projection_unavailable")


# ---------------------------------------------------------------------------------------------- session_rebound


def test_session_rebound_when_the_anchors_disagree_on_the_session(store: TranscriptStore, sid: str) -> None:
    adm, _, terminal = finished_turn(store, sid)
    store.create_session(A, session_id="s2", session_key="k2")
    other = store.admit(A, "s2", user("q"), turn_id="t1")
    failed(store.read_closed_range(adm, other.anchor), "session_rebound")
    failed(store.read_closed_range(other.anchor, terminal), "session_rebound")
    for field, value in (("scope", B), ("session_key", "other-key")):
        failed(store.read_closed_range(adm, terminal.model_copy(update={field: value})), "session_rebound")


def test_stale_across_a_rewrite(store: TranscriptStore, sid: str) -> None:
    """A turn whose transcript was rewritten while it ran (its anchors of two generations of one
    session) is stale, not another session's: the gateway reports it so for a degraded turn."""
    adm, messages, _ = finished_turn(store, sid)
    store.rewrite_entries(A, sid, [{"entry_id": messages[-1].entry_id, "message": assistant("edited")}])
    new_terminal = store.anchor(A, sid, store.get_session(A, sid).head_entry_id or "")
    assert new_terminal.generation == 1 != adm.anchor.generation
    failed(store.read_closed_range(adm, new_terminal), "stale")
    failed(store.read_closed_range(adm, new_terminal.model_copy(update={"generation": 0})), "stale")


def test_stale_when_the_session_was_imported_again(store: TranscriptStore, sid: str) -> None:
    """A turn's anchors taken before the session was exported, deleted and imported again under the same
    id (with an edit) match the new session's entries field for field; they are another session's:
    stale, as anchors of a deleted session or another scope's are. Mixed with the new session's anchors
    they disagree on the session: session_rebound."""
    store.append(A, sid, {"role": "system", "content": "ORIGINAL system prompt"})
    adm, messages, terminal = finished_turn(store, sid)
    assert ok(store.read_closed_range(adm, terminal)).messages[-1] == assistant("answer t1")
    header, records = store.export_session(A, sid)
    store.delete_session(A, sid)
    records[0]["message"]["content"] = "RESTORED, different system prompt"
    del records[0]["size_bytes"]  # edited by hand: its size is computed on import
    final = next(r for r in records if r["entry_id"] == messages[-1].entry_id)
    final["message"]["content"] = "another answer"
    del final["size_bytes"]
    store.import_session(A, header, records)
    new_adm, new_terminal = (store.anchor(A, sid, a.entry_id) for a in (adm.anchor, terminal))
    assert new_terminal.incarnation == store.get_session(A, sid).incarnation != terminal.incarnation
    assert new_adm.model_copy(update={"incarnation": adm.anchor.incarnation}) == adm.anchor
    assert new_terminal.model_copy(update={"incarnation": terminal.incarnation}) == terminal
    failed(store.read_closed_range(adm, terminal), "stale")
    failed(store.read_closed_range(adm.anchor, new_terminal), "session_rebound")
    failed(store.read_closed_range(new_adm, terminal), "session_rebound")
    assert ok(store.read_closed_range(new_adm, new_terminal)).messages[-1] == assistant("another answer")


def test_session_rebound_when_the_anchors_disagree_on_the_incarnation(store: TranscriptStore, sid: str) -> None:
    adm, _, terminal = finished_turn(store, sid)
    assert terminal.incarnation is not None and terminal.incarnation == adm.anchor.incarnation
    other = terminal.model_copy(update={"incarnation": terminal.incarnation + 1})
    failed(store.read_closed_range(adm, other), "session_rebound")
    failed(store.read_closed_range(adm.anchor.model_copy(update={"incarnation": 0}), terminal), "session_rebound")
    # Agreeing with each other but not with the session: stale. The fast completion's range does not
    # vouch for them either: the read reports it.
    both = [a.model_copy(update={"incarnation": 1}) for a in (adm.anchor, terminal)]
    failed(store.read_closed_range(*both), "stale")
    adm = store.admit(A, sid, user("q2"), turn_id="t2")
    elsewhere = Admission(anchor=adm.anchor.model_copy(update={"incarnation": 1}), turn_id="t2")
    fast, read = _append_and_both(store, sid, elsewhere, [{"message": assistant("a2")}])
    assert fast is None
    failed(read, "session_rebound")  # the terminal the append takes is of the session's incarnation


def test_anchors_without_an_incarnation_still_read_their_range(store: TranscriptStore, sid: str) -> None:
    """Anchors made before they carried an incarnation (an outbox row written before the upgrade) are
    honoured by a session that existed then; a session created since never made one: stale there."""
    adm, messages, terminal = finished_turn(store, sid)
    result = ok(store.read_closed_range(adm, terminal))
    bare = [a.model_copy(update={"incarnation": None}) for a in (adm.anchor, terminal)]
    failed(store.read_closed_range(bare[0], bare[1]), "stale")
    make_legacy(store, A, sid)
    adm = adm.model_copy(update={"anchor": store.anchor(A, sid, adm.anchor.entry_id)})
    terminal = store.anchor(A, sid, terminal.entry_id)
    for first, last in ((bare[0], bare[1]), (bare[0], terminal), (adm.anchor, bare[1])):
        assert ok(store.read_closed_range(first, last)) == result
    # Stored as JSON before the field existed: read back without it.
    texts = [a.model_dump_json(exclude={"incarnation"}) for a in (adm.anchor, terminal)]
    assert "incarnation" not in texts[0]
    first, last = (Anchor.model_validate_json(t) for t in texts)
    assert (first, last) == (bare[0], bare[1])
    assert ok(store.read_closed_range(first, last)) == result
    admission = Admission.model_validate_json(adm.model_dump_json(exclude={"anchor": {"incarnation"}}))
    assert admission.anchor == bare[0] and ok(store.read_closed_range(admission, last)) == result
    assert [e.entry_id for e in result.entries] == [e.entry_id for e in messages]


def test_the_turn_hash_does_not_cover_the_incarnation(store: TranscriptStore, sid: str) -> None:
    """A turn's canonical hash is what it was before anchors carried an incarnation: the same for an
    anchor with one, without one, or with another."""
    adm, messages, terminal = finished_turn(store, sid)
    texts = [m.message for m in messages]

    def digest(admission: Anchor, last: Anchor) -> str:
        return prepare_turn("engine", "t1", admission, last, texts).payload_hash

    expected = digest(adm.anchor, terminal)
    for incarnation in (None, 0, 12345):
        change = {"incarnation": incarnation}
        assert digest(adm.anchor.model_copy(update=change), terminal.model_copy(update=change)) == expected
    # The hash of the named fields, as ledger.prepare_turn has always computed it.
    hashed = {
        "scope": A, "session_id": sid, "session_key": "k",
        "admission": [adm.anchor.entry_id, adm.anchor.seq, adm.anchor.position],
        "terminal": [terminal.entry_id, terminal.seq, terminal.position],
        "messages": texts, "is_heartbeat": False,
    }
    assert expected == hashlib.sha256(canonical_json(hashed).encode("utf-8")).hexdigest()


def test_an_anchors_incarnation_is_none_or_a_non_negative_integer(store: TranscriptStore, sid: str) -> None:
    adm, messages, terminal = finished_turn(store, sid)
    texts = [m.message for m in messages]
    for bad in (-1, 2**63, True, "1", 1.5):
        wrong = terminal.model_copy(update={"incarnation": bad})
        with pytest.raises(InvalidInput):
            store.read_closed_range(adm, wrong)
        with pytest.raises(InvalidInput):
            prepare_turn("engine", "t1", adm, wrong, texts)
    assert prepare_turn("engine", "t1", adm, terminal.model_copy(update={"incarnation": 2**63 - 1}), texts)


# ---------------------------------------------------------------------------------------------- too_large


def test_too_large_over_the_event_or_byte_cap(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    adm, _, terminal = finished_turn(store, sid)  # 6 events: 4 messages, 2 non-message events
    monkeypatch.setattr(fences, "MAX_TURN_EVENTS", 6)
    ok(store.read_closed_range(adm, terminal))
    monkeypatch.setattr(fences, "MAX_TURN_EVENTS", 5)
    failed(store.read_closed_range(adm, terminal), "too_large")
    monkeypatch.setattr(fences, "MAX_TURN_EVENTS", 6)
    own = sum(e.size_bytes for e in store.list_entries(A, sid))  # every event of the turn counts
    monkeypatch.setattr(fences, "MAX_TURN_BYTES", own)
    ok(store.read_closed_range(adm, terminal))
    monkeypatch.setattr(fences, "MAX_TURN_BYTES", own - 1)
    failed(store.read_closed_range(adm, terminal), "too_large")


def test_a_huge_history_before_the_turn_does_not_count(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.append_many(A, sid, [{"message": user("H" * 2000)} for _ in range(30)])
    store.append_many(A, sid, [{"kind": "custom", "payload": {"i": i}} for i in range(30)])
    history_bytes = store.session_bytes(A, sid)
    adm, _, terminal = finished_turn(store, sid)
    own = store.session_bytes(A, sid) - history_bytes
    monkeypatch.setattr(fences, "MAX_TURN_BYTES", own)
    monkeypatch.setattr(fences, "MAX_TURN_EVENTS", 6)
    assert len(ok(store.read_closed_range(adm, terminal)).entries) == 4


def test_closed_ranges_take_message_anchors(store: TranscriptStore, sid: str) -> None:
    adm = store.admit(A, sid, user("q"), turn_id="t")
    event = store.append(A, sid, kind="custom", payload={})
    with pytest.raises(InvalidInput):
        store.read_closed_range(adm, store.anchor(A, sid, event.entry_id))
    with pytest.raises(InvalidInput):
        store.read_closed_range(adm, adm.anchor.model_dump())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the fast completion's range


def _append_and_both(
    store: TranscriptStore, sid: str, adm: Admission, items: list[dict[str, Any]]
) -> tuple[ClosedRange | None, Any]:
    """Append ``items`` in one transaction, then the range two ways: from the append, and read back."""
    prepared = store.prepare(items)

    def both(c: Any) -> tuple[ClosedRange | None, Any]:
        sess, appended = c.append_to_session(A, sid, prepared, with_head=True)
        terminal = c.anchor_for(sess, appended[-1])
        return fences.closed_range_of_append(adm.anchor, terminal, sess, appended), fences.read_closed_range(
            c, adm.anchor, terminal, sess
        )

    return store.write(both)


def test_the_range_of_an_append_after_its_admission_is_the_one_read_back(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast completion takes a turn's closed range from what it appended (no read): entry for entry
    what ``read_closed_range`` reads, events skipped, the admission first, the caps as they apply."""
    finished_turn(store, sid, "t0")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    replies: list[dict[str, Any]] = [
        {"message": {"role": "assistant", "content": None, "tool_calls": [call]}},
        {"kind": "custom", "payload": {"progress": 1}},
        {"message": {"role": "tool", "tool_call_id": "c1", "content": "résultat \u2603"}},
        {"message": assistant("answer")},
    ]
    adm = store.admit(A, sid, user("question"), turn_id="t1")
    fast, read = _append_and_both(store, sid, adm, replies)
    assert fast is not None and fast == ok(read)
    assert fast.entries[0].entry_id == adm.anchor.entry_id and len(fast.entries) == 4
    # Over a cap, the append's range gives way to the read, which reports it.
    adm = store.admit(A, sid, user("again"), turn_id="t2")
    monkeypatch.setattr(fences, "MAX_TURN_EVENTS", 4)
    fast, read = _append_and_both(store, sid, adm, replies)
    assert fast is None
    failed(read, "too_large")


def test_the_range_of_an_append_not_right_after_its_admission_is_read(store: TranscriptStore, sid: str) -> None:
    """Whatever the append alone cannot vouch for is read: an entry between the admission and the
    replies, replies that were already stored (a retry), a session rewritten since the admission."""
    adm = store.admit(A, sid, user("q1"), turn_id="t1")
    store.append(A, sid, kind="metadata", payload={"between": True})
    fast, read = _append_and_both(store, sid, adm, [{"message": assistant("a1")}])
    assert fast is None and len(ok(read).entries) == 2

    adm = store.admit(A, sid, user("q2"), turn_id="t2")
    items = [{"message": assistant("a2"), "entry_id": "reply-2"}]
    store.append_many(A, sid, items)
    fast, read = _append_and_both(store, sid, adm, items)  # the stored reply comes back, not appended
    assert fast is None and [e.entry_id for e in ok(read).entries] == [adm.anchor.entry_id, "reply-2"]

    adm = store.admit(A, sid, user("q3"), turn_id="t3")
    store.rewrite_entries(A, sid, [{"entry_id": "reply-2", "message": assistant("edited")}])
    fast, read = _append_and_both(store, sid, adm, [{"message": assistant("a3")}])
    assert fast is None
    failed(read, "stale")


def test_head_columns_that_are_not_the_rows_head_are_not_trusted(store: TranscriptStore, sid: str) -> None:
    """After a lock wait on PostgreSQL the session row is the newest version while its head columns
    come from the statement's earlier snapshot: ``head_view`` returns the head only when its seq and
    entry id are the row's own (a reviewer reproduced the stale pair; the fast range then reads)."""
    adm = store.admit(A, sid, user("q"), turn_id="t1")
    sess = store.write(lambda c: c.session_row(A, sid, lock=True, with_head=True))
    head = core.head_view(sess)
    assert head is not None and head.entry_id == adm.anchor.entry_id
    assert core.head_view(sess._replace(head_entry_id="moved-on", head_seq=sess.head_seq + 1)) is None
    assert core.head_view(sess._replace(head_seq=sess.head_seq + 1)) is None
