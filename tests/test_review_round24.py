"""Findings of the twenty-fourth review round (hostile input against the public API, a new user's walk
through the README).

Each test failed before its fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import module_store_fixtures, user
from test_cli import CLI, empty_url
from test_compaction_focus import everything
from test_host import make_host

from transcript_store import InvalidInput, TranscriptStore, UnknownSession
from transcript_store.turns import Turns

S = "round-24"
E = "engine-1"

shared_url, store, sid = module_store_fixtures(S, "round-24")
__all__ = ["empty_url"]  # a fixture of test_cli's, used here


class LyingStr(str):
    """A str whose ``encode`` hides a lone surrogate."""

    def encode(self, *_a: Any, **_k: Any) -> bytes:  # type: ignore[override]
        return b"x"


class LyingInt(int):
    """An int whose ``bit_length`` hides its 5,000 digits."""

    def bit_length(self) -> int:
        return 1


@pytest.mark.parametrize(
    "call",
    [
        lambda s, sid: s.append(S, sid, kind="custom", payload={"k": LyingStr("\ud800")}),
        lambda s, sid: s.append(S, sid, {"role": "user", "content": "x", "k": LyingStr("\ud800")}),
        lambda s, sid: s.append(S, sid, {"role": "user", "content": "x", "n": LyingInt(10**5000)}),
        lambda s, sid: s.append(S, sid, kind="custom", payload={"n": LyingInt(10**5000)}),
    ],
    ids=["payload-str", "message-str", "message-int", "payload-int"],
)
def test_str_and_int_subclasses_cannot_hide_what_json_cannot_carry(store: TranscriptStore, sid: str, call: Any) -> None:
    """The check called the value's own ``encode`` / ``bit_length``: a subclass overriding them passed,
    and the JSON writer raised a bare UnicodeEncodeError or ValueError."""
    before = everything(store)
    with pytest.raises(InvalidInput):
        call(store, sid)
    assert everything(store) == before


@pytest.mark.parametrize("owner", ["a\x1b[31mb", "line\nbreak", "del\x7f", "nel\x85"])
def test_a_lease_owner_with_control_characters_is_refused(store: TranscriptStore, sid: str, owner: str) -> None:
    """The message said "no control characters"; only NUL and lone surrogates were refused, and an
    owner with a terminal escape was written to the outbox (and printed by `outbox status`)."""
    before = everything(store)
    with pytest.raises(InvalidInput, match="control characters"):
        Turns(store).admit(S, sid, user("q"), turn_id="t1", engine_id=E, owner=owner)
    assert everything(store) == before


@pytest.mark.parametrize("turn_id", ["", 0, []])
def test_run_turn_refuses_an_empty_turn_id(store: TranscriptStore, sid: str, turn_id: Any) -> None:
    """``if turn_id:`` took "" (or 0, []) for "none given" and drew a new id: the same call made again,
    a retry by its caller's account, stored a second turn."""
    host, _ = make_host(store)
    before = everything(store)
    with pytest.raises(InvalidInput, match="turn_id"):
        host.run_turn(S, sid, "hello", turn_id=turn_id)
    assert everything(store) == before
    host.dispose()


def test_receipts_and_recover_refuse_an_unknown_or_foreign_session(store: TranscriptStore, sid: str) -> None:
    """Both answered empty for a session the scope does not hold, where every other session call
    raises UnknownSession."""
    turns = Turns(store)
    assert turns.receipts(S, sid) == []  # the session's own (empty) ledger
    for scope, session in (("another-scope", sid), (S, "no-such-session")):
        with pytest.raises(UnknownSession):
            turns.receipts(scope, session)
        with pytest.raises(UnknownSession):
            turns.recover(scope, session, E, lambda _engine: None)
    report = turns.recover(S, sid, E, lambda _engine: None)
    assert report.discarded == [] and report.queued == []


class NoCompactEngine:
    """An engine with the required parts only (``compact`` is optional)."""

    owns = False

    def __init__(self, ctx: Any) -> None:
        from transcript_store.engine import EngineInfo, TranscriptSemantics

        self.store = ctx.store
        self.info = EngineInfo(
            id="minimal", owns_compaction=self.owns,
            transcript_semantics=TranscriptSemantics(current_turn_fence="before-current-turn-entry-v1",
                                                     turn_advancement_idempotency="atomic-idempotent-v1"),
        )

    def assemble(self, *, scope: str, session_id: str, fence: Any, token_budget: int, **_host: Any) -> Any:
        from transcript_store.engine import AssembleResult

        messages = [e.message for e in self.store.read_visible(scope, session_id, fence=fence)]
        return AssembleResult(messages=messages, estimated_tokens=sum(len(str(m)) // 4 for m in messages))

    def commit_turn(self, *, tx: Any, advancement_key: str, admission: Any, terminal: Any, messages: Any,
                    is_heartbeat: bool = False, **_host: Any) -> Any:
        from transcript_store.ledger import commit_turn_in, prepare_turn

        return commit_turn_in(tx, prepare_turn(self.info.id, advancement_key, admission, terminal, messages,
                                               is_heartbeat=is_heartbeat))


class OwningNoCompactEngine(NoCompactEngine):
    owns = True


@pytest.mark.parametrize("kind", [NoCompactEngine, OwningNoCompactEngine])
def test_manual_compaction_of_an_engine_without_compact(store: TranscriptStore, sid: str, kind: Any) -> None:
    """``compact`` is documented optional: the host called it anyway, the AttributeError became an
    EngineError, and the engine was quarantined (every later turn ran on legacy)."""
    from transcript_store.host import HostRuntime
    from transcript_store.model import LocalResponder
    from transcript_store.registry import EngineRegistry
    from transcript_store.settings import load_settings

    registry = EngineRegistry()
    registry.register_factory("minimal", kind)
    host = HostRuntime(store, load_settings(config_path=None, engine="minimal", token_budget=2000),
                       LocalResponder(), registry=registry)
    for i in range(6):
        assert host.run_turn(S, sid, f"question {i} " + "words " * 60).engine_id == "minimal"
    result = host.compact(S, sid, focus="question")
    assert result.ok
    assert result.compacted is (kind is NoCompactEngine)  # the host's compaction, for a non-owning engine
    assert host.run_turn(S, sid, "again").engine_id == "minimal"  # not quarantined
    host.dispose()


@pytest.mark.parametrize(
    "command", [["sessions", "import", "/dev/zero", "--session-id", "z"], ["chat", "--session", "z"]]
)
def test_endless_input_without_line_breaks_is_refused_not_read_whole(tmp_path: Path, command: list[str]) -> None:
    """``sessions import /dev/zero`` and ``chat < /dev/zero`` read one endless line: memory until the
    kernel killed the process (24 GB here). A line is read up to what the payload cap allows."""
    import resource
    import subprocess

    def limit() -> None:  # so that the unfixed reader fails fast here instead of taking the machine
        resource.setrlimit(resource.RLIMIT_AS, (2 * 1024**3, 2 * 1024**3))

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    env["TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES"] = str(1024 * 1024)
    with open("/dev/zero", "rb") as zero:
        done = subprocess.run([*CLI, "--db", f"sqlite:///{tmp_path / 'z.db'}", *command], stdin=zero, cwd=tmp_path,
                              capture_output=True, text=True, env=env, timeout=120, preexec_fn=limit)
    assert done.returncode == 1, done
    unit = "bytes" if command[0] == "chat" else "characters"  # chat's cap is in bytes since round 26
    assert f" {unit} " in done.stderr and "MemoryError" not in done.stderr, done.stderr


def test_engines_list_without_a_store_says_so(empty_url: str, backend: str, tmp_path: Path) -> None:
    """It listed the engines and exited 0 without a word, where every other command names the missing
    store; the quarantines it shows come from the store."""
    from test_cli import run

    out = run("engines", "list", "--db", empty_url, cwd=tmp_path)
    assert "legacy" in out.stdout and "no store to read quarantines from" in out.stdout
    if backend == "sqlite":
        assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ({"role": "user", "content": []}, "content"),
        ({"role": "function", "content": "x"}, "name"),
        ({"role": "assistant", "tool_calls": [{"id": "c1", "type": "nope",
                                               "function": {"name": "f", "arguments": "{}"}}]}, "type"),
        ({"role": "assistant", "content": "x", "tool_calls": []}, "tool_calls"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "image_url"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}, "image_url"),
    ],
)
def test_messages_the_chat_api_refuses_are_refused(store: TranscriptStore, sid: str, message: Any, why: str) -> None:
    """Stored, each made every later model request of its session fail (the API answers 400 for the whole
    conversation); the store took them as valid chat messages."""
    from transcript_store import InvalidMessage

    before = everything(store)
    with pytest.raises(InvalidMessage, match=why):
        store.append(S, sid, message)
    assert everything(store) == before


def test_their_valid_neighbours_are_still_taken(store: TranscriptStore, sid: str) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for message in [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "function", "name": "f", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "content": None, "tool_calls": [{k: v for k, v in call.items() if k != "type"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}]},
    ]:
        assert store.append(S, sid, message).message == message


def test_a_session_deleted_and_created_again_mid_turn_is_named_as_such(store: TranscriptStore) -> None:
    """The turn failed with "its worker's lease was taken for abandoned": no lease was taken, its
    session was deleted and another created under the id while the model ran."""
    from hosting import RecordingModel

    from transcript_store.errors import OutboxCollision

    sid = store.create_session(S, session_id="replaced").session_id

    class Replacing(RecordingModel):
        def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
            store.delete_session(S, sid)
            store.create_session(S, session_id=sid)
            return super().complete(messages, tools, **kw)

    host, _ = make_host(store)
    host.model = Replacing()
    with pytest.raises(OutboxCollision, match=r"deleted .*created again") as raised:
        host.run_turn(S, sid, "question", turn_id="t1")
    assert "lease" not in str(raised.value)
    assert store.read_visible(S, sid) == [] and Turns(store).receipts(S, sid) == []
    host.dispose()


def test_a_delivery_whose_row_left_with_its_session_is_not_a_failed_one(store: TranscriptStore) -> None:
    """A drain claimed a ready row; its session was deleted and created again before the delivery ran.
    The delivery failed and was reported failed ("their rows stay queued", exit 1 in the CLI) for a row
    that no longer existed."""
    from transcript_store.ledger import commit_turn_in

    turns = Turns(store)
    sid = store.create_session(S, session_id="drained").session_id
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id=E)
    turns.complete(S, sid, "t1", [{"message": {"role": "assistant", "content": "A"}}], None)
    turns.recover(S, sid, E, lambda _engine: None)  # captured: ready, its engine not available here
    assert [i.state for i in turns.intents(S)] == ["ready"]

    def commit_in(_engine: str) -> Any:
        store.delete_session(S, sid)  # meanwhile, in another client
        store.create_session(S, session_id=sid)
        return commit_turn_in

    report = turns.drain(commit_in, scope=S, session_id=sid)
    assert report.failed == [] and report.committed == 0, report
    assert turns.intents(S) == [] and turns.receipts(S, sid) == []


def _call(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "lookup", "arguments": '{"q":"x"}'}} for i in ids]}


def test_branching_back_never_leaves_a_tool_result_without_its_call(store: TranscriptStore) -> None:
    """A side path answered one of two calls and went on; compacted there, a summary took the call and
    its one result. Branched back to the path where the second result follows, the summary was kept and
    the second result imported raw after it: a tool message whose call is in no message of the context."""
    from engines.lossless import LosslessEngine
    from transcript_store.engine import EngineContext

    sid = store.create_session(S, session_id="split").session_id
    engine = LosslessEngine(EngineContext(store=store, config={}))
    e = store.append_many(S, sid, [
        {"message": user("look up two things " + "word " * 200)}, {"message": _call("c1", "c2")},
        {"message": {"role": "tool", "tool_call_id": "c1", "content": "first result " + "data " * 400}},
        {"message": {"role": "tool", "tool_call_id": "c2", "content": "second result " + "data " * 40}},
        {"message": {"role": "assistant", "content": "both found"}},
    ])
    store.branch(S, sid, e[2].entry_id)
    store.append_many(S, sid, [{"message": {"role": r, "content": f"side {n} " + "text " * 30}}
                               for n in range(4) for r in ("user", "assistant")])
    engine.assemble(scope=S, session_id=sid, fence=None, token_budget=8000)
    assert engine.compact(scope=S, session_id=sid, force=True).compacted
    store.branch(S, sid, e[4].entry_id)
    out = engine.assemble(scope=S, session_id=sid, fence=None, token_budget=8000).messages
    called = set()
    for m in out:
        called |= {c["id"] for c in m.get("tool_calls") or []}
        assert m["role"] != "tool" or m["tool_call_id"] in called, out
    text = json.dumps(out)
    assert "second result" in text and "both found" in text and "side 0" not in text
    engine.dispose()


def test_a_large_character_class_counts_toward_the_regex_size_bound() -> None:
    """A class counted as one item whatever it held: 975 letters repeated 99,999 times passed the
    100,000-item bound and compiled to some 384 MiB (the bound keeps a pattern near 25 MiB)."""
    from engines.lossless.search import REGEX_MAX_SIZE, SearchError, compile_regex, expanded_size

    letters = [c for c in map(chr, range(0x41, 0x20000))
               if c.lower() != c.upper() and c == c.upper() and c not in "\\]^-["][:975]
    with pytest.raises(SearchError, match="too large"):
        compile_regex("(?i)(?:[" + "".join(letters) + "]){99999}")
    assert expanded_size("[a-z]{1000}") < REGEX_MAX_SIZE and expanded_size("a{99999}") < REGEX_MAX_SIZE
    compile_regex("[A-Za-z0-9_]{2000}")  # ordinary classes stay cheap


def test_engine_form_ids_are_the_engines_whichever_kind(store: TranscriptStore) -> None:
    """``sum_7`` without a summary 7 named the transcript entry called "sum_7", ``msg_7`` without a message
    7 named nothing: both now name only the engine's own, and the error says which id the entry has."""
    from engines.lossless import LosslessEngine
    from transcript_store.engine import EngineContext

    sid = store.create_session(S, session_id="ids").session_id
    store.append_many(S, sid, [{"entry_id": "sum_7", "message": user("entry named sum_7")},
                               {"entry_id": "msg_7", "message": user("entry named msg_7")}])
    engine = LosslessEngine(EngineContext(store=store, config={}))
    engine.assemble(scope=S, session_id=sid, fence=None, token_budget=4000)
    for name, own in (("sum_7", "msg_0"), ("msg_7", "msg_1")):
        for tool in ("lcm_describe", "lcm_expand"):
            out = json.loads(engine.handle_tool_call(tool, {"id": name}, scope=S, session_id=sid))
            assert "error" in out and own in out["error"], (tool, name, out)
    engine.dispose()


def test_expand_cuts_a_huge_tool_call_id(store: TranscriptStore) -> None:
    """The content was cut to ``expand_max_chars``, the tool_call_id copied whole (200,000 characters)."""
    from engines.lossless import LosslessEngine
    from transcript_store.engine import EngineContext

    sid = store.create_session(S, session_id="long-call").session_id
    huge = "c" * 200_000
    store.append_many(S, sid, [{"message": user("q")}, {"message": _call(huge)},
                               {"message": {"role": "tool", "tool_call_id": huge, "content": "r" * 500}}])
    engine = LosslessEngine(EngineContext(store=store, config={"expand_max_chars": 100}))
    engine.assemble(scope=S, session_id=sid, fence=None, token_budget=100_000)
    out = engine.handle_tool_call("lcm_expand", {"id": "msg_2"}, scope=S, session_id=sid)
    assert len(out) < 2_000, len(out)
    engine.dispose()


def test_the_0010_upgrade_reads_each_receipt_s_entry_through_the_index(tmp_path: Path) -> None:
    """Left to SQLite's planner, 0010 walked a session's entries and read every receipt of the session for
    each (no index on the receipts' admission entry at that revision): 13 s for one 10,000-turn session,
    minutes past 20,000, the write lock held. The receipts drive it now, each entry found by its id."""
    import importlib

    from sqlalchemy import text

    from transcript_store import StoreConfig, migrate
    from transcript_store.db import Database

    step = importlib.import_module("transcript_store.migrations.versions.0010_bind_committed_admissions")
    db = Database(StoreConfig(url=f"sqlite:///{tmp_path / 'old.db'}"))
    try:
        migrate.upgrade(db, "0009")
        with db.engine.connect() as c:
            plan = [r[3] for r in c.execute(text("EXPLAIN QUERY PLAN " + step._UNBOUND["sqlite"].text))]
        assert plan[0] == "SCAN r" and "SEARCH e USING INDEX ts_entries_entry_id" in plan[1], plan
    finally:
        db.dispose()


def test_the_0010_upgrade_binds_committed_entries_on_both_backends(empty_url: str, backend: str) -> None:
    """The rewritten statement binds what the old one bound (each admitted entry committed without a turn
    id takes its key); on PostgreSQL the tables are analyzed first when there are receipts, and a new
    store's empty tables are not (their statistics made later page reads use plans for empty tables)."""
    import hashlib

    from sqlalchemy import text

    from transcript_store import StoreConfig, migrate
    from transcript_store.db import Database

    def reltuples(c: Any) -> float:
        return float(c.execute(text("SELECT reltuples FROM pg_class WHERE relname = 'ts_entries'")).scalar_one())

    db = Database(StoreConfig(url=empty_url))
    try:
        migrate.upgrade(db, "0004")
        n = 120
        with db.engine.begin() as c:
            c.execute(text(
                "INSERT INTO ts_sessions (scope, session_id, session_key, active, generation, last_seq, head_seq,"
                " head_entry_id, path_length, visible_count, created_us, updated_us)"
                " VALUES ('sc', 's', NULL, true, 0, :n, :n, :h, :m, :m, 1000, 1000)"), {"n": n - 1, "h": f"e{n - 1}",
                                                                                      "m": n})
            c.execute(text("INSERT INTO ts_entries VALUES ('sc', 's', :seq, :id, :p, :seq, :seq, 0, 'message',"
                           " 'user', :pl, 10, NULL, NULL, 1)"),
                      [{"seq": i, "id": f"e{i}", "p": f"e{i - 1}" if i else None,
                        "pl": json.dumps({"role": "user", "content": f"w{i}"})} for i in range(n)])
            c.execute(text("INSERT INTO ts_active_path VALUES ('sc', 's', :d, :d, :d)"), [{"d": i} for i in range(n)])
            # every other entry committed (under two keys for one of them: the smallest wins)
            keys = [(f"k{i}", f"e{i}") for i in range(0, n, 2)] + [("a-first", "e0")]
            c.execute(text(
                "INSERT INTO ts_receipts (scope, session_id, engine_id, advancement_key, payload_hash,"
                " admission_entry_id, terminal_entry_id, message_count, is_heartbeat, committed_us)"
                " VALUES ('sc', 's', 'e', :k, :h, :a, :a, 1, false, 5)"),
                [{"k": k, "h": hashlib.sha256(k.encode()).hexdigest(), "a": a} for k, a in keys])
        migrate.upgrade(db, "0010")
        with db.engine.connect() as c:
            bound = dict(c.execute(text("SELECT entry_id, turn_id FROM ts_entries WHERE turn_id IS NOT NULL")).all())
            assert bound == {**{f"e{i}": f"k{i}" for i in range(2, n, 2)}, "e0": "a-first"}
            if backend == "postgresql":
                assert reltuples(c) == n  # analyzed: statistics of the data there is
    finally:
        db.dispose()
    if backend == "postgresql":  # a new store: nothing to bind, no statistics of its empty tables
        import uuid

        from conftest import _admin_exec, pg_url

        name = f"ts_r24_{uuid.uuid4().hex[:8]}"
        _admin_exec(f"CREATE DATABASE {name}")
        fresh = Database(StoreConfig(url=pg_url(name)))
        try:
            migrate.upgrade(fresh)
            with fresh.engine.connect() as c:
                assert reltuples(c) == -1  # never analyzed
        finally:
            fresh.dispose()
            _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
