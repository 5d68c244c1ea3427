"""``doctor`` as a demanding user runs it (session 43): an engine given an ``[engine.config.<id>]`` table that it
refuses, when that engine is not the selected one.

`engines list` warned of it ("cannot load ... see `transcript-store doctor`"), and `chat --engine lossless` ran its
turns on legacy (a bad `[engine.config.legacy]` stopped `chat` and `serve` before they opened the store), but
`doctor` checked the selected engine only: "ok", exit 0. README: such an engine is a `warning:` line, "`engines
list` still exits 0, `doctor` 1"."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import _script_mode, run, run_json  # noqa: F401 (autouse: honours real_script)

#: (settings file, the engine refused, the key named)
CASES = [
    ('[engine.config.lossless]\nfresh_tail_messages = "16"\n', "lossless", "fresh_tail_messages"),
    ('[engine]\nslot = "lossless"\n[engine.config.legacy]\nkeep_lats = 6\n', "legacy", "keep_lats"),
]


def _config(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "ts.toml"
    path.write_text(text, encoding="utf-8")
    return {"TRANSCRIPT_STORE_CONFIG": str(path)}


@pytest.mark.parametrize(("text", "engine", "key"), CASES, ids=["lossless", "legacy"])
def test_doctor_fails_on_a_configured_engine_that_cannot_load_though_not_selected(
    store_url: str, tmp_path: Path, text: str, engine: str, key: str
) -> None:
    env = _config(tmp_path, text)
    listed = run_json("engines", "list", "--db", store_url, cwd=tmp_path, env=env)  # exit 0: it lists, and warns
    assert any(f"'{engine}' cannot load" in w and key in w for w in listed["warnings"]), listed["warnings"]
    checked = run_json("doctor", "--db", store_url, cwd=tmp_path, env=env, code=1)
    assert not checked["ok"]
    assert any(f"'{engine}'" in p and key in p for p in checked["problems"]), checked["problems"]
    text_run = run("doctor", "--db", store_url, cwd=tmp_path, env=env, code=1)
    assert text_run.stdout.splitlines()[-1] == "NOT OK"
    assert any(line.startswith("problem: ") and key in line for line in text_run.stdout.splitlines())


def test_doctor_passes_a_configured_engine_that_loads(store_url: str, tmp_path: Path) -> None:
    """A table the engine takes, of an engine not selected, is no problem."""
    env = _config(tmp_path, "[engine.config.lossless]\nfresh_tail_messages = 16\n")
    checked = run_json("doctor", "--db", store_url, cwd=tmp_path, env=env)
    assert checked["ok"] and checked["problems"] == []
