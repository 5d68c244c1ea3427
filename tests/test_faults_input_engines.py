"""Fault campaign, part 4c: hostile input to every public method of the bundled engines, called directly.

Parts 4 and 4b reach the engines only through the host and the service, which check ids, anchors and
budgets before an engine sees them. An embedding application may hold an engine itself (the plugin
factory returns it), so each method of ``LegacyEngine`` and ``LosslessEngine`` gets hypothesis-drawn
arguments of its own: ids with NUL bytes, lone surrogates and SQL metacharacters, huge strings, wrong
types, forged and other-scope anchors, negative and huge budgets, arbitrary JSON for messages, tool
arguments and runtime settings, other scopes' sessions. The contract, on both backends after every call:

- a refusal is one of the library's typed errors (``TranscriptStoreError``), never ``StoreUnavailable``
  and never a raw ``TypeError``/``AttributeError``/``KeyError``/``ValueError``, driver, SQLAlchemy or
  pydantic error;
- a refused call leaves every row of every table as it was. ``handle_tool_call`` answers the model,
  so it refuses with an ``{"error": ...}`` answer instead of raising: that answer writes nothing either;
- a read never changes a row even when it succeeds (``READS``: the legacy engine's ``prefetch_in`` and
  ``assemble``, whose projection is held in memory; ``budget``, ``after_turn``, which only remembers the
  run's budget, and ``get_tool_schemas``);
- a read of the lossless engine's own state (``STATE_READS``: ``assemble`` and the recall tools) first
  brings that state up to date, which writes, and that is legitimate: the import of the visible messages
  the engine has not ingested (a lazy bootstrap: a session it never saw, turns another engine committed),
  a pending reset applied (a branch or rewrite since the last import), and, for ``assemble`` only, the
  compaction of a context over the budget. Those writes touch the engine's own rows only (its ``ts_lcm_*``
  tables and its ``ts_engine_state`` rows), never the transcript, the ledger or another engine's state,
  and the same call made again at once imports nothing (``ts_lcm_messages`` unchanged); a recall tool's
  second call writes nothing at all. (The in-memory caches, the context list and the legacy projection,
  are not rows; neither are the planner statistics an import's ANALYZE refreshes on PostgreSQL.)

Drawn: 15 methods (``calls``; a test keeps that list and ``NOT_DRAWN`` complete). ``commit_turn`` and
``commit_prepared`` run inside ``store.write`` (they take the caller's transaction) and ``prefetch_in``
inside ``store.read``. The default tier draws ``FAULT_INPUT_ENGINE_EXAMPLES`` (20) examples per method
and backend; the slow tier (``make test-slow``) 150.
"""

from __future__ import annotations

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
from test_faults_input import A, anchors, deep, ids, ints, limits, messages, payloads, texts, weighted, wrong
from test_faults_input_host import build_host_world, scopes, sessions
from workers.fault_worker import report, table_rows

from engines.legacy import LegacyEngine
from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from transcript_store import InvalidInput, StoreUnavailable, TranscriptStore, TranscriptStoreError
from transcript_store.engine import EngineContext, EngineSelection, Limits, RuntimeSettings
from transcript_store.ledger import prepare_turn
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

EXAMPLES = int(os.environ.get("FAULT_INPUT_ENGINE_EXAMPLES", "20"))
SLOW_EXAMPLES = 150
TOOLS = ["lcm_grep", "lcm_describe", "lcm_expand"]


def make_engines(
    store: TranscriptStore, lossless_config: dict[str, Any] | None = None
) -> tuple[LegacyEngine, LosslessEngine]:
    """The two bundled engines over ``store``, built as the registry builds them (default config, unless
    ``lossless_config``)."""
    def ctx(config: dict[str, Any]) -> EngineContext:
        return EngineContext(store=store, config=config, summarizer=ExtractiveSummarizer(), estimator=RoughEstimator())

    return LegacyEngine(ctx({})), LosslessEngine(ctx(lossless_config or {}))


# ---------------------------------------------------------------------------------------------- strategies



def mostly(valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` 7 draws in 8."""
    return weighted(valid, hostile, 8)


optional_texts = mostly(st.none(), st.one_of(texts, wrong))
budgets = mostly(st.sampled_from([1, 50, 2000, 128_000]), limits)
bools = mostly(st.booleans(), wrong)
SETTINGS = RuntimeSettings(context_engine_selection=EngineSelection(id="lossless", source="config"),
                           limits=Limits(prompt_token_budget=4000))
runtime_settings = mostly(st.sampled_from([None, SETTINGS]), st.one_of(st.fixed_dictionaries({}, optional={
    "token_budget": budgets, "context_window": budgets, "session_key": optional_texts, "x": payloads}), payloads))
tool_args = st.one_of(
    st.fixed_dictionaries({}, optional={
        "pattern": st.one_of(texts, st.sampled_from(["(a+)+$", "[" * 50, "\\", "(?P<x>", ".*" * 500, "a{99999}"])),
        "mode": st.one_of(st.sampled_from(["regex", "full_text"]), texts, wrong),
        "scope": st.one_of(st.sampled_from(["summaries", "messages", "both"]), texts, wrong),
        "id": st.one_of(st.sampled_from(["sum_1", "msg_1", "sum_999999999999999999999", "msg_-1"]), ids),
        "ids": st.one_of(st.lists(st.one_of(st.sampled_from(["sum_1", "msg_1"]), ids), max_size=4), payloads),
        "limit": limits, "max_chars": limits, "since": st.one_of(texts, ints, wrong), "x": payloads,
    }),
    payloads, deep,
)
message_lists = st.one_of(st.lists(messages, max_size=3), payloads)


def calls(legacy: LegacyEngine, lossless: LosslessEngine, store: TranscriptStore,
          w: dict[str, Any]) -> dict[str, Callable[[st.DataObject], Callable[[], Any]]]:
    """Per public method: draw its arguments, return the call."""
    def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
        return lambda: fn(*args, **kwargs)

    anchor = anchors(w) if w else st.none()
    fences = mostly(st.none(), st.one_of(st.just(w["fence"]), anchor)) if w else st.none()  # (s1's fence)
    # Most calls name the session of a real fence (scope A's s1), so that the rest of the call is reached.
    where = mostly(st.sampled_from([(A, "s1"), (A, "big"), (A, "fresh")]), st.tuples(scopes, sessions))

    def commit(engine: Any, d: st.DataObject) -> Callable[[], Any]:
        kwargs = {"advancement_key": d.draw(ids), "admission": d.draw(anchor), "terminal": d.draw(anchor),
                  "messages": d.draw(message_lists), "is_heartbeat": d.draw(bools)}
        return lambda: store.write(lambda c: engine.commit_turn(tx=c, **kwargs))

    def prepared(engine: Any, d: st.DataObject) -> Callable[[], Any]:
        # A payload built by prepare_turn (hostile input refused there already is the same contract), or
        # something that is not a payload at all.
        key, adm, term, msgs = d.draw(ids), d.draw(anchor), d.draw(anchor), d.draw(message_lists)
        use_wrong = d.draw(st.booleans())
        other = d.draw(payloads)

        def run() -> Any:
            turn = other if use_wrong else prepare_turn(engine.info.id, key, adm, term, msgs)
            return store.write(lambda c: engine.commit_prepared(c, turn))

        return run

    def prefetch(d: st.DataObject) -> Callable[[], Any]:
        (scope, sid), fence = d.draw(where), d.draw(anchor)
        return lambda: store.read(lambda c: legacy.prefetch_in(c, scope=scope, session_id=sid, fence=fence))

    def tool(d: st.DataObject) -> Callable[[], Any]:
        name = d.draw(mostly(st.sampled_from(TOOLS), ids))
        args, (scope, sid) = d.draw(tool_args), d.draw(where)
        return lambda: lossless.handle_tool_call(name, args, scope=scope, session_id=sid)

    def on_session(fn: Callable[..., Any], **draws: st.SearchStrategy[Any]) -> Callable[[st.DataObject], Any]:
        """A keyword call on a drawn session, each other keyword drawn from its strategy."""
        def draw(d: st.DataObject) -> Callable[[], Any]:
            scope, sid = d.draw(where)
            return call(fn, scope=scope, session_id=sid, **{k: d.draw(v) for k, v in draws.items()})

        return draw

    optional_budgets = mostly(st.none(), budgets)
    session_keys = {"session_key": optional_texts, "runtime_settings": runtime_settings}
    return {
        # LegacyEngine
        "LegacyEngine.prefetch_in": prefetch,
        "LegacyEngine.assemble": on_session(legacy.assemble, fence=fences, token_budget=budgets,
                                            prefetched=mostly(st.none(), payloads)),
        "LegacyEngine.compact": on_session(legacy.compact, force=bools, focus=optional_texts,
                                           token_budget=optional_budgets),
        "LegacyEngine.commit_turn": lambda d: commit(legacy, d),
        "LegacyEngine.commit_prepared": lambda d: prepared(legacy, d),
        # LosslessEngine
        "LosslessEngine.budget": lambda d: call(lossless.budget, *d.draw(where), d.draw(optional_budgets)),
        "LosslessEngine.bootstrap": on_session(lossless.bootstrap, fence=fences, **session_keys),
        # before assemble and maintain, which compact a session over its budget themselves
        "LosslessEngine.compact": on_session(lossless.compact, force=bools, focus=optional_texts,
                                             token_budget=optional_budgets, **session_keys),
        "LosslessEngine.assemble": on_session(
            lossless.assemble, fence=fences, token_budget=budgets,
            available_tools=mostly(st.one_of(st.none(), st.lists(st.sampled_from(TOOLS), max_size=3)),
                                   st.one_of(st.lists(texts, max_size=3), payloads)), **session_keys),
        "LosslessEngine.commit_turn": lambda d: commit(lossless, d),
        "LosslessEngine.commit_prepared": lambda d: prepared(lossless, d),
        "LosslessEngine.after_turn": on_session(
            lossless.after_turn, admission=mostly(st.none(), anchor), terminal=mostly(st.none(), anchor),
            **session_keys),
        "LosslessEngine.maintain": on_session(lossless.maintain, **session_keys),
        "LosslessEngine.get_tool_schemas": lambda d: call(lossless.get_tool_schemas),
        "LosslessEngine.handle_tool_call": tool,
    }


#: methods that only read: they must not change a row even when they succeed
READS = {
    "LegacyEngine.prefetch_in", "LegacyEngine.assemble", "LosslessEngine.budget", "LosslessEngine.after_turn",
    "LosslessEngine.get_tool_schemas",
}
#: reads that may first bring the lossless engine's own state up to date (module docstring)
STATE_READS = {"LosslessEngine.assemble", "LosslessEngine.handle_tool_call"}
#: the rows the lossless engine owns: its tables, and its rows of ``ts_engine_state``
ENGINE_TABLES = ("ts_lcm_",)


def engine_rows_only(before: dict[str, list[str]], after: dict[str, list[str]]) -> set[str]:
    """The tables a call changed beyond the lossless engine's own rows (empty when it wrote only those)."""
    changed = {t for t in after if after[t] != before[t] and not t.startswith(ENGINE_TABLES)}
    if "ts_engine_state" in changed:
        def others(rows: list[str]) -> list[str]:
            return [r for r in rows if "('engine_id', 'lossless')" not in r]

        if others(after["ts_engine_state"]) == others(before["ts_engine_state"]):
            changed.discard("ts_engine_state")
    return changed


#: public methods deliberately not drawn, with the reason
NOT_DRAWN = {
    "LegacyEngine.dispose": "no arguments",
    "LosslessEngine.dispose": "no arguments",
}


def hostile_engine_input_campaign(request: pytest.FixtureRequest, store: TranscriptStore, backend: str,
                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch, examples: int) -> None:
    """Draw ``examples`` argument sets for every method of ``calls`` and check the contract after each call."""
    started = time.monotonic()
    monkeypatch.chdir(tmp_path)
    _host, service, world = build_host_world(store)
    for h in (*world["hosts"], service.runtime):
        h.dispose()
    legacy, lossless = make_engines(store)
    # Sessions long enough to compact, one the lossless engine has imported ("big") and one no engine has
    # seen ("fresh"): the accepted calls of the methods that write (imports, compactions) do write, so
    # that "a refusal writes nothing" is tested where it can fail.
    for sid in ("big", "fresh"):
        store.create_session(A, session_id=sid)
        store.append_many(A, sid, [{"message": {"role": "user" if i % 2 == 0 else "assistant",
                                                "content": f"message {i} " + "lorem ipsum dolor " * 60}}
                                   for i in range(120)])
    lossless.bootstrap(scope=A, session_id="big", fence=None)
    names = sorted(table_rows(store))
    state = {"rows": table_rows(store, names=names)}
    figures: dict[str, dict[str, int]] = {}
    untyped: dict[tuple[str, str], str] = {}

    def check(name: str, thunk: Callable[[], Any]) -> None:
        counts = figures.setdefault(name, {"calls": 0, "refused": 0, "wrote": 0})
        counts["calls"] += 1
        before = state["rows"]
        refused: BaseException | str | None = None
        try:
            answer = thunk()
        except TranscriptStoreError as e:
            assert not isinstance(e, StoreUnavailable), f"{name}: the input was blamed on the database: {e!r}"
            refused = e
        except Exception as e:  # collected, so that one run names every method's untyped errors
            untyped.setdefault((name, type(e).__name__), f"{e!r}"[:300])
            refused = e
        else:
            if name == "LosslessEngine.handle_tool_call":
                assert isinstance(answer, str), answer
                decoded = json.loads(answer)
                if isinstance(decoded, dict) and set(decoded) == {"error"}:
                    refused = str(decoded["error"])
        after = table_rows(store, names=names)
        if refused is not None or name in READS:
            changed = {t for t in names if after[t] != before[t]}
            assert not changed, f"{name} {'refused with ' + repr(refused) if refused else 'read'} but wrote {changed}"
        elif name in STATE_READS:
            assert not engine_rows_only(before, after), \
                f"{name} read but wrote {engine_rows_only(before, after)}, not the engine's own rows"
            # The state is current now: the same call again imports nothing (a recall tool: writes nothing).
            counts["state_writes"] = counts.get("state_writes", 0) + (after != before)
            thunk()
            again = table_rows(store, names=names)
            changed = {t for t in names if again[t] != after[t]}
            if name == "LosslessEngine.assemble":
                changed &= {"ts_lcm_messages"}
            assert not changed, f"{name} made again at once wrote {changed}"
            after = again
        counts["refused"] += refused is not None
        counts["wrote"] += after != before
        state["rows"] = after

    def hypothesis_test(name: str, draw: Callable[[st.DataObject], Any]) -> Callable[[], None]:
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            check(name, draw(data))

        return run

    # For the methods that write: a call known to write, made after the drawn ones only if none of them
    # wrote (the sessions were then still writable while every drawn call was refused or wrote nothing).
    known = {
        "LegacyEngine.compact": lambda: legacy.compact(scope=A, session_id="big", force=True),
        "LosslessEngine.bootstrap": lambda: lossless.bootstrap(scope=A, session_id="fresh", fence=None),
        "LosslessEngine.compact": lambda: lossless.compact(scope=A, session_id="big", force=True),
    }
    try:
        for name, draw in calls(legacy, lossless, store, world).items():
            hypothesis_test(name, draw)()
            if name in known and figures[name]["wrote"] == 0:
                check(name, known[name])
    finally:
        legacy.dispose()
        lossless.dispose()
    assert not untyped, "untyped errors:\n" + "\n".join(f"{n}: {t}: {m}" for (n, t), m in sorted(untyped.items()))
    total = sum(c["calls"] for c in figures.values())
    refused = sum(c["refused"] for c in figures.values())
    report(request, backend, {
        "functions": len(figures), "examples_per_function": examples, "calls": total, "refusals": refused,
        "accepted": total - refused, "untyped_errors": 0, "writes_by_refused_calls": 0, "writes_by_reads": 0,
        "state_reads_that_wrote": {n: figures[n].get("state_writes", 0) for n in sorted(STATE_READS)},
        "seconds": round(time.monotonic() - started, 1),
    })
    # (get_tool_schemas takes no argument: hypothesis calls it once)
    assert all(c["calls"] >= examples for n, c in figures.items() if n != "LosslessEngine.get_tool_schemas"), figures
    assert refused > 0 and total - refused > 0, figures  # both sides of the contract were reached
    assert all(figures[n]["wrote"] > 0 for n in known), {n: figures[n] for n in known}


def test_hostile_input_to_the_engines_is_refused_with_typed_errors_and_writes_nothing(
    request: pytest.FixtureRequest, store: TranscriptStore, backend: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hostile_engine_input_campaign(request, store, backend, tmp_path, monkeypatch, EXAMPLES)


@pytest.mark.slow
def test_hostile_input_to_the_engines_150_examples_per_method(
    request: pytest.FixtureRequest, store: TranscriptStore, backend: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hostile_engine_input_campaign(request, store, backend, tmp_path, monkeypatch, SLOW_EXAMPLES)


def public_methods() -> set[str]:
    """Every public method of the two engines, inherited ones included."""
    out = set()
    for cls in (LegacyEngine, LosslessEngine):
        for klass in cls.__mro__[:-1]:
            out |= {f"{cls.__name__}.{name}" for name, value in vars(klass).items()
                    if not name.startswith("_") and isinstance(value, FunctionType | classmethod | staticmethod)}
    return out


@pytest.mark.parametrize("backend", ["sqlite"])  # names only: one backend says it
def test_every_public_method_of_the_engines_is_drawn_or_listed_as_not(store: TranscriptStore) -> None:
    legacy, lossless = make_engines(store)
    drawn = set(calls(legacy, lossless, store, {}))  # the draws are lazy: no world needed for the names
    assert len(drawn) == 15, sorted(drawn)  # the module docstring's count
    assert not drawn & set(NOT_DRAWN) and drawn | set(NOT_DRAWN) == public_methods(), \
        sorted(public_methods() ^ (drawn | set(NOT_DRAWN)))


def test_the_bugs_this_campaign_found_stay_fixed(store: TranscriptStore) -> None:
    """Each was a raw TypeError, AttributeError or UnicodeEncodeError from inside an engine (or, for the
    fence of another session and ``force="no"``, a call that ran): InvalidInput now, nothing written."""
    legacy, lossless = make_engines(store)
    store.create_session(A, session_id="s1")
    store.create_session(A, session_id="s2")
    # Long enough that a compaction would write (each refusal below comes before any write, or it is seen)
    store.append_many(A, "s1", [{"message": {"role": "user" if i % 2 == 0 else "assistant",
                                             "content": f"message {i} " + "lorem ipsum dolor " * 60}}
                                for i in range(60)])
    lossless.bootstrap(scope=A, session_id="s1", fence=None)
    admission = store.admit(A, "s1", {"role": "user", "content": "q"}, turn_id="t1")
    fence = admission.anchor
    before = table_rows(store)
    refused: list[Callable[[], Any]] = [
        lambda: lossless.assemble(scope=A, session_id="s1", fence=admission, token_budget=100),  # type: ignore[arg-type]
        lambda: lossless.bootstrap(scope=A, session_id="s2", fence=fence),  # another session's fence
        lambda: legacy.assemble(scope=A, session_id="s2", fence=fence, token_budget=100),
        lambda: legacy.assemble(scope="a\udc00", session_id="s1", fence=None, token_budget=100),
        lambda: lossless.bootstrap(scope=A, session_id="s1\x00", fence=None),
        lambda: lossless.compact(scope=A, session_id="s1", runtime_settings={"limits": 1}),  # type: ignore[arg-type]
        lambda: lossless.maintain(scope=A, session_id="s1", session_key="\ud800"),
        lambda: lossless.after_turn(scope=A, session_id="s1", admission={"turn_id": "t1"}),  # type: ignore[arg-type]
        lambda: lossless.budget(A, "s1", [1]),  # type: ignore[arg-type]
        lambda: lossless.assemble(scope=A, session_id="s1", fence=fence, token_budget=100,
                                  available_tools="lcm_grep"),  # type: ignore[arg-type]
        lambda: legacy.compact(scope=A, session_id="s1", force="no"),  # type: ignore[arg-type]
        lambda: lossless.compact(scope=A, session_id="s1", force=1),  # type: ignore[arg-type]
        lambda: store.read(lambda c: legacy.prefetch_in(c, scope=A, session_id="s1", fence=admission)),  # type: ignore[arg-type]
        lambda: store.write(lambda c: legacy.commit_prepared(c, {"scope": A})),  # type: ignore[arg-type]
        lambda: store.write(lambda c: lossless.commit_prepared(c, {"scope": A})),  # type: ignore[arg-type]
    ]
    for i, thunk in enumerate(refused):
        with pytest.raises(InvalidInput):
            thunk()
        assert table_rows(store) == before, f"refused call {i} wrote"
    legacy.dispose()
    lossless.dispose()


def test_a_read_writes_nothing_but_the_lossless_engines_own_catching_up(store: TranscriptStore) -> None:
    """The campaign's contract for successful reads, on each legitimate write path it may not draw: the
    legacy reads write nothing; the lossless engine's assemble and recall tools write its own rows only
    (a lazy import of a session it never saw, a pending reset, a compaction over the budget), and the
    same read again at once writes nothing. The engine's audit writes nothing."""
    legacy, lossless = make_engines(store)
    store.create_session(A, session_id="s1")
    store.append_many(A, "s1", [{"message": {"role": "user" if i % 2 == 0 else "assistant",
                                             "content": f"message {i} " + "lorem ipsum dolor " * 60}}
                                for i in range(60)])
    fence = store.admit(A, "s1", {"role": "user", "content": "q"}, turn_id="t1").anchor
    names = sorted(table_rows(store))

    def wrote(thunk: Callable[[], Any]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        before = table_rows(store, names=names)
        thunk()
        return before, table_rows(store, names=names)

    for i, read in enumerate([
        lambda: store.read(lambda c: legacy.prefetch_in(c, scope=A, session_id="s1", fence=fence)),
        lambda: legacy.assemble(scope=A, session_id="s1", fence=fence, token_budget=100),
        lambda: legacy.assemble(scope=A, session_id="s1", fence=None, token_budget=128_000),
        lambda: lossless.budget(A, "s1", 2000),
        lambda: lossless.after_turn(scope=A, session_id="s1"),
        lossless.get_tool_schemas,
    ]):
        before, after = wrote(read)
        assert after == before, f"read {i} wrote"
    def grep() -> str:
        return lossless.handle_tool_call("lcm_grep", {"pattern": "message"}, scope=A, session_id="s1")

    def branch() -> None:  # the active path moves back: the lossless engine's import is ahead of it
        store.branch(A, "s1", store.read_visible(A, "s1")[9].entry_id)

    for what, first, read in [
        ("the lazy import", None,
         lambda: lossless.assemble(scope=A, session_id="s1", fence=fence, token_budget=128_000)),
        ("the compaction over the budget", None,
         lambda: lossless.assemble(scope=A, session_id="s1", fence=fence, token_budget=2000)),
        ("the pending reset", branch, grep),
    ]:
        if first is not None:
            first()
        before, after = wrote(read)
        assert after["ts_lcm_context_items"] != before["ts_lcm_context_items"], f"{what} wrote nothing"
        assert not engine_rows_only(before, after), f"{what} wrote {engine_rows_only(before, after)}"
        assert wrote(read)[1] == after, f"{what}: the same read again wrote"
        # The engine's audit (``ts audit``-like: it takes the caller's transaction) only reads.
        assert wrote(lambda: store.read(lambda c: audit(c, A, "s1")))[1] == after, "the audit wrote"
    legacy.dispose()
    lossless.dispose()
