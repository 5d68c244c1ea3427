"""The lossless engine: every message kept in the engine's tables, older ones summarized into a DAG.

Lifecycle:

- ``commit_turn``: the ledger commit, and in the SAME transaction the turn's messages imported from the
  transcript (through the cursor) into the engine's tables and context list. A duplicate commit runs
  nothing, so a turn is ingested once.
- ``bootstrap`` / ``assemble``: import, page by page up to the fence, the visible messages the engine
  has not ingested (an existing session, or turns another engine committed during a degraded turn).
- ``assemble``: the context list in order (summaries rendered as messages) within the budget; reads
  the context list and the engine's rows for it, never the transcript's history.
- ``maintain`` / ``compact``: compaction above the threshold (see ``compaction``); ``maintain`` is
  deferred by the host after a turn (background mode), and run inline after a turn's bootstrap with the
  turn's fence, which it holds; so does ``compact`` run inside a turn, and ``assemble``'s own compaction;
  ``after_turn`` only remembers the run's budget.
- ``get_tool_schemas`` / ``handle_tool_call``: lcm_grep, lcm_describe, lcm_expand (see ``tools``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import replace
from typing import Any, Literal

from transcript_store.compaction import reset_in
from transcript_store.core import Core, check_anchor, now_us
from transcript_store.engine import (
    AssembleResult,
    BootstrapResult,
    CompactResult,
    ContextProjection,
    EngineContext,
    EngineInfo,
    MaintainResult,
    RuntimeSettings,
    TranscriptSemantics,
    check_call,
    check_flag,
    check_focus,
    check_token_budget,
)
from transcript_store.errors import InvalidInput, TranscriptStoreError, TransientStoreError
from transcript_store.ledger import CommitResult, TurnPayload, commit_turn_in, prepare_turn
from transcript_store.models import Admission, Anchor, DeltaMissing, DeltaPage, out_of_context
from transcript_store.reads import read_visible_delta
from transcript_store.summarize import PAUSED, ExtractiveSummarizer, SummaryBackoff
from transcript_store.tokens import RoughEstimator, count_from_parts

from . import ingest, tools
from .compaction import Plan, Planner, incarnation_of, plan_landed, shown_count, write_plan
from .config import Budget, LosslessConfig, budget
from .context import ContextCache, Item, SummaryInfo, after_reset, compacted_at_ms, epoch, fit, load_items, render
from .ingest import ImportResult, import_landed, import_pages
from .tables import ENGINE_ID, View

log = logging.getLogger("engines.lossless")

#: An import of this many messages (a bootstrap of a long host transcript) refreshes the statistics of the
#: engine's tables once, part way. On PostgreSQL tables never analyzed (a new deployment; autovacuum off
#: or behind) the check of each context item's foreign key, PostgreSQL's own query by the messages' whole
#: primary key, took the entry-id index of the session's key and filtered the session's rows: an import's
#: cost grew with the square of its length (10,000 messages through the service's bootstrap on a new
#: database: 30 s, 3.8 ms an item by the end; 2.9 s with the ANALYZE, 0.006 ms an item). The import at
#: a commit (a turn's few messages) does not refresh them.
ANALYZE_AFTER_IMPORT = 1_000
#: The commit whose import stores a session's message of this ordinal (its 1,000th) analyzes the engine's
#: tables if PostgreSQL has no statistics for them yet: the same foreign-key check of each context item
#: a commit writes read the session's messages until an ANALYZE (8 ms a turn at 10,000 messages; 0.05 ms
#: with statistics, by the messages' primary key). Once per session, a catalog read when they exist.
ANALYZE_AT = 1_000

MAX_REMEMBERED = 1024
#: summaries whose count of summarized messages a process keeps (``_shown_of``)
MAX_SHOWN = 65_536
#: the reason bootstrap, maintain and compact answer for a session the store does not hold (or another scope's)
UNKNOWN_SESSION = "unknown session"
Probe = Literal["missing", "current", "behind"]
#: compaction passes (each at most ``max_rounds`` steps) assemble may run when the context is over its budget
ASSEMBLE_PASSES = 8
#: times assemble shrinks the stored counts' budget when the context counted now is over the budget
ESTIMATE_PASSES = 4
#: the system-prompt addition when the context had to leave earlier messages out and shows no summary
CUT_HINT = (
    "Earlier parts of this conversation are not shown here for room. Nothing is lost: lcm_grep searches "
    "every original message and summary, lcm_describe tells what an id covers, and lcm_expand opens it. "
    "Use them before guessing."
)
RECALL_HINT = (
    "Earlier parts of this conversation are condensed into [Summary sum_N ...] messages. Nothing is lost: "
    "lcm_grep searches every original message and summary, lcm_describe tells what an id covers, and "
    "lcm_expand opens a summary into its children or original messages. Use them before guessing."
)


class LosslessEngine:
    """Lossless context management on the transcript store (see module doc)."""

    info = EngineInfo(
        id=ENGINE_ID,
        name="Lossless",
        version="1.0.0",
        owns_compaction=True,
        accepted_host_params=["session_key", "runtime_settings"],
        transcript_semantics=TranscriptSemantics(
            current_turn_fence="before-current-turn-entry-v1",
            turn_advancement_idempotency="atomic-idempotent-v1",
        ),
        turn_maintenance_mode="background",
    )

    def __init__(self, ctx: EngineContext) -> None:
        """Bind to the store; ``ctx.config`` is a LosslessConfig mapping (unknown keys are refused)."""
        self.store = ctx.store
        self.config = LosslessConfig.parse(ctx.config)
        self.summarizer = ctx.summarizer or ExtractiveSummarizer()
        self.estimator = ctx.estimator or RoughEstimator()
        #: automatic compactions of a session pause after its summarizer failed (``SummaryBackoff``)
        self.backoff = SummaryBackoff()
        self.stats = {"context_rows_read": 0, "imported": 0, "compactions": 0}
        estimator = self.estimator
        additive = count_from_parts(estimator, []) is not None
        self._lists = ContextCache((lambda m: int(estimator.count_messages([m]))) if additive else None)
        self._runs: OrderedDict[tuple[str, str], tuple[int | None, RuntimeSettings | None]] = OrderedDict()
        #: (scope, session, summary seq, its created_us) -> the messages it summarized (``_shown_of``)
        self._shown: OrderedDict[tuple[str, str, int, int], int] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ budgets

    def _count(self, name: str, n: int) -> None:
        """Add to a counter of ``stats`` (the host's maintenance thread counts too)."""
        with self._lock:
            self.stats[name] += int(n)

    def _remember(self, scope: str, session_id: str, window: int | None, settings: RuntimeSettings | None) -> None:
        with self._lock:
            old = self._runs.pop((scope, session_id), (None, None))
            self._runs[(scope, session_id)] = (window or old[0], settings or old[1])
            while len(self._runs) > MAX_REMEMBERED:
                self._runs.popitem(last=False)

    def budget(self, scope: str, session_id: str, window: int | None = None) -> Budget:
        """The session's token marks: the caller's window, else the last assemble budget seen, else the
        run's prompt token budget; capped by ``context_window`` (``config.budget``)."""
        check_call(scope, session_id)
        check_token_budget(window, optional=True, what="window")
        with self._lock:
            seen, settings = self._runs.get((scope, session_id), (None, None))
        return budget(self.config, window or seen, settings)

    # ------------------------------------------------------------------------------------ importing

    def _import(self, scope: str, session_id: str, fence: Anchor | None) -> ImportResult:
        """Import up to the fence, one page per transaction."""
        total = ImportResult()
        landed: list[ImportResult] = []  # what the last attempt of a page's import did

        def page(c: Core) -> ImportResult:
            if landed and import_landed(c, scope, session_id, landed[0]):
                # An earlier attempt's import, whose COMMIT was uncertain, landed (``import_landed``).
                # Imported again, the page would count nothing (or the next page's messages), and an
                # import another engine made since would be counted as this one's.
                return landed[0]
            landed[:] = [import_pages(
                c, scope, session_id, config=self.config, estimator=self.estimator, fence=fence, max_pages=1
            )]
            return landed[0]

        analyzed = False
        while True:
            landed.clear()
            step: ImportResult = self.store.write(page)
            total.imported += step.imported
            total.rebuilt = total.rebuilt or step.rebuilt
            total.missing = step.missing
            if not analyzed and total.imported >= ANALYZE_AFTER_IMPORT:
                analyzed = True
                self._analyze(total.imported)
            if step.missing or not step.more:
                self._count("imported", total.imported)
                return total

    def _analyze(self, imported: int) -> None:
        """Refresh the planner statistics of the tables an import fills (PostgreSQL; nothing on SQLite)."""
        try:
            self.store.db.analyze(("ts_lcm_messages", "ts_lcm_context_items"))
        except TranscriptStoreError as e:  # the pages landed; fresher statistics are a bonus
            log.warning("ANALYZE after importing %d messages failed: %s", imported, e)

    def _probe(self, c: Core, scope: str, session_id: str, fence: Anchor | None, view: View | None = None) -> Probe:
        """Whether the transcript holds visible messages before the fence that the engine has not ingested."""
        view = View.load(c, scope, session_id) if view is None else view
        page = read_visible_delta(c, scope, session_id, view.cursor, 1, self.config.page_bytes, fence)
        if isinstance(page, DeltaMissing):
            return "missing"
        if isinstance(page, DeltaPage) and not page.entries and page.required_bytes is None:
            return "current"
        return "behind"

    def _current(self, scope: str, session_id: str, fence: Anchor | None) -> list[Item]:
        """The context list, after importing what other engines committed (one read when nothing did)."""

        def probe_and_load(c: Core) -> list[Item] | None:
            view = View.load(c, scope, session_id)
            if self._probe(c, scope, session_id, fence, view) == "behind":
                return None
            # Only the items added since this process last loaded the list (``ContextCache``).
            items, read = self._lists.items(
                c, scope, session_id, incarnation=incarnation_of(view), epoch=view.epoch, next_item=view.next_item
            )
            self._count("context_rows_read", read)
            # A host's reset (``Service.host_compaction``): the host's context starts again at its first
            # kept message; what came before stays stored (and searchable), out of the context.
            return after_reset(items, reset_in(c, scope, session_id))

        # The list is loaded in the same snapshot as the probe that checked the fence: a turn another
        # process commits meanwhile can never slip messages after the fence into this assembly.
        for _ in range(8):
            items: list[Item] | None = self.store.read(probe_and_load)
            if items is not None:
                return items
            self._import(scope, session_id, fence)
        # Typed, and safe to retry: the host takes it as the database's failure, not the engine's.
        raise TransientStoreError("the transcript kept moving under the import (8 reads); retry")

    # ------------------------------------------------------------------------------------ lifecycle

    def bootstrap(
        self,
        *,
        scope: str,
        session_id: str,
        fence: Anchor | None,
        session_key: str | None = None,
        runtime_settings: RuntimeSettings | None = None,
    ) -> BootstrapResult:
        """Import the visible transcript before the fence that the engine has not ingested yet."""
        check_call(scope, session_id, fence=fence, session_key=session_key, runtime_settings=runtime_settings)
        self._remember(scope, session_id, None, runtime_settings)
        state = self.store.read(lambda c: self._probe(c, scope, session_id, fence))
        if state != "behind":  # nothing to import: no write transaction at all
            missing = state == "missing"
            return BootstrapResult(bootstrapped=not missing, reason=UNKNOWN_SESSION if missing else None)
        result = self._import(scope, session_id, fence)
        if result.missing:
            return BootstrapResult(bootstrapped=False, reason=UNKNOWN_SESSION)
        reason = "rebuilt after a transcript reset" if result.rebuilt else None
        return BootstrapResult(bootstrapped=True, imported_messages=result.imported, reason=reason)

    def assemble(
        self,
        *,
        scope: str,
        session_id: str,
        fence: Anchor | None,
        token_budget: int,
        available_tools: list[str] | None = None,
        session_key: str | None = None,
        runtime_settings: RuntimeSettings | None = None,
    ) -> AssembleResult:
        """Summaries + fresh tail in context order, within ``token_budget``; stable while nothing changes."""
        check_call(scope, session_id, fence=fence, session_key=session_key, runtime_settings=runtime_settings)
        check_token_budget(token_budget)
        _check_tools(available_tools)
        self._remember(scope, session_id, token_budget, runtime_settings)
        items = self._current(scope, session_id, fence)
        # The budget the stored counts are held to. Each message and summary is counted once, when it is
        # stored, by the estimator of that process: counted since by another one (another tokenizer
        # setting, another host on the same store), they may say far less than the context now costs
        # (a review saw 7,603 tokens assembled for a budget of 3,000, nothing compacted). The context
        # is counted again as it goes out; over the budget, the stored counts' budget shrinks by the
        # ratio seen, and compaction and ``fit`` run again.
        budget = token_budget
        passes = 0  # compaction passes in all: ASSEMBLE_PASSES however often the budget shrinks
        best: tuple[list[Item], list[dict[str, Any]], int] | None = None
        for _ in range(ESTIMATE_PASSES):
            while sum(i.tokens for i in items) > budget and passes < ASSEMBLE_PASSES:
                # Over the hard budget (a large import, or a failed earlier compaction): compact now, pass
                # after pass while a pass makes progress. One pass (``max_rounds`` steps) summarised a few
                # hundred of an imported session's 2,000 messages, and ``fit`` then cut the rest of the raw
                # history and the new summaries with it, for as many turns as maintenance took to catch up.
                passes += 1
                marks = self.budget(scope, session_id, budget)
                # Fenced as the turn's reads are: the planning read and the write each check that the fence
                # holds and the engine's copy ends before the admitted entry, else ReadFenceError with
                # nothing written (unfenced, a copy crossed meanwhile was compacted, the admitted entry
                # with it, before the next ``_current`` raised).
                result = self._compact(scope, session_id, marks, force=False, focus=None, fence=fence)
                items = self._current(scope, session_id, fence)
                if not result.compacted:
                    break
            shown = fit(items, budget)
            if not shown and best is not None:
                # Shrunk until nothing fit (one message over the budget by today's count): the last
                # answer that showed something stands, said to be over (below), not an empty context.
                shown, messages, estimated = best
                break
            # A message the host keeps out of the model's context is listed (it costs 0), never shown.
            kept = [i for i in shown if not out_of_context(i.message)]
            messages = render(kept)
            # From each item's own count where the estimator allows (the list is not walked again).
            parts = [i.counted for i in kept if i.counted is not None]
            known = count_from_parts(self.estimator, parts) if len(parts) == len(kept) else None
            estimated = int(self.estimator.count_messages(messages)) if known is None else known
            stored = sum(i.tokens for i in shown)
            if estimated <= token_budget or stored <= 1:
                break
            best = (shown, messages, estimated)
            if budget <= 1:
                break
            # At least 1: today's count over the budget by more than the budget itself (stored counts of
            # 2, counted 157 now, a budget of 5) made it 0, and the marks of a window of 0 raised.
            budget = max(1, min(budget - 1, stored * token_budget // estimated))
        has_summaries = any(i.summary is not None for i in shown)
        # What fit left out is stored all the same: the recall tools reach it, and the model is told so.
        hint = RECALL_HINT if has_summaries else (CUT_HINT if len(shown) < len(items) else None)
        return AssembleResult(
            messages=messages,
            estimated_tokens=estimated,
            system_prompt_addition=hint,
            # Still over after the passes (a single message larger than the budget by today's count):
            # the host, not this answer, has the last word on what fits.
            prompt_authority="assembled" if estimated <= token_budget else "preassembly_may_overflow",
            context_projection=ContextProjection(mode="per_turn", epoch=epoch(shown)),
            # The replies kept after a summary were generated after the messages it replaced: a host
            # that replays provider-signed reasoning needs to know (integrations/openclaw).
            compacted_at_ms=compacted_at_ms(shown),
        )

    def commit_turn(
        self,
        *,
        tx: Core,
        advancement_key: str,
        admission: Anchor,
        terminal: Anchor,
        messages: list[dict[str, Any]],
        is_heartbeat: bool = False,
    ) -> CommitResult:
        """The ledger commit with the turn's ingestion in the same transaction (a duplicate ingests nothing)."""
        turn = prepare_turn(ENGINE_ID, advancement_key, admission, terminal, messages, is_heartbeat=is_heartbeat)
        return commit_turn_in(tx, turn, self._apply)

    def commit_prepared(self, tx: Core, turn: TurnPayload) -> CommitResult:
        """``commit_turn`` of a payload the host made from the transcript's closed range (same transaction).

        Its messages are the stored entries, validated when they were appended, by the rules of the
        release that appended them: validated again by this release's stricter rules (an empty
        ``tool_calls`` list, refused since), a turn accepted before an upgrade was never delivered, and
        every drain that tried quarantined the engine."""
        if not isinstance(turn, TurnPayload):
            raise InvalidInput(f"commit_prepared takes a TurnPayload (prepare_turn's), not {type(turn).__name__}")
        # The receipt under this engine's id, as commit_turn writes it (the hash does not cover the id).
        return commit_turn_in(tx, replace(turn, engine_id=ENGINE_ID), self._apply)

    def _apply(self, core: Core, turn: TurnPayload) -> None:
        """Import the transcript through the turn's terminal entry (any gap first, then the turn)."""
        assert turn.terminal.position is not None
        result = import_pages(
            core, turn.scope, turn.session_id, config=self.config, estimator=self.estimator, fence=None,
            until=turn.terminal.position,
        )
        # Counted once the transaction that imported them commits: it is the host's (retried whole on a
        # transient error, rolled back on any other), and a count made here counted a retried import twice.
        core.after_commit(lambda: self._count("imported", result.imported))
        stored = (result.saved or {}).get("next_ordinal")
        if result.inserted is not None and isinstance(stored, int) and result.inserted[0] < ANALYZE_AT <= stored:
            core.after_commit(self._analyze_if_never)

    def _analyze_if_never(self) -> None:
        """ANALYZE the tables a commit's import fills if they never were (PostgreSQL; see ``ANALYZE_AT``)."""
        try:
            self.store.db.analyze_unanalyzed(("ts_lcm_messages", "ts_lcm_context_items"))
        except TranscriptStoreError as e:  # the turn committed; fresher statistics are a bonus
            log.warning("ANALYZE of the engine's tables never analyzed failed: %s", e)

    def after_turn(
        self,
        *,
        scope: str,
        session_id: str,
        admission: Admission | None = None,
        terminal: Anchor | None = None,
        session_key: str | None = None,
        runtime_settings: RuntimeSettings | None = None,
    ) -> None:
        """Remember the run's budget; the proactive compaction is ``maintain``'s, which the host runs
        after the reply (background mode), so a summarizer's time is not the reply's."""
        check_call(scope, session_id, session_key=session_key, runtime_settings=runtime_settings)
        if admission is not None and not isinstance(admission, Admission):
            raise InvalidInput(f"admission must be an Admission or None, not {type(admission).__name__}")
        if terminal is not None:
            check_anchor("terminal", terminal)
        self._remember(scope, session_id, None, runtime_settings)

    def maintain(
        self,
        *,
        scope: str,
        session_id: str,
        session_key: str | None = None,
        runtime_settings: RuntimeSettings | None = None,
        fence: Anchor | None = None,
        token_budget: int | None = None,
    ) -> MaintainResult:
        """Upkeep: compaction when over the threshold (a failing summarizer is logged and answered, never
        raised). Deferred after a turn (background mode); inline after a turn's bootstrap, with the turn's
        ``fence``: then every read and the compaction's write check, in their own transaction, that the
        engine's copy ends before the admitted entry (else ``ReadFenceError``), so no summary covers it.
        ``token_budget``: the host's budget, used as ``compact``'s is (else ``budget``'s choice)."""
        check_call(scope, session_id, fence=fence, session_key=session_key, runtime_settings=runtime_settings)
        check_token_budget(token_budget, optional=True)
        self._remember(scope, session_id, None, runtime_settings)
        result = self._compact_if_needed(scope, session_id, fence, token_budget)
        if result is None:
            return MaintainResult(changed=False, reason="under the threshold")
        if result.reason == UNKNOWN_SESSION:
            return MaintainResult(changed=False, reason=UNKNOWN_SESSION)
        if not result.ok and not (result.reason or "").startswith(PAUSED):  # paused: its failure was logged
            log.warning("lossless compaction of %s/%s in maintenance: %s", scope, session_id, result.reason)
        return MaintainResult(changed=result.compacted, reason=result.reason)

    def compact(
        self,
        *,
        scope: str,
        session_id: str,
        force: bool = False,
        focus: str | None = None,
        token_budget: int | None = None,
        session_key: str | None = None,
        runtime_settings: RuntimeSettings | None = None,
        fence: Anchor | None = None,
    ) -> CompactResult:
        """Compact until under the target (``force``: at least one step even when under the threshold).
        Inside a turn (the host's compaction before the prompt, its overflow recovery) with the turn's
        ``fence``, held as ``maintain`` holds it: ReadFenceError, nothing written, when it does not hold."""
        check_call(scope, session_id, fence=fence, session_key=session_key, runtime_settings=runtime_settings)
        check_flag("force", force)
        check_token_budget(token_budget, optional=True)
        check_focus(focus)
        self._remember(scope, session_id, None, runtime_settings)
        marks = self.budget(scope, session_id, token_budget)
        return self._compact(scope, session_id, marks, force=force, focus=focus, fence=fence)

    def _compact_if_needed(
        self, scope: str, session_id: str, fence: Anchor | None = None, token_budget: int | None = None
    ) -> CompactResult | None:
        marks = self.budget(scope, session_id, token_budget)

        def tokens(c: Core) -> int | None:
            self._hold_fence(c, scope, session_id, fence)
            held = self._context_tokens(c, scope, session_id, marks.trigger)
            # An empty context: an empty session, or none (one read more, on that path only).
            return None if held == 0 and c.session_row(scope, session_id) is None else held

        held = self.store.read(tokens)
        if held is None:
            return CompactResult(ok=False, compacted=False, reason=UNKNOWN_SESSION)
        if held <= marks.trigger:
            return None
        return self._compact(scope, session_id, marks, force=False, focus=None, fence=fence)

    def _hold_fence(self, c: Core, scope: str, session_id: str, fence: Anchor | None) -> None:
        """With a fence: ReadFenceError unless it holds and the engine's copy ends before it (a copy that
        imported the admitted entry, unfenced, is "crossed"); a compaction checked by it in its own
        transaction never covers the entry. Without one: nothing (a one-message read otherwise)."""
        if fence is not None:
            self._probe(c, scope, session_id, fence)

    def _context_tokens(self, c: Core, scope: str, session_id: str, trigger: int) -> int:
        """The tokens of what an assembly can hold, as far as ``trigger`` needs to know.

        The view's total counts the whole context list, what precedes a host's reset included, which no
        assembly returns (every maintenance pass after a /new in a long session planned a compaction for
        nothing). At most the trigger it is nothing more to tell: no reset read. Over it, the reset and
        the list (``ContextCache``: the items added since this process last loaded it) say what follows."""
        view = View.load(c, scope, session_id)
        if view.tokens <= trigger:
            return view.tokens
        start = reset_in(c, scope, session_id)
        if not start:
            return view.tokens
        items, read = self._lists.items(
            c, scope, session_id, incarnation=incarnation_of(view), epoch=view.epoch, next_item=view.next_item
        )
        self._count("context_rows_read", read)
        return sum(i.tokens for i in after_reset(items, start))

    def _compact(
        self, scope: str, session_id: str, marks: Budget, *, force: bool, focus: str | None, fence: Anchor | None = None
    ) -> CompactResult:
        """Plan outside any transaction, write in one; a plan raced by another writer is re-planned once.
        With a fence, the planning read and the write each hold it (``_hold_fence``)."""
        for _attempt in range(2):
            view, items = self._planning_state(scope, session_id, fence)
            if not items and self.store.read(lambda c: c.session_row(scope, session_id)) is None:
                # As bootstrap answers it: "nothing outside the fresh tail" told a caller with a wrong id
                # that its session was fine.
                return CompactResult(ok=False, compacted=False, reason=UNKNOWN_SESSION)
            before = sum(i.tokens for i in items)
            if not force and before <= marks.trigger:
                return CompactResult(
                    ok=True, compacted=False, reason=f"under the threshold ({before} <= {marks.trigger} tokens)",
                    tokens_before=before, tokens_after=before,
                )
            # After a summarizer failure, automatic compactions wait (``SummaryBackoff``): each one over the
            # threshold otherwise waited out a down summary model's timeout again, at every turn.
            paused = None if force else self.backoff.paused((scope, session_id))
            if paused is not None:
                return CompactResult(
                    ok=False, compacted=False, reason=paused, tokens_before=before, tokens_after=before
                )
            def shown(info: SummaryInfo) -> int:
                return self._shown_of(scope, session_id, info)

            planner = Planner(self.config, marks, self.summarizer, self.estimator, focus, shown)
            plan = planner.plan(items, view, force=force)
            if plan.error is not None:
                self.backoff.failed((scope, session_id), plan.error)
            elif plan.summaries:
                self.backoff.succeeded((scope, session_id))
            if plan.summaries and not self._write(scope, session_id, plan, fence):
                continue
            self._count("compactions", bool(plan.summaries))
            return CompactResult(
                ok=plan.error is None,
                compacted=bool(plan.summaries),
                reason=plan.error or _progress_reason(plan.summaries != [], plan.tokens_after, marks),
                tokens_before=plan.tokens_before,
                tokens_after=plan.tokens_after,
            )
        return CompactResult(ok=False, compacted=False, reason="the context changed during compaction; try again")

    def _write(self, scope: str, session_id: str, plan: Plan, fence: Anchor | None = None) -> bool:
        """Write a plan in one transaction; False when the context changed since it was planned."""
        ts = now_us()  # drawn once: a retry after an uncertain COMMIT tells its own write by it
        landed: list[bool] = []

        def run(c: Core) -> bool:
            if landed and landed[0] and plan_landed(c, scope, session_id, plan, ts):
                return True  # the earlier attempt's write, not another writer's: never planned again
            self._hold_fence(c, scope, session_id, fence)
            landed[:] = [write_plan(c, scope, session_id, plan, ts)]
            return landed[0]

        written: bool = self.store.write(run)
        if written:
            for s in plan.summaries:
                if s.info.shown is not None:
                    self._keep_shown((scope, session_id, s.info.seq, ts), s.info.shown)
        return written

    def _shown_of(self, scope: str, session_id: str, info: SummaryInfo) -> int:
        """The messages a stored summary summarized (its hidden sources left out): known when this process
        wrote it, else read (``shown_count``: O(messages it covers), once a summary). Its seq and its write
        time name it: a session deleted and created again under its id numbers its summaries afresh."""
        key = (scope, session_id, info.seq, info.created_us)
        with self._lock:
            known = self._shown.get(key)
        if known is None:
            known = int(self.store.read(lambda c: shown_count(c, scope, session_id, info.seq)))
            self._keep_shown(key, known)
        return known

    def _keep_shown(self, key: tuple[str, str, int, int], shown: int) -> None:
        with self._lock:
            self._shown.pop(key, None)
            self._shown[key] = shown
            while len(self._shown) > MAX_SHOWN:
                self._shown.popitem(last=False)

    def _planning_state(self, scope: str, session_id: str, fence: Anchor | None = None) -> tuple[View, list[Item]]:
        """The view and the context list a compaction plans on, a pending reset applied first.

        A branch or a rewrite since the last import (``maintain`` runs in the background, and in a process
        that may never import): planned on the old list, the summarizer was sent the messages that left the
        active path (a redacted secret, to a model) and the next import threw its summaries away with them.
        As the recall tools do, the reset is applied without importing (an import could cross a running
        turn's fence); the check is a one-message read, on the compaction's path only.
        """

        def state(c: Core) -> tuple[View, list[Item]] | None:
            self._hold_fence(c, scope, session_id, fence)  # before the reset's write below, too
            if ingest.reset_pending(c, scope, session_id):
                return None
            # Only what follows a host's reset is compacted (a summary never spans it).
            items = after_reset(load_items(c, scope, session_id), reset_in(c, scope, session_id))
            return View.load(c, scope, session_id), items

        for _ in range(8):
            got: tuple[View, list[Item]] | None = self.store.read(state)
            if got is not None:
                return got
            self.store.write(lambda c: self._apply_reset(c, scope, session_id, fence))
        raise TransientStoreError("the transcript kept moving under the compaction (8 reads); retry")

    def _apply_reset(self, c: Core, scope: str, session_id: str, fence: Anchor | None) -> None:
        """``ingest.apply_reset`` in a transaction that holds the fence first (a turn's write checks it)."""
        self._hold_fence(c, scope, session_id, fence)
        ingest.apply_reset(c, scope, session_id)

    # ------------------------------------------------------------------------------------ tools

    def get_tool_schemas(self) -> list[dict[str, Any]]:
        """lcm_grep, lcm_describe, lcm_expand as OpenAI function schemas."""
        return tools.schemas()

    def handle_tool_call(self, name: str, args: dict[str, Any], *, scope: str, session_id: str) -> str:
        """Run one recall tool; the answer (or ``{"error": ...}``) as a JSON string.

        The tool's name and arguments are the model's: a bad one is an error answer. The scope and
        session are the caller's: a bad one is InvalidInput, as for every engine method."""
        check_call(scope, session_id)
        compiled: list[Any] = [None]  # the regex tools.check compiles, for the grep of this call
        handlers = {
            "lcm_grep": lambda c: tools.run_grep(c, scope, session_id, args, compiled[0]),
            "lcm_describe": lambda c: tools.run_describe(c, scope, session_id, args),
            "lcm_expand": lambda c: tools.run_expand(c, scope, session_id, args, self.config.expand_max_chars),
        }
        if not isinstance(name, str) or name not in handlers:  # a list or an object is unhashable
            return json.dumps({"error": f"unknown tool {name!r}"})
        if not isinstance(args, dict):
            return json.dumps({"error": "arguments must be a JSON object"})
        try:
            # Before any read: a refused call writes nothing (no pending reset either).
            compiled[0] = tools.check(name, args)
        except tools.ToolError as e:
            return json.dumps({"error": str(e)}, ensure_ascii=False)

        def answer(c: Core) -> Any:
            # A branch or rewrite since the last import: forget what left the active path first.
            return _RESET_FIRST if ingest.reset_pending(c, scope, session_id) else handlers[name](c)

        try:
            out = self.store.read(answer)
            if out is _RESET_FIRST:
                self.store.write(lambda c: ingest.apply_reset(c, scope, session_id))
                out = self.store.read(handlers[name])
        except tools.ToolError as e:
            out = {"error": str(e)}
        except Exception as e:
            # The last line of defence: a value the checks in ``tools`` let through must not quarantine
            # the engine for the process. A database outage is not the arguments' and propagates.
            if not tools.caused_by_arguments(e):
                raise
            log.warning("lossless %s: arguments failed past the checks: %r", name, e, exc_info=True)
            out = {"error": f"the arguments could not be used: {type(e).__name__}"}
        return json.dumps(out, ensure_ascii=False)

    def dispose(self) -> None:
        """Forget the remembered budgets and the context lists held (up to 64 Mi characters)."""
        with self._lock:
            self._runs.clear()
            self._shown.clear()
        self._lists.clear()


#: what a recall tool's read returns instead of its answer when a reset must be applied first
_RESET_FIRST = object()


def _progress_reason(progressed: bool, after: int, marks: Budget) -> str | None:
    if not progressed:
        return "no progress: nothing outside the fresh tail can be summarized smaller"
    if after > marks.target:
        return f"still over the target ({after} > {marks.target} tokens) at the round limit or fresh tail"
    return None


def _check_tools(available_tools: object) -> None:
    """``available_tools``: None or a collection of tool names (a list, tuple, set: strings), else
    InvalidInput. (The engine offers its recall tools whatever the host lists: the names are not read.)"""
    if available_tools is None:
        return
    if isinstance(available_tools, str | bytes) or not isinstance(available_tools, Collection) or not all(
        isinstance(t, str) for t in available_tools
    ):
        raise InvalidInput("available_tools must be a collection of tool names (strings) or None")
