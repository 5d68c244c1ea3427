"""``openclaw install-line`` and ``hermes install``: the host plugins backed by this store."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from ..engine import MAX_TOKENS
from ..errors import InvalidInput
from .group import cli
from .options import EXIT_USAGE, URL_ENV, CommandError, Number, common, common_options, state
from .output import emit_json
from .stores import make_url_or_usage, store_session


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
    from ..openclaw import install_instructions

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
    from ..registry import EngineRegistry

    known = EngineRegistry(state().settings().plugin_dirs).specs
    if engine not in known:
        raise CommandError(f"--engine {engine!r}: no such engine here (installed: {', '.join(sorted(known))})",
                           EXIT_USAGE)


def _check_hermes_engine_config(engine: str, config: dict[str, Any] | None) -> None:
    """Refuse engine settings that the plugin's settings.json cannot carry (a TOML date), before anything is written."""
    from ..hermes import settings_json

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

    from ..hermes import install_plugin

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
