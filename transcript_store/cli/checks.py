"""``engines list`` and ``doctor``: what is installed and whether it works."""

from __future__ import annotations

import socket
from typing import Any

import click

from .. import migrate
from ..db import mask_url
from ..errors import PermissionDenied, SchemaNotCurrent, StoreUnavailable
from ..settings import HostSettings
from ..store import TranscriptStore
from ..terminal import shown
from .group import cli, exit_code
from .hosting import _engines_table, _optional_store, engine_report, unusable_warning
from .options import EXIT_FAILED, CommandError, common, state
from .output import console, emit_json
from .stores import open_store, run_advice, schema_advice, schema_state


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
        data, warnings, _dirs = engine_report(settings, store)  # (among the warnings: listed all the same)
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
        problems.append(f"no schema yet (head is {head}): {run_advice('init')}")
    elif info["state"] != "current":  # with what to do, as `current` says it
        problems.append(f"schema is {info['state']} (revision {revision}, head {head}): {schema_advice(info['state'])}")
    return info, store, None


@cli.command()
@common
def doctor() -> None:
    """Check the store, the schema, the engines and quarantines; exit 1 when a check fails."""
    from .. import quarantine

    st = state()
    settings = st.settings()
    problems: list[str] = []
    store_info, store, refusal = _doctor_store(problems)
    records: list[dict[str, Any]] = []
    try:
        engines_found, warnings, dir_problems = engine_report(
            settings, store if store_info.get("state") == "current" else None
        )
        if store is not None and store_info.get("state") == "current":
            records = [
                {**r.__dict__, "created_at": r.created_at.isoformat()}
                for r in store.read(
                    lambda c: quarantine.records(c, max_age_seconds=settings.quarantine_record_seconds)
                )
            ]
    finally:
        if store is not None:
            store.close()
    selected = next(e for e in engines_found if e["selected"])
    if not selected["valid"]:
        problems.append(f"selected engine {selected['id']!r} is invalid: {selected['reason']}")
    # An engine given an [engine.config.<id>] table that it refuses (a mistyped key or value) is one that
    # `engines list`, chat, gateway and serve warn of ("see `transcript-store doctor`"): `chat --engine` runs its
    # turns on legacy, a bad legacy table stops chat and serve. Checked for the selected engine only, doctor
    # answered "ok" (exit 0) about it when another engine was selected.
    problems.extend(
        f"context engine {e['id']!r} (configured in [engine.config.{e['id']}]) cannot load: {e['reason']}"
        for e in engines_found
        if not e["valid"] and not e["selected"] and e.get("source") is not None and e["id"] in settings.engine_config
    )
    # A plugin folder that cannot be searched (missing, no folder, unreadable) is a problem, not a warning: the
    # engines it should hold are missing wherever engines run (chat, serve and gateway warn of it at start).
    problems.extend(dir_problems)
    warnings = [w for w in warnings if w not in dir_problems]
    # The backend's own warning (db.pooler_warning: prepared statements off, the per-connection SET on) among
    # the others, said once as a `warning:` line rather than as one more setting.
    backend_warning = (store_info.get("settings") or {}).pop("warning", None)
    if backend_warning is not None:
        warnings.append(backend_warning)
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

        # A record of another host: its process cannot be checked here, so it is neither live nor dead here
        # (shown while younger than [turn] quarantine_record_seconds), and said so.
        table = Table(title=f"quarantined engines (live processes here; other hosts' of the last "
                            f"{_span(settings.quarantine_record_seconds)})",
                      title_justify="left")
        for name in ("engine", "process", "where", "operation", "reason", "since"):
            table.add_column(name, overflow="fold")
        for r in data["quarantine"]:
            if not r["elsewhere"]:
                where = "alive here"
            elif r["host"] == socket.gethostname():  # a container given this host name, or an earlier boot
                where = f"another pid namespace or boot of this host ({r['host']}): not checked"
            else:
                where = f"another host ({r['host']}): not checked"
            # An engine's error text: read, not obeyed (as outbox status shows it).
            table.add_row(r["engine_id"], Text(shown(r["process"])), Text(shown(where)), r["operation"],
                          Text(shown(r["reason"])), r["created_at"])
        out.print(table)
    else:
        click.echo("quarantine: none")
    for w in data["warnings"]:
        click.echo(f"warning: {shown(w)}")
    for p in data["problems"]:
        click.echo(f"problem: {shown(p)}")
    click.echo("ok" if data["ok"] else "NOT OK")


def _span(seconds: float) -> str:
    """A span of time as a person reads it: "7 days", "36 hours", "90 minutes" (never "0.0416667 days")."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= 2 * size or seconds == size:
            count = round(seconds / size, 1)
            return f"{count:g} {unit}" + ("" if count == 1 else "s")
    return f"{seconds:g} seconds"
