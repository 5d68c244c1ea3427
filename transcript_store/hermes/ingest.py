"""Storing Hermes' message lists: aligned with the visible transcript, branched where they differ."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .. import paths
from ..core import Core, entry_from_row
from ..errors import UnknownSession
from ..store import replaced
from .context import is_context_message, split_system
from .forms import Checked, align, new_entry, storable_tail
from .lineage import LineageMixin
from .messages import clean, digest, fingerprint, message_key
from .runtime import EMPTY, _Runtime, _Visible
from .spelling import spelled

log = logging.getLogger("transcript_store.hermes")

#: the most respelled messages a session's cache names (``_Visible.respelled``); past it, it starts anew:
#: a list holding one it forgot reads its stored row again, never aligns otherwise
_RESPELLED_MAX = 4096


def _sent(message: dict[str, Any]) -> str:
    """The digest of a message's ``api_content`` ("" for none): ``spelling.restored`` reads it, and the
    message's digest leaves it out. Its digest, not its text: it carries the memory prefetch (some KB)."""
    sent = message.get("api_content")
    return digest(sent) if isinstance(sent, str) and sent else ""


def respelled(vis: _Visible, host: Sequence[dict[str, Any]], digests: Sequence[str], start: int | None) -> list[str]:
    """``digests`` with each message where the host's list goes on along the transcript ``vis`` holds, but
    in Hermes' saved spelling of the stored message there (a pair ``vis.respelled`` names), given the stored
    one's digest: the list aligns past it as past the stored message.

    The gateway's history is Hermes' database's, reloaded for every turn: each turn (and each recall tool
    call and request, which store the list first) found such a message anew, read its stored row in a
    write transaction, and checked the forms of every message after it, a write transaction that wrote
    nothing when the list held nothing new. A pair holds for whatever the list: ``spelled`` depends on the
    two messages only, which the digests and the host's ``api_content`` (which digests leave out) name."""
    out = list(digests)
    if not vis.respelled:
        return out
    skipped, kept = align(vis.digests, out, start)
    while skipped < len(out) and kept < len(vis.digests):
        if out[skipped] != vis.digests[kept]:
            if (out[skipped], _sent(host[skipped]), vis.digests[kept]) not in vis.respelled:
                break
            out[skipped] = vis.digests[kept]
        skipped, kept = skipped + 1, kept + 1
    return out


class IngestMixin(LineageMixin):
    """Hermes' lists into the store session, each message once."""

    def _visible_in(self, c: Core, rt: _Runtime, store_session: str) -> tuple[Any, _Visible]:
        """The session's row, locked, and its visible transcript (the cache, brought up to date)."""
        sess = c.require_session(self.scope, store_session, lock=True)
        with rt.lock:
            known = rt.visible.get(store_session, EMPTY)
        same = known.incarnation == sess.incarnation and known.generation == sess.generation
        if same and known.head == sess.head_entry_id:
            return sess, known
        # Another writer moved the head. Appends after our last message keep the cached part; a
        # branch or a rewrite below it does not, and the whole transcript is read again.
        keep = known if same else EMPTY
        if keep.seqs and c.path_seq_at_position(self.scope, store_session, len(keep.seqs) - 1) != keep.seqs[-1]:
            keep = EMPTY
        entries = [
            entry_from_row(r, True)
            for r in c.visible_rows(self.scope, store_session, len(keep.seqs) - 1, None, None)
        ]
        return sess, _Visible(
            sess.head_entry_id,
            sess.generation,
            keep.digests + tuple(fingerprint([e.message or {}]) for e in entries),
            keep.entry_ids + tuple(e.entry_id for e in entries),
            keep.seqs + tuple(e.seq for e in entries),
            int(sess.incarnation),
            known.respelled if known.incarnation == sess.incarnation else frozenset(),
        )

    def _write_in(
        self, c: Core, rt: _Runtime, store_session: str, host: list[dict[str, Any]], digests: list[str],
        start: int | None, follow: bool = False, seen: dict[int, Checked] | None = None,
    ) -> _Visible:
        """Make the visible transcript follow the host's list (one transaction, the session locked).

        A list that is the start of the transcript moves nothing (a hook may send an older copy), unless
        ``follow``: ``compress`` gets the list Hermes goes on with, and what the transcript holds after
        its end (a turn ``/undo`` took back; the tail ``/compress here`` holds back and appends again)
        leaves the active branch, or the answer brought it back (a review saw an undone turn sent to
        the model again). ``seen``: what ``checked`` said of the host's messages (``storable_tail``)."""
        sess, vis = self._visible_in(c, rt, store_session)
        seen = {} if seen is None else seen
        cap = rt.store.config.max_payload_bytes
        digests = respelled(vis, host, digests, start)
        host, digests, changed = storable_tail(host, digests, vis.digests, start, cap, seen)
        skipped, kept = align(vis.digests, digests, start)
        learned: set[tuple[str, str, str]] = set()
        while skipped < len(host) and kept < len(vis.entry_ids):
            # Where the list leaves the transcript, its message may be the stored one as Hermes' database
            # hands it back (the gateway's history, reloaded for every turn): the same message, kept as
            # stored. Written, the stored one left the active branch and every message after it was
            # written again.
            rows = c.visible_rows(self.scope, store_session, kept - 1, kept + 1, 1)
            stored = entry_from_row(rows[0], True).message if rows else None
            if not isinstance(stored, dict) or not spelled(stored, host[skipped]):
                break
            if skipped not in changed:  # as the host holds it: its digest is the one a later list has
                learned.add((digests[skipped], _sent(host[skipped]), vis.digests[kept]))
            host[skipped], digests[skipped] = stored, vis.digests[kept]
            seen.pop(skipped, None)
            changed.pop(skipped, None)
            # The rest of the list is in the form the store takes already (``storable_tail`` went on to its
            # end): compared on from here, each message once.
            skipped, kept = skipped + 1, kept + 1
            while skipped < len(host) and kept < len(vis.digests) and digests[skipped] == vis.digests[kept]:
                skipped, kept = skipped + 1, kept + 1
        if learned:
            pairs = vis.respelled if len(vis.respelled) < _RESPELLED_MAX else frozenset()
            vis = replace(vis, respelled=pairs | learned)
        rest = host[skipped:]
        for i in sorted(k for k in changed if k >= skipped):
            log.warning("transcript-store: a message of store session %s is stored in another form (%s)",
                        store_session, changed[i])
        if not rest:
            if not follow or kept == 0 or kept == len(vis.entry_ids):
                return vis  # a list we hold all of (or a stale prefix of it): nothing moves
            head = vis.entry_ids[kept - 1]
            paths.branch(c, self.scope, store_session, head)
            return replace(vis, head=head, digests=vis.digests[:kept], entry_ids=vis.entry_ids[:kept],
                           seqs=vis.seqs[:kept])
        # Off-branch entries may hold the same message at the same ordinal: a key naming the seq this
        # write follows can never find one of them (it would be "already stored", silently).
        forked = kept < len(vis.entry_ids) or sess.path_length < sess.last_seq + 1
        if kept < len(vis.entry_ids):
            # The host's list differs from here on: branch after the last message both agree on.
            paths.branch(c, self.scope, store_session, vis.entry_ids[kept - 1] if kept else None)
        after_seq = int(sess.last_seq) if forked else None
        items = [
            new_entry(rt.store, m, message_key(store_session, kept + k, m, after_seq), seen.get(skipped + k))
            for k, m in enumerate(rest)
        ]
        entries = c.append(self.scope, store_session, items)
        return replace(
            vis,
            head=entries[-1].entry_id,  # the head now; neither a branch nor an append rotates the generation
            digests=vis.digests[:kept] + tuple(digests[skipped:]),
            entry_ids=vis.entry_ids[:kept] + tuple(e.entry_id for e in entries),
            seqs=vis.seqs[:kept] + tuple(e.seq for e in entries),
        )

    def ingest(
        self, messages: Sequence[dict[str, Any]], hermes_session: str | None = None, *, follow: bool = False,
        memo: dict[int, str] | None = None,
    ) -> tuple[str, int]:
        """Store the conversation's messages once each; (store session, visible messages in the lineage).
        ``follow``: the list is the conversation itself, shorter than the transcript too (``_write_in``).
        ``memo``: given, it gets each message's fingerprint the alignment computed (of its ``clean`` form),
        by the message's ``id`` (``messages`` must outlive its use).

        Our own context messages (summaries) are never stored. The rest is aligned in order with the
        session's visible transcript: the longest common prefix is skipped and everything after the
        first difference is written (see the module doc), each with the idempotency key (session,
        ordinal, canonical message). The common case, the stored list plus new messages, reads nothing
        but the session's row and writes only the new messages.
        """
        try:
            return self._ingest(messages, hermes_session, follow=follow, memo=memo)
        except UnknownSession as e:
            # The store session this runtime followed was deleted (``sessions delete``): every later call
            # failed on it until a restart, which opens the Hermes session by its key anew, and compress
            # left the conversation uncompressed meanwhile. Forgotten, it is opened as a restart opens it.
            rt = self.runtime()
            self._load_candidates(rt, refresh=True)  # first: a refresh must not bring its candidates back
            if not self._forget(rt, e.session_id):
                raise
            return self._ingest(messages, hermes_session, follow=follow, memo=memo)

    @staticmethod
    def _forget(rt: _Runtime, store_session: str) -> bool:
        """Drop what the runtime holds of a store session found deleted; whether it held anything of it."""
        with rt.lock:
            keys = [k for k, sid in rt.aliases.items() if sid == store_session]
            answers = [fp for fp, by in rt.candidates.items() if store_session in by]
            held = bool(keys or answers) or store_session in rt.visible
            for k in keys:
                del rt.aliases[k]
            for cache in (rt.visible, rt.adopted, rt.pending, rt.selections):
                cache.pop(store_session, None)
            for fp in answers:  # a compacted view of it is taken for the start of a new session's list
                del rt.candidates[fp][store_session]
                if not rt.candidates[fp]:
                    del rt.candidates[fp]
        return held

    def _ingest(
        self, messages: Sequence[dict[str, Any]], hermes_session: str | None = None, *, follow: bool = False,
        memo: dict[int, str] | None = None,
    ) -> tuple[str, int]:
        """``ingest``, once."""
        rt = self.runtime()
        _system, body = split_system([m for m in messages if isinstance(m, dict)])
        compacted = any(is_context_message(m) for m in body)
        # A compacted view whose candidate another runtime recorded after our index was read.
        cand = self._match(rt, body, hermes_session) or (
            self._match(rt, body, hermes_session, refresh=True) if compacted else None
        )
        start: int | None = 0
        key = hermes_session or self.session_id or "default"
        if cand is not None and key in getattr(self, "branches", ()) and self._lineage(rt, key) is None:
            cand = self._fork(rt, key, cand)
        if cand is not None:
            store_session = cand.store_session
            with rt.lock:
                rt.aliases[hermes_session or self.session_id or "default"] = store_session
                newly = rt.adopted.get(store_session) != cand.fp
            if newly:
                self._adopt(rt, cand)
            # The candidate stands for the transcript up to its next ordinal: what follows it in the
            # host's list follows that position (its copies of the fresh tail are not compared).
            start, body = cand.next_ordinal, body[cand.length:]
        else:
            store_session = self._store_session(rt, hermes_session)
            if compacted:
                start = None
        ours = [m for m in body if not is_context_message(m)]
        host = [clean(m) for m in ours]
        digests = [fingerprint([m]) for m in host]
        if memo is not None:
            memo.update(zip(map(id, ours), digests, strict=True))
        seen: dict[int, Checked] = {}  # each new message is checked once, whatever the attempts
        with rt.session_lock(store_session):
            with rt.lock:
                known = rt.visible.get(store_session)
            if known is not None:
                cap = rt.store.config.max_payload_bytes
                fps = storable_tail(host, respelled(known, host, digests, start), known.digests, start, cap, seen)[1]
                skipped, kept = align(known.digests, fps, start)
                if skipped == len(host) and (not follow or kept in (0, len(known.entry_ids))):
                    # Nothing new against the cache: one read of the session's head proves it current.
                    info = rt.store.get_session(self.scope, store_session)
                    if (info.head_entry_id, info.generation, info.incarnation) == (
                        known.head, known.generation, known.incarnation
                    ):
                        return store_session, len(known.entry_ids)
            landed: list[_Visible] = []  # what an attempt that ran to its end left (its incarnation with it)

            def run(c: Core) -> _Visible:
                if landed and replaced(c, self.scope, store_session, landed[0].incarnation):
                    # An earlier attempt ran to its end and only its COMMIT was uncertain; the store
                    # session it wrote was deleted since, perhaps made again under its id (someone
                    # else's transcript): aligned with that one, the list went into it. Its own answer.
                    return landed[0]
                landed[:] = [self._write_in(c, rt, store_session, host, digests, start, follow, seen)]
                return landed[0]

            vis = rt.store.write(run)
            with rt.lock:  # only after the commit: a retried transaction starts from the same cache
                rt.visible[store_session] = vis
        return store_session, len(vis.entry_ids)
