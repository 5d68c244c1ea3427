"""The CLI's signals as a demanding user sends them (session 44): Ctrl-C while a command still starts, and
while chat runs a turn; a hangup (SIGHUP: the terminal closed, the SSH connection dropped) while an export
writes its file or a gateway runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import CLI


def _default_sigint() -> None:
    """In the child before exec: SIGINT as a terminal's foreground process has it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("command", [CLI, [sys.executable, "-m", "transcript_store"]], ids=["script", "module"])
def test_ctrl_c_while_a_command_starts_is_one_line_and_exit_130(tmp_path: Path, command: list[str]) -> None:
    """A real SIGINT while the command's modules are still imported (before ``main`` runs): Python's
    KeyboardInterrupt traceback, a screenful of import machinery. Now one line, exit 130."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    env["PYTHONPROFILEIMPORTTIME"] = "1"  # each import is a stderr line as it ends: where the start-up is
    proc = subprocess.Popen([*command, "sessions", "list", "--db", f"sqlite:///{tmp_path / 'none.db'}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # sqlalchemy imported: the store's modules, the CLI's, still to come
            if line.rpartition("|")[2].strip() == "sqlalchemy":
                break
        else:
            pytest.fail("sqlalchemy was never imported")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = [line for line in err.splitlines() if line.strip() and not line.startswith("import time:")]
    assert (proc.returncode, said, out) == (130, ["error: interrupted"], ""), err


def test_the_package_imports_its_public_names_when_asked_for_them() -> None:
    """The package imports no module of its own until a name is asked for (the console script's start-up
    is then that of the standard library), and every public name is there when it is."""
    probe = ("import sys, transcript_store as ts; assert 'transcript_store.store' not in sys.modules; "
             "from transcript_store import *; assert ts.TranscriptStore.__module__ == 'transcript_store.store'; "
             "missing = [n for n in ts.__all__ if n not in globals()]; assert not missing, missing; "
             "assert set(dir(ts)) >= set(ts.__all__)")
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)
