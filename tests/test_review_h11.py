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

