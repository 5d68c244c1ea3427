"""Findings of the twenty-third review round (the turn-commit API against its own closed range).

Each test failed before its fix: ``Turns.complete`` wrote a turn's replies on a branch that had lost the
turn's question, and ``commit_turn`` receipted turns that ``read_closed_range`` refuses (branched away,
over the byte cap, one entry over the event cap).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import assistant, module_store_fixtures, user
from hosting import RecordingModel
from test_cli import empty_url
from test_compaction_focus import everything
from test_host import make_host

from transcript_store import InvalidInput, PayloadTooLarge, TranscriptStore, TurnBranchedAway
from transcript_store.fences import MAX_TURN_EVENTS
from transcript_store.ledger import CommitResult, TurnPayload, commit_turn_in
from transcript_store.models import ClosedRangeFailure
from transcript_store.turns import Turns

__all__ = ["empty_url"]  # a fixture of test_cli's, used here

S = "round-23"
E = "engine-1"

shared_url, store, sid = module_store_fixtures(S, "round-23")


def deliver(c: Any, turn: TurnPayload) -> CommitResult:
    return commit_turn_in(c, turn)


@pytest.mark.parametrize("fast", [False, True])
def test_a_turn_whose_question_was_branched_away_does_not_complete(
    store: TranscriptStore, sid: str, fast: bool
) -> None:
    """Another writer branched the session back before the turn's question while the turn ran: complete
    appended the reply at the moved head and accepted (or, fast, blocked) the turn, an answer on a
    branch without its question, which ``accept`` would have refused."""
    turns = Turns(store)
    system = store.append(S, sid, {"role": "system", "content": "sys"})
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id=E)
    store.branch(S, sid, system.entry_id)
    before = everything(store)
    with pytest.raises(TurnBranchedAway) as raised:
        turns.complete(S, sid, "t1", [{"message": assistant("A")}], deliver if fast else None)
    assert isinstance(raised.value, InvalidInput) and raised.value.turn_id == "t1"
    assert everything(store) == before
    assert [e.message for e in store.read_visible(S, sid)] == [{"role": "system", "content": "sys"}]


def test_a_turn_with_events_after_its_question_still_completes(store: TranscriptStore, sid: str) -> None:
    """The check reads the path only when the first reply does not follow the question: an event written
    in between (on the same branch) is no reason to refuse."""
    turns = Turns(store)
    turns.admit(S, sid, user("q"), turn_id="t1", engine_id=E)
    store.append(S, sid, kind="custom", payload={"note": "tool started"})
    done = turns.complete(S, sid, "t1", [{"message": assistant("A")}], deliver)
    assert done.commit is not None and done.commit.status == "committed"


def test_the_host_discards_a_turn_branched_away_while_its_model_ran(store: TranscriptStore, sid: str) -> None:
    """Through the host: the turn fails with TurnBranchedAway, nothing of it is written, its intent is
    discarded (the next turn is admitted at once)."""

    class BranchingModel(RecordingModel):
        def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
            if messages[-1].get("content") == "second":
                store.branch(S, sid, None)  # another client empties the branch mid-turn
            return super().complete(messages, tools, **kw)

    host, _ = make_host(store)
    host.model = BranchingModel()
    host.run_turn(S, sid, "first", turn_id="t0")
    with pytest.raises(TurnBranchedAway):
        host.run_turn(S, sid, "second", turn_id="t1")
    assert store.read_visible(S, sid) == []
    assert Turns(store).intent(S, sid, "t1") is None
    after = host.run_turn(S, sid, "third", turn_id="t2")
    assert [m["content"] for m in after.messages][:1] == ["third"]


def _turn(store: TranscriptStore, sid: str, replies: list[dict[str, Any]], events: int = 0) -> tuple[Any, Any]:
    admission = store.admit(S, sid, user("q"), turn_id="t1")
    if events:
        store.append_many(S, sid, [{"kind": "custom", "payload": {"i": i}} for i in range(events)])
    last = None
    for r in replies:
        last = store.append(S, sid, r)
    assert last is not None
    return admission, store.anchor(S, sid, last.entry_id)


@pytest.mark.parametrize("apply", [False, True])
def test_commit_turn_refuses_a_turn_that_left_the_active_branch(store: TranscriptStore, sid: str, apply: bool) -> None:
    """``read_closed_range`` says ``stale`` for a turn branched away; commit_turn receipted it."""
    turns = Turns(store)
    system = store.append(S, sid, {"role": "system", "content": "sys"})
    admission, terminal = _turn(store, sid, [assistant("A")])
    store.branch(S, sid, system.entry_id)
    found = store.read_closed_range(admission, terminal)
    assert isinstance(found, ClosedRangeFailure) and found.reason == "stale"
    before = everything(store)
    with pytest.raises(InvalidInput, match="active branch"):
        turns.commit_turn(E, "t1", admission, terminal, [user("q"), assistant("A")],
                          apply=(lambda c, t: None) if apply else None)
    assert everything(store) == before and turns.receipts(S, sid) == []


def test_commit_turn_refuses_a_turn_over_the_byte_cap(shared_url: str, sid: str) -> None:
    """Three messages of 3 MiB: ``read_closed_range`` says ``too_large``; commit_turn receipted them."""
    from transcript_store import StoreConfig

    big = TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False, max_payload_bytes=4 * 1024 * 1024))
    try:
        text = "x" * (3 * 1024 * 1024)
        admission = big.admit(S, sid, user(text), turn_id="t1")
        big.append(S, sid, assistant(text))
        last = big.append(S, sid, assistant(text))
        terminal = big.anchor(S, sid, last.entry_id)
        found = big.read_closed_range(admission, terminal)
        assert isinstance(found, ClosedRangeFailure) and found.reason == "too_large"
        with pytest.raises(PayloadTooLarge):
            Turns(big).commit_turn(E, "t1", admission, terminal, [user(text), assistant(text), assistant(text)])
        assert Turns(big).receipts(S, sid) == []
    finally:
        big.close()


def test_commit_turn_refuses_a_turn_one_entry_over_the_event_cap(store: TranscriptStore, sid: str) -> None:
    """Admission, 19,999 entries and the terminal are 20,001 entries: ``too_large`` for the closed range,
    a receipt for commit_turn (its bound was on the seq distance, one more)."""
    # One chain serves both sides of the cap (writing 20,000 events twice took 8-13 s of CI time): the
    # admission, 19,998 events and reply A are a turn within both caps; one more reply after A makes
    # A the 19,999th entry between the admission and a terminal one entry over the cap.
    within_admission, within_terminal = _turn(store, sid, [assistant("A")], events=MAX_TURN_EVENTS - 2)
    over = store.append(S, sid, assistant("B"))
    admission, terminal = within_admission, store.anchor(S, sid, over.entry_id)
    assert terminal.seq - admission.anchor.seq == MAX_TURN_EVENTS  # 20,001 entries, within the seq distance
    found = store.read_closed_range(admission, terminal)
    assert isinstance(found, ClosedRangeFailure) and found.reason == "too_large"
    with pytest.raises(InvalidInput, match=str(MAX_TURN_EVENTS)):
        Turns(store).commit_turn(E, "t1", admission, terminal, [user("q"), assistant("A"), assistant("B")])
    assert Turns(store).receipts(S, sid) == []
    # one entry fewer is within both caps
    assert not isinstance(store.read_closed_range(within_admission, within_terminal), ClosedRangeFailure)
    committed = Turns(store).commit_turn(E, "t1", within_admission, within_terminal, [user("q"), assistant("A")])
    assert committed.status == "committed"


def _long_session(store: TranscriptStore, sid: str, n: int) -> None:
    """``n`` ordinary messages written before the engine ever saw the session (a legacy-era session)."""
    for start in range(0, n, 500):
        store.append_many(S, sid, [
            {"message": {"role": "user" if i % 2 == 0 else "assistant",
                         "content": f"history message {i} " + "lorem ipsum dolor " * 10}}
            for i in range(start, min(n, start + 500))
        ])


def test_lossless_assemble_summarises_a_long_imported_session_before_cutting(
    store: TranscriptStore, sid: str
) -> None:
    """A 2,000-message session switched to lossless: assemble's one compaction pass summarised a few
    hundred messages, and ``fit`` cut the rest of the raw history and the new summaries with it: the
    first turns' requests began at message 1,879, with no summary and no recall hint."""
    _long_session(store, sid, 2000)
    host, model = make_host(store, engine="lossless", token_budget=8000)
    try:
        host.run_turn(S, sid, "first lossless turn", turn_id="t1")
    finally:
        host.dispose()
    request = model.requests[0]
    assert "lcm_grep" in str(request[0]["content"]), "no recall hint in the system prompt"
    assert any("messages msg_0.." in str(m.get("content")) for m in request), "no summary reaching msg_0"


def test_lossless_tells_the_model_when_it_had_to_cut_without_a_summary(store: TranscriptStore, sid: str) -> None:
    """When no summary could be made (a failing summarizer) and the context is cut, the system-prompt
    addition still points at the recall tools: it was None, and the cut went unmentioned."""
    from engines.lossless import LosslessEngine
    from engines.lossless.engine import CUT_HINT
    from transcript_store.engine import EngineContext
    from transcript_store.errors import SummarizerError
    from transcript_store.summarize import ExtractiveSummarizer
    from transcript_store.tokens import RoughEstimator

    class Down(ExtractiveSummarizer):
        def summarize(self, *args: Any, **kwargs: Any) -> Any:
            raise SummarizerError("summarizer down")

    _long_session(store, sid, 300)
    engine = LosslessEngine(EngineContext(store=store, summarizer=Down(), estimator=RoughEstimator(), config={}))
    engine.bootstrap(scope=S, session_id=sid, fence=None)
    result = engine.assemble(scope=S, session_id=sid, fence=None, token_budget=3000)
    assert result.system_prompt_addition == CUT_HINT
    assert not any("[Summary" in str(m.get("content")) for m in result.messages)
    whole = engine.assemble(scope=S, session_id=sid, fence=None, token_budget=200_000)
    assert whole.system_prompt_addition is None  # nothing cut, nothing summarised: nothing to say


def test_a_mirrored_turn_over_the_turn_cap_is_too_large_not_a_mismatch(store: TranscriptStore) -> None:
    """The service's commit_turn of a turn over ``max_turn_bytes`` (each message under the entry cap)
    answered 409 ``turn_mismatch``, "the mirrored range differs from the turn's messages": false; the
    library calls it too large, and the service maps that to 413 with the limit it advertises."""
    from mirror_helpers import A, commit, legacy_service, turn_request, visible

    sid = store.create_session(A).session_id
    svc_gen = legacy_service(store)
    svc = next(svc_gen)
    try:
        text = "x" * 3_000_000
        messages = [user("q"), assistant(text), user(text), assistant(text)]
        with pytest.raises(PayloadTooLarge, match="too large"):
            commit(svc, sid, turn_request("k1", 0, messages, ("u1", "a1")))
        assert visible(store, sid) == []  # nothing written
        small = [user("q"), assistant("a")]
        assert commit(svc, sid, turn_request("k1", 0, small, ("u1", "a1"))).status == "committed"
    finally:
        next(svc_gen, None)


def test_hermes_install_keeps_the_settings_file_private(tmp_path: Path) -> None:
    """The plugin's settings.json holds the database URL, password included: it was written world-readable
    (0644 under the usual umask)."""
    from click.testing import CliRunner

    from transcript_store.cli import cli

    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{tmp_path / 'store.db'}"  # (a PostgreSQL URL's password is what is at stake)
    settings = home / "plugins" / "transcript_store_hermes" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text("{}")
    settings.chmod(0o644)  # an earlier install's file keeps no wider mode either
    result = CliRunner().invoke(cli, ["hermes", "install", "--home", str(home), "--db", url])
    assert result.exit_code == 0, result.output
    assert json.loads(settings.read_text())["db_url"] == url
    assert stat.S_IMODE(settings.stat().st_mode) == 0o600


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_stopped_by_ctrl_c_or_sigterm_exits_cleanly(tmp_path: Path, sig: int) -> None:
    """uvicorn raised the stopping signal again after its graceful shutdown: Ctrl-C ended serve as "error:
    aborted" (exit 1, "failed"), SIGTERM killed it (143) before the store was closed and the engines
    disposed of."""
    from service_process import ServiceProcess

    proc = ServiceProcess(f"sqlite:///{tmp_path / 's.db'}", {"tok": "scope-a"}, tmp_path / "serve.log").start()
    child = proc.proc
    assert child is not None
    proc.stop(sig)
    assert child.returncode == 0, (child.returncode, proc.log())
    assert "error" not in proc.log() and "Traceback" not in proc.log(), proc.log()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_a_gateway_worker_starts_prints_no_traceback(tmp_path: Path) -> None:
    """A spawned worker imports the console script and the library (about a second) before it ignores
    SIGINT: a Ctrl-C then printed its KeyboardInterrupt traceback (3-4 of them a run: workers are
    respawned all the time). It now starts with SIGINT ignored."""
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("TRANSCRIPT_STORE_CONFIG", None)
    err = tmp_path / "err.txt"
    args = ["--db", f"sqlite:///{tmp_path / 'g.db'}", "gateway", "--workers", "2", "--sessions", "2", "--turns", "2"]
    with err.open("w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "transcript_store", *args], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _children(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _children(proc.pid), err.read_text()
        time.sleep(0.2)  # inside the worker's imports
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in err.read_text(), err.read_text()


def test_a_model_url_keeps_its_query_and_never_shows_it() -> None:
    """``/chat/completions`` went after the query (``...v1?api-version=1/chat/completions``: an Azure-style
    endpoint could not work), and the query's key was printed in errors in clear."""
    from transcript_store.errors import ModelError
    from transcript_store.model import OpenAIChatModel, endpoint_url, mask_url

    assert endpoint_url("https://h/v1/?api-version=2024-06-01", "/chat/completions") == (
        "https://h/v1/chat/completions?api-version=2024-06-01"
    )
    assert mask_url("http://127.0.0.1:9/v1?key=SECRETQ") == "http://127.0.0.1:9/v1?key=***"
    model = OpenAIChatModel("http://127.0.0.1:9/v1?key=SECRETQ", "m", timeout=5)
    with pytest.raises(ModelError) as raised:
        model.complete([{"role": "user", "content": "hi"}])
    assert "SECRETQ" not in str(raised.value) and "/v1/chat/completions?key=***" in str(raised.value)
    assert "SECRETQ" not in repr(model)


def test_a_model_url_with_credentials_is_refused(tmp_path: Path) -> None:
    """urllib sends no ``user:password@``: such a URL failed every turn with "Name or service not known"."""
    from test_cli import one_error_line, run

    run("init", "--db", f"sqlite:///{tmp_path / 'm.db'}", cwd=tmp_path)
    line = one_error_line(run("chat", "--db", f"sqlite:///{tmp_path / 'm.db'}", "--model-url",
                              "http://user:pw@127.0.0.1:9/v1", cwd=tmp_path, code=2, stdin="hi\n"))
    assert "credentials" in line and "pw" not in line.replace("password", ""), line


@pytest.mark.parametrize("command", [["chat"], ["serve", "--port", "0"], ["gateway", "--turns", "1"]])
def test_auto_upgrade_off_leaves_a_missing_or_foreign_sqlite_file_untouched(tmp_path: Path, command: list[str]) -> None:
    """With TRANSCRIPT_STORE_AUTO_UPGRADE=0 the creating commands refused (exit 4) after connecting: a new,
    empty file was left behind, and another program's database was switched to WAL."""
    import sqlite3

    from test_cli import run

    env = {"TRANSCRIPT_STORE_AUTO_UPGRADE": "0", "TRANSCRIPT_STORE_TOKENS": "tok=scope-a"}
    run(*command, "--db", f"sqlite:///{tmp_path / 'new.db'}", cwd=tmp_path, code=4, stdin="", env=env)
    assert not list(tmp_path.glob("new.db*"))
    theirs = tmp_path / "theirs.db"
    with sqlite3.connect(theirs) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
    conn.close()
    before = theirs.read_bytes()
    run(*command, "--db", f"sqlite:///{theirs}", cwd=tmp_path, code=4, stdin="", env=env)
    assert theirs.read_bytes() == before and not list(tmp_path.glob("theirs.db-*"))


def test_init_creates_a_store_with_auto_upgrade_off(tmp_path: Path) -> None:
    """Migrating on open is not init's business: with TRANSCRIPT_STORE_AUTO_UPGRADE=0 (the creating
    commands then refuse a file without a store) init refused too, advising itself."""
    from test_cli import run

    env = {"TRANSCRIPT_STORE_AUTO_UPGRADE": "0"}
    out = run("init", "--db", f"sqlite:///{tmp_path / 'n.db'}", cwd=tmp_path, env=env)
    assert "created the schema" in out.stdout
    run("chat", "--db", f"sqlite:///{tmp_path / 'n.db'}", cwd=tmp_path, stdin="/quit\n", env=env)


def test_the_chat_banner_never_shows_a_model_urls_key(tmp_path: Path) -> None:
    """The banner showed ``?key=...`` (and an Azure ``api-key``) in clear; the errors already masked it."""
    from test_cli import run

    url = "http://127.0.0.1:9/v1?api-version=2024-06-01&api-key=SECRETKEY123"
    out = run("chat", "--db", f"sqlite:///{tmp_path / 'c.db'}", "--model-url", url, "--model", "m",
              cwd=tmp_path, stdin="/quit\n")
    assert "SECRETKEY123" not in out.stdout + out.stderr and "api-key=***" in out.stdout, out.stdout


def test_a_long_full_text_term_over_a_long_text_is_linear(store: TranscriptStore) -> None:
    """SQLite's GLOB tried the whole 1,000-character term again at each of a 400,000-character tool
    result's positions (18-25 s, unbounded: regex searches have a bound, full text had none); the FTS5
    phrase of the whole run cost as much again. ``contains`` finds the folded term linearly, and a
    phrase holds at most FTS5_RUN characters."""
    from test_lossless_tools import A, call, make_engine, turn

    from engines.lossless import search as search_module

    sid = store.create_session(A).session_id
    engine = make_engine(store, {"context_window": 10**7})
    turn(store, engine, sid, "t1", "a" * 200_000 + "b", "Straße " * 10 + "ENDE")
    started = time.monotonic()
    out = call(engine, sid, "lcm_grep", {"pattern": "a" * 999 + "b"})
    assert out["count"] == 1 and time.monotonic() - started < 3.0, out  # (it took 6 to 9 s)
    assert call(engine, sid, "lcm_grep", {"pattern": "a" * 999 + "c"})["count"] == 0
    assert call(engine, sid, "lcm_grep", {"pattern": "STRASSE"})["count"] == 0  # ß is not ss by the rule
    assert call(engine, sid, "lcm_grep", {"pattern": "strASSe"})["count"] == 0
    assert call(engine, sid, "lcm_grep", {"pattern": "STRAẞE ende"})["count"] == 1  # ẞ folds as ß
    match = search_module._fts5_match(["x" * 1000])
    assert match is not None and len(match) <= search_module.FTS5_RUN + 2


def test_an_entry_id_shaped_like_an_engine_id_is_pointed_out(store: TranscriptStore) -> None:
    """Caller-given entry ids ``msg_1``..``msg_4`` (the store and the mirror keep them): lcm_grep named
    entry ``msg_3`` as ``msg_2``, and lcm_describe / lcm_expand of ``msg_3`` answered another message
    with no word of it."""
    from test_lossless_tools import A, call, make_engine

    sid = store.create_session(A).session_id
    engine = make_engine(store)
    for n in range(1, 5):
        store.append(A, sid, {"role": "user" if n % 2 else "assistant", "content": f"host message {n}"},
                     entry_id=f"msg_{n}")
    engine.bootstrap(scope=A, session_id=sid, fence=None)
    hit = call(engine, sid, "lcm_grep", {"pattern": "host message 3"})["results"][0]
    assert (hit["id"], hit["entry_id"]) == ("msg_2", "msg_3")
    for tool in ("lcm_describe", "lcm_expand"):
        out = call(engine, sid, tool, {"id": "msg_3"})
        assert "msg_2" in out.get("note", ""), out  # the entry named msg_3 is msg_2: said so
        assert "note" not in call(engine, sid, tool, {"id": "msg_0"})  # no entry is named msg_0


def test_a_compaction_through_the_service_can_be_fenced_at_a_running_turn(store: TranscriptStore) -> None:
    """The service's compact imported the transcript unfenced before compacting: a running turn's own
    message went into the lossless engine, and the turn's next fenced assemble raised
    ReadFenceError("crossed"). CompactRequest takes the turn's admission as ``fence`` now."""
    from transcript_store.service import Service
    from transcript_store.service_models import AdmitRequest, AssembleRequest, CompactRequest
    from transcript_store.settings import load_settings

    sid = store.create_session(S).session_id
    for i in range(6):
        store.append(S, sid, user(f"old question {i} " + "w " * 50))
        store.append(S, sid, assistant(f"old answer {i} " + "w " * 50))
    svc = Service(store, load_settings(config_path=None, token_budget=4000, max_output_tokens=500))
    try:
        adm = svc.admit(S, sid, AdmitRequest(message=user("the running turn's question"), turn_id="T1"))
        svc.assemble(S, "lossless", sid, AssembleRequest(fence=adm.anchor))
        done = svc.compact(S, "lossless", sid, CompactRequest(force=True, fence=adm.anchor))
        assert done.compacted
        again = svc.assemble(S, "lossless", sid, AssembleRequest(fence=adm.anchor))
        assert not any("the running turn's question" in str(m.get("content")) for m in again.messages)
    finally:
        svc.runtime.dispose()


def test_hermes_install_refuses_a_postgresql_database_without_a_store(empty_url: str, backend: str,
                                                                      tmp_path: Path) -> None:
    """PostgreSQL never migrates on open: installed on an empty database, the plugin failed every call
    inside Hermes (logged only) and compress returned the list unchanged for ever. install now asks for
    ``transcript-store init`` first; a SQLite file is still created by the plugin itself."""
    from test_cli import one_error_line, run

    home = tmp_path / "home"
    home.mkdir()
    plugin = home / "plugins" / "transcript_store_hermes"
    if backend == "sqlite":
        run("hermes", "install", "--home", str(home), "--db", empty_url, cwd=tmp_path)
        assert (plugin / "settings.json").exists()
        return
    line = one_error_line(run("hermes", "install", "--home", str(home), "--db", empty_url, cwd=tmp_path, code=4))
    assert "transcript-store init" in line and not plugin.exists(), line
    run("init", "--db", empty_url, cwd=tmp_path)
    run("hermes", "install", "--home", str(home), "--db", empty_url, cwd=tmp_path)
    assert (plugin / "settings.json").exists()
