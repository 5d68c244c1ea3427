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
