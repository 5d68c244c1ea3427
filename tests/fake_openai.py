"""A small OpenAI-compatible chat-completions server for tests (stdlib only, loopback only).

It answers ``POST /v1/chat/completions`` (and ``/chat/completions``) with the deterministic
``LocalResponder`` logic, as one JSON body or, with ``"stream": true``, as server-sent-event chunks
(role, content pieces, ``tool_calls`` deltas with ``index``, a final chunk with ``finish_reason``, a usage
chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``). ``GET /v1/models`` lists the
one model. Every request is recorded for assertions. Faults are queued per request (a delay to provoke
client timeouts, an HTTP status, or a scripted reply) or set for all requests.

In a test::

    with FakeOpenAI() as server:
        model = OpenAIChatModel(server.base_url, "fake-model")
        server.queue(Fault(status=500))          # the next request fails
        server.queue(Fault(delay=2.0))           # the one after answers after 2 s
        ...
        assert server.chat_requests[-1]["messages"][-1]["role"] == "user"

From a shell (for Hermes / OpenClaw interop runs)::

    python tests/fake_openai.py --port 8399 [--api-key KEY] [--delay 0.5] [--fail-status 500]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType, TracebackType
from typing import Any

from transcript_store.errors import InvalidInput
from transcript_store.model import LocalResponder

DEFAULT_MODEL = "fake-model"
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
MODELS_PATHS = ("/v1/models", "/models")


@dataclass(frozen=True)
class Fault:
    """What the server does to one request: wait ``delay`` seconds, then fail with ``status`` or send ``reply``."""

    delay: float = 0.0
    status: int | None = None
    message: str = "injected failure"
    code: str | None = None  # the error object's ``code`` (e.g. "context_length_exceeded")
    reply: dict[str, Any] | None = None  # an assistant message to answer with instead of the responder's


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it (``body`` is the parsed JSON, or None)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float = field(default_factory=time.monotonic)


class FakeOpenAI:
    """An OpenAI-compatible test server on 127.0.0.1 (port 0 picks a free one); a context manager."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = DEFAULT_MODEL,
        api_key: str | None = None,
        delay: float = 0.0,
        fail_status: int | None = None,
        responder: LocalResponder | None = None,
        chunk_chars: int = 12,
    ) -> None:
        """A server not yet started; ``api_key`` set means requests without that bearer key get 401."""
        self.model = model
        self.api_key = api_key
        self.delay = delay
        self.fail_status = fail_status
        self.responder = responder or LocalResponder(name=model)
        self.chunk_chars = chunk_chars
        self.requests: list[RecordedRequest] = []
        self._faults: deque[Fault] = deque()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._counter = 0
        self._thread: threading.Thread | None = None
        self.httpd = ThreadingHTTPServer((host, port), _handler_class(self))
        self.httpd.daemon_threads = True  # a handler sleeping in a delay never blocks shutdown

    # ------------------------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self.httpd.server_address[1])

    @property
    def base_url(self) -> str:
        """The OpenAI base URL to hand to clients, ``http://127.0.0.1:PORT/v1``."""
        host = self.httpd.server_address[0]
        return f"http://{host if isinstance(host, str) else host.decode()}:{self.port}/v1"

    def start(self) -> FakeOpenAI:
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"fake-openai:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: wake delayed handlers, shut the loop down, close the socket."""
        self._stopping.set()
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> FakeOpenAI:
        """Start on entry."""
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        """Stop on exit."""
        self.stop()

    # ------------------------------------------------------------------------------------ control

    def queue(self, *faults: Fault) -> None:
        """Apply these faults to the next chat requests, one each, in order."""
        with self._lock:
            self._faults.extend(faults)

    def reset(self) -> None:
        """Forget recorded requests and queued faults; clear the global delay and failure."""
        with self._lock:
            self.requests.clear()
            self._faults.clear()
        self.delay, self.fail_status = 0.0, None

    @property
    def chat_requests(self) -> list[dict[str, Any]]:
        """The JSON bodies of the chat-completion requests received so far, in order."""
        with self._lock:
            return [r.body for r in self.requests if r.path in CHAT_PATHS and isinstance(r.body, dict)]

    # ------------------------------------------------------------------------------------ answering

    def _record(self, request: RecordedRequest) -> Fault:
        """Record a request and take the fault that applies to it (queued faults go to chat requests only)."""
        chat = request.method == "POST" and request.path in CHAT_PATHS
        with self._lock:
            self.requests.append(request)
            self._counter += 1
            queued = self._faults.popleft() if chat and self._faults else None
        if queued is not None:
            return queued
        return Fault(delay=self.delay, status=self.fail_status)

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self._stopping.wait(seconds)

    def completion(self, body: dict[str, Any], fault: Fault) -> tuple[dict[str, Any], str, dict[str, int]]:
        """The assistant message, finish reason and usage for a request body."""
        messages = body.get("messages")
        tools = body.get("tools")
        if not isinstance(messages, list) or not messages:
            raise InvalidInput("'messages' must be a non-empty array")
        if tools is not None and not isinstance(tools, list):
            raise InvalidInput("'tools' must be an array")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if fault.reply is not None:
            message, finish = dict(fault.reply), "tool_calls" if fault.reply.get("tool_calls") else "stop"
        else:
            message, finish = self.responder.reply(messages, tools, max_tokens=max_tokens)
        estimator = self.responder.estimator
        prompt = estimator.count_messages(messages) + (estimator.count_text(json.dumps(tools)) if tools else 0)
        completion = estimator.count_messages([message])
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return message, finish, usage

    def next_id(self) -> str:
        """A fresh completion id."""
        with self._lock:
            return f"chatcmpl-fake{self._counter:06d}"

    def chunks(
        self, ident: str, model: str, message: dict[str, Any], finish: str, usage: dict[str, int] | None
    ) -> Iterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects that stream ``message``."""
        created = int(time.time())

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

        yield chunk({"role": "assistant", "content": ""})
        content = message.get("content") or ""
        for i in range(0, len(content), self.chunk_chars):
            yield chunk({"content": content[i:i + self.chunk_chars]})
        for index, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function", {})
            yield chunk({"tool_calls": [{"index": index, "id": call.get("id"), "type": "function",
                                         "function": {"name": function.get("name"), "arguments": ""}}]})
            arguments = function.get("arguments") or ""
            for i in range(0, len(arguments), self.chunk_chars):
                piece = arguments[i:i + self.chunk_chars]
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        yield chunk({}, finish)
        if usage is not None:
            yield {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage}


def _error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _handler_class(server: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to one FakeOpenAI."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "FakeOpenAI/1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read recorded requests instead
            return

        def _send_json(self, status: int, payload: Any) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if server.api_key is None:
                return True
            if self.headers.get("Authorization") == f"Bearer {server.api_key}":
                return True
            self._send_json(401, _error_body("Incorrect API key provided.", "invalid_request_error",
                                             "invalid_api_key"))
            return False

        def do_GET(self) -> None:
            server._record(RecordedRequest("GET", self.path, dict(self.headers), None))
            if self.path not in MODELS_PATHS:
                self._send_json(404, _error_body(f"no route {self.path}", "invalid_request_error"))
            elif self._authorized():
                self._send_json(200, {"object": "list", "data": [
                    {"id": server.model, "object": "model", "created": 0, "owned_by": "fake-openai"}]})

        def do_POST(self) -> None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                self._post()

        def _post(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body: Any = json.loads(raw) if raw else None
            except ValueError:
                body = None
            fault = server._record(RecordedRequest("POST", self.path, dict(self.headers), body))
            if self.path not in CHAT_PATHS:
                self._send_json(404, _error_body(f"no route {self.path}", "invalid_request_error"))
                return
            if not self._authorized():
                return
            server._wait(fault.delay)
            if fault.status is not None:
                kind = "server_error" if fault.status >= 500 else "invalid_request_error"
                self._send_json(fault.status, _error_body(fault.message, kind, fault.code))
                return
            if not isinstance(body, dict):
                self._send_json(400, _error_body("request body must be a JSON object", "invalid_request_error"))
                return
            try:
                message, finish, usage = server.completion(body, fault)
            except (InvalidInput, TypeError, KeyError, AttributeError) as e:
                self._send_json(400, _error_body(f"invalid request: {e}", "invalid_request_error"))
                return
            model = str(body.get("model") or server.model)
            ident = server.next_id()
            if body.get("stream"):
                options = body.get("stream_options") or {}
                self._stream(ident, model, message, finish, usage if options.get("include_usage") else None)
                return
            self._send_json(200, {
                "id": ident, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": usage,
            })

        def _stream(
            self, ident: str, model: str, message: dict[str, Any], finish: str, usage: dict[str, int] | None
        ) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in server.chunks(ident, model, message, finish, usage):
                self.wfile.write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode("utf-8") + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM: ``python tests/fake_openai.py --port N``."""
    parser = argparse.ArgumentParser(description="OpenAI-compatible fake chat-completions server (loopback)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (keep it on loopback)")
    parser.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (printed)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--api-key", default=None, help="require this bearer key")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait before every answer")
    parser.add_argument("--fail-status", type=int, default=None, help="answer every chat request with this status")
    args = parser.parse_args(argv)
    server = FakeOpenAI(host=args.host, port=args.port, model=args.model, api_key=args.api_key,
                        delay=args.delay, fail_status=args.fail_status)

    def _stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    print(f"fake-openai listening on {server.base_url}", flush=True)
    try:
        server.httpd.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
