"""One turn at a time per session: a second admission waits for the first turn to end (``SessionBusy``),
an abandoned turn (lease expired, or its worker process gone) is discarded by the next one, and a retry
of a turn that a later turn has overtaken is refused (``TurnOvertaken``). Without these, a turn's
closed range held another turn's messages, and the engine received them twice."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import assistant, user, wait_until
from hosting import CountingEngine, RecordingModel
from test_host import SCOPE, make_host
from workers.turn_worker import ENGINE, counting_engine

from transcript_store import SessionBusy, TranscriptStore, TurnOvertaken, identity, outbox
from transcript_store.errors import InvalidInput, ModelTimeout
from transcript_store.identity import ProcessIdentity
from transcript_store.leases import LeaseKeeper
from transcript_store.ledger import committed_messages, count_turn_messages
from transcript_store.outbox import OutboxConfig
from transcript_store.turns import Turns

WORKER = Path(__file__).parent / "workers" / "turn_worker.py"


@pytest.fixture
def sid(store: TranscriptStore) -> str:
    return store.create_session(SCOPE, session_id="sess", session_key="agent:main:serial").session_id


def snapshot(store: TranscriptStore, turns: Turns, sid: str) -> tuple[list[Any], list[Any]]:
    """The session's entries and the outbox's rows: what a refused call must leave as it found."""
    entries = [(e.seq, e.entry_id, e.turn_id) for e in store.list_entries(SCOPE, sid, limit=1000)]
    intents = [(i.turn_id, i.state, i.lease_owner) for i in turns.intents(SCOPE)]
    return entries, intents


def test_a_second_turn_waits_for_the_running_one(store: TranscriptStore, sid: str) -> None:
    turns = Turns(store)
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
    before = snapshot(store, turns, sid)
    with pytest.raises(SessionBusy) as caught:
        turns.admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id=ENGINE)
    assert (caught.value.session_id, caught.value.turn_id) == (sid, "t1")
    expires = caught.value.lease_expires_at
    assert expires is not None and timedelta(seconds=250) < expires - datetime.now(UTC) <= timedelta(seconds=300)
    assert turns.admit_if_clear(SCOPE, sid, user("q2"), turn_id="t2", engine_id=ENGINE) is None
    with pytest.raises(SessionBusy):  # another engine's turn runs in the same conversation
        turns.admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id="other-engine")
    assert snapshot(store, turns, sid) == before  # nothing written
    # The same turn again (a retry of t1) is not another turn: it takes its admission over.
    again, _ = turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
    assert again.anchor.seq == 0

    done = turns.complete(SCOPE, sid, "t1", [{"message": assistant("a1")}], counting_engine)
    assert done.commit is not None and done.commit.status == "committed"
    turns.admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id=ENGINE)
    done = turns.complete(SCOPE, sid, "t2", [{"message": assistant("a2")}], counting_engine)
    assert done.commit is not None and done.commit.status == "committed"
    # Each turn's range holds its own messages only: the engine got every message once.
    first = store.read(lambda c: committed_messages(c, SCOPE, sid, ENGINE, "t1"))
    second = store.read(lambda c: committed_messages(c, SCOPE, sid, ENGINE, "t2"))
    assert [m["content"] for m in first] == ["q1", "a1"] and [m["content"] for m in second] == ["q2", "a2"]
    assert store.read(lambda c: count_turn_messages(c, SCOPE, sid, ENGINE)) == 4


def test_queued_turns_do_not_hold_the_session(store: TranscriptStore, sid: str) -> None:
    """Only a running (admitted) turn holds the session: an accepted one, queued for its engine, or a
    blocked one, has its range closed already."""
    turns = Turns(store)
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
    assert turns.complete(SCOPE, sid, "t1", [{"message": assistant("a1")}], None).intent.state == "accepted"
    turns.admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id=ENGINE)
    assert turns.complete(SCOPE, sid, "t2", [{"message": assistant("a2")}], None).intent.state == "accepted"
    assert turns.drain(lambda e: counting_engine if e == ENGINE else None).committed == 2


def test_another_session_is_not_held(store: TranscriptStore, sid: str) -> None:
    turns = Turns(store)
    other = store.create_session(SCOPE, session_id="other").session_id
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
    admission, _ = turns.admit(SCOPE, other, user("q1"), turn_id="t1", engine_id=ENGINE)
    assert admission.anchor.session_id == "other"


def test_a_turn_whose_lease_expired_is_discarded_by_the_next(
    store: TranscriptStore, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    Turns(store, OutboxConfig(turn_lease_seconds=0.0)).admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
    turns = Turns(store)
    with caplog.at_level(logging.WARNING, logger="transcript_store.outbox"):
        turns.admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id=ENGINE)
    assert "turn t1 of session sess was abandoned by its worker" in caplog.text
    assert [(i.turn_id, i.state) for i in turns.intents(SCOPE)] == [("t2", "admitted")]
    assert [e.turn_id for e in store.read_visible(SCOPE, sid)] == ["t1", "t2"]  # t1's entry stays
    done = turns.complete(SCOPE, sid, "t2", [{"message": assistant("a2")}], counting_engine)
    assert done.commit is not None and done.commit.status == "committed"
    assert [m["content"] for m in store.read(lambda c: committed_messages(c, SCOPE, sid, ENGINE, "t2"))] == [
        "q2", "a2",
    ]


def start_admitter(url: str, turn_id: str, *, if_clear: bool = False) -> subprocess.Popen[str]:
    """A real worker process that admits ``turn_id`` into session ``sess`` (lease 300 s) and then waits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSCRIPT_STORE_")}
    args = [sys.executable, str(WORKER), "admit", "--url", url, "--sessions", "sess", "--scope", SCOPE,
            "--turn-id", turn_id, "--turn-lease", "300", *(["--if-clear"] if if_clear else [])]
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def admitter_result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"worker exited with {proc.wait(timeout=30)}"
    result: dict[str, Any] = json.loads(line)
    return result


def test_a_killed_workers_turn_is_discarded_at_once(store_url: str, store: TranscriptStore, sid: str) -> None:
    """Its lease has minutes to run, but its process is gone from this machine: nobody can finish it."""
    proc = start_admitter(store_url, "t1")
    try:
        assert admitter_result(proc) == {"admitted": True, "busy": None}
        turns = Turns(store)
        with pytest.raises(SessionBusy):  # its worker still lives
            turns.admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id=ENGINE)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    report = turns.recover(SCOPE, sid, ENGINE, lambda e: counting_engine)
    assert report.discarded == ["t1"] and report.running == [] and not report.must_degrade
    admitted = turns.admit_if_clear(SCOPE, sid, user("q2"), turn_id="t2", engine_id=ENGINE)
    assert admitted is not None


def test_a_killed_worker_not_reaped_yet_is_gone_too(store_url: str, store: TranscriptStore, sid: str) -> None:
    """A worker killed and not yet reaped by its parent (a zombie: a host that forks its workers may wait
    for them late) keeps its pid and start ticks in /proc, but runs no more: its turn is discarded by the
    next admission, not after its 300 s lease (a review found the session busy until the reap)."""
    proc = start_admitter(store_url, "t1")
    try:
        assert admitter_result(proc) == {"admitted": True, "busy": None}
        proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _state(proc.pid) != "Z":  # killed; Popen reaps only in wait() or poll()
            assert time.monotonic() < deadline, "the killed worker did not become a zombie"
            time.sleep(0.01)
        holder = ProcessIdentity.parse(Turns(store).intent(SCOPE, sid, "t1").lease_owner.split("/")[0])
        assert holder is not None and holder.is_dead_here() and not holder.is_alive_here()
        admission, _ = Turns(store).admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id=ENGINE)
        assert admission.turn_id == "t2" and _state(proc.pid) == "Z"  # discarded before the reap
        assert [i.turn_id for i in Turns(store).intents(SCOPE)] == ["t2"]
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _state(pid: int) -> str:
    """The /proc state letter of a process (R, S, Z, ...)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# 4 processes in make test, 8 in make test-slow (CI time: each is a Python start-up on two busy cores).
@pytest.mark.parametrize("processes", [4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("if_clear", [False, True], ids=["admit", "admit_if_clear"])
def test_processes_admitting_into_one_session_get_one_turn(
    store_url: str, store: TranscriptStore, sid: str, if_clear: bool, processes: int
) -> None:
    """On PostgreSQL they really race: the checks run with the session row locked, after the append."""
    procs = [start_admitter(store_url, f"t{i}", if_clear=if_clear) for i in range(processes)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs:  # the go signal, as close together as the pipes allow
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            assert proc.stdout is not None
            results.append(json.loads(proc.stdout.readline()))
    finally:
        for proc in procs:  # closing stdin lets each one exit (they hold their turns until then)
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
    winners = [i for i, r in enumerate(results) if r["admitted"]]
    assert len(winners) == 1, results
    assert all(r["busy"] == (None if if_clear else f"t{winners[0]}") for r in results if not r["admitted"])
    assert [e.turn_id for e in store.list_entries(SCOPE, sid)] == [f"t{winners[0]}"]
    assert [i.turn_id for i in Turns(store).intents(SCOPE)] == [f"t{winners[0]}"]


def test_a_retry_overtaken_by_a_later_turn_is_refused(store: TranscriptStore, sid: str) -> None:
    turns = Turns(store)
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
    turns.discard(SCOPE, sid, "t1")  # its attempt failed; the user's message stays in the transcript
    turns.admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id=ENGINE)
    turns.complete(SCOPE, sid, "t2", [{"message": assistant("a2")}], counting_engine)
    before = snapshot(store, turns, sid)
    for admit in (turns.admit, turns.admit_if_clear):
        with pytest.raises(TurnOvertaken) as caught:
            admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
        assert (caught.value.turn_id, caught.value.later_turn_id) == ("t1", "t2")
    assert snapshot(store, turns, sid) == before
    # Under a new turn id the same question is a new turn, after t2.
    admission, _ = turns.admit(SCOPE, sid, user("q1"), turn_id="t1b", engine_id=ENGINE)
    assert admission.anchor.seq == 3


def test_a_retry_followed_only_by_entries_of_no_turn_continues(store: TranscriptStore, sid: str) -> None:
    turns = Turns(store)
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
    turns.discard(SCOPE, sid, "t1")
    store.append(SCOPE, sid, kind="custom", payload={"note": "the host's own event"})
    admission, intent = turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
    assert admission.anchor.seq == 0 and intent.state == "admitted"


def test_the_host_reports_a_busy_session_without_degrading(
    store: TranscriptStore, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    host, model = make_host(store, "counting", {"counting": lambda ctx: CountingEngine(ctx, "counting")})
    turns = Turns(store)
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id="counting")  # another worker's running turn
    with caplog.at_level(logging.WARNING), pytest.raises(SessionBusy):
        host.run_turn(SCOPE, sid, "q2", turn_id="t2")
    assert "legacy" not in caplog.text and model.requests == []
    assert [e.turn_id for e in store.list_entries(SCOPE, sid)] == ["t1"]
    turns.complete(SCOPE, sid, "t1", [{"message": assistant("a1")}], None)  # the other worker finishes
    out = host.run_turn(SCOPE, sid, "q2", turn_id="t2")  # the same turn again: the configured engine
    assert (out.engine_id, out.degraded_reason, out.commit_status) == ("counting", None, "committed")
    assert [r.advancement_key for r in turns.receipts(SCOPE, sid, "counting")] == ["t1", "t2"]


def test_the_host_refuses_an_overtaken_retry(store: TranscriptStore, sid: str) -> None:
    host, model = make_host(store)
    model.fail_next = [RuntimeError("provider 500")]
    with pytest.raises(RuntimeError):
        host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    host.run_turn(SCOPE, sid, "q2", turn_id="t2")
    calls = len(model.requests)
    with pytest.raises(TurnOvertaken):
        host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    assert len(model.requests) == calls
    ledger = store.read(lambda c: count_turn_messages(c, SCOPE, sid, "legacy"))
    assert ledger == 2  # t2's question and answer, once


# ---------------------------------------------------------------------------------------------- review fixes


def test_a_retry_of_an_accepted_turn_after_a_later_turn_is_answered(store: TranscriptStore, sid: str) -> None:
    """Only a turn that is to run again can be overtaken: an accepted one's range closed before."""
    turns = Turns(store)
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
    turns.complete(SCOPE, sid, "t1", [{"message": assistant("a1")}], None)
    turns.admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id=ENGINE)
    turns.complete(SCOPE, sid, "t2", [{"message": assistant("a2")}], None)
    before = snapshot(store, turns, sid)
    admission, intent = turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=ENGINE)
    assert (admission.anchor.seq, intent.state) == (0, "accepted")
    assert snapshot(store, turns, sid) == before


class _Broken(CountingEngine):
    def assemble(self, **kw: Any) -> Any:
        raise RuntimeError("engine bug")


@pytest.mark.parametrize("between", ["model timeout", "degraded to legacy"])
def test_the_host_keeps_the_session_between_attempts(store: TranscriptStore, sid: str, between: str) -> None:
    """A model timeout retries the turn, and a turn degraded after its admission reruns on legacy,
    without handing the session back in between: another turn presented meanwhile is refused."""
    if between == "model timeout":
        host, model = make_host(store)
        model.fail_next = [ModelTimeout("slow provider")]
    else:
        host, model = make_host(store, "broken", {"broken": lambda ctx: _Broken(ctx, "broken")})
    others: list[str] = []
    calls: list[int] = []
    admit_if_clear = host.turns.admit_if_clear

    def meanwhile(*args: Any, **kwargs: Any) -> Any:  # another worker, right before the second attempt
        calls.append(1)
        if len(calls) >= 2:
            try:
                Turns(store).admit(SCOPE, sid, user("other"), turn_id="o1", engine_id="legacy")
                others.append("admitted")
            except SessionBusy as e:
                others.append(f"busy {e.turn_id}")
        return admit_if_clear(*args, **kwargs)

    host.turns.admit_if_clear = meanwhile  # type: ignore[method-assign]
    out = host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    assert others == ["busy t1"]
    assert out.commit_status == "committed" and out.engine_id == "legacy"
    assert [e.turn_id for e in store.read_visible(SCOPE, sid) if e.turn_id] == ["t1"]
    assert Turns(store).intents(SCOPE) == []


def test_a_refusal_raised_inside_a_turn_frees_the_session(store: TranscriptStore, sid: str) -> None:
    """``SessionBusy`` raised after the admission (by a tool or model that reaches another session) is
    a failed attempt like any other: its intent is discarded, the session is not left held."""
    host, model = make_host(store)
    model.fail_next = [SessionBusy("elsewhere", "x", None)]
    with pytest.raises(SessionBusy):
        host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    assert Turns(store).intents(SCOPE) == []
    assert host.run_turn(SCOPE, sid, "q2", turn_id="t2").commit_status == "committed"


def test_identity_judges_a_process_dead_only_on_evidence(tmp_path: Path) -> None:
    me = identity.current()
    assert str(ProcessIdentity.parse(str(me))) == str(me) and not me.is_dead_here() and me.is_alive_here()
    child = subprocess.Popen([sys.executable, "-c", "import sys; from transcript_store import identity; "
                              "print(identity.current(), flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdin is not None
    theirs = ProcessIdentity.parse(child.stdout.readline().strip())
    assert theirs is not None and theirs.machine == me.machine and not theirs.is_dead_here()
    child.stdin.close()
    child.wait(timeout=30)
    assert theirs.is_dead_here()  # gone: no process has its pid
    reused = replace(me, start_ticks=(me.start_ticks or 0) + 1)  # the pid, now another process's
    assert reused.is_dead_here()
    # Unknown is not dead: another machine, a pid namespace or boot of its own, an identity without
    # the machine key (written before it, or where /proc is missing), an unparsable owner.
    assert not replace(theirs, machine="0" * 12).is_dead_here()
    assert not replace(theirs, machine=None, start_ticks=None).is_dead_here()
    legacy = ProcessIdentity.parse(f"{me.host}:{theirs.pid}:{int(me.start_time)}:deadbeef")
    assert legacy is not None and legacy.machine is None and not legacy.is_dead_here()
    assert ProcessIdentity.parse("not an identity") is None
    assert not outbox.abandoned("garbage", 2**62, 0) and outbox.abandoned(str(theirs), 2**62, 0)
    # Alive by the start in clock ticks, not by a wall-clock start derived again now: a clock stepped
    # since the identity was made (NTP, a virtual machine resumed after a pause) moves the latter.
    stepped = replace(me, start_time=me.start_time - 3600)
    assert stepped.is_alive_here() and not stepped.is_dead_here() and not reused.is_alive_here()
    assert not theirs.is_alive_here() and not replace(me, machine="0" * 12).is_alive_here()


def test_a_long_tool_loop_keeps_its_turn_past_the_lease(store: TranscriptStore, sid: str) -> None:
    """The host renews a running turn's lease while it runs: a tool loop longer than the lease is not
    discarded by another worker's turn (which gets SessionBusy instead), and commits."""
    lease = 1.5
    host, _ = make_host(store)
    host.turns = Turns(store, OutboxConfig(turn_lease_seconds=lease))
    others: list[str] = []

    class SlowModel(RecordingModel):
        def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
            if len(self.requests) == 1:  # the second call, after the tool: past the first lease
                time.sleep(1.0)
                try:
                    Turns(store).admit(SCOPE, sid, user("other"), turn_id="o1", engine_id="legacy")
                    others.append("admitted")
                except SessionBusy as e:
                    others.append(f"busy {e.turn_id}")
            return super().complete(messages, tools, **kw)

    schema, lookup = host.host_tools["lookup"]

    def slow_lookup(args: dict[str, Any]) -> str:
        time.sleep(0.8)
        return lookup(args)

    host.host_tools["lookup"] = (schema, slow_lookup)
    host.model = SlowModel()
    out = host.run_turn(SCOPE, sid, "please use tool lookup now", turn_id="t1")
    assert others == ["busy t1"]  # 1.8 s after the admission: renewed since, so still t1's
    assert out.commit_status == "committed" and [m["role"] for m in out.messages] == [
        "user", "assistant", "tool", "assistant",
    ]


# ---------------------------------------------------------------------------------------------- heartbeat


class _OneSlowCall(RecordingModel):
    """A model whose one call outlasts the turn's lease and runs ``meanwhile`` (another worker) in it."""

    def __init__(self, seconds: float, meanwhile: Any) -> None:
        super().__init__()
        self.seconds, self.meanwhile = seconds, meanwhile

    def complete(self, messages: Any, tools: Any = None, **kw: Any) -> Any:
        time.sleep(self.seconds)
        self.meanwhile()
        return super().complete(messages, tools, **kw)


def _other_worker(store: TranscriptStore, sid: str, seen: list[str]) -> Any:
    def admit() -> None:
        try:
            Turns(store).admit(SCOPE, sid, user("other"), turn_id="o1", engine_id="legacy")
            seen.append("admitted")
        except SessionBusy as e:
            seen.append(f"busy {e.turn_id}")

    return admit


def test_a_model_call_longer_than_the_lease_keeps_its_turn(store: TranscriptStore, sid: str) -> None:
    """One model call of twice the lease (a slow provider, a reasoning model): the lease is renewed in
    the background meanwhile, so another worker's turn is refused, and this one commits."""
    lease = 1.2  # renewed every 0.4 s: a keeper woken late on a loaded machine still renews it in time
    host, _ = make_host(store)
    host.turns = Turns(store, OutboxConfig(turn_lease_seconds=lease))
    seen: list[str] = []
    host.model = _OneSlowCall(2 * lease, _other_worker(store, sid, seen))
    out = host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    assert seen == ["busy t1"]
    assert out.commit_status == "committed" and host._leases.renewals >= 2
    assert [e.turn_id for e in store.read_visible(SCOPE, sid) if e.turn_id] == ["t1"]
    assert not host._leases.holds(SCOPE, sid, "t1") and Turns(store).intents(SCOPE) == []


def test_a_turn_discarded_while_it_ran_is_reported_overtaken(store: TranscriptStore, sid: str) -> None:
    """If the turn's intent is discarded anyway while its model runs (its worker stalled past the lease:
    recovery took it for dead) and another turn is admitted, completing says ``TurnOvertaken``, and
    writes none of its replies after the other turn's message."""
    host, _ = make_host(store)
    seen: list[str] = []
    admit_other = _other_worker(store, sid, seen)

    def stalled() -> None:
        Turns(store).discard(SCOPE, sid, "t1")
        admit_other()

    host.model = _OneSlowCall(0.0, stalled)
    with pytest.raises(TurnOvertaken) as raised:
        host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    assert (raised.value.turn_id, raised.value.later_turn_id) == ("t1", "o1") and seen == ["admitted"]
    assert [(e.turn_id, e.message["role"]) for e in store.read_visible(SCOPE, sid)] == [
        ("t1", "user"), ("o1", "user"),
    ]
    assert [(i.turn_id, i.state) for i in Turns(store).intents(SCOPE)] == [("o1", "admitted")]


def _owner(turns: Turns, sid: str, turn_id: str) -> str:
    intent = turns.intent(SCOPE, sid, turn_id)
    assert intent is not None and intent.lease_owner is not None
    return intent.lease_owner


def test_the_lease_keeper_renews_only_what_it_holds(
    store: TranscriptStore, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Held turns are renewed under the admission's owner; a released one is not; one discarded
    meanwhile is dropped with a warning; a zero lease holds nothing; close stops everything."""
    turns = Turns(store, OutboxConfig(turn_lease_seconds=0.3))
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id="legacy")
    keeper = LeaseKeeper(store)
    keeper.hold(SCOPE, sid, "t1", 0.3, _owner(turns, sid, "t1"))
    keeper.hold(SCOPE, sid, "zero", 0.0, "anyone")
    assert not keeper.holds(SCOPE, sid, "zero")
    admitted = turns.intent(SCOPE, sid, "t1")
    assert admitted is not None and admitted.lease_expires_at is not None
    wait_until(lambda: keeper.renewals >= 1, "a renewal of the held turn")  # not a sleep: a loaded machine
    first = turns.intent(SCOPE, sid, "t1")
    assert first is not None and first.lease_expires_at is not None
    assert first.lease_expires_at > admitted.lease_expires_at  # renewed: its expiry moved on
    keeper.release(SCOPE, sid, "t1")
    renewals = keeper.renewals
    time.sleep(0.4)
    assert keeper.renewals == renewals
    keeper.hold(SCOPE, sid, "t1", 0.3, _owner(turns, sid, "t1"))
    turns.discard(SCOPE, sid, "t1")
    with caplog.at_level(logging.WARNING, logger="transcript_store.leases"):
        deadline = time.monotonic() + 30
        while keeper.holds(SCOPE, sid, "t1") and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not keeper.holds(SCOPE, sid, "t1")
    assert "turn t1: its lease could not be renewed" in caplog.text
    turns.admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id="legacy")
    keeper.hold(SCOPE, sid, "t2", 0.3, _owner(turns, sid, "t2"))
    keeper.close()
    assert not keeper.holds(SCOPE, sid, "t2") and keeper._thread is None
    renewals = keeper.renewals
    time.sleep(0.3)
    assert keeper.renewals == renewals


def test_the_keeper_renews_under_the_admissions_owner_only(store: TranscriptStore, sid: str) -> None:
    """The renewal matches the owner the admission wrote: the keeper is given it, it does not guess it
    (threads starting a process's first turns at once could each have made an identity of their own)."""
    turns = Turns(store, OutboxConfig(turn_lease_seconds=0.3))
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id="legacy")
    keeper = LeaseKeeper(store)
    keeper.hold(SCOPE, sid, "t1", 0.3, "another-process:1:2:3")
    time.sleep(1.0)  # three leases: a renewal under the wrong owner would have kept it alive
    intent = turns.intent(SCOPE, sid, "t1")
    assert intent is not None and intent.lease_expires_at is not None
    assert intent.lease_expires_at < datetime.now(UTC) and keeper.renewals == 0
    # Still held (another attempt may hand the turn to this owner), until its attempt releases it.
    keeper.release(SCOPE, sid, "t1", "another-process:1:2:3")
    assert not keeper.holds(SCOPE, sid, "t1")
    keeper.close()


# 2 fresh processes in make test, 5 in make test-slow (CI time: each is a Python start-up).
@pytest.mark.parametrize("processes", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_threads_of_a_new_process_agree_on_its_identity(processes: int) -> None:
    """16 threads asking a fresh process for its identity at once get one (a lease owner)."""
    code = (
        "import threading; from transcript_store import identity\n"
        "barrier = threading.Barrier(16); seen = set()\n"
        "def ask():\n    barrier.wait(); seen.add(str(identity.current()))\n"
        "threads = [threading.Thread(target=ask) for _ in range(16)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]; print(len(seen))\n"
    )
    for _ in range(processes):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.strip() == "1"


def test_a_held_turn_past_its_time_limit_lets_the_session_go(
    store: TranscriptStore, sid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A turn stuck in a live process (a tool that never returns) is renewed only up to its time
    limit; then its lease runs out and the session's next turn takes over."""
    # Renewed every 0.2 s up to its 1.5 s limit: a keeper paused more than a second on a loaded machine
    # still renews it within its limit. The test waits for each event instead of sleeping past it.
    turns = Turns(store, OutboxConfig(turn_lease_seconds=0.6))
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id="legacy")
    admitted = turns.intent(SCOPE, sid, "t1")
    assert admitted is not None and admitted.lease_expires_at is not None
    keeper = LeaseKeeper(store)
    with caplog.at_level(logging.WARNING, logger="transcript_store.leases"):
        keeper.hold(SCOPE, sid, "t1", 0.6, _owner(turns, sid, "t1"), max_seconds=1.5)
        wait_until(lambda: keeper.renewals >= 1, "a renewal within the turn's time limit")
        renewed = turns.intent(SCOPE, sid, "t1")
        assert renewed is not None and renewed.lease_expires_at is not None
        assert renewed.lease_expires_at > admitted.lease_expires_at
        wait_until(lambda: "turn t1: held past its time limit" in caplog.text, "the hold dropped at its time limit")
    assert not keeper.holds(SCOPE, sid, "t1")

    def admitted_next() -> bool:
        try:
            Turns(store).admit(SCOPE, sid, user("q2"), turn_id="t2", engine_id="legacy")
        except SessionBusy:  # t1's last renewed lease has not run out yet
            return False
        return True

    wait_until(admitted_next, "the next turn admitted once t1's lease ran out unrenewed")
    keeper.close()


def _release_in_child(keeper: LeaseKeeper, sid: str, done: Any) -> None:
    keeper.release(SCOPE, sid, "t1")
    done.set()


def test_a_keeper_inherited_across_fork_does_not_hang(store: TranscriptStore, sid: str) -> None:
    """A child forked while the parent's keeper held its lock (its thread mid-look) starts a keeper of its
    own: releasing a turn there returns at once instead of waiting on a lock nobody will free."""
    keeper = LeaseKeeper(store)
    ctx = mp.get_context("fork")
    done = ctx.Event()
    with keeper._lock:  # as the parent's keeper thread holds it while it looks at its turns
        child = ctx.Process(target=_release_in_child, args=(keeper, sid, done))
        child.start()
    child.join(timeout=20)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and done.is_set()
    keeper.close()


def test_an_outbox_config_refuses_leases_it_cannot_store() -> None:
    for bad in (float("nan"), float("inf"), -1.0, 1e13, True, "300"):
        with pytest.raises(InvalidInput):
            OutboxConfig(turn_lease_seconds=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            OutboxConfig(delivery_lease_seconds=bad)  # type: ignore[arg-type]
    for bad_limit in (0, -1, True, 1.5):
        with pytest.raises(InvalidInput):
            OutboxConfig(drain_limit=bad_limit)  # type: ignore[arg-type]
    assert OutboxConfig(turn_lease_seconds=0, delivery_lease_seconds=0.5).turn_lease_seconds == 0


# ------------------------------------------------------------------------------------- a retry on another engine


@pytest.mark.parametrize(("running", "retry"), [("counting", "legacy"), ("legacy", "counting")])
def test_a_retry_on_another_engine_leaves_the_running_attempt_alone(
    store: TranscriptStore, sid: str, running: str, retry: str
) -> None:
    """Worker A runs turn t1 on one engine (its lease lives); a retry of t1 reaches a host that decides
    another engine (legacy after a degradation, or the configured engine where A had degraded). The
    retry cannot continue A's attempt (a started turn never switches engines), so it is refused as a
    turn running elsewhere is (``SessionBusy``): A's intent stays, A's completion reaches its engine once,
    and the retry presented afterwards learns what became of the turn."""
    worker_a = Turns(store)
    worker_a.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id=running)
    before = snapshot(store, worker_a, sid)
    host, model = make_host(store, retry, {"counting": lambda ctx: CountingEngine(ctx, "counting")})
    with pytest.raises(SessionBusy) as caught:
        host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    assert (caught.value.session_id, caught.value.turn_id) == (sid, "t1") and model.requests == []
    assert snapshot(store, worker_a, sid) == before  # A's intent and lease as they were: nothing written
    done = worker_a.complete(SCOPE, sid, "t1", [{"message": assistant("a1")}], host.commit_in(running))
    assert done.commit is not None and done.commit.status == "committed"
    again = host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    assert (again.commit_status, again.engine_id, model.requests) == ("duplicate", running, [])
    assert [r.advancement_key for r in worker_a.receipts(SCOPE, sid)] == ["t1"]
    assert [e.turn_id for e in store.list_entries(SCOPE, sid)] == ["t1", None]


def test_a_retry_on_another_engine_runs_once_the_attempt_is_abandoned(store: TranscriptStore, sid: str) -> None:
    """The refusal lasts as long as the running attempt's worker: once its lease ran out, recovery
    discards its intent, and the retry runs on the engine its host decided."""
    Turns(store, OutboxConfig(turn_lease_seconds=0.0)).admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id="counting")
    host, model = make_host(store)
    out = host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    assert (out.commit_status, out.engine_id, len(model.requests)) == ("committed", "legacy", 1)
    assert [(r.engine_id, r.advancement_key) for r in Turns(store).receipts(SCOPE, sid)] == [("legacy", "t1")]


def test_a_failing_attempt_discards_only_the_intent_it_still_holds(store: TranscriptStore, sid: str) -> None:
    """Host A runs turn t1; while its model call is out, a retry of t1 by another worker (or another
    thread of the same process) takes the turn's intent over, and then A's model call fails. A discards
    the intent only while its own attempt holds it: the retry's intent stays, and its completion reaches
    the engine once."""
    host, _model = make_host(store)
    retry = Turns(store)
    taken: list[str] = []

    class TakenOverThenFailing:
        name = "taken-over"

        def complete(self, messages: Any, tools: Any = None, **_kw: Any) -> Any:
            _admission, intent = retry.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id="legacy")
            assert intent.lease_owner is not None
            taken.append(intent.lease_owner)
            raise RuntimeError("the provider broke")

    host.model = TakenOverThenFailing()
    with pytest.raises(RuntimeError, match="the provider broke"):
        host.run_turn(SCOPE, sid, "q1", turn_id="t1")
    intent = retry.intent(SCOPE, sid, "t1")
    assert intent is not None and (intent.state, intent.lease_owner) == ("admitted", taken[0])
    done = retry.complete(SCOPE, sid, "t1", [{"message": assistant("a1")}], host.commit_in("legacy"))
    assert done.commit is not None and done.commit.status == "committed"
    assert [r.advancement_key for r in retry.receipts(SCOPE, sid)] == ["t1"]
    # Two attempts of one process are told apart: each admission names an owner of its own.
    assert taken[0].split("/")[0] == str(identity.current()) and retry.discard(SCOPE, sid, "t1", owner="x") is False


def test_a_discard_by_owner_refuses_a_bad_owner(store: TranscriptStore, sid: str) -> None:
    turns = Turns(store)
    turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id="legacy", owner="worker-1/a")
    for bad in ("", "x" * 129, "a\x00b", 7):
        with pytest.raises(InvalidInput):
            turns.discard(SCOPE, sid, "t1", owner=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            turns.admit(SCOPE, sid, user("q1"), turn_id="t1", engine_id="legacy", owner=bad)  # type: ignore[arg-type]
    assert turns.discard(SCOPE, sid, "t1", owner="worker-2/b") is False
    assert turns.discard(SCOPE, sid, "t1", owner="worker-1/a") is True
