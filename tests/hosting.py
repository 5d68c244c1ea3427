"""Shared pieces for host/engine tests: a recording model and small test engines."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import event

from transcript_store.engine import AssembleResult, CompactResult, EngineContext, EngineInfo, TranscriptSemantics
from transcript_store.ledger import CommitResult, commit_turn_in, get_state, prepare_turn, put_state
from transcript_store.model import ModelResponse
from transcript_store.models import Anchor, DeltaPage

DURABLE = TranscriptSemantics(
    current_turn_fence="before-current-turn-entry-v1", turn_advancement_idempotency="atomic-idempotent-v1"
)


class RecordingModel:
    """A scripted stand-in model: answers 'reply to <text> (saw N messages)', calls a tool when asked."""

    name = "recording-model"

    def __init__(self) -> None:
        self.requests: list[list[dict[str, Any]]] = []
        self.tools: list[list[str]] = []
        self.fail_next: list[BaseException] = []

    def complete(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        max_tokens: int | None = None,
        timeout: float | None = None,
    ) -> ModelResponse:
        self.requests.append([dict(m) for m in messages])
        self.tools.append([t["function"]["name"] for t in tools or []])
        if self.fail_next:
            raise self.fail_next.pop(0)
        last = messages[-1]
        if last["role"] == "user" and "use tool" in str(last.get("content")):
            name = str(last["content"]).split("use tool", 1)[1].split()[0]
            call = {
                "id": f"call_{len(self.requests)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps({"query": "x"})},
            }
            msg: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif last["role"] == "tool":
            msg = {"role": "assistant", "content": f"tool said {last['content'][:40]}"}
        else:
            msg = {"role": "assistant", "content": f"reply to {last.get('content')} (saw {len(messages)} messages)"}
        return ModelResponse(
            message=msg, usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, model=self.name
        )


class CountingEngine:
    """A durable test engine: reads deltas up to the fence, counts committed turns in its state."""

    def __init__(self, ctx: EngineContext, engine_id: str = "counting", **info: Any) -> None:
        self.store = ctx.store
        fields: dict[str, Any] = {"id": engine_id, "name": "Counting", "transcript_semantics": DURABLE}
        fields.update(info)
        self.info = EngineInfo(**fields)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.cursor: dict[tuple[str, str], str | None] = {}
        self.seen: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def assemble(self, **kw: Any) -> AssembleResult:
        self.calls.append(("assemble", kw))
        key = (kw["scope"], kw["session_id"])
        seen = self.seen.setdefault(key, [])
        while True:
            r = self.store.read_visible_delta(kw["scope"], kw["session_id"], self.cursor.get(key), fence=kw["fence"])
            if not isinstance(r, DeltaPage):
                self.cursor[key] = getattr(r, "cursor", None)
                seen.clear()
                continue
            seen.extend(e.message for e in r.entries)
            self.cursor[key] = r.cursor
            if not r.has_more:
                break
        return AssembleResult(messages=list(seen), estimated_tokens=10 * len(seen))

    def commit_turn(
        self,
        *,
        tx: Any,
        advancement_key: str,
        admission: Anchor,
        terminal: Anchor,
        messages: list[dict[str, Any]],
        is_heartbeat: bool = False,
        **kw: Any,
    ) -> CommitResult:
        self.calls.append(("commit_turn", kw))

        def apply(c: Any, turn: Any) -> None:
            n = get_state(c, turn.scope, turn.session_id, turn.engine_id, "turns") or 0
            put_state(c, turn.scope, turn.session_id, turn.engine_id, "turns", n + 1)

        turn = prepare_turn(self.info.id, advancement_key, admission, terminal, messages, is_heartbeat=is_heartbeat)
        return commit_turn_in(tx, turn, apply)

    def compact(self, **kw: Any) -> CompactResult:
        self.calls.append(("compact", kw))
        return CompactResult(ok=True, compacted=False, reason="nothing to do")


def count_transactions(store: Any, run: Any) -> int:
    """How many transactions ``run()`` opened on the store's engine."""
    began: list[int] = []

    def on_begin(_conn: Any) -> None:
        began.append(1)

    event.listen(store.db.engine, "begin", on_begin)
    try:
        run()
    finally:
        event.remove(store.db.engine, "begin", on_begin)
    return len(began)


def store_writes(engine: Any) -> list[int]:
    """A counter of the write transactions a Hermes engine's store runs from now on (the real store's
    ``write``, counted as it is called)."""
    store = engine.runtime().store
    count, run = [0], store.write

    def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return run(fn, *args, **kwargs)

    store.write = counted
    return count


def compacted_lossless(store: Any, scope: str, sid: str, history: Sequence[dict[str, Any]], piece: int) -> Any:
    """A lossless engine over ``history`` (appended to the session; ``expand_max_chars``: ``piece``; the two
    newest messages its fresh tail), compacted once: its older messages under a leaf."""
    from engines.lossless import LosslessEngine  # the lossless engine's tests only
    from transcript_store.summarize import ExtractiveSummarizer
    from transcript_store.tokens import RoughEstimator

    store.append_many(scope, sid, [{"message": m} for m in history])
    engine = LosslessEngine(EngineContext(
        store=store, summarizer=ExtractiveSummarizer(), estimator=RoughEstimator(),
        config={"fresh_tail_messages": 2, "expand_max_chars": piece},
    ))
    engine.bootstrap(scope=scope, session_id=sid, fence=None)
    assert engine.compact(scope=scope, session_id=sid, force=True).compacted
    return engine


def terminate_when(
    proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str, pause: float = 0.001,
    signum: int = signal.SIGTERM,
) -> None:
    """Wait (two minutes at most) until ``ready()`` while ``proc`` runs (it ending first fails, naming
    ``what``), then send it ``signum`` (SIGTERM) and wait for its end."""
    deadline = time.monotonic() + 120
    while not ready():
        assert proc.poll() is None, f"the process ended before {what}"
        assert time.monotonic() < deadline, f"not within 120 s: {what}"
        time.sleep(pause)
    proc.send_signal(signum)
    proc.wait(timeout=120)
