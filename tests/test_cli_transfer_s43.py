"""Export and import as a demanding user runs them (sessions 43 and 44): an export ended by SIGTERM
(``timeout``, ``kill``, a service manager stopping its job) or SIGHUP (its terminal gone) while it writes its
file."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from hosting import terminate_when
from test_cli import CLI, SCOPE, _script_mode, one_error_line, run  # noqa: F401 (_script_mode: autouse)

from transcript_store import StoreConfig, TranscriptStore


def _big_session(url: str) -> None:
    """Session s1 of about 12 MB: its export takes long enough to be caught while it writes."""
    with TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False)) as store:
        store.create_session(SCOPE, session_id="s1")
        for batch in range(4):
            store.append_many(SCOPE, "s1", [{"message": {"role": "user", "content": f"{batch}.{i} " + "x" * 3000}}
                                            for i in range(1000)])


@pytest.mark.parametrize(
    ("signum", "ignored"), [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGHUP, True)],
    ids=["sigterm", "sighup", "nohup"],
)
def test_an_export_ended_by_a_signal_leaves_no_part_file_and_the_earlier_export(
    store_url: str, tmp_path: Path, signum: int, ignored: bool
) -> None:
    """SIGTERM (or SIGHUP: its terminal gone) mid-export: the earlier export stays as it was and no hidden part
    file is left beside it (each `timeout`-ended export left one, as large as it had got; a closed terminal
    too), and the process still ends by that signal. Started with SIGHUP ignored (``nohup``), it keeps
    ignoring it and writes the whole file."""
    _big_session(store_url)
    folder = tmp_path / "exports"
    folder.mkdir()
    path = folder / "s1.jsonl"
    path.write_bytes(b"an earlier export\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    handling = signal.SIG_IGN if ignored else signal.SIG_DFL
    proc = subprocess.Popen([*CLI, "sessions", "export", "s1", "-o", str(path), "--db", store_url], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            preexec_fn=lambda: signal.signal(signum, handling))
    try:
        # the export is writing its file
        terminate_when(proc, lambda: any(p.name.endswith(".tmp") for p in folder.iterdir()),
                       "its file was seen being written", signum=signum)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
    assert sorted(p.name for p in folder.iterdir()) == ["s1.jsonl"]
    if ignored:
        assert proc.returncode == 0
        assert len(path.read_bytes().splitlines()) == 4001  # the header and every entry
    else:
        assert proc.returncode == -signum  # ended by the signal, as before (143 or 129 in a shell)
        assert path.read_bytes() == b"an earlier export\n"


def test_an_export_longer_than_its_header_says_is_refused_for_that_not_for_a_later_broken_line(
    store_url: str, tmp_path: Path
) -> None:
    """An export with an entry past its header's count, then a broken line (an export appended to another and
    cut short) is refused for the entry past the count, the first problem in file order, as README says: the
    lines past the count were parsed to count them, and the broken one's error was given instead."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        store.create_session(SCOPE, session_id="s1")
        store.append_many(SCOPE, "s1", [{"message": {"role": "user", "content": "q"}},
                                        {"message": {"role": "assistant", "content": "a"}}])
    good = tmp_path / "s1.jsonl"
    run("sessions", "export", "s1", "-o", str(good), "--db", store_url, cwd=tmp_path)
    lines = good.read_text(encoding="utf-8").splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines, lines[1], '{"format":"transcript-store.sess']) + "\n", encoding="utf-8")
    refused = run("sessions", "import", str(bad), "--scope", "copy", "--db", store_url, cwd=tmp_path, code=1)
    assert one_error_line(refused) == "error: line 1: header says 2 entries, the export has more"
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        assert store.list_sessions("copy") == []
    # Without the broken line, the count is told as before.
    bad.write_text("\n".join([*lines, lines[1]]) + "\n", encoding="utf-8")
    refused = run("sessions", "import", str(bad), "--scope", "copy", "--db", store_url, cwd=tmp_path, code=1)
    assert one_error_line(refused) == "error: line 1: header says 2 entries, the export has 3"
