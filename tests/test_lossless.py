"""The lossless engine on both backends: its contract, the ledger cases, ingestion, assembly, compaction."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import module_store_fixtures
from hosting import RecordingModel
from sqlalchemy import func, select, update

from engines.lossless import LosslessEngine
from engines.lossless import engine as engine_module
from engines.lossless import search as search_module
from engines.lossless.audit import audit
from engines.lossless.config import LosslessConfig, budget
from engines.lossless.tables import View, context_items, messages, summaries, summary_children, summary_sources
from transcript_store import AdvancementKeyCollision, StoreConfig, TranscriptStore
from transcript_store.core import Core
from transcript_store.engine import (
    EngineContext,
    EngineSelection,
    ModelSettings,
    RuntimeSettings,
    durable_declaration,
)
from transcript_store.errors import InvalidInput, ReadFenceError, SummarizerError
from transcript_store.host import HostRuntime
from transcript_store.ledger import CommitResult, get_receipt, get_state
from transcript_store.models import Admission, Anchor, ClosedRange
from transcript_store.registry import EngineRegistry
from transcript_store.schema import entries, outbox
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

A = "scope-l"
TABLES = (messages, summaries, summary_sources, summary_children, context_items)
SMALL = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
         "condensed_summary_tokens": 160, "condense_fanin": 3}


def make_engine(store: TranscriptStore, config: dict[str, Any] | None = None, summarizer: Any = None) -> LosslessEngine:
    ctx = EngineContext(store=store, config=config or {}, summarizer=summarizer or ExtractiveSummarizer(),
                        estimator=RoughEstimator())
    return LosslessEngine(ctx)


# One migrated database per backend for this module: creating and dropping a PostgreSQL database per
# test would be most of the module's time. Each test has its own session, and every lossless row is
# keyed by session, so the tests stay isolated.
shared_url, store, sid = module_store_fixtures(A, "lossless")


@pytest.fixture
def store_url(shared_url: str) -> str:
    return shared_url


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def tool_round(call_id: str, result: str, calls: int = 1) -> list[dict[str, Any]]:
    ids = [f"{call_id}-{n}" for n in range(calls)]
    tool_calls = [{"id": i, "type": "function", "function": {"name": "lookup", "arguments": '{"q":"x"}'}} for i in ids]
    return [{"role": "assistant", "content": None, "tool_calls": tool_calls},
            *[{"role": "tool", "tool_call_id": i, "content": f"{result} from {i}"} for i in ids]]


def finished_turn(
    store: TranscriptStore, sid: str, turn_id: str, replies: Sequence[dict[str, Any]] | None = None
) -> tuple[Admission, Anchor, list[dict[str, Any]]]:
    admission = store.admit(A, sid, user(f"question {turn_id} " + "words " * 30), turn_id=turn_id)
    appended = store.append_many(A, sid, [{"message": m} for m in replies or [assistant(f"answer {turn_id} " * 10)]])
    terminal = store.anchor(A, sid, appended[-1].entry_id)
    closed = store.read_closed_range(admission, terminal)
    assert isinstance(closed, ClosedRange)
    return admission, terminal, closed.messages


def commit(
    store: TranscriptStore, engine: LosslessEngine, turn: tuple[Admission, Anchor, list[dict[str, Any]]]
) -> CommitResult:
    admission, terminal, msgs = turn
    return store.write(lambda c: engine.commit_turn(
        tx=c, advancement_key=admission.turn_id, admission=admission.anchor, terminal=terminal, messages=msgs
    ))


def run_turns(store: TranscriptStore, engine: LosslessEngine, sid: str, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        replies = [*tool_round(f"c{i}", f"result {i} " * 20), assistant(f"done {i} " * 8)] if i % 3 == 0 else None
        commit(store, engine, finished_turn(store, sid, f"t{i}", replies))


def rows(store: TranscriptStore, sid: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every lossless row of a session (engine state included), for before/after comparisons."""

    def run(c: Any) -> dict[str, list[tuple[Any, ...]]]:
        out = {t.name: sorted(tuple(r) for r in c.conn.execute(select(t).where(t.c.session_id == sid))) for t in TABLES}
        out["view"] = [(json.dumps(get_state(c, A, sid, "lossless", "view"), sort_keys=True),)]
        return out

    return store.read(run)


def count(store: TranscriptStore, table: Any, sid: str) -> int:
    return int(store.read(lambda c: c.conn.execute(
        select(func.count()).select_from(table).where(table.c.session_id == sid)).scalar_one()))


def check(store: TranscriptStore, sid: str) -> Any:
    result = store.read(lambda c: audit(c, A, sid))
    assert result.problems == []
    return result


def visible_ids(store: TranscriptStore, sid: str) -> set[str]:
    return {e.entry_id for e in store.read_visible(A, sid)}


# ---------------------------------------------------------------------------------------------- contract


def test_declares_the_full_durable_contract(store: TranscriptStore) -> None:
    registry = EngineRegistry()
    spec = registry.specs["lossless"]
    assert spec.source == "bundled" and spec.manifest["entry"] == "engines.lossless:create_engine"
    engine, info = registry.create("lossless", EngineContext(store=store))
    assert durable_declaration(engine, info) == (True, None, False)
    assert info.owns_compaction and info.turn_maintenance_mode == "background"
    assert info.accepted_host_params == ["session_key", "runtime_settings"]
    assert {t["function"]["name"] for t in engine.get_tool_schemas()} == {"lcm_grep", "lcm_describe", "lcm_expand"}


def test_config_is_validated() -> None:
    with pytest.raises(InvalidInput, match="lossless config: no_such_knob"):
        LosslessConfig.parse({"no_such_knob": 1})
    with pytest.raises(InvalidInput, match="target must not exceed threshold"):
        LosslessConfig.parse({"threshold": 0.5, "target": 0.6})


def test_thresholds_follow_the_model_with_the_longest_match() -> None:
    config = LosslessConfig.parse(
        {"threshold": 0.8, "target": 0.4, "model_thresholds": {"gpt-4o": 0.5, "gpt-4o-mini": 0.9}}
    )

    def settings(resolved: str | None, requested: str | None) -> RuntimeSettings:
        return RuntimeSettings(context_engine_selection=EngineSelection(id="lossless", source="config"),
                               model=ModelSettings(resolved=resolved, requested=requested))

    assert budget(config, 10_000, settings("openai/gpt-4o-mini-2024", None)).trigger == 9000
    assert budget(config, 10_000, settings("gpt-4o", "x")).trigger == 5000
    assert budget(config, 10_000, settings(None, "GPT-4O-MINI")).trigger == 9000
    marks = budget(config, 10_000, settings("claude", None))
    assert (marks.trigger, marks.target) == (8000, 4000)
    assert budget(config, 10_000, settings("gpt-4o", None)).target == 2500  # the target keeps its proportion
    assert budget(LosslessConfig.parse({"context_window": 2000}), 10_000, None).window == 2000


# ---------------------------------------------------------------------------------------------- ledger cases


def test_commit_then_duplicate_ingests_once(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    turn = finished_turn(store, sid, "t1", [*tool_round("c1", "42"), assistant("done")])
    first = commit(store, engine, turn)
    assert first.status == "committed" and first.receipt.message_count == 4
    assert count(store, messages, sid) == 4 and count(store, context_items, sid) == 4
    before = rows(store, sid)
    again = commit(store, engine, turn)
    assert again.status == "duplicate" and again.receipt == first.receipt
    assert rows(store, sid) == before
    result = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=10_000)
    assert result.messages == turn[2]


def test_duplicate_after_reopening_the_store(store_url: str, store: TranscriptStore, sid: str) -> None:
    first_store = TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False))
    turn = finished_turn(first_store, sid, "t1")
    first = commit(first_store, make_engine(first_store), turn)
    before = rows(first_store, sid)
    first_store.close()
    reopened = TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False))
    try:
        again = commit(reopened, make_engine(reopened), turn)
        assert again.status == "duplicate" and again.receipt == first.receipt
        assert rows(reopened, sid) == before
    finally:
        reopened.close()


def test_same_key_with_another_payload_is_a_collision(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    admission, terminal, msgs = finished_turn(store, sid, "t1", [assistant("a"), assistant("b")])
    commit(store, engine, (admission, terminal, msgs))
    before = rows(store, sid)
    changed = [msgs[0], assistant("other"), msgs[2]]
    with pytest.raises(AdvancementKeyCollision):
        commit(store, engine, (admission, terminal, changed))
    assert rows(store, sid) == before


def test_a_failure_in_apply_rolls_back_everything(
    store: TranscriptStore, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(store)
    turn = finished_turn(store, sid, "t1")
    real = engine_module.import_pages

    def broken(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)  # the rows and the view are written ...
        raise RuntimeError("engine bug after its writes")  # ... and must all roll back with the receipt

    monkeypatch.setattr(engine_module, "import_pages", broken)
    with pytest.raises(RuntimeError):
        commit(store, engine, turn)
    assert store.read(lambda c: get_receipt(c, A, sid, "lossless", "t1")) is None
    assert all(v == [] for k, v in rows(store, sid).items() if k != "view")
    assert store.read(lambda c: get_state(c, A, sid, "lossless", "view")) is None
    monkeypatch.setattr(engine_module, "import_pages", real)
    assert commit(store, engine, turn).status == "committed"
    assert count(store, messages, sid) == 2


# ---------------------------------------------------------------------------------------------- ingestion


def test_commit_imports_a_gap_left_by_another_engine_first(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    finished_turn(store, sid, "t1")  # committed elsewhere (say legacy): never reaches this engine
    commit(store, engine, finished_turn(store, sid, "t2"))
    result = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=10_000)
    assert result.messages == [e.message for e in store.read_visible(A, sid)]
    check(store, sid)


def test_bootstrap_pages_up_to_the_fence_and_is_idempotent(store: TranscriptStore, sid: str) -> None:
    big = "x" * 5000  # larger than a page: required_bytes enlarges the page
    history = [user(f"u{i} " + (big if i == 4 else "")) if i % 2 == 0 else assistant(f"a{i}") for i in range(11)]
    store.append_many(A, sid, [{"message": m} for m in history])
    admission = store.admit(A, sid, user("the current turn"), turn_id="now")
    engine = make_engine(store, {"page_messages": 3, "page_bytes": 1024})
    first = engine.bootstrap(scope=A, session_id=sid, fence=admission.anchor)
    assert first.bootstrapped and first.imported_messages == 11
    assert engine.bootstrap(scope=A, session_id=sid, fence=admission.anchor).imported_messages == 0
    result = engine.assemble(scope=A, session_id=sid, fence=admission.anchor, token_budget=100_000)
    assert result.messages == history  # the admitted user message is the host's to append
    assert engine.bootstrap(scope=A, session_id="nope", fence=None).bootstrapped is False
    check(store, sid)


def test_a_reset_rebuilds_the_context_and_forgets_the_originals(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 12)
    assert engine.compact(scope=A, session_id=sid, force=True, token_budget=800).compacted
    first = store.read_visible(A, sid)[0]
    store.rewrite_entries(A, sid, [{"entry_id": first.entry_id, "message": user("edited first question")}])
    result = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)
    assert result.messages == [e.message for e in store.read_visible(A, sid)]
    assert result.messages[0] == user("edited first question")
    # The rewritten original left the active path: no engine row keeps it (the transcript does).
    assert count(store, messages, sid) == len(result.messages)
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "question t0"}, scope=A, session_id=sid))
    assert found["count"] == 0
    audited = check(store, sid)
    assert audited.covered_entry_ids == visible_ids(store, sid)


def test_assemble_catches_up_with_turns_of_another_engine(store: TranscriptStore, sid: str) -> None:
    registry = EngineRegistry()

    def host(engine: str) -> tuple[HostRuntime, RecordingModel]:
        model = RecordingModel()
        settings = load_settings(config_path=None, engine=engine)
        return HostRuntime(store, settings, model, registry=registry, summarizer=ExtractiveSummarizer(),
                           estimator=RoughEstimator()), model

    lossless, model = host("lossless")
    one = lossless.run_turn(A, sid, "first", turn_id="t1")
    legacy, _ = host("legacy")
    two = legacy.run_turn(A, sid, "during a degraded turn", turn_id="t2")
    three = lossless.run_turn(A, sid, "third", turn_id="t3")
    assert one.engine_id == three.engine_id == "lossless" and two.engine_id == "legacy"
    assert model.requests[-1][1:] == [*one.messages, *two.messages, user("third")]
    assert count(store, messages, sid) == 6
    check(store, sid)


def test_a_turn_accepted_before_an_upgrade_reaches_the_engine_as_stored(store: TranscriptStore, sid: str) -> None:
    """A reply an earlier release stored and this one refuses (an empty tool_calls list), in a turn
    accepted but not yet delivered when the library was upgraded: the engine validated the stored
    messages again by the new rules, so every drain failed and quarantined the engine, and the
    session's later turns ran on legacy for ever. The host hands the engine the closed range as
    stored (``commit_prepared``)."""
    turns = Turns(store)
    turns.admit(A, sid, user("q"), turn_id="t1", engine_id="lossless")
    done = turns.complete(A, sid, "t1", [{"message": assistant("a")}], None)
    # What the earlier release wrote: the reply as it stored it, and the intent's copy of the turn.
    earlier = {"role": "assistant", "content": "a", "tool_calls": []}
    text = json.dumps(earlier, separators=(",", ":"))
    with store.db.engine.begin() as conn:
        conn.execute(update(entries).where(entries.c.scope == A, entries.c.session_id == sid,
                                           entries.c.entry_id == done.terminal.entry_id)
                     .values(payload=text, size_bytes=len(text)))
        conn.execute(update(outbox).where(outbox.c.scope == A, outbox.c.session_id == sid, outbox.c.turn_id == "t1")
                     .values(messages=json.dumps([user("q"), earlier])))
    host = HostRuntime(store, load_settings(config_path=None, engine="lossless"), RecordingModel(),
                       registry=EngineRegistry(), summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())
    try:
        report = turns.drain(host.commit_in, scope=A, session_id=sid)
        assert (report.committed_turns, report.failed) == ([(sid, "t1")], [])
        assert "lossless" not in host.quarantined
        assert host.run_turn(A, sid, "next", turn_id="t2").engine_id == "lossless"
    finally:
        host.dispose()
    assert count(store, messages, sid) == 4
    check(store, sid)


def test_assemble_raises_rather_than_cross_the_fence(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    t1 = finished_turn(store, sid, "t1")
    t2 = finished_turn(store, sid, "t2")
    commit(store, engine, t1)
    result = engine.assemble(scope=A, session_id=sid, fence=t2[0].anchor, token_budget=10_000)
    assert result.messages == t1[2]
    commit(store, engine, t2)
    with pytest.raises(ReadFenceError):  # the engine already holds messages after that admitted entry
        engine.assemble(scope=A, session_id=sid, fence=t2[0].anchor, token_budget=10_000)


class Meanwhile(ExtractiveSummarizer):
    """Runs ``hook`` once, at its first call: between a compaction's planning read and its write."""

    def __init__(self) -> None:
        super().__init__()
        self.hook: Any = None

    def summarize(self, *args: Any, **kwargs: Any) -> str:
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return str(super().summarize(*args, **kwargs))


@pytest.mark.parametrize("call", ["assemble", "compact"])
@pytest.mark.parametrize("change", ["crossed", "rewritten"])
def test_a_compaction_inside_a_turn_writes_nothing_once_the_fence_no_longer_holds(
    store: TranscriptStore, sid: str, call: str, change: str
) -> None:
    """Over the hard budget, assemble compacts before it answers (the host's compaction before the prompt
    and its overflow recovery call ``compact`` inside the turn too). While the summarizer ran, another
    caller imported the copy past the admitted entry unfenced ("crossed"), or a rewrite broke the fence:
    the compaction's write landed all the same (a summary written for a turn that then degraded, or one
    covering the admitted entry), and only the next fenced read raised. Now the write holds the fence."""
    summarizer = Meanwhile()
    engine = make_engine(store, SMALL, summarizer)
    run_turns(store, engine, sid, 10)
    admission = store.admit(A, sid, user("the current turn " + "words " * 30), turn_id="now")
    fence = admission.anchor
    assert engine.assemble(scope=A, session_id=sid, fence=fence, token_budget=100_000).messages  # imported
    seen: list[dict[str, list[tuple[Any, ...]]]] = []

    def meanwhile() -> None:
        if change == "crossed":
            engine.bootstrap(scope=A, session_id=sid, fence=None)  # the admitted entry into the copy
        else:
            first = store.read_visible(A, sid)[0]
            store.rewrite_entries(A, sid, [{"entry_id": first.entry_id, "message": user("edited")}])
        seen.append(rows(store, sid))

    summarizer.hook = meanwhile
    with pytest.raises(ReadFenceError) as raised:
        if call == "assemble":
            engine.assemble(scope=A, session_id=sid, fence=fence, token_budget=600)
        else:
            engine.compact(scope=A, session_id=sid, force=True, token_budget=600, fence=fence)
    assert raised.value.reason == change
    assert summarizer.hook is None and len(seen) == 1  # the compaction was planned, its write refused
    assert rows(store, sid) == seen[0]  # nothing written after the fence broke: no summary, no item moved
    assert count(store, summaries, sid) == 0
    if change == "crossed":
        assert fence.entry_id in {r[3] for r in seen[0]["ts_lcm_messages"]}  # the copy holds it, unsummarized


def test_a_fenced_compaction_applies_no_pending_reset_once_the_fence_no_longer_holds(
    store: TranscriptStore, sid: str
) -> None:
    """A rewrite since the engine's import leaves a reset pending, which a compaction applies before it
    plans: with the turn's fence it applied it (a write: rows forgotten, the epoch moved) and only then
    found the fence broken by that very rewrite. The fence is checked first now."""
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 6)
    admission = store.admit(A, sid, user("the current turn"), turn_id="now")
    first = store.read_visible(A, sid)[0]
    store.rewrite_entries(A, sid, [{"entry_id": first.entry_id, "message": user("edited")}])
    before = rows(store, sid)
    with pytest.raises(ReadFenceError) as raised:
        engine.compact(scope=A, session_id=sid, force=True, fence=admission.anchor)
    assert raised.value.reason == "rewritten"
    assert rows(store, sid) == before


# ---------------------------------------------------------------------------------------------- assembly


def test_assembly_is_stable_and_the_epoch_follows_the_summaries(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 10)

    def assemble() -> Any:
        return engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)

    a, b = assemble(), assemble()
    assert json.dumps(a.model_dump()) == json.dumps(b.model_dump())
    assert a.system_prompt_addition is None and a.context_projection is not None
    assert engine.compact(scope=A, session_id=sid, force=True, token_budget=1500).compacted
    c = assemble()
    assert c.context_projection.epoch != a.context_projection.epoch and c.system_prompt_addition
    assert c.messages[0]["content"].startswith("[Summary sum_")
    run_turns(store, engine, sid, 1, start=10)
    d = assemble()
    assert d.context_projection.epoch == c.context_projection.epoch and d.messages != c.messages
    assert d.messages[: len(c.messages)] == c.messages  # appends keep the prefix (provider caches)


def test_assembly_says_when_its_summaries_were_written(store: TranscriptStore, sid: str) -> None:
    # A reply kept after a summary was generated after the messages the summary replaced: a host that
    # replays provider-signed reasoning (OpenClaw's Anthropic thinking) must drop its signature, and only
    # the assembly can say which replies are older than the compaction.
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 10)

    def assemble(on: LosslessEngine = engine) -> Any:
        return on.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)

    assert assemble().compacted_at_ms is None  # nothing summarised yet
    before = int(time.time() * 1000)
    assert engine.compact(scope=A, session_id=sid, force=True, token_budget=1500).compacted
    after = int(time.time() * 1000) + 1
    first = assemble().compacted_at_ms
    assert first is not None and before <= first <= after
    run_turns(store, engine, sid, 1, start=10)
    assert assemble().compacted_at_ms == first  # a turn appended later changes no prefix
    assert assemble(make_engine(store, SMALL)).compacted_at_ms == first  # read from the store, not a cache
    time.sleep(0.002)
    assert engine.compact(scope=A, session_id=sid, force=True, token_budget=1500).compacted
    assert assemble().compacted_at_ms > first  # the newest summary counts


def test_tool_calls_and_results_are_never_split(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, {**SMALL, "leaf_chunk_messages": 3, "fresh_tail_messages": 3})
    for i in range(14):
        replies = [*tool_round(f"c{i}", f"r{i} " * 30, calls=1 + i % 3), assistant(f"a{i}")]
        commit(store, engine, finished_turn(store, sid, f"t{i}", replies))
        engine.compact(scope=A, session_id=sid, force=True, token_budget=1200)

    def leaves(c: Any) -> dict[int, list[dict[str, Any]]]:
        out: dict[int, list[dict[str, Any]]] = {}
        q = select(summary_sources.c.summary_seq, messages.c.message).join(
            messages, (messages.c.session_id == summary_sources.c.session_id)
            & (messages.c.ordinal == summary_sources.c.message_ordinal)).where(summary_sources.c.session_id == sid)
        for r in c.conn.execute(q.order_by(messages.c.ordinal)):
            out.setdefault(r.summary_seq, []).append(json.loads(r.message))
        return out

    for group in [*store.read(leaves).values(),
                  engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000).messages]:
        calls = {c["id"] for m in group for c in m.get("tool_calls") or []}
        results = {m["tool_call_id"] for m in group if m["role"] == "tool"}
        assert calls == results
    check(store, sid)


# ---------------------------------------------------------------------------------------------- compaction


def test_leaf_passes_then_condensation_keep_the_context_bounded(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    sizes = []
    for i in range(40):
        run_turns(store, engine, sid, 1, start=i)
        engine.compact(scope=A, session_id=sid, force=False, token_budget=1500)
        sizes.append(count(store, context_items, sid))
    kinds = store.read(
        lambda c: {r.kind for r in c.conn.execute(select(summaries).where(summaries.c.session_id == sid))}
    )
    assert kinds == {"leaf", "condensed"}
    audited = check(store, sid)
    assert audited.covered_entry_ids == visible_ids(store, sid)
    assert max(sizes[20:]) <= max(sizes[:20]) + 3  # the context list does not grow with the history
    view = store.read(lambda c: View.load(c, A, sid))
    assert view.tokens <= budget(engine.config, 1500, None).trigger


def test_a_chunk_that_cannot_shrink_is_passed_over_for_the_next(store: TranscriptStore, sid: str) -> None:
    """A tiny first exchange before a tool unit too large to join it: its chunk cannot be summarized
    smaller, and compaction offered that same oldest chunk again and again, so nothing after it was
    ever summarized (the context grew and assemble cut raw history). The next chunk is taken instead."""
    engine = make_engine(store, SMALL)
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for k in (1, 2)]
    results = [{"role": "tool", "tool_call_id": f"c{k}", "content": f"r{k}"} for k in (1, 2)]
    first = [user("hi"), assistant("hello"), {"role": "assistant", "content": None, "tool_calls": calls}, *results]
    store.append_many(A, sid, [{"message": m} for m in first])
    for i in range(40):
        store.append_many(A, sid, [{"message": user(f"Question {i}. " + "Long text here. " * 40)},
                                   {"message": assistant(f"Answer {i}. " + "More long text. " * 40)}])
    engine.bootstrap(scope=A, session_id=sid, fence=None)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=2000)
    assert result.compacted and result.tokens_after < result.tokens_before / 2, result
    assert count(store, summaries, sid) > 0
    check(store, sid)


def test_compaction_reports_no_progress_honestly(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    commit(store, engine, finished_turn(store, sid, "t1"))
    calm = engine.compact(scope=A, session_id=sid, force=False, token_budget=100_000)
    assert calm.ok and not calm.compacted and "under the threshold" in (calm.reason or "")
    forced = engine.compact(scope=A, session_id=sid, force=True, token_budget=100_000)
    assert forced.ok and not forced.compacted and "no progress" in (forced.reason or "")
    assert forced.tokens_before == forced.tokens_after


class Verbose:
    """A summarizer whose summaries do not shrink at the levels in ``long_at``."""

    def __init__(self, long_at: tuple[str, ...]) -> None:
        self.long_at = long_at

    def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        if kw["level"] in self.long_at:
            return "padding " * 4000
        return ExtractiveSummarizer().summarize(messages, **kw)


@pytest.mark.parametrize(("long_at", "level"), [((), "normal"), (("normal",), "aggressive"),
                                                (("normal", "aggressive"), "truncated")])
def test_a_summary_that_does_not_shrink_escalates(
    store: TranscriptStore, sid: str, long_at: tuple[str, ...], level: str
) -> None:
    engine = make_engine(store, SMALL, summarizer=Verbose(long_at))
    run_turns(store, engine, sid, 6)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=100_000)
    assert result.ok and result.compacted
    assert result.tokens_after is not None and result.tokens_before is not None
    assert result.tokens_after < result.tokens_before
    made = store.read(lambda c: [(r.level, r.tokens < r.source_tokens)
                                 for r in c.conn.execute(select(summaries).where(summaries.c.session_id == sid))])
    assert made and all(m == (level, True) for m in made)


class Failing:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        self.calls += 1
        raise self.error


@pytest.mark.parametrize("error", [SummarizerError("provider down"), RuntimeError("bug in summarizer")])
def test_a_failing_summarizer_never_loses_messages(store: TranscriptStore, sid: str, error: Exception) -> None:
    engine = make_engine(store, SMALL, summarizer=Failing(error))
    run_turns(store, engine, sid, 8)
    before = rows(store, sid)
    result = engine.compact(scope=A, session_id=sid, force=True, token_budget=1000)
    assert not result.ok and not result.compacted and type(error).__name__ in (result.reason or "")
    assert rows(store, sid) == before  # every raw message still in context, nothing written
    engine.maintain(scope=A, session_id=sid)  # proactive compaction fails quietly, never raises
    fitted = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=1000)
    assert fitted.estimated_tokens <= 1000  # the request still fits, the context list keeps everything
    engine.summarizer = ExtractiveSummarizer()
    assert engine.compact(scope=A, session_id=sid, force=True, token_budget=1000).compacted
    check(store, sid)


def test_failing_summarizer_through_the_host_keeps_the_engine(store: TranscriptStore, sid: str) -> None:
    # The budget leaves ~500 tokens of context once the reply, the system prompt, the user message and
    # the recall tools' schemas (~670 tokens) are set aside: the turns outgrow it and compaction is tried.
    model = RecordingModel()
    settings = load_settings(config_path=None, engine="lossless", token_budget=1300, max_output_tokens=100,
                             engine_config={"lossless": SMALL})
    failing = Failing(SummarizerError("down"))
    host = HostRuntime(store, settings, model, registry=EngineRegistry(), summarizer=failing,
                       estimator=RoughEstimator())
    est = RoughEstimator()
    tools = json.dumps([s for s, _ in host.host_tools.values()] + host.engine("lossless")[0].get_tool_schemas())
    for i in range(12):
        out = host.run_turn(A, sid, f"message {i} " + "words " * 40, turn_id=f"t{i}")
        assert out.engine_id == "lossless" and out.commit_status == "committed"
        assert est.count_messages(model.requests[-1]) + est.count_text(tools) <= 1300 - 100
    assert failing.calls > 0 and "lossless" not in host.quarantined
    assert count(store, context_items, sid) == count(store, messages, sid) == 24


class _Where(ExtractiveSummarizer):
    """Records the thread each summary is written on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def summarize(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        self.threads.append(threading.current_thread().name)
        return super().summarize(messages, **kw)


def test_proactive_compaction_through_the_host_runs_after_the_reply(store: TranscriptStore, sid: str) -> None:
    """Above the threshold but within what assemble may show, the compaction is maintenance (background
    mode): the summarizer (a model call, in production) runs on the host's maintenance thread, not
    before ``run_turn`` returns; the next turns see its summaries."""
    settings = load_settings(config_path=None, engine="lossless", token_budget=4000, max_output_tokens=100,
                             engine_config={"lossless": SMALL})
    where = _Where()
    host = HostRuntime(store, settings, RecordingModel(), registry=EngineRegistry(), summarizer=where,
                       estimator=RoughEstimator())
    for i in range(30):
        out = host.run_turn(A, sid, f"message {i} " + "words " * 40, turn_id=f"t{i}")
        assert out.engine_id == "lossless" and out.commit_status == "committed"
        # Each pass is let finish before the next turn: on a loaded machine the turns outran the maintenance
        # thread until the context passed the hard budget, and assemble compacted at once (as it must).
        assert host.maintenance.wait(30)
    assert where.threads and set(where.threads) == {"transcript-store-maintain"}, where.threads
    assert count(store, summaries, sid) > 0 and "lossless" not in host.quarantined
    check(store, sid)
    host.dispose()


def test_a_manual_compaction_through_the_host_compacts_what_the_engine_has_not_ingested_yet(
    store: TranscriptStore, sid: str
) -> None:
    """A long session from before lossless was selected (or turns that ran on legacy): the engine has
    ingested none of it, and a manual compaction must not answer "no progress" on 0 tokens. A turn
    still running on the session is not read (its admission fences the import)."""
    store.append_many(A, sid, [{"message": (user if i % 2 == 0 else assistant)(f"old {i} " + "words " * 200)}
                               for i in range(30)])
    settings = load_settings(config_path=None, engine="lossless", token_budget=8000, engine_config={"lossless": SMALL})
    host = HostRuntime(store, settings, RecordingModel(), registry=EngineRegistry(),
                       summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())
    running = host.turns.admit(A, sid, user("a turn still running"), turn_id="running", engine_id="lossless")[0]
    result = host.compact(A, sid)
    assert result.ok and result.compacted and (result.tokens_before or 0) > 6000
    assert (result.tokens_after or 0) < (result.tokens_before or 0)
    check(store, sid)
    ingested = store.read(lambda c: c.conn.execute(
        select(messages.c.entry_id).where(messages.c.scope == A, messages.c.session_id == sid)).scalars().all())
    assert len(ingested) == 30 and running.anchor.entry_id not in ingested


# ---------------------------------------------------------------------------------------------- lifecycle


def test_delete_session_removes_every_lossless_row(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 8)
    engine.compact(scope=A, session_id=sid, force=True, token_budget=800)
    store.delete_session(A, sid)
    assert all(v == [] for k, v in rows(store, sid).items() if k != "view")
    if store.backend == "sqlite":  # its search rows and their slot (revision 0012) went with them
        left = store.read(lambda c: c.conn.exec_driver_sql(
            "SELECT count(*) FROM ts_lcm_search_slots WHERE session_id = ?", (sid,)).scalar())
        assert left == 0
    store.create_session(A, session_id=sid)
    found = json.loads(engine.handle_tool_call("lcm_grep", {"pattern": "question"}, scope=A, session_id=sid))
    assert found["count"] == 0


def test_maintain_compacts_in_the_background_mode(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, {**SMALL, "context_window": 1000})
    assert engine.maintain(scope=A, session_id=sid).changed is False
    run_turns(store, engine, sid, 10)
    result = engine.maintain(scope=A, session_id=sid)
    assert result.changed
    assert store.read(lambda c: View.load(c, A, sid)).tokens <= budget(engine.config, None, None).trigger


# ---------------------------------------------------------------------------------------------- tools


def grep(engine: LosslessEngine, sid: str, **args: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(engine.handle_tool_call("lcm_grep", args, scope=A, session_id=sid))
    return out


def test_grep_full_text_is_cjk_safe_and_regexes_work(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store)
    texts = ["我们明天去北京开会", "apple apple apple banana kiwi", "apple cherry kiwi melon", "an ox, 東京の天気",
             "100% of a_b"]
    commit(store, engine, finished_turn(store, sid, "t1", [assistant(t) for t in texts]))

    def ids(out: dict[str, Any]) -> list[str]:
        return [r["snippet"] for r in out["results"]]

    assert ids(grep(engine, sid, pattern="北京开")) == ["我们明天去北京开会"]  # a trigram: the FTS index
    assert ids(grep(engine, sid, pattern="北京")) == ["我们明天去北京开会"]  # shorter: the LIKE fallback
    assert ids(grep(engine, sid, pattern="天気")) == ["an ox, 東京の天気"]
    assert ids(grep(engine, sid, pattern="APPLE kiwi")) == ["apple cherry kiwi melon", "apple apple apple banana kiwi"]
    ranked = grep(engine, sid, pattern="apple", sort="relevance")
    assert ids(ranked)[0] == "apple apple apple banana kiwi" and ranked["results"][0]["score"] > 0
    assert ids(grep(engine, sid, pattern="ox")) == ["an ox, 東京の天気"]
    assert ids(grep(engine, sid, pattern="0% of a_")) == ["100% of a_b"]  # LIKE wildcards are literal
    assert ids(grep(engine, sid, pattern=r"ap+le\s+ch", mode="regex")) == ["apple cherry kiwi melon"]
    assert grep(engine, sid, pattern="(", mode="regex")["error"].startswith("invalid regular expression")
    assert grep(engine, sid, pattern="kiwi", limit=1000)["count"] == 2  # the limit is capped, not refused
    assert "error" in grep(engine, sid, pattern="kiwi", limit="many")
    assert "error" in grep(engine, sid, pattern="kiwi", sort="newest")
    assert "error" in grep(engine, sid, pattern="   ")
    assert grep(engine, sid, pattern="kiwi", search_in="summaries")["count"] == 0


def test_a_huge_tool_output_of_distinct_words_commits_and_stays_searchable(store: TranscriptStore, sid: str) -> None:
    """PostgreSQL refuses a word vector over 1 MiB: a ~2 MB file listing failed every commit of its turn
    (the turn stayed queued, the session ran on legacy for good). The word index reads the start of a
    text (revision 0008); a word past it is found by the trigram index, as any search also uses."""
    engine = make_engine(store)
    lines = [f"/var/lib/app/{uuid.uuid4().hex}/chunk-{n}.bin" for n in range(30_000)]
    listing = "\n".join(lines)
    assert len(listing.encode()) > 1_800_000
    turn = finished_turn(store, sid, "t1", [*tool_round("c1", listing), assistant("listed the files")])
    assert commit(store, engine, turn).status == "committed"
    check(store, sid)
    for line in (lines[0], lines[-1]):  # inside the word index's part of the text, and far past it
        word = line.split("/")[4]
        assert grep(engine, sid, pattern=word)["count"] == 1, word


def test_full_text_search_plans_for_its_terms(store: TranscriptStore, sid: str) -> None:
    """The store's PostgreSQL connections plan statements once for any values; a full-text search,
    whose best plan depends on its terms, switches its own transaction back to per-execution plans
    (and only that transaction). SQLite plans every statement for its values anyway."""
    engine = make_engine(store)
    commit(store, engine, finished_turn(store, sid, "t1", [assistant("apple cherry kiwi"), assistant("melon")]))

    def search(c: Core) -> tuple[list[str], str | None]:
        hits = search_module.grep(c, A, sid, "kiwi", mode="full_text", kinds=("message",), sort="recency", limit=5)
        mode = None if c.dialect.is_sqlite else c.conn.exec_driver_sql("SHOW plan_cache_mode").scalar()
        return [h.content for h in hits], mode

    found, mode = store.read(search)
    assert found == ["apple cherry kiwi"]
    if store.backend == "postgresql":
        assert mode == "auto"
        assert store.db.settings()["plan_cache_mode"] == "force_generic_plan"  # the next transaction's


def test_describe_and_expand_walk_the_dag_both_ways(store: TranscriptStore, sid: str) -> None:
    engine = make_engine(store, SMALL)
    run_turns(store, engine, sid, 30)
    for _ in range(6):
        engine.compact(scope=A, session_id=sid, force=True, token_budget=1200)

    def call(name: str, **args: Any) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(engine.handle_tool_call(name, args, scope=A, session_id=sid))
        return out

    context = engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000).messages
    top = context[0]["content"].split()[1]
    described = call("lcm_describe", id=top)
    assert described["kind"] == "condensed" and described["in_context"] and described["context_holder"] == top
    assert described["lineage"] == [top] and described["parent"] is None
    children = call("lcm_expand", id=top)
    assert [i["id"] for i in children["items"]] == described["children"]
    child = call("lcm_describe", id=described["children"][0])
    assert child["parent"] == top and not child["in_context"] and child["context_holder"] == top
    leaf = child
    while leaf["kind"] != "leaf":
        leaf = call("lcm_describe", id=leaf["children"][0])
    first = call("lcm_expand", id=leaf["id"], limit=1)
    assert first["total"] == leaf["source_messages"] and first["next_offset"] == 1
    rest = call("lcm_expand", id=leaf["id"], offset=1, limit=200)
    assert rest["next_offset"] is None and len(rest["items"]) == first["total"] - 1
    message = first["items"][0]
    about = call("lcm_describe", id=message["entry_id"])
    assert about["id"] == message["id"] and about["summarized_in"] == [leaf["id"]]
    assert about["context_holder"] == top and about["lineage"][0] == leaf["id"] and about["lineage"][-1] == top
    assert call("lcm_expand", id=message["id"])["items"][0]["entry_id"] == message["entry_id"]
    summary_hits = call("lcm_grep", pattern="Summary of", search_in="summaries")
    assert summary_hits["count"] > 0 and {r["kind"] for r in summary_hits["results"]} == {"summary"}
    assert "error" in call("lcm_describe", id="sum_99999")
    assert "error" in call("lcm_expand", id="nothing")
    assert "error" in call("lcm_nope")
    assert "error" in json.loads(engine.handle_tool_call("lcm_grep", ["x"], scope=A, session_id=sid))  # type: ignore[arg-type]


def test_engine_tools_reach_the_model_through_the_host(store: TranscriptStore, sid: str) -> None:
    model = RecordingModel()
    settings = load_settings(config_path=None, engine="lossless")
    host = HostRuntime(store, settings, model, registry=EngineRegistry(), summarizer=ExtractiveSummarizer(),
                       estimator=RoughEstimator())
    out = host.run_turn(A, sid, "please use tool lcm_grep now", turn_id="t1")
    assert out.engine_id == "lossless" and {"lcm_grep", "lcm_describe", "lcm_expand"} <= set(model.tools[0])
    answer = json.loads(out.messages[2]["content"])
    assert answer == {"error": "pattern must be a non-empty string"}  # the scripted model sends "query"
    assert "lossless" not in host.quarantined


class _TripleEstimator(RoughEstimator):
    """Counts three times what the rough estimator counts: another tokenizer than the one that stored."""

    def count_text(self, text: str) -> int:
        return 3 * super().count_text(text)


def test_assemble_fits_its_budget_by_todays_count_when_the_stored_counts_were_made_by_another_estimator(
    store: TranscriptStore, sid: str
) -> None:
    """Each message and summary is counted once, when stored, by that process's estimator. Read by a
    process counting with another (another tokenizer setting, another host on the same store), the
    stored counts said far less than the context cost: 7,603 tokens came back for a budget of 3,000,
    marked "assembled", nothing compacted (a review found it). Now the context counted as it goes out
    fits, compacted into summaries, and the recall hint says so."""
    for k in range(20):
        store.append_many(A, sid, [{"message": {"role": "user", "content": f"q{k} " + "words " * 40}},
                                   {"message": {"role": "assistant", "content": f"a{k} " + "reply " * 40}}])
    stored = make_engine(store).assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)
    assert len(stored.messages) == 40 and stored.estimated_tokens > 2_000
    ctx = EngineContext(store=store, config={}, summarizer=ExtractiveSummarizer(), estimator=_TripleEstimator())
    triple = LosslessEngine(ctx)
    result = triple.assemble(scope=A, session_id=sid, fence=None, token_budget=3_000)
    assert result.prompt_authority == "assembled"
    assert result.estimated_tokens == _TripleEstimator().count_messages(result.messages) <= 3_000
    assert result.system_prompt_addition is not None  # summaries made: the recall tools are named
    assert any(m["content"].startswith("q19 ") for m in result.messages)  # the latest turn is shown raw
    assert store.read(lambda c: audit(c, A, sid)).problems == []


class _DownSummarizer:
    """A summarizer whose model cannot be reached: nothing can be compacted."""

    def __getattr__(self, name: str) -> Any:
        def unreachable(*_args: Any, **_kwargs: Any) -> Any:
            raise SummarizerError("model unreachable")

        return unreachable


class _HeavierEstimator(RoughEstimator):
    """Counts a fifth more than the rough estimator."""

    def count_text(self, text: str) -> int:
        return int(super().count_text(text) * 1.2)


def test_a_message_over_the_budget_by_todays_count_comes_back_said_to_be_over_not_dropped(
    store: TranscriptStore, sid: str
) -> None:
    """Shrinking the stored counts' budget could cut the only message and answer an empty context marked
    ``assembled`` where the message came back before (a review found it): the last answer that showed
    something stands, marked ``preassembly_may_overflow``."""
    store.append_many(A, sid, [{"message": {"role": "user", "content": "word " * 800}}])
    stored = make_engine(store).assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)
    assert stored.estimated_tokens < 1_100  # stored by the rough estimator: it fits by that count
    ctx = EngineContext(store=store, config={}, summarizer=_DownSummarizer(), estimator=_HeavierEstimator())
    result = LosslessEngine(ctx).assemble(scope=A, session_id=sid, fence=None, token_budget=1_100)
    assert len(result.messages) == 1 and result.estimated_tokens > 1_100
    assert result.prompt_authority == "preassembly_may_overflow"


class _TwoPerMessage(RoughEstimator):
    """Counts every message as two tokens: a store whose counts say next to nothing."""

    def count_messages(self, messages: Any) -> int:
        return 2 * len(messages)


class _FiftyFold(RoughEstimator):
    """Counts fifty times what the rough estimator counts."""

    def count_text(self, text: str) -> int:
        return 50 * super().count_text(text)


@pytest.mark.parametrize("budget", [2, 5, 10])
def test_a_shrunk_budget_never_reaches_zero(store: TranscriptStore, sid: str, budget: int) -> None:
    """When today's count of the assembled list exceeds the budget by more than the budget itself (stored
    counts of 2, counted 157 now, a budget of 5), the stored counts' budget shrank to 0, and the next
    compaction pass asked for the marks of a window of 0: assemble raised InvalidInput for a valid budget
    (through the host, the engine was quarantined). It shrinks to 1 at least, and the last answer that
    showed something comes back, said to be over."""
    store.append_many(A, sid, [{"message": {"role": "user", "content": "hello there"}}])
    low = EngineContext(store=store, config={}, summarizer=ExtractiveSummarizer(), estimator=_TwoPerMessage())
    LosslessEngine(low).assemble(scope=A, session_id=sid, fence=None, token_budget=100)
    ctx = EngineContext(store=store, config={}, summarizer=ExtractiveSummarizer(), estimator=_FiftyFold())
    result = LosslessEngine(ctx).assemble(scope=A, session_id=sid, fence=None, token_budget=budget)
    assert len(result.messages) == 1 and result.estimated_tokens > budget
    assert result.prompt_authority == "preassembly_may_overflow"
