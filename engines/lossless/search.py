"""Search over the engine's messages and summaries: full text (indexed, CJK-safe) or a regular expression.

Full text means: every whitespace-separated term occurs in the text as a substring (so CJK words, which
have no spaces, are found), case-insensitively by one rule, the same on both backends:

- Two characters match when they fold to the same code point. A character's fold is its Unicode simple
  case folding, as Python's Unicode database (``unicodedata.unidata_version``) knows it:
  ``ch.casefold()`` when that is one code point, else ``ch.lower()`` when that is one, else the
  character itself. So K, k and the Kelvin sign (U+212A) match; ß matches ẞ but not "ss" (one code
  point never matches two); the Greek sigmas U+03C3, U+03C2 (final) and U+03A3 match; the micro sign
  U+00B5 matches the Greek mu; the long s U+017F matches s; İ (U+0130, whose lower case is i + U+0307,
  two code points) matches only itself, and the dotless i U+0131 only itself. Besides, U+FFFE and
  U+FFFF count as U+FFFD (SQLite reads all three as U+FFFD). Nothing else is normalized: é (one code
  point) does not match e + U+0301.
- A fold is one code point for one, so the folded text is as long as the text: a hit's ``span`` (the
  first match of the first term) indexes the original text (``content.lower()`` does not: İ lowers
  to two code points, and every İ before a match shifted the span and the snippet).

The backends decide the rule exactly, in SQL (so LIMIT pages stay exact), each helped by its index,
the one place this engine branches on the dialect (the migration explains why):

- SQLite: ``contains``, a function on the connection: the term folded found in the text folded (one
  code point for one, so exactly the rule). GLOB with each character as the class of its forms decided
  before: SQLite's GLOB tries the whole pattern again at each position, a text's length times the
  term's (a 1,000-character term over a 400,000-character tool result: 20 s, unbounded); ``str.find``
  is linear. The FTS5 trigram table finds the candidates, in the session's own range of
  rowids (see ``_full_text``): each term's longest run of 3+ characters is a phrase, spelt every way
  the tokenizer tells apart. It folds by its own table, older than Python's (not Cherokee, nor
  Georgian Mtavruli, nor U+1C80, an old form of в), so ``в`` is the two spellings в and U+1C80; a run
  takes at most FTS5_SPELLINGS, and FTS5_RUN characters (a phrase of a long run costs FTS5 time in
  proportion to the run, and a shorter one finds at least as much). How the tokenizer folds a
  character is read once per process from an in-memory FTS5 table of the same library (``sqlite3``,
  the store's driver). A term without such a run (under a trigram, say) adds no phrase; when no term
  has one, the session's rows are scanned.
  A hit's relevance is ``occurrences``, a function on the connection (``_score``): its terms'
  matches by the rule, counted apart in its own text.
- PostgreSQL: a case-sensitive regular expression (``~``) of the same classes, its characters written
  as ``\\uXXXX`` escapes: it compares code points, whatever the database's collation and ctype. ILIKE
  does not: it folds by the database's lower() (C.UTF-8 or en_US.UTF-8: İ is an i, and a final sigma,
  the micro sign and the long s stay themselves; C: ASCII letters only; ICU: the locale's way). The
  pg_trgm GIN index serves the expression (pg_trgm reads its classes of characters up to U+07FF:
  PostgreSQL's regex library enumerates none beyond), and a case-sensitive LIKE of the term with every
  run of cased characters as ``%`` serves runs of uncased characters past U+07FF (CJK). The LIKE
  compares code points too, so it finds at least the rule's matches whatever lower() does (an ILIKE,
  with each cased character as ``_``, did not: ICU's Lithuanian lowers Ì to three code points). Its
  escape character is ``!``: a backslash in ``ESCAPE '\\'`` is an unterminated literal under
  ``standard_conforming_strings = off``. So the hits do not depend on the ctype or the server's
  settings; how far the index narrows them does (under C, pg_trgm makes trigrams of ASCII characters
  only). For a short or common term the planner walks the session's rows instead. Hits are ranked by
  ts_rank on the 'simple' tsvector column, which never decides (its parser drops punctuation: it found
  "foo s" for foo's).

Hits are ordered without ties (see ``_recency``), so a search answers the same page on both backends
(``relevance`` aside: SQLite counts the terms' matches, PostgreSQL's ts_rank weighs words). A score
reads the hit's own row only, on both backends: no other session's rows (bm25, which SQLite ranked
with until revision 0012, weighed each phrase by how many rows of the whole table held it).

A message the host keeps out of the model's context (OpenClaw's ``excludeFromContext``: the column
``hidden``, revision 0016) is never a hit, in either mode, on either backend: a tool's answer is model
context too. The condition is in the SQL of each query (full text) and batch (regex), so a page of
``limit`` holds that many hits whenever the session has them.

Regular expressions (Python syntax, run by the ``regex`` package) scan the session's rows newest
first, in bounded batches. The model writes them, so each is bounded: a pattern whose size (its
counted repetitions expanded, see ``expanded_size``) passes REGEX_MAX_SIZE is refused before compiling
(compiling expands them, unbounded in time and memory), each row's first REGEX_MAX_TEXT characters
are searched, and matching stops with a SearchError after REGEX_SECONDS over the whole search.
Matching releases the GIL (``concurrent``), so a slow pattern never freezes the process's other
threads (heartbeats, other sessions' turns). A search holds what it needs, whatever the session's
size: a pattern compiled once and cached nowhere (the ``regex`` module's cache kept 500, a large one
100+ MiB), a batch of rows read up to their searched prefix, and the best ``limit`` hits, each with
the piece of its text that its snippet shows.
"""

from __future__ import annotations

import heapq
import re
import sqlite3
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Set
from dataclasses import dataclass
from functools import cache
from itertools import islice, product
from re import _constants as _sre  # type: ignore[attr-defined]  # Python's own regex parser (3.11+)
from re import _parser as _sre_parse  # type: ignore[attr-defined]
from typing import Any, Literal

import regex
from sqlalchemy import Table, false, func, null, select, text

from transcript_store.core import Core
from transcript_store.db import PG_VALUE_PLANS

from .tables import keyed, messages, summaries

Kind = Literal["message", "summary"]
Mode = Literal["full_text", "regex"]
Sort = Literal["recency", "relevance"]
#: rows of a regex scan's batch (each read up to REGEX_MAX_TEXT characters and a snippet's margin)
SCAN_BATCH = 100
#: seconds of regex matching one search may take, in all
REGEX_SECONDS = 2.0
#: characters of each row a regex searches (a longer tool result is searched from its start)
REGEX_MAX_TEXT = 100_000
#: the size of a regex once its counted repetitions are expanded (``(a{100}){100}``: 10,000)
REGEX_MAX_SIZE = 100_000
#: matches of one row that count towards its score
REGEX_MAX_MATCHES = 1000
#: characters of a snippet (``snippet``)
SNIPPET_WIDTH = 160
# Characters of a row a regex scan reads: what it searches, and what the snippet of a match at its end
# reads past it (half a snippet, and one character to tell whether the text goes on).
_REGEX_READ = REGEX_MAX_TEXT + SNIPPET_WIDTH + 1
#: characters at the start of a text a relevance score on SQLite reads (``occurrences``): as many as a
#: regex searches and PostgreSQL's word vector, which ts_rank reads, holds (revision 0008)
SCORE_MAX_TEXT = 100_000
#: the name of ``occurrences`` in SQL, on each SQLite connection a relevance search runs on (``_score``)
SCORE_FUNCTION = "ts_lcm_occurrences"
#: spellings of one run of a term an FTS5 query spells out (see ``_fts5_match``)
FTS5_SPELLINGS = 16
#: the longest run of a term that becomes an FTS5 phrase (a prefilter: the rule decides after it)
FTS5_RUN = 32
#: the SQLite function deciding a full-text match (``contains``)
CONTAINS_FUNCTION = "ts_lcm_contains"
#: SQLite's search rowids of one (scope, session), its slot (revision 0012): slot * SLOT_ROWS + ...
SLOT_ROWS = 2**32
#: ... where each kind's rows start in the slot (a message's rowid adds its ordinal, a summary's its seq)
KIND_ROWS: dict[Kind, int] = {"message": 0, "summary": 2**31}
#: the rows of a kind in a slot (an ordinal or seq is an INTEGER: below 2**31)
KIND_SPAN = 2**31

_SOURCES: dict[Kind, tuple[Table, str]] = {"message": (messages, "ordinal"), "summary": (summaries, "summary_seq")}
#: the condition of a message row the model may be shown: not one the host keeps out of its context
#: (``tables.messages.c.hidden``); a search finds such a row never, on either backend, in either mode
_SHOWN = "NOT t.hidden"


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
    #: where ``content`` starts in the text: a regex hit keeps only the piece its snippet shows
    offset: int = 0


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
    compiled: regex.Pattern[str] | None = None,
) -> list[Hit]:
    """The best ``limit`` hits over ``kinds`` (see module doc); a bad or too slow regex raises SearchError.

    ``compiled``: the regex ``compile_regex`` made of ``pattern``, when the caller has it (a large one
    takes its compile time and memory again otherwise)."""
    hits: list[Hit] = []
    if mode == "regex" and compiled is None:
        compiled = compile_regex(pattern)
    deadline = time.monotonic() + REGEX_SECONDS
    if not core.dialect.is_sqlite and core.config.pg_generic_plans and mode != "regex":
        # The store's connections plan statements once, for any values (transcript_store/db.py); a
        # full-text search's best plan depends on its terms (a rare word: the text indexes; a short
        # or common one: the session's own rows), so this transaction plans per execution again.
        core.conn.exec_driver_sql(PG_VALUE_PLANS)
    for kind in kinds:
        if mode == "regex" and compiled is not None:
            hits += _regex(core, scope, session_id, kind, compiled, sort, limit, deadline)
        else:
            hits += _full_text(core, scope, session_id, kind, pattern.split(), sort, limit)
    hits.sort(key=_relevance if sort == "relevance" else _recency)
    return hits[:limit]


# Orders with no ties, so that a page is the same on every backend and every limit's page starts the
# next larger one: recency (the latest message covered; a summary and its condensed parent share it),
# then a message before a summary, then the newer id. Recency never falls back on the score: the
# backends score differently (matches counted, ts_rank), and the order of ties was the database's to pick.
def _recency(h: Hit) -> tuple[int, str, int]:
    return -h.recency, h.kind, -h.ref


def _relevance(h: Hit) -> tuple[float, int, str, int]:
    return -h.score, -h.recency, h.kind, -h.ref


def compile_regex(pattern: str) -> regex.Pattern[str]:
    """The compiled pattern, cached nowhere; SearchError when it is invalid or its size passes REGEX_MAX_SIZE."""
    size = expanded_size(pattern)
    if size > REGEX_MAX_SIZE:
        raise SearchError(
            f"regular expression too large: about {size} items once its counted repetitions are expanded "
            f"(at most {REGEX_MAX_SIZE})"
        )
    try:
        # Not in the regex module's cache: it keeps 500 patterns for the life of the process, and one
        # within REGEX_MAX_SIZE can take 100+ MiB compiled. The caller keeps it for one search.
        return regex.compile(pattern, cache_pattern=False)
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
# What some items cost compiled, in literals (measured: x{100000} takes 25 MiB compiled; (?:\X){100000}
# 4.7 times as much, x? 2, x+ 3, x++ 4.4, (?=x) 2.9, (?>x) 2.4, (x) 2.5, ten nested groups 16). The
# size once counted \X and loops as one literal: (?:\X?){99990} passed and took 170 MiB.
_GRAPHEME = "(?:" + "x" * 5 + ")"  # \X, a grapheme cluster: a program of its own
_LOOP = 3  # ?, * and + (lazy too): a loop around their item, which is never expanded
_NODE = 2  # a lookaround, an atomic group, a possessive repetition: the group's own nodes
_CAPTURE = 2  # a capture group: at least this much for each group it holds, itself included
# A character class compiles to its members (measured, repeated 20,000 times: a literal 5.5 MiB, a class
# of 10 letters 8, of 100 15, of 975 83; of 13 ranges of letters 39): one literal for every 64 of
# its single members and for every 2 of its ranges (one at least).
_CLASS_MEMBERS = 64
_CLASS_RANGES = 2


def expanded_size(pattern: str) -> int:
    """The pattern's items once its counted repetitions (``x{n,m}``) are expanded, as compiling does.

    A repetition multiplies its item by its upper bound (by its lower one when it has none: ``*`` and
    ``+`` do not expand); a group, a branch or a lookaround counts what it holds. Items that compile
    large weigh more (``_GRAPHEME`` and after), so REGEX_MAX_SIZE holds a compiled pattern to some
    25 MiB: ``\\X`` is 5 items, a character class 1 for each 64 of its members and each 2 of its ranges
    (1 at least), a loop (``?``, ``*``, ``+``) 3 times its item, a lookaround, an atomic
    group or a possessive repetition 2 more than it holds, a capture group at least 2 for each group it
    holds, itself included. SearchError for a pattern Python's ``re`` parser refuses (``regex``'s
    property escapes aside).
    """
    plain = _PROPERTY.sub(lambda m: {"\\\\": "\\\\", "\\X": _GRAPHEME}.get(m.group(), "x"), pattern)
    try:
        tree = _sre_parse.parse(plain)
        return _size(tree)[0]
    except (re.error, OverflowError, RecursionError, Warning) as e:  # Warning: see compile_regex
        if "too large" in str(e) or isinstance(e, OverflowError):
            return REGEX_MAX_SIZE + 1
        raise SearchError(f"invalid regular expression (Python re syntax; \\p{{...}} classes allowed): {e}") from None


def _size(items: Any) -> tuple[int, int]:
    """The size of a parsed sequence (``expanded_size``) and the capture groups it holds."""
    total = groups = 0
    for op, av in items:
        size, held = 1, 0
        if op in _REPEATS:
            low, high, item = av
            size, held = _size(item)
            if high == _sre.MAXREPEAT or (low, high) == (0, 1):
                size *= _LOOP
            size *= max(low if high == _sre.MAXREPEAT else high, 1)
            size += _NODE if op is _sre.POSSESSIVE_REPEAT else 0
        elif op is _sre.SUBPATTERN:
            size, held = _size(av[-1])
            if av[0] is not None:
                held += 1
                size = max(size, _CAPTURE * held)
        elif op is _sre.ATOMIC_GROUP:
            size, held = _size(av)
            size += _NODE
        elif op is _sre.BRANCH:
            size, held = _sizes(av[1])
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            size, held = _size(av[1])
            size += _NODE
        elif op is _sre.IN:
            size = _class_size(av)
        elif op is _sre.GROUPREF_EXISTS:
            size, held = _sizes(part for part in av[1:] if part is not None)
        total += size
        groups += held
    return total, groups


def _class_size(members: Any) -> int:
    """What a character class weighs: a class once counted as one item whatever it held, and
    ``(?i)(?:[<975 letters>]){99999}`` passed and took 384 MiB compiled."""
    ranges = sum(1 for op, _ in members if op is _sre.RANGE)
    others = sum(1 for op, _ in members if op is not _sre.RANGE and op is not _sre.NEGATE)
    return max(1, -(-others // _CLASS_MEMBERS) + -(-ranges // _CLASS_RANGES))


def _sizes(parts: Iterable[Any]) -> tuple[int, int]:
    """The sizes and groups of alternatives (a branch's, a conditional's), added."""
    pairs = [_size(part) for part in parts]
    return sum(size for size, _ in pairs), sum(held for _, held in pairs)


def _columns(kind: Kind) -> str:
    """A full-text hit's columns: its text only up to ``:head`` characters (``_placed`` reads on when its
    match is further)."""
    text = "substr(t.content, 1, :head) AS content"
    if kind == "message":
        return f"t.ordinal AS ref, t.ordinal AS recency, t.role AS role, t.entry_id AS entry_id, {text}"
    return f"t.summary_seq AS ref, t.latest_ordinal AS recency, NULL AS role, NULL AS entry_id, {text}"


# ---------------------------------------------------------------------------------------------- case folding


def _fold_char(ch: str) -> str:
    """The code point ``ch`` folds to (the module doc's rule)."""
    if ch in "\ufffe\uffff":
        return "\ufffd"
    folded = ch.casefold()
    if len(folded) != 1:
        folded = ch.lower()
    return folded if len(folded) == 1 else ch


@cache
def _folding() -> tuple[dict[int, str], dict[str, str]]:
    """The rule as tables, built once: code point -> its fold (where it is another character), for
    ``str.translate``; and fold -> every character that folds to it (where that is more than one)."""
    table = {0xFFFE: "\ufffd", 0xFFFF: "\ufffd"}
    # Every code point, a block at a time, as UTF-32: the block's offsets plus its base in each 4 bytes
    # (an integer sum, no carries: the offsets stay under the base's lowest bit). Surrogates included:
    # they fold to themselves.
    step = 256
    offsets = sum(n << (32 * n) for n in range(step))
    ones = sum(1 << (32 * n) for n in range(step))
    for base in range(0, sys.maxunicode + 1, step):
        chars = (offsets + base * ones).to_bytes(4 * step, "little").decode("utf-32-le", "surrogatepass")
        if chars.casefold() == chars:  # casefold() maps each character by itself: none folds here
            continue
        for offset, ch in enumerate(chars):
            if (folded := _fold_char(ch)) != ch:
                table[base + offset] = folded
    classes: dict[str, set[str]] = {}
    for code, folded in table.items():
        classes.setdefault(folded, {folded}).add(chr(code))
    return table, {folded: "".join(sorted(chars)) for folded, chars in classes.items()}


def fold(text: str) -> str:
    """``text`` folded by the module doc's rule: one code point for each, so as long as ``text``.

    When every character's case folding is one code point, the text's (``str.casefold``, which folds
    each character alone) is the rule's, U+FFFE and U+FFFF aside: some 3 ns a character. Else (ß, a
    ligature, İ: some fold to several) the rule's table, character by character: some 50 ns each
    outside ASCII."""
    folded = text.casefold()
    if len(folded) != len(text):
        return text.translate(_folding()[0])
    if "\ufffe" in folded or "\uffff" in folded:
        folded = folded.replace("\ufffe", "\ufffd").replace("\uffff", "\ufffd")
    return folded


def _forms(ch: str) -> str:
    """Every character that matches ``ch`` (``ch`` among them), in code point order."""
    folded = fold(ch)
    return _folding()[1].get(folded, folded)


#: the escape character of every LIKE pattern here: not a backslash, which would make ``ESCAPE '\\'`` an
#: unterminated literal on a server with ``standard_conforming_strings = off``
LIKE_ESCAPE = "!"


def _like(text: str) -> str:
    """``text`` as a LIKE pattern that matches only itself (``ESCAPE '!'``)."""
    return text.replace("!", "!!").replace("%", "!%").replace("_", "!_")


def _glob(term: str) -> str:
    """A GLOB pattern finding ``term`` anywhere by the rule: each character as the class of its forms."""
    out = []
    for ch in term:
        forms = _forms(ch)
        # *, ? and [ are GLOB's wildcards: a class of one makes them literal ("]" outside a class is).
        # A class of several holds letters only (no "]", "^" or "-" to escape).
        out.append(f"[{forms}]" if len(forms) > 1 or ch in "*?[" else ch)
    return "*" + "".join(out) + "*"


def _pg_regex(term: str) -> str:
    """A PostgreSQL regular expression (ARE) finding ``term`` anywhere by the rule, case-sensitively:
    each character as the class of its forms, written as escapes (ASCII letters and digits aside)."""

    def one(ch: str) -> str:
        return (
            ch if ch.isascii() and ch.isalnum() else f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}"
        )

    out = []
    for ch in term:
        forms = _forms(ch)
        out.append("[" + "".join(map(one, forms)) + "]" if len(forms) > 1 else one(ch))
    return "".join(out)


def _pg_like(term: str) -> str | None:
    """A case-sensitive LIKE pattern (``ESCAPE '!'``) finding at least the term's matches, whatever the
    database's lower() and ctype: each run of cased characters (those with other forms) as ``%``, the
    uncased ones literal (only itself matches such a character). Only for a term with a run of 3+
    uncased letters or digits one of which is past U+07FF, which the regular expression's trigrams miss
    (CJK); None otherwise."""
    out = ["%"]
    run = wide = 0
    useful = False
    for ch in term:
        if len(_forms(ch)) > 1:
            if out[-1] != "%":
                out.append("%")
            run = wide = 0
            continue
        out.append(_like(ch))
        run, wide = (run + 1, wide + 1 if ord(ch) > 0x7FF else wide) if ch.isalnum() else (0, 0)
        useful = useful or (run >= 3 and wide > 0)
    if out[-1] != "%":
        out.append("%")
    return "".join(out) if useful else None


# How SQLite's trigram tokenizer folds a character (its own table: the module doc), read once per
# character and process from an in-memory FTS5 table of the sqlite3 module's library.
_FTS5_FOLDS: dict[str, str | None] = {}
_FTS5_LOCK = threading.Lock()


def _fts5_folds(chars: Set[str]) -> dict[str, str | None]:
    with _FTS5_LOCK:
        todo = sorted(chars - _FTS5_FOLDS.keys())
        if todo:
            db = sqlite3.connect(":memory:")
            try:
                db.execute("CREATE VIRTUAL TABLE probe USING fts5(x, tokenize = 'trigram')")
                db.execute("CREATE VIRTUAL TABLE probe_terms USING fts5vocab(probe, 'instance')")
                # One trigram a row: the character between two of a known fold.
                db.executemany(
                    "INSERT INTO probe (rowid, x) VALUES (?, ?)", enumerate((f"\x01{c}\x01" for c in todo), 1)
                )
                found = {todo[doc - 1]: term[1:-1] for term, doc in db.execute("SELECT term, doc FROM probe_terms")}
            finally:
                db.close()
            for ch in todo:
                _FTS5_FOLDS[ch] = found.get(ch)  # None: not read back, so never trusted
        return {ch: _FTS5_FOLDS[ch] for ch in chars}


def _fts5_match(terms: list[str]) -> str | None:
    """An FTS5 query finding at least every text the rule finds the terms in, or None (no term has one).

    A character whose forms the tokenizer folds to one character is itself in a phrase; one whose
    forms it folds to several (в, and U+1C80, an old form of it that the tokenizer does not fold) is
    each of them, so a run of a term stands for all its spellings: ``("привет" OR "приᲀет" ...)``. Each
    term gives its longest run of 3+ characters of at most FTS5_SPELLINGS spellings (a shorter run
    is no phrase: the index holds trigrams).
    """
    forms = {ch: _forms(ch) for ch in set("".join(terms))}
    folds = _fts5_folds({f for fs in forms.values() if len(fs) > 1 for f in fs})
    # ch -> one form for each way the tokenizer folds its forms (None: one of them could not be read)
    options: dict[str, list[str] | None] = {}
    for ch, fs in forms.items():
        by_fold: dict[str | None, str] = {}
        for f in (fold(ch), *fs) if len(fs) > 1 else ():
            by_fold.setdefault(folds[f], f)
        options[ch] = [ch] if len(fs) == 1 else None if None in by_fold else list(by_fold.values())
    groups = []
    for term in terms:
        widths = [len(spelt) if (spelt := options[ch]) is not None else 0 for ch in term]  # 0: no phrase
        best = (0, 0)
        start, spellings = 0, 1
        for end, width in enumerate(widths):
            if width == 0:
                start, spellings = end + 1, 1
                continue
            spellings *= width
            while spellings > FTS5_SPELLINGS:
                spellings //= widths[start]
                start += 1
            if end + 1 - start > best[1] - best[0]:
                best = (start, end + 1)
        if best[1] - best[0] >= 3:
            best = (best[0], min(best[1], best[0] + FTS5_RUN))
            run = [options[ch] or [] for ch in term[best[0] : best[1]]]
            phrases = ['"' + "".join(p).replace('"', '""') + '"' for p in product(*run)]
            groups.append(phrases[0] if len(phrases) == 1 else "(" + " OR ".join(phrases) + ")")
    return " AND ".join(groups) or None


def _full_text(
    core: Core, scope: str, session_id: str, kind: Kind, terms: list[str], sort: str, limit: int
) -> list[Hit]:
    if not terms:
        return []
    table, key = _SOURCES[kind]
    params: dict[str, Any] = {"scope": scope, "session_id": session_id, "limit": limit}
    order = "score DESC, recency DESC, ref DESC" if sort == "relevance" else "recency DESC, ref DESC"
    # A message the host keeps out of the model's context is never a hit (``_SHOWN``), in SQL: a page of
    # ``limit`` holds that many hits the model may see whenever there are.
    exact = [_SHOWN] if kind == "message" else []
    if core.dialect.is_sqlite:
        # ``contains`` decides (the rule, code point by code point); the FTS index only finds candidates.
        _register(core)
        exact += [f"{CONTAINS_FUNCTION}(t.content, :cf{n}, :c{n})" for n in range(len(terms))]
        for n, term in enumerate(terms):
            params[f"c{n}"] = term
            params[f"cf{n}"] = int(any(len(_forms(ch)) > 1 for ch in term))
        match = _fts5_match(terms)
        score = _score(core, terms, params) if sort == "relevance" else "0"
        if match is not None:
            params["match"] = match
            # The FTS index is one table for every scope and session, but a row's rowid says whose it
            # is: its session's slot, its kind's half of the slot, its ordinal or seq (revision 0012).
            # FTS5 takes the rowid bounds into its doclist iteration (it seeks each term's doclist to the
            # lower one and stops past the upper one: EXPLAIN QUERY PLAN shows "INDEX 0:M1><"), so the
            # search reads this session's rows of this kind and no other: its time does not grow with
            # the rest of the store (a 50-message session, a common term matching 50,000 rows in other
            # sessions: about 27 ms before, 1 ms now). CROSS JOIN fixes the join order: the session's slot,
            # then the FTS index, then the row by its key (SQLite's planner would otherwise walk the
            # session's rows and probe the FTS table once per row).
            first = f"s.slot * {SLOT_ROWS} + {KIND_ROWS[kind]}"
            sql = (
                f"SELECT {_columns(kind)}, {score} AS score FROM ts_lcm_search_slots AS s"
                " CROSS JOIN ts_lcm_search"
                f" CROSS JOIN {table.name} AS t ON t.scope = s.scope AND t.session_id = s.session_id"
                f" AND t.{key} = ts_lcm_search.rowid - ({first})"
                " WHERE s.scope = :scope AND s.session_id = :session_id AND ts_lcm_search MATCH :match"
                f" AND ts_lcm_search.rowid BETWEEN {first} AND {first} + {KIND_SPAN - 1}"
            )
        else:
            sql = (
                f"SELECT {_columns(kind)}, {score} AS score FROM {table.name} AS t"
                " WHERE t.scope = :scope AND t.session_id = :session_id"
            )
        sql += "".join(f" AND {c}" for c in exact)
    else:
        params["q"] = " ".join(terms)
        # The regular expression decides (the rule, code point by code point, whatever the ctype) and
        # the pg_trgm index serves it; a LIKE helps the index with what the expression's trigrams miss.
        # A word match alone is never one (the parser drops punctuation: "foo's" is the words foo & s,
        # "[x" the word x); the word vector only ranks.
        for n, term in enumerate(terms):
            params[f"r{n}"] = _pg_regex(term)
            exact.append(f"t.content ~ :r{n}")
            if (like := _pg_like(term)) is not None:
                params[f"t{n}"] = like
                exact.append(f"t.content LIKE :t{n} ESCAPE '{LIKE_ESCAPE}'")
        sql = (
            f"SELECT {_columns(kind)}, ts_rank(t.search_tsv, plainto_tsquery('simple', :q)) AS score"
            f" FROM {table.name} AS t WHERE t.scope = :scope AND t.session_id = :session_id"
            f" AND {' AND '.join(exact)}"
        )
    sql += f" ORDER BY {order} LIMIT :limit"
    params["head"] = _head()
    hits = []
    for r in core.conn.execute(text(sql), params).all():
        span, piece, offset = _placed(core, scope, session_id, kind, r.ref, r.content, terms[0])
        hits.append(Hit(kind, r.ref, r.recency, float(r.score or 0.0), piece, r.role, r.entry_id, span, offset))
    return hits


# A full-text hit's text is read up to its head, FIND_CHUNK characters and a snippet's width: what its
# snippet shows when the first term's first match is there (a message of usual size is read whole). A
# hit whose match is further is read on by key, FIND_READ characters at a time (``_placed``), and a hit
# keeps only its snippet's piece. The whole text of every hit came back before: a page of tool outputs
# matching a common word ("error", 50 hits of 4 MB) took 207 MB (SQLite) and 382 MB (PostgreSQL) of
# the process for an answer of 14 KB, and max_payload_bytes allows 64 MiB a message.
FIND_READ = 1 << 20


def _head() -> int:
    """Characters of a full-text hit's text its search reads (see above)."""
    return FIND_CHUNK + SNIPPET_WIDTH + 1


def _placed(
    core: Core, scope: str, session_id: str, kind: Kind, ref: int, head: str, term: str
) -> tuple[tuple[int, int] | None, str, int]:
    """The first match of ``term`` in a hit's text (``head``: its start, ``_head`` characters of it),
    the piece of the text its snippet shows (and a character more, if any), and where that piece starts."""
    span = _find(head, term)
    whole = len(head) < _head()
    if span is None and not whole:
        # Every match starting before ``at`` would lie in the head: read on from there, a piece at a time.
        at = max(0, len(head) - len(term) + 1)
        while span is None:
            chunk = _read(core, scope, session_id, kind, ref, at, FIND_READ + len(term) - 1)
            found = _find(chunk, term)
            if found is not None:
                span = (at + found[0], at + found[1])
            elif len(chunk) < FIND_READ + len(term) - 1:
                break  # the text ends (never for a hit: its match is somewhere)
            at += FIND_READ
    start = _snippet_start(span, SNIPPET_WIDTH)
    if whole or start + SNIPPET_WIDTH + 1 <= len(head):
        return span, head[start : start + SNIPPET_WIDTH + 1], start
    return span, _read(core, scope, session_id, kind, ref, start, SNIPPET_WIDTH + 1), start


def _read(core: Core, scope: str, session_id: str, kind: Kind, ref: int, start: int, length: int) -> str:
    """``length`` characters of a row's text from ``start`` on (0-based), by the row's key."""
    table, key = _SOURCES[kind]
    q = select(func.substr(table.c.content, start + 1, length)).where(
        table.c.scope == scope, table.c.session_id == session_id
    )
    return str(core.conn.execute(keyed(q, table.c[key], ref)).scalar() or "")


# A full-text hit's score on SQLite: how often its terms occur in its text by the rule, counted in
# Python (``occurrences``, a SQL function) as SQLite reads the candidate, from its own row alone. Until
# revision 0012 it was bm25, which weighs each phrase by the rows of the whole FTS5 table holding it
# (FTS5 counts them over the whole index, once per search): the ranking and the time of a search in
# one session depended on every other session's text. After it, FTS5's highlight() measured the
# places its phrases occur (the text's length with a character added at each, less the text's): the
# trigram tokenizer's phrases overlap in a repeated text (a run of "A" in base64, a "=====" rule),
# highlight() then copies the rest of the text again at each overlapping match, so the score grew with
# the square of the run ("haha" in one long laugh outranked five separate ones) and its time with the
# cube (4,000 "A" took seconds, 40,000 never finished). ``occurrences`` reads the first SCORE_MAX_TEXT
# characters once (a fold, a str.count a term), whatever they hold. It is registered once a connection:
# the pool's record of the connection keeps a mark, cleared when the connection is replaced (SQLite
# refuses to redefine a function while another statement of the connection is active).
def _register(core: Core) -> None:
    """Register ``occurrences`` and ``contains`` on the SQLite connection, once (see the comment above)."""
    proxied = core.conn.connection
    if not proxied.info.get(SCORE_FUNCTION):
        driver: Any = proxied.driver_connection
        driver.create_function(SCORE_FUNCTION, -1, occurrences, deterministic=True)
        driver.create_function(CONTAINS_FUNCTION, 3, contains, deterministic=True)
        proxied.info[SCORE_FUNCTION] = True


def contains(content: object, folded: object, term: object) -> int:
    """Whether ``term`` occurs in ``content`` by the rule (the module doc), 1 or 0, for SQL: folded a
    chunk at a time up to its first match (``_find``). ``folded`` false: no character of the term has
    another form, so the text is searched as it is."""
    if not isinstance(content, str) or not isinstance(term, str):
        return 0
    return int(_find(content, term) is not None) if folded else int(term in content)


def _score(core: Core, terms: list[str], params: dict[str, Any]) -> str:
    """The SQL of a relevance score (``occurrences``) of ``terms``, which it adds to ``params``."""
    _register(core)
    # Terms whose characters each match only themselves (CJK, digits, "=") are counted in the text as it
    # is: the same matches, and no fold of the text (``fold`` of a text with ß takes its slow way).
    params["fold"] = int(any(len(_forms(ch)) > 1 for term in terms for ch in term))
    params.update({f"o{n}": fold(term) for n, term in enumerate(terms)})
    args = "".join(f", :o{n}" for n in range(len(terms)))
    return f"{SCORE_FUNCTION}(substr(t.content, 1, {SCORE_MAX_TEXT}), :fold{args})"


def occurrences(content: object, folded: object, *terms: object) -> int:
    """A full-text hit's relevance on SQLite: for each term, its matches by the rule (the module doc) in
    the first SCORE_MAX_TEXT characters of ``content``, added up. A term's matches are counted left to
    right, each after the previous one ends (``str.count``): "haha" occurs twice in "hahahaha", once in
    "hahaha" (a run of n characters holds n // len(term) matches of a term that repeats one character).
    ``terms`` are folded; ``folded`` false: no term has a character that another matches, so the text
    is counted as it is (the same matches). Total: 0 for what is not text (SQL calls it)."""
    if not isinstance(content, str):
        return 0
    text = content[:SCORE_MAX_TEXT]
    if folded:
        text = fold(text)
    return sum(text.count(term) for term in terms if isinstance(term, str) and term)


#: characters of a hit's text folded at a time while its snippet's match is looked for (``_find``)
FIND_CHUNK = 65_536


def _find(content: str, term: str) -> tuple[int, int] | None:
    """The first match of ``term`` in ``content`` by the rule, as indexes into ``content`` (a fold keeps
    the length: see the module doc).

    The text is folded a chunk at a time (each overlapping the next by the term's length less one, so a
    match across a border is found) and the look stops at the first match: folding a whole hit's text
    for a match near its start cost its whole length, some 50 ns a character in a text with a character
    that folds to several (a 4 MB tool output: 0.2 s for each such hit of a page)."""
    want = fold(term)
    if not want:
        return (0, 0)
    for start in range(0, max(1, len(content) - len(want) + 1), FIND_CHUNK):
        at = fold(content[start : start + FIND_CHUNK + len(want) - 1]).find(want)
        if at >= 0:
            return (start + at, start + at + len(want))
    return None


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
    found = _regex_hits(core, scope, session_id, kind, pattern, deadline)
    if sort == "recency" and kind == "message":
        # Messages come newest first, in their _recency order: the first ``limit`` are the page.
        # (Summaries come by id, which is not their recency: a condensed summary made after a leaf
        # covers older messages.)
        return list(islice(found, limit))
    # The best ``limit`` in a heap: what a search holds does not grow with the session.
    return heapq.nsmallest(limit, found, key=_relevance if sort == "relevance" else _recency)


def _regex_hits(
    core: Core, scope: str, session_id: str, kind: Kind, pattern: regex.Pattern[str], deadline: float
) -> Iterator[Hit]:
    """Each row of the session the pattern matches, newest first, with the piece of its text that the
    match's snippet shows."""
    for row in _scan(core, scope, session_id, kind):
        found = _matches(pattern, row.content[:REGEX_MAX_TEXT], deadline)
        if found:
            span = found[0].span()
            start = _snippet_start(span, SNIPPET_WIDTH)
            piece = row.content[start : start + SNIPPET_WIDTH + 1]  # + 1: is there more text after it
            yield Hit(kind, row.ref, row.recency, float(len(found)), piece, row.role, row.entry_id, span, start)


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


def _scan(core: Core, scope: str, session_id: str, kind: Kind) -> Iterator[Any]:
    """Every row of the session, newest first, in indexed batches: its keys and its text up to what a
    regex searches and the snippet of a match there reads (a long tool result is not read whole)."""
    table, key = _SOURCES[kind]
    column = table.c[key]
    is_message = kind == "message"
    columns = (
        column.label("ref"),
        (table.c.ordinal if is_message else table.c.latest_ordinal).label("recency"),
        (table.c.role if is_message else null()).label("role"),
        (table.c.entry_id if is_message else null()).label("entry_id"),
        func.substr(table.c.content, 1, _REGEX_READ).label("content"),
    )
    before: int | None = None
    while True:
        q = select(*columns).where(table.c.scope == scope, table.c.session_id == session_id)
        if is_message:
            q = q.where(table.c.hidden == false())  # never shown to the model, so never a hit (``_SHOWN``)
        if before is not None:
            q = q.where(column < before)
        rows = core.conn.execute(q.order_by(column.desc()).limit(SCAN_BATCH)).all()
        yield from rows
        if len(rows) < SCAN_BATCH:
            return
        before = rows[-1].ref
        del rows  # before the next batch comes: one batch at a time in memory


def _snippet_start(span: tuple[int, int] | None, width: int) -> int:
    return 0 if span is None else max(0, span[0] - width // 2)


def snippet(content: str, span: tuple[int, int] | None, width: int = SNIPPET_WIDTH, offset: int = 0) -> str:
    """About ``width`` characters around the match, whitespace collapsed. ``content`` is the text from
    ``offset`` on (``Hit.offset``), at least as far as the snippet reads and a character more if any."""
    start = _snippet_start(span, width)
    piece = content[start - offset : start - offset + width]
    flat = " ".join(piece.split())
    return ("…" if start > 0 else "") + flat + ("…" if start + width < offset + len(content) else "")
