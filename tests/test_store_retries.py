"""Retries of a transient database error: waits drawn without touching the application's random stream."""

from __future__ import annotations

import random
from typing import Any

from transcript_store import TranscriptStore
from transcript_store.errors import TransientStoreError


def test_retry_waits_leave_the_global_random_stream_alone(store: TranscriptStore) -> None:
    """The retry jitter came from the ``random`` module's global generator: an application that seeds it
    for reproducible runs (a simulation, a test suite, Hypothesis) saw its sequence move whenever a
    transaction of the store was retried, from any thread."""
    failures = [TransientStoreError("transient database error: injected") for _ in range(3)]

    def flaky(c: Any) -> str:
        if failures:
            raise failures.pop()
        return "done"

    random.seed(1234)
    state = random.getstate()
    retries = store.db.retries
    assert store.write(flaky) == "done"
    assert store.db.retries == retries + 3  # the bare first attempt, then tenacity's waits between attempts
    assert random.getstate() == state
