"""Fault campaign, part 4e: hostile arguments and input files to every CLI command that takes any.

The CLI is run as its console script runs (``main(argv)`` in this process, with its own environment,
stdin and captured output: test_cli.py's ``_in_process``) on the test's database, with hypothesis
drawing the arguments: session ids, keys, turn ids, scopes and engine names with lone surrogates (what
invalid UTF-8 in argv decodes to), control characters, SQL metacharacters and huge strings; negative,
huge and non-numeric limits; export files edited or replaced by garbage, invalid UTF-8 and endless
nesting for ``sessions import``; hostile lines on ``chat``'s stdin. NUL is left out of argv, which no
process can be given. The contract, on both backends, after every command:

- the exit code is one of the documented ones for an input at fault (0 ok, 1 failed, 2 usage error,
  3 not found), never 4, 5 or 6 (schema, database, permission: the input is not theirs) and never an
  escaped exception; no traceback on stderr, nor the note of an internal error (an exception that is
  no library, command or OS error, which ``main`` reports as exit 1);
- a command that failed (any exit but 0) leaves every row of every table as it was, and the commands
  that only read (``sessions list/show/export``, ``outbox status``, ``engines list``, ``doctor``,
  ``current``) never change any. ``chat`` runs each line as a turn and exits 1 when any failed: the
  entries it wrote are exactly the answered turns' (a failed line wrote none).

The default tier draws ``FAULT_INPUT_CLI_EXAMPLES`` (8) per command and backend; the slow tier 60.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import _in_process
from test_faults_input import NASTY, deep, json_values, texts, weighted
from workers.fault_worker import report, table_rows

from transcript_store import TranscriptStore

EXAMPLES = int(os.environ.get("FAULT_INPUT_CLI_EXAMPLES", "8"))
SLOW_EXAMPLES = 60
SCOPE = "cli-scope"
#: exit codes that blame the input or report a result; 4-6 blame the schema, the database, a permission
ALLOWED = {0, 1, 2, 3}
READS = {"sessions list", "sessions show", "sessions export", "outbox status", "engines list", "doctor", "current"}


def argv_safe(value: str) -> str:
    """``value`` as argv can carry it: no NUL (execve refuses one)."""
    return value.replace("\x00", "")


hostile = st.one_of(st.sampled_from(NASTY), texts, st.text(max_size=20)).map(argv_safe)
surrogates = st.lists(st.integers(0x80, 0xFF), min_size=1, max_size=4).map(lambda bs: "s" + "".join(
    chr(0xDC00 + b) for b in bs))  # os.fsdecode of invalid UTF-8 bytes


def mostly(valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` 3 draws in 4."""
    return weighted(valid, hostile, 4)


sessions = mostly(st.sampled_from(["s1", "s2", "key-s1", "nowhere"]), st.one_of(hostile, surrogates))
hostile_sessions = st.one_of(hostile, surrogates, st.just("nowhere"))  # never a real one: for deletes
engines = mostly(st.sampled_from(["legacy", "lossless"]), st.one_of(hostile, surrogates))
numbers = st.one_of(st.integers(-10, 10).map(str), st.sampled_from(["0", "-1", "1e9", "10" * 30, "x", "", "1.5"]))


def export_files(export: str) -> st.SearchStrategy[bytes]:
    """A real export with one line edited, or garbage: invalid JSON, invalid UTF-8, deep nesting, empty."""
    lines = export.splitlines()

    def edit(i: int, value: Any) -> bytes:
        out = list(lines)
        out[i % len(out)] = json.dumps(value, default=repr)
        return ("\n".join(out) + "\n").encode("utf-8", "surrogatepass")

    def field(i: int, key: str, value: Any) -> bytes:
        out = list(lines)
        record = json.loads(out[i % len(out)])
        if isinstance(record, dict):
            record[key] = value
        out[i % len(out)] = json.dumps(record, default=repr)
        return ("\n".join(out) + "\n").encode("utf-8", "surrogatepass")

    keys = st.sampled_from(["session_id", "session_key", "entry_id", "parent_id", "message", "kind", "seq", "format",
                            "version", "payload", "turn_id", "idempotency_key", "generation", "scope"])
    values = st.one_of(json_values, deep, st.sampled_from(NASTY))
    return st.one_of(
        st.builds(field, st.integers(0, 50), keys, values),
        st.builds(edit, st.integers(0, 50), st.one_of(json_values, deep)),
        st.sampled_from(GARBAGE),
    )


#: files that are no export at all: each is also imported once in every run, not only when drawn
GARBAGE = [b"", b"\n", b"{", b"\xff\xfe\n", b"[" * 50_000 + b"\n", b"null\n", b'{"format": 1}\n',
           b"1" * 5000 + b"\n", b'{"a": NaN}\n', b'{"a": 1, "a": 2}\n', b"\xed\xa0\x80\n"]


def build_world(store: TranscriptStore) -> None:
    """Two sessions with entries, a committed turn and a queued one, in the CLI's scope."""
    store.create_session(SCOPE, session_id="s1", session_key="key-s1")
    store.create_session(SCOPE, session_id="s2")
    for i in range(4):
        store.append(SCOPE, "s1", {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"})
    store.admit(SCOPE, "s2", {"role": "user", "content": "held"}, turn_id="T1")


def commands(tmp: Path, export: str) -> dict[str, Callable[[st.DataObject], tuple[list[str], str | None]]]:
    """Per command: draw its argv (after the global options) and its stdin."""
    def with_file(content: bytes) -> str:
        path = tmp / f"import-{time.monotonic_ns()}.jsonl"
        path.write_bytes(content)
        return str(path)

    def opt(d: st.DataObject, flag: str, values: st.SearchStrategy[str]) -> list[str]:
        return [flag, d.draw(values)] if d.draw(st.booleans()) else []

    files = export_files(export)
    return {
        "sessions list": lambda d: (["sessions", "list"], None),
        "sessions show": lambda d: (["sessions", "show", d.draw(sessions),
                                     *(["--all"] if d.draw(st.booleans()) else [])], None),
        "sessions export": lambda d: (["sessions", "export", d.draw(sessions)], None),
        "sessions import": lambda d: (["sessions", "import", with_file(d.draw(files)),
                                       *opt(d, "--session-id", mostly(st.just("copy"), hostile)),
                                       *opt(d, "--session-key", mostly(st.just("copy-key"), hostile))], None),
        "sessions delete": lambda d: (["sessions", "delete", d.draw(hostile_sessions), "--yes"], None),
        "outbox status": lambda d: (["outbox", "status"], None),
        "outbox drain": lambda d: (["outbox", "drain", *opt(d, "--session", sessions), *opt(d, "--limit", numbers)],
                                   None),
        "outbox recover": lambda d: (["outbox", "recover", *([d.draw(sessions)] if d.draw(st.booleans()) else [])],
                                     None),
        "outbox block": lambda d: (["outbox", "block", d.draw(hostile_sessions), d.draw(mostly(st.just("T1"), hostile)),
                                    "--reason", d.draw(hostile), "--yes"], None),
        "compact": lambda d: (["compact", d.draw(sessions), *opt(d, "--focus", hostile), *opt(d, "--engine", engines)],
                              None),
        "chat": lambda d: (["chat", "--session", d.draw(mostly(st.just("chat-key"), hostile)),
                            *opt(d, "--engine", engines)],
                           "\n".join(d.draw(st.lists(mostly(st.just("hello"), hostile), max_size=3))) + "\n"),
        "engines list": lambda d: (["engines", "list"], None),
        "doctor": lambda d: (["doctor"], None),
        "current": lambda d: (["current"], None),
    }


def hostile_cli_campaign(request: pytest.FixtureRequest, store: TranscriptStore, store_url: str, backend: str,
                         tmp_path: Path, examples: int) -> None:
    """Draw ``examples`` invocations per command and check the contract after each."""
    started = time.monotonic()
    build_world(store)
    header, records = store.export_session(SCOPE, "s1")
    export = "\n".join(json.dumps(r, default=str) for r in [header, *records]) + "\n"
    names = sorted(table_rows(store))
    state = {"rows": table_rows(store, names=names)}
    figures: dict[str, dict[str, int]] = {}

    def check(name: str, argv: list[str], stdin: str | None, scope: str, as_json: bool) -> None:
        counts = figures.setdefault(name, {"runs": 0, "failed": 0})
        counts["runs"] += 1
        args = ["--db", store_url, "--scope", scope, *(["--json"] if as_json else []), *argv]
        # stdin as the bytes a pipe carries: a lone surrogate drawn becomes invalid UTF-8
        data = None if stdin is None else stdin.encode("utf-8", "surrogatepass")
        result = _in_process(tuple(args), tmp_path, data,  # type: ignore[arg-type]
                             {"COLUMNS": "200", "TRANSCRIPT_STORE_MODEL": "local"})
        where = f"{' '.join(map(repr, argv))[:300]} (exit {result.returncode})"
        assert result.returncode in ALLOWED, f"{where}\n{result.stderr[-1500:]}"
        assert "Traceback" not in result.stderr, f"{where}\n{result.stderr[-3000:]}"
        # main() maps an exception that is no library, command or OS error to exit 1 with this note
        assert "an internal error" not in result.stderr, f"{where}\n{result.stderr[-1500:]}"
        after = table_rows(store, names=names)
        if name == "chat" and result.returncode != 0:
            # chat runs each line as a turn and exits 1 when any failed: the turns answered are written
            # (a question each, then its replies), a line that failed wrote nothing.
            answered = result.stdout.count('"event": "reply"' if as_json else "\nassistant: ")
            added = [r for r in set(after["ts_entries"]) - set(state["rows"]["ts_entries"]) if "('role', 'user')" in r]
            assert len(added) == answered, f"{where}: {answered} turns answered, {len(added)} questions written"
            # and a failed line left no turn behind for the outbox to deliver (an intent of its own)
            assert after["ts_outbox"] == state["rows"]["ts_outbox"], f"{where}: a failed line left an intent"
        elif result.returncode != 0 or name in READS:
            changed = {t for t in names if after[t] != state["rows"][t]}
            assert not changed, f"{where}: {'failed' if result.returncode else 'a read'} but wrote {changed}"
        counts["failed"] += result.returncode != 0
        state["rows"] = after

    def campaign(name: str, draw: Callable[[st.DataObject], tuple[list[str], str | None]]) -> None:
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            scope = data.draw(mostly(st.just(SCOPE), st.one_of(st.just("other"), hostile, surrogates)))
            check(name, *draw(data), scope, data.draw(st.booleans()))

        run()

    for i, garbage in enumerate(GARBAGE):
        path = tmp_path / f"garbage-{i}.jsonl"
        path.write_bytes(garbage)
        check("sessions import", ["sessions", "import", str(path)], None, SCOPE, False)
    for name, draw in commands(tmp_path, export).items():
        campaign(name, draw)
    runs = sum(c["runs"] for c in figures.values())
    failed = sum(c["failed"] for c in figures.values())
    report(request, backend, {
        "commands": len(figures), "examples_per_command": examples, "runs": runs, "refusals": failed,
        "succeeded": runs - failed, "tracebacks": 0, "writes_by_failed_commands": 0,
        "seconds": round(time.monotonic() - started, 1),
    })
    assert failed > 0 and runs - failed > 0, figures


def test_hostile_cli_arguments_and_files_fail_cleanly_and_write_nothing(
    request: pytest.FixtureRequest, store: TranscriptStore, store_url: str, backend: str, tmp_path: Path,
) -> None:
    hostile_cli_campaign(request, store, store_url, backend, tmp_path, EXAMPLES)


@pytest.mark.slow
def test_hostile_cli_arguments_60_per_command(
    request: pytest.FixtureRequest, store: TranscriptStore, store_url: str, backend: str, tmp_path: Path,
) -> None:
    hostile_cli_campaign(request, store, store_url, backend, tmp_path, SLOW_EXAMPLES)


def test_invalid_utf8_on_chats_stdin_is_one_failed_line(store: TranscriptStore, store_url: str,
                                                         tmp_path: Path) -> None:
    """Decoded strictly, one byte of invalid UTF-8 ended the run as an internal error (exit 1 with the
    note) and the lines after it were never read: it is one failed turn now, the others are answered."""
    stdin = b"hello\n\xed\xa0\x80 bad\n\xff\xfe\nbye\n"
    for as_json in (False, True):
        args = ("--db", store_url, "--scope", SCOPE, *(["--json"] if as_json else []), "chat", "--session", "u8")
        result = _in_process(args, tmp_path, stdin, {"COLUMNS": "200"})  # type: ignore[arg-type]
        assert result.returncode == 1, result.stderr
        assert "internal error" not in result.stderr and "2 turn(s) or command(s) failed" in result.stderr
        assert result.stdout.count('"event": "reply"' if as_json else "\nassistant: ") == 2, result.stdout


def test_a_stdin_error_handler_the_user_chose_is_kept(store: TranscriptStore, store_url: str, tmp_path: Path) -> None:
    """PYTHONIOENCODING=utf-8:replace turns invalid bytes into U+FFFD and the turn is answered: chat's
    own lenient decoding (for a strict stdin) must not replace a handler the user chose."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    env["PYTHONIOENCODING"] = "utf-8:replace"
    result = subprocess.run([sys.executable, "-m", "transcript_store", "--db", store_url, "--scope", SCOPE, "chat",
                             "--session", "replace"], input=b"caf\xe9 latin-1\n", capture_output=True, env=env,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert "caf\ufffd latin-1" in result.stdout.decode(), result.stdout.decode(errors="replace")
