"""The OpenClaw plugin (integrations/openclaw) given host values at the edge of what OpenClaw sends, against a
real ``transcript-store serve`` on each backend, driven through Node (tests/openclaw_calls_s43.mjs)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import under_ci
from service_process import ServiceProcess

ROOT = Path(__file__).resolve().parent.parent
ENGINE_MODULE = ROOT / "integrations" / "openclaw" / "src" / "engine.js"
DRIVER = Path(__file__).with_name("openclaw_calls_s43.mjs")
TOKEN = "tok-openclaw-s43-0123456789"
SCOPE = "scope-openclaw"


def _node() -> str:
    """Node 20 or newer; without it the test is skipped locally, and fails with CI=true."""
    node = shutil.which("node")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False).stdout if node else ""
    found = re.findall(r"\d+", version)
    if node is None or not found or int(found[0]) < 20:
        problem = f"node 20 or newer is needed, found {version.strip() or 'none'}"
        if under_ci():
            pytest.fail(f"CI=true: {problem}")
        pytest.skip(problem)
    return node


@pytest.fixture
def service(store_url: str, tmp_path: Path) -> Any:
    node = _node()
    proc = ServiceProcess(store_url, {TOKEN: SCOPE}, tmp_path / "serve.log").start()
    try:
        yield node, proc
    finally:
        proc.stop()


def run_driver(service: Any, engine: str, calls: list[dict[str, Any]],
               transcript: list[dict[str, Any]] | None = None, *, url: str | None = None) -> dict[str, Any]:
    """What tests/openclaw_calls_s43.mjs printed: the calls' results, or the error building the engine."""
    node, proc = service
    request = {"engineModule": str(ENGINE_MODULE), "serviceUrl": url or proc.url, "token": TOKEN, "engine": engine,
               "transcript": transcript or [], "calls": calls}
    done = subprocess.run([node, str(DRIVER)], input=json.dumps(request), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def drive(service: Any, engine: str, calls: list[dict[str, Any]],
          transcript: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each call's {result} or {error} from the plugin's engine, built against the service."""
    out = run_driver(service, engine, calls, transcript)
    assert "built" not in out, out
    results: list[dict[str, Any]] = out["results"]
    return results


SESSION = {"sessionId": "s-budget", "sessionKey": "agent:main:s-budget"}
HISTORY = [
    {"entryId": "e1", "message": {"role": "user", "content": "hello there", "timestamp": 1}},
    {"entryId": "e2", "message": {"role": "assistant", "content": [{"type": "text", "text": "hi"}],
                                  "api": "openai-completions", "provider": "fake", "model": "m", "usage": {},
                                  "stopReason": "stop", "timestamp": 2}},
]


@pytest.mark.parametrize("engine", ["lossless", "legacy"])
def test_a_token_budget_beyond_what_the_service_takes_still_assembles(service: Any, engine: str) -> None:
    """A host budget over the service's 100 million tokens (a model configured with a huge context window) or
    under one token was sent as it was: the service refused it (422), every assemble threw (OpenClaw then
    sends the model its own unassembled history: with lossless, which turns OpenClaw's compaction off, the
    whole of it), and an owned compaction answered that it did nothing."""
    budgets = [200_000_000, 1e21, 0.5]
    calls: list[dict[str, Any]] = [{"method": "bootstrap", "params": SESSION}]
    for budget in budgets:
        calls.append({"method": "assemble", "params": {**SESSION, "messages": [], "tokenBudget": budget}})
        calls.append({"method": "compact", "params": {**SESSION, "force": True, "tokenBudget": budget}})
    results = drive(service, engine, calls, HISTORY)
    assert "error" not in results[0], results[0]
    for i, budget in enumerate(budgets):
        assembled, compacted = results[1 + 2 * i], results[2 + 2 * i]
        assert "error" not in assembled, (budget, assembled)
        assert isinstance(assembled["result"]["estimatedTokens"], int)
        if budget >= 1:
            assert [m["role"] for m in assembled["result"]["messages"]] == ["user", "assistant"]
        assert "error" not in compacted, (budget, compacted)
        assert compacted["result"]["ok"] is True, (budget, compacted)


def test_a_service_url_with_a_query_or_fragment_is_refused_when_the_engine_is_built(service: Any) -> None:
    """The plugin appended each API path to the whole URL: with a query (`?x=1`) or a fragment (`#a`) every
    request went to the service's `/` (the path became part of the query, or was dropped with the
    fragment), and the engine's build failed as `GET /v1/engines/lossless: not found`, as if the engine
    did not exist; `install-line` printed such a URL into the config. The URL is refused for what it is
    (never quoted: a query can hold a secret); a bare `?` is no query and is dropped."""
    _, proc = service
    for url in (f"{proc.url}/?secret=s3cr3t", f"{proc.url}#s3cr3t", f"{proc.url}/?secret=s3cr3t#a"):
        out = run_driver(service, "lossless", [], url=url)
        assert "built" in out, (url, out)
        message = out["built"]["message"]
        assert "query" in message and "fragment" in message, (url, message)
        assert "s3cr3t" not in message
    out = run_driver(service, "lossless", [{"method": "bootstrap", "params": SESSION}], url=f"{proc.url}/?")
    assert out.get("results") == [{"result": {"bootstrapped": True, "importedMessages": 0}}], out


def test_install_line_refuses_a_service_url_with_a_query_or_fragment() -> None:
    """install-line checks the URL the plugin will use (scheme, no credentials): one with a query or a fragment
    was printed into openclaw.json, where the plugin could never reach the service with it."""
    from transcript_store.errors import InvalidInput
    from transcript_store.openclaw import install_instructions

    for url in ("http://127.0.0.1:8765/?secret=s3cr3t", "http://127.0.0.1:8765/#s3cr3t"):
        with pytest.raises(InvalidInput) as refused:
            install_instructions(url)
        assert "query" in str(refused.value) and "s3cr3t" not in str(refused.value)
    assert install_instructions("http://127.0.0.1:8765/base/")["config"]["plugins"]["entries"][
        "transcript-store"]["config"]["serviceUrl"] == "http://127.0.0.1:8765/base"
