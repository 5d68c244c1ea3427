"""A real process for the migration tests: it migrates a store from a URL, its own way.

- ``python tests/workers/migrate_worker.py kill URL TEXT N``: upgrade the store to head, and SIGKILL this
  process right after the N-th statement containing TEXT has run (inside the upgrade's transaction).
- ``python tests/workers/migrate_worker.py open URL START``: at the wall-clock time START, open the store
  as an application does (``TranscriptStore(url)``, migrating on open per the config); print one JSON
  line: the revision it found open, its session count in scope-a and how many version rows this
  process wrote (``migrated``: 0 when another process had done the work).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from sqlalchemy import event

from transcript_store import StoreConfig, TranscriptStore, migrate
from transcript_store.db import Database


def _count(engine: Any, text: str, then: Any) -> None:
    """Call ``then(n)`` after each statement containing ``text`` (n: how many so far)."""
    seen = 0

    @event.listens_for(engine, "after_cursor_execute")
    def _after(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        nonlocal seen
        if text in statement:
            seen += 1
            then(seen)


def kill(url: str, text: str, n: int) -> None:
    """Upgrade, killed after the n-th statement containing ``text``."""
    db = Database(StoreConfig(url=url))
    _count(db.engine, text, lambda seen: os.kill(os.getpid(), signal.SIGKILL) if seen == n else None)
    migrate.upgrade(db)
    print(json.dumps({"finished": True}))  # the statement never ran: the test says so


def open_store(url: str, start: float) -> None:
    """Open the store at ``start``, as an application does; report what this process did."""
    writes = [0]
    while time.time() < start:
        time.sleep(0.001)
    store = TranscriptStore(url, create=False)
    _count(store.db.engine, "UPDATE alembic_version", lambda seen: writes.__setitem__(0, seen))
    with store:
        store.ensure_current()
        print(json.dumps({"revision": store.current_revision(), "sessions": len(store.list_sessions("scope-a")),
                          "migrated": writes[0]}))


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        kill(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        open_store(sys.argv[2], float(sys.argv[3]))
