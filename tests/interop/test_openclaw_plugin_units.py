"""The OpenClaw plugin's own tests under Node (``node --test test/``; no OpenClaw needed), with the interop
tier (``make test-openclaw``, run by CI beside ``make test``): one test of 50-70 s of Node and
``transcript-store serve`` CPU (its findings run serially against real services with messages of MiBs),
which held a worker of the default tier that long on CI's two cores."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.openclaw

PLUGIN = Path(__file__).resolve().parents[2] / "integrations" / "openclaw"


def test_plugin_unit_tests_pass_under_node() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    if int(re.findall(r"\d+", version)[0]) < 20:
        pytest.skip(f"node {version} is older than 20")
    done = subprocess.run([node, "--test", "test/"], cwd=PLUGIN, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"^# fail 0$", done.stdout, re.M)
