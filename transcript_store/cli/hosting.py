"""The host runtime and the engines as commands load them: engines' output on stderr, reports, warnings."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import TYPE_CHECKING, Any

import click

from ..engine import EngineContext
from ..errors import SchemaNotCurrent, StoreUnavailable
from ..settings import HostSettings
from ..store import TranscriptStore
from ..terminal import ShownStream, shown
from .stores import cli_advice, open_store

if TYPE_CHECKING:  # imported where they are used: the CLI's start stays light (rich: by a command drawing a table)
    from rich.table import Table

    from ..host import HostRuntime
    from ..registry import EngineRegistry


def refuse_bad_legacy_config(settings: HostSettings) -> None:
    """InvalidInput (exit 1) for a bad ``[engine.config.legacy]``, which stops every host as it is built
    (the fallback engine's, never quarantined): checked by the host's own check before a command that builds
    one opens, creates or migrates a store, so such a mistake leaves no new store behind."""
    from ..compaction import check_legacy_config
    from ..host import LEGACY

    check_legacy_config(settings.engine_config.get(LEGACY, {}))


def _runtime(store: TranscriptStore, settings: HostSettings, model: Any = None) -> Any:
    from ..host import HostRuntime
    from ..model import LocalResponder

    return HostRuntime(store=store, settings=settings, model=model if model is not None else LocalResponder())


@contextmanager
def engine_output_on_stderr() -> Iterator[None]:
    """Engines loaded in this process (their imports, factories, dispose) write to stderr, shown: stdout
    holds the command's own output only (one JSON document under --json), and an engine's ``print`` is
    escaped as under ``serve``."""
    shown_err = sys.stderr if isinstance(sys.stderr, ShownStream) else ShownStream(sys.stderr)
    with redirect_stdout(shown_err), redirect_stderr(shown_err):
        yield


def engine_report(settings: HostSettings, store: TranscriptStore | None
                  ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Every discovered engine, loaded and validated, with its declarations; the registry's warnings; and
    among them, those about a ``plugin_dirs`` folder that cannot be searched (``doctor``'s problems)."""
    with engine_output_on_stderr():
        return _engine_report(settings, store)


def engine_context(settings: HostSettings, store: TranscriptStore | None, engine_id: str) -> EngineContext:
    """The context an engine is checked with: its config table, the store, the summarizer and estimator."""
    from ..summarize import summarizer_from_env
    from ..tokens import default_estimator

    return EngineContext(store=store, config=settings.engine_config.get(engine_id, {}),
                         summarizer=summarizer_from_env(), estimator=default_estimator())


def _engine_report(settings: HostSettings, store: TranscriptStore | None
                   ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    from ..models import CURRENT_TURN_FENCE, TURN_ADVANCEMENT_IDEMPOTENCY
    from ..registry import EngineRegistry

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
    return out, [*registry.warnings, *unread], list(registry.plugin_dir_problems)


def unusable_engines(settings: HostSettings, store: TranscriptStore | None, runtime: HostRuntime | None = None
                     ) -> list[str]:
    """A warning for each ``plugin_dirs`` folder that cannot be searched, and for each engine that cannot load
    among the selected one and those with an ``[engine.config.<id>]`` table (a mistyped value in it, say): hosts
    run such an engine's turns on legacy, which said nothing before a turn ran (and ``engines list`` exited 0 on
    it).

    Given the ``runtime`` that will run them, the engines are checked in it and those that load are kept for
    their first use: a plugin was imported, and its factory run, once for the check and again for the runtime
    (its output said twice; the factory's time paid twice)."""
    return [text for _engine_id, text in _unusable(settings, store, runtime)]


def _unusable(settings: HostSettings, store: TranscriptStore | None, runtime: HostRuntime | None
              ) -> list[tuple[str | None, str]]:
    """``unusable_engines``' warnings, each with the engine it is about (None: a plugin folder)."""
    from ..registry import EngineRegistry

    out: list[tuple[str | None, str]] = []
    with engine_output_on_stderr():  # an engine's import and factory print there, as in engine_report
        registry = runtime.registry if runtime is not None and runtime.registry is not None \
            else EngineRegistry(settings.plugin_dirs)
        # A plugin folder that is missing (a typo in TRANSCRIPT_STORE_PLUGIN_DIRS or plugin_dirs), no folder or
        # unreadable: its engines are missing too, which said nothing before a turn asked for one of them.
        out.extend((None, shown(f"{p}; no engine is loaded from it (see `transcript-store doctor`)", one_line=True))
                   for p in registry.plugin_dir_problems)
        for engine_id in sorted({settings.engine, *settings.engine_config} & set(registry.specs)):
            if runtime is not None:
                status = runtime.preload(engine_id)
            else:
                status = registry.check(engine_id, engine_context(settings, store, engine_id))
            if not status.valid:
                out.append((engine_id, unusable_warning(engine_id, status.reason, engine_id == settings.engine)))
        if settings.engine not in registry.specs:  # a slot naming no installed engine (a typo): as unusable
            out.append((settings.engine, unusable_warning(settings.engine, unknown_engine_reason(registry), True)))
    return out


def unknown_engine_reason(registry: EngineRegistry) -> str:
    """Why an engine id no plugin registered cannot load, naming the ones that are."""
    return f"unknown context engine; known: {', '.join(sorted(registry.specs))}"


def unusable_warning(engine_id: str, reason: str | None, selected: bool) -> str:
    """The warning line's text for an engine that cannot load, naming its reason (the key of a mistyped value)."""
    from ..host import LEGACY

    what = "the selected context engine" if selected else "context engine"
    then = ("its turns run on the legacy engine until it is fixed" if engine_id != LEGACY
            else "turns fail until it is fixed")
    return shown(f"{what} {engine_id!r} cannot load: {reason}; {then} (see `transcript-store doctor`)",
                 one_line=True)


def warn_unusable_engines(settings: HostSettings, store: TranscriptStore | None,
                          runtime: HostRuntime | None = None) -> list[str]:
    """Write ``unusable_engines``' warnings to stderr, one line each; the ids of the engines warned about."""
    warned = []
    for engine_id, w in _unusable(settings, store, runtime):
        click.echo(f"warning: {w}", err=True)
        if engine_id is not None:
            warned.append(engine_id)
    return warned


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
        return None, cli_advice(str(e))
