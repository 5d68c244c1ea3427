"""Entries and messages as people read them (rich tables, drawn by the commands that show them) and as JSON."""

from __future__ import annotations

import json
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from .. import showing
from ..models import Entry
from ..store import TranscriptStore
from ..terminal import shown
from .options import CommandError
from .output import WholeStdout, holds_unicode

if TYPE_CHECKING:  # imported where they are used: the CLI's start stays light (rich: by a command drawing a table)
    from rich.console import Console


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
