"""An engine's description (GET /v1/engines/{engine}) carries the service's limits, as it enforces them.

A client that sizes what it sends (the OpenClaw plugin cuts oversized messages and turns) reads the
entry cap, the turn cap and the body limit of the service it talks to instead of assuming the defaults:
a service started with a lower entry cap (TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES) or --max-body says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from service_process import ServiceProcess
from test_service import TOKEN_A, TOKENS, open_session

from transcript_store.fences import MAX_TURN_BYTES

MiB = 1024 * 1024


def test_the_default_limits_are_described(store_url: str, tmp_path: Path) -> None:
    with ServiceProcess(store_url, TOKENS, tmp_path / "serve.log") as server:
        for engine in ("legacy", "lossless"):
            status, described = server.call("GET", f"/v1/engines/{engine}", TOKEN_A)
            assert status == 200, described
            assert described["limits"] == {
                "max_entry_bytes": 4 * MiB, "max_turn_bytes": MAX_TURN_BYTES, "max_body_bytes": 8 * MiB}
            assert described["id"] == engine and described["durable"] is True  # the rest as it was
        status, doc = server.call("GET", "/openapi.json", TOKEN_A)
        assert status == 200
        ref = doc["paths"]["/v1/engines/{engine}"]["get"]["responses"]["200"]["content"]["application/json"]
        schema = doc["components"]["schemas"][ref["schema"]["$ref"].rsplit("/", 1)[1]]
        assert "limits" in schema["required"]


def test_lowered_limits_are_described_and_are_the_ones_enforced(store_url: str, tmp_path: Path) -> None:
    env = {"TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES": str(MiB)}
    with ServiceProcess(store_url, TOKENS, tmp_path / "serve.log", env=env,
                        extra_args=("--max-body", str(3 * MiB))) as server:
        status, described = server.call("GET", "/v1/engines/legacy", TOKEN_A)
        assert status == 200
        limits = described["limits"]
        assert limits == {"max_entry_bytes": MiB, "max_turn_bytes": MAX_TURN_BYTES, "max_body_bytes": 3 * MiB}
        open_session(server, session_id="s-limits")
        path = "/v1/sessions/s-limits/entries"

        def append(size: int) -> tuple[int, object]:
            # a message whose compact JSON (what the store weighs) is ``size`` bytes
            around = len(json.dumps({"role": "user", "content": ""}, separators=(",", ":")))
            message = {"role": "user", "content": "x" * (size - around)}
            return server.call("POST", path, TOKEN_A, {"items": [{"message": message}]})

        assert append(limits["max_entry_bytes"])[0] == 200
        status, data = append(limits["max_entry_bytes"] + 1)
        assert status == 413 and data["error"]["code"] == "payload_too_large", data  # type: ignore[index]
        status, data = server.call("POST", path, TOKEN_A, raw=b" " * (limits["max_body_bytes"] + 1))
        assert status == 413 and data["error"]["code"] == "request_too_large", data  # type: ignore[index]
