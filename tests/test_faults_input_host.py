"""Fault campaign, part 4b: hostile input to every public method of ``HostRuntime`` and ``Service``.

Part 4 (test_faults_input.py) draws the arguments of ``TranscriptStore`` and ``Turns``; this file draws
those of the layers above them, with the same strategies: the host runtime (``run_turn``, ``compact``,
``spawn_subagent``, the engine and session look-ups) and the service (every operation the HTTP API and
the OpenClaw plugin call). Ids with NUL bytes, lone surrogates, control characters and SQL
metacharacters, huge strings, wrong types, negative and huge numbers, deep nesting, arbitrary JSON for
messages, ``runtime_context`` and request bodies, other scopes' sessions, unknown sessions and engines.
The contract, asserted on both backends after every call:

- a refusal is one of the library's typed errors (``TranscriptStoreError``; ``InvalidInput`` is also a
  ``ValueError``), never ``StoreUnavailable`` and never a raw ``TypeError``/``AttributeError``/
  ``KeyError``/``UnicodeEncodeError``/``ValueError``, driver, SQLAlchemy or pydantic error;
- a refused call leaves every row of every table exactly as it was, and a read never changes any. One
  documented exception: ``HostRuntime.engine`` / ``commit_in`` given a well-formed id of an engine that
  cannot load quarantine it, and the quarantine record is written (README: an engine id that is not
  installed is reported by ``doctor``); for those two only ``ts_quarantine`` may change;
- ``spawn_subagent`` raises the child's own exception as it is (README: "its own exception is the one
  raised"): a ``run_child`` that raises ``ChildFailed`` is let through (the child session was opened).

Service requests are drawn as the HTTP layer hands them over: arbitrary JSON bodies that pydantic
validates into the request model (a body it refuses is the HTTP layer's 422 and never reaches
``Service``; that raw body is passed instead, as a Python caller passing anything but the model would).

Drawn: 27 methods (``calls`` below; a test keeps that list and ``NOT_DRAWN`` complete). Not drawn:
``HostRuntime.flush_quarantines``, ``HostRuntime.dispose``, ``Service.engines``, ``Service.limits`` and
``Service.close`` (no arguments; ``close`` also closes the store).

The default tier draws ``FAULT_INPUT_HOST_EXAMPLES`` (10) examples per method and backend; the slow tier
(``make test-slow``) runs the same campaign with 150.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from types import FunctionType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from test_faults_input import (
    A,
    B,
    anchors,
    append_items,
    build_world,
    cursors,
    deep,
    ids,
    ints,
    json_values,
    limits,
    messages,
    optional_ids,
    payloads,
    texts,
    wrong,
)
from workers.fault_worker import report, table_rows

from transcript_store import InvalidInput, StoreUnavailable, TranscriptStore, TranscriptStoreError
from transcript_store.engine import SessionTarget
from transcript_store.errors import UnknownEngine
from transcript_store.host import HostRuntime
from transcript_store.model import LocalResponder
from transcript_store.registry import EngineRegistry
from transcript_store.service import Service
from transcript_store.service_models import (
    AdmitRequest,
    AppendRequest,
    AssembleRequest,
    BootstrapRequest,
    CommitTurnRequest,
    CompactRequest,
    DeltaRequest,
    HostCompactionRequest,
    OpenSession,
)
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

# 10 in make test (CI time: 25 took 15-20 s a backend); the slow tier's 150 is the campaign's figure.
EXAMPLES = int(os.environ.get("FAULT_INPUT_HOST_EXAMPLES", "10"))
#: per method and backend in the slow tier
SLOW_EXAMPLES = 150
ENGINE_IDS = ["legacy", "lossless"]


class ChildFailed(Exception):
    """A subagent child's own failure: ``spawn_subagent`` raises it as it is (documented)."""


# ---------------------------------------------------------------------------------------------- world


def make_host(store: TranscriptStore, engine: str = "legacy") -> HostRuntime:
    """A host runtime on ``engine`` with the deterministic local model."""
    return HostRuntime(
        store, load_settings(config_path=None, engine=engine), LocalResponder(), registry=EngineRegistry(),
        summarizer=ExtractiveSummarizer(), estimator=RoughEstimator(),
    )


def build_host_world(store: TranscriptStore) -> tuple[HostRuntime, Service, dict[str, Any]]:
    """test_faults_input's world (its running turns discarded), a host turn in each scope, a session of
    scope A mirrored and committed through the service's lossless engine, and a host on the lossless
    engine (``w["hosts"]``, with the legacy one) for the calls that run an engine."""
    turns = Turns(store)
    w = build_world(store, turns)
    for scope in (A, B):
        turns.discard(scope, "s1", "T3")
    host = make_host(store)
    service = Service(store, load_settings(config_path=None, engine="legacy"))
    lossless = make_host(store, "lossless")
    for scope in (A, B):
        host.run_turn(scope, "s1", "hello host", turn_id="H1")
        lossless.run_turn(scope, "s1", "hello lossless", turn_id="H2")
    lossless.maintenance.wait(10)
    service.open_session(A, OpenSession(session_id="m1", session_key="mk1"))
    commit = {
        "advancement_key": "K1",
        "admission": {"entry_id": "M1.u", "position": 0},
        "terminal": {"entry_id": "M1.a", "position": 1},
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    }
    service.commit_turn(A, "lossless", "m1", CommitTurnRequest.model_validate(commit))
    w["commit"] = commit
    w["hosts"] = [host, lossless]
    return host, service, w


# ---------------------------------------------------------------------------------------------- strategies

# Most draws name a real scope, session and engine, so that the hostile part of the call (another
# argument, the body) is reached; the rest are any id at all.
engine_ids = st.one_of(st.sampled_from(ENGINE_IDS), st.sampled_from(ENGINE_IDS), ids)
scopes = st.one_of(st.sampled_from([A, A, A, B]), st.sampled_from([A, B, "nowhere"]), ids)
sessions = st.one_of(st.sampled_from(["s1", "s2", "m1"]), st.sampled_from(["s1", "m1", "nowhere", "only-b"]), ids)
bools = st.one_of(st.booleans(), st.booleans(), wrong)
plain_messages = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": texts})
host_messages = st.one_of(texts, st.fixed_dictionaries({"role": st.just("user"), "content": texts}), messages)
plain_items = st.lists(st.fixed_dictionaries({"message": plain_messages},
                                             optional={"entry_id": ids, "idempotency_key": optional_ids}),
                       min_size=1, max_size=3)


def bodies(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """A request body of all or some of ``fields``, an extra field, or any JSON at all."""
    return st.one_of(
        st.fixed_dictionaries(fields),
        st.fixed_dictionaries({}, optional=fields),
        st.fixed_dictionaries({}, optional={**fields, "unknown": payloads}),
        payloads,
    )


def requests(model: type[BaseModel], body: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``body`` validated into ``model`` as the HTTP layer does; a body pydantic refuses is passed raw."""

    def validated(value: Any) -> Any:
        try:
            return model.model_validate(value)
        except (ValidationError, RecursionError):
            return value

    return st.one_of(body.map(validated), wrong)


def anchor_json(w: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Anchors as a request body carries them (JSON), forged ones included."""
    def dumped(a: Any) -> Any:
        return a.model_dump(mode="json", warnings=False) if isinstance(a, BaseModel) else a

    return st.one_of(anchors(w).map(dumped), json_values)


def entry_refs() -> st.SearchStrategy[Any]:
    """An entry reference of a commit: an id and a position, hostile either."""
    return st.one_of(st.fixed_dictionaries({"entry_id": ids}, optional={"position": st.one_of(st.none(), ints)}),
                     payloads)


def commit_requests(w: dict[str, Any]) -> st.SearchStrategy[Any]:
    """The world's committed turn (a replay), with one field changed, or arbitrary bodies."""
    real = w["commit"]
    edits = {
        "advancement_key": ids, "admission": entry_refs(), "terminal": entry_refs(),
        "messages": st.one_of(st.lists(messages, max_size=3), payloads), "is_heartbeat": bools,
        "session_target": st.one_of(st.none(), st.fixed_dictionaries({"session_id": ids}), payloads),
    }
    edited = st.sampled_from(sorted(edits)).flatmap(lambda k: edits[k].map(lambda v: {**real, k: v}))
    return requests(CommitTurnRequest, st.one_of(st.just(real), edited, bodies(edits)))


def targets() -> st.SearchStrategy[Any]:
    """Successor session targets: real ones (own scope, other scope), forged ones, wrong types."""
    real = st.builds(SessionTarget, scope=st.sampled_from([A, B]), session_id=st.sampled_from(["s1", "s2", "x"]))
    forged = st.builds(lambda s, sid: SessionTarget.model_construct(scope=s, session_id=sid), ids, ids)
    return st.one_of(st.none(), real, forged, payloads)


def children() -> st.SearchStrategy[Any]:
    """A subagent child: one that returns, one that fails on its own, and things that cannot run."""
    def fails(_sid: str) -> Any:
        raise ChildFailed("the child failed")

    return st.one_of(st.sampled_from([lambda sid: sid, fails]), st.just(lambda sid: sid), wrong)


def calls(host: HostRuntime, service: Service, w: dict[str, Any]) -> dict[str, Callable[[st.DataObject], Any]]:
    """Per public method: draw its arguments, return the call."""
    def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
        return lambda: fn(*args, **kwargs)

    numbers = st.one_of(st.none(), ints, st.floats(), wrong)
    hosts = st.sampled_from(w.get("hosts", [host]))
    return {
        # HostRuntime
        "HostRuntime.engine": lambda d: call(host.engine, d.draw(engine_ids)),
        "HostRuntime.quarantine": lambda d: call(
            host.quarantine, d.draw(engine_ids.filter(lambda e: e not in ENGINE_IDS)), d.draw(ids),
            d.draw(st.one_of(st.builds(RuntimeError, texts), payloads)), in_transaction=d.draw(bools)),
        "HostRuntime.commit_in": lambda d: call(host.commit_in, d.draw(engine_ids)),
        "HostRuntime.preload": lambda d: call(host.preload, d.draw(engine_ids)),
        "HostRuntime.resolve_session": lambda d: call(host.resolve_session, d.draw(scopes), d.draw(sessions)),
        "HostRuntime.follow": lambda d: call(host.follow, d.draw(scopes), d.draw(sessions), d.draw(targets())),
        "HostRuntime.decide": lambda d: call(host.decide, d.draw(scopes), d.draw(sessions), d.draw(ids)),
        "HostRuntime.run_turn": lambda d: call(
            d.draw(hosts).run_turn, d.draw(scopes), d.draw(sessions), d.draw(host_messages),
            turn_id=d.draw(optional_ids), runtime_context=d.draw(st.one_of(st.none(), payloads, deep))),
        "HostRuntime.prompt_budget": lambda d: call(host.prompt_budget, d.draw(st.one_of(ints, wrong))),
        "HostRuntime.compact": lambda d: call(d.draw(hosts).compact, d.draw(scopes), d.draw(sessions),
                                              focus=d.draw(st.one_of(st.none(), texts, wrong)), force=d.draw(bools)),
        "HostRuntime.spawn_subagent": lambda d: call(
            d.draw(hosts).spawn_subagent, d.draw(scopes), d.draw(sessions), d.draw(ids), d.draw(children()),
            context_mode=d.draw(st.one_of(st.sampled_from(["isolated", "fork"]), ids)), ttl_seconds=d.draw(numbers)),
        # Service
        "Service.open_session": lambda d: call(service.open_session, d.draw(scopes), d.draw(requests(
            OpenSession, bodies({"session_id": optional_ids, "session_key": optional_ids, "rebind_key": bools})))),
        "Service.get_session": lambda d: call(service.get_session, d.draw(scopes), d.draw(sessions)),
        "Service.list_sessions": lambda d: call(service.list_sessions, d.draw(scopes), d.draw(optional_ids),
                                                d.draw(optional_ids), d.draw(limits)),
        "Service.delta": lambda d: call(service.delta, d.draw(scopes), d.draw(sessions), d.draw(requests(
            DeltaRequest, bodies({"cursor": st.one_of(st.none(), cursors(w)), "max_messages": limits,
                                  "max_bytes": limits, "fence": st.one_of(st.none(), anchor_json(w))})))),
        "Service.append": lambda d: call(service.append, d.draw(scopes), d.draw(sessions), d.draw(requests(
            AppendRequest, bodies({"items": st.one_of(plain_items, append_items(w))})))),
        "Service.admit": lambda d: call(service.admit, d.draw(scopes), d.draw(sessions), d.draw(requests(
            AdmitRequest, bodies({"message": st.one_of(plain_messages, messages), "turn_id": ids,
                                  "entry_id": optional_ids})))),
        "Service.engine": lambda d: call(service.engine, d.draw(engine_ids)),
        "Service.describe": lambda d: call(service.describe, d.draw(engine_ids)),
        "Service.bootstrap_state": lambda d: call(service.bootstrap_state, d.draw(scopes), d.draw(engine_ids),
                                                  d.draw(sessions)),
        "Service.bootstrap": lambda d: call(service.bootstrap, d.draw(scopes), d.draw(engine_ids), d.draw(sessions),
                                            d.draw(requests(BootstrapRequest, bodies({
                                                "page": st.one_of(st.none(), bodies({
                                                    "cursor": st.one_of(st.none(), texts),
                                                    "next_cursor": st.one_of(st.none(), texts),
                                                    "entries": st.lists(bodies({"entry_id": ids, "message": messages}),
                                                                        max_size=3)})),
                                                "done": bools})))),
        "Service.assemble": lambda d: call(service.assemble, d.draw(scopes), d.draw(engine_ids), d.draw(sessions),
                                           d.draw(requests(AssembleRequest, bodies({
                                               "token_budget": limits, "fence": st.one_of(st.none(), anchor_json(w)),
                                               "available_tools": st.lists(texts, max_size=3),
                                               "prompt": st.one_of(st.none(), texts, messages)})))),
        "Service.compact": lambda d: call(service.compact, d.draw(scopes), d.draw(engine_ids), d.draw(sessions),
                                          d.draw(requests(CompactRequest, bodies({
                                              "force": bools, "focus": st.one_of(st.none(), texts),
                                              "token_budget": limits})))),
        "Service.host_compaction": lambda d: call(
            service.host_compaction, d.draw(scopes), d.draw(engine_ids), d.draw(sessions),
            d.draw(requests(HostCompactionRequest, bodies({
                "summary": texts, "first_kept_position": limits, "first_kept_entry_id": ids})))),
        "Service.maintain": lambda d: call(service.maintain, d.draw(scopes), d.draw(engine_ids), d.draw(sessions)),
        "Service.commit_turn": lambda d: call(service.commit_turn, d.draw(scopes), d.draw(engine_ids),
                                              d.draw(sessions), d.draw(commit_requests(w))),
        "Service.receipts": lambda d: call(service.receipts, d.draw(scopes), d.draw(engine_ids), d.draw(sessions),
                                           d.draw(st.one_of(st.none(), texts)), d.draw(limits)),
    }


#: methods that only read: they must not change a row even when they succeed
READS = {
    "HostRuntime.resolve_session", "HostRuntime.follow", "HostRuntime.prompt_budget", "HostRuntime.decide",
    "Service.get_session", "Service.list_sessions", "Service.delta", "Service.engine", "Service.describe",
    "Service.bootstrap_state", "Service.receipts",
}
#: methods whose refusal of an engine that cannot load writes its quarantine record (module docstring)
QUARANTINES = {"HostRuntime.engine", "HostRuntime.commit_in"}
#: public methods deliberately not drawn, with the reason
NOT_DRAWN = {
    "HostRuntime.flush_quarantines": "no arguments",
    "HostRuntime.dispose": "no arguments",
    "Service.engines": "no arguments",
    "Service.limits": "no arguments",
    "Service.close": "no arguments; it closes the store the campaign runs on",
}


def hostile_host_input_campaign(
    request: pytest.FixtureRequest, store: TranscriptStore, backend: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, examples: int,
) -> None:
    """Draw ``examples`` argument sets for every method of ``calls`` and check the contract after each call."""
    started = time.monotonic()
    monkeypatch.chdir(tmp_path)
    host, service, world = build_host_world(store)
    names = sorted(table_rows(store))
    state = {"rows": table_rows(store, names=names)}
    figures: dict[str, dict[str, int]] = {}

    def check(name: str, thunk: Callable[[], Any]) -> None:
        counts = figures.setdefault(name, {"calls": 0, "refused": 0})
        counts["calls"] += 1
        before = state["rows"]
        refused: BaseException | None = None
        try:
            thunk()
        except TranscriptStoreError as e:
            assert not isinstance(e, StoreUnavailable), f"{name}: the input was blamed on the database: {e!r}"
            refused = e
        except ChildFailed:
            assert name == "HostRuntime.spawn_subagent", name
        for h in world["hosts"]:
            assert h.maintenance.wait(10), "background maintenance did not settle"
        after = table_rows(store, names=names)
        if refused is not None or name in READS:
            changed = {t for t in names if after[t] != before[t]}
            if name in QUARANTINES and refused is not None:
                changed -= {"ts_quarantine"}
            assert not changed, f"{name} {'refused with ' + repr(refused) if refused else 'read'} but wrote {changed}"
        counts["refused"] += refused is not None
        state["rows"] = after

    def hypothesis_test(name: str, draw: Callable[[st.DataObject], Any]) -> Callable[[], None]:
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            check(name, draw(data))

        return run

    try:
        for name, draw in calls(host, service, world).items():
            hypothesis_test(name, draw)()
    finally:
        for h in (*world["hosts"], service.runtime):
            h.dispose()
    total = sum(c["calls"] for c in figures.values())
    refused = sum(c["refused"] for c in figures.values())
    report(request, backend, {
        "functions": len(figures), "examples_per_function": examples, "calls": total, "refusals": refused,
        "accepted": total - refused, "untyped_errors": 0, "writes_by_refused_calls": 0,
        "seconds": round(time.monotonic() - started, 1),
    })
    assert all(c["calls"] >= examples for c in figures.values()), figures


def test_hostile_input_to_host_and_service_is_refused_with_typed_errors_and_writes_nothing(
    request: pytest.FixtureRequest, store: TranscriptStore, backend: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hostile_host_input_campaign(request, store, backend, tmp_path, monkeypatch, EXAMPLES)


@pytest.mark.slow
def test_hostile_input_to_host_and_service_150_examples_per_method(
    request: pytest.FixtureRequest, store: TranscriptStore, backend: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hostile_host_input_campaign(request, store, backend, tmp_path, monkeypatch, SLOW_EXAMPLES)


def public_methods() -> set[str]:
    """Every public method of ``HostRuntime`` and ``Service`` (not properties, not dataclass fields)."""
    return {f"{cls.__name__}.{name}" for cls in (HostRuntime, Service) for name, value in vars(cls).items()
            if not name.startswith("_") and isinstance(value, FunctionType | classmethod | staticmethod)}


@pytest.mark.parametrize("backend", ["sqlite"])  # names only: one backend says it
def test_every_public_method_of_host_and_service_is_drawn_or_listed_as_not(store: TranscriptStore) -> None:
    host, service = make_host(store), Service(store, load_settings(config_path=None, engine="legacy"))
    drawn = set(calls(host, service, {}))  # the draws are lazy: no world needed for the names
    assert len(drawn) == 27, sorted(drawn)  # the module docstring's count
    assert not drawn & set(NOT_DRAWN) and drawn | set(NOT_DRAWN) == public_methods(), \
        sorted(public_methods() ^ (drawn | set(NOT_DRAWN)))
    host.dispose()
    service.runtime.dispose()



def test_the_bugs_this_campaign_found_stay_fixed(store: TranscriptStore, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of these escaped as a raw Python or driver error, as StoreUnavailable, or wrote before refusing."""
    monkeypatch.chdir(tmp_path)
    host, service, w = build_host_world(store)
    lossless: HostRuntime = w["hosts"][1]
    # A session long enough for the lossless engine's compaction to reach its summarizer.
    store.create_session(A, session_id="long")
    store.append_many(A, "long", [{"message": {"role": role, "content": f"{role} {i} " + "words " * 30}}
                                  for i in range(40) for role in ("user", "assistant")])
    no_request: Any = {"session_id": "s9"}  # a body, not the request model the HTTP layer validates it into
    cases: list[tuple[Callable[[], Any], type[Exception]]] = [
        (lambda: host.engine(["legacy"]), UnknownEngine),  # type: ignore[arg-type]  # TypeError: unhashable
        # UnicodeEncodeError writing its quarantine record; on PostgreSQL a NUL one was retried and logged
        (lambda: host.engine("e\ud800"), UnknownEngine),
        (lambda: host.engine("e\x00"), UnknownEngine),
        (lambda: host.quarantine({"id": 1}, "op", RuntimeError("x")), InvalidInput),  # type: ignore[arg-type]
        (lambda: host.quarantine("e\ud800", "op", RuntimeError("x")), InvalidInput),
        (lambda: host.quarantine("e1", "o" * 65, RuntimeError("x")), InvalidInput),  # PostgreSQL: over its column
        (lambda: host.resolve_session(A, ["s1"]), InvalidInput),  # type: ignore[arg-type]
        (lambda: host.compact(A, {"s": 1}), InvalidInput),  # type: ignore[arg-type]
        (lambda: host.follow(A, "s1", 1.5), InvalidInput),  # type: ignore[arg-type]  # AttributeError
        (lambda: host.follow(A, "s1", SessionTarget.model_construct(scope=A, session_id="s\x00")), InvalidInput),
        (lambda: host.decide(A, "s1", {"t": 1}), InvalidInput),  # type: ignore[arg-type]
        (lambda: host.prompt_budget("10"), InvalidInput),  # type: ignore[arg-type]  # TypeError
        (lambda: host.prompt_budget(-10**6), InvalidInput),  # a budget larger than the token budget
        # legacy: AttributeError in the summarizer; lossless: compacted with a list for its focus
        (lambda: host.compact(A, "long", focus={"f": 1}), InvalidInput),  # type: ignore[arg-type]
        (lambda: lossless.compact(A, "long", focus=["f"]), InvalidInput),  # type: ignore[arg-type]
        # UnicodeEncodeError from the lossless engine, which was quarantined for it (and its record written)
        (lambda: lossless.compact(A, "long", focus="x\ud800", force=True), InvalidInput),
        (lambda: host.spawn_subagent(A, "s1", "child", 42), InvalidInput),  # type: ignore[arg-type]  # opened it
        (lambda: service.open_session(A, no_request), InvalidInput),  # AttributeError
        (lambda: service.delta(A, "s1", no_request), InvalidInput),
        (lambda: service.append(A, "s1", no_request), InvalidInput),  # dict.items, a method, reached the store
        (lambda: service.admit(A, "s1", no_request), InvalidInput),
        (lambda: service.bootstrap(A, "lossless", "m1", no_request), InvalidInput),
        (lambda: service.assemble(A, "lossless", "m1", no_request), InvalidInput),
        (lambda: service.compact(A, "lossless", "s1", 5), InvalidInput),  # type: ignore[arg-type]  # bootstrapped first
        (lambda: service.commit_turn(A, "lossless", "m1", no_request), InvalidInput),
        (lambda: service.bootstrap_state("a\ud800", "lossless", "m1"), InvalidInput),  # UnicodeEncodeError
        (lambda: service.receipts("a\x00", "lossless", "m1"), InvalidInput),  # PostgreSQL: StoreUnavailable
        (lambda: service.receipts("a\udc00", "lossless", "m1"), InvalidInput),
    ]
    names = sorted(table_rows(store))
    before = table_rows(store, names=names)
    try:
        for i, (call, error) in enumerate(cases):
            with pytest.raises(error) as info:
                call()
            assert not isinstance(info.value, StoreUnavailable), (i, info.value)
            for h in w["hosts"]:
                assert h.maintenance.wait(10)
            assert table_rows(store, names=names) == before, f"case {i} wrote something"
        assert not host.quarantined and not lossless.quarantined and host.flush_quarantines()
        assert lossless.compact(A, "long", focus="words", force=True).ok  # the engine still runs
    finally:
        for h in (*w["hosts"], service.runtime):
            h.dispose()
