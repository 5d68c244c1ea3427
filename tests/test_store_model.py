"""Model-based test: random append/admit/branch/rewrite/read sequences against a tiny in-memory model.

The model is a tree of entries with a head and a generation; the visible transcript is the message
entries on the path root -> head. Every page, reset, fence error and closed range the store returns is
checked against what the model says it must be, and each reader following its cursor chain must see
every visible message exactly once between resets.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from transcript_store import (
    Admission,
    Anchor,
    ClosedRange,
    ClosedRangeFailure,
    DeltaPage,
    DeltaReset,
    IdempotencyConflict,
    ReadFenceError,
    TranscriptStore,
)

SCOPE = "model"
KEY_POOL = ["k1", "k2", "k3"]
TURN_POOL = ["t1", "t2", "t3", "t4"]
TEXTS = ["a", "b", "hello", "x" * 40]


def size_of(body: dict[str, Any]) -> int:
    return len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())


@dataclass
class Node:
    """One entry of the model tree."""

    entry_id: str
    parent_id: str | None
    seq: int
    kind: str
    body: dict[str, Any]
    idempotency_key: str | None = None
    turn_id: str | None = None


@dataclass
class Reader:
    """A consumer following its cursor chain."""

    cursor: str | None = None
    generation: int = 0
    last: str | None = None  # entry id of the last message read, None before the first
    seen: list[str] = field(default_factory=list)


class Model:
    """The semantics, in memory."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.by_seq: list[str] = []
        self.head: str | None = None
        self.generation = 0
        self.keys: dict[str, str] = {}
        self.turns: dict[str, str] = {}

    def path(self, head: str | None = None) -> list[str]:
        out = []
        current = self.head if head is None else head
        while current is not None:
            out.append(current)
            current = self.nodes[current].parent_id
        return out[::-1]

    def visible(self) -> list[str]:
        return [e for e in self.path() if self.nodes[e].kind == "message"]

    def position(self, entry_id: str) -> int | None:
        """Intrinsic: the number of messages before it on its own root path."""
        if self.nodes[entry_id].kind != "message":
            return None
        return sum(1 for e in self.path(entry_id) if self.nodes[e].kind == "message") - 1

    def on_path(self, entry_id: str) -> bool:
        return entry_id in set(self.path())

    def add(self, node: Node) -> None:
        assert node.seq == len(self.by_seq)
        self.nodes[node.entry_id] = node
        self.by_seq.append(node.entry_id)
        self.head = node.entry_id


def make_machine(store: TranscriptStore) -> type[RuleBasedStateMachine]:
    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.store = store
            self.sid = uuid.uuid4().hex
            self.model = Model()
            self.readers = [Reader(), Reader()]
            self.admissions: list[Admission] = []  # every admission the store returned, old ones too

        def pick_admission(self, index: int | None) -> Admission | None:
            if index is None or not self.admissions:
                return None
            return self.admissions[index % len(self.admissions)]

        @initialize()
        def create(self) -> None:
            info = self.store.create_session(SCOPE, session_id=self.sid, session_key=f"key-{self.sid}")
            assert info.generation == 0 and info.head_entry_id is None

        # ------------------------------------------------------------------------------ helpers

        def expect_anchor(self, entry_id: str) -> Anchor:
            node = self.model.nodes[entry_id]
            return Anchor(
                scope=SCOPE, session_id=self.sid, session_key=f"key-{self.sid}", generation=self.model.generation,
                entry_id=entry_id, seq=node.seq, parent_id=node.parent_id, position=self.model.position(entry_id),
                idempotency_key=node.idempotency_key,
                incarnation=self.store.get_session(SCOPE, self.sid).incarnation,
            )

        def check_new_entry(self, got: Any, kind: str, body: dict[str, Any], key: str | None, turn: str | None) -> None:
            seq = len(self.model.by_seq)
            assert (got.seq, got.parent_id, got.kind) == (seq, self.model.head, kind)
            assert got.generation == self.model.generation
            assert (got.message if kind == "message" else got.payload) == body
            node = Node(got.entry_id, self.model.head, seq, kind, body, key, turn)
            self.model.add(node)
            assert got.position == self.model.position(got.entry_id)

        # ------------------------------------------------------------------------------ writes

        @rule(role=st.sampled_from(["user", "assistant"]), text=st.sampled_from(TEXTS),
              key=st.none() | st.sampled_from(KEY_POOL))
        def append_message(self, role: str, text: str, key: str | None) -> None:
            body = {"role": role, "content": text}
            if key is not None and key in self.model.keys:
                existing = self.model.nodes[self.model.keys[key]]
                if existing.kind != "message" or existing.body != body:
                    with pytest.raises(IdempotencyConflict):
                        self.store.append(SCOPE, self.sid, body, idempotency_key=key)
                    return
                got = self.store.append(SCOPE, self.sid, body, idempotency_key=key)
                assert (got.entry_id, got.seq) == (existing.entry_id, existing.seq)
                assert got.active == self.model.on_path(existing.entry_id)
                return
            got = self.store.append(SCOPE, self.sid, body, idempotency_key=key)
            self.check_new_entry(got, "message", body, key, None)
            if key is not None:
                self.model.keys[key] = got.entry_id

        @rule(kind=st.sampled_from(["custom", "metadata", "compaction"]), n=st.integers(0, 3))
        def append_event(self, kind: str, n: int) -> None:
            body = {"n": n}
            got = self.store.append(SCOPE, self.sid, kind=kind, payload=body)  # type: ignore[arg-type]
            self.check_new_entry(got, kind, body, None, None)

        @rule(turn=st.sampled_from(TURN_POOL), text=st.sampled_from(TEXTS[:2]))
        def admit(self, turn: str, text: str) -> None:
            body = {"role": "user", "content": text}
            if turn in self.model.turns:
                existing = self.model.nodes[self.model.turns[turn]]
                if existing.body != body:
                    with pytest.raises(IdempotencyConflict):
                        self.store.admit(SCOPE, self.sid, body, turn_id=turn)
                    body = existing.body
                got = self.store.admit(SCOPE, self.sid, body, turn_id=turn)
                assert got == Admission(anchor=self.expect_anchor(existing.entry_id), turn_id=turn)
                self.admissions.append(got)
                return
            got = self.store.admit(SCOPE, self.sid, body, turn_id=turn)
            entry = self.store.get_entries(SCOPE, self.sid, [got.anchor.entry_id])[0]
            self.check_new_entry(entry, "message", body, None, turn)
            self.model.turns[turn] = entry.entry_id
            assert got == Admission(anchor=self.expect_anchor(entry.entry_id), turn_id=turn)
            self.admissions.append(got)

        @rule(data=st.data())
        def branch(self, data: st.DataObject) -> None:
            targets: list[str | None] = [None, *self.model.by_seq]
            target = data.draw(st.sampled_from(targets))
            info = self.store.branch(SCOPE, self.sid, target)
            self.model.head = target
            assert info.head_entry_id == target
            assert info.generation == self.model.generation

        @precondition(lambda self: bool(self.model.visible()))
        @rule(data=st.data(), text=st.sampled_from(TEXTS), allowed=st.sampled_from(["none", "all", "short"]))
        def rewrite(self, data: st.DataObject, text: str, allowed: str) -> None:
            visible = self.model.visible()
            target = data.draw(st.sampled_from(visible))
            old = self.model.nodes[target]
            body = {"role": old.body["role"], "content": text}
            path = self.model.path()
            suffix = path[path.index(target):]
            allow: list[str] | None = None
            if allowed == "all":
                allow = list(suffix)
            elif allowed == "short":
                allow = suffix[:-1]
            result = self.store.rewrite_entries(
                SCOPE, self.sid, [{"entry_id": target, "message": body}], allowed_rewrite_suffix_entry_ids=allow
            )
            if allowed == "short":
                assert not result.changed and (result.reason or "").startswith("suffix_not_allowed")
                assert result.generation == self.model.generation
                return
            if body == old.body:
                assert (result.changed, result.reason, result.generation) == (False, "unchanged", self.model.generation)
                return
            assert result.changed and result.reason is None
            assert result.rewritten_entries == len(suffix)
            assert result.bytes_freed == size_of(old.body) - size_of(body)
            self.model.generation += 1
            assert result.generation == self.model.generation
            new = self.store.list_entries(SCOPE, self.sid, after_seq=len(self.model.by_seq) - 1)
            assert len(new) == len(suffix)
            self.model.head = self.model.nodes[target].parent_id
            for original_id, got in zip(suffix, new, strict=True):
                original = self.model.nodes[original_id]
                want = body if original_id == target else original.body
                self.check_new_entry(got, original.kind, want, None, None)

        # ------------------------------------------------------------------------------ reads

        def expected_fence_error(self, fence: Anchor) -> str | None:
            if fence.generation != self.model.generation:
                return "rewritten"
            if not self.model.on_path(fence.entry_id):
                return "missing"
            return None

        @rule(reader=st.integers(0, 1), max_messages=st.integers(1, 4), tight=st.booleans(),
              fence_index=st.none() | st.integers(0, 15))
        def read(self, reader: int, max_messages: int, tight: bool, fence_index: int | None) -> None:
            fence = self.pick_admission(fence_index)
            r = self.readers[reader]
            m = self.model
            visible = m.visible()
            max_bytes = 1 if tight else 1_000_000

            def call() -> Any:
                return self.store.read_visible_delta(
                    SCOPE, self.sid, r.cursor, max_messages=max_messages, max_bytes=max_bytes,
                    fence=None if fence is None else fence.fence,
                )

            fence_error = None if fence is None else self.expected_fence_error(fence.fence)
            if fence_error is not None:
                with pytest.raises(ReadFenceError) as info:
                    call()
                assert info.value.reason == fence_error
                return
            reset = None
            if r.cursor is not None and r.generation != m.generation:
                reset = "generation_mismatch"
            elif r.last is not None and not m.on_path(r.last):
                reset = "anchor_missing"
            if reset is not None:
                result = call()
                assert isinstance(result, DeltaReset), result
                assert result.reason == reset
                self.readers[reader] = Reader(result.cursor, m.generation)
                return
            after = -1 if r.last is None else m.position(r.last)
            assert after is not None
            before = len(visible) if fence is None else fence.fence.position
            assert before is not None
            if fence is not None and after >= before:
                with pytest.raises(ReadFenceError) as info:
                    call()
                assert info.value.reason == "crossed"
                return
            unread = visible[after + 1 : before]
            result = call()
            assert isinstance(result, DeltaPage), result
            if tight:
                assert result.entries == [] and result.serialized_bytes == 0
                if unread:
                    assert result.required_bytes == size_of(m.nodes[unread[0]].body)
                    assert result.has_more
                    if r.cursor is not None:
                        assert result.cursor == r.cursor
                else:
                    assert result.required_bytes is None and not result.has_more
                r.cursor, r.generation = result.cursor, m.generation
                return
            want = unread[:max_messages]
            assert [e.entry_id for e in result.entries] == want
            assert [e.message for e in result.entries] == [m.nodes[e].body for e in want]
            assert [e.position for e in result.entries] == [m.position(e) for e in want]
            assert result.has_more == (len(unread) > max_messages)
            assert result.serialized_bytes == sum(size_of(m.nodes[e].body) for e in want)
            assert result.required_bytes is None
            r.cursor, r.generation = result.cursor, m.generation
            if want:
                r.last = want[-1]
            r.seen += want
            # Exactly once: what the reader has seen since its last reset is the visible prefix.
            assert r.seen == visible[: len(r.seen)]
            if fence is None and not result.has_more:
                assert r.seen == visible

        @precondition(lambda self: bool(self.admissions))
        @rule(index=st.integers(0, 15), data=st.data())
        def closed_range(self, index: int, data: st.DataObject) -> None:
            adm = self.pick_admission(index)
            m = self.model
            visible = m.visible()
            if adm is None or not visible:
                return
            terminal_id = data.draw(st.sampled_from(visible))
            terminal = self.store.anchor(SCOPE, self.sid, terminal_id)
            assert terminal == self.expect_anchor(terminal_id)
            result = self.store.read_closed_range(adm, terminal)
            start, end = m.position(adm.fence.entry_id), m.position(terminal_id)
            assert start is not None and end is not None
            if adm.fence.generation != m.generation:
                assert isinstance(result, ClosedRangeFailure) and result.reason == "stale", result
            elif not m.on_path(adm.fence.entry_id) or end < start:
                assert isinstance(result, ClosedRangeFailure) and result.reason == "non_descendant", result
            else:
                assert isinstance(result, ClosedRange), result
                assert [e.entry_id for e in result.entries] == visible[start : end + 1]

        # ------------------------------------------------------------------------------ invariants

        @invariant()
        def visible_transcript_matches(self) -> None:
            got = self.store.read_visible(SCOPE, self.sid)
            want = self.model.visible()
            assert [e.entry_id for e in got] == want
            assert [e.message for e in got] == [self.model.nodes[e].body for e in want]

        @invariant()
        def session_matches(self) -> None:
            info = self.store.get_session(SCOPE, self.sid)
            assert (info.generation, info.head_entry_id, info.entry_count, info.visible_count) == (
                self.model.generation, self.model.head, len(self.model.by_seq), len(self.model.visible()),
            )

        @invariant()
        def every_entry_stays_stored(self) -> None:
            listed = self.store.list_entries(SCOPE, self.sid, limit=10_000)
            path = set(self.model.path())
            assert [e.entry_id for e in listed] == self.model.by_seq
            assert [e.active for e in listed] == [e in path for e in self.model.by_seq]
            assert [e.parent_id for e in listed] == [self.model.nodes[e].parent_id for e in self.model.by_seq]

    return StoreMachine


# 10 runs of the machine in make test, 25 in make test-slow (CI time).
@pytest.mark.parametrize("examples", [10, pytest.param(25, marks=pytest.mark.slow)])
def test_the_store_follows_the_model(store: TranscriptStore, examples: int) -> None:
    run_state_machine_as_test(
        make_machine(store),
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
