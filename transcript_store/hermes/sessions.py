"""Hermes session ids: starts, switches (``/new``, ``/resume``, ``/branch``), rotations and ends."""

from __future__ import annotations

import contextlib
import json
import logging
import weakref
from collections import Counter
from typing import Any

from .config import as_int
from .context import is_context_message
from .ingest import IngestMixin
from .lineage import ALIAS, INDEX_KEY
from .messages import canonical, clean, detached, digest, fingerprint
from .runtime import _BOUND, _LIVE, _RUNTIME_LOCK, _TURN
from .spelling import as_shown, live_keys, saved_keys

log = logging.getLogger("transcript_store.hermes")


def _branch_parent(session_db: Any, session_id: str) -> str | None:
    """The session ``session_id`` is a ``/branch`` of, as hermes-agent's session database records it (its
    ``_branched_from`` mark, or a parent that ended as ``branched``); None when it is none or cannot tell."""
    try:
        row = session_db.get_session(session_id) if session_db is not None else None
        if not isinstance(row, dict):
            return None
        config = row.get("model_config") or "{}"
        config = json.loads(config) if isinstance(config, str) else config
        marked = config.get("_branched_from") if isinstance(config, dict) else None
        parent_id = row.get("parent_session_id")
        if isinstance(marked, str) and marked:
            return marked
        if marked:
            return parent_id if isinstance(parent_id, str) and parent_id else None
        parent = session_db.get_session(parent_id) if parent_id else None
        return parent_id if isinstance(parent, dict) and parent.get("end_reason") == "branched" else None
    except Exception:
        return None


def rewound(session_db: Any, hermes_session: str) -> bool:
    """Whether hermes-agent's session database counts a rewind of the conversation (``/undo``, the
    checkpoint ``/rollback``: ``rewind_to_message`` soft-deletes the undone rows and counts it on the
    session's row); False when it counts none or cannot tell."""
    try:
        row = session_db.get_session(hermes_session) if session_db is not None else None
        return isinstance(row, dict) and as_int(row.get("rewind_count")) > 0
    except Exception:
        return False


def saved_all(session_db: Any, hermes_session: str, messages: Any) -> bool:
    """Whether hermes-agent's session database holds every message of ``messages`` (kept or rewound; a
    message it saves in another spelling, as spelled: ``live_keys``); False when it cannot tell. A write
    Hermes could not make (its database locked by another writer: it logs it and goes on) left a kept
    turn out of it: followed, the session end took that turn off the transcript."""
    try:
        own, back = saved_keys(session_db.get_messages_as_conversation(hermes_session, include_inactive=True))
        known = set(own)
        return all(
            any(k in known for k in live_keys(clean(m), back)) for m in messages or ()
            if isinstance(m, dict) and m.get("role") != "system" and not is_context_message(m)
        )
    except Exception:
        return False


def saved_ask(session_db: Any, hermes_session: str, messages: Any) -> bool:
    """Whether hermes-agent's session database keeps the last user message of ``messages`` active (a turn's
    list: its own message, which Hermes saves at the turn's start; in its saved spelling, too); False
    when it cannot tell. The background review's list, under its parent's id, ends with a prompt never
    saved."""
    try:
        asks = [clean(m) for m in messages or () if isinstance(m, dict) and m.get("role") == "user"
                and not is_context_message(m)]
        if not asks:
            return False
        own, back = saved_keys(session_db.get_messages_as_conversation(hermes_session))
        known = set(own)
        return any(k in known for k in live_keys(asks[-1], back))
    except Exception:
        return False


def kept_all(session_db: Any, hermes_session: str, messages: Any) -> bool:
    """Whether ``messages`` holds something and hermes-agent's session database keeps every message of it
    active (a message the list holds twice, twice; one it saves in another spelling, as spelled); False
    when it cannot tell. Such a list undid nothing the database took back: it is what Hermes shows. The
    CLI's ``/retry`` takes the last exchange out of its list and leaves its rows active, so the database
    then holds the exchange before the retried one: followed after an earlier ``/undo``, the session end
    stored the old exchange and the retried message again, visible beside the retried exchange Hermes
    showed."""
    try:
        own, back = saved_keys(session_db.get_messages_as_conversation(hermes_session))
        left = Counter(own)
        wanted = [clean(m) for m in messages or ()
                  if isinstance(m, dict) and m.get("role") != "system" and not is_context_message(m)]
        for m in wanted:
            key = next((k for k in live_keys(m, back) if left[k] > 0), None)
            if key is None:
                return False
            left[key] -= 1
        return bool(wanted)
    except Exception:
        return False


#: the start of a user message's digest (``shown_digests``): where an exchange of the list held ends
_USER = "user:"


def _digest(message: dict[str, Any], memo: dict[int, str] | None = None) -> str:
    """One conversation message's digest for ``unretried``: its fingerprint (``memo``'s for it, by its
    ``id``, when it holds one), a user message's marked."""
    fp = memo.get(id(message)) if memo else None
    return (_USER if message.get("role") == "user" else "") + (fp or fingerprint([clean(message)]))


def shown_digests(messages: Any, memo: dict[int, str] | None = None) -> tuple[str, ...]:
    """The conversation messages of a list Hermes holds, by digest (``_digest``), in order (no system
    prompt, none of ours): what ``unretried`` compares the saved list with. ``memo``: fingerprints of
    the very messages of ``messages`` computed already, by ``id`` (``ingest``'s)."""
    return tuple(
        _digest(m, memo) for m in messages or ()
        if isinstance(m, dict) and m.get("role") != "system" and not is_context_message(m)
    )


def unretried(saved: list[Any], shown: tuple[str, ...] | None) -> tuple[list[Any], bool]:
    """``saved`` (what Hermes' session database keeps active) without the exchanges a CLI ``/retry`` took out
    of the list Hermes held (``shown``: its ``shown_digests``); whether it took any out.

    The CLI's ``/retry`` takes the last exchange out of its list and sends the user message again, leaving
    the exchange's rows active: the database holds ``[..., X, A_old, X, A_new]`` while Hermes shows
    ``[..., X, A_new]``. Read at a switch (``/resume``, ``/branch``), at the end of an interrupted turn or
    at the session end after an ``/undo``, those rows put the old exchange and ``X`` a second time into the
    visible transcript. Exchanges are taken out only where the list held goes on, at that point, not with
    them but with the exchange their user message was sent again with (a message the user really sent
    twice stays, and so does one whose answer the database saved otherwise than Hermes holds it: its
    ``sanitize_context`` takes a ``<memory-context>`` tag out of a text, a multimodal tool result is saved
    as its text summary). Compared in order, an answer or tool result of the saved list may differ from
    the one the list held at its place (the database saved it otherwise); what follows the first other
    difference (at a user message) is kept as saved."""
    if not shown:
        return saved, False
    conv = [i for i, m in enumerate(saved)
            if isinstance(m, dict) and m.get("role") != "system" and not is_context_message(m)]
    fps = [_digest(saved[i]) for i in conv]
    users = [k for k, i in enumerate(conv) if saved[i].get("role") == "user"]
    after = {u: users[n + 1] for n, u in enumerate(users[:-1])}  # a user message -> the next one
    def held(a: int) -> bool:
        """Whether the list held goes on at ``j`` with the exchange at ``a``, whole (the saved list's last
        one: that exchange, or its start where the list held ends, an unfinished turn's)."""
        b = after.get(a)
        if b is not None:
            return tuple(fps[a:b]) == shown[j : j + b - a]
        n = min(len(conv) - a, len(shown) - j)
        return tuple(fps[a : a + n]) == shown[j : j + n] and (j + n == len(shown) or shown[j + n].startswith(_USER))

    drop: set[int] = set()
    j = k = 0
    while k < len(conv) and j < len(shown):
        nxt, last = after.get(k), k
        while nxt is not None and fps[nxt] == fps[k] == shown[j] and not held(last):
            last, nxt = nxt, after.get(nxt)  # the same message again: the exchange before it retried?
        if last != k and held(last):
            # Retried: the list held goes on with the exchange the user message was sent again with. Only
            # then: an exchange the database saved otherwise (``sanitize_context``) is no retried one.
            drop.update(conv[k:last])
            k = last
            continue
        if fps[k] != shown[j] and (fps[k].startswith(_USER) or shown[j].startswith(_USER)):
            break
        # The same, or an answer or tool result at the same place the database saved otherwise (what
        # ``sanitize_context`` rewrites, a multimodal result's summary): the rest is compared still.
        j, k = j + 1, k + 1
    return [m for i, m in enumerate(saved) if i not in drop], bool(drop)


def saved_conversation(session_db: Any, hermes_session: str) -> Any:
    """What Hermes' session database saved of a conversation, as Hermes replays it: with
    ``repair_alternation`` (what its gateway and ``/resume`` load), so consecutive user messages come
    merged, as ``repair_message_sequence`` merged them in the live list before the request.

    The turn after an interrupted one merges the interrupted user message and its own into one in the
    live list (what the turn hook stores) while the database keeps the two rows: read as saved, the
    list differed from the transcript there, and each later store of it (``end_turn``, a switch)
    branched the session and stored the rest of the conversation again. An older hermes-agent without
    the parameter is read as saved."""
    read = session_db.get_messages_as_conversation
    try:
        return read(hermes_session, repair_alternation=True)
    except TypeError:  # no such parameter
        return read(hermes_session)


class SessionsMixin(IngestMixin):
    """The Hermes session the adapter follows, and what it stores when the session changes."""

    def _tell_thread(self) -> None:
        """Name this copy as the one last told its agent's session in this thread (``end_turn``): Hermes
        builds an agent, binding its copy, in the thread that runs it (the background review's, too)."""
        with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced: no hook
            _TURN.told = weakref.ref(self)

    def _mark_turn(self) -> None:
        """Name this copy as the engine of the turn running on this thread (see ``observe_turn``)."""
        with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced: no hook
            _TURN.engine = weakref.ref(self)

    def on_session_start(self, session_id: str, **kwargs: Any) -> None:
        """Remember the Hermes session id (the store session opens lazily); a compaction boundary that
        moves to a new id (``boundary_reason="compression"``, ``old_session_id``) continues the old id's
        store session under the new one."""
        self.session_id = session_id
        if isinstance(session_id, str) and session_id:
            self._tell_thread()
            with _RUNTIME_LOCK:  # the new id's unfinished turns, too (``end_turn``)
                _LIVE[session_id] = self
                if self._bound_db() is not None:
                    _BOUND[session_id] = self
        old = kwargs.get("old_session_id")
        if kwargs.get("boundary_reason") != "compression" or not isinstance(old, str) or not old:
            return
        if not isinstance(session_id, str) or not session_id or old == session_id:
            return  # in place: the same id, the same store session
        # Without this, the turns after a rotation (below the trigger: no compress, whose adopted
        # candidate would link the new id) ran their recall tools in a new, empty store session.
        try:
            rt = self.runtime()
            lineage = self._store_session(rt, old)
            # Durable, in the candidates' index: a process restarted under the new id (Hermes resumes
            # it from its session database, no boundary told again) continues the lineage too.
            index = rt.store.open_session(self.scope, INDEX_KEY)
            rt.store.append(
                self.scope, index.session_id, kind="metadata",
                payload={"type": ALIAS, "hermes_session": session_id, "store_session": lineage},
                idempotency_key="alias-" + digest(canonical([session_id, lineage])),
            )
            with rt.lock:
                rt.aliases[session_id] = lineage
        except Exception:  # never an error into Hermes: the next compress links the lineage too
            log.exception("transcript-store: could not continue session %s under %s", old, session_id)

    def on_session_end(self, session_id: str, messages: list[dict[str, Any]]) -> None:
        """Store whatever of the conversation is not stored yet (idempotent); after an ``/undo``, what
        Hermes' session database kept of it (``_store_saved``)."""
        try:
            db = self._bound_db()
            if (
                session_id and db is not None and rewound(db, session_id) and saved_all(db, session_id, messages)
                and not kept_all(db, session_id, messages)
                and self._store_saved(db, session_id, self._shown_of(session_id), messages)
            ):
                # /undo tells the engine nothing, and the list Hermes passes at exit (the agent's
                # ``_session_messages``) still holds the undone turn: stored, it stayed visible to every
                # later read and resume. The database's active rows are what the user kept. A list
                # holding none of the rows taken back is the conversation itself (``kept_all``).
                return
            if messages:
                self.ingest(detached(list(messages)), session_id or None)
        except Exception:
            log.exception("transcript-store: storing the conversation at session end failed")

    def bind_session_state(self, session_db: Any = None, session_id: str = "", **_kwargs: Any) -> None:
        """Follow the agent's session id: hermes-agent calls this at agent start and when ``/new``,
        ``/resume`` or ``/branch`` switch the id without a session-start hook (its session database is
        not used: the store holds the transcript)."""
        # Without it the adapter kept the old id after a switch: the next conversation was aligned with
        # the old one's store session (branched onto its transcript) and the new id's stayed empty.
        if not isinstance(session_id, str) or not session_id:
            return
        self._tell_thread()
        with _RUNTIME_LOCK:
            _LIVE[session_id] = self
            if session_db is not None:
                self._session_db = session_db
                _BOUND[session_id] = self
        previous = self.session_id
        if previous == session_id:
            return
        # Hermes ends the conversation it leaves (on_session_end) on /new, not on /resume or /branch:
        # what it saved of that one since our last call is stored now, from its database.
        if previous:
            # The list Hermes showed of it, not the rows a CLI /retry left active (``unretried``).
            self._store_saved(session_db, previous, self._shown_of(previous))
        # A /branch is told here with the id it switches from (the CLI) or, in the gateway, which builds
        # a new agent for the branch, with none: the session database's mark says it is one either way
        # (unmarked in the gateway, the branch joined the parent's store session).
        parent = _branch_parent(session_db, session_id)
        if parent is not None:
            if not isinstance(getattr(self, "branches", None), set):
                self.branches = set()
            self.branches.add(session_id)
            if parent != previous and self._unstored(session_id):
                # The gateway left the parent without a hook: store what it saved, once (before the
                # branch has a store session; the gateway binds a new agent at every turn).
                self._store_saved(session_db, parent)
        self.session_id = session_id

    def _undone_whole(self, session_db: Any, hermes_session: str) -> bool:
        """Every turn of a rewound conversation undone (the database saved rows, none active): its store
        session shows nothing, the turns kept off the active branch; whether it did. Only a store session
        of the Hermes session's own, no compaction taken in it (a lineage's earlier turns are no
        rewound rows of this id)."""
        if not session_db.get_messages_as_conversation(hermes_session, include_inactive=True):
            return False
        rt = self.runtime()
        own = rt.store.find_session(self.scope, hermes_session)
        store_session = self._lineage(rt, hermes_session)
        with rt.lock:
            taken = store_session in rt.adopted or store_session in rt.pending
        if own is None or store_session != own.session_id or taken:
            return False
        with rt.session_lock(store_session):
            if rt.store.get_session(self.scope, store_session).head_entry_id is not None:
                rt.store.branch(self.scope, store_session, None)
            with rt.lock:
                rt.visible.pop(store_session, None)
                rt.selections.pop(store_session, None)
        return True

    def _bound_db(self) -> Any:
        """Hermes' session database given by ``bind_session_state`` (None: none yet)."""
        return getattr(self, "_session_db", None)

    def _unstored(self, hermes_session: str) -> bool:
        """Whether no store session holds ``hermes_session`` yet (False when the store cannot tell)."""
        try:
            return self._lineage(self.runtime(), hermes_session) is None
        except Exception:
            log.exception("transcript-store: could not look up session %s", hermes_session)
            return False

    def _note_shown(self, hermes_session: Any, messages: Any, memo: dict[int, str] | None = None) -> None:
        """Remember the list Hermes holds of the session this copy follows (a turn's, as the turn hooks
        pass it), for ``unretried`` when the session is stored from Hermes' database. ``memo``: the
        fingerprints ``ingest`` computed of these very messages (``shown_digests``)."""
        if isinstance(hermes_session, str) and hermes_session and hermes_session == self.session_id:
            self._shown = (hermes_session, shown_digests(messages, memo))

    def _shown_of(self, hermes_session: str) -> tuple[str, ...] | None:
        """The list Hermes last held of ``hermes_session`` in this copy (``_note_shown``); None: none."""
        shown = getattr(self, "_shown", None)
        return shown[1] if isinstance(shown, tuple) and shown[0] == hermes_session else None

    def _store_saved(
        self, session_db: Any, hermes_session: str, shown: tuple[str, ...] | None = None, live: Any = None
    ) -> bool:
        """Store what Hermes' session database saved of a conversation; whether it saved any (never raises
        into Hermes). After a rewind (``rewound``) the saved list is the conversation itself: what the
        store shows after its end (the turns ``/undo`` took back) leaves the active branch, kept off it.
        ``shown``: the list Hermes held (``shown_digests``); the exchanges a CLI ``/retry`` took out of it
        are left out of the saved list (``unretried``), which is then the conversation itself too.
        A message the database saved in another spelling than the transcript, or ``live`` (a list Hermes
        holds), holds it at its place is stored as they hold it (``as_shown``): read as saved, it left the
        active branch and every message after it was written again."""
        try:
            saved = saved_conversation(session_db, hermes_session) if session_db is not None else None
            follow = isinstance(saved, list) and rewound(session_db, hermes_session)
            if follow and not saved:
                return self._undone_whole(session_db, hermes_session)
            if not isinstance(saved, list) or not saved:
                return False
            saved = as_shown(saved, self._stored_visible(hermes_session, saved))
            if isinstance(live, list):
                saved = as_shown(saved, live)
            saved, retried = unretried(saved, shown)
            follow = follow or retried
            self.ingest(detached([m for m in saved if isinstance(m, dict)]), hermes_session, follow=follow)
            return True
        except Exception:
            log.exception("transcript-store: storing conversation %s at a session switch failed", hermes_session)
            return False

    def _stored_visible(self, hermes_session: str, saved: list[Any]) -> list[dict[str, Any]]:
        """The messages of the visible transcript of ``hermes_session``'s store session, for ``as_shown``
        (none: no store session, or it shows every message of ``saved`` as it is, by the runtime's cache)."""
        try:
            rt = self.runtime()
            store_session = self._lineage(rt, hermes_session)
            if store_session is None:
                return []
            with rt.lock:
                known = rt.visible.get(store_session)
            if known is not None and {
                fingerprint([clean(m)]) for m in saved
                if isinstance(m, dict) and m.get("role") != "system" and not is_context_message(m)
            } <= set(known.digests):
                return []  # each of them is in the transcript as it is: none to find in another spelling
            return [e.message for e in rt.store.read_visible(self.scope, store_session)
                    if e.kind == "message" and isinstance(e.message, dict)]
        except Exception:
            log.exception("transcript-store: could not read the transcript of session %s", hermes_session)
            return []
