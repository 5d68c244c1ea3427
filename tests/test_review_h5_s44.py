"""Review of the session-44 fixes (helper h5), on both backends.

1. A host's compaction stored before the payload cap applied to its summary (an older release, or a store
   whose cap was lowered since) is told again by the plugin at every bootstrap of a new process: refused
   as ``PayloadTooLarge`` before the "told again" check, every such bootstrap failed for ever, though
   nothing would be written.
2. ``import_session(keyless=...)`` took any truthy value for yes (``keyless="no"`` imported the copy
   without its key), where every other yes/no argument of the library is a bool or ``InvalidInput``.
3. ``HostRuntime.compact`` fenced at any admitted turn of the session, one whose worker is gone too (a chat
   killed mid-turn): once that turn's message was branched away (``/branch`` in the next chat, before any
   turn there recovered the session), every manual compaction was ``ReadFenceError`` until a turn ran.
"""

from __future__ import annotations

from typing import Any

import pytest
from hosting import RecordingModel
from sqlalchemy import update

from transcript_store import StoreConfig, TranscriptStore, compaction
from transcript_store.errors import InvalidInput, PayloadTooLarge
from transcript_store.host import HostRuntime
from transcript_store.schema import outbox as outbox_table
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

SCOPE = "scope-a"
CAP = 4096


def _record(store: TranscriptStore, sid: str, summary: str, **kw: Any) -> Any:
    return store.write(lambda c: compaction.record_host_compaction(
        c, SCOPE, sid, summary=summary, first_kept_position=1, first_kept_entry_id="h1", **kw
    ))


def test_a_stored_host_summary_over_a_lowered_cap_told_again_is_not_refused(store_url: str) -> None:
    summary = "the host's summary " + "y" * (2 * CAP)
    store = TranscriptStore(config=StoreConfig(url=store_url))
    try:
        sid = store.create_session(SCOPE).session_id
        for i in range(3):
            store.append(SCOPE, sid, {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"},
                         entry_id=f"h{i}")
        first = _record(store, sid, summary)
    finally:
        store.close()
    store = TranscriptStore(config=StoreConfig(url=store_url, max_payload_bytes=CAP))
    try:
        again = _record(store, sid, summary)  # the plugin's bootstrap of a new process tells it again
        assert again["created_ms"] == first["created_ms"]
        assert compaction.load_pointer(store, SCOPE, sid)["summary"] == summary  # type: ignore[index]
        with pytest.raises(PayloadTooLarge):  # a new one over the cap is still refused
            _record(store, sid, summary + " and more")
        assert compaction.load_pointer(store, SCOPE, sid)["summary"] == summary  # type: ignore[index]
    finally:
        store.close()


@pytest.mark.parametrize("flag", ["no", 1, None])
def test_import_keyless_takes_a_bool_only(store: TranscriptStore, flag: Any) -> None:
    source = store.create_session(SCOPE, session_key="k-source").session_id
    store.append(SCOPE, source, {"role": "user", "content": "hi"})
    header, records = store.export_session(SCOPE, source)
    with pytest.raises(InvalidInput, match="keyless"):
        store.import_session("scope-b", header, records, keyless=flag)
    assert store.list_sessions("scope-b") == []
    copy = store.import_session(SCOPE, header, records, session_id="copy", keyless=True)  # beside its source
    assert copy.session_key is None and store.get_session(SCOPE, source).session_key == "k-source"


def test_a_manual_compaction_ignores_a_turn_whose_worker_is_gone(store: TranscriptStore) -> None:
    sid = store.create_session(SCOPE).session_id
    talk = " tell me more about this" * 20
    said = store.append_many(SCOPE, sid, [
        {"message": {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}{talk}"}} for i in range(12)
    ])
    settings = load_settings(config_path=None, engine="legacy", engine_config={"legacy": {"keep_last": 2}})
    host = HostRuntime(store, settings, RecordingModel(), summarizer=ExtractiveSummarizer(),
                       estimator=RoughEstimator())
    try:
        host.turns.admit(SCOPE, sid, {"role": "user", "content": "and now?"}, turn_id="t-dead", engine_id="legacy")
        # Its worker died (a chat killed mid-turn): its lease runs out, no turn has recovered the session yet.
        store.write(lambda c: c.conn.execute(update(outbox_table).values(lease_expires_us=0)))
        store.branch(SCOPE, sid, said[-1].entry_id)  # the next chat's /branch: the dead turn's message goes
        out = host.compact(SCOPE, sid)  # was: ReadFenceError, at every try until a turn ran
    finally:
        host.dispose()
    assert out.compacted, out.reason
    pointer = compaction.load_pointer(store, SCOPE, sid)
    assert pointer is not None and pointer["first_kept_position"] == 10
