"""Export files: written whole or not at all, read back line by line and strictly."""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any, BinaryIO

import click

from ..errors import InvalidInput
from .options import CommandError
from .output import _write_all


def _spooled(fill: Callable[[BinaryIO], int], stream: BinaryIO) -> int:
    """``fill`` a temporary file, then copy it whole to ``stream`` (stdout, a device or a FIFO): a read
    retried after a transient error rewrites the file, which a stream cannot take back, and the store's
    snapshot is not held open at the pace of the stream's reader."""
    with tempfile.TemporaryFile() as spool:
        count = fill(spool)
        spool.seek(0)
        while chunk := spool.read(1024 * 1024):
            _write_all(stream, chunk)
        stream.flush()
    return count


def _write_file(output: Path, fill: Callable[[BinaryIO], int]) -> int:
    """Write ``output`` whole with ``fill`` (which returns a count, returned here), or leave what was
    there: into a new file in the same folder, synced, then renamed over it. A failed export never
    destroys an earlier good one, nor leaves a part."""
    try:
        old = output.stat()
    except FileNotFoundError:
        old = None
    if old is not None and not stat.S_ISREG(old.st_mode):
        # A device or a FIFO (/dev/stdout, a named pipe): no file to keep, none to rename over it.
        with output.open("wb", buffering=0) as stream:
            return _spooled(fill, stream)
    from ..gateway import sigterm_ends_the_run

    target = Path(os.path.realpath(output))  # through a symbolic link: the file it names is replaced
    temp = target.with_name(f".{target.name[:40]}.{secrets.token_hex(6)}.tmp")
    # A SIGTERM (`timeout`, `kill`, a service manager) or a SIGHUP (the terminal closed, the SSH connection
    # dropped) ended the process where it stood, and the part written so far stayed beside the export under
    # its hidden name: one more for every export ended so. Raised as Ctrl-C is, it removes the part, then
    # ends the process as that signal would (under `nohup`, SIGHUP stays ignored: the export goes on).
    with sigterm_ends_the_run():
        fd = -1
        try:
            # O_EXCL: a name no one else holds; 0o666 under the umask: the mode a plain new file gets. Inside
            # the try: a signal handled as the call returns (the file made, ``fd`` not yet set) raised
            # before a try after it, and the part stayed (seen in CI: a SIGHUP as the part appeared).
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with open(fd, "w+b") as stream:
                count = fill(stream)
                stream.flush()
                os.fsync(stream.fileno())
            if old is not None:
                os.chmod(temp, stat.S_IMODE(old.st_mode))  # the earlier export's mode, as an overwrite kept it
            os.replace(temp, target)
        except BaseException as e:
            if fd >= 0 or not isinstance(e, FileExistsError):  # not another's file under that name
                with suppress(OSError):
                    temp.unlink()
            raise
    with suppress(OSError):  # the rename made durable; a file system that cannot sync a folder keeps it
        folder = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    return count


def _names_the_store(output: Path, database: Path) -> bool:
    """Whether writing ``output`` would write the SQLite store's database, WAL, shared memory or journal."""
    own = [Path(f"{database}{suffix}") for suffix in ("", "-wal", "-shm", "-journal")]
    # By name, for the files that do not exist now: a WAL appears while the store is in use, and a file
    # written under its name would be taken for one. resolve() follows symbolic links.
    if output.resolve() in {path.resolve() for path in own}:
        return True
    # By identity, for the files that do: a hard link (or a bind mount) is the same file under a name
    # that resolves elsewhere, and writing it would truncate the store.
    try:
        target = output.stat()
    except OSError:  # not there (or not reachable): the export creates a new file
        return False
    for path in own:
        try:
            if os.path.samestat(target, path.stat()):
                return True
        except OSError:
            continue
    return False


class _Ambiguous(Exception):
    """JSON that Python would read by guessing: a key twice in one object, NaN or Infinity."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object of an export line; a key given twice is refused (json.loads kept the last silently)."""
    seen: set[str] = set()
    for key, _value in pairs:
        if key in seen:
            raise _Ambiguous(f"the key {key!r} appears twice in one object")
        seen.add(key)
    return dict(pairs)


def _no_constant(name: str) -> Any:
    """NaN, Infinity and -Infinity are no JSON (Python's json reads them): refused where they stand."""
    raise _Ambiguous(f"{name} is not a JSON number")


def export_line_limit(max_payload_bytes: int) -> int:
    """The longest line (characters) an import reads: an entry over the payload cap written with every
    character escaped (``\u0000`` is 6 characters for 1 byte), and room for the entry's fields."""
    return 6 * max_payload_bytes + 64 * 1024


def _export_records(stream: IO[str], max_line: int, numbers: MutableSequence[int]) -> Iterator[Any]:
    """The records of an export file (JSON lines) as they are read, each line read strictly; the line
    number of each record is appended to ``numbers`` (blank lines are skipped, so entry i is not always
    on line i + 2).

    A line is read up to ``max_line`` characters: iterating the stream read a line of any length whole
    (``/dev/zero``, a file without line breaks: memory until the process was killed)."""

    def lines() -> Iterator[tuple[int, str]]:
        number = 0
        while True:
            try:
                line = stream.readline(max_line + 1)
            except OSError as e:
                raise CommandError(f"cannot read the export: {e.strerror or e}") from e
            if not line:
                return
            number += 1
            if len(line) > max_line:
                raise InvalidInput(f"line {number}: more than {max_line} characters (no entry under this "
                                   "store's payload cap is that long)")
            yield number, line

    try:
        for number, line in lines():
            if not line.strip():
                continue
            numbers.append(number)
            yield _export_record(line, number)
    except UnicodeDecodeError as e:
        raise InvalidInput(f"not UTF-8 text: {e.reason} (byte {e.object[e.start:e.start + 1]!r})") from None


def _export_record(line: str, number: int) -> Any:
    """One line of an export parsed strictly: a key twice in one object, NaN or Infinity are refused."""
    try:
        return json.loads(line, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except _Ambiguous as e:
        raise InvalidInput(f"line {number}: not JSON this store can read: {e}") from None
    except json.JSONDecodeError as e:
        raise InvalidInput(f"line {number}: not JSON: {e.msg}") from None
    except RecursionError:
        raise InvalidInput(f"line {number}: not JSON this store can read: nested too deeply") from None
    except ValueError:  # past Python's limit on the digits of an integer
        raise InvalidInput(
            f"line {number}: not JSON this store can read: an integer of more than "
            f"{sys.get_int_max_str_digits()} digits"
        ) from None


_SPOOL_FAILED = "cannot keep the checked entries in a temporary file: "


@contextmanager
def _scratch_file() -> Iterator[BinaryIO]:
    """A temporary file whose closing raises nothing: a write that failed (a full TMPDIR, a file size limit)
    leaves bytes in the buffer, which closing writes again, and that error would hide the first one's report."""
    try:
        made = tempfile.TemporaryFile()  # noqa: SIM115 (the with below closes it: its creation alone is caught)
    except OSError as e:  # no usable temporary directory (TMPDIR, /tmp, /var/tmp and the working one)
        raise CommandError(_SPOOL_FAILED + (e.strerror or str(e))) from e
    with made as spool:
        try:
            yield spool
        finally:
            with suppress(OSError):  # closed and gone all the same (closing it again does nothing)
                spool.close()


#: what an export without a line yields in place of its header
_NO_HEADER = object()

_ENTRY_AT = re.compile(r"entry (\d+)\b")


def _at_line(e: InvalidInput, numbers: Sequence[int]) -> InvalidInput:
    """``e`` (a refused export, naming the entry or header it is about) led by that record's line number."""
    message = str(e)
    if message.startswith("line "):
        return e
    found = _ENTRY_AT.match(message)
    if found is not None and int(found.group(1)) + 1 < len(numbers):
        return InvalidInput(f"line {numbers[int(found.group(1)) + 1]}: {message}")
    if message.startswith("header") and numbers:
        return InvalidInput(f"line {numbers[0]}: {message}")
    return e


class _ExportFile(click.File):
    """An export file to read, '-' for stdin: a stdin that is closed (``<&-``) is refused with one line (click
    failed on it with an AttributeError, an internal error)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The opened file; CommandError (exit 1) for '-' when the process has no stdin."""
        if isinstance(value, str) and value == "-" and sys.stdin is None:
            raise CommandError("cannot read the export from stdin: it is closed")
        return super().convert(value, param, ctx)
