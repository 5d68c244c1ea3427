"""The ``transcript-store`` group, its --help and --version; ``main``, the console script: an error is one
line and a documented exit code."""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from typing import NoReturn

import click

from ..db import url_secrets
from ..entry import interrupted
from ..errors import (
    EngineError,
    PermissionDenied,
    SchemaNotCurrent,
    StoreUnavailable,
    TranscriptStoreError,
    UnknownEntry,
    UnknownSession,
    UnknownTurn,
)
from ..terminal import shown, shown_log_handler
from .options import (
    EXIT_DENIED,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_SCHEMA,
    EXIT_UNAVAILABLE,
    CommandError,
    State,
    common,
    state,
)
from .output import WholeStdout


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
    6 permission denied, 130 interrupted (Ctrl-C).
    """
    state()


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
    """One line describing an error, with any database password scrubbed, and a schema's advice naming ``url``.

    Only line breaks (with the whitespace around them) become one space: the rest of the text is kept as
    it is, so that an id or a path with two spaces or a tab in it is named exactly (every run of
    whitespace was collapsed to one space, naming a session or a file that does not exist)."""
    text = _LINE_BREAK_RUN.sub(" ", str(error).strip()) or type(error).__name__
    if not isinstance(error, TranscriptStoreError | CommandError | OSError):
        text = f"{type(error).__name__}: {text}"
    if isinstance(error, SchemaNotCurrent):  # its advice names the database the command was given
        from .stores import cli_advice

        text = cli_advice(text, url)
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
    except click.Abort as e:
        if isinstance(e.__cause__, KeyboardInterrupt):
            # Ctrl-C: exit 130, as a shell reports a process SIGINT ended and as a Ctrl-C while the command
            # still starts (entry.py) ends it. It was click's "error: aborted", exit 1: "the operation failed".
            interrupted()
        click.echo("error: aborted", err=True)  # an EOFError out of a command
        sys.exit(EXIT_FAILED)
    except Exception as e:
        _fail(e, st)
    sys.exit(rv if isinstance(rv, int) else EXIT_OK)
