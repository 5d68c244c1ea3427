"""A SESSION, TURN, key or name given as bytes that are not UTF-8 (``$'\\xff'`` in a shell) is a usage error,
exit 2 naming the argument, before the store is opened: it was refused by the store's checks after opening
it, as a failure (exit 1), while ``--scope`` with the same bytes was already exit 2."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_cli import CLI

BAD = b"caf\xff"


# Once, on SQLite: the refusal comes before the store is opened, so the backend --db names plays no part.
@pytest.mark.parametrize("backend", ["sqlite"])
@pytest.mark.parametrize(
    ("args", "named"),
    [
        ([b"sessions", b"show", BAD], b"SESSION"),
        ([b"sessions", b"export", BAD], b"SESSION"),
        ([b"compact", BAD], b"SESSION"),
        ([b"outbox", b"block", b"s1", BAD, b"--reason", b"why"], b"TURN"),
        ([b"outbox", b"block", b"s1", b"t1", b"--reason", BAD], b"--reason"),
        ([b"chat", b"--session", BAD], b"--session"),
    ],
)
def test_an_argument_of_bytes_that_are_not_utf8_is_a_usage_error(
    args: list[bytes], named: bytes, store_url: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    argv = [c.encode() for c in CLI] + args + [b"--db", store_url.encode()]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = subprocess.run(argv, cwd=cwd, capture_output=True, env=env, timeout=120, input=b"")
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and b"not UTF-8" in result.stderr, result.stderr
    assert b"Traceback" not in result.stderr
    assert list(cwd.iterdir()) == []  # nothing made (no ./transcripts.db either)
