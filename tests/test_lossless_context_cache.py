"""The lossless engine's assembly reads only the context items added since the process last loaded the
list (``engines.lossless.context.ContextCache``), and answers exactly what a fresh engine answers: after
turns, compactions, branches, rewrites, turns another engine committed, and a session deleted and
created again under its id. Both backends."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from conftest import module_store_fixtures
from test_lossless import SMALL, assistant, make_engine, run_turns

from engines.lossless import LosslessEngine
from transcript_store import TranscriptStore
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
