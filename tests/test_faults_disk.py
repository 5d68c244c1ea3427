"""Fault campaign, part 6: disk full on SQLite.

The store lives on a 2 MiB tmpfs mounted by the test (root only; CI runs as root). A filler file takes
nearly all of it, then turns are written until the disk is full. The write that does not fit fails
with ``StorageFull`` (a ``StoreUnavailable``: clear, typed, not retried), nothing is corrupted
(``PRAGMA integrity_check``, every committed turn intact with its receipt), and once the filler is
removed the interrupted turn is retried and new turns are written again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from workers.fault_worker import report, sqlite_integrity, verify_turns
from workers.turn_worker import ENGINE, SCOPE, counting_engine

from transcript_store import StorageFull, StoreConfig, StoreUnavailable, TranscriptStore
from transcript_store.turns import Turns

SID = "full"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted after the test."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs (needs root / CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def turn_messages(turn_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A turn of ~6 KiB: the disk fills within a few dozen turns."""
    question = {"role": "user", "content": f"question of {turn_id} " + "q" * 2_000}
    answer = [{"message": {"role": "assistant", "content": f"answer of {turn_id} " + "a" * 4_000},
               "entry_id": f"{turn_id}.r0"}]
    return question, answer


def run_turn(turns: Turns, turn_id: str) -> bool:
    """Admit and complete one turn; True when the engine committed it in the completion transaction.

    False: the completion was accepted and queued for the drain (the fast path failed, e.g. because
    the commit's transaction did not fit on the disk while the smaller acceptance still did).
    """
    question, answer = turn_messages(turn_id)
    turns.admit(SCOPE, SID, question, turn_id=turn_id, engine_id=ENGINE)
    return turns.complete(SCOPE, SID, turn_id, answer, counting_engine).commit is not None


def fill(directory: Path, keep: int) -> Path:
    """A filler file taking all free space of the filesystem but ``keep`` bytes."""
    filler = directory / "filler"
    size = max(shutil.disk_usage(directory).free - keep, 0)
    with open(filler, "wb") as f:
        f.write(b"\0" * size)
        f.flush()
        os.fsync(f.fileno())
    return filler


def test_disk_full_is_a_clear_error_and_nothing_is_lost(
    request: pytest.FixtureRequest, sqlite_template: Path, small_fs: Path
) -> None:
    started = time.monotonic()
    db = small_fs / "store.db"
    shutil.copyfile(sqlite_template, db)
    url = f"sqlite:///{db}"
    store = TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))
    turns = Turns(store)
    try:
        store.create_session(SCOPE, session_id=SID)
        filler = fill(small_fs, keep=600 * 1024)
        committed: list[str] = []
        queued: list[str] = []
        error: StoreUnavailable | None = None
        for n in range(1000):
            try:
                done = run_turn(turns, f"{SID}.t{n}")
            except StoreUnavailable as e:
                error = e
                break
            (committed if done else queued).append(f"{SID}.t{n}")
        assert error is not None, "the disk never filled up"
        assert isinstance(error, StorageFull), repr(error)
        assert "full" in str(error), str(error)
        assert committed, "not a single turn fitted"
        ran = len(committed) + len(queued)
        interrupted = f"{SID}.t{ran}"

        # Still full: reads work and see every committed turn, and every accepted one is queued, not
        # lost; the next write fails the same clear way.
        assert sqlite_integrity(url) == "ok"
        receipts = [r.advancement_key for r in turns.receipts(SCOPE, SID, ENGINE)]
        assert sorted(receipts) == sorted(committed)
        assert sorted(i.turn_id for i in turns.intents() if i.state in ("accepted", "ready")) == sorted(queued)
        with pytest.raises(StorageFull):
            run_turn(turns, interrupted)

        # Space is back: queued turns drain, the interrupted turn is retried (same logical turn) and
        # new turns fit again.
        filler.unlink()
        drained = turns.drain(lambda engine: counting_engine if engine == ENGINE else None)
        assert drained.committed == len(queued), drained
        assert run_turn(turns, interrupted)
        for n in range(ran + 1, ran + 6):
            assert run_turn(turns, f"{SID}.t{n}")
    finally:
        store.close()
    totals = verify_turns(url, [SID])
    assert sqlite_integrity(url) == "ok"
    assert totals["turns"] == ran + 6 and totals["unaccepted"] == 0, totals
    report(request, "sqlite", {
        "filesystem": "tmpfs 2 MiB", "turns_before_full": len(committed), "queued_when_full": len(queued),
        "error": type(error).__name__,
        "message": str(error), "turns_after_space_back": 6, "integrity_check": "ok",
        "seconds": round(time.monotonic() - started, 1),
    })
