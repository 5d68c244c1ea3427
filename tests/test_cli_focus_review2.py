"""``transcript-store compact --focus`` with bytes that are not UTF-8 is a usage error (exit 2), as any bad
argument is; it was refused by the compaction, as a failure (exit 1)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from transcript_store import TranscriptStore
from transcript_store.cli import cli


def test_compact_with_an_undecodable_focus_is_a_usage_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    store = TranscriptStore(url)
    try:
        sid = store.create_session("default").session_id
    finally:
        store.close()
    focus = b"caf\xff".decode("utf-8", "surrogateescape")  # what Python makes of such an argv byte
    result = CliRunner().invoke(cli, ["--db", url, "compact", sid, "--focus", focus])
    assert result.exit_code == 2, result.output
    assert "--focus" in result.output and "lone surrogates" in result.output
