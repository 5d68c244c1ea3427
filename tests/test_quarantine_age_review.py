"""Quarantine records age out, and doctor tells another host's records from dead ones (both backends).

Before: no record was ever deleted, so the records of every gateway worker and chat process that ever
quarantined an engine piled up in ``ts_quarantine`` and were read by every gateway report and ``doctor``;
and ``doctor`` checked the pid of a record written on another host on this machine, so a live process's
quarantine there was hidden as if its process were dead.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hosting import CountingEngine, RecordingModel
from test_cli import _script_mode, run  # noqa: F401 (_script_mode: autouse, honours real_script)

from transcript_store import StoreConfig, TranscriptStore
from transcript_store.core import now_us
from transcript_store.errors import InvalidInput
from transcript_store.host import HostRuntime
from transcript_store.identity import ProcessIdentity, current
from transcript_store.quarantine import RECORD_SECONDS, prune, record, records
from transcript_store.registry import EngineRegistry
from transcript_store.schema import quarantine
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

DAY_US = 86_400 * 1_000_000


@cache
def _dead_identity() -> str:
    """The identity of a real process of this machine that has exited (one for the whole run: a process
    start costs ~1.2 s here, and an exited process stays exited; its start time tells a reused pid apart)."""
    child = subprocess.run(
        [sys.executable, "-c", "from transcript_store.identity import current; print(current())"],
        capture_output=True, text=True, check=True, timeout=60,
    )
    text = child.stdout.strip()
    who = ProcessIdentity.parse(text)
    assert who is not None and who.is_dead_here(), text
    return text


def _elsewhere(pid: int = 4242) -> str:
    """An identity written by a process on another host (its pid may be any process's here)."""
    return str(ProcessIdentity(f"not-{socket.gethostname()}", pid, 1.0, "feedbeef", "abcdef012345", 7))


def _put(store: TranscriptStore, engine_id: str, process: str, age_us: int) -> None:
    store.write(lambda c: c.conn.execute(quarantine.insert().values(
        engine_id=engine_id, process=process, operation="assemble", reason="boom", created_us=now_us() - age_us,
    )))


def _held(store: TranscriptStore) -> list[str]:
    return sorted(r.engine_id for r in store.read(lambda c: records(c, live_only=False)))


def test_writing_a_record_prunes_expired_records_of_processes_not_alive_here(store: TranscriptStore) -> None:
    dead = _dead_identity()
    _put(store, "dead-old", dead, 8 * DAY_US)  # past the week: gone
    _put(store, "dead-recent", dead, DAY_US // 12)  # a gateway run's dead worker: its report still reads it
    _put(store, "elsewhere-old", _elsewhere(), 8 * DAY_US)  # not written again for a week: its process is gone
    _put(store, "elsewhere-recent", _elsewhere(), DAY_US)
    _put(store, "alive-old", str(current()), 30 * DAY_US)  # a live process's quarantine holds at any age
    _put(store, "unreadable-old", "no identity", 8 * DAY_US)
    store.write(lambda c: record(c, "new", "assemble", "RuntimeError: x"))
    assert _held(store) == ["alive-old", "dead-recent", "elsewhere-recent", "new"]
    # A shorter age prunes more; a live process's record still stays.
    assert store.write(lambda c: prune(c, max_age_seconds=3600)) == 2  # dead-recent, elsewhere-recent
    assert _held(store) == ["alive-old", "new"]


def test_an_age_out_of_bounds_is_refused_and_deletes_nothing(store: TranscriptStore) -> None:
    _put(store, "dead-old", _dead_identity(), 8 * DAY_US)
    for bad in (0.0, -1.0, 60.0, float("nan"), float("inf"), 400 * 86_400.0):
        with pytest.raises(InvalidInput, match="max_age_seconds"):
            store.write(lambda c: prune(c, max_age_seconds=bad))  # noqa: B023
        with pytest.raises(InvalidInput, match="max_age_seconds"):
            store.write(lambda c: record(c, "new", "assemble", "x", max_age_seconds=bad))  # noqa: B023
    assert _held(store) == ["dead-old"]


def test_records_name_another_hosts_process_as_not_checked_not_dead(store: TranscriptStore) -> None:
    # A pid that is alive here (this process's): the record is another host's all the same.
    _put(store, "remote", _elsewhere(os.getpid()), DAY_US)
    _put(store, "remote-stale", _elsewhere(), 8 * DAY_US)
    _put(store, "dead", _dead_identity(), 60 * 1_000_000)
    shown = store.read(lambda c: records(c))
    assert [(r.engine_id, r.alive, r.elsewhere, r.host) for r in shown] == [
        ("remote", False, True, f"not-{socket.gethostname()}")
    ]
    everything = {r.engine_id: r for r in store.read(lambda c: records(c, live_only=False))}
    assert sorted(everything) == ["dead", "remote", "remote-stale"]
    assert not everything["dead"].elsewhere and everything["dead"].host == socket.gethostname()
    # The age is the reader's too: a day-old record of another host is past an age of an hour.
    assert store.read(lambda c: records(c, max_age_seconds=3600)) == []


def _doctor(url: str, cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # In-process (test_cli's runner): the report's content is the point, not the process; a record's pid is
    # checked against this machine's processes either way.
    return run("doctor", "--db", url, *extra, cwd=cwd, env={"COLUMNS": "300"})


def test_doctor_shows_another_hosts_quarantine_as_such(store_url: str, tmp_path: Path) -> None:
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        _put(store, "remote-engine", _elsewhere(), 2 * 3_600_000_000)
        _put(store, "dead-engine", _dead_identity(), 60 * 1_000_000)
    report = json.loads(_doctor(store_url, tmp_path, "--json").stdout)
    assert [(r["engine_id"], r["alive"], r["elsewhere"], r["host"]) for r in report["quarantine"]] == [
        ("remote-engine", False, True, f"not-{socket.gethostname()}")
    ]
    text = _doctor(store_url, tmp_path).stdout
    assert "remote-engine" in text and f"another host (not-{socket.gethostname()})" in text, text
    assert "dead-engine" not in text and "quarantine: none" not in text
    # [turn] quarantine_record_seconds is the age doctor shows other hosts' records for.
    config = tmp_path / "short.toml"
    config.write_text("[turn]\nquarantine_record_seconds = 3600.0\n")
    short = json.loads(_doctor(store_url, tmp_path, "--config", str(config), "--json").stdout)
    assert short["quarantine"] == []
    assert "quarantine: none" in _doctor(store_url, tmp_path, "--config", str(config)).stdout


def test_the_setting_is_bounded(tmp_path: Path) -> None:
    assert load_settings(config_path=None).quarantine_record_seconds == RECORD_SECONDS
    config = tmp_path / "bad.toml"
    config.write_text("[turn]\nquarantine_record_seconds = 60.0\n")
    with pytest.raises(InvalidInput, match="quarantine_record_seconds"):
        load_settings(config_path=str(config))


def test_a_live_host_writes_its_records_again_before_other_hosts_prune_them(store: TranscriptStore) -> None:
    """Another host cannot see this process, so it prunes this process's record once it is older than the
    age: the runtime writes it again (after a turn) once half of the age has passed."""

    class Broken(CountingEngine):
        def assemble(self, **kw: Any) -> Any:
            raise RuntimeError("engine bug")

    registry = EngineRegistry()
    registry.register_factory("broken", lambda ctx: Broken(ctx, "broken"))
    host = HostRuntime(store, load_settings(config_path=None, engine="broken", quarantine_record_seconds=3600.0),
                       RecordingModel(), registry=registry, summarizer=ExtractiveSummarizer(),
                       estimator=RoughEstimator())
    sid = store.create_session("scope-q", session_id="sess").session_id
    try:
        assert host.run_turn("scope-q", sid, "hello", turn_id="t1").engine_id == "legacy"
        [first] = store.read(lambda c: records(c))
        host.run_turn("scope-q", sid, "again", turn_id="t2")  # not due yet: not written again
        assert [r.created_at for r in store.read(lambda c: records(c))] == [first.created_at]
        # Half an hour and more since it was written (by this process's monotonic clock):
        host._recorded_at["broken"] -= 1801
        host.run_turn("scope-q", sid, "later", turn_id="t3")
        [again] = store.read(lambda c: records(c))
        assert again.engine_id == "broken" and again.operation == "assemble" and again.alive
        assert again.created_at > first.created_at
    finally:
        host.dispose()


def test_doctor_names_a_short_age_in_hours(store_url: str, tmp_path: Path) -> None:
    """The table's title gives the configured age as a person reads it: an hour was "0.0416667 days"."""
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        _put(store, "remote-engine", _elsewhere(), 60 * 1_000_000)
    config = tmp_path / "short.toml"
    config.write_text("[turn]\nquarantine_record_seconds = 3600.0\n")
    text = " ".join(_doctor(store_url, tmp_path, "--config", str(config)).stdout.split())
    assert "remote-engine" in text and "of the last 1 hour)" in text, text
    assert "of the last 7 days)" in " ".join(_doctor(store_url, tmp_path).stdout.split())
