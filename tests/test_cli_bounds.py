"""What the second CLI review left open: the gateway's worker processes logged engines' errors raw, a SQLite
busy timeout past SQLite's range silently became no wait at all, and the service waited forever for a
request body that stopped coming."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_process import ServiceProcess
from test_cli import _script_mode, one_error_line, run, run_json  # noqa: F401 (autouse: honours real_script)
from test_cli_hardening import HOSTILE_SHOWN, _hostile_plugin

from transcript_store import InvalidInput, StoreConfig

TOKEN = "token-bounds-0123456789abcdef"

# ---------------------------------------------------------------------------------------------- 1: engine text


@pytest.mark.real_script
def test_the_gateway_workers_log_lines_show_engine_text_escaped(tmp_path: Path) -> None:
    """A worker is a process of its own: without the CLI's log handler its records reached stderr through
    logging's last resort, raw (an engine's error with a window title and a colour in it)."""
    _hostile_plugin(tmp_path, "assemble")
    result = run("gateway", "--engine", "hostile", "--workers", "1", "--sessions", "1", "--turns", "1",
                 "--no-faults", "--db", f"sqlite:///{tmp_path / 'g.db'}", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert "\x1b" not in out and "\x07" not in out, repr(result.stderr)
    logged = [line for line in result.stderr.splitlines() if "quarantined" in line]
    assert logged and all(line.startswith("ERROR: transcript_store.host: ") for line in logged), result.stderr
    assert any(HOSTILE_SHOWN in line for line in logged), result.stderr


# ---------------------------------------------------------------------------------------------- 3: bounds


def test_a_busy_timeout_past_sqlites_range_is_a_usage_error(tmp_path: Path) -> None:
    """SQLite keeps the busy timeout in a C int: 2**31 ms and up were taken, and the store then waited for
    no lock at all (``PRAGMA busy_timeout`` read back 0)."""
    for bad in ("2147483648", "99999999999999999999", "86400001"):
        result = run("init", cwd=tmp_path, code=2, env={"TRANSCRIPT_STORE_BUSY_TIMEOUT_MS": bad})
        line = one_error_line(result)
        assert "TRANSCRIPT_STORE_BUSY_TIMEOUT_MS" in line and "86400000" in line, line
        with pytest.raises(InvalidInput, match="busy_timeout_ms"):
            StoreConfig.from_env(busy_timeout_ms=int(bad))
    assert list(tmp_path.iterdir()) == []
    run("init", cwd=tmp_path, env={"TRANSCRIPT_STORE_BUSY_TIMEOUT_MS": "86400000"})
    doctor = run_json("doctor", cwd=tmp_path, env={"TRANSCRIPT_STORE_BUSY_TIMEOUT_MS": "86400000"})
    assert doctor["store"]["settings"]["busy_timeout_ms"] == 86_400_000, doctor["store"]


# ---------------------------------------------------------------------------------------------- 4: stalled bodies


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """One real server on a SQLite file, a 1 s body timeout and a 1 KiB body limit."""
    folder = tmp_path_factory.mktemp("bounds")
    args = ("--body-timeout", "1", "--max-body", "1024")
    with ServiceProcess(f"sqlite:///{folder / 'service.db'}", {TOKEN: "bounds"}, folder / "serve.log",
                        extra_args=args) as proc:
        yield proc


def _exchange(server: ServiceProcess, length: int, pieces: list[bytes], *, gap: float = 0.0,
              close: bool = False) -> tuple[bytes, float]:
    """POST /v1/sessions announcing ``length`` body bytes, send ``pieces`` ``gap`` seconds apart, then read
    until the server closes (asked to with ``close``); (what it answered, seconds from the last piece on)."""
    head = (f"POST /v1/sessions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
            f"{'Connection: close' if close else 'Connection: keep-alive'}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(head.encode("ascii"))
        for piece in pieces:
            time.sleep(gap)
            sock.sendall(piece)
        sent = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):  # a server that never answers nor closes: socket.timeout
            answer += chunk
    return answer, time.monotonic() - sent


def _status_and_error(answer: bytes) -> tuple[int, dict[str, str]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_stalled_request_body_gets_408_and_its_connection_closed(server: ServiceProcess) -> None:
    """Content-Length promised 100 bytes, 10 came: the request and its connection were held forever (uvicorn
    has no timeout for a request's body; its keep-alive timeout runs between requests only)."""
    answer, waited = _exchange(server, 100, [b'{"session_'])
    status, error = _status_and_error(answer)
    assert status == 408 and error["code"] == "request_timeout", answer
    assert b"connection: close" in answer.lower() and 0.9 <= waited < 5, (answer, waited)
    assert server.call("GET", "/v1/whoami", TOKEN)[0] == 200  # the server goes on serving


def test_a_stalled_body_past_the_size_limit_is_refused_in_bounded_time(server: ServiceProcess) -> None:
    """A Content-Length past the limit: the excess is drained before the 413, and that drain waited forever
    for bytes that never came."""
    answer, waited = _exchange(server, 4096, [b"x" * 100])
    status, error = _status_and_error(answer)
    assert status == 413 and error["code"] == "request_too_large", answer
    assert b"connection: close" in answer.lower() and waited < 5, (answer, waited)


def test_a_slow_body_that_keeps_coming_is_served(server: ServiceProcess) -> None:
    """The timeout is a pause between two reads, not a deadline for the whole body."""
    body = b'{"session_id": "slow-body-1"}'
    pieces = [body[i:i + 8] for i in range(0, len(body), 8)]
    answer, _ = _exchange(server, len(body), pieces, gap=0.6, close=True)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert server.call("GET", "/v1/sessions/slow-body-1", TOKEN)[0] == 200


def test_the_body_timeout_is_bounded_and_in_the_help(tmp_path: Path) -> None:
    help_text = " ".join(run("serve", "--help", cwd=tmp_path).stdout.split())
    assert "--body-timeout" in help_text and "default: 30; 1<=x<=3600" in help_text, help_text
    for bad in ("0", "3601", "99999999999999999999"):
        result = run("serve", "--body-timeout", bad, cwd=tmp_path, code=2)
        assert "--body-timeout" in result.stderr and "1<=x<=3600" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []
