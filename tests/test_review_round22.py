"""Findings of the twenty-second review round (an operator's walk through the CLI and the service).

Each test failed before its fix: bad URLs that surfaced as internal errors (exit 1, "rerun with --debug")
instead of usage errors (exit 2), and session ids with a slash that the service created but could not
address afterwards.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from conftest import tool_round
from hosting import CountingEngine
from mirror_helpers import A as MIRROR_SCOPE
from mirror_helpers import a, commit, hosted, legacy_service, page, turn_request, u, visible
from service_process import ServiceProcess
from test_cli import one_error_line, run
from test_host import SCOPE as HOST_SCOPE
from test_host import make_host
from test_service import TOKEN_A, TOKEN_B, db_url, server

from engines.lossless import LosslessEngine
from engines.lossless.audit import audit
from transcript_store import InvalidInput, TranscriptStore, outbox
from transcript_store.db import parse_url
from transcript_store.engine import EngineContext
from transcript_store.errors import EngineError, SessionBusy
from transcript_store.host import STOPPED_OVER_BUDGET, HostRuntime
from transcript_store.model import ModelResponse
from transcript_store.outbox import MAX_DISPLACED, MAX_OWNER, OutboxConfig
from transcript_store.settings import load_settings
from transcript_store.summarize import ExtractiveSummarizer
from transcript_store.tokens import RoughEstimator
from transcript_store.turns import Turns

__all__ = ["db_url", "server"]  # test_service's fixtures, used here

# ---------------------------------------------------------------------------------------------- usage errors


def test_an_unclosed_ipv6_service_url_is_a_usage_error(tmp_path: Path) -> None:
    line = one_error_line(run("openclaw", "install-line", "--service-url", "http://[::1", cwd=tmp_path, code=2))
    assert "--service-url" in line and "IPv6" in line and "internal error" not in line, line


@pytest.mark.parametrize("query", ["timeout=abc", "check_same_thread=maybe", "timeout=3", "isolation_level=x"])
def test_a_sqlite_url_with_query_parameters_is_a_usage_error(query: str, tmp_path: Path) -> None:
    """sqlite3's options in the URL: malformed, a ValueError from the driver at the first connection (exit
    1, "an internal error"); well formed, overridden by the store's own without a word."""
    url = f"sqlite:///{tmp_path / 'x.db'}?{query}"
    with pytest.raises(InvalidInput, match="takes no query parameters"):
        parse_url(url)
    line = one_error_line(run("current", "--db", url, cwd=tmp_path, code=2))
    assert "no query parameters" in line and "internal error" not in line, line
    assert not (tmp_path / "x.db").exists()


# ---------------------------------------------------------------------------------------------- ids in paths

#: ids whose characters a path decodes: a slash, a percent sign and what looks like an escape, both
IDS = ["team/alice", "100%", "a%2Fb", "caf\u00e9/\u00fc?#", "x%252F"]


@pytest.mark.parametrize("sid", IDS)
def test_the_service_reaches_a_session_whatever_its_id_holds(server: ServiceProcess, sid: str) -> None:
    """A session id with a slash, created through the service (the id is in a JSON body), was answered
    404 "Not Found" on every route naming it (sent as team%2Falice, the server decoded the path before
    routing: two segments). Every route reaches it, by its exact id, in its own scope only."""
    sid = f"{sid}-{uuid.uuid4().hex[:6]}"
    status, created = server.call("POST", "/v1/sessions", TOKEN_A, {"session_id": sid})
    assert status == 200 and created["session_id"] == sid, created
    path = f"/v1/sessions/{quote(sid, safe='')}"
    status, got = server.call("GET", path, TOKEN_A)
    assert status == 200 and got["session_id"] == sid, got
    items = [{"message": {"role": "user", "content": "hello"}, "entry_id": "e1"}]
    status, appended = server.call("POST", f"{path}/entries", TOKEN_A, {"items": items})
    assert status == 200 and [e["entry_id"] for e in appended["entries"]] == ["e1"], appended
    status, page = server.call("POST", f"{path}/delta", TOKEN_A, {})
    assert status == 200 and [e["entry_id"] for e in page["entries"]] == ["e1"], page
    status, bootstrap = server.call("GET", f"/v1/engines/legacy/sessions/{quote(sid, safe='')}/bootstrap", TOKEN_A)
    assert status == 200, bootstrap
    # another scope: the same id is no session there
    status, err = server.call("GET", path, TOKEN_B)
    assert status == 404 and err["error"]["code"] == "session_not_found", err


def test_an_id_that_differs_from_another_only_by_an_escape_is_another_session(server: ServiceProcess) -> None:
    """``a/b`` and ``a%2Fb`` are two ids: each path reaches its own session, never the other's."""
    tag = uuid.uuid4().hex[:6]
    for sid in (f"a/b-{tag}", f"a%2Fb-{tag}"):
        assert server.call("POST", "/v1/sessions", TOKEN_A, {"session_id": sid})[0] == 200
    for sid in (f"a/b-{tag}", f"a%2Fb-{tag}"):
        status, got = server.call("GET", f"/v1/sessions/{quote(sid, safe='')}", TOKEN_A)
        assert status == 200 and got["session_id"] == sid, got
    status, err = server.call("GET", f"/v1/sessions/a/b-{tag}", TOKEN_A)  # unescaped: two segments, no route
    assert status == 404 and err["error"]["code"] == "not_found", err


# ---------------------------------------------------------------------------------------------- host


class _BadCompact(CountingEngine):
    def compact(self, **kw: Any) -> Any:
        raise KeyError("engine bug in compact")


class _BadBootstrap(CountingEngine):
    def bootstrap(self, **kw: Any) -> Any:
        raise ValueError("engine bug in bootstrap")


class _BadSchemas(CountingEngine):
    def get_tool_schemas(self) -> Any:
        raise ZeroDivisionError("engine bug in get_tool_schemas")


@pytest.mark.parametrize("bad", [_BadCompact, _BadBootstrap, _BadSchemas])
def test_a_manual_compaction_whose_engine_raises_is_a_typed_error(store: TranscriptStore, bad: type) -> None:
    """An engine's own exception in compact, its bootstrap before it or its tool schemas came out of
    HostRuntime.compact as it was (KeyError...): the CLI's chat loop, which handles the library's errors,
    ended the session on /compact with "an internal error". It is EngineError now, the engine quarantined."""
    sid = store.create_session(HOST_SCOPE, session_id=f"s-{uuid.uuid4().hex[:8]}").session_id
    host, _model = make_host(store, "x", {"x": lambda ctx: bad(ctx, "x")})
    try:
        with pytest.raises(EngineError, match=r"engine 'x' failed during compaction: .*engine bug"):
            host.compact(HOST_SCOPE, sid)
        assert "x" in host.quarantined
    finally:
        host.dispose()


class _FailingCommit(CountingEngine):
    def commit_turn(self, **kw: Any) -> Any:
        raise RuntimeError("engine commit fails: the turn is queued")


def test_a_retry_admitted_after_another_attempt_accepted_the_turn_never_calls_the_model(
    store: TranscriptStore,
) -> None:
    """Attempt A of turn t1 is in its model call; retry B looks for an accepted attempt (none yet: A's
    intent is admitted); A completes (its engine's commit fails: accepted, queued) right before B admits.
    B's admission met the queued row and B assembled, called the model and ran the tools again for an
    accepted turn (its replies discarded at its completion). B reports A's turn, delivered by its drain."""
    sid = store.create_session(HOST_SCOPE, session_id=f"s-{uuid.uuid4().hex[:8]}").session_id
    in_model, go = threading.Event(), threading.Event()
    a, model_a = make_host(store, "x", {"x": lambda ctx: _FailingCommit(ctx, "x")})
    b, model_b = make_host(store, "x", {"x": lambda ctx: CountingEngine(ctx, "x")})
    complete = model_a.complete

    def blocking(*args: Any, **kw: Any) -> Any:
        in_model.set()
        go.wait(30)
        return complete(*args, **kw)

    model_a.complete = blocking  # type: ignore[method-assign]
    out_a: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out_a.setdefault("o", a.run_turn(HOST_SCOPE, sid, "hello", turn_id="t1")))
    try:
        thread.start()
        assert in_model.wait(30)
        admit = b.turns.admit

        def late_admit(*args: Any, **kw: Any) -> Any:
            go.set()
            thread.join(30)  # A completes, accepted and queued, right before B's admission
            assert (intent := a.turns.intent(HOST_SCOPE, sid, "t1")) is not None and intent.state == "ready"
            return admit(*args, **kw)

        b.turns.admit = late_admit  # type: ignore[method-assign]
        out_b = b.run_turn(HOST_SCOPE, sid, "hello", turn_id="t1")
    finally:
        go.set()
        thread.join(30)
        a.dispose()
        b.dispose()
    assert out_a["o"].commit_status == "queued"
    assert model_b.requests == [], "the retry called the model for a turn already accepted"
    assert out_b.commit_status == "committed" and out_b.messages == out_a["o"].messages
    assert [e.message["content"] for e in store.read_visible(HOST_SCOPE, sid)] == [
        "hello", out_a["o"].reply["content"]
    ]


# ---------------------------------------------------------------------------------------------- OpenClaw mirror


def test_an_import_of_a_committed_turn_stored_otherwise_keeps_the_turns_messages(store: TranscriptStore) -> None:
    """The OpenClaw plugin may store a huge turn's last message cut at its commit and whole at a later
    import (its messages.js: a commit is sized to the turn cap, an import is not), under the same host
    ids. Matching an import's message by id and content branched the mirror off the message the turn's
    receipt names, and stored a second, uncut copy (a review of this round's change found it; the
    change was withdrawn): the import matches by id, and changes nothing."""
    svc_gen = legacy_service(store)
    svc = next(svc_gen)
    try:
        sid = store.create_session(MIRROR_SCOPE, session_id=f"m-{uuid.uuid4().hex[:8]}").session_id
        cut = [u("question"), a("looked it up"), a("the answer [... cut to the turn cap ...]")]
        assert commit(svc, sid, turn_request("k1", 0, cut, ("h0", "h2"))).status == "committed"
        before = store.get_session(MIRROR_SCOPE, sid)
        whole = hosted(("h0", u("question")), ("h1", a("looked it up")), ("h2", a("the answer " + "x" * 5000)))
        page(store, sid, None, "c1", whole)
        after = store.get_session(MIRROR_SCOPE, sid)
        assert (after.head_entry_id, after.entry_count, after.generation) == (
            before.head_entry_id, before.entry_count, before.generation
        )
        shown = visible(store, sid, MIRROR_SCOPE)
        assert [e for e, _m in shown][::2] == ["h0", "h2"] and [m for _e, m in shown] == cut
    finally:
        next(svc_gen, None)


class _ToolHappyModel:
    """Calls a tool with ~150 tokens of arguments every time it is asked (within max_tokens)."""

    name = "tool-happy"

    def __init__(self) -> None:
        self.requests: list[list[dict[str, Any]]] = []

    def complete(self, messages: Any, tools: Any = None, *, max_tokens: Any = None, timeout: Any = None) -> Any:
        self.requests.append(list(messages))
        call = {"id": f"c{len(self.requests)}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"query": "word " * 140})}}
        return ModelResponse(message={"role": "assistant", "content": None, "tool_calls": [call]}, usage={},
                             model=self.name)


def test_a_tool_loop_whose_own_calls_outgrow_the_budget_stops_instead_of_sending_it(store: TranscriptStore) -> None:
    """fit_tool_round drops the engine's context, then cuts this turn's tool results; the assistant's tool
    calls themselves it cannot shrink, and a request they kept over the budget went to the model anyway
    (3 of 8 requests, up to 1,594 tokens where 1,000 were left). The loop stops there, as at its step
    limit, and the turn commits with what it did."""
    estimator = RoughEstimator()
    schema = {"type": "function", "function": {"name": "lookup", "description": "Look things up.",
                                               "parameters": {"type": "object", "properties": {}}}}
    model = _ToolHappyModel()
    settings = load_settings(config_path=None, engine="legacy", token_budget=1200, max_output_tokens=200,
                             max_tool_steps=8)
    host = HostRuntime(store, settings, model, summarizer=ExtractiveSummarizer(), estimator=estimator,
                       host_tools={"lookup": (schema, lambda _args: "found it")})
    sid = store.create_session(HOST_SCOPE, session_id=f"s-{uuid.uuid4().hex[:8]}").session_id
    try:
        out = host.run_turn(HOST_SCOPE, sid, "hi", turn_id="t1")
    finally:
        host.dispose()
    sizes = [estimator.count_messages(r) + estimator.count_text(json.dumps([schema])) for r in model.requests]
    assert max(sizes) <= 1200 - 200, sizes
    assert out.commit_status == "committed" and out.reply["content"] == STOPPED_OVER_BUDGET
    assert 2 <= len(model.requests) < 8


# ---------------------------------------------------------------------------------------------- lossless


def test_a_tool_call_waiting_for_its_results_is_never_summarized(store: TranscriptStore) -> None:
    """A transcript that ends in an assistant's tool call (a branch back to it to run the tool again, a
    bootstrap of a host transcript) had that call summarized when the fresh tail did not protect it
    (fresh_tail_messages 0, or a call larger than the tail's token cap); the result appended next then
    followed a summary raw: a tool message whose call was in no message, which the host drops."""
    scope = "scope-r22-lossless"
    sid = store.create_session(scope, session_id=f"s-{uuid.uuid4().hex[:8]}").session_id
    engine = LosslessEngine(EngineContext(
        store=store, config={"fresh_tail_messages": 0, "leaf_summary_tokens": 60},
        summarizer=ExtractiveSummarizer(), estimator=RoughEstimator(),
    ))
    call, result = tool_round("call-1", "sunny, 21 C")
    store.append_many(scope, sid, [{"message": {"role": "user", "content": "please look up the weather " * 20}},
                                   {"message": {"role": "assistant", "content": "I will look it up now. " * 20}},
                                   {"message": call}])
    engine.bootstrap(scope=scope, session_id=sid, fence=None)
    assert engine.compact(scope=scope, session_id=sid, force=True, token_budget=2000).compacted
    store.append_many(scope, sid, [{"message": result}, {"message": {"role": "assistant", "content": "Sunny."}}])
    out = engine.assemble(scope=scope, session_id=sid, fence=None, token_budget=2000).messages
    at = next(i for i, m in enumerate(out) if m["role"] == "tool")
    assert out[at - 1] == call and out[at] == result, out
    assert store.read(lambda c: audit(c, scope, sid)).problems == []


# ---------------------------------------------------------------------------------------------- outbox


def test_displaced_attempts_with_long_non_ascii_owners_are_all_kept(store: TranscriptStore) -> None:
    """The list of live attempts a retry took a turn from was written with every non-ASCII character of
    an owner escaped (up to 12 characters for one) and read only under a cap for plain owners: five
    owners of 128 such characters and the list was ignored. The turn was then taken for abandoned while
    those attempts ran (discarded; another turn admitted; a live attempt's completion UnknownTurn).
    Sixteen attempts with the longest owners of characters outside the BMP are kept, and hold the session."""
    sid = store.create_session(HOST_SCOPE, session_id=f"s-{uuid.uuid4().hex[:8]}").session_id
    long_lease = Turns(store, OutboxConfig(turn_lease_seconds=300))
    owners = [chr(0x1F600 + i) * MAX_OWNER for i in range(MAX_DISPLACED)]
    for owner in owners:
        long_lease.admit(HOST_SCOPE, sid, {"role": "user", "content": "q1"}, turn_id="t1", engine_id="legacy",
                         owner=owner)
    # the last attempt takes it over on a lease that runs out at once (its machine lost)
    Turns(store, OutboxConfig(turn_lease_seconds=0.0)).admit(
        HOST_SCOPE, sid, {"role": "user", "content": "q1"}, turn_id="t1", engine_id="legacy", owner="elsewhere"
    )
    row = store.read(lambda c: outbox.get_row(c, HOST_SCOPE, sid, "t1"))
    assert [o for o, _e in outbox.parse_displaced(row.displaced_leases)] == owners
    with pytest.raises(SessionBusy):  # the sixteen still run it: no other turn of the session
        long_lease.admit(HOST_SCOPE, sid, {"role": "user", "content": "q2"}, turn_id="t2", engine_id="legacy")
    # the one that failed hands the turn back to the most recent live attempt, which completes it
    assert not long_lease.discard(HOST_SCOPE, sid, "t1", owner="elsewhere")
    done = long_lease.complete(HOST_SCOPE, sid, "t1", [{"message": {"role": "assistant", "content": "a1"}}], None)
    assert done.intent.state in ("accepted", "ready")


# ---------------------------------------------------------------------------------------------- CLI settings


@pytest.mark.parametrize("value", ["a\x01", "x" * 300, "\u20ac" * 250])
def test_a_bad_scope_is_a_usage_error_named_by_its_source(value: str, tmp_path: Path) -> None:
    """A bad TRANSCRIPT_STORE_SCOPE (or --scope) was "scope must ...", exit 1: an unnamed internal-looking
    failure, where the README says a bad variable is a usage error (2) reported under its name."""
    db = f"sqlite:///{tmp_path / 'none.db'}"
    line = one_error_line(run("sessions", "list", "--db", db, cwd=tmp_path, code=2,
                              env={"TRANSCRIPT_STORE_SCOPE": value}))
    assert line.startswith("error: TRANSCRIPT_STORE_SCOPE: scope "), line
    line = one_error_line(run("--scope", value, "sessions", "list", "--db", db, cwd=tmp_path, code=2))
    assert line.startswith("error: --scope: scope "), line
    # hermes install wrote it into the plugin's settings, where every store call inside Hermes failed
    home = tmp_path / "hermes-home"
    line = one_error_line(run("hermes", "install", "--home", str(home), cwd=tmp_path, code=2,
                              env={"TRANSCRIPT_STORE_SCOPE": value}))
    assert line.startswith("error: TRANSCRIPT_STORE_SCOPE: scope "), line
    assert not (home / "plugins").exists()


def test_a_bad_url_variable_is_named_as_the_variable(tmp_path: Path) -> None:
    """TRANSCRIPT_STORE_URL's problems were reported as --db's, an option the user never passed."""
    line = one_error_line(run("sessions", "list", cwd=tmp_path, code=2, env={"TRANSCRIPT_STORE_URL": "sqlite://x.db"}))
    assert line.startswith("error: TRANSCRIPT_STORE_URL: a SQLite URL takes no host"), line
    line = one_error_line(run("sessions", "list", "--db", "mysql://a/b", cwd=tmp_path, code=2,
                              env={"TRANSCRIPT_STORE_URL": "sqlite://x.db"}))
    assert line.startswith("error: --db: unsupported database backend"), line


def test_the_openai_summarizers_endpoint_is_checked_by_every_command(tmp_path: Path) -> None:
    """doctor, compact and chat refused OPENAI_BASE_URL=ftp://x with the openai summarizer; sessions list
    and outbox status ran on as if it were fine."""
    env = {"TRANSCRIPT_STORE_SUMMARIZER": "openai", "OPENAI_BASE_URL": "ftp://x"}
    db = f"sqlite:///{tmp_path / 'none.db'}"
    for args in (["sessions", "list"], ["outbox", "status"]):
        line = one_error_line(run(*args, "--db", db, cwd=tmp_path, code=2, env=env))
        assert "OPENAI_BASE_URL" in line and "http" in line, (args, line)


@pytest.mark.parametrize("args", [["init"], ["chat", "--session", "x"],
                                  ["gateway", "--workers", "1", "--sessions", "1", "--turns", "1"]])
def test_a_file_that_is_not_sqlite_is_no_store_even_for_commands_that_create_one(
    args: list[str], tmp_path: Path
) -> None:
    """init, chat, gateway and sessions import on a text file answered sqlite3's "file is not a database"
    as an outage (exit 5, which invites a retry); the other commands said exit 4, no store there."""
    path = tmp_path / "text.db"
    path.write_text("my notes\n")
    line = one_error_line(run(*args, "--db", f"sqlite:///{path}", cwd=tmp_path, code=4, stdin="hi\n"))
    assert "the file is not a SQLite database" in line, line
    assert path.read_text() == "my notes\n"
