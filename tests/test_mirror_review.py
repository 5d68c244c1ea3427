"""Hostile review of the host transcript mirror (``transcript_store.mirror``), on both backends.

Concurrency with real threads, each with its own ``TranscriptStore`` (its own connections): the same
range aligned by several callers at once is one copy and no branch; conflicting ranges at one
position branch exactly once each, and the last to commit is the active branch; a turn raced by its
replay and by a rival turn through ``Service.commit_turn`` lands once. These held before the review (the
session's row lock serializes the callers) and pin it down.

Then what the review found (each test failed before the fix): a host message named again at a later
position was appended a second time under a fresh id (a turn sent with a stale position, a page that
overlaps the mirror, a page naming one entry twice); a turn whose admission matched another entry with
the same message, and a one-message turn naming two entries, were committed under receipts that no
replay could match (every retry after an uncertain commit a key collision); a turn that moved the
host's transcript left the import's resume point past it (the next import page ``behind``, for ever).

Last, hostile input (NUL bytes, key order, other sessions' ids and cursors, a page of MAX_ITEMS) and an
import killed (SIGKILL) between and inside pages, resumed from its recorded point.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import module_store_fixtures
from mirror_helpers import (
    A,
    a,
    commit,
    every_entry,
    hosted,
    legacy_service,
    page,
    race,
    state_of,
    turn_request,
    u,
    visible,
)

from transcript_store import InvalidInput, StoreConfig, TranscriptStore
from transcript_store.errors import MirrorConflict
from transcript_store.mirror import Alignment, HostMessage, align
from transcript_store.service import Service
from transcript_store.service_models import MAX_ITEMS
from transcript_store.settings import load_settings

B = "scope-b"
shared_url, store, sid = module_store_fixtures(A, "mirror_review")


@pytest.fixture(scope="module")
def service(store: TranscriptStore) -> Iterator[Service]:
    yield from legacy_service(store)


@pytest.fixture
def stores(shared_url: str) -> Iterator[list[TranscriptStore]]:
    """Four stores on the module's database: four callers with connections of their own."""
    made = [TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False)) for _ in range(4)]
    yield made
    for s in made:
        s.close()


# ---------------------------------------------------------------------------------------------- concurrency


def test_the_same_range_aligned_at_once_is_one_copy(store: TranscriptStore, stores: list[TranscriptStore]) -> None:
    """Four callers align one turn's range at once (a retry racing its original, two gateways): one
    appends it, the others find it there; no branch, no second copy, round after round."""

    def one_round(round_: int) -> None:
        session_id = store.create_session(A).session_id
        page(store, session_id, None, "c2", hosted(("h0", u("hello")), ("h1", a("hi"))))
        turn = hosted((f"t{round_}u", u("question")), (None, a("thinking")), (f"t{round_}a", a("answer")))
        results = race([lambda s=s: s.write(lambda c: align(c, s.config, A, session_id, 2, turn)) for s in stores])
        assert all(kind == "ok" for kind, _ in results), results
        done = [r for _, r in results]
        assert sorted(d.imported for d in done) == [0, 0, 0, 3] and not any(d.rewound for d in done)
        assert len(every_entry(store, session_id)) == 5
        assert [m for _, m in visible(store, session_id)] == [
            u("hello"), a("hi"), u("question"), a("thinking"), a("answer")
        ]

    for round_ in range(5):
        one_round(round_)


@pytest.mark.parametrize("inside", [False, True], ids=["at-the-end", "inside"])
def test_conflicting_ranges_at_one_position_branch_once_each(
    store: TranscriptStore, stores: list[TranscriptStore], inside: bool
) -> None:
    """Four callers put four different messages at one position at once. They run one after the other
    (the session's row lock): each one that finds another message there branches exactly once, and the
    last to commit is the active branch. Every message is stored once; none is shown twice."""
    at = 2 if inside else 3

    def one_round() -> None:
        session_id = store.create_session(A).session_id
        base = hosted(("b0", u("zero")), ("b1", a("one")), ("b2", u("two")))
        page(store, session_id, None, "c3", base)
        order: list[int] = []
        lock = threading.Lock()

        def rival(i: int, s: TranscriptStore) -> Alignment:
            def run(c: Any) -> Alignment:
                done = align(c, s.config, A, session_id, at, hosted((f"r{i}", u(f"rival {i}"))))
                with lock:  # inside the transaction, holding the session's lock: the commit order
                    order.append(i)
                return done

            return s.write(run)

        results = race([lambda i=i, s=s: rival(i, s) for i, s in enumerate(stores)])
        assert all(kind == "ok" for kind, _ in results), results
        assert sorted(order) == [0, 1, 2, 3]  # each ran once (no retry re-ran one)
        rewound = [results[i][1].rewound for i in order]
        assert rewound == ([True] * 4 if inside else [False, True, True, True])
        last = order[-1]
        shown = visible(store, session_id)
        assert shown[:at] == [(e.entry_id, e.message) for e in base[:at]]
        assert shown[at:] == [(f"r{last}", u(f"rival {last}"))]
        ids = [e for e, _, _ in every_entry(store, session_id)]
        assert len(ids) == len(set(ids)) == 3 + 4
        assert {e for e, position, _ in every_entry(store, session_id) if position == at} == (
            {f"r{i}" for i in range(4)} | ({"b2"} if inside else set())
        )

    for _ in range(4):
        one_round()


def test_a_turn_raced_by_its_replay_and_by_a_rival_lands_once(shared_url: str, store: TranscriptStore) -> None:
    """Through the service, each caller with its own store: a turn and its replay at once answer
    committed and duplicate (one copy); two different turns at one position both commit, the later
    one branching once, and the transcript shows exactly one of them."""
    services = [
        Service(TranscriptStore(config=StoreConfig(url=shared_url, auto_upgrade=False)),
                load_settings(config_path=None, engine="legacy"))
        for _ in range(2)
    ]

    def one_round(round_: int) -> None:
        session_id = store.create_session(A).session_id
        same = turn_request("k1", 0, [u("q"), a("tool call"), a("r")], (f"u{round_}", f"a{round_}"))
        results = race([lambda s=s: commit(s, session_id, same) for s in services])
        assert sorted(r.status for _, r in results) == ["committed", "duplicate"], results
        assert len(every_entry(store, session_id)) == 3
        one = turn_request("kA", 3, [u("qA"), a("rA")], ("xA", "yA"))
        two = turn_request("kB", 3, [u("qB"), a("rB")], ("xB", "yB"))
        results = race([lambda: commit(services[0], session_id, one), lambda: commit(services[1], session_id, two)])
        assert [r.status for _, r in results] == ["committed", "committed"], results
        tail = [m for _, m in visible(store, session_id)][3:]
        assert tail in ([u("qA"), a("rA")], [u("qB"), a("rB")])
        assert len(every_entry(store, session_id)) == 3 + 4  # each rival stored once

    try:
        for round_ in range(3):
            one_round(round_)
    finally:
        for svc in services:
            svc.close()


# ---------------------------------------------------------------------------------------------- duplicates


def test_a_turn_sent_again_at_a_later_position_is_refused_not_shown_twice(service: Service, sid: str) -> None:
    """The host's turn arrives again under another key with a stale (shifted) position: its entries are
    mirrored at 0..1 already. It was appended again under fresh ids (the turn shown twice, and committed
    twice to the engine); it is a turn_mismatch now, and nothing is written."""
    turn = [u("q"), a("r")]
    assert commit(service, sid, turn_request("k1", 0, turn, ("hu", "ha"))).status == "committed"
    before = every_entry(service.store, sid)
    with pytest.raises(MirrorConflict) as refused:
        commit(service, sid, turn_request("k2", 2, turn, ("hu", "ha")))
    assert refused.value.reason == "turn_mismatch"
    assert every_entry(service.store, sid) == before
    assert [m for _, m in visible(service.store, sid)] == turn


def test_a_page_that_overlaps_the_mirror_is_refused_not_shown_twice(store: TranscriptStore, sid: str) -> None:
    """A page whose first entry is the last one of the page before (an off-by-one host cursor) names a
    message mirrored at position 1 for position 2: it was appended again; now ``cursor``, nothing
    written, and the resume point stays where it was."""
    page(store, sid, None, "c1", hosted(("x", u("hi")), ("y", a("yo"))))
    with pytest.raises(MirrorConflict) as refused:
        page(store, sid, "c1", "c2", hosted(("y", a("yo")), ("z", u("next"))))
    assert refused.value.reason == "cursor"
    assert visible(store, sid) == [("x", u("hi")), ("y", a("yo"))]
    assert state_of(store, sid) == ("c1", 2)
    page(store, sid, "c1", "c2", hosted(("z", u("next"))))
    assert [e for e, _ in visible(store, sid)] == ["x", "y", "z"]


def test_a_range_naming_one_entry_twice_is_invalid(store: TranscriptStore, sid: str) -> None:
    """One host entry at two positions of one page: refused as invalid input before anything is written,
    whether or not the mirror already holds it (it was appended a second time under a fresh id when it
    did, and an IdempotencyConflict when it did not)."""
    page(store, sid, None, "c1", hosted(("x", u("hi"))))
    with pytest.raises(InvalidInput, match="two positions"):
        page(store, sid, None, "c2", hosted(("x", u("hi")), ("x", u("hi"))))
    assert visible(store, sid) == [("x", u("hi"))] and len(every_entry(store, sid)) == 1
    assert state_of(store, sid) == ("c1", 1)
    fresh = store.create_session(A).session_id
    with pytest.raises(InvalidInput, match="two positions"):
        page(store, fresh, None, "c2", hosted(("y", u("hi")), (None, a("between")), ("y", u("hi"))))
    assert every_entry(store, fresh) == []


# ---------------------------------------------------------------------------------------------- replays


def test_a_turn_over_equal_messages_of_other_entries_replays_as_a_duplicate(service: Service, sid: str) -> None:
    """The mirror holds the turn's messages at its positions, but as other entries (another host id,
    the same text). Matched by message, the receipt named those entries, and the host's replay of the
    turn after an uncertain commit (the same request) was an advancement-key collision. The named ends
    of a turn match by id: the mirror branches to the host's entries, and the replay is a duplicate."""
    page(service.store, sid, None, "c2", hosted(("old-u", u("q")), ("old-a", a("r"))))
    req = turn_request("k1", 0, [u("q"), a("r")], ("hu", "ha"))
    first = commit(service, sid, req)
    assert first.status == "committed"
    again = commit(service, sid, req)  # was: AdvancementKeyCollision
    assert again.status == "duplicate" and again.receipt == first.receipt
    assert (first.receipt.admission_entry_id, first.receipt.terminal_entry_id) == ("hu", "ha")
    assert visible(service.store, sid) == [("hu", u("q")), ("ha", a("r"))]


def test_a_one_message_turn_naming_two_entries_is_refused(service: Service, sid: str) -> None:
    """One message cannot be two entries: its receipt named the admission as the terminal too, so every
    replay (the same request) was an advancement-key collision. And two messages cannot be one entry.
    Both are a turn_mismatch, nothing written."""
    for messages, ids in (([u("only")], ("hu", "ht")), ([u("q"), a("r")], ("same", "same"))):
        req = turn_request("k1", 0, messages, ids)
        for _ in range(2):
            with pytest.raises(MirrorConflict) as refused:
                commit(service, sid, req)
            assert refused.value.reason == "turn_mismatch"
        assert every_entry(service.store, sid) == []
    req = turn_request("k1", 0, [u("only")], ("hu", "hu"))
    assert commit(service, sid, req).status == "committed"
    assert commit(service, sid, req).status == "duplicate"


def test_a_turn_that_moves_the_host_transcript_resets_the_import_resume_point(service: Service, sid: str) -> None:
    """Five host messages imported (resume point: cursor c5, position 5). The host goes back and the
    next turn replaces positions 2..: the mirror holds 4. The resume point stayed at 5, so the next
    page the importer sent from it was ``behind`` (the very import meant to catch up), on every try.
    Now the turn resets it: the importer starts from the host's beginning and everything lines up."""
    s = service.store
    host = hosted(*((f"h{i}", u(f"m{i}") if i % 2 == 0 else a(f"m{i}")) for i in range(5)))
    page(s, sid, None, "c5", host)
    assert state_of(s, sid) == ("c5", 5)
    assert commit(service, sid, turn_request("k1", 2, [u("new"), a("reply")], ("nu", "na"))).status == "committed"
    assert state_of(s, sid) == (None, 0)
    with pytest.raises(MirrorConflict) as refused:
        page(s, sid, "c5", "c6", hosted(("h5", u("m5"))))
    assert refused.value.reason == "cursor"  # the importer re-reads the resume point
    now = [*host[:2], HostMessage("nu", u("new")), HostMessage("na", a("reply")), HostMessage("h9", u("later"))]
    done = page(s, sid, None, "c9", now)
    assert (done.matched, done.imported, done.rewound) == (4, 1, False)
    assert [e for e, _ in visible(s, sid)] == ["h0", "h1", "nu", "na", "h9"]
    assert state_of(s, sid) == ("c9", 5)


def test_a_turn_after_the_import_keeps_the_resume_point(service: Service, sid: str) -> None:
    """A turn that only appends, or moves the transcript at or after the resume point, leaves it."""
    s = service.store
    page(s, sid, None, "c2", hosted(("h0", u("m0")), ("h1", a("m1"))))
    assert commit(service, sid, turn_request("k1", 2, [u("q"), a("r")], ("qu", "qa"))).status == "committed"
    assert commit(service, sid, turn_request("k2", 2, [u("q2"), a("r2")], ("qu2", "qa2"))).status == "committed"
    assert state_of(s, sid) == ("c2", 2)


# ---------------------------------------------------------------------------------------------- hostile input


def test_nul_bytes_in_ids_are_refused_and_in_messages_kept(store: TranscriptStore, sid: str) -> None:
    for bad in ("nul\x00id", "\x00", "line\nbreak", "lone\ud800"):
        with pytest.raises(InvalidInput):
            page(store, sid, None, "c", hosted((bad, u("hi"))))
    assert every_entry(store, sid) == [] and state_of(store, sid) == (None, 0)
    odd = {"role": "user", "content": "a\x00b \U0001f600 \u2028", "name": "n\x00"}
    page(store, sid, None, "c1", hosted(("x", odd)))
    assert visible(store, sid) == [("x", odd)]
    again = page(store, sid, None, "c1", hosted(("x2", dict(odd))))  # another id, the same message
    assert (again.matched, again.imported, again.rewound) == (1, 0, False)


def test_a_message_in_another_key_order_matches(store: TranscriptStore, sid: str) -> None:
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    page(store, sid, None, "c1", hosted(("x", message)))
    reordered = {"tool_calls": [{"function": {"arguments": "{}", "name": "f"}, "type": "function", "id": "c1"}],
                 "content": None, "role": "assistant"}
    done = page(store, sid, None, "c1", hosted(("y", reordered)))
    assert (done.matched, done.imported, done.rewound) == (1, 0, False)
    # 1 and 1.0 are not the same JSON (core.same_json): that one is a change.
    page(store, sid, None, "c2", hosted(("x", message), ("n", {"role": "user", "content": "n", "n": 1})))
    moved = page(store, sid, None, "c2", hosted(("x", message), ("n2", {"role": "user", "content": "n", "n": 1.0})))
    assert (moved.matched, moved.imported, moved.rewound) == (1, 1, True)


def test_ids_and_cursors_of_other_sessions_and_scopes_are_not_this_mirrors(store: TranscriptStore) -> None:
    """Another session (of this scope, or one of another scope under the same session id) holding the
    same host entry ids and cursors: each mirror is its own; a cursor another session holds is not one
    this mirror holds."""
    one = store.create_session(A).session_id
    store.create_session(B, session_id=one)
    two = store.create_session(A).session_id
    for session_id, scope in ((one, A), (one, B), (two, A)):
        page(store, session_id, None, "shared-cursor", hosted(("x", u(f"{scope}:{session_id}"))), scope=scope)
    for session_id, scope in ((one, A), (one, B), (two, A)):
        assert visible(store, session_id, scope) == [("x", u(f"{scope}:{session_id}"))]
    page(store, one, "shared-cursor", "next", hosted(("y", a("on"))))
    fresh = store.create_session(A).session_id
    with pytest.raises(MirrorConflict) as refused:
        page(store, fresh, "next", "after", hosted(("z", u("forged"))))
    assert refused.value.reason == "cursor" and every_entry(store, fresh) == []
    assert visible(store, two) == [("x", u(f"{A}:{two}"))] and visible(store, one, B) == [("x", u(f"{B}:{one}"))]


def test_the_store_own_ids_named_by_the_host(service: Service, sid: str) -> None:
    """A host id equal to the id the store gave a turn's middle message names that message: a range that
    puts it after its place (which stays) is refused, not shown twice; one that moves the transcript
    before it takes it off the branch, and the host's message is appended under a fresh id."""
    s = service.store
    commit(service, sid, turn_request("k1", 0, [u("q"), a("calling"), a("r")], ("hu", "ha")))
    middle = visible(s, sid)[1][0]
    assert middle not in ("hu", "ha")
    with pytest.raises(MirrorConflict) as refused:
        s.write(lambda c: align(c, s.config, A, sid, 3, hosted((middle, a("calling")))))
    assert refused.value.reason == "cursor"
    with pytest.raises(MirrorConflict) as refused:
        s.write(lambda c: align(c, s.config, A, sid, 3, hosted((middle, a("calling"))), turn=True))
    assert refused.value.reason == "turn_mismatch"
    assert [e for e, _ in visible(s, sid)] == ["hu", middle, "ha"]
    done = page(s, sid, None, "c", hosted(("hu", u("q")), ("hx", a("other")), (middle, a("calling"))))
    assert (done.matched, done.imported, done.rewound) == (1, 2, True)
    shown = visible(s, sid)
    assert [e for e, _ in shown][:2] == ["hu", "hx"] and shown[2][0] != middle and shown[2][1] == a("calling")


def test_a_page_of_max_items(store: TranscriptStore, sid: str) -> None:
    """A page of MAX_ITEMS messages is imported in one transaction, and matched as a whole when sent again."""
    host = hosted(*((f"h{i}", u(f"message {i}")) for i in range(MAX_ITEMS)))
    started = time.monotonic()
    done = page(store, sid, None, "end", host)
    assert (done.imported, done.matched) == (MAX_ITEMS, 0)
    again = page(store, sid, None, "end", host)
    assert (again.imported, again.matched, again.rewound) == (0, MAX_ITEMS, False)
    assert state_of(store, sid) == ("end", MAX_ITEMS)
    assert time.monotonic() - started < 120


# ---------------------------------------------------------------------------------------------- crashes

_IMPORTER = textwrap.dedent(
    """
    import sys
    from transcript_store import StoreConfig, TranscriptStore
    from transcript_store.mirror import HostMessage, import_page, import_state

    url, scope, session_id, total, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    s = TranscriptStore(config=StoreConfig(url=url, auto_upgrade=False))
    host = [HostMessage(f"h{i}", {"role": "user", "content": f"m{i} " + "x" * 200}) for i in range(total)]
    while True:
        st = s.read(lambda c: import_state(c, scope, session_id))
        at = st.position if st.cursor is not None else 0
        if at >= total:
            break
        nxt = min(at + size, total)
        s.write(lambda c: import_page(c, s.config, scope, session_id, cursor=st.cursor, next_cursor=f"c{nxt}",
                                      messages=host[at:nxt]))
        print(nxt, flush=True)
    """
)


def test_an_import_killed_between_and_inside_pages_resumes_exactly(shared_url: str, store: TranscriptStore,
                                                                   sid: str) -> None:
    """An importer process SIGKILLed at random moments, again and again, then resumed from the recorded
    point: the resume point always agrees with the mirror (cursor c<n> at position n, n messages), and
    the finished mirror is the host's transcript, each message once."""
    total, size = 600, 25
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    rng = random.Random(7)
    for _ in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-c", _IMPORTER, shared_url, A, sid, str(total), str(size)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )
        time.sleep(rng.uniform(0.3, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        cursor, position = state_of(store, sid)
        shown = visible(store, sid)
        assert len(shown) == position and cursor == (f"c{position}" if position else None)
        assert [e for e, _ in shown] == [f"h{i}" for i in range(position)]
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTER, shared_url, A, sid, str(total), str(size)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [e for e, _ in visible(store, sid)] == [f"h{i}" for i in range(total)]
    assert len(every_entry(store, sid)) == total and state_of(store, sid) == (f"c{total}", total)
