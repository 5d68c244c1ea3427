"""``transcript-store hermes install``: the plugin's folder, settings.json and config.yaml."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import bundled

PLUGIN_NAME = "transcript-store"
PLUGIN_DIR = "transcript_store_hermes"
TEMPLATE_DIR = bundled.integration("hermes", "plugin")
MIN_CONTEXT_LENGTH = 64000


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600, an existing file's mode too): the
    plugin's settings hold the database URL, password included, and the engine's configuration."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def settings_json(settings: Mapping[str, Any]) -> str:
    """The text of the plugin's settings.json; InvalidInput naming the first value JSON cannot hold."""
    try:
        return json.dumps(settings, indent=2) + "\n"
    except (TypeError, ValueError):
        pass
    # A TOML settings file holds dates and times, which JSON does not: said before anything is written
    # (a plugin whose settings.json is missing runs on the default engine and database inside Hermes).
    from ..errors import InvalidInput

    for name, value in settings.items():
        inner = value.items() if isinstance(value, Mapping) else [(None, value)]
        for key, item in inner:
            try:
                json.dumps(item)
            except (TypeError, ValueError):
                where = name if key is None else f"{name}.{key}"
                what = type(item).__name__
                raise InvalidInput(f"{where}: a {what} value, which settings.json (JSON) cannot hold") from None
    raise InvalidInput("the settings cannot be written as JSON")


def config_snippet(engine: str = "lossless", context_length: int = 128000) -> dict[str, Any]:
    """The config.yaml keys that enable the plugin and select the engine."""
    return {
        "plugins": {"enabled": [PLUGIN_NAME]},
        "context": {"engine": engine},
        "model": {"context_length": max(MIN_CONTEXT_LENGTH, context_length)},
    }


def install_plugin(home: str | Path, *, engine: str = "lossless", db_url: str | None = None,
                   merge_config: bool = False, threshold: float | None = None,
                   scope: str | None = None, plugin_dirs: Sequence[str] = (),
                   engine_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write the plugin into ``home``/plugins/<dir>/ (and optionally merge config.yaml); what was done.

    ``engine_config``: the engine's settings (``[engine.config.<engine>]`` of transcript-store's own
    settings file), carried into settings.json so that the engine runs with them inside Hermes too."""
    import yaml

    home = Path(home).expanduser()
    if not (TEMPLATE_DIR / "plugin.yaml").is_file():
        from ..errors import InvalidInput

        raise InvalidInput(f"no Hermes plugin template at {TEMPLATE_DIR} (this installation lacks the bundled plugin)")
    target = home / "plugins" / PLUGIN_DIR
    manifest = (TEMPLATE_DIR / "plugin.yaml").read_text(encoding="utf-8")
    init = (TEMPLATE_DIR / "__init__.py").read_text(encoding="utf-8")
    if db_url is None:
        db_url = f"sqlite:///{home.resolve() / 'transcript-store.db'}"
    settings: dict[str, Any] = {"engine": engine, "db_url": db_url}
    if scope is not None:
        settings["scope"] = scope
    if threshold is not None:
        settings["threshold_percent"] = threshold
    if plugin_dirs:  # absolute: Hermes may start anywhere
        settings["plugin_dirs"] = [str(Path(d).expanduser().resolve()) for d in plugin_dirs]
    if engine_config:
        settings["engine_config"] = dict(engine_config)
    text = settings_json(settings)  # refused before the plugin's folder and files are written
    target.mkdir(parents=True, exist_ok=True)
    (target / "plugin.yaml").write_text(manifest, encoding="utf-8")
    (target / "__init__.py").write_text(init, encoding="utf-8")
    _write_private(target / "settings.json", text)
    snippet = config_snippet(engine)
    config_path = home / "config.yaml"
    if merge_config:
        loaded = yaml.safe_load(config_path.read_text(encoding="utf-8")) if config_path.exists() else None
        data: dict[str, Any] = loaded if isinstance(loaded, dict) else {}
        plugins: dict[str, Any] = data["plugins"] if isinstance(data.get("plugins"), dict) else {}
        enabled: list[Any] = plugins["enabled"] if isinstance(plugins.get("enabled"), list) else []
        if PLUGIN_NAME not in enabled:
            enabled.append(PLUGIN_NAME)
        plugins["enabled"] = enabled
        data["plugins"] = plugins
        context: dict[str, Any] = data["context"] if isinstance(data.get("context"), dict) else {}
        context["engine"] = engine
        data["context"] = context
        given_model = data.get("model")
        if isinstance(given_model, str) and given_model.strip():
            # Hermes' short form, the model's name alone, which it reads as ``{"default": name}``: replaced by
            # the context length alone, the model chosen was lost and Hermes ran on its default one.
            given_model = {"default": given_model}
        model: dict[str, Any] = given_model if isinstance(given_model, dict) else {}
        # A context length already set is kept (raised to Hermes' minimum); none yet: the snippet's.
        given = int(model.get("context_length") or 0)
        model["context_length"] = max(MIN_CONTEXT_LENGTH, given) if given else snippet["model"]["context_length"]
        data["model"] = model
        config_path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return {"plugin_dir": str(target), "config": snippet, "config_path": str(config_path), "merged": merge_config}
