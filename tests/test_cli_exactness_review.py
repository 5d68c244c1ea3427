"""A review of the CLI's exactness: --version and --help with no stdout, an empty --focus, chat's /compact,
error lines that name an id or a path exactly, empty folder options, import's id options, drain's failed lines."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import assistant, user
from test_cli import CLI, SCOPE, one_error_line, open_store, run, run_json

from transcript_store.cli import error_line
from transcript_store.turns import Turns


def _no_stdout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The real console script with its stdout closed (``>&-``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    return subprocess.run([*CLI, *args], cwd=cwd, stderr=subprocess.PIPE, text=True, env=env, timeout=120,
                          preexec_fn=lambda: os.close(1))


@pytest.mark.parametrize("args", [("--version",), ("--help",), ("-h",), ("sessions", "--help"),
                                  ("sessions", "show", "--help"), ("compact", "-h"), ("serve", "--help")])
def test_version_and_help_with_stdout_closed_exit_1(args: tuple[str, ...], tmp_path: Path) -> None:
    """``--version >&-`` exited 0 with nothing said: click.echo drops its text when there is no stdout.
    Like every command's output (but serve's courtesy line), it is one error line, exit 1."""
    result = _no_stdout(*args, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == "error: cannot write to stdout: it is closed"


def test_version_and_help_still_print(tmp_path: Path) -> None:
    version = run("--version", cwd=tmp_path)
    assert version.stdout.startswith("transcript-store, version ") and version.stdout.count("\n") == 1
    assert "Usage: transcript-store sessions show" in run("sessions", "show", "-h", cwd=tmp_path).stdout
    assert "--version" in run("--help", cwd=tmp_path).stdout


def _long_session(url: str, session_id: str, key: str | None = None) -> None:
    with open_store(url) as store:
        store.create_session(SCOPE, session_id=session_id, session_key=key)
        for i in range(12):
            words = " ".join(f"word{i}-{j}" for j in range(120))
            store.append(SCOPE, session_id, user(f"question {i}: {words}. Please keep the weather notes."))
            store.append(SCOPE, session_id, assistant(f"answer {i}: {words}."))


def _compactions(url: str, session_id: str, tmp_path: Path) -> list[dict[str, object]]:
    entries = run_json("sessions", "show", session_id, "--all", "--db", url, cwd=tmp_path)["entries"]
    return [e["payload"] for e in entries if e["kind"] == "compaction"]


@pytest.mark.parametrize("focus", ["", "  "])
def test_an_empty_focus_is_a_usage_error_and_compacts_nothing(store_url: str, tmp_path: Path, focus: str) -> None:
    """``compact --focus "$FOCUS"`` with FOCUS unset stored a compaction whose focus was "" (exit 0)."""
    _long_session(store_url, "long")
    result = run("compact", "long", "--focus", focus, "--db", store_url, cwd=tmp_path, code=2)
    assert "the focus must not be empty" in result.stderr
    assert _compactions(store_url, "long", tmp_path) == []


def test_chat_compact_without_a_focus_compacts_with_none(store_url: str, tmp_path: Path) -> None:
    """``/compact`` with nothing (or only blanks) after it is a compaction without a focus, not an empty one;
    a tab separates the focus as a space does (``/compact\\tweather`` was an unknown command)."""
    for sid, line, focus in (("blank", "/compact   ", None), ("tab", "/compact\tweather", "weather")):
        _long_session(store_url, sid, key=f"k-{sid}")
        run("chat", "--json", "--session", f"k-{sid}", "--db", store_url, cwd=tmp_path, stdin=f"{line}\n")
        assert [p["focus"] for p in _compactions(store_url, sid, tmp_path)] == [focus]


def test_an_error_line_keeps_the_whitespace_inside_a_name(store_url: str, tmp_path: Path) -> None:
    """Every run of whitespace was collapsed to one space: an error naming session 'a  b' named 'a b', another
    session's id, and a path with two spaces or a tab one that does not exist."""
    line = one_error_line(run("sessions", "show", "a  b", "--db", store_url, cwd=tmp_path, code=3))
    assert "'a  b'" in line
    missing = tmp_path / "no  such dir" / "x.db"
    line = one_error_line(run("sessions", "list", "--db", f"sqlite:///{missing}", cwd=tmp_path, code=4))
    assert str(missing) in line
    (tmp_path / "bad\t two  .toml").write_text("x = [", encoding="utf-8")
    result = run("sessions", "list", "--config", "bad\t two  .toml", "--db", store_url, cwd=tmp_path, code=2)
    assert one_error_line(result).startswith("error: cannot read bad\t two  .toml: ")


def test_an_error_line_is_one_line() -> None:
    """Line breaks (and the indentation after them) still become one space; control characters are shown."""
    text = error_line(ValueError("first  line\n\t  second\r\nthird\u2028fourth\x1b[2J "), None)
    assert text == "error: ValueError: first  line second third fourth\\x1b[2J"
    assert error_line(OSError("tab\there"), None) == "error: tab\there"


@pytest.mark.parametrize("args", [("hermes", "install", "--home", ""),
                                  ("openclaw", "install-line", "--service-url", "http://127.0.0.1:1",
                                   "--plugin-dir", "")])
def test_an_empty_folder_option_is_a_usage_error_and_writes_nothing(tmp_path: Path, args: tuple[str, ...]) -> None:
    """``hermes install --home "$HERMES_HOME"`` with the variable unset wrote plugins/ into the working
    directory and pointed at ./config.yaml, exit 0; ``--plugin-dir ''`` printed the bundled plugin's folder."""
    result = run(*args, cwd=tmp_path, code=2)
    assert "an empty path names no folder" in result.stderr and result.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_a_bad_new_id_for_an_import_names_its_option(store_url: str, tmp_path: Path) -> None:
    """A too long ``--session-id`` was refused as "session_id must be 1..255 characters", as a header's own
    bad session_id is (led there by "line 1: header:"): which of the two was meant, the error did not say.
    (An empty one is a usage error before any work: tests/test_cli_strict_values.py.)"""
    _long_session(store_url, "src")
    export = tmp_path / "src.jsonl"
    run("sessions", "export", "src", "-o", str(export), "--db", store_url, cwd=tmp_path)
    for option, value in (("--session-id", "k" * 300), ("--session-key", "k" * 300)):
        result = run("sessions", "import", str(export), option, value, "--db", store_url, cwd=tmp_path, code=1)
        assert one_error_line(result).startswith(f"error: {option}: {option[2:].replace('-', '_')} must be ")
    assert [s["session_id"] for s in run_json("sessions", "list", "--db", store_url, cwd=tmp_path)] == ["src"]


def test_outbox_drain_shows_an_engines_error_escaped(store_url: str, tmp_path: Path) -> None:
    """A failed delivery's line quoted the engine's error raw on stdout: an escape sequence in it acted on
    the terminal, where `outbox status`, the log lines and error lines show it escaped (README)."""
    plugin = tmp_path / "plugins" / "evil"
    plugin.mkdir(parents=True)
    (plugin / "plugin.yaml").write_text("name: evil\nentry: create_engine\n", encoding="utf-8")
    (plugin / "__init__.py").write_text(
        "from engines.legacy import LegacyEngine\n\n"
        "class Evil(LegacyEngine):\n"
        "    def __init__(self, ctx):\n"
        "        super().__init__(ctx)\n"
        "        self.info = self.info.model_copy(update={'id': 'evil'})\n\n"
        "    def commit_turn(self, *args, **kwargs):\n"
        "        raise RuntimeError('boom \\x1b]0;owned\\x07 done')\n\n"
        "def create_engine(ctx):\n"
        "    return Evil(ctx)\n",
        encoding="utf-8",
    )
    (tmp_path / "transcript-store.toml").write_text('[engine]\nslot = "evil"\nplugin_dirs = ["plugins"]\n',
                                                    encoding="utf-8")
    with open_store(store_url) as store:
        store.create_session(SCOPE, session_id="s1")
        turns = Turns(store)
        turns.admit(SCOPE, "s1", user("question"), turn_id="turn-1", engine_id="evil")
        turns.complete(SCOPE, "s1", "turn-1", [{"message": assistant("answer")}], None)
    result = run("outbox", "drain", "--db", store_url, cwd=tmp_path, code=1)
    failed = [line for line in result.stdout.splitlines() if "failed: session s1" in line]
    assert len(failed) == 1 and "\x1b" not in result.stdout, repr(result.stdout)
    assert failed[0].endswith("boom \\x1b]0;owned\\x07 done"), repr(failed[0])
