"""Review of the s41 commits (both backends): what the lossless audit and the quarantine records missed.

- ``ts_lcm_messages.hidden`` (revision 0016) is what keeps a message the host keeps out of the model's
  context away from the recall tools; the audit, which checks every other column the tools rely on,
  never read it: a row marked wrong (shown to the model through lcm_grep, or a visible message lost to
  it) passed the audit.
"""

from __future__ import annotations

import os
import socket

import pytest
from conftest import module_store_fixtures
from sqlalchemy import delete, update
from test_lossless_hidden_recall_s41 import SECRET, A, call, conversation, rows

from engines.lossless.audit import audit
from engines.lossless.tables import messages
from transcript_store import TranscriptStore, identity
from transcript_store.core import now_us
from transcript_store.identity import ProcessIdentity
from transcript_store.quarantine import records
from transcript_store.schema import quarantine

shared_url, store, sid = module_store_fixtures(A, "review_s41")


def _mark(store: TranscriptStore, sid: str, ordinal: int, hidden: bool) -> None:
    m = messages.c
    store.write(lambda c: c.conn.execute(
        update(messages).where(m.scope == A, m.session_id == sid, m.ordinal == ordinal).values(hidden=hidden)))


def test_the_audit_checks_the_hidden_mark_of_each_message(store: TranscriptStore, sid: str) -> None:
    engine = conversation(store, sid)
    assert store.read(lambda c: audit(c, A, sid)).problems == []
    table = rows(store, sid)
    kept_out = next(o for o, _, out in table if out)
    shown = next(o for o, _, out in table if not out)
    _mark(store, sid, kept_out, False)  # as a row written without the column's value would be
    _mark(store, sid, shown, True)
    # What the wrong marks do: the kept-out text reaches the model, a message it may see is lost to it.
    assert SECRET in str(call(engine, sid, "lcm_expand", {"id": f"msg_{kept_out}"}))
    assert "error" in call(engine, sid, "lcm_expand", {"id": f"msg_{shown}"})
    problems = store.read(lambda c: audit(c, A, sid)).problems
    assert problems == [p for _, p in sorted([  # before the fix: [] (the audit never read the column)
        (shown, f"msg_{shown} is marked hidden, but the host does not keep it out of the model's context"),
        (kept_out, f"msg_{kept_out} is kept out of the model's context by the host, but not marked hidden"),
    ])], problems
    _mark(store, sid, kept_out, True)
    _mark(store, sid, shown, False)
    assert store.read(lambda c: audit(c, A, sid)).problems == []


def test_a_record_with_a_machine_key_is_not_checked_by_a_process_without_one(
    store: TranscriptStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This process's pid in a record of another machine key: neither this process's (it has no key to
    compare, so no pid of that record can be told alive or dead here) nor hidden as dead."""
    written = str(ProcessIdentity(socket.gethostname(), os.getpid(), 1.0, "feedbeef", "000000000000", 7))
    store.write(lambda c: c.conn.execute(quarantine.insert().values(
        engine_id="review-s41", process=written, operation="assemble", reason="boom", created_us=now_us())))
    try:
        monkeypatch.setattr(identity, "_machine", (os.getpid(), None))  # as machine_key() without /proc
        assert identity.machine_key() is None
        shown = [r for r in store.read(lambda c: records(c)) if r.engine_id == "review-s41"]
        # before the fix: [] (the same host name, no key to compare: taken for this namespace's, not alive)
        assert [(r.alive, r.elsewhere, r.host) for r in shown] == [(False, True, socket.gethostname())]
    finally:
        store.write(lambda c: c.conn.execute(delete(quarantine).where(quarantine.c.engine_id == "review-s41")))
