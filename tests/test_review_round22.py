"""Findings of the twenty-second review round (an operator's walk through the CLI and the service).

Each test failed before its fix: bad URLs that surfaced as internal errors (exit 1, "rerun with --debug")
instead of usage errors (exit 2), and session ids with a slash that the service created but could not
address afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import one_error_line, run

from transcript_store import InvalidInput
from transcript_store.db import parse_url

# ---------------------------------------------------------------------------------------------- usage errors


def test_an_unclosed_ipv6_service_url_is_a_usage_error(tmp_path: Path) -> None:
    line = one_error_line(run("openclaw", "install-line", "--service-url", "http://[::1", cwd=tmp_path, code=2))
    assert "--service-url" in line and "IPv6" in line and "internal error" not in line, line


@pytest.mark.parametrize("query", ["timeout=abc", "check_same_thread=maybe", "timeout=3", "isolation_level=x"])
def test_a_sqlite_url_with_query_parameters_is_a_usage_error(query: str, tmp_path: Path) -> None:
    """sqlite3's options in the URL: malformed, a ValueError from the driver at the first connection (exit
    1, "an internal error"); well formed, overridden by the store's own without a word."""
    url = f"sqlite:///{tmp_path / 'x.db'}?{query}"
    with pytest.raises(InvalidInput, match="takes no query parameters"):
        parse_url(url)
    line = one_error_line(run("current", "--db", url, cwd=tmp_path, code=2))
    assert "no query parameters" in line and "internal error" not in line, line
    assert not (tmp_path / "x.db").exists()
