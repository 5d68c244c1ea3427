"""The README's Python examples run as printed, in a fresh process, on both backends: a reader copies
them first, and an API change that breaks one would otherwise only show when a user tries it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
# Every example opens its store on a SQLite file of its own; on PostgreSQL that URL becomes the test's.
SQLITE_URL = re.compile(r'"sqlite:///[\w.-]+\.db"')


def test_the_readme_has_its_examples() -> None:
    """The examples below are the README's (the quickstart, turn commits, an engine in a host), each
    opening a store the one way the substitution below knows."""
    assert len(BLOCKS) >= 3, len(BLOCKS)
    for block in BLOCKS:
        assert len(SQLITE_URL.findall(block)) == 1, block[:200]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_example_runs(index: int, backend: str, store_url: str, tmp_path: Path) -> None:
    """Each example's own asserts hold and it exits 0 (SQLite: the file it names, created by the example
    itself in an empty directory; PostgreSQL: a fresh migrated database)."""
    code = BLOCKS[index]
    if backend != "sqlite":
        code = SQLITE_URL.sub(lambda _m: repr(store_url), code)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
