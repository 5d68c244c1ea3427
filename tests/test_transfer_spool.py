"""`sessions import` checks an export whole before one transaction writes it, holding what the checks of
the whole file need and spooling the checked rows to a temporary file: it held every record and every
row (about 6 times the file: 640 MB of RSS for a 100 MB export). The write reads the spool, again when a
transient error retries it."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import pytest
from test_cli import CLI, _script_mode, one_error_line, run  # noqa: F401 (_script_mode: autouse, honours real_script)
from test_outbox_review import commit_fails_once, commits_lost

from transcript_store import InvalidInput, StoreConfig, TranscriptStore, transfer

SCOPE = "spool-scope"


def _export(tmp_path: Path, count: int, body: str) -> Path:
    """The CLI's export of a session of ``count`` entries (a branch and an event among them), from a
    SQLite store of its own."""
    url = f"sqlite:///{tmp_path / 'source.db'}"
    TranscriptStore.upgrade_url(url)
    with TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False)) as store:
        store.create_session(SCOPE, session_id="big", session_key="agent:big")
        first = store.append(SCOPE, "big", {"role": "user", "content": "first"})
        store.append(SCOPE, "big", kind="custom", payload={"note": "event \u00e9"})
        store.append(SCOPE, "big", {"role": "assistant", "content": "off the branch"})
        store.branch(SCOPE, "big", first.entry_id)
        for start in range(3, count, 1000):
            store.append_many(SCOPE, "big", [{"message": {"role": "user", "content": f"{i} {body}"}}
                                             for i in range(start, min(count, start + 1000))])
    path = tmp_path / "big.jsonl"
    run("sessions", "export", "big", "-o", str(path), "--db", url, "--scope", SCOPE, cwd=tmp_path)
    return path


def _reexport(url: str, tmp_path: Path) -> bytes:
    again = tmp_path / "again.jsonl"
    run("sessions", "export", "big", "-o", str(again), "--db", url, "--scope", SCOPE, cwd=tmp_path)
    return again.read_bytes()


def test_an_import_holds_what_its_checks_need_not_the_session(store_url: str, tmp_path: Path) -> None:
    """The import of a 13 MB export peaked at 40 MB of traced memory (3 times the file); now at 2 MB, a
    batch of rows and a few facts per entry."""
    path = _export(tmp_path, 4000, "x\u00e9" * 1000)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        run("sessions", "import", str(path), "--db", store_url, "--scope", SCOPE, cwd=tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > 12_000_000
    assert peak < size / 4, (peak, size)
    assert _reexport(store_url, tmp_path) == path.read_bytes()


def test_an_import_from_stdin_is_the_same_session(store_url: str, tmp_path: Path) -> None:
    """`import -` reads the export once from stdin, as a file is read."""
    path = _export(tmp_path, 1200, "y" * 300)
    run("sessions", "import", "-", "--db", store_url, "--scope", SCOPE, cwd=tmp_path,
        stdin=path.read_text(encoding="utf-8"))
    assert _reexport(store_url, tmp_path) == path.read_bytes()


def test_a_retried_import_writes_the_spooled_entries_again(store_url: str, tmp_path: Path) -> None:
    """The plan reads its entries from the spool each time the transaction runs: a retry after a rolled
    back attempt writes every entry again, not none."""
    path = _export(tmp_path, 1200, "z" * 900)  # more than one batch of rows
    lines = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines())
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        with tempfile.TemporaryFile() as spool:
            plan = transfer.plan_import_stream(store.config, SCOPE, next(lines), lines, spool)
            failed: list[int] = []
            with commit_fails_once(store, lambda: failed.append(1)):
                info = transfer.write_import(store, plan)
        assert failed == [1] and info.entry_count == 1200
    assert _reexport(store_url, tmp_path) == path.read_bytes()


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


def test_an_import_whose_spool_cannot_be_written_fails_and_creates_nothing(tmp_path: Path) -> None:
    """The checked entries go to a temporary file before the store is opened: a file size limit (or a full
    TMPDIR) refuses the import in one line, and the database --db names is not created."""
    path = _export(tmp_path, 1200, "w" * 400)
    target = tmp_path / "target.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    result = subprocess.run([*CLI, "sessions", "import", str(path), "--db", f"sqlite:///{target}"], cwd=tmp_path,
                            capture_output=True, text=True, env=env, timeout=120, preexec_fn=_limited)
    assert result.returncode == 1, result
    assert one_error_line(result).startswith("error: cannot keep the checked entries in a temporary file: ")
    assert not target.exists()


def _sessions(url: str) -> list[str]:
    with TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False)) as store:
        return [info.session_id for info in store.list_sessions(SCOPE)]


def test_a_first_line_of_null_is_a_wrong_header_not_an_empty_export(store_url: str, tmp_path: Path) -> None:
    """The header is read on its own now: a first line of JSON ``null`` was taken for no line at all and
    refused as an empty export, where the whole-file reader named the header at line 1."""
    path = _export(tmp_path, 5, "v")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text("null\n" + "".join(lines[1:]), encoding="utf-8")
    result = run("sessions", "import", str(path), "--db", store_url, "--scope", SCOPE, cwd=tmp_path, code=1)
    assert one_error_line(result) == "error: line 1: header must be a JSON object"
    assert _sessions(store_url) == []


def test_an_import_without_a_usable_temporary_directory_is_refused_in_one_line(store_url: str, tmp_path: Path) -> None:
    """Making the spool itself can fail (no writable TMPDIR, /tmp, /var/tmp or working directory): that is
    the spool's failure in the spool's words, as a full TMPDIR is, not a bare OSError's."""
    path = _export(tmp_path, 5, "t")
    # tempfile falls back from an unusable TMPDIR to /tmp: its chosen directory is set missing instead
    script = ("import sys, tempfile; tempfile.tempdir = sys.argv[1]; from transcript_store.cli import main; "
              "main(sys.argv[2:])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "missing"), "sessions", "import",
                             str(path), "--db", store_url, "--scope", SCOPE],
                            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1, result
    assert one_error_line(result) == (
        "error: cannot keep the checked entries in a temporary file: No such file or directory"
    )
    assert _sessions(store_url) == []


def test_a_streamed_plan_counts_records_past_the_header_once(tmp_path: Path) -> None:
    """``plan_import_stream`` given a list (any iterable, not only an iterator) counted the records past
    the header's count from the list's start again: 4 + 1 + 5 for an export of 5."""
    path = _export(tmp_path, 5, "c")
    header, *records = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines())
    header["entry_count"] = 4
    with tempfile.TemporaryFile() as spool, pytest.raises(InvalidInput) as refused:
        transfer.plan_import_stream(StoreConfig(url="sqlite://"), SCOPE, header, records, spool)
    assert str(refused.value) == "header says 4 entries, the export has 5"


def test_a_spooled_import_whose_commit_landed_is_not_refused_by_its_retry(store_url: str, tmp_path: Path) -> None:
    """The retry of a spooled import finds the session its first attempt committed under the plan's
    incarnation: that import, reported as such, not 'already exists', and its entries written once."""
    path = _export(tmp_path, 1200, "u" * 500)
    lines = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines())
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        with tempfile.TemporaryFile() as spool:
            plan = transfer.plan_import_stream(store.config, SCOPE, next(lines), lines, spool)
            landed: list[int] = []
            with commits_lost(store, lambda n: landed.append(n) is None and n == 1):
                info = transfer.write_import(store, plan)
        assert landed == [1, 2] and info.entry_count == 1200
    assert _reexport(store_url, tmp_path) == path.read_bytes()
