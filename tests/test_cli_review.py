"""Findings of the documentation review: the gateway's scope and its quarantine count, settings refused
by every command, the Hermes merge report, the sessions table at 80 columns, connection refusals."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import random
import shlex
import socket
import subprocess
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from conftest import _admin_exec, _conninfo, _pg_reachable, pg_url
from rich.cells import cell_len
from rich.console import Console
from test_cli import CLI, SCOPE, one_error_line, run, run_json, seed

from transcript_store import InvalidInput, StoreConfig, TranscriptStore, TranscriptStoreError, quarantine
from transcript_store.db import Database
from transcript_store.errors import TransientStoreError
from transcript_store.gateway import GatewayOptions, GatewayReport, Job, _dispatch, run_gateway

# ---------------------------------------------------------------------------------------------- 1, 2: gateway


def test_gateway_help_and_report_name_its_scope(store_url: str, tmp_path: Path) -> None:
    assert "default 'gateway'" in " ".join(run("gateway", "--help", cwd=tmp_path).stdout.split())
    out = run("gateway", "--workers", "1", "--sessions", "1", "--turns", "1", "--no-faults", "--db", store_url,
              cwd=tmp_path).stdout
    line = next(line for line in out.splitlines() if "sessions in scope 'gateway':" in line)
    command = shlex.split(line.split(":", 1)[1])
    assert command[:5] == ["transcript-store", "sessions", "list", "--scope", "gateway"]
    listed = run_json(*command[1:], cwd=tmp_path)  # the printed command, as printed, finds the run
    assert len(listed) == 1 and listed[0]["session_key"].startswith("gateway:")
    assert run_json("sessions", "list", "--db", store_url, cwd=tmp_path) == []  # the default scope: not there


def test_the_gateway_prints_its_sessions_command_on_one_line_at_80_columns(tmp_path: Path) -> None:
    deep = tmp_path / "a-folder-with-a-long-name" / "another-one-below-it"
    url = f"sqlite:///{deep / 'gateway-store.db'}"
    run("init", "--db", url, cwd=tmp_path)
    out = run("gateway", "--workers", "1", "--sessions", "1", "--turns", "1", "--no-faults", "--db", url,
              cwd=tmp_path, env={"COLUMNS": "80"}).stdout
    line = next(line for line in out.splitlines() if "sessions in scope 'gateway':" in line)
    command = shlex.split(line.split(":", 1)[1])
    assert command[-2:] == ["--db", url]  # whole: pasted as printed, it lists this run's store
    assert len(run_json(*command[1:], cwd=tmp_path)) == 1


def test_gateway_counts_only_the_quarantines_of_its_own_run(store_url: str) -> None:
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        store.write(lambda c: quarantine.record(c, "flaky-engine", "assemble", "RuntimeError: an earlier run"))
    options = GatewayOptions(db_url=store_url, engine="nosuch", workers=1, sessions=1, turns=1, faults=False,
                             progress=False)
    report = run_gateway(options, Console(quiet=True))
    assert report.ok, report.problems
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        stored = store.read(lambda c: quarantine.records(c, live_only=False))
    assert report.quarantines >= 1  # this run's unknown engine, quarantined by its worker
    assert report.quarantines == len(stored) - 1  # not the earlier one
    clean = run_gateway(GatewayOptions(db_url=store_url, workers=1, sessions=1, turns=1, faults=False,
                                       progress=False), Console(quiet=True))
    assert clean.ok and clean.quarantines == 0


# ---------------------------------------------------------------------------------------------- 3: env values


# Once, on SQLite: the value is refused before the store is opened (the test checks nothing was written), so
# the backend plays no part; test_a_bad_legacy_config_leaves_no_new_store_behind covers an empty PostgreSQL.
@pytest.mark.parametrize("backend", ["sqlite"])
@pytest.mark.parametrize("var", ["TRANSCRIPT_STORE_TOKENIZER", "TRANSCRIPT_STORE_SUMMARIZER"])
@pytest.mark.parametrize(
    "command",
    [("chat",), ("compact", "s1"), ("outbox", "drain"), ("outbox", "recover"), ("engines", "list"), ("doctor",),
     ("gateway", "--workers", "2", "--sessions", "1", "--turns", "1")],
)
def test_bad_tokenizer_or_summarizer_values_are_usage_errors(store_url: str, tmp_path: Path, var: str,
                                                             command: tuple[str, ...]) -> None:
    seed(store_url)
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        before = store.list_sessions("gateway") + store.list_sessions(SCOPE)
    line = one_error_line(run(*command, "--db", store_url, cwd=tmp_path, stdin="hello\n", code=2,
                              env={var: "bogus"}))
    assert var in line and "'bogus'" in line
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        assert store.list_sessions("gateway") + store.list_sessions(SCOPE) == before


def test_bad_tokenizer_value_creates_no_store(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    run("chat", "--db", f"sqlite:///{path}", cwd=tmp_path, stdin="hello\n", code=2,
        env={"TRANSCRIPT_STORE_TOKENIZER": "bogus"})
    assert not path.exists()


def test_tiktoken_asked_for_but_not_installed_is_a_usage_error_before_any_write(tmp_path: Path) -> None:
    if importlib.util.find_spec("tiktoken") is not None:
        pytest.skip("tiktoken is installed here")
    path = tmp_path / "new.db"
    for command in (("chat",), ("gateway", "--workers", "2", "--sessions", "1", "--turns", "1")):
        line = one_error_line(run(*command, "--db", f"sqlite:///{path}", cwd=tmp_path, stdin="hello\n", code=2,
                                  env={"TRANSCRIPT_STORE_TOKENIZER": "tiktoken"}))
        assert "pip install tiktoken" in line
        assert not path.exists()


def test_the_real_gateway_prints_no_traceback_for_a_bad_value(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "TRANSCRIPT_STORE_SUMMARIZER": "bogus", "COLUMNS": "200"}
    result = subprocess.run([*CLI, "gateway", "--workers", "2", "--sessions", "1", "--turns", "1"], cwd=tmp_path,
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    one_error_line(result)
    assert not (tmp_path / "transcripts.db").exists()


def test_a_gateway_worker_that_cannot_start_reports_one_line(store_url: str, capfd: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the dispatcher's own checks (a library caller of _dispatch): the workers still print no traceback."""
    monkeypatch.setenv("TRANSCRIPT_STORE_TOKENIZER", "bogus")
    options = GatewayOptions(db_url=store_url, workers=2, sessions=1, turns=1, faults=False, progress=False)
    report = GatewayReport(url=store_url, engine="legacy", workers=2, planned_turns=1)
    plan = {"s-1": [Job("s-1", "s-1:turn-0", "hello")]}
    with pytest.raises(TranscriptStoreError, match="worker could not start: InvalidInput: TRANSCRIPT_STORE_TOKENIZER"):
        _dispatch(options, store_url, plan, report, random.Random(1), Console(quiet=True))
    assert not mp.active_children()
    assert "Traceback" not in capfd.readouterr().err


# ---------------------------------------------------------------------------------------------- 4: settings file

READS_NO_SETTINGS = [
    ("sessions", "list"), ("sessions", "show", "s1"), ("sessions", "export", "s1"), ("outbox", "status"),
    ("current",), ("upgrade",), ("init",), ("openclaw", "install-line", "--service-url", "http://127.0.0.1:8765"),
]


# Once, on SQLite: the value is refused before the store is opened (the test checks nothing was written), so
# the backend plays no part; test_a_bad_legacy_config_leaves_no_new_store_behind covers an empty PostgreSQL.
@pytest.mark.parametrize("backend", ["sqlite"])
@pytest.mark.parametrize("command", READS_NO_SETTINGS)
@pytest.mark.parametrize("how", ["option", "variable", "missing variable"])
def test_every_command_refuses_a_named_bad_settings_file(store_url: str, tmp_path: Path, command: tuple[str, ...],
                                                         how: str) -> None:
    seed(store_url)
    bad = tmp_path / "bad.toml"
    bad.write_text("x = 1\n", encoding="utf-8")
    args: tuple[str, ...] = ("--config", str(bad)) if how == "option" else ()
    named = bad if how == "variable" else tmp_path / "nothere.toml"
    env = {} if how == "option" else {"TRANSCRIPT_STORE_CONFIG": str(named)}
    line = one_error_line(run(*command, *args, "--db", store_url, cwd=tmp_path, code=2, env=env))
    assert ("unknown key 'x'" in line) if how != "missing variable" else ("does not exist" in line)


def test_a_named_bad_settings_file_creates_no_store(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    run("init", "--db", f"sqlite:///{path}", cwd=tmp_path, code=2,
        env={"TRANSCRIPT_STORE_CONFIG": str(tmp_path / "nothere.toml")})
    hermes_home = tmp_path / "hermes"
    run("hermes", "install", "--home", str(hermes_home), "--config", str(tmp_path / "x.toml"), cwd=tmp_path, code=2)
    assert not path.exists() and not hermes_home.exists()


@pytest.mark.parametrize(("config", "words"), [
    ('keep_last = "abc"', "keep_last must be an integer"), ("keep_last = 0", "keep_last must be an integer"),
    ("max_sessions = 2.5", "max_sessions must be an integer"), ("keep_lst = 3", "unknown key 'keep_lst'"),
])
def test_a_bad_legacy_engine_config_is_one_typed_error_line(store_url: str, tmp_path: Path, config: str,
                                                            words: str) -> None:
    seed(store_url)
    settings = tmp_path / "transcript-store.toml"
    settings.write_text(f"[engine.config.legacy]\n{config}\n", encoding="utf-8")
    line = one_error_line(run("compact", "s1", "--db", store_url, "--config", str(settings), cwd=tmp_path, code=1))
    assert words in line and "internal error" not in line
    chat = run("chat", "--session", "s1", "--db", store_url, "--config", str(settings), cwd=tmp_path, stdin="hi\n",
               code=1)
    assert words in chat.stderr and "internal error" not in chat.stderr and "Traceback" not in chat.stderr


# Once, on SQLite: the value is refused before the store is opened (the test checks nothing was written), so
# the backend plays no part; test_a_bad_legacy_config_leaves_no_new_store_behind covers an empty PostgreSQL.
@pytest.mark.parametrize("backend", ["sqlite"])
@pytest.mark.parametrize(("config", "words"), [
    ("keep_last = 0", "keep_last must be an integer"), ("max_sessions = 2.5", "max_sessions must be an integer"),
    ("max_sessions = 0", "max_sessions must be an integer"), ('max_sessions = "x"', "max_sessions must be an integer"),
    ("max_sessions = true", "max_sessions must be an integer"), ("keep_lst = 3", "unknown key 'keep_lst'"),
])
def test_chat_refuses_a_bad_legacy_config_before_it_opens_a_session(store_url: str, tmp_path: Path, config: str,
                                                                    words: str) -> None:
    """Any mistake of [engine.config.legacy] stops chat as it starts, as a bad keep_last does: one error
    line, exit 1, no session opened, no turn run (an unknown key or a bad max_sessions let it start, open
    the session and fail every turn on the legacy engine, the fallback; a bad keep_last opened the session)."""
    seed(store_url)
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        before = store.list_sessions("default") + store.list_sessions(SCOPE)
    settings = tmp_path / "transcript-store.toml"
    settings.write_text(f"[engine.config.legacy]\n{config}\n", encoding="utf-8")
    line = one_error_line(run("chat", "--session", "new-key", "--db", store_url, "--config", str(settings),
                              cwd=tmp_path, stdin="hi\n", code=1))
    assert words in line and line.startswith("error: legacy config: ")
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        assert store.list_sessions("default") + store.list_sessions(SCOPE) == before


@pytest.mark.parametrize("config", ["max_sessions = 0", "keep_last = 0"])
def test_the_gateway_refuses_a_bad_legacy_config_before_a_worker_starts(store_url: str, tmp_path: Path,
                                                                        config: str) -> None:
    """The gateway's workers each refused the bad config as their host was built, after a warning line and
    the progress bar: refused once now, before any worker, one error line, exit 1 as chat and serve."""
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        before = store.list_sessions("gateway") + store.list_sessions(SCOPE)
    settings = tmp_path / "transcript-store.toml"
    settings.write_text(f"[engine.config.legacy]\n{config}\n", encoding="utf-8")
    line = one_error_line(run("gateway", "--workers", "1", "--sessions", "1", "--turns", "1", "--db", store_url,
                              "--config", str(settings), cwd=tmp_path, code=1))
    assert line.startswith("error: legacy config: ") and "must be an integer of at least 1, got 0" in line
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        assert store.list_sessions("gateway") + store.list_sessions(SCOPE) == before


@pytest.mark.parametrize("command", [("chat",), ("serve", "--port", "0")])
def test_a_bad_legacy_config_leaves_no_new_store_behind(backend: str, tmp_path: Path,
                                                        command: tuple[str, ...]) -> None:
    """chat and serve refuse a bad [engine.config.legacy] (exit 1) before they create a store, as the gateway
    does: they created and migrated a SQLite one (a new file in the folder of a first try), then refused the
    config; an empty PostgreSQL database hid the config's error behind exit 4 (no schema)."""
    settings = tmp_path / "transcript-store.toml"
    settings.write_text("[engine.config.legacy]\nkeep_lst = 3\n", encoding="utf-8")
    name = f"h11_empty_{uuid.uuid4().hex[:12]}"
    url = f"sqlite:///{tmp_path / 'new.db'}" if backend == "sqlite" else pg_url(name)
    if backend == "postgresql":
        _admin_exec(f"CREATE DATABASE {name}")
    try:
        line = one_error_line(run(*command, "--db", url, "--config", str(settings), cwd=tmp_path, stdin="hi\n",
                                  code=1, env={"TRANSCRIPT_STORE_TOKENS": "tok=s"}))
        assert "unknown key 'keep_lst'" in line
        if backend == "sqlite":
            assert not (tmp_path / "new.db").exists()
        else:
            with psycopg.connect(_conninfo(name)) as conn:
                assert conn.execute("select count(*) from pg_tables where schemaname = 'public'").fetchone() == (0,)
    finally:
        if backend == "postgresql":
            _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_the_gateways_usage_errors_come_before_a_bad_legacy_config(store_url: str, tmp_path: Path) -> None:
    """Counts past a run's bound are a usage error (exit 2) with a bad [engine.config.legacy] too: the legacy
    config's check (exit 1) ran first and turned the usage error into a failure."""
    settings = tmp_path / "transcript-store.toml"
    settings.write_text("[engine.config.legacy]\nkeep_lst = 3\n", encoding="utf-8")
    line = one_error_line(run("gateway", "--workers", "1", "--sessions", "1000", "--turns", "1000", "--db", store_url,
                              "--config", str(settings), cwd=tmp_path, code=2))
    assert "at most" in line and "turns in a run" in line and "legacy config" not in line


@pytest.mark.parametrize("command", [("chat",), ("gateway", "--workers", "1", "--sessions", "1", "--turns", "1")])
def test_a_bad_model_url_is_a_usage_error_before_any_write(store_url: str, tmp_path: Path,
                                                           command: tuple[str, ...]) -> None:
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        before = store.list_sessions("gateway") + store.list_sessions(SCOPE)
    line = one_error_line(run(*command, "--model-url", "api.example.com/v1", "--db", store_url, cwd=tmp_path,
                              stdin="hello\n", code=2))
    assert "model URL must start with http:// or https://" in line
    one_error_line(run(*command, "--db", store_url, cwd=tmp_path, stdin="hello\n", code=2,
                       env={"OPENAI_BASE_URL": "api.example.com/v1"}))
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        assert store.list_sessions("gateway") + store.list_sessions(SCOPE) == before
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    run(*command, "--model-url", "api.example.com/v1", cwd=fresh, stdin="hello\n", code=2)
    assert list(fresh.iterdir()) == []  # no store created either


@pytest.mark.parametrize("url", ["http://localhost:80x/v1", "http://user:pw@localhost:80x/v1",
                                 "http://localhost:99999/v1"])
def test_a_model_url_with_a_bad_port_is_a_usage_error_before_any_write(store_url: str, tmp_path: Path,
                                                                       url: str) -> None:
    """As a database URL's: a port that is not a number (or past 65535) is refused typed, before the chat's
    session is created, not at the first turn (or, with a user:password part, as an internal error)."""
    line = one_error_line(run("chat", "--model-url", url, "--db", store_url, cwd=tmp_path, stdin="hello\n", code=2))
    assert "port" in line and "internal error" not in line and "pw" not in line
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        assert store.list_sessions(SCOPE) == []


def test_a_good_named_settings_file_is_accepted_everywhere(store_url: str, tmp_path: Path) -> None:
    seed(store_url)
    good = tmp_path / "good.toml"
    good.write_text('[engine]\nslot = "lossless"\n', encoding="utf-8")
    assert len(run_json("sessions", "list", "--config", str(good), "--db", store_url, cwd=tmp_path)) == 2
    env = {"TRANSCRIPT_STORE_CONFIG": str(good)}
    assert len(run_json("sessions", "list", "--db", store_url, cwd=tmp_path, env=env)) == 2


# ---------------------------------------------------------------------------------------------- 5: hermes merge


@pytest.mark.parametrize("existing", [None, "model:\n  context_length: 200000\nplugins:\n  enabled: [other]\n"])
def test_hermes_merge_prints_what_it_wrote(tmp_path: Path, existing: str | None) -> None:
    home = tmp_path / "hermes"
    if existing is not None:
        home.mkdir()
        (home / "config.yaml").write_text(existing, encoding="utf-8")
    out = run("hermes", "install", "--home", str(home), "--engine", "lossless", "--merge-config", cwd=tmp_path).stdout
    printed = yaml.safe_load(out.split(":\n", 1)[1])
    written = yaml.safe_load((home / "config.yaml").read_text(encoding="utf-8"))
    assert printed["model"]["context_length"] == written["model"]["context_length"]
    assert printed["plugins"]["enabled"] == written["plugins"]["enabled"]
    assert printed["context"]["engine"] == written["context"]["engine"] == "lossless"
    as_json = run_json("hermes", "install", "--home", str(home), "--merge-config", cwd=tmp_path)
    assert as_json["config"]["model"] == written["model"]


# ---------------------------------------------------------------------------------------------- 6: 80 columns


def _column(lines: list[str], header: str, name: str, after: str) -> str:
    """The text of one column, its folded lines joined: from ``name``'s start to ``after``'s in the header."""
    start, end = header.index(name), header.index(after)
    return "".join(line[start:end].strip() for line in lines)


def test_sessions_list_is_readable_at_80_columns(store_url: str, tmp_path: Path) -> None:
    ids = [f"run-1715000000-{uuid.uuid4().hex[:8]}-conv-{i}" for i in range(2)]
    keys = [f"gateway:1715000000-{sid[15:23]}:{i}" for i, sid in enumerate(ids)]
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        for sid, key in zip(ids, keys, strict=True):
            store.create_session(SCOPE, session_id=sid, session_key=key)
    out = run("sessions", "list", "--db", store_url, cwd=tmp_path, env={"COLUMNS": "80"}).stdout
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in out
    header = next(line for line in lines if "session" in line and "updated" in line)
    body = [line for line in lines[lines.index(header) + 1:] if line.strip() and set(line.strip()) != {"─"}]
    assert _column(body, header, "key", "entries") == "".join(sorted(keys, key=lambda k: ids[keys.index(k)]))
    assert _column(body, header, "session", "key") == "".join(sorted(ids))


def test_sessions_show_all_is_readable_at_80_columns(store_url: str, tmp_path: Path) -> None:
    seed(store_url)
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        every = store.list_entries(SCOPE, "s1")
    out = run("sessions", "show", "s1", "--all", "--db", store_url, cwd=tmp_path, env={"COLUMNS": "80"}).stdout
    lines = out.splitlines()
    assert max(cell_len(line) for line in lines) <= 80 and "…" not in out
    header = next(line for line in lines if "seq" in line and "content" in line)
    body = "".join(line[header.index("content"):].strip(" │") for line in lines[lines.index(header) + 2:])
    for text in ("FIRST", "alternative", "a turn", "its reply", '"note"'):  # every content, whole
        assert text in body, (text, out)
    marks = [line[:header.index("seq")].strip(" │") for line in lines[lines.index(header) + 2:]]
    assert marks.count("*") == sum(e.active for e in every) and marks.count("off") == sum(not e.active for e in every)
    ids = "".join(line[header.index("entry"):header.index("parent")] for line in lines)
    assert all(e.entry_id in ids.replace("│", "").replace(" ", "") for e in every)


def test_escape_sequences_in_messages_are_shown_not_obeyed(store_url: str, tmp_path: Path) -> None:
    hostile = "red \x1b[31mtext\x1b[0m, a title \x1b]0;owned\x07, a rewind\r and a NUL \x00"
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        store.create_session(SCOPE, session_id="esc")
        store.append(SCOPE, "esc", {"role": "user", "content": hostile})
    for every in ((), ("--all",)):
        out = run("sessions", "show", "esc", *every, "--db", store_url, cwd=tmp_path).stdout
        assert not any(c in out for c in "\x1b\x07\r\x00"), repr(out)
        assert "\\x1b[31mtext\\x1b[0m" in out and "\\x1b]0;owned\\x07" in out and "\\x00" in out
    chat = run("chat", "--session", "esc-chat", "--db", store_url, cwd=tmp_path, stdin=hostile + "\n").stdout
    assert "\\x1b[31m" in chat and not any(c in chat for c in "\x1b\x07\x00"), repr(chat)  # the reply quotes it
    shown = run_json("sessions", "show", "esc", "--db", store_url, cwd=tmp_path)  # JSON keeps the text as stored
    assert shown["entries"][0]["message"]["content"] == hostile


def test_an_engine_error_in_chat_is_shown_not_obeyed(store_url: str, tmp_path: Path) -> None:
    """The reason a turn ran on legacy (an engine's error text) and /engine's echo of it are escaped too."""
    plugin = tmp_path / "plugins" / "hostile"
    plugin.mkdir(parents=True)
    (plugin / "plugin.yaml").write_text("name: hostile\nentry: create_engine\n", encoding="utf-8")
    (plugin / "__init__.py").write_text(
        "def create_engine(ctx):\n    raise RuntimeError('boom \\x1b]0;owned\\x07 \\x1b[31mred')\n", encoding="utf-8"
    )
    (tmp_path / "transcript-store.toml").write_text('[engine]\nplugin_dirs = ["plugins"]\n', encoding="utf-8")
    out = run("chat", "--session", "esc", "--engine", "hostile", "--db", store_url, cwd=tmp_path,
              stdin="hello\n/engine\n").stdout
    assert "ran on legacy" in out and "degraded: " in out
    assert not any(c in out for c in "\x1b\x07"), repr(out)
    assert out.count("\\x1b]0;owned\\x07") == 2


def test_an_error_line_shows_an_engine_error_escaped(store_url: str, tmp_path: Path) -> None:
    """A command failing with an engine's exception prints its text as the one error line: escaped too."""
    plugin = tmp_path / "plugins" / "hostile"
    plugin.mkdir(parents=True)
    (plugin / "plugin.yaml").write_text("name: hostile\nentry: create_engine\n", encoding="utf-8")
    (plugin / "__init__.py").write_text(
        "from engines.legacy import LegacyEngine\n\n"
        "class Hostile(LegacyEngine):\n"
        "    def __init__(self, ctx):\n"
        "        super().__init__(ctx)\n"
        "        self.info = self.info.model_copy(update={'id': 'hostile'})\n\n"
        "    def compact(self, **kw):\n"
        "        raise RuntimeError('boom \\x1b]0;owned\\x07')\n\n"
        "def create_engine(ctx):\n"
        "    return Hostile(ctx)\n",
        encoding="utf-8",
    )
    (tmp_path / "transcript-store.toml").write_text('[engine]\nplugin_dirs = ["plugins"]\nslot = "hostile"\n',
                                                    encoding="utf-8")
    with TranscriptStore(config=StoreConfig(url=store_url)) as store:
        store.create_session(SCOPE, session_id="esc")
        store.append(SCOPE, "esc", {"role": "user", "content": "hello"})
    line = one_error_line(run("compact", "esc", "--db", store_url, cwd=tmp_path, code=1))
    assert "boom \\x1b]0;owned\\x07" in line and not any(c in line for c in "\x1b\x07"), repr(line)


# ---------------------------------------------------------------------------------------------- 7: refusals


@pytest.fixture
def pg_server() -> None:
    problem = _pg_reachable()
    if problem is not None:
        pytest.skip(f"PostgreSQL unreachable: {problem}")


def test_a_failed_connection_attempt_is_not_called_transient(pg_server: None, tmp_path: Path) -> None:
    """A database or role that does not exist fails the connection attempt as a server out of slots
    does (psycopg gives no SQLSTATE for either): retried, exit 5, but reported as a failed connection,
    not as a passing error."""
    url = pg_url(f"ts_missing_{uuid.uuid4().hex[:8]}")
    db = Database(StoreConfig(url=url, retry_attempts=2))
    with pytest.raises(TransientStoreError, match=r"cannot connect to the database: .*does not exist"):
        db.read(lambda conn: 1)
    db.dispose()
    line = one_error_line(run("sessions", "list", "--db", url, cwd=tmp_path, code=5,
                              env={"TRANSCRIPT_STORE_RETRY_ATTEMPTS": "2"}))
    assert "transient" not in line and "cannot connect to the database" in line and "does not exist" in line
    gone = Database(StoreConfig(url="postgresql+psycopg://postgres@127.0.0.1:1/x", retry_attempts=3))
    with pytest.raises(TransientStoreError, match="cannot connect to the database"):
        gone.read(lambda conn: 1)
    assert gone.retries == 2
    gone.dispose()


# ---------------------------------------------------------------------------------------------- integrations


@pytest.mark.parametrize("command", [("current",), ("init",), ("sessions", "list"), ("doctor",), ("gateway",)])
def test_a_url_with_a_port_that_is_not_a_number_is_a_usage_error(tmp_path: Path, command: tuple[str, ...]) -> None:
    bad = "postgresql+psycopg://app:s3cret@db-host:5432x/transcripts"  # a typo in the port
    line = one_error_line(run(*command, "--db", bad, cwd=tmp_path, code=2))
    assert "not a database URL" in line and "s3cret" not in line
    one_error_line(run(*command, cwd=tmp_path, code=2, env={"TRANSCRIPT_STORE_URL": bad}))
    with pytest.raises(InvalidInput, match="not a database URL"):  # the library refuses it typed, too
        TranscriptStore(bad)


def test_a_drain_limit_past_the_librarys_bound_is_a_usage_error(store_url: str, tmp_path: Path) -> None:
    for limit in ("1000001", "99999999999999999999"):
        usage = run("outbox", "drain", "--limit", limit, "--db", store_url, cwd=tmp_path, code=2)
        assert "not in the range 1<=x<=1000000" in usage.stderr and "internal error" not in usage.stderr
    run("outbox", "drain", "--limit", "1000000", "--db", store_url, cwd=tmp_path)


def test_install_commands_refuse_an_engine_that_is_not_installed(tmp_path: Path) -> None:
    home = tmp_path / "hermes"
    line = one_error_line(run("hermes", "install", "--home", str(home), "--engine", "nosuch", cwd=tmp_path, code=2))
    assert "'nosuch'" in line and "lossless" in line and not home.exists()
    line = one_error_line(run("openclaw", "install-line", "--service-url", "http://127.0.0.1:8765",
                              "--engine", "nosuch", cwd=tmp_path, code=2))
    assert "'nosuch'" in line


def test_hermes_install_takes_the_url_and_scope_like_every_command(tmp_path: Path) -> None:
    """--db, else TRANSCRIPT_STORE_URL (a relative SQLite path made absolute: Hermes starts elsewhere);
    --scope, else TRANSCRIPT_STORE_SCOPE; neither: the Hermes home's own file and the adapter's scope."""
    home = tmp_path / "hermes"
    settings = home / "plugins" / "transcript_store_hermes" / "settings.json"
    run("hermes", "install", "--home", str(home), cwd=tmp_path,
        env={"TRANSCRIPT_STORE_URL": "sqlite:///rel/x.db", "TRANSCRIPT_STORE_SCOPE": "team-a"})
    written = json.loads(settings.read_text(encoding="utf-8"))
    assert written["db_url"] == f"sqlite:///{(tmp_path / 'rel' / 'x.db').resolve()}" and written["scope"] == "team-a"
    run("hermes", "install", "--home", str(home), "--db", "sqlite:///y.db", "--scope", "team-b", cwd=tmp_path)
    written = json.loads(settings.read_text(encoding="utf-8"))
    assert written["db_url"] == f"sqlite:///{(tmp_path / 'y.db').resolve()}" and written["scope"] == "team-b"
    run("hermes", "install", "--home", str(home), cwd=tmp_path)
    written = json.loads(settings.read_text(encoding="utf-8"))
    assert written["db_url"] == f"sqlite:///{home.resolve() / 'transcript-store.db'}" and "scope" not in written


def test_serve_refuses_bad_tokens_as_usage_errors_and_a_busy_port_before_the_store(tmp_path: Path) -> None:
    for env in ({"TRANSCRIPT_STORE_TOKENS": "tok"}, {"TRANSCRIPT_STORE_TOKENS": "tok=a,tok=b"}):
        run("serve", "--port", "0", cwd=tmp_path, env=env, code=2)
    bad = tmp_path / "tokens.txt"
    bad.write_text("tok=openclaw\n", encoding="utf-8")
    run("serve", "--port", "0", "--tokens", str(bad), cwd=tmp_path, code=2)
    bad.write_bytes(b"tok\xff openclaw\n")  # not UTF-8: a usage error too, not an internal one
    assert "cannot read" in one_error_line(run("serve", "--port", "0", "--tokens", str(bad), cwd=tmp_path, code=2))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        busy = run("serve", "--port", port, cwd=tmp_path, env={"TRANSCRIPT_STORE_TOKENS": "t=s"}, code=1)
        line = one_error_line(busy)
    assert f"cannot listen on 127.0.0.1:{port}" in line
    assert not (tmp_path / "transcripts.db").exists()


def test_sessions_list_survives_a_session_deleted_while_it_lists(
    store: TranscriptStore, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each session was sized in a read of its own after the listing: one deleted in between failed the
    whole list, exit 3 "unknown session". A page and its sizes are one snapshot now."""
    from transcript_store.core import Core

    for sid in ("s0", "s1", "s2"):
        store.create_session(SCOPE, session_id=sid)
    store.append(SCOPE, "s1", {"role": "user", "content": "x"})
    listing = Core.list_sessions

    def list_then_delete(self: Core, scope: str, after: str | None, limit: int) -> list[Any]:
        out = listing(self, scope, after, limit)
        if any(s.session_id == "s1" for s in out):
            store.delete_session(SCOPE, "s1")  # another connection's delete, committed meanwhile
        return out

    monkeypatch.setattr(Core, "list_sessions", list_then_delete)
    listed = run_json("sessions", "list", "--scope", SCOPE, "--db", store_url, cwd=tmp_path)
    assert [s["session_id"] for s in listed] == ["s0", "s1", "s2"]
    assert [s["session_id"] for s in run_json("sessions", "list", "--scope", SCOPE, "--db", store_url,
                                              cwd=tmp_path)] == ["s0", "s2"]
