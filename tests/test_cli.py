"""The `transcript-store` command on both backends: its ``main`` in-process, and the real console script
in subprocesses for the tests marked ``real_script`` (all of them with TRANSCRIPT_STORE_TEST_CLI_SUBPROCESS=1)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from conftest import PG_ADMIN, RUN_ID, _admin_exec, _pg_reachable, assistant, pg_url, user
from fake_openai import FakeOpenAI
from sqlalchemy import inspect as sa_inspect

from transcript_store import (
    IdempotencyConflict,
    InvalidInput,
    InvalidMessage,
    SessionKeyConflict,
    StoreConfig,
    TranscriptStore,
    UnknownSession,
    migrate,
    quarantine,
)
from transcript_store.cli import cli as cli_group
from transcript_store.cli import main
from transcript_store.db import Database
from transcript_store.turns import Turns

ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = shutil.which("transcript-store", path=str(Path(sys.executable).parent))
CLI = [_SCRIPT] if _SCRIPT else [sys.executable, "-m", "transcript_store"]
SCOPE = "default"


#: ``run`` calls the console script's ``main`` in this process (as the script would, with the same
#: argv, environment, working directory, stdin and captured stdout/stderr): a subprocess costs ~1.5 s of
#: interpreter start and imports per command, and this file runs ~180 commands. Tests marked
#: ``real_script`` (and every command when TRANSCRIPT_STORE_TEST_CLI_SUBPROCESS=1) run the installed
#: console script in a subprocess instead.
SUBPROCESS = os.environ.get("TRANSCRIPT_STORE_TEST_CLI_SUBPROCESS") == "1"
_real_script = [False]


@pytest.fixture(autouse=True)
def _script_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    _real_script[0] = SUBPROCESS or request.node.get_closest_marker("real_script") is not None
    yield
    _real_script[0] = False


def _in_process(
    args: tuple[str, ...], cwd: Path, stdin: str | None, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``main(args)`` with the isolation of a subprocess: env, cwd, stdin, stdout and stderr."""
    overrides: dict[str, str | None] = {
        k: None for k in os.environ if k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))
    }
    overrides.update(env)
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with CliRunner().isolation(input=stdin, env=overrides) as (out, err, _):
            try:
                main(list(args))
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess([*CLI, *args], code, stdout, stderr)


def run(
    *args: str, cwd: Path, stdin: str | None = None, code: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the console script (see SUBPROCESS above); assert its exit code."""
    if not _real_script[0]:
        result = _in_process(args, cwd, stdin, {"COLUMNS": "200", **(env or {})})
    else:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
        clean.update({"COLUMNS": "200", **(env or {})})
        result = subprocess.run(
            [*CLI, *args], cwd=cwd, input=stdin, capture_output=True, text=True, env=clean, timeout=300
        )
    assert result.returncode == code, (
        f"{args}: exit {result.returncode}, wanted {code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


def run_json(*args: str, cwd: Path, code: int = 0, env: dict[str, str] | None = None) -> Any:
    """Run with --json and parse stdout."""
    return json.loads(run(*args, "--json", cwd=cwd, code=code, env=env).stdout)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The stderr of a failed command: exactly one `error: ...` line, no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def open_store(url: str) -> TranscriptStore:
    return TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))


def seed(url: str) -> dict[str, str]:
    """s1: a rewritten first message, an off-branch suffix, an event, an idempotency key, an accepted turn."""
    with open_store(url) as store:
        store.create_session(SCOPE, session_id="s1", session_key="agent:s1")
        first = store.append(SCOPE, "s1", user("first"))
        store.append(SCOPE, "s1", assistant("one"))
        store.append(SCOPE, "s1", kind="custom", payload={"note": "event", "n": 1})
        store.append(SCOPE, "s1", user("second \u00e9\u0000"), idempotency_key="ik-2")
        store.branch(SCOPE, "s1", first.entry_id)
        store.append(SCOPE, "s1", assistant("alternative"))
        store.rewrite_entries(SCOPE, "s1", [{"entry_id": first.entry_id, "message": user("FIRST")}])
        turns = Turns(store)
        turns.admit(SCOPE, "s1", user("a turn"), turn_id="turn-1", engine_id="legacy")
        turns.complete(SCOPE, "s1", "turn-1", [{"message": assistant("its reply")}], None)
        store.create_session(SCOPE, session_id="s2")
        store.append(SCOPE, "s2", user("hello s2"))
    return {"first": first.entry_id}


@pytest.fixture
def db(store_url: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A migrated store URL and a working directory for the command."""
    work = tmp_path / "work"
    work.mkdir()
    yield store_url, work


@pytest.fixture
def empty_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A database without any schema: a SQLite path that does not exist, or an empty PostgreSQL database."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh' / 'new.db'}"
        return
    problem = _pg_reachable()
    if problem is not None:
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN}: {problem}")
    name = f"ts_cli_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    _admin_exec(f"CREATE DATABASE {name}")
    try:
        yield pg_url(name)
    finally:
        _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


# ---------------------------------------------------------------------------------------------- help, docs


def _command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], bool]]:
    """(path, is_leaf) of every command and group under ``group``."""
    out: list[tuple[tuple[str, ...], bool]] = []
    for name, command in sorted(group.commands.items()):
        is_group = isinstance(command, click.Group)
        out.append(((*prefix, name), not is_group))
        if is_group:
            out.extend(_command_paths(command, (*prefix, name)))
    return out


COMMANDS = [path for path, _leaf in _command_paths(cli_group)]
LEAVES = [path for path, leaf in _command_paths(cli_group) if leaf]


@pytest.mark.real_script
def test_every_command_has_help(tmp_path: Path) -> None:
    assert {("init",), ("sessions", "import"), ("outbox", "recover"), ("engines", "list"), ("chat",)} <= set(COMMANDS)
    # Every command in process (click's runner), the entry points themselves as real processes.
    runner = CliRunner()
    for path in COMMANDS:
        result = runner.invoke(cli_group, [*path, "--help"], prog_name="transcript-store", terminal_width=200)
        assert result.exit_code == 0, (path, result.output)
        assert f"Usage: transcript-store {' '.join(path)}" in result.output
        assert "--db URL" in result.output and "--json" in result.output, f"{path} lacks the global options"
    script = run("--help", cwd=tmp_path).stdout
    module = subprocess.run([sys.executable, "-m", "transcript_store", "--help"], capture_output=True, text=True)
    assert module.returncode == 0 and module.stdout == script
    assert all(name in script for name in {p[0] for p in COMMANDS})


def test_readme_cli_section_lists_every_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^## CLI\b.*?(?=^## |\Z)", readme, re.S | re.M)
    if match is None:
        pytest.skip("README.md has no '## CLI' section yet")
    section = match.group(0)
    missing = [" ".join(p) for p in LEAVES if f"transcript-store {' '.join(p)}" not in section]
    assert not missing, f"the README's CLI section does not document: {missing}"
    for code in ("0", "1", "2", "3", "4", "5"):
        assert re.search(rf"\b{code}\b", section), f"exit code {code} is not documented"


# ---------------------------------------------------------------------------------------------- schema


def test_init_current_upgrade(empty_url: str, backend: str, tmp_path: Path) -> None:
    line = one_error_line(run("current", "--db", empty_url, cwd=tmp_path, code=4))
    if backend == "postgresql":
        assert run_json("current", "--db", empty_url, cwd=tmp_path, code=4)["state"] == "none"
    one_error_line(run("sessions", "list", "--db", empty_url, cwd=tmp_path, code=4))
    assert "init" in line or "upgrade" in line
    created = run_json("init", "--db", empty_url, cwd=tmp_path)
    assert created["before"] is None and created["revision"] == created["head"]
    report = run_json("current", "--db", empty_url, cwd=tmp_path)
    assert report["state"] == "current" and report["backend"] == backend
    again = run_json("upgrade", "--db", empty_url, cwd=tmp_path)
    assert again["before"] == again["revision"] == again["head"]
    assert "already at revision" in run("--db", empty_url, "init", cwd=tmp_path).stdout
    assert run_json("sessions", "list", "--db", empty_url, cwd=tmp_path) == []


def test_an_empty_postgresql_database_is_advised_init_not_upgrade(
    empty_url: str, backend: str, tmp_path: Path
) -> None:
    """Commands that create a store on SQLite refuse an empty PostgreSQL database (no migration on open):
    their advice said `upgrade`, which refuses a database without a store in turn (exit 4 twice)."""
    if backend != "postgresql":
        pytest.skip("SQLite: these commands create the store")
    for args in (["chat", "--session", "x"], ["sessions", "list"]):
        line = one_error_line(run(*args, "--db", empty_url, cwd=tmp_path, code=4, stdin="hi\n"))
        assert "`transcript-store init" in line and "upgrade --db" not in line, (args, line)
    db = Database(StoreConfig(url=empty_url))
    try:
        migrate.upgrade(db, "0001")
    finally:
        db.dispose()
    line = one_error_line(run("sessions", "list", "--db", empty_url, cwd=tmp_path, code=4))
    assert f"`transcript-store upgrade --db {empty_url}`" in line, line  # a store that is behind: upgrade it


def test_a_schema_behind_is_reported(empty_url: str, backend: str, tmp_path: Path) -> None:
    db = Database(StoreConfig(url=empty_url))
    try:
        migrate.upgrade(db, "0001")
    finally:
        db.dispose()
    report = run_json("current", "--db", empty_url, cwd=tmp_path, code=4)
    assert report["state"] == "behind" and report["revision"] == "0001"
    doctor = run_json("doctor", "--db", empty_url, cwd=tmp_path, code=1)
    assert not doctor["ok"] and doctor["store"]["state"] == "behind"
    # doctor says what to do about it, as `current` does (it said "schema is behind" alone)
    advice = f"schema is behind (revision 0001, head {report['head']}): run `transcript-store upgrade --db {empty_url}`"
    assert doctor["problems"] == [advice]
    assert "upgrade" in one_error_line(run("current", "--db", empty_url, cwd=tmp_path, code=4))
    if backend == "postgresql":  # PostgreSQL never migrates itself on open
        one_error_line(run("sessions", "list", "--db", empty_url, cwd=tmp_path, code=4))
    migrated = run_json("upgrade", "--db", empty_url, cwd=tmp_path)
    assert migrated["before"] == "0001" and migrated["revision"] == migrated["head"]
    assert run_json("doctor", "--db", empty_url, cwd=tmp_path)["ok"]


def test_a_schema_newer_than_the_library_asks_for_a_newer_library(
    empty_url: str, backend: str, tmp_path: Path
) -> None:
    """A store migrated by a newer release: every command says so and exits 4 (upgrade/init crashed
    with alembic's "Can't locate revision" and exit 1; `current` advised `transcript-store upgrade`)."""
    run("init", "--db", empty_url, cwd=tmp_path)
    db = Database(StoreConfig(url=empty_url))
    try:
        db.write(lambda conn: conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'"))
        tables = db.read(lambda conn: sorted(sa_inspect(conn).get_table_names()))
    finally:
        db.dispose()
    for command in (("upgrade",), ("init",), ("current",), ("sessions", "list")):
        line = one_error_line(run(*command, "--db", empty_url, cwd=tmp_path, code=4))
        assert "upgrade the library" in line and "9999" in line, (command, line)
    assert run_json("current", "--db", empty_url, cwd=tmp_path, code=4)["state"] == "ahead"
    doctor = run_json("doctor", "--db", empty_url, cwd=tmp_path, code=1)  # a failed check, as README says
    assert doctor["store"]["state"] == "ahead" and doctor["problems"] == [
        f"schema is ahead (revision 9999, head {doctor['store']['head']}): upgrade the library"
    ]
    # None of it changed the store: still at the newer revision, its rows and tables as they were.
    db = Database(StoreConfig(url=empty_url))
    try:
        version = db.read(lambda conn: conn.exec_driver_sql("SELECT version_num FROM alembic_version").all())
        assert version == [("9999",)]
        assert db.read(lambda conn: sorted(sa_inspect(conn).get_table_names())) == tables
    finally:
        db.dispose()


@pytest.mark.real_script
def test_processes_migrating_one_store_at_once_all_succeed(empty_url: str, backend: str, tmp_path: Path) -> None:
    """Three `init` commands at once: on SQLite the migration's write lock is taken up front, so
    the others wait for it (they failed at once with "database is locked"); on PostgreSQL they queue
    on an advisory lock and find the work done (they replayed migrations and failed). One creates."""
    procs = [
        subprocess.Popen([*CLI, "init", "--db", empty_url], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [(p.wait(120), *p.communicate()) for p in procs]
    assert [code for code, _, _ in outs] == [0, 0, 0], outs
    said = sorted("created" if "created the schema" in out else "already" for _, out, _ in outs)
    assert said == ["already", "already", "created"], outs


def test_sqlite_urls_with_a_home_folder_or_in_uri_mode(tmp_path: Path) -> None:
    """``sqlite:///~/x.db`` made the folder under the home directory and then asked sqlite3 for a file
    under a folder named "~" (exit 5); sqlite3's URI mode made a stray "file:" folder, a read command
    created a store in it, and `hermes install` wrote a path to another file: refused (exit 2)."""
    home = tmp_path / "home"
    home.mkdir()
    run("init", "--db", "sqlite:///~/stores/x.db", cwd=tmp_path, env={"HOME": str(home)})
    assert (home / "stores" / "x.db").is_file() and not (tmp_path / "~").exists()
    with TranscriptStore(f"sqlite:///{home / 'stores' / 'x.db'}") as store:
        store.create_session("default", session_id="s1")
    listed = run_json("sessions", "list", "--db", "sqlite:///~/stores/x.db", cwd=tmp_path, env={"HOME": str(home)})
    assert [s["session_id"] for s in listed] == ["s1"]
    # URI mode: refused (a read command created the store in it, hermes install made its path wrong).
    uri = f"sqlite:///file:{tmp_path / 'u.db'}?uri=true"
    for command in (("init",), ("sessions", "list"), ("hermes", "install", "--home", str(tmp_path / "h"))):
        assert "URI mode" in one_error_line(run(*command, "--db", uri, cwd=tmp_path, code=2)), command
    assert not (tmp_path / "u.db").exists() and not (tmp_path / "file:").exists()


@pytest.mark.real_script
def test_default_store_is_a_file_in_the_working_directory(tmp_path: Path) -> None:
    run("init", cwd=tmp_path)
    assert (tmp_path / "transcripts.db").is_file()
    assert run_json("current", cwd=tmp_path)["url"] == "sqlite:///transcripts.db"
    env = {"TRANSCRIPT_STORE_URL": f"sqlite:///{tmp_path / 'other.db'}"}
    one_error_line(run("current", cwd=tmp_path, env=env, code=4))  # the variable wins over the default


# ---------------------------------------------------------------------------------------------- sessions


def test_sessions_list_and_show(db: tuple[str, Path]) -> None:
    url, work = db
    seed(url)
    listed = {s["session_id"]: s for s in run_json("sessions", "list", "--db", url, cwd=work)}
    assert set(listed) == {"s1", "s2"}
    s1 = listed["s1"]
    assert s1["session_key"] == "agent:s1" and s1["active"] is True and s1["generation"] == 1
    assert s1["entry_count"] == 9 and s1["visible_count"] == 4 and s1["bytes"] > 0
    text = run("--db", url, "sessions", "list", cwd=work).stdout
    assert "agent:s1" in text and "s2" in text
    assert run_json("--scope", "elsewhere", "sessions", "list", "--db", url, cwd=work) == []

    shown = run_json("sessions", "show", "s1", "--db", url, cwd=work)
    contents = [e["message"]["content"] for e in shown["entries"]]
    assert contents == ["FIRST", "alternative", "a turn", "its reply"]
    assert [e["position"] for e in shown["entries"]] == [0, 1, 2, 3]
    by_key = run_json("sessions", "show", "agent:s1", "--db", url, cwd=work)
    assert by_key["entries"] == shown["entries"]
    assert "alternative" in run("sessions", "show", "s1", "--db", url, cwd=work).stdout

    every = run_json("sessions", "show", "s1", "--all", "--db", url, cwd=work)["entries"]
    assert [e["seq"] for e in every] == list(range(9))
    off = [e for e in every if not e["active"]]
    assert {e["kind"] for e in every} == {"message", "custom"}
    assert any(e["kind"] == "custom" and e["payload"] == {"note": "event", "n": 1} for e in off)
    assert any(e.get("message", {}) and e["message"]["content"] == "first" for e in off)
    text = run("sessions", "show", "s1", "--all", "--db", url, cwd=work).stdout
    assert "off" in text and "custom" in text and '"note"' in text


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_an_export_never_overwrites_the_store_it_reads(tmp_path: Path) -> None:
    """``-o`` naming the SQLite store's own file (or its WAL) is a usage error, the store untouched."""
    url = f"sqlite:///{tmp_path / 'transcripts.db'}"
    run("init", "--db", url, cwd=tmp_path)
    seed(url)
    before = (tmp_path / "transcripts.db").read_bytes()
    for target in ("transcripts.db", "./transcripts.db-wal"):
        err = one_error_line(run("sessions", "export", "s1", "-o", target, "--db", url, cwd=tmp_path, code=2))
        assert "own database file" in err
    assert (tmp_path / "transcripts.db").read_bytes() == before
    assert run_json("sessions", "show", "s1", "--db", url, cwd=tmp_path)["entries"]


def test_an_export_never_overwrites_the_store_through_a_link(tmp_path: Path) -> None:
    """A hard link or a symbolic link to the store's file (or to its WAL) is that file: ``-o`` naming one
    is refused as the file itself is. SQLite only: the guard is about the SQLite database file (a
    PostgreSQL store has no file an export could name)."""
    url = f"sqlite:///{tmp_path / 'transcripts.db'}"
    run("init", "--db", url, cwd=tmp_path)
    seed(url)
    db = tmp_path / "transcripts.db"
    links = tmp_path / "elsewhere"
    links.mkdir()
    os.link(db, links / "hard.db")
    (links / "soft.db").symlink_to(db)
    (links / "via").symlink_to(tmp_path, target_is_directory=True)
    before = db.read_bytes()
    live = sqlite3.connect(db)  # another process using the store: its WAL exists meanwhile
    try:
        live.execute("SELECT count(*) FROM sqlite_master").fetchall()
        os.link(tmp_path / "transcripts.db-wal", links / "hard.wal")
        targets = ("elsewhere/hard.db", "elsewhere/hard.wal", "elsewhere/soft.db", "elsewhere/via/transcripts.db")
        for target in targets:
            err = one_error_line(run("sessions", "export", "s1", "-o", target, "--db", url, cwd=tmp_path, code=2))
            assert "own database file" in err, target
    finally:
        live.close()
    assert db.read_bytes() == before and (links / "hard.db").read_bytes() == before
    assert run_json("sessions", "show", "s1", "--db", url, cwd=tmp_path)["entries"]
    # Another file, even one in the same directory named like it, is written as asked.
    run("sessions", "export", "s1", "-o", "elsewhere/transcripts.db", "--db", url, cwd=tmp_path)
    assert (links / "transcripts.db").read_text(encoding="utf-8").startswith("{")


def test_export_import_round_trip(db: tuple[str, Path]) -> None:
    url, work = db
    seed(url)
    first = work / "s1.jsonl"
    run("sessions", "export", "s1", "-o", str(first), "--db", url, cwd=work)
    stdout_export = run("sessions", "export", "agent:s1", "--db", url, cwd=work).stdout
    assert stdout_export == first.read_text(encoding="utf-8")
    header, *entries = _lines(first)
    assert header["session_id"] == "s1" and header["entry_count"] == len(entries) == 9
    assert set(entries[0]) >= {"entry_id", "parent_id", "seq", "kind", "role", "message", "payload",
                               "idempotency_key", "turn_id", "created_at", "active", "position", "generation"}
    assert any(e["idempotency_key"] == "ik-2" for e in entries)
    assert any(e["turn_id"] == "turn-1" for e in entries)
    assert any(e["message"] and e["message"]["content"] == "second \u00e9\u0000" for e in entries)

    # Into another scope with the same ids; then under a new id and key next to the original.
    run("--scope", "copy", "sessions", "import", str(first), "--db", url, cwd=work)
    second = work / "copy.jsonl"
    run("--scope", "copy", "sessions", "export", "s1", "-o", str(second), "--db", url, cwd=work)
    copied_header, *copied = _lines(second)
    assert copied == entries
    assert {**copied_header, "scope": SCOPE} == header

    info = run_json("sessions", "import", str(first), "--session-id", "s1-copy", "--session-key", "agent:copy",
                    "--db", url, cwd=work)
    assert info["session_id"] == "s1-copy" and info["entry_count"] == 9 and info["visible_count"] == 4
    third = work / "again.jsonl"
    run("sessions", "export", "s1-copy", "-o", str(third), "--db", url, cwd=work)
    again_header, *again = _lines(third)
    assert again == entries
    assert {**again_header, "session_id": "s1", "session_key": "agent:s1"} == header
    assert (run_json("sessions", "show", "s1-copy", "--db", url, cwd=work)["entries"]
            == run_json("sessions", "show", "s1", "--db", url, cwd=work)["entries"])

    # Refusals: an existing session, a taken key, a corrupted file; nothing is written.
    assert "already exists" in one_error_line(run("sessions", "import", str(first), "--db", url, cwd=work, code=1))
    one_error_line(run("sessions", "import", str(first), "--session-id", "x1", "--db", url, cwd=work, code=1))
    bad = work / "bad.jsonl"
    broken = [dict(e) for e in entries]
    broken[2]["active"] = not broken[2]["active"]
    bad.write_text("\n".join(json.dumps(r) for r in [header, *broken]) + "\n", encoding="utf-8")
    assert "path to the head" in one_error_line(
        run("sessions", "import", str(bad), "--session-id", "bad", "--session-key", "k:bad", "--db", url,
            cwd=work, code=1)
    )
    bad.write_text(json.dumps(header) + "\n{not json\n", encoding="utf-8")
    one_error_line(run("sessions", "import", str(bad), "--session-id", "bad", "--db", url, cwd=work, code=1))
    run("sessions", "show", "bad", "--db", url, cwd=work, code=3)
    assert {s["session_id"] for s in run_json("sessions", "list", "--db", url, cwd=work)} == {"s1", "s1-copy", "s2"}

    # From stdin.
    run("--scope", "stdin", "sessions", "import", "-", "--db", url, cwd=work, stdin=first.read_text())
    assert run_json("--scope", "stdin", "sessions", "show", "s1", "--db", url, cwd=work)["entries"] == (
        run_json("sessions", "show", "s1", "--db", url, cwd=work)["entries"]
    )


def test_sessions_delete_needs_yes(db: tuple[str, Path]) -> None:
    url, work = db
    seed(url)
    line = one_error_line(run("sessions", "delete", "s2", "--db", url, cwd=work, code=1))
    assert "--yes" in line
    run("sessions", "show", "s2", "--db", url, cwd=work)
    assert run_json("sessions", "delete", "s2", "--yes", "--db", url, cwd=work)["deleted"] == "s2"
    one_error_line(run("sessions", "show", "s2", "--db", url, cwd=work, code=3))
    one_error_line(run("sessions", "delete", "s2", "--yes", "--db", url, cwd=work, code=3))


# ---------------------------------------------------------------------------------------------- outbox


def test_outbox_status_drain_recover(db: tuple[str, Path]) -> None:
    url, work = db
    seed(url)
    with open_store(url) as store:
        store.create_session(SCOPE, session_id="s3")
        turns = Turns(store)
        admission, _ = turns.admit(SCOPE, "s3", user("doomed"), turn_id="turn-3", engine_id="legacy")
        turns.complete(SCOPE, "s3", "turn-3", [{"message": assistant("reply")}], None)
        # A rewrite after acceptance: the turn's closed range is stale, the drain blocks it as evidence.
        store.rewrite_entries(SCOPE, "s3", [{"entry_id": admission.anchor.entry_id, "message": user("edited")}])
    rows = run_json("outbox", "status", "--db", url, cwd=work)
    assert {(r["session_id"], r["turn_id"], r["state"]) for r in rows} == {
        ("s1", "turn-1", "accepted"), ("s3", "turn-3", "accepted")
    }
    assert all({"attempt_count", "last_error", "block_reason"} <= set(r) for r in rows)
    assert "s1" in run("outbox", "status", "--db", url, cwd=work).stdout

    report = run_json("outbox", "drain", "--db", url, cwd=work)
    assert report["committed"] == 1 and report["blocked"] == 1 and report["failed"] == []
    rows = run_json("outbox", "status", "--db", url, cwd=work)
    assert [(r["session_id"], r["state"]) for r in rows] == [("s3", "blocked")]
    assert rows[0]["block_reason"].startswith("stale")
    assert "stale" in run("outbox", "status", "--db", url, cwd=work).stdout

    recovered = run_json("outbox", "recover", "--db", url, cwd=work)
    assert [r["session_id"] for r in recovered] == ["s3"]
    assert run_json("outbox", "recover", "s1", "--db", url, cwd=work)[0]["pending"] == []
    one_error_line(run("outbox", "recover", "nope", "--db", url, cwd=work, code=3))


def test_outbox_recover_counts_the_turns_queued_for_every_engine(db: tuple[str, Path]) -> None:
    """Recovery's report counts every turn left queued, not only the selected engine's: turns queued for
    another engine (here one not installed, whose delivery fails) were reported "pending 0" under the
    default engine, and "pending 2" for the same rows with that engine selected."""
    url, work = db
    with open_store(url) as store:
        store.create_session(SCOPE, session_id="s6")
        turns = Turns(store)
        for t in ("turn-a", "turn-b"):
            turns.admit(SCOPE, "s6", user(f"q {t}"), turn_id=t, engine_id="gone-engine")
            turns.complete(SCOPE, "s6", t, [{"message": assistant(f"a {t}")}], None)
    report = run_json("outbox", "recover", "s6", "--db", url, cwd=work, code=1)
    assert report[0]["pending"] == ["turn-a", "turn-b"]
    assert "pending 2" in run("outbox", "recover", "s6", "--db", url, cwd=work, code=1).stdout


def test_outbox_block_lets_the_later_turns_of_a_poisoned_engine_go_on(db: tuple[str, Path]) -> None:
    """A turn queued for an engine that can never take it (here: not installed) fails every drain; an
    operator blocks it with a reason (--yes), `outbox status` shows who blocked it and why."""
    url, work = db
    with open_store(url) as store:
        store.create_session(SCOPE, session_id="s5")
        turns = Turns(store)
        turns.admit(SCOPE, "s5", user("q"), turn_id="turn-5", engine_id="gone-engine")
        turns.complete(SCOPE, "s5", "turn-5", [{"message": assistant("a")}], None)
    failed = run_json("outbox", "drain", "--db", url, cwd=work, code=1)["failed"]
    assert [(f["turn_id"], f["error"]) for f in failed] == [("turn-5", "engine unavailable")]
    assert "--yes" in one_error_line(run("outbox", "block", "s5", "turn-5", "--reason", "engine retired",
                                         "--db", url, cwd=work, code=1))
    one_error_line(run("outbox", "block", "s5", "turn-9", "--reason", "x", "--yes", "--db", url, cwd=work, code=3))
    assert "'--reason': must not be empty or blank" in run("outbox", "block", "s5", "turn-5", "--reason", " ", "--yes",
                                                            "--db", url, cwd=work, code=2).stderr
    # A short reason with a lone surrogate (a byte that is no UTF-8 on the command line) was told "at most
    # 500 characters of text": the problem is named now, as the usage error (exit 2) it is.
    stray = run("outbox", "block", "s5", "turn-5", "--reason", "retired \udcff", "--yes", "--db", url,
                cwd=work, code=2).stderr
    assert "'--reason'" in stray and "not UTF-8" in stray and "500" not in stray, stray
    assert run_json("outbox", "status", "--db", url, cwd=work)[-1]["state"] == "ready"  # refused: unchanged
    done = run_json("outbox", "block", "s5", "turn-5", "--reason", "engine retired", "--yes", "--db", url, cwd=work)
    assert (done["state"], done["block_reason"]) == ("blocked", "blocked by hand: engine retired")
    row = next(r for r in run_json("outbox", "status", "--db", url, cwd=work) if r["turn_id"] == "turn-5")
    assert (row["state"], row["block_reason"]) == ("blocked", "blocked by hand: engine retired")
    assert run_json("outbox", "drain", "--db", url, cwd=work)["failed"] == []
    # A reason is text for the terminal to show, never to obey: its escape sequences come out escaped.
    with open_store(url) as store:
        Turns(store).admit(SCOPE, "s5", user("q2"), turn_id="turn-6", engine_id="gone-engine")
        Turns(store).complete(SCOPE, "s5", "turn-6", [{"message": assistant("a2")}], None)
    said = run("outbox", "block", "s5", "turn-6", "--reason", "red \x1b[31m alert", "--yes", "--db", url,
               cwd=work).stdout
    shown = run("outbox", "status", "--db", url, cwd=work).stdout
    assert "\x1b" not in said + shown and "\\x1b[31m" in said and "\\x1b[31m" in shown


# ---------------------------------------------------------------------------------------------- engines, doctor


def test_engines_list_and_doctor(db: tuple[str, Path], backend: str) -> None:
    url, work = db
    listed = run_json("engines", "list", "--db", url, cwd=work)
    assert listed["selected"] == "legacy" and listed["selection_source"] == "default"
    legacy = next(e for e in listed["engines"] if e["id"] == "legacy")
    assert legacy["selected"] and legacy["valid"] and legacy["source"] == "bundled"
    assert legacy["fence"] == "before-current-turn-entry-v1"
    assert legacy["idempotency"] == "atomic-idempotent-v1"
    assert legacy["owns_compaction"] is False and legacy["location"]
    assert "legacy" in run("engines", "list", "--db", url, cwd=work).stdout

    report = run_json("doctor", "--db", url, cwd=work)
    assert report["ok"] and report["engine"] == {"selected": "legacy", "source": "default", "valid": True,
                                                 "reason": None}
    assert report["store"]["state"] == "current" and report["store"]["revision"] == report["store"]["head"]
    assert report["store"]["settings"]["backend"] == backend
    if backend == "sqlite":
        assert report["store"]["settings"]["journal_mode"] == "wal"
    else:
        assert report["store"]["settings"]["server_version"]
    assert report["quarantine"] == []
    assert "ok" in run("doctor", "--db", url, cwd=work).stdout

    # A quarantine recorded by a live process (this test) shows up in another process's doctor.
    with open_store(url) as store:
        store.write(lambda c: quarantine.record(c, "flaky-engine", "assemble", "RuntimeError: boom"))
    records = run_json("doctor", "--db", url, cwd=work)["quarantine"]
    assert [(r["engine_id"], r["operation"], r["alive"]) for r in records] == [("flaky-engine", "assemble", True)]
    assert "flaky-engine" in run("doctor", "--db", url, cwd=work).stdout
    # The reason is an engine's error text: its escape sequences are shown, never obeyed (as outbox status).
    with open_store(url) as store:
        store.write(lambda c: quarantine.record(c, "flaky-engine", "assemble", "RuntimeError: \x1b]0;owned\x07"))
    shown = run("doctor", "--db", url, cwd=work).stdout
    assert "\x1b" not in shown and "\\x1b]0;owned\\x07" in shown
    # So is a plugin's load error in the engines table (doctor's and engines list's).
    plugin = work / "plugins" / "hostile"
    plugin.mkdir(parents=True)
    (plugin / "plugin.yaml").write_text("name: hostile\nentry: create_engine\n", encoding="utf-8")
    (plugin / "__init__.py").write_text("raise RuntimeError('boom \\x1b]0;owned\\x07')\n", encoding="utf-8")
    (work / "transcript-store.toml").write_text('[engine]\nplugin_dirs = ["plugins"]\n', encoding="utf-8")
    for command in (("doctor",), ("engines", "list")):
        shown = run(*command, "--db", url, cwd=work).stdout
        assert "hostile" in shown and "\x1b" not in shown and "\\x1b]0;owned\\x07" in shown, repr(shown)
    (work / "transcript-store.toml").unlink()

    env = {"TRANSCRIPT_STORE_ENGINE": "missing-engine"}
    bad = run_json("doctor", "--db", url, cwd=work, code=1, env=env)
    assert not bad["ok"] and bad["engine"]["source"] == "env" and not bad["engine"]["valid"]
    assert run_json("engines", "list", "--db", url, cwd=work, env=env)["selected"] == "missing-engine"


@pytest.mark.real_script
def test_passwords_are_masked(db: tuple[str, Path], backend: str) -> None:
    url, work = db
    if backend != "postgresql":
        pytest.skip("SQLite URLs carry no password")
    secret_url = url.replace("postgres@", "postgres:s3cr3t-pw@")  # trust auth ignores it
    for args in (("current",), ("doctor",), ("init",)):
        result = run(*args, "--db", secret_url, cwd=work)
        assert "s3cr3t-pw" not in result.stdout + result.stderr and "***" in result.stdout
    dead = secret_url.replace(":5432/", ":1/")
    for args in (("sessions", "list"), ("doctor",)):
        result = run(*args, "--db", dead, cwd=work, code=5)
        assert "s3cr3t-pw" not in one_error_line(result) + result.stdout


# ---------------------------------------------------------------------------------------------- compact, chat


def test_compact(db: tuple[str, Path]) -> None:
    url, work = db
    with open_store(url) as store:
        store.create_session(SCOPE, session_id="long")
        for i in range(12):
            words = " ".join(f"word{i}-{j}" for j in range(120))
            store.append(SCOPE, "long", user(f"question {i}: {words}. Please keep the weather notes."))
            store.append(SCOPE, "long", assistant(f"answer {i}: {words}."))
    result = run_json("compact", "long", "--focus", "weather", "--db", url, cwd=work)
    assert result["ok"] and result["compacted"] and result["tokens_after"] < result["tokens_before"]
    every = run_json("sessions", "show", "long", "--all", "--db", url, cwd=work)["entries"]
    marker = [e for e in every if e["kind"] == "compaction"]
    assert len(marker) == 1 and marker[0]["payload"]["focus"] == "weather"
    assert "compacted" in run("compact", "long", "--db", url, cwd=work).stdout
    one_error_line(run("compact", "nope", "--db", url, cwd=work, code=3))


@pytest.mark.parametrize("command", [("sessions", "list"), ("init",), ("doctor",), ("current",)])
def test_a_sqlite_url_naming_a_directory_is_a_usage_error(tmp_path: Path, command: tuple[str, ...]) -> None:
    """`--db sqlite:///somedir`: sqlite3's "unable to open database file" came out as a database down,
    exit 5. The path is the user's mistake: exit 2, one line saying what it names, nothing created."""
    (tmp_path / "somedir").mkdir()
    line = one_error_line(run(*command, "--db", f"sqlite:///{tmp_path / 'somedir'}", cwd=tmp_path, code=2))
    assert "names a directory" in line, line
    assert list((tmp_path / "somedir").iterdir()) == []


def test_compact_with_an_engine_that_cannot_be_used_compacts_nothing(db: tuple[str, Path]) -> None:
    """`compact --engine lossless` with a lossless that fails to load (a bad key in its config) compacted
    with legacy instead and answered "compacted", exit 0: a legacy compaction written into the session
    the user asked lossless for. Now exit 1, one line naming the engine, and nothing written."""
    url, work = db
    with open_store(url) as store:
        store.create_session(SCOPE, session_id="long")
        for i in range(8):
            store.append(SCOPE, "long", user(f"question {i}: " + " ".join(f"w{i}-{j}" for j in range(100))))
            store.append(SCOPE, "long", assistant(f"answer {i}"))
    (work / "bad.toml").write_text("[engine.config.lossless]\nno_such_key = 1\n")
    before = run_json("sessions", "show", "long", "--all", "--db", url, cwd=work)["entries"]
    line = one_error_line(
        run("compact", "long", "--engine", "lossless", "--config", "bad.toml", "--db", url, cwd=work, code=1)
    )
    assert "lossless" in line and "nothing compacted" in line, line
    assert run_json("sessions", "show", "long", "--all", "--db", url, cwd=work)["entries"] == before


def test_compact_with_an_unknown_engine_writes_no_quarantine(db: tuple[str, Path]) -> None:
    """`compact --engine nosuch` loaded the id through the runtime, which quarantined it and wrote a
    quarantine record of the command's own process: a command that failed, exit 1, wrote a row (the
    hostile-input CLI campaign caught it now and then, when it drew such a name). Now refused as unknown
    before anything loads: exit 1, one line naming the id and the known engines, no row anywhere."""
    url, work = db
    with open_store(url) as store:
        store.create_session(SCOPE, session_id="long")
        store.append(SCOPE, "long", user("a question"))
    for name in ("nosuch", "\u00af"):
        line = one_error_line(run("compact", "long", "--engine", name, "--db", url, cwd=work, code=1))
        assert "unknown context engine" in line and "legacy" in line and "nothing compacted" in line, line
    with open_store(url) as store:
        assert store.read(lambda c: c.conn.exec_driver_sql("SELECT count(*) FROM ts_quarantine").scalar()) == 0


@pytest.mark.parametrize("encoding", ["ascii", "latin-1", "ascii:replace"])
def test_output_to_a_stdout_that_cannot_carry_every_character(db: tuple[str, Path], encoding: str) -> None:
    """Under a C or Latin-1 locale (here PYTHONIOENCODING), `--json` of a session holding non-ASCII text
    failed as an "internal error" (UnicodeEncodeError), or with `:replace` wrote `?` into the data. JSON
    output now escapes non-ASCII characters (the same document), and text output that the encoding
    cannot carry fails with one line saying so, exit 1."""
    url, work = db
    text = "caf\u00e9 \u4e2d\u6587 \U0001f600"
    with open_store(url) as store:
        store.create_session(SCOPE, session_id="intl")
        store.append(SCOPE, "intl", user(text))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    env.update({"COLUMNS": "200", "PYTHONIOENCODING": encoding})

    def cli(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([*CLI, "--db", url, "--scope", SCOPE, *args], cwd=work, capture_output=True,
                              env=env, timeout=300)

    for args in (["--json", "sessions", "show", "intl"], ["--json", "sessions", "show", "intl", "--all"],
                 ["--json", "sessions", "list"]):
        done = cli(*args)
        assert done.returncode == 0, done.stderr
        assert done.stdout.isascii(), done.stdout[:300]
        if "list" not in args:
            assert json.loads(done.stdout)["entries"][0]["message"]["content"] == text
    if not encoding.endswith(":replace"):  # a table of the text: refused in one line, not an internal error
        done = cli("sessions", "show", "intl")
        lines = [line for line in done.stderr.decode().splitlines() if line.strip()]
        assert done.returncode == 1 and len(lines) == 1 and "cannot carry" in lines[0], done.stderr


def _events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_chat_with_slash_commands(db: tuple[str, Path]) -> None:
    url, work = db
    script = "hello there\nplease look up the weather in Paris\n/history\n/engine\n/branch\nhello again\n" \
             "/compact weather\n/nonsense\n/quit\nnever sent\n"
    result = run("chat", "--json", "--db", url, cwd=work, stdin=script, code=1)  # the unknown command failed
    events = _events(result.stdout)
    kinds = [e["event"] for e in events]
    assert kinds.count("reply") == 3 and kinds[-1] == "quit"
    replies = [e for e in events if e["event"] == "reply"]
    assert all(r["engine_id"] == "legacy" and r["commit_status"] == "committed" for r in replies)
    assert "weather in Paris" in replies[1]["reply"]
    assert any(e["event"] == "step" and e["message"].get("tool_calls") for e in events)  # the tool loop ran
    history = next(e for e in events if e["event"] == "history")["entries"]
    assert history[0]["message"]["content"] == "hello there"
    engine = next(e for e in events if e["event"] == "engine")
    assert engine["selected"] == "legacy" and engine["last_turn_engine"] == "legacy"
    assert engine["last_turn_degraded_reason"] is None
    branch = next(e for e in events if e["event"] == "branch")
    assert branch["moved"] is True
    assert next(e for e in events if e["event"] == "compact")["ok"] is True
    assert "unknown command /nonsense" in result.stderr

    every = run_json("sessions", "show", "cli:chat", "--all", "--db", url, cwd=work)["entries"]
    visible = run_json("sessions", "show", "cli:chat", "--db", url, cwd=work)["entries"]
    users = [e["message"]["content"] for e in visible if e["role"] == "user"]
    assert users == ["hello there", "hello again"]  # the Paris turn is off the branch now
    assert any(not e["active"] and e["message"] and e["message"]["content"] == "please look up the weather in Paris"
               for e in every)
    assert "never sent" not in json.dumps(every)

    # The conversation is persisted: a second chat continues it; text output for people.
    text = run("chat", "--db", url, cwd=work, stdin="one more\n").stdout
    assert "assistant:" in text and "cli:chat" in text
    assert run_json("sessions", "show", "cli:chat", "--db", url, cwd=work)["entries"][-1]["role"] == "assistant"


def test_chat_through_an_openai_compatible_endpoint(db: tuple[str, Path]) -> None:
    url, work = db
    with FakeOpenAI(api_key="sk-test-key") as server:
        result = run("chat", "--model-url", server.base_url, "--model", "fake-model", "--api-key", "sk-test-key",
                     "--session", "k:remote", "--db", url, cwd=work, stdin="hi there\n/quit\n")
        assert server.chat_requests and server.chat_requests[-1]["model"] == "fake-model"
    assert "model fake-model at http://127.0.0.1" in result.stdout and "assistant:" in result.stdout
    assert "sk-test-key" not in result.stdout + result.stderr
    shown = run_json("sessions", "show", "k:remote", "--db", url, cwd=work)["entries"]
    assert [e["role"] for e in shown] == ["user", "assistant"]
    with FakeOpenAI(api_key="sk-test-key") as server:  # a wrong key: the turn fails, one error line, exit 1
        failed = run("chat", "--model-url", server.base_url, "--api-key", "wrong", "--session", "k:remote",
                     "--db", url, cwd=work, stdin="hi again\n", code=1)
    assert all(line.startswith("error: ") for line in failed.stderr.splitlines() if line.strip())
    assert "wrong" not in failed.stderr


def test_chat_degrades_an_unknown_engine(db: tuple[str, Path]) -> None:
    url, work = db
    result = run("chat", "--engine", "no-such-engine", "--session", "k:2", "--json", "--db", url, cwd=work,
                 stdin="hi\n/engine\n")
    events = _events(result.stdout)
    reply = next(e for e in events if e["event"] == "reply")
    assert reply["engine_id"] == "legacy" and "no-such-engine" in reply["degraded_reason"]
    engine = next(e for e in events if e["event"] == "engine")
    assert engine["selected"] == "no-such-engine" and engine["source"] == "argument"
    assert engine["last_turn_engine"] == "legacy" and engine["last_turn_degraded_reason"]


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.real_script
def test_error_paths(db: tuple[str, Path], backend: str) -> None:
    url, work = db
    line = one_error_line(run("sessions", "show", "nope", "--db", url, cwd=work, code=3))
    assert "unknown session 'nope'" in line
    debug = run("sessions", "show", "nope", "--db", url, "--debug", cwd=work, code=3)
    assert "Traceback" in debug.stderr and "UnknownSession" in debug.stderr
    # Global options work before and after the command name.
    assert run_json("--db", url, "--json", "sessions", "list", cwd=work) == []


@pytest.mark.real_script
def test_error_paths_before_the_store(tmp_path: Path) -> None:
    """Refused before any store is opened: once, not once a backend (CI time: each is a process)."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    for bad in ("not a url", "mysql://u@h/x", "sqlite://"):
        assert "--db" in one_error_line(run("sessions", "list", "--db", bad, cwd=tmp_path, code=2))
    one_error_line(run("sessions", "list", "--db", "postgresql+psycopg://postgres@127.0.0.1:1/x", cwd=tmp_path, code=5))
    usage = run("sessions", "show", "--db", url, cwd=tmp_path, code=2)  # click's usage error
    assert "Missing argument" in usage.stderr
    run("sessions", "show", "s1", "--config", str(tmp_path / "missing.toml"), "--db", url, cwd=tmp_path, code=2)
    assert not (tmp_path / "store.db").exists()  # none of them made a store


# ---------------------------------------------------------------------------------------------- gateway


def test_gateway_command(db: tuple[str, Path]) -> None:
    url, work = db
    report = run_json("gateway", "--workers", "2", "--sessions", "2", "--turns", "2", "--seed", "5", "--db", url,
                      cwd=work)
    assert report["ok"] is True and report["planned_turns"] == 4
    assert report["committed"] + report["blocked"] >= 1


# ---------------------------------------------------------------------------------------------- import refusals


def test_import_refuses_bad_exports_before_writing(store_url: str) -> None:
    """Library level (no subprocess): every inconsistency is a typed error and nothing is written."""
    seed(store_url)
    with open_store(store_url) as store:
        header, entries = store.export_session(SCOPE, "s1")

        def refused(h: dict[str, Any], es: list[dict[str, Any]], words: str, error: type[Exception] = InvalidInput):
            with pytest.raises(error, match=words):
                store.import_session("other", h, es, session_id="imported")
            with pytest.raises(UnknownSession):
                store.get_session("other", "imported")

        def edit(i: int, **changes: Any) -> list[dict[str, Any]]:
            return [({**e, **changes} if j == i else e) for j, e in enumerate(entries)]

        refused({**header, "format": "other/1"}, entries, "format")
        refused({**header, "entry_count": 8}, entries, "entries")
        refused({**header, "visible_count": 3}, entries, "visible")
        refused({**header, "head_entry_id": "nope"}, entries, "head_entry_id")
        refused({**header, "generation": "1"}, entries, "generation")
        refused({**header, "extra": 1}, entries, "extra")
        refused(header, edit(3, seq=7), "seq")
        refused(header, edit(1, parent_id="ghost"), "parent")
        refused(header, edit(1, position=5), "position")
        refused(header, edit(1, entry_id=entries[0]["entry_id"]), "twice")
        refused(header, edit(0, message={"role": "user"}), "content", InvalidMessage)
        refused(header, edit(0, role="assistant"), "role")
        refused(header, edit(2, kind="bogus"), "kind")
        refused(header, edit(2, created_at="yesterday"), "created_at")
        refused(header, edit(2, created_at="2024-01-01T00:00:00"), "UTC offset")
        # Past year 9999 in UTC: stored, then no read could make a datetime of it.
        refused(header, edit(2, created_at="9999-12-31T23:59:59.999999-05:00"), "9999")
        refused({**header, "updated_at": "9999-12-31T23:59:59.999999-00:01"}, entries, "9999")
        # Past the INTEGER columns (a generation at the top could not be rewritten once more).
        refused({**header, "generation": 2**31 - 1}, entries, "generation")
        refused({**header, "generation": 2**63}, entries, "generation")
        refused(header, edit(1, position=2**31), "position")
        refused(header, edit(1, size_bytes=2**40), "size_bytes")
        # Before the epoch: stored times are non-negative microseconds since it.
        refused({**header, "created_at": "1969-12-31T23:59:59.999999+00:00"}, entries, "1970")
        refused(header, edit(2, created_at="1969-07-20T20:17:40+00:00"), "1970")
        refused(header, edit(1, idempotency_key="ik-2"), "idempotency_key")
        refused(header, edit(0, generation=2), "generation")
        refused(header, [*entries[:-1], "not an object"], "JSON object")
        # A good import of the same data then succeeds, and is refused a second time.
        info = store.import_session("other", header, entries, session_id="imported")
        assert info.entry_count == 9 and info.head_entry_id == header["head_entry_id"]
        with pytest.raises(IdempotencyConflict):
            store.import_session("other", header, entries, session_id="imported")
        with pytest.raises(SessionKeyConflict):
            store.import_session("other", header, entries, session_id="imported-2")
        assert store.export_session("other", "imported")[1] == entries


# ---------------------------------------------------------------------------------- settings and option refusals


def test_a_missing_config_file_named_by_the_environment_is_a_usage_error(tmp_path: Path) -> None:
    env = {"TRANSCRIPT_STORE_CONFIG": str(tmp_path / "missing.toml")}
    line = one_error_line(run("engines", "list", "--db", f"sqlite:///{tmp_path / 'x.db'}", cwd=tmp_path, code=2,
                              env=env))
    assert "missing.toml" in line and "does not exist" in line


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[engine]\nplugin_dirs = "./my-engines"\n', "engine.plugin_dirs must be a list"),
        ("turn = 3\n", "turn must be a table"),
        ("engine = 5\n", "engine must be a table"),
        ('engine = "lossless"\n', "engine must be a table"),
        ('slot = "lossless"\n', "unknown key 'slot'"),
        ('[turn]\nengine = "lossless"\n', "unknown key turn.engine"),
        ('[turn]\nengine_source = "env"\n', "unknown key turn.engine_source"),
        ("[engine]\nslot = 5\n", "engine.slot must be a non-empty string"),
        ('[engine]\nslots = "lossless"\n', "unknown key engine.slots"),
        ("[engine.config]\nlegacy = 3\n", "engine.config.legacy must be a table"),
        ('[turn]\ntoken_budget = "9000"\n', "turn.token_budget"),
        ("[turn]\ntoken_budget = " + "9" * 5000 + "\n", "an integer of more than"),
    ],
)
def test_bad_config_files_are_usage_errors(tmp_path: Path, text: str, words: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text, encoding="utf-8")
    line = one_error_line(run("engines", "list", "--config", str(config), "--db", f"sqlite:///{tmp_path / 'x.db'}",
                              cwd=tmp_path, code=2))
    assert words in line and "internal error" not in line


def test_the_engine_slot_of_the_config_file_reports_its_source(tmp_path: Path) -> None:
    (tmp_path / "transcript-store.toml").write_text('[engine]\nslot = "lossless"\n', encoding="utf-8")
    listed = run_json("engines", "list", "--db", f"sqlite:///{tmp_path / 'x.db'}", cwd=tmp_path)
    assert (listed["selected"], listed["selection_source"]) == ("lossless", "config")


@pytest.mark.parametrize(
    ("var", "value", "words"),
    [
        ("TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES", "abc", "TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES='abc'"),
        ("TRANSCRIPT_STORE_RETRY_ATTEMPTS", "0", "TRANSCRIPT_STORE_RETRY_ATTEMPTS='0'"),
        ("TRANSCRIPT_STORE_AUTO_UPGRADE", "y", "TRANSCRIPT_STORE_AUTO_UPGRADE"),
        ("TRANSCRIPT_STORE_PG_GENERIC_PLANS", "maybe", "TRANSCRIPT_STORE_PG_GENERIC_PLANS"),
        ("TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS", "maybe", "TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS"),
    ],
)
def test_bad_store_settings_in_the_environment_are_usage_errors(tmp_path: Path, var: str, value: str,
                                                                words: str) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    line = one_error_line(run("sessions", "list", "--db", url, cwd=tmp_path, code=2, env={var: value}))
    assert line.startswith("error: invalid store setting") and words in line


def test_boolean_store_settings_accept_only_known_words(monkeypatch: pytest.MonkeyPatch) -> None:
    for word, expected in [("1", True), ("Yes", True), ("ON", True), (" true ", True), ("0", False),
                           ("no", False), ("Off", False), ("FALSE", False)]:
        monkeypatch.setenv("TRANSCRIPT_STORE_AUTO_UPGRADE", word)
        assert StoreConfig.from_env().auto_upgrade is expected, word
    for word in ("y", "n", "maybe", "2", "  "):
        monkeypatch.setenv("TRANSCRIPT_STORE_AUTO_UPGRADE", word)
        with pytest.raises(InvalidInput, match="TRANSCRIPT_STORE_AUTO_UPGRADE"):
            StoreConfig.from_env()


def test_sqlite_durability_accepts_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    for word, expected in [("normal", "NORMAL"), (" Full ", "FULL"), ("NORMAL", "NORMAL")]:
        monkeypatch.setenv("TRANSCRIPT_STORE_SQLITE_SYNCHRONOUS", word)
        assert StoreConfig.from_env().sqlite_synchronous == expected, word
    monkeypatch.setenv("TRANSCRIPT_STORE_SQLITE_SYNCHRONOUS", "off")
    with pytest.raises(InvalidInput, match="TRANSCRIPT_STORE_SQLITE_SYNCHRONOUS='off'"):
        StoreConfig.from_env()


def test_an_empty_scope_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    run("init", "--db", url, cwd=tmp_path)
    assert "scope" in run("--scope", "", "sessions", "list", "--db", url, cwd=tmp_path, code=2).stderr
    assert "scope" in run("sessions", "list", "--scope", "", "--db", url, cwd=tmp_path, code=2).stderr


@pytest.mark.parametrize("threshold", ["nan", "inf", "-inf", "-0.5", "0", "1.5"])
def test_hermes_install_refuses_a_bad_threshold(tmp_path: Path, threshold: str) -> None:
    home = tmp_path / "home"
    result = run("hermes", "install", "--home", str(home), f"--threshold={threshold}", cwd=tmp_path, code=2)
    assert "--threshold" in result.stderr
    assert not home.exists()


def test_hermes_install_accepts_a_fraction_or_tokens(tmp_path: Path) -> None:
    for threshold, home in (("0.8", tmp_path / "a"), ("1", tmp_path / "b"), ("64000", tmp_path / "c")):
        run("hermes", "install", "--home", str(home), "--threshold", threshold, cwd=tmp_path)
        settings = json.loads(next(home.glob("plugins/*/settings.json")).read_text(encoding="utf-8"))
        assert settings["threshold_percent"] == float(threshold)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("model: [1\n", "invalid YAML"),
        ("model:\n  context_length: lots\n", "model.context_length"),
        ("model:\n  context_length: [1]\n", "model.context_length"),
        ("- a list\n", "not a YAML mapping"),
        ("other: " + "9" * 5000 + "\n", "an integer of more than"),
    ],
)
def test_hermes_merge_config_refuses_a_bad_config_before_writing(tmp_path: Path, text: str, words: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text(text, encoding="utf-8")
    line = one_error_line(run("hermes", "install", "--home", str(home), "--merge-config", cwd=tmp_path, code=2))
    assert words in line and "internal error" not in line
    assert [p.name for p in home.iterdir()] == ["config.yaml"]
    assert (home / "config.yaml").read_text(encoding="utf-8") == text



def test_an_export_saved_with_a_byte_order_mark_imports(db: tuple[str, Path]) -> None:
    """Editors on Windows save UTF-8 with a byte order mark: the import refused such a file ("Unexpected UTF-8
    BOM") from a path and from stdin. The mark is no part of the JSON lines; it is skipped."""
    url, work = db
    seed(url)
    plain = work / "s1.jsonl"
    run("sessions", "export", "s1", "-o", str(plain), "--db", url, cwd=work)
    marked = work / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    run("--scope", "from-file", "sessions", "import", str(marked), "--db", url, cwd=work)
    run("--scope", "from-stdin", "sessions", "import", "-", "--db", url, cwd=work,
        stdin="\ufeff" + plain.read_text(encoding="utf-8"))
    for scope in ("from-file", "from-stdin"):
        again = work / f"{scope}.jsonl"
        run("--scope", scope, "sessions", "export", "s1", "-o", str(again), "--db", url, cwd=work)
        assert _lines(again)[1:] == _lines(plain)[1:]

@pytest.mark.parametrize("content", [b"\xff\xfe{\"x\": 1}\n", ("[" * 100_000 + "]" * 100_000 + "\n").encode(),
                                     b'{"x": ' + b"9" * 5000 + b"}\n"])
def test_import_of_an_unreadable_file_is_one_error_line(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    db_file = tmp_path / "x.db"
    line = one_error_line(run("sessions", "import", str(bad), "--db", f"sqlite:///{db_file}", cwd=tmp_path, code=1))
    assert "internal error" not in line and "Error:" not in line
    assert not db_file.exists()


def test_import_refuses_json_python_would_read_by_guessing(db: tuple[str, Path]) -> None:
    """A key twice in one object (json.loads kept the last, silently: the file said two things) and NaN or
    Infinity (no JSON; Python reads them) are refused at their line, and nothing is written."""
    url, work = db
    seed(url)
    good = work / "s1.jsonl"
    run("sessions", "export", "s1", "-o", str(good), "--db", url, cwd=work)
    lines = good.read_text(encoding="utf-8").splitlines()
    first = lines[1]
    assert first.startswith('{') and '"message":{' in first
    cases = [
        (first[:-1] + ', "entry_id": "forged"}', 2, "'entry_id' appears twice"),
        (first.replace('"message":{', '"message":{"role":"assistant",', 1), 2, "'role' appears twice"),
        (first.replace('"message":{', '"message":{"score":NaN,', 1), 2, "NaN is not a JSON number"),
        (first.replace('"message":{', '"message":{"score":-Infinity,', 1), 2, "-Infinity is not"),
    ]
    for i, (changed, number, words) in enumerate(cases):
        bad = work / f"bad{i}.jsonl"
        bad.write_text("\n".join([lines[0], changed, *lines[2:]]) + "\n", encoding="utf-8")
        line = one_error_line(run("--scope", "copy", "sessions", "import", str(bad), "--db", url, cwd=work, code=1))
        assert f"line {number}:" in line and words in line, line
    assert run_json("--scope", "copy", "sessions", "list", "--db", url, cwd=work) == []


@pytest.mark.parametrize("url", ["http://h:99999", "http://h:abc", " http://h:8765", "http://h:8765\n",
                                 "http://:8765", "http://h:0", "ftp://h"])
def test_openclaw_install_line_refuses_bad_urls(tmp_path: Path, url: str) -> None:
    line = one_error_line(run("openclaw", "install-line", "--service-url", url, cwd=tmp_path, code=2))
    assert "--service-url" in line


def test_openclaw_install_line_accepts_good_urls(tmp_path: Path) -> None:
    for url in ("http://127.0.0.1:8765", "https://[::1]/base/", "http://service.internal"):
        info = run_json("openclaw", "install-line", "--service-url", url, cwd=tmp_path)
        assert info["line"].startswith("openclaw plugins install")
