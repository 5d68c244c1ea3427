"""The SIGKILL campaign through the host runtime and the bundled engines (tests/test_faults_crash_host.py).

``fault_worker.py``'s campaign drives ``Turns`` with a counting engine; this one drives what a gateway
runs: ``HostRuntime.run_turn`` with the legacy engine on some sessions and the lossless engine on
others (its summaries made in the turns' compactions and in forced ones between turns), a scripted
model that calls a host tool now and then. Same shape: one zygote per slot imports everything and
warms up once, then ``fork()``s children that open their own connections, run turns and die by
SIGKILL, either from the zygote at a random instant or at a fault point (the library's admission,
acceptance and commit points, the lossless engine's compaction points, and the worker's own as a turn
returned).

A child first sends the turn a killed child was running again, same turn id and message, as a gateway
sends a turn whose worker died before answering (wherever it died: before its admission, after its
commit...); it runs a session's unfinished turn (the last message is a user entry of a turn) before a
new one. It logs every acknowledgement it got (admitted: the admission's commit returned; committed
or accepted: ``run_turn`` returned) for the checks, which hold the recovered store to them.

``python tests/workers/host_fault_worker.py --url URL --slot N ...`` prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `workers.*`, as the tests import them

from workers.fault_worker import _Trace, ack_log, count_retries, kill_plan, open_store, reap
from workers.lossless_worker import CHURN_CONFIG, make_host, user_text

from engines.lossless.audit import audit
from transcript_store import ClosedRange, TranscriptStore, faults
from transcript_store.core import Core
from transcript_store.host import HostRuntime
from transcript_store.ledger import committed_messages, count_turn_messages
from transcript_store.turns import Turns

SCOPE = "host-crash"
ENGINES = ("legacy", "lossless")
#: every point a child can die at: the library's, the lossless engine's compaction (in a turn's
#: compaction, the background maintenance after a reply, or a forced one between turns), and the
#: worker's own as ``run_turn`` returned (the turn is done, its worker dies before it answers). Not the
#: drain's: both bundled engines commit in the turn's completion transaction, so a host turn reaches
#: the drain only when that commit fails (an engine error), which a well-behaved engine never gives;
#: fault_worker.py's campaign (a flaky engine, queued completions) kills there.
FAULT_POINTS = (
    *(p for p in faults.POINTS if not p.startswith("drain.")),
    "lossless.compact.mid_write", "lossless.compact.before_view", "turn.returned",
)
#: a budget small enough that the lossless sessions compact every few turns
TOKEN_BUDGET = 3000
#: the record of the turn a child is running ("<session> <turn id>", padded)
RUNNING_BYTES = 512
WORKER = Path(__file__).resolve()


def engine_of(session_id: str) -> str:
    """The engine a session's turns run on: its id's last letter says (``L`` legacy, ``X`` lossless)."""
    return "lossless" if session_id.endswith("X") else "legacy"


def hosts(store: TranscriptStore, seed: int) -> dict[str, HostRuntime]:
    """One host runtime per engine over ``store``, their scripted models seeded alike (a retried turn's
    request gets the same reply in every process)."""
    return {
        engine: make_host(store, seed=seed, token_budget=TOKEN_BUDGET, config=CHURN_CONFIG, engine=engine)[0]
        for engine in ENGINES
    }


def unfinished(store: TranscriptStore, session_id: str) -> str | None:
    """The turn to send again: the last message is a user entry of a turn (admitted, never accepted).

    The last message, not the last entry: an attempt killed after its admission may have written an
    event after it (the built-in compaction's marker) before it died."""
    last = [e for e in store.list_entries(SCOPE, session_id, limit=10_000) if e.message is not None][-1:]
    if last and last[0].role == "user" and last[0].turn_id is not None:
        return str(last[0].turn_id)
    return None


def next_turn(store: TranscriptStore, session_id: str) -> str:
    """The unfinished turn again, else a new turn id (``<session>.t<number of its turns>``)."""
    again = unfinished(store, session_id)
    if again is not None:
        return again
    users = [e for e in store.list_entries(SCOPE, session_id, limit=10_000) if e.role == "user"]
    return f"{session_id}.t{len(users)}"


def question(turn_id: str) -> str:
    """The user message of a turn: a function of its id (a retry sends the same)."""
    return user_text(random.Random(turn_id), len(turn_id))


def run_one(runtimes: dict[str, HostRuntime], session_id: str, turn_id: str) -> str:
    """One turn through the host; its acknowledgement (``committed`` or ``accepted``)."""
    outcome = runtimes[engine_of(session_id)].run_turn(SCOPE, session_id, question(turn_id), turn_id=turn_id)
    if outcome.commit_status in ("committed", "duplicate"):
        return "committed"
    if outcome.commit_status == "queued":
        return "accepted"
    raise AssertionError(f"turn {turn_id}: commit status {outcome.commit_status!r}")


# ---------------------------------------------------------------------------------------------- campaign


def warm_store(url: str, prefix: str) -> TranscriptStore:
    """A store whose hosts ran a few turns on each engine (imports, compiled statements, the registry's
    discovery), with every connection closed and every host disposed (no thread) before forking."""
    store = open_store(url)
    runtimes = hosts(store, 0)
    for suffix in ("L", "X"):
        sid = f"{prefix}warm{suffix}"
        store.create_session(SCOPE, session_id=sid)
        for _ in range(4):
            run_one(runtimes, sid, next_turn(store, sid))
    for runtime in runtimes.values():
        runtime.dispose()
    store.db.engine.dispose()
    return store


def child(store: TranscriptStore, sessions: list[str], spec: str | None, seed: int, trace_fd: int, ack_fd: int,
          ready_fd: int, resend: tuple[str, str] | None, running_fd: int) -> NoReturn:
    """Send the turn a killed child was running again (``resend``), then run host turns (and now and
    then a forced compaction) until killed; log each acknowledgement, and the turn running now at
    ``running_fd`` (one pwrite: the zygote reads it after a kill)."""
    code = 0
    try:
        os.environ.pop("TRANSCRIPT_STORE_FAULTS", None)
        if spec is not None:
            os.environ["TRANSCRIPT_STORE_FAULTS"] = spec
            os.environ["TRANSCRIPT_STORE_FAULT_SEED"] = str(seed)
        faults.reset()
        trace = _Trace(trace_fd)
        ack = ack_log(ack_fd)
        real_point = faults.point
        current: list[str] = ["", ""]  # the session and turn running now

        def traced(name: str) -> None:
            trace.point = name
            trace.write()
            if name == "admit.after_commit" and current[1]:  # the admission is durable from here
                ack("admitted", current[0], current[1])
            real_point(name)

        faults.point = traced  # type: ignore[assignment]
        trace.write()
        count_retries(store, trace.retries)
        runtimes = hosts(store, 0)
        for sid in sessions:
            store.create_session(SCOPE, session_id=sid)
        os.write(ready_fd, b"r")
        os.close(ready_fd)
        rng = random.Random(seed)

        def turn(sid: str, turn_id: str) -> None:
            current[:] = [sid, turn_id]
            os.pwrite(running_fd, f"{sid} {turn_id}".encode().ljust(RUNNING_BYTES), 0)
            trace.point = "turn.begin"
            trace.write()
            told = run_one(runtimes, sid, turn_id)
            traced("turn.returned")  # died before it could answer: the turn is sent again, committed
            ack(told, sid, turn_id)
            os.pwrite(running_fd, b" " * RUNNING_BYTES, 0)
            trace.turns += 1
            trace.write()

        if resend is not None:  # a gateway sends a turn whose worker died before answering again
            turn(*resend)
        for _ in range(40 if spec is not None else 1_000_000):
            sid = rng.choice(sessions)
            if engine_of(sid) == "lossless" and rng.random() < 0.15:
                trace.point = "compact.begin"
                trace.write()
                current[:] = ["", ""]
                runtimes["lossless"].compact(SCOPE, sid, force=True)
                continue
            turn(sid, next_turn(store, sid))
        for runtime in runtimes.values():
            runtime.dispose()
        store.close()
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        code = 1
    os._exit(code)


def campaign(args: argparse.Namespace) -> dict[str, Any]:
    """Fork, kill and reap children until ``--kills`` SIGKILLs landed (or ``--seconds`` passed)."""
    store = warm_store(args.url, args.prefix)
    rng = random.Random(args.seed)
    trace_path, acks = Path(args.trace), Path(args.acks)
    running_path = trace_path.with_name(trace_path.name + ".running")
    resend: tuple[str, str] | None = None
    deadline = time.monotonic() + args.seconds
    out: dict[str, Any] = {
        "kills": 0, "parent_kills": 0, "point_kills": 0, "finished": 0, "children": 0, "turns": 0,
        "retries": 0, "resent": 0, "killed_at": Counter(), "errors": [],
        "sessions": [f"{args.prefix}warmL", f"{args.prefix}warmX"],
    }
    single = 0
    while out["kills"] < args.kills and time.monotonic() < deadline and len(out["errors"]) < 3:
        n = out["children"]
        out["children"] += 1
        group = n // args.children_per_session
        sessions = [f"{args.prefix}{group}L", f"{args.prefix}{group}X"]
        if sessions[0] not in out["sessions"]:
            out["sessions"].extend(sessions)
        by_parent, spec = kill_plan(rng, FAULT_POINTS, args.slot + single)
        single += spec is not None and not spec.startswith("*")
        fd = os.open(trace_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        ack_fd = os.open(acks / f"{args.slot:02d}-{n:06d}.log", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND,
                         0o600)
        running_fd = os.open(running_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        ready_r, ready_w = os.pipe()
        child_seed = rng.randrange(2**31)
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            child(store, sessions, spec, child_seed, fd, ack_fd, ready_w, resend, running_fd)
        os.close(ready_w)
        os.close(fd)
        os.close(ack_fd)
        os.close(running_fd)
        reap(pid, ready_r, by_parent and rng.uniform(0.0, args.max_delay), trace_path, out, f"child {n} ({spec})")
        running = running_path.read_bytes().decode().split()
        resend = (running[0], running[1]) if len(running) == 2 else None
        out["resent"] += resend is not None
    return out


# ---------------------------------------------------------------------------------------------- checks


def recover_and_verify(url: str, sessions: Sequence[str], acks: Sequence[tuple[str, str, str]]) -> Counter[str]:
    """A new gateway's recovery, then every invariant of the host campaign; returns its counts.

    Recovery is what a gateway does after a crash: each session's unfinished turn sent again (same id),
    then one new turn, which must commit (the session is usable). Then, per session: every turn's user
    entry once (no duplicate admission), its replies after it ending with an answer and each tool call
    with its result (no partial turn), exactly one receipt for it on one engine whose ledger messages
    are the turn's closed range, no ledger message without a receipt, no intent left; a lossless
    session's summary DAG passes the audit and its messages cover every visible entry (its state is
    its receipts'); and every acknowledgement a worker got holds.
    """
    store = open_store(url)
    runtimes = hosts(store, 0)
    totals: Counter[str] = Counter()
    try:
        for sid in sessions:
            again = unfinished(store, sid)
            if again is not None:
                totals["resent_by_recovery"] += 1
                assert run_one(runtimes, sid, again) == "committed", again
            assert run_one(runtimes, sid, f"{sid}.final") == "committed", sid
        turns = Turns(store)
        left = [(i.session_id, i.turn_id, i.state) for i in turns.intents(SCOPE, limit=10_000)]
        assert left == [], f"intents left after recovery: {left[:5]}"
        seen: dict[str, tuple[set[str], set[str]]] = {}
        for sid in sessions:
            seen[sid] = _verify_session(store, turns, sid, totals)
        _verify_acks(seen, acks, totals)
        return totals  # a Counter: a count that never came up is 0
    finally:
        for runtime in runtimes.values():
            runtime.dispose()
        store.close()


def _verify_session(
    store: TranscriptStore, turns: Turns, sid: str, totals: Counter[str]
) -> tuple[set[str], set[str]]:
    """Check one session (see ``recover_and_verify``); its admitted turns and its committed ones."""
    entries = store.list_entries(SCOPE, sid, limit=10_000)
    assert len(entries) < 10_000, "session too long for one listing"
    segments: list[tuple[Any, list[Any]]] = []
    for e in entries:
        if e.message is None:  # an event (a compaction's marker): not a message of any turn
            totals["events_" + str(e.kind)] += 1
            continue
        if e.role == "user":
            assert e.turn_id is not None, f"{sid}: a user entry of no turn: {e.entry_id}"
            segments.append((e, []))
        else:
            assert segments, f"{sid}: replies before any admission"
            segments[-1][1].append(e)
    keys = [str(u.turn_id) for u, _ in segments]
    duplicated = [k for k, n in Counter(keys).items() if n > 1]
    assert not duplicated, f"{sid}: turns admitted twice: {duplicated[:5]}"
    receipts = {engine: {r.advancement_key: r for r in turns.receipts(SCOPE, sid, engine)} for engine in ENGINES}
    both = set(receipts["legacy"]) & set(receipts["lossless"])
    assert not both, f"{sid}: turns committed to both engines: {sorted(both)[:5]}"
    ledger_total = 0
    for user, reply in segments:
        key = str(user.turn_id)
        if not reply:  # admitted, its worker killed before the acceptance, and never sent again
            assert key not in receipts["legacy"] and key not in receipts["lossless"], f"{sid}: {key} committed empty"
            totals["unaccepted"] += 1
            continue
        _check_turn(key, [e.message for e in reply])
        engine = "legacy" if key in receipts["legacy"] else "lossless"
        receipt = receipts[engine].get(key)
        assert receipt is not None, f"{sid}: turn {key} has replies and no receipt"
        assert (receipt.admission_entry_id, receipt.terminal_entry_id) == (user.entry_id, reply[-1].entry_id), key
        closed = store.read_closed_range(store.anchor(SCOPE, sid, user.entry_id),
                                         store.anchor(SCOPE, sid, reply[-1].entry_id))
        assert isinstance(closed, ClosedRange), (key, closed)
        stored = store.read(lambda c, k=key, e=engine: committed_messages(c, SCOPE, sid, e, k))
        assert stored == closed.messages and receipt.message_count == len(stored), f"{sid}: ledger of {key} differs"
        ledger_total += len(stored)
        totals["turns_committed"] += 1
        totals["committed_on_" + engine] += 1
    extra = (set(receipts["legacy"]) | set(receipts["lossless"])) - set(keys)
    assert not extra, f"{sid}: receipts of turns not in the transcript: {sorted(extra)[:5]}"

    def ledger_rows(c: Core) -> int:
        return sum(count_turn_messages(c, SCOPE, sid, engine) for engine in ENGINES)

    assert store.read(ledger_rows) == ledger_total, f"{sid}: ledger messages without a receipt"
    if engine_of(sid) == "lossless":
        result = store.read(lambda c: audit(c, SCOPE, sid))
        assert result.problems == [], (sid, result.problems[:5])
        visible = {e.entry_id for e in store.read_visible(SCOPE, sid)}
        assert result.covered_entry_ids == visible, f"{sid}: the lossless engine's messages differ from the transcript"
        totals["lossless_summaries"] += result.summaries
    return set(keys), set(receipts["legacy"]) | set(receipts["lossless"])


def _check_turn(key: str, messages: list[dict[str, Any]]) -> None:
    """A whole turn: tool calls answered in order, ending with an assistant answer."""
    calls: list[str] = []
    for m in messages:
        assert m.get("role") in ("assistant", "tool"), f"turn {key}: a {m.get('role')} message among its replies"
        if m.get("role") == "tool":
            assert m.get("tool_call_id") in calls, f"turn {key}: a tool result without its call: {m!r}"
            calls.remove(m["tool_call_id"])
        calls += [c["id"] for c in m.get("tool_calls") or ()]
    assert not calls, f"partial turn {key}: tool calls without their result: {calls}"
    last = messages[-1]
    assert last.get("role") == "assistant" and not last.get("tool_calls") and last.get("content"), (
        f"partial turn {key}: it ends with {last!r}"
    )


def _verify_acks(
    seen: dict[str, tuple[set[str], set[str]]], acks: Sequence[tuple[str, str, str]], totals: Counter[str]
) -> None:
    """Every admission a worker was told of exists; every turn it was told was accepted or committed has
    its receipt (``_verify_session`` showed: one, with its replies whole); none was admitted again after."""
    told: dict[tuple[str, str], str] = {}
    for what, sid, key in acks:
        assert sid in seen, f"acknowledgement of an unchecked session {sid}"
        assert what != "admitted" or told.get((sid, key), "admitted") == "admitted", (
            f"turn {key} admitted again after the worker was told it was {told[(sid, key)]}: that write was lost"
        )
        told[(sid, key)] = what if told.get((sid, key)) != "committed" else "committed"
    for (sid, key), what in told.items():
        admitted, committed = seen[sid]
        assert key in admitted, f"turn {key} of {sid} was acknowledged {what}, then its admission was lost"
        assert what == "admitted" or key in committed, f"turn {key} of {sid} was acknowledged {what}, then lost"
    totals["acked_admitted"] += len(told)
    totals["acked_accepted"] += sum(what in ("accepted", "committed") for what in told.values())


def main(argv: list[str]) -> None:
    """Run one slot's campaign and print its JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slot", type=int, default=0)
    parser.add_argument("--prefix", default="h")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-delay", type=float, default=0.15)
    parser.add_argument("--children-per-session", type=int, default=20)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--acks", required=True)
    args = parser.parse_args(argv)
    logging.getLogger("transcript_store").setLevel(logging.CRITICAL)
    logging.getLogger("engines").setLevel(logging.CRITICAL)
    print(json.dumps(campaign(args)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
