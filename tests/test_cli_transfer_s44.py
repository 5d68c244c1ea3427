"""Export and import as a demanding user runs them (session 44): a copy imported without the source's
session key, a header whose session id is too long for a new session, and Ctrl-C mid-import (real
subprocesses and real SIGINTs for those)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from test_cli import CLI, SCOPE, _script_mode, one_error_line, run, run_json  # noqa: F401 (_script_mode: autouse)

from transcript_store import InvalidInput, StoreConfig, TranscriptStore


def _store(url: str) -> TranscriptStore:
    return TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))


def _export(url: str, tmp_path: Path, key: str | None = "cli:orig") -> Path:
    """Session s1 (with ``key``) of two messages, exported to a file."""
    with _store(url) as store:
        store.create_session(SCOPE, session_id="s1", session_key=key)
        store.append_many(SCOPE, "s1", [{"message": {"role": "user", "content": "q"}},
                                        {"message": {"role": "assistant", "content": "a"}}])
    path = tmp_path / "s1.jsonl"
    run("sessions", "export", "s1", "-o", str(path), "--db", url, cwd=tmp_path)
    return path


# ---------------------------------------------------------------------------------------------- keyless copy


def test_a_copy_imports_without_a_session_key_beside_its_source(store_url: str, tmp_path: Path) -> None:
    """The source still holds its key: the copy was refused (the key is taken), and the only way out offered
    was another key (``--session-key ""`` is a usage error). ``--no-session-key`` imports it with none."""
    path = _export(store_url, tmp_path)
    taken = run("sessions", "import", str(path), "--session-id", "s2", "--db", store_url, cwd=tmp_path, code=1)
    assert "--no-session-key" in one_error_line(taken)
    empty = run("sessions", "import", str(path), "--session-id", "s2", "--session-key", "", "--db", store_url,
                cwd=tmp_path, code=2)
    assert "--no-session-key" in empty.stderr
    info = run_json("sessions", "import", str(path), "--session-id", "s2", "--no-session-key", "--db", store_url,
                    cwd=tmp_path)
    assert info["session_id"] == "s2" and info["session_key"] is None and info["visible_count"] == 2
    with _store(store_url) as store:
        assert store.get_session(SCOPE, "s2").session_key is None
        assert store.get_session(SCOPE, "s1").session_key == "cli:orig"
        assert [e.message for e in store.read_visible(SCOPE, "s2")] == [e.message for e in
                                                                        store.read_visible(SCOPE, "s1")]


def test_no_session_key_with_a_session_key_is_a_usage_error(store_url: str, tmp_path: Path) -> None:
    """Both options at once say two things: refused before the file is read, nothing written."""
    path = _export(store_url, tmp_path)
    both = run("sessions", "import", str(path), "--session-id", "s2", "--session-key", "k", "--no-session-key",
               "--db", store_url, cwd=tmp_path, code=2)
    assert "--session-key and --no-session-key cannot be given together" in both.stderr
    with _store(store_url) as store:
        assert [s.session_id for s in store.list_sessions(SCOPE)] == ["s1"]


def test_the_library_imports_a_copy_keyless(store_url: str, tmp_path: Path) -> None:
    """``import_session(..., keyless=True)`` drops the header's key; with a session_key too it is refused."""
    _export(store_url, tmp_path)
    with _store(store_url) as store:
        header, entries = store.export_session(SCOPE, "s1")
        with pytest.raises(InvalidInput, match="keyless"):
            store.import_session(SCOPE, header, entries, session_id="s2", session_key="k", keyless=True)
        info = store.import_session(SCOPE, header, entries, session_id="s2", keyless=True)
        assert info.session_key is None and info.entry_count == 2


# ---------------------------------------------------------------------------------------------- header ids


def test_a_header_session_id_too_long_for_a_new_session_is_refused_at_its_line_with_a_hint(
    store_url: str, tmp_path: Path
) -> None:
    """A header whose session id (or key) is under 256 characters but over 640 bytes (an id an earlier
    release stored): the error had no line number and no advice, unlike every other import error. It names
    line 1 and the header's field, and the option that imports it all the same; which then works."""
    path = _export(store_url, tmp_path, key=None)
    lines = path.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    long_id = "\N{GRINNING FACE}" * 200  # 800 bytes of UTF-8
    for field, option in (("session_id", "--session-id"), ("session_key", "--session-key")):
        bad = tmp_path / f"{field}.jsonl"
        bad.write_text("\n".join([json.dumps({**header, field: long_id}), *lines[1:]]) + "\n", encoding="utf-8")
        refused = one_error_line(run("sessions", "import", str(bad), "--scope", "copy", "--db", store_url,
                                     cwd=tmp_path, code=1))
        assert refused.startswith(f"error: line 1: header: {field} ")
        assert "640 bytes" in refused and option in refused
    with _store(store_url) as store:
        assert store.list_sessions("copy") == []
    run("sessions", "import", str(tmp_path / "session_id.jsonl"), "--scope", "copy", "--session-id", "short",
        "--db", store_url, cwd=tmp_path)
    run("sessions", "import", str(tmp_path / "session_key.jsonl"), "--scope", "copy", "--session-id", "s3",
        "--no-session-key", "--db", store_url, cwd=tmp_path)
    with _store(store_url) as store:
        assert sorted(s.session_id for s in store.list_sessions("copy")) == ["s3", "short"]


# ---------------------------------------------------------------------------------------------- Ctrl-C


def _default_sigint() -> None:
    """In the child before exec: SIGINT as a terminal's foreground process has it (a background job of a
    non-interactive shell inherits it ignored, and Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _holds(pid: int, wanted: Callable[[str], bool]) -> bool:
    """Whether process ``pid`` has a file open whose path (as /proc shows it) is ``wanted``."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if wanted(os.readlink(fd)):
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def _wait_until(proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert proc.poll() is None, f"the import ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"not within 60 s: {what}"
        time.sleep(0.01)


def _import(url: str, tmp_path: Path, *args: str, stdin: int | None = None) -> subprocess.Popen[bytes]:
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    env["TMPDIR"] = str(spool)  # where the import's checked entries wait: seen open, it is reading the file
    return subprocess.Popen([*CLI, "sessions", "import", *args, "--session-id", "s2", "--session-key", "cli:copy",
                             "--db", url], cwd=tmp_path, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, preexec_fn=_default_sigint)


def _ended(proc: subprocess.Popen[bytes]) -> tuple[int, str, str]:
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    if proc.stdin is not None:
        proc.stdin.close()
    return proc.returncode, out, err


def test_ctrl_c_while_an_import_reads_its_file_ends_it_cleanly(store_url: str, tmp_path: Path) -> None:
    """A real SIGINT while the import reads its export (from a pipe that has not ended): it printed
    click's "error: aborted" after a blank line, exit 1 (or Python's traceback, before the command ran),
    saying nothing of the import. Now one line saying nothing was imported, exit 130, and nothing is."""
    lines = _export(store_url, tmp_path).read_bytes().splitlines(keepends=True)
    proc = _import(store_url, tmp_path, "-", stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(b"".join(lines[:2]))  # the header and one entry of two
    proc.stdin.flush()
    _wait_until(proc, lambda: _holds(proc.pid, lambda p: p.startswith(str(tmp_path / "spool"))),
                "it read the export")
    time.sleep(0.2)  # blocked on the pipe for the next line
    proc.send_signal(signal.SIGINT)
    code, out, err = _ended(proc)
    assert code == 130, err
    assert [line for line in err.splitlines() if line.strip()] == ["error: interrupted: nothing was imported"]
    assert out == ""
    with _store(store_url) as store:
        assert [s.session_id for s in store.list_sessions(SCOPE)] == ["s1"]


def test_ctrl_c_while_an_import_waits_to_write_rolls_it_back(store_url: str, tmp_path: Path) -> None:
    """A real SIGINT while the import's transaction waits for another writer's lock: one line, exit 130,
    nothing of the session written; the same import afterwards lands whole."""
    path = _export(store_url, tmp_path)
    if store_url.startswith("sqlite"):
        database = store_url.removeprefix("sqlite:///")
        locker = sqlite3.connect(database, isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")  # every other writer waits (its busy timeout: 10 s)

        def waiting(proc: subprocess.Popen[bytes]) -> bool:
            return _holds(proc.pid, lambda p: p == os.path.realpath(database))
    else:
        conninfo = store_url.replace("postgresql+psycopg", "postgresql")
        locker = psycopg.connect(conninfo)
        locker.execute("LOCK TABLE ts_sessions IN SHARE ROW EXCLUSIVE MODE")  # reads go on, inserts wait

        def waiting(proc: subprocess.Popen[bytes]) -> bool:
            # Autocommit: a transaction sees one snapshot of the activity, taken at its first look.
            with psycopg.connect(conninfo, autocommit=True) as watcher:
                row = watcher.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                      "AND query ILIKE 'INSERT INTO ts_sessions%'").fetchone()
            return bool(row and row[0])
    try:
        proc = _import(store_url, tmp_path, str(path))
        _wait_until(proc, lambda: waiting(proc), "it waited for the lock")
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)  # SQLite's busy wait sees the signal once it has the lock: let it have it
    finally:
        locker.rollback()
        locker.close()
    code, _, err = _ended(proc)
    assert code == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    if store_url.startswith("postgresql"):
        assert lines[0].startswith("error: interrupted while writing session 's2': an import is one transaction")
    else:  # the signal may be seen before the transaction began, as the lock was taken
        assert lines[0].startswith(("error: interrupted while writing session 's2'",
                                    "error: interrupted: nothing was imported")), lines
    with _store(store_url) as store:
        assert [s.session_id for s in store.list_sessions(SCOPE)] == ["s1"]
    run("sessions", "import", str(path), "--session-id", "s2", "--session-key", "cli:copy", "--db", store_url,
        cwd=tmp_path)
    with _store(store_url) as store:
        assert store.get_session(SCOPE, "s2").entry_count == 2
