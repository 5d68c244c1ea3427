"""The CLI's signals as a demanding user sends them (session 44): Ctrl-C while a command still starts, and
while chat runs a turn; a hangup (SIGHUP: the terminal closed, the SSH connection dropped) while an export
writes its file or a gateway runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI
from test_cli import CLI, SCOPE
from test_cli_chat_s44 import _chat, _roles
from test_cli_transfer_s43 import _big_session
from test_gateway_review import SLOW, _busy_worker, _ended, _plugin, _stop

from transcript_store import StoreConfig, TranscriptStore


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


def test_ctrl_c_mid_turn_ends_chat_with_exit_130(store_url: str, tmp_path: Path) -> None:
    """Ctrl-C while a turn waits for the model: the turn is discarded, then one line and exit 130, as every
    command a Ctrl-C ends (it was click's "error: aborted", exit 1: "the operation failed")."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        store.create_session(SCOPE, session_id="s1", session_key="cli:slow")
    with FakeOpenAI(delay=60.0) as server:
        proc = _chat(store_url, tmp_path, server.base_url)
        try:
            assert proc.stdin is not None
            proc.stdin.write(b"a question the model is slow to answer\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 120
            while not server.chat_requests:  # the turn is admitted and waits for the model
                assert proc.poll() is None and time.monotonic() < deadline, "its turn never reached the model"
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert (proc.returncode, [line for line in err.decode().splitlines() if line.strip()]) == (
        130, ["error: interrupted"]), err
    assert _roles(store_url) == ["user"]


def test_the_package_imports_its_public_names_when_asked_for_them() -> None:
    """The package imports no module of its own until a name is asked for (the console script's start-up
    is then that of the standard library), and every public name is there when it is."""
    probe = ("import sys, transcript_store as ts; assert 'transcript_store.store' not in sys.modules; "
             "from transcript_store import *; assert ts.TranscriptStore.__module__ == 'transcript_store.store'; "
             "missing = [n for n in ts.__all__ if n not in globals()]; assert not missing, missing; "
             "assert set(dir(ts)) >= set(ts.__all__)")
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)


def _hup(ignored: bool) -> None:
    """In the child before exec: SIGHUP as a terminal's process has it, or as ``nohup`` leaves it."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL)


@pytest.mark.parametrize("nohup", [False, True], ids=["hangup", "nohup"])
def test_an_export_whose_terminal_hangs_up_leaves_no_part_file(store_url: str, tmp_path: Path, nohup: bool) -> None:
    """SIGHUP while ``export -o`` writes: Python's default SIGHUP ended it where it stood, its hidden part file
    left beside the export (SIGTERM already removed it). Now the part is removed and the process still ends
    by the SIGHUP; an export started under ``nohup`` goes on and writes its file whole."""
    _big_session(store_url)
    folder = tmp_path / "exports"
    folder.mkdir()
    path = folder / "s1.jsonl"
    path.write_bytes(b"an earlier export\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    proc = subprocess.Popen([*CLI, "sessions", "export", "s1", "-o", str(path), "--db", store_url], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, preexec_fn=lambda: _hup(nohup))
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.endswith(".tmp") for p in folder.iterdir()):  # it writes its file
            assert proc.poll() is None and time.monotonic() < deadline, "its file was never seen being written"
            time.sleep(0.001)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["s1.jsonl"]
    if nohup:
        assert proc.returncode == 0, err
        assert len(path.read_bytes().splitlines()) == 4001  # the header and every entry
    else:
        assert proc.returncode == -signal.SIGHUP, err  # ended by the signal, as before (129 in a shell)
        assert path.read_bytes() == b"an earlier export\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("backend", ["sqlite"])  # the dispatcher's signal handling: no store in it (CI time)
def test_a_gateway_whose_terminal_hangs_up_stops_its_run_and_gives_the_cursor_back(
    store_url: str, tmp_path: Path
) -> None:
    """SIGHUP mid-run: Python's default ended the dispatcher where it stood, its progress display never
    closed (the cursor left hidden), its workers not stopped by it (on Linux the kernel kills them; elsewhere
    they went on). It ends the run as SIGTERM does, then the process as the SIGHUP would."""
    import pty

    config = _plugin(tmp_path, "slow", SLOW)
    env = {**os.environ, "COLUMNS": "200", "TERM": "xterm"}
    env.pop("TRANSCRIPT_STORE_CONFIG", None)
    args = ["--config", config, "--db", store_url, "gateway", "--engine", "slow"]
    args += ["--workers", "1", "--sessions", "1", "--turns", "1", "--no-faults"]
    master, slave = pty.openpty()
    err = tmp_path / "err.txt"
    with err.open("w") as err_file:
        proc = subprocess.Popen([*CLI, *args], cwd=tmp_path, env=env, stdout=slave, stderr=err_file,
                                start_new_session=True, preexec_fn=lambda: _hup(False))
    os.close(slave)
    shown = bytearray()

    def read_terminal() -> None:
        with suppress(OSError):  # EIO once every writer of the terminal is gone
            while chunk := os.read(master, 65536):
                shown.extend(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    worker = None
    try:
        worker = _busy_worker(tmp_path, proc, err)
        os.kill(proc.pid, signal.SIGHUP)
        proc.wait(timeout=30)
        reader.join(timeout=10)
        assert proc.returncode == -signal.SIGHUP, (proc.returncode, err.read_text())
        assert shown.rfind(b"\x1b[?25h") > shown.rfind(b"\x1b[?25l"), bytes(shown[-200:])
        assert "Traceback" not in err.read_text(), err.read_text()
        assert _ended(worker)
    finally:
        _stop(proc, worker)
        os.close(master)
