"""Fault campaign, part 4: hostile input to every public function of ``TranscriptStore`` and ``Turns``.

Hypothesis draws the arguments: arbitrary JSON, huge strings, NUL bytes, lone surrogates, deep nesting,
negative and huge limits, forged / truncated / other-scope cursors and anchors, ids with SQL
metacharacters, wrong types. The contract, asserted on both backends after every call:

- a refusal is one of the library's typed errors (``TranscriptStoreError``; ``InvalidInput`` is also a
  ``ValueError``), never ``StoreUnavailable`` (the input, not the database, is at fault) and never a
  raw driver, SQLAlchemy or pydantic error, nor a plain ``ValueError`` (an out-of-range limit, ``limit``,
  ``after_seq``, ``max_messages`` or ``max_bytes``, is ``InvalidInput`` naming that argument);
- a refused call leaves every row of every table exactly as it was, and a read never changes any.

Drawn: 42 functions, the ``TranscriptStore`` constructor (URL, ``config`` and ``create``) and 25 of its
methods, and the ``Turns`` constructor (store and config; the ``Turns`` it built is then used) and 15 of
its methods (``calls`` below; a test keeps that list and this one complete). Not drawn:
``write``/``read``/``statement`` (they run the caller's own code, in a transaction or as one statement
outside any), ``close``, ``upgrade``, ``current_revision`` and ``ensure_current`` (no arguments), and
URLs of reachable servers.

The default tier draws ``FAULT_INPUT_EXAMPLES`` (14) examples per function and backend; the slow tier
(``make test-slow``) runs the same campaign with 150.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import FunctionType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workers.fault_worker import report, table_rows
from workers.turn_worker import count_turn, counting_engine

from transcript_store import (
    AppendItem,
    InvalidInput,
    Replacement,
    StoreConfig,
    StoreUnavailable,
    TranscriptStore,
    TranscriptStoreError,
)
from transcript_store.cursors import CursorState
from transcript_store.models import Anchor
from transcript_store.outbox import AdmittedLease, OutboxConfig, intent_cursor
from transcript_store.turns import Turns

A, B = "scope-a", "scope-b"
ENGINE = "counter"
# Per function and backend: keeps this file well under a minute for both backends. Raise it to hunt.
EXAMPLES = int(os.environ.get("FAULT_INPUT_EXAMPLES", "14"))
#: per function and backend in the slow tier: the figure the README's campaign table reports
SLOW_EXAMPLES = 150

# ---------------------------------------------------------------------------------------------- strategies

NASTY = [
    "", " ", "\x00", "s1\x00", "\ud800", "s1\udfff", "\x7f", "\x85", "\u2028", "'", "\"", "s1'--",
    "'; DROP TABLE ts_sessions; --", "\" OR 1=1 --", "%", "_", "\\", "s1%", "é" * 255, "x" * 256,
    "\U0010ffff" * 255, "a" * 100_000, "NULL", "null", "0", "-1",
]
VALID = ["s1", "s2", "E0", "E1", "T1", "T1.r0", "T3", "k1", A, B, "only-b", ENGINE]
WRONG = [None, 0, -1, 1.5, True, b"s1", ["s1"], {"id": "s1"}, ("s1",), float("nan")]
ALPHABET = ["\x00", "\ud800", "\udc00", "'", "\"", ";", "-", "%", "_", "\\", "é", "\U0001f600", "a", "\x85", "1"]

texts = st.one_of(st.sampled_from(NASTY), st.text(max_size=30), st.text(st.sampled_from(ALPHABET), max_size=12))
wrong = st.sampled_from(WRONG)
ids = st.one_of(st.sampled_from(VALID), texts, wrong)
hostile_ids = st.one_of(texts, wrong)  # never an existing id: for calls that would destroy the fixture
optional_ids = st.one_of(st.none(), ids)
ints = st.one_of(st.integers(), st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63, 10**30, -(10**30)]))
limits = st.one_of(ints, st.sampled_from([1, 20, 10_000, 10_001, True, False, "10", 1.5, None]))


def weighted(valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any], one_in: int) -> st.SearchStrategy[Any]:
    """``hostile`` one draw in ``one_in``, else ``valid``: a call with one hostile argument gets past the
    others. (``one_of(valid, valid, hostile)`` does not weigh: hypothesis picks among distinct strategies.)"""
    return st.integers(0, one_in - 1).flatmap(lambda i: hostile if i == 0 else valid)


def nested(depth: int) -> Any:
    """JSON nested ``depth`` levels deep (objects and arrays in turn)."""
    value: Any = "bottom"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Arrays and objects of ``inner`` (object keys of any text, and integers: not JSON)."""
    return st.lists(inner, max_size=4) | st.dictionaries(st.one_of(texts, st.integers()), inner, max_size=4)


json_values = st.recursive(st.one_of(st.none(), st.booleans(), ints, st.floats(), texts), containers, max_leaves=12)
deep = st.integers(min_value=60, max_value=400).map(nested)
payloads = st.one_of(json_values, deep, wrong)
roles = st.sampled_from(["user", "assistant", "tool", "system", "developer", "function", "robot", "", None, 1])
contents = st.one_of(texts, st.just("c" * 5_000_000), json_values, deep)
messages = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": texts}),
    st.fixed_dictionaries({"role": roles, "content": contents}, optional={"tool_calls": json_values,
                                                                         "tool_call_id": ids, "x": payloads}),
    payloads,
)
kinds = st.one_of(st.sampled_from(["message", "custom", "metadata", "compaction"]), ids)


def cursors(w: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Real cursors (own, other session, other scope), truncated, corrupted, forged, garbage, wrong types."""
    own: str = w["cursor"]
    forged = st.builds(
        lambda scope, sid, gen, seq, pos, inc: CursorState(scope, sid, gen, seq, pos, inc).encode(),
        st.sampled_from([A, B, "x"]), st.sampled_from(["s1", "only-b", "nowhere"]), ints, ints, ints,
        st.one_of(st.just(w["incarnation"]), st.integers(min_value=0, max_value=2**63 - 1)),
    )
    return st.one_of(
        st.sampled_from([own, w["b_cursor"], w["other_session_cursor"]]),
        st.integers(0, len(own) - 1).map(lambda n: own[:n]),  # truncated
        st.integers(0, len(own) - 1).map(lambda n: own[:n] + ("A" if own[n] != "A" else "B") + own[n + 1 :]),
        forged,
        json_values.map(lambda v: "tsc2." + base64.urlsafe_b64encode(json.dumps(v).encode()).decode().rstrip("=")),
        texts, wrong,
    )


def anchors(w: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Real anchors (both scopes), anchors with one field forged, dumps of anchors, wrong types."""
    real = st.sampled_from([w["admission"].anchor, w["terminal"], w["fence"], w["b_terminal"], w["b_admission"].anchor])
    fields = st.sampled_from(list(Anchor.model_fields))
    mutated = st.builds(lambda a, f, v: a.model_copy(update={f: v}), real, fields, st.one_of(ids, ints))
    return st.one_of(real, mutated, real.map(lambda a: a.model_dump()), st.sampled_from([w["admission"]]), wrong)


def append_items(w: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Lists of append items with hostile fields, and things that are not lists of items."""
    item = st.one_of(
        st.fixed_dictionaries({"message": messages}, optional={"entry_id": optional_ids, "kind": kinds,
                                                              "payload": payloads, "idempotency_key": optional_ids,
                                                              "extra": payloads}),
        st.builds(lambda m: AppendItem(message=m), st.just({"role": "assistant", "content": "ok"})),
        payloads,
    )
    return st.one_of(st.lists(item, max_size=4), payloads, st.just([]))


def records(w: dict[str, Any]) -> st.SearchStrategy[tuple[Any, Any]]:
    """An export (header, entries) with one field changed, or arbitrary JSON, or the export as it is."""
    header, entries = w["export"]
    field_edit = st.tuples(st.sampled_from(sorted(header)), st.one_of(ids, ints, payloads))
    entry_edit = st.tuples(st.sampled_from(sorted(entries[0])), st.one_of(ids, ints, payloads))
    return st.one_of(
        st.builds(lambda e: ({**header, e[0]: e[1]}, entries), field_edit),
        st.builds(lambda i, e: (header, [*entries[:i], {**entries[i], e[0]: e[1]}, *entries[i + 1 :]]),
                  st.integers(0, len(entries) - 1), entry_edit),
        st.tuples(payloads, st.one_of(payloads, st.lists(payloads, max_size=3))),
        st.just((header, entries)),
    )


# ---------------------------------------------------------------------------------------------- world


def build_world(store: TranscriptStore, turns: Turns) -> dict[str, Any]:
    """Real sessions, turns, cursors and anchors in two scopes, for the draws to start from."""
    w: dict[str, Any] = {}
    for scope, prefix in ((A, ""), (B, "b_")):
        store.create_session(scope, session_id="s1", session_key="k1")
        store.append(scope, "s1", {"role": "user", "content": "hello"}, entry_id="E0", idempotency_key="i0")
        fence = store.append(scope, "s1", {"role": "assistant", "content": "hi"}, entry_id="E1")
        admission, _ = turns.admit(scope, "s1", {"role": "user", "content": "q1"}, turn_id="T1", engine_id=ENGINE)
        done = turns.complete(scope, "s1", "T1", [{"message": {"role": "assistant", "content": "a1"},
                                                   "entry_id": "T1.r0"}], counting_engine)
        turns.admit(scope, "s1", {"role": "user", "content": "q3"}, turn_id="T3", engine_id=ENGINE)
        page = store.read_visible_delta(scope, "s1", max_messages=2)
        w.update({f"{prefix}admission": admission, f"{prefix}terminal": done.terminal,
                  f"{prefix}fence": store.anchor(scope, "s1", fence.entry_id), f"{prefix}cursor": page.cursor})  # type: ignore[union-attr]
    store.create_session(A, session_id="s2")
    store.append(A, "s2", {"role": "user", "content": "other"}, entry_id="E0")
    w["other_session_cursor"] = store.read_visible_delta(A, "s2").cursor  # type: ignore[union-attr]
    w["messages"] = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    w["incarnation"] = store.get_session(A, "s1").incarnation
    w["export"] = store.export_session(A, "s1")
    w["intent_cursor"], w["b_intent_cursor"] = (intent_cursor(turns.intents(scope)[0], scope) for scope in (A, B))
    w["all_intent_cursor"] = intent_cursor(turns.intents(None)[0], None)
    return w


def engines(w: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Engine lookups for drain and recovery: working, missing, failing, broken, not callable."""
    def failing(_c: Any, _t: Any) -> Any:
        raise RuntimeError("engine failed")

    lookups = st.sampled_from([lambda _e: counting_engine, lambda _e: None, lambda _e: failing, lambda _e: 42])
    return st.one_of(lookups, wrong)


def use_turns(turns: Turns) -> None:
    """Run what a ``Turns`` reads of its store and config (a list of intents, a drain of an empty scope)."""
    turns.intents(A, 1)
    turns.drain(lambda _e: None, scope="nowhere")


def calls(store: TranscriptStore, turns: Turns, w: dict[str, Any]) -> dict[str, Callable[[st.DataObject], Any]]:
    """Per public function: draw its arguments, return the call."""
    def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
        return lambda: fn(*args, **kwargs)

    commit_ins = st.one_of(st.none(), st.just(counting_engine), wrong)
    configs = st.sampled_from([StoreConfig(url="sqlite:///drawn.db"), OutboxConfig(), StoreConfig])
    urls = st.sampled_from(["", "not a url", "mysql://u@h/d", "sqlite://", "sqlite:///:memory:", "://", "\x00",
                            "sqlite:///a\x00b", "sqlite:///\ud800", "oracle+x://", 5, 1.5, b"sqlite://", ["x"]])
    return {
        # the URL, a config (the store's own, one of its own, or anything) and ``create``, alone or together
        "TranscriptStore": lambda data: call(
            TranscriptStore, data.draw(st.one_of(urls, st.none())),
            config=data.draw(st.one_of(st.none(), st.just(store.config), configs, payloads)),
            create=data.draw(st.one_of(st.booleans(), wrong))),
        # a Turns that was built is then used: a config it took unchecked failed in its methods instead
        "Turns": lambda data: (lambda made: lambda: use_turns(made()))(call(
            Turns, data.draw(weighted(st.just(store), st.one_of(wrong, payloads, st.just(store.config)), 3)),
            data.draw(st.one_of(st.none(), st.just(OutboxConfig(turn_lease_seconds=1.0)), wrong, payloads)))),
        "upgrade_url": lambda data: call(TranscriptStore.upgrade_url, data.draw(urls)),
        "create_session": lambda data: call(store.create_session, data.draw(ids), session_id=data.draw(optional_ids),
                                            session_key=data.draw(optional_ids)),
        "open_session": lambda data: call(store.open_session, data.draw(ids), data.draw(ids)),
        "get_session": lambda data: call(store.get_session, data.draw(ids), data.draw(ids)),
        "find_session": lambda data: call(store.find_session, data.draw(ids), data.draw(ids)),
        "list_sessions": lambda data: call(store.list_sessions, data.draw(ids), after=data.draw(optional_ids),
                                           limit=data.draw(limits)),
        "ended_sessions": lambda data: call(store.ended_sessions, data.draw(ids), data.draw(ids),
                                            limit=data.draw(limits)),
        "session_bytes": lambda data: call(store.session_bytes, data.draw(ids), data.draw(ids)),
        "end_session": lambda data: call(store.end_session, data.draw(ids), data.draw(hostile_ids)),
        "delete_session": lambda data: call(store.delete_session, data.draw(ids), data.draw(hostile_ids)),
        "append": lambda data: call(store.append, data.draw(ids), data.draw(ids), data.draw(messages),
                                    kind=data.draw(kinds), payload=data.draw(st.one_of(st.none(), payloads)),
                                    entry_id=data.draw(optional_ids), idempotency_key=data.draw(optional_ids)),
        "append_many": lambda data: call(store.append_many, data.draw(ids), data.draw(ids), data.draw(append_items(w))),
        "prepare": lambda data: call(store.prepare, data.draw(append_items(w))),
        "admit": lambda data: call(store.admit, data.draw(ids), data.draw(ids), data.draw(messages),
                                   turn_id=data.draw(ids), entry_id=data.draw(optional_ids)),
        "prepare_admission": lambda data: call(store.prepare_admission, data.draw(messages), turn_id=data.draw(ids),
                                               entry_id=data.draw(optional_ids)),
        "anchor": lambda data: call(store.anchor, data.draw(ids), data.draw(ids), data.draw(ids)),
        "read_visible_delta": lambda data: call(
            store.read_visible_delta, data.draw(ids), data.draw(ids), data.draw(st.one_of(st.none(), cursors(w))),
            max_messages=data.draw(limits), max_bytes=data.draw(limits),
            fence=data.draw(st.one_of(st.none(), anchors(w)))),
        "read_visible": lambda data: call(store.read_visible, data.draw(ids), data.draw(ids),
                                          fence=data.draw(st.one_of(st.none(), anchors(w)))),
        "get_entries": lambda data: call(store.get_entries, data.draw(ids), data.draw(ids),
                                         data.draw(st.one_of(st.lists(ids, max_size=4), ids))),
        "list_entries": lambda data: call(store.list_entries, data.draw(ids), data.draw(ids),
                                          after_seq=data.draw(limits), limit=data.draw(limits)),
        "read_closed_range": lambda data: call(store.read_closed_range, data.draw(anchors(w)), data.draw(anchors(w))),
        "branch": lambda data: call(store.branch, data.draw(ids), data.draw(ids), data.draw(hostile_ids)),
        "rewrite_entries": lambda data: call(
            store.rewrite_entries, data.draw(ids), data.draw(ids),
            data.draw(st.one_of(st.lists(st.one_of(
                st.fixed_dictionaries({"entry_id": ids, "message": messages}),
                st.builds(lambda m: Replacement(entry_id="E1", message=m), st.just({"role": "user", "content": "r"})),
                payloads), max_size=3), payloads)),
            allowed_rewrite_suffix_entry_ids=data.draw(st.one_of(st.none(), st.lists(ids, max_size=3), ids))),
        "export_session": lambda data: call(store.export_session, data.draw(ids), data.draw(ids)),
        "import_session": lambda data: (lambda h_e: call(
            store.import_session, data.draw(ids), h_e[0], h_e[1], session_id=data.draw(optional_ids),
            session_key=data.draw(optional_ids)))(data.draw(records(w))),
        # Turns
        "commit_turn": lambda data: call(
            turns.commit_turn, data.draw(ids), data.draw(ids), data.draw(anchors(w)), data.draw(anchors(w)),
            data.draw(st.one_of(st.just(w["messages"]), st.lists(messages, max_size=3), payloads)),
            is_heartbeat=data.draw(st.one_of(st.booleans(), wrong)),
            apply=data.draw(st.one_of(st.none(), st.just(count_turn), wrong))),
        "receipts": lambda data: call(turns.receipts, data.draw(ids), data.draw(ids), data.draw(optional_ids)),
        "receipts_page": lambda data: call(
            turns.receipts_page, data.draw(ids), data.draw(ids), data.draw(ids),
            # keys around the world's receipt (T1): a cursor is the last advancement key seen
            after=data.draw(st.one_of(st.none(), ids, st.sampled_from(["T0", "T1", "T1.", "T2", "\U0010fffd"]))),
            limit=data.draw(limits)),
        "turns.admit": lambda data: call(turns.admit, data.draw(ids), data.draw(ids), data.draw(messages),
                                         turn_id=data.draw(ids), engine_id=data.draw(ids),
                                         is_heartbeat=data.draw(st.one_of(st.booleans(), wrong)),
                                         taken_over=data.draw(st.one_of(st.none(), st.just([]), wrong))),
        "admit_if_clear": lambda data: call(turns.admit_if_clear, data.draw(ids), data.draw(ids),
                                            data.draw(messages), turn_id=data.draw(ids), engine_id=data.draw(ids),
                                            is_heartbeat=data.draw(st.one_of(st.booleans(), wrong))),
        "discard": lambda data: call(turns.discard, data.draw(ids), data.draw(ids), data.draw(ids)),
        "hand_back": lambda data: call(
            turns.hand_back, data.draw(ids), data.draw(ids), data.draw(ids), owner=data.draw(st.one_of(ids, wrong)),
            lease=data.draw(st.one_of(wrong, st.builds(
                AdmittedLease, ids, optional_ids, st.one_of(st.none(), st.integers(), wrong))))),
        "accept": lambda data: call(turns.accept, data.draw(ids), data.draw(ids), data.draw(ids),
                                    data.draw(anchors(w))),
        "complete": lambda data: call(turns.complete, data.draw(ids), data.draw(ids), data.draw(ids),
                                      data.draw(append_items(w)), data.draw(commit_ins)),
        "drain": lambda data: call(turns.drain, data.draw(engines(w)), scope=data.draw(optional_ids),
                                   session_id=data.draw(optional_ids), limit=data.draw(st.one_of(st.none(), limits)),
                                   on_committed=data.draw(st.one_of(st.none(), wrong))),
        "recover": lambda data: call(turns.recover, data.draw(ids), data.draw(ids), data.draw(ids),
                                     data.draw(engines(w))),
        "block": lambda data: call(turns.block, data.draw(ids), data.draw(ids), data.draw(ids),
                                   data.draw(st.one_of(ids, payloads))),
        "intents": lambda data: call(turns.intents, data.draw(optional_ids), data.draw(limits)),
        "intent": lambda data: call(turns.intent, data.draw(ids), data.draw(ids), data.draw(ids)),
        "intents_page": lambda data: call(
            turns.intents_page, data.draw(optional_ids),
            # the world's own cursors (of one scope and of every scope), another scope's, cut or extended ones, and
            # anything else
            after=data.draw(st.one_of(
                st.none(), ids, payloads,
                st.sampled_from([w["intent_cursor"], w["b_intent_cursor"], w["all_intent_cursor"], w["cursor"]]),
                st.builds(lambda c, n, x: c[:n] + x, st.sampled_from([w["intent_cursor"]]), st.integers(0, 80),
                          st.text(max_size=4)),
            )),
            limit=data.draw(limits)),
    }


#: functions that only read: they must not change a row even when they succeed
READS = {
    "get_session", "find_session", "list_sessions", "ended_sessions", "session_bytes", "prepare", "prepare_admission",
    "anchor",
    "read_visible_delta", "read_visible", "get_entries", "list_entries", "read_closed_range", "export_session",
    "receipts", "receipts_page", "intents", "intents_page", "intent", "upgrade_url", "TranscriptStore", "Turns",
}
#: public functions deliberately not drawn (the module docstring says why)
NOT_DRAWN = {
    "TranscriptStore.write", "TranscriptStore.read", "TranscriptStore.statement", "TranscriptStore.close",
    "TranscriptStore.upgrade", "TranscriptStore.current_revision", "TranscriptStore.ensure_current",
}


def hostile_input_campaign(
    request: pytest.FixtureRequest, store: TranscriptStore, backend: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, examples: int,
) -> None:
    """Draw ``examples`` argument sets for every function of ``calls`` and check the contract after each call."""
    started = time.monotonic()
    monkeypatch.chdir(tmp_path)  # a URL that slips through must not leave a database in the repository
    turns = Turns(store)
    world = build_world(store, turns)
    names = sorted(table_rows(store))
    state = {"rows": table_rows(store, names=names)}
    figures: dict[str, dict[str, int]] = {}

    def check(name: str, thunk: Callable[[], Any]) -> None:
        counts = figures.setdefault(name, {"calls": 0, "refused": 0})
        counts["calls"] += 1
        before = state["rows"]
        refused: BaseException | None = None
        try:
            result = thunk()
            if isinstance(result, TranscriptStore):
                result.close()
        except TranscriptStoreError as e:
            assert not isinstance(e, StoreUnavailable), f"{name}: the input was blamed on the database: {e!r}"
            refused = e
        after = table_rows(store, names=names)
        if refused is not None or name in READS:
            assert after == before, f"{name} {'refused with ' + repr(refused) if refused else 'read'} but wrote"
        counts["refused"] += refused is not None
        state["rows"] = after

    def hypothesis_test(name: str, draw: Callable[[st.DataObject], Any]) -> Callable[[], None]:
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            check(name, draw(data))

        return run

    for name, draw in calls(store, turns, world).items():
        hypothesis_test(name, draw)()
    total = sum(c["calls"] for c in figures.values())
    refused = sum(c["refused"] for c in figures.values())
    report(request, backend, {
        "functions": len(figures), "examples_per_function": examples, "calls": total, "refusals": refused,
        "accepted": total - refused,
        "untyped_errors": 0, "writes_by_refused_calls": 0, "seconds": round(time.monotonic() - started, 1),
    })
    assert all(c["calls"] >= 10 for c in figures.values()), figures


def test_hostile_input_is_refused_with_typed_errors_and_writes_nothing(
    request: pytest.FixtureRequest, store: TranscriptStore, backend: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hostile_input_campaign(request, store, backend, tmp_path, monkeypatch, EXAMPLES)


@pytest.mark.slow
def test_hostile_input_150_examples_per_function(
    request: pytest.FixtureRequest, store: TranscriptStore, backend: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hostile_input_campaign(request, store, backend, tmp_path, monkeypatch, SLOW_EXAMPLES)


def public_functions() -> set[str]:
    """Every public function of ``TranscriptStore`` and ``Turns``: constructors and methods, not properties."""
    out = {"TranscriptStore", "Turns"}
    for cls in (TranscriptStore, Turns):
        out |= {f"{cls.__name__}.{name}" for name, value in vars(cls).items()
                if not name.startswith("_") and isinstance(value, FunctionType | classmethod | staticmethod)}
    return out


@pytest.mark.parametrize("backend", ["sqlite"])  # names only: one backend says it
def test_every_public_function_is_drawn_or_listed_as_not(store: TranscriptStore) -> None:
    turns = Turns(store)
    drawn = {name if name in ("TranscriptStore", "Turns") else "Turns.admit" if name == "turns.admit"
             else f"TranscriptStore.{name}" if name in vars(TranscriptStore) else f"Turns.{name}"
             for name in calls(store, turns, build_world(store, turns))}
    assert len(drawn) == 42, sorted(drawn)  # the module docstring's count
    assert not drawn & NOT_DRAWN and drawn | NOT_DRAWN == public_functions(), sorted(public_functions() - drawn)


def test_the_bugs_this_campaign_found_stay_fixed(store: TranscriptStore, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of these escaped as a raw driver / pydantic / Python error, as StoreUnavailable, or was written."""
    monkeypatch.chdir(tmp_path)
    turns = Turns(store)
    w = build_world(store, turns)
    anchor: Anchor = w["admission"].anchor
    cases: list[tuple[Callable[[], Any], type[Exception]]] = [
        (lambda: turns.receipts(A + "\x00", "s1"), InvalidInput),  # PostgreSQL: "text cannot contain NUL"
        (lambda: turns.intent(A, "s1", "T\ud800"), InvalidInput),  # UnicodeEncodeError from the driver
        (lambda: turns.discard(A, "s1\x00", "T3"), InvalidInput),
        (lambda: turns.intents(A, -1), InvalidInput),  # PostgreSQL: "LIMIT must not be negative"
        (lambda: turns.intents(A, 10**30), InvalidInput),  # OverflowError / "bigint out of range"
        (lambda: turns.drain(lambda _e: counting_engine, scope=A, limit=-5), InvalidInput),  # silently nothing
        (lambda: turns.admit(A, "s1", {"role": "user", "content": "x"}, turn_id="T9", engine_id="e\x00"),
         InvalidInput),
        (lambda: turns.admit(A, "s1", {"role": "user", "content": "x"}, turn_id="T9", engine_id=ENGINE,
                             is_heartbeat="yes"), InvalidInput),  # StatementError as StoreUnavailable
        (lambda: turns.recover(A, "s1", ENGINE, 42), InvalidInput),  # type: ignore[arg-type]
        (lambda: turns.complete(A, "s1", "T3", [{"message": {"role": "assistant", "content": "a"}}], 42),  # type: ignore[arg-type]
         InvalidInput),  # a TypeError inside the transaction, then the slow path wrote the turn
        (lambda: turns.commit_turn(ENGINE, "T1", w["admission"], w["terminal"], w["messages"], apply=42),  # type: ignore[arg-type]
         InvalidInput),
        (lambda: turns.accept(A, "s1", "T3", "terminal"), InvalidInput),  # type: ignore[arg-type]
        (lambda: store.list_entries(A, "s1", after_seq=2**70), InvalidInput),  # OverflowError / integer out of range
        (lambda: store.read_closed_range(anchor.model_copy(update={"entry_id": "E\ud800"}), w["terminal"]),
         InvalidInput),
        (lambda: store.read_visible(A, "s1", fence=anchor.model_copy(update={"entry_id": "E\x00"})), InvalidInput),
        (lambda: store.read_visible_delta(A, "nowhere", fence="x"), InvalidInput),  # type: ignore[arg-type]
        (lambda: store.rewrite_entries(A, "s1", [{"entry_id": "E1", "message": {"role": "user", "content": "r"}}],
                                       allowed_rewrite_suffix_entry_ids=[["E1"]]), InvalidInput),  # type: ignore[list-item]
        (lambda: TranscriptStore(5), InvalidInput),  # type: ignore[arg-type]  # was pydantic ValidationError
        (lambda: TranscriptStore("sqlite:///a\x00b"), InvalidInput),  # ValueError: embedded null byte
        (lambda: TranscriptStore("sqlite:///\ud800"), InvalidInput),  # UnicodeEncodeError
        # The constructors' other arguments were taken unchecked: AttributeError, TypeError, or a Turns
        # whose every method raised AttributeError.
        (lambda: TranscriptStore(config=42), InvalidInput),  # type: ignore[arg-type]
        (lambda: TranscriptStore(config={"url": "sqlite:///x.db"}), InvalidInput),  # type: ignore[arg-type]
        (lambda: TranscriptStore(5, config=store.config), InvalidInput),  # type: ignore[arg-type]  # model_copy
        (lambda: TranscriptStore("sqlite:///a\x00b", config=store.config), InvalidInput),
        (lambda: TranscriptStore("sqlite:///x.db", create="no"), InvalidInput),  # type: ignore[arg-type]
        (lambda: Turns(store, 42), InvalidInput),  # type: ignore[arg-type]
        (lambda: Turns(store, {"drain_limit": 1}), InvalidInput),  # type: ignore[arg-type]
        (lambda: Turns(42), InvalidInput),  # type: ignore[arg-type]
        (lambda: Turns(store.config), InvalidInput),  # type: ignore[arg-type]
    ]
    # Forged anchors were receipted: a terminal naming no stored entry, an admission at another seq.
    turns.discard(A, "s1", "T3")  # the world's running turn: a session runs one turn at a time
    fresh, _ = turns.admit(A, "s1", w["messages"][0], turn_id="T7", engine_id=ENGINE)
    reply = store.append(A, "s1", w["messages"][1], entry_id="T7.r0")
    terminal = store.anchor(A, "s1", reply.entry_id)
    nowhere = terminal.model_copy(update={"entry_id": "no-such-entry"})
    moved = fresh.model_copy(update={"anchor": fresh.anchor.model_copy(update={"seq": 999})})
    cases += [
        (lambda: turns.commit_turn(ENGINE, "T7", fresh, nowhere, w["messages"]), InvalidInput),
        (lambda: turns.commit_turn(ENGINE, "T7", moved, terminal, w["messages"]), InvalidInput),
    ]
    names = sorted(table_rows(store))
    before = table_rows(store, names=names)
    for i, (call, error) in enumerate(cases):
        with pytest.raises(error) as info:
            call()
        assert not isinstance(info.value, StoreUnavailable), (i, info.value)
        assert isinstance(info.value, TranscriptStoreError), (i, info.value)
        assert table_rows(store, names=names) == before, f"case {i} wrote something"
    assert turns.commit_turn(ENGINE, "T7", fresh, terminal, w["messages"]).status == "committed"
