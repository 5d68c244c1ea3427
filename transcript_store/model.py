"""The small pluggable Model interface the host runtime calls: messages and tools in, one assistant message out.

Two models ship: ``LocalResponder``, a deterministic offline stand-in that exercises tool calls (it is not a
language model), and ``OpenAIChatModel`` for any OpenAI-compatible ``/chat/completions`` endpoint.
``model_from_settings`` picks one from explicit arguments, then OPENAI_BASE_URL / OPENAI_API_KEY /
TRANSCRIPT_STORE_MODEL; without a URL the local responder answers, so everything works offline.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from .errors import InvalidInput, ModelError, ModelTimeout
from .tokens import RoughEstimator, TokenEstimator

DEFAULT_OPENAI_MODEL = "gpt-4o-mini"
LOCAL_MODEL_NAME = "local-responder"
#: words that make the local responder reach for a tool when tools are offered
TOOL_WORDS = ("look up", "lookup", "search", "find", "time", "calculate", "compute", "weather")


class ModelResponse(BaseModel):
    """One completion: the assistant message (possibly with tool_calls), token usage, the answering model."""

    model_config = ConfigDict(frozen=True)

    message: dict[str, Any]
    usage: dict[str, int]
    model: str
    finish_reason: str | None = None


@runtime_checkable
class Model(Protocol):
    """A chat model: OpenAI-format messages and tool schemas in, one assistant message out."""

    name: str

    def complete(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        max_tokens: int | None = None,
        timeout: float | None = None,
    ) -> ModelResponse:
        """Answer the conversation; ModelTimeout when the provider timed out, ModelError on other failures."""
        ...


def _positive_seconds(what: str, value: object, *, optional: bool) -> None:
    """A timeout in seconds: a positive finite number (None when ``optional``), else InvalidInput."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        shown = repr(value) if isinstance(value, int | float) else type(value).__name__
        raise InvalidInput(f"{what} must be a positive finite number of seconds, not {shown}")


def check_request(messages: object, tools: object, max_tokens: object, timeout: object) -> None:
    """The arguments of ``Model.complete`` checked (InvalidInput): a non-empty sequence of message dicts, None
    or a sequence of tool dicts, a ``max_tokens`` of None or a positive integer, a ``timeout`` of None or a
    positive finite number of seconds. The host passes no other; a library caller could, and a string limit,
    a tool that was no dict or a NaN timeout surfaced as TypeError, AttributeError or ValueError."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidInput("complete() needs a non-empty list of message dicts")
    if not all(isinstance(m, dict) for m in messages):
        raise InvalidInput("complete() needs a non-empty list of message dicts")
    if tools is not None and (
        isinstance(tools, str | bytes) or not isinstance(tools, Sequence) or not all(isinstance(t, dict) for t in tools)
    ):
        raise InvalidInput("tools must be None or a list of tool schemas (dicts)")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        shown = repr(max_tokens) if isinstance(max_tokens, int) else type(max_tokens).__name__
        raise InvalidInput(f"max_tokens must be None or a positive integer, not {shown}")
    _positive_seconds("timeout", timeout, optional=True)


# ------------------------------------------------------------------------------------------- local responder


def _digest(*parts: str) -> bytes:
    """A stable hash of some texts (Python's ``hash`` is salted per process; this is not)."""
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).digest()


def message_text(message: dict[str, Any]) -> str:
    """The plain text of a message's content: a string, or the text parts of a part list joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _excerpt(text: str, limit: int) -> str:
    """Whitespace collapsed, cut to ``limit`` characters with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


def _schema_value(prop_name: str, prop: dict[str, Any], text: str) -> Any:
    """A deterministic argument value for one JSON-schema property, taken from the user's text when possible."""
    if isinstance(prop.get("enum"), list) and prop["enum"]:
        return prop["enum"][0]
    kind = prop.get("type", "string")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    number = re.search(r"-?\d+(?:\.\d+)?", text)
    if kind == "integer":
        return int(float(number.group())) if number else 1
    if kind == "number":
        return float(number.group()) if number else 1.0
    if kind == "boolean":
        return True
    if kind == "array":
        return [_excerpt(text, 100)]
    if kind == "object":
        return {}
    if prop_name.lower() in ("city", "location", "place", "country", "timezone", "tz", "name"):
        proper = re.findall(r"(?<=\s)[A-Z][\w/-]+", text)  # a capitalised word after the first: a place
        if proper:
            return proper[-1]
    if prop_name.lower() in ("expression", "expr", "formula"):
        expression = re.search(r"[-+(\d][\d\s.+\-*/()]*[\d)]", text)
        if expression and re.search(r"\d\s*[-+*/]\s*[\d(]", expression.group()):
            return expression.group().strip()
    return _excerpt(text, 200)


def _tool_arguments(tool: dict[str, Any], text: str) -> str:
    """JSON arguments for a tool: the required properties (else the first one) filled from the text."""
    function = tool.get("function")
    params = function.get("parameters") if isinstance(function, dict) else None
    params = params if isinstance(params, dict) else {}
    props = params.get("properties")
    props = props if isinstance(props, dict) else {}
    required = params.get("required")
    required = required if isinstance(required, list) else []
    names = [n for n in required if isinstance(n, str) and n in props] or list(props)[:1]
    args = {name: _schema_value(name, props[name] if isinstance(props[name], dict) else {}, text) for name in names}
    return json.dumps(args, ensure_ascii=False, sort_keys=True)


_GENERIC_WORDS = frozenset({"get", "set", "run", "the", "and", "for", "tool", "call", "use", "make"})


def _stems(text: str) -> set[str]:
    """Six-letter stems of the words of a text or tool name (``calculate`` meets ``calculator``)."""
    words = re.findall(r"[a-z]+", text.lower().replace("_", " "))
    return {w[:6] for w in words if len(w) >= 3 and w not in _GENERIC_WORDS}


def _tool_name(tool: dict[str, Any]) -> str:
    """The function name of an OpenAI tool schema."""
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidInput("a tool schema needs function.name")
    return name


class LocalResponder:
    """A deterministic local STAND-IN for a model, not a language model: canned, predictable replies.

    It exists so the gateway, the CLI and the tests run offline and still exercise the host's tool loop:

    - last message from the user, tools offered, and the text asks for something tool-worthy (it contains
      one of ``TOOL_WORDS``, or, for about one user text in three, a stable hash says so): one tool call to
      an offered tool (one whose name appears in the text, else one picked by the hash), arguments filled
      from the tool's JSON schema and the user's text;
    - last message a tool result: a final answer quoting the result;
    - otherwise: a reply echoing the user's last text and ``I see N messages of context``, so tests can
      check what context reached the model.

    The same messages and tools always give the same reply, ids included (a retried turn gets the same
    answer). Usage is counted with ``RoughEstimator``. Fault injection for demos: ``fail_every=N`` makes
    every Nth call (per instance) raise ModelTimeout; ``timeout_predicate(messages)`` returning True does
    too.
    """

    def __init__(
        self,
        *,
        name: str = LOCAL_MODEL_NAME,
        estimator: TokenEstimator | None = None,
        fail_every: int | None = None,
        timeout_predicate: Callable[[Sequence[dict[str, Any]]], bool] | None = None,
    ) -> None:
        """A local responder; ``fail_every`` / ``timeout_predicate`` inject ModelTimeout for fault demos."""
        bad_every = isinstance(fail_every, bool) or not isinstance(fail_every, int) or fail_every < 1
        if fail_every is not None and bad_every:
            raise InvalidInput("fail_every must be None or an integer of at least 1")
        self.name = name
        self.estimator: TokenEstimator = estimator or RoughEstimator()
        self.fail_every = fail_every
        self.timeout_predicate = timeout_predicate
        self.calls = 0
        self._lock = threading.Lock()

    def complete(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        max_tokens: int | None = None,
        timeout: float | None = None,
    ) -> ModelResponse:
        """A deterministic reply: a tool call, an answer quoting a tool result, or an echo of the user."""
        check_request(messages, tools, max_tokens, timeout)
        with self._lock:
            self.calls += 1
            call_number = self.calls
        if self.fail_every is not None and call_number % self.fail_every == 0:
            raise ModelTimeout(f"{self.name}: injected timeout on call {call_number} (fail_every={self.fail_every})")
        if self.timeout_predicate is not None and self.timeout_predicate(messages):
            raise ModelTimeout(f"{self.name}: injected timeout (timeout_predicate)")
        message, finish = self.reply(messages, tools, max_tokens=max_tokens)
        return ModelResponse(message=message, usage=self._usage(messages, tools, message), model=self.name,
                             finish_reason=finish)

    def reply(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, *, max_tokens: int | None
    ) -> tuple[dict[str, Any], str]:
        """The assistant message and finish reason for ``messages`` (no fault injection, no usage)."""
        last = messages[-1]
        user_text = next((message_text(m) for m in reversed(messages) if m.get("role") == "user"), "")
        if last.get("role") == "user" and tools and self.wants_tool(user_text):
            return self._tool_call(messages, tools, user_text), "tool_calls"
        if last.get("role") == "tool":
            content = self._answer_from_tool(messages, user_text)
        else:
            content = (f'(local responder) You said: "{_excerpt(user_text, 160)}". '
                       f"I see {len(messages)} messages of context.")
        return self._fit({"role": "assistant", "content": content}, max_tokens)

    @staticmethod
    def wants_tool(text: str) -> bool:
        """Whether a user text is tool-worthy: a tool word, or (about one text in three) by a stable hash."""
        lowered = text.lower()
        return any(word in lowered for word in TOOL_WORDS) or _digest(text)[0] % 3 == 0

    def _tool_call(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], user_text: str
    ) -> dict[str, Any]:
        said = _stems(user_text)
        named = [t for t in tools if _stems(_tool_name(t)) & said]
        pool = named or list(tools)
        key = _digest(user_text, str(len(messages)))
        tool = pool[key[1] % len(pool)]
        call = {
            "id": "call_" + key.hex()[:24],
            "type": "function",
            "function": {"name": _tool_name(tool), "arguments": _tool_arguments(tool, user_text)},
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    @staticmethod
    def _answer_from_tool(messages: Sequence[dict[str, Any]], user_text: str) -> str:
        result = messages[-1]
        call_id = result.get("tool_call_id")
        names = (
            c.get("function", {}).get("name")
            for m in reversed(messages)
            for c in (m.get("tool_calls") or [])
            if isinstance(c, dict) and c.get("id") == call_id
        )
        tool = next(names, None) or result.get("name") or "the tool"
        return (f'(local responder) {tool} returned: "{_excerpt(message_text(result), 200)}". '
                f'That answers "{_excerpt(user_text, 120)}". I see {len(messages)} messages of context.')

    def _fit(self, message: dict[str, Any], max_tokens: int | None) -> tuple[dict[str, Any], str]:
        """Cut the content to ``max_tokens`` (finish reason ``length``), like a provider would."""
        content = message["content"]
        if max_tokens is None or self.estimator.count_text(content) <= max_tokens:
            return message, "stop"
        lo, hi = 0, len(content)
        while lo < hi:  # longest prefix that fits
            mid = (lo + hi + 1) // 2
            if self.estimator.count_text(content[:mid]) <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        return {"role": "assistant", "content": content[:lo]}, "length"

    def _usage(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, message: dict[str, Any]
    ) -> dict[str, int]:
        prompt = self.estimator.count_messages(messages)
        if tools:
            prompt += self.estimator.count_text(json.dumps(list(tools), sort_keys=True))
        completion = self.estimator.count_messages([message])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---------------------------------------------------------------------------------------------- OpenAI HTTP


def mask_url(url: str) -> str:
    """The URL with any user:password part and every query value masked (for messages and logs): an
    endpoint's query may carry its key (``?key=...``, ``?api-key=...``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.query:
        pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        parts = parts._replace(query="&".join(f"{urllib.parse.quote(k)}=***" for k, _ in pairs))
    if parts.username is None and parts.password is None:
        return urllib.parse.urlunsplit(parts)
    # The host and port as written: ``parts.port`` raises ValueError for a port that is not a number.
    netloc = "***@" + parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def endpoint_url(base_url: str, path: str) -> str:
    """``base_url`` with ``path`` appended to its path, its query kept after it (``?api-version=...``)."""
    parts = urllib.parse.urlsplit(base_url)
    return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + path))


def _redact(text: str, secret: str | None) -> str:
    """``text`` with the secret replaced (providers sometimes echo the key back in errors)."""
    return text.replace(secret, "***") if secret else text


#: what is read of an error answer's body (bytes): an excerpt of it is all the error shows
_ERROR_BODY_BYTES = 4096


def _error_code(body: str) -> str | None:
    """The ``error.code`` of an OpenAI-style error answer (a short string), or None."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    error = answer.get("error") if isinstance(answer, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and 0 < len(code) <= 100 else None


#: what providers say when the request is over the model's context window (OpenAI, Anthropic-style
#: gateways, vLLM, llama.cpp): the code OpenAI sends, or words of the message
_OVERFLOW_CODES = frozenset({"context_length_exceeded", "context_window_exceeded"})
_OVERFLOW_TEXT = re.compile(
    r"context[ _]length[ _]exceeded|maximum context length|context[ _](?:length|window)[ _](?:is |was |has been )?"
    r"exceeded|exceeds? (?:the )?(?:model'?s? )?(?:maximum )?context (?:length|window)|prompt is too long",
    re.IGNORECASE,
)


def is_context_overflow(error: BaseException) -> bool:
    """Whether a model call failed because the provider found the request over the context window: an
    OpenAI-style 400 (or 413) with code ``context_length_exceeded``, or a message saying so."""
    if not isinstance(error, ModelError) or isinstance(error, ModelTimeout):
        return False
    if error.code in _OVERFLOW_CODES:
        return True
    return error.status in (400, 413) and _OVERFLOW_TEXT.search(str(error)) is not None


def _error_body(error: urllib.error.HTTPError, deadline: float) -> str:
    """The start of an HTTP error answer's body, or "" when it cannot be read by the deadline."""
    if getattr(error, "fp", None) is None:  # an error raised without an answer to read
        return ""
    try:
        return _read_answer(error, deadline, limit=_ERROR_BODY_BYTES).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException, _ResponseTooLarge):
        return ""


#: the largest answer read from a model endpoint (bytes): a completion is kilobytes, and a server that
#: streams without end must not fill the host's memory
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
#: what one read of an answer takes at most (bytes)
_CHUNK = 64 * 1024


class _ResponseTooLarge(Exception):
    """An answer past MAX_RESPONSE_BYTES."""


def _read_answer(response: Any, deadline: float, *, limit: int | None = None) -> bytes:
    """The whole body of ``response``, by the deadline and within MAX_RESPONSE_BYTES (``limit``: its first
    ``limit`` bytes at most, the rest unread).

    urllib's timeout bounds each socket read, not the answer: a server trickling a byte before every
    timeout held the turn for ever. The deadline is checked after each read (``read1``: what one read
    returns, not a full buffer), so an answer takes at most the timeout and one more read.
    """
    chunks: list[bytes] = []
    size = 0
    while limit is None or size < limit:
        if time.monotonic() > deadline:
            raise TimeoutError("the answer did not finish in time")
        chunk = response.read1(_CHUNK)
        if not chunk:
            break
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise _ResponseTooLarge()
        chunks.append(chunk)
    body = b"".join(chunks)
    return body if limit is None else body[:limit]


def post_chat_completion(
    base_url: str, payload: dict[str, Any], *, api_key: str | None, timeout: float
) -> dict[str, Any]:
    """POST ``payload`` to ``{base_url}/chat/completions``; the JSON answer, or ModelTimeout / ModelError."""
    url = endpoint_url(base_url, "/chat/completions")
    where = mask_url(url)
    headers = {"Content-Type": "application/json", "Accept": "application/json", "User-Agent": "transcript-store"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as e:  # no JSON (an object, a cycle), a lone surrogate
        raise InvalidInput(f"the request to the model is no JSON it can be sent as: {type(e).__name__}") from None
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    deadline = time.monotonic() + timeout
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = _read_answer(response, deadline)
    except _ResponseTooLarge:
        raise ModelError(f"model endpoint {where} answered more than {MAX_RESPONSE_BYTES} bytes") from None
    except urllib.error.HTTPError as e:
        text = _error_body(e, deadline)
        excerpt = _redact(_excerpt(text, 300), api_key)
        # 408 and 504 are the provider (or its gateway) timing out: the same turn may simply be retried
        error = ModelTimeout if e.code in (408, 504) else ModelError
        raise error(
            f"model endpoint {where} answered HTTP {e.code}: {excerpt}", status=e.code, code=_error_code(text)
        ) from None
    except TimeoutError as e:
        raise ModelTimeout(f"model endpoint {where} timed out after {timeout:g}s") from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise ModelTimeout(f"model endpoint {where} timed out after {timeout:g}s") from e
        raise ModelError(f"model endpoint {where} unreachable: {_redact(str(e.reason), api_key)}") from e
    except (OSError, http.client.HTTPException) as e:  # reset or cut off mid-response, TLS failures
        raise ModelError(f"model endpoint {where} failed: {type(e).__name__}: {_redact(str(e), api_key)}") from e
    try:
        answer = json.loads(raw)
    except ValueError:
        excerpt = _redact(_excerpt(raw.decode("utf-8", "replace"), 200), api_key)
        raise ModelError(f"model endpoint {where} returned non-JSON: {excerpt}") from None
    if not isinstance(answer, dict):
        raise ModelError(f"model endpoint {where} returned JSON that is not an object")
    return answer


def _usage_ints(usage: Any) -> dict[str, int]:
    """The integer fields of a provider's usage object (nested detail objects are dropped)."""
    out = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    if isinstance(usage, dict):
        out.update({k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)})
    if not out["total_tokens"]:
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


class OpenAIChatModel:
    """A model behind an OpenAI-compatible ``/chat/completions`` endpoint (non-streaming, stdlib HTTP)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 60.0) -> None:
        """Talk to ``base_url`` (e.g. ``https://api.openai.com/v1``) as ``model``; ``timeout`` in seconds."""
        if not isinstance(base_url, str):
            raise InvalidInput(f"model URL must be a string, not {type(base_url).__name__}")
        if not isinstance(model, str) or not model:
            raise InvalidInput("model name must be a non-empty string")
        if api_key is not None and not isinstance(api_key, str):
            raise InvalidInput(f"api key must be a string or None, not {type(api_key).__name__}")
        _positive_seconds("model timeout", timeout, optional=False)
        if not base_url.startswith(("http://", "https://")):
            raise InvalidInput(f"model URL must start with http:// or https://, not {mask_url(base_url)!r}")
        try:  # else the first turn fails, after the chat's session was written
            split = urllib.parse.urlsplit(base_url)
        except ValueError as e:  # an unclosed IPv6 bracket: not shown (mask_url cannot split it either)
            raise InvalidInput(f"model URL is no URL: {e}") from None
        try:
            _port = split.port
        except ValueError as e:  # not a number, or not in 0..65535
            raise InvalidInput(f"model URL {mask_url(base_url)!r}: bad port: {e}") from None
        if "@" in split.netloc:  # urllib takes no credentials in the URL
            raise InvalidInput(
                f"model URL {mask_url(base_url)!r}: credentials in the URL are not sent; pass the key with "
                "--api-key or OPENAI_API_KEY"
            )
        if not split.hostname:  # http:// or http:///v1: every turn failed on "no host given"
            raise InvalidInput(f"model URL {mask_url(base_url)!r} names no host")
        parts = urllib.parse.urlsplit(base_url)
        self.base_url = urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/")))
        self.name = model
        self.timeout = timeout
        self._api_key = api_key

    def __repr__(self) -> str:
        """Shows the endpoint and model, never the key."""
        return f"OpenAIChatModel(base_url={mask_url(self.base_url)!r}, model={self.name!r})"

    def complete(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        max_tokens: int | None = None,
        timeout: float | None = None,
    ) -> ModelResponse:
        """One non-streaming completion; ModelTimeout on timeouts, ModelError on HTTP and protocol failures."""
        check_request(messages, tools, max_tokens, timeout)
        payload: dict[str, Any] = {"model": self.name, "messages": list(messages)}
        if tools:
            payload["tools"] = list(tools)
        if max_tokens is not None:
            payload["max_tokens"] = max_tokens
        answer = post_chat_completion(
            self.base_url, payload, api_key=self._api_key, timeout=timeout if timeout is not None else self.timeout
        )
        choices = answer.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        message = first.get("message") if isinstance(first, dict) else None
        if not isinstance(message, dict):
            error = answer.get("error")
            detail = _excerpt(json.dumps(error, ensure_ascii=False), 200) if error else "no choices[0].message"
            raise ModelError(f"model endpoint {mask_url(self.base_url)} returned no message: {detail}")
        # providers send null or empty fields (refusal, audio, tool_calls: []) that are not part of the message
        message = {k: v for k, v in message.items() if (v is not None and v != []) or k == "content"}
        message.setdefault("role", "assistant")
        if message.get("content") is None and not message.get("tool_calls"):
            message["content"] = ""
        return ModelResponse(
            message=message,
            usage=_usage_ints(answer.get("usage")),
            model=str(answer.get("model") or self.name),
            finish_reason=first.get("finish_reason") if isinstance(first, dict) else None,
        )


def _env(name: str) -> str | None:
    """An environment variable, with the empty string meaning unset."""
    value = os.environ.get(name, "").strip()
    return value or None


def model_from_settings(model_url: str | None, model: str | None, api_key: str | None) -> Model:
    """Explicit arguments, else OPENAI_BASE_URL / TRANSCRIPT_STORE_MODEL / OPENAI_API_KEY; no URL: LocalResponder."""
    url = model_url or _env("OPENAI_BASE_URL")
    if not url:
        return LocalResponder()
    name = model or _env("TRANSCRIPT_STORE_MODEL") or DEFAULT_OPENAI_MODEL
    return OpenAIChatModel(url, name, api_key or _env("OPENAI_API_KEY"))


__all__ = [
    "DEFAULT_OPENAI_MODEL",
    "LocalResponder",
    "Model",
    "ModelResponse",
    "OpenAIChatModel",
    "mask_url",
    "message_text",
    "model_from_settings",
    "post_chat_completion",
]
