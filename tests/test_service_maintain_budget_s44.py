"""``POST .../maintain`` takes the host's token budget, on both backends.

The request had no budget: the lossless engine compacted against the last ``assemble`` budget the service
process had seen for the session, else the service's default. A fresh service process (a restart, another
replica) or an assemble with another budget made maintenance compact against the wrong window: too big,
and a context over the host's window was "under the threshold". An optional ``token_budget`` (1 to
100,000,000, as assemble's; 422 outside) is now used when given; without it nothing changed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from engines.lossless import LosslessEngine
from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.errors import InvalidInput
from transcript_store.service import Service, TokenMap
from transcript_store.service_app import create_app
from transcript_store.settings import load_settings

TOKEN = "maintain-budget-token-0123456789"
SCOPE = "scope-maintain-s44"


def call(app: Any, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request through the ASGI app in this process: (status, JSON answer)."""
    raw = b"" if body is None else json.dumps(body).encode()
    headers = [(b"authorization", f"Bearer {TOKEN}".encode()), (b"content-type", b"application/json"),
               (b"content-length", str(len(raw)).encode())]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
        "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1234),
    }
    sent: list[dict[str, Any]] = []
    given = [False]

    async def receive() -> dict[str, Any]:
        if given[0]:
            await asyncio.sleep(3600)
        given[0] = True
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


@pytest.fixture
def apps(store: TranscriptStore) -> Iterator[tuple[Any, Any]]:
    """Two service processes' apps over one store (the lossless engine)."""
    services = [Service(store, load_settings(config_path=None, engine="lossless")) for _ in range(2)]
    yield tuple(create_app(s, TokenMap([(TOKEN, SCOPE)])) for s in services)  # type: ignore[misc]
    for s in services:
        s.runtime.dispose()


def imported(app: Any) -> str:
    """A session whose lossless copy holds 40 messages, some 6,000 tokens: under the service's default
    budget's threshold, over that of a budget of 4,000."""
    sid = f"s-{uuid.uuid4().hex[:12]}"
    status, out = call(app, "POST", "/v1/sessions", {"session_id": sid})
    assert status == 200, out
    entries = [{"entry_id": f"h{i}", "message": {"role": "user" if i % 2 == 0 else "assistant",
                                                  "content": f"message {i} " * 60}} for i in range(40)]
    status, out = call(app, "POST", f"/v1/engines/lossless/sessions/{sid}/bootstrap",
                       {"page": {"cursor": None, "next_cursor": "c40", "entries": entries}, "done": True})
    assert status == 200 and out["imported"] == 40, out
    return sid


def test_maintain_compacts_against_the_budget_it_is_given(apps: tuple[Any, Any]) -> None:
    first, fresh = apps
    sid = imported(first)
    path = f"/v1/engines/lossless/sessions/{sid}"
    # The process remembers this assembly's budget, far above the host's window.
    status, out = call(first, "POST", f"{path}/assemble", {"token_budget": 1_000_000})
    assert status == 200, out
    status, out = call(first, "POST", f"{path}/maintain", {"token_budget": 4000})
    assert status == 200 and out["changed"] is True, out
    # A fresh process never saw an assembly: without a budget it keeps its default (as before) ...
    other = imported(fresh)
    path = f"/v1/engines/lossless/sessions/{other}"
    status, out = call(fresh, "POST", f"{path}/maintain", {})
    assert status == 200 and out["changed"] is False, out
    status, out = call(fresh, "POST", f"{path}/maintain", {"token_budget": None})
    assert status == 200 and out["changed"] is False, out
    # ... and with one, compacts against it
    status, out = call(fresh, "POST", f"{path}/maintain", {"token_budget": 4000})
    assert status == 200 and out["changed"] is True, out
    status, out = call(fresh, "POST", f"{path}/assemble", {"token_budget": 4000})
    assert status == 200 and out["estimated_tokens"] <= 4000, out


@pytest.mark.parametrize("budget", [0, -1, 100_000_001, 2**70, "4000", True, 4000.5, [4000]])
def test_a_budget_out_of_bounds_is_a_typed_422_and_changes_nothing(apps: tuple[Any, Any], budget: Any) -> None:
    app = apps[0]
    sid = imported(app)
    path = f"/v1/engines/lossless/sessions/{sid}"
    status, out = call(app, "POST", f"{path}/maintain", {"token_budget": budget})
    assert status == 422 and out["error"]["code"] == "invalid_request", out
    status, out = call(app, "POST", f"{path}/compact", {"force": False})
    assert status == 200 and out["compacted"] is False, out  # nothing compacted by the refused call


def test_the_openapi_schema_names_the_budget(apps: tuple[Any, Any]) -> None:
    status, doc = call(apps[0], "GET", "/openapi.json")
    assert status == 200
    field = doc["components"]["schemas"]["MaintainRequest"]["properties"]["token_budget"]
    bounded = next(f for f in field["anyOf"] if f.get("type") == "integer")
    assert (bounded["minimum"], bounded["maximum"]) == (1, 100_000_000), field
    assert "budget" in field.get("description", ""), field


@pytest.mark.parametrize("budget", [0, 100_000_001, True, "4000"])
def test_the_engines_maintain_refuses_a_bad_budget(store: TranscriptStore, budget: Any) -> None:
    """The library call checks the budget as compact's: InvalidInput, nothing run."""
    sid = store.create_session(SCOPE, session_id=f"s-{uuid.uuid4().hex[:12]}").session_id
    engine = LosslessEngine(EngineContext(store=store))
    with pytest.raises(InvalidInput, match="token_budget"):
        engine.maintain(scope=SCOPE, session_id=sid, token_budget=budget)
    assert engine.maintain(scope=SCOPE, session_id=sid, token_budget=4000).changed is False
