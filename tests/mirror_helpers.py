"""Shared pieces of the host transcript mirror's tests (test_mirror_*.py): host messages, pages, turn
requests, what the store holds, and racing calls on threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from transcript_store import TranscriptStore
from transcript_store.mirror import Alignment, HostMessage, import_page, import_state
from transcript_store.service import Service
from transcript_store.service_models import AssembleRequest, CommitTurnRequest, CommitTurnResponse
from transcript_store.settings import load_settings

A = "scope-a"


def u(text: str) -> dict[str, Any]:
    """A user message."""
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, Any]:
    """An assistant message."""
    return {"role": "assistant", "content": text}


def hosted(*items: tuple[str | None, dict[str, Any]]) -> list[HostMessage]:
    """Host messages from (host id, message) pairs."""
    return [HostMessage(entry_id, message) for entry_id, message in items]


def page(
    s: TranscriptStore, session_id: str, cursor: str | None, next_cursor: str | None, messages: list[HostMessage],
    scope: str = A,
) -> Alignment:
    """Import one host page in a transaction of its own."""
    return s.write(
        lambda c: import_page(c, s.config, scope, session_id, cursor=cursor, next_cursor=next_cursor, messages=messages)
    )[0]


def visible(s: TranscriptStore, session_id: str, scope: str = A) -> list[tuple[str, Any]]:
    """The visible transcript as (entry id, message)."""
    return [(e.entry_id, e.message) for e in s.read_visible(scope, session_id)]


def every_entry(s: TranscriptStore, session_id: str, scope: str = A) -> list[tuple[str, int | None, bool]]:
    """Every stored entry of the session (any branch): its id, position and whether it is active."""
    rows = s.read(lambda c: c.all_rows(scope, session_id, -1, 1_000_000))
    return [(r.entry_id, r.position, active) for r, active in rows]


def state_of(s: TranscriptStore, session_id: str, scope: str = A) -> tuple[str | None, int]:
    """The import's resume point: (host cursor, position)."""
    st = s.read(lambda c: import_state(c, scope, session_id))
    return st.cursor, st.position


def turn_request(key: str, start: int, messages: list[dict[str, Any]], ids: tuple[str, str]) -> CommitTurnRequest:
    """A commit_turn request for ``messages`` at ``start``, its ends named ``ids``."""
    return CommitTurnRequest.model_validate(
        {
            "advancement_key": key,
            "admission": {"entry_id": ids[0], "position": start},
            "terminal": {"entry_id": ids[1], "position": start + len(messages) - 1},
            "messages": messages,
        }
    )


def legacy_service(store: TranscriptStore) -> Iterator[Service]:
    """A service on the legacy engine over a module's store (a fixture's body)."""
    svc = Service(store, load_settings(config_path=None, engine="legacy"))
    yield svc
    svc.runtime.dispose()  # not close(): the module's store outlives it


def commit(svc: Service, session_id: str, req: CommitTurnRequest) -> CommitTurnResponse:
    """commit_turn through the legacy engine in scope A."""
    return svc.commit_turn(A, "legacy", session_id, req)


def race(calls: list[Callable[[], Any]]) -> list[tuple[str, Any]]:
    """Run the calls at once, one thread each, released together; ("ok", result) or ("err", exception)."""
    gate = threading.Barrier(len(calls))
    out: list[tuple[str, Any]] = [("err", None)] * len(calls)

    def run(i: int) -> None:
        gate.wait()
        try:
            out[i] = ("ok", calls[i]())
        except Exception as e:  # reported to the test, which asserts on it
            out[i] = ("err", e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a racing call hung"
    return out


def shown(svc: Service, session_id: str, scope: str = A) -> list[Any]:
    """What the legacy engine assembles: each message's content."""
    out = svc.assemble(scope, "legacy", session_id, AssembleRequest(token_budget=100_000))
    return [m["content"] for m in out.messages]
