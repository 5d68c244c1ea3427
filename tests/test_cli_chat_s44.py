"""``chat`` as a demanding user runs it (session 44): a conversation whose terminal went away (SIGHUP: the
window closed, the SSH connection dropped) while a turn waits for the model."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from fake_openai import FakeOpenAI
from test_cli import CLI, SCOPE, _script_mode  # noqa: F401 (_script_mode: autouse)

from transcript_store import StoreConfig, TranscriptStore
from transcript_store.turns import Turns


def _chat(store_url: str, tmp_path: Path, base_url: str, ignore_hup: bool = False) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}

    def hup() -> None:  # as a terminal's process has it, or as nohup leaves it
        signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore_hup else signal.SIG_DFL)

    return subprocess.Popen([*CLI, "chat", "--session", "cli:slow", "--model-url", base_url, "--db", store_url],
                            cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env, preexec_fn=hup)


def _hang_up_mid_turn(proc: subprocess.Popen[bytes], server: FakeOpenAI) -> tuple[int, str]:
    """Send one message, SIGHUP chat once its turn waits for the model, close its input; its exit status
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
        proc.send_signal(signal.SIGHUP)
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


def test_a_chat_whose_terminal_hangs_up_mid_turn_discards_its_turn(store_url: str, tmp_path: Path) -> None:
    """SIGHUP while a turn waits for the model: the turn is discarded, as Ctrl-C and SIGTERM discard it, and
    the process still ends by that SIGHUP. Python's default SIGHUP ended chat where it stood: its admitted
    intent stayed in the outbox (the session's next admission discarded it with a warning)."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        store.create_session(SCOPE, session_id="s1", session_key="cli:slow")
    with FakeOpenAI(delay=60.0) as server:
        code, stderr = _hang_up_mid_turn(_chat(store_url, tmp_path, server.base_url), server)
    assert code == -signal.SIGHUP, stderr  # ended by the signal, as before (129 in a shell)
    assert "Traceback" not in stderr
    assert _roles(store_url) == ["user"]


def test_a_chat_under_nohup_goes_on_after_a_hangup(store_url: str, tmp_path: Path) -> None:
    """A chat started with SIGHUP ignored (``nohup``) keeps ignoring it: the turn is answered."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        store.create_session(SCOPE, session_id="s1", session_key="cli:slow")
    with FakeOpenAI(delay=1.0) as server:
        code, stderr = _hang_up_mid_turn(_chat(store_url, tmp_path, server.base_url, ignore_hup=True), server)
    assert code == 0, stderr
    assert _roles(store_url) == ["user", "assistant"]
