"""Fault campaign, part 4c: hostile input to the service's bearer tokens (``TokenMap`` and the HTTP auth).

``transcript-store serve`` reads its tokens from a file (``--tokens FILE``, ``TOKEN SCOPE`` per line) and
from ``TRANSCRIPT_STORE_TOKENS`` (``tok=scope,...``); every request presents one in its Authorization
header. Hypothesis draws all three: token and scope text with NUL bytes, lone surrogates, control and
non-ASCII whitespace, '=' and ',' inside, huge strings, empty ones, one token listed with two scopes;
file contents as bytes (a byte-order mark, every line break ``splitlines`` knows, comments, non-UTF-8
bytes, random bytes); paths that are directories, missing, unreadable, too long, with a NUL or a lone
surrogate; wrong types for every argument; and Authorization header values as raw bytes (any Latin-1
text, the scheme in any case, the known tokens' prefixes, extensions, case variants, the tokens with
whitespace of every kind around them, several Authorization headers). The contract:

- a refusal is ``InvalidInput`` (a ``TranscriptStoreError``), never a raw ``TypeError``, ``ValueError``,
  ``UnicodeError``, ``OSError`` or ``AttributeError``, and a map is built exactly when every token is
  non-empty printable ASCII without whitespace, every scope an id a session can be created under, and
  no token is listed with two scopes (an oracle decides it, from the documented rules);
- loading changes nothing: neither the tokens file nor the environment;
- a lookup (``scope_for``; ``TokenMap`` keeps only digests) grants a scope exactly to a known token:
  never to a prefix, an extension, a case variant or a token with anything around it, and never raises;
- over HTTP (the real app, driven in-process as ASGI): a request is 200 exactly when its first
  Authorization header is ``Bearer`` (any case), one or more spaces, a known token, and nothing but
  spaces or tabs after it; every other value is 401 with ``WWW-Authenticate: Bearer``, never a 500. A
  real server process is sent the same kinds of headers over a socket.

Drawn: the ``TokenMap`` constructor, ``load``, ``parse_file``, ``parse_env``, ``scope_for``,
``service_app.bearer_token`` and the app's auth (``calls`` below; a test keeps it complete). The default
tier draws ``FAULT_INPUT_TOKENS_EXAMPLES`` (60) examples per function; the slow tier 1,000.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FunctionType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_process import ROOT, ServiceProcess
from test_faults_input import NASTY, WRONG, texts
from workers.fault_worker import report

from transcript_store import InvalidInput, TranscriptStore, TranscriptStoreError, service, service_app
from transcript_store.core import check_id
from transcript_store.service import TOKENS_ENV, Service, TokenMap
from transcript_store.service_app import create_app
from transcript_store.settings import load_settings

#: the largest tokens file (README): 16 MiB
MAX_TOKENS_FILE_BYTES = 16 * 1024 * 1024
EXAMPLES = int(os.environ.get("FAULT_INPUT_TOKENS_EXAMPLES", "60"))
#: per function in the slow tier
SLOW_EXAMPLES = 1000

#: the tokens the app and the lookups know
KNOWN = {"tok-A_0123456789": "scope-a", "c2VjcmV0LXRva2VuIQ==": "scope-b", "x": "scope-c", "#hash,comma=eq": "é"}

# ---------------------------------------------------------------------------------------------- strategies

#: whitespace of every kind Python's str.strip / str.split / str.splitlines knows, and what HTTP calls OWS
SPACES = [" ", "\t", "\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\xa0", "\u2028", "\u3000"]
printable_tokens = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=24)
tokens = st.one_of(
    printable_tokens, st.sampled_from(list(KNOWN)), texts,
    st.sampled_from(["tok=", "=tok", "tok,en", "#tok", "tok en", "\ufefftok", "tok\x00", "tök", "a" * 100_000]),
    st.builds(lambda t, s: s + t + s, printable_tokens, st.sampled_from(SPACES)),
)
scopes = st.one_of(
    st.sampled_from(["scope-a", "scope-b", "é" * 255, "\U0010ffff" * 200, "sc ope", "s=1", "s,1"]), texts,
)
pair_items = st.one_of(
    st.tuples(tokens, scopes), st.lists(st.one_of(tokens, scopes), max_size=3), st.sampled_from(WRONG)
)
pair_lists = st.one_of(
    st.lists(st.tuples(tokens, scopes), max_size=5),
    st.lists(pair_items, max_size=4),
    # one token twice, with the same or another scope
    st.builds(lambda t, s1, s2: [(t, s1), ("other-token", "scope-x"), (t, s2)], printable_tokens, scopes, scopes),
    st.sampled_from([*WRONG, {"ab": "scope"}, {"tok-1": "scope-a"}, "ab", b"ab", iter([("tok-1", "s")])]),
)
LINE_BREAKS = ["\n", "\r\n", "\r", "\x85", "\u2028", "\x0b", "\x1e"]


@st.composite
def env_values(draw: st.DrawFn) -> Any:
    """A TRANSCRIPT_STORE_TOKENS value: items of drawn tokens and scopes, or any text, or a wrong type."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.one_of(texts, st.sampled_from(WRONG), st.sampled_from(["", ",", "=", "==", ",,a=b,,"])))
    items = draw(st.lists(st.tuples(tokens, st.sampled_from(["=", "==", " = ", ""]), scopes), max_size=4))
    pad = draw(st.sampled_from(["", " ", "\t", "\xa0"]))
    return draw(st.sampled_from([",", ", ", ",,"])).join(f"{pad}{t}{eq}{s}{pad}" for t, eq, s in items)


@st.composite
def file_contents(draw: st.DrawFn) -> bytes:
    """A tokens file's bytes: lines of drawn tokens and scopes, comments and blank lines, any line break,
    a byte-order mark; or random bytes, or text that is not UTF-8."""
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.binary(max_size=80))
    lines = draw(st.lists(st.one_of(
        st.builds(lambda t, sep, s: f"{t}{sep}{s}", tokens, st.sampled_from([" ", "\t", "  ", " \xa0", "="]), scopes),
        st.sampled_from(["", "   ", "# a comment", "#tok-1 scope-a", "tok-1 scope-a extra", "tok-only"]),
    ), max_size=5))
    text = draw(st.sampled_from(LINE_BREAKS)).join(lines)
    if draw(st.booleans()):
        text = "\ufeff" + text
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "latin-1", "utf-16", "surrogatepass"]))
    if encoding == "surrogatepass":
        return text.encode("utf-8", "surrogatepass")
    return text.encode(encoding, "replace")


header_values = st.one_of(
    st.binary(max_size=60),
    st.builds(
        lambda scheme, gap, before, token, after: (scheme + gap + before + token + after).encode("latin-1"),
        st.sampled_from(["Bearer", "bearer", "BEARER", "bEaReR", "Basic", "Bearer:", "Token", ""]),
        st.sampled_from([" ", "  ", "\t", "", " \t"]),
        st.sampled_from(["", " ", "\t", "\xa0", "\x85", "\x0b", "\x1c", "\x00", "\r"]),
        st.one_of(
            st.sampled_from(list(KNOWN)),
            st.sampled_from(list(KNOWN)).map(lambda t: t[:-1]),
            st.sampled_from(list(KNOWN)).map(lambda t: t + "x"),
            st.sampled_from(list(KNOWN)).map(str.swapcase),
            st.sampled_from(list(KNOWN)).map(lambda t: t + " " + t),
            printable_tokens,
            st.text(st.characters(max_codepoint=0xFF), max_size=20),
        ),
        st.sampled_from(["", " ", "\t", " \t ", "\xa0", "\x85", "\x0b", "\x1f", "\x00", "é"]),
    ),
    st.just(b"Bearer " + b"t" * 100_000),
)


def token_variants(token: str) -> list[str]:
    """Strings one edit away from a known token: none may open its scope."""
    out = [token[:-1], token + "x", "x" + token, token.swapcase(), token.upper(), token.lower(), token * 2,
           token + "\x00", "\ufeff" + token, token.encode().decode("latin-1") + "\u0301"]
    out += [s + token for s in SPACES] + [token + s for s in SPACES]
    return out


# ---------------------------------------------------------------------------------------------- oracles


def valid_token(token: object) -> bool:
    """The documented rule: non-empty printable ASCII without whitespace."""
    return isinstance(token, str) and re.fullmatch(r"[!-~]+", token) is not None


def valid_scope(scope: object) -> bool:
    """The documented rule: an id a session can be created under."""
    try:
        check_id("scope", scope, new=True)
    except InvalidInput:
        return False
    return True


def expected_map(pairs: Any) -> dict[str, str] | None:
    """The token -> scope map ``TokenMap(pairs)`` must hold, or None when it must refuse them."""
    if isinstance(pairs, str | bytes | dict) or not isinstance(pairs, list | tuple):
        return None
    known: dict[str, str] = {}
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            return None
        token, scope = pair
        if not valid_token(token) or not valid_scope(scope) or known.get(token, scope) != scope:
            return None
        known[token] = scope
    return known


def expected_scope(header: bytes | None) -> str | None:
    """The scope a request with this first Authorization header must get (None: 401)."""
    if header is None:
        return None
    m = re.fullmatch(r"(?i:bearer) [ \t]*([!-~]+)[ \t]*", header.decode("latin-1"))
    return KNOWN.get(m.group(1)) if m else None


def check_lookups(tm: TokenMap, known: dict[str, str]) -> None:
    """``tm`` grants each known token its scope, and nothing one edit away from one (unless known too)."""
    assert len(tm) == len(known)
    for token, scope in known.items():
        assert tm.scope_for(token) == scope
        if len(token) < 1000:
            for variant in token_variants(token):
                assert tm.scope_for(variant) == known.get(variant), (token, variant)


# ---------------------------------------------------------------------------------------------- the app


def asgi_request(app: Any, headers: list[tuple[bytes, bytes]], path: str = "/v1/whoami") -> tuple[int, dict[str, str]]:
    """One GET through the ASGI app in this process: (status, response headers)."""
    status, answered, _body = asgi_exchange(app, headers, path)
    return status, answered


def asgi_exchange(
    app: Any, headers: list[tuple[bytes, bytes]], path: str = "/v1/whoami"
) -> tuple[int, dict[str, str], bytes]:
    """One GET with an empty body through the ASGI app in this process: (status, headers, body)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
        "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1234),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    answered = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start["headers"]}
    return start["status"], answered, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The service's app over a SQLite store, knowing ``KNOWN``."""
    store = TranscriptStore(f"sqlite:///{tmp_path_factory.mktemp('tokens') / 'store.db'}")
    service = Service(store, load_settings(config_path=None, engine="legacy"))
    yield create_app(service, TokenMap(list(KNOWN.items())))
    service.runtime.dispose()
    store.close()


# ---------------------------------------------------------------------------------------------- the campaign


def calls(app: Any, folder: Path) -> dict[str, Callable[[st.DataObject], Callable[[], Any]]]:
    """Each drawn function: a draw of its arguments, returning the call and the checks of its result."""
    folder.mkdir(exist_ok=True)
    tokens_file = folder / "tokens.txt"
    directory = folder / "a-directory"
    directory.mkdir(exist_ok=True)
    unreadable = folder / "unreadable.txt"
    unreadable.write_bytes(b"tok-1 scope-a\n")
    unreadable.chmod(0)  # still readable by root: then it parses
    paths = st.one_of(
        st.just(str(tokens_file)), st.just(tokens_file), st.sampled_from([
            str(directory), str(folder / "missing.txt"), str(unreadable), str(folder / "a\x00b"),
            str(folder / "a\ud800"), str(folder / "\udcff"), str(folder / ("x" * 5000)), "",
        ]),
        st.sampled_from(WRONG),
    )

    def constructor(data: st.DataObject) -> Callable[[], Any]:
        pairs = data.draw(pair_lists, "pairs")
        if isinstance(pairs, Iterator):  # an iterator is good once: the oracle reads a list
            pairs = iter(listed := list(pairs))
            expected = expected_map(listed)
        else:
            expected = expected_map(pairs)

        def call() -> None:
            try:
                tm = TokenMap(pairs)
            except InvalidInput:
                assert expected is None, f"refused pairs the rules accept: {pairs!r:.200}"
                raise
            assert expected is not None, f"accepted pairs the rules refuse: {pairs!r:.200}"
            check_lookups(tm, expected)

        return call

    def unchanged_load(run: Callable[[], Any], content: bytes | None) -> Any:
        environ = dict(os.environ)
        try:
            return run()
        finally:
            assert dict(os.environ) == environ, "loading changed the environment"
            if content is not None:
                assert tokens_file.read_bytes() == content, "loading changed the tokens file"

    def parsed_pairs_work(pairs: list[tuple[str, str]], separators: bool) -> None:
        assert isinstance(pairs, list) and all(isinstance(p, tuple) and len(p) == 2 for p in pairs)
        for token, scope in pairs:
            assert token and scope and isinstance(token, str) and isinstance(scope, str)
            assert not (separators and any(c.isspace() for c in token + scope)), (token, scope)
        expected = expected_map(pairs)
        try:
            tm = TokenMap(pairs)
        except InvalidInput:
            assert expected is None
            return
        assert expected is not None
        check_lookups(tm, expected)

    def parse_file(data: st.DataObject) -> Callable[[], Any]:
        content = data.draw(file_contents(), "content")
        tokens_file.write_bytes(content)
        path = data.draw(paths, "path")
        return lambda: unchanged_load(lambda: parsed_pairs_work(TokenMap.parse_file(path), True), content)

    def parse_env(data: st.DataObject) -> Callable[[], Any]:
        value = data.draw(env_values(), "value")
        return lambda: parsed_pairs_work(TokenMap.parse_env(value), False)

    def load(data: st.DataObject) -> Callable[[], Any]:
        content = data.draw(file_contents(), "content")
        tokens_file.write_bytes(content)
        path = data.draw(st.one_of(st.none(), paths), "path")
        env = data.draw(st.one_of(st.none(), env_values()), "env")
        from_environ = data.draw(env_values(), "environ") if env is None else None

        def call() -> None:
            saved = os.environ.get(TOKENS_ENV)
            if isinstance(from_environ, str):
                try:
                    os.environ[TOKENS_ENV] = from_environ
                except (ValueError, UnicodeError):  # no NUL, no lone surrogate in a real environment
                    os.environ.pop(TOKENS_ENV, None)
            else:
                os.environ.pop(TOKENS_ENV, None)
            try:
                tm = unchanged_load(lambda: TokenMap.load(path=path, env=env), content)
                assert isinstance(tm, TokenMap)
            finally:
                os.environ.pop(TOKENS_ENV, None)
                if saved is not None:
                    os.environ[TOKENS_ENV] = saved

        return call

    lookup_map = TokenMap(list(KNOWN.items()))

    def scope_for(data: st.DataObject) -> Callable[[], Any]:
        token = data.draw(st.one_of(
            tokens, st.sampled_from(WRONG),
            st.sampled_from(list(KNOWN)).flatmap(lambda t: st.sampled_from(token_variants(t))),
        ), "token")

        def call() -> None:
            assert lookup_map.scope_for(token) == (KNOWN.get(token) if type(token) is str else None), token
            assert len(lookup_map) == len(KNOWN)

        return call

    def bearer(data: st.DataObject) -> Callable[[], Any]:
        value = data.draw(st.one_of(st.none(), header_values.map(lambda b: b.decode("latin-1"))), "header")

        def call() -> None:
            token = service_app.bearer_token(value)
            expected = expected_scope(None if value is None else value.encode("latin-1"))
            assert (KNOWN.get(token) if token is not None else None) == expected, (value, token)

        return call

    def auth(data: st.DataObject) -> Callable[[], Any]:
        values = data.draw(st.lists(header_values, max_size=3), "authorization headers")
        name = data.draw(st.sampled_from([b"authorization", b"Authorization", b"AUTHORIZATION"]), "name")
        path = data.draw(st.sampled_from(["/v1/whoami", "/openapi.json", "/v1/sessions", "/v1/sessions/s-0"]), "path")

        def call() -> None:
            # Servers hand headers to ASGI apps with lower-case names; a name in another case is no header.
            headers = [(name, v) for v in values]
            status, response = asgi_request(app, headers, path)
            # Exactly one header grants (two are refused, whatever the first holds).
            only = values[0] if len(values) == 1 and name == b"authorization" else None
            scope = expected_scope(only)
            if scope is None:
                assert status == 401 and response.get("www-authenticate") == "Bearer", (values, status)
            else:
                assert status in (200, 404), (values, status)  # 404: an unknown session of the scope

        return call

    return {
        "TokenMap": constructor, "TokenMap.parse_file": parse_file, "TokenMap.parse_env": parse_env,
        "TokenMap.load": load, "TokenMap.scope_for": scope_for, "service_app.bearer_token": bearer,
        "service_app.caller": auth,
    }


def hostile_tokens_campaign(request: pytest.FixtureRequest, app: Any, tmp_path: Path, examples: int) -> None:
    """Draw ``examples`` inputs for every function of ``calls``: typed refusals only, and the lookups' rules."""
    started = time.monotonic()
    figures: dict[str, dict[str, int]] = {}

    def check(name: str, thunk: Callable[[], Any]) -> None:
        counts = figures.setdefault(name, {"calls": 0, "refused": 0})
        counts["calls"] += 1
        try:
            thunk()
        except TranscriptStoreError as e:
            assert isinstance(e, InvalidInput), f"{name} refused with {e!r}, not InvalidInput"
            assert str(e).isprintable(), f"{name}: an error message that is not one printable line: {e!r}"
            counts["refused"] += 1

    def hypothesis_test(name: str, draw: Callable[[st.DataObject], Callable[[], Any]]) -> Callable[[], None]:
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            check(name, draw(data))

        return run

    for name, draw in calls(app, tmp_path / "files").items():
        hypothesis_test(name, draw)()
    total = sum(c["calls"] for c in figures.values())
    refused = sum(c["refused"] for c in figures.values())
    report(request, "none", {
        "functions": len(figures), "examples_per_function": examples, "calls": total, "refusals": refused,
        "accepted": total - refused, "untyped_errors": 0, "grants_to_unknown_tokens": 0,
        "seconds": round(time.monotonic() - started, 1),
    })
    assert all(c["calls"] >= examples for c in figures.values()), figures


def test_hostile_tokens_and_headers_get_typed_errors_and_grant_only_known_tokens(
    request: pytest.FixtureRequest, app: Any, tmp_path: Path
) -> None:
    hostile_tokens_campaign(request, app, tmp_path, EXAMPLES)


@pytest.mark.slow
def test_hostile_tokens_and_headers_1000_examples_per_function(
    request: pytest.FixtureRequest, app: Any, tmp_path: Path
) -> None:
    hostile_tokens_campaign(request, app, tmp_path, SLOW_EXAMPLES)


def test_every_public_function_of_the_tokens_is_drawn(app: Any, tmp_path: Path) -> None:
    public = {f"TokenMap.{n}" for n, v in vars(TokenMap).items()
              if not n.startswith("_") and isinstance(v, FunctionType | classmethod | staticmethod)}
    drawn = set(calls(app, tmp_path / "files"))
    assert drawn == {"TokenMap", *public, "service_app.bearer_token", "service_app.caller"}


# ---------------------------------------------------------------------------------------------- the bugs


#: (id, arguments of TokenMap / TokenMap.load): each escaped as a raw Python error, or built a map the
#: rules refuse; ``{tmp}`` in a path is the test's folder
REFUSED: list[tuple[str, Callable[[Path], Any]]] = [
    ("dict-of-two-char-tokens", lambda t: TokenMap({"ab": "scope"})),  # mapped the token "a" to the scope "b"
    ("dict-of-tokens", lambda t: TokenMap({"tok-1": "scope"})),  # ValueError: too many values to unpack
    ("none", lambda t: TokenMap(None)),  # TypeError
    ("int-token", lambda t: TokenMap([(1, "scope-a")])),  # TypeError
    ("three-item-pair", lambda t: TokenMap([("tok-1", "scope-a", "x")])),  # ValueError
    ("empty-pair", lambda t: TokenMap([[]])),  # ValueError
    # a scope no session can be created under (over MAX_ID_BYTES): every request of its token was a 400
    ("astral-scope", lambda t: TokenMap([("tok-1", "\U0010ffff" * 200)])),
    ("path-with-nul", lambda t: TokenMap.load(path=str(t / "a\x00b"), env="")),  # ValueError: embedded null byte
    ("path-with-surrogate", lambda t: TokenMap.load(path=str(t / "a\ud800"), env="")),  # UnicodeEncodeError
    ("int-path", lambda t: TokenMap.load(path=5, env="")),  # TypeError
    ("bytes-env", lambda t: TokenMap.load(env=b"tok-1=scope-a")),  # TypeError
    ("int-env", lambda t: TokenMap.load(env=5)),  # AttributeError
]


@pytest.mark.parametrize("case", [c for _, c in REFUSED], ids=[i for i, _ in REFUSED])
def test_the_bugs_this_campaign_found_stay_fixed(case: Callable[[Path], Any], tmp_path: Path) -> None:
    with pytest.raises(InvalidInput):
        case(tmp_path)


@pytest.mark.parametrize("token", ["\ud800", "tok-A_0123456789\udc00", b"tok-A_0123456789", None, 1])
def test_a_lookup_of_anything_but_text_or_of_a_lone_surrogate_is_no_scope(token: Any) -> None:
    """These raised UnicodeEncodeError or AttributeError hashing the presented token."""
    assert TokenMap(list(KNOWN.items())).scope_for(token) is None


@pytest.mark.parametrize("value", [
    b"Bearer tok-A_0123456789\x85", b"Bearer \xa0tok-A_0123456789", b"Bearer tok-A_0123456789\x1c",
    b"Bearer \x0btok-A_0123456789", b"Bearer x\x0c",
])
def test_a_token_with_latin1_whitespace_around_it_is_401(app: Any, value: bytes) -> None:
    """FastAPI's HTTPBearer strips the credentials with str.strip: NEL, NBSP, \\x1c-\\x1f... around a token
    (Latin-1 in the header) were dropped, and the request got the token's scope."""
    assert asgi_request(app, [(b"authorization", value)])[0] == 401
    assert asgi_request(app, [(b"authorization", b"bearer   tok-A_0123456789 \t")])[0] == 200


def test_a_tokens_file_over_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    line = b"# " + b"-" * 1021 + b"\n"
    with path.open("wb") as f:
        for _ in range(MAX_TOKENS_FILE_BYTES // len(line)):
            f.write(line)
        f.write(b"tok-1 scope-a\n")
    assert path.stat().st_size > MAX_TOKENS_FILE_BYTES
    with pytest.raises(InvalidInput, match="at most"):
        TokenMap.load(path=str(path), env="")
    assert service.MAX_TOKENS_FILE_BYTES == MAX_TOKENS_FILE_BYTES


def _limit_memory() -> None:
    """In the child: 1 GiB of address space, so an unbounded read fails fast instead of filling the host."""
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def test_serve_refuses_an_endless_tokens_file_as_a_usage_error(tmp_path: Path) -> None:
    """``serve --tokens /dev/zero`` read the whole device into memory; it is a usage error (exit 2)."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKENS_ENV, "TRANSCRIPT_STORE_URL")}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "transcript_store", "serve", "--db", f"sqlite:///{tmp_path / 's.db'}",
         "--port", "0", "--tokens", "/dev/zero"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, preexec_fn=_limit_memory,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "at most" in result.stderr and "Traceback" not in result.stderr


def raw_request(port: int, header_lines: list[bytes]) -> int:
    """GET /v1/whoami with these raw header lines over a socket; the response's status."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + b"".join(
            line + b"\r\n" for line in header_lines) + b"\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_a_real_server_grants_only_exact_tokens_and_never_answers_500(tmp_path: Path) -> None:
    token = "tok-A_0123456789"
    good = [b"Bearer " + token.encode(), b"bearer  " + token.encode() + b"  ", b"BEARER " + token.encode() + b"\t"]
    bad = [
        b"Bearer " + token.encode() + b"\x85", b"Bearer \xa0" + token.encode(), b"Bearer " + token.encode() + b"\x1f",
        b"Bearer " + token[:-1].encode(), b"Bearer " + token.upper().encode(), b"Bearer " + token.encode() + b"x",
        b"Basic " + token.encode(), b"Bearer", b"Bearer ", token.encode(), b"Bearer\t" + token.encode(),
        b"Bearer " + token.encode() + b" " + token.encode(), b"Bearer \xff\xfe\x80", b"Bearer \xc3\xa9",
        b"Bearer " + b"t" * 60_000, b"Bearer " + token.encode() + b"\x00", b"Bearer " + token.encode() + b"\x7f",
    ]
    with ServiceProcess(f"sqlite:///{tmp_path / 's.db'}", {token: "scope-a"}, tmp_path / "serve.log") as server:
        for value in good:
            assert raw_request(server.port, [b"Authorization: " + value]) == 200, value
        for value in bad:
            # 401 from the app; 400 or 431 from the HTTP parser for bytes no header may hold, or too many
            assert raw_request(server.port, [b"Authorization: " + value]) in (400, 401, 431), value
        # Two Authorization headers are refused whatever their order (the first used to count: a good token
        # in front let a request carrying another in).
        assert raw_request(server.port, [b"Authorization: Bearer nope", b"Authorization: " + good[0]]) == 401
        assert raw_request(server.port, [b"Authorization: " + good[0], b"Authorization: Bearer nope"]) == 401
        assert "Traceback" not in server.log()


def test_nasty_text_never_opens_a_scope() -> None:
    tm = TokenMap(list(KNOWN.items()))
    assert all(tm.scope_for(t) is None for t in NASTY)
