"""Hostile review of session export/import, second round: what an export declares is checked, not recomputed.

test_transfer_review.py holds the first round (round trips on one backend, malformed trees, times, turn ids,
ids of the header). This file covers: ``size_bytes`` checked against the entry's stored text; the
generations along seq held to what the store itself writes (every session starts in generation 0, a rewrite
adds one and re-appends under it, nothing else moves it); exact round trips across backends (SQLite ->
PostgreSQL -> SQLite and back) for sessions of every shape; forged files of more kinds (numbers out of
range or of the wrong type, seq gaps, ids of another scope's session); and a session exported mid-turn,
whose receipts, engine state and turn intents the export does not carry. Every refusal is a typed error
and leaves every table of the store as it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import fresh_url
from hosting import RecordingModel
from test_transfer_review import (
    DST,
    NUMBERS,
    SRC,
    TRICKY,
    assistant,
    build,
    edit,
    jsonl,
    refused_cleanly,
    snapshot,
    user,
)

from transcript_store import IdempotencyConflict, InvalidInput, StoreConfig, TranscriptStore
from transcript_store.errors import TurnOvertaken
from transcript_store.host import HostRuntime
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

Records = list[dict[str, Any]]


def stored_size(value: Any) -> int:
    """The bytes of an entry's stored text (compact JSON, UTF-8 as is)."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8"))


def read_jsonl(text: str) -> tuple[dict[str, Any], Records]:
    """The export as the CLI reads it: lines end at \\n only (str.splitlines also splits inside a JSON text at
    U+2028, U+2029 and U+0085, which the export writes as they are)."""
    lines = [json.loads(line) for line in text.split("\n") if line.strip()]
    return lines[0], lines[1:]


def body(record: dict[str, Any]) -> Any:
    return record["message"] if record["kind"] == "message" else record["payload"]


def generations(records: Records, gens: list[int]) -> Records:
    assert len(gens) == len(records)
    return [{**r, "generation": g} for r, g in zip(records, gens, strict=True)]


# ---------------------------------------------------------------------------------------------- size_bytes


def test_the_exports_size_bytes_match_the_stored_text(store: TranscriptStore) -> None:
    """What the checks below hold an import to: the store's own exports declare the UTF-8 bytes of the text."""
    build(store)
    _header, records = store.export_session(SRC, "s1")
    assert [r["size_bytes"] for r in records] == [stored_size(body(r)) for r in records]


def test_a_size_bytes_that_disagrees_with_the_content_is_refused(store: TranscriptStore) -> None:
    """size_bytes was recomputed and the file's value ignored: an entry declaring 1 byte for 100, or a
    payload edited under its old size, was imported without a word (the file is not what it says)."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    by_id = {r["entry_id"]: r for r in records}
    for entry_id, size in (
        ("u1", by_id["u1"]["size_bytes"] + 1),
        ("a1", by_id["a1"]["size_bytes"] - 1),
        ("ev1", 0),
        ("md1", 3),
        ("u2", 2**31 - 1),
    ):
        refused_cleanly(store, header, edit(records, entry_id, size_bytes=size), "size_bytes")
    # Characters are not bytes: the system message holds astral and combining characters.
    refused_cleanly(
        store,
        header,
        edit(
            records,
            "sys",
            size_bytes=len(json.dumps(by_id["sys"]["message"], ensure_ascii=False, separators=(",", ":"))),
        ),
        "size_bytes",
    )
    # The content edited, its declared size left as it was.
    changed = {"z": 2, "a": [], "k": {}}
    refused_cleanly(store, header, edit(records, "ev1", payload=changed), "size_bytes")
    # The same edit declaring its own size is a consistent file: imported, and exported as it was given.
    fixed = edit(records, "ev1", payload=changed, size_bytes=stored_size(changed))
    store.import_session(DST, header, fixed)
    assert store.export_session(DST, "s1")[1] == fixed


def test_size_bytes_of_the_wrong_type_or_range_is_refused(store: TranscriptStore) -> None:
    build(store)
    header, records = store.export_session(SRC, "s1")
    size = records[1]["size_bytes"]
    for value in (str(size), float(size), True, -1, 2**31, 2**63, 10**30, [size]):
        with pytest.raises(InvalidInput, match="size_bytes"):
            store.import_session(DST, header, edit(records, "u1", size_bytes=value))
    refused_cleanly(store, header, edit(records, "u1", size_bytes=-size), "size_bytes")
    # Left out (a file edited by hand), or null: the size is computed, as the export says it.
    without = [{k: v for k, v in r.items() if k != "size_bytes"} for r in records]
    store.import_session(DST, header, without)
    assert store.export_session(DST, "s1")[1] == records
    store.import_session(DST, header, edit(records, "u1", size_bytes=None), session_id="s2", session_key="key:s2")
    assert store.export_session(DST, "s2")[1] == records


# ---------------------------------------------------------------------------------------------- generations


def test_generations_that_go_back_along_seq_are_refused(store: TranscriptStore) -> None:
    """A rewrite adds one to the session's generation and re-appends under it; appends take the session's
    generation. Along seq an export's generations never go back: a file where they do was imported."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    assert [r["generation"] for r in records] == [0] * 9 + [1] * 3 and header["generation"] == 1
    cases = [
        [0] * 9 + [1, 1, 0],  # the last entry back in generation 0
        [0] * 9 + [1, 0, 1],  # one entry back in the middle of the rewrite's entries
        [0, 1] + [0] * 7 + [1] * 3,  # up and down again among the first entries
        [0] * 8 + [1, 0, 1, 1],
    ]
    for gens in cases:
        refused_cleanly(store, header, generations(records, gens), "generation")


def test_generations_the_store_never_writes_are_refused(store: TranscriptStore) -> None:
    """Every session starts in generation 0 (a rewrite needs an entry to rewrite), a rewrite adds exactly
    one and writes at least one entry in it, and the session's generation is its last entry's."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    two = {**header, "generation": 2}
    cases: list[tuple[dict[str, Any], Records, str]] = [
        (header, generations(records, [1] * 9 + [1] * 3), "first entry"),  # no generation 0
        (two, generations(records, [1] * 9 + [2] * 3), "first entry"),
        (two, generations(records, [0] * 9 + [2] * 3), "skips"),  # generation 1 never written
        (two, records, "last entry"),  # the session's generation moved without a rewrite
        ({**header, "generation": 5}, records, "last entry"),
        (header, generations(records, [0] * 12), "last entry"),  # a rewrite that wrote nothing
    ]
    for h, rs, words in cases:
        refused_cleanly(store, h, rs, words)
    # An empty session is in generation 0: nothing was ever rewritten.
    store.create_session(SRC, session_id="empty")
    empty_header, empty = store.export_session(SRC, "empty")
    assert empty == [] and empty_header["generation"] == 0
    refused_cleanly(store, {**empty_header, "generation": 1}, empty, "generation")
    store.import_session(DST, empty_header, empty)
    assert store.export_session(DST, "empty") == ({**empty_header, "scope": DST}, [])


def test_generation_numbers_of_the_wrong_type_or_range_are_refused(store: TranscriptStore) -> None:
    build(store)
    header, records = store.export_session(SRC, "s1")
    for value in ("0", 0.0, False, None, -1, 2**31, 2**63, 10**30):
        with pytest.raises(InvalidInput, match="generation"):
            store.import_session(DST, header, edit(records, "u1", generation=value))
    with pytest.raises(InvalidInput, match="generation"):
        store.import_session(DST, header, edit(records, "u2", generation=2**31 - 1))
    refused_cleanly(store, {**header, "generation": 2**31 - 2}, edit(records, "u2", generation=2**31 - 2), "generation")


def test_several_rewrites_round_trip_and_go_on(store: TranscriptStore) -> None:
    """Generations 0, 1, 2 and 3 with appends between the rewrites and a branch back to generation 0."""
    build(store)
    store.rewrite_entries(SRC, "s1", [{"entry_id": "u2", "message": user("after the second rewrite")}])
    store.branch(SRC, "s1", "a2")  # back onto a generation-0 branch: the generation stays
    store.append(SRC, "s1", assistant("on the old branch"), entry_id="old")
    store.rewrite_entries(SRC, "s1", [{"entry_id": "old", "message": assistant("rewritten again")}])
    header, records = store.export_session(SRC, "s1")
    gens = [r["generation"] for r in records]
    assert header["generation"] == 3 and gens == sorted(gens) and set(gens) == {0, 1, 2, 3}
    store.import_session(DST, header, records)
    assert store.export_session(DST, "s1") == ({**header, "scope": DST}, records)
    result = store.rewrite_entries(DST, "s1", [{"entry_id": "u1", "message": user("q1, rewritten")}])
    assert result.generation == 4
    again_header, again = store.export_session(DST, "s1")
    store.import_session(DST, again_header, again, session_id="s1-again", session_key="k:again")


# ---------------------------------------------------------------------------------------------- across backends


def shapes(store: TranscriptStore) -> list[str]:
    """Sessions of every shape: branched and rewritten with odd JSON, empty, ended, headless, twice rewritten."""
    build(store, "full")
    store.create_session(SRC, session_id="empty")
    store.create_session(SRC, session_id="ended", session_key="key:ended")
    store.append(SRC, "ended", user("bye"), entry_id="bye")
    store.end_session(SRC, "ended")
    store.append(SRC, "ended", assistant("after the end"), entry_id="late")  # an ended session takes appends
    store.create_session(SRC, session_id="headless")
    store.append_many(SRC, "headless", [{"message": user("one")}, {"message": assistant("two")}])
    store.branch(SRC, "headless", None)
    store.create_session(SRC, session_id="twice")
    store.append(SRC, "twice", user("x \u2028 y \x7f \x85 \u2029 \r"), entry_id="x")
    for n in range(2):
        store.rewrite_entries(
            SRC,
            "twice",
            [
                {
                    "entry_id": store.read_visible(SRC, "twice")[0].entry_id,
                    "message": user(f"x{n}", numbers=NUMBERS, text=TRICKY),
                }
            ],
        )
    return ["full", "empty", "ended", "headless", "twice"]


def open_store(url: str) -> TranscriptStore:
    return TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))


@pytest.fixture
def both(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Callable[[], TranscriptStore]]]:
    """Fresh stores of each backend on demand (two SQLite files may be asked for)."""
    made: list[tuple[Iterator[str], TranscriptStore]] = []

    def maker(backend: str) -> Callable[[], TranscriptStore]:
        def make() -> TranscriptStore:
            folder = tmp_path / f"{backend}{len(made)}"
            folder.mkdir()
            urls = fresh_url(backend, request, folder)
            s = open_store(next(urls))
            made.append((urls, s))
            return s

        return make

    yield {"sqlite": maker("sqlite"), "postgresql": maker("postgresql")}
    for urls, s in reversed(made):
        s.close()
        next(urls, None)  # drops the PostgreSQL database


@pytest.mark.parametrize("order", [("sqlite", "postgresql", "sqlite"), ("postgresql", "sqlite", "postgresql")])
def test_a_round_trip_across_backends_is_byte_identical(
    both: dict[str, Callable[[], TranscriptStore]], order: tuple[str, str, str]
) -> None:
    """Export from one backend, import into the other under the same scope and id, export: the JSONL text
    is the same bytes; and again back into a fresh store of the first backend."""
    first = both[order[0]]()
    sids = shapes(first)
    texts = {sid: jsonl(*first.export_session(SRC, sid)) for sid in sids}
    current = first
    for backend in order[1:]:
        target = both[backend]()
        for sid in sids:
            target.import_session(SRC, *read_jsonl(texts[sid]))
            assert jsonl(*target.export_session(SRC, sid)) == texts[sid], (backend, sid)
            assert target.list_entries(SRC, sid) == current.list_entries(SRC, sid)
            assert target.read_visible(SRC, sid) == current.read_visible(SRC, sid)
        current = target
    ended = current.get_session(SRC, "ended")
    assert ended.active is False and ended.session_key == "key:ended"
    assert current.get_session(SRC, "headless").head_entry_id is None


# ---------------------------------------------------------------------------------------------- forged files


def test_forged_numbers_and_seqs_are_refused(store: TranscriptStore) -> None:
    """Seq gaps, a seq repeated or past the columns, negative and huge numbers, numbers of the wrong type."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    n = len(records)
    renumbered = [{**r, "seq": r["seq"] + (1 if r["seq"] >= 5 else 0)} for r in records]
    cases: list[tuple[Any, Any, str]] = [
        (header, renumbered, "seq"),  # a gap at 5, the count right
        (header, [{**r, "seq": r["seq"] + 1} for r in records], "seq"),  # starting at 1
        (header, [*records[:5], {**records[5], "seq": 4}, *records[6:]], "seq"),
        (header, edit(records, "u2", seq=2**31), "seq"),
        (header, edit(records, "u2", seq=-1), "seq"),
        (header, edit(records, "u2", seq=10**40), "seq"),
        (header, edit(records, "u2", seq=float(n - 1)), "seq"),
        ({**header, "entry_count": n + 1}, [*records, {**records[-1], "seq": n, "entry_id": "extra"}], "active"),
        ({**header, "entry_count": -1}, records, "entry_count"),
        ({**header, "entry_count": 2**31}, records, "entry_count"),
        ({**header, "visible_count": -1}, records, "visible_count"),
        ({**header, "visible_count": 10**20}, records, "visible_count"),
        ({**header, "visible_count": header["visible_count"] + 1}, records, "visible"),
        (header, edit(records, "u2", position=2**31 - 1), "position"),
        (header, edit(records, "u2", position=str(header["visible_count"] - 1)), "position"),
        (header, edit(records, "ev1", position=0), "position"),
        (header, edit(records, "u2", created_at="+275760-09-13T00:00:00Z"), "created_at"),
        (header, edit(records, "u2", created_at="2024-01-01T00:00:00+25:00"), "created_at"),
        ({**header, "active": "true"}, records, "active"),
        ({**header, "head_entry_id": 5}, records, "head_entry_id"),
        (header, edit(records, "u2", kind=["message"]), "kind"),
        (header, edit(records, "u2", role="assistant"), "role"),
        (header, edit(records, "ev1", role="user"), "role"),
        (header, edit(records, "u2", message=json.dumps(user("x"))), "message"),
        (header, edit(records, "u2", message=None), "message"),
    ]
    for h, rs, words in cases:
        with pytest.raises(InvalidInput, match=words):
            store.import_session(DST, h, rs)
    assert store.list_sessions(DST) == []
    refused_cleanly(store, header, renumbered, "seq")


def test_a_null_payload_of_an_event_is_refused_not_taken_for_an_empty_object(store: TranscriptStore) -> None:
    """The store exports every event's payload as the object it stored ({} when empty). A null was taken
    for {} (an append's default), and the copy then exported {} where its file said null."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    assert next(r for r in records if r["entry_id"] == "md1")["payload"] == {}
    refused_cleanly(store, header, edit(records, "md1", payload=None), "payload")
    refused_cleanly(store, header, edit(records, "ev1", payload=None, size_bytes=2), "payload")


def test_ids_of_another_scopes_session_collide_with_nothing(store: TranscriptStore) -> None:
    """The same session id, key and entry ids as a session of another scope: a separate session, the other
    scope's rows untouched; over a session of the target scope: refused, nothing written."""
    build(store)
    header, records = store.export_session(SRC, "s1")
    source_rows = snapshot(store)
    info = store.import_session(DST, header, records)
    assert (info.scope, info.session_id, info.session_key) == (DST, "s1", "key:s1")
    after = snapshot(store)
    for table, rows in source_rows.items():
        assert [r for r in after[table] if SRC in r] == [r for r in rows if SRC in r], table
    # The header still names the source scope: it is never used, the import goes where it is told.
    assert store.export_session(SRC, "s1") == (header, records)
    before = snapshot(store)
    with pytest.raises(IdempotencyConflict, match="already exists"):
        store.import_session(DST, {**header, "scope": DST}, records)
    assert snapshot(store) == before


# ---------------------------------------------------------------------------------------------- mid-turn


def make_host(store: TranscriptStore, engine: str) -> tuple[HostRuntime, RecordingModel]:
    model = RecordingModel()
    host = HostRuntime(
        store,
        load_settings(config_path=None, engine=engine),
        model,
        registry=EngineRegistry(),
        summarizer=ExtractiveSummarizer(),
        estimator=RoughEstimator(),
    )
    return host, model


def test_a_session_exported_mid_turn_imports_into_a_state_the_host_recovers_from(store: TranscriptStore) -> None:
    """The export is the transcript only: no turn intents, receipts or engine state. A session exported
    while a turn was admitted (its intent pending in the source) is imported as its entries: the copy has
    no intent; the admitted turn, retried under its turn id on the copy, runs and commits; a new turn
    follows; the engine, holding no state of the copy, reads it from its start. The source is untouched."""
    host, model = make_host(store, "lossless")
    try:
        store.create_session(SRC, session_id="s", session_key="k")
        first = host.run_turn(SRC, "s", "hello", turn_id="t1")
        assert first.commit_status == "committed"
        turns = Turns(store)
        turns.admit(SRC, "s", user("pending question"), turn_id="t2", engine_id=first.engine_id)
        assert host.maintenance.wait(30)  # the engine's deferred upkeep of t1 is done: the source holds still
        header, records = store.export_session(SRC, "s")
        source = {table: [r for r in rows if SRC in r] for table, rows in snapshot(store).items()}
        store.import_session(DST, header, records)
        assert turns.intents(DST) == [] and turns.receipts(DST, "s") == []
        assert [(i.turn_id, i.state) for i in turns.intents(SRC)] == [("t2", "admitted")]

        resumed = host.run_turn(DST, "s", "pending question", turn_id="t2")
        assert resumed.commit_status == "committed" and resumed.degraded_reason is None
        # The model saw the whole copied transcript: the engine started the copy from its first entry.
        assert [m["content"] for m in model.requests[-1] if m["role"] != "system"] == [
            "hello",
            first.reply["content"],
            "pending question",
        ]
        after = host.run_turn(DST, "s", "and then", turn_id="t3")
        assert after.commit_status == "committed"
        assert [r.advancement_key for r in turns.receipts(DST, "s")] == ["t2", "t3"]
        assert turns.intents(DST) == []
        visible = [(e.message or {}).get("content") for e in store.read_visible(DST, "s")]
        assert visible == [
            "hello",
            first.reply["content"],
            "pending question",
            resumed.reply["content"],
            "and then",
            after.reply["content"],
        ]
        # Another copy, where a new turn goes first: it follows the unanswered question, which is overtaken then.
        store.import_session(DST, header, records, session_id="s-new", session_key="k-new")
        assert host.run_turn(DST, "s-new", "something else", turn_id="t9").commit_status == "committed"
        with pytest.raises(TurnOvertaken):
            host.run_turn(DST, "s-new", "pending question", turn_id="t2")
        # The source session, its pending intent and its receipt are as they were.
        assert host.maintenance.wait(30)
        assert {table: [r for r in rows if SRC in r] for table, rows in snapshot(store).items()} == source
    finally:
        host.dispose()


def test_a_turn_completed_in_the_source_is_not_known_as_completed_on_the_copy(store: TranscriptStore) -> None:
    """The limit the docstring names: the copy's ledger holds no receipt, so the last completed turn of the
    source, retried under its turn id on the copy, runs again (the source answers ``duplicate``) and its
    reply lands a second time. A turn that a later turn followed is still refused (TurnOvertaken)."""
    host, _model = make_host(store, "legacy")
    try:
        store.create_session(SRC, session_id="s")
        done = host.run_turn(SRC, "s", "hello", turn_id="t1")
        header, records = store.export_session(SRC, "s")
        store.import_session(DST, header, records)
        assert host.run_turn(SRC, "s", "hello", turn_id="t1").commit_status == "duplicate"
        again = host.run_turn(DST, "s", "hello", turn_id="t1")
        assert again.commit_status == "committed"
        assert [e.message["role"] for e in store.read_visible(DST, "s")] == ["user", "assistant", "assistant"]  # type: ignore[index]
        assert len(store.read_visible(SRC, "s")) == 2 and done.commit_status == "committed"
    finally:
        host.dispose()
