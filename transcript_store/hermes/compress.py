"""``compress``: the engine's context, aimed below Hermes' trigger, with the fresh tail kept."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..tokens import RoughEstimator
from .config import as_int
from .context import (
    addition_of,
    checked_assembly,
    fresh_tail,
    memory_block,
    place_addition,
    split_system,
    with_fresh_tail,
)
from .ingest import IngestMixin
from .messages import canonical, clean, detached, digest
from .request import settled
from .runtime import _Runtime

log = logging.getLogger("transcript_store.hermes")


#: the share of Hermes' trigger a compress answer aims at (with the system prompt and tools): the next
#: turns grow it back to the trigger, and Hermes' estimate, ours and the provider's count differ
COMPRESS_TARGET = 0.75
#: the least room a compress answer leaves the engine's context (its summaries) beside the fresh tail
MIN_CONTEXT = 1000
#: the measures of what Hermes' requests carry besides their messages that ``request_overhead`` is the
#: median of (system prompt, tool schemas: ``compress_target``)
OVERHEAD_SAMPLES = 9
#: assemblies asked for to make room for an engine's system-prompt addition (compress)
FIT_ATTEMPTS = 3


class CompressMixin(IngestMixin):
    """Hermes' ``compress``: store, compact in the engine, answer below the trigger."""

    #: Hermes reads these two of its compressor after ``compress`` (``getattr``: any engine may lack them) to
    #: tell the user, in the chat, that the summary failed: "aborted" when the conversation came back
    #: unchanged, the error alone when the answer is shorter without the summary. Without them a broken
    #: summarizer was only in our log, where a gateway's user never looks.
    _last_compress_aborted: bool = False
    _last_summary_error: str | None = None

    def compress(
        self,
        messages: list[dict[str, Any]],
        current_tokens: int | None = None,
        focus_topic: str | None = None,
        force: bool = False,
        session_id: str | None = None,
        memory_context: str = "",
        **_kwargs: Any,
    ) -> list[dict[str, Any]]:
        """Store the conversation, compact in the engine, answer below the trigger with the fresh tail kept.

        The answer is the system prompt, the engine's context and the fresh tail (``fresh_tail``),
        aimed at ``compress_target`` tokens. The input list itself comes back (no progress, not counted)
        when nothing changes: our last answer sent back with nothing new, or an engine that cannot
        make it shorter.
        """
        self._last_compress_aborted, self._last_summary_error = False, None
        try:
            snapshot = detached(list(messages))
        except Exception:  # not a list of messages: nothing to store or compact
            log.exception("transcript-store: compress got no message list; leaving it unchanged")
            return messages
        try:
            memory = memory_block(memory_context)
            answer = self._compress(snapshot, current_tokens, focus_topic, force, session_id, memory)
        except Exception:  # never an untyped error into Hermes: the originals are stored or still the host's
            log.exception("transcript-store: compress failed; leaving the conversation uncompressed")
            return snapshot
        # A compaction that failed and left the conversation as it was: Hermes says so in the chat.
        self._last_compress_aborted = self._last_summary_error is not None and answer is snapshot
        return answer

    def _compress(
        self, snapshot: list[Any], current_tokens: int | None, focus_topic: str | None, force: bool,
        session_id: str | None, memory: str | None = None,
    ) -> list[dict[str, Any]]:
        """``compress`` on the host's copied list (which it returns when nothing changes)."""
        messages = [m for m in snapshot if isinstance(m, dict)]  # anything else is no message of ours
        try:
            rt = self.runtime()
            store_session, n = self.ingest(messages, session_id, follow=True)
        except Exception:
            log.exception("transcript-store: storing the conversation failed; leaving it uncompressed")
            return snapshot
        system, body = split_system(messages)
        current, pending = fresh_tail(body)
        if current is None and not pending:
            return snapshot  # nothing but our own context messages
        if not force and self._is_our_answer(rt, body, session_id):
            # Hermes asks again with our last answer and nothing new (it retries up to three times a
            # request): compacting again could only squeeze the summaries, a summarizer call each time.
            return snapshot
        estimator = RoughEstimator()
        room = self.compress_target(messages, current_tokens) - estimator.count_messages(system)
        tail = estimator.count_messages(([current] if current else []) + pending)
        if tail + MIN_CONTEXT > room:
            self._warn_tail_over(rt, store_session, current or pending[0], tail, room)
        # The engine compacts and assembles to what the answer may take: its copies of the fresh tail
        # are in it, and its summaries get MIN_CONTEXT at least, however large the tail.
        budget = max(room, tail + MIN_CONTEXT)
        assembled = self._compact_and_assemble(rt, store_session, budget, focus_topic, force)
        if assembled is None or not assembled.messages:
            return snapshot
        fit = self._fit_addition(
            rt, store_session, system, budget, tail + MIN_CONTEXT, current, pending, assembled, memory
        )
        if fit is None:
            answer = with_fresh_tail(assembled.messages, current, pending, rt.store.config.max_payload_bytes)
        else:
            assembled, answer = fit
        head, answer = place_addition(system, answer, addition_of(assembled, memory))
        if canonical([clean(m) for m in answer]) == canonical([clean(m) for m in body]):
            return snapshot  # the engine could not make it shorter: Hermes sees no progress and stops
        if estimator.count_messages(head + answer) >= estimator.count_messages(messages):
            # The fresh tail is kept verbatim beside the engine's context, and the engine may have
            # summarized its own copy of it (the current user message, raw in its last compaction as its
            # newest message, is an older one now): the summary came in addition to the message, and a
            # compress inside a turn over the trigger answered "done" with the request grown (~9,070 to
            # ~10,730 tokens), a compaction counted, for nothing. Not smaller is no progress.
            return snapshot
        self._record_candidate(rt, answer, store_session, n)
        self.compression_count += 1
        return head + answer

    def _fit_addition(
        self, rt: _Runtime, store_session: str, system: list[dict[str, Any]], budget: int, floor: int,
        current: dict[str, Any] | None, pending: list[dict[str, Any]], assembled: Any, memory: str | None = None,
    ) -> tuple[Any, list[dict[str, Any]]] | None:
        """The assembly again, and its answer, with the engine's system-prompt addition reserved when the
        answer and the addition are over ``budget`` (None: the first assembly stands).

        The addition joins the system prompt or our context block (``place_addition``), which ``budget``
        did not leave room for, and is known only once the engine has assembled: an engine that fills its
        budget put the answer over the aim by its addition. It is asked again for its budget less what the
        answer is over by (not below ``floor``: the fresh tail and the least context), at most
        ``FIT_ATTEMPTS`` times (a smaller assembly can leave out a fresh-tail message the answer then adds
        back); no compaction again.
        """
        est = RoughEstimator()
        fit: tuple[Any, list[dict[str, Any]]] | None = None
        answer = with_fresh_tail(assembled.messages, current, pending, rt.store.config.max_payload_bytes)
        asked = budget
        for _ in range(FIT_ATTEMPTS):
            head, placed = place_addition(system, answer, addition_of(assembled, memory))
            extra = est.count_messages(head + placed) - est.count_messages(system + answer)
            over = est.count_messages(answer) + extra - budget
            smaller = max(asked - over, floor)
            if extra <= 0 or over <= 0 or smaller >= asked:
                break  # the common case: no addition, or room for it; or nothing smaller to ask for
            try:
                again = checked_assembly(rt.engine.assemble(scope=self.scope, session_id=store_session,
                                                             fence=None, token_budget=smaller))
            except Exception:
                log.exception("transcript-store: assembling with the system-prompt addition reserved failed")
                break
            if again is None or not getattr(again, "messages", None):
                break
            cap = rt.store.config.max_payload_bytes
            assembled, answer, asked = again, with_fresh_tail(again.messages, current, pending, cap), smaller
            fit = (assembled, answer)
        return fit

    def _trigger(self) -> int:
        """Hermes' compression trigger in tokens (the window when no threshold is set)."""
        return self.threshold_tokens if self.threshold_tokens > 0 else self.context_length

    def compress_target(self, messages: Sequence[dict[str, Any]], current_tokens: int | None = None) -> int:
        """The tokens a compress answer aims at: COMPRESS_TARGET of the trigger, less what Hermes' request
        carries besides the messages (system prompt, tool schemas).

        That part is what ``current_tokens`` (Hermes' count of the whole request) exceeds the messages by.
        ``request_overhead`` is the lower median of the last ``OVERHEAD_SAMPLES`` such measures, for the
        calls that pass no count (``/compress``): one measure is off either way now and then, and kept
        as the largest ever seen, one was enough for the agent's life. A count of the previous request
        (Hermes' check after a tool round passes ``last_prompt_tokens``) is set against the messages that
        request held: the list before its pending tool round. ``/compress here N`` passes the whole history's count with
        its head only, the held-back tail taken for overhead (a review saw the target fall from ~21,500
        to 411 tokens, every later answer squeezed to the minimum).
        """
        # Read as should_compress reads a count (a numeric text, an infinity, an object): raised here, it
        # left the list uncompressed where should_compress had just said to compress it.
        tokens = as_int(current_tokens)
        if tokens > 0:
            counted = list(messages)
            if tokens == as_int(self.last_prompt_tokens):
                # Hermes' check after a tool round passes the provider's count of the request that asked
                # for the tools: the round (the call and its results) was not in it. Measured against the
                # whole list, a large result cancelled the system prompt and tools out (0 where they were
                # ~4,000 tokens), and where that check is the one that fires (the provider counts more
                # than Hermes' rough estimate, as for CJK text) every measure was such a one.
                counted = settled(counted)
            measured = tokens - RoughEstimator().count_messages(counted)
            seen = [*getattr(self, "_overheads", []), max(0, measured)][-OVERHEAD_SAMPLES:]
            self._overheads = seen
            self.request_overhead = sorted(seen)[(len(seen) - 1) // 2]
        return int(self._trigger() * COMPRESS_TARGET) - self.request_overhead

    def _is_our_answer(self, rt: _Runtime, body: list[dict[str, Any]], hermes_session: str | None = None) -> bool:
        """Whether the host's list is exactly a compress answer (a candidate), with nothing after it."""
        cand = self._match(rt, body, hermes_session)
        return cand is not None and cand.length == len(body)

    def _warn_tail_over(
        self, rt: _Runtime, store_session: str, first: dict[str, Any], tokens: int, room: int
    ) -> None:
        """Say once per user turn that its fresh tail leaves the engine's context too little room."""
        key = digest(store_session, canonical(first))
        with rt.lock:
            if key in rt.warned:
                return
            if len(rt.warned) >= 4096:  # a long-lived gateway: forget old turns rather than grow for ever
                rt.warned.clear()
            rt.warned.add(key)
        log.warning(
            "transcript-store: the current turn's fresh tail (%d tokens) leaves the summaries less than %d "
            "of the %d tokens compress aims at (%d%% of the %d-token trigger, less ~%d for the system "
            "prompt and tools); it is kept whole, so the answer may stay over the trigger until the next "
            "user message (Hermes then compresses once a request and gets its answer back unchanged)",
            tokens, MIN_CONTEXT, room, int(COMPRESS_TARGET * 100), self._trigger(), self.request_overhead,
        )

    def _compact_and_assemble(
        self, rt: _Runtime, store_session: str, budget: int, focus: str | None, force: bool
    ) -> Any:
        """The engine's context after its compaction to ``budget`` tokens (None: assembling failed)."""
        try:
            boot = getattr(rt.engine, "bootstrap", None)
            if callable(boot):  # import what was just stored, so the compaction sees all of it
                boot(scope=self.scope, session_id=store_session, fence=None)
            result = rt.engine.compact(
                scope=self.scope, session_id=store_session, force=force, focus=focus, token_budget=budget
            )
            if not getattr(result, "ok", True):
                self._last_summary_error = str(getattr(result, "reason", "") or "the compaction failed")
                log.warning("transcript-store compaction: %s (nothing lost)", self._last_summary_error)
        except Exception as e:  # a failing summarizer loses nothing: the originals are stored
            self._last_summary_error = f"the compaction failed: {type(e).__name__}: {e}"
            log.warning("transcript-store compaction failed: %s (nothing lost)", e)
        try:
            return checked_assembly(
                rt.engine.assemble(scope=self.scope, session_id=store_session, fence=None, token_budget=budget)
            )
        except Exception:
            log.exception("transcript-store: assembling failed; leaving the conversation uncompressed")
            return None
