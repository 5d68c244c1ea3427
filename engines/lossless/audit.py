"""A consistency audit of one session's lossless state (for tests, crash checks and operators).

It reads the whole session (O(session), never on a turn's path) and reports what is wrong: context
items that point nowhere, messages covered twice by the context (raw and summarized, or by two
summaries), summaries without sources or children or unreachable from the context, and a view whose
counters disagree with the rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, Row, Table, select

from transcript_store.core import Core

from .context import load_items
from .tables import (
    View,
    context_items,
    message_id,
    messages,
    summaries,
    summary_children,
    summary_id,
    summary_sources,
)


@dataclass
class Audit:
    """What the audit found: problems (empty when consistent) and what the context covers."""

    problems: list[str] = field(default_factory=list)
    covered_entry_ids: set[str] = field(default_factory=set)
    context_items: int = 0
    summaries: int = 0
    messages: int = 0
    max_depth: int = 0


def audit(core: Core, scope: str, session_id: str) -> Audit:
    """Audit one session (see module doc)."""
    out = Audit()
    key = {"scope": scope, "session_id": session_id}

    def where(table: Table) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
        return table.c.scope == scope, table.c.session_id == session_id

    entry_of = {r.ordinal: r.entry_id for r in core.conn.execute(select(messages).where(*where(messages)))}
    rows = {r.summary_seq: r for r in core.conn.execute(select(summaries).where(*where(summaries)))}
    sources: dict[int, list[int]] = defaultdict(list)
    for r in core.conn.execute(select(summary_sources).where(*where(summary_sources))):
        sources[r.summary_seq].append(r.message_ordinal)
    children: dict[int, list[int]] = defaultdict(list)
    for r in core.conn.execute(select(summary_children).where(*where(summary_children))):
        children[r.parent_seq].append(r.child_seq)
    raw = core.conn.execute(select(context_items).where(*where(context_items))).all()
    out.messages, out.summaries, out.context_items = len(entry_of), len(rows), len(raw)
    out.max_depth = max((r.depth for r in rows.values()), default=0)
    for item in raw:
        if item.summary_seq is not None and item.summary_seq not in rows:
            out.problems.append(f"item {item.item_ordinal} points to a missing {summary_id(item.summary_seq)}")
        if item.message_ordinal is not None and item.message_ordinal not in entry_of:
            out.problems.append(f"item {item.item_ordinal} points to a missing {message_id(item.message_ordinal)}")
    for seq, row in rows.items():
        got = sources.get(seq, []) if row.kind == "leaf" else children.get(seq, [])
        if not got:
            out.problems.append(f"{summary_id(seq)} ({row.kind}) covers nothing")
        if row.kind == "leaf" and got and (min(got), max(got)) != (row.earliest_ordinal, row.latest_ordinal):
            out.problems.append(f"{summary_id(seq)} covers {min(got)}..{max(got)}, says {row.earliest_ordinal}..")

    def descendants(seq: int, seen: set[int]) -> list[int]:
        if seq in seen:
            out.problems.append(f"{summary_id(seq)} is its own descendant")
            return []
        seen.add(seq)
        found = list(sources.get(seq, []))
        for child in children.get(seq, []):
            found += descendants(child, seen)
        return found

    count: dict[int, int] = defaultdict(int)
    reached: set[int] = set()
    for item in raw:
        seen: set[int] = set()
        covered = [item.message_ordinal] if item.message_ordinal is not None else descendants(item.summary_seq, seen)
        reached |= seen
        for ordinal in covered:
            count[ordinal] += 1
    for ordinal, n in sorted(count.items()):
        if n > 1:
            out.problems.append(f"{message_id(ordinal)} is covered {n} times by the context (raw and summarized?)")
    # Every summary is in context or under one that is: a reset forgets the others (they cover
    # messages that left the active path), so none is left for the recall tools to find.
    for seq in sorted(set(rows) - reached):
        out.problems.append(f"{summary_id(seq)} is neither in context nor under a summary that is")
    out.covered_entry_ids = {entry_of[o] for o in count if o in entry_of}
    _audit_view(core, out, key, raw, entry_of, rows)
    return out


def _audit_view(
    core: Core, out: Audit, key: dict[str, str], raw: Sequence[Row[Any]], entry_of: dict[int, str],
    rows: dict[int, Row[Any]],
) -> None:
    view = View.load(core, key["scope"], key["session_id"])
    total = sum(i.tokens for i in load_items(core, key["scope"], key["session_id"]))
    if view.tokens != total:
        out.problems.append(f"view.tokens is {view.tokens}, the context holds {total}")
    if entry_of and view.next_ordinal <= max(entry_of):
        out.problems.append("view.next_ordinal is not past the last message")
    if rows and view.next_summary <= max(rows):
        out.problems.append("view.next_summary is not past the last summary")
    items = [i.item_ordinal for i in raw]
    if items and view.next_item <= max(items):
        out.problems.append("view.next_item is not past the last context item")
