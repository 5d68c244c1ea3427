"""The global options (given before or after the command name), the State they fill, and the option types
and callbacks every command shares."""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from ..config import INTEGER_RULE, INTEGER_TEXT, StoreConfig
from ..core import check_id
from ..errors import InvalidInput
from ..settings import HostSettings, check_settings_env, load_settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_SCHEMA, EXIT_UNAVAILABLE, EXIT_DENIED = 0, 1, 2, 3, 4, 5, 6
DEFAULT_SCOPE = "default"
SCOPE_ENV = "TRANSCRIPT_STORE_SCOPE"
URL_ENV = "TRANSCRIPT_STORE_URL"


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


#: a lone surrogate: how Python hands over an argument's bytes that are not UTF-8
_SURROGATE = re.compile("[\ud800-\udfff]")


def filled(*, blank_ok: bool = False) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A callback refusing an empty value (``--reason "$WHY"`` with WHY unset), and a blank one unless
    ``blank_ok``, as the usage error (exit 2) that names the option or argument, before any work.

    Bytes that are not UTF-8 are refused the same way. ``blank_ok`` is for a name that looks up what is
    stored (a SESSION, a TURN): an id the library took, " " too, is named exactly; an empty one names
    nothing. Before, such values were refused by the store's own checks as failures (exit 1), or taken as
    absent (``chat --model-url ''``)."""

    def callback(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if isinstance(value, str) and (not value if blank_ok else not value.strip()):
            raise click.BadParameter("must not be empty" if blank_ok else "must not be empty or blank")
        if isinstance(value, str) and _SURROGATE.search(value):
            # Bytes that are not UTF-8 arrive as lone surrogates: no id, key, name or text the store takes
            # (it refused them later, as a failure, exit 1, after opening the store).
            raise click.BadParameter("must be text: it holds bytes that are not UTF-8")
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
