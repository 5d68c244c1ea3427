"""A command's output on stdout: every write whole or failing the command, JSON that the stream's encoding carries."""

from __future__ import annotations

import codecs
import io
import json
import sys
from typing import IO, TYPE_CHECKING, Any, BinaryIO, cast

from .options import CommandError

if TYPE_CHECKING:  # imported where they are used: the CLI's start stays light (rich: by a command drawing a table)
    from rich.console import Console


def _unencodable(encoding: str, error: UnicodeEncodeError) -> CommandError:
    """The one-line error for text that stdout's encoding cannot carry (a C or Latin-1 locale)."""
    char = error.object[error.start : error.start + 1] if isinstance(error.object, str) else "?"
    return CommandError(
        f"cannot write to stdout: its encoding {encoding!r} cannot carry {char!r} (U+{ord(char):04X}); "
        "use a UTF-8 locale or PYTHONIOENCODING=utf-8 (--json output escapes such characters)"
    )


class WholeStdout(io.TextIOBase):
    """The command's output on stdout, every write landing whole or failing the command (exit 1).

    A text stream hands a long text to its buffer in one write, which may take only part of it (a pipe
    whose reader left, a file at its size limit) and say so only in a count the text stream drops:
    ``sessions show --json | head -c 10`` ended cut short with exit 0, while the same reader gone
    before the first write made it exit 1. Written as an export to stdout is (``_write_all``).
    """

    def __init__(self, inner: IO[str] | None) -> None:
        super().__init__()
        self._inner = inner  # None: the process started with its stdout closed (``>&-``)

    @property
    def encoding(self) -> str:  # type: ignore[override]
        """The encoding of the stream written to."""
        return getattr(self._inner, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        """Written to, never read."""
        return True

    def isatty(self) -> bool:
        """Whether the stream written to is a terminal (rich decides colours by it)."""
        return self._inner is not None and self._inner.isatty()

    def write(self, text: str) -> int:
        """Write ``text`` whole, or raise CommandError; the count is of the characters given."""
        if self._inner is None:
            raise CommandError("cannot write to stdout: it is closed")
        buffer = getattr(self._inner, "buffer", None)
        try:
            if buffer is None:  # a text-only stream (a test's, a wrapper's): it answers for its writes
                self._inner.write(text)
                self._inner.flush()
                return len(text)
            data = text.encode(self.encoding, getattr(self._inner, "errors", None) or "strict")
            self._inner.flush()  # what click.echo wrote before goes first
            _write_all(buffer, data)
            buffer.flush()
        except OSError as e:
            raise CommandError(f"cannot write to stdout: {e.strerror or e}") from e
        except UnicodeEncodeError as e:
            raise _unencodable(self.encoding, e) from None
        return len(text)

    def flush(self) -> None:
        """Every write is flushed already."""

    def codec(self) -> tuple[str, str]:
        """The encoding and error handler of text for ``copy_from``: the stream's own, or for a text-only
        stream one that reads back every character as it was (lone surrogates too)."""
        if getattr(self._inner, "buffer", None) is None:
            return "utf-8", "surrogatepass"
        return self.encoding, getattr(self._inner, "errors", None) or "strict"

    def copy_from(self, spool: BinaryIO) -> None:
        """Write the text in ``spool`` (encoded as ``codec`` says) whole, a chunk at a time, or raise
        CommandError as ``write`` does."""
        if self._inner is None:
            raise CommandError("cannot write to stdout: it is closed")
        buffer = getattr(self._inner, "buffer", None)
        encoding, errors = self.codec()
        decoder = codecs.getincrementaldecoder(encoding)(errors)
        try:
            self._inner.flush()  # what click.echo wrote before goes first
            while chunk := spool.read(1024 * 1024):
                if buffer is None:
                    self._inner.write(decoder.decode(chunk))
                else:
                    _write_all(buffer, chunk)
            (buffer or self._inner).flush()
        except OSError as e:
            raise CommandError(f"cannot write to stdout: {e.strerror or e}") from e


def console() -> Console:
    """A console for human output on stdout."""
    from rich.console import Console

    out = cast(IO[str], WholeStdout(sys.stdout))  # a TextIOBase: the text file rich asks for, untyped as IO
    return Console(file=out, highlight=False, soft_wrap=False, markup=False, emoji=False)


#: characters from three planes: an encoding that holds them all holds every character JSON text may carry
_UNICODE_PROBE = "\u00e9\u4e2d\U0001f600"


def holds_unicode(encoding: str) -> bool:
    """Whether text in ``encoding`` can carry any character (UTF-8, -16, -32), not only some (ASCII, Latin-1)."""
    try:
        _UNICODE_PROBE.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def emit_json(data: Any) -> None:
    """Print one JSON document, whole or failing the command (``WholeStdout``); to a stdout whose encoding
    cannot carry every character, with non-ASCII characters as ``\\u`` escapes (the same document)."""
    out = WholeStdout(sys.stdout)
    out.write(json.dumps(data, indent=2, ensure_ascii=not holds_unicode(out.encoding), default=str) + "\n")


def _write_all(stream: BinaryIO, data: bytes) -> None:
    """Write every byte of ``data``. A write may take fewer bytes than it was given and raise nothing (a
    file size limit, a full disk, a pipe whose reader left): only the next write raises the real error, so
    an export is never cut short with exit 0."""
    view = memoryview(data)
    while view:
        written = stream.write(view)
        if not written:  # None (a non-blocking stream) or 0: no progress, and no error to raise
            raise OSError("the output took no more bytes")
        view = view[written:]
