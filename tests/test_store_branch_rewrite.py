"""Moving the active branch: branch to another entry, and branch-and-reappend rewrites."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from transcript_store import (
    DeltaPage,
    DeltaReset,
    Entry,
    InvalidInput,
    InvalidMessage,
    Replacement,
    TranscriptStore,
    UnknownEntry,
)
from transcript_store.cursors import start_cursor
from transcript_store.schema import active_path, entries, sessions

A = "scope-a"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(A, session_id="s1").session_id


def snapshot(store: TranscriptStore) -> list[list[tuple[Any, ...]]]:
    """Every stored row of the store's tables, in key order."""
    with store.db.engine.connect() as conn:
        return [
            [tuple(r) for r in conn.execute(select(t).order_by(*t.primary_key.columns))]
            for t in (sessions, entries, active_path)
        ]


def visible(store: TranscriptStore, sid: str) -> list[str]:
    return [e.entry_id for e in store.read_visible(A, sid)]


def chat(store: TranscriptStore, sid: str, n: int) -> list[Entry]:
    return [store.append(A, sid, (user if i % 2 == 0 else assistant)(f"m{i}")) for i in range(n)]


# ---------------------------------------------------------------------------------------------- branch


def test_branch_moves_the_head_and_later_appends_follow_it(store: TranscriptStore, sid: str) -> None:
    made = chat(store, sid, 5)
    info = store.branch(A, sid, made[2].entry_id)
    assert (info.head_entry_id, info.visible_count, info.generation, info.entry_count) == (
        made[2].entry_id, 3, 0, 5,
    )
    assert visible(store, sid) == [e.entry_id for e in made[:3]]
    regen = store.append(A, sid, assistant("regenerated"))
    assert (regen.parent_id, regen.seq, regen.position) == (made[2].entry_id, 5, 3)
    assert visible(store, sid) == [e.entry_id for e in made[:3]] + [regen.entry_id]
    # The old branch stays stored, off the active path.
    listed = {e.entry_id: e.active for e in store.list_entries(A, sid)}
    assert [listed[e.entry_id] for e in made] == [True, True, True, False, False]
    assert listed[regen.entry_id] is True
    old = store.get_entries(A, sid, [made[4].entry_id])[0]
    assert old.active is False and old.message == made[4].message


def test_branch_back_restores_the_old_branch(store: TranscriptStore, sid: str) -> None:
    made = chat(store, sid, 4)
    store.branch(A, sid, made[1].entry_id)
    alt = chat(store, sid, 3)
    store.branch(A, sid, made[3].entry_id)
    assert visible(store, sid) == [e.entry_id for e in made]
    assert store.get_session(A, sid).visible_count == 4
    assert [e.active for e in store.get_entries(A, sid, [a.entry_id for a in alt])] == [False] * 3
    # And to the middle of the other branch.
    store.branch(A, sid, alt[1].entry_id)
    assert visible(store, sid) == [made[0].entry_id, made[1].entry_id, alt[0].entry_id, alt[1].entry_id]
    nxt = store.append(A, sid, user("on alt"))
    assert (nxt.parent_id, nxt.position) == (alt[1].entry_id, 4)


def test_branch_to_none_empties_the_path(store: TranscriptStore, sid: str) -> None:
    made = chat(store, sid, 3)
    info = store.branch(A, sid, None)
    assert (info.head_entry_id, info.visible_count) == (None, 0)
    assert store.read_visible(A, sid) == []
    fresh = store.append(A, sid, user("new root"))
    assert (fresh.parent_id, fresh.position, fresh.seq) == (None, 0, 3)
    assert visible(store, sid) == [fresh.entry_id]
    assert len(store.list_entries(A, sid)) == 4
    store.branch(A, sid, made[2].entry_id)
    assert visible(store, sid) == [e.entry_id for e in made]


def test_branch_to_an_event_or_to_the_head(store: TranscriptStore, sid: str) -> None:
    m0 = store.append(A, sid, user("q"))
    ev = store.append(A, sid, kind="compaction", payload={"summary": "s"})
    m1 = store.append(A, sid, assistant("a"))
    assert store.branch(A, sid, m1.entry_id).head_entry_id == m1.entry_id
    assert visible(store, sid) == [m0.entry_id, m1.entry_id]
    info = store.branch(A, sid, ev.entry_id)
    assert (info.head_entry_id, info.visible_count) == (ev.entry_id, 1)
    assert store.append(A, sid, assistant("b")).parent_id == ev.entry_id


def test_branch_to_an_unknown_entry_changes_nothing(store: TranscriptStore, sid: str) -> None:
    chat(store, sid, 3)
    store.create_session(A, session_id="s2")
    other = store.append(A, "s2", user("elsewhere"))
    before = snapshot(store)
    for target in ("nope", other.entry_id):
        with pytest.raises(UnknownEntry):
            store.branch(A, sid, target)
    assert snapshot(store) == before


def test_an_idempotent_retry_after_a_branch_returns_the_stored_entry(store: TranscriptStore, sid: str) -> None:
    made = chat(store, sid, 2)
    keyed = store.append(A, sid, assistant("once"), idempotency_key="k")
    store.branch(A, sid, made[1].entry_id)
    again = store.append(A, sid, assistant("once"), idempotency_key="k")
    assert again.entry_id == keyed.entry_id and again.active is False
    assert len(store.list_entries(A, sid)) == 3


def test_branch_keeps_cursors_whose_anchor_stays_and_resets_the_others(store: TranscriptStore, sid: str) -> None:
    made = chat(store, sid, 6)
    early = store.read_visible_delta(A, sid, max_messages=2)
    late = store.read_visible_delta(A, sid, max_messages=5)
    assert isinstance(early, DeltaPage) and isinstance(late, DeltaPage)
    store.branch(A, sid, made[2].entry_id)
    regen = store.append(A, sid, assistant("regen"))
    cont = store.read_visible_delta(A, sid, early.cursor)
    assert isinstance(cont, DeltaPage)
    assert [e.entry_id for e in cont.entries] == [made[2].entry_id, regen.entry_id]
    gone = store.read_visible_delta(A, sid, late.cursor)
    assert isinstance(gone, DeltaReset) and gone.reason == "anchor_missing"


# ---------------------------------------------------------------------------------------------- rewrite


def test_rewrite_branches_and_reappends_the_suffix(store: TranscriptStore, sid: str) -> None:
    m0 = store.append(A, sid, user("q"))
    big = store.append(A, sid, {"role": "tool", "tool_call_id": "c1", "content": "X" * 300})
    ev = store.append(A, sid, kind="custom", payload={"after": "tool"})
    m3 = store.append(A, sid, assistant("a"))
    stub = {"role": "tool", "tool_call_id": "c1", "content": "[elided]", "x_elided_bytes": 300}
    result = store.rewrite_entries(A, sid, [Replacement(entry_id=big.entry_id, message=stub)])
    assert result.changed and result.reason is None
    assert result.rewritten_entries == 3  # the replaced entry, the event, the message after it
    assert result.generation == 1 == store.get_session(A, sid).generation
    stub_bytes = len('{"role":"tool","tool_call_id":"c1","content":"[elided]","x_elided_bytes":300}')
    assert result.bytes_freed == big.size_bytes - stub_bytes
    now = store.read_visible(A, sid)
    assert [e.message for e in now] == [m0.message, stub, m3.message]
    assert now[0].entry_id == m0.entry_id
    assert {now[1].entry_id, now[2].entry_id}.isdisjoint({big.entry_id, m3.entry_id})
    assert [e.position for e in now] == [0, 1, 2]
    # The new chain: parent of the first re-appended entry is the replaced entry's parent.
    listed = store.list_entries(A, sid)
    assert [e.seq for e in listed] == list(range(7))
    new = listed[4:]
    assert new[0].parent_id == m0.entry_id
    assert [e.parent_id for e in new[1:]] == [new[0].entry_id, new[1].entry_id]
    assert new[1].kind == "custom" and new[1].payload == {"after": "tool"}
    assert all(e.generation == 1 and e.active for e in new)
    # The originals stay stored, off the active path.
    originals = store.get_entries(A, sid, [big.entry_id, ev.entry_id, m3.entry_id])
    assert [e.active for e in originals] == [False, False, False]
    assert originals[0].message == big.message
    assert store.get_session(A, sid).head_entry_id == new[-1].entry_id
    # Appends continue after the new head, without rotating the generation again.
    nxt = store.append(A, sid, user("next"))
    assert (nxt.parent_id, nxt.position, nxt.generation) == (new[-1].entry_id, 3, 1)


def test_rewrite_of_several_entries_branches_at_the_earliest(store: TranscriptStore, sid: str) -> None:
    made = chat(store, sid, 5)
    result = store.rewrite_entries(
        A, sid,
        [{"entry_id": made[3].entry_id, "message": assistant("three")},
         {"entry_id": made[1].entry_id, "message": assistant("one")}],
    )
    assert result.changed and result.rewritten_entries == 4
    contents = [(e.message or {}).get("content") for e in store.read_visible(A, sid)]
    assert contents == ["m0", "one", "m2", "three", "m4"]
    assert store.read_visible(A, sid)[0].entry_id == made[0].entry_id


def test_rewrite_rotates_the_generation_and_resets_cursors(store: TranscriptStore, sid: str) -> None:
    made = chat(store, sid, 3)
    page = store.read_visible_delta(A, sid)
    assert isinstance(page, DeltaPage)
    store.rewrite_entries(A, sid, [{"entry_id": made[0].entry_id, "message": user("edited")}])
    reset = store.read_visible_delta(A, sid, page.cursor)
    assert isinstance(reset, DeltaReset) and reset.reason == "generation_mismatch"
    assert reset.cursor == start_cursor(A, sid, 1, store.get_session(A, sid).incarnation)
    store.rewrite_entries(A, sid, [{"entry_id": store.read_visible(A, sid)[2].entry_id, "message": user("x")}])
    assert store.get_session(A, sid).generation == 2


def test_an_unchanged_rewrite_changes_nothing(store: TranscriptStore, sid: str) -> None:
    made = chat(store, sid, 3)
    before = snapshot(store)
    result = store.rewrite_entries(A, sid, [{"entry_id": made[1].entry_id, "message": made[1].message}])
    assert (result.changed, result.rewritten_entries, result.bytes_freed, result.generation) == (False, 0, 0, 0)
    assert result.reason == "unchanged"
    assert snapshot(store) == before
    # The same message with its keys in another order is the same message (as for an idempotency key).
    reordered = dict(reversed(list(made[1].message.items())))
    assert list(reordered) != list(made[1].message)
    result = store.rewrite_entries(A, sid, [{"entry_id": made[1].entry_id, "message": reordered}])
    assert (result.changed, result.reason, result.generation) == (False, "unchanged", 0)
    assert snapshot(store) == before


def test_the_allowed_suffix_must_cover_every_active_entry_from_the_first_replacement(
    store: TranscriptStore, sid: str
) -> None:
    m0, m1 = chat(store, sid, 2)
    ev = store.append(A, sid, kind="metadata", payload={})
    m3 = store.append(A, sid, assistant("tail"))
    rep = [{"entry_id": m1.entry_id, "message": assistant("new")}]
    before = snapshot(store)
    for allowed in (
        [],
        [m1.entry_id],
        [m1.entry_id, m3.entry_id],  # the event in between is an active entry too
        [m0.entry_id, ev.entry_id, m3.entry_id],
    ):
        result = store.rewrite_entries(A, sid, rep, allowed_rewrite_suffix_entry_ids=allowed)
        assert (result.changed, result.rewritten_entries, result.generation) == (False, 0, 0)
        assert result.reason and result.reason.startswith("suffix_not_allowed"), result.reason
        assert snapshot(store) == before
    # Covering the whole suffix (extra ids are fine) lets it through.
    ok = store.rewrite_entries(
        A, sid, rep, allowed_rewrite_suffix_entry_ids=[m1.entry_id, ev.entry_id, m3.entry_id, "unrelated"]
    )
    assert ok.changed and ok.rewritten_entries == 3


def test_rewrite_refuses_events_and_off_branch_entries(store: TranscriptStore, sid: str) -> None:
    made = chat(store, sid, 3)
    ev = store.append(A, sid, kind="custom", payload={})
    store.branch(A, sid, made[1].entry_id)
    before = snapshot(store)
    off = store.rewrite_entries(A, sid, [{"entry_id": made[2].entry_id, "message": user("x")}])
    assert (off.changed, off.reason) == (False, f"not_active: {made[2].entry_id}")
    assert snapshot(store) == before
    store.branch(A, sid, ev.entry_id)
    before = snapshot(store)
    event = store.rewrite_entries(A, sid, [{"entry_id": ev.entry_id, "message": user("x")}])
    assert (event.changed, event.reason) == (False, f"not_a_message: {ev.entry_id}")
    assert snapshot(store) == before


BAD_REWRITES: list[tuple[Any, type[Exception]]] = [
    ([], InvalidInput),
    ("abc", InvalidInput),
    ([{"entry_id": "E0"}], InvalidInput),
    ([{"entry_id": "E0", "message": user("x"), "extra": 1}], InvalidInput),
    ([{"entry_id": "E0", "message": user("x")}, {"entry_id": "E0", "message": user("y")}], InvalidInput),
    ([{"entry_id": "E0", "message": {"role": "user"}}], InvalidMessage),
    ([{"entry_id": "E0", "message": {"role": "tool", "content": "no id"}}], InvalidMessage),
    ([{"entry_id": "bad\x00id", "message": user("x")}], InvalidInput),
    ([{"entry_id": "missing", "message": user("x")}], UnknownEntry),
    (["not a dict"], InvalidInput),
]


def test_invalid_rewrites_are_refused_before_anything_is_written(store: TranscriptStore, sid: str) -> None:
    store.append(A, sid, user("zero"), entry_id="E0")
    store.append(A, sid, assistant("one"))
    before = snapshot(store)
    for replacements, error in BAD_REWRITES:
        with pytest.raises(error):
            store.rewrite_entries(A, sid, replacements)
        assert snapshot(store) == before, replacements
    with pytest.raises(InvalidInput):
        store.rewrite_entries(
            A, sid, [{"entry_id": "E0", "message": user("x")}], allowed_rewrite_suffix_entry_ids="E0"
        )
    assert snapshot(store) == before
