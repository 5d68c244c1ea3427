"""``run_turn`` tells what became of a turn its own drain did not deliver: ``blocked``, ``committed`` (both backends).

A turn whose fast commit failed waits in the outbox, and ``run_turn`` drains its session at once. When the row
is blocked by then (an operator's ``outbox block`` landing between the completion and that drain, or the
drain's own block of another version receipted for the key), the turn will never reach its engine. The
outcome said ``queued`` for it, a promise of a later delivery, while a retry of the same turn id said
``blocked``. And when another process's drain delivered it in between, the outcome said ``queued`` for a
committed turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hosting import CountingEngine
from test_host import SCOPE, make_host
from workers.turn_worker import counting_engine

from transcript_store import TranscriptStore
from transcript_store.host import HostRuntime
from transcript_store.turns import DrainReport, Turns


class _Down(CountingEngine):
    def commit_turn(self, **kw: Any) -> Any:
        raise RuntimeError("engine down")


class _BlockedFirst(Turns):
    """Turns whose next drain finds ``t1`` blocked by an operator (a real ``outbox block``) just before it runs."""

    def drain(self, *args: Any, **kw: Any) -> DrainReport:
        self.block(SCOPE, kw["session_id"], "t1", "bad turn")
        return super().drain(*args, **kw)


@contextmanager
def _first_turn(store: TranscriptStore, name: str, turns: type[Turns] = Turns) -> Iterator[tuple[HostRuntime, str]]:
    """A host whose engine is down (``t1`` waits in the outbox), its drains through ``turns``; and a session."""
    sid = store.create_session(SCOPE, session_id=name).session_id
    host, _ = make_host(store, "down", {"down": lambda ctx: _Down(ctx, "down")})
    host.turns = turns(store)
    try:
        yield host, sid
    finally:
        host.dispose()


def test_a_turn_blocked_before_its_drain_is_reported_blocked(store: TranscriptStore) -> None:
    with _first_turn(store, "blocked-status", _BlockedFirst) as (host, sid):
        out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
        assert out.commit_status == "blocked"  # before the fix: "queued"
        intent = Turns(store).intent(SCOPE, sid, "t1")
        assert intent is not None and intent.state == "blocked"
        # A retry of the turn id tells the same.
        host.turns = Turns(store)
        again = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
        assert again.commit_status == "blocked"


def test_a_queued_turn_is_still_reported_queued(store: TranscriptStore) -> None:
    with _first_turn(store, "queued-status") as (host, sid):
        out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
        assert out.commit_status == "queued"
        intent = Turns(store).intent(SCOPE, sid, "t1")
        assert intent is not None and intent.state in ("accepted", "ready")


class _OtherDrainFirst(Turns):
    """Turns whose next drain finds ``t1`` delivered by another process's drain (a working engine) just before."""

    def drain(self, *args: Any, **kw: Any) -> DrainReport:
        other = Turns(self.store).drain(
            lambda engine_id: counting_engine if engine_id == "down" else None, scope=SCOPE,
            session_id=kw["session_id"],
        )
        assert other.committed_turns == [(kw["session_id"], "t1")]
        return super().drain(*args, **kw)


def test_a_turn_another_drain_delivered_meanwhile_is_reported_committed(store: TranscriptStore) -> None:
    """Another worker's drain (``outbox drain``, a gateway's recovery) delivered the turn between its
    completion and ``run_turn``'s own drain: this drain delivered nothing, and the outcome said ``queued``
    for a turn that was committed."""
    with _first_turn(store, "other-drain", _OtherDrainFirst) as (host, sid):
        out = host.run_turn(SCOPE, sid, "hello", turn_id="t1")
        assert out.commit_status == "committed"  # before the fix: "queued"
        assert Turns(store).intent(SCOPE, sid, "t1") is None
        assert [r.advancement_key for r in Turns(store).receipts(SCOPE, sid, "down")] == ["t1"]
