"""`transcript-store serve` and SIGHUP (session 44), a real ``serve`` process.

uvicorn handles SIGINT and SIGTERM only: a SIGHUP (the terminal closed, the SSH connection dropped) ended
serve where it stood (exit -SIGHUP), its engines not disposed of and its store not closed. It now stops
serve as SIGTERM does; one the process was started ignoring (``nohup``) stays ignored.

SQLite only: the signal's handling comes before the store, and closing the store is seen on SQLite
(the last connection's close checkpoints the write-ahead log and removes it); a PostgreSQL server drops
a killed client's connections as it does a closed one's.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from service_process import ServiceProcess

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no SIGHUP")


def _serving(tmp_path: Path) -> ServiceProcess:
    proc = ServiceProcess(f"sqlite:///{tmp_path / 's.db'}", {"tok": "scope-a"}, tmp_path / "serve.log").start()
    status, _ = proc.call("POST", "/v1/sessions", "tok", {})  # a write: the store's log files exist
    assert status == 200
    assert (tmp_path / "s.db-wal").exists()
    return proc


def test_sighup_stops_serve_as_sigterm_does(tmp_path: Path) -> None:
    """Exit 0, nothing in the log of an error, and the store closed (its write-ahead log checkpointed away)."""
    proc = _serving(tmp_path)
    child = proc.proc
    assert child is not None
    proc.stop(signal.SIGHUP)
    assert child.returncode == 0, (child.returncode, proc.log())
    assert "error" not in proc.log().lower() and "Traceback" not in proc.log(), proc.log()
    assert not (tmp_path / "s.db-wal").exists() and not (tmp_path / "s.db-shm").exists()


def test_sighup_ignored_at_start_stays_ignored(tmp_path: Path) -> None:
    """Started under ``nohup`` (SIGHUP ignored, inherited through exec), serve keeps serving after a SIGHUP;
    SIGTERM then stops it cleanly."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        proc = _serving(tmp_path)
    finally:
        signal.signal(signal.SIGHUP, previous)
    try:
        child = proc.proc
        assert child is not None
        child.send_signal(signal.SIGHUP)
        status, _ = proc.call("POST", "/v1/sessions", "tok", {})
        assert status == 200 and child.poll() is None
    finally:
        proc.stop(signal.SIGTERM)
    assert child.returncode == 0, (child.returncode, proc.log())
