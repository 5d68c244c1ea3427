"""``sessions``: list, show, export, import and delete sessions."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import IO, BinaryIO, cast

import click

from .. import showing, transfer
from ..config import StoreConfig
from ..core import Core, check_id
from ..db import sqlite_file
from ..entry import EXIT_INTERRUPTED
from ..errors import IdempotencyConflict, InvalidInput, SessionKeyConflict, SessionReplaced, UnknownSession
from ..models import SessionInfo
from ..store import TranscriptStore
from .exports import (
    _NO_HEADER,
    _SPOOL_FAILED,
    _at_line,
    _export_records,
    _ExportFile,
    _names_the_store,
    _scratch_file,
    _spooled,
    _write_file,
    export_line_limit,
)
from .group import cli
from .options import EXIT_USAGE, CommandError, common, filled, state
from .output import console, emit_json
from .rendering import _show_json, print_entries
from .stores import find_session, make_url_or_usage, store_session


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


def _filled_key(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``filled()`` for --session-key, whose empty value (asking for no key) is refused pointing at the flag
    that says so."""
    try:
        return cast("str | None", filled()(ctx, param, value))
    except click.BadParameter as e:
        raise click.BadParameter(f"{e.message} (--no-session-key imports the copy without a key)") from None


#: the library's advice on a header's id or key too long for a new session, as the command's options say it
_HEADER_ID_ADVICE = {
    "import it under another session_id": "import it under another with --session-id",
    "import it under another session_key": "import it under another with --session-key, or without one with "
    "--no-session-key",
}


def _with_options(e: InvalidInput) -> InvalidInput:
    """A refused import's error, its advice naming this command's options rather than the library's arguments."""
    message = str(e)
    for said, option in _HEADER_ID_ADVICE.items():
        if message.endswith(said):
            return InvalidInput(message[: -len(said)] + option)
    return e


def _import_file(
    file: IO[str], config: StoreConfig, scope: str, naming: tuple[str | None, str | None, bool], phase: list[str]
) -> SessionInfo:
    """Check the export ``file`` whole, then write it in one transaction (``sessions import``); ``phase``
    gets the session's id once the write may begin, then ``landed``."""
    new_id, new_key, keyless = naming
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
                config, scope, header, records, spool, session_id=new_id, session_key=new_key,
                keyless=keyless,
            )
        except InvalidInput as e:
            raise _at_line(_with_options(e), numbers) from None
        except OSError as e:  # the spool's (the export's own are CommandErrors): a full TMPDIR, a size limit
            raise CommandError(_SPOOL_FAILED + (e.strerror or str(e))) from e
        with store_session(create=True) as store:
            phase.append(plan.session["session_id"])
            try:
                info = transfer.write_import(store, plan)
                phase.append("landed")
            except SessionKeyConflict as e:  # the file's own key, or --session-key's: say how to give another
                raise SessionKeyConflict(
                    f"{e}; import it under another with --session-key, or without one with --no-session-key"
                ) from None
            except IdempotencyConflict as e:  # the file's own id, or --session-id's
                raise IdempotencyConflict(f"{e}; import it under another id with --session-id") from None
    return info


def _interrupted(phase: list[str]) -> str:
    """What a Ctrl-C of ``sessions import`` left, by how far it got (``_import_file``'s ``phase``)."""
    if not phase:
        return "interrupted: nothing was imported"
    sid = phase[0]
    if phase[-1] == "landed":
        return f"interrupted after the import landed: session {sid!r} is imported whole"
    return (
        f"interrupted while writing session {sid!r}: an import is one transaction, so it landed whole or not "
        f"at all (`sessions show {sid}` tells; the same import again is refused if it landed)"
    )


@sessions.command("import")
@click.argument("file", type=_ExportFile("r", encoding="utf-8-sig"))
@click.option("--session-id", "new_id", metavar="ID", callback=filled(), help="Import under a new session id.")
@click.option("--session-key", "new_key", metavar="KEY", callback=_filled_key,
              help="Import under a new session key.")
@click.option("--no-session-key", "keyless", is_flag=True,
              help="Import without a session key (the copy of a session whose key its source still holds).")
@common
def sessions_import(file: IO[str], new_id: str | None, new_key: str | None, keyless: bool) -> None:
    """Recreate a session from an export FILE ('-' for stdin): same entries, tree and head, in --scope (not
    the scope the file names).

    The copy keeps the file's session id and key unless --session-id, --session-key or --no-session-key say
    otherwise (a key is held by one active session: a copy beside its source needs another key, or none).
    The file holds the transcript only (no turn intents, receipts or engine state): do not retry the
    source's turns on the copy. Declared sizes and generations are checked; drop an entry's size_bytes
    after editing it by hand. The import is one transaction: Ctrl-C ends it with exit 130, saying whether
    it can have landed."""
    st = state()
    config = st.store_config()
    make_url_or_usage(config.url)
    if keyless and new_key is not None:
        raise CommandError("--session-key and --no-session-key cannot be given together", EXIT_USAGE)
    for option, what, value in (("--session-id", "session_id", new_id), ("--session-key", "session_key", new_key)):
        # Named as the option, before the file is read: "session_id must be ..." read as the file's own.
        try:
            check_id(what, value, optional=True, new=True)
        except InvalidInput as e:
            raise InvalidInput(f"{option}: {e}") from None
    # A Ctrl-C became click's Abort ("error: aborted", exit 1), which said nothing of the import: told here
    # whether anything can have landed (the import is one transaction: whole or nothing), exit 130.
    phase: list[str] = []  # the session's id once its transaction may have begun, then "landed"
    try:
        info = _import_file(file, config, st.scope_name, (new_id, new_key, keyless), phase)
    except KeyboardInterrupt:
        raise CommandError(_interrupted(phase), EXIT_INTERRUPTED) from None
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
