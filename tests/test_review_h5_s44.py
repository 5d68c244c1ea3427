"""Review of the session-44 fixes (helper h5), on both backends.

1. A host's compaction stored before the payload cap applied to its summary (an older release, or a store
   whose cap was lowered since) is told again by the plugin at every bootstrap of a new process: refused
   as ``PayloadTooLarge`` before the "told again" check, every such bootstrap failed for ever, though
   nothing would be written.
2. ``import_session(keyless=...)`` took any truthy value for yes (``keyless="no"`` imported the copy
   without its key), where every other yes/no argument of the library is a bool or ``InvalidInput``.
"""

from __future__ import annotations

from typing import Any

import pytest

from transcript_store import StoreConfig, TranscriptStore, compaction
from transcript_store.errors import InvalidInput, PayloadTooLarge

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
