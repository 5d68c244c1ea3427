"""``compact``: a session compacted now through the selected engine."""

from __future__ import annotations

from typing import Any

import click

from ..engine import check_focus
from ..errors import EngineError, InvalidInput
from .group import cli
from .hosting import _runtime, engine_output_on_stderr
from .options import CommandError, common, filled, state
from .output import emit_json
from .stores import find_session, store_session


def compact_json(result: Any) -> dict[str, Any]:
    """A CompactResult as JSON (with the successor session id, if any)."""
    return {**result.model_dump(mode="json"), "session_id": result.session_id}


def _check_focus(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """Refuse an empty (or blank) --focus: it was stored as the compaction's focus, an empty one, where no
    --focus at all means none (`--focus "$FOCUS"` with FOCUS unset); and one no summary can hold (bytes
    that are not UTF-8, which arrive as lone surrogates), as the usage error (exit 2) a bad argument is,
    before the store is opened: the compaction refused it as a failure (exit 1)."""
    if value is not None and not value.strip():
        raise click.BadParameter("the focus must not be empty (leave --focus out for none)")
    try:
        return check_focus(value)
    except InvalidInput as e:
        raise click.BadParameter(str(e)) from None


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
