"""`sessions delete` and `sessions show` against writes of another connection landing mid-command: a delete
removes the session it looked up or nothing, a show prints one moment of the session. The other
connection's writes run from hooks the tests set in this process, so the command runs in-process."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tracemalloc
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from test_cli import (  # noqa: F401 (_script_mode: autouse, honours real_script)
    CLI,
    SCOPE,
    SUBPROCESS,
    _script_mode,
    one_error_line,
    run,
    run_json,
    seed,
)

from transcript_store import TranscriptStore
from transcript_store.cli import WholeStdout, main
from transcript_store.cli import transcripts as cli_sessions  # the module the sessions commands look names up in
from transcript_store.core import Core

pytestmark = pytest.mark.skipif(SUBPROCESS, reason="the hooks run in this process")


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


# ---------------------------------------------------------------------------------------------- delete


def _replace_after_lookup(monkeypatch: pytest.MonkeyPatch, store: TranscriptStore) -> list[str]:
    """After the command looks the session up, another connection deletes it and makes it again under the
    same id and key, with an entry of its own. Returns the list the hook notes each replacement in."""
    looked_up = cli_sessions.find_session
    done: list[str] = []

    def look_up_then_replace(s: TranscriptStore, scope: str, ref: str) -> Any:
        info = looked_up(s, scope, ref)
        if not done:
            done.append(info.session_id)
            store.delete_session(scope, info.session_id)
            store.create_session(scope, session_id=info.session_id, session_key=info.session_key)
            store.append(scope, info.session_id, _user("made again"))
        return info

    monkeypatch.setattr(cli_sessions, "find_session", look_up_then_replace)
    return done


@pytest.mark.parametrize("ref", ["s1", "agent:s1"])
def test_delete_spares_a_session_made_again_after_the_lookup(
    store: TranscriptStore, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ref: str
) -> None:
    """The delete looked the session up in one transaction and deleted by id in another: a session deleted
    and made again under the id in between (someone else's now) was deleted in its place, exit 0. It is
    deleted only if it is still the one looked up: else nothing is, exit 3, and the new one stays whole."""
    store.create_session(SCOPE, session_id="s1", session_key="agent:s1")
    store.append_many(SCOPE, "s1", [{"message": _user(f"old {i}")} for i in range(3)])
    done = _replace_after_lookup(monkeypatch, store)
    result = run("sessions", "delete", ref, "--yes", "--db", store_url, cwd=tmp_path, code=3)
    assert done == ["s1"]
    line = one_error_line(result)
    assert "s1" in line and "made again" in line and "nothing changed" in line, line
    survivor = store.get_session(SCOPE, "s1")
    assert survivor.entry_count == 1 and survivor.session_key == "agent:s1"
    assert [e.message for e in store.read_visible(SCOPE, "s1")] == [_user("made again")]


@pytest.mark.parametrize("to_file", [True, False])
def test_export_spares_a_session_made_again_after_the_lookup(
    store: TranscriptStore, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to_file: bool
) -> None:
    """The export looked the session up in one read and exported by id in another: a session deleted and
    made again under the id in between was exported in its place, exit 0, a file of another session
    under the name asked for. Now nothing is written, exit 3."""
    store.create_session(SCOPE, session_id="s1", session_key="agent:s1")
    store.append_many(SCOPE, "s1", [{"message": _user(f"old {i}")} for i in range(3)])
    done = _replace_after_lookup(monkeypatch, store)
    out = tmp_path / "s1.jsonl"
    args = ("--output", str(out)) if to_file else ()
    result = run("sessions", "export", "agent:s1", *args, "--db", store_url, cwd=tmp_path, code=3)
    assert done == ["s1"] and not out.exists() and result.stdout == ""
    line = one_error_line(result)
    assert "s1" in line and "made again" in line, line


def test_delete_reports_the_entries_it_deleted(
    store: TranscriptStore, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries appended between the lookup and the delete are deleted with the session: the report counts
    them (it counted the entries of the lookup)."""
    store.create_session(SCOPE, session_id="s1")
    store.append(SCOPE, "s1", _user("one"))
    looked_up = cli_sessions.find_session

    def look_up_then_append(s: TranscriptStore, scope: str, ref: str) -> Any:
        info = looked_up(s, scope, ref)
        store.append(scope, info.session_id, _user("two"))
        return info

    monkeypatch.setattr(cli_sessions, "find_session", look_up_then_append)
    assert run_json("sessions", "delete", "s1", "--yes", "--db", store_url, cwd=tmp_path) == {
        "deleted": "s1", "entries": 2
    }
    assert store.list_sessions(SCOPE) == []


# ---------------------------------------------------------------------------------------------- show


def _once_after(monkeypatch: pytest.MonkeyPatch, name: str, calls: int, write: Callable[[], None]) -> list[int]:
    """Run ``write`` (another connection's) once, right after the ``calls``-th call of ``Core.<name>``."""
    original = getattr(Core, name)
    seen: list[int] = []

    def hooked(self: Core, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        seen.append(1)
        if len(seen) == calls:
            write()
        return out

    monkeypatch.setattr(Core, name, hooked)
    return seen


# Pages grow from one entry to at most 2,000 (transfer.sized_pages): 2,500 entries already take several, so
# make test reads those; the slow tier the 10,002 of pages of 10,000 entries, as `show --all` read them.
@pytest.mark.parametrize("count", [2_500, pytest.param(10_002, marks=pytest.mark.slow)])
def test_show_all_reads_every_page_from_one_snapshot(
    store: TranscriptStore, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """`show --all` read its pages of 10,000 entries each in a read of its own: a branch and an append
    landing between two pages showed the first page on the old branch, the rest on the new one, and an
    entry the session header did not count. Every page comes from one snapshot now."""
    store.create_session(SCOPE, session_id="long")
    for start in range(0, count, 1_000):
        store.append_many(SCOPE, "long", [{"message": _user(f"m{i}")} for i in range(start, min(start + 1000, count))])
    expected = run_json("sessions", "show", "long", "--all", "--db", store_url, cwd=tmp_path)
    assert len(expected["entries"]) == count and all(e["active"] for e in expected["entries"])
    first = expected["entries"][0]["entry_id"]

    def branch_and_append() -> None:
        store.branch(SCOPE, "long", first)
        store.append(SCOPE, "long", _user("on the new branch"))

    seen = _once_after(monkeypatch, "all_rows", 1, branch_and_append)
    shown = run_json("sessions", "show", "long", "--all", "--db", store_url, cwd=tmp_path)
    assert len(seen) >= 2  # pages read one after another
    assert shown == expected
    assert store.get_session(SCOPE, "long").entry_count == count + 1  # the write landed


def test_show_reads_the_session_and_its_entries_from_one_snapshot(
    store: TranscriptStore, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session was looked up in one read and its visible entries read in another: an append in
    between printed a header counting one visible entry over two entries."""
    store.create_session(SCOPE, session_id="s1", session_key="agent:s1")
    store.append(SCOPE, "s1", _user("one"))
    for ref in ("s1", "agent:s1"):
        monkeypatch.undo()
        _once_after(monkeypatch, "session_row", 1, lambda: store.append(SCOPE, "s1", _user("more")))
        shown = run_json("sessions", "show", ref, "--db", store_url, cwd=tmp_path)
        assert shown["session"]["visible_count"] == len(shown["entries"]), shown


def _as_emitted(store: TranscriptStore, ref: str, every: bool) -> str:
    """The document `show --json` printed before it streamed: built whole, dumped at once."""
    info = store.get_session(SCOPE, ref)
    entries = store.list_entries(SCOPE, ref, limit=10_000) if every else store.read_visible(SCOPE, ref)
    document = {"session": info.model_dump(mode="json"), "entries": [e.model_dump(mode="json") for e in entries]}
    return json.dumps(document, indent=2, ensure_ascii=False, default=str) + "\n"


def test_show_json_streams_the_same_bytes(store: TranscriptStore, store_url: str, tmp_path: Path) -> None:
    """A page at a time, the document is the one built whole: rewritten, off-branch, events, NUL and
    non-ASCII text, nested payloads, an empty session; through the real console script's stdout once (a
    process start costs ~1.2 s here: the other cases run its ``main`` in-process, a byte stdout as well)."""
    seed(store_url)
    store.create_session(SCOPE, session_id="empty")
    store.append(SCOPE, "s2", kind="custom", payload={"nested": {"list": [1, {"a": "b\nc"}], "empty": {}}})
    for ref, options in (("s1", ()), ("s1", ("--all",)), ("s2", ("--all",)), ("empty", ()), ("empty", ("--all",))):
        shown = run("sessions", "show", ref, *options, "--json", "--db", store_url, cwd=tmp_path).stdout
        assert shown == _as_emitted(store, ref, bool(options)), (ref, options)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    real = subprocess.run([*CLI, "sessions", "show", "s1", "--all", "--json", "--db", store_url], cwd=tmp_path,
                          env=env, capture_output=True, timeout=120)
    assert real.returncode == 0, real.stderr
    assert real.stdout == _as_emitted(store, "s1", True).encode("utf-8")


def _peak_of_show(args: list[str], output: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Run the console script's ``main`` in this process with stdout a file; the peak of memory it traced."""
    for name in [k for k in os.environ if k.startswith("TRANSCRIPT_STORE_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(output.parent)
    with output.open("w", encoding="utf-8") as stdout, redirect_stdout(stdout):
        tracemalloc.start()
        try:
            main(args)
        except SystemExit as e:
            assert e.code == 0, e.code
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    return peak


def test_show_json_holds_a_page_in_memory_not_the_session(
    store: TranscriptStore, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`show --json` built every entry, their dicts and then the whole text before its first byte (memory
    several times the document's size, growing with the session); it writes a page at a time now, so a
    session 4 times as long takes no more memory."""
    body = "x" * 2000
    for sid, count in (("small", 1000), ("big", 4000)):
        store.create_session(SCOPE, session_id=sid)
        for start in range(0, count, 1000):
            store.append_many(SCOPE, sid, [{"message": _user(f"{i} {body}")} for i in range(start, start + 1000)])
    output = tmp_path / "shown.json"
    _peak_of_show(["sessions", "show", "small", "--json", "--db", store_url], output, monkeypatch)  # imports
    for options in ([], ["--all"]):
        peaks, sizes = [], []
        for sid in ("small", "big"):
            args = ["sessions", "show", sid, *options, "--json", "--db", store_url]
            peaks.append(_peak_of_show(args, output, monkeypatch))
            assert output.read_text(encoding="utf-8") == _as_emitted(store, sid, bool(options))
            sizes.append(output.stat().st_size)
        assert sizes[1] > 8_000_000
        assert peaks[1] < peaks[0] + sizes[0] / 4 and peaks[1] < sizes[1] / 4, (options, peaks, sizes)


def test_a_text_only_stdout_gets_every_character_of_the_document() -> None:
    """A stdout without a byte buffer (a wrapper's) is given text: a character cut by a chunk's end and a
    lone surrogate come through as they were (json.dumps writes one as it is with ensure_ascii off)."""
    inner = io.StringIO()
    out = WholeStdout(inner)
    text = "a" + "\u00e9" * 700_000 + "\ud800 end"  # 1.4 MB in UTF-8: the 1 MiB chunk ends inside an é
    encoding, errors = out.codec()
    out.copy_from(io.BytesIO(text.encode(encoding, errors)))
    assert inner.getvalue() == text
