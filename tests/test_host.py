"""The host runtime over both backends: commits, degradation, quarantine, requirements, projection."""

from __future__ import annotations

import json
import logging
import sys
import types
from typing import Any

import pytest
from conftest import assistant, user
from hosting import CountingEngine, RecordingModel, count_transactions
from sqlalchemy import event

from transcript_store import TranscriptStore, compaction
from transcript_store.engine import AssembleResult, CompactResult, EngineContext, HostRequirement, SessionTarget
from transcript_store.errors import (
    EngineError,
    HostRequirementError,
    InvalidInput,
    ModelTimeout,
    PermissionDenied,
    SessionBusy,
    StorageFull,
    TransientStoreError,
    TurnBranchedAway,
    UnknownEngine,
    UnknownSession,
)
from transcript_store.host import HostRuntime, TurnFailed, prune_tool_results
from transcript_store.ledger import committed_messages, get_state
from transcript_store.quarantine import records
from transcript_store.registry import EngineRegistry
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator, TiktokenEstimator, count_from_parts
from transcript_store.turns import Turns

SCOPE = "tenant-1"


def make_host(
    store: TranscriptStore, engine: str = "legacy", factories: dict[str, Any] | None = None, **settings: Any
) -> tuple[HostRuntime, RecordingModel]:
    registry = EngineRegistry()
    for engine_id, factory in (factories or {}).items():
        registry.register_factory(engine_id, factory)
    model = RecordingModel()
    host = HostRuntime(
        store,
        load_settings(config_path=None, engine=engine, **settings),
        model,
        registry=registry,
        summarizer=ExtractiveSummarizer(),
        estimator=RoughEstimator(),
    )
    return host, model


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(SCOPE, session_id="sess", session_key="agent:main:test").session_id


def receipts(store: TranscriptStore, engine_id: str) -> list[str]:
    return [r.advancement_key for r in Turns(store).receipts(SCOPE, "sess", engine_id)]


def test_legacy_turns_commit_once_and_see_history(store: TranscriptStore, sid: str) -> None:
    host, model = make_host(store)
    first = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert first.engine_id == "legacy" and first.degraded_reason is None
    assert first.commit_status == "committed"
    second = host.run_turn(SCOPE, sid, "again", turn_id="t2")
    # The second request carried system + the first turn (user + reply) + the new user message.
    contents = [m.get("content") for m in model.requests[-1]]
    assert contents[1:] == ["hello", first.reply["content"], "again"]
    assert receipts(store, "legacy") == ["t1", "t2"]
    ledger = store.read(lambda c: committed_messages(c, SCOPE, sid, "legacy", "t2"))
    assert ledger == second.messages
    assert [e.message for e in store.read_visible(SCOPE, sid)] == first.messages + second.messages


def test_tool_loop_messages_are_one_turn(store: TranscriptStore, sid: str) -> None:
    host, _model = make_host(store)
    out = host.run_turn(SCOPE, sid, "please use tool lookup now", turn_id="t1")
    roles = [m["role"] for m in out.messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert store.read(lambda c: committed_messages(c, SCOPE, sid, "legacy", "t1")) == out.messages


def test_unknown_session_and_bad_message_write_nothing(store: TranscriptStore, sid: str) -> None:
    host, _ = make_host(store)
    with pytest.raises(UnknownSession):
        host.run_turn("other-scope", sid, "hi")
    with pytest.raises(InvalidInput):
        host.run_turn(SCOPE, sid, {"role": "assistant", "content": "not a user"})
    assert store.get_session(SCOPE, sid).entry_count == 0


def test_configured_durable_engine_gets_the_commit(store: TranscriptStore, sid: str) -> None:
    engines: dict[str, CountingEngine] = {}

    def factory(ctx: EngineContext) -> CountingEngine:
        engines["counting"] = CountingEngine(ctx)
        return engines["counting"]

    host, _ = make_host(store, "counting", {"counting": factory})
    for i in range(3):
        out = host.run_turn(SCOPE, sid, f"m{i}", turn_id=f"t{i}")
        assert out.engine_id == "counting" and out.commit_status == "committed"
    assert receipts(store, "counting") == ["t0", "t1", "t2"]
    assert store.read(lambda c: get_state(c, SCOPE, sid, "counting", "turns")) == 3
    # The engine saw exactly the prefix before the third admitted entry: two turns of two messages.
    assert len(engines["counting"].seen[(SCOPE, sid)]) == 4


def test_broken_engine_is_quarantined_and_turns_go_to_legacy(store: TranscriptStore, sid: str) -> None:
    class Broken(CountingEngine):
        def assemble(self, **kw: Any) -> Any:
            raise RuntimeError("engine bug")

    host, _ = make_host(store, "broken", {"broken": lambda ctx: Broken(ctx, "broken")})
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.engine_id == "legacy" and "engine bug" in (out.degraded_reason or "")
    assert "broken" in host.quarantined
    out2 = host.run_turn(SCOPE, sid, "again", turn_id="t2")
    assert out2.engine_id == "legacy" and out2.commit_status == "committed"
    recs = store.read(lambda c: records(c))
    assert [(r.engine_id, r.operation, r.alive) for r in recs] == [("broken", "assemble", True)]
    assert receipts(store, "broken") == []
    assert receipts(store, "legacy") == ["t1", "t2"]


def test_a_quarantined_engine_is_disposed_of_with_the_runtime(store: TranscriptStore, sid: str) -> None:
    """Quarantine dropped the instance from the runtime's engines, and ``dispose`` walked those only: an
    engine that failed once never had its ``dispose`` called, whatever it held (connections, threads,
    files) left to the process's end. It is disposed of with the runtime now, once, the live ones too."""
    disposed: list[str] = []

    class Broken(CountingEngine):
        def assemble(self, **kw: Any) -> Any:
            raise RuntimeError("engine bug")

        def dispose(self) -> None:
            disposed.append(self.info.id)

    class Fine(CountingEngine):
        def dispose(self) -> None:
            disposed.append(self.info.id)

    host, _ = make_host(store, "broken", {"broken": lambda ctx: Broken(ctx, "broken"),
                                          "fine": lambda ctx: Fine(ctx, "fine")})
    host.engine("fine")
    assert host.run_turn(SCOPE, sid, "hello", turn_id="t1").engine_id == "legacy"
    assert "broken" in host.quarantined and disposed == []  # not at once: another thread may be inside it
    host.dispose()
    assert sorted(disposed) == ["broken", "fine"]
    host.dispose()
    assert sorted(disposed) == ["broken", "fine"]


def test_a_quarantine_record_the_database_cannot_take_yet_is_written_by_a_later_flush(
    store: TranscriptStore, store_url: str, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The record of a quarantine is what other processes see (doctor, the gateway's report). A database
    that cannot take it at the time (StoreUnavailable: here its table is renamed away) keeps it queued,
    and the flush after a later turn writes it; nothing else of that turn is held up."""
    from sqlalchemy import create_engine, text

    class Broken(CountingEngine):
        def assemble(self, **kw: Any) -> Any:
            raise RuntimeError("engine bug")

    admin = create_engine(store_url)

    def rename(old: str, new: str) -> None:
        with admin.begin() as conn:
            conn.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))

    host, _ = make_host(store, "broken", {"broken": lambda ctx: Broken(ctx, "broken")})
    rename("ts_quarantine", "ts_quarantine_away")
    try:
        with caplog.at_level(logging.WARNING, logger="transcript_store.host"):
            out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
        assert out.engine_id == "legacy" and out.commit_status == "committed" and "broken" in host.quarantined
        assert any("kept for the next try" in r.getMessage() for r in caplog.records)
    finally:
        rename("ts_quarantine_away", "ts_quarantine")
        admin.dispose()
    assert store.read(lambda c: records(c)) == []
    out2 = host.run_turn(SCOPE, sid, "again", turn_id="t2")
    assert out2.engine_id == "legacy" and out2.commit_status == "committed"
    recs = store.read(lambda c: records(c))
    assert [(r.engine_id, r.operation, r.alive) for r in recs] == [("broken", "assemble", True)]
    host.dispose()
    assert len(store.read(lambda c: records(c))) == 1


def test_an_engine_error_with_a_nul_and_a_lone_surrogate_is_recorded_escaped(store: TranscriptStore, sid: str) -> None:
    """PostgreSQL's text takes no NUL and no driver encodes a lone surrogate: the quarantine record of an
    engine whose error held them was refused (and an intent's last error would have been too)."""

    class Broken(CountingEngine):
        def assemble(self, **kw: Any) -> Any:
            raise RuntimeError("bad \x00 byte and \ud800 half")

    host, _ = make_host(store, "broken", {"broken": lambda ctx: Broken(ctx, "broken")})
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.engine_id == "legacy" and out.commit_status == "committed"
    [rec] = store.read(lambda c: records(c))
    assert rec.engine_id == "broken" and rec.reason == "RuntimeError: bad \\x00 byte and \\ud800 half"


def test_a_quarantine_record_the_database_keeps_refusing_is_given_up(
    store: TranscriptStore, store_url: str, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A record is retried at QUARANTINE_RECORD_TRIES flushes at most (it must not be tried, and warned
    about, after every turn for ever); a later engine's record is written once the database takes it."""
    from sqlalchemy import create_engine, text

    from transcript_store.host import QUARANTINE_RECORD_TRIES

    admin = create_engine(store_url)

    def rename(old: str, new: str) -> None:
        with admin.begin() as conn:
            conn.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))

    host, _ = make_host(store)
    rename("ts_quarantine", "ts_quarantine_away")
    try:
        with caplog.at_level(logging.WARNING, logger="transcript_store.host"):
            host.quarantine("first", "assemble", RuntimeError("one"))
            for _ in range(QUARANTINE_RECORD_TRIES - 2):
                assert host.flush_quarantines() is False
            assert host.flush_quarantines() is True  # the last try: given up
            assert host.flush_quarantines() is True  # nothing left to try
        assert any(f"after {QUARANTINE_RECORD_TRIES} tries" in r.getMessage() for r in caplog.records)
    finally:
        rename("ts_quarantine_away", "ts_quarantine")
        admin.dispose()
    host.quarantine("second", "after_turn", RuntimeError("two"))
    assert [r.engine_id for r in store.read(lambda c: records(c))] == ["second"]
    assert "first" in host.quarantined and "second" in host.quarantined


def test_the_callers_runtime_context_reaches_the_engine_as_values(store: TranscriptStore, sid: str) -> None:
    """run_turn's runtime_context was accepted and dropped: the engine never saw it. It is now the
    RuntimeContext's ``values``, a copy, in every call of the turn; anything but a JSON object of at
    most 64 KiB is refused before the turn starts, nothing written."""

    class Seeing(CountingEngine):
        def assemble(self, **kw: Any) -> AssembleResult:
            self.calls.append(("values", {"values": kw["runtime_context"].values}))
            return super().assemble(**kw)

    engines: dict[str, Seeing] = {}
    host, _ = make_host(store, "seeing", {"seeing": lambda ctx: engines.setdefault("e", Seeing(ctx, "seeing"))})
    mine = {"workspace": "/srv/agent", "user": {"tier": "pro", "tags": ["a", "b"]}}
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1", runtime_context=mine)
    assert out.engine_id == "seeing" and out.commit_status == "committed"
    seen = [kw["values"] for name, kw in engines["e"].calls if name == "values"]
    assert seen == [mine]
    mine["user"]["tier"] = "changed"  # the engine holds a copy, not the caller's object
    assert seen[0]["user"]["tier"] == "pro"
    host.run_turn(SCOPE, sid, "again", turn_id="t2")  # none given: empty
    assert [kw["values"] for name, kw in engines["e"].calls if name == "values"][-1] == {}
    before = store.get_session(SCOPE, sid).entry_count
    for bad in (["a"], "text", {1: "x"}, {"x": float("nan")}, {"x": "\ud800"}, {"x": object()},
                {"x": "y" * (64 * 1024)}):
        with pytest.raises(InvalidInput, match="runtime_context"):
            host.run_turn(SCOPE, sid, "bad", runtime_context=bad)  # type: ignore[arg-type]
    assert store.get_session(SCOPE, sid).entry_count == before


def test_an_engine_failing_to_give_its_tools_degrades_the_turn_to_legacy(store: TranscriptStore, sid: str) -> None:
    """get_tool_schemas runs before the model is first called: an engine raising there is quarantined
    and the turn is answered on legacy, as for assemble, not failed."""

    class NoSchemas(CountingEngine):
        def get_tool_schemas(self) -> Any:
            raise RuntimeError("schema bug")

    host, _ = make_host(store, "noschemas", {"noschemas": lambda ctx: NoSchemas(ctx, "noschemas")})
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert (out.engine_id, out.commit_status) == ("legacy", "committed")
    assert "schema bug" in (out.degraded_reason or "")
    assert host.quarantined["noschemas"][0] == "get_tool_schemas"
    assert receipts(store, "legacy") == ["t1"]


def test_an_engine_tool_that_raises_is_answered_as_an_error_and_the_turn_goes_on(
    store: TranscriptStore, sid: str
) -> None:
    """handle_tool_call runs after the model was called (host tools may have run): the turn cannot move
    to legacy, but it must not fail either. The engine is quarantined, the model gets an error for the
    call and answers, and the accepted turn waits in the outbox for the engine."""

    class ToolBroken(CountingEngine):
        def get_tool_schemas(self) -> Any:
            return [{"name": "recall", "parameters": {"type": "object", "properties": {}}}]

        def handle_tool_call(self, name: str, args: Any, **kw: Any) -> str:
            raise RuntimeError("tool bug")

    host, _ = make_host(store, "broken", {"broken": lambda ctx: ToolBroken(ctx, "broken")})
    out = host.run_turn(SCOPE, sid, "please use tool recall now", turn_id="t1")
    assert (out.engine_id, out.commit_status) == ("broken", "queued")
    assert [m["role"] for m in out.messages] == ["user", "assistant", "tool", "assistant"]
    assert "tool 'recall' failed" in out.messages[2]["content"]
    assert host.quarantined["broken"][0] == "handle_tool_call"
    assert [e.message for e in store.read_visible(SCOPE, sid)] == out.messages
    nxt = host.run_turn(SCOPE, sid, "again", turn_id="t2")
    assert (nxt.engine_id, nxt.commit_status) == ("legacy", "committed")


def test_a_driver_error_is_described_without_its_statement_and_parameters(
    store: TranscriptStore, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLAlchemy's error text carries the statement's SQL and parameters: an engine failing on a turn
    with a 2 MB tool output logged, queued and recorded those 2 MB of the user's content. What the
    host keeps of an engine's error is its driver message's first line, bounded. (A driver error is the
    database's answer, which no longer quarantines the engine, b42aa7f: the queued row and the log keep it.)"""
    secret = "user-content-" + "x" * 2_000_000

    class Failing(CountingEngine):
        def commit_turn(self, *, tx: Any, **kw: Any) -> Any:  # inside the completion's transaction
            mark = "?" if tx.dialect.is_sqlite else "%s"
            tx.conn.exec_driver_sql(f"SELECT * FROM no_such_table WHERE x = {mark}", (secret,))

    host, _ = make_host(store, "failing", {"failing": lambda ctx: Failing(ctx, "failing")})
    with caplog.at_level(logging.WARNING):
        out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.engine_id == "failing" and out.commit_status == "queued"
    assert store.read(lambda c: records(c)) == [] and "failing" not in host.quarantined
    [queued] = Turns(store).intents(SCOPE)
    reason = queued.last_error
    assert reason is not None and "no_such_table" in reason and "no_such_table" in caplog.text
    for text in (reason, caplog.text):
        assert "user-content" not in text and "[SQL:" not in text and len(text) < 5_000, text[:300]


def test_factory_exception_quarantines(store: TranscriptStore, sid: str) -> None:
    def factory(ctx: EngineContext) -> Any:
        raise RuntimeError("cannot start")

    host, _ = make_host(store, "bad", {"bad": factory})
    out = host.run_turn(SCOPE, sid, "hello")
    assert out.engine_id == "legacy" and host.quarantined["bad"][0] == "factory"


def test_preload_of_an_id_no_engine_has_is_unknown_engine_even_once_quarantined(store: TranscriptStore) -> None:
    """``engine`` quarantines an id no engine has at its first use (its "factory" failed); ``preload`` of that
    id then answered a bare KeyError (its quarantined branch looked the id up in the registry's specs), not
    the UnknownEngine its contract names. A registered engine's quarantine is still reported invalid."""
    def factory(ctx: EngineContext) -> Any:
        raise RuntimeError("cannot start")

    host, _ = make_host(store, "legacy", {"bad": factory})
    with pytest.raises(UnknownEngine):
        host.preload("nosuch")
    with pytest.raises(EngineError):
        host.engine("nosuch")
    assert "nosuch" in host.quarantined
    with pytest.raises(UnknownEngine):
        host.preload("nosuch")
    assert not host.preload("bad").valid and "bad" not in host.quarantined  # invalid, not quarantined
    with pytest.raises(EngineError):
        host.engine("bad")
    status = host.preload("bad")
    assert not status.valid and status.spec.id == "bad" and (status.reason or "").startswith("quarantined (factory")
    assert host.preload("legacy").valid
    host.dispose()


def test_fence_rewritten_mid_turn_degrades_that_turn_only(store: TranscriptStore, sid: str) -> None:
    class Rewriter(CountingEngine):
        rewrite_next = True

        def assemble(self, **kw: Any) -> Any:
            if self.rewrite_next:
                self.rewrite_next = False
                first = store.read_visible(SCOPE, sid)[0]
                store.rewrite_entries(
                    SCOPE, sid, [{"entry_id": first.entry_id, "message": {"role": "user", "content": "edited"}}]
                )
            return super().assemble(**kw)

    host, _ = make_host(store)
    host.run_turn(SCOPE, sid, "first", turn_id="t0")
    host2, _ = make_host(store, "rw", {"rw": lambda ctx: Rewriter(ctx, "rw")})
    out = host2.run_turn(SCOPE, sid, "second", turn_id="t1")
    assert out.engine_id == "legacy" and "read fence" in (out.degraded_reason or "")
    assert "rw" not in host2.quarantined  # a fence error is not the engine's fault
    out2 = host2.run_turn(SCOPE, sid, "third", turn_id="t2")
    assert out2.engine_id == "rw" and out2.degraded_reason is None
    assert "t1" not in receipts(store, "rw")


def test_a_degraded_turn_id_in_one_session_does_not_degrade_the_same_id_in_another(
    store: TranscriptStore, sid: str
) -> None:
    """Turn ids are the caller's: the engine decided for a failed, degraded turn of one session (kept
    for that turn's retry) is not the decision of a turn with the same id in another session."""
    other = store.create_session(SCOPE, session_id="other").session_id
    store.append(SCOPE, sid, {"role": "system", "content": "be brief"})

    def rewrite_then_fail(scope: str, session_id: str, admission: Any) -> None:
        if session_id == sid and store.get_session(scope, session_id).generation == 0:
            first = store.read_visible(scope, session_id)[0]
            edit = {"entry_id": first.entry_id, "message": {"role": "system", "content": "be briefer"}}
            store.rewrite_entries(scope, session_id, [edit])

    host, model = make_host(store, "counting", {"counting": lambda ctx: CountingEngine(ctx, "counting")})
    host.before_assemble = rewrite_then_fail
    model.fail_next = [RuntimeError("provider 500")]  # the degraded attempt fails too
    with pytest.raises(RuntimeError):
        host.run_turn(SCOPE, sid, "hello", turn_id="turn-1")
    host.before_assemble = None
    out = host.run_turn(SCOPE, other, "hello", turn_id="turn-1")
    assert (out.engine_id, out.degraded_reason) == ("counting", None)


def test_a_second_worker_on_the_same_turn_learns_duplicate(store: TranscriptStore, sid: str) -> None:
    """A dispatcher re-sent a turn after a timeout while its first worker was slow, not dead: the
    attempt that completes second learns "duplicate" (with the other attempt's reply), never an
    error, and its own reply is not written."""
    first, _ = make_host(store)
    second, _ = make_host(store)
    ran: list[str] = []

    class Slow(RecordingModel):
        def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
            if not ran:  # while the first worker's model runs, the second worker runs the whole turn
                ran.append(second.run_turn(SCOPE, sid, "hello", turn_id="turn-1").commit_status)
            return super().complete(messages, tools, **kw)

    first.model = Slow()
    out = first.run_turn(SCOPE, sid, "hello", turn_id="turn-1")
    assert ran == ["committed"]
    stored = [e.message["content"] for e in store.read_visible(SCOPE, sid)]
    assert out.commit_status == "duplicate" and out.reply["content"] == stored[-1]
    assert len(stored) == 2 and receipts(store, "legacy") == ["turn-1"]


def test_a_retry_that_delivers_an_accepted_turn_reports_it_committed(store: TranscriptStore, sid: str) -> None:
    """The first attempt got as far as the acceptance (its delivery never ran: a crash, an engine out);
    the retry delivers it, without calling the model: that is this call's commit, "committed" (it said
    "duplicate", as for a turn committed before it, and the gateway counted it as a duplicate absorbed).
    The next retry learns "duplicate"."""
    turns = Turns(store)
    turns.admit(SCOPE, sid, user("hello"), turn_id="turn-1", engine_id="legacy")
    done = turns.complete(SCOPE, sid, "turn-1", [{"message": assistant("stored answer")}], None)
    assert done.intent.state == "accepted"
    host, model = make_host(store)
    out = host.run_turn(SCOPE, sid, "hello", turn_id="turn-1")
    assert (out.commit_status, out.reply["content"], model.requests) == ("committed", "stored answer", [])
    again = host.run_turn(SCOPE, sid, "hello", turn_id="turn-1")
    assert (again.commit_status, again.reply["content"], model.requests) == ("duplicate", "stored answer", [])
    assert receipts(store, "legacy") == ["turn-1"]


def test_cursor_crossing_engine_is_degraded(store: TranscriptStore, sid: str) -> None:
    class Crosser(CountingEngine):
        def assemble(self, **kw: Any) -> Any:
            page = store.read_visible_delta(SCOPE, sid)  # unfenced: runs past the admitted entry
            return store.read_visible_delta(SCOPE, sid, page.cursor, fence=kw["fence"])  # type: ignore[union-attr]

    host, _ = make_host(store, "x", {"x": lambda ctx: Crosser(ctx, "x")})
    out = host.run_turn(SCOPE, sid, "one", turn_id="t0")
    assert out.engine_id == "legacy" and out.degraded_reason == "read fence: crossed"
    assert "x" not in host.quarantined
    assert receipts(store, "legacy") == ["t0"] and receipts(store, "x") == []


def test_missing_declarations_degrade_with_the_documented_reasons(
    store: TranscriptStore, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    class NoCommit(CountingEngine):
        commit_turn = None  # type: ignore[assignment]

    cases = {
        "nofence": (
            lambda ctx: CountingEngine(ctx, "nofence", transcript_semantics={}),
            "current-turn transcript fencing is not declared",
        ),
        "noidem": (
            lambda ctx: CountingEngine(
                ctx, "noidem", transcript_semantics={"current_turn_fence": "before-current-turn-entry-v1"}
            ),
            "atomic idempotent turn advancement is not declared",
        ),
        "partial": (lambda ctx: NoCommit(ctx, "partial"), "atomic idempotent turn advancement is not declared"),
    }
    for engine_id, (factory, reason) in cases.items():
        host, _ = make_host(store, engine_id, {engine_id: factory})
        with caplog.at_level(logging.WARNING):
            out = host.run_turn(SCOPE, sid, f"hi {engine_id}")
        assert out.engine_id == "legacy" and out.degraded_reason == reason
    assert "invariant failure" in caplog.text


def test_host_requirements_fail_closed(store: TranscriptStore, sid: str) -> None:
    def factory(ctx: EngineContext) -> CountingEngine:
        return CountingEngine(
            ctx,
            "needy",
            host_requirements={
                "agent-run": HostRequirement(
                    required_capabilities=["assemble-before-prompt", "thread-bootstrap"],
                    unsupported_message="Use another host.",
                )
            },
        )

    host, _ = make_host(store, "needy", {"needy": factory})
    with pytest.raises(HostRequirementError) as err:
        host.run_turn(SCOPE, sid, "hi")
    assert str(err.value).startswith('Context engine "needy" cannot run operation "agent-run"')
    assert "Missing host capabilities: thread-bootstrap" in str(err.value)
    assert store.get_session(SCOPE, sid).entry_count == 0


@pytest.mark.parametrize(
    "accepted,expected",
    [
        (None, {"session_key", "prompt", "runtime_settings", "runtime_context"}),
        ([], set()),
        (["session_key"], {"session_key"}),
    ],
)
def test_host_params_are_projected(store: TranscriptStore, sid: str, accepted: Any, expected: set[str]) -> None:
    engine: dict[str, CountingEngine] = {}

    def factory(ctx: EngineContext) -> CountingEngine:
        engine["e"] = CountingEngine(ctx, "p", accepted_host_params=accepted)
        return engine["e"]

    host, _ = make_host(store, "p", {"p": factory})
    host.run_turn(SCOPE, sid, "hi")
    _, kw = next(c for c in engine["e"].calls if c[0] == "assemble")
    host_params = {"session_key", "prompt", "runtime_settings", "session_target", "runtime_context"}
    assert set(kw) & host_params == expected
    if "runtime_settings" in expected:
        rs = kw["runtime_settings"]
        assert rs.schema_version == 1 and rs.context_engine_selection.id == "p"
        assert rs.runtime.mode == "normal" and rs.model.requested is not None
        # The prompt's budget is the one assemble gets (the window less the reply, the system prompt,
        # the user message and the tools), not the window.
        reserved = RoughEstimator().count_messages([{"role": "system", "content": host.settings.system_prompt},
                                                    {"role": "user", "content": "hi"}])
        assert rs.limits.prompt_token_budget == kw["token_budget"] <= 32000 - rs.limits.max_output_tokens - reserved


def test_model_timeout_retries_the_same_logical_turn(store: TranscriptStore, sid: str) -> None:
    host, model = make_host(store)
    model.fail_next = [ModelTimeout("slow provider")]
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.attempts == 2 and out.commit_status == "committed"
    users = [e for e in store.read_visible(SCOPE, sid) if e.role == "user"]
    assert len(users) == 1 and receipts(store, "legacy") == ["t1"]


def test_failed_turn_discards_its_intent_and_commits_nothing(store: TranscriptStore, sid: str) -> None:
    host, model = make_host(store, max_attempts=2)
    model.fail_next = [ModelTimeout("1"), ModelTimeout("2")]
    with pytest.raises(TurnFailed):
        host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert Turns(store).intents(SCOPE) == [] and receipts(store, "legacy") == []


def test_successor_session_after_compaction(store: TranscriptStore, sid: str) -> None:
    class Rotator(CountingEngine):
        def compact(self, **kw: Any) -> CompactResult:
            store.end_session(SCOPE, kw["session_id"])
            new = store.create_session(SCOPE, session_id="sess-2", session_key="agent:main:test")
            return CompactResult(
                ok=True,
                compacted=True,
                session_target=SessionTarget(scope=SCOPE, session_id=new.session_id, session_key=new.session_key),
            )

    host, _ = make_host(store, "rot", {"rot": lambda ctx: Rotator(ctx, "rot")})
    host.run_turn(SCOPE, sid, "before")
    result = host.compact(SCOPE, sid)
    assert result.session_id == "sess-2"
    out = host.run_turn(SCOPE, sid, "after")
    assert out.session_id == "sess-2"
    assert store.read_visible(SCOPE, "sess-2")[0].message == {"role": "user", "content": "after"}


def test_legacy_assembly_reads_only_the_delta(store: TranscriptStore) -> None:
    """Rows read per turn do not depend on the history length (counted, not timed)."""
    host, _ = make_host(store)
    costs = {}
    for n_history in (10, 200):
        sid = store.create_session(SCOPE).session_id
        store.append_many(
            SCOPE,
            sid,
            [
                {"message": {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}}
                for i in range(n_history)
            ],
        )
        host.run_turn(SCOPE, sid, "warm up")
        legacy, _info = host.engine("legacy")
        before = legacy.rows_read
        host.run_turn(SCOPE, sid, "measured")
        costs[n_history] = legacy.rows_read - before
    assert costs[10] == costs[200] == 2  # the previous turn's user message and reply


def test_a_legacy_turn_reads_each_row_of_its_completion_once(store: TranscriptStore, sid: str) -> None:
    """The fast completion holds the session row from its append, with the head it appended to (the
    admission): its closed range is that head and the replies it wrote, read from nowhere; it neither
    reads the session again nor reads the range (or the ledger) to commit."""
    host, _ = make_host(store)
    host.run_turn(SCOPE, sid, "warm up", turn_id="t1")
    executed: list[str] = []

    def listen(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        executed.append(" ".join(statement.split()))

    event.listen(store.db.engine, "before_cursor_execute", listen)
    try:
        assert host.run_turn(SCOPE, sid, "measured", turn_id="t2").commit_status == "committed"
    finally:
        event.remove(store.db.engine, "before_cursor_execute", listen)
    session_reads = [s for s in executed if s.startswith("SELECT ts_sessions.")]
    # The admission's, the assembly read's (with the cursor's position) and the completion's (which
    # the closed range reuses).
    assert len(session_reads) == 3, session_reads
    assert not [s for s in executed if s.startswith("SELECT") and "FROM ts_receipts" in s.split(" WHERE ")[0]]
    # The fence the admission itself wrote is not checked again, nor is the outbox read twice.
    assert not [s for s in executed if s.startswith("SELECT") and "FROM ts_outbox" in s and "earlier" not in s][1:]
    accept = next(i for i, s in enumerate(executed) if s.startswith("SELECT ts_outbox."))
    assert not [s for s in executed[accept + 1 :] if s.startswith("SELECT")], executed[accept:]  # no range read
    assert len(executed) <= (15 if store.backend == "sqlite" else 11), executed
    assert receipts(store, "legacy") == ["t1", "t2"]


def test_a_legacy_turn_is_two_transactions_the_first_one_too(store: TranscriptStore, sid: str) -> None:
    """Admission (with the assembly's reads under its lock) and completion: no read snapshot between."""
    host, _ = make_host(store)
    assert count_transactions(store, lambda: host.run_turn(SCOPE, sid, "first", turn_id="t1")) == 2
    assert count_transactions(store, lambda: host.run_turn(SCOPE, sid, "second", turn_id="t2")) == 2
    # A long history the admission does not read in one page: the rest in a snapshot of its own.
    other = store.create_session(SCOPE).session_id
    store.append_many(SCOPE, other, [{"message": {"role": "user", "content": f"m{i}"}} for i in range(700)])
    assert count_transactions(store, lambda: host.run_turn(SCOPE, other, "long", turn_id="t3")) == 3
    assert count_transactions(store, lambda: host.run_turn(SCOPE, other, "warm", turn_id="t4")) == 2
    assert receipts(store, "legacy") == ["t1", "t2"]


def _same_turns_two_ways(store: TranscriptStore, **settings: Any) -> tuple[RecordingModel, RecordingModel]:
    """The same turns on two sessions: one host reading in the admission, one in a snapshot of its own
    (a ``before_assemble`` seam turns the prefetch off); a tool turn, a maintenance rewrite (the
    cursor resets), long turns and a compaction (a new pointer) on the way."""
    fast, fast_model = make_host(store, **settings)
    slow, slow_model = make_host(store, **settings)
    slow.before_assemble = lambda *_args: None
    for host in (fast, slow):
        sid = store.create_session(SCOPE).session_id
        host.run_turn(SCOPE, sid, "hello", turn_id=f"{sid}-1")
        host.run_turn(SCOPE, sid, "please use tool lookup now", turn_id=f"{sid}-2")
        reply = next(e for e in store.read_visible(SCOPE, sid) if e.role == "assistant")
        store.rewrite_entries(
            SCOPE, sid, [{"entry_id": reply.entry_id, "message": {"role": "assistant", "content": "redacted"}}]
        )
        host.run_turn(SCOPE, sid, "after the rewrite", turn_id=f"{sid}-3")
        for i in range(8):
            text = " ".join(f"filler{i}-{k} with several more words to summarise" for k in range(40))
            host.run_turn(SCOPE, sid, text, turn_id=f"{sid}-f{i}")
        host.compact(SCOPE, sid, force=True)
        host.run_turn(SCOPE, sid, "after the compaction", turn_id=f"{sid}-4")
    return fast_model, slow_model


def test_assembly_read_in_the_admission_gives_what_its_own_snapshot_gives(store: TranscriptStore) -> None:
    fast, slow = _same_turns_two_ways(store)
    assert fast.requests == slow.requests
    assert any("redacted" in str(r) for r in fast.requests)
    assert any("[Summary of the earlier conversation]" in str(r[1]) for r in fast.requests)


def test_auto_compaction_inside_a_turn_assembles_again_from_the_new_pointer(store: TranscriptStore) -> None:
    """A budget the long turns overflow: the host compacts before the prompt and assembles again; the
    second assembly must not reuse what the admission read before that compaction."""
    fast, slow = _same_turns_two_ways(store, token_budget=1400, max_output_tokens=100, compaction_threshold=0.5)
    assert fast.requests == slow.requests
    kinds = [e.kind for e in store.list_entries(SCOPE, store.list_sessions(SCOPE)[0].session_id)]
    assert kinds.count("compaction") >= 2  # the manual one and at least one automatic one


def test_a_retried_turn_id_whose_entry_left_the_path_is_fenced_as_before(store: TranscriptStore, sid: str) -> None:
    """A turn id admitted again after its entry was branched away: the admission stores nothing new, so
    its prefetch checks the fence like any read. The retry fails before its model call: the branch no
    longer holds its question (TurnBranchedAway; the turn was degraded, its reply written after the
    branch point and the turn blocked, an answer without its question on the branch)."""
    host, model = make_host(store)
    host.run_turn(SCOPE, sid, "first", turn_id="t1")
    parent = store.read_visible(SCOPE, sid)[-1]

    class BranchThenTimeout:
        name = "branch-then-timeout"

        def __init__(self) -> None:
            self.calls = 0

        def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
            self.calls += 1
            if self.calls == 1:  # between the two attempts: drop the admitted entry from the path
                store.branch(SCOPE, sid, parent.entry_id)
                raise ModelTimeout("first attempt times out")
            return model.complete(messages, tools, **kw)

    host.model = BranchThenTimeout()
    before = store.read_visible(SCOPE, sid)
    with pytest.raises(TurnBranchedAway):
        host.run_turn(SCOPE, sid, "second", turn_id="t2")
    assert host.model.calls == 1  # the retry never reached the model
    assert store.read_visible(SCOPE, sid) == before and Turns(store).intent(SCOPE, sid, "t2") is None


class _PrefetchFails(CountingEngine):
    """A test engine whose admission-time read raises what it is given."""

    def __init__(self, ctx: EngineContext, error: BaseException) -> None:
        super().__init__(ctx, "pf")
        self.error = error

    def prefetch_in(self, _c: Any, **_kw: Any) -> bool:
        raise self.error


def test_a_refused_prefetch_only_skips_it(store: TranscriptStore, sid: str) -> None:
    from transcript_store.errors import ReadFenceError

    host, _ = make_host(store, "pf", {"pf": lambda ctx: _PrefetchFails(ctx, ReadFenceError("moved", "test"))})
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.engine_id == "pf" and out.commit_status == "committed" and out.degraded_reason is None


def test_another_engines_failing_prefetch_quarantines_it_and_legacy_answers(
    store: TranscriptStore, sid: str
) -> None:
    host, _ = make_host(store, "pf", {"pf": lambda ctx: _PrefetchFails(ctx, RuntimeError("engine bug"))})
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.engine_id == "legacy" and out.commit_status == "committed"
    assert out.degraded_reason is not None and "engine bug" in out.degraded_reason
    assert "pf" in host.quarantined
    # The failed admission rolled back whole: one user entry, the one legacy admitted.
    assert [e.message for e in store.read_visible(SCOPE, sid)] == out.messages


def test_an_error_inside_the_admission_rolls_it_back(store: TranscriptStore, sid: str) -> None:
    def within(_c: Any, _admission: Any) -> None:
        raise RuntimeError("after the admission's writes")

    with pytest.raises(RuntimeError, match="admission's writes"):
        Turns(store).admit_if_clear(
            SCOPE, sid, {"role": "user", "content": "hi"}, turn_id="t1", engine_id="legacy", within=within
        )
    assert store.read_visible(SCOPE, sid) == []
    assert Turns(store).intent(SCOPE, sid, "t1") is None


def test_pending_earlier_turn_degrades_the_next(store: TranscriptStore, sid: str) -> None:
    class FailingCommit(CountingEngine):
        def commit_turn(self, **kw: Any) -> Any:
            raise RuntimeError("ledger down")

    host, _ = make_host(store, "fc", {"fc": lambda ctx: FailingCommit(ctx, "fc")})
    out = host.run_turn(SCOPE, sid, "one", turn_id="t1")
    assert out.engine_id == "fc" and out.commit_status in ("accepted", "ready", "queued")
    # The accepted turn is kept, never lost; the engine is quarantined (recorded once the completion
    # transaction ended, without waiting on its own write lock); the next turn goes to legacy.
    assert [i.turn_id for i in Turns(store).intents(SCOPE)] == ["t1"]
    assert [(r.engine_id, r.operation) for r in store.read(lambda c: records(c))] == [("fc", "commit_turn")]
    out2 = host.run_turn(SCOPE, sid, "two", turn_id="t2")
    assert out2.engine_id == "legacy"
    # A new process with a working engine drains the queued turn first.
    host3, _ = make_host(store, "fc", {"fc": lambda ctx: CountingEngine(ctx, "fc")})
    out3 = host3.run_turn(SCOPE, sid, "three", turn_id="t3")
    assert out3.engine_id == "fc" and receipts(store, "fc") == ["t1", "t3"]


def test_prune_trims_old_tool_results_in_request_only() -> None:
    msgs = [{"role": "tool", "tool_call_id": str(i), "content": "x" * 5000} for i in range(6)]
    pruned = prune_tool_results(msgs, keep_recent=2, max_chars=1000)
    assert all(len(m["content"]) < 1200 for m in pruned[:4])
    assert all(len(m["content"]) == 5000 for m in pruned[4:])
    assert all(len(m["content"]) == 5000 for m in msgs)


def test_subagent_prepare_rollback_and_end(store: TranscriptStore, sid: str) -> None:
    events: list[str] = []

    class Sub(CountingEngine):
        def prepare_subagent_spawn(self, **kw: Any) -> Any:
            from transcript_store.engine import SubagentSpawnPreparation

            events.append(f"prepare:{kw['context_mode']}")
            return SubagentSpawnPreparation(rollback=lambda: events.append("rollback"))

        def on_subagent_ended(self, **kw: Any) -> None:
            events.append(f"ended:{kw['child_session_key']}")

    host, _ = make_host(store, "sub", {"sub": lambda ctx: Sub(ctx, "sub")})
    assert host.spawn_subagent(SCOPE, sid, "child:1", lambda child: "ok", context_mode="fork") == "ok"
    with pytest.raises(RuntimeError):
        host.spawn_subagent(SCOPE, sid, "child:2", lambda child: (_ for _ in ()).throw(RuntimeError("spawn failed")))
    assert events == ["prepare:fork", "ended:child:1", "prepare:isolated", "rollback"]


def test_subagent_hooks_that_raise_never_cost_the_child_run(
    store: TranscriptStore, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine failing a subagent hook is quarantined like any lifecycle failure, and the spawn goes on
    without it: a failing prepare runs the child unprepared (legacy has no such hook), a failing
    on_subagent_ended does not lose the finished child's result, and a failing rollback does not hide why
    the child failed."""
    from transcript_store.engine import SubagentSpawnPreparation

    events: list[str] = []

    class Sub(CountingEngine):
        fail: str = ""

        def prepare_subagent_spawn(self, **kw: Any) -> Any:
            events.append("prepare")
            if self.fail == "prepare":
                raise RuntimeError("prepare broke")

            def rollback() -> None:
                events.append("rollback")
                if self.fail == "rollback":
                    raise RuntimeError("rollback broke")

            return SubagentSpawnPreparation(rollback=rollback)

        def on_subagent_ended(self, **kw: Any) -> None:
            events.append("ended")
            if self.fail == "ended":
                raise RuntimeError("ended broke")

    for fail, child_fails in (("prepare", False), ("ended", False), ("rollback", True)):
        events.clear()
        Sub.fail = fail
        host, _ = make_host(store, "sub", {"sub": lambda ctx: Sub(ctx, "sub")})

        def child(child_sid: str, fails: bool = child_fails) -> str:
            events.append("child")
            if fails:
                raise ValueError("the child failed")
            return f"ran {child_sid}"

        with caplog.at_level(logging.WARNING):
            if child_fails:
                with pytest.raises(ValueError, match="the child failed"):
                    host.spawn_subagent(SCOPE, sid, f"child:{fail}", child)
            else:
                assert host.spawn_subagent(SCOPE, sid, f"child:{fail}", child).startswith("ran ")
        assert host.quarantined["sub"][0] == {
            "prepare": "prepare_subagent_spawn", "ended": "on_subagent_ended", "rollback": "subagent_rollback"
        }[fail]
        assert f"{fail} broke" in caplog.text
        # A quarantined engine is not called again: no on_subagent_ended after a failed prepare.
        assert events == {
            "prepare": ["prepare", "child"], "ended": ["prepare", "child", "ended"],
            "rollback": ["prepare", "child", "rollback"],
        }[fail]
        assert store.read(records)[-1].engine_id == "sub"
        caplog.clear()


def test_builtin_compaction_runs_for_non_owning_engines_only(store: TranscriptStore, sid: str) -> None:
    big = "word " * 400
    store.append_many(
        SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": big}} for i in range(30)]
    )
    host, _ = make_host(store, token_budget=4000)
    out = host.run_turn(SCOPE, sid, "go")
    assert out.assembled_tokens < 4000
    kinds = [e.kind for e in store.list_entries(SCOPE, sid)]
    assert "compaction" in kinds
    sid2 = store.create_session(SCOPE).session_id
    store.append_many(SCOPE, sid2, [{"message": {"role": "user", "content": big}} for _ in range(30)])
    host2, _ = make_host(
        store, "own", {"own": lambda ctx: CountingEngine(ctx, "own", owns_compaction=True)}, token_budget=4000
    )
    host2.run_turn(SCOPE, sid2, "go")
    assert "compaction" not in [e.kind for e in store.list_entries(SCOPE, sid2)]


def test_the_pre_prompt_safeguard_of_an_owning_engine_runs_its_own_compaction(
    store: TranscriptStore, sid: str
) -> None:
    """An engine that owns compaction and answers prompt_authority="preassembly_may_overflow" keeps the
    pre-prompt safeguard on: over the threshold, the host asks the engine's compact(), never the
    built-in compaction (whose summary the engine would not read), and assembles again."""

    class Owning(CountingEngine):
        compacted = False

        def assemble(self, **kw: Any) -> AssembleResult:
            window = super().assemble(**kw).messages[-2:]
            tokens = 100 if self.compacted else 5000
            return AssembleResult(messages=window, estimated_tokens=tokens, prompt_authority="preassembly_may_overflow")

        def compact(self, **kw: Any) -> CompactResult:
            self.calls.append(("compact", kw))
            self.compacted = True
            return CompactResult(ok=True, compacted=True)

    store.append_many(
        SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 300}}
                     for i in range(20)]
    )
    engines: dict[str, Owning] = {}
    host, _ = make_host(
        store, "own", {"own": lambda ctx: engines.setdefault("own", Owning(ctx, "own", owns_compaction=True))},
        token_budget=4000,
    )
    out = host.run_turn(SCOPE, sid, "hello")
    assert (out.engine_id, out.assembled_tokens) == ("own", 100)
    assert [name for name, _ in engines["own"].calls] == ["assemble", "compact", "assemble", "commit_turn"]
    assert "compaction" not in [e.kind for e in store.list_entries(SCOPE, sid)]


def test_builtin_compaction_before_the_prompt_keeps_the_configured_keep_last(store: TranscriptStore, sid: str) -> None:
    """[engine.config.legacy] keep_last protects recent messages from the built-in compaction: the one
    the host runs before the prompt too, not only a manual one."""
    big = "word " * 150
    store.append_many(
        SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": big}} for i in range(30)]
    )
    host, _ = make_host(store, token_budget=4000, engine_config={"legacy": {"keep_last": 12}})
    out = host.run_turn(SCOPE, sid, "go")
    [marker] = [e for e in store.list_entries(SCOPE, sid) if e.kind == "compaction"]
    kept = store.get_entries(SCOPE, sid, [marker.payload["first_kept_entry_id"]])[0]
    assert out.admission is not None and out.admission.anchor.position == 30
    assert kept.position == 30 - 12


def test_legacy_estimate_is_the_count_of_the_assembled_messages(store: TranscriptStore, sid: str) -> None:
    """The legacy engine sums the per-message counts it keeps instead of counting its context again:
    the estimate must still be exactly the estimator's count of what it assembled, with a compaction
    summary in front, tool calls inside, non-ASCII text, and after the budget cut older messages."""
    big = "word 字 " * 300
    store.append_many(
        SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": big}} for i in range(30)]
    )
    host, _ = make_host(store, token_budget=4000)
    host.run_turn(SCOPE, sid, "use tool lookup please")
    legacy, _info = host.engine("legacy")
    legacy.compact(scope=SCOPE, session_id=sid, force=True)
    host.run_turn(SCOPE, sid, "and again, with ümlauts")
    assert "compaction" in [e.kind for e in store.list_entries(SCOPE, sid)]
    estimator = RoughEstimator()
    for budget in (200_000, 3000, 900):
        result = legacy.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=budget)
        assert result.estimated_tokens == estimator.count_messages(result.messages)
        assert str(result.messages[0]["content"]).startswith("[Summary of the earlier")  # the prefix


def test_count_from_parts_is_the_list_count_for_this_modules_estimators(monkeypatch: pytest.MonkeyPatch) -> None:
    messages = [
        {"role": "system", "content": "summary"},
        {"role": "user", "content": "héllo 字字", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    class WordEncoding:  # tiktoken is optional: its estimator's framing, with words for tokens
        def encode(self, text: str, disallowed_special: Any = ()) -> list[int]:
            return [0] * len(text.split())

    fake = types.ModuleType("tiktoken")
    fake.get_encoding = lambda name: WordEncoding()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    for estimator in (RoughEstimator(), TiktokenEstimator()):
        for n in range(len(messages) + 1):
            parts = [estimator.count_messages([m]) for m in messages[:n]]
            assert count_from_parts(estimator, parts) == estimator.count_messages(messages[:n])

    class Own(RoughEstimator):
        def count_messages(self, messages: Any) -> int:
            return 7 * len(messages)

    assert count_from_parts(Own(), [7, 7]) is None  # a subclass may count lists its own way


def test_a_database_error_inside_a_prefetch_is_retried_not_blamed_on_the_engine(
    store: TranscriptStore, sid: str
) -> None:
    """The admission's own failure (here its connection is terminated under it) is translated and the
    transaction retried whole, as for any write: the engine is not quarantined for it."""
    if store.backend != "postgresql":
        pytest.skip("terminating the transaction's own connection is a PostgreSQL operation")

    class DropsItsConnectionOnce(CountingEngine):
        def __init__(self, ctx: EngineContext) -> None:
            super().__init__(ctx, "dc")
            self.prefetches = 0

        def prefetch_in(self, c: Any, **_kw: Any) -> None:
            self.prefetches += 1
            if self.prefetches == 1:
                c.conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")

    host, _ = make_host(store, "dc", {"dc": DropsItsConnectionOnce})
    retries = store.db.retries
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.engine_id == "dc" and out.degraded_reason is None and out.commit_status == "committed"
    assert "dc" not in host.quarantined and store.db.retries == retries + 1
    assert [e.message for e in store.read_visible(SCOPE, sid)] == out.messages


def test_a_database_error_inside_a_commit_is_retried_not_blamed_on_the_engine(store: TranscriptStore, sid: str) -> None:
    """The completion's connection is terminated while the engine commits: the transaction is retried
    whole and commits; the engine is not isolated for the rest of the process because of it."""
    if store.backend != "postgresql":
        pytest.skip("terminating the transaction's own connection is a PostgreSQL operation")

    class DropsItsConnectionOnce(CountingEngine):
        commits = 0

        def commit_turn(self, *, tx: Any, **kw: Any) -> Any:
            self.commits += 1
            if self.commits == 1:
                tx.conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")
            return super().commit_turn(tx=tx, **kw)

    host, _ = make_host(store, "dc", {"dc": lambda ctx: DropsItsConnectionOnce(ctx, "dc")})
    retries = store.db.retries
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert (out.engine_id, out.commit_status) == ("dc", "committed") and store.db.retries == retries + 1
    assert "dc" not in host.quarantined and store.read(lambda c: records(c)) == []
    assert host.run_turn(SCOPE, sid, "again", turn_id="t2").engine_id == "dc"


@pytest.mark.parametrize("failure", [
    TransientStoreError("transient database error: the server closed the connection"),
    StorageFull("database storage is full: database or disk is full"),
    PermissionDenied("database permission denied: attempt to write a readonly database"),
])
def test_an_engine_call_failing_with_the_database_leaves_the_engine_selectable(
    store: TranscriptStore, sid: str, failure: Exception
) -> None:
    """An assemble that fails because the database did (its retries ran out, a full disk, a missing
    grant or a read-only file) runs that turn on legacy; the configured engine is tried again on the
    next turn instead of being isolated for the process."""

    class Outage(CountingEngine):
        failures = [failure]

        def assemble(self, **kw: Any) -> Any:
            if self.failures:
                raise self.failures.pop()
            return super().assemble(**kw)

    host, _ = make_host(store, "outage", {"outage": lambda ctx: Outage(ctx, "outage")})
    out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
    assert out.engine_id == "legacy" and str(failure) in (out.degraded_reason or "")
    assert "outage" not in host.quarantined and store.read(lambda c: records(c)) == []
    out = host.run_turn(SCOPE, sid, "again", turn_id="t2")
    assert (out.engine_id, out.degraded_reason, out.commit_status) == ("outage", None, "committed")


def test_compaction_keeping_no_message_is_refused_and_writes_nothing(store: TranscriptStore, sid: str) -> None:
    from engines.legacy import LegacyEngine

    for i in range(6):
        store.append(SCOPE, sid, {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20})
    before = store.list_entries(SCOPE, sid)
    for keep_last in (0, -1, True, 2.5):
        with pytest.raises(InvalidInput, match="keep_last"):
            compaction.compact_session(
                store, SCOPE, sid, summarizer=ExtractiveSummarizer(), estimator=RoughEstimator(),
                keep_last=keep_last,  # type: ignore[arg-type]
                force=True,
            )
    assert store.list_entries(SCOPE, sid) == before
    # The legacy engine refuses such a setting when it is built, not at its first compaction.
    with pytest.raises(ValueError, match="keep_last"):
        LegacyEngine(EngineContext(store=store, config={"keep_last": 0}))


@pytest.mark.parametrize("engine", ["legacy", "lossless"])
def test_every_model_request_fits_the_prompt_budget_with_the_system_prompt_and_tools(
    store: TranscriptStore, sid: str, engine: str
) -> None:
    """The budget is the prompt's, not the transcript's: assemble gets it less the system prompt, the
    user message and the tools' schemas, so the request the model receives fits (it did not: a long
    system prompt and a tool's schema went over the budget by their size)."""
    estimator = RoughEstimator()
    schema = {"type": "function", "function": {"name": "lookup", "description": "Look things up. " * 60,
                                                "parameters": {"type": "object", "properties": {}}}}
    settings = load_settings(config_path=None, engine=engine, token_budget=3000, max_output_tokens=200,
                             system_prompt="You are careful and brief. " * 120)
    model = RecordingModel()
    host = HostRuntime(store, settings, model, summarizer=ExtractiveSummarizer(), estimator=estimator,
                       host_tools={"lookup": (schema, lambda _args: "found it")})
    for i in range(14):
        host.run_turn(SCOPE, sid, f"question {i}: " + "tell me more about this " * 40)
    assert len(model.requests) == 14
    for request in model.requests:
        tools = [schema] + [t for t in (host.engine(engine)[0].get_tool_schemas() if engine == "lossless" else [])]
        size = estimator.count_messages(request) + estimator.count_text(json.dumps(tools))
        assert size <= 3000 - 200, size


def _tool_rounds_are_closed(request: list[dict[str, Any]]) -> bool:
    """Every tool call answered right after its message, every tool result answering such a call."""
    open_calls: list[str] = []
    for m in request:
        if m["role"] == "tool":
            if m.get("tool_call_id") not in open_calls:
                return False
            open_calls.remove(m["tool_call_id"])
            continue
        if open_calls:
            return False
        open_calls = [c["id"] for c in m.get("tool_calls") or []]
    return not open_calls


@pytest.mark.parametrize("engine", ["legacy", "lossless"])
def test_a_branch_into_a_tool_round_still_sends_a_request_chat_apis_take(
    store: TranscriptStore, sid: str, engine: str
) -> None:
    """Branching onto the assistant's tool call (its result left behind) or appending a stray result
    leaves the transcript with an open tool round: the request answers the call with a stand-in and
    leaves the stray result out, and the transcript itself is not touched."""
    host, model = make_host(store, engine)
    host.run_turn(SCOPE, sid, "please use tool lookup now", turn_id="t1")
    call = next(e for e in store.read_visible(SCOPE, sid) if e.message and e.message.get("tool_calls"))
    store.branch(SCOPE, sid, call.entry_id)
    host.run_turn(SCOPE, sid, "and now?", turn_id="t2")
    store.append(SCOPE, sid, {"role": "tool", "tool_call_id": "nobody-asked", "content": "stray"})
    host.run_turn(SCOPE, sid, "once more", turn_id="t3")
    assert all(_tool_rounds_are_closed(r) for r in model.requests), model.requests
    sent = next(r for r in model.requests if r[-1].get("content") == "and now?")
    at = next(i for i, m in enumerate(sent) if m.get("tool_calls"))
    assert sent[at + 1]["role"] == "tool" and "no result" in sent[at + 1]["content"]
    last = next(r for r in model.requests if r[-1].get("content") == "once more")
    assert not any(m.get("tool_call_id") == "nobody-asked" for m in last)
    stored = [e.message for e in store.read_visible(SCOPE, sid)]
    assert stored[stored.index(call.message) + 1]["role"] == "user"  # the stand-in was never stored


class _BudgetFilling(CountingEngine):
    """Fills its whole token budget with the newest messages and adds a long system-prompt addition."""

    addition = "Recall what was said before you answer; the summaries hold the rest. " * 30

    def assemble(self, **kw: Any) -> AssembleResult:
        seen = super().assemble(**kw).messages
        est = RoughEstimator()
        shown: list[dict[str, Any]] = []
        for m in reversed(seen):
            if est.count_messages([m, *shown]) > kw["token_budget"]:
                break
            shown.insert(0, m)
        return AssembleResult(
            messages=shown, estimated_tokens=est.count_messages(shown), system_prompt_addition=self.addition
        )


def _request_tokens(request: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
    est = RoughEstimator()
    return est.count_messages(request) + (est.count_text(json.dumps(tools)) if tools else 0)


def test_the_engines_system_prompt_addition_is_counted_in_the_budget(store: TranscriptStore, sid: str) -> None:
    """assemble's system_prompt_addition goes into the request's system prompt: the request, addition
    included, fits the budget (it did not: the engine had filled the whole budget it was given, and the
    addition came on top of it)."""
    store.append_many(
        SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 200}}
                     for i in range(40)]
    )
    engines: dict[str, _BudgetFilling] = {}

    def factory(ctx: EngineContext) -> _BudgetFilling:
        # owning compaction: no pre-prompt compaction, so the only second assembly is the addition's
        return engines.setdefault("fill", _BudgetFilling(ctx, "fill", owns_compaction=True))

    host, model = make_host(store, "fill", {"fill": factory}, token_budget=3000, max_output_tokens=200)
    out = host.run_turn(SCOPE, sid, "hello")
    assert out.engine_id == "fill" and out.degraded_reason is None
    [request] = model.requests
    assert request[0]["content"].startswith(_BudgetFilling.addition)
    tools = [schema for schema, _ in host.host_tools.values()]
    assert _request_tokens(request, tools) <= 3000 - 200
    # The engine was asked again, with the addition reserved: what it returned is what the model saw.
    asked = [kw for name, kw in engines["fill"].calls if name == "assemble"]
    assert len(asked) == 2 and asked[1]["token_budget"] < asked[0]["token_budget"]
    assert asked[1]["runtime_settings"].limits.prompt_token_budget == asked[1]["token_budget"]


@pytest.mark.parametrize("engine", ["legacy", "lossless"])
def test_a_user_message_the_budget_cannot_hold_is_refused_before_anything_is_written(
    store: TranscriptStore, sid: str, engine: str
) -> None:
    """A request that cannot fit the budget even with no context at all (the system prompt, the user
    message, the tools' schemas and the reply's tokens) is refused with PromptTooLarge, no model call and
    nothing written (it was admitted, assemble got 1 token and the request went over the budget)."""
    from transcript_store.errors import PromptTooLarge

    host, model = make_host(store, engine, token_budget=1000, max_output_tokens=200)
    with pytest.raises(PromptTooLarge) as caught:
        host.run_turn(SCOPE, sid, "tell me more about this " * 200, turn_id="t1")
    assert isinstance(caught.value, InvalidInput) and caught.value.budget == 1000
    assert caught.value.tokens > 1000 - 200
    assert model.requests == [] and store.get_session(SCOPE, sid).entry_count == 0
    assert Turns(store).intents(SCOPE) == []
    # The session is not held: a message the budget can hold runs as usual, and the same turn id too.
    out = host.run_turn(SCOPE, sid, "a short one", turn_id="t1")
    assert out.commit_status == "committed" and out.engine_id == engine


class _Recording(CountingEngine):
    """Records the budget its compact() gets, and what the built-in compaction it delegates to does."""

    delegated: list[CompactResult]

    def compact(self, **kw: Any) -> CompactResult:
        self.calls.append(("compact", kw))
        done = kw["runtime_context"].delegate_compaction_to_runtime(force=False)
        self.delegated = [*getattr(self, "delegated", []), done]
        return done


def test_a_manual_compaction_gets_the_budget_the_pre_prompt_one_does(store: TranscriptStore, sid: str) -> None:
    """The engine's compact, and the built-in compaction it delegates to, work to the prompt's budget
    (the budget less the reply, the system prompt and the tools' schemas), as before a prompt; they got
    the whole token_budget, so a compaction asked for left more than assemble could then take."""
    estimator = RoughEstimator()
    system = "You are careful and brief. " * 80
    store.append_many(
        SCOPE, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 100}}
                     for i in range(19)]
    )
    engines: dict[str, _Recording] = {}
    host, _ = make_host(store, "rec", {"rec": lambda ctx: engines.setdefault("rec", _Recording(ctx, "rec"))},
                        token_budget=4000, max_output_tokens=500, system_prompt=system)
    carried = estimator.count_messages([{"role": "system", "content": system}]) + estimator.count_text(
        json.dumps([schema for schema, _ in host.host_tools.values()]))
    result = host.compact(SCOPE, sid, force=False)
    [(_name, kw)] = engines["rec"].calls
    assert kw["token_budget"] == 4000 - 500 - carried
    # ~2450 tokens of history: under 0.8 of 4000 - 500, over 0.8 of what the system prompt also leaves.
    assert result.compacted, result
    assert "compaction" in [e.kind for e in store.list_entries(SCOPE, sid)]


def test_a_pre_prompt_compaction_that_changes_the_session_is_followed(store: TranscriptStore, sid: str) -> None:
    """An owning engine's compact, run by the pre-prompt safeguard, may answer a session_target (the
    successor session): the next turn runs on it, as after a manual compaction (it was ignored, and the
    next turn went to the session the engine had ended). The turn in flight ends where it was admitted."""

    class Rotating(CountingEngine):
        rotated = False

        def assemble(self, **kw: Any) -> AssembleResult:
            window = super().assemble(**kw).messages[-2:]
            tokens = 100 if self.rotated else 5000
            return AssembleResult(messages=window, estimated_tokens=tokens, prompt_authority="preassembly_may_overflow")

        def compact(self, **kw: Any) -> CompactResult:
            self.calls.append(("compact", kw))
            store.end_session(SCOPE, kw["session_id"])
            new = store.create_session(SCOPE, session_id="sess-2", session_key="agent:main:test")
            self.rotated = True
            target = SessionTarget(scope=SCOPE, session_id=new.session_id, session_key=new.session_key)
            return CompactResult(ok=True, compacted=True, session_target=target)

    host, _ = make_host(
        store, "rot", {"rot": lambda ctx: Rotating(ctx, "rot", owns_compaction=True)}, token_budget=4000
    )
    first = host.run_turn(SCOPE, sid, "before", turn_id="t1")
    assert (first.session_id, first.commit_status) == (sid, "committed")
    assert store.read_visible(SCOPE, sid)[0].message == {"role": "user", "content": "before"}
    assert host.resolve_session(SCOPE, sid) == "sess-2"
    second = host.run_turn(SCOPE, sid, "after", turn_id="t2")
    assert (second.session_id, second.commit_status) == ("sess-2", "committed")
    assert store.read_visible(SCOPE, "sess-2")[0].message == {"role": "user", "content": "after"}


@pytest.mark.parametrize("keep_last", ["12", 2.5, True, 0, "many"])
def test_the_built_in_compactions_keep_last_is_validated_as_the_legacy_engine_does(
    store: TranscriptStore, sid: str, keep_last: Any
) -> None:
    """[engine.config.legacy] keep_last, which the built-in compaction reads for every engine that
    delegates to it, is refused with InvalidInput when the host is built, as the legacy engine refuses
    it (it was int()ed: "12" and 2.5 passed as 12 and 2, and "many" raised a bare ValueError inside an
    engine's compaction, which quarantined that engine)."""
    with pytest.raises(InvalidInput, match="legacy config: keep_last must be an integer of at least 1"):
        make_host(store, "counting", {"counting": lambda ctx: CountingEngine(ctx)},
                  engine_config={"legacy": {"keep_last": keep_last}})
    assert store.get_session(SCOPE, sid).entry_count == 0


@pytest.mark.parametrize(("config", "words"), [
    ({"keep_lst": 3}, "legacy config: unknown key 'keep_lst'"),
    ({"max_sessions": 2.5}, "legacy config: max_sessions must be an integer of at least 1, got 2.5"),
    ({"max_sessions": 0}, "legacy config: max_sessions must be an integer of at least 1, got 0"),
    ({"max_sessions": "x"}, "legacy config: max_sessions must be an integer of at least 1, got 'x'"),
    ({"max_sessions": True}, "legacy config: max_sessions must be an integer of at least 1, got True"),
])
def test_a_bad_legacy_config_is_refused_when_the_host_is_built(
    store: TranscriptStore, sid: str, config: dict[str, Any], words: str
) -> None:
    """The whole [engine.config.legacy], not only keep_last, is refused with InvalidInput when the host is
    built, with the legacy engine's own words: the legacy engine is every host's fallback and is never
    quarantined, and an unknown key or a bad max_sessions was found by its factory only, at the first turn,
    so a host built with it failed every turn."""
    from engines.legacy import LegacyEngine

    with pytest.raises(InvalidInput) as refused:
        make_host(store, engine_config={"legacy": config})
    assert words in str(refused.value)
    with pytest.raises(InvalidInput) as engine_refused:  # the same check, the same words
        LegacyEngine(EngineContext(store=store, config=config))
    assert str(engine_refused.value) == str(refused.value)
    assert store.get_session(SCOPE, sid).entry_count == 0 and store.read(lambda c: records(c)) == []


def test_a_degrading_attempt_never_moves_a_turn_a_retry_took_over(store: TranscriptStore, sid: str) -> None:
    """Host A runs turn t1 on an engine; a retry of t1 (another worker) takes the turn over, and then
    A's engine fails. A's turn-local degradation moved the intent to legacy under the retry, its next
    attempt took the retry's lease and committed on legacy, and the retry that ran on the engine learnt
    'duplicate'. The intent is the retry's now: A is SessionBusy, and the retry commits on its engine."""
    from engines.legacy import LegacyEngine

    retry = Turns(store)
    taken: list[str] = []

    class TakenOverThenFailing(LegacyEngine):
        info = LegacyEngine.info.model_copy(update={"id": "flaky", "name": "flaky"})

        def assemble(self, **kw: Any) -> Any:
            _admission, intent = retry.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id="flaky")
            assert intent.lease_owner is not None
            taken.append(intent.lease_owner)
            raise RuntimeError("the engine broke")

    host, model = make_host(store, engine="flaky", factories={"flaky": TakenOverThenFailing})
    with pytest.raises(SessionBusy) as caught:
        host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    assert caught.value.turn_id == "t1" and not model.requests
    intent = retry.intent(SCOPE, sid, "t1")
    assert intent is not None
    assert (intent.state, intent.engine_id, intent.lease_owner) == ("admitted", "flaky", taken[0])
    # The retry completes its turn for its engine (queued: this process quarantined the engine), and
    # nothing of it was committed on legacy.
    done = retry.complete(SCOPE, sid, "t1", [{"message": assistant("a1")}], None)
    assert done.intent.engine_id == "flaky" and done.intent.state in ("accepted", "ready")
    assert retry.receipts(SCOPE, sid) == []


@pytest.mark.parametrize("answer", [None, b"summary", 42, ["summary"]], ids=repr)
def test_legacy_compaction_refuses_a_summarizer_answer_that_is_no_text(
    store: TranscriptStore, sid: str, answer: Any
) -> None:
    """``str()`` of it was the summary ("None" in context in place of the older messages): now the
    summarizer failed, and nothing changes."""
    for i in range(8):
        store.append(SCOPE, sid, user(f"question {i} " + "words " * 40))
        store.append(SCOPE, sid, assistant(f"answer {i} " + "words " * 40))
    before = store.list_entries(SCOPE, sid)

    class Broken:
        def summarize(self, messages: Any, **kw: Any) -> Any:
            return answer

    done = compaction.compact_session(
        store, SCOPE, sid, summarizer=Broken(), estimator=RoughEstimator(), keep_last=2, force=True
    )
    assert not done.ok and not done.compacted and "not a string" in (done.reason or "")
    assert store.list_entries(SCOPE, sid) == before


def test_legacy_compaction_stores_a_summary_with_nul_or_a_lone_surrogate(store: TranscriptStore, sid: str) -> None:
    """A model's summary cut inside an emoji (a lone surrogate), or holding NUL: the marker's write was
    refused (``InvalidInput``) at every turn's compaction, so ``run_turn`` failed for good. Shown as
    U+FFFD instead."""
    for i in range(8):
        store.append(SCOPE, sid, user(f"question {i} " + "words " * 40))
        store.append(SCOPE, sid, assistant(f"answer {i} " + "words " * 40))

    class Cut:
        def summarize(self, messages: Any, **kw: Any) -> str:
            return "the user asked eight questions \ud83d and\x00 more"

    done = compaction.compact_session(
        store, SCOPE, sid, summarizer=Cut(), estimator=RoughEstimator(), keep_last=2, force=True
    )
    assert done.ok and done.compacted
    pointer = compaction.load_pointer(store, SCOPE, sid)
    assert pointer is not None and pointer["summary"] == "the user asked eight questions \ufffd and\ufffd more"


@pytest.mark.parametrize("engine_id", ["legacy", "lossless"])
def test_a_bundled_engine_refuses_a_token_budget_that_is_no_count(
    store: TranscriptStore, sid: str, engine_id: str
) -> None:
    """A library caller's budget of 0, a negative one, a bool, a float or a text: ``InvalidInput``. A
    negative one was taken for no budget (lossless compacted everything, its fresh tail included, and
    remembered it; legacy assembled nothing)."""
    host, _ = make_host(store, engine_id)
    host.run_turn(SCOPE, sid, "hello")
    engine, _info = host.engine(engine_id)
    for bad in (0, -5, True, 2.5, "100", 10**9):
        with pytest.raises(InvalidInput, match="token_budget"):
            engine.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=bad)
        with pytest.raises(InvalidInput, match="token_budget"):
            engine.compact(scope=SCOPE, session_id=sid, token_budget=bad)
    assert engine.assemble(scope=SCOPE, session_id=sid, fence=None, token_budget=1000).messages
    assert engine.compact(scope=SCOPE, session_id=sid, token_budget=None).ok
    host.dispose()
