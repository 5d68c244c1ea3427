"""Findings of the CLI/configuration review: engines' print output under --json, read commands on a
PostgreSQL database without the schema, secrets in URL query parameters, the summarizer's endpoint, SQLite
driver names, chat's exit codes (a failed /compact, the database's refusal), the outbox beyond one read."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import PG_ADMIN, _admin_exec, assistant, pg_url, user
from test_cli import SCOPE, SUBPROCESS, empty_url, one_error_line, open_store, run, run_json
from test_cli_transfer_review import _chatty_plugin

from transcript_store import InvalidInput, cli
from transcript_store.cli import error_line
from transcript_store.db import mask_url, parse_url
from transcript_store.settings import load_settings
from transcript_store.turns import Turns

__all__ = ["empty_url"]  # a fixture of test_cli's, used here

PG_ONLY = pytest.mark.parametrize("backend", ["postgresql"])


# ---------------------------------------------------------------------------------------------- 1: engines' print


@pytest.mark.real_script
def test_an_engines_print_goes_to_stderr_in_chat_compact_drain_and_recover(store_url: str, tmp_path: Path) -> None:
    """stdout holds the command's own output (JSON lines for chat, one document for the others)."""
    _chatty_plugin(tmp_path)
    (tmp_path / "transcript-store.toml").write_text('[engine]\nslot = "chatty"\nplugin_dirs = ["plugins"]\n',
                                                    encoding="utf-8")
    chat = run("chat", "--json", "--session", "s1", "--db", store_url, cwd=tmp_path, stdin="hello there\n")
    events = [json.loads(line) for line in chat.stdout.splitlines() if line.strip()]
    assert any(e["event"] == "reply" and e["engine_id"] == "chatty" for e in events), events
    outputs = [chat]
    for command in (("compact", "s1"), ("outbox", "drain"), ("outbox", "recover")):
        result = run(*command, "--json", "--db", store_url, cwd=tmp_path)
        json.loads(result.stdout)  # nothing around the document
        outputs.append(result)
    for result in outputs:
        assert "chatty says" not in result.stdout, result.stdout
        assert "chatty says: loading" in result.stderr, result.stderr
        assert "\x1b" not in result.stderr  # shown, as under engines list and doctor
    table = run("compact", "s1", "--db", store_url, cwd=tmp_path)
    assert "compacted" in table.stdout and "chatty says" not in table.stdout


# ---------------------------------------------------------------------------------------------- 2: no schema


@pytest.mark.parametrize("command", [("sessions", "list"), ("outbox", "status"), ("sessions", "show", "s1")])
def test_read_commands_never_create_a_store_even_with_auto_upgrade(
    empty_url: str, backend: str, tmp_path: Path, command: tuple[str, ...]
) -> None:
    env = {"TRANSCRIPT_STORE_AUTO_UPGRADE": "1"}
    line = one_error_line(run(*command, "--db", empty_url, cwd=tmp_path, env=env, code=4))
    assert "no store at" in line and "transcript-store init" in line
    run("engines", "list", "--db", empty_url, cwd=tmp_path, env=env)  # lists the engines, without a store
    if backend == "sqlite":
        assert not Path(empty_url.removeprefix("sqlite:///")).exists()
    else:
        assert run_json("current", "--db", empty_url, cwd=tmp_path, env=env, code=4)["state"] == "none"
    assert "created the schema" in run("init", "--db", empty_url, cwd=tmp_path, env=env).stdout  # init does


# ---------------------------------------------------------------------------------------------- 3: ?password=


def test_mask_url_and_error_lines_hide_secret_query_parameters() -> None:
    url = "postgresql+psycopg://app:userinfo-pw@db/x?password=q-pw&sslmode=require&sslpassword=key-pw"
    masked = mask_url(url)
    assert masked == "postgresql+psycopg://app:***@db/x?password=***&sslmode=require&sslpassword=***"
    line = error_line(RuntimeError("failed with userinfo-pw, q-pw and key-pw"), url)
    assert "pw" not in line.replace("userinfo", ""), line  # every one scrubbed
    assert mask_url("sqlite:///a.db?timeout=3") == "sqlite:///a.db?timeout=3"


@PG_ONLY
def test_a_password_given_as_a_query_parameter_is_never_printed(empty_url: str, tmp_path: Path) -> None:
    url = f"{empty_url}?password=s3cr3t-pw"
    outputs = [run("init", "--db", url, cwd=tmp_path), run("init", "--json", "--db", url, cwd=tmp_path),
               run("current", "--db", url, cwd=tmp_path), run("doctor", "--db", url, cwd=tmp_path)]
    down = url.replace(":5432/", ":1/")  # nothing listens on port 1
    outputs.append(run("sessions", "list", "--db", down, cwd=tmp_path, code=5))
    outputs.append(run("doctor", "--db", down, cwd=tmp_path, code=5))
    for result in outputs:
        assert "s3cr3t" not in result.stdout + result.stderr, result
    assert "password=***" in outputs[2].stdout


# ---------------------------------------------------------------------------------------------- 4: summarizer URL


def test_a_summarizer_endpoint_that_is_not_http_is_a_usage_error_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"TRANSCRIPT_STORE_SUMMARIZER": "openai", "OPENAI_BASE_URL": "ftp://example.com/v1"}
    new = tmp_path / "new.db"
    line = one_error_line(run("chat", "--model-url", "http://127.0.0.1:9/v1", "--db", f"sqlite:///{new}",
                              cwd=tmp_path, stdin="hi\n", env=env, code=2))
    assert "OPENAI_BASE_URL" in line
    assert not new.exists()  # refused before the store was created
    doctor = run("doctor", "--json", "--db", f"sqlite:///{new}", cwd=tmp_path, env=env, code=2)
    assert doctor.stdout == ""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInput, match="OPENAI_BASE_URL"):
        load_settings()
    monkeypatch.setenv("OPENAI_BASE_URL", "https://example.com/v1")
    assert load_settings().engine == "legacy"


# ---------------------------------------------------------------------------------------------- 5: SQLite driver


@pytest.mark.parametrize("driver", ["nope", "aiosqlite"])
def test_a_sqlite_driver_other_than_sqlite3_is_a_usage_error(tmp_path: Path, driver: str) -> None:
    url = f"sqlite+{driver}:///{tmp_path / 'a.db'}"
    for command in (("init",), ("sessions", "list")):
        line = one_error_line(run(*command, "--db", url, cwd=tmp_path, code=2))
        assert f"unsupported SQLite driver {driver!r}" in line
    assert not (tmp_path / "a.db").exists()
    with pytest.raises(InvalidInput):
        parse_url(url)
    ok = f"sqlite+pysqlite:///{tmp_path / 'ok.db'}"
    run("init", "--db", ok, cwd=tmp_path)
    assert run_json("sessions", "list", "--db", ok, cwd=tmp_path) == []


# ---------------------------------------------------------------------------------------------- 6: chat /compact


def test_a_failed_compact_in_chat_fails_the_chat(store_url: str, tmp_path: Path) -> None:
    with open_store(store_url) as store:
        store.create_session(SCOPE, session_id="long", session_key="cli:long")
        for i in range(12):
            words = " ".join(f"word{i}-{j}" for j in range(120))
            store.append(SCOPE, "long", user(f"question {i}: {words}"))
            store.append(SCOPE, "long", assistant(f"answer {i}: {words}"))
    # a summarizer whose endpoint refuses connections: the compaction fails
    env = {"TRANSCRIPT_STORE_SUMMARIZER": "openai", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    alone = run_json("compact", "long", "--db", store_url, cwd=tmp_path, env=env, code=1)
    assert alone["ok"] is False
    chat = run("chat", "--json", "--session", "cli:long", "--db", store_url, cwd=tmp_path, env=env,
               stdin="/compact\n", code=1)
    event = json.loads(chat.stdout.splitlines()[0])
    assert event["event"] == "compact" and event["ok"] is False
    assert "1 turn(s) or command(s) failed" in chat.stderr


# ---------------------------------------------------------------------------------------------- 7: chat refused


@pytest.fixture
def read_only_url(empty_url: str, tmp_path: Path) -> Iterator[str]:
    """A store with session key k1, and the URL of a role that may only read it (dropped afterwards)."""
    run("init", "--db", empty_url, cwd=tmp_path)
    run("chat", "--session", "k1", "--db", empty_url, cwd=tmp_path, stdin="hello\n")
    role = f"ts_ro_{uuid.uuid4().hex[:10]}"
    name = empty_url.rsplit("/", 1)[1]
    _admin_exec(f"CREATE ROLE {role} LOGIN")
    with psycopg.connect(PG_ADMIN.rsplit("/", 1)[0] + f"/{name}", autocommit=True) as conn:
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    try:
        yield pg_url(name).replace("postgres@", f"{role}@", 1)
    finally:
        with psycopg.connect(PG_ADMIN.rsplit("/", 1)[0] + f"/{name}", autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
        _admin_exec(f"DROP ROLE IF EXISTS {role}")


@PG_ONLY
def test_chat_exits_with_the_databases_refusal(read_only_url: str, tmp_path: Path) -> None:
    one_error_line(run("sessions", "delete", "k1", "--yes", "--db", read_only_url, cwd=tmp_path, code=6))
    chat = run("chat", "--session", "k1", "--db", read_only_url, cwd=tmp_path, stdin="hello again\n", code=6)
    assert "permission denied" in chat.stderr


def test_chat_loop_keeps_the_worst_exit_code() -> None:
    from transcript_store.errors import PermissionDenied, StoreUnavailable

    loop = cli.ChatLoop(runtime=None, scope=SCOPE, session_id="s", as_json=True)
    loop.failure(InvalidInput("a bad message"))
    assert loop.code == cli.EXIT_FAILED
    loop.failure(StoreUnavailable("down"))
    assert loop.code == cli.EXIT_UNAVAILABLE
    loop.failure(PermissionDenied("no grant"))
    loop.failure(InvalidInput("another"))
    assert (loop.failed, loop.code) == (4, cli.EXIT_DENIED)


# ---------------------------------------------------------------------------------------------- 8: the outbox


def test_outbox_status_says_it_shows_part_and_recover_reaches_every_session(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if SUBPROCESS:
        pytest.skip("lowers the CLI's bounds in this process")
    with open_store(store_url) as store:
        turns = Turns(store)
        for n in range(5):
            sid = f"s{n}"
            store.create_session(SCOPE, session_id=sid)
            turns.admit(SCOPE, sid, user("hi"), turn_id="t1", engine_id="legacy")
            turns.complete(SCOPE, sid, "t1", [{"message": assistant("hello")}], None)
    # Where the outbox commands read them (cli/intents.py): set on the package, they would change nothing.
    monkeypatch.setattr(cli.intents, "OUTBOX_STATUS_ROWS", 2)
    monkeypatch.setattr(cli.intents, "OUTBOX_PAGE", 2)  # three pages of session ids
    status = run("outbox", "status", "--json", "--db", store_url, cwd=tmp_path)
    assert [r["session_id"] for r in json.loads(status.stdout)] == ["s0", "s1"]
    assert "holds 5 rows; showing the first 2" in status.stderr
    table = run("outbox", "status", "--db", store_url, cwd=tmp_path)
    assert table.stdout.strip().splitlines()[-1] == "5 accepted"  # every row counted
    recovered = run_json("outbox", "recover", "--db", store_url, cwd=tmp_path)
    assert [r["session_id"] for r in recovered] == [f"s{n}" for n in range(5)]
    assert run("outbox", "status", "--db", store_url, cwd=tmp_path).stdout.strip() == "the outbox is empty"


# ---------------------------------------------------------------------------------------------- config tables


def test_a_config_table_of_no_engine_is_said_by_engines_list_and_doctor(store_url: str, tmp_path: Path) -> None:
    """[engine.config.legcy] (a typo) was taken without a word: legacy ran on its defaults and doctor said
    ok, where a typo in a key inside [engine.config.legacy] is refused."""
    (tmp_path / "typo.toml").write_text("[engine.config.legcy]\nkeep_last = 2\n")
    (tmp_path / "right.toml").write_text("[engine.config.legacy]\nkeep_last = 2\n")
    for command in (("engines", "list"), ("doctor",)):
        typo = run_json(*command, "--config", "typo.toml", "--db", store_url, cwd=tmp_path)
        assert any("[engine.config.legcy]" in w and "nothing reads it" in w for w in typo["warnings"]), typo
        right = run_json(*command, "--config", "right.toml", "--db", store_url, cwd=tmp_path)
        assert not any("engine.config" in w for w in right["warnings"]), right


# ---------------------------------------------------------------------------------------------- 9: chat's edges
# (round 26: a review of the CLI found each of these)


def test_chat_refuses_a_bad_session_key_or_scope_before_creating_a_store(tmp_path: Path) -> None:
    """Settings and the model URL were checked before the store was created, the key and the scope only
    in ``open_session``, after: a refused chat left a new store behind."""
    url = f"sqlite:///{tmp_path / 'new.db'}"
    one_error_line(run("chat", "--session", "bad\tkey", "--db", url, cwd=tmp_path, stdin="hi\n", code=1))
    run("chat", "--db", url, cwd=tmp_path, stdin="hi\n", env={"TRANSCRIPT_STORE_SCOPE": "s" * 300}, code=2)
    assert not (tmp_path / "new.db").exists()


def test_a_chat_line_over_the_cap_in_bytes_ends_the_chat(store_url: str, tmp_path: Path) -> None:
    """The cap is in bytes: a line of 1,500 "é" (3,000 bytes) under a 2,000-byte cap became a failed turn
    and chat went on, where 2,500 ASCII characters ended it."""
    env = {"TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES": "2000"}
    for line in ("x" * 2_500, "é" * 1_500):
        chat = run("chat", "--json", "--session", "k-cap", "--db", store_url, cwd=tmp_path, env=env,
                   stdin=f"{line}\nthe line after it\n", code=1)
        assert "bytes (over the store's payload cap" in chat.stderr and "the line after it" not in chat.stdout


# Once, on SQLite: a missing stdin is the process's, not the store's.
@pytest.mark.parametrize("backend", ["sqlite"])
def test_chat_with_its_stdin_closed_ends_at_once(store_url: str, tmp_path: Path) -> None:
    """``chat <&-``: no standard input at all (sys.stdin is None) was an internal error."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    result = subprocess.run([sys.executable, "-m", "transcript_store", "chat", "--db", store_url], cwd=tmp_path,
                            capture_output=True, text=True, env=env, timeout=120, preexec_fn=lambda: os.close(0))
    assert result.returncode == 0 and "internal error" not in result.stderr, result.stderr


# Once, on SQLite: a missing stdout is refused before the session is opened, whatever the backend.
@pytest.mark.parametrize("backend", ["sqlite"])
def test_chat_with_its_stdout_closed_fails_before_any_turn(store_url: str, tmp_path: Path) -> None:
    """``chat >&-``: the loop took the missing stdout for "the default", by then stderr: every turn ran and
    committed, its replies (--json too) on stderr, exit 0. It fails as every other command does, exit 1,
    before the session is opened."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    result = subprocess.run([sys.executable, "-m", "transcript_store", "chat", "--json", "--session", "k-out",
                             "--db", store_url], cwd=tmp_path, input="hello\n", stderr=subprocess.PIPE, text=True,
                            env=env, timeout=120, preexec_fn=lambda: os.close(1))
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == "error: cannot write to stdout: it is closed"
    with open_store(store_url) as store:
        assert store.find_session(SCOPE, "k-out") is None


def test_a_failed_chat_turn_exits_1_unless_the_database_refused_it() -> None:
    """A turn whose session was deleted under it (3) or whose schema moved (4) is a failed turn: 1."""
    from transcript_store.errors import SchemaNotCurrent, UnknownSession

    loop = cli.ChatLoop(runtime=None, scope=SCOPE, session_id="s", as_json=True)
    loop.failure(UnknownSession(SCOPE, "s"))
    loop.failure(SchemaNotCurrent("moved"))
    assert (loop.failed, loop.code) == (2, cli.EXIT_FAILED)
