"""Findings of a new user's walk through the README and the CLI: `upgrade` on a database without a store,
credentials in the OpenClaw service URL, a two-slash SQLite URL, bad TRANSCRIPT_STORE_* values named as
variables and refused by every command, `current`'s advice, doctor on an unreachable database, import
errors at their line, the Hermes install's help defaults."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from test_cli import empty_url, one_error_line, run, run_json

from transcript_store import InvalidInput, StoreConfig
from transcript_store.db import parse_url

__all__ = ["empty_url"]  # a fixture of test_cli's, used here


# ---------------------------------------------------------------------------------------------- upgrade


def test_upgrade_never_creates_a_store(empty_url: str, backend: str, tmp_path: Path) -> None:
    """`upgrade` migrates a store; on an empty PostgreSQL database it created one (init's job, and the
    README says only init and the serving commands create stores)."""
    if backend == "sqlite":  # a file that exists, holds no store and is in WAL mode (another program's)
        path = Path(empty_url.removeprefix("sqlite:///"))
        path.parent.mkdir(parents=True, exist_ok=True)
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("CREATE TABLE theirs (x INTEGER)")
        conn.close()
    line = one_error_line(run("upgrade", "--db", empty_url, cwd=tmp_path, code=4))
    assert "no store at" in line and "transcript-store init" in line, line
    assert run_json("current", "--db", empty_url, cwd=tmp_path, code=4)["revision"] is None
    if backend == "sqlite":
        with sqlite3.connect(path) as conn:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        conn.close()
        assert tables == {"theirs"}, tables
    assert "transcript-store init" in one_error_line(run("current", "--db", empty_url, cwd=tmp_path, code=4))
    run("init", "--db", empty_url, cwd=tmp_path)
    assert run_json("upgrade", "--db", empty_url, cwd=tmp_path)["before"] is not None


# ---------------------------------------------------------------------------------------------- URLs


def test_openclaw_install_line_refuses_credentials_without_showing_them(tmp_path: Path) -> None:
    for url in ("http://u:s3cret@h:1", "https://user@h/", "ftp://u:s3cret@h"):
        line = one_error_line(run("openclaw", "install-line", "--service-url", url, cwd=tmp_path, code=2))
        assert "credentials" in line and "s3cret" not in line, line


@pytest.mark.parametrize("url", ["sqlite://x.db", "sqlite://host/x.db", "sqlite://u:pw@/x.db", "sqlite://h:5/x.db"])
def test_a_sqlite_url_with_a_host_part_is_refused(url: str, tmp_path: Path) -> None:
    """sqlite://x.db was "an in-memory database cannot be shared", sqlite://host/x.db opened x.db."""
    with pytest.raises(InvalidInput, match="three slashes"):
        parse_url(url)
    line = one_error_line(run("--db", url, "init", cwd=tmp_path, code=2))
    assert "three slashes" in line and "pw" not in line, line
    assert not list(tmp_path.iterdir())


def test_the_three_slash_forms_still_open(tmp_path: Path) -> None:
    parse_url("sqlite:///relative.db")
    parse_url(f"sqlite:///{tmp_path / 'abs.db'}")


# ---------------------------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    ("var", "value"),
    [("TRANSCRIPT_STORE_BUSY_TIMEOUT_MS", "abc"), ("TRANSCRIPT_STORE_SQLITE_SYNCHRONOUS", "off"),
     ("TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES", "10"), ("TRANSCRIPT_STORE_RETRY_ATTEMPTS", "0")],
)
def test_a_bad_store_variable_is_named_as_the_variable(var: str, value: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(InvalidInput, match=f"{var}="):
        StoreConfig.from_env()
    line = one_error_line(run("sessions", "list", cwd=tmp_path, env={var: value}, code=2))
    assert f"{var}='{value}'" in line, line


def test_an_argument_keeps_its_own_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSCRIPT_STORE_BUSY_TIMEOUT_MS", "abc")
    with pytest.raises(InvalidInput, match="busy_timeout_ms") as caught:
        StoreConfig.from_env(busy_timeout_ms="xyz")
    assert "TRANSCRIPT_STORE_BUSY_TIMEOUT_MS" not in str(caught.value)


def test_a_bad_url_variable_is_not_quoted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSCRIPT_STORE_URL", "x" * 5000)
    try:
        StoreConfig.from_env()
    except InvalidInput as e:  # whether the URL's length is checked here or on open, never quoted whole
        assert "x" * 100 not in str(e)


@pytest.mark.parametrize(
    ("var", "value"),
    [("TRANSCRIPT_STORE_TOKENIZER", "foo"), ("TRANSCRIPT_STORE_SUMMARIZER", "foo"),
     ("TRANSCRIPT_STORE_ENGINE", " legacy")],
)
@pytest.mark.parametrize("command", [("current",), ("sessions", "list")])
def test_a_bad_settings_variable_is_a_usage_error_for_every_command(
    var: str, value: str, command: tuple[str, ...], tmp_path: Path
) -> None:
    """These were exit 0 on commands that build no engine, though the README names them usage errors."""
    line = one_error_line(run(*command, cwd=tmp_path, env={var: value}, code=2))
    assert var in line, line
    assert not (tmp_path / "transcripts.db").exists()


# ---------------------------------------------------------------------------------------------- doctor, import


def test_doctor_on_an_unreachable_database_says_unknown(tmp_path: Path) -> None:
    url = "postgresql+psycopg://postgres@127.0.0.1:1/nothing_here?connect_timeout=2"
    result = run("doctor", "--db", url, cwd=tmp_path, env={"TRANSCRIPT_STORE_RETRY_ATTEMPTS": "1"}, code=5)
    schema = next(line for line in result.stdout.splitlines() if line.startswith("schema:"))
    assert "None" not in schema and "unknown" in schema, schema


def test_import_errors_name_the_line_of_the_record(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    run("chat", "--session", "s1", "--db", url, cwd=tmp_path, stdin="hello there\n")
    lines = run("sessions", "export", "s1", "--db", url, cwd=tmp_path).stdout.splitlines()
    assert len(lines) >= 3
    entry = json.loads(lines[2])
    entry["created_at"] = entry["created_at"].replace("+00:00", "").replace("Z", "")
    no_offset = tmp_path / "no_offset.jsonl"  # a blank line before it: entry 1 is on line 4
    no_offset.write_text("\n".join([lines[0], "", lines[1], json.dumps(entry), *lines[3:]]) + "\n", encoding="utf-8")
    line = one_error_line(run("--scope", "copy", "sessions", "import", str(no_offset), "--db", url,
                              cwd=tmp_path, code=1))
    assert line.startswith("error: line 4: entry 1") and "UTC offset" in line, line
    first = json.loads(lines[1])
    first["size_bytes"] = 3
    sized = tmp_path / "sized.jsonl"
    sized.write_text("\n".join([lines[0], json.dumps(first), *lines[2:]]) + "\n", encoding="utf-8")
    line = one_error_line(run("--scope", "copy", "sessions", "import", str(sized), "--db", url, cwd=tmp_path, code=1))
    assert line.startswith("error: line 2: entry 0") and "size_bytes" in line, line
    header = json.loads(lines[0])
    header["format"] = "nope"
    bad_head = tmp_path / "head.jsonl"
    bad_head.write_text("\n".join(["", json.dumps(header), *lines[1:]]) + "\n", encoding="utf-8")
    line = one_error_line(run("--scope", "copy", "sessions", "import", str(bad_head), "--db", url,
                              cwd=tmp_path, code=1))
    assert line.startswith("error: line 2: header"), line


# ---------------------------------------------------------------------------------------------- hermes install


def test_hermes_install_help_shows_its_own_defaults(tmp_path: Path) -> None:
    """--help said sqlite:///transcripts.db and scope 'default', which hermes install never uses."""
    text = " ".join(run("hermes", "install", "--help", cwd=tmp_path).stdout.split())
    assert "transcript-store.db" in text and "'hermes'" in text, text
    assert "sqlite:///transcripts.db" not in text and "'default'" not in text


def test_hermes_install_merges_the_context_length_it_prints(tmp_path: Path) -> None:
    """On a fresh home --merge-config wrote 64000 while the printed snippet (and the README) said 128000."""
    import yaml

    printed = run_json("hermes", "install", "--home", str(tmp_path / "a"), cwd=tmp_path)
    merged = run_json("hermes", "install", "--home", str(tmp_path / "b"), "--merge-config", cwd=tmp_path)
    assert merged["config"]["model"]["context_length"] == printed["config"]["model"]["context_length"] == 128000
    home = tmp_path / "c"
    home.mkdir()
    for given, kept in ((32000, 64000), (96000, 96000), (200000, 200000)):
        (home / "config.yaml").write_text(f"model:\n  context_length: {given}\n", encoding="utf-8")
        run("hermes", "install", "--home", str(home), "--merge-config", cwd=tmp_path)
        data = yaml.safe_load((home / "config.yaml").read_text(encoding="utf-8"))
        assert data["model"]["context_length"] == kept, (given, data)


def test_hermes_install_carries_the_engines_settings(tmp_path: Path) -> None:
    """[engine.config.lossless] of the settings file was dropped: the engine ran on defaults inside Hermes."""
    (tmp_path / "transcript-store.toml").write_text(
        "[engine.config.lossless]\nfresh_tail_messages = 12\n\n[engine.config.legacy]\nunused = 1\n", encoding="utf-8")
    info = run_json("hermes", "install", "--home", str(tmp_path / "h"), cwd=tmp_path)
    written = json.loads((Path(info["plugin_dir"]) / "settings.json").read_text(encoding="utf-8"))
    assert written["engine"] == "lossless" and written["engine_config"] == {"fresh_tail_messages": 12}, written
    (tmp_path / "transcript-store.toml").unlink()
    info = run_json("hermes", "install", "--home", str(tmp_path / "h2"), cwd=tmp_path)
    written = json.loads((Path(info["plugin_dir"]) / "settings.json").read_text(encoding="utf-8"))
    assert "engine_config" not in written


def test_hermes_install_refuses_engine_settings_json_cannot_hold_and_writes_nothing(tmp_path: Path) -> None:
    """A TOML date in [engine.config.<engine>] was an internal error (TypeError from json.dumps) after the
    plugin's manifest and __init__.py were written: a plugin without its settings.json, which Hermes then
    loaded on the default engine and database."""
    (tmp_path / "transcript-store.toml").write_text(
        "[engine.config.lossless]\nsince = 1979-05-27T07:32:00Z\n", encoding="utf-8")
    home = tmp_path / "h"
    line = one_error_line(run("hermes", "install", "--home", str(home), cwd=tmp_path, code=2))
    assert "engine.config.lossless" in line and "since" in line and "internal error" not in line, line
    assert not (home / "plugins").exists()


def test_hermes_install_merge_keeps_a_model_named_in_hermes_short_form(tmp_path: Path) -> None:
    """``model: <name>`` (Hermes reads a string as ``{"default": <name>}``) was replaced by the context
    length alone: --merge-config silently dropped the model the user had chosen."""
    import yaml

    home = tmp_path / "h"
    home.mkdir()
    (home / "config.yaml").write_text("model: openai/gpt-4o\n", encoding="utf-8")
    run("hermes", "install", "--home", str(home), "--merge-config", cwd=tmp_path)
    data = yaml.safe_load((home / "config.yaml").read_text(encoding="utf-8"))
    assert data["model"] == {"default": "openai/gpt-4o", "context_length": 128000}, data
