"""A review of the CLI's exactness: --version and --help with no stdout."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_cli import CLI, run


def _no_stdout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The real console script with its stdout closed (``>&-``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    return subprocess.run([*CLI, *args], cwd=cwd, stderr=subprocess.PIPE, text=True, env=env, timeout=120,
                          preexec_fn=lambda: os.close(1))


@pytest.mark.parametrize("args", [("--version",), ("--help",), ("-h",), ("sessions", "--help"),
                                  ("sessions", "show", "--help"), ("compact", "-h"), ("serve", "--help")])
def test_version_and_help_with_stdout_closed_exit_1(args: tuple[str, ...], tmp_path: Path) -> None:
    """``--version >&-`` exited 0 with nothing said: click.echo drops its text when there is no stdout.
    Like every command's output (but serve's courtesy line), it is one error line, exit 1."""
    result = _no_stdout(*args, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == "error: cannot write to stdout: it is closed"


def test_version_and_help_still_print(tmp_path: Path) -> None:
    version = run("--version", cwd=tmp_path)
    assert version.stdout.startswith("transcript-store, version ") and version.stdout.count("\n") == 1
    assert "Usage: transcript-store sessions show" in run("sessions", "show", "-h", cwd=tmp_path).stdout
    assert "--version" in run("--help", cwd=tmp_path).stdout
