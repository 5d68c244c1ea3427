"""The OpenClaw plugin's files (no OpenClaw needed), and the CLI around it.

The plugin's own node tests are tests/interop/test_openclaw_plugin_units.py, the proof inside the real host
tests/interop/test_openclaw.py (both ``make test-openclaw``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "integrations" / "openclaw"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    run_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "transcript_store", *args], capture_output=True, text=True,
                          env=run_env, timeout=120)


def test_manifest_and_package_declare_a_context_engine() -> None:
    manifest = json.loads((PLUGIN / "openclaw.plugin.json").read_text())
    package = json.loads((PLUGIN / "package.json").read_text())
    assert manifest["id"] == "transcript-store" and manifest["kind"] == "context-engine"
    assert {"serviceUrl", "token"} <= set(manifest["configSchema"]["properties"])
    assert manifest["configSchema"]["additionalProperties"] is False
    assert package["type"] == "module"
    for entry in package["openclaw"]["extensions"]:
        assert (PLUGIN / entry).is_file()
    source = (PLUGIN / "index.js").read_text()
    assert "registerContextEngine(PLUGIN_ID" in source


def test_install_line_prints_the_command_and_the_config() -> None:
    done = cli("openclaw", "install-line", "--service-url", "http://127.0.0.1:8765/")
    assert done.returncode == 0, done.stderr
    assert f"openclaw plugins install -l {PLUGIN} --force --accept-capabilities" in done.stdout
    assert "export TRANSCRIPT_STORE_TOKEN=" in done.stdout
    data = json.loads(cli("openclaw", "install-line", "--service-url", "http://h:1", "--engine", "legacy",
                          "--json").stdout)
    assert data["config"]["plugins"]["slots"]["contextEngine"] == "transcript-store"
    assert data["config"]["plugins"]["entries"]["transcript-store"]["config"] == {
        "serviceUrl": "http://h:1", "engine": "legacy"}
    bad = cli("openclaw", "install-line", "--service-url", "ftp://nope")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")


def test_serve_refuses_to_start_without_tokens(tmp_path: Path) -> None:
    env = {"TRANSCRIPT_STORE_TOKENS": ""}
    done = cli("serve", "--db", f"sqlite:///{tmp_path / 's.db'}", "--port", "0", env=env)
    assert done.returncode == 2 and "no tokens" in done.stderr
    (tmp_path / "tokens").write_text("tok-1 scope-a\ntok-1 scope-b\n")
    done = cli("serve", "--tokens", str(tmp_path / "tokens"), "--port", "0", env=env)
    assert done.returncode == 2 and "exactly one scope" in done.stderr
