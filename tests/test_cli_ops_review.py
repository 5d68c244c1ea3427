"""Findings of a review of the CLI's configuration and operational commands: secrets in a database URL
that the URL's own syntax splits, settings that reach the commands."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import one_error_line, run

from transcript_store import InvalidInput, TranscriptStore
from transcript_store.db import parse_url

# ---------------------------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    "url",
    ["postgresql+psycopg://app:top@s3cret-pw@127.0.0.1:1/x", "sqlite://app:top@s3cret-pw@x.db"],
)
@pytest.mark.parametrize("command", [("current",), ("doctor", "--json"), ("init",), ("gateway", "--no-faults")])
def test_a_password_with_an_unescaped_at_sign_is_refused_unshown(url: str, command: tuple[str, ...],
                                                                  tmp_path: Path) -> None:
    """The password ended at its first "@" and the rest became the host: `failed to resolve host
    's3cret-pw@127.0.0.1'` (exit 5, retried) and doctor's masked URL `app:***@s3cret-pw@...` showed it."""
    result = run(*command, "--db", url, cwd=tmp_path, code=2)
    line = one_error_line(result)
    assert "%40" in line, line
    assert "s3cret" not in result.stdout + result.stderr, result
    assert not list(tmp_path.iterdir())
    with pytest.raises(InvalidInput, match="%40") as caught:
        TranscriptStore(url)
    assert "s3cret" not in str(caught.value)


def test_a_percent_encoded_at_sign_is_still_a_password() -> None:
    parsed = parse_url("postgresql+psycopg://app:top%40s3cret@127.0.0.1/x")
    assert (parsed.password, parsed.host) == ("top@s3cret", "127.0.0.1")
