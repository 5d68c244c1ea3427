"""A quarantine record of this host name in another pid namespace is not checked here (both backends).

Processes whose machine key differs (another pid namespace, such as a container given this host's name,
or an earlier boot) cannot see each other's pids, so whether the record's process lives cannot be told
here. The record was taken for this machine's (the same host name), found not alive, and hidden as if
its process were dead: a live process's quarantine there vanished from ``doctor``. It is now shown as not
checked, as another host's is, and ages out the same way.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from test_cli import _script_mode, run  # noqa: F401 (_script_mode: autouse, honours real_script)
from test_quarantine_age_review import DAY_US, _dead_identity, _put

from transcript_store import StoreConfig, TranscriptStore
from transcript_store.identity import ProcessIdentity, machine_key
from transcript_store.quarantine import records


def _other_namespace(pid: int) -> str:
    """An identity of this host name written by a process of another pid namespace (another machine key)."""
    here = machine_key()
    assert here is not None  # Linux with /proc: the machine key is what tells namespaces apart
    other = "000000000000" if here != "000000000000" else "111111111111"
    return str(ProcessIdentity(socket.gethostname(), pid, 1.0, "feedbeef", other, 7))


def test_a_record_of_another_pid_namespace_is_shown_as_not_checked(store: TranscriptStore) -> None:
    # A pid alive here (this process's) and one surely not: neither is checked against this namespace.
    _put(store, "container", _other_namespace(os.getpid()), DAY_US)
    _put(store, "container-gone", _other_namespace(2**22 + 7), DAY_US)
    _put(store, "container-stale", _other_namespace(os.getpid()), 8 * DAY_US)
    _put(store, "dead", _dead_identity(), 60 * 1_000_000)
    shown = store.read(lambda c: records(c))
    assert [(r.engine_id, r.alive, r.elsewhere, r.host) for r in shown] == [
        ("container", False, True, socket.gethostname()),
        ("container-gone", False, True, socket.gethostname()),
    ]  # before the fix: [] (both taken for this namespace's processes, not alive, hidden)
    everything = {r.engine_id: r for r in store.read(lambda c: records(c, live_only=False))}
    assert not everything["dead"].elsewhere  # this machine's exited process: still known dead
    assert everything["container-stale"].elsewhere
    assert store.read(lambda c: records(c, max_age_seconds=3600)) == []  # ages out as another host's


def test_doctor_names_another_pid_namespace(store_url: str, tmp_path: Path) -> None:
    with TranscriptStore(config=StoreConfig(url=store_url, auto_upgrade=False)) as store:
        _put(store, "container", _other_namespace(os.getpid()), 3_600_000_000)
    env = {"COLUMNS": "300"}
    report = json.loads(run("doctor", "--db", store_url, "--json", cwd=tmp_path, env=env).stdout)
    assert [(r["engine_id"], r["elsewhere"]) for r in report["quarantine"]] == [("container", True)]
    text = " ".join(run("doctor", "--db", store_url, cwd=tmp_path, env=env).stdout.split())
    assert "container" in text and "another pid namespace or boot of this host" in text, text
