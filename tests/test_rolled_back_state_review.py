"""A review of process-local state an attempt changes inside a write transaction that then rolls back.

A write is retried whole on a transient error and rolled back on any other: what an attempt told the
process (a counter, a cache) before its COMMIT describes a write that may never have happened. Each test
here failed on the code before its fix (see the docstrings).
"""

from __future__ import annotations

import pytest
from conftest import commit_with, finished_turn, user
from test_lost_commit_review import Counting, lossless
from test_outbox_review import commit_fails_once, commits_lost

from transcript_store import TranscriptStore
from transcript_store.core import Core

S = "rolled-back-scope"


class _Undo(Exception):
    """Raised by a test's transaction after the engine's commit: the transaction rolls back."""


def _turns(store: TranscriptStore, sid: str) -> list[object]:
    store.create_session(S, session_id=sid)
    return [finished_turn(store, S, sid, f"t{i}") for i in range(2)]


def test_a_lossless_commit_retried_after_a_failed_commit_counts_its_messages_once(store_url: str) -> None:
    """A lossless ``commit_turn`` whose COMMIT did not land (the connection dropped at it): the retry
    imported the turn's messages again, and ``stats["imported"]`` counted them twice (4 for 2 messages)."""
    with TranscriptStore(store_url) as store:
        engine = lossless(store, Counting())
        first, second = _turns(store, "f")
        assert commit_with(store, engine, first).status == "committed"  # type: ignore[arg-type]
        before = engine.stats["imported"]
        with commit_fails_once(store, lambda: None):
            assert commit_with(store, engine, second).status == "committed"  # type: ignore[arg-type]
        assert engine.stats["imported"] - before == 2


def test_a_lossless_commit_whose_commit_landed_unseen_counts_its_messages_once(store_url: str) -> None:
    """The same, the COMMIT landed and its answer was lost: the retry found the receipt and imported
    nothing; the messages the landed attempt imported are counted, once (this held before the fix)."""
    with TranscriptStore(store_url) as store:
        engine = lossless(store, Counting())
        first, second = _turns(store, "l")
        assert commit_with(store, engine, first).status == "committed"  # type: ignore[arg-type]
        before = engine.stats["imported"]
        with commits_lost(store, lambda n: n == 1):
            assert commit_with(store, engine, second).status in ("committed", "duplicate")  # type: ignore[arg-type]
        assert engine.stats["imported"] - before == 2


def test_a_lossless_commit_rolled_back_counts_nothing(store_url: str) -> None:
    """A lossless ``commit_turn`` in a transaction that then failed (rolled back, nothing imported): the
    messages were counted imported all the same."""
    with TranscriptStore(store_url) as store:
        engine = lossless(store, Counting())
        first, second = _turns(store, "r")
        assert commit_with(store, engine, first).status == "committed"  # type: ignore[arg-type]
        before = engine.stats["imported"]
        admission, terminal, msgs = second  # type: ignore[misc]

        def commit_then_fail(c: object) -> None:
            engine.commit_turn(tx=c, advancement_key=admission.turn_id, admission=admission.anchor,
                               terminal=terminal, messages=msgs)
            raise _Undo

        with pytest.raises(_Undo):
            store.write(commit_then_fail)  # type: ignore[arg-type]
        assert engine.stats["imported"] == before
        assert commit_with(store, engine, second).status == "committed"  # type: ignore[arg-type]
        assert engine.stats["imported"] - before == 2


def test_a_lossless_commit_whose_failed_commit_another_client_committed_counts_nothing(store_url: str) -> None:
    """A lossless ``commit_turn`` whose COMMIT did not land, and another client committed the same turn
    through the same engine before the retry: the retry found that client's receipt (``duplicate``,
    nothing imported), had no hooks of its own, and the write ran the failed attempt's instead: the
    engine counted the turn's 2 messages imported twice (4), once for a transaction that never stood."""
    with TranscriptStore(store_url) as store, TranscriptStore(store_url) as other:
        engine = lossless(store, Counting())
        first, second = _turns(store, "o")
        assert commit_with(store, engine, first).status == "committed"  # type: ignore[arg-type]
        before = engine.stats["imported"]
        theirs: list[str] = []

        def other_commits() -> None:
            theirs.append(commit_with(other, engine, second).status)  # type: ignore[arg-type]

        with commit_fails_once(store, other_commits):
            assert commit_with(store, engine, second).status == "duplicate"  # type: ignore[arg-type]
        assert theirs == ["committed"]
        assert engine.stats["imported"] - before == 2


def test_a_hook_that_raises_neither_fails_the_committed_write_nor_skips_the_others(store_url: str) -> None:
    """An ``after_commit`` hook that raised (an engine's, on process-local state) after the write had
    committed: ``TranscriptStore.write`` raised its error for a write that stands (a caller that takes
    it for failed and makes it again has the message twice), and the hooks after it never ran."""
    with TranscriptStore(store_url) as store:
        store.create_session(S, session_id="h")
        told: list[str] = []
        item = store.prepare([{"message": user("once")}])

        def broken() -> None:
            raise RuntimeError("a hook's bug")

        def append(c: Core) -> int:
            out = c.append(S, "h", item)
            c.after_commit(broken)
            c.after_commit(lambda: told.append("after"))
            return len(out)

        assert store.write(append) == 1
        assert told == ["after"]
        assert [e.message["content"] for e in store.read_visible(S, "h") if e.message] == ["once"]
