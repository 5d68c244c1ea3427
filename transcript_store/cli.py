"""The ``transcript-store`` command: stores, sessions, the outbox, engines, chat and the gateway run.

Every command takes ``--db URL`` (else TRANSCRIPT_STORE_URL, else ``sqlite:///transcripts.db`` in the
working directory), ``--scope`` (else TRANSCRIPT_STORE_SCOPE, else ``default``; ``gateway`` for the
gateway), ``--json``, ``--config PATH`` (host settings TOML) and ``--debug``, before or after the command
name. A settings file named by --config or TRANSCRIPT_STORE_CONFIG is checked by every command.

Exit codes: 0 ok; 1 the operation or a check failed; 2 usage error (a bad option or ``--db`` URL, an
empty value of an option or argument, a number not written as ASCII digits, a bad settings file or
TRANSCRIPT_STORE_* value);
3 not found (unknown session); 4 schema not current (or no store yet: run ``init``); 5 database
unavailable; 6 permission denied (the database role lacks a grant). An error is one line on stderr,
``error: ...``; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import codecs
import functools
import io
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import socket
import sqlite3
import stat
import sys
import tempfile
import traceback
from array import array
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from contextlib import closing, contextmanager, redirect_stderr, redirect_stdout, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, NoReturn, TypeVar, cast
from urllib.parse import urlsplit

import click
from sqlalchemy.engine import URL

from . import migrate, showing, transfer
from .config import INTEGER_RULE, INTEGER_TEXT, StoreConfig
from .core import Core, check_id
from .db import mask_url, parse_url, sqlite_file, url_secrets
from .engine import MAX_TOKENS, EngineContext
from .errors import (
    EngineError,
    IdempotencyConflict,
    InvalidInput,
    PermissionDenied,
    SchemaNotCurrent,
    SessionKeyConflict,
    SessionReplaced,
    StoreUnavailable,
    TranscriptStoreError,
    UnknownEntry,
    UnknownSession,
    UnknownTurn,
)
from .gateway import GATEWAY_SCOPE, MAX_RUN_TURNS, MAX_SESSIONS, MAX_TURNS, MAX_WORKERS
from .models import Entry, SessionInfo
from .settings import HostSettings, check_settings_env, load_settings
from .store import TranscriptStore
from .terminal import ShownStream, show_process_output, shown, shown_log_handler
from .turns import MAX_DRAIN

if TYPE_CHECKING:  # imported where they are used: the CLI's start stays light (rich: by a command drawing a table)
    from rich.console import Console
    from rich.table import Table

    from .host import HostRuntime
    from .registry import EngineRegistry

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_SCHEMA, EXIT_UNAVAILABLE, EXIT_DENIED = 0, 1, 2, 3, 4, 5, 6
DEFAULT_SCOPE = "default"
SCOPE_ENV = "TRANSCRIPT_STORE_SCOPE"
URL_ENV = "TRANSCRIPT_STORE_URL"
CHAT_KEY = "cli:chat"
BLANK_SCOPE = "the scope must not be empty or blank"

F = TypeVar("F", bound=Callable[..., Any])


class CommandError(Exception):
    """A failure the CLI reports as one line with its own exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class State:
    """The global options, wherever on the command line they were given."""

    db: str | None = None
    scope: str | None = None
    json: bool = False
    config: str | None = None
    debug: bool = False

    @property
    def scope_name(self) -> str:
        """--scope, else TRANSCRIPT_STORE_SCOPE, else ``default``; a bad one is a usage error naming where
        it came from (it was "scope must not contain ...", exit 1, whichever had given it)."""
        value, source = (self.scope, "--scope") if self.scope else (os.environ.get(SCOPE_ENV), SCOPE_ENV)
        if value is None:
            return DEFAULT_SCOPE
        if not value.strip():
            # As --scope '' is: set but empty or blank (`TRANSCRIPT_STORE_SCOPE=$TENANT` with TENANT unset)
            # was the scope " " or, empty, the default one: another tenant's sessions, exit 0.
            raise CommandError(f"{source}: {BLANK_SCOPE} (unset it for the default scope)", EXIT_USAGE)
        try:
            check_id("scope", value, new=True)  # sessions are created under it: a new id's bounds
        except InvalidInput as e:
            raise CommandError(f"{source}: {e}", EXIT_USAGE) from None
        return value

    @property
    def scope_given(self) -> bool:
        """Whether --scope or TRANSCRIPT_STORE_SCOPE names a scope (set but empty too: scope_name refuses it)."""
        return bool(self.scope) or SCOPE_ENV in os.environ

    def store_config(self) -> StoreConfig:
        """Store settings from TRANSCRIPT_STORE_* variables and --db."""
        try:
            return StoreConfig.from_env(url=self.db)
        except InvalidInput as e:  # a bad TRANSCRIPT_STORE_* value: a usage error
            raise CommandError(str(e), EXIT_USAGE) from None

    def settings(self, engine: str | None = None) -> HostSettings:
        """Host settings from the TOML file, TRANSCRIPT_STORE_* variables and --engine."""
        try:
            return load_settings(self.config, engine=engine)
        except InvalidInput as e:  # a bad settings file or variable: a usage error
            raise CommandError(str(e), EXIT_USAGE) from None

    def check_named_settings(self) -> None:
        """Refuse a settings file named by --config or TRANSCRIPT_STORE_CONFIG that is missing or invalid,
        also for a command that reads no settings: naming a file and having it ignored is a usage error."""
        if self.config or os.environ.get("TRANSCRIPT_STORE_CONFIG"):
            self.settings()
        else:
            try:
                check_settings_env()
            except InvalidInput as e:
                raise CommandError(str(e), EXIT_USAGE) from None


# ---------------------------------------------------------------------------------------------- options


def _remember(name: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if name == "scope" and value is not None and not value.strip():
            raise click.BadParameter(BLANK_SCOPE)
        if value is not None and value is not False:
            setattr(ctx.ensure_object(State), name, value)
            if name == "debug":
                logging.getLogger().setLevel(logging.INFO)
        return value

    return callback


class Integer(click.IntRange):
    """click's IntRange for a number written as INTEGER_TEXT: click reads it with ``int``, which also took
    ``+5``, ``4_096`` and `` 5 `` (as the environment's settings and the HTTP API's query parameters refuse)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The number, or click's usage error naming the option."""
        if isinstance(value, str) and not INTEGER_TEXT.fullmatch(value):
            self.fail(f"{value!r}: {INTEGER_RULE}", param, ctx)
        return super().convert(value, param, ctx)

    def _describe_range(self) -> str:
        return _bounds(self, super()._describe_range)


#: a number with an optional fraction, as written: ASCII digits and at most one '.' (an optional '-' in front)
NUMBER_TEXT = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")


class Number(click.FloatRange):
    """click's FloatRange for a number written as NUMBER_TEXT: ``float`` also took ``1e3``, ``inf``, ``+0.5``,
    ``0_5`` and `` 0.5 ``."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The number, or click's usage error naming the option."""
        if isinstance(value, str) and not NUMBER_TEXT.fullmatch(value):
            self.fail(f"{value!r}: must be a number written as ASCII digits with an optional '.' (an optional "
                      "'-' in front), nothing else", param, ctx)
        return super().convert(value, param, ctx)

    def _describe_range(self) -> str:
        return _bounds(self, super()._describe_range)


def _bounds(kind: click.IntRange | click.FloatRange, describe: Callable[[], str]) -> str:
    """The range --help shows: none without bounds (click wrote ``[x<=None]`` for --seed)."""
    return "" if kind.min is None and kind.max is None else describe()


def filled(*, blank_ok: bool = False) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A callback refusing an empty value (``--reason "$WHY"`` with WHY unset), and a blank one unless
    ``blank_ok``, as the usage error (exit 2) that names the option or argument, before any work.

    ``blank_ok`` is for a name that looks up what is stored (a SESSION, a TURN): an id the library took,
    " " too, is named exactly; an empty one names nothing. Before, such values were refused by the
    store's own checks as failures (exit 1), or taken as absent (``chat --model-url ''``)."""

    def callback(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if isinstance(value, str) and (not value if blank_ok else not value.strip()):
            raise click.BadParameter("must not be empty" if blank_ok else "must not be empty or blank")
        return value

    return callback


def _scope_option(default: str) -> Callable[[F], F]:
    return click.option("--scope", metavar="SCOPE", expose_value=False, callback=_remember("scope"),
                        help=f"Scope of the sessions [env TRANSCRIPT_STORE_SCOPE; default {default!r}].")


def _db_option(default: str) -> Callable[[F], F]:
    return click.option("--db", metavar="URL", expose_value=False, callback=_remember("db"),
                        help=f"Database URL [env TRANSCRIPT_STORE_URL; default {default}].")


_COMMON = (
    click.option("--json", "json_output", is_flag=True, default=False, expose_value=False,
                 callback=_remember("json"), help="Machine-readable JSON output."),
    click.option("--config", metavar="PATH", type=click.Path(exists=True, dir_okay=False), expose_value=False,
                 callback=_remember("config"),
                 help="Host settings TOML [env TRANSCRIPT_STORE_CONFIG; default ./transcript-store.toml]."),
    click.option("--debug", is_flag=True, default=False, expose_value=False, callback=_remember("debug"),
                 help="Show tracebacks and library log messages."),
)


#: the commands that run without a stdout (its one line, serve's URL, is a courtesy: a daemon closes it)
_NO_STDOUT_NEEDED = frozenset({"serve"})


def common_options(scope_default: str, db_default: str = "sqlite:///transcripts.db") -> Callable[[F], F]:
    """The global options, so they work before or after the command name; the defaults for --help.

    A command (not a group: its subcommand's options are not parsed yet when it runs) first refuses a
    named settings file that is missing or invalid, before any work.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            ctx = click.get_current_context()
            if not isinstance(ctx.command, click.Group):
                ctx.ensure_object(State).check_named_settings()
                if sys.stdout is None and ctx.command.name not in _NO_STDOUT_NEEDED:
                    # Started with stdout closed (``>&-``): refused before any work. Its output was lost
                    # either way, but click.echo drops it silently: `sessions import FILE >&-` imported
                    # and exited 0 where the same with --json, or `sessions show`, exited 1.
                    raise CommandError("cannot write to stdout: it is closed")
            try:
                return fn(*args, **kwargs)
            except BrokenPipeError as e:
                # A click.echo whose reader left (`current | true`): click ends the command with exit 1
                # and not a word; said in one line as WholeStdout's writes say it. The bytes left in
                # stdout's buffer go nowhere, or flushing them at exit would fail again (exit 120).
                _discard_stdout()
                raise CommandError(f"cannot write to stdout: {e.strerror or e}") from e

        out: Any = checked
        for option in reversed((_db_option(db_default), _scope_option(scope_default), *_COMMON)):
            out = option(out)
        return out  # type: ignore[no-any-return]

    return decorate


common = common_options(DEFAULT_SCOPE)


def _discard_stdout() -> None:
    """Point stdout's file descriptor at the null device (a pipe whose reader left): what its buffer
    still holds is flushed there at exit instead of failing. A stream without one (a test's) is left."""
    with suppress(OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both of the first two
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)


def state() -> State:
    """The global options of the running command."""
    return click.get_current_context().ensure_object(State)


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


# ---------------------------------------------------------------------------------------------- stores


def _no_store_file(path: Path) -> str | None:
    """Why a SQLite file holds no store without opening it (None: it may hold one)."""
    if not path.exists():
        return "the file does not exist"
    # A zero-byte file is an empty database to sqlite3, which writes a header into it on the first
    # connection (the WAL mode): a read would change the file it was pointed at.
    if path.is_file() and path.stat().st_size == 0:
        return "the file is empty"
    return _not_a_store_database(path) if path.is_file() else None


#: the first 16 bytes of every SQLite database file
_SQLITE_MAGIC = b"SQLite format 3\x00"
#: why a file holds no store when it is no SQLite database at all, and what to do: not `init`, which refuses it
_NOT_SQLITE = "the file is not a SQLite database"
_NOT_SQLITE_ADVICE = "it cannot hold one; give the path of a store or of a file to create"


def _no_store_advice(why: str) -> str:
    """What to do about a SQLite file that holds no store for ``why``: `init`, unless it could not make one."""
    return _NOT_SQLITE_ADVICE if why == _NOT_SQLITE else "run `transcript-store init`"


def _refuse_non_sqlite_file(url: str) -> None:
    """SchemaNotCurrent for a SQLite URL naming a file that is not a SQLite database: a command that would
    create a store there got sqlite3's "file is not a database" at its first statement, an outage (5)."""
    path = sqlite_file(url)
    if path is not None and _not_sqlite(path):
        raise SchemaNotCurrent(f"no store at {mask_url(url)} ({_NOT_SQLITE}): {_NOT_SQLITE_ADVICE}")


def _not_sqlite(path: Path) -> bool:
    """Whether ``path`` is a non-empty file that does not start as a SQLite database does."""
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return False
        with path.open("rb") as f:
            return not f.read(len(_SQLITE_MAGIC)).startswith(_SQLITE_MAGIC)
    except OSError:
        return False  # the store's own open reports it


def _not_a_store_database(path: Path) -> str | None:
    """Why a non-empty file holds no store, judged without changing it (None: it may hold one).

    Opening it as the store does would switch another program's database to WAL mode (a store's
    connections set it) before the schema check refused it. A store's file is in WAL mode, where that
    setting changes nothing, so only a file in rollback-journal mode is looked into, read-only.
    """
    try:
        with path.open("rb") as f:
            header = f.read(100)
    except OSError:
        return None  # the store's own open reports it
    if len(header) < 100 or not header.startswith(_SQLITE_MAGIC):
        return _NOT_SQLITE
    if header[18] == 2 or header[19] == 2:  # WAL mode: may be a store
        return None
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            found = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version'"
            ).fetchone()
    except sqlite3.Error:
        return None  # locked, a hot journal to roll back...: the store's own open decides
    return None if found is not None else "the database holds no transcript-store schema"


def open_store(*, create: bool = False, check_schema: bool = True) -> TranscriptStore:
    """The store named by --db; ``create`` allows a new SQLite store, ``check_schema`` refuses old ones.

    Without ``create`` a SQLite file that holds no store (missing, empty, or a database without the
    store's schema: another program's, given by mistake) is refused as no store yet, untouched: a SQLite
    store migrates itself on open, which would create one in it. So is a PostgreSQL database without the
    schema: with TRANSCRIPT_STORE_AUTO_UPGRADE=1 its migration on open would create one too.
    """
    config = state().store_config()
    make_url_or_usage(config.url)  # a bad URL is a usage error before its file is looked at
    url = mask_url(config.url)
    path = sqlite_file(config.url)
    # TRANSCRIPT_STORE_AUTO_UPGRADE=0 turns migrating on open off: a creating command that relies on it
    # then refuses a file without a store as the others do, before connecting (which switched another
    # program's database to WAL, or left a new, empty file behind its refusal). init and upgrade
    # (``check_schema=False``) migrate themselves: the setting is not theirs.
    create = create and (config.auto_upgrade is not False or not check_schema)
    why = _no_store_file(path) if path is not None and not create else None
    if why is not None:
        # (a file that is no SQLite database at all is not for init either: it refuses it, exit 4 again)
        raise SchemaNotCurrent(f"no store at {url} ({why}): {_no_store_advice(why)}")
    if create:
        _refuse_non_sqlite_file(config.url)
    try:
        store = TranscriptStore(config=config, create=False)
    except InvalidInput as e:  # only the URL is validated before the first connection
        raise CommandError(f"{url_source()}: {e}", EXIT_USAGE) from e
    if not check_schema:
        return store
    try:
        if not create and store.current_revision() is None:
            raise SchemaNotCurrent(
                f"no store at {url} (the database holds no transcript-store schema): run `transcript-store init`"
            )
        store.ensure_current()
    except BaseException:
        store.close()
        raise
    return store


@contextmanager
def store_session(*, create: bool = False, check_schema: bool = True) -> Iterator[TranscriptStore]:
    """An open store, closed afterwards."""
    store = open_store(create=create, check_schema=check_schema)
    try:
        yield store
    finally:
        store.close()


def find_session(store: TranscriptStore, scope: str, ref: str) -> SessionInfo:
    """A session by id, else by its session key; UnknownSession when neither names one."""
    try:
        return store.get_session(scope, ref)
    except UnknownSession:
        by_key = store.find_session(scope, ref)
        if by_key is None:
            raise
        return by_key


def schema_state(revision: str | None, head: str) -> str:
    """``current``, ``none`` (no schema), ``behind`` or ``ahead`` (newer than this library)."""
    if revision == head:
        return "current"
    if revision is None:
        return "none"
    return "behind" if revision in migrate.known_revisions() else "ahead"


def schema_advice(state_now: str) -> str:
    """What to do about a schema in ``state_now`` (``none``, ``behind`` or ``ahead``)."""
    return {"ahead": "upgrade the library", "none": "run `transcript-store init`"}.get(
        state_now, "run `transcript-store upgrade`"
    )


# ---------------------------------------------------------------------------------------------- rendering


def message_text(message: dict[str, Any]) -> str:
    """A message as one readable text: content, content parts, tool calls."""
    parts: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        parts.extend(p["text"] if p.get("type") == "text" else f"[{p.get('type')}]" for p in content)
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        parts.append(f"-> {fn.get('name')}({fn.get('arguments', '')})")
    if message.get("role") == "tool":
        parts.insert(0, f"[{message.get('tool_call_id')}]")
    return " ".join(parts)


def entry_text(entry: Entry) -> str:
    """An entry as one readable text; events show their payload."""
    if entry.message is not None:
        return message_text(entry.message)
    payload = entry.payload or {}
    if entry.kind == "compaction" and isinstance(payload.get("summary"), str):
        return f"summary: {payload['summary']}"
    return json.dumps(payload, ensure_ascii=False)


def _show_json(store: TranscriptStore, scope: str, ref: str, every: bool) -> None:
    """Print the session's JSON document, read from one snapshot a page at a time into a temporary file
    (memory holds a page, not the session), then copied to stdout: the snapshot is not held open at the
    pace of stdout's reader, and a read retried after a transient error rewrites the file."""
    out = WholeStdout(sys.stdout)
    encoding, errors = out.codec()
    ascii_only = not holds_unicode(encoding)  # the same document, its non-ASCII characters escaped
    with tempfile.TemporaryFile() as spool:
        try:
            store.read(lambda c: showing.write_json_in(c, scope, ref, spool, every=every, encoding=encoding,
                                                       errors=errors, ascii_only=ascii_only))
            spool.seek(0)
        except OSError as e:  # a full TMPDIR, a file size limit: the document cannot reach stdout whole
            raise CommandError(f"cannot write to stdout: its temporary file failed: {e.strerror or e}") from e
        out.copy_from(spool)


def entry_json(entry: Entry) -> dict[str, Any]:
    """An entry as JSON."""
    return entry.model_dump(mode="json")


def print_entries(out: Console, entries: list[Entry], *, every: bool, title: str) -> None:
    """A transcript table; ``every`` adds seq, kind, ids and the active marker."""
    from rich.table import Table
    from rich.text import Text

    # Readable at 80 columns (a pipe's width) with every column: the ids fold, the content takes what the
    # others leave (rich would otherwise squeeze it to nothing, and the marker with it).
    table = Table(title=title, title_justify="left", show_lines=False)
    if every:
        table.add_column("", no_wrap=True)
        table.add_column("seq", justify="right", no_wrap=True)
        table.add_column("entry", overflow="fold", min_width=8)
        table.add_column("parent", overflow="fold", min_width=8)
        table.add_column("kind", no_wrap=True)
    table.add_column("pos", justify="right", no_wrap=True)
    table.add_column("role", no_wrap=True)
    table.add_column("content", overflow="fold", ratio=1 if every else None)
    for e in entries:
        pos = "" if e.position is None else str(e.position)
        cells: list[str | Text] = [pos, e.role or "", Text(shown(entry_text(e)))]
        if every:
            mark = "*" if e.active else "off"
            cells = [mark, str(e.seq), e.entry_id, e.parent_id or "", e.kind, *cells]
        table.add_row(*cells)
    out.print(table)
    if every:
        out.print("* on the active branch; off: stored off the active branch (or before a rewrite)")


# ---------------------------------------------------------------------------------------------- the group


def _write_info(text: str) -> None:
    """Print --help's or --version's text whole, or fail the command (exit 1) as any other output does:
    click.echo dropped it silently when stdout was closed (``--version >&-`` exited 0 with nothing said)."""
    WholeStdout(sys.stdout).write(text + "\n")


def _show_help(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    _write_info(ctx.get_help())
    ctx.exit()


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import version

    _write_info(f"{ctx.find_root().info_name}, version {version('transcript-store')}")
    ctx.exit()


class _Command(click.Command):
    """A command whose --help writes as every output does (``_write_info``)."""

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        """click's help option, its text written whole or failing the command."""
        option = super().get_help_option(ctx)
        if option is not None:
            option.callback = _show_help
        return option


class _Group(_Command, click.Group):
    """A group whose --help, subcommands and subgroups write as every output does (``_write_info``)."""

    command_class = _Command
    group_class = type


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@common
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version and exit.")
def cli() -> None:
    """A durable conversation-transcript store with turn commits, for agent hosts and their engines.

    Exit codes: 0 ok, 1 failed, 2 usage error, 3 not found, 4 schema not current, 5 database unavailable,
    6 permission denied.
    """
    state()


# ---------------------------------------------------------------------------------------------- schema


def _migrate(*, create: bool) -> None:
    st = state()
    with store_session(create=create, check_schema=False) as store:
        if not create and store.current_revision() is None:
            # upgrade migrates a store; a database without one (an empty PostgreSQL database, another
            # program's SQLite file in WAL mode) is left as it is: creating one is init's to do.
            raise SchemaNotCurrent(
                f"no store at {store.url} (the database holds no transcript-store schema): run `transcript-store init`"
            )
        before, after = migrate.upgrade_from(store.db)  # "before" as read under the migration's lock
        head = migrate.head_revision()
        report = {"url": store.url, "backend": store.backend, "before": before, "revision": after, "head": head}
    if st.json:
        emit_json(report)
    elif before == after:
        click.echo(f"{report['url']}: already at revision {after} (head)")
    elif before is None:
        click.echo(f"{report['url']}: created the schema at revision {after}")
    else:
        click.echo(f"{report['url']}: migrated {before} -> {after}")


@cli.command()
@common
def init() -> None:
    """Create a store (or migrate an existing one to the newest schema)."""
    _migrate(create=True)


@cli.command()
@common
def upgrade() -> None:
    """Migrate an existing store to the newest schema revision."""
    _migrate(create=False)


@cli.command()
@common
def current() -> None:
    """Show the store's schema revision and this library's head; exit 4 when they differ."""
    st = state()
    with store_session(check_schema=False) as store:
        revision = store.current_revision()
        report = {"url": store.url, "backend": store.backend, "revision": revision}
    head = migrate.head_revision()
    report.update(head=head, state=schema_state(revision, head))
    if st.json:
        emit_json(report)
    else:
        for key in ("url", "revision", "head", "state"):
            click.echo(f"{key + ':':9} {report.get(key) or '(none)'}")
    if revision != head:
        raise CommandError(
            f"the schema is {report['state']} (revision {revision or 'none'}, head {head}): "
            f"{schema_advice(schema_state(revision, head))}",
            EXIT_SCHEMA,
        )


# ---------------------------------------------------------------------------------------------- sessions


@cli.group()
@common
def sessions() -> None:
    """List, show, export, import and delete sessions."""


def _all_sessions(store: TranscriptStore, scope: str) -> list[tuple[SessionInfo, int]]:
    """Every session of the scope (``State.scope_name`` checked it) with its stored bytes, a page of 1,000
    and their sizes from one snapshot: sized one read each after the listing, a session deleted meanwhile
    failed the whole list as unknown (exit 3)."""
    out: list[tuple[SessionInfo, int]] = []
    after: str | None = None

    def sized(after: str | None) -> Callable[[Core], list[tuple[SessionInfo, int]]]:
        return lambda c: [(s, c.session_bytes(scope, s.session_id)) for s in c.list_sessions(scope, after, 1000)]

    while True:
        page = store.read(sized(after))
        out.extend(page)
        if len(page) < 1000:
            return out
        after = page[-1][0].session_id


@sessions.command("list")
@common
def sessions_list() -> None:
    """Sessions of the scope with entry and visible counts, sizes, keys and state."""
    st = state()
    scope = st.scope_name
    with store_session() as store:
        rows = _all_sessions(store, scope)
    if st.json:
        emit_json([{**s.model_dump(mode="json"), "bytes": size} for s, size in rows])
        return
    if not rows:
        click.echo(f"no sessions in scope {scope!r}")
        return
    from rich import box
    from rich.table import Table
    from rich.text import Text

    # Readable at 80 columns (a pipe's width): no vertical rules and shared padding; the id and the key
    # fold (never shrink to nothing), the time wraps at its space, the short columns stay whole.
    table = Table(title=f"sessions in scope {scope!r}", title_justify="left", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False)
    for name in ("session", "key"):
        table.add_column(name, overflow="fold", min_width=8)
    for name in ("entries", "visible", "bytes", "gen"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("active", no_wrap=True)
    table.add_column("updated", min_width=10)
    for s, size in rows:
        table.add_row(s.session_id, Text(s.session_key or ""), str(s.entry_count), str(s.visible_count), str(size),
                      str(s.generation), "yes" if s.active else "no", s.updated_at.strftime("%Y-%m-%d %H:%M:%S"))
    console().print(table)


@sessions.command("show")
@click.argument("session", callback=filled(blank_ok=True))
@click.option("--all", "every", is_flag=True, help="Every stored entry: off-branch ones and events too, marked.")
@common
def sessions_show(session: str, every: bool) -> None:
    """Show the visible transcript of SESSION (an id or a session key)."""
    st = state()
    scope = st.scope_name
    with store_session() as store:
        check_id("session_id", session)  # refused before a read, as the lookup by id refused it
        if st.json:
            _show_json(store, scope, session, every)
            return
        # One snapshot: the session and every page of its entries of one moment.
        info, entries = store.read(lambda c: showing.read_all_in(c, scope, session, every=every))
    what = "every stored entry" if every else "visible transcript"
    print_entries(console(), entries, every=every, title=f"session {info.session_id} ({what})")


@sessions.command("export")
@click.argument("session", callback=filled(blank_ok=True))
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              help="Write to FILE (default, or '-': stdout).")
@common
def sessions_export(session: str, output: str | None) -> None:
    """Export SESSION losslessly as JSONL: a header line, then one line per stored entry."""
    st = state()
    if output == "-":  # stdout, as ``import -`` reads stdin (it wrote a file named "-")
        output = None
    if output == "":  # ("-o $FILE", FILE unset) click checks no path for it: the export was read, then
        # refused as "cannot write : Is a directory" (exit 1)
        raise CommandError("--output: an empty path names no file (give a file, or '-' for stdout)", EXIT_USAGE)
    database = sqlite_file(st.store_config().url)
    if output is not None and database is not None and _names_the_store(Path(output), database):
        raise CommandError(f"--output: {output} is the store's own database file", EXIT_USAGE)
    with store_session() as store:
        info = find_session(store, st.scope_name, session)

        def export_in(c: Core, stream: BinaryIO) -> int:
            # The session looked up, or nothing: one deleted and made again under its id since is another.
            row = c.session_row(st.scope_name, info.session_id)
            if row is None:
                raise UnknownSession(st.scope_name, info.session_id)
            if row.incarnation != info.incarnation:
                raise SessionReplaced(st.scope_name, info.session_id)
            return transfer.write_export_in(c, st.scope_name, info.session_id, stream)

        def fill(stream: BinaryIO) -> int:
            # Written from one snapshot, a page at a time, into a file: memory holds one page.
            return store.read(lambda c: export_in(c, stream))

        if output is None:
            sys.stdout.flush()
            try:
                count = _spooled(fill, sys.stdout.buffer)
            except OSError as e:
                raise CommandError(f"cannot write the export to stdout: {e.strerror or e}") from e
            return
        try:
            count = _write_file(Path(output), fill)
        except OSError as e:
            raise CommandError(f"--output: cannot write {output}: {e.strerror or e}") from e
    if st.json:
        emit_json({"session_id": info.session_id, "entries": count, "file": output})
    else:
        click.echo(f"exported session {info.session_id}: {count} entries to {output}")


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
    target = Path(os.path.realpath(output))  # through a symbolic link: the file it names is replaced
    temp = target.with_name(f".{target.name[:40]}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: a name no one else holds; 0o666 under the umask: the mode a plain new file gets.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "w+b") as stream:
            count = fill(stream)
            stream.flush()
            os.fsync(stream.fileno())
        if old is not None:
            os.chmod(temp, stat.S_IMODE(old.st_mode))  # the earlier export's mode, as an overwrite kept it
        os.replace(temp, target)
    except BaseException:
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


@sessions.command("import")
@click.argument("file", type=_ExportFile("r", encoding="utf-8-sig"))
@click.option("--session-id", "new_id", metavar="ID", callback=filled(), help="Import under a new session id.")
@click.option("--session-key", "new_key", metavar="KEY", callback=filled(), help="Import under a new session key.")
@common
def sessions_import(file: IO[str], new_id: str | None, new_key: str | None) -> None:
    """Recreate a session from an export FILE ('-' for stdin): same entries, tree and head, in --scope (not
    the scope the file names).

    The file holds the transcript only (no turn intents, receipts or engine state): do not retry the
    source's turns on the copy. Declared sizes and generations are checked; drop an entry's size_bytes
    after editing it by hand."""
    st = state()
    config = st.store_config()
    make_url_or_usage(config.url)
    for option, what, value in (("--session-id", "session_id", new_id), ("--session-key", "session_key", new_key)):
        # Named as the option, before the file is read: "session_id must be ..." read as the file's own.
        try:
            check_id(what, value, optional=True, new=True)
        except InvalidInput as e:
            raise InvalidInput(f"{option}: {e}") from None
    numbers = array("q")  # the line of each record: 8 bytes an entry
    records = _export_records(file, export_line_limit(config.max_payload_bytes), numbers)
    # Checked whole before the store is opened: opening creates or migrates the database --db names (a
    # mistyped path's new file; another program's SQLite file, switched to WAL and given the store's
    # tables), which a refused import must leave as it was. The checked rows wait in a temporary file,
    # which the write transaction reads (again, when it is retried): memory holds a batch of them.
    with _scratch_file() as spool:
        try:
            header = next(records, _NO_HEADER)
            if header is _NO_HEADER:  # not None: a first line of `null` is a header, and a wrong one
                raise InvalidInput("the export is empty (no header line)")
            plan = transfer.plan_import_stream(
                config, st.scope_name, header, records, spool, session_id=new_id, session_key=new_key
            )
        except InvalidInput as e:
            raise _at_line(e, numbers) from None
        except OSError as e:  # the spool's (the export's own are CommandErrors): a full TMPDIR, a size limit
            raise CommandError(_SPOOL_FAILED + (e.strerror or str(e))) from e
        with store_session(create=True) as store:
            try:
                info = transfer.write_import(store, plan)
            except SessionKeyConflict as e:  # the file's own key, or --session-key's: say how to give another
                raise SessionKeyConflict(f"{e}; import it under another with --session-key") from None
            except IdempotencyConflict as e:  # the file's own id, or --session-id's
                raise IdempotencyConflict(f"{e}; import it under another id with --session-id") from None
    if st.json:
        emit_json(info.model_dump(mode="json"))
    else:
        click.echo(f"imported session {info.session_id}: {info.entry_count} entries, {info.visible_count} visible")


@sessions.command("delete")
@click.argument("session", callback=filled(blank_ok=True))
@click.option("--yes", is_flag=True, help="Really delete (required).")
@common
def sessions_delete(session: str, yes: bool) -> None:
    """Delete SESSION and every entry of it, for good (only with --yes)."""
    st = state()
    with store_session() as store:
        info = find_session(store, st.scope_name, session)
        if not yes:
            raise CommandError(
                f"refusing to delete session {info.session_id} ({info.entry_count} entries) without --yes"
            )
        # The session looked up, or none: one deleted and made again under its id since (by another
        # process, between the lookup and this write) is someone else's now, and stays (exit 3).
        info = store.delete_session(st.scope_name, info.session_id, incarnation=info.incarnation)
    if st.json:
        emit_json({"deleted": info.session_id, "entries": info.entry_count})
    else:
        click.echo(f"deleted session {info.session_id} ({info.entry_count} entries)")


# ---------------------------------------------------------------------------------------------- outbox


@cli.group()
@common
def outbox() -> None:
    """Turn intents waiting for their engine: status, drain, recover, block."""


def refuse_bad_legacy_config(settings: HostSettings) -> None:
    """InvalidInput (exit 1) for a bad ``[engine.config.legacy]``, which stops every host as it is built
    (the fallback engine's, never quarantined): checked by the host's own check before a command that builds
    one opens, creates or migrates a store, so such a mistake leaves no new store behind."""
    from .compaction import check_legacy_config
    from .host import LEGACY

    check_legacy_config(settings.engine_config.get(LEGACY, {}))


def _runtime(store: TranscriptStore, settings: HostSettings, model: Any = None) -> Any:
    from .host import HostRuntime
    from .model import LocalResponder

    return HostRuntime(store=store, settings=settings, model=model if model is not None else LocalResponder())


#: the most outbox rows `outbox status` lists (its counts are of every row); Turns.intents reads at most 10,000
OUTBOX_STATUS_ROWS = 10_000
#: session ids per read when `outbox recover` lists every session with outbox rows
OUTBOX_PAGE = 1000


def _outbox_counts(store: TranscriptStore, scope: str) -> dict[str, int]:
    """Outbox rows of ``scope`` per state, every row counted."""
    from sqlalchemy import func, select

    from .schema import outbox as rows

    q = select(rows.c.state, func.count()).where(rows.c.scope == scope).group_by(rows.c.state)
    return store.read(lambda c: {str(state): int(n) for state, n in c.conn.execute(q)})


@outbox.command("status")
@common
def outbox_status() -> None:
    """Pending and blocked turn intents per session, with attempts and last errors."""
    from .turns import Turns

    st = state()
    with store_session() as store:
        intents = Turns(store).intents(st.scope_name, limit=OUTBOX_STATUS_ROWS)
        counts = _outbox_counts(store, st.scope_name)
    total = sum(counts.values())
    if total > len(intents):  # never a silent cut: the counts below are of every row
        click.echo(f"warning: the outbox holds {total} rows; showing the first {len(intents)} "
                   "(by session and enqueue order)", err=True)
    fields = ("session_id", "turn_id", "engine_id", "state", "enqueue_seq", "attempt_count", "last_error",
              "block_reason", "lease_owner", "last_attempt_at")
    if st.json:
        emit_json([{k: v for k, v in i.model_dump(mode="json").items() if k in fields} for i in intents])
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"outbox of scope {st.scope_name!r}", title_justify="left")
    for name in ("session", "turn", "engine", "state", "seq", "attempts", "last error / block reason"):
        table.add_column(name, overflow="fold")
    for i in intents:
        why = " | ".join(x for x in (i.last_error, i.block_reason) if x)
        table.add_row(i.session_id, i.turn_id, i.engine_id, i.state, str(i.enqueue_seq), str(i.attempt_count),
                      Text(shown(why)))  # an engine's error or an operator's reason: read, not obeyed
    if intents:
        console().print(table)
    click.echo(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) if counts else "the outbox is empty")


@outbox.command("drain")
@click.option("--session", "session", metavar="SESSION", callback=filled(blank_ok=True), help="Only this session.")
@click.option("--limit", type=Integer(1, MAX_DRAIN), default=1000, show_default=True, help="Rows to deliver.")
@common
def outbox_drain(session: str | None, limit: int) -> None:
    """Deliver ready intents to their engines' commit_turn, in order; exit 1 if any failed."""
    st = state()
    with store_session() as store:
        # Not "if session": an empty one (`--session "$SID"`, SID unset) is refused as an id, not taken for
        # none, which delivered every session's turns.
        sid = find_session(store, st.scope_name, session).session_id if session is not None else None
        settings = st.settings()
        with engine_output_on_stderr():
            runtime = _runtime(store, settings)
            try:
                report = runtime.turns.drain(runtime.commit_in, scope=st.scope_name, session_id=sid, limit=limit)
            finally:
                runtime.dispose()
    data = {
        "committed": report.committed,
        "duplicates": report.duplicates,
        "blocked": report.blocked,
        "failed": [{"session_id": s, "turn_id": t, "error": e} for s, t, e in report.failed],
        "stopped_sessions": report.stopped_sessions,
    }
    if st.json:
        emit_json(data)
    else:
        click.echo(f"committed {report.committed}, duplicates {report.duplicates}, blocked {report.blocked}, "
                   f"failed {len(report.failed)}")
        for s, t, e in report.failed:  # an engine's error text: read, not obeyed (as outbox status shows it)
            click.echo(f"  failed: session {s} turn {t}: {shown(e, one_line=True)}")
    if report.failed:
        raise CommandError(f"{len(report.failed)} deliveries failed; their rows stay queued")


@outbox.command("block")
@click.argument("session", callback=filled(blank_ok=True))
@click.argument("turn_id", metavar="TURN", callback=filled(blank_ok=True))
@click.option("--reason", required=True, callback=filled(), help="Why (kept with the row, shown by `outbox status`).")
@click.option("--yes", is_flag=True, help="Really block it: the turn never reaches its engine.")
@common
def outbox_block(session: str, turn_id: str, reason: str, yes: bool) -> None:
    """Block a queued TURN of SESSION that its engine can never take, so that the later ones go on."""
    from .turns import Turns

    st = state()
    if not yes:
        raise CommandError("blocking a turn keeps it from its engine for good: add --yes", EXIT_FAILED)
    with store_session() as store:
        sid = find_session(store, st.scope_name, session).session_id
        intent = Turns(store).block(st.scope_name, sid, turn_id, reason)
    if st.json:
        emit_json({"session_id": sid, "turn_id": turn_id, "engine_id": intent.engine_id, "state": intent.state,
                   "block_reason": intent.block_reason})
    else:
        reason = shown(intent.block_reason or "")
        click.echo(f"session {sid} turn {turn_id} ({intent.engine_id}): {intent.state} ({reason})")


def _outbox_sessions(store: TranscriptStore, scope: str) -> list[str]:
    """Every session of ``scope`` with outbox rows, read in keyset pages of OUTBOX_PAGE ids: however many."""
    from sqlalchemy import select

    from .schema import outbox as rows

    def page(after: str | None) -> Callable[[Any], list[str]]:
        q = select(rows.c.session_id).where(rows.c.scope == scope).distinct()
        if after is not None:
            q = q.where(rows.c.session_id > after)
        q = q.order_by(rows.c.session_id).limit(OUTBOX_PAGE)
        return lambda c: [str(r.session_id) for r in c.conn.execute(q)]

    out: list[str] = []
    while True:
        ids = store.read(page(out[-1] if out else None))
        out.extend(ids)
        if len(ids) < OUTBOX_PAGE:
            return out


@outbox.command("recover")
@click.argument("session", required=False, callback=filled(blank_ok=True))
@common
def outbox_recover(session: str | None) -> None:
    """Discard dead admitted intents and drain ready ones (SESSION, or every session with intents)."""
    st = state()
    scope = st.scope_name
    with store_session() as store:
        # An empty SESSION is refused as an id, not taken for none (every session recovered), as drain's.
        targets = (
            [find_session(store, scope, session).session_id] if session is not None else _outbox_sessions(store, scope)
        )
        settings = st.settings()
        results = []
        with engine_output_on_stderr():
            runtime = _runtime(store, settings)
            try:
                for sid in targets:
                    try:
                        r = runtime.turns.recover(scope, sid, settings.engine, runtime.commit_in)
                    except UnknownSession:
                        if session is not None:
                            raise
                        continue  # deleted since the list was read: its intents went with it
                    results.append({
                        "session_id": sid,
                        "discarded": r.discarded,
                        "committed": r.drain.committed,
                        "duplicates": r.drain.duplicates,
                        "blocked": r.drain.blocked,
                        "failed": [{"turn_id": t, "error": e} for _s, t, e in r.drain.failed],
                        "pending": r.queued,
                    })
            finally:
                runtime.dispose()
    if st.json:
        emit_json(results)
    else:
        for r in results:
            click.echo(f"session {r['session_id']}: discarded {len(r['discarded'])}, committed {r['committed']}, "
                       f"duplicates {r['duplicates']}, blocked {r['blocked']}, failed {len(r['failed'])}, "
                       f"pending {len(r['pending'])}")
        if not results:
            click.echo("nothing to recover")
    failed = sum(len(r["failed"]) for r in results)
    if failed:
        raise CommandError(f"{failed} deliveries failed; their rows stay queued")


# ---------------------------------------------------------------------------------------------- engines


@contextmanager
def engine_output_on_stderr() -> Iterator[None]:
    """Engines loaded in this process (their imports, factories, dispose) write to stderr, shown: stdout
    holds the command's own output only (one JSON document under --json), and an engine's ``print`` is
    escaped as under ``serve``."""
    shown_err = sys.stderr if isinstance(sys.stderr, ShownStream) else ShownStream(sys.stderr)
    with redirect_stdout(shown_err), redirect_stderr(shown_err):
        yield


def engine_report(settings: HostSettings, store: TranscriptStore | None) -> tuple[list[dict[str, Any]], list[str]]:
    """Every discovered engine, loaded and validated, with its declarations; and the registry's warnings."""
    with engine_output_on_stderr():
        return _engine_report(settings, store)


def engine_context(settings: HostSettings, store: TranscriptStore | None, engine_id: str) -> EngineContext:
    """The context an engine is checked with: its config table, the store, the summarizer and estimator."""
    from .summarize import summarizer_from_env
    from .tokens import default_estimator

    return EngineContext(store=store, config=settings.engine_config.get(engine_id, {}),
                         summarizer=summarizer_from_env(), estimator=default_estimator())


def _engine_report(settings: HostSettings, store: TranscriptStore | None) -> tuple[list[dict[str, Any]], list[str]]:
    from .models import CURRENT_TURN_FENCE, TURN_ADVANCEMENT_IDEMPOTENCY
    from .registry import EngineRegistry

    registry = EngineRegistry(settings.plugin_dirs)
    out = []
    for engine_id in sorted(registry.specs):
        status = registry.check(engine_id, engine_context(settings, store, engine_id))
        info = status.info
        sem = info.transcript_semantics if info else None
        out.append({
            "id": engine_id,
            "selected": engine_id == settings.engine,
            "source": status.spec.source,
            "location": status.spec.location,
            "version": info.version if info else status.spec.manifest.get("version"),
            "description": status.spec.manifest.get("description"),
            "valid": status.valid,
            "reason": status.reason,
            "owns_compaction": info.owns_compaction if info else None,
            "fence": sem.current_turn_fence if sem else None,
            "idempotency": sem.turn_advancement_idempotency if sem else None,
            "durable": bool(sem and sem.current_turn_fence == CURRENT_TURN_FENCE
                            and sem.turn_advancement_idempotency == TURN_ADVANCEMENT_IDEMPOTENCY),
            "accepted_host_params": info.accepted_host_params if info else None,
            "host_requirements": {k: v.model_dump() for k, v in info.host_requirements.items()} if info else {},
            "turn_maintenance_mode": info.turn_maintenance_mode if info else None,
        })
    if settings.engine not in registry.specs:
        out.append({"id": settings.engine, "selected": True, "source": None, "location": None, "valid": False,
                    "reason": unknown_engine_reason(registry)})
    # A config table of no engine here is read by none (a typo in its name left the engine on defaults,
    # where a typo in a key inside it is refused): said, not refused (the engine may be another host's).
    unread = [
        f"[engine.config.{shown(name, one_line=True)}] names no engine found here; nothing reads it "
        f"(known: {', '.join(sorted(registry.specs))})"
        for name in sorted(settings.engine_config) if name not in registry.specs
    ]
    return out, [*registry.warnings, *unread]


def unusable_engines(settings: HostSettings, store: TranscriptStore | None, runtime: HostRuntime | None = None
                     ) -> list[str]:
    """A warning for each engine that cannot load among the selected one and those with an
    ``[engine.config.<id>]`` table (a mistyped value in it, say): hosts run such an engine's turns on legacy,
    which said nothing before a turn ran (and ``engines list`` exited 0 on it).

    Given the ``runtime`` that will run them, the engines are checked in it and those that load are kept for
    their first use: a plugin was imported, and its factory run, once for the check and again for the runtime
    (its output said twice; the factory's time paid twice)."""
    from .registry import EngineRegistry

    out = []
    with engine_output_on_stderr():  # an engine's import and factory print there, as in engine_report
        registry = runtime.registry if runtime is not None and runtime.registry is not None \
            else EngineRegistry(settings.plugin_dirs)
        for engine_id in sorted({settings.engine, *settings.engine_config} & set(registry.specs)):
            if runtime is not None:
                status = runtime.preload(engine_id)
            else:
                status = registry.check(engine_id, engine_context(settings, store, engine_id))
            if not status.valid:
                out.append(unusable_warning(engine_id, status.reason, engine_id == settings.engine))
        if settings.engine not in registry.specs:  # a slot naming no installed engine (a typo): as unusable
            out.append(unusable_warning(settings.engine, unknown_engine_reason(registry), True))
    return out


def unknown_engine_reason(registry: EngineRegistry) -> str:
    """Why an engine id no plugin registered cannot load, naming the ones that are."""
    return f"unknown context engine; known: {', '.join(sorted(registry.specs))}"


def unusable_warning(engine_id: str, reason: str | None, selected: bool) -> str:
    """The warning line's text for an engine that cannot load, naming its reason (the key of a mistyped value)."""
    from .host import LEGACY

    what = "the selected context engine" if selected else "context engine"
    then = ("its turns run on the legacy engine until it is fixed" if engine_id != LEGACY
            else "turns fail until it is fixed")
    return shown(f"{what} {engine_id!r} cannot load: {reason}; {then} (see `transcript-store doctor`)",
                 one_line=True)


def warn_unusable_engines(settings: HostSettings, store: TranscriptStore | None,
                          runtime: HostRuntime | None = None) -> None:
    """Write ``unusable_engines``' warnings to stderr, one line each."""
    for w in unusable_engines(settings, store, runtime):
        click.echo(f"warning: {w}", err=True)


def _engines_table(engines: list[dict[str, Any]], settings: HostSettings) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"engines (selected: {settings.engine}, from {settings.engine_source})", title_justify="left")
    for name in ("", "id", "source", "version", "compaction", "fence", "idempotency", "host params", "valid"):
        table.add_column(name, overflow="fold")
    for e in engines:
        params = e.get("accepted_host_params")
        table.add_row(
            ">" if e["selected"] else "", e["id"], e.get("source") or "-", str(e.get("version") or "-"),
            "owns" if e.get("owns_compaction") else "runtime", e.get("fence") or "-", e.get("idempotency") or "-",
            "all" if params is None else ", ".join(params) or "none",
            Text("yes" if e["valid"] else f"NO: {shown(e['reason'])}"),  # a plugin's error text, read not obeyed
        )
    return table


def _optional_store() -> tuple[TranscriptStore | None, str | None]:
    """The store when there is a current one (engines may need it to load), else None and why not."""
    try:
        return open_store(), None
    except (SchemaNotCurrent, StoreUnavailable) as e:
        return None, str(e)


@cli.group()
@common
def engines() -> None:
    """Discovered context engines."""


@engines.command("list")
@common
def engines_list() -> None:
    """Every discovered engine: source, location, version, declarations, validation; the selected one."""
    st = state()
    settings = st.settings()
    store, why = _optional_store()
    try:
        data, warnings = engine_report(settings, store)
    finally:
        if store is not None:
            store.close()
    if why is not None:  # listed all the same (no engine needs the store to be found); said, not silent
        warnings.append(f"no store to read quarantines from ({why}); engines listed without them")
    # The selected engine, or one given a config table, that cannot load (a mistyped value): its turns run
    # on legacy, a line in the "valid" column alone was easy to miss (still exit 0: `doctor` is the check).
    warnings.extend(unusable_warning(e["id"], e.get("reason"), e["selected"]) for e in data
                    if not e["valid"] and (e["selected"] or (e.get("source") is not None
                                                             and e["id"] in settings.engine_config)))
    if st.json:
        emit_json({"selected": settings.engine, "selection_source": settings.engine_source, "engines": data,
                   "warnings": warnings})
        return
    out = console()
    out.print(_engines_table(data, settings))
    for e in data:
        click.echo(shown(f"{e['id']}: {e.get('location') or '-'}"))
    for w in warnings:
        click.echo(f"warning: {shown(w)}")


# ---------------------------------------------------------------------------------------------- doctor


def _doctor_store(problems: list[str]) -> tuple[dict[str, Any], TranscriptStore | None, StoreUnavailable | None]:
    """The store's part of the report, the open store (None when there is none to check further), and the
    database's refusal when there was one."""
    config = state().store_config()
    head = migrate.head_revision()
    info: dict[str, Any] = {"url": mask_url(config.url), "head": head}
    try:
        store = open_store(check_schema=False)
    except SchemaNotCurrent as e:
        problems.append(str(e))
        return {**info, "revision": None, "state": "none"}, None, None
    try:
        revision = store.current_revision()
        info.update(backend=store.backend, revision=revision, state=schema_state(revision, head))
        info["settings"] = store.db.settings()
    except SchemaNotCurrent as e:
        # A version table that says no one revision (several rows; a store's tables with none): the
        # schema's state is unknown, and is one of the problems, not the end of the report (exit 4).
        store.close()
        problems.append(str(e))
        return {**info, "backend": store.backend, "revision": None, "state": None}, None, None
    except StoreUnavailable as e:
        store.close()
        info["error"] = str(e)
        problems.append(str(e) if isinstance(e, PermissionDenied) else f"database unavailable: {e}")
        return info, None, e
    if info["state"] == "none":
        problems.append(f"no schema yet (head is {head}): run `transcript-store init`")
    elif info["state"] != "current":  # with what to do, as `current` says it
        problems.append(f"schema is {info['state']} (revision {revision}, head {head}): {schema_advice(info['state'])}")
    return info, store, None


@cli.command()
@common
def doctor() -> None:
    """Check the store, the schema, the engines and quarantines; exit 1 when a check fails."""
    from . import quarantine

    st = state()
    settings = st.settings()
    problems: list[str] = []
    store_info, store, refusal = _doctor_store(problems)
    records: list[dict[str, Any]] = []
    try:
        engines_found, warnings = engine_report(settings, store if store_info.get("state") == "current" else None)
        if store is not None and store_info.get("state") == "current":
            records = [
                {**r.__dict__, "created_at": r.created_at.isoformat()}
                for r in store.read(lambda c: quarantine.records(c))
            ]
    finally:
        if store is not None:
            store.close()
    selected = next(e for e in engines_found if e["selected"])
    if not selected["valid"]:
        problems.append(f"selected engine {selected['id']!r} is invalid: {selected['reason']}")
    data = {
        "ok": not problems,
        "problems": problems,
        "store": store_info,
        "engine": {"selected": settings.engine, "source": settings.engine_source, "valid": selected["valid"],
                   "reason": selected["reason"]},
        "engines": engines_found,
        "quarantine": records,
        "warnings": warnings,
    }
    if st.json:
        emit_json(data)
    else:
        _print_doctor(data, settings)
    if problems:
        code = exit_code(refusal) if refusal is not None else EXIT_FAILED  # 5 or 6: the database's refusal
        raise CommandError(f"{len(problems)} problem(s): {'; '.join(problems)}", code)


def _print_doctor(data: dict[str, Any], settings: HostSettings) -> None:
    out = console()
    s = data["store"]
    click.echo(f"store:     {s['url']} ({s.get('backend', '?')})")
    # state None: the database could not be read (unreachable, refused), so nothing is known of it
    click.echo(f"schema:    {s.get('state') or 'unknown'} (revision {s.get('revision') or '(none)'}, head {s['head']})")
    for key, value in (s.get("settings") or {}).items():
        click.echo(f"  {key}: {value}")
    e = data["engine"]
    # The engine's load error and the problems that quote it: read, not obeyed (as the engines table).
    click.echo(shown(f"engine:    {e['selected']} (from {e['source']}): {'valid' if e['valid'] else e['reason']}"))
    out.print(_engines_table(data["engines"], settings))
    if data["quarantine"]:
        from rich.table import Table
        from rich.text import Text

        table = Table(title="quarantined engines (live processes)", title_justify="left")
        for name in ("engine", "process", "operation", "reason", "since"):
            table.add_column(name, overflow="fold")
        for r in data["quarantine"]:
            # An engine's error text: read, not obeyed (as outbox status shows it).
            table.add_row(r["engine_id"], r["process"], r["operation"], Text(shown(r["reason"])), r["created_at"])
        out.print(table)
    else:
        click.echo("quarantine: none")
    for w in data["warnings"]:
        click.echo(f"warning: {shown(w)}")
    for p in data["problems"]:
        click.echo(f"problem: {shown(p)}")
    click.echo("ok" if data["ok"] else "NOT OK")


# ---------------------------------------------------------------------------------------------- compact


def compact_json(result: Any) -> dict[str, Any]:
    """A CompactResult as JSON (with the successor session id, if any)."""
    return {**result.model_dump(mode="json"), "session_id": result.session_id}


def _check_focus(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """Refuse an empty (or blank) --focus: it was stored as the compaction's focus, an empty one, where no
    --focus at all means none (`--focus "$FOCUS"` with FOCUS unset)."""
    if value is not None and not value.strip():
        raise click.BadParameter("the focus must not be empty (leave --focus out for none)")
    return value


@cli.command()
@click.argument("session", callback=filled(blank_ok=True))
@click.option("--focus", metavar="TEXT", callback=_check_focus, help="What the summary should keep in focus.")
@click.option("--engine", metavar="NAME", callback=filled(), help="The engine for this run (overrides the settings).")
@common
def compact(session: str, focus: str | None, engine: str | None) -> None:
    """Compact SESSION now through the selected engine; exit 1 when the compaction failed."""
    st = state()
    settings = st.settings(engine)
    with store_session() as store:
        sid = find_session(store, st.scope_name, session).session_id
        with engine_output_on_stderr():
            runtime = _runtime(store, settings)
            try:
                # The engine asked for, or nothing: the runtime would compact with legacy instead (as a turn
                # degrades), writing a legacy compaction into the session and answering "compacted".
                # An id no engine is registered under (a typo): refused as it is, not loaded and quarantined,
                # which wrote a quarantine record of this process for a command that changed nothing.
                if settings.engine not in runtime.registry.specs:
                    known = ", ".join(sorted(runtime.registry.specs))
                    unknown = f"unknown context engine {settings.engine!r} (known: {known})"
                    raise CommandError(f"{unknown}: nothing compacted")
                try:
                    runtime.engine(settings.engine)
                except EngineError as e:
                    raise CommandError(f"{e}: nothing compacted") from None
                result = runtime.compact(st.scope_name, sid, focus=focus)
            finally:
                runtime.dispose()
    if st.json:
        emit_json(compact_json(result))
    else:
        click.echo(_compact_line(result))
    if not result.ok:
        raise CommandError(f"compaction failed: {result.reason}")


def _compact_line(result: Any) -> str:
    what = "compacted" if result.compacted else "not compacted"
    parts = [what]
    if result.reason:
        parts.append(f"({result.reason})")
    if result.tokens_before is not None:
        after = result.tokens_after if result.tokens_after is not None else "-"
        parts.append(f"tokens {result.tokens_before} -> {after}")
    if result.session_id:
        parts.append(f"successor session {result.session_id}")
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------- chat


@cli.command()
@click.option("--session", "session_key", default=CHAT_KEY, show_default=True, metavar="KEY", callback=filled(),
              help="The session key to open (created when missing).")
@click.option("--engine", metavar="NAME", callback=filled(), help="The context engine (overrides settings).")
@click.option("--model-url", metavar="URL", callback=filled(),
              help="OpenAI-compatible endpoint [env OPENAI_BASE_URL; default: the local responder].")
@click.option("--model", "model_name", metavar="NAME", callback=filled(),
              help="Model name [env TRANSCRIPT_STORE_MODEL].")
@click.option("--api-key", metavar="KEY", callback=filled(), help="API key [env OPENAI_API_KEY].")
@common
def chat(session_key: str, engine: str | None, model_url: str | None, model_name: str | None,
         api_key: str | None) -> None:
    """An interactive, persisted conversation through the host runtime (reads lines from stdin).

    Slash commands: /compact [focus], /branch, /history, /engine, /help, /quit.
    """
    st = state()
    settings = st.settings(engine)  # a bad settings file or variable: refused before the store is created
    model = chosen_model(model_url, model_name, api_key)  # so is a bad model URL
    scope = st.scope_name  # so are a bad scope and a bad session key (open_session would refuse them after)
    check_id("session_key", session_key, new=True)
    refuse_bad_legacy_config(settings)  # exit 1, but before the store is created too (the host checks it again)
    source = sys.stdin if sys.stdin is not None else io.StringIO("")  # stdin closed (``<&-``): no input
    # Never None (a closed stdout is refused before any command runs): the loop took None for "sys.stdout",
    # which by then was stderr, and every turn ran and committed with its replies there, exit 0.
    stdout = sys.stdout  # the conversation's own output; an engine's goes to stderr
    with store_session(create=True) as store, engine_output_on_stderr():
        # Built before the session is opened: a bad [engine.config.legacy] (which the host checks whole)
        # stops chat with nothing written, not after it opened the session.
        runtime = _runtime(store, settings, model)
        try:
            info = store.open_session(scope, session_key)
            loop = ChatLoop(runtime, scope, info.session_id, st.json, stdout)
            # Before the first turn runs it on legacy, said once; checked in the runtime, the engine
            # (imported once, made once) is the one the turns use.
            warn_unusable_engines(settings, store, runtime)
            if not st.json:
                loop.banner(session_key)
            loop.run(_lenient(source))
        finally:
            runtime.dispose()
    if loop.failed:
        # The database's refusal (5 unavailable, 6 permission denied) keeps its own exit code.
        raise CommandError(f"{loop.failed} turn(s) or command(s) failed", loop.code)


def chosen_model(model_url: str | None, model_name: str | None, api_key: str | None) -> Any:
    """The model of --model-url/--model/--api-key (or their variables); a URL that is not http(s), or
    --model/--api-key without an endpoint, is a usage error, refused before any work."""
    from .model import LocalResponder, model_from_settings

    try:
        model = model_from_settings(model_url, model_name, api_key)
    except InvalidInput as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    if isinstance(model, LocalResponder) and (model_name is not None or api_key is not None):
        # No endpoint: the local stand-in answered, the model named or the key given silently unused
        # (`chat --model gpt-4o` talked to the stand-in, exit 0).
        given = "--model" if model_name is not None else "--api-key"
        raise CommandError(f"{given} needs an endpoint: give --model-url (or set OPENAI_BASE_URL); without one "
                           "the local stand-in answers", EXIT_USAGE)
    return model


CHAT_HELP = "/compact [focus]  /branch  /history  /engine  /help  /quit"


def _lenient(stream: IO[str]) -> IO[str]:
    """``stream`` decoding bytes that are not valid in its encoding as lone surrogates (surrogateescape).

    Strictly decoded, one such byte on ``chat``'s stdin raised UnicodeDecodeError out of the loop: the
    lines after it were never read and the run ended as an internal error. Decoded leniently, that line
    is one failed turn (a message with a lone surrogate is refused, as every one is) and the rest run.
    A handler chosen with PYTHONIOENCODING (``utf-8:replace``) is kept."""
    if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":  # not a handler the user chose
        stream.reconfigure(errors="surrogateescape")
    return stream


class ChatLoop:
    """One conversation: user lines become logical turns, slash lines become commands."""

    def __init__(self, runtime: Any, scope: str, session_id: str, as_json: bool, stdout: IO[str] | None = None) -> None:
        """Bind to a host runtime and an open session; write the conversation to ``stdout`` (default
        sys.stdout now: the chat command passes its own, engines' output going to stderr meanwhile)."""
        self.runtime = runtime
        self.scope = scope
        self.session_id = session_id
        self.as_json = as_json
        self.stdout = stdout if stdout is not None else sys.stdout
        from rich.console import Console

        self.out = Console(file=self.stdout, highlight=False, soft_wrap=False, markup=False, emoji=False)
        self.last: Any = None  # the last TurnOutcome
        self.failed = 0
        self.code = EXIT_FAILED  # the exit code of the failures: the worst error's (see exit_code)
        #: the longest input line read (characters): a message over the payload cap is refused anyway
        config = getattr(getattr(runtime, "store", None), "config", None)
        self.max_line = int(config.max_payload_bytes) if config is not None else 64 * 1024 * 1024

    def failure(self, error: TranscriptStoreError) -> None:
        """Count a failed turn or command and show its error line."""
        self.failed += 1
        # 1, or the database's refusal (5 unavailable, 6 permission denied) as documented: a turn whose
        # session was deleted under it (3) or a schema changed under it (4) is a failed turn, 1.
        code = exit_code(error)
        self.code = max(self.code, code if code in (EXIT_UNAVAILABLE, EXIT_DENIED) else EXIT_FAILED)
        click.echo(error_line(error, None), err=True)

    def banner(self, session_key: str) -> None:
        """Say what this conversation runs on."""
        from .model import mask_url as mask_model_url  # every query value masked: an endpoint's key

        s = self.runtime.settings
        model = self.runtime.model
        where = f" at {mask_model_url(model.base_url)}" if getattr(model, "base_url", None) else ""
        click.echo(f"chat: session {session_key} ({self.session_id}), engine {s.engine} "
                   f"(from {s.engine_source}), model {getattr(model, 'name', '?')}{where}", file=self.stdout)
        click.echo(f"commands: {CHAT_HELP}", file=self.stdout)

    def run(self, stream: IO[str]) -> None:
        """Read lines until /quit or the end of input."""
        interactive = stream.isatty()
        while True:
            if interactive:
                # Under --json stdout holds JSON lines only (`chat --json | jq` at a terminal): the
                # prompt goes to stderr there.
                click.echo("you> ", nl=False, file=sys.stderr if self.as_json else self.stdout)
            # At most a message's worth: a line of any length was read whole (``chat < /dev/zero``
            # took memory until the process was killed).
            line = stream.readline(self.max_line + 1)
            if not line:
                return
            # The cap is in bytes (UTF-8, as stored): a line of 1,500 "é" is 3,000 bytes.
            if len(line) > self.max_line or len(line.encode("utf-8", "surrogatepass")) > self.max_line:
                raise InvalidInput(f"an input line of more than {self.max_line} bytes (over the "
                                   "store's payload cap for one message)")
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return
            else:
                self.turn(text)

    def emit(self, event: str, data: dict[str, Any], text: str | None) -> None:
        """One event: a JSON line, or text for people."""
        if self.as_json:
            ascii_only = not holds_unicode(getattr(self.stdout, "encoding", None) or "utf-8")
            click.echo(json.dumps({"event": event, **data}, ensure_ascii=ascii_only, default=str), file=self.stdout)
        elif text is not None:
            click.echo(text, file=self.stdout)

    def turn(self, text: str) -> None:
        """Run one logical turn and show the replies."""
        try:
            outcome = self.runtime.run_turn(self.scope, self.session_id, text)
        except TranscriptStoreError as e:
            self.failure(e)
            return
        self.last = outcome
        self.session_id = outcome.session_id
        for m in outcome.messages[1:-1]:
            self.emit("step", {"message": m}, f"  [{m['role']}] {shown(message_text(m))}")
        if outcome.degraded_reason:
            self.emit("degraded", {"reason": outcome.degraded_reason},
                      f"  (this turn ran on {outcome.engine_id}: {shown(outcome.degraded_reason)})")
        data = {
            "turn_id": outcome.turn_id, "session_id": outcome.session_id, "engine_id": outcome.engine_id,
            "degraded_reason": outcome.degraded_reason, "commit_status": outcome.commit_status,
            "attempts": outcome.attempts, "reply": message_text(outcome.reply),
        }
        self.emit("reply", data, f"assistant: {shown(message_text(outcome.reply))}")

    def command(self, line: str) -> bool:
        """Run a slash command; False ends the conversation."""
        # Any whitespace ends the name (`/compact<TAB>focus` was an unknown command "/compact\tfocus").
        name, arg = (*line.split(None, 1), "")[:2]
        if name in ("/quit", "/exit"):
            self.emit("quit", {}, "bye")
            return False
        handlers: dict[str, Callable[[str], None]] = {
            "/compact": self.compact, "/branch": self.branch, "/history": self.history,
            "/engine": self.engine, "/help": lambda _arg: self.emit("help", {"commands": CHAT_HELP}, CHAT_HELP),
        }
        handler = handlers.get(name)
        if handler is None:
            # A typo or a command of another tool: said with the known ones, the conversation going on (at a
            # terminal, the next line can be the right command), and counted as a failed command, so that
            # the run ends with exit 1: a script's unknown command was a warning on stderr only, exit 0.
            self.failure(InvalidInput(f"unknown command {name}; the commands are {CHAT_HELP}"))
            return True
        try:
            handler(arg.strip())
        except TranscriptStoreError as e:
            self.failure(e)
        return True

    def compact(self, focus: str) -> None:
        """/compact [focus]: manual compaction through the selected engine."""
        result = self.runtime.compact(self.scope, self.session_id, focus=focus or None)
        self.session_id = self.runtime.resolve_session(self.scope, self.session_id)
        self.emit("compact", compact_json(result), _compact_line(result))
        if not result.ok:  # a failed compaction, as `compact` counts it (exit 1)
            self.failed += 1

    def branch(self, _arg: str) -> None:
        """/branch: move the head to before the last user message; the next message regenerates."""
        store = self.runtime.store
        visible = store.read_visible(self.scope, self.session_id)
        last_user = next((e for e in reversed(visible) if e.role == "user"), None)
        if last_user is None:
            self.emit("branch", {"moved": False}, "nothing to branch from: no user message yet")
            return
        info = store.branch(self.scope, self.session_id, last_user.parent_id)
        text = message_text(last_user.message or {})
        self.emit("branch", {"moved": True, "before_entry_id": last_user.entry_id, "head_entry_id": info.head_entry_id,
                             "visible_count": info.visible_count},
                  f"branched: the head is back before {text!r}; your next message starts a new branch")

    def history(self, _arg: str) -> None:
        """/history: the visible transcript."""
        entries = self.runtime.store.read_visible(self.scope, self.session_id)
        if self.as_json:
            self.emit("history", {"entries": [entry_json(e) for e in entries]}, None)
        else:
            print_entries(self.out, entries, every=False, title=f"session {self.session_id}")

    def engine(self, _arg: str) -> None:
        """/engine: the selected engine, and what the last turn ran on."""
        s = self.runtime.settings
        last = self.last
        data = {
            "selected": s.engine, "source": s.engine_source,
            "last_turn_engine": last.engine_id if last else None,
            "last_turn_degraded_reason": last.degraded_reason if last else None,
            "quarantined": {k: {"operation": op, "reason": why} for k, (op, why) in self.runtime.quarantined.items()},
        }
        text = f"engine: {s.engine} (from {s.engine_source})"
        if last is not None:
            text += f"; last turn ran on {last.engine_id}"
            # An engine's error text, as outbox status and doctor show it: read, not obeyed.
            text += f" (degraded: {shown(last.degraded_reason)})" if last.degraded_reason else " (not degraded)"
        if self.runtime.quarantined:
            text += "; quarantined: " + ", ".join(sorted(self.runtime.quarantined))
        self.emit("engine", data, text)


# ---------------------------------------------------------------------------------------------- gateway


@cli.command()
@click.option("--workers", type=Integer(1, MAX_WORKERS), default=4, show_default=True,
              help="Worker processes.")
@click.option("--sessions", "session_count", type=Integer(1, MAX_SESSIONS), default=6, show_default=True,
              help="Conversations.")
@click.option("--turns", type=Integer(1, MAX_TURNS), default=5, show_default=True,
              help=f"Turns per conversation (at most {MAX_RUN_TURNS} turns in all).")
@click.option("--engine", metavar="NAME", callback=filled(), help="The context engine (overrides settings).")
@click.option("--model-url", metavar="URL", callback=filled(),
              help="OpenAI-compatible endpoint [env OPENAI_BASE_URL; default: the local responder].")
@click.option("--model", "model_name", metavar="NAME", callback=filled(),
              help="Model name [env TRANSCRIPT_STORE_MODEL].")
@click.option("--api-key", metavar="KEY", callback=filled(), help="API key [env OPENAI_API_KEY].")
@click.option("--faults/--no-faults", default=True, show_default=True, help="Inject crashes, timeouts and rewrites.")
@click.option("--seed", type=Integer(), metavar="INTEGER",
              help="Seed of the workload and the faults [default: the gateway's].")
@common_options(GATEWAY_SCOPE)
def gateway(workers: int, session_count: int, turns: int, engine: str | None, model_url: str | None,
            model_name: str | None, api_key: str | None, faults: bool, seed: int | None) -> None:
    """Run the main job: a multi-worker gateway with injected faults, ending with an exactly-once report."""
    from .gateway import GatewayOptions, run_gateway

    st = state()
    config = st.store_config()
    make_url_or_usage(config.url)
    _refuse_non_sqlite_file(config.url)
    path = sqlite_file(config.url)
    why = _no_store_file(path) if path is not None and config.auto_upgrade is False else None
    if why is not None:  # (as open_store: nothing migrates on open, so nothing is created either)
        raise SchemaNotCurrent(f"no store at {mask_url(config.url)} ({why}): {_no_store_advice(why)}")
    settings = st.settings(engine)  # a bad settings file is a usage error here, not in the workers
    chosen_model(model_url, model_name, api_key)  # so is a bad model URL
    options = GatewayOptions(
        db_url=config.url, workers=workers, sessions=session_count, turns=turns, engine=engine,
        model_url=model_url, model=model_name, api_key=api_key, faults=faults, config_path=st.config,
        progress=not st.json,
    )
    try:
        options.check()
    except InvalidInput as e:  # sessions x turns past the bound of a run: a usage error
        raise CommandError(str(e), EXIT_USAGE) from None
    # A bad [engine.config.legacy] stops every worker's host as it is built: refused before a worker starts,
    # but after the usage errors above: checked first, it turned counts past a run's bound from 2 into 1.
    refuse_bad_legacy_config(settings)
    if seed is not None:
        options.seed = seed
    if st.scope_given:
        options.scope = st.scope_name
    # An engine that cannot load (a mistyped config value) is said once, before the workers run its turns on
    # legacy; it may need the store to load (none yet: checked without one, as engines list does).
    store, _why = _optional_store()
    try:
        warn_unusable_engines(settings, store)
    finally:
        if store is not None:
            store.close()
    # The faults are on purpose and the report counts them: their records would drown the progress bar.
    # Set here, never by run_gateway (a library call leaves its caller's logging alone), and given back
    # after the run: the command may run inside another program's process (click's runner, a test).
    lib_log = logging.getLogger("transcript_store")
    level = lib_log.level
    lib_log.setLevel(logging.ERROR)
    try:
        report = run_gateway(options, console())
    finally:
        lib_log.setLevel(level)
    if st.json:
        emit_json(report.to_dict())
    else:
        report.render(console())
    if not report.ok:
        raise CommandError(f"the gateway run failed its checks: {'; '.join(report.problems)}")


def make_url_or_usage(url: str) -> URL:
    """The parsed --db value; a URL no store accepts is a usage error, named by where it came from."""
    try:
        parsed = parse_url(url)
    except InvalidInput as e:
        raise CommandError(f"{url_source()}: {e}", EXIT_USAGE) from None
    path = sqlite_file(url)
    if path is not None and path.is_dir():
        # sqlite3 answers "unable to open database file", which read as a database down (exit 5).
        raise CommandError(f"{url_source()}: {mask_url(url)} names a directory: give the path of a store's "
                           "file (or of one to create)", EXIT_USAGE)
    if path is not None and path.exists() and not path.is_file():
        # A device or a FIFO (/dev/null): sqlite3's "disk I/O error" read as a database down (exit 5), and
        # a read command advised `init` on it, which then failed so.
        raise CommandError(f"{url_source()}: {mask_url(url)} names no regular file (a device, a FIFO or a "
                           "socket): give the path of a store's file (or of one to create)", EXIT_USAGE)
    above = next((p for p in path.parents if p.exists()), None) if path is not None else None
    if above is not None and not above.is_dir():
        # A path under a file: "cannot create the directory" read as a database down (exit 5).
        raise CommandError(f"{url_source()}: {mask_url(url)}: {above} is not a directory: give the path of a "
                           "store's file (or of one to create)", EXIT_USAGE)
    return parsed


def url_source() -> str:
    """Where the store's URL came from, as an error names it: --db, else TRANSCRIPT_STORE_URL."""
    ctx = click.get_current_context(silent=True)
    st = ctx.find_object(State) if ctx is not None else None
    # "is None", not "not st.db": an empty --db is the URL used (and refused), not the variable's
    if (st is None or st.db is None) and os.environ.get(URL_ENV):
        return URL_ENV
    return "--db"


# ---------------------------------------------------------------------------------------------- serve


def _loopback(sock: socket.socket) -> bool:
    """Whether a listening socket is bound to a loopback address (reachable from this machine only)."""
    address = str(sock.getsockname()[0]).split("%", 1)[0]
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (loopback unless you mean it).")
@click.option("--port", type=Integer(0, 65535), default=8765, show_default=True,
              help="Port; 0 picks a free one (the URL is printed).")
@click.option("--tokens", "tokens_file", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Bearer tokens, one 'TOKEN SCOPE' per line [also env TRANSCRIPT_STORE_TOKENS='tok=scope,...'].")
@click.option("--max-body", type=Integer(min=1024), default=8 * 1024 * 1024, show_default=True,
              help="Largest request body in bytes (413 above).")
@click.option("--body-timeout", type=Integer(1, 3600), default=30, show_default=True, metavar="SECONDS",
              help="A request body that pauses this long gets 408, and its connection is closed; so is a "
              "connection whose request head is not whole this long after it opened or its last response.")
@click.option("--access-log", is_flag=True, help="Log every request.")
@common
def serve(host: str, port: int, tokens_file: str | None, max_body: int, body_timeout: int, access_log: bool) -> None:
    """Serve the store and its engines over HTTP: JSON API, OpenAPI at /openapi.json, one scope per token."""
    from .service import Service, TokenMap
    from .service_app import bind, create_app
    from .service_app import serve as run_server

    try:
        tokens = TokenMap.load(tokens_file)
    except InvalidInput as e:  # a malformed tokens file or TRANSCRIPT_STORE_TOKENS: a usage error
        raise CommandError(str(e), EXIT_USAGE) from None
    if not len(tokens):
        raise CommandError("no tokens: pass --tokens FILE or set TRANSCRIPT_STORE_TOKENS", EXIT_USAGE)
    settings = state().settings()
    refuse_bad_legacy_config(settings)  # as a port in use, it must not leave a new store behind
    # The port first: a port in use must not leave a new store behind (the default is a file here).
    try:
        sock = bind(host, port)
    except OSError as e:
        raise CommandError(f"cannot listen on {host}:{port}: {e.strerror or e}", EXIT_FAILED) from None
    try:
        store = open_store(create=True)
    except BaseException:
        sock.close()
        raise
    service: Service | None = None
    try:
        with engine_output_on_stderr():  # a plugin's import prints there, escaped (it went to stdout as it was)
            service = Service(store, settings)
        # Before the requests that would run its turns on legacy; checked in the service's runtime, an engine
        # that loads is kept for them: the start waits for its factory once, and its first request does not.
        warn_unusable_engines(settings, store, service.runtime)
        app = create_app(service, tokens, max_body_bytes=max_body, body_timeout_seconds=body_timeout)
        if not _loopback(sock):
            # By the address bound, not the host's spelling: 127.0.0.2 and 127.1 are this machine; '' is not.
            click.echo(f"warning: listening on {host or 'every interface'} ({sock.getsockname()[0]}), beyond "
                       "this machine", err=True)
        logging.getLogger("transcript_store").setLevel(logging.INFO)
        # Engines run in this process: their print() and warnings.warn() quote stored text as their log
        # records do (uvicorn logs through the root handler here: log_config=None).
        show_process_output()
        run_server(app, sock, access_log=access_log, head_timeout=body_timeout,
                   announce=lambda url: click.echo(f"transcript-store serve: listening on {url} ({store.url})"))
    finally:
        # Stopped by Ctrl-C or SIGTERM, serve returns here (exit 0): the engines are disposed of (their
        # maintenance finished) and the store released.
        if service is not None:
            service.close()
        else:
            store.close()


@cli.group()
@common
def openclaw() -> None:
    """The OpenClaw context-engine plugin (integrations/openclaw) backed by `transcript-store serve`."""


def check_service_url(url: str) -> None:
    """Refuse a --service-url that is not a plain http(s) URL with a host and a valid port, as a usage error."""
    try:
        parts = urlsplit(url)
    except ValueError as e:  # an unclosed IPv6 bracket: "Invalid IPv6 URL"
        raise CommandError(f"--service-url {url!r}: {e}", EXIT_USAGE) from None
    problem = None
    if "@" in parts.netloc:
        # The plugin refuses it when OpenClaw builds the engine; quoted here, the password would be on the
        # terminal (the token goes in its own variable).
        raise CommandError("--service-url must not contain credentials (user:password@); the value is not shown",
                           EXIT_USAGE)
    if url != url.strip() or any(c.isspace() or not c.isprintable() for c in url):
        problem = "it contains whitespace or control characters"
    elif parts.scheme not in ("http", "https") or not parts.hostname:
        problem = "it is not an http(s) URL with a host"
    else:
        try:
            if parts.port == 0:
                problem = "bad port: 0"
        except ValueError as e:  # not a number, or not in 0..65535
            problem = f"bad port: {e}"
    if problem:
        raise CommandError(f"--service-url {url!r}: {problem}", EXIT_USAGE)


def _no_empty_path(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """Refuse an empty folder path (`--home "$HERMES_HOME"` with the variable unset): it was taken for the
    working directory (hermes install wrote plugins/ and pointed config.yaml there, exit 0) or for none
    (openclaw install-line printed the bundled plugin's folder)."""
    if value == "":
        raise click.BadParameter("an empty path names no folder")
    return value


@openclaw.command("install-line")
@click.option("--service-url", required=True, metavar="URL", help="Where `transcript-store serve` listens.")
@click.option("--engine", default="lossless", show_default=True, help="The service engine the plugin runs.")
@click.option("--plugin-dir", type=click.Path(file_okay=False), callback=_no_empty_path,
              help="The plugin folder [default: the bundled one].")
@common
def openclaw_install_line(service_url: str, engine: str, plugin_dir: str | None) -> None:
    """Print the `openclaw plugins install -l ...` line and the config for a service URL."""
    from .openclaw import install_instructions

    check_service_url(service_url)
    _check_engine_id(engine)
    try:
        info = install_instructions(service_url, engine=engine, plugin_dir=plugin_dir)
    except InvalidInput as e:
        raise CommandError(str(e), EXIT_USAGE) from e
    if state().json:
        emit_json(info)
    else:
        click.echo(info["text"])


@cli.group()
@common
def hermes() -> None:
    """The Hermes Agent context-engine plugin (integrations/hermes) backed by this store."""


def _check_threshold(_ctx: click.Context, _param: click.Parameter, value: float | None) -> float | None:
    """A finite --threshold: a fraction in (0, 1], or a whole number of tokens above 1 up to MAX_TOKENS."""
    if value is not None and not (
        math.isfinite(value) and value > 0 and (value <= 1 or (value.is_integer() and value <= MAX_TOKENS))
    ):
        raise click.BadParameter(
            f"{value} is not a fraction in (0, 1] or a whole number of tokens above 1 up to {MAX_TOKENS}"
        )
    return value


def _check_hermes_config(path: Path) -> None:
    """Refuse a config.yaml that --merge-config could not merge, before anything is written."""
    import yaml

    if not path.exists():
        return
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        raise CommandError(f"cannot merge into {path}: invalid YAML{where}: {problem}", EXIT_USAGE) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CommandError(f"cannot merge into {path}: {e}", EXIT_USAGE) from None
    except ValueError:  # PyYAML's int() past Python's limit on the digits of an integer
        raise CommandError(
            f"cannot merge into {path}: an integer of more than {sys.get_int_max_str_digits()} digits", EXIT_USAGE
        ) from None
    if data is None:
        return
    if not isinstance(data, dict):
        raise CommandError(f"cannot merge into {path}: not a YAML mapping", EXIT_USAGE)
    model = data.get("model")
    length = model.get("context_length") if isinstance(model, dict) else None
    try:
        int(length or 0)  # what the merge makes of it
    except (TypeError, ValueError, OverflowError):
        raise CommandError(
            f"cannot merge into {path}: model.context_length is not a number: {length!r}", EXIT_USAGE
        ) from None


def _merged_keys(path: Path, snippet: dict[str, Any]) -> dict[str, Any]:
    """The snippet's keys with the values ``path`` holds, read back after the merge wrote it."""
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return {section: {key: data[section][key] for key in keys} for section, keys in snippet.items()}


def _check_engine_id(engine: str) -> None:
    """Refuse an engine id that no engine installed here has (the settings' plugin folders included)."""
    from .registry import EngineRegistry

    known = EngineRegistry(state().settings().plugin_dirs).specs
    if engine not in known:
        raise CommandError(f"--engine {engine!r}: no such engine here (installed: {', '.join(sorted(known))})",
                           EXIT_USAGE)


def _check_hermes_engine_config(engine: str, config: dict[str, Any] | None) -> None:
    """Refuse engine settings that the plugin's settings.json cannot carry (a TOML date), before anything is written."""
    from .hermes import settings_json

    try:
        settings_json({f"[engine.config.{engine}]": config or {}})
    except InvalidInput as e:
        raise CommandError(f"cannot install the Hermes plugin: {e}", EXIT_USAGE) from None


def _absolute_sqlite(url: str) -> str:
    """A SQLite URL with a relative path made absolute (the plugin runs from wherever Hermes starts)."""
    parsed = make_url_or_usage(url)
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or not path or path == ":memory:" or Path(path).is_absolute():
        return url
    return parsed.set(database=str(Path(path).expanduser().resolve())).render_as_string(hide_password=False)


@hermes.command("install")
@click.option("--home", required=True, type=click.Path(file_okay=False), callback=_no_empty_path,
              help="The HERMES_HOME to install into.")
@click.option("--engine", default="lossless", show_default=True, help="The transcript-store engine to run.")
@click.option("--threshold", type=Number(), metavar="FLOAT", callback=_check_threshold,
              help="Compaction threshold: a fraction of the window, or tokens when > 1.")
@click.option("--merge-config", is_flag=True, help="Merge the config keys into HOME/config.yaml.")
@common_options("hermes", db_default="sqlite:///HOME/transcript-store.db")
def hermes_install(home: str, engine: str, threshold: float | None, merge_config: bool) -> None:
    """Write the plugin into HOME/plugins/ and print (or merge) the config snippet; --db picks the store."""
    import yaml

    from .hermes import install_plugin

    st = state()
    _check_engine_id(engine)
    _check_hermes_engine_config(engine, st.settings().engine_config.get(engine))
    if merge_config:
        _check_hermes_config(Path(home).expanduser() / "config.yaml")
    # --db, else TRANSCRIPT_STORE_URL, else a file in the Hermes home; --scope, else
    # TRANSCRIPT_STORE_SCOPE, else the adapter's own ("hermes").
    # An empty --db is a URL given (and refused below), not none: the plugin was pointed at another store.
    url = st.db if st.db is not None else (os.environ.get(URL_ENV) or None)
    if url is not None:
        make_url_or_usage(url)
    scope = st.scope_name if st.scope_given else None  # checked: a usage error
    # The settings' plugin folders go along: the engine was found in one of them (_check_engine_id).
    # So do the engine's settings ([engine.config.<engine>]): else it ran on its defaults inside Hermes.
    settings = st.settings()
    if url and not url.startswith("sqlite"):
        # PostgreSQL never migrates on open: the plugin failed every call inside Hermes (logged only)
        # and compress returned the list unchanged for ever. The store must be there before Hermes is.
        with store_session(check_schema=True):
            pass
    info = install_plugin(home, engine=engine, db_url=_absolute_sqlite(url) if url else None,
                          merge_config=merge_config, threshold=threshold, scope=scope,
                          plugin_dirs=settings.plugin_dirs, engine_config=settings.engine_config.get(engine))
    if merge_config:  # what the file now holds (the merge keeps a larger context_length, other plugins)
        info["config"] = _merged_keys(Path(info["config_path"]), info["config"])
    if state().json:
        emit_json(info)
    else:
        click.echo(f"plugin written to {info['plugin_dir']}")
        click.echo(("merged into " if merge_config else "add to ") + info["config_path"] + ":")
        click.echo(yaml.safe_dump(info["config"], sort_keys=False).rstrip())


# ---------------------------------------------------------------------------------------------- main


def exit_code(error: BaseException) -> int:
    """The documented exit code of an error."""
    if isinstance(error, CommandError):
        return error.code
    if isinstance(error, UnknownSession | UnknownEntry | UnknownTurn):
        return EXIT_NOT_FOUND
    if isinstance(error, SchemaNotCurrent):
        return EXIT_SCHEMA
    if isinstance(error, PermissionDenied):  # a grant to fix, not a server to wait for
        return EXIT_DENIED
    if isinstance(error, StoreUnavailable):
        return EXIT_UNAVAILABLE
    return EXIT_FAILED


#: a run of whitespace holding a line break (those str.splitlines breaks at): one space in an error line
_LINE_BREAK_RUN = re.compile(r"\s*[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]\s*")


def error_line(error: BaseException, url: str | None) -> str:
    """One line describing an error, with any database password scrubbed.

    Only line breaks (with the whitespace around them) become one space: the rest of the text is kept as
    it is, so that an id or a path with two spaces or a tab in it is named exactly (every run of
    whitespace was collapsed to one space, naming a session or a file that does not exist)."""
    text = _LINE_BREAK_RUN.sub(" ", str(error).strip()) or type(error).__name__
    if not isinstance(error, TranscriptStoreError | CommandError | OSError):
        text = f"{type(error).__name__}: {text}"
    for secret in url_secrets(url) if url else []:  # the userinfo's password, ?password=, ?sslpassword=
        text = text.replace(secret, "***")
    if isinstance(error, EngineError):
        text = f"engine: {text}"
    # The text may quote an engine's exception or a server's answer: shown, never obeyed by the terminal.
    return f"error: {shown(text)}"


def _fail(error: BaseException, st: State) -> NoReturn:
    if st.debug:
        traceback.print_exception(error)
    url = st.db or os.environ.get("TRANSCRIPT_STORE_URL")
    line = error_line(error, url)
    if not isinstance(error, TranscriptStoreError | CommandError | OSError) and not st.debug:
        line += " (an internal error: rerun with --debug for the traceback)"
    click.echo(line, err=True)
    sys.exit(exit_code(error))


def main(argv: list[str] | None = None) -> NoReturn:
    """The console script: run the command, map errors to one line and a documented exit code."""
    # A record quotes engines' errors and operators' reasons: shown on the terminal, never obeyed by it.
    logging.basicConfig(level=logging.WARNING, handlers=[shown_log_handler()])
    st = State()
    try:
        rv = cli.main(args=argv, prog_name="transcript-store", obj=st, standalone_mode=False)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(EXIT_FAILED)
    except Exception as e:
        _fail(e, st)
    sys.exit(rv if isinstance(rv, int) else EXIT_OK)
