"""Search over the engine's messages and summaries: full text (indexed, CJK-safe) or a regular expression.

Full text means: every whitespace-separated term occurs in the text, case-insensitively, as a
substring (so CJK words, which have no spaces, are found). The backends reach that through their own
indexes, the one place this engine branches on the dialect (the migration explains why):

- SQLite: the FTS5 trigram table (terms of 3+ characters), ranked by bm25; terms shorter than a
  trigram fall back to GLOB on the session's rows, each letter as a class of its cases (SQLite's LIKE
  folds ASCII letters only; PostgreSQL's ILIKE and the trigram tokenizer fold every letter).
- PostgreSQL: ILIKE for every term (the pg_trgm GIN index), ranked by ts_rank on the 'simple'
  tsvector column. A word match is not a substring match (the parser drops punctuation), so the word
  index never decides alone: it found "foo s" for foo's, where SQLite found nothing.

Hits are ordered without ties (see ``_recency``), so a search answers the same page on both backends
(``relevance`` aside: bm25 and ts_rank score differently).

Regular expressions (Python syntax, run by the ``regex`` package) scan the session's rows newest
first, in bounded batches. The model writes them, so each is bounded: a pattern whose counted
repetitions expand past REGEX_MAX_SIZE is refused before compiling (compiling expands them, unbounded
in time), each row's first REGEX_MAX_TEXT characters are searched, and matching stops with a
SearchError after REGEX_SECONDS over the whole search. Matching releases the GIL (``concurrent``), so
a slow pattern never freezes the process's other threads (heartbeats, other sessions' turns).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from re import _constants as _sre  # type: ignore[attr-defined]  # Python's own regex parser (3.11+)
from re import _parser as _sre_parse  # type: ignore[attr-defined]
from typing import Any, Literal

import regex
from sqlalchemy import Table, select, text

from transcript_store.core import Core
from transcript_store.db import PG_VALUE_PLANS

from .tables import messages, summaries

Kind = Literal["message", "summary"]
Mode = Literal["full_text", "regex"]
Sort = Literal["recency", "relevance"]
SCAN_BATCH = 500
#: seconds of regex matching one search may take, in all
REGEX_SECONDS = 2.0
#: characters of each row a regex searches (a longer tool result is searched from its start)
REGEX_MAX_TEXT = 100_000
#: the size of a regex once its counted repetitions are expanded (``(a{100}){100}``: 10,000)
REGEX_MAX_SIZE = 100_000
#: matches of one row that count towards its score
REGEX_MAX_MATCHES = 1000

_SOURCES: dict[Kind, tuple[Table, str]] = {"message": (messages, "ordinal"), "summary": (summaries, "summary_seq")}


class SearchError(ValueError):
    """A search refused or stopped: an invalid or too large regex, or one that ran past its time bound."""


@dataclass
class Hit:
    """One search result: a message (ref = ordinal) or a summary (ref = seq)."""

    kind: Kind
    ref: int
    recency: int
    score: float
    content: str
    role: str | None = None
    entry_id: str | None = None
    span: tuple[int, int] | None = None


def grep(
    core: Core,
    scope: str,
    session_id: str,
    pattern: str,
    *,
    mode: Mode,
    kinds: tuple[Kind, ...],
    sort: Sort,
    limit: int,
) -> list[Hit]:
    """The best ``limit`` hits over ``kinds`` (see module doc); a bad or too slow regex raises SearchError."""
    hits: list[Hit] = []
    compiled = compile_regex(pattern) if mode == "regex" else None
    deadline = time.monotonic() + REGEX_SECONDS
    if not core.dialect.is_sqlite and core.config.pg_generic_plans and mode != "regex":
        # The store's connections plan statements once, for any values (transcript_store/db.py); a
        # full-text search's best plan depends on its terms (a rare word: the text indexes; a short
        # or common one: the session's own rows), so this transaction plans per execution again.
        core.conn.exec_driver_sql(PG_VALUE_PLANS)
    for kind in kinds:
        if compiled is not None:
            hits += _regex(core, scope, session_id, kind, compiled, sort, limit, deadline)
        else:
            hits += _full_text(core, scope, session_id, kind, pattern.split(), sort, limit)
    hits.sort(key=_relevance if sort == "relevance" else _recency)
    return hits[:limit]


# Orders with no ties, so that a page is the same on every backend and every limit's page starts the
# next larger one: recency (the latest message covered; a summary and its condensed parent share it),
# then a message before a summary, then the newer id. Recency never falls back on the score: the
# backends score differently (bm25, ts_rank), and the order of ties was the database's to pick.
def _recency(h: Hit) -> tuple[int, str, int]:
    return -h.recency, h.kind, -h.ref


def _relevance(h: Hit) -> tuple[float, int, str, int]:
    return -h.score, -h.recency, h.kind, -h.ref


def compile_regex(pattern: str) -> regex.Pattern[str]:
    """The compiled pattern; SearchError when it is invalid or expands past REGEX_MAX_SIZE."""
    size = expanded_size(pattern)
    if size > REGEX_MAX_SIZE:
        raise SearchError(
            f"regular expression too large: its counted repetitions expand to about {size} items "
            f"(at most {REGEX_MAX_SIZE})"
        )
    try:
        return regex.compile(pattern)
    # Warning: a host running with warnings as errors (-W error) gets the parser's FutureWarning of a
    # pattern like "[[a]" raised; the pattern is refused like an invalid one, not the engine quarantined.
    except (regex.error, ValueError, OverflowError, RecursionError, Warning) as e:
        raise SearchError(f"invalid regular expression: {e}") from None


# The size is computed on the parse tree of Python's own ``re`` parser, which reads the pattern as the
# ``regex`` package's default (re-compatible) mode does: comments, verbose mode, escapes and classes
# are the parser's to read, not a hand-written scanner's (one was fooled by ``(?#[)``, which hid the
# repetitions after it, and the compile then ran for seconds holding the GIL). ``regex``'s own
# Unicode property escapes are read as the one character they match; syntax ``re`` refuses (recursion,
# version flags) is refused here too. (``regex``'s fuzzy constraints, ``{e<=1}``, read as literal text
# by ``re``, expand nothing when compiled; their matching is bounded in time like any.)
_PROPERTY = regex.compile(r"\\\\|\\[pP]\{[^}]*\}|\\[pP][A-Za-z]|\\X")
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT)


def expanded_size(pattern: str) -> int:
    """The pattern's items once its counted repetitions (``x{n,m}``) are expanded, as compiling does.

    A repetition multiplies its item by its upper bound (by its lower one when it has none: ``*`` and
    ``+`` do not expand); a group, a branch or a lookaround counts what it holds. SearchError for a
    pattern Python's ``re`` parser refuses (``regex``'s property escapes aside).
    """
    plain = _PROPERTY.sub(lambda m: m.group() if m.group() == "\\\\" else "x", pattern)
    try:
        tree = _sre_parse.parse(plain)
        return _size(tree)
    except (re.error, OverflowError, RecursionError, Warning) as e:  # Warning: see compile_regex
        if "too large" in str(e) or isinstance(e, OverflowError):
            return REGEX_MAX_SIZE + 1
        raise SearchError(
            f"invalid regular expression (Python re syntax; \\p{{...}} classes allowed): {e}"
        ) from None


def _size(items: Any) -> int:
    total = 0
    for op, av in items:
        if op in _REPEATS:
            low, high, item = av
            total += max(low if high == _sre.MAXREPEAT else high, 1) * _size(item)
        elif op is _sre.SUBPATTERN:
            total += _size(av[-1])
        elif op is _sre.ATOMIC_GROUP:
            total += _size(av)
        elif op is _sre.BRANCH:
            total += sum(_size(branch) for branch in av[1])
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            total += _size(av[1])
        elif op is _sre.GROUPREF_EXISTS:
            total += _size(av[1]) + (_size(av[2]) if av[2] is not None else 0)
        else:
            total += 1
    return total


def _columns(kind: Kind) -> str:
    if kind == "message":
        return "t.ordinal AS ref, t.ordinal AS recency, t.role AS role, t.entry_id AS entry_id, t.content AS content"
    return "t.summary_seq AS ref, t.latest_ordinal AS recency, NULL AS role, NULL AS entry_id, t.content AS content"


def _like(term: str) -> str:
    return "%" + term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _glob(term: str) -> str:
    """A GLOB pattern finding ``term`` anywhere, case-insensitively like ILIKE: each letter as a class
    of the single characters that lower-case as it does (SQLite's LIKE folds ASCII letters only)."""
    out = []
    for ch in term:
        forms = "".join(dict.fromkeys(
            f for f in (ch, ch.lower(), ch.upper(), ch.title()) if len(f) == 1 and f.lower() == ch.lower()
        ))
        # *, ? and [ are GLOB's wildcards: a class of one makes them literal ("]" outside a class is).
        out.append(f"[{forms}]" if len(forms) > 1 or ch in "*?[" else ch)
    return "*" + "".join(out) + "*"


def _full_text(
    core: Core, scope: str, session_id: str, kind: Kind, terms: list[str], sort: str, limit: int
) -> list[Hit]:
    if not terms:
        return []
    table, key = _SOURCES[kind]
    params: dict[str, Any] = {"scope": scope, "session_id": session_id, "limit": limit}
    likes = []
    for n, term in enumerate(terms):
        params[f"t{n}"] = _like(term)
    order = "score DESC, recency DESC, ref DESC" if sort == "relevance" else "recency DESC, ref DESC"
    if core.dialect.is_sqlite:
        long = [t for t in terms if len(t) >= 3]
        short = [n for n, t in enumerate(terms) if len(t) < 3]
        likes = [f"t.content GLOB :g{n}" for n in short]
        params.update({f"g{n}": _glob(terms[n]) for n in short})
        if long:
            params["match"] = " AND ".join('"' + t.replace('"', '""') + '"' for t in long)
            # CROSS JOIN fixes the join order: the FTS index drives (SQLite's planner would otherwise
            # walk the session's rows and probe the FTS table once per row).
            sql = (
                f"SELECT {_columns(kind)}, -bm25(ts_lcm_search) AS score FROM ts_lcm_search"
                " CROSS JOIN ts_lcm_search_map AS map ON map.id = ts_lcm_search.rowid"
                f" CROSS JOIN {table.name} AS t ON t.scope = map.scope AND t.session_id = map.session_id"
                f" AND t.{key} = map.ref"
                f" WHERE ts_lcm_search MATCH :match AND map.scope = :scope AND map.session_id = :session_id"
                f" AND map.kind = '{kind}'"
            )
        else:
            sql = (
                f"SELECT {_columns(kind)}, 0.0 AS score FROM {table.name} AS t"
                " WHERE t.scope = :scope AND t.session_id = :session_id"
            )
        sql += "".join(f" AND {c}" for c in likes)
    else:
        params["q"] = " ".join(terms)
        likes = [f"t.content ILIKE :t{n} ESCAPE '\\'" for n in range(len(terms))]
        # Every term as a substring (the pg_trgm index): a word match alone is not one (the parser
        # drops punctuation: "foo's" is the words foo & s, "[x" the word x). The word vector ranks.
        sql = (
            f"SELECT {_columns(kind)}, ts_rank(t.search_tsv, plainto_tsquery('simple', :q)) AS score"
            f" FROM {table.name} AS t WHERE t.scope = :scope AND t.session_id = :session_id"
            f" AND {' AND '.join(likes)}"
        )
    sql += f" ORDER BY {order} LIMIT :limit"
    rows = core.conn.execute(text(sql), params).all()
    needle = terms[0].lower()
    return [
        Hit(kind, r.ref, r.recency, float(r.score or 0.0), r.content, r.role, r.entry_id, _find(r.content, needle))
        for r in rows
    ]


def _find(content: str, needle: str) -> tuple[int, int] | None:
    at = content.lower().find(needle)
    return (at, at + len(needle)) if at >= 0 else None


def _regex(
    core: Core,
    scope: str,
    session_id: str,
    kind: Kind,
    pattern: regex.Pattern[str],
    sort: str,
    limit: int,
    deadline: float,
) -> list[Hit]:
    hits: list[Hit] = []
    for row in _scan(core, scope, session_id, kind):
        found = _matches(pattern, row["content"][:REGEX_MAX_TEXT], deadline)
        if not found:
            continue
        first = found[0]
        hits.append(
            Hit(kind, row["ref"], row["recency"], float(len(found)), row["content"], row["role"], row["entry_id"],
                (first.start(), first.end()))
        )
        if sort == "recency" and kind == "message" and len(hits) >= limit:
            break  # messages come newest first (summaries by id, which is not their recency: a condensed
            # summary made after a leaf covers older messages)
    return hits


def _matches(pattern: regex.Pattern[str], content: str, deadline: float) -> list[regex.Match[str]]:
    """The first REGEX_MAX_MATCHES matches, matched without the GIL; SearchError past the deadline."""
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        return list(islice(pattern.finditer(content, concurrent=True, timeout=left), REGEX_MAX_MATCHES))
    except TimeoutError:
        raise SearchError(
            f"the regular expression ran past its {REGEX_SECONDS:g} s bound over this session's text "
            "(nested repetition such as (a+)+ backtracks exponentially): simplify it, or use full_text"
        ) from None


def _scan(core: Core, scope: str, session_id: str, kind: Kind) -> Iterator[dict[str, Any]]:
    """Every row of the session, newest first, in indexed batches."""
    table, key = _SOURCES[kind]
    column = table.c[key]
    before: int | None = None
    while True:
        q = select(table).where(table.c.scope == scope, table.c.session_id == session_id)
        if before is not None:
            q = q.where(column < before)
        rows = core.conn.execute(q.order_by(column.desc()).limit(SCAN_BATCH)).all()
        for r in rows:
            is_message = kind == "message"
            yield {
                "ref": r._mapping[key],
                "recency": r.ordinal if is_message else r.latest_ordinal,
                "role": r.role if is_message else None,
                "entry_id": r.entry_id if is_message else None,
                "content": r.content,
            }
        if len(rows) < SCAN_BATCH:
            return
        before = rows[-1]._mapping[key]


def snippet(content: str, span: tuple[int, int] | None, width: int = 160) -> str:
    """About ``width`` characters around the match, whitespace collapsed."""
    start = 0 if span is None else max(0, span[0] - width // 2)
    piece = content[start : start + width]
    flat = " ".join(piece.split())
    return ("…" if start > 0 else "") + flat + ("…" if start + width < len(content) else "")
