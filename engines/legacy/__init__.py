"""The legacy engine (the default): the visible transcript from cursor deltas, fitted to the budget.

ingest does nothing (the store is the transcript); assemble keeps a per-session projection and a
cursor, reads only the visible messages it has not seen (rebuilding on reset), and returns the
latest compaction summary plus the messages after it; compact is the built-in summarising compaction;
commit_turn records the turn in the ledger. A turn costs O(new messages) rows, whatever the history.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from transcript_store import compaction, reads
from transcript_store.core import Core
from transcript_store.engine import (
    AssembleResult,
    CompactResult,
    EngineContext,
    EngineInfo,
    TranscriptSemantics,
    check_call,
    check_flag,
    check_focus,
    check_token_budget,
)
from transcript_store.errors import InvalidInput
from transcript_store.ledger import CommitResult, TurnPayload, commit_turn_in, prepare_turn
from transcript_store.models import RESULT_ROLES, Anchor, DeltaMissing, DeltaPage, DeltaReset, out_of_context
from transcript_store.summarize import ExtractiveSummarizer, SummaryBackoff, hold
from transcript_store.tokens import RoughEstimator, count_from_parts

ENGINE_ID = "legacy"
PAGE_MESSAGES = 500
PAGE_BYTES = 4 * 1024 * 1024
#: the most ``prefetch_in`` reads inside an admission (on SQLite that transaction holds the database's
#: write lock): a turn's delta is a few messages; a rebuild goes on in ``assemble``'s own snapshot
PREFETCH_MESSAGES = 64
PREFETCH_BYTES = 256 * 1024


@dataclass(frozen=True)
class Prefetched:
    """What ``prefetch_in`` read in an admission transaction: the projection is complete up to
    ``fence``, and ``pointer`` is the session's compaction pointer as of that transaction."""

    fence: Anchor
    pointer: dict[str, Any] | None


@dataclass
class _Projection:
    """What the engine has seen of one session: visible messages 0..n-1 and the cursor after them."""

    cursor: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)
    #: each message's own token estimate, counted once when it is read (not on every turn)
    tokens: list[int] = field(default_factory=list)
    #: held while the projection is read and advanced: two threads assembling one session at once took
    #: the same page from the same cursor, each appending it (every message of it twice, for good)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


class LegacyEngine:
    """Pass-through assembly from cursor deltas; built-in compaction; ledger commits."""

    info = EngineInfo(
        id=ENGINE_ID,
        name="Legacy",
        version="1.0.0",
        owns_compaction=False,
        accepted_host_params=None,
        transcript_semantics=TranscriptSemantics(
            current_turn_fence="before-current-turn-entry-v1",
            turn_advancement_idempotency="atomic-idempotent-v1",
        ),
    )

    def __init__(self, ctx: EngineContext) -> None:
        """Bind to the store; config keys: keep_last (6), max_sessions (256)."""
        self.store = ctx.store
        self.summarizer = ctx.summarizer or ExtractiveSummarizer()
        self.estimator = ctx.estimator or RoughEstimator()
        # Compaction keeps at least the last message. The host checks the same config with the same
        # function when it is built, so a mistake stops it before any turn.
        self.keep_last, self.max_sessions = compaction.check_legacy_config(ctx.config)
        #: automatic compactions of a session pause after its summarizer failed (``SummaryBackoff``)
        self.backoff = SummaryBackoff()
        self._projections: OrderedDict[tuple[str, str], _Projection] = OrderedDict()
        self._lock = threading.Lock()
        self.rows_read = 0  # visible rows fetched by assembly (tests assert it does not grow with history)

    # ------------------------------------------------------------------------------------ reading

    def _projection(self, scope: str, session_id: str) -> _Projection:
        with self._lock:
            key = (scope, session_id)
            proj = self._projections.pop(key, None) or _Projection()
            self._projections[key] = proj
            while len(self._projections) > self.max_sessions:
                self._projections.popitem(last=False)
            return proj

    def _advance(self, c: Core, proj: _Projection, scope: str, session_id: str, fence: Anchor | None) -> None:
        """Read the visible messages not seen yet (up to the fence) into ``proj`` (its lock held),
        rebuilding on reset.

        Runs inside the one read transaction of ``assemble`` (pages, resets and the compaction
        pointer from one snapshot: one transaction per assembly instead of one per read).
        """
        if fence is not None and fence.position is not None and len(proj.messages) >= fence.position:
            # Already past the fence (an unfenced read earlier): validate the fence, then only check
            # the cursor's ground with an unfenced read; the slice below keeps the prefix exact.
            reads.read_visible_delta(c, scope, session_id, None, 1, PAGE_BYTES, fence)
            fence_for_read = None
        else:
            fence_for_read = fence
        max_bytes = PAGE_BYTES
        while True:
            result = reads.read_visible_delta(
                c, scope, session_id, proj.cursor, PAGE_MESSAGES, max_bytes, fence_for_read
            )
            if isinstance(result, DeltaMissing):
                proj.cursor, proj.messages, proj.entry_ids, proj.tokens = None, [], [], []
                return
            if isinstance(result, DeltaReset):
                proj.cursor, proj.messages, proj.entry_ids, proj.tokens = result.cursor, [], [], []
                continue
            if result.required_bytes is not None:
                max_bytes = result.required_bytes  # one message is larger than a page: enlarge the page
                continue
            max_bytes = PAGE_BYTES
            self._take(proj, result)
            if not result.has_more:
                return

    def _take(self, proj: _Projection, page: DeltaPage) -> None:
        """Add a page's messages (each counted once, here) to the projection and move its cursor."""
        self.rows_read += len(page.entries)
        for e in page.entries:
            message = e.message or {}
            proj.messages.append(message)
            proj.entry_ids.append(e.entry_id)
            # A message the host keeps out of the model's context (out_of_context) costs nothing: it took the
            # budget of messages the model then did not get.
            proj.tokens.append(0 if out_of_context(message) else int(self.estimator.count_messages([message])))
        proj.cursor = page.cursor

    def prefetch_in(self, c: Core, *, scope: str, session_id: str, fence: Anchor) -> Prefetched | None:
        """Do the next ``assemble``'s reads inside the admission transaction that wrote ``fence``.

        The host calls this last in ``Turns.admit_if_clear(within=...)`` and hands what it returns to
        ``assemble`` (``prefetched=``) only if that transaction committed: the session is locked, so
        the page after the cursor and the compaction pointer are exactly the pre-turn transcript, and
        ``assemble`` needs no read transaction of its own (a turn is two transactions, not three). A
        fence this transaction did not append (a retried turn id whose entry was already stored) is
        checked like any other. At most PREFETCH_MESSAGES / PREFETCH_BYTES are read here: when the
        delta is longer (a rebuild, many messages from elsewhere), what was read is kept and
        ``assemble`` reads the rest in its own snapshot (None), as it does after a reset. The
        messages taken here are all before the fence: they stay valid if the admission rolls back.
        """
        if fence is None:
            raise InvalidInput("prefetch_in needs the fence its admission wrote")
        check_call(scope, session_id, fence=fence)
        proj = self._projection(scope, session_id)
        if not proj.lock.acquire(blocking=False):
            return None  # another thread is advancing it: assemble reads in its own snapshot
        try:
            if fence.position is None or len(proj.messages) > fence.position:
                return None  # past the fence already (an unfenced read earlier): assemble's own path
            result = reads.read_visible_delta(
                c, scope, session_id, proj.cursor, PREFETCH_MESSAGES, PREFETCH_BYTES, fence
            )
            if not isinstance(result, DeltaPage) or result.required_bytes is not None:
                return None
            self._take(proj, result)
            if result.has_more:
                return None
            return Prefetched(fence, compaction.pointer_in(c, scope, session_id))
        finally:
            proj.lock.release()

    # ------------------------------------------------------------------------------------ lifecycle

    def assemble(
        self,
        *,
        scope: str,
        session_id: str,
        fence: Anchor | None,
        token_budget: int,
        prefetched: Prefetched | None = None,
        **_host: Any,
    ) -> AssembleResult:
        """The latest summary + the visible messages after it, before the fence, within the budget.

        ``prefetched``: what ``prefetch_in`` read for this fence in its committed admission.
        """
        check_call(scope, session_id, fence=fence)
        check_token_budget(token_budget)

        proj = self._projection(scope, session_id)

        def read(c: Core) -> dict[str, Any] | None:
            self._advance(c, proj, scope, session_id, fence)
            return compaction.pointer_in(c, scope, session_id)

        with proj.lock:
            if (
                isinstance(prefetched, Prefetched)
                and fence is not None
                and prefetched.fence == fence
                and len(proj.messages) == fence.position
            ):
                pointer = prefetched.pointer  # read by prefetch_in in this fence's admission transaction
            else:
                pointer = self.store.read(read)
            end = fence.position if fence is not None and fence.position is not None else len(proj.messages)
            # At ``end`` only for a host's compaction that kept nothing before the turn it ran in; at 0 for
            # one of the host's that kept its first message (its summary still stands in front of it, as
            # OpenClaw's own context shows it: hidden there, the built-in compaction counted it all the same).
            in_force = pointer is not None and pointer["first_kept_position"] <= end
            start = pointer["first_kept_position"] if pointer is not None and in_force else 0
            # (A host's reset has no summary: its context starts again at its first kept message.)
            summary = (pointer["summary"] or None) if pointer is not None and in_force else None
            prefix = [compaction.summary_message(summary)] if summary is not None else []
            prefix_tokens = int(self.estimator.count_messages(prefix))
            if summary is not None and prefix_tokens > token_budget:
                # A summary larger than the whole budget (it shrank the transcript, not below this budget)
                # was shown whole, over the budget: it is cut to half the budget, the newest messages get
                # the rest.
                prefix, prefix_tokens = self._cut_summary(summary, token_budget // 2)
            # Under the lock: another thread's advance must not move the lists while they are sliced
            # (the slices are what fits, never the whole history).
            first = self._fit(proj.messages, proj.tokens, start, end, token_budget - prefix_tokens)
            if summary is not None and prefix_tokens > token_budget // 2 and first > start:
                turn = self._newest_turn(proj.messages, start, end)
            else:
                turn = None
            if summary is not None and turn is not None and first > turn:
                # A summary a little smaller than the budget left the newest turn no room: the model got it
                # alone (or an answer without its question), where a smaller budget (the summary over it,
                # cut to half) showed the turn. One that crowds out the newest turn is cut as one over the
                # budget is, and the newest messages get the rest (kept whole when that shows no more).
                cut, cut_tokens = self._cut_summary(summary, token_budget // 2)
                fits = self._fit(proj.messages, proj.tokens, start, end, token_budget - cut_tokens)
                if fits < first:
                    prefix, prefix_tokens, first = cut, cut_tokens, fits
            shown = [i for i in range(first, end) if not out_of_context(proj.messages[i])]
            messages = prefix + [proj.messages[i] for i in shown]
            # The estimate from the counts the projection keeps (each message was counted once, when
            # read): counting the whole context again was ~10% of a host turn's CPU, and grows with what
            # fits.
            parts = ([prefix_tokens] if prefix else []) + [proj.tokens[i] for i in shown]
        estimated = count_from_parts(self.estimator, parts)
        if estimated is None:
            estimated = int(self.estimator.count_messages(messages))
        # When the messages shown lost what preceded them: a summary in its place, or a host's reset that
        # kept a tail before it (its replies were signed after the messages the reset dropped).
        tail = pointer is not None and start > 0 and pointer["first_kept_entry_id"] is not None
        made = pointer.get("created_ms") if pointer is not None and (summary is not None or tail) else None
        return AssembleResult(
            messages=messages, estimated_tokens=estimated, compacted_at_ms=made if isinstance(made, int) else None
        )

    @staticmethod
    def _newest_turn(visible: list[dict[str, Any]], start: int, end: int) -> int | None:
        """Where the newest turn of visible[start:end] begins: its last user message the model is shown, else
        its newest such message of any role; None when it shows none (walked back from the newest)."""
        newest = None
        for i in range(end - 1, start - 1, -1):
            if out_of_context(visible[i]):
                continue
            if visible[i].get("role") == "user":
                return i
            if newest is None:
                newest = i
        return newest

    def _cut_summary(self, summary: str, budget: int) -> tuple[list[dict[str, Any]], int]:
        """The summary message held to at most ``budget`` tokens (``summarize.hold`` of its text, in the room
        the message's header leaves), with its count; none (and 0) when not even the header fits."""
        room = budget - int(self.estimator.count_messages([compaction.summary_message("")]))
        while room > 0:
            text = hold(summary, room, self.estimator)
            if not text:
                break
            message = compaction.summary_message(text)
            tokens = int(self.estimator.count_messages([message]))
            if tokens <= budget:
                return [message], tokens
            room -= max(1, tokens - budget)  # the message counts its text differently from the text alone
        return [], 0

    def _fit(self, visible: list[dict[str, Any]], tokens: list[int], start: int, end: int, budget: int) -> int:
        """Where the newest messages of visible[start:end] that fit the budget begin (never on a tool or
        function result, nor on a hidden message before one).

        Walks back from the newest message over the counts kept in the projection, so a turn costs
        O(what fits), not O(history), and no message is counted twice.
        """
        first, total = end, 0
        while first > start:
            cost = tokens[first - 1]
            if total + cost > budget:
                break
            total += cost
            first -= 1
        # A hidden message costs nothing, so the walk takes it for free: one between a call and its result
        # was where the context began, and the result was shown without its call.
        while first < end and (visible[first].get("role") in RESULT_ROLES or out_of_context(visible[first])):
            first += 1
        return first

    def compact(
        self,
        *,
        scope: str,
        session_id: str,
        force: bool = False,
        focus: str | None = None,
        token_budget: int | None = None,
        fence: Anchor | None = None,
        **_host: Any,
    ) -> CompactResult:
        """The built-in summarising compaction: one summary of the older messages (before ``fence``, the
        running turn's admitted message, when the host compacts inside a turn: its overflow recovery)."""
        # Declared so that the host hands a compaction inside a turn its fence (``host._fenced``): unfenced,
        # it read the turn's own admitted message, counted it among the ``keep_last`` kept verbatim (one
        # fewer of the conversation's was kept) and named it in the pointer, a read past the fence.
        check_call(scope, session_id, fence=fence)
        check_flag("force", force)
        check_token_budget(token_budget, optional=True)
        check_focus(focus)
        return compaction.compact_session(
            self.store,
            scope,
            session_id,
            summarizer=self.summarizer,
            estimator=self.estimator,
            fence=fence,
            keep_last=self.keep_last,
            focus=focus,
            force=force,
            token_budget=token_budget,
            backoff=self.backoff,
        )

    def commit_turn(
        self,
        *,
        tx: Any,
        advancement_key: str,
        admission: Anchor,
        terminal: Anchor,
        messages: list[dict[str, Any]],
        is_heartbeat: bool = False,
        **_host: Any,
    ) -> CommitResult:
        """Record the accepted turn in the ledger (the transcript already holds it)."""
        turn = prepare_turn(ENGINE_ID, advancement_key, admission, terminal, messages, is_heartbeat=is_heartbeat)
        return commit_turn_in(tx, turn)

    def commit_prepared(self, tx: Any, turn: TurnPayload) -> CommitResult:
        """``commit_turn`` of a payload the host already validated and hashed (same transaction)."""
        if not isinstance(turn, TurnPayload):
            raise InvalidInput(f"commit_prepared takes a TurnPayload (prepare_turn's), not {type(turn).__name__}")
        return commit_turn_in(tx, turn)

    def dispose(self) -> None:
        """Forget every projection."""
        with self._lock:
            self._projections.clear()


def create_engine(ctx: EngineContext) -> LegacyEngine:
    """The plugin factory."""
    return LegacyEngine(ctx)
