"""``outbox``: turn intents waiting for their engine (status, drain, block, recover)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ..core import Core
from ..errors import UnknownSession
from ..store import TranscriptStore
from ..terminal import shown
from ..turns import MAX_DRAIN
from .group import cli
from .hosting import _runtime, engine_output_on_stderr
from .options import EXIT_FAILED, CommandError, Integer, common, filled, state
from .output import console, emit_json
from .stores import find_session, store_session


@cli.group()
@common
def outbox() -> None:
    """Turn intents waiting for their engine: status, drain, recover, block."""


#: the most outbox rows `outbox status` lists (its counts are of every row); Turns.intents reads at most 10,000
OUTBOX_STATUS_ROWS = 10_000
#: session ids per read when `outbox recover` lists every session with outbox rows
OUTBOX_PAGE = 1000


def _counts_in(c: Core, scope: str) -> dict[str, int]:
    """Outbox rows of ``scope`` per state, every row counted, in the caller's snapshot."""
    from sqlalchemy import func, select

    from ..schema import outbox as rows

    q = select(rows.c.state, func.count()).where(rows.c.scope == scope).group_by(rows.c.state)
    return {str(state): int(n) for state, n in c.conn.execute(q)}


def _outbox_counts(store: TranscriptStore, scope: str) -> dict[str, int]:
    """Outbox rows of ``scope`` per state, every row counted."""
    return store.read(lambda c: _counts_in(c, scope))


@outbox.command("status")
@common
def outbox_status() -> None:
    """Pending and blocked turn intents per session, with attempts and last errors."""
    from .. import outbox as rows

    st = state()
    with store_session() as store:
        # The rows and the counts of one snapshot: read in two, a row enqueued between them made the
        # "showing the first N" warning below say so of a listing that held every row.
        intents, counts = store.read(
            lambda c: (rows.list_intents(c, st.scope_name, OUTBOX_STATUS_ROWS), _counts_in(c, st.scope_name))
        )
    total = sum(counts.values())
    if total > len(intents):  # never a silent cut: the counts below are of every row
        click.echo(f"warning: the outbox holds {total} rows; showing the first {len(intents)} "
                   "(by session and enqueue order)", err=True)
    fields = ("session_id", "turn_id", "engine_id", "state", "enqueue_seq", "attempt_count", "last_error",
              "block_reason", "lease_owner", "last_attempt_at")
    if st.json:
        emit_json([{k: v for k, v in i.model_dump(mode="json").items() if k in fields} for i in intents])
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"outbox of scope {st.scope_name!r}", title_justify="left")
    for name in ("session", "turn", "engine", "state", "seq", "attempts", "last error / block reason"):
        table.add_column(name, overflow="fold")
    for i in intents:
        why = " | ".join(x for x in (i.last_error, i.block_reason) if x)
        table.add_row(i.session_id, i.turn_id, i.engine_id, i.state, str(i.enqueue_seq), str(i.attempt_count),
                      Text(shown(why)))  # an engine's error or an operator's reason: read, not obeyed
    if intents:
        console().print(table)
    click.echo(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) if counts else "the outbox is empty")


@outbox.command("drain")
@click.option("--session", "session", metavar="SESSION", callback=filled(blank_ok=True), help="Only this session.")
@click.option("--limit", type=Integer(1, MAX_DRAIN), default=1000, show_default=True, help="Rows to deliver.")
@common
def outbox_drain(session: str | None, limit: int) -> None:
    """Deliver ready intents to their engines' commit_turn, in order; exit 1 if any failed."""
    st = state()
    with store_session() as store:
        # Not "if session": an empty one (`--session "$SID"`, SID unset) is refused as an id, not taken for
        # none, which delivered every session's turns.
        sid = find_session(store, st.scope_name, session).session_id if session is not None else None
        settings = st.settings()
        with engine_output_on_stderr():
            runtime = _runtime(store, settings)
            try:
                report = runtime.turns.drain(runtime.commit_in, scope=st.scope_name, session_id=sid, limit=limit)
            finally:
                runtime.dispose()
    data = {
        "committed": report.committed,
        "duplicates": report.duplicates,
        "blocked": report.blocked,
        "failed": [{"session_id": s, "turn_id": t, "error": e} for s, t, e in report.failed],
        "stopped_sessions": report.stopped_sessions,
    }
    if st.json:
        emit_json(data)
    else:
        click.echo(f"committed {report.committed}, duplicates {report.duplicates}, blocked {report.blocked}, "
                   f"failed {len(report.failed)}")
        for s, t, e in report.failed:  # an engine's error text: read, not obeyed (as outbox status shows it)
            click.echo(f"  failed: session {s} turn {t}: {shown(e, one_line=True)}")
    if report.failed:
        raise CommandError(f"{len(report.failed)} deliveries failed; their rows stay queued")


@outbox.command("block")
@click.argument("session", callback=filled(blank_ok=True))
@click.argument("turn_id", metavar="TURN", callback=filled(blank_ok=True))
@click.option("--reason", required=True, callback=filled(), help="Why (kept with the row, shown by `outbox status`).")
@click.option("--yes", is_flag=True, help="Really block it: the turn never reaches its engine.")
@common
def outbox_block(session: str, turn_id: str, reason: str, yes: bool) -> None:
    """Block a queued TURN of SESSION that its engine can never take, so that the later ones go on."""
    from ..turns import Turns

    st = state()
    if not yes:
        raise CommandError("blocking a turn keeps it from its engine for good: add --yes", EXIT_FAILED)
    with store_session() as store:
        sid = find_session(store, st.scope_name, session).session_id
        intent = Turns(store).block(st.scope_name, sid, turn_id, reason)
    if st.json:
        emit_json({"session_id": sid, "turn_id": turn_id, "engine_id": intent.engine_id, "state": intent.state,
                   "block_reason": intent.block_reason})
    else:
        reason = shown(intent.block_reason or "")
        click.echo(f"session {sid} turn {turn_id} ({intent.engine_id}): {intent.state} ({reason})")


def _outbox_sessions(store: TranscriptStore, scope: str) -> list[str]:
    """Every session of ``scope`` with outbox rows, read in keyset pages of OUTBOX_PAGE ids: however many."""
    from sqlalchemy import select

    from ..schema import outbox as rows

    def page(after: str | None) -> Callable[[Any], list[str]]:
        q = select(rows.c.session_id).where(rows.c.scope == scope).distinct()
        if after is not None:
            q = q.where(rows.c.session_id > after)
        q = q.order_by(rows.c.session_id).limit(OUTBOX_PAGE)
        return lambda c: [str(r.session_id) for r in c.conn.execute(q)]

    out: list[str] = []
    while True:
        ids = store.read(page(out[-1] if out else None))
        out.extend(ids)
        if len(ids) < OUTBOX_PAGE:
            return out


@outbox.command("recover")
@click.argument("session", required=False, callback=filled(blank_ok=True))
@common
def outbox_recover(session: str | None) -> None:
    """Discard dead admitted intents and drain ready ones (SESSION, or every session with intents)."""
    st = state()
    scope = st.scope_name
    with store_session() as store:
        # An empty SESSION is refused as an id, not taken for none (every session recovered), as drain's.
        targets = (
            [find_session(store, scope, session).session_id] if session is not None else _outbox_sessions(store, scope)
        )
        settings = st.settings()
        results = []
        with engine_output_on_stderr():
            runtime = _runtime(store, settings)
            try:
                for sid in targets:
                    try:
                        r = runtime.turns.recover(scope, sid, settings.engine, runtime.commit_in)
                    except UnknownSession:
                        if session is not None:
                            raise
                        continue  # deleted since the list was read: its intents went with it
                    results.append({
                        "session_id": sid,
                        "discarded": r.discarded,
                        "committed": r.drain.committed,
                        "duplicates": r.drain.duplicates,
                        "blocked": r.drain.blocked,
                        "failed": [{"turn_id": t, "error": e} for _s, t, e in r.drain.failed],
                        "pending": r.queued,
                    })
            finally:
                runtime.dispose()
    if st.json:
        emit_json(results)
    else:
        for r in results:
            click.echo(f"session {r['session_id']}: discarded {len(r['discarded'])}, committed {r['committed']}, "
                       f"duplicates {r['duplicates']}, blocked {r['blocked']}, failed {len(r['failed'])}, "
                       f"pending {len(r['pending'])}")
        if not results:
            click.echo("nothing to recover")
    failed = sum(len(r["failed"]) for r in results)
    if failed:
        raise CommandError(f"{failed} deliveries failed; their rows stay queued")
