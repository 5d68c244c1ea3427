"""``chat`` ended by a signal while a turn waits for the model (sessions 43 and 44): SIGTERM (``timeout``,
``kill``, a service manager stopping its job), SIGHUP (the window closed, the SSH connection dropped) and
Ctrl-C. Each discards the turn; the signals then end the process as they would, Ctrl-C with exit 130."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI
from test_cli import CLI, SCOPE, _script_mode  # noqa: F401 (_script_mode: autouse)

from transcript_store import StoreConfig, TranscriptStore
from transcript_store.turns import Turns


def _chat(store_url: str, tmp_path: Path, base_url: str, signum: int, ignored: bool = False) -> subprocess.Popen[bytes]:
    """``chat`` on session key cli:slow, ``signum`` as a terminal's process has it (or ignored, as ``nohup``
    leaves SIGHUP)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        store.create_session(SCOPE, session_id="s1", session_key="cli:slow")
    handling = signal.SIG_IGN if ignored else signal.SIG_DFL
    return subprocess.Popen([*CLI, "chat", "--session", "cli:slow", "--model-url", base_url, "--db", store_url],
                            cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env, preexec_fn=lambda: signal.signal(signum, handling))


def _signal_mid_turn(proc: subprocess.Popen[bytes], server: FakeOpenAI, signum: int) -> tuple[int, str]:
    """Send one message, signal chat once its turn waits for the model, close its input; its exit status
    and stderr."""
    try:
        assert proc.stdin is not None
        proc.stdin.write(b"a question the model is slow to answer\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 120
        while not server.chat_requests:  # the turn is admitted and waits for the model
            assert proc.poll() is None, "chat ended before its turn reached the model"
            assert time.monotonic() < deadline, "its turn never reached the model"
            time.sleep(0.01)
        proc.send_signal(signum)
        proc.stdin.close()  # no more input: a chat that goes on ends after its turn
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        stderr = proc.stderr.read().decode()
        proc.stderr.close()
    return proc.returncode, stderr


def _roles(store_url: str) -> list[str]:
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        assert Turns(store).intents(SCOPE) == []  # nothing left admitted for a later run to clean up
        return [e.message["role"] for e in store.read_visible(SCOPE, "s1") if e.message]


@pytest.mark.parametrize(
    ("signum", "status"),
    [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGHUP, -signal.SIGHUP), (signal.SIGINT, 130)],
    ids=["sigterm", "sighup", "ctrl-c"],
)
def test_a_chat_signalled_mid_turn_discards_its_turn(store_url: str, tmp_path: Path, signum: int, status: int) -> None:
    """A signal while a turn waits for the model: the turn is discarded, and the process ends by that signal
    (143 or 129 in a shell), or for Ctrl-C with one line and exit 130 (it was click's "error: aborted", exit
    1: "the operation failed"). Python's default SIGTERM and SIGHUP ended chat where it stood: its admitted
    intent stayed in the outbox (`outbox status` showed it; the session's next admission discarded it with
    a warning) and the runtime was never disposed of."""
    with FakeOpenAI(delay=60.0) as server:
        code, stderr = _signal_mid_turn(_chat(store_url, tmp_path, server.base_url, signum), server, signum)
    assert code == status, stderr
    assert "Traceback" not in stderr
    if signum == signal.SIGINT:
        assert [line for line in stderr.splitlines() if line.strip()] == ["error: interrupted"], stderr
    assert _roles(store_url) == ["user"]


def test_a_chat_under_nohup_goes_on_after_a_hangup(store_url: str, tmp_path: Path) -> None:
    """A chat started with SIGHUP ignored (``nohup``) keeps ignoring it: the turn is answered."""
    with FakeOpenAI(delay=1.0) as server:
        proc = _chat(store_url, tmp_path, server.base_url, signal.SIGHUP, ignored=True)
        code, stderr = _signal_mid_turn(proc, server, signal.SIGHUP)
    assert code == 0, stderr
    assert _roles(store_url) == ["user", "assistant"]
