"""A reset (the active path moved: a branch, a rewrite): keep what is still true, forget the rest.

The context list is a chain: its items, in order, cover the ingested messages at active positions
0, 1, 2, ... An entry's ancestry never changes, so the messages of that chain still on the active
path (at the same positions) are a prefix of it; a binary search finds where it ends, the divergence
point (one indexed entry lookup per probe). Then, in the caller's transaction:

- the context items that cover only messages before the divergence stay (raw messages and summaries);
- the first item that reaches past it goes: a condensed summary gives back those of its children
  (recursively) that are still true, a leaf nothing; its still-visible messages are appended raw again
  (their rows and ``msg_N`` ids stay), and later compaction re-summarizes;
- every other row of the session goes: the messages that left the active path (an abandoned branch,
  the originals of a rewrite) and every summary not reachable from the kept items, with their
  sources and children edges, so the recall tools cannot find them any more (SQLite's FTS rows go
  with them through the 0004 triggers; PostgreSQL's search column is part of the row). The
  transcript keeps every entry: branching back imports them again, as new rows.

The view then ends just before the divergence point, so the import reads only from there on.
Cost: one pass over the session's engine rows (messages without their text, the summary edges) and
O(log n) entry lookups. A reset is rare (a branch or a rewrite) and never on a turn's common path.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Table, delete, insert, select

from transcript_store import faults
from transcript_store.core import Core
from transcript_store.cursors import CursorState
from transcript_store.models import RESULT_ROLES, call_answered, calls_made

from .tables import View, context_items, messages, rows_of, summaries, summary_children, summary_sources

BATCH = 500


@dataclass
class _Rows:
    """The session's engine rows a reset needs: no message or summary text."""

    position: dict[int, int] = field(default_factory=dict)  # message ordinal -> active position
    role: dict[int, str] = field(default_factory=dict)  # message ordinal -> role
    entry: dict[int, str] = field(default_factory=dict)  # message ordinal -> entry id
    tokens: dict[int, int] = field(default_factory=dict)  # message ordinal -> tokens
    summary_tokens: dict[int, int] = field(default_factory=dict)
    sources: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    children: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    items: Sequence[Any] = ()  # context item rows, in order
    _covered: dict[int, list[int]] = field(default_factory=dict)

    def covered(self, seq: int, depth: int = 0) -> list[int]:
        """The message ordinals a summary covers, in order (a cycle, which audit reports, covers nothing)."""
        if seq not in self._covered:
            if depth > 64:
                return []
            out = sorted(self.sources.get(seq, []))
            for child in self.children.get(seq, []):
                out += self.covered(child, depth + 1)
            self._covered[seq] = out
        return self._covered[seq]

    def item_covers(self, item: Any) -> list[int]:
        """The message ordinals one context item covers, in order."""
        if item.summary_seq is not None:
            return self.covered(item.summary_seq)
        return [item.message_ordinal]

    def item_tokens(self, item: Any) -> int:
        """The tokens of one context item."""
        if item.summary_seq is not None:
            return self.summary_tokens[item.summary_seq]
        return self.tokens[item.message_ordinal]

    def reachable(self, seqs: list[int]) -> set[int]:
        """The summaries ``seqs`` and all their descendants."""
        out: set[int] = set()
        todo = list(seqs)
        while todo:
            seq = todo.pop()
            if seq not in out:
                out.add(seq)
                todo += self.children.get(seq, [])
        return out


def _load(core: Core, scope: str, session_id: str) -> _Rows:
    def where(table: Table) -> tuple[Any, Any]:
        return table.c.scope == scope, table.c.session_id == session_id

    out = _Rows()
    m = messages.c
    for r in core.conn.execute(select(m.ordinal, m.entry_id, m.position, m.tokens, m.role).where(*where(messages))):
        out.position[r.ordinal], out.entry[r.ordinal], out.tokens[r.ordinal] = r.position, r.entry_id, r.tokens
        out.role[r.ordinal] = r.role
    s = summaries.c
    out.summary_tokens = {
        r.summary_seq: r.tokens for r in core.conn.execute(select(s.summary_seq, s.tokens).where(*where(summaries)))
    }
    for r in core.conn.execute(select(summary_sources).where(*where(summary_sources))):
        out.sources[r.summary_seq].append(r.message_ordinal)
    edges = select(summary_children).where(*where(summary_children)).order_by(summary_children.c.idx)
    for r in core.conn.execute(edges):
        out.children[r.parent_seq].append(r.child_seq)
    ci = context_items.c
    listed = select(ci.item_ordinal, ci.message_ordinal, ci.summary_seq).where(*where(context_items))
    out.items = core.conn.execute(listed.order_by(ci.item_ordinal)).all()
    return out


def _true_length(core: Core, scope: str, session_id: str, rows: _Rows, chain: list[int], seqs: dict[int, int]) -> int:
    """How many messages at the start of ``chain`` are still on the active path (binary search).

    Only the prefix whose positions are 0, 1, 2, ... is a chain at all: anything after a gap (never
    written by this engine, but cheap to refuse) counts as diverged.
    """
    limit = next((i for i, o in enumerate(chain) if rows.position.get(o) != i), len(chain))
    lo, hi = 0, limit  # invariant: chain[:lo] is on the path, chain[hi:limit] is not
    while lo < hi:
        mid = (lo + hi) // 2
        if _on_path(core, scope, session_id, rows.entry[chain[mid]], mid, seqs):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _on_path(core: Core, scope: str, session_id: str, entry_id: str, position: int, seqs: dict[int, int]) -> bool:
    """Whether the entry is on the active path at ``position``; if so its raw seq goes into ``seqs``."""
    row = core.entries_with_path(scope, session_id, [entry_id]).get(entry_id)
    if row is None or row.ts_path_seq != row.seq or row.position != position:
        return False
    seqs[position] = int(row.seq)
    return True


def _open_round(core: Core, scope: str, session_id: str, rows: _Rows, covered: list[int]) -> bool:
    """Whether the messages ``covered`` end inside a tool round: their last assistant message with tool
    calls or a function call (followed only by tool or function results) has a call none of those results
    answers."""
    at = len(covered) - 1
    while at >= 0 and rows.role.get(covered[at]) in RESULT_ROLES:
        at -= 1
    if at < 0 or rows.role.get(covered[at]) != "assistant":
        return False
    wanted = covered[at : len(covered)]
    m = messages.c
    found = rows_of(core, scope, session_id, m.ordinal, wanted, (m.ordinal, m.message))
    by = {r.ordinal: json.loads(r.message) for r in found}
    ids = set(calls_made(by.get(covered[at])))
    answered = {call_answered(by.get(o)) for o in wanted[1:]}
    return bool(ids - answered)


def _give_back(rows: _Rows, seq: int, done: int, true: int, out: list[int]) -> int:
    """A summary that reaches past the divergence goes: keep its still-true children (recursively) in
    ``out``; returns how many chain messages the context covers then (``done`` before)."""
    for child in rows.children.get(seq, []):
        size = len(rows.covered(child))
        if done + size <= true:
            out.append(child)
            done += size
            continue
        return _give_back(rows, child, done, true, out)
    return done


def keep_true_prefix(core: Core, scope: str, session_id: str, view: View, sess: Any, fresh_cursor: str) -> None:
    """Apply a reset to the view and the engine's rows (see module doc); the caller saves the view."""
    rows = _load(core, scope, session_id)
    spans = [rows.item_covers(item) for item in rows.items]
    chain = [o for span in spans for o in span]
    seqs: dict[int, int] = {}
    true = _true_length(core, scope, session_id, rows, chain, seqs)
    kept: list[Any] = []
    reinstated: list[int] = []
    done, cut = 0, None
    for item, span in zip(rows.items, spans, strict=True):
        if done + len(span) <= true:
            kept.append(item)
            done += len(span)
            continue
        cut = item.item_ordinal
        if item.summary_seq is not None:
            done = _give_back(rows, item.summary_seq, done, true, reinstated)
        break
    # A summary must not end inside a tool round: summarized on a path where the round went on with other
    # messages (a call whose other results never came), it held the call, and the path branched back to
    # resumes with the missing results, imported raw after it: tool results without their call (the
    # Chat Completions API refuses the request). Such summaries go too; their messages come back raw.
    while True:
        last = reinstated[-1] if reinstated else (kept[-1].summary_seq if kept else None)
        if last is None or not _open_round(core, scope, session_id, rows, chain[:done]):
            break
        if reinstated:
            done -= sum(len(rows.covered(s)) for s in reinstated)
            reinstated.clear()
            continue
        dropped = kept.pop()
        cut = dropped.item_ordinal
        done -= len(rows.item_covers(dropped))
    alive_summaries = rows.reachable([i.summary_seq for i in kept if i.summary_seq is not None] + reinstated)
    dead_summaries = [s for s in rows.summary_tokens if s not in alive_summaries]
    alive_messages = set(chain[:true])
    dead_messages = [o for o in rows.entry if o not in alive_messages]
    _forget(core, scope, session_id, cut, dead_summaries, dead_messages)
    faults.point("lossless.reset.mid_forget")
    new_items = []
    for seq in reinstated:
        new_items.append({"scope": scope, "session_id": session_id, "item_ordinal": view.next_item,
                          "summary_seq": seq, "message_ordinal": None})
        view.next_item += 1
    # The still-true messages of a dropped leaf go back raw now, as the import would add them: a reset
    # the recall tools apply imports nothing, and if the path then moved again with the view's cursor
    # still on it (a branch before it), no reset would come for them: out of the context, never deleted,
    # the recall tools would find them after they left the active path.
    given_back = chain[done:true]
    for ordinal in given_back:
        new_items.append({"scope": scope, "session_id": session_id, "item_ordinal": view.next_item,
                          "summary_seq": None, "message_ordinal": ordinal})
        view.next_item += 1
    done = true
    if new_items:
        core.conn.execute(insert(context_items), new_items)
    view.tokens = (
        sum(map(rows.item_tokens, kept))
        + sum(rows.summary_tokens[s] for s in reinstated)
        + sum(rows.tokens[o] for o in given_back)
    )
    view.generation, view.position, view.cursor = sess.generation, done - 1, fresh_cursor
    if done > 0:
        if done - 1 not in seqs:  # the binary search may not have probed it (it is on the path)
            _on_path(core, scope, session_id, rows.entry[chain[done - 1]], done - 1, seqs)
        last = CursorState(scope, session_id, sess.generation, seqs[done - 1], done - 1, sess.incarnation)
        view.cursor = last.encode()
    view.epoch += 1


def _forget(
    core: Core, scope: str, session_id: str, cut: int | None, dead_summaries: list[int], dead_messages: list[int]
) -> None:
    """Delete the context items from ``cut`` on, then the dead summaries (edges first), then the dead messages."""
    key = (scope, session_id)
    if cut is not None:
        ci = context_items.c
        core.conn.execute(delete(context_items).where(ci.scope == scope, ci.session_id == session_id,
                                                      ci.item_ordinal >= cut))
    for batch in _batches(dead_summaries):
        _delete(core, summary_children, key, summary_children.c.parent_seq.in_(batch))
        _delete(core, summary_children, key, summary_children.c.child_seq.in_(batch))
        _delete(core, summary_sources, key, summary_sources.c.summary_seq.in_(batch))
        _delete(core, summaries, key, summaries.c.summary_seq.in_(batch))
    for batch in _batches(dead_messages):
        _delete(core, summary_sources, key, summary_sources.c.message_ordinal.in_(batch))
        _delete(core, messages, key, messages.c.ordinal.in_(batch))


def _delete(core: Core, table: Table, key: tuple[str, str], condition: Any) -> None:
    core.conn.execute(delete(table).where(table.c.scope == key[0], table.c.session_id == key[1], condition))


def _batches(values: list[int]) -> Iterator[list[int]]:
    for n in range(0, len(values), BATCH):
        yield values[n : n + BATCH]
