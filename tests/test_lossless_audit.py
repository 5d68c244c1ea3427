"""``audit()`` sees every inconsistency of the lossless engine's tables, on both backends.

It checked dangling context items, messages covered twice, unreachable summaries and the view's
counters, and nothing of the DAG itself: a leaf at depth 1, a condensed summary at the wrong depth, a
``message_count`` or a range that is not what a summary covers, a source that is missing or is no
message of the engine's branch, context items out of position order all audited clean. Each test
here corrupts one thing with a real write to the database and finds it reported; a healthy engine
after many compactions, branches and rewrites audits clean.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from conftest import commit_with as commit
from conftest import finished_turn, module_store_fixtures, tool_round
from sqlalchemy import create_engine, event, insert, select, text, update

from engines.lossless import LosslessEngine
from engines.lossless.audit import Audit, audit
from engines.lossless.search import SLOT_ROWS
from engines.lossless.tables import View, context_items, messages, summaries, summary_children, summary_sources
from transcript_store import TranscriptStore
from transcript_store.core import Core
from transcript_store.engine import EngineContext
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

A = "scope-audit"
SMALL = {"fresh_tail_messages": 4, "leaf_chunk_messages": 4, "leaf_summary_tokens": 120,
         "condensed_summary_tokens": 160, "condense_fanin": 2}

shared_url, store, sid = module_store_fixtures(A, "lossless_audit")


def make_engine(store: TranscriptStore, config: dict[str, Any] | None = None) -> LosslessEngine:
    return LosslessEngine(EngineContext(store=store, config={**SMALL, **(config or {})},
                                        summarizer=ExtractiveSummarizer(), estimator=RoughEstimator()))


def check(store: TranscriptStore, sid: str) -> Audit:
    return store.read(lambda c: audit(c, A, sid))


def turn(store: TranscriptStore, engine: LosslessEngine, sid: str, i: int) -> None:
    done = {"role": "assistant", "content": f"done {i}"}
    replies = [*tool_round(f"call-{i}", f"result {i} " * 20), done] if i % 5 == 3 else None
    assert commit(store, engine, finished_turn(store, A, sid, f"t{i}", replies=replies)).status == "committed"


def rows(store: TranscriptStore, sid: str) -> dict[str, list[Any]]:
    """The session's summaries (by seq), source and child edges, context items (in order) and messages."""

    def run(c: Core) -> dict[str, list[Any]]:
        def where(t: Any) -> tuple[Any, Any]:
            return t.c.scope == A, t.c.session_id == sid

        return {
            "summaries": c.conn.execute(select(summaries).where(*where(summaries))
                                        .order_by(summaries.c.summary_seq)).all(),
            "sources": c.conn.execute(select(summary_sources).where(*where(summary_sources)).order_by(
                summary_sources.c.summary_seq, summary_sources.c.message_ordinal)).all(),
            "children": c.conn.execute(select(summary_children).where(*where(summary_children))
                                       .order_by(summary_children.c.parent_seq, summary_children.c.idx)).all(),
            "items": c.conn.execute(select(context_items).where(*where(context_items))
                                    .order_by(context_items.c.item_ordinal)).all(),
            "messages": c.conn.execute(select(messages).where(*where(messages)).order_by(messages.c.ordinal)).all(),
        }

    return store.read(run)


@pytest.fixture
def built(store: TranscriptStore, sid: str) -> dict[str, list[Any]]:
    """A session of 18 turns compacted into a DAG of depth 2 or more, with a raw tail; audits clean."""
    engine = make_engine(store)
    for i in range(18):
        turn(store, engine, sid, i)
    for budget in (1600, 1000):
        assert engine.compact(scope=A, session_id=sid, force=True, token_budget=budget).compacted
    found = rows(store, sid)
    kinds = [s.kind for s in found["summaries"]]
    assert kinds.count("condensed") >= 2 and kinds.count("leaf") >= 3, kinds
    assert max(s.depth for s in found["summaries"]) >= 2
    assert sum(i.message_ordinal is not None for i in found["items"]) >= 4
    assert check(store, sid).problems == []
    return found


# ---------------------------------------------------------------------------------------------- corruptions

Corrupt = Callable[[TranscriptStore, str, dict[str, list[Any]]], str]


def _key(table: Any, sid: str) -> tuple[Any, Any]:
    return table.c.scope == A, table.c.session_id == sid


def _set_summary(store: TranscriptStore, sid: str, seq: int, **values: Any) -> None:
    store.write(lambda c: c.conn.execute(
        update(summaries).where(*_key(summaries, sid), summaries.c.summary_seq == seq).values(**values)))


def _leaf(found: dict[str, list[Any]]) -> Any:
    return next(s for s in found["summaries"] if s.kind == "leaf")


def _condensed(found: dict[str, list[Any]]) -> Any:
    return next(s for s in found["summaries"] if s.kind == "condensed")


def _raw_items(found: dict[str, list[Any]]) -> list[Any]:
    return [i for i in found["items"] if i.message_ordinal is not None]


def leaf_depth(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    leaf = _leaf(found)
    _set_summary(store, sid, leaf.summary_seq, depth=1)
    return rf"sum_{leaf.summary_seq} is a leaf at depth 1, not 0"


def condensed_depth(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    top = max(found["summaries"], key=lambda s: s.depth)
    _set_summary(store, sid, top.summary_seq, depth=top.depth + 1)
    return rf"sum_{top.summary_seq} is condensed at depth {top.depth + 1}, its children make it {top.depth}"


def leaf_count(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    leaf = _leaf(found)
    _set_summary(store, sid, leaf.summary_seq, message_count=leaf.message_count + 1)
    return rf"sum_{leaf.summary_seq} says it covers {leaf.message_count + 1} messages, it covers {leaf.message_count}"


def condensed_count(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    top = _condensed(found)
    _set_summary(store, sid, top.summary_seq, message_count=top.message_count - 1)
    return rf"sum_{top.summary_seq} says it covers {top.message_count - 1} messages, it covers {top.message_count}"


def condensed_earliest(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    top = _condensed(found)
    _set_summary(store, sid, top.summary_seq, earliest_ordinal=top.earliest_ordinal + 1)
    return (rf"sum_{top.summary_seq} says msg_{top.earliest_ordinal + 1}\.\.msg_{top.latest_ordinal}, "
            rf"its children cover msg_{top.earliest_ordinal}\.\.msg_{top.latest_ordinal}")


def condensed_latest(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    top = _condensed(found)
    _set_summary(store, sid, top.summary_seq, latest_ordinal=top.latest_ordinal + 7)
    return (rf"sum_{top.summary_seq} says msg_{top.earliest_ordinal}\.\.msg_{top.latest_ordinal + 7}, "
            rf"its children cover msg_{top.earliest_ordinal}\.\.msg_{top.latest_ordinal}")


def _move_source(store: TranscriptStore, sid: str, source: Any, to: int) -> None:
    store.write(lambda c: c.conn.execute(
        update(summary_sources).where(*_key(summary_sources, sid), summary_sources.c.summary_seq == source.summary_seq,
                                      summary_sources.c.message_ordinal == source.message_ordinal)
        .values(message_ordinal=to)))


def missing_source(store: TranscriptStore, sid: str, found: dict[str, list[Any]], url: str) -> str:
    source = found["sources"][0]
    unchecked(url, update(summary_sources).where(
        *_key(summary_sources, sid), summary_sources.c.summary_seq == source.summary_seq,
        summary_sources.c.message_ordinal == source.message_ordinal).values(message_ordinal=10**6))
    return rf"sum_{source.summary_seq}: source msg_1000000 is missing"


def missing_child(store: TranscriptStore, sid: str, found: dict[str, list[Any]], url: str) -> str:
    edge = found["children"][0]
    unchecked(url, update(summary_children).where(
        *_key(summary_children, sid), summary_children.c.parent_seq == edge.parent_seq,
        summary_children.c.child_seq == edge.child_seq).values(child_seq=10**6))
    return rf"sum_{edge.parent_seq}: child sum_1000000 is missing"


def unchecked(url: str, statement: Any) -> None:
    """A write the schema's foreign keys would refuse, as a database that lost them takes it: SQLite
    without ``PRAGMA foreign_keys`` (a plain connection), PostgreSQL with its triggers off (replica role)."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SET LOCAL session_replication_role = replica"))
            conn.execute(statement)
    finally:
        engine.dispose()


def source_off_the_branch(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    """A source that is a stored message, but of another branch of the transcript (as an abandoned
    branch's message would be, had a reset not deleted it)."""
    head = store.read_visible(A, sid)[-1].entry_id
    fork = next(m for m in found["messages"] if m.position == 3)
    store.branch(A, sid, store.read_visible(A, sid)[2].entry_id)
    side = store.append(A, sid, {"role": "user", "content": "a message on a side branch"})
    store.branch(A, sid, head)  # back: the engine's branch is the active one again, no reset pending
    ordinal = 10_000
    store.write(lambda c: c.conn.execute(insert(messages).values(
        scope=A, session_id=sid, ordinal=ordinal, entry_id=side.entry_id, generation=fork.generation,
        position=side.position, role="user", content="a message on a side branch", message="{}", tokens=5,
        created_us=fork.created_us)))
    source = next(s for s in found["sources"] if s.message_ordinal == fork.ordinal)
    _move_source(store, sid, source, ordinal)
    assert side.position == 3
    return rf"msg_{ordinal} \(entry {re.escape(side.entry_id)}\) is not at position 3 of the branch the engine imported"


def source_covered_raw(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    """A leaf's source moved to a message of the raw tail: the leaf covers what it does not summarize."""
    source = found["sources"][0]
    tail = _raw_items(found)[-1].message_ordinal
    _move_source(store, sid, source, tail)
    return rf"item \d+ covers msg_{tail} at position \d+, the next position is \d+"


def items_out_of_order(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    first, second = _raw_items(found)[-2:]

    def swap(c: Core) -> None:  # through a free ordinal: the item ordinals are the table's key
        def move(start: int, to: int) -> None:
            c.conn.execute(update(context_items).where(*_key(context_items, sid), context_items.c.item_ordinal == start)
                           .values(item_ordinal=to))

        move(first.item_ordinal, 10**6)
        move(second.item_ordinal, first.item_ordinal)
        move(10**6, second.item_ordinal)

    store.write(swap)
    position = next(m.position for m in found["messages"] if m.ordinal == second.message_ordinal)
    return rf"item {first.item_ordinal} covers msg_{second.message_ordinal} at position {position}, " \
           rf"the next position is {position - 1}"


def message_moved(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    ordinal = _raw_items(found)[-1].message_ordinal
    store.write(lambda c: c.conn.execute(update(messages).where(*_key(messages, sid), messages.c.ordinal == ordinal)
                                         .values(position=messages.c.position + 100)))
    return rf"msg_{ordinal} \(entry [^)]+\) is not at position \d+ of the branch the engine imported"


def child_in_context(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    edge = found["children"][0]
    store.write(lambda c: c.conn.execute(insert(context_items).values(
        scope=A, session_id=sid, item_ordinal=10_000, message_ordinal=None, summary_seq=edge.child_seq)))
    return rf"item 10000: sum_{edge.child_seq} is in context and under sum_{edge.parent_seq}"


def leaf_with_children(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    """A leaf given a child: the child has no parent yet (one in context), and the edge makes a cycle."""
    leaf = _leaf(found)
    top = next(i.summary_seq for i in found["items"] if i.summary_seq is not None)
    store.write(lambda c: c.conn.execute(insert(summary_children).values(
        scope=A, session_id=sid, parent_seq=leaf.summary_seq, child_seq=top, idx=0)))
    return rf"sum_{leaf.summary_seq} is a leaf with children"


def unknown_level(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    leaf = _leaf(found)
    _set_summary(store, sid, leaf.summary_seq, level="bogus")
    return rf"sum_{leaf.summary_seq} has the unknown level 'bogus'"


def not_smaller(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    leaf = _leaf(found)
    _set_summary(store, sid, leaf.summary_seq, source_tokens=leaf.tokens)
    return (rf"sum_{leaf.summary_seq} is empty or not smaller than what it replaced "
            rf"\({leaf.tokens} of {leaf.tokens} tokens\)")


def view_position(store: TranscriptStore, sid: str, found: dict[str, list[Any]]) -> str:
    def move(c: Core) -> None:
        view = View.load(c, A, sid)
        view.position -= 1
        view.save(c, A, sid)

    store.write(move)
    return r"view\.position is \d+, the context covers \d+ messages"


CORRUPTIONS: dict[str, Corrupt] = {f.__name__: f for f in (
    leaf_depth, condensed_depth, leaf_count, condensed_count, condensed_earliest, condensed_latest,
    source_off_the_branch, source_covered_raw, items_out_of_order, message_moved, child_in_context,
    leaf_with_children, unknown_level, not_smaller, view_position,
)}
UNCHECKED = {f.__name__: f for f in (missing_source, missing_child)}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_audit_reports_a_corrupted_row(
    store: TranscriptStore, sid: str, built: dict[str, list[Any]], corruption: str
) -> None:
    expected = CORRUPTIONS[corruption](store, sid, built)
    problems = check(store, sid).problems
    assert any(re.fullmatch(expected, p) for p in problems), (expected, problems)


@pytest.mark.parametrize("corruption", list(UNCHECKED))
def test_audit_reports_a_row_the_foreign_keys_would_have_refused(
    store: TranscriptStore, sid: str, built: dict[str, list[Any]], shared_url: str, corruption: str
) -> None:
    """The schema's foreign keys keep sources and children pointing at rows; a database that lost them
    (a restore without constraints, SQLite without its pragma) is audited all the same."""
    expected = UNCHECKED[corruption](store, sid, built, shared_url)
    problems = check(store, sid).problems
    assert any(re.fullmatch(expected, p) for p in problems), (expected, problems)


# ---------------------------------------------------------------------------------------------- health


# Each move and every budget comes by turn 30 (a forced compaction every fifth turn); sixty turns, a
# forced one every tenth, in the slow tier.
@pytest.mark.parametrize("turns", [30, pytest.param(60, marks=pytest.mark.slow)])
def test_a_healthy_engine_audits_clean_after_many_compactions(store: TranscriptStore, sid: str, turns: int) -> None:
    """Thirty turns (sixty in the slow tier) with tool calls, background compaction after each, forced ones
    at several budgets, a regenerated reply, a redaction, a branch: after every step the audit finds
    nothing, pending resets included, and the context covers exactly the visible transcript once the
    engine has imported it."""
    engine = make_engine(store, {"context_window": 1200})
    every = turns // 6
    for i in range(turns):
        turn(store, engine, sid, i)
        engine.maintain(scope=A, session_id=sid)
        if i % every == every - 1:
            engine.compact(scope=A, session_id=sid, force=True, token_budget=[600, 900, 2000][i // every % 3])
        if i == turns * 2 // 5:  # regenerate the last reply
            visible = store.read_visible(A, sid)
            store.branch(A, sid, visible[-2].entry_id)
            store.append(A, sid, {"role": "assistant", "content": "a regenerated answer"})
        if i == 4 * every - 1:  # redact a message that is summarized by now
            visible = store.read_visible(A, sid)
            store.rewrite_entries(A, sid, [{"entry_id": visible[10].entry_id,
                                            "message": {"role": "user", "content": "[redacted]"}}])
        if i == 5 * every - 1:  # branch back a few turns
            store.branch(A, sid, store.read_visible(A, sid)[-7].entry_id)
        result = check(store, sid)  # right after a move, too: a pending reset is no inconsistency
        assert result.problems == [], (i, result.problems)
    engine.assemble(scope=A, session_id=sid, fence=None, token_budget=100_000)
    result = check(store, sid)
    assert result.problems == []
    assert result.covered_entry_ids == {e.entry_id for e in store.read_visible(A, sid)}
    assert result.max_depth >= 2 and result.summaries >= 10, result


# ---------------------------------------------------------------------------------------------- the search index


def _search_slot(store: TranscriptStore, sid: str) -> int:
    return int(store.read(lambda c: c.conn.execute(
        text("SELECT slot FROM ts_lcm_search_slots WHERE scope = :a AND session_id = :s"), {"a": A, "s": sid}
    ).scalar_one()))


def _on_search(store: TranscriptStore, sql: str, **params: Any) -> None:
    store.write(lambda c: c.conn.execute(text(sql), params))


SEARCH_CORRUPTIONS = {
    # a message's row gone from the index: a search never finds it
    "missing": ("DELETE FROM ts_lcm_search WHERE rowid = :first + :ref", r"msg_{ref} is not in the search index"),
    # its indexed text another: found by text it does not hold
    "stale": ("UPDATE ts_lcm_search SET content = 'nothing of the kind' WHERE rowid = :first + :ref",
              r"msg_{ref} is in the search index with other text"),
    # a row the session does not store, in the session's range
    "extra": ("INSERT INTO ts_lcm_search (rowid, content) VALUES (:first + 999999, 'a ghost')",
              r"the search index holds msg_999999, which is not stored"),
}


@pytest.mark.parametrize("corruption", list(SEARCH_CORRUPTIONS))
def test_audit_reports_a_search_index_out_of_step_with_the_rows(
    store: TranscriptStore, sid: str, built: dict[str, list[Any]], corruption: str
) -> None:
    """SQLite's full-text index is kept by triggers (a restore or a hand edit without them is not): a row
    it lacks is never found by a search, one it holds other text for is found by words it does not say;
    the audit compares the two (in SQL). PostgreSQL's search column is generated: nothing to corrupt."""
    if store.backend != "sqlite":
        pytest.skip("the full-text index table is SQLite's (PostgreSQL's search column is generated)")
    ref = built["messages"][3].ordinal
    sql, expected = SEARCH_CORRUPTIONS[corruption]
    _on_search(store, sql, first=_search_slot(store, sid) * SLOT_ROWS, ref=ref)
    problems = check(store, sid).problems
    assert any(re.fullmatch(expected.format(ref=ref), p) for p in problems), problems


def test_audit_reports_a_session_missing_from_the_search_index(store: TranscriptStore, sid: str) -> None:
    """Rows whose session has no slot at all (the slots table restored without it): nothing of it is found."""
    if store.backend != "sqlite":
        pytest.skip("the full-text index table is SQLite's (PostgreSQL's search column is generated)")
    engine = make_engine(store)
    for i in range(3):
        turn(store, engine, sid, i)
    assert check(store, sid).problems == []
    slot = _search_slot(store, sid)
    _on_search(store, "DELETE FROM ts_lcm_search_slots WHERE scope = :a AND session_id = :s", a=A, s=sid)
    try:
        problems = check(store, sid).problems
    finally:  # the module's store is shared: a later session would be given this slot and collide
        _on_search(store, "INSERT INTO ts_lcm_search_slots (slot, scope, session_id) VALUES (:n, :a, :s)",
                   n=slot, a=A, s=sid)
    assert check(store, sid).problems == []
    assert any(re.fullmatch(r"the search index has no slot for the session's \d+ messages and 0 summaries", p)
               for p in problems), problems


def test_audit_reads_no_text(store: TranscriptStore, sid: str, built: dict[str, list[Any]]) -> None:
    """The audit reads the rows' keys and links, never a message's or summary's text nor an entry's payload:
    it read every payload of the transcript (hundreds of MB for a session of large tool outputs) and every
    summary's text, to keep none of it. Its result is the same."""
    columns: list[str] = []

    def after(_conn: Any, cursor: Any, *_rest: Any) -> None:
        columns.extend(d[0] for d in cursor.description or ())

    event.listen(store.db.engine, "after_cursor_execute", after)
    try:
        result = check(store, sid)
    finally:
        event.remove(store.db.engine, "after_cursor_execute", after)
    assert result.problems == [] and result.messages == len(built["messages"])
    assert columns and not {"payload", "content", "message"} & set(columns), sorted(set(columns))
