"""A consistency audit of one session's lossless state (for tests, crash checks and operators).

It reads the whole session (O(session), never on a turn's path): the engine's rows, and the
transcript's entries for the branch the engine imported. It reports, one line per problem:

- context items: each is one message or one summary that exists, a summary in context is under no
  other; in order they cover the stored messages at positions 0, 1, 2, ... each once (a message
  covered twice, raw and summarized or by two summaries, is reported as such), every stored message;
- summaries: a leaf has sources, no children and depth 0; a condensed summary has children (each
  with one parent at most), no sources and depth 1 + its deepest child's; the range (earliest and
  latest ordinal) a summary states is that of its sources, a condensed one's exactly its children's;
  its ``message_count`` is the number of messages it covers; it has a known level, some text, and
  fewer tokens than what it replaced; it is in context or under a summary that is; no cycle;
- messages: each one's entry is on the branch the engine imported (the path to its cursor's entry,
  which a pending reset has not moved yet) at the position the row states, so a leaf's sources are
  messages of that branch;
- the view: counters past the rows, tokens and position those of the context, its cursor's position;
- the search index (SQLite: its triggers keep it; PostgreSQL's search column is generated): each
  message and summary is in it under its own rowid with its own text, and it holds nothing else of
  the session;
- the ``hidden`` mark (revision 0016): a message is marked exactly when the host keeps it out of the
  model's context (``models.out_of_context``), which the recall tools go by.

No text is downloaded but the stored message of a row marked hidden or holding the marker
(``excludeFromContext``), one at a time: summaries and messages are read without their content, the
transcript's entries without their payloads, and the search index is compared with the rows in SQL.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, Row, Table, func, inspect, or_, select, text, true

from transcript_store.core import Core
from transcript_store.cursors import decode_cursor
from transcript_store.models import out_of_context
from transcript_store.schema import entries

from .search import KIND_ROWS, KIND_SPAN, SLOT_ROWS, Kind
from .tables import (
    View,
    context_items,
    message_id,
    messages,
    rows_of,
    summaries,
    summary_children,
    summary_id,
    summary_sources,
)

LEVELS = ("normal", "aggressive", "truncated")
_MESSAGE_COLUMNS = (messages.c.ordinal, messages.c.entry_id, messages.c.position, messages.c.tokens)  # no text
#: what audit reads of a summary: everything but its text, and whether it has any
_SUMMARY_COLUMNS = (
    *(c for c in summaries.c if c.name != "content"),
    (func.length(summaries.c.content) > 0).label("has_content"),
)
_LINK_COLUMNS = (entries.c.seq, entries.c.entry_id, entries.c.parent_id, entries.c.kind, entries.c.position)
_ENTRY_PAGE = 5000  # entries per read (their links only: no payload)


@dataclass
class Audit:
    """What the audit found: problems (empty when consistent) and what the context covers."""

    problems: list[str] = field(default_factory=list)
    covered_entry_ids: set[str] = field(default_factory=set)
    context_items: int = 0
    summaries: int = 0
    messages: int = 0
    max_depth: int = 0


@dataclass
class _Rows:
    """The session's engine rows, and what each summary covers (computed once, cycles reported once)."""

    msgs: dict[int, Any]  # ordinal -> (ordinal, entry_id, position, tokens)
    sums: dict[int, Row[Any]]
    sources: dict[int, list[int]]
    children: dict[int, list[int]]  # in idx order
    parents: dict[int, list[int]]
    items: Sequence[Row[Any]]  # in item order
    cycles: set[int] = field(default_factory=set)
    _covered: dict[int, list[int]] = field(default_factory=dict)

    def covered(self, seq: int, stack: frozenset[int] = frozenset()) -> list[int]:
        """The message ordinals under a summary, in order: a leaf's sources by position, children in turn."""
        if seq in self._covered:
            return self._covered[seq]
        if seq in stack:
            self.cycles.add(seq)
            return []
        out = sorted(self.sources.get(seq, []), key=lambda o: (self.position(o), o))
        for child in self.children.get(seq, []):
            out += self.covered(child, stack | {seq})
        self._covered[seq] = out
        return out

    def position(self, ordinal: int) -> int:
        """A stored message's position (-1 for a missing one)."""
        row = self.msgs.get(ordinal)
        return -1 if row is None else int(row.position)


def audit(core: Core, scope: str, session_id: str) -> Audit:
    """Audit one session (see module doc)."""
    rows = _load(core, scope, session_id)
    out = Audit(messages=len(rows.msgs), summaries=len(rows.sums), context_items=len(rows.items))
    out.max_depth = max((r.depth for r in rows.sums.values()), default=0)
    view = View.load(core, scope, session_id)
    _audit_summaries(out, rows)
    chain = _audit_items(out, rows)
    out.problems += [f"{summary_id(seq)} is its own descendant" for seq in sorted(rows.cycles)]
    out.covered_entry_ids = {rows.msgs[o].entry_id for o in chain if o in rows.msgs}
    _audit_branch(core, out, scope, session_id, view, rows)
    _audit_view(out, view, rows, chain)
    _audit_search(core, out, scope, session_id, rows)
    _audit_hidden(core, out, scope, session_id)
    return out


def _load(core: Core, scope: str, session_id: str) -> _Rows:
    def where(table: Table) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
        return table.c.scope == scope, table.c.session_id == session_id

    sources: dict[int, list[int]] = defaultdict(list)
    for r in core.conn.execute(select(summary_sources).where(*where(summary_sources))):
        sources[r.summary_seq].append(r.message_ordinal)
    children: dict[int, list[int]] = defaultdict(list)
    parents: dict[int, list[int]] = defaultdict(list)
    edges = select(summary_children).where(*where(summary_children)).order_by(summary_children.c.idx)
    for r in core.conn.execute(edges):
        children[r.parent_seq].append(r.child_seq)
        parents[r.child_seq].append(r.parent_seq)
    ci = context_items.c
    return _Rows(
        msgs={r.ordinal: r for r in core.conn.execute(select(*_MESSAGE_COLUMNS).where(*where(messages)))},
        sums={r.summary_seq: r for r in core.conn.execute(select(*_SUMMARY_COLUMNS).where(*where(summaries)))},
        sources=sources,
        children=children,
        parents=parents,
        items=core.conn.execute(select(context_items).where(*where(context_items)).order_by(ci.item_ordinal)).all(),
    )


def _audit_summaries(out: Audit, rows: _Rows) -> None:
    for seq, row in sorted(rows.sums.items()):
        name = summary_id(seq)
        if row.kind == "leaf":
            _audit_leaf(out, rows, seq, row)
        else:
            _audit_condensed(out, rows, seq, row)
        got = rows.covered(seq)
        out.problems += [f"{name} covers {message_id(o)} {n} times" for o, n in sorted(Counter(got).items()) if n > 1]
        if row.message_count != len(got):
            out.problems.append(f"{name} says it covers {row.message_count} messages, it covers {len(got)}")
        if len(rows.parents.get(seq, [])) > 1:
            out.problems.append(f"{name} has {len(rows.parents[seq])} parents: "
                                + ", ".join(map(summary_id, rows.parents[seq])))
        if row.level not in LEVELS:
            out.problems.append(f"{name} has the unknown level {row.level!r}")
        if not row.has_content or row.tokens >= row.source_tokens:
            out.problems.append(f"{name} is empty or not smaller than what it replaced "
                                f"({row.tokens} of {row.source_tokens} tokens)")


def _audit_leaf(out: Audit, rows: _Rows, seq: int, row: Row[Any]) -> None:
    name, got = summary_id(seq), rows.sources.get(seq, [])
    if not got:
        out.problems.append(f"{name} ({row.kind}) covers nothing")
    if rows.children.get(seq):
        out.problems.append(f"{name} is a leaf with children")
    if row.depth != 0:
        out.problems.append(f"{name} is a leaf at depth {row.depth}, not 0")
    out.problems += [f"{name}: source {message_id(o)} is missing" for o in sorted(got) if o not in rows.msgs]
    if got and (min(got), max(got)) != (row.earliest_ordinal, row.latest_ordinal):
        out.problems.append(f"{name} says {_range(row.earliest_ordinal, row.latest_ordinal)}, "
                            f"its sources are {_range(min(got), max(got))}")


def _audit_condensed(out: Audit, rows: _Rows, seq: int, row: Row[Any]) -> None:
    name, kids = summary_id(seq), rows.children.get(seq, [])
    if not kids:
        out.problems.append(f"{name} ({row.kind}) covers nothing")
    if rows.sources.get(seq):
        out.problems.append(f"{name} is condensed and has sources")
    out.problems += [f"{name}: child {summary_id(k)} is missing" for k in kids if k not in rows.sums]
    found = [rows.sums[k] for k in kids if k in rows.sums]
    if not found:
        return
    depth = 1 + max(k.depth for k in found)
    if row.depth != depth:
        out.problems.append(f"{name} is condensed at depth {row.depth}, its children make it {depth}")
    span = min(k.earliest_ordinal for k in found), max(k.latest_ordinal for k in found)
    if (row.earliest_ordinal, row.latest_ordinal) != span:
        out.problems.append(f"{name} says {_range(row.earliest_ordinal, row.latest_ordinal)}, "
                            f"its children cover {_range(*span)}")


def _range(earliest: int, latest: int) -> str:
    return f"{message_id(earliest)}..{message_id(latest)}"


def _audit_items(out: Audit, rows: _Rows) -> list[int]:
    """Check the context list; returns the message ordinals it covers, in order, each once."""
    chain: list[int] = []
    for item in rows.items:
        where = f"item {item.item_ordinal}"
        if (item.message_ordinal is None) == (item.summary_seq is None):
            out.problems.append(f"{where} is not exactly one message or one summary")
        elif item.summary_seq is not None:
            if item.summary_seq not in rows.sums:
                out.problems.append(f"{where} points to a missing {summary_id(item.summary_seq)}")
            elif rows.parents.get(item.summary_seq):
                out.problems.append(f"{where}: {summary_id(item.summary_seq)} is in context and under "
                                    + ", ".join(map(summary_id, rows.parents[item.summary_seq])))
            chain += rows.covered(item.summary_seq)
        else:
            if item.message_ordinal not in rows.msgs:
                out.problems.append(f"{where} points to a missing {message_id(item.message_ordinal)}")
            chain.append(item.message_ordinal)
    _audit_order(out, rows)
    counts = Counter(chain)
    for ordinal, n in sorted(counts.items()):
        if n > 1:
            out.problems.append(f"{message_id(ordinal)} is covered {n} times by the context (raw and summarized?)")
    for ordinal in sorted(set(rows.msgs) - set(counts)):
        out.problems.append(f"{message_id(ordinal)} is stored but the context does not reach it")
    _audit_reach(out, rows)
    return list(counts)


def _audit_order(out: Audit, rows: _Rows) -> None:
    """In item order, the context covers the stored messages at positions 0, 1, 2, ...: each break is reported."""
    expected = 0
    for item in rows.items:
        covered = rows.covered(item.summary_seq) if item.summary_seq is not None else [item.message_ordinal]
        for ordinal in (o for o in covered if o in rows.msgs):
            position = rows.position(ordinal)
            if position != expected:  # out of position order, or a gap, or an overlap
                out.problems.append(f"item {item.item_ordinal} covers {message_id(ordinal)} at position "
                                    f"{position}, the next position is {expected}")
            expected = position + 1


def _audit_reach(out: Audit, rows: _Rows) -> None:
    # Every summary is in context or under one that is: a reset forgets the others (they cover
    # messages that left the active path), so none is left for the recall tools to find.
    reached: set[int] = set()
    todo = [i.summary_seq for i in rows.items if i.summary_seq is not None]
    while todo:
        seq = todo.pop()
        if seq not in reached:
            reached.add(seq)
            todo += rows.children.get(seq, [])
    for seq in sorted(set(rows.sums) - reached):
        out.problems.append(f"{summary_id(seq)} is neither in context nor under a summary that is")


def _audit_branch(core: Core, out: Audit, scope: str, session_id: str, view: View, rows: _Rows) -> None:
    """Each message's entry is on the branch the engine imported (the path to its cursor's entry), at its position.

    Not the active path: a branch or rewrite not imported yet (a pending reset) leaves the engine's
    rows true to the path it read, which the next import or recall tool then cuts back.
    """
    state = None if view.cursor is None else decode_cursor(view.cursor)
    if state is None:
        if rows.msgs:
            out.problems.append(f"{len(rows.msgs)} messages are stored, the view has no cursor")
        return
    if state.last_position != view.position:
        out.problems.append(f"view.position is {view.position}, its cursor's {state.last_position}")
    branch = _branch(core, scope, session_id, state.last_seq) if rows.msgs else {}
    for ordinal, row in sorted(rows.msgs.items()):
        if branch.get(row.position) != row.entry_id:
            out.problems.append(f"{message_id(ordinal)} (entry {row.entry_id}) is not at position {row.position} "
                                "of the branch the engine imported")


def _branch(core: Core, scope: str, session_id: str, last_seq: int) -> dict[int, str]:
    """position -> entry id of the message entries on the path from the root to the entry ``last_seq``.

    Only the entries' links are read, a page at a time: reading the rows read every payload of the
    transcript (a session of large tool outputs: hundreds of MB over the wire, to keep none of it).
    """
    links: dict[str, tuple[str | None, int | None]] = {}  # entry id -> (parent id, message position)
    start: str | None = None
    after = -1
    e = entries.c
    while True:
        page = core.conn.execute(
            select(*_LINK_COLUMNS)
            .where(e.scope == scope, e.session_id == session_id, e.seq > after)
            .order_by(e.seq)
            .limit(_ENTRY_PAGE)
        ).all()
        if not page:
            break
        for r in page:
            message = r.kind == "message" and r.position is not None
            links[r.entry_id] = (r.parent_id, int(r.position) if message else None)
            if r.seq == last_seq:
                start = r.entry_id
        after = page[-1].seq
    out: dict[int, str] = {}
    entry = start
    for _ in range(len(links)):  # a path is no longer than the session (a cycle would be)
        if entry is None or entry not in links:
            break
        parent, position = links[entry]
        if position is not None:
            out[position] = entry
        entry = parent
    return out


def _audit_view(out: Audit, view: View, rows: _Rows, chain: list[int]) -> None:
    total = sum(_item_tokens(rows, item) for item in rows.items)
    if view.tokens != total:
        out.problems.append(f"view.tokens is {view.tokens}, the context holds {total}")
    if view.position != len(chain) - 1:
        out.problems.append(f"view.position is {view.position}, the context covers {len(chain)} messages")
    if rows.msgs and view.next_ordinal <= max(rows.msgs):
        out.problems.append("view.next_ordinal is not past the last message")
    if rows.sums and view.next_summary <= max(rows.sums):
        out.problems.append("view.next_summary is not past the last summary")
    items = [i.item_ordinal for i in rows.items]
    if items and view.next_item <= max(items):
        out.problems.append("view.next_item is not past the last context item")


def _item_tokens(rows: _Rows, item: Row[Any]) -> int:
    """An item's tokens as assemble counts them (a summary's if it names one, else its message's; 0 if missing)."""
    summary = item.summary_seq is not None
    row = rows.sums.get(item.summary_seq) if summary else rows.msgs.get(item.message_ordinal)
    return 0 if row is None else int(row.tokens)


#: kind -> (its table, its key column, how a problem names a row)
_SEARCHED: dict[Kind, tuple[Table, str, Callable[[int], str]]] = {
    "message": (messages, "ordinal", message_id),
    "summary": (summaries, "summary_seq", summary_id),
}


def _audit_search(core: Core, out: Audit, scope: str, session_id: str, rows: _Rows) -> None:
    """SQLite: the full-text index holds every message and summary of the session under its rowid
    (the session's slot, the kind's half of it, the row's key: revision 0012) with the row's text, and
    nothing else in the session's rowid range. A search finds candidates there only: a row missing
    from it is never found, one whose indexed text differs is found by text it no longer has.
    Compared in SQL, so no text crosses the wire; PostgreSQL's search column is generated."""
    if not core.dialect.is_sqlite:
        return
    slots = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'ts_lcm_search_slots'"
    if core.conn.execute(text(slots)).first() is None:
        return  # a schema before revision 0012, whose index is keyed otherwise (its upgrade rebuilds it)
    key = {"scope": scope, "session_id": session_id}
    slot = core.conn.execute(
        text("SELECT slot FROM ts_lcm_search_slots WHERE scope = :scope AND session_id = :session_id"), key
    ).scalar()
    if slot is None:
        if rows.msgs or rows.sums:
            out.problems.append(f"the search index has no slot for the session's {len(rows.msgs)} messages"
                                f" and {len(rows.sums)} summaries")
        return
    for kind, (table, column, name) in _SEARCHED.items():
        first = int(slot) * SLOT_ROWS + KIND_ROWS[kind]
        params = {**key, "first": first, "last": first + KIND_SPAN - 1}
        differ = core.conn.execute(
            text(
                f"SELECT t.{column} AS ref, f.rowid IS NULL AS missing FROM {table.name} AS t"
                f" LEFT JOIN ts_lcm_search AS f ON f.rowid = :first + t.{column}"
                " WHERE t.scope = :scope AND t.session_id = :session_id"
                " AND (f.rowid IS NULL OR f.content IS NOT t.content)"
                f" ORDER BY t.{column}"
            ),
            params,
        ).all()
        for r in differ:
            what = "is not in the search index" if r.missing else "is in the search index with other text"
            out.problems.append(f"{name(r.ref)} {what}")
        extra = core.conn.execute(
            text(
                "SELECT f.rowid - :first AS ref FROM ts_lcm_search AS f WHERE f.rowid BETWEEN :first AND :last"
                f" AND NOT EXISTS (SELECT 1 FROM {table.name} AS t WHERE t.scope = :scope"
                f" AND t.session_id = :session_id AND t.{column} = f.rowid - :first) ORDER BY f.rowid"
            ),
            params,
        ).all()
        out.problems += [f"the search index holds {name(r.ref)}, which is not stored" for r in extra]


#: what every message the host keeps out of the model's context holds in its stored JSON (``out_of_context``)
_MARKER = "%excludeFromContext%"


def _audit_hidden(core: Core, out: Audit, scope: str, session_id: str) -> None:
    """Each message is marked ``hidden`` exactly when the host keeps it out of the model's context: the
    recall tools go by the mark, so a row marked wrong shows the model text kept from it (lcm_grep,
    lcm_expand) or hides a message it may see. Only the rows marked or holding the marker are candidates
    (SQLite's LIKE folds ASCII case: more of them, never fewer), each decided by ``out_of_context`` on
    its stored message, read one at a time; a schema before revision 0016 has no mark to check."""
    if "hidden" not in {c["name"] for c in inspect(core.conn).get_columns(messages.name)}:
        return
    m = messages.c
    candidates = select(m.ordinal, m.hidden).where(
        m.scope == scope, m.session_id == session_id, or_(m.hidden == true(), m.message.like(_MARKER))
    )
    for r in core.conn.execute(candidates.order_by(m.ordinal)).all():
        found = rows_of(core, scope, session_id, m.ordinal, [r.ordinal], (m.message,))
        kept_out = bool(found) and out_of_context(json.loads(found[0].message))
        if bool(r.hidden) and not kept_out:
            out.problems.append(f"{message_id(r.ordinal)} is marked hidden, but the host does not keep it out "
                                "of the model's context")
        elif kept_out and not r.hidden:
            out.problems.append(f"{message_id(r.ordinal)} is kept out of the model's context by the host, "
                                "but not marked hidden")
