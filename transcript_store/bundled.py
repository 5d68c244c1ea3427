"""Where the bundled OpenClaw and Hermes plugins are: inside the installed package, or in a checkout."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def integration(*parts: str) -> Path:
    """A path under ``integrations/``: the copy a wheel installs inside the package (pyproject.toml maps
    ``transcript_store.integrations`` to the folder), else the checkout's own folder (editable installs)."""
    installed = _HERE.joinpath("integrations", *parts)
    return installed if installed.exists() else _HERE.parent.joinpath("integrations", *parts)
