"""The built wheel carries what the installed commands need: the migrations, the bundled engines, and the
OpenClaw and Hermes plugins (`hermes install` and `openclaw install-line` from a wheel, not only from a
checkout: a plain `pip install` of the project left them out, and both commands failed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "transcript_store", "engines", "integrations")


def build_wheel(tmp_path: Path) -> Path:
    """The project's wheel, built from a copy of its sources with this environment's setuptools."""
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "node_modules", "*.egg-info")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=skip)
        else:
            shutil.copy2(path, src / name)
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (wheel,) = out.glob("transcript_store-*.whl")
    return wheel


def test_the_wheel_carries_the_plugins_and_installed_code_finds_them(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "transcript_store/integrations/hermes/plugin/plugin.yaml",
        "transcript_store/integrations/hermes/plugin/__init__.py",
        "transcript_store/integrations/openclaw/openclaw.plugin.json",
        "transcript_store/integrations/openclaw/package.json",
        "transcript_store/integrations/openclaw/index.js",
        "transcript_store/integrations/openclaw/src/engine.js",
        "transcript_store/migrations/env.py",
        "engines/lossless/plugin.yaml",
    ):
        assert required in names, f"{required} is not in {wheel.name}"
    # Unpacked as pip installs it: the code finds its own copies, not the checkout's.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "from transcript_store import hermes, openclaw; "
        "print(hermes.TEMPLATE_DIR); print(openclaw.find_plugin())"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""},
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout.split()
    assert [Path(p) for p in found] == [
        site / "transcript_store" / "integrations" / "hermes" / "plugin",
        site / "transcript_store" / "integrations" / "openclaw",
    ]
