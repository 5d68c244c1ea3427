"""Review of the day's fixes (helper h11): legitimate inputs a new check must not refuse."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from transcript_store import StoreConfig, TranscriptStore


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_multi_host_postgresql_url_still_opens(store_url: str) -> None:
    """SQLAlchemy's multi-host form (``?host=A:port&host=B:port``, for a primary and its standbys) gives
    ``host`` more than once: the URL option check refused it as an option given twice (InvalidInput),
    although it connected before. The first host that answers is used."""
    parts = urlsplit(store_url)
    hostport = parts.netloc.split("@", 1)[1]
    user = parts.netloc.split("@", 1)[0]
    url = f"{parts.scheme}://{user}@{parts.path}?host={hostport}&host={hostport}&target_session_attrs=read-write"
    store = TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))
    try:
        assert store.create_session("a", session_id="s1").session_id == "s1"
    finally:
        store.close()


def test_an_intent_cursor_of_long_non_ascii_ids_reads_the_next_page(store: TranscriptStore) -> None:
    """A page's ``next`` is taken back as ``after`` whatever ids the rows hold: the cursor writes each
    non-ASCII character as a JSON escape (6 characters, 12 for one past the BMP) and base64 grows that by
    a third, so a cursor of ids within the id limits (255 characters, 640 bytes) can be far longer than
    8 * 255 characters. The length guard refused such a cursor a page itself gave (InvalidInput "not an
    intent cursor")."""
    from transcript_store.turns import Turns

    turns = Turns(store)
    scope = "\u7bc4" * 213  # ids: at most 255 characters and 640 bytes of UTF-8
    sessions = ["\u65e5" * 212 + "a", "\u65e5" * 212 + "b"]
    for sid in sessions:
        store.create_session(scope, session_id=sid)
        turns.admit(scope, sid, {"role": "user", "content": "q"}, turn_id="\U0001f600" * 160, engine_id="e")
    first = turns.intents_page(scope, limit=1)
    assert first.next is not None and [i.session_id for i in first.intents] == sessions[:1]
    rest = turns.intents_page(scope, after=first.next, limit=1)
    assert [i.session_id for i in rest.intents] == sessions[1:] and rest.next is None
    # The longest place there is: ids an earlier release stored may pass the 640 bytes of new ones.
    from transcript_store import outbox
    from transcript_store.core import MAX_INT

    longest = "\U0001f600" * 255
    place = (longest, longest, MAX_INT, longest)
    for listing, scope in (("scope", longest), ("all", None)):
        assert outbox.parse_intent_cursor(outbox._encode_place(listing, list(place)), scope) == place


def test_an_engine_owning_compaction_is_not_asked_to_compact_every_turn_for_the_builtin_history(
    store: TranscriptStore,
) -> None:
    """The unwindowed estimate a ``preassembly_may_overflow`` answer is compared on is the built-in
    compaction's history (its latest summary and every message after it). An engine owning compaction
    never moves that summary: its own compaction, however successful, left the estimate over the threshold,
    and its ``compact`` was called before every prompt (3 turns, 3 compactions; each may be a model call).
    Its own assembled estimate decides for it, as before the unwindowed one was read."""
    from typing import Any

    from test_host import SCOPE, make_host
    from test_host_engine_contract_review import _long_history, _Windowed

    from transcript_store.engine import CompactResult

    sid = store.create_session(SCOPE, session_id="sess").session_id
    _long_history(store, sid)  # ~30 x 300 words, far over the threshold of a 4000-token budget
    compactions: list[dict[str, Any]] = []

    class Owning(_Windowed):
        def compact(self, **kw: Any) -> CompactResult:
            compactions.append(kw)
            return CompactResult(ok=True, compacted=True, reason="its own summary")

    host, _ = make_host(store, "win", {"win": lambda ctx: Owning(ctx, "win", owns_compaction=True)},
                        token_budget=4000)
    for i in range(3):
        out = host.run_turn(SCOPE, sid, f"go {i}")
        assert out.engine_id == "win" and out.degraded_reason is None and out.commit_status == "committed"
    assert compactions == []
