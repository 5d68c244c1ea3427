"""A hostile review of the keyed host transcript mirror (``transcript_store.mirror``), on both backends.

The host is modelled (``Host``: ids, messages, cursors reset when the host goes back) and the OpenClaw
plugin's ``importTranscript`` and ``commitTurn`` (integrations/openclaw/src/engine.js) are replayed step
for step, so each flow is the one a gateway runs. What the review found (each test failed before the fix):

1. A host that edits an earlier message, after an import read its transcript past it (every
   bootstrap reads to the end), could never commit its next turn: the turn is ``behind`` (a later
   turn is mirrored past its admission), the plugin imports from the resume point up to the turn's end,
   which reads nothing when the resume point is past the turn, and the retry was ``behind`` again, on
   every delivery. Now the refusal resets such a resume point (``mirror.reopen_import``): the import
   reads the host from its start, the page branches where the host went back, and the turn commits;
   a stale turn stays refused.
2. A resume point stored past the mirror's end was only *read* as the start: a turn (or the store's
   own appends after a branch) growing the mirror past it revived it, and the next import resumed from
   a host cursor of another transcript. Now the next turn or branch resets it for good.

A turn of a host that went back, racing a bootstrap import (threads, a store each), failed before
too, in the order where the commit ran first (1.). The rest pins down what held: a turn racing an
import page of its own messages, a heartbeat the host prunes, a turn's cost on a 5,000-message mirror
(statements, and rows read on PostgreSQL), and ``store.branch`` on a session that never used the mirror.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import module_store_fixtures
from mirror_helpers import A, a, every_entry, legacy_service, race, state_of, turn_request, u
from sqlalchemy import event, text

from transcript_store import StoreConfig, TranscriptStore, paths
from transcript_store.errors import MirrorConflict
from transcript_store.fences import MAX_TURN_EVENTS
from transcript_store.ledger import put_state
from transcript_store.mirror import STATE_KEY, STATE_OWNER, HostMessage, import_page
from transcript_store.service import Service
from transcript_store.service_models import BootstrapRequest, CommitTurnRequest, CommitTurnResponse
from transcript_store.settings import load_settings

shared_url, store, sid = module_store_fixtures(A, "mirror_hostile")


def call(call_id: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}


def result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "found"}


@pytest.fixture(scope="module")
def service(store: TranscriptStore) -> Iterator[Service]:
    yield from legacy_service(store)


def visible_ids(s: TranscriptStore, session_id: str) -> list[str]:
    return [e.entry_id for e in s.read_visible(A, session_id)]


@dataclass
class Host:
    """The host's own transcript: ids and messages. A cursor names the host's version and a count; going
    back (an edit, a regenerate, a pruned heartbeat) starts a new version, and older cursors reset."""

    messages: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    version: int = 0

    def say(self, *items: tuple[str, dict[str, Any]]) -> int:
        at = len(self.messages)
        self.messages.extend(items)
        return at

    def back_to(self, position: int) -> None:
        del self.messages[position:]
        self.version += 1

    def read(self, cursor: str | None, limit: int) -> tuple[str, list[tuple[str, dict[str, Any]]], str, bool]:
        n = 0
        if cursor is not None:
            version, _, count = cursor.partition(":")
            if int(version) != self.version:
                return "reset", [], f"{self.version}:0", True
            n = int(count)
        got = self.messages[n : n + limit]
        return "page", got, f"{self.version}:{n + len(got)}", n + len(got) < len(self.messages)

    def turn(self, key: str, start: int, heartbeat: bool = False) -> CommitTurnRequest:
        """The turn of the host's messages from ``start`` to its end."""
        span = self.messages[start:]
        return CommitTurnRequest.model_validate({
            "advancement_key": key,
            "admission": {"entry_id": span[0][0], "position": start},
            "terminal": {"entry_id": span[-1][0], "position": len(self.messages) - 1},
            "messages": [m for _, m in span],
            "is_heartbeat": heartbeat,
        })


def plugin_import(svc: Service, session_id: str, host: Host, until: int | None = None, page_size: int = 3) -> int:
    """The plugin's importTranscript, step for step: from the recorded resume point (``until``: up to
    that host position, else to the end), restarting on a host reset or a ``cursor`` refusal."""
    state = svc.bootstrap_state(A, "legacy", session_id)
    read_cursor, sent, position = state.cursor, state.cursor, (state.position if state.cursor else 0)
    imported = restarts = 0
    for _ in range(200):
        remaining = page_size if until is None else until + 1 - position
        if remaining <= 0:
            return imported
        kind, got, next_cursor, has_more = host.read(read_cursor, min(page_size, remaining))
        if kind == "reset":
            read_cursor, sent, position = next_cursor, None, 0
            continue
        req = BootstrapRequest.model_validate({"done": False, "page": {
            "cursor": sent, "next_cursor": next_cursor,
            "entries": [{"entry_id": e, "message": m} for e, m in got]}})
        try:
            answer = svc.bootstrap(A, "legacy", session_id, req)
        except MirrorConflict as e:
            if e.reason != "cursor" or restarts >= 3:
                raise
            restarts += 1
            state = svc.bootstrap_state(A, "legacy", session_id)
            read_cursor, sent, position = state.cursor, state.cursor, (state.position if state.cursor else 0)
            continue
        imported += answer.imported
        position = answer.position
        read_cursor = sent = next_cursor
        if not has_more:
            return imported
    raise AssertionError("the import did not finish")


def plugin_commit(svc: Service, session_id: str, host: Host, req: CommitTurnRequest) -> CommitTurnResponse:
    """The plugin's commitTurn: on ``behind``, import up to the turn's end and commit again (once)."""
    try:
        return svc.commit_turn(A, "legacy", session_id, req)
    except MirrorConflict as e:
        if e.reason != "behind":
            raise
    plugin_import(svc, session_id, host, until=req.terminal.position)
    return svc.commit_turn(A, "legacy", session_id, req)


def two_turns_then_bootstrap(svc: Service, session_id: str, host: Host) -> None:
    """Two host messages imported, turns k1 (with a tool call) and k2 committed, and a bootstrap (a
    gateway restart) that reads the host to its end: the resume point is past both turns."""
    host.say(("h0", u("m0")), ("h1", a("m1")))
    plugin_import(svc, session_id, host)
    start = host.say(("x1", u("q1")), ("c1", call("t1")), ("r1", result("t1")), ("y1", a("a1")))
    assert plugin_commit(svc, session_id, host, host.turn("k1", start)).status == "committed"
    start = host.say(("x2", u("q2")), ("y2", a("a2")))
    assert plugin_commit(svc, session_id, host, host.turn("k2", start)).status == "committed"
    plugin_import(svc, session_id, host)
    assert state_of(svc.store, session_id) == (f"{host.version}:8", 8)


# ---------------------------------------------------------------------------------------------- 1. behind for ever


def test_an_edit_below_a_full_import_commits_after_the_plugins_import(service: Service, sid: str) -> None:
    """The host edits its message at position 2 (k1's question) after a bootstrap read it to the end, and
    runs the edited turn (a tool call in its middle). The turn was ``behind`` (k2 is mirrored past its
    admission), the plugin's import up to the turn's end read nothing (the resume point, 8, is past it)
    and the retry was ``behind`` again, on every delivery: the session could never commit a turn again.
    Now the refusal resets the resume point; the import branches the mirror where the host went back,
    the turn commits, its replay is a duplicate, and the next bootstrap matches."""
    s = service.store
    host = Host()
    two_turns_then_bootstrap(service, sid, host)
    stored = len(every_entry(s, sid))
    host.back_to(2)
    start = host.say(("e1", u("edited")), ("ec", call("t9")), ("er", result("t9")), ("e2", a("again")))
    edited = host.turn("k3", start)
    assert plugin_commit(service, sid, host, edited).status == "committed"  # was: MirrorConflict behind
    assert visible_ids(s, sid) == ["h0", "h1", "e1", "ec", "er", "e2"]
    assert len(every_entry(s, sid)) == stored + 4
    assert service.commit_turn(A, "legacy", sid, edited).status == "duplicate"
    start = host.say(("x4", u("q4")), ("y4", a("a4")))
    assert plugin_commit(service, sid, host, host.turn("k4", start)).status == "committed"
    assert plugin_import(service, sid, host) == 0 and state_of(s, sid) == (f"{host.version}:8", 8)
    assert visible_ids(s, sid) == [e for e, _ in host.messages]


def test_a_stale_turn_stays_refused(service: Service, sid: str) -> None:
    """A turn the host sent for positions 0..1 long ago, arriving after k1 and k2: the refusal resets the
    resume point, the import it triggers finds the mirror is the host's transcript, and the turn stays
    refused; nothing is written, and the next bootstrap reads on to the end and matches."""
    s = service.store
    host = Host()
    two_turns_then_bootstrap(service, sid, host)
    stored = every_entry(s, sid)
    stale = CommitTurnRequest.model_validate({
        "advancement_key": "kA", "admission": {"entry_id": "xa", "position": 0},
        "terminal": {"entry_id": "ya", "position": 1}, "messages": [u("qa"), a("ra")]})
    for _ in range(2):
        with pytest.raises(MirrorConflict) as refused:
            plugin_commit(service, sid, host, stale)
        assert refused.value.reason == "behind"
    assert every_entry(s, sid) == stored
    assert [r.advancement_key for r in service.receipts(A, "legacy", sid).receipts] == ["k1", "k2"]
    assert plugin_import(service, sid, host) == 0
    assert every_entry(s, sid) == stored and state_of(s, sid) == ("0:8", 8)


# ---------------------------------------------------------------------------------------------- 2. past the end


def test_a_resume_point_past_the_end_is_not_revived_by_a_turn(service: Service, sid: str) -> None:
    """A resume point stored past the mirror's end (c9 at 9 over one message: left by a branch before
    the previous fix, or a path move outside ``branch``) reads as the start; a turn then grows the
    mirror to nine messages. It read as (c9, 9) again, and the next import resumed after the turn's
    messages from a cursor of another transcript. Now the turn resets it for good."""
    s = service.store
    host = Host()
    host.say(("h0", u("m0")))
    plugin_import(service, sid, host)
    s.write(lambda c: put_state(c, A, sid, STATE_OWNER, STATE_KEY, {"cursor": "9:9", "position": 9}))
    assert state_of(s, sid) == (None, 0)
    start = host.say(("x1", u("q1")), *((f"m{i}", a(f"step {i}")) for i in range(6)), ("y1", a("a1")))
    assert plugin_commit(service, sid, host, host.turn("k1", start)).status == "committed"
    assert state_of(s, sid) == (None, 0)  # was: ("9:9", 9)
    assert plugin_import(service, sid, host) == 0 and state_of(s, sid) == ("0:9", 9)


def test_a_resume_point_past_the_end_is_not_revived_by_a_branch_and_appends(store: TranscriptStore, sid: str) -> None:
    """The same through the store: a branch (that changes no imported position) and then the store's own
    appends past the stale point revived it; the branch resets it now."""
    store.write(lambda c: import_page(c, store.config, A, sid, cursor=None, next_cursor="c1",
                                      messages=[HostMessage("h0", u("m0"))]))
    store.write(lambda c: put_state(c, A, sid, STATE_OWNER, STATE_KEY, {"cursor": "c9", "position": 9}))
    store.branch(A, sid, "h0")
    store.append_many(A, sid, [{"message": u(f"own {i}")} for i in range(9)])
    assert state_of(store, sid) == (None, 0)  # was: ("c9", 9)


# ---------------------------------------------------------------------------------------------- what held


@pytest.fixture
def services(shared_url: str) -> Iterator[list[Service]]:
    """Two services on the module's database, each with a store (connections) of its own."""
    made = [Service(TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False)),
                    load_settings(config_path=None, engine="legacy")) for _ in range(2)]
    yield made
    for svc in made:
        svc.close()


def test_a_turn_racing_the_import_of_its_own_messages_lands_once(store: TranscriptStore,
                                                                 services: list[Service]) -> None:
    """A turn (with a tool call the turn does not name) and an import page holding the same host
    messages, at once, in both orders: one copy of each message, the turn committed, its replay a
    duplicate."""
    def one_round(round_: int) -> None:
        session_id = store.create_session(A).session_id
        host = Host()
        host.say(("h0", u("m0")), ("h1", a("m1")))
        plugin_import(services[0], session_id, host)
        start = host.say(("x1", u("q1")), ("hc", call("t1")), ("hr", result("t1")), ("y1", a("a1")))
        req = host.turn("k1", start)
        page = BootstrapRequest.model_validate({"done": False, "page": {
            "cursor": "0:2", "next_cursor": "0:6",
            "entries": [{"entry_id": e, "message": m} for e, m in host.messages[2:]]}})
        calls = [lambda: services[0].commit_turn(A, "legacy", session_id, req),
                 lambda: services[1].bootstrap(A, "legacy", session_id, page)]
        got = race(calls[:: 1 if round_ % 2 else -1])
        assert all(kind == "ok" for kind, _ in got), got
        ids = visible_ids(store, session_id)
        assert len(every_entry(store, session_id)) == 6
        assert ids[:3] == ["h0", "h1", "x1"] and ids[5] == "y1"
        assert services[1].commit_turn(A, "legacy", session_id, req).status == "duplicate"

    for round_ in range(4):
        one_round(round_)


def test_a_turn_racing_the_import_of_a_host_that_went_back(store: TranscriptStore, services: list[Service]) -> None:
    """The host edits below a full import; its edited turn (the plugin's commit, with its import and
    retry) and a bootstrap import run at once: either order ends with the host's transcript, the turn
    committed once, nothing stored twice."""
    def one_round(round_: int) -> None:
        session_id = store.create_session(A).session_id
        host = Host()
        two_turns_then_bootstrap(services[0], session_id, host)
        host.back_to(2)
        start = host.say(("e1", u("edited")), ("e2", a("again")))
        req = host.turn("k3", start)
        calls = [lambda: plugin_commit(services[0], session_id, host, req),
                 lambda: plugin_import(services[1], session_id, host)]
        got = race(calls[:: 1 if round_ % 2 else -1])
        assert all(kind == "ok" for kind, _ in got), got  # was: the commit first, then behind for ever
        assert visible_ids(store, session_id) == ["h0", "h1", "e1", "e2"]
        assert len(every_entry(store, session_id)) == 8 + 2
        assert services[1].commit_turn(A, "legacy", session_id, req).status == "duplicate"

    for round_ in range(4):
        one_round(round_)


def test_a_pruned_heartbeat_is_replaced_by_the_next_turn(service: Service, sid: str) -> None:
    """A heartbeat turn is committed, a bootstrap reads past it, and the host prunes it: the next turn
    sits at the heartbeat's admission. It is no late turn (the heartbeat is admitted at its very
    position): it commits at once, and the bootstrap's resume point, past the pruned heartbeat, is reset."""
    s = service.store
    host = Host()
    host.say(("h0", u("m0")), ("h1", a("m1")))
    plugin_import(service, sid, host)
    start = host.say(("hb", u("heartbeat")), ("ok", a("HEARTBEAT_OK")))
    assert plugin_commit(service, sid, host, host.turn("hb1", start, heartbeat=True)).status == "committed"
    plugin_import(service, sid, host)
    host.back_to(2)
    start = host.say(("x1", u("q1")), ("y1", a("a1")))
    assert service.commit_turn(A, "legacy", sid, host.turn("k1", start)).status == "committed"
    assert visible_ids(s, sid) == ["h0", "h1", "x1", "y1"] and state_of(s, sid) == (None, 0)
    assert plugin_import(service, sid, host) == 0 and state_of(s, sid) == ("1:4", 4)


def counted(s: TranscriptStore, run: Callable[[], Any]) -> tuple[int, int]:
    """Statements ``run`` sends, and (PostgreSQL) the table rows its write transactions read."""
    statements: list[str] = []
    rows = [0]
    real = s.write
    touched = text("SELECT coalesce(sum(seq_tup_read + coalesce(idx_tup_fetch, 0)), 0) FROM pg_stat_xact_user_tables")

    def listen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "pg_stat_xact" not in statement:
            statements.append(statement)

    def write(fn: Callable[[Any], Any]) -> Any:
        def measured(c: Any) -> Any:
            if c.dialect.is_sqlite:
                return fn(c)
            before = int(c.conn.execute(touched).scalar())
            out = fn(c)
            rows[0] += int(c.conn.execute(touched).scalar()) - before
            return out

        return real(measured)

    s.write = write  # type: ignore[method-assign]
    event.listen(s.db.engine, "before_cursor_execute", listen)
    try:
        run()
    finally:
        event.remove(s.db.engine, "before_cursor_execute", listen)
        del s.write
    return len(statements), rows[0]


def test_a_turns_cost_does_not_grow_with_the_mirror(service: Service, store: TranscriptStore) -> None:
    """A turn with a tool call, its replay, a regenerate at its position, a turn over imported entries
    and a store branch, on mirrors of 50 and 5,000 host messages: the same statements, and on PostgreSQL
    (statistics fresh, so the planner uses the indexes) a few hundred rows read at most, not thousands."""
    def measure(n: int) -> list[tuple[int, int]]:
        session_id = store.create_session(A).session_id
        history = [HostMessage(f"h{i}", u(f"m{i}") if i % 2 == 0 else a(f"m{i}")) for i in range(n)]
        store.write(lambda c: import_page(c, store.config, A, session_id, cursor=None, next_cursor="c0",
                                          messages=history))
        if not store.db.dialect.is_sqlite:
            with store.db.engine.connect() as conn:
                conn.execute(text("ANALYZE"))
                conn.commit()

        def turn(key: str, ids: tuple[str, str], messages: list[dict[str, Any]], at: int) -> Callable[[], Any]:
            req = CommitTurnRequest.model_validate({
                "advancement_key": key, "admission": {"entry_id": ids[0], "position": at},
                "terminal": {"entry_id": ids[1], "position": at + len(messages) - 1}, "messages": messages})
            return lambda: service.commit_turn(A, "legacy", session_id, req)

        first = turn("k1", ("x1", "y1"), [u("q"), call("t1"), result("t1"), a("r")], n)
        out = [counted(store, first), counted(store, first)]
        out.append(counted(store, turn("k2", ("x2", "y2"), [u("q2"), call("t1"), result("t1"), a("r2")], n)))
        more = [HostMessage("x2", u("q2")), HostMessage("c2", call("t1")), HostMessage("r2", result("t1")),
                HostMessage("y2", a("r2")), HostMessage("x3", u("q3")), HostMessage("m3", a("thinking")),
                HostMessage("y3", a("r3"))]  # k2's messages, then k3's, imported first (the plugin's catch-up)
        store.write(lambda c: import_page(c, store.config, A, session_id, cursor="c0", next_cursor="c1",
                                          messages=more))
        out.append(counted(store, turn("k3", ("x3", "y3"), [u("q3"), a("thinking"), a("r3")], n + 4)))
        out.append(counted(store, lambda: store.branch(A, session_id, "y2")))
        return out

    costs = {n: measure(n) for n in (50, 5000)}
    assert [c[0] for c in costs[50]] == [c[0] for c in costs[5000]], costs
    if not store.db.dialect.is_sqlite:
        # A scan of the 5,000 entries would read thousands; what is read besides the indexes (small
        # tables the planner scans whole, whatever their statistics) moves from run to run: 100-340 seen.
        assert max(c[1] for c in costs[5000]) < 1500, costs


def test_store_branch_of_a_session_without_a_mirror(store: TranscriptStore, sid: str) -> None:
    """``store.branch`` goes through the mirror now: on a session that never imported, it moves the path
    as ``paths.branch`` does, writes no resume point, and reads two rows more (the session and the state)."""
    made = store.append_many(A, sid, [{"message": u(f"m{i}")} for i in range(6)])
    twin = store.create_session(A).session_id
    twin_made = store.append_many(A, twin, [{"message": u(f"m{i}")} for i in range(6)])
    n_store, _ = counted(store, lambda: store.branch(A, sid, made[2].entry_id))
    n_paths, _ = counted(store, lambda: store.write(lambda c: paths.branch(c, A, twin, twin_made[2].entry_id)))
    assert n_store == n_paths + 2
    assert [e.message for e in store.read_visible(A, sid)] == [e.message for e in store.read_visible(A, twin)]
    assert store.read(lambda c: c.conn.execute(text(
        "SELECT count(*) FROM ts_engine_state WHERE session_id = :s"), {"s": sid}).scalar()) == 0


def test_a_turn_of_more_than_ten_thousand_messages_commits_as_the_store_takes_it(service: Service, sid: str) -> None:
    # The store takes a turn of up to MAX_TURN_EVENTS entries (OpenClaw closes turns of as many events), but
    # the service's commit_turn body took at most 10,000 messages: a longer tool loop was a 422 on every
    # replay, and the session's later turns ran on legacy.
    messages = [u("q")] + [a(f"step {i}") for i in range(12_000)]
    out = service.commit_turn(A, "legacy", sid, turn_request("long", 0, messages, ("h0", f"h{len(messages) - 1}")))
    assert out.status == "committed"
    assert service.store.get_session(A, sid).visible_count == len(messages)
    with pytest.raises(ValueError, match="messages"):  # pydantic's ValidationError
        turn_request("over", 0, [u("q")] + [a("x")] * MAX_TURN_EVENTS, ("x0", "x1"))
