"""What a CLI start imports: each command pays for its modules in CPU (a test run starts hundreds of
processes: servers, gateway workers), so a module only some commands need is imported by those only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: imported by the commands that draw a table, run a gateway (the dispatcher), or use a summarizer only
DEFERRED = ("rich", "ctypes", "regex", "transcript_store.summarize")


def _imported_after(code: str, cwd: Path) -> list[str]:
    """Which of DEFERRED ``code`` leaves imported, run in a fresh interpreter."""
    script = f"import sys\n{code}\nprint(sorted(m for m in {DEFERRED!r} if m in sys.modules))\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    env["TRANSCRIPT_STORE_URL"] = f"sqlite:///{cwd / 's.db'}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


def _cli(*commands: list[str]) -> str:
    """Code running each command through the CLI's entry point, in this process, each to exit 0."""
    return (
        "from transcript_store.cli import main\n"
        f"for args in {list(commands)!r}:\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, e.code\n"
    )


def test_a_json_command_and_a_gateway_worker_import_no_table_drawing_summarizer_or_ctypes(tmp_path: Path) -> None:
    """``sessions list --json`` imported rich (for tables it does not draw), the summarizer (regex, a model
    client) to check a variable that was unset, and the gateway's dispatcher with its progress bar and ctypes;
    a gateway worker imported rich too. A table command still imports rich when it draws."""
    json_list = _cli(["init"], ["sessions", "list", "--json"])
    assert _imported_after(json_list, tmp_path)[-1] == "[]"
    assert _imported_after("import transcript_store.gateway", tmp_path) == ["[]"]
    table = _cli(["sessions", "list"])  # no sessions: a line, no table; the store has one below
    assert _imported_after(table, tmp_path)[-1] == "[]"
    seeded = "import transcript_store as ts\nts.TranscriptStore().create_session('default', session_id='s1')\n"
    assert _imported_after(seeded + table, tmp_path)[-1] == "['rich']"
