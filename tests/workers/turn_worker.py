"""A real worker process for the crash and race tests: it opens its own TranscriptStore from a URL.

Modes (``python tests/workers/turn_worker.py MODE --url URL ...``):

- ``turns``: run full logical turns like a gateway worker (recover -> admit -> complete, with an engine
  that sometimes fails) on its sessions until it is killed (SIGKILL from a fault point chosen by
  TRANSCRIPT_STORE_FAULTS, or from the parent) or has run ``--turns`` turns.
- ``commit``: wait for "go" on stdin, then present every advancement key of a plan file to
  ``Turns.commit_turn``; print each key's status.
- ``drain``: wait for "go" on stdin, then drain the outbox until no accepted or ready row is left;
  print what it committed.
- ``admit``: wait for "go" on stdin, then admit one turn (``--turn-id``) into ``--sessions``; print
  whether it was admitted or which turn holds the session, and keep running until stdin closes.

Every mode prints ``ready`` once its store is open, and one JSON line at the end. The counting engine
(``count_turn``) is shared with the in-process tests: its state (a counter and the committed keys in
order) rides in the commit transaction, so after any crash it must equal the receipts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from transcript_store import Admission, Anchor, SessionBusy, TranscriptStore, faults
from transcript_store.core import Core
from transcript_store.ledger import CommitResult, TurnPayload, commit_turn_in, get_state, put_state
from transcript_store.outbox import OutboxConfig
from transcript_store.turns import CommitIn, Turns

SCOPE = "crash-scope"
ENGINE = "counter"
#: What a worker is told as a call returns: (acknowledgement, session id, turn id); see ``run_turn``.
Ack = Callable[[str, str, str], None]


def count_turn(c: Core, turn: TurnPayload) -> None:
    """The engine's own state: how many turns it has seen and their keys, in commit order."""
    n = get_state(c, turn.scope, turn.session_id, turn.engine_id, "turns") or 0
    put_state(c, turn.scope, turn.session_id, turn.engine_id, "turns", n + 1)
    faults.point("engine.apply")
    order = get_state(c, turn.scope, turn.session_id, turn.engine_id, "order") or []
    put_state(c, turn.scope, turn.session_id, turn.engine_id, "order", [*order, turn.advancement_key])


def counting_engine(c: Core, turn: TurnPayload) -> CommitResult:
    """A well-behaved engine: the ledger commit with the counter in the same transaction."""
    return commit_turn_in(c, turn, count_turn)


def flaky_engine(rng: random.Random, fail_rate: float) -> CommitIn:
    """An engine that sometimes raises AFTER writing its receipt and state (all must roll back)."""

    def commit(c: Core, turn: TurnPayload) -> CommitResult:
        result = counting_engine(c, turn)
        if rng.random() < fail_rate:
            raise RuntimeError(f"engine failed on {turn.advancement_key}")
        return result

    return commit


def user_message(turn_id: str) -> dict[str, Any]:
    """The admitted user message of a turn: a function of the turn id, so a retry admits the same."""
    return {"role": "user", "content": f"question of {turn_id}"}


def turn_digest(turn_id: str) -> int:
    """A stable 64-bit hash of a turn id, the same in every process (``hash()`` of a str is salted)."""
    return int.from_bytes(hashlib.blake2b(turn_id.encode(), digest_size=8).digest(), "big")


def replies(turn_id: str, _rng: random.Random | None = None) -> list[dict[str, Any]]:
    """The reply messages of a turn, a function of its id alone: 0..2 tool round trips, then the answer.

    A retry writes the same replies, and the checks after a crash derive how many a turn must have (a
    turn that kept only some of them is partial). ``_rng`` is ignored: some callers still pass one.
    """
    digest = turn_digest(turn_id)
    rounds = (0, 0, 0, 0, 0, 0, 0, 1, 1, 2)[digest % 10]  # 1, 3 or 5 replies: 70 / 20 / 10 %
    messages: list[dict[str, Any]] = []
    for i in range(rounds):
        call_id = f"call_{digest >> 8 & 0xFFFF:04x}_{i}"
        arguments = json.dumps({"q": f"{turn_id}/{i}"})
        call = {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": arguments}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": f"result {i} of {turn_id}"})
    messages.append({"role": "assistant", "content": f"answer of {turn_id}"})
    return [{"message": m, "entry_id": f"{turn_id}.r{i}"} for i, m in enumerate(messages)]


# ---------------------------------------------------------------------------------------------- turns


def next_turn(store: TranscriptStore, session_id: str) -> tuple[str, bool]:
    """The turn to run: the unfinished last engine turn again (a retry), else a new turn id."""
    entries = store.list_entries(SCOPE, session_id, limit=10_000)
    users = [e for e in entries if e.role == "user" and e.turn_id is not None]
    last = entries[-1] if entries else None
    if last is not None and last.role == "user" and last.turn_id is not None and ".t" in last.turn_id:
        return last.turn_id, True
    return f"{session_id}.t{len(users)}", False


def degrade(store: TranscriptStore, session_id: str, ack: Ack | None = None) -> None:
    """A turn that must not reach the engine (an earlier one is still queued) runs without the outbox."""
    users = [e for e in store.list_entries(SCOPE, session_id, limit=10_000) if e.role == "user"]
    turn_id = f"{session_id}.d{len(users)}"
    store.admit(SCOPE, session_id, user_message(turn_id), turn_id=turn_id)
    if ack is not None:
        ack("admitted", session_id, turn_id)
    store.append_many(SCOPE, session_id, replies(turn_id))
    if ack is not None:
        ack("stored", session_id, turn_id)


def run_turn(
    turns: Turns, session_id: str, rng: random.Random, args: argparse.Namespace, stats: dict[str, int],
    ack: Ack | None = None,
) -> None:
    """One gateway turn: recovery, admission, then completion (fast path, or queued for the drain).

    ``ack`` is told each acknowledgement as the call that gives it returns: admitted (``admit``),
    accepted or committed (``complete``: queued for the drain, or committed on the fast path), and
    stored (the replies of a degraded turn).
    """
    engine = flaky_engine(rng, args.fail_rate)
    store = turns.store
    turn_id, retry = next_turn(store, session_id)
    report = turns.recover(SCOPE, session_id, ENGINE, lambda _engine_id: engine)
    stats["recovered"] += report.drain.delivered
    if [p for p in report.pending if p != turn_id]:
        stats["degraded"] += 1
        degrade(store, session_id, ack)
        return
    stats["retries"] += retry
    turns.admit(SCOPE, session_id, user_message(turn_id), turn_id=turn_id, engine_id=ENGINE)
    if ack is not None:
        ack("admitted", session_id, turn_id)
    if rng.random() < args.abort_rate:  # the provider call failed: the attempt is aborted, its intent deleted
        turns.discard(SCOPE, session_id, turn_id)
        stats["aborted"] += 1
        return
    result = turns.complete(SCOPE, session_id, turn_id, replies(turn_id), engine if rng.random() < 0.8 else None)
    if ack is not None:
        ack("accepted" if result.commit is None else "committed", session_id, turn_id)
    stats["fast" if result.commit is not None else "queued"] += 1


def main_turns(args: argparse.Namespace) -> dict[str, Any]:
    config = OutboxConfig(turn_lease_seconds=args.turn_lease, delivery_lease_seconds=args.delivery_lease)
    store = TranscriptStore(args.url)
    turns = Turns(store, config)
    rng = random.Random(args.seed)
    sessions = args.sessions.split(",")
    for sid in sessions:
        store.create_session(SCOPE, session_id=sid)
    ready()
    stats = dict.fromkeys(("recovered", "degraded", "retries", "aborted", "fast", "queued"), 0)
    for _ in range(args.turns):
        run_turn(turns, rng.choice(sessions), rng, args, stats)
    store.close()
    return stats


# ---------------------------------------------------------------------------------------------- races


def main_commit(args: argparse.Namespace) -> dict[str, Any]:
    store = TranscriptStore(args.url)
    turns = Turns(store)
    with open(args.plan, encoding="utf-8") as f:
        plan = json.load(f)
    random.Random(args.seed).shuffle(plan)
    ready()
    wait_for_go()
    statuses: dict[str, str] = {}
    for turn in plan:
        admission = Admission.model_validate(turn["admission"])
        terminal = Anchor.model_validate(turn["terminal"])
        result = turns.commit_turn(
            ENGINE, admission.turn_id, admission, terminal, turn["messages"], apply=count_turn
        )
        statuses[admission.turn_id] = result.status
    store.close()
    return {"statuses": statuses}


def main_drain(args: argparse.Namespace) -> dict[str, Any]:
    store = TranscriptStore(args.url)
    turns = Turns(store, OutboxConfig(delivery_lease_seconds=args.delivery_lease))
    committed: list[str] = []
    duplicates: list[str] = []

    def observe(intent: Any, result: CommitResult) -> None:
        (committed if result.status == "committed" else duplicates).append(intent.turn_id)

    engines: Callable[[str], CommitIn | None] = lambda e: counting_engine if e == ENGINE else None  # noqa: E731
    ready()
    wait_for_go()
    while any(i.state in ("accepted", "ready") for i in turns.intents(SCOPE)):
        report = turns.drain(engines, scope=SCOPE, on_committed=observe)
        if report.delivered == 0:
            time.sleep(0.002)
    store.close()
    return {"committed": committed, "duplicates": duplicates}


def main_admit(args: argparse.Namespace) -> dict[str, Any]:
    """Admit one turn when told "go", report it, and hold it (alive) until stdin closes."""
    store = TranscriptStore(args.url)
    turns = Turns(store, OutboxConfig(turn_lease_seconds=args.turn_lease))
    ready()
    wait_for_go()
    message = user_message(args.turn_id)
    result: dict[str, Any] = {"admitted": True, "busy": None}
    try:
        if args.if_clear:  # None: the session's outbox is not clear (another turn runs)
            admitted = turns.admit_if_clear(args.scope, args.sessions, message, turn_id=args.turn_id, engine_id=ENGINE)
            result["admitted"] = admitted is not None
        else:
            turns.admit(args.scope, args.sessions, message, turn_id=args.turn_id, engine_id=ENGINE)
    except SessionBusy as e:
        result = {"admitted": False, "busy": e.turn_id}
    print(json.dumps(result), flush=True)
    sys.stdin.read()
    store.close()
    return result


# ---------------------------------------------------------------------------------------------- main


def ready() -> None:
    print("ready", flush=True)


def wait_for_go() -> None:
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go signal")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("turns", "commit", "drain", "admit"))
    parser.add_argument("--url", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions", default="s0")
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--fail-rate", type=float, default=0.2)
    parser.add_argument("--abort-rate", type=float, default=0.1)
    parser.add_argument("--turn-lease", type=float, default=0.0)
    parser.add_argument("--delivery-lease", type=float, default=0.0)
    parser.add_argument("--plan", default="")
    parser.add_argument("--scope", default=SCOPE)
    parser.add_argument("--turn-id", default="t1")
    parser.add_argument("--if-clear", action="store_true", help="admit mode: admit_if_clear instead of admit")
    args = parser.parse_args()
    logging.getLogger("transcript_store").setLevel(logging.ERROR)
    if args.mode == "admit":  # prints its own line as soon as it has one, then holds its turn
        main_admit(args)
        return
    run = {"turns": main_turns, "commit": main_commit, "drain": main_drain}[args.mode]
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
