"""A refusal's advice names the database the command was given: with TRANSCRIPT_STORE_AUTO_UPGRADE=0 and a
missing SQLite file (or an empty PostgreSQL database), the commands advised "run `transcript-store init`"
without the --db given, and that advice, as printed, made a store in ./transcripts.db and left the refusal
standing. Every advice is now the command line to paste: `transcript-store init --db '<url>'`, shell-quoted,
its password masked; the library's "--db URL" placeholder is filled in the same way."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from test_cli import empty_url, one_error_line, run, run_json  # noqa: F401  (empty_url: a fixture)

from transcript_store import StoreConfig, migrate
from transcript_store.db import Database, mask_url

NO_AUTO = {"TRANSCRIPT_STORE_AUTO_UPGRADE": "0"}
#: one session, one turn: enough for each creating command to open (and, after init, use) the store
CREATING: list[tuple[tuple[str, ...], str | None]] = [
    (("chat", "--session", "x"), "hi\n"),
    (("gateway", "--workers", "1", "--sessions", "1", "--turns", "1", "--no-faults"), None),
]
READING: list[tuple[str, ...]] = [("sessions", "list"), ("current",), ("upgrade",)]


def _advice(line: str) -> list[str]:
    """The command line a refusal advises, as argv (after `transcript-store`)."""
    found = re.findall(r"run `(transcript-store [^`]*)`", line)
    assert len(found) == 1, line
    argv = shlex.split(found[0])
    assert argv[0] == "transcript-store", line
    return argv[1:]


def _spaced(url: str, tmp_path: Path, backend: str) -> str:
    """On SQLite, a path with a space and a quote in it: the advice must be shell-quoted to paste."""
    return "sqlite:///" + str(tmp_path / "my store" / "it's.db") if backend == "sqlite" else url


@pytest.mark.parametrize(("args", "stdin"), CREATING)
def test_a_creating_command_advises_init_on_the_database_it_was_given(
    empty_url: str, backend: str, tmp_path: Path, args: tuple[str, ...], stdin: str | None  # noqa: F811
) -> None:
    url = _spaced(empty_url, tmp_path, backend)
    env = NO_AUTO if backend == "sqlite" else {}  # PostgreSQL never creates a store on open
    line = one_error_line(run(*args, "--db", url, cwd=tmp_path, code=4, stdin=stdin, env=env))
    advice = _advice(line)
    assert advice == ["init", "--db", mask_url(url)], line  # (as "no store at" names it: the same database)
    assert "in Python" not in line  # the library's own advice, for a caller in Python
    run(*advice, cwd=tmp_path, env=env)  # pasted as printed: it makes the store the command wanted
    assert not (tmp_path / "transcripts.db").exists()
    run(*args, "--db", url, cwd=tmp_path, stdin=stdin, env=env)


@pytest.mark.parametrize("args", READING)
def test_a_reading_command_advises_init_on_the_database_it_was_given(
    empty_url: str, backend: str, tmp_path: Path, args: tuple[str, ...]  # noqa: F811
) -> None:
    url = _spaced(empty_url, tmp_path, backend)
    line = one_error_line(run(*args, "--db", url, cwd=tmp_path, code=4, env=NO_AUTO))
    assert _advice(line) == ["init", "--db", mask_url(url)], line
    doctor = run_json("doctor", "--db", url, cwd=tmp_path, code=1, env=NO_AUTO)
    (problem,) = doctor["problems"]
    assert _advice(problem) == ["init", "--db", mask_url(url)], problem


def test_the_advice_names_the_database_of_the_variable_too(empty_url: str, tmp_path: Path) -> None:  # noqa: F811
    """Given by TRANSCRIPT_STORE_URL, for the command line alone: the advice pasted in another shell (or a
    script's variable set for one command) still names it."""
    env = {**NO_AUTO, "TRANSCRIPT_STORE_URL": empty_url}
    line = one_error_line(run("sessions", "list", cwd=tmp_path, code=4, env=env))
    assert _advice(line) == ["init", "--db", empty_url], line


def test_the_default_store_is_advised_init_alone(tmp_path: Path) -> None:
    line = one_error_line(run("sessions", "list", cwd=tmp_path, code=4, env=NO_AUTO))
    assert _advice(line) == ["init"], line


def test_the_advice_masks_the_password(empty_url: str, backend: str, tmp_path: Path) -> None:  # noqa: F811
    if backend != "postgresql":
        pytest.skip("a SQLite URL holds no password")
    url = empty_url.replace("://postgres@", "://postgres:s3cret@", 1)
    assert url != empty_url, empty_url
    for args, stdin in [*CREATING, *((a, None) for a in READING)]:
        line = one_error_line(run(*args, "--db", url, cwd=tmp_path, code=4, stdin=stdin))
        assert "s3cret" not in line and _advice(line) == ["init", "--db", mask_url(url)], line
        assert "postgres:***@" in line, line


def test_a_schema_behind_is_advised_upgrade_on_the_database_it_was_given(
    empty_url: str, backend: str, tmp_path: Path  # noqa: F811
) -> None:
    db = Database(StoreConfig(url=empty_url))
    try:
        migrate.upgrade(db, "0001")
    finally:
        db.dispose()
    env = NO_AUTO if backend == "sqlite" else {}
    lines = [one_error_line(run("current", "--db", empty_url, cwd=tmp_path, code=4, env=env)),
             one_error_line(run("sessions", "list", "--db", empty_url, cwd=tmp_path, code=4, env=env)),
             *run_json("doctor", "--db", empty_url, cwd=tmp_path, code=1, env=env)["problems"],
             *[w for w in run_json("engines", "list", "--db", empty_url, cwd=tmp_path, env=env)["warnings"]
               if w.startswith("no store to read quarantines from")]]
    assert len(lines) == 4, lines
    for line in lines:
        assert _advice(line) == ["upgrade", "--db", empty_url], line
    run("upgrade", "--db", empty_url, cwd=tmp_path)
    run("sessions", "list", "--db", empty_url, cwd=tmp_path, env=env)
