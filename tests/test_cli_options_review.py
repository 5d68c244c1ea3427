"""Findings of the CLI options review: empty values taken for none (`outbox drain --session ''`, `recover ''`,
`hermes install --db ''`) or blamed on the wrong source, database URLs no store can use (a port out of
range, a device or FIFO, whitespace around it) answered as outages, options silently unused (`--model`
without an endpoint), model URLs without a host, a silent exit on a closed pipe, chat --json's prompt."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import assistant, user
from service_process import ServiceProcess
from test_cli import CLI, SCOPE, one_error_line, open_store, run, run_json

from transcript_store.turns import Turns


def _ready_turn(url: str, session_id: str) -> None:
    """A session with one accepted turn waiting for its engine."""
    with open_store(url) as store:
        store.create_session(SCOPE, session_id=session_id)
        turns = Turns(store)
        turns.admit(SCOPE, session_id, user("question"), turn_id="turn-1", engine_id="legacy")
        turns.complete(SCOPE, session_id, "turn-1", [{"message": assistant("answer")}], None)


def test_an_empty_session_is_refused_not_taken_for_every_session(store_url: str, tmp_path: Path) -> None:
    """`outbox drain --session "$SID"` with SID unset delivered every session's turns (exit 0), where
    `sessions show ''` refuses the empty id: a script meaning one session drained them all."""
    _ready_turn(store_url, "other")
    for args, name in ((("outbox", "drain", "--session", ""), "'--session'"),
                       (("outbox", "recover", ""), "'[SESSION]'")):
        stderr = run(*args, "--db", store_url, cwd=tmp_path, code=2).stderr  # a usage error, as README says
        assert f"{name}: must not be empty" in stderr, stderr
    rows = run_json("outbox", "status", "--db", store_url, cwd=tmp_path)
    assert [(r["session_id"], r["state"]) for r in rows] == [("other", "accepted")]  # nothing delivered


def test_a_postgresql_port_out_of_range_is_a_usage_error(tmp_path: Path) -> None:
    """libpq refuses port 99999 only when connecting: exit 5, "database unavailable", which a script
    retries for ever; the documented answer to a bad --db URL is a usage error (2), before any work."""
    for port in ("0", "65536", "99999"):
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/x"
        for command in (("sessions", "list"), ("init",), ("doctor",)):
            line = one_error_line(run(*command, "--db", url, cwd=tmp_path, code=2))
            assert "--db" in line and "not a TCP port" in line, line
    line = one_error_line(run("sessions", "list", cwd=tmp_path, code=2,
                              env={"TRANSCRIPT_STORE_URL": "postgresql://postgres@127.0.0.1:70000/x"}))
    assert "TRANSCRIPT_STORE_URL" in line


@pytest.mark.parametrize("command", [("sessions", "list"), ("init",), ("doctor",), ("current",)])
def test_a_sqlite_url_naming_a_device_or_a_fifo_is_a_usage_error(tmp_path: Path, command: tuple[str, ...]) -> None:
    """`--db sqlite:////dev/null`: `sessions list` advised `init` (exit 4), which then failed with "disk I/O
    error" (exit 5, a database down); a FIFO was the same outage. The path is the user's mistake, as a
    directory's is: exit 2, one line."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/null", str(fifo)):
        line = one_error_line(run(*command, "--db", f"sqlite:///{path}", cwd=tmp_path, code=2))
        assert "names no regular file" in line, line
    assert fifo.exists() and not fifo.is_file()
    # A path under a file (`a/x.db` where `a` is a file) was "cannot create the directory", exit 5.
    (tmp_path / "a").write_text("not a directory")
    line = one_error_line(run(*command, "--db", f"sqlite:///{tmp_path / 'a' / 'x.db'}", cwd=tmp_path, code=2))
    assert "is not a directory" in line, line
    assert (tmp_path / "a").read_text() == "not a directory"


def test_an_empty_export_output_is_a_usage_error(store_url: str, tmp_path: Path) -> None:
    """`sessions export s -o "$FILE"` with FILE unset read the whole session, then failed with "cannot
    write : Is a directory", exit 1: a usage error (2), said before the store is read."""
    _ready_turn(store_url, "s")
    line = one_error_line(run("sessions", "export", "s", "-o", "", "--db", store_url, cwd=tmp_path, code=2))
    assert "--output" in line and "empty path" in line, line


def test_a_model_name_or_key_without_an_endpoint_is_a_usage_error(tmp_path: Path) -> None:
    """`chat --model gpt-4o` (no --model-url, no OPENAI_BASE_URL) talked to the local stand-in, exit 0, the
    model named unused; so did `--api-key`, and the gateway's. Refused before any work, nothing created."""
    db = tmp_path / "t.db"
    for args in (("chat", "--model", "gpt-4o"), ("chat", "--api-key", "sk-x"), ("gateway", "--model", "m")):
        line = one_error_line(run(*args, "--db", f"sqlite:///{db}", cwd=tmp_path, stdin="hello\n", code=2))
        assert "needs an endpoint" in line and args[1] in line, line
    assert not db.exists()


def test_an_empty_db_option_is_named_as_the_source_of_its_error(tmp_path: Path) -> None:
    """`--db ''` is the URL used and refused; the error blamed TRANSCRIPT_STORE_URL, which was fine."""
    env = {"TRANSCRIPT_STORE_URL": f"sqlite:///{tmp_path / 'fine.db'}"}
    line = one_error_line(run("sessions", "list", "--db", "", cwd=tmp_path, code=2, env=env))
    assert line.startswith("error: --db:"), line
    line = one_error_line(run("sessions", "list", cwd=tmp_path, code=2, env={"TRANSCRIPT_STORE_URL": "nope"}))
    assert line.startswith("error: TRANSCRIPT_STORE_URL:"), line


def test_a_database_url_with_whitespace_around_it_is_a_usage_error(tmp_path: Path) -> None:
    """`TRANSCRIPT_STORE_URL="sqlite:///t.db "` (a .env file's trailing space) created and used a file
    "t.db " beside the store meant, which then looked empty: refused, nothing created."""
    for url in (f"sqlite:///{tmp_path / 't.db'} ", f" sqlite:///{tmp_path / 't.db'}",
                "postgresql+psycopg://postgres@127.0.0.1/x\u00a0"):
        line = one_error_line(run("init", cwd=tmp_path, code=2, env={"TRANSCRIPT_STORE_URL": url}))
        assert "whitespace" in line and "TRANSCRIPT_STORE_URL" in line, line
        assert "whitespace" in one_error_line(run("sessions", "list", "--db", url, cwd=tmp_path, code=2))
    assert list(tmp_path.iterdir()) == []


def test_hermes_install_refuses_an_empty_db_instead_of_another_store(tmp_path: Path) -> None:
    """`hermes install --db "$URL"` with URL unset pointed the plugin at TRANSCRIPT_STORE_URL's store (or a
    new file in the Hermes home), exit 0: the empty --db is refused as every command refuses it."""
    home = tmp_path / "h"
    env = {"TRANSCRIPT_STORE_URL": f"sqlite:///{tmp_path / 'other.db'}"}
    line = one_error_line(run("hermes", "install", "--home", str(home), "--db", "", cwd=tmp_path, code=2, env=env))
    assert line.startswith("error: --db:"), line
    assert not home.exists()


# Once, on SQLite: what a closed pipe does to the command's first line is the process's stdout, not the store's.
@pytest.mark.parametrize("backend", ["sqlite"])
@pytest.mark.parametrize("command", [("current",), ("init",), ("sessions", "delete", "s", "--yes")])
def test_a_reader_gone_before_a_plain_line_is_one_error_line(store_url: str, tmp_path: Path,
                                                             command: tuple[str, ...]) -> None:
    """`current | true`: click ends a command whose click.echo met a closed pipe with exit 1 and not a
    word, where `sessions list | true` says "cannot write to stdout" (the README's one error line)."""
    _ready_turn(store_url, "s")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    proc = subprocess.Popen([*CLI, *command, "--db", store_url], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()  # long before the interpreter has started: the reader is gone at the first write
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines == ["error: cannot write to stdout: Broken pipe"], stderr


def test_a_model_url_without_a_host_or_unparseable_is_a_usage_error(tmp_path: Path) -> None:
    """`--model-url http://` was taken, and every turn failed (exit 1, the session written); `http://[::1`
    (an unclosed bracket) was an internal error, ValueError, exit 1, also as the openai summarizer's
    OPENAI_BASE_URL, which every command checks. Usage errors now, before anything is created."""
    db = tmp_path / "t.db"
    for url in ("http://", "http:///v1", "http://[::1"):
        line = one_error_line(run("chat", "--model-url", url, "--db", f"sqlite:///{db}", cwd=tmp_path,
                                  stdin="hello\n", code=2))
        assert "model URL" in line and "internal error" not in line, line
    env = {"TRANSCRIPT_STORE_SUMMARIZER": "openai", "OPENAI_BASE_URL": "http://[::1"}
    line = one_error_line(run("sessions", "list", "--db", f"sqlite:///{db}", cwd=tmp_path, code=2, env=env))
    assert "OPENAI_BASE_URL" in line and "internal error" not in line, line
    assert not db.exists()


# Once, on SQLite: where the prompt goes at a terminal is the process's streams, not the store's.
@pytest.mark.parametrize("backend", ["sqlite"])
def test_chat_json_at_a_terminal_keeps_its_prompt_out_of_stdout(store_url: str, tmp_path: Path) -> None:
    """`chat --json | jq` typed at a terminal: the "you> " prompt was written into stdout before every
    JSON line, which then no longer parsed. The prompt goes to stderr under --json."""
    import pty

    main_fd, tty_fd = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    try:
        proc = subprocess.Popen([*CLI, "chat", "--json", "--session", "tty", "--db", store_url], cwd=tmp_path,
                                env=env, stdin=tty_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        os.write(main_fd, b"hello\n/quit\n")
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        os.close(main_fd)
        os.close(tty_fd)
    assert proc.returncode == 0, stderr
    events = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    assert [e["event"] for e in events] == ["reply", "quit"], stdout
    assert "you> " in stderr


@pytest.mark.parametrize(("host", "warned"), [("127.0.0.2", None), ("127.1", None), ("0.0.0.0", "0.0.0.0"),
                                              ("", "every interface")])
def test_serve_warns_of_listening_beyond_this_machine_only_when_it_does(
    tmp_path: Path, host: str, warned: str | None
) -> None:
    """The warning was decided by the host's spelling: every loopback address but three (127.0.0.2, 127.1)
    was "beyond this machine", and ``--host ''`` (every interface) said "listening on , beyond"."""
    log = tmp_path / "serve.log"
    with ServiceProcess(f"sqlite:///{tmp_path / 's.db'}", {"tok-serve-host-0123456789": SCOPE}, log,
                        extra_args=("--host", host)):
        pass
    lines = [line for line in log.read_text(encoding="utf-8").splitlines() if "beyond this machine" in line]
    if warned is None:
        assert lines == []
    else:
        assert len(lines) == 1 and f"listening on {warned} " in lines[0], lines


def test_a_postgresql_url_option_libpq_would_refuse_is_a_usage_error(tmp_path: Path) -> None:
    """`?sslmode=requre` (a typo), an option libpq does not know or one given twice failed only when connecting:
    exit 5, "cannot connect", each call retried as transient first (a service: 503s). A bad URL: exit 2, and
    the library's InvalidInput, before any connection. Options libpq takes still pass (sslmode=disable)."""
    from transcript_store import TranscriptStore
    from transcript_store.errors import InvalidInput

    base = "postgresql+psycopg://postgres@127.0.0.1:5432/x"
    for query, said in (("sslmode=requre", "sslmode='requre' is not one of"),
                        ("target_session_attrs=rw", "target_session_attrs='rw' is not one of"),
                        ("sslmod=require", 'invalid connection option "sslmod"'),
                        ("prepare_threshold=0", 'invalid connection option "prepare_threshold"'),
                        ("sslmode=require&sslmode=disable", "'sslmode' 2 times")):
        line = one_error_line(run("sessions", "list", "--db", f"{base}?{query}", cwd=tmp_path, code=2))
        assert "--db" in line and said in line, line
        with pytest.raises(InvalidInput, match="the URL"):
            TranscriptStore(f"{base}?{query}")
    # Accepted options reach the server as before: the database x is missing, which is an outage (exit 5).
    line = one_error_line(run("sessions", "list", "--db", f"{base}?sslmode=disable&application_name=t",
                              cwd=tmp_path, code=5))
    assert '"x" does not exist' in line, line
