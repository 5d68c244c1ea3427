"""Pluggable token estimation: a fast rough default, exact counting when ``tiktoken`` is installed.

Engines fit assembled context to a token budget and decide when to compact; both need a count that is
cheap and, for budgeting, errs on the high side rather than the low one. ``default_estimator()`` picks the
estimator from ``TRANSCRIPT_STORE_TOKENIZER`` (``rough``, the default, or ``tiktoken``).
"""

from __future__ import annotations

import base64
import binascii
import importlib
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from .errors import InvalidInput, TokenizerUnavailable

TOKENIZER_ENV = "TRANSCRIPT_STORE_TOKENIZER"

# CJK ideographs, kana, hangul, CJK punctuation and full-width forms: about one token per character in
# the GPT BPE vocabularies (often more for rare ideographs), never four characters per token.
_WIDE = re.compile(
    "[\u1100-\u11ff\u2e80-\u2fdf\u3000-\u9fff\ua960-\ua97f\uac00-\ud7ff\uf900-\ufaff\ufe30-\ufe4f"
    "\uff00-\uffef\U00020000-\U0003ffff]"
)
# ASCII digits and punctuation tokenize about twice as densely as letters and spaces (JSON, code, ids).
_DENSE_ASCII = re.compile(r"[!-@\[-`{-~]")
# Other non-ASCII letters (accents, Cyrillic, Greek, Arabic, emoji, ...) tokenize denser than ASCII letters.
_NON_ASCII = re.compile("[^\x00-\x7f]")
# Characters of three UTF-8 bytes (Devanagari, Tamil, Thai, symbols, emoji joiners) and of four (emoji and
# other characters outside the BMP): byte-level BPE vocabularies merge few of them, about one token per
# character of three bytes and two per character of four (cl100k_base: Hindi 1.03, Thai 0.99, Tamil
# 1.36, emoji with their joiners 2.2 per character), never two characters per token.
_THREE_BYTES = re.compile("[\u0800-\uffff]")
_FOUR_BYTES = re.compile("[\U00010000-\U0010ffff]")
_WIDE_FOUR_BYTES = re.compile("[\U00020000-\U0003ffff]")  # the CJK ideographs of _WIDE outside the BMP
# Georgian letters (three bytes): cl100k_base merges few of them, 2.0-2.2 tokens a letter (counted at 11 per 5)
_GEORGIAN = re.compile("[\u10a0-\u10ff\u1c90-\u1cbf\u2d00-\u2d2f]+")
# Characters of two UTF-8 bytes by script, at what cl100k_base gives them (tokens a character, median to
# p95 of 300-character texts of gettext catalogs): Latin letters 9 tokens per 4 (Latin-1: e acute, u
# umlaut) or 11 per 4 (Latin Extended, IPA, combining marks: Polish, Czech, Turkish, Romanian, Vietnamese,
# Hungarian), because an accent splits its word and the word's other letters tokenize worse too (needed:
# 1.9-2.7 tokens an accented letter in those languages, 1.1-2.2 in French, Spanish, German); Latin-1
# signs and spaces (U+0080-U+00BF, times, divide) a token each; Cyrillic 0.45-0.53 in Russian, 0.57-0.65
# in Bulgarian, 0.62-0.79 in Ukrainian,
# Serbian, Belarusian (their words are rarer in the vocabulary; told apart by the letters Russian lacks,
# U+0456 i, U+0458 j, U+045E short u, U+04D9 schwa, ...);
# Greek 1.04-1.11; Hebrew 1.15-1.29; Arabic and Persian 0.86-0.93 (Pashto, Uyghur ~1.2); Armenian,
# Syriac, Thaana and NKo about 2, a token per byte (cl100k merges none of them).
# (runs of characters: counted by their lengths, three times faster than one match a character)
_LATIN_TWO = re.compile("[\u0080-\u036f]+")
_LATIN_SIGNS = re.compile("[\u0080-\u00bf\u00d7\u00f7]+")  # Latin-1 spaces, signs, punctuation: « » ° ©
_LATIN_EXTENDED = re.compile("[\u0100-\u036f]+")  # ą ł č ř ğ ş ő ș ơ ư, IPA, combining marks
_CYRILLIC = re.compile("[\u0400-\u052f]+")
_CYRILLIC_NOT_RUSSIAN = re.compile("[\u0400\u0402-\u040f\u0450\u0452-\u052f]")  # all but U+0410-U+044F, Ё, ё
_GREEK = re.compile("[\u0370-\u03ff]+")
_HEBREW = re.compile("[\u0590-\u05ff]+")
_ARABIC = re.compile("[\u0600-\u06ff\u0750-\u077f]+")


@runtime_checkable
class TokenEstimator(Protocol):
    """Counts tokens of chat messages and of plain text."""

    def count_messages(self, messages: Sequence[dict[str, Any]]) -> int:
        """Tokens of a list of OpenAI chat messages, framing and tool calls included."""
        ...

    def count_text(self, text: str) -> int:
        """Tokens of one plain text."""
        ...


#: an image part at ``low`` detail: OpenAI's fixed 85 tokens
IMAGE_TOKENS_LOW = 85
#: an image part at ``high`` or ``auto`` detail, whatever its size: the most OpenAI's tile formula gives
#: (85 + 170 per 512-pixel tile of the image scaled into 2048x2048, its short side to at most 768: 8 tiles)
IMAGE_TOKENS = 85 + 8 * 170


def _image_tokens(part: dict[str, Any]) -> int | None:
    """The tokens of an ``image_url`` content part (None for another part).

    Counted as the provider counts an image, never as the text of its URL: a screenshot sent inline (a
    ``data:`` URL, as chat clients send a pasted picture) was counted as its base64, ~40,000 tokens for
    100 KB, over the default budget by itself, so the turn carrying it was refused (PromptTooLarge)."""
    if part.get("type") != "image_url" and "image_url" not in part:
        return None
    image = part.get("image_url")
    detail = image.get("detail") if isinstance(image, dict) else None
    return IMAGE_TOKENS_LOW if detail == "low" else IMAGE_TOKENS


#: an ``input_audio`` part: OpenAI's rate for audio input, a token per 100 ms of sound
AUDIO_TOKENS_PER_SECOND = 10
#: the fewest bytes a second of audio takes (32 kbit/s, compressed speech): its length in seconds is its
#: size over this, or over a WAV header's byte rate when that is higher
AUDIO_MIN_BYTES_PER_SECOND = 4_000
#: a page of a ``file`` part (a PDF): what a provider sends the model for it, an image of the page (at
#: most ~1,100 tokens for a letter page) and its text
FILE_PAGE_TOKENS = 2_000
#: the bytes of a page when a file's pages cannot be counted (a text PDF's; a scanned page is larger)
FILE_BYTES_PER_PAGE = 10_000
_PDF_PAGE = re.compile(rb"/Type\s*/Page(?![A-Za-z])")


def _base64_payload(data: Any) -> str:
    """The base64 text of an inline payload: a ``data:`` URL's part after its comma, else ``data`` itself."""
    if not isinstance(data, str):
        return ""
    if data.startswith("data:"):
        return data.partition(",")[2]
    return data


def _decoded_size(payload: str) -> int:
    """The bytes a base64 text decodes to (padding aside; line breaks in it count), without decoding it."""
    return len(payload.rstrip("=")) * 3 // 4


def _audio_tokens(audio: Any) -> int:
    """The tokens of an ``input_audio`` part's payload: AUDIO_TOKENS_PER_SECOND a second of it, its
    seconds its size over its WAV header's byte rate, or over AUDIO_MIN_BYTES_PER_SECOND when that is
    higher or there is no such header."""
    payload = _base64_payload(audio.get("data") if isinstance(audio, dict) else None)
    size = _decoded_size(payload)
    if not size:
        return 0
    rate = AUDIO_MIN_BYTES_PER_SECOND
    try:
        head = base64.b64decode(payload[:48])
    except (binascii.Error, ValueError):
        head = b""
    if len(head) >= 32 and head[:4] == b"RIFF" and head[8:16] == b"WAVEfmt ":
        rate = max(rate, int.from_bytes(head[28:32], "little"))  # the fmt chunk's byte rate
    return math.ceil(size * AUDIO_TOKENS_PER_SECOND / rate)


def _file_tokens(file: Any) -> int:
    """The tokens of a ``file`` part: FILE_PAGE_TOKENS a page, its pages counted in a PDF whose page
    objects are plain, else one per FILE_BYTES_PER_PAGE of it; one page for a file sent by id alone."""
    payload = _base64_payload(file.get("file_data") if isinstance(file, dict) else None)
    size = _decoded_size(payload)
    if not size:
        return FILE_PAGE_TOKENS
    try:
        pages = len(_PDF_PAGE.findall(base64.b64decode(payload)))
    except (binascii.Error, ValueError):
        pages = 0
    return FILE_PAGE_TOKENS * (pages or -(-size // FILE_BYTES_PER_PAGE))


def _media_tokens(part: dict[str, Any]) -> int | None:
    """The tokens of an image, audio or file content part, as a provider counts it (None for another).

    Never the text of its payload: an audio clip or a PDF sent inline (base64 in ``input_audio.data``,
    ``file.file_data``) was counted as that text, ~300,000 tokens for 1 MB, so its turn was refused.
    Anthropic's ``image`` and ``document`` parts (base64 in ``source.data``) and the Responses API's
    ``input_image`` and ``input_file`` count as OpenAI's image and file parts do."""
    image = _image_tokens(part)
    if image is not None:
        return image
    kind = part.get("type")
    if kind in ("image", "input_image"):
        return IMAGE_TOKENS_LOW if part.get("detail") == "low" else IMAGE_TOKENS
    if kind == "input_audio" or (kind is None and "input_audio" in part):
        return _audio_tokens(part.get("input_audio"))
    if kind == "file" or (kind is None and "file" in part):
        return _file_tokens(part.get("file"))
    if kind == "input_file":
        return _file_tokens(part)
    if kind == "document":
        source = part.get("source")
        if isinstance(source, dict) and source.get("type") in ("text", "content"):
            return None  # a plain-text document or one of parts: counted as text (and its parts as parts)
        return _file_tokens({"file_data": source.get("data") if isinstance(source, dict) else None})
    return None


def _nested_parts(part: dict[str, Any]) -> tuple[dict[str, Any], list[Any]] | None:
    """A part holding parts of its own (a ``tool_result``'s ``content``, a ``document``'s
    ``source.content``): the part without them, and them; None for another part."""
    inner = part.get("content")
    if isinstance(inner, list):
        return {k: v for k, v in part.items() if k != "content"}, inner
    source = part.get("source")
    if isinstance(source, dict) and isinstance(source.get("content"), list):
        return {**part, "source": {k: v for k, v in source.items() if k != "content"}}, source["content"]
    return None


def _part_tokens(part: dict[str, Any], count_text: Callable[[str], int]) -> int:
    """The tokens of one content part: its text, its media (``_media_tokens``), else its JSON, the parts
    it holds counted as parts (a tool result's screenshot is an image, not the text of its base64)."""
    text = part.get("text")
    if isinstance(text, str):
        return count_text(text)
    media = _media_tokens(part)
    if media is not None:
        return media
    if part.get("type") == "text":
        return 0
    nested = _nested_parts(part)
    if nested is not None:
        rest, inner = nested
        return count_text(json.dumps(rest, ensure_ascii=False, sort_keys=True)) + _content_tokens(inner, count_text)
    # another kind of part: count its JSON so a large inline payload is not free
    return count_text(json.dumps(part, ensure_ascii=False, sort_keys=True))


def _content_tokens(content: Any, count_text: Callable[[str], int]) -> int:
    """The tokens of a message's ``content`` (a string or a list of parts): texts by ``count_text``, an
    image, audio or file by what the provider counts for it (``_part_tokens``)."""
    if isinstance(content, str):
        return count_text(content)
    if not isinstance(content, list):
        return 0
    total = 0
    for part in content:
        if isinstance(part, dict):
            total += _part_tokens(part, count_text)
        elif isinstance(part, str):
            total += count_text(part)
    return total


def _tool_call_texts(tool_calls: Any) -> Iterator[str]:
    """The function names and argument texts of an assistant message's ``tool_calls``."""
    if not isinstance(tool_calls, list):
        return
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        for key in ("name", "arguments"):
            value = function.get(key)
            if isinstance(value, str):
                yield value
            elif value is not None:
                yield json.dumps(value, ensure_ascii=False, sort_keys=True)


def _count_messages(
    messages: Sequence[dict[str, Any]],
    count_text: Callable[[str], int],
    *,
    per_message: int,
    per_name: int,
    per_tool_call: int,
    priming: int,
) -> int:
    """Shared message walk: framing per message, content, name, tool calls (an older-format function
    call too), tool-call ids."""
    if not messages:
        return 0
    total = priming
    for message in messages:
        if not isinstance(message, dict):
            raise InvalidInput(f"a message must be a dict, not {type(message).__name__}")
        total += per_message
        total += _content_tokens(message.get("content"), count_text)
        name = message.get("name")
        if isinstance(name, str):
            total += per_name + count_text(name)
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, list):
            total += per_tool_call * len(tool_calls)
            total += sum(count_text(text) for text in _tool_call_texts(tool_calls))
        call_id = message.get("tool_call_id")
        if isinstance(call_id, str):
            total += count_text(call_id)
        legacy = message.get("function_call")  # the older format's one call (``function`` results: name)
        if isinstance(legacy, dict):
            total += per_tool_call + sum(count_text(text) for text in _tool_call_texts([{"function": legacy}]))
    return total


def _count(runs: re.Pattern[str], text: str) -> int:
    """The characters of ``text`` that ``runs`` (a class of characters, repeated) matches."""
    return sum(map(len, runs.findall(text)))


def _two_byte_tokens(text: str, two: int) -> int:
    """The rough tokens of the ``two`` characters of two UTF-8 bytes in ``text``, by script (_LATIN_TWO..).

    Counted at two characters a token whatever their script, Greek, Hebrew and Arabic text was about half
    of what cl100k_base gives it, Ukrainian or Serbian 15-30% under: a budget fitted with it overflowed."""
    latin = _count(_LATIN_TWO, text)
    rest = two - latin
    if latin:
        signs = _count(_LATIN_SIGNS, text)
        extended = _count(_LATIN_EXTENDED, text)
        tokens = signs + -(-(9 * (latin - signs - extended) + 11 * extended) // 4)
    else:
        tokens = 0
    if rest:
        cyrillic = _count(_CYRILLIC, text)
        if cyrillic:
            # Russian 3 tokens per 5 letters; a text with a letter Russian lacks, 3 per 4
            tokens += -(-3 * cyrillic // (4 if _CYRILLIC_NOT_RUSSIAN.search(text) else 5))
            rest -= cyrillic
    # Most texts are of one script: the others are looked for only while characters are left to place.
    for pattern, per, of in ((_GREEK, 6, 5), (_HEBREW, 5, 4), (_ARABIC, 1, 1)):
        if not rest:
            break
        found = _count(pattern, text)
        tokens += -(-per * found // of)
        rest -= found
    return tokens + 2 * rest  # Armenian, Syriac, Thaana, NKo: a token a byte


class RoughEstimator:
    """Fast default estimator: ~4 chars per token for Latin text, CJK ~1 token per char, 4 tokens per message.

    Text: ASCII letters and spaces 4 chars per token, ASCII digits and punctuation 2 per token, CJK
    ideographs / kana / hangul / full-width forms 1 token each; other characters of two UTF-8 bytes by
    script: Latin-1 letters 9 tokens per 4, other Latin letters (Latin Extended, IPA, combining marks) 11
    per 4, Latin-1 signs and spaces 1 each, Cyrillic 3 tokens per 5 letters (3 per 4 in a text with a
    letter Russian lacks: Ukrainian, Serbian, ...), Greek 6 per 5, Hebrew 5 per 4, Arabic 1 each,
    Armenian, Syriac, Thaana, NKo 2 each; of three bytes (Devanagari, Tamil, Thai, symbols) 1 token
    each (Georgian 11 per 5), of four (emoji) 2 tokens each.
    Messages: 4 tokens of framing each, plus content, ``name``, tool-call names and arguments (and 3
    tokens per call; an older-format ``function_call`` is one call), ``tool_call_id``, plus 3 tokens of
    reply priming. An image part is IMAGE_TOKENS (IMAGE_TOKENS_LOW at ``low`` detail), whatever its URL;
    an ``input_audio`` part AUDIO_TOKENS_PER_SECOND a second of it, a ``file`` part FILE_PAGE_TOKENS a
    page (``_media_tokens``; Anthropic's ``image`` and ``document`` parts too, and the images among a
    tool result's parts), never the text of their base64.

    Typical error, measured against tiktoken ``cl100k_base`` exact counts (p5 / median / p95 per text of
    a few hundred characters): English prose (stdlib docstrings) +0% / +18% / +38%; Python source
    -4% / +20% / +44%; JSON tool arguments -12% / -5% / +2%; Chinese and Japanese UI strings (gettext
    catalogs) -12% / -5% / +2%; Korean -15% / -9% / -3%; German -14% / -3% / +12%; French -4% / +10% /
    +25%; Spanish -7% / +5% / +20%; Polish, Czech, Turkish, Vietnamese, Romanian, Hungarian -14%..+1% /
    +0%..+15% / +15%..+35% (-39%..-28% / -34%..-21% / -24%..-9% at two characters an accented letter;
    man pages: +3%..+23% median); Georgian +2% / +4% / +5% (-50% at a token a letter); Russian +10% /
    +26% / +40%; Ukrainian +6% / +17% /
    +28%; Bulgarian, Serbian, Belarusian -6% / +5% / +18%; Kazakh -21% / -14% / -6%; Greek +7% / +13% /
    +18%; Hebrew -1% / +6% / +20% (Yiddish -11%); Arabic and Persian +6% / +13% / +21% (Uyghur, Pashto,
    Kurdish -11%..-17%); Armenian -6% (Greek, Hebrew, Arabic and Armenian were counted at half of
    cl100k's count or less before, at two characters a token). Over 40-message transcripts (framing included, against
    ``TiktokenEstimator.count_messages``) it over-counts English/code/JSON mixes by +11%..+21% and lands
    within -2%..+5% when other languages are mixed in. Emoji, Indic and Thai sentences (counted at half
    a token per character before: a quarter to a half of cl100k's count) land at -36%..+1% of
    cl100k_base and at or above o200k_base; math symbols at about two thirds of either. It leans high on
    purpose: a budget fitted with it rarely overflows. Newer encodings (``o200k_base``) need fewer tokens
    for most text (every script above but Latin ones lands over o200k's count), so the estimate is higher
    still against them. For exact budgets use ``TiktokenEstimator``.
    """

    per_message = 4
    per_name = 1
    per_tool_call = 3
    priming = 3

    def count_text(self, text: str) -> int:
        """Rough tokens of one text (0 for the empty string, never negative)."""
        if not text:
            return 0
        dense = len(_DENSE_ASCII.findall(text))
        if text.isascii():
            return math.ceil((len(text) - dense) / 4) + math.ceil(dense / 2)
        non_ascii = len(_NON_ASCII.findall(text))
        wide = len(_WIDE.findall(text))
        three = len(_THREE_BYTES.findall(text))
        four = len(_FOUR_BYTES.findall(text))
        wide_four = len(_WIDE_FOUR_BYTES.findall(text)) if four else 0
        light = len(text) - dense - non_ascii
        two = non_ascii - three - four  # characters of two UTF-8 bytes: by script (_two_byte_tokens)
        narrow_three = three - (wide - wide_four)  # three bytes, not CJK: one token each (Georgian more)
        georgian = -(-6 * _count(_GEORGIAN, text) // 5) if narrow_three else 0  # 1 + 6/5 a Georgian letter
        return (
            math.ceil(light / 4) + math.ceil(dense / 2) + wide + (_two_byte_tokens(text, two) if two else 0)
            + narrow_three + georgian + 2 * (four - wide_four)
        )

    def count_messages(self, messages: Sequence[dict[str, Any]]) -> int:
        """Rough tokens of chat messages: framing, content, names, tool calls and ids."""
        return _count_messages(
            messages,
            self.count_text,
            per_message=self.per_message,
            per_name=self.per_name,
            per_tool_call=self.per_tool_call,
            priming=self.priming,
        )


class TiktokenEstimator:
    """Exact text counts with the optional ``tiktoken`` package; message framing per OpenAI's cookbook.

    Text counts are exact for the encoding. Message framing (3 tokens per message, 1 per name, 3 of reply
    priming) follows OpenAI's published counting recipe for chat models; tool-call framing is not published
    and is approximated with 3 tokens per call. ``tiktoken`` downloads its encoding files on first use
    unless they are in its cache (``TIKTOKEN_CACHE_DIR``); offline machines need them provisioned.
    """

    per_message = 3
    per_name = 1
    per_tool_call = 3
    priming = 3

    def __init__(self, encoding: str = "cl100k_base") -> None:
        """Load ``encoding`` (``cl100k_base``, ``o200k_base``, ...); raise TokenizerUnavailable if it cannot."""
        try:
            tiktoken = importlib.import_module("tiktoken")  # optional dependency: imported only when asked for
        except ImportError as e:
            raise TokenizerUnavailable(
                "TiktokenEstimator needs the optional 'tiktoken' package (pip install tiktoken); "
                f"or unset {TOKENIZER_ENV} to use the rough estimator"
            ) from e
        try:
            self._encoding: Any = tiktoken.get_encoding(encoding)
        except Exception as e:  # network or cache failures surface as many types; name the fix once
            raise TokenizerUnavailable(
                f"tiktoken could not load encoding {encoding!r} ({type(e).__name__}); on an offline machine "
                "put the encoding file in TIKTOKEN_CACHE_DIR"
            ) from e
        self.encoding_name = encoding

    def count_text(self, text: str) -> int:
        """Exact tokens of one text in this encoding (special-token text counted as ordinary text)."""
        if not text:
            return 0
        return len(self._encoding.encode(text, disallowed_special=()))

    def count_messages(self, messages: Sequence[dict[str, Any]]) -> int:
        """Tokens of chat messages: exact text, cookbook framing, approximate tool-call framing."""
        return _count_messages(
            messages,
            self.count_text,
            per_message=self.per_message,
            per_name=self.per_name,
            per_tool_call=self.per_tool_call,
            priming=self.priming,
        )


def count_from_parts(estimator: object, counts: Sequence[int]) -> int | None:
    """``count_messages`` of a list, from ``count_messages([m])`` of each of its messages; None if unknown.

    This module's estimators count a list as its reply priming plus a sum over the messages, so the
    list's count is the sum of the one-message counts minus the priming they repeat: an engine that
    keeps per-message counts need not walk every message of its context again. For any other
    estimator (a subclass may count lists its own way) the answer is None: count the list.
    """
    if type(estimator) not in (RoughEstimator, TiktokenEstimator):
        return None
    if not counts:
        return 0
    priming: int = estimator.priming  # type: ignore[attr-defined]
    return sum(counts) - (len(counts) - 1) * priming


def tokenizer_choice() -> str:
    """TRANSCRIPT_STORE_TOKENIZER: ``rough`` (also when unset) or ``tiktoken``; InvalidInput otherwise."""
    choice = os.environ.get(TOKENIZER_ENV, "").strip().lower() or "rough"
    if choice not in ("rough", "tiktoken"):
        raise InvalidInput(f"{TOKENIZER_ENV} must be 'rough' or 'tiktoken', not {choice!r}")
    return choice


def _importable(name: str) -> bool:
    """Whether ``import name`` would find a module, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module put in sys.modules by hand has no spec
        return sys.modules.get(name) is not None


def check_tokenizer() -> str:
    """``tokenizer_choice``, also refusing ``tiktoken`` when the package is not installed (InvalidInput):
    a command checks it before it writes anything, not when its host runtime starts."""
    choice = tokenizer_choice()
    if choice == "tiktoken" and not _importable("tiktoken"):
        raise InvalidInput(
            f"{TOKENIZER_ENV}=tiktoken needs the optional 'tiktoken' package (pip install tiktoken), "
            "or unset it to use the rough estimator"
        )
    return choice


def default_estimator() -> TokenEstimator:
    """``TiktokenEstimator`` when TRANSCRIPT_STORE_TOKENIZER=tiktoken, else ``RoughEstimator``."""
    return TiktokenEstimator() if tokenizer_choice() == "tiktoken" else RoughEstimator()
