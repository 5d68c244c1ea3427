"""A ``plugin_dirs`` folder that cannot be searched (TRANSCRIPT_STORE_PLUGIN_DIRS=/nonexistent, a settings file's
entry naming a missing folder or a file) was accepted silently where engines run: `chat`, `serve` and
`gateway` started without a word, and `doctor` said "ok" (exit 0) with a warning line; the engines it was
meant to hold were missing all the same. Treated as the other engine-loading problems are: `engines list`
warns (exit 0: it lists), `doctor` reports a problem (exit 1), `chat`, `serve` and `gateway` warn at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from service_process import ServiceProcess
from test_cli import run, run_json

CASES = ["env-missing", "file-missing", "file-a-file"]


#: a plugin dir is checked from the settings, before any store is opened: the backend changes nothing there,
#: so these run on one (CI time: each is a process or two, 3-4 s a backend)
ONE_BACKEND = pytest.mark.parametrize("backend", ["sqlite"])


def _env(tmp_path: Path, case: str) -> tuple[dict[str, str], str]:
    """The environment naming the bad folder, and the path the warning names."""
    if case == "env-missing":
        missing = tmp_path / "nonexistent"
        return {"TRANSCRIPT_STORE_PLUGIN_DIRS": str(missing)}, f"plugin dir {missing} does not exist"
    config = tmp_path / "ts.toml"
    if case == "file-missing":
        config.write_text('[engine]\nplugin_dirs = ["my-engines"]\n', encoding="utf-8")
        return {"TRANSCRIPT_STORE_CONFIG": str(config)}, f"plugin dir {tmp_path / 'my-engines'} does not exist"
    (tmp_path / "engines.txt").write_text("not a folder\n", encoding="utf-8")
    config.write_text('[engine]\nplugin_dirs = ["engines.txt"]\n', encoding="utf-8")
    return {"TRANSCRIPT_STORE_CONFIG": str(config)}, f"plugin dir {tmp_path / 'engines.txt'} is not a folder"


def _said(stderr: str, what: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: ") and what in line]


@ONE_BACKEND
@pytest.mark.parametrize("case", CASES)
def test_engines_list_warns_and_doctor_fails(store_url: str, tmp_path: Path, case: str) -> None:
    env, what = _env(tmp_path, case)
    listed = run_json("engines", "list", "--db", store_url, cwd=tmp_path, env=env)
    assert what in listed["warnings"]
    text = run("engines", "list", "--db", store_url, cwd=tmp_path, env=env).stdout
    assert f"warning: {what}" in text.splitlines()
    doctor = run_json("doctor", "--db", store_url, cwd=tmp_path, env=env, code=1)
    assert not doctor["ok"] and doctor["problems"] == [what], doctor["problems"]
    assert what not in doctor["warnings"]  # said once, as the problem it is
    out = run("doctor", "--db", store_url, cwd=tmp_path, env=env, code=1)
    assert f"problem: {what}" in out.stdout.splitlines() and "NOT OK" in out.stdout


@ONE_BACKEND
def test_a_folder_that_is_there_is_no_problem(store_url: str, tmp_path: Path) -> None:
    (tmp_path / "my-engines").mkdir()
    env = {"TRANSCRIPT_STORE_PLUGIN_DIRS": str(tmp_path / "my-engines")}
    assert run_json("doctor", "--db", store_url, cwd=tmp_path, env=env)["ok"]
    assert not _said(run("chat", "--db", store_url, cwd=tmp_path, stdin="/quit\n", env=env).stderr, "plugin dir")


@ONE_BACKEND
@pytest.mark.parametrize("case", CASES)
def test_chat_and_gateway_warn_at_start(store_url: str, tmp_path: Path, case: str) -> None:
    env, what = _env(tmp_path, case)
    chat = run("chat", "--db", store_url, cwd=tmp_path, stdin="/quit\n", env=env)
    (line,) = _said(chat.stderr, what)
    assert "no engine is loaded from it" in line, line
    gateway = run("gateway", "--db", store_url, "--workers", "1", "--sessions", "1", "--turns", "1", "--no-faults",
                  "--json", cwd=tmp_path, env=env)
    assert len(_said(gateway.stderr, what)) == 1, gateway.stderr
    assert json.loads(gateway.stdout)["ok"]


@ONE_BACKEND
def test_serve_warns_at_start(store_url: str, tmp_path: Path) -> None:
    env, what = _env(tmp_path, "env-missing")
    with ServiceProcess(store_url, {"tok": "s"}, tmp_path / "serve.log", env=env) as proc:
        log = proc.log()
    assert len(_said(log, what)) == 1, log
