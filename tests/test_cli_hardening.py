"""Defects the CLI review left open: engine text in the gateway report and the log lines, reads that wrote
into an empty SQLite file, control characters in a SQLite file name, unbounded numeric settings and
flags, and a PostgreSQL permission error reported as an outage."""

from __future__ import annotations

import io
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from rich.console import Console
from sqlalchemy import event, text
from test_cli import SCOPE, _script_mode, one_error_line, run, run_json  # noqa: F401 (autouse: honours real_script)

from transcript_store import InvalidInput, StoreConfig, TranscriptStore
from transcript_store.cli import exit_code
from transcript_store.db import Database
from transcript_store.errors import PermissionDenied, StoreUnavailable, TransientStoreError
from transcript_store.gateway import GatewayOptions, GatewayReport, run_gateway
from transcript_store.settings import load_settings
from transcript_store.terminal import ShownFormatter

#: what a terminal would obey: a window title (OSC ... BEL), a colour (CSI), and rich's markup
HOSTILE = "boom \x1b]0;owned\x07 \x1b[31mred [/oops]"
HOSTILE_SHOWN = "boom \\x1b]0;owned\\x07 \\x1b[31mred [/oops]"


def _hostile_plugin(root: Path, operation: str) -> None:
    """A plugin engine ``hostile`` (the legacy engine) whose ``operation`` raises HOSTILE."""
    plugin = root / "plugins" / "hostile"
    plugin.mkdir(parents=True)
    (plugin / "plugin.yaml").write_text("name: hostile\nentry: create_engine\n", encoding="utf-8")
    (plugin / "__init__.py").write_text(
        "from engines.legacy import LegacyEngine\n\n"
        "class Hostile(LegacyEngine):\n"
        "    def __init__(self, ctx):\n"
        "        super().__init__(ctx)\n"
        "        self.info = self.info.model_copy(update={'id': 'hostile'})\n\n"
        f"    def {operation}(self, **kw):\n"
        f"        raise RuntimeError({HOSTILE!r})\n\n"
        "def create_engine(ctx):\n"
        "    return Hostile(ctx)\n",
        encoding="utf-8",
    )
    (root / "transcript-store.toml").write_text('[engine]\nplugin_dirs = ["plugins"]\n', encoding="utf-8")


# ---------------------------------------------------------------------------------------------- 1: engine text


def test_the_gateway_report_shows_engine_text_escaped() -> None:
    """Degraded reasons and problems quote engines' errors: read, not obeyed (nor taken as rich markup)."""
    report = GatewayReport(url="sqlite:///x.db", engine="lossless", workers=1, planned_turns=1,
                           degraded={f"fence: {HOSTILE}": 1}, problems=[f"turn t-1 attempt 0 raised {HOSTILE}"])
    for markup in (True, False):  # the CLI's console has no markup; a library caller's default one has
        out = io.StringIO()
        report.render(Console(file=out, width=200, markup=markup, highlight=False))
        text = out.getvalue()
        assert "\x1b" not in text and "\x07" not in text, repr(text)
        assert f"degraded x1: fence: {HOSTILE_SHOWN}" in text and f"raised {HOSTILE_SHOWN}" in text


@pytest.mark.real_script
def test_log_lines_show_engine_text_escaped(store_url: str, tmp_path: Path) -> None:
    """The stderr log lines (a turn that ran on legacy, a quarantine) quote an engine's error: escaped, one line."""
    _hostile_plugin(tmp_path, "assemble")
    result = run("chat", "--session", "esc", "--engine", "hostile", "--db", store_url, cwd=tmp_path,
                 stdin="hello\n")
    logged = [line for line in result.stderr.splitlines() if "hostile" in line]
    assert logged and all(line.startswith(("WARNING: ", "ERROR: ")) for line in logged), result.stderr
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr, repr(result.stderr)
    assert any(HOSTILE_SHOWN in line for line in logged), result.stderr


def test_a_log_record_stays_one_line_and_a_traceback_keeps_its_lines() -> None:
    """A newline in an engine's error would forge a second record on the operator's stderr."""
    try:
        raise RuntimeError("boom\x1b[2J")
    except RuntimeError:
        info = sys.exc_info()
    record = logging.LogRecord("transcript_store.host", logging.WARNING, __file__, 1, "failed: %s",
                               ("a\nERROR: forged \x1b[2J",), info)
    text = ShownFormatter("%(levelname)s: %(message)s").format(record)
    first, *trace = text.splitlines()
    assert first == "WARNING: failed: a\\x0aERROR: forged \\x1b[2J"
    assert trace[0] == "Traceback (most recent call last):" and trace[-1] == "RuntimeError: boom\\x1b[2J"


def test_doctor_problems_and_warnings_show_engine_text_escaped(store_url: str, tmp_path: Path) -> None:
    """doctor's problem lines quote the selected engine's load error."""
    plugin = tmp_path / "plugins" / "hostile"
    plugin.mkdir(parents=True)
    (plugin / "plugin.yaml").write_text("name: hostile\nentry: create_engine\n", encoding="utf-8")
    (plugin / "__init__.py").write_text(f"raise RuntimeError({HOSTILE!r})\n", encoding="utf-8")
    (tmp_path / "transcript-store.toml").write_text('[engine]\nplugin_dirs = ["plugins"]\nslot = "hostile"\n',
                                                    encoding="utf-8")
    result = run("doctor", "--db", store_url, cwd=tmp_path, code=1)
    assert "\x1b" not in result.stdout + result.stderr, repr(result.stdout)
    assert any(line.startswith("problem: ") and HOSTILE_SHOWN in line for line in result.stdout.splitlines())
    one_error_line(result)


# ---------------------------------------------------------------------------------------------- 2: no store, no write

#: (command, exit code) of every command that opens a store it must not create: 4 "no store yet" as for a
#: missing file; doctor reports it as a failed check (1); engines list lists the engines without it
READS = [
    (("current",), 4), (("upgrade",), 4), (("sessions", "list"), 4), (("sessions", "show", "s1"), 4),
    (("sessions", "export", "s1"), 4), (("sessions", "delete", "s1", "--yes"), 4), (("outbox", "status"), 4),
    (("outbox", "drain"), 4), (("outbox", "recover"), 4), (("compact", "s1"), 4), (("doctor",), 1),
    (("engines", "list"), 0),
]


@pytest.mark.parametrize(("command", "code"), READS)
def test_a_read_leaves_an_empty_sqlite_file_untouched(tmp_path: Path, command: tuple[str, ...], code: int) -> None:
    """A zero-byte file is no store: sqlite3 would write a header into it on the first connection (and the
    reads that migrate a SQLite store on open, a whole schema)."""
    path = tmp_path / "empty.db"
    path.touch()
    result = run(*command, "--db", f"sqlite:///{path}", cwd=tmp_path, code=code)
    assert path.stat().st_size == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"]
    if code == 4:
        line = one_error_line(result)
        assert "no store at" in line and "the file is empty" in line and "transcript-store init" in line, line
    run("init", "--db", f"sqlite:///{path}", cwd=tmp_path)  # init creates the store in it
    assert run("current", "--db", f"sqlite:///{path}", cwd=tmp_path).stdout


@pytest.mark.parametrize(("command", "code"), [c for c in READS if c[0] not in (("current",), ("upgrade",))])
def test_a_read_creates_no_schema_in_a_sqlite_file_without_one(tmp_path: Path, command: tuple[str, ...],
                                                               code: int) -> None:
    """Another program's SQLite file given by mistake: a read that migrates a store on open created the
    store's tables in it."""
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE app (x)")
    conn.close()
    before = path.read_bytes()
    result = run(*command, "--db", f"sqlite:///{path}", cwd=tmp_path, code=code)
    # Not a byte changed: not even the journal mode a store's connection sets (WAL), and no WAL files.
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]
    with sqlite3.connect(path) as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["app"]
    conn.close()
    if code == 4:
        line = one_error_line(result)
        assert "no store at" in line and "no transcript-store schema" in line and "init" in line, line


@pytest.mark.parametrize(("command", "code"), [c for c in READS if c[0] not in (("current",), ("upgrade",))])
def test_a_read_of_a_file_that_is_no_database_is_no_store(tmp_path: Path, command: tuple[str, ...],
                                                          code: int) -> None:
    """A text file given as --db was a driver error ("file is not a database", exit 5: an outage to wait
    out); it is no store, like a missing or empty file, and stays as it was."""
    path = tmp_path / "notes.db"
    path.write_text("not a database\n" * 20)
    before = path.read_bytes()
    result = run(*command, "--db", f"sqlite:///{path}", cwd=tmp_path, code=code)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["notes.db"]
    if code == 4:
        line = one_error_line(result)
        assert "no store at" in line and "not a SQLite database" in line, line


@pytest.mark.parametrize(("command", "code"), READS)
def test_a_file_that_is_no_database_is_not_sent_to_init(tmp_path: Path, command: tuple[str, ...], code: int) -> None:
    """Every command said "run `transcript-store init`" of a text file given as --db, and init refuses it
    (it cannot hold a store): the advice led to a second refusal. They say what init says instead."""
    path = tmp_path / "notes.db"
    path.write_text("not a database\n" * 20)
    result = run(*command, "--db", f"sqlite:///{path}", cwd=tmp_path, code=code)
    said = [line for line in (result.stdout + result.stderr).splitlines() if "not a SQLite database" in line]
    assert said and all("transcript-store init" not in line and "give the path of a store" in line
                        for line in said), said
    init = one_error_line(run("init", "--db", f"sqlite:///{path}", cwd=tmp_path, code=4))
    assert "give the path of a store" in init and "transcript-store init" not in init, init


# ---------------------------------------------------------------------------------------------- 3: control characters

BAD_NAMES = ["a\nb.db", "a\x1b[31mb.db", "a\tb.db", "a\rb.db", "a\x7fb.db", "a\x85b.db"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_the_library_refuses_a_url_with_control_characters(tmp_path: Path, name: str) -> None:
    """A file name with a newline or an escape sequence is no store's name: every line that shows it (an
    error, doctor, the gateway's report) would be split or obeyed. Refused like any bad URL, typed."""
    for url in (f"sqlite:///{tmp_path / name}", f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"):
        with pytest.raises(InvalidInput, match="control characters"):
            TranscriptStore(url)
        with pytest.raises(InvalidInput, match="control characters"):
            TranscriptStore.upgrade_url(url)
        with pytest.raises(InvalidInput, match="control characters"):
            TranscriptStore(config=StoreConfig(), url=url)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [
    ("current",), ("init",), ("upgrade",), ("sessions", "list"), ("sessions", "export", "s1"), ("doctor",),
    ("engines", "list"), ("gateway", "--workers", "1", "--sessions", "1", "--turns", "1", "--no-faults"),
])
def test_the_cli_refuses_a_url_with_control_characters_as_a_usage_error(tmp_path: Path,
                                                                        command: tuple[str, ...]) -> None:
    for name in ("a\nb.db", "a\x1b]0;owned\x07.db"):
        url = f"sqlite:///{tmp_path / name}"
        line = one_error_line(run(*command, "--db", url, cwd=tmp_path, code=2))
        assert "--db" in line and "control characters" in line and "\x1b" not in line, line
        one_error_line(run(*command, cwd=tmp_path, code=2, env={"TRANSCRIPT_STORE_URL": url}))
    assert list(tmp_path.iterdir()) == []


def test_the_gateway_refuses_a_bad_url_as_a_usage_error_like_every_command(tmp_path: Path) -> None:
    for bad in ("sqlite://", "mysql://u@h/x", "not a url"):
        line = one_error_line(run("gateway", "--workers", "1", "--sessions", "1", "--turns", "1", "--db", bad,
                                  cwd=tmp_path, code=2))
        assert line.startswith("error: --db: "), line


# ---------------------------------------------------------------------------------------------- 4: bounds

@pytest.mark.parametrize(("key", "bad", "good"), [
    ("token_budget", "100000001", "100000000"), ("token_budget", "100000000000000000000000000000", "2048"),
    ("max_output_tokens", "100000001", "99999999"),
])
def test_token_settings_past_their_bound_are_a_usage_error(store_url: str, tmp_path: Path, key: str, bad: str,
                                                          good: str) -> None:
    """A token budget past any model's window was taken, and failed deep in a model call (or a bound
    parameter) at the first turn; the service already refuses a request's budget past 100,000,000."""
    config = tmp_path / "transcript-store.toml"
    config.write_text(f"[turn]\n{key} = {bad}\n", encoding="utf-8")
    line = one_error_line(run("sessions", "list", "--config", str(config), "--db", store_url, cwd=tmp_path, code=2))
    assert f"turn.{key}" in line and "100000000" in line, line
    with pytest.raises(InvalidInput, match=key):
        load_settings(None, **{key: int(bad)})
    room = "token_budget = 100000000\n" if key == "max_output_tokens" else ""  # the reply is part of the budget
    config.write_text(f"[turn]\n{room}{key} = {good}\n", encoding="utf-8")
    run("sessions", "list", "--config", str(config), "--db", store_url, cwd=tmp_path)


def test_a_hermes_threshold_past_the_token_bound_is_a_usage_error(tmp_path: Path) -> None:
    for threshold in ("100000001", "1" + "0" * 300):  # (1e300 is no number as written: test_cli_strict_values)
        result = run("hermes", "install", "--home", str(tmp_path / "home"), "--threshold", threshold, cwd=tmp_path,
                     code=2)
        assert "--threshold" in result.stderr and "100000000" in result.stderr
    assert not (tmp_path / "home").exists()
    run("hermes", "install", "--home", str(tmp_path / "home"), "--threshold", "100000000", cwd=tmp_path)


@pytest.mark.parametrize(("flags", "words"), [
    (("--workers", "65"), "1<=x<=64"), (("--sessions", "1001"), "1<=x<=1000"), (("--turns", "1001"), "1<=x<=1000"),
    (("--workers", "99999999999999999999"), "1<=x<=64"),
    (("--sessions", "1000", "--turns", "101"), "at most 100000 turns"),
])
def test_gateway_numbers_past_their_bounds_are_a_usage_error(tmp_path: Path, flags: tuple[str, ...],
                                                             words: str) -> None:
    """A million workers were spawned, or a plan of a billion turns allocated, before anything failed."""
    args = {"--workers": "1", "--sessions": "1", "--turns": "1"}
    args.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    result = run("gateway", *[x for kv in args.items() for x in kv], cwd=tmp_path, code=2)
    assert words in result.stderr and "internal error" not in result.stderr, result.stderr
    assert not (tmp_path / "transcripts.db").exists()


@pytest.mark.parametrize("options", [{"workers": 65}, {"sessions": 1001}, {"turns": 1001}, {"workers": 0},
                                     {"sessions": 1000, "turns": 101}])
def test_the_library_gateway_refuses_the_same_numbers(tmp_path: Path, options: dict[str, int]) -> None:
    url = f"sqlite:///{tmp_path / 'g.db'}"
    with pytest.raises(InvalidInput):
        run_gateway(GatewayOptions(db_url=url, progress=False, **options), Console(quiet=True))  # type: ignore[arg-type]
    assert not (tmp_path / "g.db").exists()


# ---------------------------------------------------------------------------------------------- 5: grants


def test_a_missing_grant_is_its_own_error_and_exit_code(store_url: str, tmp_path: Path) -> None:
    """A role without a privilege (42501) is no outage: retrying cannot help until someone grants it, and
    an operator must be told it is a grant to fix, not a server to wait for (exit 5 said that)."""
    if store_url.startswith("sqlite"):
        pytest.skip("SQLite has no roles or grants")
    role = f"ts_ro_{uuid.uuid4().hex[:8]}"
    admin = Database(StoreConfig(url=store_url))
    with TranscriptStore(config=StoreConfig(url=store_url)) as owner:
        owner.create_session(SCOPE, session_id="s1")
    try:
        with admin.engine.begin() as conn:
            conn.execute(text(f"CREATE ROLE {role} LOGIN"))
            conn.execute(text(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}"))  # a read-only role
        url = store_url.replace("postgres@", f"{role}@", 1)
        with TranscriptStore(config=StoreConfig(url=url)) as store:
            assert [s.session_id for s in store.list_sessions(SCOPE)] == ["s1"]
            with pytest.raises(PermissionDenied, match="permission denied for table ts_sessions") as refused:
                store.create_session(SCOPE, session_id="s2")
            # Still a StoreUnavailable for callers that catch those, and final: never retried.
            assert isinstance(refused.value, StoreUnavailable) and not isinstance(refused.value, TransientStoreError)
            assert store.db.retries == 0
        assert [s["session_id"] for s in run_json("sessions", "list", "--db", url, cwd=tmp_path)] == ["s1"]
        line = one_error_line(run("sessions", "delete", "s1", "--yes", "--db", url, cwd=tmp_path, code=6))
        assert "permission denied for table" in line, line
        with admin.engine.begin() as conn:
            conn.execute(text(f"REVOKE SELECT ON ALL TABLES IN SCHEMA public FROM {role}"))
        assert "permission denied" in one_error_line(run("sessions", "list", "--db", url, cwd=tmp_path, code=6))
        doctor = run_json("doctor", "--db", url, cwd=tmp_path, code=6)
        assert not doctor["ok"] and any("permission denied" in p for p in doctor["problems"]), doctor["problems"]
    finally:
        with admin.engine.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
        admin.dispose()


@pytest.mark.parametrize("refusal", [PermissionError(13, "Permission denied"), OSError(30, "Read-only file system")])
def test_a_folder_a_store_cannot_be_made_in_is_permission_denied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: OSError
) -> None:
    """A SQLite store's missing folder that this process may not create (its parent read-only to it, or
    on a read-only file system) was StoreUnavailable, "database unavailable" (exit 5): an outage to wait
    for. It is a permission to fix, as the file's own (exit 6). (SQLite only: PostgreSQL makes no folder.)"""
    url = f"sqlite:///{tmp_path / 'missing' / 'store.db'}"

    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise refusal

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(PermissionDenied, match="cannot create the directory") as refused:
        TranscriptStore(config=StoreConfig(url=url))
    assert exit_code(refused.value) == 6


def test_a_folder_that_cannot_be_made_is_still_an_outage_for_other_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that is full when the folder is made stays what it was: the store unavailable (exit 5)."""

    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(StoreUnavailable, match="cannot create the directory") as refused:
        TranscriptStore(config=StoreConfig(url=f"sqlite:///{tmp_path / 'missing' / 'store.db'}"))
    assert not isinstance(refused.value, PermissionDenied) and exit_code(refused.value) == 5


def test_the_gateway_in_a_folder_it_may_not_write_is_permission_denied(tmp_path: Path) -> None:
    """The report's reproduction: `gateway --db` naming a file in a missing folder under an immutable one
    (chattr +i: root is refused too) exited 5, "database unavailable"; now 6, nothing made."""
    locked = tmp_path / "locked"
    locked.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "transcript_store", "gateway", "--db", f"sqlite:///{locked / 'sub' / 'g.db'}",
             "--workers", "1", "--sessions", "1", "--turns", "1"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    assert done.returncode == 6, (done.returncode, done.stderr)
    assert done.stderr.startswith("error: database permission denied: cannot create the directory"), done.stderr
    assert list(locked.iterdir()) == []


def test_a_read_only_sqlite_database_is_permission_denied_and_changes_nothing(tmp_path: Path) -> None:
    """A SQLite file this process may only read (chmod, a read-only mount; here a read-only connection,
    since tests run as root) is no outage either: PermissionDenied at once, never retried."""
    url = f"sqlite:///{tmp_path / 'ro.db'}"
    with TranscriptStore(config=StoreConfig(url=url)) as owner:
        owner.create_session(SCOPE, session_id="s1")
    with TranscriptStore(config=StoreConfig(url=url)) as store:
        event.listen(store.db.engine, "connect", lambda dbapi, _rec: dbapi.execute("PRAGMA query_only = ON"))
        store.db.engine.dispose()  # connections opened from now on are read-only
        assert [s.session_id for s in store.list_sessions(SCOPE)] == ["s1"]
        with pytest.raises(PermissionDenied, match="readonly database") as refused:
            store.create_session(SCOPE, session_id="s2")
        assert exit_code(refused.value) == 6 and store.db.retries == 0
    with TranscriptStore(config=StoreConfig(url=url)) as store:
        assert [s.session_id for s in store.list_sessions(SCOPE)] == ["s1"]


def _as_unprivileged(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The CLI run by a process the file permissions apply to: ``nobody`` when the tests run as root."""
    command = [sys.executable, "-m", "transcript_store", *args]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: file permissions do not apply to root")
        command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(cwd)})


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_a_store_file_this_process_may_not_use_is_permission_denied(mode: int) -> None:
    """A store file another user owns: unreadable (0600: SQLITE_CANTOPEN) or read-only with its folder
    (0644: the WAL index cannot be made) is a permission to fix (exit 6), not an outage (exit 5); the
    file is left as it was."""
    folder = Path(tempfile.mkdtemp(prefix="ts-perm-", dir="/tmp"))
    try:
        folder.chmod(0o755)
        path = folder / "owned.db"
        with TranscriptStore(config=StoreConfig(url=f"sqlite:///{path}")) as owner:
            owner.create_session(SCOPE, session_id="s1")
        path.chmod(mode)
        before = path.read_bytes()
        done = _as_unprivileged(["sessions", "list", "--scope", SCOPE, "--db", f"sqlite:///{path}"], folder)
        assert done.returncode == 6, (done.returncode, done.stdout, done.stderr)
        assert "permission denied" in done.stderr, done.stderr
        assert path.read_bytes() == before and sorted(p.name for p in folder.iterdir()) == ["owned.db"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(("key", "bad", "good"), [
    ("max_tool_steps", 10_001, 10_000), ("max_attempts", 101, 100), ("prune_keep_recent_tool_results", 10_001, 0),
    ("model_timeout_seconds", float("inf"), 604_800.0), ("model_timeout_seconds", 604_801.0, 0.5),
    ("max_turn_seconds", 1e300, 604_800.0),
])
def test_turn_settings_past_their_bound_are_refused(key: str, bad: object, good: object) -> None:
    """A tool loop, a retry count or a time span past any sensible value is a typo: refused when the
    settings load (naming the key), not found out inside the first turn (an infinite timeout fails in the
    HTTP client, ten thousand attempts retry a dead provider for hours)."""
    with pytest.raises(InvalidInput, match=key):
        load_settings(None, **{key: bad})
    assert getattr(load_settings(None, **{key: good}), key) == good
