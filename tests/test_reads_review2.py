"""Review of the read side (round 2): the cursor loop a reader writes, as the README shows it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _window_engine_source() -> str:
    """The README's example durable engine (its imports and class), without the part that runs it in a host."""
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", README, re.S | re.M) if "class WindowEngine" in b]
    assert len(blocks) == 1
    return blocks[0].split("# Run it in a host:")[0]


def test_the_readme_engine_reads_a_message_larger_than_a_default_page(store_url: str, tmp_path: Path) -> None:
    """A visible message over the default ``max_bytes`` (1,000,000) but under the default payload cap (4 MiB) comes
    as an empty page with ``has_more`` and ``required_bytes``: the README's example engine looped on that page for
    ever (the same cursor back every time), a host's turn hung in ``assemble``."""
    driver = f"""
from transcript_store import StoreConfig, TranscriptStore
store = TranscriptStore(config=StoreConfig(url={store_url!r}, auto_upgrade=False))
sid = store.create_session("t").session_id
store.append("t", sid, {{"role": "user", "content": "x" * 1_200_000}})
store.append("t", sid, {{"role": "assistant", "content": "ok"}})
admission = store.admit("t", sid, {{"role": "user", "content": "next"}}, turn_id="t2")
class Ctx:
    pass
ctx = Ctx()
ctx.store = store
out = WindowEngine(ctx).assemble(scope="t", session_id=sid, fence=admission.anchor, token_budget=10**9)
assert [len(m["content"]) for m in out.messages] == [1_200_000, 2], [len(m["content"]) for m in out.messages]
store.close()
"""
    script = tmp_path / "window.py"
    script.write_text(_window_engine_source() + driver, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRANSCRIPT_STORE_URL", None)
    try:
        result = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the README's example engine still reads after 30 s: it loops on a page it cannot take")
    assert result.returncode == 0, result.stderr
