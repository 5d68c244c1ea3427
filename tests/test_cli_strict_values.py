"""Values the CLI and the store's environment took leniently: numbers as Python's ``int`` reads them
(``+5``, ``4_096``, `` 4096 ``), a blank TRANSCRIPT_STORE_SCOPE, empty options and arguments refused as
failures (exit 1) where ``--scope ''`` was a usage error (exit 2), and chat's unknown slash commands, exit 0.

Each refusal is a usage error (exit 2) naming the variable, option or argument, with nothing written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import assistant, user
from test_cli import SCOPE, one_error_line, open_store, run, run_json

from transcript_store import InvalidInput, StoreConfig
from transcript_store.turns import Turns

#: integers as Python's int() reads them, each refused as written
LENIENT = ["+5000", "4_096", " 4096 ", "4096\n", "4096.0", "\u0664\u0660\u0669\u0666", "0x1000", " "]
NUMBER_VARS = ["TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES", "TRANSCRIPT_STORE_BUSY_TIMEOUT_MS",
               "TRANSCRIPT_STORE_RETRY_ATTEMPTS"]


def _world(url: str) -> None:
    """A session ``s1`` with one accepted turn waiting for its engine."""
    with open_store(url) as store:
        store.create_session(SCOPE, session_id="s1", session_key="key-s1")
        turns = Turns(store)
        turns.admit(SCOPE, "s1", user("question"), turn_id="turn-1", engine_id="legacy")
        turns.complete(SCOPE, "s1", "turn-1", [{"message": assistant("answer")}], None)


def _state(url: str, tmp_path: Path) -> tuple[object, object]:
    """What a refused command must leave as it was: the sessions and the outbox rows."""
    listed = run_json("sessions", "list", "--db", url, cwd=tmp_path)
    status = run_json("outbox", "status", "--db", url, cwd=tmp_path)
    rows = [(r["session_id"], r["turn_id"], r["state"]) for r in status]
    return [(s["session_id"], s["entry_count"]) for s in listed], rows


@pytest.mark.parametrize("var", NUMBER_VARS)
def test_a_number_setting_is_ascii_digits_only(var: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRANSCRIPT_STORE_RETRY_ATTEMPTS=+5`` was 5 tries, `` 4096 `` and ``4_096`` 4096: now refused,
    naming the variable, as the HTTP API's query parameters are; digits as written are taken."""
    for value in LENIENT:
        monkeypatch.setenv(var, value)
        with pytest.raises(InvalidInput, match=f"{var}=.*ASCII digits"):
            StoreConfig.from_env()
    monkeypatch.setenv(var, "5000" if var != "TRANSCRIPT_STORE_RETRY_ATTEMPTS" else "5")
    assert StoreConfig.from_env()  # as written: taken
    monkeypatch.setenv(var, "-5")  # a '-' is read, then refused by the setting's range
    with pytest.raises(InvalidInput, match="greater than or equal"):
        StoreConfig.from_env()


def test_a_lenient_number_setting_is_a_usage_error_and_nothing_is_written(store_url: str, tmp_path: Path) -> None:
    """The CLI reports it under the variable's name, exit 2, before a creating command writes."""
    _world(store_url)
    before = _state(store_url, tmp_path)
    for var in NUMBER_VARS:
        for value in ("+5000", "4_096", " 4096 "):
            result = run("chat", "--session", "new-chat", "--db", store_url, cwd=tmp_path, stdin="hello\n", code=2,
                         env={var: value})
            assert one_error_line(result).startswith(f"error: invalid store setting {var}="), result.stderr
    assert _state(store_url, tmp_path) == before


@pytest.mark.parametrize("args", [
    ("outbox", "drain", "--limit", "+5"),
    ("outbox", "drain", "--limit", "1_0"),
    ("outbox", "drain", "--limit", " 5"),
    ("outbox", "drain", "--limit", "\u0665"),
])
def test_a_number_option_is_ascii_digits_only(args: tuple[str, ...], store_url: str, tmp_path: Path) -> None:
    """click reads an integer option with ``int``: ``--limit +5`` delivered 5 turns. A usage error now,
    nothing delivered."""
    _world(store_url)
    before = _state(store_url, tmp_path)
    result = run(*args, "--db", store_url, cwd=tmp_path, code=2)
    assert f"'{args[2]}'" in result.stderr and "ASCII digits" in result.stderr, result.stderr
    assert _state(store_url, tmp_path) == before
    run("outbox", "drain", "--limit", "5", "--db", store_url, cwd=tmp_path)  # as written: taken


@pytest.mark.parametrize("args", [
    ("serve", "--port", "+8765"),
    ("serve", "--max-body", "1_048_576"),
    ("serve", "--body-timeout", " 30"),
    ("gateway", "--workers", "+1"),
    ("gateway", "--seed", "1_0"),
    ("hermes", "install", "--home", "home", "--threshold", "1e3"),
    ("hermes", "install", "--home", "home", "--threshold", "+0.5"),
    ("hermes", "install", "--home", "home", "--threshold", "nan"),
])
def test_every_number_option_is_strict(args: tuple[str, ...], tmp_path: Path) -> None:
    """The other number options, refused before any work (no store, no Hermes home made)."""
    db = f"sqlite:///{tmp_path / 'none.db'}"
    result = run(*args, "--db", db, cwd=tmp_path, code=2)
    assert "ASCII digits" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["", " ", "   "])
def test_an_empty_or_blank_scope_variable_is_refused_as_the_option_is(value: str, store_url: str,
                                                                       tmp_path: Path) -> None:
    """``TRANSCRIPT_STORE_SCOPE=" "`` was the scope " " (and "" the default scope: another tenant's
    sessions, with TENANT unset in ``TRANSCRIPT_STORE_SCOPE=$TENANT``), where ``--scope ''`` is refused."""
    _world(store_url)
    before = _state(store_url, tmp_path)
    env = {"TRANSCRIPT_STORE_SCOPE": value}
    for args in (("chat", "--session", "new-chat"), ("sessions", "list"), ("sessions", "show", "s1")):
        line = one_error_line(run(*args, "--db", store_url, cwd=tmp_path, stdin="hello\n", code=2, env=env))
        assert line.startswith("error: TRANSCRIPT_STORE_SCOPE: the scope must not be empty or blank"), line
    if value:  # the option: refused as the variable is
        result = run("chat", "--scope", value, "--db", store_url, cwd=tmp_path, stdin="hello\n", code=2)
        assert "'--scope': the scope must not be empty or blank" in result.stderr, result.stderr
    with open_store(store_url) as store:
        assert store.list_sessions(value or " ") == []
    assert _state(store_url, tmp_path) == before


def test_an_empty_scope_variable_is_refused_by_the_gateway_and_hermes_install(tmp_path: Path) -> None:
    """Those two have a scope of their own when none is named: an empty variable named none there too."""
    db = f"sqlite:///{tmp_path / 'none.db'}"
    env = {"TRANSCRIPT_STORE_SCOPE": ""}
    for args in (("gateway", "--workers", "1", "--sessions", "1", "--turns", "1", "--no-faults"),
                 ("hermes", "install", "--home", str(tmp_path / "home"))):
        line = one_error_line(run(*args, "--db", db, cwd=tmp_path, code=2, env=env))
        assert line.startswith("error: TRANSCRIPT_STORE_SCOPE: "), line
    assert list(tmp_path.iterdir()) == []


#: (argv, the name its error gives): empty or blank values, each a usage error before any work
EMPTY = [
    (("sessions", "show", ""), "'SESSION'"),
    (("sessions", "export", ""), "'SESSION'"),
    (("sessions", "delete", "", "--yes"), "'SESSION'"),
    (("compact", ""), "'SESSION'"),
    (("outbox", "drain", "--session", ""), "'--session'"),
    (("outbox", "recover", ""), "'[SESSION]'"),
    (("outbox", "block", "", "turn-1", "--reason", "why", "--yes"), "'SESSION'"),
    (("outbox", "block", "s1", "", "--reason", "why", "--yes"), "'TURN'"),
    (("outbox", "block", "s1", "turn-1", "--reason", "", "--yes"), "'--reason'"),
    (("outbox", "block", "s1", "turn-1", "--reason", "  ", "--yes"), "'--reason'"),
    (("sessions", "import", "EXPORT", "--session-id", ""), "'--session-id'"),
    (("sessions", "import", "EXPORT", "--session-id", " "), "'--session-id'"),
    (("sessions", "import", "EXPORT", "--session-id", "copy", "--session-key", " "), "'--session-key'"),
    (("chat", "--session", ""), "'--session'"),
    (("chat", "--session", " "), "'--session'"),
    (("chat", "--model-url", ""), "'--model-url'"),
    (("chat", "--model", ""), "'--model'"),
    (("chat", "--api-key", " "), "'--api-key'"),
    (("chat", "--engine", ""), "'--engine'"),
    (("compact", "s1", "--engine", " "), "'--engine'"),
]


@pytest.mark.parametrize(("args", "name"), EMPTY, ids=[" ".join(a) for a, _ in EMPTY])
def test_an_empty_value_is_a_usage_error_naming_it(args: tuple[str, ...], name: str, store_url: str,
                                                   tmp_path: Path) -> None:
    """They were exit 1 (the store's own "session_id must be 1..255 characters", "a reason is required")
    or taken for none (``chat --model-url ''`` talked to the local stand-in, exit 0)."""
    _world(store_url)
    export = tmp_path / "s1.jsonl"
    run("sessions", "export", "s1", "-o", str(export), "--db", store_url, cwd=tmp_path)
    before = _state(store_url, tmp_path)
    argv = tuple(str(export) if a == "EXPORT" else a for a in args)
    result = run(*argv, "--db", store_url, cwd=tmp_path, stdin="hello\n", code=2)
    assert f"{name}: must not be empty" in result.stderr, result.stderr
    assert result.stdout == ""
    assert _state(store_url, tmp_path) == before


def test_a_blank_name_of_a_stored_session_is_named_as_given(store_url: str, tmp_path: Path) -> None:
    """A SESSION looks up what is stored, and the store takes the id " ": it stays reachable (exit 3 when
    there is none), where an empty one names nothing (exit 2)."""
    one_error_line(run("sessions", "show", " ", "--db", store_url, cwd=tmp_path, code=3))
    with open_store(store_url) as store:
        store.create_session(SCOPE, session_id=" ")
    assert run_json("sessions", "show", " ", "--db", store_url, cwd=tmp_path)["session"]["session_id"] == " "


def test_an_unknown_chat_command_is_said_and_counted_the_chat_going_on(store_url: str, tmp_path: Path) -> None:
    """``/nonsense`` was a warning on stderr and the run exit 0: a script's typo went unnoticed. It is an
    error line naming the known commands, the lines after it still run, and the run ends with exit 1."""
    script = "hello\n/nonsense now\nagain\n/quit\n"
    result = run("chat", "--json", "--session", "c", "--db", store_url, cwd=tmp_path, stdin=script, code=1)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith("error: unknown command /nonsense; the commands are /compact"), result.stderr
    assert "/history" in errors[0] and "/quit" in errors[0]
    assert errors[-1] == "error: 1 turn(s) or command(s) failed"
    replies = [line for line in result.stdout.splitlines() if '"event": "reply"' in line]
    assert len(replies) == 2  # the conversation went on after it
    run("chat", "--session", "c", "--db", store_url, cwd=tmp_path, stdin="/help\n/history\n/quit\n")  # known: 0


#: TRANSCRIPT_STORE_FAULTS values float() and the split took as something else, and why each is refused
BAD_FAULTS = [
    ("admit.before=0.1, admit.before=0.2", "named twice"),  # the last one silently won
    ("admit.before=nan", "'nan'"),        # a probability never met: the point never fired
    ("admit.before=2", "'2'"),            # over 1: the point always fired (a kill on every pass)
    ("admit.before=-0.5", "'-0.5'"),
    ("admit.before=inf", "'inf'"),
    ("admit.before=1_0", "'1_0'"),
    ("admit.before=\u0660.\u0665", "'\u0660.\u0665'"),  # other scripts' digits: float read 0.5
    ("admit.before=", "''"),              # an '=' and nothing: it was 1
    ("admit.before=0,5", "'5'"),          # a decimal comma: a point named '5' at 1, admit.before at 0
    ("=0.5", "'=0.5'"),                   # no name
]
GOOD_FAULTS = {"admit.before": {"admit.before": 1.0}, " *=0.25 , commit.after_apply=1e-3,": {"*": 0.25,
               "commit.after_apply": 0.001}, "lossless.compact.mid_write=0": {"lossless.compact.mid_write": 0.0},
               "no.such.point=1": {"no.such.point": 1.0}, "": {}}


def test_a_malformed_fault_setting_names_the_variable_and_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """``float()`` and ``int()`` read TRANSCRIPT_STORE_FAULTS and TRANSCRIPT_STORE_FAULT_SEED: a bad value was a
    bare ValueError out of the first fault point passed, inside a turn (``could not convert string to float``),
    or a setting other than the one meant. InvalidInput now, naming the variable and the value, at that point
    too; a name no code passes is still inert (engines and plugins name their own points)."""
    from transcript_store import faults

    for spec, bad in BAD_FAULTS:
        with pytest.raises(InvalidInput, match=f"TRANSCRIPT_STORE_FAULTS=.*{re.escape(bad)}"):
            faults.parse_rates(spec)
    for spec, rates in GOOD_FAULTS.items():
        assert faults.parse_rates(spec) == rates, spec
    for seed in LENIENT:
        with pytest.raises(InvalidInput, match=r"TRANSCRIPT_STORE_FAULT_SEED=.*ASCII digits"):
            faults.parse_seed(seed)
    assert faults.parse_seed("-7") == -7 and faults.parse_seed("") is None and faults.parse_seed(None) is None
    try:
        for var, value in (("TRANSCRIPT_STORE_FAULTS", "admit.before=nan"), ("TRANSCRIPT_STORE_FAULT_SEED", "1_0")):
            monkeypatch.setenv(var, value)
            faults.reset()
            with pytest.raises(InvalidInput, match=f"{var}="):
                faults.point("admit.before")
            monkeypatch.delenv(var)
    finally:
        faults.reset()


@pytest.mark.real_script
def test_a_malformed_fault_setting_is_a_usage_error_and_nothing_is_written(store_url: str, tmp_path: Path) -> None:
    """`chat` with ``TRANSCRIPT_STORE_FAULTS=admit.before=2`` was killed at its first admission (any value over
    1 always fired), ``=nan`` ran with the point off; a seed `` 5`` was 5. Exit 2 now, before anything is written."""
    _world(store_url)
    before = _state(store_url, tmp_path)
    for var, value in (("TRANSCRIPT_STORE_FAULTS", "admit.before=2"), ("TRANSCRIPT_STORE_FAULTS", "admit.before=nan"),
                       ("TRANSCRIPT_STORE_FAULTS", "admit.before=0,5"), ("TRANSCRIPT_STORE_FAULT_SEED", " 5")):
        result = run("chat", "--session", "new-chat", "--db", store_url, cwd=tmp_path, stdin="hello\n", code=2,
                     env={var: value})
        assert one_error_line(result).startswith(f"error: invalid {var}="), result.stderr
        for command in (("sessions", "list"), ("outbox", "status")):  # a command that builds no engine too
            result = run(*command, "--db", store_url, cwd=tmp_path, code=2, env={var: value})
            assert one_error_line(result).startswith(f"error: invalid {var}="), result.stderr
    assert _state(store_url, tmp_path) == before
