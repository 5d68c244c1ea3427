"""What an OpenClaw operator runs to use the bundled context-engine plugin with `transcript-store serve`."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from . import bundled
from .errors import InvalidInput

PLUGIN_ID = "transcript-store"
TOKEN_ENV = "TRANSCRIPT_STORE_TOKEN"
BUNDLED_PLUGIN = bundled.integration("openclaw")


def find_plugin(path: str | None = None) -> Path:
    """The plugin folder: ``path``, else the bundled one; InvalidInput when it has no manifest."""
    folder = Path(path).expanduser().resolve() if path else BUNDLED_PLUGIN
    if not (folder / "openclaw.plugin.json").is_file():
        hint = "" if path else " (this installation lacks the bundled plugin: pass --plugin-dir)"
        raise InvalidInput(f"no OpenClaw plugin at {folder}{hint}")
    return folder


def plugin_config(service_url: str, engine: str = "lossless") -> dict[str, Any]:
    """The openclaw.json fragment that selects the plugin's engine and points it at the service."""
    return {
        "plugins": {
            "slots": {"contextEngine": PLUGIN_ID},
            "entries": {PLUGIN_ID: {"enabled": True, "config": {"serviceUrl": service_url, "engine": engine}}},
        }
    }


def install_instructions(
    service_url: str, *, engine: str = "lossless", plugin_dir: str | None = None
) -> dict[str, Any]:
    """The install command, the config fragment and the token variable, as data and as text."""
    parts = urlsplit(service_url)
    if "@" in parts.netloc:
        # The plugin refuses such a URL when OpenClaw builds the engine; printed here, the password would
        # land in a terminal and in openclaw.json. The token goes in its own variable (step 3).
        raise InvalidInput("--service-url must not contain credentials (user:password@); the value is not shown")
    if parts.query or parts.fragment:
        # The plugin appends the API's paths to the URL: after a query or a fragment they never reach it.
        raise InvalidInput("--service-url must not have a query (?...) or a fragment (#...); the value is not shown")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidInput(f"--service-url must be an http(s) URL, got {service_url!r}")
    folder = find_plugin(plugin_dir)
    command = ["openclaw", "plugins", "install", "-l", str(folder), "--force", "--accept-capabilities"]
    config = plugin_config(service_url.rstrip("/"), engine)
    line = shlex.join(command)
    text = "\n".join(
        [
            "# 1. link the plugin (selects it as the context engine):",
            line,
            "# 2. merge into openclaw.json:",
            json.dumps(config, indent=2),
            "# 3. give the OpenClaw process a token of the service (it decides the scope):",
            f"export {TOKEN_ENV}=<token>",
        ]
    )
    return {"command": command, "line": line, "config": config, "token_env": TOKEN_ENV, "text": text}

