"""The README's Python examples run as printed, in a fresh process, on both backends: a reader copies
them first, and an API change that breaks one would otherwise only show when a user tries it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
# Every example opens its store on a SQLite file of its own; on PostgreSQL that URL becomes the test's.
SQLITE_URL = re.compile(r'"sqlite:///[\w.-]+\.db"')


def test_the_readme_has_its_examples() -> None:
    """The examples below are the README's (the quickstart, turn commits, an engine in a host), each
    opening a store the one way the substitution below knows."""
    assert len(BLOCKS) >= 3, len(BLOCKS)
    for block in BLOCKS:
        assert len(SQLITE_URL.findall(block)) == 1, block[:200]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_example_runs(index: int, backend: str, store_url: str, tmp_path: Path) -> None:
    """Each example's own asserts hold and it exits 0 (SQLite: the file it names, created by the example
    itself in an empty directory; PostgreSQL: a fresh migrated database)."""
    code = BLOCKS[index]
    if backend != "sqlite":
        code = SQLITE_URL.sub(lambda _m: repr(store_url), code)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


SHELL_BLOCKS = [
    block for block in re.findall(r"^```sh\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
    if not block.lstrip().startswith("make ")  # the Makefile's targets: CI runs `make test` itself
]


def test_the_readme_has_its_command_examples() -> None:
    """The command examples below are the README's (the CLI walk-through, a PostgreSQL deployment, the
    OpenClaw and Hermes install lines), every line a `transcript-store` command."""
    assert len(SHELL_BLOCKS) >= 4, len(SHELL_BLOCKS)
    for block in SHELL_BLOCKS:
        for line in block.splitlines():
            assert line.startswith(("#", "transcript-store ", "echo ")) and (
                line.startswith("#") or "transcript-store " in line), line


@pytest.mark.parametrize("index", range(len(SHELL_BLOCKS)))
def test_a_readme_command_example_runs(index: int, backend: str, store_url: str, tmp_path: Path) -> None:
    """Each command example runs as printed through the installed console script, line by line, every
    line exit 0, in an empty directory (SQLite: the default `transcripts.db` there; PostgreSQL: the
    test's database as `TRANSCRIPT_STORE_URL`, as the deployment example sets it)."""
    if "TRANSCRIPT_STORE_URL=postgresql" in SHELL_BLOCKS[index] and backend == "sqlite":
        pytest.skip("the PostgreSQL deployment example (its eight gateway workers are the walk-through's)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    env["HOME"] = str(tmp_path)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if backend != "sqlite":
        env["TRANSCRIPT_STORE_URL"] = store_url
    script = "set -e -o pipefail\n" + SHELL_BLOCKS[index]
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
