"""A review of the store's library API: what its documentation promises and the code did not hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from transcript_store import InvalidInput, PayloadTooLarge, StoreConfig, TranscriptStore
from transcript_store.fences import MAX_TURN_BYTES
from transcript_store.turns import Turns

A = "scope-a"


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("field", "value"),
    [("url", None), ("url", 5), ("max_payload_bytes", "x"), ("max_payload_bytes", -1), ("busy_timeout_ms", None)],
)
@pytest.mark.parametrize("made", ["model_copy", "model_construct"])
def test_a_config_made_without_validation_is_refused_by_the_store(
    store_url: str, made: str, field: str, value: Any
) -> None:
    # README ("Bad input"): a StoreConfig made by model_construct or model_copy(update=...), passed to the
    # store, is refused with InvalidInput. Only a config given together with a url was validated again:
    # alone, a url of None failed in the driver with TypeError, and a max_payload_bytes of "x" or -1
    # opened a store whose every append raised TypeError (or refused the smallest message).
    good = StoreConfig(url=store_url)
    if made == "model_copy":
        bad = good.model_copy(update={field: value})
    else:
        bad = StoreConfig.model_construct(**{**dict(good), field: value})
    with pytest.raises(InvalidInput, match=field):
        TranscriptStore(config=bad).close()


def test_a_valid_config_given_alone_is_kept(store_url: str) -> None:
    config = StoreConfig(url=store_url, max_payload_bytes=2048)
    with TranscriptStore(config=config) as store:
        assert store.config == config
        sid = store.create_session(A).session_id
        store.append(A, sid, {"role": "user", "content": "x" * 1500})


def test_upgrade_url_refuses_none_instead_of_migrating_the_default_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``upgrade_url(url)`` migrates the database at ``url``. None was passed on to StoreConfig.from_env,
    # which ignores a None override: the call created ./transcripts.db (or migrated whatever
    # TRANSCRIPT_STORE_URL names) instead of refusing a URL that is no string. Other wrong types
    # (5, b"...") were refused already.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRANSCRIPT_STORE_URL", raising=False)
    with pytest.raises(InvalidInput, match="url"):
        TranscriptStore.upgrade_url(None)  # type: ignore[arg-type]
    elsewhere = tmp_path / "elsewhere.db"
    monkeypatch.setenv("TRANSCRIPT_STORE_URL", f"sqlite:///{elsewhere}")
    with pytest.raises(InvalidInput, match="url"):
        TranscriptStore.upgrade_url(None)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- turns


def test_an_admission_too_large_for_any_turn_is_refused_before_anything_is_written(store_url: str) -> None:
    # With max_payload_bytes above the turn's cap (8 MiB), Turns.admit took a user message of 9 MiB: its
    # turn could never complete (every completion raised PayloadTooLarge, the reply and the admission
    # over the cap), and the session stayed busy for the turn's whole lease (SessionBusy for the next).
    config = StoreConfig(url=store_url, max_payload_bytes=16 * 1024 * 1024)
    with TranscriptStore(config=config) as store:
        turns = Turns(store)
        sid = store.create_session(A).session_id
        before = store.list_entries(A, sid), turns.intents(A)
        huge = {"role": "user", "content": "x" * (MAX_TURN_BYTES + 1)}
        with pytest.raises(PayloadTooLarge, match="no room for a reply"):
            turns.admit(A, sid, huge, turn_id="t1", engine_id="e")
        with pytest.raises(PayloadTooLarge):
            turns.admit_if_clear(A, sid, huge, turn_id="t1", engine_id="e")
        assert (store.list_entries(A, sid), turns.intents(A)) == before
        # The session is free for a turn that fits; the store's own admit is no turn and still takes it.
        admission, _ = turns.admit(A, sid, {"role": "user", "content": "hi"}, turn_id="t2", engine_id="e")
        done = turns.complete(A, sid, "t2", [{"message": {"role": "assistant", "content": "ok"}}], commit_in=None)
        assert done.intent.state == "accepted" and admission.turn_id == "t2"


def test_an_admission_a_few_bytes_under_the_turn_cap_is_refused_too(store_url: str) -> None:
    # The refusal above took only a user message at the cap or over it: one 10 bytes under it was admitted,
    # and no reply fits in 10 bytes (the smallest message is 28), so the turn could never complete and held
    # the session busy for its lease. Refused as well; one that leaves room for the smallest reply is not.
    config = StoreConfig(url=store_url, max_payload_bytes=16 * 1024 * 1024)
    base = len('{"role":"user","content":""}')
    with TranscriptStore(config=config) as store:
        turns = Turns(store)
        sid = store.create_session(A).session_id
        before = store.list_entries(A, sid), turns.intents(A)
        near = {"role": "user", "content": "x" * (MAX_TURN_BYTES - 10 - base)}
        with pytest.raises(PayloadTooLarge, match="no room for a reply"):
            turns.admit(A, sid, near, turn_id="t1", engine_id="e")
        assert (store.list_entries(A, sid), turns.intents(A)) == before
        fits = {"role": "user", "content": "x" * (MAX_TURN_BYTES - 2 * base)}
        turns.admit(A, sid, fits, turn_id="t2", engine_id="e")
        done = turns.complete(A, sid, "t2", [{"message": {"role": "user", "content": ""}}], commit_in=None)
        assert done.intent.state == "accepted"
