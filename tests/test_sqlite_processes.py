"""The embedded SQLite store shared by several OS processes on one file: what a reader or writer in
another process leaves behind for the store's own processes (SQLite only: the behaviour is its WAL's)."""

from __future__ import annotations

import subprocess
import sys
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
