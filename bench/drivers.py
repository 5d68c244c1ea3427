"""What the benchmarks drive: an instant model, the host runtime, finished turns, bulk loads, row counts."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event

from transcript_store import Admission, Anchor, AppendItem, TranscriptStore
from transcript_store.core import Core
from transcript_store.host import HostRuntime
from transcript_store.model import ModelResponse
from transcript_store.settings import HostSettings
from transcript_store.store import admit_in
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator

from .raw import RawStore
from .workload import TOOL_NAME, Turn, Workload

SCOPE = "bench"
TURNS_PER_SESSION = 8
_USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


class InstantModel:
    """A model that answers at once with the scripted replies of the current turn (no provider call)."""

    name = "bench-instant"

    def __init__(self) -> None:
        self.script: list[ModelResponse] = []

    def complete(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        max_tokens: int | None = None,
        timeout: float | None = None,
    ) -> ModelResponse:
        """The next scripted reply."""
        return self.script.pop(0)


@dataclass
class Plan:
    """A turn to run: where it goes, its id, its messages."""

    session_id: str
    turn_id: str
    first_seq: int
    turn: Turn


def plan_turns(workload: Workload, count: int, prefix: str) -> list[Plan]:
    """``count`` turns, TURNS_PER_SESSION per session in order (sessions stay short: no compaction)."""
    plans = []
    for i in range(count):
        session, k = divmod(i, TURNS_PER_SESSION)
        plans.append(Plan(f"{prefix}-s{session:05d}", f"{prefix}-t{i:06d}", k * 4, workload.turn()))
    return plans


def create_sessions(store: TranscriptStore, plans: Sequence[Plan]) -> None:
    """Create the sessions of some plans (untimed setup: one transaction per 500 sessions)."""
    ids = sorted({p.session_id for p in plans})
    for at in range(0, len(ids), 500):
        chunk = ids[at : at + 500]

        def create(c: Core, chunk: list[str] = chunk) -> None:
            for sid in chunk:
                c.create_session(SCOPE, sid, f"agent:bench:{sid}")

        store.write(create)


class HostDriver:
    """Full durable turns through the host runtime with the legacy engine and an instant model."""

    def __init__(self, store: TranscriptStore) -> None:
        self.store = store
        self.model = InstantModel()
        self._tool_result = ""
        schema = {
            "type": "function",
            "function": {
                "name": TOOL_NAME,
                "description": "Look up reference notes.",
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
            },
        }
        # A budget far above a session's size: compaction is not what this measures.
        settings = HostSettings(engine="legacy", token_budget=1_000_000)
        self.host = HostRuntime(
            store,
            settings,
            self.model,
            summarizer=ExtractiveSummarizer(),
            estimator=RoughEstimator(),
            host_tools={TOOL_NAME: (schema, lambda _args: self._tool_result)},
        )

    def script(self, plan: Plan) -> Callable[[], object]:
        """The timed operation of one turn (its model replies prepared outside the timing)."""
        responses = [
            ModelResponse(message=plan.turn.call, usage=_USAGE, model=InstantModel.name),
            ModelResponse(message=plan.turn.final, usage=_USAGE, model=InstantModel.name),
        ]
        tool_result = plan.turn.tool["content"]

        def run() -> object:
            self.model.script = list(responses)
            self._tool_result = tool_result
            outcome = self.host.run_turn(SCOPE, plan.session_id, plan.turn.user, turn_id=plan.turn_id)
            if outcome.commit_status != "committed":
                raise RuntimeError(f"turn {plan.turn_id} ended {outcome.commit_status}")
            return outcome

        return run


def raw_op(raw: RawStore, plan: Plan) -> Callable[[], None]:
    """The raw baseline's operation for one turn: its four rows in one transaction."""
    return lambda: raw.insert_turn(plan.session_id, plan.first_seq, plan.turn.messages)


@dataclass
class Finished:
    """A turn already in the transcript (admitted, replies appended), ready for commit_turn."""

    plan: Plan
    admission: Admission
    terminal: Anchor


def finish_turns(store: TranscriptStore, plans: Sequence[Plan]) -> list[Finished]:
    """Admit and append every planned turn (one transaction per session: untimed setup)."""
    out: list[Finished] = []
    by_session: dict[str, list[Plan]] = {}
    for p in plans:
        by_session.setdefault(p.session_id, []).append(p)
    for sid, group in by_session.items():
        prepared = [
            (
                p,
                store.prepare_admission(p.turn.user, turn_id=p.turn_id),
                store.prepare([AppendItem(message=m) for m in p.turn.replies]),
            )
            for p in group
        ]

        def run(c: Core, sid: str = sid, prepared: Any = prepared) -> list[Finished]:
            done = []
            for plan, admission_item, replies in prepared:
                admission = admit_in(c, SCOPE, sid, admission_item)
                last = c.append(SCOPE, sid, replies)[-1]
                sess = c.require_session(SCOPE, sid)
                terminal = c.anchor_for(sess, c.entry_row(SCOPE, sid, last.entry_id))
                done.append(Finished(plan, admission, terminal))
            return done

        out.extend(store.write(run))
    return out


def bulk_append(
    store: TranscriptStore,
    session_id: str,
    messages: Sequence[dict[str, Any]],
    batch: int = 2000,
    every_4_batches: Callable[[], None] | None = None,
) -> None:
    """Load a long transcript through the public ``append_many``, ``batch`` messages per transaction."""
    for n, at in enumerate(range(0, len(messages), batch), start=1):
        store.append_many(SCOPE, session_id, [AppendItem(message=m) for m in messages[at : at + batch]])
        if every_4_batches is not None and n % 4 == 0:
            every_4_batches()


class RowCounter:
    """Rows the driver hands to SQLAlchemy, and statements executed, on one store's connections.

    Each pooled connection gets a counting row factory at checkout (sqlite3 ``row_factory``, psycopg
    ``row_factory``), so every row a query returns is counted, whatever code path fetched it; a
    ``before_cursor_execute`` listener counts statements. Use it on a store of its own: the factories
    stay on its connections.
    """

    def __init__(self, store: TranscriptStore) -> None:
        self.rows = 0
        self.statements = 0
        self.transactions = 0
        engine = store.db.engine
        sqlite = store.backend == "sqlite"

        def count_sqlite(_cursor: Any, row: tuple[Any, ...]) -> tuple[Any, ...]:
            self.rows += 1
            return row

        def count_pg(_cursor: Any) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
            def make(values: Sequence[Any]) -> tuple[Any, ...]:
                self.rows += 1
                return tuple(values)

            return make

        @event.listens_for(engine, "checkout")
        def _checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
            dbapi_conn.row_factory = count_sqlite if sqlite else count_pg

        @event.listens_for(engine, "before_cursor_execute")
        def _statement(*_args: Any) -> None:
            self.statements += 1

        @event.listens_for(engine, "begin")
        def _begin(*_args: Any) -> None:
            self.transactions += 1

    def take(self) -> dict[str, int]:
        """Rows, statements and transactions since the last take."""
        out = {"rows": self.rows, "statements": self.statements, "transactions": self.transactions}
        self.rows = self.statements = self.transactions = 0
        return out


def payload_chars(messages: Sequence[dict[str, Any]]) -> int:
    """Characters of JSON the messages serialize to (for the record)."""
    return sum(len(json.dumps(m)) for m in messages)
