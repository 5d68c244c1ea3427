"""Pluggable summarizers for compaction: a deterministic extractive default, and an OpenAI-compatible one.

``summarizer_from_env()`` builds ``OpenAISummarizer`` when TRANSCRIPT_STORE_SUMMARIZER=openai (OPENAI_BASE_URL,
OPENAI_API_KEY, TRANSCRIPT_STORE_SUMMARIZER_MODEL), else ``ExtractiveSummarizer``, which needs no network.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import regex

from .db import UNSENDABLE
from .engine import MAX_TOKENS
from .errors import InvalidInput, ModelError, SummarizerError
from .model import DEFAULT_OPENAI_MODEL, OpenAIChatModel, message_text
from .models import RESULT_ROLES, functions_called
from .tokens import RoughEstimator, TokenEstimator

Level = Literal["normal", "aggressive"]
SUMMARIZER_ENV = "TRANSCRIPT_STORE_SUMMARIZER"
SUMMARIZER_MODEL_ENV = "TRANSCRIPT_STORE_SUMMARIZER_MODEL"
DEFAULT_OPENAI_URL = "https://api.openai.com/v1"

log = logging.getLogger("transcript_store.summarize")


@runtime_checkable
class Summarizer(Protocol):
    """Turns older messages (and the summary that already covers what came before them) into one summary."""

    def summarize(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        previous_summary: str | None = None,
        focus: str | None = None,
        level: Level = "normal",
        max_tokens: int = 1024,
    ) -> str:
        """A summary of ``previous_summary`` + ``messages``, at most about ``max_tokens`` tokens. A message
        made by ``summary_input`` is an earlier summary (a condensation's child), not a conversation's message."""
        ...


#: the key of a summarizer's input that stands for an earlier summary: the number of messages it covers
SUMMARY_INPUT = "transcript_store_summary_of"


def summary_input(text: str, messages: int) -> dict[str, Any]:
    """A summarizer's input for an earlier summary of ``messages`` messages (a condensed summary's child):
    a user message holding ``text`` alone, marked (``SUMMARY_INPUT``) so a summarizer reads it as one."""
    return {"role": "user", "content": text, SUMMARY_INPUT: messages}


def summarized(message: dict[str, Any]) -> int | None:
    """How many messages ``message`` summarizes when it is a ``summary_input``, else None."""
    n = message.get(SUMMARY_INPUT)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def summary_text(answer: object) -> str:
    """A summarizer's answer as the text a summary stores and shows (SummarizerError if it is no text).

    Anything but a string is the summarizer's failure: ``str()`` of it made ``None`` (an adapter passing
    on a model message without content) the summary "None", in context in place of what it covered.
    NUL and lone surrogates (half of an emoji, a model's output cut) are shown as U+FFFD: no database
    takes them, so such a summary failed the compaction's write, every time. Count a summary's tokens
    on this text, the one shown."""
    if not isinstance(answer, str):
        raise SummarizerError(f"the summarizer returned {type(answer).__name__}, not a string")
    return UNSENDABLE.sub("\ufffd", str(answer)).strip()


CUT_MARK = "[… cut to {max_tokens} tokens]"
# Where a cut may end, cleanest first: a line end, a sentence end (CJK full stops too), a space.
_BOUNDARIES = (re.compile(r"\n"), re.compile(r"(?<=[.!?;:])\s|(?<=[\u3002\uff01\uff1f\uff1b])"), re.compile(r"\s"))
# One user-perceived character (an extended grapheme cluster): a letter with its accents or vowel signs
# (Thai and Devanagari ones too, which have combining class 0), an emoji with its joiners, modifiers or
# keycap, a flag's two regional indicators, CR LF.
_CHARACTER = regex.compile(r"\X")
_FIRST_PROBE = 64  # characters: the prefix search doubles from here


def hold(text: str, max_tokens: int, estimator: TokenEstimator) -> str:
    """``text`` if within ``max_tokens`` (``estimator.count_text``), else its start cut cleanly + CUT_MARK
    ("" when not even the marker fits). Never over ``max_tokens``, whatever the estimator counts.
    InvalidInput for a text that is no string or a limit that is no integer."""
    if not isinstance(text, str):
        raise InvalidInput(f"hold takes a text (a string), not {type(text).__name__}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidInput(f"max_tokens must be an integer, not {type(max_tokens).__name__}")
    if estimator.count_text(text) <= max_tokens:
        return text
    mark = "\n" + CUT_MARK.format(max_tokens=max_tokens)
    end = _longest_prefix(text, mark, max_tokens, estimator)
    # The clean cut, else the last character boundary; else where the search ended, which it found to fit
    # (an estimator need not count a shorter prefix lower; one character longer than the budget is split).
    for cut in dict.fromkeys((_clean_end(text, end), _character_end(text, end), end)):
        head = text[:cut].rstrip()
        if head and estimator.count_text(head + mark) <= max_tokens:
            return head + mark
    return ""


def _longest_prefix(text: str, suffix: str, budget: int, estimator: TokenEstimator) -> int:
    """The largest n with ``text[:n].rstrip() + suffix`` within ``budget`` tokens, or 0.

    Doubling from a short prefix, then bisecting: no probe counts more than twice what fits, so the cost
    is that of the budget, not of the text (bisecting from the whole length counted half of a 2 MB answer,
    then a quarter, ...). A probe that fits is the only way ``lo`` moves: the answer always fits.
    """

    def fits(n: int) -> bool:
        return estimator.count_text(text[:n].rstrip() + suffix) <= budget

    lo, hi, n = 0, len(text), _FIRST_PROBE
    while n < hi:
        if not fits(n):
            hi = n - 1
            break
        lo, n = n, 2 * n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _clean_end(text: str, end: int) -> int:
    """Where to cut ``text[:end]``: the last line end, else sentence end, else space in its last quarter;
    else the last character boundary (``_character_end``)."""
    floor = end - end // 4
    for boundary in _BOUNDARIES:
        last = max((m.start() for m in boundary.finditer(text, 0, end)), default=0)
        if last >= max(floor, 1):
            return _character_end(text, last)
    return _character_end(text, end)


def _character_end(text: str, end: int) -> int:
    """The last boundary between two user-perceived characters at or before ``end`` (0 if none).

    Not ``unicodedata.combining``: Thai and Devanagari vowel signs, the keycap mark, an emoji's skin tone
    or a flag's second letter all have combining class 0, and were cut off their character.
    """
    if end >= len(text):
        return len(text)
    for m in _CHARACTER.finditer(text):
        if m.end() > end:
            return m.start()
    return end  # pragma: no cover - the clusters cover the text


def _check_args(
    messages: object, previous_summary: object, focus: object, level: str, max_tokens: int
) -> None:
    """Refuse arguments no summarizer can honour (InvalidInput): messages that are no sequence of message
    dicts, a previous summary or focus that is no string, an unknown level, a token limit that is no integer
    in 16..MAX_TOKENS. Unchecked, a string limit, a dict's place taken by a string or a focus of 5 surfaced
    as a TypeError or AttributeError from deep inside the summarizer."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidInput(f"messages must be a list of message dicts, not {type(messages).__name__}")
    if not all(isinstance(m, dict) for m in messages):
        raise InvalidInput("messages must be a list of message dicts")
    for what, value in (("previous_summary", previous_summary), ("focus", focus)):
        if value is not None and not isinstance(value, str):
            raise InvalidInput(f"{what} must be a string or None, not {type(value).__name__}")
    if level not in ("normal", "aggressive"):
        raise InvalidInput(f"summary level must be 'normal' or 'aggressive', not {level!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidInput(f"max_tokens must be an integer, not {type(max_tokens).__name__}")
    if not 16 <= max_tokens <= MAX_TOKENS:
        raise InvalidInput(f"a summary needs max_tokens of at least 16 (and at most {MAX_TOKENS})")


# ------------------------------------------------------------------------------------------------ backoff

#: seconds the automatic compactions of a session wait after its summarizer failed once
BACKOFF_BASE_SECONDS = 30.0
#: the longest they wait (the wait doubles at each failure in a row, up to this)
BACKOFF_CAP_SECONDS = 600.0
#: the sessions a ``SummaryBackoff`` remembers (the least recently failed one is forgotten first)
BACKOFF_KEYS = 4096
#: how the reason of a compaction skipped while its session's backoff runs starts
PAUSED = "automatic compaction paused: "


@dataclass
class _Failures:
    """A session's summarizer failures in a row: how many, the last one's reason, until when to wait."""

    count: int
    reason: str
    delay: float
    until: float


class SummaryBackoff:
    """How long the automatic compactions of a session wait after its summarizer failed, in this process.

    A failure (an error, a timeout, an empty answer) pauses the automatic compactions of its key (an engine's
    ``(scope, session_id)``) for ``base`` seconds, doubled at each failure in a row up to ``cap``; a
    summary the summarizer answered forgets the key. A down summary model otherwise cost every later turn
    over the threshold its whole timeout (60 s by default) again. A forced compaction (``compact``,
    ``/compact``, the overflow recovery) is never paused, and its outcome counts as any other's.
    Thread-safe; at most ``BACKOFF_KEYS`` keys."""

    def __init__(
        self,
        base: float = BACKOFF_BASE_SECONDS,
        cap: float = BACKOFF_CAP_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """A backoff waiting ``base`` seconds after a first failure, doubled up to ``cap``, timed by ``clock``."""
        self.base, self.cap, self.clock = float(base), float(cap), clock
        self._failures: OrderedDict[Hashable, _Failures] = OrderedDict()
        self._lock = threading.Lock()

    def paused(self, key: Hashable) -> str | None:
        """Why an automatic compaction of ``key`` is skipped now (starting with ``PAUSED``), else None.

        The text stays the same while a pause lasts (a host that shows a failure once per text, as Hermes
        does, is not told again at every turn)."""
        with self._lock:
            failures = self._failures.get(key)
            if failures is None or self.clock() >= failures.until:
                return None
            return (
                f"{PAUSED}{failures.reason} ({failures.count} summarizer failure(s) in a row; tried again after "
                f"{failures.delay:.0f} s, a forced compaction tries now)"
            )

    def failed(self, key: Hashable, reason: str) -> float:
        """Record a summarizer failure of ``key``: the seconds its automatic compactions now wait."""
        with self._lock:
            before = self._failures.pop(key, None)
            count = 1 if before is None else before.count + 1
            delay: float = min(self.cap, self.base * 2.0 ** min(count - 1, 32))
            self._failures[key] = _Failures(count, reason, delay, self.clock() + delay)
            while len(self._failures) > BACKOFF_KEYS:
                self._failures.popitem(last=False)
        log.warning("%s; automatic compactions of %s paused for %.0f s", reason, key, delay)
        return delay

    def succeeded(self, key: Hashable) -> None:
        """Forget the failures of ``key``: the summarizer answered."""
        with self._lock:
            self._failures.pop(key, None)


# --------------------------------------------------------------------------------------------- extractive


@dataclass(frozen=True)
class _Limits:
    """Character limits of one extract, per level."""

    sentence: int
    key_line: int
    key_lines: int
    tool_result: int
    arguments: int
    summary_line: int  # a line of an earlier summary (a condensation's child)


_LIMITS: dict[str, _Limits] = {
    "normal": _Limits(sentence=200, key_line=160, key_lines=2, tool_result=160, arguments=80, summary_line=600),
    "aggressive": _Limits(sentence=90, key_line=90, key_lines=1, tool_result=60, arguments=40, summary_line=120),
}
# Lines worth keeping besides the first sentence when no focus is given: decisions, failures, open work.
_KEY_WORDS = re.compile(r"\b(error|fail|decid|todo|must|important|result|because|next)", re.IGNORECASE)
_OMITTED = re.compile(r"\(\d+ older lines omitted\)")
_SENTENCE_END = re.compile("(?<=[.!?])\\s+|(?<=[\u3002\uff01\uff1f])")  # CJK full stop, !, ?


def _cut(text: str, limit: int) -> str:
    """Whitespace collapsed, cut to ``limit`` characters with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


def _first_sentence(text: str, limit: int) -> str:
    """The first sentence of the first non-empty line, cut to ``limit``."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    return _cut(_SENTENCE_END.split(line.strip(), maxsplit=1)[0], limit)


def _key_lines(text: str, focus: str | None, limits: _Limits) -> list[str]:
    """Lines after the first that mention the focus (else a key word), cut, at most ``limits.key_lines``."""
    lines = [ln for ln in text.splitlines() if ln.strip()][1:]
    if focus:
        wanted = [ln for ln in lines if focus.lower() in ln.lower()]
    else:
        wanted = [ln for ln in lines if _KEY_WORDS.search(ln)]
    return [_cut(ln, limits.key_line) for ln in wanted[: limits.key_lines]]


#: lines a summary holds about itself, not about the conversation: the extractive header, a cut's mark, the
#: model's cut-off mark, a truncation's mark
_SUMMARY_MARKS = re.compile(
    r"Summary of \d+ messages( \(focused\))?:|\[… (cut to \d+ tokens|summary cut off by the model at its length "
    r"limit)\]|\(truncated\)"
)


def summary_lines(summary: str) -> list[str]:
    """The lines of an earlier summary that tell the conversation: without our own header, notes and marks,
    nor the ``Earlier:`` lines it repeated from the summary before it (a condensation holds that one too,
    or it is in context before it)."""
    return [
        line
        for line in (ln.strip() for ln in summary.splitlines())
        if line
        and not line.startswith("Earlier: ")
        and not _OMITTED.fullmatch(line)
        and not _SUMMARY_MARKS.fullmatch(line)
    ]


def _gist(previous_summary: str) -> list[str]:
    """The content lines of a previous summary, without our own header, notes and ``Earlier:`` prefixes."""
    lines = []
    for line in previous_summary.splitlines():
        line = line.strip()
        while line.startswith("Earlier: "):
            line = line.removeprefix("Earlier: ").strip()
        if line and not line.startswith("Summary of ") and not _OMITTED.fullmatch(line):
            lines.append(line)
    return lines


#: the fewest tokens of a line worth keeping cut (its role and a few words), else it is dropped whole
_MIN_CLIP = 12


def _clip(line: str, room: int, estimator: TokenEstimator) -> str:
    """The start of ``line`` within ``room`` tokens, cut at a sentence end or space in its last quarter (else
    between two characters) and ended with "…"; "" when not even that fits."""
    end = _longest_prefix(line, "…", room, estimator)
    for cut in dict.fromkeys((_clean_end(line, end), _character_end(line, end), end)):
        head = line[:cut].rstrip()
        if head and estimator.count_text(head + "…") <= room:
            return head + "…"
    return ""


def _joined(
    header: str, lines: list[str], keep: list[bool], clip: tuple[int, str] | None, *, note: bool
) -> str:
    """The header, the note on the dropped lines (when ``note``), and the kept lines in their order, the
    line ``clip`` names replaced by its cut start."""
    dropped = keep.count(False) - (clip is not None)
    out = [header] + ([f"({dropped} older lines omitted)"] if dropped and note else [])
    for i, (line, kept) in enumerate(zip(lines, keep, strict=True)):
        if kept:
            out.append(line)
        elif clip is not None and clip[0] == i:
            out.append(clip[1])
    return "\n".join(out)


def _tool_names(messages: Sequence[dict[str, Any]]) -> dict[str, str]:
    """tool_call id -> function name, over every assistant message."""
    names: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                names[str(call.get("id"))] = str(call["function"].get("name"))
    return names


def _extract(message: dict[str, Any], tool_names: dict[str, str], focus: str | None, limits: _Limits) -> str:
    """One line for one message: role, first sentence, key lines, tools called or the tool's result."""
    role = str(message.get("role", "?"))
    text = message_text(message)
    if role in ("tool", "function"):  # a function result names its function (the older format's answer)
        name = tool_names.get(str(message.get("tool_call_id")), str(message.get("name") or "tool"))
        return f"- {role} {name} -> {_cut(text, limits.tool_result)}"
    parts = [_first_sentence(text, limits.sentence)] if text.strip() else []
    parts += _key_lines(text, focus, limits)
    calls = [f"{name}({_cut(arguments, limits.arguments)})" for name, arguments in functions_called(message)]
    if calls:
        parts.append("called " + ", ".join(calls))
    return f"- {role}: " + (" | ".join(parts) or "(no text)")


class ExtractiveSummarizer:
    """Deterministic offline summarizer: the previous summary's gist, then one short extract per message.

    Each message gives one line: its role and first sentence, up to two further lines that mention the
    focus (else lines with a key word such as "error", "decided", "todo"), the tools it called, or, for a
    tool result, the result cut short; an earlier summary given as a message (``summary_input``, a
    condensation's child) gives its content lines (``summary_lines``) and counts as the messages it covers.
    ``aggressive`` cuts every extract shorter and halves the budget.
    When the lines exceed ``max_tokens`` (counted with ``RoughEstimator``), lines are dropped oldest first,
    those that do not mention the focus before those that do, and a note says how many were dropped; the
    room left holds the start of the last line dropped, cut at a word boundary and marked "…" (the note
    goes when it leaves that line no room); so the output never exceeds ``max_tokens``, and is always
    shorter than an input longer than ``max_tokens * 4`` characters. Lines that all fit are written
    whole, as they were. Same input, same output.
    """

    def __init__(self) -> None:
        """An extractive summarizer; budgets are counted with ``RoughEstimator``."""
        self._estimator = RoughEstimator()

    def summarize(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        previous_summary: str | None = None,
        focus: str | None = None,
        level: Level = "normal",
        max_tokens: int = 1024,
    ) -> str:
        """An extractive summary of ``previous_summary`` + ``messages`` within ``max_tokens``."""
        _check_args(messages, previous_summary, focus, level, max_tokens)
        focus = focus.strip() if focus and focus.strip() else None
        limits = _LIMITS[level]
        budget = max_tokens if level == "normal" else max(16, max_tokens // 2)
        # The focus shapes which lines stay, but its words are not written: the summary would hold text no
        # message held (a search for it found the summary; it outlived a redaction of what it quoted).
        covered = sum(1 if (n := summarized(m)) is None else n for m in messages)
        header = f"Summary of {covered} messages" + (" (focused)" if focus else "") + ":"
        lines: list[str] = []
        if previous_summary and previous_summary.strip():
            lines += ["Earlier: " + _cut(ln, limits.sentence) for ln in _gist(previous_summary)]
        names = _tool_names(messages)
        for m in messages:
            if summarized(m) is None:
                lines.append(_extract(m, names, focus, limits))
            else:  # an earlier summary (a condensation's child): its own lines, not an extract of its first
                lines += [_cut(ln, limits.summary_line) for ln in summary_lines(message_text(m))]
        return self._fit(header, lines, focus, budget)

    def _fit(self, header: str, lines: list[str], focus: str | None, budget: int) -> str:
        """Drop lines (oldest, non-focus first) until header + note + lines fit ``budget`` tokens; the room
        that leaves holds the start of the last line dropped, cut short (``_clipped``)."""
        count = self._estimator.count_text
        # per-line counts (+1 for the newline) add up to at least the count of the joined text
        cost = [count(ln) + 1 for ln in lines]
        total = count(header) + sum(cost)
        keep = [True] * len(lines)
        last: int | None = None
        if total > budget:
            total += 12  # room for the "(N older lines omitted)" note
            needle = focus.lower() if focus else None
            focused = [needle is not None and needle in ln.lower() for ln in lines]
            order = [i for i in range(len(lines)) if not focused[i]] + [i for i in range(len(lines)) if focused[i]]
            for i in order:
                if total <= budget:
                    break
                keep[i] = False
                total -= cost[i]
                last = i
        text = _joined(header, lines, keep, None, note=True)
        if last is not None:
            text = self._clipped(header, lines, keep, last, budget) or text
        return self._truncate(text, budget)

    def _clipped(self, header: str, lines: list[str], keep: list[bool], last: int, budget: int) -> str | None:
        """The summary with the start of ``lines[last]`` in the room the kept lines leave, cut at a word
        boundary and marked with "…"; None when not even ``_MIN_CLIP`` tokens of it fit.

        A budget smaller than one line (a leaf of 32 tokens in a window of 512, where a line of a message
        is ~100) dropped every line: the summary said only how many were omitted. The note goes when it
        leaves no room for the line: the header counts the messages, and the marker shows the cut."""
        count = self._estimator.count_text
        for note in (True, False):
            room = budget - count(_joined(header, lines, keep, (last, ""), note=note))
            while room >= _MIN_CLIP:
                piece = _clip(lines[last], room, self._estimator)
                if not piece:
                    break
                text = _joined(header, lines, keep, (last, piece), note=note)
                over = count(text) - budget
                if over <= 0:
                    return text
                room -= over  # counts need not add up (a script's rate depends on the whole text)
        return None

    def _truncate(self, text: str, budget: int) -> str:
        """The longest prefix of ``text`` within ``budget`` tokens (only when the header alone is too long)."""
        if self._estimator.count_text(text) <= budget:
            return text
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._estimator.count_text(text[:mid] + "…") <= budget:
                lo = mid
            else:
                hi = mid - 1
        return text[:lo] + "…"


# ------------------------------------------------------------------------------------------------- OpenAI

_SYSTEM_PROMPT = """You compress the earlier part of a conversation between a user and an AI assistant so \
the assistant can continue the conversation without the original messages.
Write a faithful summary in the conversation's language, as terse notes, at most {max_tokens} tokens.
Keep: the user's goals, requests and preferences; decisions made and why; facts, names, numbers, file \
paths, identifiers and URLs that later turns may need; tools called and what they returned; open \
questions and unfinished work. Drop greetings, repetition and anything superseded.
If an earlier summary is given, merge it: keep what still matters, do not lose facts it holds.
Do not invent anything. Do not address the user. Output only the summary text."""

_LEVEL_HINT = {
    "normal": "Be concise but complete.",
    "aggressive": "Be very brief: keep only what the assistant cannot continue without, in a few lines.",
}


def render_transcript(messages: Sequence[dict[str, Any]], *, max_chars_per_message: int = 4000) -> str:
    """The messages as plain text for a summarization prompt (tool calls and results included, long ones cut)."""
    names = _tool_names(messages)
    return "\n\n".join(_rendered(m, names, max_chars_per_message) for m in messages)


def _rendered(m: dict[str, Any], names: dict[str, str], max_chars: int) -> str:
    """One message as ``render_transcript`` shows it (``names``: tool_call id -> function name)."""
    role = str(m.get("role", "?"))
    text = message_text(m)
    if (covered := summarized(m)) is not None:  # a condensation's child: a summary, not the user's words
        return f"[summary of {covered} earlier messages]\n{text[:max_chars]}"
    if role in ("tool", "function"):
        tool = names.get(str(m.get("tool_call_id")), str(m.get("name") or "tool"))
        return f"[{role} result: {tool}]\n{_cut(text, max_chars // 2)}"
    block = f"[{role}]\n{text[:max_chars]}" if text else f"[{role}]"
    for name, arguments in functions_called(m):
        block += f"\n(calls {name} with {_cut(arguments, 500)})"
    return block


#: ends a summary the model cut off at its token limit (``finish_reason: "length"``)
CUT_OFF_MARK = "[… summary cut off by the model at its length limit]"
#: the most one summarization request holds (tokens, counted with ``RoughEstimator``, which counts high): well
#: inside the window of the models a summarizer runs on (128k for the default one)
MAX_INPUT_TOKENS = 64_000


class OpenAISummarizer:
    """Summaries written by a model behind an OpenAI-compatible ``/chat/completions`` endpoint."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout: float = 60.0,
        max_input_tokens: int = MAX_INPUT_TOKENS,
    ) -> None:
        """Summarize with ``model`` at ``base_url``; ``timeout`` seconds per request, each request at most
        ``max_input_tokens`` (a longer history is folded in over several)."""
        if isinstance(max_input_tokens, bool) or not isinstance(max_input_tokens, int) or max_input_tokens < 4096:
            raise InvalidInput(f"max_input_tokens must be an integer of at least 4096, got {max_input_tokens!r}")
        self._model = OpenAIChatModel(base_url, model, api_key, timeout)
        self.name = model
        self.max_input_tokens = max_input_tokens
        self._estimator = RoughEstimator()

    def __repr__(self) -> str:
        """Shows the endpoint and model, never the key."""
        return f"OpenAISummarizer({self._model!r})"

    def summarize(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        previous_summary: str | None = None,
        focus: str | None = None,
        level: Level = "normal",
        max_tokens: int = 1024,
    ) -> str:
        """Ask the model for a summary; SummarizerError on HTTP/network failures or an empty answer. A summary
        the model cut off (``finish_reason: "length"``) is kept, ending with CUT_OFF_MARK, and logged.

        Messages that do not fit one request of ``max_input_tokens`` are folded in over several, in order,
        each request carrying the summary the one before answered: sent whole, a long history (one that
        grew while compactions failed) was refused by the model as over its window at every compaction."""
        _check_args(messages, previous_summary, focus, level, max_tokens)
        summary = previous_summary
        for chunk in self._chunks(messages, previous_summary, focus, level, max_tokens):
            summary = self._summarize_once(chunk, summary, focus, level, max_tokens)
        assert summary is not None  # one request at least, which answered a summary or raised
        return summary

    def _chunks(
        self,
        messages: Sequence[dict[str, Any]],
        previous_summary: str | None,
        focus: str | None,
        level: Level,
        max_tokens: int,
    ) -> list[list[dict[str, Any]]]:
        """``messages`` in consecutive runs whose request fits ``max_input_tokens`` (one run at least; a
        message is never split, nor a call from its results, and one too long alone still goes, cut as
        ``render_transcript`` cuts it)."""
        count = self._estimator.count_text
        # What every request holds besides the messages: the prompt's frame, and the summary carried in
        # (the previous one, then an answer of at most ``max_tokens``).
        frame = self._estimator.count_messages(
            self.prompt([], previous_summary=previous_summary, focus=focus, level=level, max_tokens=max_tokens)
        )
        room = self.max_input_tokens - frame - max_tokens
        names = _tool_names(messages)
        chunks: list[list[dict[str, Any]]] = [[]]
        used = 0
        for m in messages:
            cost = count(_rendered(m, names, 4000)) + 1
            # (Never between a call and its results: a result would lose the name of the tool it came from.)
            if chunks[-1] and used + cost > room and m.get("role") not in RESULT_ROLES:
                chunks.append([])
                used = 0
            chunks[-1].append(m)
            used += cost
        return chunks

    def _summarize_once(
        self,
        messages: Sequence[dict[str, Any]],
        previous_summary: str | None,
        focus: str | None,
        level: Level,
        max_tokens: int,
    ) -> str:
        """One request: ``previous_summary`` + ``messages`` summarized by the model."""
        request = self.prompt(messages, previous_summary=previous_summary, focus=focus, level=level,
                              max_tokens=max_tokens)
        try:
            response = self._model.complete(request, max_tokens=max_tokens)
        except ModelError as e:
            raise SummarizerError(f"summarizer {self.name}: {e}", status=e.status) from e
        summary = message_text(response.message).strip()
        if not summary:
            raise SummarizerError(f"summarizer {self.name} returned an empty summary")
        if response.finish_reason == "length":
            # Cut off at max_tokens: its start is kept (the originals stay stored, and a summary that always
            # runs long, refused, would leave the session never compacted until the model's window overflowed),
            # marked so that the model reading it, and a user, know its end is missing.
            log.warning("summarizer %s: the summary was cut off at max_tokens=%d; kept, marked as cut",
                        self.name, max_tokens)
            summary = f"{summary}\n{CUT_OFF_MARK}"
        return summary

    @staticmethod
    def prompt(
        messages: Sequence[dict[str, Any]],
        *,
        previous_summary: str | None,
        focus: str | None,
        level: Level,
        max_tokens: int,
    ) -> list[dict[str, Any]]:
        """The chat messages sent to the summarization model."""
        parts = []
        if previous_summary and previous_summary.strip():
            parts.append(f"Earlier summary:\n{previous_summary.strip()}")
        parts.append(f"Conversation to summarize:\n{render_transcript(messages)}")
        if focus and focus.strip():
            parts.append(f"Focus: give priority to everything about {focus.strip()!r}.")
        parts.append(_LEVEL_HINT[level])
        return [
            {"role": "system", "content": _SYSTEM_PROMPT.format(max_tokens=max_tokens)},
            {"role": "user", "content": "\n\n".join(parts)},
        ]


def summarizer_choice() -> str:
    """TRANSCRIPT_STORE_SUMMARIZER: ``extractive`` (also when unset) or ``openai``; InvalidInput otherwise."""
    choice = os.environ.get(SUMMARIZER_ENV, "").strip().lower() or "extractive"
    if choice not in ("extractive", "openai"):
        raise InvalidInput(f"{SUMMARIZER_ENV} must be 'extractive' or 'openai', not {choice!r}")
    return choice


def summarizer_from_env() -> Summarizer:
    """``OpenAISummarizer`` when TRANSCRIPT_STORE_SUMMARIZER=openai, else ``ExtractiveSummarizer``."""
    if summarizer_choice() == "extractive":
        return ExtractiveSummarizer()
    url = os.environ.get("OPENAI_BASE_URL", "").strip() or DEFAULT_OPENAI_URL
    model = os.environ.get(SUMMARIZER_MODEL_ENV, "").strip() or DEFAULT_OPENAI_MODEL
    return OpenAISummarizer(url, model, os.environ.get("OPENAI_API_KEY", "").strip() or None)
