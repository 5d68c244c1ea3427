"""Compress answers as candidates: their index, adoption, and the store session of each lineage."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..core import Core, entry_from_row, new_id
from ..errors import SessionKeyConflict
from ..store import AppendItem
from .context import is_context_message
from .messages import canonical, clean, digest, fingerprint, message_key
from .runtime import RuntimeMixin, _Candidate, _Runtime

INDEX_KEY = "_hermes_candidates"
CANDIDATE = "hermes-candidate"
#: an index entry linking a Hermes session id to the store session of its lineage (a rotation)
ALIAS = "hermes-alias"
ADOPTED = "hermes-adopted"


def _remember_candidate(rt: _Runtime, cand: _Candidate) -> None:
    """Index a candidate by its answer and lineage, as the newest of its answer (call holding ``rt.lock``)."""
    by = rt.candidates.setdefault(cand.fp, {})
    by.pop(cand.store_session, None)
    by[cand.store_session] = cand


class LineageMixin(RuntimeMixin):
    """The candidate index and the store session (lineage) of each Hermes session."""

    def _load_candidates(self, rt: _Runtime, *, refresh: bool = False) -> None:
        """Read the durable candidate index once per runtime (``refresh``: what was added since)."""
        if rt.loaded and not refresh:
            return
        index = rt.store.open_session(self.scope, INDEX_KEY)
        with rt.lock:
            after = rt.index_seq
        while True:
            page = rt.store.list_entries(self.scope, index.session_id, after_seq=after, limit=1000)
            with rt.lock:
                for e in page:
                    p = e.payload or {}
                    if e.kind == "metadata" and p.get("type") == CANDIDATE:
                        _remember_candidate(rt, _Candidate(
                            p["fp"], p["length"], p["store_session"], p["next_ordinal"],
                            p.get("head"), p.get("last"), int(p.get("last_len") or 0),
                            ctx=p.get("ctx"), ctx_len=int(p.get("ctx_len") or 0),
                        ))
                    elif e.kind == "metadata" and p.get("type") == ALIAS:
                        rt.aliases[p["hermes_session"]] = p["store_session"]
                    after = e.seq
                rt.index_seq = max(rt.index_seq, after)
            if len(page) < 1000:
                break
        rt.loaded = True

    def _store_session(self, rt: _Runtime, hermes_session: str | None) -> str:
        """The store session of a Hermes session (its lineage when a candidate linked it)."""
        key = hermes_session or self.session_id or "default"
        self._load_candidates(rt)  # the durable aliases come with the index (once per process)
        with rt.lock:
            if key in rt.aliases:
                return rt.aliases[key]
        sid = rt.store.open_session(self.scope, key).session_id
        with rt.lock:
            return rt.aliases.setdefault(key, sid)

    def _match(
        self, rt: _Runtime, body: list[dict[str, Any]], hermes_session: str | None = None, *, refresh: bool = False
    ) -> _Candidate | None:
        """The longest candidate the message list starts with; of an answer two lineages got, the one of
        ``hermes_session``'s lineage when it is one of them, else the newest."""
        self._load_candidates(rt, refresh=refresh)
        with rt.lock:
            lengths = sorted(
                {c.length for by in rt.candidates.values() for c in by.values() if c.length <= len(body)},
                reverse=True,
            )
            # the answers ending with a user message Hermes may have merged its next one into, by length
            mergeable: dict[int, list[tuple[str, _Candidate]]] = {}
            for by in rt.candidates.values():
                for k, c in by.items():
                    if c.head is not None and c.length <= len(body):
                        mergeable.setdefault(c.length, []).append((k, c))
        # Fingerprinted without the host's bookkeeping, as the answer was (``_record_candidate``): Hermes
        # marks every message it saved to its session database (``_db_persisted``), so the answer it took
        # comes back marked, and a raw fingerprint never matched: no candidate adopted, no lineage.
        cleaned = [clean(m) for m in body[: lengths[0]]] if lengths else []
        for n in lengths:
            found: dict[str, _Candidate] = {}
            # (The second is how releases before message identities fingerprinted an answer: a candidate
            # they recorded is still recognised after an upgrade.)
            for fp in (fingerprint(cleaned[:n]), digest(canonical(cleaned[:n]))):
                with rt.lock:
                    found.update({k: c for k, c in rt.candidates.get(fp, {}).items() if c.length == n})
            if not found:
                # Hermes merged the user message it appended after the answer into the answer's last one:
                # the answer up to that message, which the list holds edited (stored as an edit of it).
                for k, c in mergeable.get(n, ()):
                    if c.merged_into(cleaned):
                        found[k] = c.before_last()
                        # a /branch forked from it holds that shorter answer as its own candidate
                        with rt.lock:
                            forks = dict(rt.candidates.get(c.head or "", {}))
                        found.update({f: fc for f, fc in forks.items() if fc.length == n - 1})
            if found:
                mine = self._lineage(rt, hermes_session) if len(found) > 1 else None
                return found[mine] if mine in found else list(found.values())[-1]
        # The list holds an answer's context messages and no more of it: an /undo took back the turn its
        # fresh tail held. Matched with nothing, the view was taken for the end of the transcript: the
        # next turn was stored after the undone one, which stayed visible and went to the model again.
        with rt.lock:
            heads = [c for by in rt.candidates.values() for c in by.values() if c.ctx and c.ctx_len <= len(body)]
        found = {c.store_session: c.context_only() for c in heads if fingerprint(
            [clean(m) for m in body[: c.ctx_len]]) == c.ctx}
        if found:
            mine = self._lineage(rt, hermes_session) if len(found) > 1 else None
            return found[mine] if mine in found else list(found.values())[-1]
        return None

    def _lineage(self, rt: _Runtime, hermes_session: str | None) -> str | None:
        """The store session a Hermes session is known to continue, without opening one."""
        key = hermes_session or self.session_id or "default"
        with rt.lock:
            if key in rt.aliases:
                return rt.aliases[key]
        info = rt.store.find_session(self.scope, key)
        return info.session_id if info is not None else None

    def _adopt(self, rt: _Runtime, cand: _Candidate) -> None:
        """The host took a compress answer: record it (idempotently) and make the compacted view visible."""
        rt.store.append(
            self.scope, cand.store_session, kind="metadata",
            payload={"type": ADOPTED, "fp": cand.fp}, idempotency_key="adopt-" + cand.fp,
        )
        with rt.lock:
            rt.adopted[cand.store_session] = cand.fp
            if rt.pending.get(cand.store_session) in {cand.fp, cand.of} - {None}:
                del rt.pending[cand.store_session]

    def _fork(self, rt: _Runtime, key: str, cand: _Candidate) -> _Candidate:
        """A ``/branch`` of a compacted conversation: a store session of its own for ``key``, holding a
        copy of the parent lineage's transcript up to the answer, and the answer as its own candidate.

        The branch's list starts with the parent's compress answer; matched, it made the branch join the
        parent's store session: its turns went into the parent's, and each switch between the two
        branched that session again (and the recall tools of one found the other's turns).

        One transaction: the session, the copy and the candidate land together or not at all. Made in
        steps, a fork failing after the session was made (the copy or the candidate's record refused)
        left a session for ``key``; the next call took that for the branch's lineage, forked no more,
        and the branch joined the parent's again. A retry (its COMMIT's answer lost, or a fork of the
        same branch by another process) finds its own rows by their keys."""

        def session_of(c: Core, session_key: str) -> str:
            row = c.find_session_by_key(self.scope, session_key)
            if row is None:
                try:
                    return c.create_session(self.scope, new_id(), session_key).session_id
                except SessionKeyConflict:  # made by another writer after the lookup (PostgreSQL waited)
                    row = c.find_session_by_key(self.scope, session_key)
                    if row is None:
                        raise
            return str(row.session_id)

        def run(c: Core) -> _Candidate:
            own = session_of(c, key)
            c.require_session(self.scope, cand.store_session)
            parent = [
                entry_from_row(r, True)
                for r in c.visible_rows(self.scope, cand.store_session, -1, cand.next_ordinal, None)
            ]
            items = rt.store.prepare([
                AppendItem(message=e.message, idempotency_key=message_key(own, k, e.message or {}))
                for k, e in enumerate(parent)
            ])
            for at in range(0, len(items), 500):  # a long transcript in statements of a bounded size
                c.append(self.scope, own, items[at : at + 500])
            forked = replace(cand, store_session=own)
            c.append(self.scope, session_of(c, INDEX_KEY), rt.store.prepare([self._candidate_item(forked)]))
            return forked

        forked = rt.store.write(run)
        self._remember(rt, forked)
        with rt.lock:
            rt.aliases[key] = forked.store_session
        return forked

    def _record_candidate(self, rt: _Runtime, body: list[dict[str, Any]], store_session: str, n: int) -> None:
        """Write a compress answer as an unreferenced candidate (durable, idempotent)."""
        cleaned = [clean(m) for m in body]
        cand = _Candidate(fingerprint(cleaned), len(cleaned), store_session, n)
        k = next((i for i, m in enumerate(body) if not is_context_message(m)), len(body))
        if 0 < k < len(cleaned):
            cand = replace(cand, ctx=fingerprint(cleaned[:k]), ctx_len=k)
        last = cleaned[-1] if cleaned else {}
        if len(cleaned) >= 2 and last.get("role") == "user" and isinstance(last.get("content"), str):
            cand = replace(cand, head=fingerprint(cleaned[:-1]), last=fingerprint([last]),
                           last_len=len(last["content"].strip()))
        self._record(rt, cand)

    @staticmethod
    def _candidate_item(cand: _Candidate) -> AppendItem:
        """The index entry recording a candidate (idempotent by its answer and lineage)."""
        return AppendItem(
            kind="metadata",
            payload={"type": CANDIDATE, "fp": cand.fp, "length": cand.length,
                     "store_session": cand.store_session, "next_ordinal": cand.next_ordinal,
                     **({"head": cand.head, "last": cand.last, "last_len": cand.last_len} if cand.head else {}),
                     **({"ctx": cand.ctx, "ctx_len": cand.ctx_len} if cand.ctx else {})},
            # Keyed by the lineage too: two conversations can get the same answer (a conversation run
            # again, a scripted one), and a key of the answer alone refused the second one's record
            # (IdempotencyConflict: its compress failed, three times, and left it uncompressed).
            idempotency_key="cand-" + digest(cand.fp, cand.store_session),
        )

    def _record(self, rt: _Runtime, cand: _Candidate) -> None:
        """Write a candidate to the index (durable, idempotent) and remember it."""
        index = rt.store.open_session(self.scope, INDEX_KEY)
        rt.store.append_many(self.scope, index.session_id, [self._candidate_item(cand)])
        self._remember(rt, cand)

    @staticmethod
    def _remember(rt: _Runtime, cand: _Candidate) -> None:
        """Know a recorded candidate in this runtime (the newest unadopted one of its lineage)."""
        with rt.lock:
            _remember_candidate(rt, cand)
            if rt.adopted.get(cand.store_session) != cand.fp:
                rt.pending[cand.store_session] = cand.fp
