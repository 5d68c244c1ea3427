"""Review of the CLI's export and import and of its engine reports: a refused import that still created or
changed the database --db names, an export cut short with exit 0 (a short write to stdout, a failed ``-o``
that destroyed the earlier export), and a plugin's ``print`` in front of ``engines list --json`` and
``doctor --json``."""

from __future__ import annotations

import json
import os
import resource
import sqlite3
import subprocess
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from service_process import ServiceProcess
from sqlalchemy import create_engine, inspect
from test_cli import (  # noqa: F401 (_script_mode: autouse, honours real_script; empty_url: a fixture)
    CLI,
    SCOPE,
    _script_mode,
    empty_url,
    one_error_line,
    run,
    run_json,
    seed,
)

from transcript_store import StoreConfig, TranscriptStore

# ---------------------------------------------------------------------------------------------- 1: import


@pytest.fixture
def export_file(tmp_path: Path) -> Path:
    """A good export of test_cli's s1 (branches, a rewrite, an event, a turn), from a store of its own."""
    url = f"sqlite:///{tmp_path / 'source.db'}"
    run("init", "--db", url, cwd=tmp_path)
    seed(url)
    path = tmp_path / "s1.jsonl"
    run("sessions", "export", "s1", "-o", str(path), "--db", url, cwd=tmp_path)
    return path


def _refused_exports(good: Path) -> Iterator[tuple[Path, tuple[str, ...], str]]:
    """Exports (and options) an import refuses, each with words of its error: the header, an entry deep in
    the file, and a new id that no store takes."""
    header, *entries = (json.loads(line) for line in good.read_text(encoding="utf-8").splitlines())
    cases: list[tuple[list[dict[str, Any]], tuple[str, ...], str]] = [
        ([{"format": "nope"}], (), "header"),
        ([header, *entries[:-1], {**entries[-1], "position": 99}], (), "position"),
        ([header, *entries], ("--session-id", "a\x01b"), "session_id"),
    ]
    for i, (records, options, words) in enumerate(cases):
        path = good.with_name(f"bad-{i}.jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        yield path, options, words


def _tables(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        return inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_a_refused_import_creates_no_store(empty_url: str, backend: str, export_file: Path,  # noqa: F811
                                           tmp_path: Path) -> None:
    """A mistyped --db path stays missing (its folder too); an empty PostgreSQL database gets no schema."""
    for bad, options, words in _refused_exports(export_file):
        err = one_error_line(run("sessions", "import", str(bad), *options, "--db", empty_url, cwd=tmp_path, code=1))
        assert words in err
        if backend == "sqlite":
            assert not (tmp_path / "fresh").exists(), f"{bad.name} created {empty_url}"
        else:
            assert _tables(empty_url) == [], bad.name
    # The same database takes a good import: the check comes first, the write still happens (a SQLite
    # store is created by it; a PostgreSQL database is migrated by `init` only).
    if backend == "postgresql":
        run("init", "--db", empty_url, cwd=tmp_path)
    info = run_json("sessions", "import", str(export_file), "--db", empty_url, cwd=tmp_path)
    assert info["session_id"] == "s1" and info["entry_count"] == 9
    assert run_json("sessions", "show", "s1", "--db", empty_url, cwd=tmp_path)["entries"]


def test_an_import_over_a_taken_id_or_key_names_the_option_that_gives_another(store_url: str, export_file: Path,
                                                                              tmp_path: Path) -> None:
    """An import keeps the file's id and key: over a session holding either it was refused with the store's
    words alone ("already has key 'agent:s1'"), not how to import it all the same."""
    run("sessions", "import", str(export_file), "--db", store_url, cwd=tmp_path)
    taken_id = one_error_line(run("sessions", "import", str(export_file), "--db", store_url, cwd=tmp_path, code=1))
    assert "'s1' already exists" in taken_id and "--session-id" in taken_id, taken_id
    taken_key = one_error_line(run("sessions", "import", str(export_file), "--session-id", "s1-copy",
                                   "--db", store_url, cwd=tmp_path, code=1))
    assert "'agent:s1'" in taken_key and "--session-key" in taken_key, taken_key
    copy = run_json("sessions", "import", str(export_file), "--session-id", "s1-copy", "--session-key", "agent:copy",
                    "--db", store_url, cwd=tmp_path)
    assert (copy["session_id"], copy["session_key"]) == ("s1-copy", "agent:copy")


def test_a_refused_import_leaves_another_programs_sqlite_file_byte_for_byte(export_file: Path,
                                                                             tmp_path: Path) -> None:
    """--db naming another program's database by mistake: no WAL mode, no store tables, no -wal/-shm files."""
    other = tmp_path / "contacts.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE contacts (name TEXT)")
        conn.execute("INSERT INTO contacts VALUES ('ada')")
    conn.close()
    before = other.read_bytes()
    for bad, options, words in _refused_exports(export_file):
        err = one_error_line(run("sessions", "import", str(bad), *options, "--db", f"sqlite:///{other}",
                                 cwd=tmp_path, code=1))
        assert words in err
        assert other.read_bytes() == before, f"{bad.name} changed {other}"
        assert not any(Path(f"{other}{suffix}").exists() for suffix in ("-wal", "-shm", "-journal"))


# ---------------------------------------------------------------------------------------------- 2: export

#: the file size limit of an export that fails (a full disk, a quota): far below the export's size
LIMIT = 64 * 1024


@pytest.fixture
def big_store(tmp_path: Path) -> str:
    """A store whose session s1 exports to about 400 KB (more than LIMIT and than a pipe's buffer)."""
    url = f"sqlite:///{tmp_path / 'big.db'}"
    with TranscriptStore(config=StoreConfig(url=url)) as store:
        store.create_session(SCOPE, session_id="s1")
        store.append_many(SCOPE, "s1", [{"message": {"role": "user", "content": f"{i} " + "x" * 300}}
                                        for i in range(1200)])
    return url


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def _export(url: str, *options: str, cwd: Path, stdout: Any = subprocess.PIPE,
            limited: bool = False) -> subprocess.CompletedProcess[bytes]:
    """The console script in a subprocess (a file size limit is per process), stdout as bytes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([*CLI, "sessions", "export", "s1", *options, "--db", url], cwd=cwd, stdout=stdout,
                          stderr=subprocess.PIPE, env=env, timeout=120, preexec_fn=_limited if limited else None)


def _error_line(result: subprocess.CompletedProcess[bytes]) -> str:
    return one_error_line(subprocess.CompletedProcess(result.args, result.returncode, "", result.stderr.decode()))


def test_an_export_to_stdout_that_cannot_be_written_whole_fails(big_store: str, tmp_path: Path) -> None:
    """A write to stdout may take fewer bytes than given and raise nothing: the export is never cut short
    with exit 0."""
    full = run("sessions", "export", "s1", "--db", big_store, cwd=tmp_path).stdout.encode()  # whole: in-process
    assert len(full) > 4 * LIMIT
    out = tmp_path / "out.jsonl"
    with out.open("wb") as stdout:
        result = _export(big_store, cwd=tmp_path, stdout=stdout, limited=True)
    assert out.stat().st_size < len(full)  # the limit held: the export could not land whole
    assert result.returncode == 1, f"exit {result.returncode} with {out.stat().st_size} of {len(full)} bytes"
    assert "cannot write the export to stdout" in _error_line(result)


def test_an_export_into_a_pipe_whose_reader_leaves_fails(big_store: str, tmp_path: Path) -> None:
    """`export | head -c 10`: the reader left mid-write, the export is not whole, exit 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    proc = subprocess.Popen([*CLI, "sessions", "export", "s1", "--db", big_store], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10) == b'{"format":'
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, stderr
    assert "cannot write the export to stdout" in stderr


@pytest.mark.parametrize("options", [("--json",), (), ("--all", "--json")], ids=["json", "table", "all-json"])
def test_sessions_show_into_a_pipe_whose_reader_leaves_fails(
    big_store: str, tmp_path: Path, options: tuple[str, ...]
) -> None:
    """`sessions show --json | head -c 10`: the reader left mid-write, the output is not whole, exit 1 as
    an export's (it exited 0, cut short: the text stream dropped the count of a short write)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    proc = subprocess.Popen([*CLI, "sessions", "show", "s1", *options, "--db", big_store], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, stderr
    assert "cannot write to stdout" in stderr


@pytest.mark.parametrize("options", [("--json",), ()], ids=["json", "table"])
def test_sessions_show_with_stdout_closed_fails_with_one_line(
    big_store: str, tmp_path: Path, options: tuple[str, ...]
) -> None:
    """`sessions show >&-`: Python starts with no stdout at all; the command said "AttributeError ...
    (an internal error)" for --json. It fails as any write to stdout that does not land: exit 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    result = subprocess.run([*CLI, "sessions", "show", "s1", *options, "--db", big_store], cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, timeout=120, preexec_fn=lambda: os.close(1))
    assert result.returncode == 1, result.stderr
    assert "cannot write to stdout: it is closed" in _error_line(result)


def test_sessions_show_json_that_cannot_be_written_whole_fails(big_store: str, tmp_path: Path) -> None:
    """A file size limit takes part of the document: exit 1 and the error line, never exit 0 cut short."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    full = run("sessions", "show", "s1", "--json", "--db", big_store, cwd=tmp_path)  # whole: in-process
    assert len(full.stdout) > 4 * LIMIT
    out = tmp_path / "show.json"
    with out.open("wb") as stdout:
        result = subprocess.run([*CLI, "sessions", "show", "s1", "--json", "--db", big_store], cwd=tmp_path,
                                env=env, stdout=stdout, stderr=subprocess.PIPE, timeout=120, preexec_fn=_limited)
    assert out.stat().st_size < len(full.stdout.encode())
    assert result.returncode == 1, f"exit {result.returncode} with {out.stat().st_size} of {len(full.stdout)} chars"
    assert "cannot write to stdout" in _error_line(result)


def test_a_failed_export_to_a_file_keeps_the_earlier_export(big_store: str, tmp_path: Path) -> None:
    """-o PATH is written whole or not at all: the good export there survives, and no part file is left."""
    folder = tmp_path / "exports"
    folder.mkdir()
    path = folder / "s1.jsonl"
    run("sessions", "export", "s1", "-o", str(path), "--db", big_store, cwd=tmp_path)  # the good one: in-process
    good = path.read_bytes()
    assert len(good) > 4 * LIMIT and good.startswith(b'{"format":')
    result = _export(big_store, "-o", str(path), cwd=tmp_path, limited=True)
    assert path.read_bytes() == good, f"{path.stat().st_size} of {len(good)} bytes left"
    assert result.returncode == 1
    assert "cannot write" in _error_line(result)
    assert sorted(p.name for p in folder.iterdir()) == ["s1.jsonl"]
    # A new file that fails is not left behind in part either.
    result = _export(big_store, "-o", str(folder / "new.jsonl"), cwd=tmp_path, limited=True)
    assert result.returncode == 1
    assert sorted(p.name for p in folder.iterdir()) == ["s1.jsonl"]


def test_an_export_replaces_the_file_a_link_names_and_keeps_its_mode(tmp_path: Path) -> None:
    """The renamed file takes the place of the one a symbolic link names (the link stays) with its mode;
    a device is written in place."""
    url = f"sqlite:///{tmp_path / 'transcripts.db'}"
    run("init", "--db", url, cwd=tmp_path)
    seed(url)
    real = tmp_path / "real.jsonl"
    real.write_text("an earlier export\n", encoding="utf-8")
    real.chmod(0o640)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    run("sessions", "export", "s1", "-o", str(link), "--db", url, cwd=tmp_path)
    assert link.is_symlink() and real.read_text(encoding="utf-8").startswith('{"format":')
    assert real.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []
    done = run_json("sessions", "export", "s1", "-o", os.devnull, "--db", url, cwd=tmp_path)
    assert done["file"] == os.devnull and Path(os.devnull).is_char_device()


# ---------------------------------------------------------------------------------------------- 3: engines

def _chatty_plugin(root: Path) -> None:
    """A valid plugin engine that prints at import (a window title a terminal would obey), in its factory and
    in dispose."""
    plugin = root / "plugins" / "chatty"
    plugin.mkdir(parents=True)
    (plugin / "plugin.yaml").write_text("name: chatty\nentry: create_engine\n", encoding="utf-8")
    (plugin / "__init__.py").write_text(
        "print('chatty says: loading \\x1b]0;owned\\x07')\n"
        "from engines.legacy import LegacyEngine\n\n"
        "class Chatty(LegacyEngine):\n"
        "    def __init__(self, ctx):\n"
        "        print('chatty says: factory')\n"
        "        super().__init__(ctx)\n"
        "        self.info = self.info.model_copy(update={'id': 'chatty'})\n\n"
        "    def dispose(self):\n"
        "        print('chatty says: dispose')\n\n"
        "def create_engine(ctx):\n"
        "    return Chatty(ctx)\n",
        encoding="utf-8",
    )
    (root / "transcript-store.toml").write_text('[engine]\nplugin_dirs = ["plugins"]\n', encoding="utf-8")


# Once, on SQLite: where a plugin's print goes is the process's stdout and stderr, not the store's, so the backend
# --db names plays no part.
@pytest.mark.parametrize("backend", ["sqlite"])
@pytest.mark.real_script
@pytest.mark.parametrize("command", [("engines", "list"), ("doctor",)])
def test_a_plugins_print_goes_to_stderr_shown(store_url: str, tmp_path: Path, command: tuple[str, ...]) -> None:
    """stdout holds the JSON document only; the plugin's output is on stderr, escaped."""
    _chatty_plugin(tmp_path)
    result = run(*command, "--json", "--db", store_url, cwd=tmp_path)
    report = json.loads(result.stdout)  # nothing in front of it
    chatty = next(e for e in report["engines"] if e["id"] == "chatty")
    assert chatty["valid"], chatty
    assert "chatty says" not in result.stdout
    for said in ("chatty says: loading", "chatty says: factory", "chatty says: dispose"):
        assert said in result.stderr, result.stderr
    assert "\x1b" not in result.stderr and "\\x1b]0;owned\\x07" in result.stderr, repr(result.stderr)
    table = run(*command, "--db", store_url, cwd=tmp_path)  # the table too: the command's output only
    assert "chatty" in table.stdout and "chatty says" not in table.stdout and "\x1b" not in table.stdout


# Once, on SQLite: how often a plugin is imported and made is the runtime's, not the store's, so the backend --db
# names plays no part.
@pytest.mark.parametrize("backend", ["sqlite"])
@pytest.mark.real_script
def test_chat_imports_and_makes_a_plugin_engine_once(store_url: str, tmp_path: Path) -> None:
    """The start-up check loaded the engine in a registry of its own, then the chat's runtime loaded it again:
    the plugin's import-time output was said twice, its factory run twice. Checked in the chat's runtime now,
    the engine it made is the one the turns use."""
    _chatty_plugin(tmp_path)
    result = run("chat", "--engine", "chatty", "--db", store_url, cwd=tmp_path, stdin="hello\n/quit\n")
    for said in ("chatty says: loading", "chatty says: factory", "chatty says: dispose"):
        assert result.stderr.count(said) == 1, result.stderr
    assert "chatty says" not in result.stdout and "legacy" not in result.stdout, result.stdout


# Once, on SQLite: how often a plugin is imported and made is the service's, not the store's, so the backend --db
# names plays no part.
@pytest.mark.parametrize("backend", ["sqlite"])
def test_serve_imports_and_makes_a_plugin_engine_once(store_url: str, tmp_path: Path) -> None:
    """`serve` built its service (the plugin imported, its output on stdout as it was, escape sequence and
    all), then checked the engine in another registry (imported again, its factory run), and the first request
    made it again. The import is said once, on stderr, shown; the engine the check made serves the requests."""
    _chatty_plugin(tmp_path)
    with ServiceProcess(store_url, {"tok": "s"}, tmp_path / "serve.log", env={"TRANSCRIPT_STORE_ENGINE": "chatty"}) \
            as proc:
        status, data = proc.call("GET", "/v1/engines/chatty", "tok")
        assert status == 200 and data["id"] == "chatty", data
        log = proc.log()
    for said in ("chatty says: loading", "chatty says: factory"):
        assert log.count(said) == 1, log
    assert "\x1b" not in log and "\\x1b]0;owned\\x07" in log, repr(log)
    assert "chatty says: loading" not in proc.stdout_rest and "\x1b" not in proc.stdout_rest, proc.stdout_rest


# ---------------------------------------------------------------------------------------------- 4: memory


# The assertion is a proportion (a page held, not the session): 2,800 entries (5.6 MB, 44 pages) in make test,
# the full 4,000 (8 MB) in the slow tier. Not fewer: a first export in a fresh process peaks near 1 MB (its
# imports and caches), past a quarter of 3.2 MB.
@pytest.mark.parametrize("count", [2800, pytest.param(4000, marks=pytest.mark.slow)])
def test_an_export_holds_a_page_in_memory_not_the_session(store_url: str, tmp_path: Path, count: int) -> None:
    """`sessions export` built every record, every line and then the whole file in memory before its first
    byte (900 MB of RSS for a 190 MB export, growing with the session); it writes a page at a time now,
    the same bytes."""
    store = TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False))
    body = "x" * 2000
    try:
        store.create_session(SCOPE, session_id="big", session_key="agent:big")
        for start in range(0, count, 800):
            store.append_many(SCOPE, "big", [{"message": {"role": "user", "content": f"{i} {body}"}}
                                             for i in range(start, min(start + 800, count))])
        header, records = store.export_session(SCOPE, "big")
        expected = "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n"
                           for r in [header, *records]).encode("utf-8")
    finally:
        store.close()
    path = tmp_path / "big.jsonl"
    tracemalloc.start()
    try:
        run("sessions", "export", "big", "-o", str(path), "--db", store_url, cwd=tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert path.read_bytes() == expected and len(expected) > count * 2000
    assert peak < len(expected) / 4, (peak, len(expected))


# ---------------------------------------------------------------------------------------------- 5: closed streams


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}


# Once, on SQLite: a missing stdout is refused before the export's first read, so the backend --db names plays no part.
@pytest.mark.parametrize("backend", ["sqlite"])
def test_an_export_to_a_closed_stdout_fails_with_one_line(store_url: str, tmp_path: Path) -> None:
    """`sessions export s1 >&-`: Python starts with no stdout at all; the export said "AttributeError:
    'NoneType' object has no attribute 'flush' (an internal error)". It fails as `sessions show` does."""
    seed(store_url)
    result = subprocess.run([*CLI, "sessions", "export", "s1", "--db", store_url], cwd=tmp_path, env=_clean_env(),
                            stderr=subprocess.PIPE, timeout=120, preexec_fn=lambda: os.close(1))
    assert result.returncode == 1, result.stderr
    assert _error_line(result) == "error: cannot write to stdout: it is closed"


def test_an_import_from_a_closed_stdin_fails_with_one_line_and_creates_nothing(
    empty_url: str, backend: str, tmp_path: Path  # noqa: F811
) -> None:
    """`sessions import - <&-`: click's file type failed on the missing stdin with an AttributeError (an
    internal error); it is one line, exit 1, before --db is opened (no SQLite file, no schema)."""
    result = subprocess.run([*CLI, "sessions", "import", "-", "--db", empty_url], cwd=tmp_path, env=_clean_env(),
                            capture_output=True, timeout=120, preexec_fn=lambda: os.close(0))
    assert result.returncode == 1, result.stderr
    assert _error_line(result) == "error: cannot read the export from stdin: it is closed"
    if backend == "sqlite":
        assert not (tmp_path / "fresh").exists()
    else:
        assert _tables(empty_url) == []


def test_export_output_dash_is_stdout_as_import_dash_is_stdin(store_url: str, tmp_path: Path) -> None:
    """`-o -` wrote a file named "-" and printed its summary line on stdout, so `export -o - | import -`
    fed that line to the import ("not JSON"). It is stdout now, the same bytes as no -o."""
    seed(store_url)
    plain = run("sessions", "export", "s1", "--db", store_url, cwd=tmp_path).stdout
    dashed = run("sessions", "export", "s1", "-o", "-", "--db", store_url, cwd=tmp_path).stdout
    assert dashed == plain and plain.startswith('{"format":')
    assert not (tmp_path / "-").exists()
    copy = json.loads(run("sessions", "import", "-", "--session-id", "copy", "--session-key", "agent:copy",
                          "--json", "--db", store_url, cwd=tmp_path, stdin=dashed).stdout)
    assert (copy["session_id"], copy["entry_count"]) == ("copy", 9)


@pytest.mark.parametrize(
    "command",
    [("sessions", "import", "{export}", "--session-id", "copy", "--session-key", "k:copy"),
     ("sessions", "delete", "s1", "--yes"), ("current",)],
    ids=["import", "delete", "current"],
)
# Once, on SQLite: the command is refused before it opens the store (the test checks nothing changed), so the backend
# --db names plays no part.
@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_closed_stdout_refuses_a_command_before_it_changes_anything(
    store_url: str, export_file: Path, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """click.echo drops its line when there is no stdout: `sessions import FILE >&-` imported and exited 0
    (with --json, exit 1 after importing), `sessions delete s1 --yes >&-` deleted and exited 0. Every
    command but `serve` is refused first now, as `sessions show` fails its output: exit 1, nothing changed."""
    seed(store_url)
    args = [part.format(export=export_file) for part in command]
    for options in ((), ("--json",)):
        result = subprocess.run([*CLI, *args, *options, "--db", store_url], cwd=tmp_path, env=_clean_env(),
                                stderr=subprocess.PIPE, timeout=120, preexec_fn=lambda: os.close(1))
        assert result.returncode == 1, result.stderr
        assert _error_line(result) == "error: cannot write to stdout: it is closed"
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        assert [s.session_id for s in store.list_sessions(SCOPE)] == ["s1", "s2"]
