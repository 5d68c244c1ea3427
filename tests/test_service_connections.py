"""A real ``transcript-store serve``: connections that never send a whole request head, and requests still
running when the server is stopped.

Both were found by a review: a client without any token could hold connections open for ever (nothing,
or a head one byte at a time: uvicorn has no deadline for a head), enough of them locking everyone out;
and a request cancelled at shutdown got uvicorn's plain-text 500 while its write committed afterwards,
into a store being closed under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import wait_until
from service_process import ServiceProcess, request

from transcript_store.service_app import _drain, _patient

TOKEN = "tok-connections"
TOKENS = {TOKEN: "scope-a"}
HEAD = b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A server whose body (and head) timeout is 1 second (the head deadline: uvicorn's keep-alive, 5 s, at
    least), bodies 1 KiB at most; on SQLite (the HTTP layer's connections: no store call decides them), one
    for the module's tests of connections, each on connections of its own."""
    folder = tmp_path_factory.mktemp("connections")
    args = ("--body-timeout", "1", "--max-body", "1024")
    with ServiceProcess(f"sqlite:///{folder / 'service.db'}", TOKENS, folder / "serve.log", extra_args=args) as proc:
        yield proc


def _connect(server: ServiceProcess) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    return sock


def _reused_after(server: ServiceProcess, pause: float) -> None:
    """Two requests on one connection, ``pause`` seconds idle between them: the connection stays open."""
    with _connect(server) as pooled:
        pooled.settimeout(10)
        for n in range(2):
            if n:  # idle only between the two (CI time: a pause after the last request showed nothing)
                time.sleep(pause)
            pooled.sendall(HEAD + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
            answer = b""
            while not answer.endswith(b'{"scope":"scope-a"}'):
                chunk = pooled.recv(4096)
                assert chunk, f"closed: {answer!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")


def _closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``seconds``), sending ``drip`` one
    byte every 0.2 s meanwhile (bytes that never finish a head)."""
    started = time.monotonic()
    sock.settimeout(0.2)
    sent = 0
    while time.monotonic() - started < seconds:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - started
        if sent < len(drip):
            try:
                sock.sendall(drip[sent : sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started
            sent += 1
    return None


def test_a_connection_without_a_whole_request_head_is_closed_after_the_timeout(server: ServiceProcess) -> None:
    silent, dripping, kept, early = (_connect(server) for _ in range(4))
    try:
        # A request on a kept-alive connection, then the next head left unfinished.
        kept.sendall(HEAD + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
        kept.settimeout(10)
        answer = b""
        while not answer.endswith(b'{"scope":"scope-a"}'):
            chunk = kept.recv(4096)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /v1/who")
        # Answered before its body came (413 by its length, no token needed), the rest of the body then
        # dripping: the next head's deadline runs from the answer all the same (a review found it open).
        early.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100)
        early.settimeout(10)
        assert early.recv(4096).startswith(b"HTTP/1.1 413")
        # The deadline runs from the connection (or the last response), whatever bytes keep coming.
        for sock, drip in ((silent, b""), (dripping, HEAD * 3), (kept, b""), (early, b"x" * 60)):
            took = _closed_within(sock, 10.0, drip)
            assert took is not None and took < 8.0, f"still open after 10 s (drip {len(drip)} bytes)"
    finally:
        for sock in (silent, dripping, kept, early):
            sock.close()
    # A pooled client reusing its idle connection two seconds later (under uvicorn's keep-alive, over
    # the 1 s head timeout) finds it open: the head deadline is never shorter than the keep-alive.
    _reused_after(server, 2.0)
    # A whole request still goes through, its body in time too.
    assert server.call("GET", "/v1/whoami", TOKEN) == (200, {"scope": "scope-a"})
    assert server.call("POST", "/v1/sessions", TOKEN, {"session_id": "after"})[0] == 200


def _read_response(sock: socket.socket) -> bytes:
    """Everything up to the end of one response's head, and a little more (JSON bodies are short)."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_a_request_answered_without_reading_its_awaited_body_closes_the_connection(server: ServiceProcess) -> None:
    """A client waiting for 100 Continue that gets a final answer instead (404, 405) may skip its body
    and send its next request on the connection, which the server would read as that body (a review
    found the next request swallowed). Such an answer closes the connection; a body read is not."""
    head = (f"POST /v1/nothing HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n").encode()
    with _connect(server) as sock:
        sock.sendall(head)
        answer = _read_response(sock)
        assert answer.startswith(b"HTTP/1.1 404") and b"connection: close" in answer.lower(), answer
        assert _closed_within(sock, 5.0) is not None
    # Without a body to come (Content-Length: 0), nothing is left to be misread: the connection stays.
    with _connect(server) as sock:
        sock.sendall(head.replace(b"Content-Length: 2", b"Content-Length: 0"))
        answer = _read_response(sock)
        assert answer.startswith(b"HTTP/1.1 404") and b"connection: close" not in answer.lower(), answer
    # Read, the body keeps the connection: 100 Continue, the answer, and the next request on it.
    with _connect(server) as sock:
        body = b'{"session_id": "cont-1"}'
        sock.sendall(head.replace(b"/v1/nothing", b"/v1/sessions").replace(b"Length: 2", b"Length: %d" % len(body)))
        assert _read_response(sock).startswith(b"HTTP/1.1 100")
        sock.sendall(body)
        answer = _read_response(sock)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" not in answer.lower(), answer


def _hold_the_sessions_table(store_url: str, held: threading.Event, release: threading.Event) -> None:
    """Keep every write to the session table waiting until ``release`` (another writer's long transaction)."""
    if store_url.startswith("sqlite"):
        conn = sqlite3.connect(store_url.split(":///", 1)[1], isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        release.wait(60)
        conn.execute("ROLLBACK")
        conn.close()
        return
    with psycopg.connect(store_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        conn.execute("LOCK TABLE ts_sessions IN ACCESS EXCLUSIVE MODE")
        held.set()
        release.wait(60)
        conn.rollback()


def _wait_for_a_lock(store_url: str) -> None:
    """Until a request waits for the table ``_hold_the_sessions_table`` holds. PostgreSQL shows the waiting
    backend (a fixed second was short on a loaded machine: the request had not reached the table when the
    server was told to stop); SQLite's busy wait shows nowhere, so it gets the second."""
    if store_url.startswith("sqlite"):
        time.sleep(1.0)
        return
    query = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    with psycopg.connect(store_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        wait_until(lambda: (conn.execute(query).fetchone() or (0,))[0], "a request waiting for the sessions table")


def test_a_request_still_running_at_shutdown_is_told_so_and_the_store_closes_after_it(
    store_url: str, tmp_path: Path
) -> None:
    server = ServiceProcess(store_url, TOKENS, tmp_path / "serve.log").start()
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_the_sessions_table, args=(store_url, held, release), daemon=True)
    holder.start()
    answer: list[Any] = []
    try:
        assert held.wait(30)
        client = threading.Thread(target=lambda: answer.append(
            request(server.url, "POST", "/v1/sessions", TOKEN, {"session_id": "late"})), daemon=True)
        client.start()
        _wait_for_a_lock(store_url)  # the request waits for the table
        assert server.proc is not None
        server.proc.send_signal(15)  # SIGTERM: 5 s for requests in flight, then they are cancelled
        client.join(20)
        assert answer, "no answer within 20 s"
        status, body = answer[0]
        assert status == 503 and body["error"]["code"] == "shutting_down", answer
        assert "may still be carried out" in body["error"]["message"]
        time.sleep(0.5)
        assert server.proc.poll() is None  # waiting for the request's thread before closing the store
        release.set()
        assert server.proc.wait(30) == 0
    finally:
        release.set()
        holder.join(30)
        server.stop()
    log = server.log()
    assert "waiting for 1 request(s) still running before closing the store" in log, log[-3000:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    # The request ran to its end in its thread, into an open store: the session is there, once.
    check = ServiceProcess(store_url, TOKENS, tmp_path / "serve2.log").start()
    try:
        assert check.call("GET", "/v1/sessions/late", TOKEN)[0] == 200
    finally:
        check.stop()


def test_the_shutting_down_code_is_documented() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    assert "`shutting_down`" in readme
    assert json.dumps("shutting_down")  # the code is plain ASCII


def _answer_while_dripping(
    sock: socket.socket, head: bytes, answers: dict[str, bytes], name: str, sent: dict[str, int]
) -> None:
    """Send ``head``, then its body a byte every 0.3 s (in time for the 1 s body timeout), until answered;
    ``sent`` counts the body's bytes sent."""
    sock.sendall(head)
    sock.settimeout(0.3)
    data = b""
    started = time.monotonic()
    while time.monotonic() - started < 20 and not (b"\r\n\r\n" in data and data.rstrip().endswith(b"}")):
        with contextlib.suppress(OSError):
            sock.sendall(b"x")
            sent[name] = sent.get(name, 0) + 1
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    answers[name] = data


def test_a_request_cut_off_at_shutdown_before_its_route_is_told_so_too(store_url: str, tmp_path: Path) -> None:
    """The 503 ``shutting_down`` whichever layer the request was in when the graceful period ended: a
    review found a body being dropped before the route (by its token's 401, by its length's 413)
    answered with uvicorn's plain-text 500 instead."""
    # A body timeout past the 5 s graceful period: the bodies still come when the requests are cut off.
    args = ("--body-timeout", "30", "--max-body", "1024")
    server = ServiceProcess(store_url, TOKENS, tmp_path / "serve.log", extra_args=args).start()
    heads = {
        "unauthorized": b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
        b"Content-Length: 1000\r\n\r\n",
        "too large": b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n",
        "in its route": f"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode(),
    }
    answers: dict[str, bytes] = {}
    sent: dict[str, int] = {}
    socks = [_connect(server) for _ in heads]
    clients = [threading.Thread(target=_answer_while_dripping, args=(sock, head, answers, name, sent), daemon=True)
               for sock, (name, head) in zip(socks, heads.items(), strict=True)]
    try:
        for client in clients:
            client.start()
        # Every body is coming, none is whole: four bytes of each sent (about a second on an idle machine).
        # A fixed second was short on a loaded one, where a client had not even sent its head yet.
        wait_until(lambda: all(sent.get(name, 0) >= 4 for name in heads), "four bytes of every body")
        assert server.proc is not None
        server.proc.send_signal(15)  # SIGTERM: 5 s for requests in flight, then they are cancelled
        for client in clients:
            client.join(25)
        assert server.proc.wait(30) == 0
    finally:
        for sock in socks:
            sock.close()
        server.stop()
    for name in heads:
        answer = answers.get(name, b"")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head.lower(), (name, answer)
        assert json.loads(body)["error"]["code"] == "shutting_down", (name, answer)
    log = server.log()
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]


def test_a_refused_body_dripping_in_does_not_hold_its_connection(server: ServiceProcess) -> None:
    """A body refused before its route (no token's 401, a Content-Length over the limit's 413) is dropped so
    that the client reads the answer, but for the body timeout in all, not for as long as a byte comes
    before each pause runs out: a review held such connections open without any token, a byte every half
    second (at the defaults, 8 MiB a byte every 29 s), as the head deadline stops it for a head."""
    heads = (
        (b"401", b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"),
        (b"401", b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n"),
        (b"413", b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"),
    )
    socks = [_connect(server) for _ in heads]
    answers = [b""] * len(heads)
    took: list[float | None] = [None] * len(heads)
    try:
        for sock, (_status, head) in zip(socks, heads, strict=True):
            sock.sendall(head)
            sock.settimeout(0.05)
        # One byte on every connection every 0.2 s (a chunked body's chunks of one byte): never a 1 s pause.
        drip = (b"x", b"1\r\nx\r\n", b"x")
        started = time.monotonic()
        while time.monotonic() - started < 10 and None in took:
            for i, sock in enumerate(socks):
                if took[i] is not None:
                    continue
                with contextlib.suppress(OSError):
                    sock.sendall(drip[i])
                try:
                    chunk = sock.recv(4096)
                except TimeoutError:
                    continue
                except OSError:
                    chunk = b""
                answers[i] += chunk
                if not chunk or b"\r\n\r\n" in answers[i]:
                    took[i] = time.monotonic() - started
            time.sleep(0.05)
        for (status, _head), answer, seconds in zip(heads, answers, took, strict=True):
            assert seconds is not None and seconds < 5.0, (seconds, answer)
            assert answer.startswith(b"HTTP/1.1 " + status) and b"connection: close" in answer.lower(), answer
        for sock, byte in zip(socks, drip, strict=True):
            assert _closed_within(sock, 5.0, byte * 25) is not None
    finally:
        for sock in socks:
            sock.close()
    assert server.call("GET", "/v1/whoami", TOKEN) == (200, {"scope": "scope-a"})


@pytest.mark.parametrize("steps", [0, 1, 2, 3])
def test_a_request_cancelled_as_its_body_chunk_arrives_stays_cancelled(steps: int) -> None:
    """The server cancels a request (shutdown, client gone) at any instant, also the one at which a body
    chunk has just been read: the read must not swallow the cancellation (asyncio.wait_for did on
    Python 3.11: the chunk came back and the request ran on, its write with it)."""
    chunk = {"type": "http.request", "body": b"x", "more_body": True}

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0)  # the server's read of the socket: one suspension
        return chunk

    async def cancelled_at(step: int, read: Any) -> str:
        task = asyncio.create_task(read())
        for _ in range(step):
            await asyncio.sleep(0)
        if task.done():
            return "done"
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "cancellation lost"

    async def main() -> list[str]:
        patient = _patient(receive, 5)
        return [
            await cancelled_at(steps, patient),
            await cancelled_at(steps, lambda: _drain(_patient(receive, 5), 1 << 20, 5)),
        ]

    assert "cancellation lost" not in asyncio.run(main())


@pytest.mark.parametrize("backend", ["sqlite"])  # the HTTP layer's connections: no store call decides it
def test_an_idle_pooled_connection_outlives_a_clients_keep_alive(store_url: str, tmp_path: Path) -> None:
    """An idle keep-alive connection stays open as long as a request head may take (30 s by default), not
    uvicorn's 5 s: a pooled client keeping idle connections 4 s (Node's fetch) whose event loop ran late
    reused one just closed, and its request failed unsent (UND_ERR_SOCKET in the OpenClaw plugin's tests)."""
    with ServiceProcess(store_url, TOKENS, tmp_path / "serve.log") as server:
        _reused_after(server, 6.5)  # past uvicorn's 5 s


def test_a_client_gone_before_its_body_is_whole_is_no_internal_error(store_url: str, tmp_path: Path) -> None:
    """A review found a client that closed its connection mid-body (a timeout, a crash) logged as an
    internal error with a traceback: README calls a 500 with a correlation id a bug, and an operator
    alerting on them was paged for an everyday event. Nothing is written, and the log says what it was."""
    server = ServiceProcess(store_url, TOKENS, tmp_path / "serve.log").start()
    try:
        body = b'{"session_id": "gone"}'
        for path in ("/v1/sessions", "/v1/sessions?sesion_key=x"):  # read by the route, and by a refusal
            with _connect(server) as sock:
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                             f"Content-Type: application/json\r\nContent-Length: {len(body) + 100}\r\n\r\n".encode()
                             + body)
        wait_until(lambda: server.log().count("the client disconnected before its request body was whole") == 2,
                   "both disconnects logged")
        assert server.call("GET", "/v1/sessions/gone", TOKEN)[0] == 404
        assert server.call("GET", "/v1/whoami", TOKEN) == (200, {"scope": "scope-a"})
    finally:
        server.stop()
    log = server.log()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]
