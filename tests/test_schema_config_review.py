"""Findings of the schema-management and configuration review: ``doctor`` on a version table that holds
no one revision, the lossless engine's settings taking mistyped TOML values, and a SQLite URL naming no
regular file given to the library."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import text
from test_cli import run, run_json

from engines.lossless.config import LosslessConfig
from transcript_store import InvalidInput, StoreConfig, TranscriptStore
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


@pytest.mark.parametrize(
    ("line", "key"),
    [("fresh_tail_messages = true", "fresh_tail_messages"), ('fresh_tail_messages = "16"', "fresh_tail_messages"),
     ("leaf_chunk_messages = 24.0", "leaf_chunk_messages"), ('threshold = "0.5"', "threshold"),
     ("context_window = false", "context_window")],
)
def test_the_lossless_engines_settings_refuse_mistyped_toml_values(
    store_url: str, tmp_path: Path, line: str, key: str
) -> None:
    """``[engine.config.lossless]`` was validated lax: ``fresh_tail_messages = true`` ran the engine with a
    tail of 1 message, ``"16"`` and ``24.0`` were counts, ``"0.5"`` a threshold, where the legacy engine's
    ``keep_last`` and the ``[turn]`` knobs refuse a bool, a float or a string as a count. Refused, with the
    key named: doctor says the selected engine is invalid."""
    with pytest.raises(InvalidInput, match=f"lossless config: {key}"):
        LosslessConfig.parse(dict([_toml_pair(line)]))
    (tmp_path / "transcript-store.toml").write_text(
        f'[engine]\nslot = "lossless"\n\n[engine.config.lossless]\n{line}\n', encoding="utf-8")
    report = run_json("doctor", "--db", store_url, cwd=tmp_path, code=1)
    assert report["engine"]["valid"] is False and f"lossless config: {key}" in report["engine"]["reason"], report
    # typed values as the file holds them are taken (an integer for a fraction too)
    typed = LosslessConfig.parse({"fresh_tail_messages": 16, "threshold": 1, "model_thresholds": {"gpt": 1}})
    assert typed.threshold == 1 and typed.fresh_tail_messages == 16


def _toml_pair(line: str) -> tuple[str, object]:
    """One ``key = value`` TOML line as its key and typed value."""
    import tomllib

    ((key, value),) = tomllib.loads(line).items()
    return key, value


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_sqlite_url_naming_no_regular_file_is_invalid_input_and_makes_nothing(tmp_path: Path, kind: str) -> None:
    """The CLI refuses a directory, a device or a FIFO as a usage error; the library (``TranscriptStore(url)``,
    ``upgrade_url``) handed it to sqlite3: StoreUnavailable ("unable to open database file", "disk I/O
    error": the database down, to be retried) and, beside a device, a ``-journal`` file of its own
    (``sqlite:////dev/null`` left ``/dev/null-journal``). Refused as the bad input it is, nothing made."""
    target = tmp_path / "target"
    if kind == "directory":
        target.mkdir()
    else:
        os.mkfifo(target)
    url = f"sqlite:///{target}"
    for attempt in (lambda: TranscriptStore(url), lambda: TranscriptStore.upgrade_url(url),
                    lambda: TranscriptStore(url, create=False).current_revision()):
        with pytest.raises(InvalidInput, match="names a directory" if kind == "directory" else "no regular file"):
            attempt()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    assert kind == "fifo" or list(target.iterdir()) == []


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_postgresql_urls_connect_timeout_and_application_name_are_used(store_url: str) -> None:
    """``?application_name=`` and ``?connect_timeout=`` in the URL (TRANSCRIPT_STORE_URL) were taken as valid
    and silently overridden by the store's own (``transcript-store:<pid>``, 10 s); a malformed timeout was
    never looked at. The URL's own now win, and a timeout that is no number is a bad URL."""
    sep = "&" if "?" in store_url else "?"
    with TranscriptStore(config=StoreConfig(url=f"{store_url}{sep}application_name=my-app&connect_timeout=3",
                                            auto_upgrade=False)) as store:
        name, params = store.read(lambda c: (
            c.conn.exec_driver_sql("SHOW application_name").scalar(),
            c.conn.connection.dbapi_connection.info.get_parameters()))  # type: ignore[union-attr]
        assert name == "my-app" and params["connect_timeout"] == "3", params
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        assert store.read(lambda c: c.conn.exec_driver_sql("SHOW application_name").scalar()).startswith(
            "transcript-store:")
    for bad in ("abc", "-1", "1.5"):
        with pytest.raises(InvalidInput, match="connect_timeout"):
            TranscriptStore(config=StoreConfig(url=f"{store_url}{sep}connect_timeout={bad}"))
