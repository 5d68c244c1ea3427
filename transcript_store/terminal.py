"""Text for a terminal: stored messages, engines' errors and operators' reasons are read there, never obeyed.

The CLI's tables and lines, the gateway's report and the log lines on stderr all show text that the store
holds or an engine wrote: an escape sequence in it (a window title, a colour, a cursor move) would act on
the operator's terminal instead. Machine output (--json) keeps the text as it is.
"""

from __future__ import annotations

import io
import logging
import re
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from logging import _SysExcInfoType

#: a log record on stderr: its level, its logger, its message
LOG_FORMAT = "%(levelname)s: %(name)s: %(message)s"
#: what a terminal would act on instead of showing (ESC sequences, NUL, CR, DEL, C1), but newline and tab
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: the same and newlines too: a line that must stay one line (a log record)
_CONTROL_OR_NEWLINE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def quoted(value: object) -> str:
    """A value as an error or a warning quotes it: escaped by repr (control characters, lone surrogates),
    and cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def shown(text: str, *, one_line: bool = False) -> str:
    """Stored text for a terminal: its control characters as ``\\xNN``, so that a message holding an escape
    sequence (a user's, a model's, an engine's error) is read, not obeyed by the terminal; ``one_line``
    escapes newlines as well."""
    pattern = _CONTROL_OR_NEWLINE if one_line else _CONTROL
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class ShownFormatter(logging.Formatter):
    """A log formatter for a terminal: a record is one line with its control characters shown (the message
    quotes engines' errors and reasons: a newline in one would forge a second record); a traceback keeps its
    lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The record's line, its control characters shown, on one line."""
        return shown(super().formatMessage(record), one_line=True)

    def formatException(self, ei: _SysExcInfoType) -> str:
        """A traceback, its control characters shown; its own line breaks kept."""
        return shown(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        """A stack's lines, their control characters shown; its own line breaks kept."""
        return shown(super().formatStack(stack_info))


def shown_log_handler() -> logging.Handler:
    """The stderr handler of the CLI's processes (the gateway's workers too): one shown line per record."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ShownFormatter(LOG_FORMAT))
    return handler


class ShownStream(io.TextIOBase):
    """A text stream for a terminal that shows what is written to it: control characters as ``\\xNN``
    (newlines and tabs kept) and what the terminal's encoding cannot take (a lone surrogate) as a
    backslash escape. A gateway worker's ``sys.stdout`` / ``sys.stderr``: an engine's ``print`` or a
    library's direct write quotes stored text as freely as a log record does."""

    def __init__(self, inner: TextIO) -> None:
        super().__init__()
        self._inner = inner
        self._encoding = getattr(inner, "encoding", None) or "utf-8"

    @property
    def encoding(self) -> str:  # type: ignore[override]
        """The encoding of the stream written to."""
        return self._encoding

    def writable(self) -> bool:
        """A shown stream is written to, never read."""
        return True

    def isatty(self) -> bool:
        """Whether the stream written to is a terminal."""
        return self._inner.isatty()

    def write(self, text: str) -> int:
        """Write ``text`` shown; the count is of the characters given, as a text stream's is."""
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        out = shown(text).encode(self._encoding, "backslashreplace").decode(self._encoding, "replace")
        self._inner.write(out)
        return len(text)

    def flush(self) -> None:
        """Flush the stream written to."""
        self._inner.flush()


def show_process_output() -> None:
    """Route a worker process's own output through :class:`ShownStream` and its warnings through logging
    (configure the log handler first: it keeps the stream it was given)."""
    logging.captureWarnings(True)
    if not isinstance(sys.stdout, ShownStream) and sys.stdout is not None:
        sys.stdout = ShownStream(sys.stdout)
    if not isinstance(sys.stderr, ShownStream) and sys.stderr is not None:
        sys.stderr = ShownStream(sys.stderr)
