"""The embedded SQLite store shared by several OS processes on one file: what a reader or writer in
another process leaves behind for the store's own processes (SQLite only: the behaviour is its WAL's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from transcript_store import StoreConfig, TranscriptStore
from transcript_store import db as db_module

SCOPE = "procs"

#: another process that opens a read snapshot of the file, says so, and holds it until told to end
_READER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN")
conn.execute("SELECT count(*) FROM ts_entries").fetchall()
print("reading", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
"""


def test_the_wal_shrinks_back_after_a_long_reader_in_another_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read snapshot held in another process (a slow export, a paging reader) keeps every write since
    in the WAL; once it ends and a checkpoint restarts the WAL, the file is cut back to the limit instead
    of keeping its high-water size for as long as the writing process (a ``serve``) runs."""
    limit = 1024 * 1024  # the production limit is 64 MiB: a smaller one keeps the test quick
    monkeypatch.setattr(db_module, "SQLITE_WAL_SIZE_LIMIT", limit, raising=False)
    path = tmp_path / "store.db"
    wal = Path(f"{path}-wal")
    with TranscriptStore(config=StoreConfig(url=f"sqlite:///{path}")) as store:
        sid = store.create_session(SCOPE).session_id
        reader = subprocess.Popen([sys.executable, "-c", _READER, str(path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdout is not None and reader.stdout.readline().strip() == "reading"
            for i in range(40):  # ~8 MiB the reader's snapshot keeps from being checkpointed
                store.append(SCOPE, sid, {"role": "user", "content": f"{i} " + "x" * 200_000})
            grown = wal.stat().st_size
            assert grown > 4 * limit, grown
        finally:
            assert reader.stdin is not None
            reader.stdin.write("\n")
            reader.stdin.close()
            assert reader.wait(timeout=60) == 0
        for i in range(3):  # a checkpoint of the whole WAL, then a write that restarts it
            store.append(SCOPE, sid, {"role": "user", "content": f"after {i}"})
        assert wal.stat().st_size <= limit, (grown, wal.stat().st_size)
        assert store.get_session(SCOPE, sid).visible_count == 43


def _as_user(uid: int, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The CLI (or, for ``args`` starting with "touch", that) run as ``uid``, to whom file permissions apply."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run processes as two other users")
    command = args if args[0] == "touch" else [sys.executable, "-m", "transcript_store", *args]
    return subprocess.run([shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}",
                           "--clear-groups", *command], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(cwd)})


#: the store's owner and another user (neither is root, to whom permissions do not apply)
OWNER, OTHER = 1, 65534


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder every user may write to (as /tmp, or a group's shared folder), holding a store of OWNER's."""
    folder = Path(tempfile.mkdtemp(prefix="ts-shared-", dir="/tmp"))
    try:
        folder.chmod(0o1777)
        path = folder / "owned.db"
        with TranscriptStore(config=StoreConfig(url=f"sqlite:///{path}")) as owner:
            owner.create_session(SCOPE, session_id="s1")
            owner.create_session(SCOPE, session_id="s2")
        os.chown(path, OWNER, OWNER)
        path.chmod(0o644)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_read_by_a_user_who_may_not_write_the_store_is_refused_and_leaves_no_files(shared_folder: Path) -> None:
    """Another user may read the file but not write it: exit 6, as documented, and nothing left in the
    folder. It was read through a read-only connection (exit 0) that left a -wal and -shm of that user's,
    after which every write of the store's owner failed with "attempt to write a readonly database"."""
    path = shared_folder / "owned.db"
    before = path.read_bytes()
    url = f"sqlite:///{path}"
    done = _as_user(OTHER, ["sessions", "list", "--scope", SCOPE, "--db", url], shared_folder)
    assert done.returncode == 6, (done.returncode, done.stdout, done.stderr)
    assert f"{path} is not readable and writable" in done.stderr, done.stderr
    assert path.read_bytes() == before and sorted(p.name for p in shared_folder.iterdir()) == ["owned.db"]
    owner = _as_user(OWNER, ["sessions", "delete", "s1", "--yes", "--scope", SCOPE, "--db", url], shared_folder)
    assert owner.returncode == 0, (owner.returncode, owner.stdout, owner.stderr)


def test_a_wal_index_another_user_left_is_named_to_the_stores_owner(shared_folder: Path) -> None:
    """A -shm another user's process left (an earlier release's read, another program) that the owner may
    not write: the owner's commands are refused naming that file (exit 6), not only its writes with
    sqlite3's "attempt to write a readonly database", which named no file."""
    path = shared_folder / "owned.db"
    url = f"sqlite:///{path}"
    assert _as_user(OTHER, ["touch", f"{path}-shm"], shared_folder).returncode == 0
    for args in (["sessions", "list"], ["sessions", "delete", "s1", "--yes"]):
        done = _as_user(OWNER, [*args, "--scope", SCOPE, "--db", url], shared_folder)
        assert done.returncode == 6, (args, done.returncode, done.stdout, done.stderr)
        assert f"{path}-shm is not readable and writable" in done.stderr, done.stderr
    Path(f"{path}-shm").unlink()
    done = _as_user(OWNER, ["sessions", "delete", "s1", "--yes", "--scope", SCOPE, "--db", url], shared_folder)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
