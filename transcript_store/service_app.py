"""The HTTP face of ``Service``: routes, bearer-token scopes, a request size limit, JSON errors.

Every route needs ``Authorization: Bearer <token>``; the token's scope is the only scope the request
can touch. Errors are ``{"error": {"code": ..., "message": ...}}`` with a stable code per error type
(``ERRORS``); an unexpected exception is a 500 whose body carries only a correlation id, the traceback
going to the server log under the same id. Bodies over the size limit are refused with 413 while they
are read, whatever Content-Length claims; a body that stops coming is answered 408 and its connection
closed (uvicorn has no timeout for a request's body).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import functools
import json
import logging
import math
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator, MutableMapping, Sequence
from typing import Annotated, Any
from urllib.parse import unquote, unquote_to_bytes

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BeforeValidator
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match

from . import __version__
from .config import INTEGER_RULE, INTEGER_TEXT
from .engine import AssembleResult, CompactResult, MaintainResult
from .errors import (
    AdvancementKeyCollision,
    EngineContractError,
    EngineError,
    HostRequirementError,
    IdempotencyConflict,
    InvalidInput,
    InvalidMessage,
    MirrorConflict,
    PayloadTooLarge,
    PermissionDenied,
    ReadFenceError,
    SchemaNotCurrent,
    SessionKeyConflict,
    StorageFull,
    StoreUnavailable,
    TranscriptStoreError,
    TurnKeyConflict,
    UnknownEngine,
    UnknownEntry,
    UnknownSession,
)
from .ledger import DEFAULT_RECEIPTS_PAGE, MAX_RECEIPTS_PAGE, RECEIPT_CURSOR_CHARS
from .models import Admission, DeltaPage, DeltaReset, SessionInfo
from .service import InFlight, Service, TokenMap
from .service_models import (
    AdmitRequest,
    AppendRequest,
    AssembleRequest,
    BootstrapRequest,
    BootstrapResponse,
    BootstrapState,
    CommitTurnRequest,
    CommitTurnResponse,
    CompactRequest,
    DeltaRequest,
    EngineDescriptionWithLimits,
    EngineList,
    EntryList,
    ErrorBody,
    HostCompactionRequest,
    HostCompactionResponse,
    MaintainRequest,
    OpenSession,
    ReceiptList,
    ServiceLimits,
    SessionList,
    WhoAmI,
)

log = logging.getLogger("transcript_store.service")


DEFAULT_MAX_BODY = 8 * 1024 * 1024
#: seconds a request body may pause (between two reads, not in all) before its 408
DEFAULT_BODY_TIMEOUT = 30.0

#: error type -> (HTTP status, stable code); the first matching entry wins, so subclasses come first.
ERRORS: tuple[tuple[type[BaseException], int, str], ...] = (
    (UnknownSession, 404, "session_not_found"),
    (UnknownEntry, 404, "entry_not_found"),
    (UnknownEngine, 404, "engine_not_found"),
    (TurnKeyConflict, 409, "turn_key_conflict"),
    (AdvancementKeyCollision, 409, "advancement_key_collision"),
    (IdempotencyConflict, 409, "idempotency_conflict"),
    (SessionKeyConflict, 409, "session_key_conflict"),
    (ReadFenceError, 409, "read_fence"),
    (MirrorConflict, 409, "transcript_mirror"),
    (HostRequirementError, 409, "host_requirement"),
    (EngineContractError, 409, "engine_contract"),
    (PayloadTooLarge, 413, "payload_too_large"),
    (InvalidMessage, 400, "invalid_message"),
    (InvalidInput, 400, "invalid_input"),
    (SchemaNotCurrent, 503, "schema_not_current"),
    # the server's database refuses this role or file, or is full: no retry fixes them, an operator does
    (PermissionDenied, 503, "store_permission_denied"),
    (StorageFull, 503, "store_full"),
    (StoreUnavailable, 503, "store_unavailable"),
    (EngineError, 503, "engine_unavailable"),
    # Nothing untyped: an engine's own ValueError (a pydantic error of the result it returned among them) is
    # the server's fault, a 500 with a correlation id, never a 400 blaming the request.
)
#: FastAPI's detail for a request body it could not decode other than as malformed JSON
_BODY_NOT_PARSED = "There was an error parsing the body"
HTTP_CODES = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
              408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type"}
#: the header of an answer after which the connection cannot go on: its request's body was not all read
_CLOSE = {"Connection": "close"}

_ERROR_DOCS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (400, 401, 404, 405, 408, 409, 413, 415, 422, 500, 503)
}


def error_json(status: int, code: str, message: str, **extra: str | None) -> JSONResponse:
    """One error response in the service's shape."""
    detail: dict[str, Any] = {"code": code, "message": message}
    detail.update({k: v for k, v in extra.items() if v is not None})
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": detail}, status_code=status, headers=headers)


def error_for(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and stable code of a library error."""
    for kind, status, code in ERRORS:
        if isinstance(exc, kind):
            return status, code
    return 500, "internal_error"


# ---------------------------------------------------------------------------------------------- middleware


class _TooLarge(StarletteHTTPException):
    """Raised while reading a body past the limit; FastAPI passes HTTP exceptions through as they are."""

    def __init__(self, limit: int, *, stalled: bool = False) -> None:
        super().__init__(413, f"request bodies are limited to {limit} bytes", headers=_CLOSE if stalled else None)


class _Stalled(StarletteHTTPException):
    """Raised when a request's body pauses past the timeout: 408, and the connection closes."""

    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body stopped coming: nothing for {seconds:g} s", headers=_CLOSE)


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes (413), by Content-Length and while streaming, and bodies
    that pause ``timeout`` seconds (408).

    The excess is read and dropped (up to a few times the limit, ``timeout`` seconds in all) before the 413
    goes out: a server that answers and closes while the client is still sending makes the client see a
    reset, not the 413.
    """

    def __init__(self, app: Any, limit: int, timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        """Wrap an ASGI app."""
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        """Pass through, counting body bytes."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        receive = _patient(receive, self.timeout)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and not _length_within(value, self.limit):
                # A client waiting for 100 Continue has sent nothing yet: reading would invite the body.
                stalled = _expects_continue(scope) or not await _drain(receive, 4 * self.limit, self.timeout)
                response = error_json(413, "request_too_large", f"request bodies are limited to {self.limit} bytes")
                if stalled:
                    response.headers.update(_CLOSE)
                await response(scope, receive, send)
                return
        seen = 0
        asked = False  # whether anything inside read the body (asked for it: 100 Continue goes out then)

        async def counted() -> Any:
            nonlocal seen, asked
            asked = True
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    stalled = message.get("more_body", False) and not await _drain(
                        receive, 3 * self.limit, self.timeout
                    )
                    raise _TooLarge(self.limit, stalled=stalled)
            return message

        if not (_expects_continue(scope) and _body_announced(scope)):
            await self.app(scope, counted, send)
            return

        async def closing(message: Any) -> None:
            # Answered without reading the body (404, 405, 401, ...): the client never got its 100
            # Continue. It may send the body all the same or skip it and send its next request; the
            # server, reading the connection on, would take that request for the body. Closed instead.
            if message["type"] == "http.response.start" and not asked:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, counted, closing)


def _expects_continue(scope: MutableMapping[str, Any]) -> bool:
    """Whether the client waits for ``100 Continue`` before it sends the body (the server sends that
    when the body is first read: a request refused unread must not read it)."""
    return any(k == b"expect" and v.lower() == b"100-continue" for k, v in scope.get("headers", []))


def _body_announced(scope: MutableMapping[str, Any]) -> bool:
    """Whether the request announces a body (a Content-Length other than 0, or chunked): one without
    leaves nothing on the connection that a next request could be taken for."""
    for name, value in scope.get("headers", []):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip().lstrip(b"0") != b""):
            return True
    return False


def _length_within(value: bytes, limit: int) -> bool:
    """A Content-Length of ``limit`` bytes or fewer. Its digits are counted before ``int`` reads them:
    ``int`` refuses a string of more than 4,300 digits (a ValueError, not the 413 such a length is)."""
    digits = value.lstrip(b"0")
    return value.isdigit() and len(digits) <= len(str(limit)) and int(digits or b"0") <= limit


def _patient(receive: Any, seconds: float) -> Any:
    """``receive`` that raises _Stalled when the request's body pauses ``seconds``; once the body ended,
    ``receive`` as it is (a wait for the client's disconnect is no stalled body)."""
    ended = False

    async def timed() -> Any:
        nonlocal ended
        if ended:
            return await receive()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the read in a task of its own, and a
        # cancellation of the request (a shutdown, a client gone) that came as that task finished was
        # lost: the read's message returned and the request went on. The timeout reads in this task.
        try:
            async with asyncio.timeout(seconds):
                message = await receive()
        except TimeoutError:
            raise _Stalled(seconds) from None
        ended = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return timed


async def _drain(receive: Any, budget: int, seconds: float) -> bool:
    """Read and drop request body chunks until the body ends or ``budget`` bytes were dropped; False when
    it stalled instead, or was not over within ``seconds`` in all (the rest may never come: the answer
    closes the connection).

    The body of a refused request is dropped only so that the client reads the answer. Timed per read
    alone, a client without any token held its connection as long as it sent a byte before each pause
    ran out (8 MiB at one byte in 29 s), and enough such connections locked everyone out, as a head sent
    a byte at a time did before its deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while budget > 0:
        left = deadline - loop.time()
        if left <= 0:
            return False
        # Each read timed with what is left of the deadline, in this task (see ``_patient``).
        try:
            async with asyncio.timeout(left):
                message = await receive()
        except (_Stalled, TimeoutError):
            return False
        if message["type"] != "http.request":
            return True
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return True


class Authenticate:
    """401 for a request without a known bearer token, before anything else looks at it.

    The token was a dependency of each route: FastAPI parses a request's body before it solves those,
    and routes before both, so a request without a token had its body parsed (a malformed one was
    answered 422) and its path looked up (404, 405) before it was refused. Its body is read and dropped
    (at most what the body limit lets through, ``timeout`` seconds in all), so that the client reads the
    401, not a reset."""

    def __init__(self, app: Any, timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        """Wrap an ASGI app (the tokens are the app's ``state.tokens``, as ``caller`` reads them)."""
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        """Pass a request with a known token through; answer 401 to any other."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Exactly one header: of two, the first was taken, so another scope's token put in front of the
        # request's own (a proxy adding one, a client merging headers) reached that scope.
        headers = [v for k, v in scope.get("headers", []) if k == b"authorization"]
        token = bearer_token(headers[0].decode("latin-1")) if len(headers) == 1 else None
        tokens: TokenMap = scope["app"].state.tokens
        if token is not None and tokens.scope_for(token) is not None:
            await self.app(scope, receive, send)
            return
        response = error_json(401, "unauthorized", "a valid bearer token is required")
        await _refuse_unread(response, scope, receive, send, self.timeout)


async def _refuse_unread(
    response: JSONResponse, scope: MutableMapping[str, Any], receive: Any, send: Any, timeout: float
) -> None:
    """Send ``response`` to a request refused before its body was read: the body dropped first (at most
    what ``BodyLimit`` around lets through, ``timeout`` seconds in all) so that the client reads the
    answer, and the connection closed when it could not all be read."""
    if _expects_continue(scope):
        # Reading the body would tell the client to send it (100 Continue), for nothing: it is not read.
        complete = False
    else:
        try:
            complete = await _drain(receive, 1 << 62, timeout)  # bounded by BodyLimit around it (413)
        except _TooLarge as e:  # BodyLimit dropped the excess (closing only for a body that stalled)
            complete = not e.headers
    if not complete:
        response.headers.update(_CLOSE)
    await response(scope, receive, send)


class CatchAll:
    """Turn any exception that escaped the handlers into a 500 with a correlation id (logged here), and a
    request cancelled at shutdown into a 503 ``shutting_down``.

    The outermost of the service's middleware: a request is cut off wherever it waits when the graceful
    period ends, also while ``BodyLimit`` or ``Authenticate`` drop its body before any route (a 413, a
    401): inside them, such a request got uvicorn's plain-text 500. A client that closed its connection
    before its body was whole is logged (INFO), not answered: no internal error, nothing was done."""

    def __init__(self, app: Any) -> None:
        """Wrap an ASGI app."""
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        """Pass through; answer 500 when the response has not started."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            # The server stopped waiting for this request (shutdown past its graceful period). Its call
            # may still run in its thread, and complete: the client is told so, in the error shape,
            # rather than uvicorn's plain-text 500 (``Service.close`` waits for that call).
            log.warning("%s %s cancelled: the server is shutting down", scope.get("method"), scope.get("path"))
            if not started:
                response = error_json(503, "shutting_down", "the server is shutting down; this request may still "
                                      "be carried out: retry it once the service is back")
                response.headers.update(_CLOSE)
                await response(scope, receive, send)
        except ClientDisconnect:
            # The client closed its connection before its body was all sent: nothing was read whole, so
            # nothing ran, and nobody is left to answer. It was logged as an internal error (a 500 with a
            # traceback, which README calls a bug) for what a client's timeout or crash does every day.
            log.info("%s %s: the client disconnected before its request body was whole; nothing was done",
                     scope.get("method"), scope.get("path"))
        except Exception:
            cid = uuid.uuid4().hex[:16]
            log.exception("internal error %s on %s %s", cid, scope.get("method"), scope.get("path"))
            if not started:
                response = error_json(500, "internal_error", "internal error; see the server log", correlation_id=cid)
                if _expects_continue(scope) and _body_announced(scope):
                    # Outside BodyLimit, this answer misses its close of a body perhaps never invited.
                    response.headers.update(_CLOSE)
                await response(scope, receive, send)


# ---------------------------------------------------------------------------------------------- the app

_bearer = HTTPBearer(auto_error=False, description="a token from --tokens FILE or TRANSCRIPT_STORE_TOKENS")


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization`` value ``Bearer <token>`` (scheme in any case, then one or more
    spaces), with only spaces and tabs around it dropped; None for any other value."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip(" \t")
    return token if scheme.lower() == "bearer" and token else None


def caller(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    """The scope of the request's bearer token; 401 without a known one."""
    tokens: TokenMap = request.app.state.tokens
    # ``credentials`` (which declares the scheme in the OpenAPI document) has the token stripped of any
    # Unicode whitespace of the Latin-1 header: "tok\x85" or "\xa0tok" would open tok's scope. The token
    # is read again here with only the spaces around it dropped: it must be exactly a known token.
    token = bearer_token(request.headers.get("authorization")) if credentials is not None else None
    scope = tokens.scope_for(token) if token is not None else None
    if scope is None:
        raise StarletteHTTPException(401, "a valid bearer token is required")
    return scope


# ---------------------------------------------------------------------------------------------- ids in paths


def _encode_segment(segment: str) -> str:
    """A path segment as the routes see it: its ``%`` and ``/`` escaped, nothing else."""
    return segment.replace("%", "%25").replace("/", "%2F")


class _Segment(Convertor[str]):
    """A path parameter that is one segment of the path as sent (``{session_id:segment}``): the id itself,
    whatever characters it holds (see ``PathSegments``)."""

    regex = "[^/]+"

    def convert(self, value: str) -> str:
        """The id: the segment's ``%25`` and ``%2F`` decoded (the only escapes ``PathSegments`` leaves)."""
        return unquote(value)

    def to_string(self, value: str) -> str:
        """The segment of an id."""
        return _encode_segment(value)


register_url_convertor("segment", _Segment())


class HeadAsGet:
    """Answer ``HEAD`` on a route that takes ``GET`` as ``GET`` is answered, headers only (RFC 9110).

    FastAPI's routes answer only the methods they declare, so a ``HEAD`` was 405 everywhere. Here it runs
    as the ``GET`` (the same token, checks, status and ``Content-Length``) and its body is dropped; on a
    route without ``GET`` it is that ``GET``'s 405. A 405's ``Allow`` lists every method of every route of
    the path (the framework's named only the first route's: ``DELETE /v1/sessions`` answered
    ``Allow: POST``, though ``GET`` lists them), ``HEAD`` beside ``GET``."""

    def __init__(self, app: Any, routes: Sequence[BaseRoute] = ()) -> None:
        """Wrap an ASGI app; ``routes``: the app's routes, which a 405's ``Allow`` is made of."""
        self.app = app
        self.routes = routes

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on, a ``HEAD`` as a ``GET`` whose body is not sent."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = scope["method"] == "HEAD"
        scope = {**scope, "method": "GET"} if head else scope

        async def answer(message: Any) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                allowed = self._allowed(scope)
                message = {**message, "headers": [
                    (k, allowed) if allowed and k.lower() == b"allow" else _allow_head(k, v)
                    for k, v in message.get("headers", [])
                ]}
            elif head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app(scope, receive, answer)

    def _allowed(self, scope: MutableMapping[str, Any]) -> bytes:
        """The ``Allow`` of the request's path: the methods of every route it matches, in a fixed order
        (``HEAD`` with ``GET``); empty when no route has methods."""
        methods: set[str] = set()
        for route in self.routes:
            if route.matches(scope)[0] is not Match.NONE:
                methods |= set(getattr(route, "methods", None) or ())
        if "GET" in methods:
            methods.add("HEAD")
        return ", ".join(sorted(methods, key=lambda m: (_METHOD_ORDER.get(m, len(_METHOD_ORDER)), m))).encode()


#: the order of a 405's ``Allow``
_METHOD_ORDER = {m: i for i, m in enumerate(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))}


def _allow_head(name: bytes, value: bytes) -> tuple[bytes, bytes]:
    """A response header, an ``Allow`` that lists ``GET`` with ``HEAD`` added."""
    if name.lower() != b"allow":
        return name, value
    methods = [m.strip() for m in value.split(b",")]
    if b"GET" in methods and b"HEAD" not in methods:
        methods.append(b"HEAD")
    return name, b", ".join(methods)


class PathSegments:
    """Route on the path's segments as the client sent them.

    The server decodes the path before routing, so a session id holding a slash, sent as ``team%2Falice``,
    arrived as two segments: the service created such a session (its id in a JSON body) and then
    answered 404 on every route that names it. Here the path the routes match is rebuilt from the raw
    path, each segment decoded and only its ``%`` and ``/`` escaped again; every id parameter is a
    ``segment``, which decodes those two. A path that is not raw ASCII, or whose raw form does not decode
    to the server's path (a proxy rewrote one of them), is taken as the server decoded it: its segments
    as they are, ``%`` escaped.

    A path or query string whose percent-escapes decode to bytes that are not UTF-8 (``%FF``, an overlong
    form, a surrogate) is refused here, 400 ``invalid_input``, before any route: decoded, each bad byte
    was U+FFFD, and the request reached (and wrote to) the session whose id holds that character."""

    def __init__(self, app: Any, timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        """Wrap an ASGI app (``timeout``: how long a refused request's body is dropped, as ``Authenticate``)."""
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on with its path rebuilt (HTTP only); 400 for a path or query not UTF-8."""
        if scope["type"] == "http":
            problem = _not_utf8(scope)
            if problem is not None:
                response = error_json(400, "invalid_input", problem)
                await _refuse_unread(response, scope, receive, send, self.timeout)
                return
            scope = {**scope, "path": _route_path(scope)}
        await self.app(scope, receive, send)


def _not_utf8(scope: MutableMapping[str, Any]) -> str | None:
    """What in the request's raw path or query string percent-decodes to bytes that are not UTF-8, or None."""
    raw = scope.get("raw_path")
    if isinstance(raw, bytes):
        for segment in raw.split(b"?", 1)[0].split(b"/"):
            if not _utf8(unquote_to_bytes(segment)):
                shown = segment.decode("ascii", "backslashreplace")[:64]
                return f"the path segment {shown!r} is not UTF-8 once percent-decoded"
    query = scope.get("query_string") or b""
    if not query.isascii():  # read as Latin-1 by the framework: UTF-8 sent as is would become other characters
        return "the query string holds bytes that are not percent-encoded"
    for part in query.split(b"&"):  # as the framework splits it (parse_qsl)
        name, _, value = part.partition(b"=")
        for what, text in (("name", name), ("value", value)):
            if not _utf8(unquote_to_bytes(text.replace(b"+", b" "))):
                label = name.decode("ascii", "backslashreplace")[:64]
                return f"query parameter {what} of {label!r} is not UTF-8 once percent-decoded"
    return None


def _utf8(data: bytes) -> bool:
    """Whether ``data`` is UTF-8 (strict: no surrogates, no overlong forms)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _route_path(scope: MutableMapping[str, Any]) -> str:
    """The path the routes match: ``root_path`` as it is, the rest segment by segment (``PathSegments``)."""
    path: str = scope["path"]
    root: str = scope.get("root_path") or ""
    if not path.startswith(root):
        root = ""
    rest = path[len(root) :]
    raw = scope.get("raw_path")
    if isinstance(raw, bytes):
        try:
            text = raw.split(b"?", 1)[0].decode("ascii")
        except UnicodeDecodeError:
            text = None
        if text is not None and text.startswith(root):
            segments = [unquote(s) for s in text[len(root) :].split("/")]
            if "/".join(segments) == rest:
                return root + "/".join(map(_encode_segment, segments))
    return root + "/".join(map(_encode_segment, rest.split("/")))


Scope = Annotated[str, Depends(caller)]



def create_app(service: Service, tokens: TokenMap, *, max_body_bytes: int = DEFAULT_MAX_BODY,
               body_timeout_seconds: float = DEFAULT_BODY_TIMEOUT) -> FastAPI:
    """The ASGI app over ``service``; ``tokens`` decide each request's scope."""
    app = FastAPI(
        title="transcript-store",
        version=__version__,
        description="Durable transcripts, visible-delta reads and the context-engine lifecycle over HTTP. "
        "Every request needs a bearer token; the token's scope is the only scope it reaches.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        responses=_ERROR_DOCS,
        # A path with a trailing slash is no route (404 not_found), not a bodiless 307 to the path without
        # it: ``/v1/sessions/`` + an empty id answered the scope's session list, and a POST was re-sent.
        redirect_slashes=False,
    )
    app.state.tokens = tokens
    app.state.max_body_bytes = max_body_bytes
    app.router.route_class = _counted_route(service.inflight)
    _errors(app)
    _routes(app, service)
    app.add_middleware(HeadAsGet, routes=app.router.routes)  # innermost: a HEAD is routed as its GET
    app.add_middleware(PathSegments, timeout=body_timeout_seconds)
    app.add_middleware(Authenticate, timeout=body_timeout_seconds)  # inside BodyLimit: the body it drops is bounded
    app.add_middleware(BodyLimit, limit=max_body_bytes, timeout=body_timeout_seconds)
    app.add_middleware(CatchAll)  # outermost (added last): it answers whatever layer a request was in
    _protect_openapi(app)
    return app


def _counted_route(inflight: InFlight) -> type[APIRoute]:
    """FastAPI's route, its (synchronous) endpoint counted in ``inflight`` while it runs in its thread."""

    class Counted(APIRoute):
        def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
            if not asyncio.iscoroutinefunction(endpoint):
                inner = endpoint

                @functools.wraps(inner)  # FastAPI reads the signature through __wrapped__
                def endpoint(*args: Any, **kw: Any) -> Any:
                    with inflight.call():
                        return inner(*args, **kw)

            super().__init__(path, endpoint, **kwargs)

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            """The handler, after the query string is checked against the route's parameters."""
            handler = super().get_route_handler()
            allowed = _query_names(self.dependant)  # (APIRoute.__init__ calls this once its dependant is made)
            takes_body = self.body_field is not None

            async def checked(request: Request) -> Response:
                problem = _query_problem(request, allowed)
                if problem is not None:
                    await request.body()  # read and dropped (bounded by BodyLimit), as any refusal's
                    raise RequestValidationError([{"loc": ("query", problem[0]), "msg": problem[1],
                                                   "type": "extra_forbidden"}])
                if takes_body:
                    await _read_json_strictly(request)
                return await handler(request)

            return checked

    return Counted


def _query_names(dependant: Any) -> frozenset[str]:
    """The query parameters a route takes: its own and its dependencies' (FastAPI's ``Dependant`` tree)."""
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return frozenset(names)


def _query_problem(request: Request, allowed: frozenset[str]) -> tuple[str, str] | None:
    """A query parameter the route does not take, or one given twice: (its name, what is wrong), or None.

    Bodies refuse fields they do not know; a query parameter a route does not take was dropped, so a typo
    (``?sesion_key=x``) listed the whole scope, and of a parameter given twice the last one counted."""
    seen: set[str] = set()
    for name, _value in request.query_params.multi_items():
        if name not in allowed:
            return name[:64], "unknown query parameter" + (
                f" (this route takes {', '.join(sorted(allowed))})" if allowed else " (this route takes none)")
        if name in seen:
            return name, "query parameter given more than once"
        seen.add(name)
    return None


class _RepeatedKey(ValueError):
    """A JSON object of a request body names a key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One object of a request body; a key given twice is refused (json.loads kept the last one silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise _RepeatedKey(f"the key {key[:64]!r} appears twice in one object")
            seen.add(key)
    return out


async def _read_json_strictly(request: Request) -> None:
    """Parse a JSON request body before FastAPI does, refusing (422) an object that names a key twice, as
    ``sessions import`` refuses it: read with the last value kept, ``{"session_id": "a", "session_id": "b"}``
    created ``b``, and a message's second ``role`` replaced its first. The parsed body is left where
    ``Request.json`` caches it, so FastAPI does not parse it again; a body this parse fails on otherwise
    (malformed, not UTF-8, too deep) is left to FastAPI, which answers it as before."""
    if not _json_media(request.headers.get("content-type")):
        return
    body = await request.body()
    if not body:
        return
    try:
        parsed = json.loads(body, object_pairs_hook=_unique_keys)
    except _RepeatedKey as e:
        raise RequestValidationError([{"loc": ("body",), "msg": str(e), "type": "value_error"}]) from None
    except (ValueError, RecursionError):
        return
    request._json = parsed


def _errors(app: FastAPI) -> None:
    async def library(request: Request, exc: Exception) -> JSONResponse:
        status, code = error_for(exc)
        if status == 500:
            raise exc
        if isinstance(exc, StoreUnavailable):
            # The driver's message names the database's host, port and name: the client gets what kind
            # of failure it was ("cannot connect to the database", "database storage is full", ...),
            # the server log the whole message under the correlation id.
            cid = uuid.uuid4().hex[:16]
            log.warning("%s %s on %s %s: %s", code, cid, request.method, request.url.path, exc)
            kind = str(exc).split(":", 1)[0]
            return error_json(status, code, f"{kind}; see the server log", correlation_id=cid)
        return error_json(status, code, str(exc), reason=getattr(exc, "reason", None))

    async def http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400 and exc.detail == _BODY_NOT_PARSED:
            # FastAPI's answer to a body json.loads refused without a JSONDecodeError (invalid UTF-8, an
            # integer past Python's 4,300 digits, nesting past the recursion limit): malformed JSON
            # answers 422 invalid_request, so does every body that is not JSON.
            return error_json(422, "invalid_request", "body: not a JSON document this service can read")
        code = HTTP_CODES.get(exc.status_code, "http_error")
        response = error_json(exc.status_code, code, str(exc.detail))
        response.headers.update(exc.headers or {})  # Connection: close after a body not all read
        return response

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        left_out = {"loc": ("body",), "type": "missing"}
        if not _json_media(request.headers.get("content-type")) and any(
            tuple(e.get("loc", ()))[:1] == ("body",) and {"loc": tuple(e["loc"]), "type": e.get("type")} != left_out
            for e in errors
        ):
            # FastAPI reads a body as JSON only when it is sent as JSON: any other body (one without a
            # Content-Type too) stays bytes and fails the route's shape, a 422 blaming a body that may be
            # a valid one (``curl -d`` sends its JSON as a form). A body left out is still 422.
            return error_json(415, "unsupported_media_type", "request bodies are JSON: send Content-Type: "
                              "application/json")
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()))
        # A rule of a model's own validator: pydantic puts "Value error, " in front of its message.
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return error_json(422, "invalid_request", f"{where}: {message}")

    app.add_exception_handler(TranscriptStoreError, library)
    app.add_exception_handler(StarletteHTTPException, http)
    app.add_exception_handler(RequestValidationError, validation)


def _json_media(content_type: str | None) -> bool:
    """Whether a request's Content-Type lets FastAPI read its body as JSON: ``application/json`` or
    ``application/*+json`` (parameters aside), as FastAPI decides it (a body without one is not read)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _protect_openapi(app: FastAPI) -> None:
    """Serve /openapi.json to token holders only (every request is authenticated); the document is made at
    the first request for it, not at each start (~50 ms of a server's start)."""
    document: list[dict[str, Any]] = []

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(scope: Scope) -> dict[str, Any]:
        if not document:  # two first requests at once make it twice, the same document
            document.append(get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            ))
        return document[0]


IDEMPOTENCY_KEY_DOC = (
    "1 to 255 printable ASCII characters naming a request without a session_id: the same key again (a retry "
    "after a lost answer) answers the session the first request made instead of creating another; reused with "
    "another session_key it is 409 idempotency_conflict. Beside a session_id (a request idempotent by it) it "
    "is 400 invalid_input."
)


APPEND_KEY_DOC = (
    "1 to 255 printable ASCII characters naming this request: each item with neither an entry_id nor an "
    "idempotency_key takes the idempotency_key 'Idempotency-Key:<id derived from the header>:<its index>', so "
    "the same request again (a retry after a lost answer) answers the entries the first one appended instead "
    "of appending them again; another request under it (other content at an index, or items without an id or "
    "key at other indexes) is 409 idempotency_conflict, writing nothing. A request whose every item has an "
    "entry_id or idempotency_key is 400 invalid_input under a key no request used (it would key nothing); to a "
    "session the scope does not have, it is 404 session_not_found, as without the header."
)

#: why each writing route but these two refuses the header: what makes its retry safe instead
NO_KEY_ADMIT = "an admission is retried safely by its turn_id: the same turn_id again answers the same admission"
NO_KEY_BOOTSTRAP = (
    "an import page is retried safely by its page.cursor: a page that landed is refused on its retry (409 "
    "transcript_mirror cursor; GET .../bootstrap reads where the import resumes), and done runs the engine's "
    "bootstrap, which runs again over the same mirror"
)
NO_KEY_COMPACT = (
    "nothing keys a compaction, and its retry compacts again: with \"force\": false it compacts only a "
    "context over its budget, which a compaction that landed brought under it"
)
NO_KEY_HOST_COMPACTION = (
    "a host compaction is retried safely by its summary and first_kept_entry_id: the same compaction recorded "
    "again changes nothing"
)
NO_KEY_MAINTAIN = "a maintenance pass is retried safely as it is: it does only what is due"
NO_KEY_COMMIT = (
    "a commit_turn is retried safely by its advancement_key: the same key and turn again answer duplicate"
)


def _one_idempotency_key(request: Request) -> None:
    """InvalidInput when the request has several Idempotency-Key headers: which one it is would be a guess."""
    if len(request.headers.getlist("idempotency-key")) > 1:
        raise InvalidInput("one Idempotency-Key per request: this one has several")


def _no_idempotency_key(why: str) -> Any:
    """A dependency refusing an ``Idempotency-Key`` (400, before anything is written) on a writing route
    that has nothing to derive from it: ignored, a client counting on it for a safe retry was misled."""

    def refuse(request: Request, idempotency_key: str | None = None) -> None:
        if idempotency_key is not None or request.headers.getlist("idempotency-key"):
            raise InvalidInput(f"this route takes no Idempotency-Key: {why}; send the request without the header")

    # Set here, not written in the signature: annotations are strings in this module, and FastAPI resolves
    # them in the module's globals, where ``why`` is not. Declared, the header is documented in OpenAPI.
    refuse.__annotations__["idempotency_key"] = Annotated[
        str | None, Header(alias="Idempotency-Key", description=f"Refused (400 invalid_input): {why}.")
    ]
    return Depends(refuse)


def _decimal(value: Any) -> Any:
    """A query parameter's integer as written: an optional ``-`` and ASCII digits, nothing else.

    pydantic reads a string as Python's ``int`` does, so ``1_0``, ``+5``, `` 5``, ``5.0`` and other
    scripts' digits were taken as numbers; a query string is text a client wrote, read here as written."""
    if isinstance(value, str) and not INTEGER_TEXT.fullmatch(value):
        raise ValueError(INTEGER_RULE)  # the rule of the environment's and the CLI's integers too
    return value


#: the check of every integer query parameter (after ``Query(...)`` in its ``Annotated``: the document keeps
#: the bounds as ``minimum`` / ``maximum`` then)
DECIMAL = BeforeValidator(_decimal)


def _routes(app: FastAPI, service: Service) -> None:
    @app.get("/v1/whoami", response_model=WhoAmI, tags=["service"])
    def whoami(scope: Scope) -> WhoAmI:
        """The scope of the presented token."""
        return WhoAmI(scope=scope)

    @app.post("/v1/sessions", response_model=SessionInfo, tags=["sessions"])
    def open_session(
        scope: Scope,
        body: OpenSession,
        request: Request,
        idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", description=IDEMPOTENCY_KEY_DOC)] = None,
    ) -> SessionInfo:
        """Create a session by id (idempotent) or open the active session holding a key; a request without an
        id retries safely under an ``Idempotency-Key``."""
        _one_idempotency_key(request)
        return service.open_session(scope, body, idempotency_key)

    @app.get("/v1/sessions", response_model=SessionList, tags=["sessions"])
    def list_sessions(
        scope: Scope,
        session_key: Annotated[str | None, Query(max_length=255)] = None,
        after: Annotated[str | None, Query(max_length=255)] = None,
        limit: Annotated[int, Query(ge=1, le=10_000), DECIMAL] = 100,
    ) -> SessionList:
        """The active session holding ``session_key``, or the scope's sessions in id order."""
        return SessionList(sessions=service.list_sessions(scope, session_key, after, limit))

    @app.get("/v1/sessions/{session_id:segment}", response_model=SessionInfo, tags=["sessions"])
    def get_session(scope: Scope, session_id: str) -> SessionInfo:
        """One session."""
        return service.get_session(scope, session_id)

    @app.post("/v1/sessions/{session_id:segment}/delta", response_model=DeltaPage | DeltaReset, tags=["sessions"])
    def delta(scope: Scope, session_id: str, body: DeltaRequest) -> DeltaPage | DeltaReset:
        """Visible messages after a cursor: a page, or a reset to rebuild from."""
        return service.delta(scope, session_id, body)

    @app.post("/v1/sessions/{session_id:segment}/entries", response_model=EntryList, tags=["sessions"])
    def append(
        scope: Scope,
        session_id: str,
        body: AppendRequest,
        request: Request,
        idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", description=APPEND_KEY_DOC)] = None,
    ) -> EntryList:
        """Append entries at the head (idempotent per entry id / idempotency key, or under an
        ``Idempotency-Key`` for items with neither)."""
        _one_idempotency_key(request)
        return EntryList(entries=service.append(scope, session_id, body, idempotency_key))

    @app.post("/v1/sessions/{session_id:segment}/admissions", response_model=Admission, tags=["sessions"],
              dependencies=[_no_idempotency_key(NO_KEY_ADMIT)])
    def admit(scope: Scope, session_id: str, body: AdmitRequest) -> Admission:
        """Admit the user message of a logical turn."""
        return service.admit(scope, session_id, body)

    @app.get("/v1/engines", response_model=EngineList, tags=["engines"])
    def engines(scope: Scope) -> EngineList:
        """Every engine the service can run."""
        return EngineList(engines=service.engines())

    @app.get("/v1/engines/{engine:segment}", response_model=EngineDescriptionWithLimits, tags=["engines"])
    def describe(scope: Scope, engine: str) -> EngineDescriptionWithLimits:
        """An engine's declarations, and the service's limits (``limits``, bytes) on what its sessions take."""
        limits = ServiceLimits(**service.limits(), max_body_bytes=app.state.max_body_bytes)
        return EngineDescriptionWithLimits(**dict(service.describe(engine)), limits=limits)

    prefix = "/v1/engines/{engine:segment}/sessions/{session_id:segment}"

    @app.get(f"{prefix}/bootstrap", response_model=BootstrapState, tags=["engines"])
    def bootstrap_state(scope: Scope, engine: str, session_id: str) -> BootstrapState:
        """Where the next host-transcript import page resumes."""
        return service.bootstrap_state(scope, engine, session_id)

    @app.post(f"{prefix}/bootstrap", response_model=BootstrapResponse, tags=["engines"],
              dependencies=[_no_idempotency_key(NO_KEY_BOOTSTRAP)])
    def bootstrap(scope: Scope, engine: str, session_id: str, body: BootstrapRequest) -> BootstrapResponse:
        """Import one page of the host's transcript; on ``done`` run the engine's bootstrap."""
        return service.bootstrap(scope, engine, session_id, body)

    @app.post(f"{prefix}/assemble", response_model=AssembleResult, tags=["engines"])
    def assemble(scope: Scope, engine: str, session_id: str, body: AssembleRequest) -> AssembleResult:
        """The engine's context for the next model call."""
        return service.assemble(scope, engine, session_id, body)

    @app.post(f"{prefix}/compact", response_model=CompactResult, tags=["engines"],
              dependencies=[_no_idempotency_key(NO_KEY_COMPACT)])
    def compact(scope: Scope, engine: str, session_id: str, body: CompactRequest) -> CompactResult:
        """Run the engine's compaction."""
        return service.compact(scope, engine, session_id, body)

    @app.post(f"{prefix}/host_compaction", response_model=HostCompactionResponse, tags=["engines"],
              dependencies=[_no_idempotency_key(NO_KEY_HOST_COMPACTION)])
    def host_compaction(
        scope: Scope, engine: str, session_id: str, body: HostCompactionRequest
    ) -> HostCompactionResponse:
        """Record a compaction the host made of its own transcript (409 ``behind`` past the mirror's end)."""
        return service.host_compaction(scope, engine, session_id, body)

    @app.post(f"{prefix}/maintain", response_model=MaintainResult, tags=["engines"],
              dependencies=[_no_idempotency_key(NO_KEY_MAINTAIN)])
    def maintain(scope: Scope, engine: str, session_id: str, body: MaintainRequest) -> MaintainResult:
        """Run the engine's maintenance pass."""
        return service.maintain(scope, engine, session_id, body)

    @app.post(f"{prefix}/commit_turn", response_model=CommitTurnResponse, tags=["engines"],
              dependencies=[_no_idempotency_key(NO_KEY_COMMIT)])
    def commit_turn(scope: Scope, engine: str, session_id: str, body: CommitTurnRequest) -> CommitTurnResponse:
        """Commit one accepted turn: 200 ``committed`` / ``duplicate``, 409 on a reused key with other content."""
        return service.commit_turn(scope, engine, session_id, body)

    @app.get(f"{prefix}/receipts", response_model=ReceiptList, tags=["engines"])
    def receipts(
        scope: Scope,
        engine: str,
        session_id: str,
        after: Annotated[str | None, Query(max_length=RECEIPT_CURSOR_CHARS)] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_RECEIPTS_PAGE), DECIMAL] = DEFAULT_RECEIPTS_PAGE,
    ) -> ReceiptList:
        """The engine's ledger for one session in advancement-key order, ``limit`` receipts a page: pass an
        answer's ``next`` as ``after`` for the next page (``next`` is null on the last one)."""
        page = service.receipts(scope, engine, session_id, after, limit)
        return ReceiptList(receipts=page.receipts, next=page.next)


# ---------------------------------------------------------------------------------------------- serving


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), bound before the server starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(app: FastAPI, sock: socket.socket, *, access_log: bool = False,
          announce: Callable[[str], None] | None = None, head_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
    """Serve ``app`` on ``sock`` until SIGINT/SIGTERM/SIGHUP; a request head must arrive whole within
    ``head_timeout`` seconds of the connection or of the previous response."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    if access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    # An idle connection is kept as long as a head may take (30 s by default; 5 s at least, uvicorn's own):
    # with uvicorn's 5 s, a pooled client keeping its idle connections 4 s (Node's fetch) whose event loop
    # ran a second late reused one the server had just closed, and its request failed unsent
    # (UND_ERR_SOCKET: the OpenClaw plugin's turn fell back to legacy).
    config = uvicorn.Config(app, log_config=None, access_log=access_log, server_header=False,
                            timeout_keep_alive=max(KEEP_ALIVE_SECONDS, math.ceil(head_timeout)),
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS, http=_head_deadline(head_timeout))
    url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    server = _server_class()(config, lambda: announce(url) if announce is not None else None)
    server.run(sockets=[sock])


#: the least an idle keep-alive connection is kept open (uvicorn's default); ``--body-timeout`` when longer
KEEP_ALIVE_SECONDS = 5
#: how long requests in flight may run on after Ctrl-C or SIGTERM, before they are answered 503
GRACEFUL_SHUTDOWN_SECONDS = 5


def _head_deadline(seconds: float) -> type:
    """uvicorn's h11 protocol with a deadline for every request head.

    uvicorn times out only a keep-alive connection idle after a response, and restarts even that on any
    byte: a client (no token needed, the head never reaches ``Authenticate``) could hold a connection
    open for ever by sending nothing, or one header byte now and then, and enough of them took every
    file descriptor, locking everyone out (a review did so with 300 under a low limit). The deadline
    runs from the connection, or from the previous response, until the next head is whole: bytes that do
    not finish it (the rest of a body answered early, a head a byte at a time) do not move it; it is never
    shorter than uvicorn's keep-alive. Past it the connection is closed, as uvicorn closes an idle one.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _serving(self) -> bool:
            """Whether a request is being answered (its head came whole; the response is not done)."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            # Never shorter than uvicorn's own keep-alive: a pooled client reusing an idle connection a
            # few seconds later must not find it closed (the head deadline is for heads, not for pools).
            self._head_timer = self.loop.call_later(max(seconds, self.timeout_keep_alive), self._head_overdue)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._serving():  # a head came whole: its request is answered; no deadline meanwhile
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # The next head's deadline, from now: also when the response went out before the request's
            # body had all come (a 413, a 401), whose rest the client may drip for ever (a review saw it).
            if not self.transport.is_closing() and not self._serving():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _head_overdue(self) -> None:
            self._head_timer = None
            if not self._serving():
                self.timeout_keep_alive_handler()  # uvicorn's own close of an idle connection

    return HeadDeadline


def _server_class() -> type:
    """uvicorn's Server, except that the signal that stopped it is not raised again once it has shut down,
    and that it announces itself (``started``) once it serves.

    uvicorn re-raises a SIGINT or SIGTERM after its graceful shutdown, for the default action: a Ctrl-C
    then ended ``serve`` as "error: aborted" (exit 1, "failed"), a SIGTERM killed the process (143)
    before the store was closed and the engines disposed. Stopped by either, ``serve`` returns.
    """
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config: Any, started: Callable[[], None]) -> None:
            super().__init__(config)
            self._started = started

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:  # said once it serves, its signal handlers in place
                self._started()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                # SIGHUP (the terminal closed, the SSH connection dropped) stops it as SIGTERM does: uvicorn
                # handles SIGINT and SIGTERM only, and the default SIGHUP ended serve where it stood, its
                # engines not disposed of nor the store closed. Under ``nohup`` (started ignoring it) it
                # stays ignored.
                hangup: int | None = getattr(signal, "SIGHUP", None)  # none on Windows
                previous: Any = signal.SIG_IGN
                if hangup is not None and threading.current_thread() is threading.main_thread():
                    previous = signal.getsignal(hangup)
                    if previous is not signal.SIG_IGN:
                        signal.signal(hangup, self.handle_exit)
                try:
                    yield
                finally:
                    if hangup is not None and previous is not signal.SIG_IGN:
                        signal.signal(hangup, signal.SIG_DFL if previous is None else previous)
                    captured = getattr(self, "_captured_signals", None)
                    if isinstance(captured, list):
                        captured.clear()

    return Server
