"""A long synthetic conversation through the HostRuntime on the lossless engine, on both backends.

A seeded generator drives the turns (user messages with unique tokens, sometimes CJK, sometimes long;
a scripted model that calls a host tool with long results about a third of the time). Checked:
the context stays under the budget at every turn; two assemblies without a new turn are identical;
the projection epoch changes exactly when the summary prefix does; every original message is found by
lcm_grep on a token of its own and is reachable from the assembled context through lcm_expand; the
per-turn cost (SQL statements, context rows read) does not grow with the conversation's length.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import event
from workers.lossless_worker import SCOPE, TOKEN, make_host, user_text

from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from transcript_store import StoreConfig, TranscriptStore
from transcript_store.engine import AssembleResult

TOKEN_BUDGET = 4000
MAX_OUTPUT = 256
ASSEMBLE_BUDGET = TOKEN_BUDGET - MAX_OUTPUT
CONFIG = {
    "fresh_tail_messages": 6,
    "leaf_chunk_messages": 8,
    "leaf_chunk_tokens": 1500,
    "leaf_summary_tokens": 200,
    "condensed_summary_tokens": 300,
    "condense_fanin": 4,
}


@dataclass
class Run:
    """What a conversation did, turn by turn."""

    engine: LosslessEngine
    session_id: str
    statements: list[int] = field(default_factory=list)
    rows_read: list[int] = field(default_factory=list)
    assembled: list[AssembleResult] = field(default_factory=list)


def converse(store: TranscriptStore, turns: int, seed: int) -> Run:
    """Drive ``turns`` logical turns through the host; assert the budget at every one."""
    host, _model = make_host(store, seed=seed, token_budget=TOKEN_BUDGET, max_output_tokens=MAX_OUTPUT, config=CONFIG)
    sid = store.create_session(SCOPE, session_id=f"conv-{seed}").session_id
    engine, _info = host.engine("lossless")
    assert isinstance(engine, LosslessEngine)
    run = Run(engine, sid)
    real = engine.assemble

    def recording(**kw: Any) -> AssembleResult:
        result = real(**kw)
        run.assembled.append(result)
        return result

    engine.assemble = recording  # type: ignore[method-assign]
    executed = [0]

    def count(*_args: Any) -> None:
        executed[0] += 1

    event.listen(store.db.engine, "before_cursor_execute", count)
    rng = random.Random(seed)
    try:
        for n in range(turns):
            before, rows = executed[0], engine.stats["context_rows_read"]
            out = host.run_turn(SCOPE, sid, user_text(rng, n), turn_id=f"t{n}")
            assert (out.engine_id, out.degraded_reason, out.commit_status) == ("lossless", None, "committed")
            assert out.assembled_tokens <= ASSEMBLE_BUDGET, f"turn {n} over budget"
            run.statements.append(executed[0] - before)
            run.rows_read.append(engine.stats["context_rows_read"] - rows)
    finally:
        event.remove(store.db.engine, "before_cursor_execute", count)
    engine.assemble = real  # type: ignore[method-assign]
    # The host runs the engine's maintain (a compaction over the threshold) on its maintenance thread
    # after each reply: the checks that follow read a session that must not change under them (two
    # assemblies raced the last turn's compaction and differed, now and then, in the slow tier).
    assert host.maintenance.wait(60), "the last turn's maintenance did not finish"
    return run


def tool(run: Run, name: str, **args: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(run.engine.handle_tool_call(name, args, scope=SCOPE, session_id=run.session_id))
    assert "error" not in out, out
    return out


def check_stability(run: Run) -> AssembleResult:
    """Two assemblies without a new turn are byte-identical; the epoch moves with the summary prefix only."""
    first = run.engine.assemble(scope=SCOPE, session_id=run.session_id, fence=None, token_budget=ASSEMBLE_BUDGET)
    second = run.engine.assemble(scope=SCOPE, session_id=run.session_id, fence=None, token_budget=ASSEMBLE_BUDGET)
    assert json.dumps(first.model_dump(), ensure_ascii=False) == json.dumps(second.model_dump(), ensure_ascii=False)

    def prefix(result: AssembleResult) -> list[str]:
        return [m["content"] for m in result.messages if str(m.get("content") or "").startswith("[Summary sum_")]

    changes = 0
    for a, b in zip(run.assembled, run.assembled[1:], strict=False):
        assert a.context_projection is not None and b.context_projection is not None
        same = prefix(a) == prefix(b)
        assert (a.context_projection.epoch == b.context_projection.epoch) == same
        changes += not same
    assert changes > 0
    return first


def check_recall(store: TranscriptStore, run: Run, assembled: AssembleResult) -> None:
    """Every original message: found by a token of its own, and reachable from the context by expansion."""
    visible = store.read_visible(SCOPE, run.session_id)
    owners: dict[str, set[str]] = {}
    for entry in visible:
        for tok in set(TOKEN.findall(json.dumps(entry.message))):
            owners.setdefault(tok, set()).add(entry.entry_id)
    for entry in visible:
        own = sorted(t for t in set(TOKEN.findall(json.dumps(entry.message))) if owners[t] == {entry.entry_id})
        assert own, f"message {entry.entry_id} has no token of its own"
        hits = tool(run, "lcm_grep", pattern=own[0], search_in="messages", limit=200)
        assert entry.entry_id in {h["entry_id"] for h in hits["results"]}, own[0]
    by_message = {json.dumps(e.message, sort_keys=True): e.entry_id for e in visible}
    reached = {by_message[json.dumps(m, sort_keys=True)] for m in assembled.messages
               if json.dumps(m, sort_keys=True) in by_message}
    queue = deque(m["content"].split()[1] for m in assembled.messages
                  if str(m.get("content") or "").startswith("[Summary sum_"))
    while queue:
        sid, offset = queue.popleft(), 0
        while offset is not None:
            page = tool(run, "lcm_expand", id=sid, offset=offset, limit=200)
            for item in page["items"]:
                if item["kind"] == "message":
                    reached.add(item["entry_id"])
                else:
                    queue.append(item["id"])
            offset = page.get("next_offset")
    assert reached == {e.entry_id for e in visible}


def check_cost(run: Run, early: slice, late: slice) -> None:
    """The per-turn cost of the late turns is that of the early ones (amortized compaction included)."""

    def mean(values: list[int]) -> float:
        return sum(values) / len(values)

    assert mean(run.statements[late]) <= 1.25 * mean(run.statements[early]) + 3, (
        mean(run.statements[early]), mean(run.statements[late]))
    assert mean(run.rows_read[late]) <= 1.25 * mean(run.rows_read[early]) + 3
    assert max(run.rows_read[late]) <= max(run.rows_read[early]) + 8


def check_dag(store: TranscriptStore, run: Run) -> None:
    result = store.read(lambda c: audit(c, SCOPE, run.session_id))
    assert result.problems == []
    assert result.covered_entry_ids == {e.entry_id for e in store.read_visible(SCOPE, run.session_id)}
    assert result.summaries > 0 and result.max_depth >= 1


@pytest.fixture
def fast_store(store_url: str) -> Iterator[TranscriptStore]:
    """The test's database with commits that skip the disk flush (SQLite NORMAL, PostgreSQL synchronous_commit
    off): the statements and transactions are the same, only the fsyncs a crash test would need are not."""
    store = TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False, sqlite_synchronous="NORMAL"))
    if store.backend == "postgresql":

        @event.listens_for(store.db.engine, "connect")
        def _no_flush(dbapi_conn: Any, _record: Any) -> None:
            with dbapi_conn.cursor() as cur:
                cur.execute("SET synchronous_commit = off")
            dbapi_conn.commit()

    yield store
    store.close()


def test_a_long_conversation(fast_store: TranscriptStore) -> None:
    # 120 turns in make test (CI time): compaction runs from the first tens of turns, so both cost windows
    # are past it; the 2,000-turn conversation below runs in the slow tier.
    store = fast_store
    run = converse(store, 120, seed=7)
    assembled = check_stability(run)
    check_recall(store, run, assembled)
    check_cost(run, slice(30, 60), slice(90, 120))
    check_dag(store, run)


@pytest.mark.slow
def test_a_2000_turn_conversation(fast_store: TranscriptStore) -> None:
    store = fast_store
    run = converse(store, 2000, seed=11)
    assembled = check_stability(run)
    check_recall(store, run, assembled)
    check_cost(run, slice(100, 400), slice(1700, 2000))
    check_dag(store, run)
