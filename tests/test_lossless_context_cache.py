"""The lossless engine's assembly reads only the context items added since the process last loaded the
list (``engines.lossless.context.ContextCache``), and answers exactly what a fresh engine answers: after
turns, compactions, branches, rewrites, turns another engine committed, and a session deleted and
created again under its id. Both backends."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import pytest
from conftest import module_store_fixtures
from test_lossless import SMALL, assistant, commit, finished_turn, make_engine, run_turns, tool_round

from engines.lossless import LosslessEngine
from engines.lossless.compaction import incarnation_of
from engines.lossless.context import ContextCache, Item, load_items, render
from engines.lossless.tables import View
from transcript_store import TranscriptStore
from transcript_store.cursors import decode_cursor
from transcript_store.engine import AssembleResult, EngineContext
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-l"  # the scope test_lossless's helpers write to
BIG = 1_000_000

shared_url, store, sid = module_store_fixtures(A, "lossless_cache")


def assemble(engine: LosslessEngine, sid: str, budget: int = BIG) -> AssembleResult:
    return engine.assemble(scope=A, session_id=sid, fence=None, token_budget=budget)


def dump(result: AssembleResult) -> str:
    return json.dumps(result.model_dump(), ensure_ascii=False, sort_keys=True)


def rows_read(engine: LosslessEngine, sid: str) -> tuple[AssembleResult, int]:
    before = engine.stats["context_rows_read"]
    result = assemble(engine, sid)
    return result, engine.stats["context_rows_read"] - before


def test_an_assembly_reads_only_the_items_added_since_the_last(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 30)
    first, read = rows_read(engine, sid)
    assert read == len(first.messages) > 60  # the first load of this process reads the whole list
    again, read = rows_read(engine, sid)
    assert read == 0 and dump(again) == dump(first)  # nothing new: no item row read at all
    run_turns(store, engine, sid, 1, start=31)  # a turn of a user message and an answer (no tool round)
    after, read = rows_read(engine, sid)
    assert read == 2 and len(after.messages) == len(first.messages) + 2
    assert dump(after) == dump(assemble(make_engine(store, SMALL), sid))


def test_a_cached_assembly_is_what_a_fresh_engine_assembles(store: TranscriptStore, sid: str) -> None:
    cached = make_engine(store, SMALL)
    other = make_engine(store, SMALL)  # another process's engine: its commits are not in cached's list

    def same(budget: int = BIG) -> AssembleResult:
        mine = assemble(cached, sid, budget)
        assert dump(mine) == dump(assemble(make_engine(store, SMALL), sid, budget))
        return mine

    run_turns(store, cached, sid, 12)
    same()
    run_turns(store, other, sid, 3, start=12)  # imported by cached's assembly, appended to its list
    same()
    assert cached.compact(scope=A, session_id=sid, force=True, token_budget=1500).compacted
    summarized = same()
    assert summarized.messages[0]["content"].startswith("[Summary sum_")
    run_turns(store, cached, sid, 2, start=15)
    same()
    assert other.compact(scope=A, session_id=sid, force=True, token_budget=900).compacted  # not by cached
    same()
    visible = store.read_visible(A, sid)
    store.rewrite_entries(A, sid, [{"entry_id": visible[-1].entry_id, "message": assistant("[edited]")}])
    assert same().messages[-1]["content"] == "[edited]"
    store.branch(A, sid, visible[-6].entry_id)  # back over the last turns: a reset
    same()
    run_turns(store, cached, sid, 2, start=17)
    same()
    same(budget=2000)  # fitted to a small budget from the same list


def test_a_session_created_again_under_its_id_is_not_the_cached_one(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 6)
    old = assemble(engine, sid)
    assert len(old.messages) == 16  # two turns with a tool round
    store.delete_session(A, sid)
    store.create_session(A, session_id=sid)
    # As many messages again, other words: the same counters and epoch, other messages.
    for i in range(8):
        admission = store.admit(A, sid, {"role": "user", "content": f"another question {i}"}, turn_id=f"t{i}")
        store.append_many(A, sid, [{"message": assistant(f"another answer {i}")}])
        assert admission.turn_id == f"t{i}"
    new = assemble(engine, sid)
    assert [m["content"] for m in new.messages] == [
        text for i in range(8) for text in (f"another question {i}", f"another answer {i}")
    ]
    assert dump(new) != dump(old) and dump(new) == dump(assemble(make_engine(store, SMALL), sid))


def test_the_messages_handed_out_are_the_callers_own(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 4)
    first = assemble(engine, sid)
    expected = dump(first)
    first.messages[0]["content"] = "changed by the caller"
    first.messages[1].clear()
    first.messages.append({"role": "user", "content": "added by the caller"})
    assert dump(assemble(engine, sid)) == expected


class OwnCount(RoughEstimator):
    """An estimator that counts a list its own way (not the sum of its messages)."""

    def count_messages(self, messages: Sequence[dict[str, Any]]) -> int:
        return 1000 + 7 * len(messages)


def test_the_estimate_is_the_count_of_the_assembled_list(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 9)  # tool rounds included
    assert engine.compact(scope=A, session_id=sid, force=True, token_budget=1500).compacted
    run_turns(store, engine, sid, 2, start=9)
    for _ in range(2):  # loaded whole, then from the list held
        result = assemble(engine, sid)
        assert result.estimated_tokens == RoughEstimator().count_messages(result.messages)
    own = LosslessEngine(EngineContext(store=store, config=SMALL, summarizer=ExtractiveSummarizer(),
                                       estimator=OwnCount()))
    for _ in range(2):
        result = assemble(own, sid)
        assert result.estimated_tokens == 1000 + 7 * len(result.messages)


# ---------------------------------------------------------------------------------------------- randomized
#
# Every writer of the context list, in a seeded random order, each followed by a comparison of the cached
# engine's assembly with a fresh engine's: turns (by the cached engine, by another, and on the transcript
# alone, as a turn degraded to legacy leaves them), compactions (by either), rewrites and branches (a
# reset, applied by the next import or by another engine's recall tool), a view whose cursor is format 1,
# and the session deleted and created again under its id. Bounded in steps and in seconds per backend.

STEPS = 160
SECONDS = 18.0


class _Walk:
    """One seeded walk over a session: the cached engine, another process's engine, and the transcript."""

    def __init__(self, store: TranscriptStore, sid: str, seed: int) -> None:
        self.store, self.sid, self.rng = store, sid, random.Random(seed)
        self.cached, self.other = make_engine(store, SMALL), make_engine(store, SMALL)
        self.turns = 0
        self.log: list[str] = []

    def turn(self, engine: LosslessEngine | None) -> None:
        i, self.turns = self.turns, self.turns + 1
        replies = [*tool_round(f"r{i}", f"result {i} " * self.rng.randint(1, 30)), assistant(f"done {i}")] \
            if self.rng.random() < 0.3 else [assistant(f"answer {i} " * self.rng.randint(1, 20))]
        turn = finished_turn(self.store, self.sid, f"w{i}", replies)
        if engine is not None:
            commit(self.store, engine, turn)

    def plain(self) -> list[Any]:
        """The visible entries a rewrite or a branch may take: user messages and answers without calls."""
        return [e for e in self.store.read_visible(A, self.sid)
                if e.message is not None and e.message.get("role") in ("user", "assistant")
                and not e.message.get("tool_calls")]

    def rewrite(self) -> None:
        entries = self.plain()
        if entries:
            entry = self.rng.choice(entries)
            text = f"rewritten {self.rng.randint(0, 10**6)}"
            message = {"role": entry.message["role"], "content": text}
            self.store.rewrite_entries(A, self.sid, [{"entry_id": entry.entry_id, "message": message}])

    def branch(self) -> None:
        answers = [e for e in self.plain() if e.message["role"] == "assistant"]
        if answers:
            self.store.branch(A, self.sid, self.rng.choice(answers[-8:]).entry_id)

    def compact(self, engine: LosslessEngine) -> None:
        budget = self.rng.choice([400, 900, 1500, 3000])
        engine.compact(scope=A, session_id=self.sid, force=self.rng.random() < 0.7, token_budget=budget)

    def recall(self) -> None:
        # The recall tools apply a pending reset (a branch or a rewrite since the last import) first.
        self.other.handle_tool_call("lcm_grep", {"pattern": "answer"}, scope=A, session_id=self.sid)

    def format_one(self) -> None:
        """Store the view's cursor as a format-1 token (issued before cursors carried the incarnation)."""

        def run(c: Any) -> None:
            view = View.load(c, A, self.sid)
            state = None if view.cursor is None else decode_cursor(view.cursor)
            if state is not None:
                view.cursor = replace(state, incarnation=None).encode()
                view.save(c, A, self.sid)

        self.store.write(run)

    def recreate(self) -> None:
        self.store.delete_session(A, self.sid)
        self.store.create_session(A, session_id=self.sid)

    def step(self) -> None:
        ops: list[tuple[float, str, Callable[[], None]]] = [
            (30, "turn", lambda: self.turn(self.cached)),
            (12, "other turn", lambda: self.turn(self.other)),
            (10, "degraded turn", lambda: self.turn(None)),
            (10, "compact", lambda: self.compact(self.cached)),
            (8, "other compact", lambda: self.compact(self.other)),
            (6, "rewrite", self.rewrite),
            (6, "branch", self.branch),
            (4, "recall", self.recall),
            (3, "format 1", self.format_one),
            (1, "recreate", self.recreate),
        ]
        _, name, op = self.rng.choices(ops, weights=[w for w, _, _ in ops])[0]
        self.log.append(name)
        op()

    def view(self) -> dict[str, Any]:
        return asdict(self.store.read(lambda c: View.load(c, A, self.sid)))

    def compare(self) -> None:
        where = f"after {self.log[-6:]}"
        mine = assemble(self.cached, self.sid)
        assert dump(mine) == dump(assemble(make_engine(self.store, SMALL), self.sid)), where
        _, read = rows_read(self.cached, self.sid)
        if incarnation_of(View(**self.view())) is not None:
            assert read == 0, where  # nothing new since: no item row read
        # A small budget may compact in the assembly (a write): compared only when neither wrote.
        budget = self.rng.choice([300, 700, 2000])
        before = self.view()
        mine = assemble(self.cached, self.sid, budget)
        if self.view() == before:
            fresh = assemble(make_engine(self.store, SMALL), self.sid, budget)
            if self.view() == before:
                assert dump(mine) == dump(fresh), where


# One walk in make test, the second seed's in make test-slow (CI time: each is a 9 s campaign).
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_random_walk_of_every_writer_assembles_what_a_fresh_engine_does(
    store: TranscriptStore, sid: str, seed: int
) -> None:
    walk = _Walk(store, sid, seed)
    walk.turn(walk.cached)
    deadline = time.monotonic() + SECONDS / 2
    for step in range(STEPS):
        walk.step()
        walk.compare()
        # The deadline bounds the walk on a fast machine; the first 20 steps run however loaded this one is
        # (a busy 2-core run got 7-19 steps in 9 s, and the assertion below failed).
        if step >= 20 and time.monotonic() > deadline:
            break
    assert len(walk.log) >= 20 and {"turn", "compact"} <= set(walk.log)


def test_threads_assembling_while_another_compacts_agree_with_a_fresh_engine(
    store: TranscriptStore, sid: str
) -> None:
    """The host's maintenance thread compacts while turns assemble on others, all through one engine."""
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 12)
    stop = threading.Event()
    errors: list[BaseException] = []
    compared = [0]

    def view() -> View:
        return store.read(lambda c: View.load(c, A, sid))

    def assembling() -> None:
        try:
            while not stop.is_set():
                before = view()
                mine = dump(assemble(engine, sid))
                fresh = dump(assemble(make_engine(store, SMALL), sid))
                if view() == before:  # nothing written meanwhile: the same state, the same answer
                    assert mine == fresh
                    compared[0] += 1
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=assembling) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(12, 30):
            run_turns(store, engine, sid, 1, start=i)
            engine.compact(scope=A, session_id=sid, force=i % 2 == 0, token_budget=1200 + 100 * (i % 5))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == [] and compared[0] > 0
    assert dump(assemble(engine, sid)) == dump(assemble(make_engine(store, SMALL), sid))


# ---------------------------------------------------------------------------------------------- bounds


def _session(store: TranscriptStore, turns: int) -> str:
    sid = store.create_session(A, session_id=f"s-{uuid.uuid4().hex[:12]}").session_id
    run_turns(store, make_engine(store, SMALL), sid, turns)
    return sid


def _through(cache: ContextCache, store: TranscriptStore, sid: str) -> tuple[list[Item], int]:
    """The cache's list of a session, read as an assembly reads it (with the view, in one snapshot)."""

    def run(c: Any) -> tuple[list[Item], int]:
        view = View.load(c, A, sid)
        return cache.items(c, A, sid, incarnation=incarnation_of(view), epoch=view.epoch, next_item=view.next_item)

    return store.read(run)


def _text(store: TranscriptStore, sid: str) -> int:
    """Characters of stored message text in a session's context list (what the cache's bound counts)."""
    return store.read(lambda c: sum(len(json.dumps(i.message, ensure_ascii=False, separators=(",", ":")))
                                    for i in load_items(c, A, sid) if i.message is not None))


def test_the_cache_holds_its_bounds_and_answers_the_same_past_them(store: TranscriptStore) -> None:
    small = [_session(store, 4) for _ in range(3)]
    huge = _session(store, 16)
    chars = 2 * max(_text(store, s) for s in small) + 100  # two small sessions, never the huge one
    assert _text(store, huge) > chars
    estimator = RoughEstimator()
    cache, counting = ContextCache(lambda m: estimator.count_messages([m]), sessions=2, chars=chars), True

    def check(sid: str, whole: bool) -> None:
        items, read = _through(cache, store, sid)
        expected = store.read(lambda c: load_items(c, A, sid))
        assert [replace(i, counted=None) for i in items] == expected
        counts = [estimator.count_messages(render([i])) if counting else None for i in items]
        assert [i.counted for i in items] == counts
        assert read == (len(expected) if whole else 0)

    check(small[0], True)
    check(small[1], True)
    check(small[0], False)
    check(small[2], True)  # a third session: the least recently used (small[1]) goes
    check(small[0], False)
    check(small[1], True)  # and small[2] goes
    for _ in range(2):
        check(huge, True)  # larger than the bound by itself: read whole every time, and never held
    check(small[0], False)  # the two held stay, whatever the huge one did
    check(small[1], False)
    check(small[2], True)
    # Room for one small session only, and no counts kept (an estimator that counts a list its own way).
    cache, counting = ContextCache(None, sessions=256, chars=chars * 3 // 4), False
    check(small[0], True)
    check(small[0], False)
    check(small[1], True)  # the characters bound: small[0] goes
    check(small[0], True)


def test_a_snapshot_older_than_the_list_held_reads_its_own_list(store: TranscriptStore, sid: str) -> None:
    """Two threads of one process: a turn's assembly in a snapshot taken before another's turn committed
    and was loaded. The list held is longer than the older snapshot's: it is not that snapshot's prefix."""
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 4)
    cache = ContextCache(None)
    _through(cache, store, sid)

    def older(c: Any) -> None:
        view = View.load(c, A, sid)
        expected = load_items(c, A, sid)  # this snapshot's list
        run_turns(store, engine, sid, 2, start=4)  # committed meanwhile
        newer, read = _through(cache, store, sid)  # and held by the cache
        assert read == 4 and len(newer) == len(expected) + 4
        items, read = cache.items(c, A, sid, incarnation=incarnation_of(view), epoch=view.epoch,
                                  next_item=view.next_item)
        assert items == expected and read == len(expected)

    store.read(older)


def test_dispose_lets_go_of_the_lists_held(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 4)
    first, read = rows_read(engine, sid)
    assert read == len(first.messages) and rows_read(engine, sid)[1] == 0
    engine.dispose()
    again, read = rows_read(engine, sid)
    assert read == len(first.messages) and dump(again) == dump(first)

