"""The lossless engine on a session the store does not hold: ``compact`` and ``maintain`` answer "unknown
session", as ``bootstrap`` does, instead of telling a caller with a wrong id (or another scope's) that its
session was fine; an empty session that exists is not unknown."""

from __future__ import annotations

import pytest

from engines.lossless import LosslessEngine
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

UNKNOWN_SESSION = "unknown session"  # the engine's reason (engines.lossless.engine.UNKNOWN_SESSION)


def make_engine(store: TranscriptStore) -> LosslessEngine:
    """A lossless engine with the offline summarizer."""
    return LosslessEngine(EngineContext(store=store, config={}, summarizer=ExtractiveSummarizer(),
                                        estimator=RoughEstimator()))


@pytest.mark.parametrize("force", [False, True])
def test_compact_and_maintain_of_an_unknown_session_say_so(store: TranscriptStore, force: bool) -> None:
    engine = make_engine(store)
    store.create_session("other", session_id="theirs")
    store.append("other", "theirs", {"role": "user", "content": "another scope's words " * 50})
    store.create_session("mine", session_id="empty")
    for sid in ("nowhere", "theirs"):  # none at all, and another scope's: the same answer
        result = engine.compact(scope="mine", session_id=sid, force=force)
        assert (result.ok, result.compacted, result.reason) == (False, False, UNKNOWN_SESSION)
        maintained = engine.maintain(scope="mine", session_id=sid)
        assert (maintained.changed, maintained.reason) == (False, UNKNOWN_SESSION)
        assert engine.bootstrap(scope="mine", session_id=sid, fence=None).reason == UNKNOWN_SESSION
    # An empty session of one's own is known: nothing to do, no error.
    assert engine.compact(scope="mine", session_id="empty", force=force).reason != UNKNOWN_SESSION
    assert engine.maintain(scope="mine", session_id="empty").reason == "under the threshold"
    engine.dispose()
