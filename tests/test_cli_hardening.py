"""Defects the CLI review left open: engine text in the gateway report and the log lines, reads that wrote
into an empty SQLite file, control characters in a SQLite file name, unbounded numeric settings and
flags, and a PostgreSQL permission error reported as an outage."""

from __future__ import annotations

import io
import logging
import sqlite3
import sys
from pathlib import Path

import pytest
from rich.console import Console
from test_cli import _script_mode, one_error_line, run  # noqa: F401 (autouse: honours real_script)

from transcript_store import InvalidInput, StoreConfig, TranscriptStore
from transcript_store.gateway import GatewayReport
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
    result = run(*command, "--db", f"sqlite:///{path}", cwd=tmp_path, code=code)
    with sqlite3.connect(path) as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["app"]
    conn.close()
    if code == 4:
        line = one_error_line(result)
        assert "no store at" in line and "no transcript-store schema" in line and "init" in line, line


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
