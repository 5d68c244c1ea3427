"""The recall tools the agent gets: lcm_grep, lcm_describe, lcm_expand (OpenAI function schemas + handlers).

Every original message stays reachable from the assembled context: a summary in context names its id,
``lcm_expand`` walks a condensed summary to its children and a leaf to its source messages, and
``lcm_describe`` walks the other way (a message -> the summaries that cover it, up to the one in context).
A message the host keeps out of the model's context (``messages.c.hidden``) is the exception: no tool
finds, lists or opens it (a tool's answer is model context too); its id is answered as no message.
Handlers never raise for bad arguments: the model gets ``{"error": ...}`` and can try again. Arguments
are checked before any query (``check``, before the engine's first read: a refused call reads and
writes nothing, not even a pending reset): ids as the store takes them, choices as strings, numbers
within the INTEGER columns, no NUL or lone surrogate that a database cannot take, bounded patterns and
regexes. ``caused_by_arguments`` tells the engine which failure that slipped past the checks is still
the arguments' (never a database outage).
"""

from __future__ import annotations

from typing import Any, cast

import regex
from sqlalchemy import Label, bindparam, false, func, literal_column, select
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import JSON
from sqlalchemy.exc import DataError

from transcript_store.compaction import reset_in
from transcript_store.core import MAX_INT, Core, check_id, from_us
from transcript_store.db import UNSENDABLE
from transcript_store.errors import (
    InvalidInput,
    StorageFull,
    StoreUnavailable,
    TranscriptStoreError,
    TransientStoreError,
)

from .context import after_reset, load_items
from .search import Kind, Mode, SearchError, Sort, compile_regex, grep, snippet
from .tables import (
    context_items,
    keyed,
    message_id,
    messages,
    parse_id,
    rows_of,
    summaries,
    summary_children,
    summary_id,
    summary_sources,
)

MAX_LIMIT = 200
#: characters of an lcm_grep pattern, and whitespace-separated terms of a full-text one
MAX_PATTERN_CHARS = 1000
MAX_TERMS = 32
_MODES = ("full_text", "regex")
_SORTS = ("recency", "relevance")
_TARGETS: dict[str, tuple[Kind, ...]] = {
    "messages": ("message",),
    "summaries": ("summary",),
    "all": ("message", "summary"),
}


def schemas() -> list[dict[str, Any]]:
    """The OpenAI function schemas of the three tools."""
    ident = {"type": "string", "description": "a summary id (sum_N), a message id (msg_N) or a message entry id"}
    return [
        _schema(
            "lcm_grep",
            "Search the whole conversation, including everything summarized away: full text (every word must "
            "appear; works for Chinese/Japanese too) or a Python regular expression, over messages and/or summaries.",
            {
                "pattern": {
                    "type": "string",
                    "maxLength": MAX_PATTERN_CHARS,
                    "description": "words to find, or a regex when mode is regex",
                },
                "mode": {"type": "string", "enum": list(_MODES), "default": "full_text"},
                "search_in": {"type": "string", "enum": list(_TARGETS), "default": "all"},
                "sort": {"type": "string", "enum": list(_SORTS), "default": "recency"},
                "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": 20},
            },
            ["pattern"],
        ),
        _schema(
            "lcm_describe",
            "What a summary or message covers and its lineage (which summaries contain it, up to the one in context).",
            {"id": ident},
            ["id"],
        ),
        _schema(
            "lcm_expand",
            "Open a summary: a condensed summary gives its child summaries, a leaf summary its original messages. "
            "A message id gives that message's text, a long one a piece at a time (ask again from next_offset); "
            "a summary id with text true gives that summary's own text the same way (a summary shown truncated).",
            {
                "id": ident,
                "offset": {
                    "type": "integer",
                    "minimum": 0,
                    "default": 0,
                    "description": "a summary: the first child or message to list; a message, or a summary with "
                    "text true: the first character",
                },
                "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": 50},
                "text": {
                    "type": "boolean",
                    "default": False,
                    "description": "true: a summary's own text from character offset on, instead of what it covers",
                },
            },
            ["id"],
        ),
    ]


def _schema(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


class ToolError(ValueError):
    """A bad tool argument: reported to the model, never raised to the host."""


def caused_by_arguments(error: BaseException) -> bool:
    """Whether a handler's failure came from an argument's value (the model's to fix), not the database."""
    if isinstance(error, (TransientStoreError, StorageFull)):
        return False
    if isinstance(error, StoreUnavailable):
        # A value the database or its driver refused (DB-API DataError: SQLSTATE class 22 on PostgreSQL,
        # a NUL in a text value); anything else, an outage included, stays the host's.
        return isinstance(error.__cause__, DataError)
    if isinstance(error, TranscriptStoreError):
        return isinstance(error, InvalidInput)
    return isinstance(error, (ValueError, OverflowError))  # UnicodeError is a ValueError


def _text(args: dict[str, Any], name: str, what: str) -> str:
    value = args.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ToolError(f"{name} must be {what}")
    if len(value) > MAX_PATTERN_CHARS:
        raise ToolError(f"{name} is too long: at most {MAX_PATTERN_CHARS} characters")
    if UNSENDABLE.search(value) is not None:
        raise ToolError(f"{name} must not contain NUL characters or lone surrogates")
    return value


def _ident(args: dict[str, Any], what: str) -> str:
    raw = args.get("id")
    if not isinstance(raw, str) or not raw:
        raise ToolError(f"id must be {what}")
    try:
        # An entry id the store could hold, so any query on it is a plain lookup. Not ``new=True``: the
        # 640-byte limit is for ids given to something new, and an earlier release stored longer ones.
        check_id("id", raw)
    except InvalidInput as e:
        raise ToolError(str(e)) from None
    return raw


def _optional(args: dict[str, Any], name: str, default: Any) -> Any:
    """An optional argument; null is its default too (models in strict function-calling mode send every
    property, null for the ones they leave out)."""
    value = args.get(name)
    return default if value is None else value


def _int(args: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = _optional(args, name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ToolError(f"{name} must be an integer")
    return max(low, min(high, value))


def _choice(args: dict[str, Any], name: str, options: tuple[str, ...] | dict[str, Any], default: str) -> str:
    value = _optional(args, name, default)
    # A string first: ``in`` a dict hashes the value, and a list or an object is unhashable (TypeError).
    if not isinstance(value, str) or value not in options:
        raise ToolError(f"{name} must be one of {', '.join(options)}")
    return value


def _grep_args(args: dict[str, Any]) -> tuple[str, Mode, str, Sort, int]:
    pattern = _text(args, "pattern", "a non-empty string")
    mode = cast(Mode, _choice(args, "mode", _MODES, "full_text"))
    if mode == "full_text" and len(pattern.split()) > MAX_TERMS:
        raise ToolError(f"pattern has too many words: at most {MAX_TERMS}")
    target = _choice(args, "search_in", _TARGETS, "all")
    sort = cast(Sort, _choice(args, "sort", _SORTS, "recency"))
    limit = _int(args, "limit", 20, 1, MAX_LIMIT)
    return pattern, mode, target, sort, limit


def _describe_args(args: dict[str, Any]) -> str:
    return _ident(args, "a summary id (sum_N), a message id (msg_N) or an entry id")


def _offset(args: dict[str, Any]) -> int:
    """``offset`` as given: a negative or huge one is refused, never moved to 0 or to the INTEGER columns'
    end (the answer then named an offset other than the one asked for, and the model read on from there)."""
    value = _optional(args, "offset", 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ToolError("offset must be an integer")
    if not 0 <= value <= MAX_INT:
        raise ToolError(f"offset must be an integer from 0 to {MAX_INT}")  # never the value: 5,000 digits
    return value


def _past_end(offset: int, total: int, ident: str, unit: str) -> ToolError | None:
    """The error for an offset after the end of what ``ident`` holds (``total`` ``unit``); ``total`` itself
    is the end, answered with no items and no ``next_offset``."""
    if offset <= total:
        return None
    return ToolError(f"offset {offset} is past the end of {ident}: it has {total} {unit} (offsets 0 to {total})")


def _expand_args(args: dict[str, Any]) -> tuple[str, int, int, bool]:
    raw = _ident(args, "a summary id (sum_N) or a message id")
    text = _optional(args, "text", False)
    if not isinstance(text, bool):
        raise ToolError("text must be true or false")
    return raw, _offset(args), _int(args, "limit", 50, 1, MAX_LIMIT), text


def check(name: str, args: dict[str, Any]) -> regex.Pattern[str] | None:
    """ToolError for a call whose arguments a handler would refuse, found without touching the database:
    the engine asks before its first read, so a refused call never writes (a pending reset included).

    An ``lcm_grep`` regex is compiled here, once a call, and returned for ``run_grep`` to use: a large
    pattern takes seconds and many MiB to compile, and nothing keeps it past the call."""
    if name == "lcm_grep":
        pattern, mode, *_ = _grep_args(args)
        if mode == "regex":
            try:
                return compile_regex(pattern)
            except SearchError as e:
                raise ToolError(str(e)) from None
    elif name == "lcm_describe":
        _describe_args(args)
    elif name == "lcm_expand":
        _expand_args(args)
    return None


def run_grep(
    core: Core, scope: str, session_id: str, args: dict[str, Any], compiled: regex.Pattern[str] | None = None
) -> dict[str, Any]:
    """lcm_grep (``compiled``: the regex ``check`` compiled for this call, else compiled here)."""
    pattern, mode, target, sort, limit = _grep_args(args)
    if compiled is not None and compiled.pattern != pattern:
        compiled = None
    try:
        hits = grep(
            core, scope, session_id, pattern, mode=mode, kinds=_TARGETS[target], sort=sort, limit=limit,
            compiled=compiled if mode == "regex" else None,
        )
    except SearchError as e:
        raise ToolError(str(e)) from None
    results = []
    for h in hits:
        row: dict[str, Any] = {"id": message_id(h.ref) if h.kind == "message" else summary_id(h.ref), "kind": h.kind}
        if h.kind == "message":
            row.update(role=h.role, entry_id=h.entry_id)
        row["snippet"] = snippet(h.content, h.span, offset=h.offset)
        if sort == "relevance":
            row["score"] = round(h.score, 6)
        results.append(row)
    return {"pattern": pattern, "mode": mode, "sort": sort, "count": len(results), "results": results}


# ---------------------------------------------------------------------------------------------- lineage


# Every lookup here is ``tables.keyed``: a key as a range in its own index's order (on PostgreSQL tables
# never analyzed an equality took another index of the session's key and filtered the session's rows).
_ONE: Any = literal_column("1")  # a written-out LIMIT: a generic plan takes a bound LIMIT for 10% of the rows


def _key(table: Any, scope: str, session_id: str) -> tuple[Any, Any]:
    return table.c.scope == scope, table.c.session_id == session_id


def _parent(core: Core, scope: str, session_id: str, seq: int) -> int | None:
    q = select(summary_children.c.parent_seq).where(*_key(summary_children, scope, session_id))
    return core.conn.execute(keyed(q, summary_children.c.child_seq, seq).limit(_ONE)).scalar()


def _lineage(core: Core, scope: str, session_id: str, seq: int) -> list[int]:
    """``seq`` and its ancestors, up to the root of its tree."""
    out = [seq]
    while (parent := _parent(core, scope, session_id, out[-1])) is not None and parent not in out:
        out.append(parent)
    return out


def _first_shown(core: Core, scope: str, session_id: str) -> int:
    """The item ordinal the assembled context starts at: 0, or after a host's reset the first item
    ``context.after_reset`` keeps (past every item when it keeps none). Rare, so the list is read whole."""
    start = reset_in(core, scope, session_id)
    if not start:
        return 0
    shown = after_reset(load_items(core, scope, session_id), start)
    return shown[0].ordinal if shown else MAX_INT + 1


def _in_context(
    core: Core, scope: str, session_id: str, first: int, *, summary: int | None = None, message: int | None = None
) -> bool:
    """Whether the summary or message is an item of the context the model is shown (from item ``first`` on:
    what precedes a host's reset stays listed, never assembled)."""
    column = context_items.c.summary_seq if summary is not None else context_items.c.message_ordinal
    q = select(context_items.c.item_ordinal).where(*_key(context_items, scope, session_id))
    q = keyed(q, column, summary if summary is not None else message).limit(_ONE)
    found = core.conn.execute(q).scalar()
    return found is not None and found >= first


def _holder(core: Core, scope: str, session_id: str, chain: list[int], first: int) -> str | None:
    """The id of the first summary of a lineage that is in context now."""
    return next((summary_id(s) for s in chain if _in_context(core, scope, session_id, first, summary=s)), None)


def _shown(scope: str, session_id: str, *columns: Any) -> Any:
    """A query of ``columns`` of the session's messages the model may be shown (not ``hidden``)."""
    return select(*columns).where(*_key(messages, scope, session_id), messages.c.hidden == false())


def _find_message(core: Core, scope: str, session_id: str, raw: str, columns: tuple[Any, ...] = (messages,)) -> Any:
    """The row (``columns`` of it) of the message ``raw`` names, or None (also for a hidden one)."""
    parsed = parse_id(raw)
    q = _shown(scope, session_id, *columns)
    if parsed is not None:
        # An id of the engine's form is the engine's, either kind: ``sum_7`` with no summary 7 named the
        # transcript entry called "sum_7" (``msg_7`` never did), and the same id switched to another
        # object once summary 7 was made.
        if parsed[0] != "message":
            return None
        return core.conn.execute(keyed(q, messages.c.ordinal, parsed[1]).limit(_ONE)).first()
    return core.conn.execute(keyed(q, messages.c.entry_id, raw).limit(_ONE)).first()


def _shadow_note(core: Core, scope: str, session_id: str, raw: str, found: tuple[str, int]) -> str | None:
    """A note when ``raw``, read as the engine's id (``msg_N``/``sum_N``), is also the entry id of another
    message: that message is reached by its own engine id only, and the caller is told which."""
    if parse_id(raw) is None:
        return None
    q = _shown(scope, session_id, messages.c.ordinal)
    other = core.conn.execute(keyed(q, messages.c.entry_id, raw).limit(_ONE)).scalar()
    if other is None or found == ("message", int(other)):
        return None
    return (f"{raw!r} is read as this engine's id; the transcript entry named {raw!r} is message "
            f"{message_id(int(other))}: ask for that id")


def _find_summary(
    core: Core, scope: str, session_id: str, raw: str, columns: tuple[Any, ...] = (summaries,)
) -> Any:
    """The row (``columns`` of it) of the summary ``raw`` names, or None."""
    parsed = parse_id(raw)
    if parsed is None or parsed[0] != "summary":
        return None
    q = select(*columns).where(*_key(summaries, scope, session_id))
    return core.conn.execute(keyed(q, summaries.c.summary_seq, parsed[1]).limit(_ONE)).first()


#: characters of the text ``lcm_describe`` previews
PREVIEW_CHARS = 240
_M = messages.c
# What lcm_describe reads of a message: the columns it shows, and the start of its text, a character past the
# preview (``snippet`` marks a text longer than the preview). It read the whole row: for a tool output of
# 5 MB, its text and its JSON, 15 MB in Python (30 ms on SQLite, 44 ms on PostgreSQL; 15 and 8 ms now).
_DESCRIBED = (_M.ordinal, _M.entry_id, _M.role, _M.tokens, _M.position,
              func.substr(_M.content, 1, PREVIEW_CHARS + 1).label("start"))


def run_describe(core: Core, scope: str, session_id: str, args: dict[str, Any]) -> dict[str, Any]:
    """lcm_describe."""
    raw = _describe_args(args)
    row = _find_summary(core, scope, session_id, raw)
    if row is not None:
        return _noted(_describe_summary(core, scope, session_id, row, _first_shown(core, scope, session_id)),
                      _shadow_note(core, scope, session_id, raw, ("summary", row.summary_seq)))
    row = _find_message(core, scope, session_id, raw, _DESCRIBED)
    if row is None:
        raise _missing(core, scope, session_id, raw)
    note = _shadow_note(core, scope, session_id, raw, ("message", row.ordinal))
    covering = select(summary_sources.c.summary_seq).where(*_key(summary_sources, scope, session_id))
    leaves = sorted(
        core.conn.execute(keyed(covering, summary_sources.c.message_ordinal, row.ordinal)).scalars(), reverse=True
    )
    first = _first_shown(core, scope, session_id)
    raw_in_context = _in_context(core, scope, session_id, first, message=row.ordinal)
    chains = [_lineage(core, scope, session_id, leaf) for leaf in leaves]
    holder = message_id(row.ordinal) if raw_in_context else next(
        (h for c in chains if (h := _holder(core, scope, session_id, c, first)) is not None), None
    )
    return _noted({
        "id": message_id(row.ordinal),
        "kind": "message",
        "entry_id": row.entry_id,
        "role": row.role,
        "tokens": row.tokens,
        "transcript_position": row.position,
        "in_context": raw_in_context,
        "context_holder": holder,
        "summarized_in": [summary_id(s) for s in leaves],
        "lineage": [summary_id(s) for s in chains[0]] if chains else [],
        "preview": snippet(row.start, None, PREVIEW_CHARS),
    }, note)


def _missing(core: Core, scope: str, session_id: str, raw: str) -> ToolError:
    """The error for an id naming nothing of the engine's, with the engine id of a transcript entry
    that has that very name (``sum_7`` as an entry id, no summary 7)."""
    note = _shadow_note(core, scope, session_id, raw, ("none", -1))
    return ToolError(f"no summary or message {raw!r} in this session" + (f"; {note}" if note else ""))


def _noted(out: dict[str, Any], note: str | None) -> dict[str, Any]:
    """``out`` with ``note`` when there is one."""
    return {**out, "note": note} if note else out


def _describe_summary(core: Core, scope: str, session_id: str, row: Any, first: int) -> dict[str, Any]:
    seq = row.summary_seq
    chain = _lineage(core, scope, session_id, seq)
    out: dict[str, Any] = {
        "id": summary_id(seq),
        "kind": row.kind,
        "depth": row.depth,
        "level": row.level,
        "tokens": row.tokens,
        "source_tokens": row.source_tokens,
        "covers": {
            "first": message_id(row.earliest_ordinal),
            "last": message_id(row.latest_ordinal),
            "message_count": row.message_count,
        },
        "created_at": from_us(row.created_us).isoformat(),
        "in_context": _in_context(core, scope, session_id, first, summary=seq),
        "parent": summary_id(chain[1]) if len(chain) > 1 else None,
        "lineage": [summary_id(s) for s in chain],
        "context_holder": _holder(core, scope, session_id, chain, first),
    }
    if row.kind == "condensed":
        out["children"] = [summary_id(c) for c in _children(core, scope, session_id, seq)]
    else:
        out["source_messages"] = len(_sources(core, scope, session_id, seq))
    out["preview"] = snippet(row.content, None, PREVIEW_CHARS)
    return out


def _children(core: Core, scope: str, session_id: str, seq: int) -> list[int]:
    """A condensed summary's children in their order (``idx``, sorted here: in SQL only the primary key's
    order is an index lookup on PostgreSQL tables never analyzed)."""
    q = select(summary_children.c.child_seq, summary_children.c.idx).where(*_key(summary_children, scope, session_id))
    edges = core.conn.execute(keyed(q, summary_children.c.parent_seq, seq).order_by(summary_children.c.child_seq))
    return [r.child_seq for r in sorted(edges, key=lambda r: r.idx)]


def _sources(core: Core, scope: str, session_id: str, seq: int) -> list[int]:
    """The ordinals of a leaf summary's source messages the model may be shown, in order: a leaf covers
    the hidden messages among its chunk too (its summary leaves their text out). Every source is read,
    then the hidden ones are left out by their rows (two keyed lookups: see context.load_items on
    PostgreSQL join plans), so that offsets, ``total`` and the pages count the messages shown only."""
    q = select(summary_sources.c.message_ordinal).where(*_key(summary_sources, scope, session_id))
    q = keyed(q, summary_sources.c.summary_seq, seq).order_by(summary_sources.c.message_ordinal)
    ordinals = list(core.conn.execute(q).scalars())
    m = messages.c
    flags = rows_of(core, scope, session_id, m.ordinal, ordinals, (m.ordinal, m.hidden))
    hidden = {r.ordinal for r in flags if r.hidden}
    return [o for o in ordinals if o not in hidden]


def _cut(content: str, limit: int) -> tuple[str, bool]:
    return (content, False) if len(content) <= limit else (content[:limit] + "…", True)


def run_expand(core: Core, scope: str, session_id: str, args: dict[str, Any], max_chars: int) -> dict[str, Any]:
    """lcm_expand."""
    raw, offset, limit, text = _expand_args(args)
    if text:
        found = _find_summary(core, scope, session_id, raw, _summary_piece_columns(offset, max_chars))
        if found is not None:
            return _expand_summary_text(core, scope, session_id, raw, found, offset, max_chars)
    row = _find_summary(core, scope, session_id, raw)
    if row is None:
        return _expand_message(core, scope, session_id, raw, offset, max_chars)
    seq = row.summary_seq
    items: list[dict[str, Any]]
    if row.kind == "condensed":
        children = _children(core, scope, session_id, seq)
        total = len(children)
        if (error := _past_end(offset, total, summary_id(seq), "child summaries")) is not None:
            raise error
        shown = children[offset : offset + limit]
        stored = rows_of(core, scope, session_id, summaries.c.summary_seq, shown, tuple(summaries.c))
        found = {r.summary_seq: r for r in stored}
        items = [_summary_item(found[c], max_chars) for c in shown if c in found]
    else:
        sources = _sources(core, scope, session_id, seq)
        total = len(sources)
        if (error := _past_end(offset, total, summary_id(seq), "source messages")) is not None:
            raise error
        page = sources[offset : offset + limit]
        columns = _ITEM_COLUMNS[core.dialect.is_sqlite]
        # A character past the cut (no INTEGER past MAX_INT, and no text is that long: the whole text)
        chars = {"b_chars": min(max_chars + 1, MAX_INT)}
        stored = rows_of(core, scope, session_id, messages.c.ordinal, page, columns, chars)
        items = [_message_item(m, max_chars) for m in sorted(stored, key=lambda m: m.ordinal)]
    done = offset + len(items)
    return _noted({
        "id": summary_id(seq),
        "kind": row.kind,
        "total": total,
        "offset": offset,
        "items": items,
        "next_offset": done if done < total else None,
    }, _shadow_note(core, scope, session_id, raw, ("summary", seq)))


def _piece_columns(core: Core, offset: int, max_chars: int) -> tuple[Any, ...]:
    """The columns of a message that ``lcm_expand`` answers with: its text's length and the ``max_chars``
    characters from ``offset`` on (``substr`` and ``length`` count characters, code points, on SQLite and
    on PostgreSQL, whose databases the store requires in UTF8, as Python's ``len`` and slices do), and its
    ``tool_call_id``, read by the database from the stored message. A piece read the whole row before: a
    message of some MB sent all of its text and its JSON, parsed, for every piece of 4,000 characters."""
    m = messages.c
    # substr's start is 1-based; one past MAX_INT is no INTEGER, and no text is that long anyway. So is a
    # length past it (an ``expand_max_chars`` meant as "all of it"): PostgreSQL has no substr of a bigint.
    start = min(offset, MAX_INT - 1) + 1
    return (m.ordinal, m.entry_id, m.role, func.length(m.content).label("total_chars"),
            func.substr(m.content, start, min(max_chars, MAX_INT)).label("piece"), _CALL[core.dialect.is_sqlite])


# The tool_call_id of a stored message, read by the database from its JSON (by ``dialect.is_sqlite``).
# PostgreSQL's JSON cannot turn the escape of a NUL character (``\u0000``, anywhere in the message: a
# binary tool output) into text, and failed the whole page; written as U+FFFD's escape, as long and as
# valid, it reads. (A tool_call_id holding a NUL, or the text ``\u0000`` itself, reads with U+FFFD.)
_CALL: dict[bool, Label[Any]] = {
    True: func.json_extract(_M.message, "$.tool_call_id").label("call"),
    False: sql_cast(func.replace(_M.message, "\\u0000", "\\ufffd"), JSON)["tool_call_id"].astext.label("call"),
}
# A leaf's source message as its expansion shows it: the start of its text, a character past ``b_chars``
# (``_cut`` marks a longer one), and its tool_call_id. The page read whole rows: every source's text and
# JSON, parsed in Python, to show ``expand_max_chars`` of each (a page of 200 outputs of 4 MB is 1.6 GB).
_ITEM_COLUMNS = {
    dialect: (_M.ordinal, _M.entry_id, _M.role, func.substr(_M.content, 1, bindparam("b_chars")).label("content"),
              call)
    for dialect, call in _CALL.items()
}


def _expand_message(core: Core, scope: str, session_id: str, raw: str, offset: int, max_chars: int) -> dict[str, Any]:
    """lcm_expand of a message: its text from character ``offset`` on, ``max_chars`` of it, read a piece at a
    time from ``next_offset`` on (a tool output summarized away, longer than ``max_chars``, is read whole)."""
    row = _find_message(core, scope, session_id, raw, _piece_columns(core, offset, max_chars))
    if row is None:
        raise _missing(core, scope, session_id, raw)
    total = int(row.total_chars)
    if (error := _past_end(offset, total, message_id(row.ordinal), "characters")) is not None:
        raise error
    cut = total - offset > max_chars
    item = _item(row, row.piece + "…" if cut else row.piece, cut, row.call)
    done = min(total, offset + max_chars)
    out = {
        "id": message_id(row.ordinal),
        "kind": "message",
        "total_chars": total,
        "offset": offset,
        "items": [item],
        "next_offset": done if done < total else None,
    }
    return _noted(out, _shadow_note(core, scope, session_id, raw, ("message", row.ordinal)))


def _summary_piece_columns(offset: int, max_chars: int) -> tuple[Any, ...]:
    """A summary's columns that ``lcm_expand`` with ``text`` answers with: its text's length and the
    ``max_chars`` characters from ``offset`` on, cut by the database as a message's piece is."""
    s = summaries.c
    start = min(offset, MAX_INT - 1) + 1
    return (s.summary_seq, s.kind, s.depth, s.earliest_ordinal, s.latest_ordinal, s.message_count,
            func.length(s.content).label("total_chars"), func.substr(s.content, start, min(max_chars, MAX_INT))
            .label("content"))


def _expand_summary_text(
    core: Core, scope: str, session_id: str, raw: str, row: Any, offset: int, max_chars: int
) -> dict[str, Any]:
    """lcm_expand of a summary's own text (``text``): as a message's, from character ``offset`` on,
    ``max_chars`` of it, read on from ``next_offset`` (the expansion of its parent shows it cut)."""
    seq = row.summary_seq
    total = int(row.total_chars)
    if (error := _past_end(offset, total, summary_id(seq), "characters")) is not None:
        raise error
    cut = total - offset > max_chars
    item = {**_summary_item(row, max_chars), "content": row.content + "…" if cut else row.content, "truncated": cut}
    done = min(total, offset + max_chars)
    return _noted({
        "id": summary_id(seq),
        "kind": row.kind,
        "total_chars": total,
        "offset": offset,
        "items": [item],
        "next_offset": done if done < total else None,
    }, _shadow_note(core, scope, session_id, raw, ("summary", seq)))


def _message_item(row: Any, max_chars: int) -> dict[str, Any]:
    """A message as an item of a leaf summary's expansion (a row of ``_ITEM_COLUMNS``), cut to ``max_chars``."""
    content, cut = _cut(row.content, max_chars)
    return _item(row, content, cut, row.call)


def _item(row: Any, content: str, cut: bool, call: Any) -> dict[str, Any]:
    out = {"id": message_id(row.ordinal), "kind": "message", "entry_id": row.entry_id, "role": row.role}
    if call:
        # Cut too (to 255 characters, an id's length): the store does not bound it, and a 200,000-character
        # one made the answer 2,000 times ``expand_max_chars``.
        out["tool_call_id"] = _cut(str(call), 255)[0]
    out.update(content=content, truncated=cut)
    return out


def _summary_item(row: Any, max_chars: int) -> dict[str, Any]:
    content, cut = _cut(row.content, max_chars)
    return {
        "id": summary_id(row.summary_seq),
        "kind": row.kind,
        "depth": row.depth,
        "covers": [message_id(row.earliest_ordinal), message_id(row.latest_ordinal)],
        "message_count": row.message_count,
        "content": content,
        "truncated": cut,
    }
