"""A mistyped ``[engine.config.<id>]`` value (``fresh_tail_messages = "16"``) made the engine fail to load, and
the host ran its turns on legacy, by design: `chat` said nothing before a turn ran (exit 0), `serve` nothing
before a request, `engines list` exited 0 with a "NO:" in a table column; only `doctor` reported it.

Now `chat`, `gateway` and `serve` say so on stderr, one warning line naming the key, before any turn, and
`engines list` lists it among its warnings (still exit 0: `doctor` is the check, exit 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from service_process import ServiceProcess
from test_cli import _script_mode, run, run_json  # noqa: F401 (autouse: honours real_script)

MISTYPED = '[engine]\nslot = "lossless"\n[engine.config.lossless]\nfresh_tail_messages = "16"\n'
FINE = '[engine]\nslot = "lossless"\n[engine.config.lossless]\nfresh_tail_messages = 16\n'


#: warnings said at start come from the settings, before any store is opened: the backend changes nothing
#: there, so these run on one (CI time: each is a process or two, 4-7 s a backend)
ONE_BACKEND = pytest.mark.parametrize("backend", ["sqlite"])


def _config(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "ts.toml"
    path.write_text(text, encoding="utf-8")
    return {"TRANSCRIPT_STORE_CONFIG": str(path)}


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: ") and "cannot load" in line]


@ONE_BACKEND
def test_chat_warns_of_a_mistyped_engine_value_before_any_turn(store_url: str, tmp_path: Path) -> None:
    """One line on stderr naming the engine and the key, with nothing typed yet; the run is as before."""
    env = _config(tmp_path, MISTYPED)
    result = run("chat", "--db", store_url, cwd=tmp_path, stdin="/quit\n", env=env)
    (line,) = _warnings(result.stderr)
    assert "'lossless'" in line and "fresh_tail_messages" in line and "legacy" in line, line
    turn = run("chat", "--db", store_url, cwd=tmp_path, stdin="hello\n", env=env)  # by design: runs on legacy
    assert len(_warnings(turn.stderr)) == 1 and "ran on legacy" in turn.stdout
    fine = run("chat", "--db", store_url, cwd=tmp_path, stdin="/quit\n", env=_config(tmp_path, FINE))
    assert _warnings(fine.stderr) == []


@ONE_BACKEND
def test_engines_list_warns_and_doctor_fails(store_url: str, tmp_path: Path) -> None:
    env = _config(tmp_path, MISTYPED)
    listed = run_json("engines", "list", "--db", store_url, cwd=tmp_path, env=env)
    (warning,) = [w for w in listed["warnings"] if "cannot load" in w]
    assert "fresh_tail_messages" in warning
    text = run("engines", "list", "--db", store_url, cwd=tmp_path, env=env).stdout
    assert any(line.startswith("warning: ") and "fresh_tail_messages" in line for line in text.splitlines())
    run("doctor", "--db", store_url, cwd=tmp_path, env=env, code=1)
    fine = run_json("engines", "list", "--db", store_url, cwd=tmp_path, env=_config(tmp_path, FINE))
    assert not [w for w in fine["warnings"] if "cannot load" in w]


@ONE_BACKEND
def test_serve_warns_at_start(store_url: str, tmp_path: Path) -> None:
    env = _config(tmp_path, MISTYPED)
    with ServiceProcess(store_url, {"tok": "s"}, tmp_path / "serve.log", env=env) as proc:
        log = proc.log()
    (line,) = _warnings(log)
    assert "'lossless'" in line and "fresh_tail_messages" in line


@ONE_BACKEND
def test_a_selected_engine_that_is_not_installed_is_warned_of_too(store_url: str, tmp_path: Path) -> None:
    """A slot naming no installed engine (`slot = "losless"`, a typo) runs every turn on legacy, as a mistyped
    value does: it was no warning at all, `chat` and `serve` silent before a turn, `engines list` exit 0 with
    a "NO:" in a table cell."""
    env = _config(tmp_path, '[engine]\nslot = "losless"\n')
    chat = run("chat", "--db", store_url, cwd=tmp_path, stdin="/quit\n", env=env)
    (line,) = _warnings(chat.stderr)
    assert "'losless'" in line and "known: legacy, lossless" in line and "legacy engine" in line, line
    listed = run_json("engines", "list", "--db", store_url, cwd=tmp_path, env=env)
    assert [w for w in listed["warnings"] if "cannot load" in w] == [line.removeprefix("warning: ")]
    with ServiceProcess(store_url, {"tok": "s"}, tmp_path / "serve.log", env=env) as proc:
        log = proc.log()
    assert _warnings(log) == [line]


@pytest.mark.real_script  # the workers' stderr is the process's own: only a subprocess captures it
def test_gateway_says_a_bad_engine_config_once_not_once_a_worker(store_url: str, tmp_path: Path) -> None:
    """Each worker quarantined the engine as it first met it, and its record reached stderr: one `ERROR: ...
    quarantined` line a worker (respawns included) after the start-up warning that had said it already.
    The gateway's own start-up warning is checked here too (CI time: one gateway run, not two)."""
    env = _config(tmp_path, MISTYPED)
    result = run("gateway", "--db", store_url, "--workers", "2", "--sessions", "2", "--turns", "1", "--no-faults",
                 "--json", cwd=tmp_path, env=env)
    (line,) = _warnings(result.stderr)
    assert "fresh_tail_messages" in line
    assert "quarantined" not in result.stderr, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["quarantines"] == 1  # the report still counts it, and says why turns degraded
    assert any("fresh_tail_messages" in reason for reason in report["degraded"])


def test_the_workers_filter_drops_only_the_load_failures_already_reported() -> None:
    """Another failure of that engine (its assemble), or another engine's failure to load, is still printed."""
    import logging

    from transcript_store.gateway import _NotReportedAgain
    from transcript_store.host import QUARANTINE_RECORD

    def record(engine_id: str, operation: str) -> logging.LogRecord:
        rec = logging.LogRecord("transcript_store.host", logging.ERROR, __file__, 1, "quarantined", (), None)
        setattr(rec, QUARANTINE_RECORD, (engine_id, operation))
        return rec

    keep = _NotReportedAgain(["lossless"])
    assert not keep.filter(record("lossless", "factory"))
    assert keep.filter(record("lossless", "assemble"))
    assert keep.filter(record("other", "factory"))
    plain = logging.LogRecord("transcript_store.host", logging.ERROR, __file__, 1, "a worker error", (), None)
    assert keep.filter(plain)
