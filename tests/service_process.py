"""`transcript-store serve` as a real child process for tests, and a tiny JSON client for it (stdlib only)."""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent


class ServiceProcess:
    """One server process on a free loopback port (or ``port``), its log in ``log_path``."""

    def __init__(
        self,
        db_url: str,
        tokens: dict[str, str],
        log_path: Path,
        *,
        port: int = 0,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.db_url = db_url
        self.tokens = tokens
        self.log_path = log_path
        self.port = port
        self.extra_args = extra_args
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.stdout_rest = ""

    def start(self, timeout: float = 60.0) -> ServiceProcess:
        """Start and wait for the 'listening on URL' line."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        env["TRANSCRIPT_STORE_TOKENS"] = ",".join(f"{t}={s}" for t, s in self.tokens.items())
        env.pop("TRANSCRIPT_STORE_URL", None)
        args = [sys.executable, "-m", "transcript_store", "serve", "--db", self.db_url, "--port", str(self.port),
                *self.extra_args]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=env, cwd=self.log_path.parent,
                                     start_new_session=True)
        log.close()
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = b""
        while time.monotonic() < deadline and b"\n" not in line:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
        text = line.decode("utf-8", "replace")
        if "listening on " not in text:
            self.stop()
            raise RuntimeError(f"serve did not start: {text!r}\n{self.log_path.read_text(errors='replace')[-3000:]}")
        self.url = text.split("listening on ", 1)[1].split()[0]
        self.port = int(urlsplit(self.url).port or 0)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Stop the process group (SIGKILL after ``timeout``)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            except ProcessLookupError:
                pass
        if proc.stdout is not None:
            if proc.returncode is not None:  # what it wrote after the 'listening' line, to its end
                self.stdout_rest = proc.stdout.read().decode("utf-8", "replace")
            proc.stdout.close()

    def __enter__(self) -> ServiceProcess:
        """Start on entry."""
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        """Stop on exit."""
        self.stop()

    def log(self) -> str:
        """The server log so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def call(
        self, method: str, path: str, token: str | None = None, body: Any = None, *, raw: bytes | None = None,
        headers: dict[str, str] | None = None, chunked: bool = False,
    ) -> tuple[int, Any]:
        """One request; (status, parsed JSON body or None)."""
        return request(self.url, method, path, token, body, raw=raw, headers=headers, chunked=chunked)


def request(
    base_url: str, method: str, path: str, token: str | None = None, body: Any = None, *, raw: bytes | None = None,
    headers: dict[str, str] | None = None, timeout: float = 60.0, chunked: bool = False,
) -> tuple[int, Any]:
    """One JSON request to ``base_url``; (status, parsed body or None)."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    sent = {"Accept": "application/json", **(headers or {})}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    data = raw
    if data is None and body is not None:
        data = json.dumps(body).encode("utf-8")
    if data is not None:
        sent.setdefault("Content-Type", "application/json")
    try:
        if chunked and data is not None:
            pieces = [data[i:i + 65536] for i in range(0, len(data), 65536)]
            conn.request(method, path, body=iter(pieces), headers=sent, encode_chunked=True)
        else:
            conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    try:
        parsed = json.loads(payload) if payload else None
    except ValueError:
        parsed = payload.decode("utf-8", "replace")
    return response.status, parsed


class Tenant:
    """A test's own two scopes on a server its module shares: ``token_a`` of ``scope_a``, ``token_b`` of
    ``scope_b``. No other test of the module holds either token, so the scopes are as empty as a fresh
    database's at the test's start (what is outside them, other tests' sessions, the test must not count)."""

    def __init__(self, process: ServiceProcess, token_a: str, token_b: str) -> None:
        self.process = process
        self.token_a, self.token_b = token_a, token_b
        self.scope_a, self.scope_b = process.tokens[token_a], process.tokens[token_b]

    @property
    def url(self) -> str:
        """The shared server's URL."""
        return self.process.url

    def call(
        self, method: str, path: str, token: str | None = None, body: Any = None, *, raw: bytes | None = None,
        headers: dict[str, str] | None = None, chunked: bool = False,
    ) -> tuple[int, Any]:
        """One request; (status, parsed JSON body or None)."""
        return self.process.call(method, path, token, body, raw=raw, headers=headers, chunked=chunked)


class SharedServer:
    """One server process for a module's tests, each test in a ``Tenant`` of its own: a server start
    (a second of CPU) per module and backend instead of one per test. ``tenants`` token pairs are known
    to it from its start; ``tenant()`` hands out the next unused one."""

    def __init__(self, db_url: str, log_path: Path, *, tenants: int = 64, extra_args: tuple[str, ...] = ()) -> None:
        self._pairs = [(f"token-a-{n:04d}-0123456789abcdef", f"token-b-{n:04d}-0123456789abcdef")
                       for n in range(tenants)]
        tokens = {token: f"scope-{side}-{n:04d}" for n, pair in enumerate(self._pairs)
                  for side, token in zip("ab", pair, strict=True)}
        self.process = ServiceProcess(db_url, tokens, log_path, extra_args=extra_args)
        self._next = 0

    def __enter__(self) -> SharedServer:
        """Start the server."""
        self.process.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        """Stop it."""
        self.process.stop()

    def tenant(self) -> Tenant:
        """The next unused pair of tokens and their scopes."""
        if self._next == len(self._pairs):
            raise RuntimeError(f"all {len(self._pairs)} tenants of the shared server are taken: raise `tenants`")
        token_a, token_b = self._pairs[self._next]
        self._next += 1
        return Tenant(self.process, token_a, token_b)
