"""Findings of the schema-management and configuration review: ``doctor`` on a version table that holds
no one revision, and the lossless engine's settings taking mistyped TOML values."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text
from test_cli import run, run_json

from engines.lossless.config import LosslessConfig
from transcript_store import InvalidInput, StoreConfig
from transcript_store.db import Database


@pytest.mark.parametrize(
    ("statement", "error"),
    [("INSERT INTO alembic_version (version_num) VALUES ('0014')", "several revisions"),
     ("DELETE FROM alembic_version", "records no revision")],
    ids=["several-revisions", "no-revision"],
)
def test_doctor_reports_a_version_table_without_one_revision_as_a_problem(
    store_url: str, tmp_path: Path, statement: str, error: str
) -> None:
    """``doctor`` reports a schema problem as one of its problems, exit 1, with its whole report (README);
    a version table holding several revisions, or none beside the store's tables, ended it instead with
    one error line and exit 4, no report (``--json`` wrote nothing to stdout)."""
    db = Database(StoreConfig(url=store_url))
    try:
        with db.engine.begin() as conn:
            conn.execute(text(statement))
    finally:
        db.dispose()
    report = run_json("doctor", "--db", store_url, cwd=tmp_path, code=1)
    assert report["ok"] is False and any(error in p for p in report["problems"]), report
    assert report["store"]["state"] is None and report["store"]["revision"] is None
    assert [e["id"] for e in report["engines"] if e["selected"]] == ["legacy"]
    shown = run("doctor", "--db", store_url, cwd=tmp_path, code=1)
    assert "schema:    unknown" in shown.stdout and error in shown.stderr
