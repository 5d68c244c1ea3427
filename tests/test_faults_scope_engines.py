"""Fault campaign, part 5b: scope isolation through the service and the bundled engines.

Part 5 (test_faults_scope.py) calls the store, ``Turns`` and the host across scopes. Here two scopes
mirror the same conversation ids through ``Service`` (what the HTTP API and the OpenClaw plugin call),
committed to both engines, the lossless one compacted into summaries, each scope with a secret of its
own; scope B also has a session A has not. Then, in scope A:

1. every service operation and every engine method (called directly) on the session only B has answers
   word for word as for a session nobody has, and writes nothing;
2. the recall tools on A's own session find only A's text: a search for B's secret finds nothing, and a
   summary id only B has is answered as an unknown one;
3. every write (commits to both engines, compactions, maintenance, bootstrap imports, the recall tools'
   resets) leaves every row of scope B as it was.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import inspect
from test_faults_input_engines import make_engines
from test_faults_scope import outcome
from workers.fault_worker import report, table_rows

from engines.legacy import LegacyEngine
from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from transcript_store import TranscriptStore
from transcript_store.service import Service
from transcript_store.service_models import (
    AdmitRequest,
    AppendRequest,
    AssembleRequest,
    BootstrapRequest,
    CommitTurnRequest,
    CompactRequest,
    DeltaRequest,
    OpenSession,
)
from transcript_store.settings import load_settings

A, B = "scope-a", "scope-b"
SMALL = {"fresh_tail_messages": 2, "leaf_chunk_messages": 4, "max_rounds": 4, "leaf_summary_tokens": 60,
         "condensed_summary_tokens": 80, "condense_fanin": 2}


def commit(service: Service, scope: str, engine: str, sid: str, n: int, secret: str) -> None:
    """Turn ``n`` of a mirrored conversation (entries n.u, n.a) committed to ``engine``."""
    body = {
        "advancement_key": f"K{n}",
        "admission": {"entry_id": f"{n}.u", "position": 2 * n},
        "terminal": {"entry_id": f"{n}.a", "position": 2 * n + 1},
        "messages": [{"role": "user", "content": f"{secret} question {n} " + "words " * 40},
                     {"role": "assistant", "content": f"{secret} answer {n} " + "more " * 40}],
    }
    result = service.commit_turn(scope, engine, sid, CommitTurnRequest.model_validate(body))
    assert result.status == "committed", result


def populate(service: Service, scope: str, sids: list[str], turns: int = 8) -> None:
    """The same session ids and keys in each scope, a secret of the scope in every message; committed to
    both engines (the lossless one compacted into summaries)."""
    for sid in sids:
        secret = f"secret of {scope}"
        service.open_session(scope, OpenSession(session_id=sid, session_key=f"key-{sid}"))
        for n in range(turns):
            commit(service, scope, "lossless" if sid != "legacy-only" else "legacy", sid, n, secret)
        for _ in range(turns // 8):  # B's longer s1 compacts more often: more summaries
            service.compact(scope, "lossless", sid, CompactRequest(force=True, token_budget=400))


@pytest.fixture
def world(store: TranscriptStore) -> tuple[Service, LegacyEngine, LosslessEngine]:
    """Both scopes populated alike; B also holds ``only-b``. Engines built over the same store."""
    service = Service(store, load_settings(config_path=None, engine="legacy",
                                           engine_config={"lossless": SMALL}))
    populate(service, A, ["s1"])
    populate(service, B, ["s1", "only-b"], turns=20)  # more summaries in B's s1 than in A's
    return service, *make_engines(store, SMALL)


def test_the_service_and_the_engines_never_cross_scopes(
    request: pytest.FixtureRequest, backend: str, store: TranscriptStore,
    world: tuple[Service, LegacyEngine, LosslessEngine],
) -> None:
    started = time.monotonic()
    service, legacy, lossless = world
    request.addfinalizer(service.runtime.dispose)
    # Scope B's rows of every table with a scope column; the SQLite full-text index's shadow tables have
    # none (they change with any write): B's index is checked by the lossless audit after the writes.
    with store.db.engine.connect() as conn:
        schema = inspect(conn)
        scoped_tables = [t for t in schema.get_table_names() if "scope" in {c["name"] for c in schema.get_columns(t)}]
    b_before = table_rows(store, B, names=scoped_tables)
    only_b_summaries = [json.loads(lossless.handle_tool_call("lcm_describe", {"id": f"sum_{n}"}, scope=B,
                                                             session_id="only-b")) for n in range(1, 4)]
    assert all("error" not in s for s in only_b_summaries), only_b_summaries  # B has them: A must not

    # 1. The session only B has answers in A exactly as a session nobody has, and nothing is written.
    msg = {"role": "user", "content": "probe"}
    by_session: dict[str, Callable[[str], Any]] = {
        "Service.get_session": lambda s: service.get_session(A, s),
        "Service.delta": lambda s: service.delta(A, s, DeltaRequest()),
        "Service.append": lambda s: service.append(A, s, AppendRequest.model_validate({"items": [{"message": msg}]})),
        "Service.admit": lambda s: service.admit(A, s, AdmitRequest.model_validate({"message": msg, "turn_id": "T"})),
        **{f"Service.{op}({engine})": call for engine in ("legacy", "lossless") for op, call in {
            "bootstrap_state": lambda s, e=engine: service.bootstrap_state(A, e, s),
            "bootstrap": lambda s, e=engine: service.bootstrap(A, e, s, BootstrapRequest()),
            "assemble": lambda s, e=engine: service.assemble(A, e, s, AssembleRequest(token_budget=4000)),
            "compact": lambda s, e=engine: service.compact(A, e, s, CompactRequest(force=True)),
            "maintain": lambda s, e=engine: service.maintain(A, e, s),
            "receipts": lambda s, e=engine: service.receipts(A, e, s),
            "commit_turn": lambda s, e=engine: commit(service, A, e, s, 0, "probe"),
        }.items()},
        "LegacyEngine.assemble": lambda s: legacy.assemble(scope=A, session_id=s, fence=None, token_budget=4000),
        "LegacyEngine.compact": lambda s: legacy.compact(scope=A, session_id=s, force=True),
        "LosslessEngine.bootstrap": lambda s: lossless.bootstrap(scope=A, session_id=s, fence=None),
        "LosslessEngine.assemble": lambda s: lossless.assemble(scope=A, session_id=s, fence=None, token_budget=4000),
        "LosslessEngine.compact": lambda s: lossless.compact(scope=A, session_id=s, force=True),
        "LosslessEngine.maintain": lambda s: lossless.maintain(scope=A, session_id=s),
        "LosslessEngine.after_turn": lambda s: lossless.after_turn(scope=A, session_id=s),
        "LosslessEngine.budget": lambda s: lossless.budget(A, s),
        **{f"LosslessEngine.handle_tool_call({tool})": call for tool, call in {
            "lcm_grep": lambda s: lossless.handle_tool_call("lcm_grep", {"pattern": "secret"}, scope=A, session_id=s),
            "lcm_describe": lambda s: lossless.handle_tool_call("lcm_describe", {"id": "sum_1"}, scope=A, session_id=s),
            "lcm_expand": lambda s: lossless.handle_tool_call("lcm_expand", {"id": "sum_1"}, scope=A, session_id=s),
        }.items()},
    }
    names = {"only-b": "<sid>", "nowhere": "<sid>"}
    compared = 0
    for name, call in by_session.items():
        before = table_rows(store)
        foreign, unknown = outcome(lambda c=call: c("only-b"), names), outcome(lambda c=call: c("nowhere"), names)
        assert foreign == unknown, f"{name}: B's session answers {foreign}, an unknown one {unknown}"
        assert "secret of" not in foreign[1], f"{name} leaked: {foreign}"
        assert table_rows(store) == before, f"{name} wrote something"
        compared += 1

    # 2. On A's own s1 (B has an s1 too), the recall tools and the engines see A's text only.
    # A summary id B's s1 has and A's s1 has not answers as one nobody has.
    counts = {scope: len([n for n in range(1, 40) if "error" not in json.loads(lossless.handle_tool_call(
        "lcm_describe", {"id": f"sum_{n}"}, scope=scope, session_id="s1"))]) for scope in (A, B)}
    assert counts[B] > counts[A] > 0, counts
    for tool in ("lcm_describe", "lcm_expand"):
        only_b, nobody = (lossless.handle_tool_call(tool, {"id": f"sum_{n}"}, scope=A, session_id="s1")
                          for n in (counts[B], 999))
        assert only_b.replace(f"sum_{counts[B]}", "<id>") == nobody.replace("sum_999", "<id>"), (only_b, nobody)
    for mode in ("regex", "full_text"):  # B's secret: no result (the answer echoes the pattern asked)
        found = json.loads(lossless.handle_tool_call("lcm_grep", {"pattern": "scope-b", "mode": mode},
                                                     scope=A, session_id="s1"))
        assert "error" not in found and found["results"] == [], found
    seen: list[str] = []
    for tool, args in [("lcm_grep", {"pattern": "secret"}), ("lcm_grep", {"pattern": "secret", "mode": "full_text"}),
                       *[("lcm_describe", {"id": f"sum_{n}"}) for n in range(1, 6)],
                       *[("lcm_expand", {"id": f"sum_{n}"}) for n in range(1, 6)]]:
        seen.append(lossless.handle_tool_call(tool, args, scope=A, session_id="s1"))
    seen.append(repr(lossless.assemble(scope=A, session_id="s1", fence=None, token_budget=100_000)))
    seen.append(repr(legacy.assemble(scope=A, session_id="s1", fence=None, token_budget=100_000)))
    seen.append(repr(service.assemble(A, "lossless", "s1", AssembleRequest(token_budget=100_000))))
    seen.append(repr(service.receipts(A, "lossless", "s1")))
    text = "\n".join(seen)
    assert "scope-b" not in text and "secret of scope-a" in text

    # 3. Writes in A, with the ids B uses, never change a row of B.
    writes: list[tuple[str, Callable[[], Any]]] = [
        ("Service.open_session(only-b)", lambda: service.open_session(A, OpenSession(session_id="only-b",
                                                                                       session_key="key-only-b"))),
        *[(f"Service.commit_turn({e}, only-b, K{n})", lambda e=e, n=n: commit(service, A, e, "only-b", n, "A's"))
          for e, n in (("lossless", 0), ("lossless", 1), ("legacy", 2))],
        ("Service.commit_turn(s1, K8)", lambda: commit(service, A, "lossless", "s1", 8, "A's")),
        ("Service.compact(s1)", lambda: service.compact(A, "lossless", "s1", CompactRequest(force=True,
                                                                                            token_budget=300))),
        ("Service.maintain(s1)", lambda: service.maintain(A, "lossless", "s1")),
        ("Service.bootstrap(only-b)", lambda: service.bootstrap(A, "lossless", "only-b", BootstrapRequest())),
        ("LosslessEngine.compact(only-b)", lambda: lossless.compact(scope=A, session_id="only-b", force=True,
                                                                    token_budget=300)),
        ("LegacyEngine.compact(s1)", lambda: legacy.compact(scope=A, session_id="s1", force=True,
                                                            token_budget=300)),
        ("LosslessEngine.handle_tool_call(lcm_grep, only-b)", lambda: lossless.handle_tool_call(
            "lcm_grep", {"pattern": "A's"}, scope=A, session_id="only-b")),
    ]
    for name, write in writes:
        write()
        assert table_rows(store, B, names=scoped_tables) == b_before, f"{name} in scope A changed scope B"
    for sid in ("s1", "only-b"):
        assert store.read(lambda c, s=sid: audit(c, B, s)).problems == [], sid
    legacy.dispose()
    lossless.dispose()
    report(request, backend, {
        "service_and_engine_apis_compared_with_unknown_ids": compared, "recall_calls_checked": 18,
        "cross_scope_writes_checked": len(writes), "leaks": 0, "seconds": round(time.monotonic() - started, 1),
    })
