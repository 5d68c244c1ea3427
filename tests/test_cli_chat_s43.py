"""``chat`` as a demanding user runs it (session 43): a conversation ended by SIGTERM (``timeout``, ``kill``,
a service manager stopping its job) while a turn waits for the model."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from fake_openai import FakeOpenAI
from hosting import terminate_when
from test_cli import CLI, SCOPE, _script_mode  # noqa: F401 (_script_mode: autouse)

from transcript_store import StoreConfig, TranscriptStore
from transcript_store.turns import Turns


def test_a_chat_ended_by_sigterm_mid_turn_discards_its_turn_as_ctrl_c_does(store_url: str, tmp_path: Path) -> None:
    """SIGTERM while a turn waits for the model: the turn is discarded, as Ctrl-C discards it, and the
    process still ends by that SIGTERM. Python's default SIGTERM ended chat where it stood: its admitted
    intent stayed in the outbox (`outbox status` showed it; the session's next admission discarded it with a
    warning) and the runtime was never disposed of."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        store.create_session(SCOPE, session_id="s1", session_key="cli:slow")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    with FakeOpenAI(delay=60.0) as server:
        proc = subprocess.Popen([*CLI, "chat", "--session", "cli:slow", "--model-url", server.base_url,
                                 "--db", store_url], cwd=tmp_path, stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        try:
            assert proc.stdin is not None
            proc.stdin.write(b"a question the model is slow to answer\n")
            proc.stdin.flush()
            # the turn is admitted and waits for the model
            terminate_when(proc, lambda: bool(server.chat_requests), "its turn reached the model", 0.01)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stderr is not None
            stderr = proc.stderr.read().decode()
            proc.stderr.close()
            if proc.stdin is not None:
                proc.stdin.close()
    assert proc.returncode == -signal.SIGTERM, stderr  # ended by the signal, as before (143 in a shell)
    assert "Traceback" not in stderr
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        assert Turns(store).intents(SCOPE) == []  # nothing left admitted for a later run to clean up
        assert [e.message["role"] for e in store.read_visible(SCOPE, "s1") if e.message] == ["user"]
