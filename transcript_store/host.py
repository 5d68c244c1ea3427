"""The host runtime: one logical turn from admission to commit, with degradation and quarantine.

A turn: recover and drain the session's outbox, admit the user message, open a fenced read context,
let the engine bootstrap (then ``maintain`` under the same fence, when its ``maintain`` takes one) and
assemble from cursor deltas, call the model (engine tools dispatched to the
engine), append the replies, accept, and commit through the engine's ``commit_turn`` (in the same
transaction when possible). The engine for a turn is decided before the turn starts and kept for the
whole logical turn, retries included; the configured engine is tried again on the next turn. After
the commit: ``after_turn``, then ``maintain`` (inline, or on the maintenance thread for an engine in
background mode: maintenance.py).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, get_args

from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from . import compaction, outbox, quarantine
from .core import Core, check_id, new_id
from .engine import (
    MAX_TOKENS,
    AssembleResult,
    CompactResult,
    Diagnostics,
    EngineContext,
    EngineInfo,
    EngineSelection,
    Limits,
    ModelSettings,
    RuntimeInfo,
    RuntimeSettings,
    SessionTarget,
    SubagentSpawnPreparation,
    check_focus,
    durable_declaration,
    missing_capabilities,
    project_params,
    takes_keyword,
)
from .errors import (
    AdvancementKeyCollision,
    EngineContractError,
    EngineError,
    EngineSwitchError,
    HostRequirementError,
    InvalidInput,
    ModelError,
    ModelTimeout,
    OutboxCollision,
    PromptTooLarge,
    ReadFenceError,
    SchemaNotCurrent,
    SessionBusy,
    StoreUnavailable,
    TranscriptStoreError,
    TurnBranchedAway,
    TurnOvertaken,
    UnknownEngine,
    UnknownSession,
    UnknownTurn,
    describe,
)
from .errors import TurnFailed as TurnFailed  # raised by run_turn; importable from here as before
from .host_context import MAX_RUNTIME_CONTEXT_BYTES as MAX_RUNTIME_CONTEXT_BYTES
from .host_context import RuntimeContext as RuntimeContext
from .host_context import delegate_compaction_to_runtime as delegate_compaction_to_runtime
from .host_context import host_values as host_values
from .host_messages import CUT_TOOL_RESULT as CUT_TOOL_RESULT
from .host_messages import STOPPED_OVER_BUDGET as STOPPED_OVER_BUDGET
from .host_messages import UNANSWERED_TOOL_CALL as UNANSWERED_TOOL_CALL
from .host_messages import HostTool as HostTool
from .host_messages import default_host_tools as default_host_tools
from .host_messages import fit_tool_round as fit_tool_round
from .host_messages import pair_tool_calls as pair_tool_calls
from .host_messages import prune_tool_results as prune_tool_results
from .host_messages import with_addition as with_addition
from .host_tokens import TokenCounts
from .leases import LeaseKeeper
from .ledger import CommitResult, Receipt, TurnPayload, committed_messages, get_receipt, receipts_for_key
from .maintenance import BackgroundMaintenance
from .model import is_context_overflow
from .models import (
    Admission,
    Anchor,
    Role,
    validate_message,
)
from .outbox import TurnIntent
from .registry import EngineRegistry, EngineStatus, dispose_engine
from .settings import HostSettings
from .store import AppendItem, TranscriptStore
from .summarize import SummaryBackoff
from .terminal import quoted
from .turns import CommitIn, Turns, new_owner

log = logging.getLogger("transcript_store.host")
#: the attribute of the log record of a quarantine that holds (engine id, operation)
QUARANTINE_RECORD = "ts_quarantine"
#: failed writes of one quarantine record before it is given up (logged): the database refusing it for good
QUARANTINE_RECORD_TRIES = 5

LEGACY = "legacy"
#: engine decisions kept for turns not (yet) finished: a retry of a failed turn reuses its decision
_MAX_DECISIONS = 10_000
T = TypeVar("T")


class _Degrade(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Refused(Exception):
    """The turn is refused (the admission's ``SessionBusy``, ``TurnOvertaken``; ``PromptTooLarge`` before
    it): raised to the caller as is."""

    def __init__(self, error: SessionBusy | TurnOvertaken | PromptTooLarge) -> None:
        super().__init__(str(error))
        self.error = error


class _PrefetchFailed(Exception):
    """An engine's ``prefetch_in`` raised inside the admission (which rolled back because of it)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class TurnOutcome:
    """What one logical turn did."""

    turn_id: str
    scope: str
    session_id: str
    engine_id: str
    configured_engine: str
    degraded_reason: str | None
    reply: dict[str, Any]
    messages: list[dict[str, Any]]
    commit_status: str  # committed | duplicate | queued | blocked
    attempts: int
    assembled_tokens: int
    admission: Admission | None
    terminal: Anchor | None


_ROLES = frozenset(get_args(Role))


def _assembled(info: EngineInfo, answer: object) -> AssembleResult:
    """An engine's answer to ``assemble`` as an AssembleResult whose every message has a chat role; else the
    engine's failure (ValidationError, EngineContractError: quarantined, the turn on legacy). A message
    without one (``{"foo": 1}``, a role of "wizard") was sent on to the model, whose provider refused
    the request: every turn failed, and the engine was never isolated. Only the role is looked at here:
    validating every message of every context is a host turn's CPU over again."""
    result = AssembleResult.model_validate(answer)
    for message in result.messages:
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise EngineContractError(f"engine {info.id!r} assembled a message without a chat role: {quoted(role)}")
    return result


def _fenced(method: object, base: dict[str, Any], fence: Anchor | None) -> dict[str, Any]:
    """``base`` with the running turn's ``fence`` for a ``compact`` inside a turn (before the prompt, an
    overflow's recovery) that declares a ``fence`` keyword (``takes_keyword``), as the maintain after a
    bootstrap is given it: the engine holds it in each read and write (the lossless engine raises
    ReadFenceError, nothing written, when its copy holds the admitted entry), so no compaction of the turn
    covers the turn's own message. A ``compact`` without it is called as before."""
    if fence is None or method is None or not takes_keyword(method, "fence"):
        return base
    return {**base, "fence": fence}


def _driver_error(error: BaseException) -> DBAPIError | None:
    """The driver error a store error was translated from (its cause, or the cause's), else None."""
    seen: BaseException | None = error.__cause__ or error.__context__
    for _ in range(8):
        if seen is None or isinstance(seen, DBAPIError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _check_engine_id(engine_id: object) -> None:
    """UnknownEngine for a value that is no engine id: nothing to load, nor to quarantine and record."""
    try:
        check_id("engine", engine_id)
    except InvalidInput as e:
        raise UnknownEngine(str(e)) from None


def _same_owner(obj: object, *names: str) -> bool:
    """Whether one class of ``obj``'s MRO defines every one of ``names`` (none inherited past another)."""
    owners = set()
    for name in names:
        owner = next((k for k in type(obj).__mro__ if name in vars(k)), None)
        if owner is None:
            return False
        owners.add(owner)
    return len(owners) == 1


@dataclass
class _Decision:
    engine_id: str
    reason: str | None


@dataclass
class HostRuntime(TokenCounts):
    """Runs logical turns for one host slot over a store, a model and the discovered engines."""

    store: TranscriptStore
    settings: HostSettings
    model: Any
    registry: EngineRegistry | None = None
    summarizer: Any = None
    estimator: Any = None
    host_tools: dict[str, HostTool] = field(default_factory=default_host_tools)
    #: Test and fault-injection seam: runs after the admission, before the engine reads anything.
    before_assemble: Callable[[str, str, Admission], None] | None = None
    turns: Turns = field(init=False)
    quarantined: dict[str, tuple[str, str]] = field(init=False, default_factory=dict)
    _engines: dict[str, tuple[Any, EngineInfo]] = field(init=False, default_factory=dict)
    #: engines quarantined since they were made: out of use, disposed of with the runtime (not at once: a
    #: turn or maintenance pass on another thread may still be inside one)
    _retired: list[tuple[str, Any]] = field(init=False, default_factory=list)
    #: tokens of a system prompt and tool list, by their texts (``_reserved_tokens``)
    _fixed_tokens: dict[tuple[str, str], int] = field(init=False, default_factory=dict)
    #: tokens an engine's system-prompt addition adds to a system prompt, by their texts (``_addition_tokens``)
    _addition_counts: dict[tuple[str, str], int] = field(init=False, default_factory=dict)
    # Per (scope, session, turn id): turn ids are the caller's, and the same id in another session is
    # another turn. Kept after a failed turn (its retry runs on the same engine), so bounded.
    _decisions: OrderedDict[tuple[str, str, str], _Decision] = field(init=False, default_factory=OrderedDict)
    _bootstrapped: set[tuple[str, str, str]] = field(init=False, default_factory=set)
    _successors: dict[tuple[str, str], str] = field(init=False, default_factory=dict)
    #: quarantine records not written yet (engine id, operation, reason), with the failed tries of each
    _unrecorded: list[tuple[str, str, str]] = field(init=False, default_factory=list)
    _record_tries: dict[str, int] = field(init=False, default_factory=dict)
    #: when each quarantine's record was last written (monotonic): written again once half of
    #: ``quarantine_record_seconds`` has passed, so other hosts never prune a live process's record
    _recorded_at: dict[str, float] = field(init=False, default_factory=dict)
    _unrecorded_lock: threading.Lock = field(init=False, default_factory=threading.Lock)  # the list's, held briefly
    _flush_lock: threading.Lock = field(init=False, default_factory=threading.Lock)  # one flush at a time
    _leases: LeaseKeeper = field(init=False)
    #: maintain() of background-mode engines, off the reply path (maintenance.py)
    maintenance: BackgroundMaintenance = field(init=False)
    #: (engine id, error) of deferred passes that failed: the caller's thread quarantines them before its
    #: next turn or compaction (a deque: appended by the maintenance thread, taken by the caller's)
    _failed_in_background: deque[tuple[str, BaseException]] = field(init=False, default_factory=deque)
    #: the built-in compaction's ``keep_last`` (``delegate_compaction_to_runtime``)
    keep_last: int = field(init=False)
    #: ``dispose`` ran: no engine is made any more (a request outliving a service's close would make
    #: one nobody disposes of). Set, and the engine table changed, under ``_engines_lock``.
    _disposed: bool = field(init=False, default=False)
    _engines_lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    #: the engine instance a background ``maintain`` pass runs on now, and the one ``dispose`` left to be
    #: disposed of when that pass ends (not under it); both under ``_engines_lock``
    _passing: Any = field(init=False, default=None)
    _dispose_after_pass: tuple[str, Any] | None = field(init=False, default=None)
    #: the built-in compaction's pause after a summarizer failure, per (scope, session)
    #: (``delegate_compaction_to_runtime``; an engine owning compaction keeps its own)
    summary_backoff: SummaryBackoff = field(init=False, default_factory=SummaryBackoff)

    def __post_init__(self) -> None:
        # The built-in compaction is the legacy engine's: its ``keep_last`` protects the same recent
        # messages whether a compaction is asked for or fires before the prompt, for every engine that
        # delegates to it. The whole legacy config is checked here, when the host is built, by the check
        # the legacy engine makes: at the first compaction a bad keep_last failed inside an engine's
        # compact (isolating that engine for a mistake of the settings), and an unknown key or a bad
        # max_sessions failed the legacy factory, the fallback never quarantined, at every turn.
        legacy = self.settings.engine_config.get(LEGACY, {})
        self.keep_last, _ = compaction.check_legacy_config(legacy)
        if self.registry is None:
            self.registry = EngineRegistry(self.settings.plugin_dirs)
        if self.summarizer is None:
            from .summarize import summarizer_from_env

            self.summarizer = summarizer_from_env()
        if self.estimator is None:
            from .tokens import default_estimator

            self.estimator = default_estimator()
        self.turns = Turns(self.store)
        self._leases = LeaseKeeper(self.store)
        self.maintenance = BackgroundMaintenance(self._maintain_in_background)

    # ------------------------------------------------------------------------------------ engines

    def engine(self, engine_id: str) -> tuple[Any, EngineInfo]:
        """The live instance of an engine (created on first use); EngineError if it cannot be."""
        _check_engine_id(engine_id)
        if engine_id in self.quarantined:
            op, reason = self.quarantined[engine_id]
            raise EngineError(f"context engine {engine_id!r} is quarantined ({op}: {reason})")
        live = self._engines.get(engine_id)
        if live is not None:
            return live
        self._check_not_disposed(engine_id)
        assert self.registry is not None
        try:
            made = self.registry.create(engine_id, self._context(engine_id))
        except Exception as e:
            if engine_id == LEGACY:
                raise
            # A factory reading the store that failed because the database did is not the engine's
            # failure (as for any of its calls): that turn runs on legacy, the next one makes it again.
            if not self._database_failed(e):
                self.quarantine(engine_id, "factory", e)
            raise EngineError(f"context engine {engine_id!r} failed to load: {e}") from e
        return self._keep(engine_id, made)

    def _check_not_disposed(self, engine_id: str) -> None:
        if self._disposed:
            raise EngineError(f"the host runtime is disposed: context engine {engine_id!r} is not made")

    def _keep(self, engine_id: str, made: tuple[Any, EngineInfo]) -> tuple[Any, EngineInfo]:
        """Keep an engine just made, unless the runtime was disposed of meanwhile (its factory outlived a
        service's close) or another thread made one first: then this one is disposed of at once."""
        with self._engines_lock:
            disposed = self._disposed
            kept = self._engines.get(engine_id)
            if kept is None and not disposed:
                self._engines[engine_id] = kept = made
        if kept is not made:
            _dispose_engine(engine_id, made[0])
        if kept is None:
            raise EngineError(f"the host runtime is disposed: context engine {engine_id!r} is not kept")
        return kept

    def _context(self, engine_id: str) -> EngineContext:
        """What this runtime makes engine ``engine_id`` with: its config table, the store, summarizer, estimator."""
        return EngineContext(
            store=self.store,
            config=self.settings.engine_config.get(engine_id, {}),
            summarizer=self.summarizer,
            estimator=self.estimator,
        )

    def preload(self, engine_id: str) -> EngineStatus:
        """Load and validate an engine ahead of its first use, kept for it (its factory runs once in the
        process, not once for a start-up check and again at the first turn); UnknownEngine for an id not
        registered. One that cannot load is reported invalid, and not quarantined: its first use tries
        again (and quarantines it then), as without this check."""
        assert self.registry is not None
        _check_engine_id(engine_id)  # a list raised a bare TypeError from the config lookup
        # Registered first: ``engine`` quarantines an id no engine has at its first use (its factory
        # "failed"), and the quarantined branch below then raised a bare KeyError from ``specs``.
        spec = self.registry.specs.get(engine_id)
        if spec is not None and engine_id in self.quarantined:
            op, reason = self.quarantined[engine_id]
            return EngineStatus(spec, None, False, f"quarantined ({op}: {reason})")
        if spec is not None and engine_id in self._engines:
            return EngineStatus(spec, self._engines[engine_id][1], True, None)
        self._check_not_disposed(engine_id)
        status, engine = self.registry.load(engine_id, self._context(engine_id))  # UnknownEngine: not registered
        if status.valid and status.info is not None:
            self._keep(engine_id, (engine, status.info))
        return status

    def quarantine(self, engine_id: str, operation: str, error: BaseException, *, in_transaction: bool = False) -> None:
        """Isolate an engine for the rest of this process and record it in the store.

        ``in_transaction``: the failure happened inside an open write transaction (commit_turn); the
        record is written after it ends, since a second writer would wait on SQLite's write lock.
        """
        check_id("engine_id", engine_id)
        check_id("operation", operation)
        if len(operation) > quarantine.MAX_OPERATION_CHARS:
            raise InvalidInput(f"operation must be at most {quarantine.MAX_OPERATION_CHARS} characters")
        if engine_id == LEGACY:
            return  # the fallback itself cannot be isolated: its errors surface to the caller
        reason = describe(error)
        log.error("context engine %r quarantined after %s failed: %s", engine_id, operation, reason,
                  extra={QUARANTINE_RECORD: (engine_id, operation)})  # (for a filter: the gateway's workers)
        self.quarantined[engine_id] = (operation, reason)
        with self._engines_lock:  # out of use, disposed of by ``dispose`` (never lost between the two lists)
            live = self._engines.pop(engine_id, None)
            if live is not None:
                self._retired.append((engine_id, live[0]))
        with self._unrecorded_lock:
            self._unrecorded.append((engine_id, operation, reason))
        if not in_transaction:
            self.flush_quarantines()

    def flush_quarantines(self) -> bool:
        """Write the quarantine records not written yet; whether none is left (isolation already happened).

        A record the database refuses (StoreUnavailable, after the store's own retries of a transient
        error, or SchemaNotCurrent: its table is missing) stays queued for the next flush (after the next
        turn, or at ``dispose``), up to
        ``QUARANTINE_RECORD_TRIES`` failed writes; the records after it are still written. Each engine
        is quarantined once per process, so the queue holds at most one record per engine. One flush
        runs at a time (threads sharing a runtime); the list's own lock is never held across a write,
        so an engine failing inside a transaction can queue its record while a flush waits on that
        transaction's lock.
        """
        with self._flush_lock:
            age = self.settings.quarantine_record_seconds
            with self._unrecorded_lock:
                pending, self._unrecorded = self._unrecorded, []
                # A record of this live process is pruned by another host past the age (it cannot see
                # this process): written again (its "since" then moves) once half of that has passed.
                queued = {item[0] for item in pending}
                stale = time.monotonic() - age / 2
                for engine_id, written in list(self._recorded_at.items()):
                    if written < stale and engine_id not in queued and engine_id in self.quarantined:
                        pending.append((engine_id, *self.quarantined[engine_id]))
            left: list[tuple[str, str, str]] = []
            for item in pending:
                engine_id, operation, reason = item
                try:
                    self.store.write(
                        lambda c: quarantine.record(c, engine_id, operation, reason, max_age_seconds=age)  # noqa: B023
                    )
                except (StoreUnavailable, SchemaNotCurrent) as e:  # its table missing (mid-migration) too
                    tries = self._record_tries[engine_id] = self._record_tries.get(engine_id, 0) + 1
                    if tries < QUARANTINE_RECORD_TRIES:
                        log.warning("could not record quarantine of %s yet (kept for the next try): %s", engine_id, e)
                        left.append(item)
                        continue
                    log.error("could not record quarantine of %s after %d tries: %s", engine_id, tries, e)
                except TranscriptStoreError as e:
                    log.warning("could not record quarantine of %s: %s", engine_id, e)
                # Written, or given up: tried again (as a refresh) once half of the age has passed.
                self._recorded_at[engine_id] = time.monotonic()
                self._record_tries.pop(engine_id, None)
            with self._unrecorded_lock:
                self._unrecorded[:0] = left
                return not self._unrecorded

    def _call(self, engine_id: str, operation: str, fn: Callable[[], T]) -> T:
        """Run a lifecycle call; an exception quarantines the engine (fence errors are not its fault)."""
        try:
            return fn()
        except (ReadFenceError, HostRequirementError):
            raise
        except SystemExit as e:
            # A plugin's sys.exit() is its failure (as the registry takes it from a factory), not the
            # host's exit: it ended a chat or a gateway worker mid-turn instead of the turn going to legacy.
            error = _exited(engine_id, operation, e)
            self.quarantine(engine_id, operation, error)
            raise error from e
        except Exception as e:
            if not self._database_failed(e):
                self.quarantine(engine_id, operation, e)
            raise

    def _database_failed(self, error: BaseException) -> bool:
        """Whether an engine's call failed because the store's database did: the transaction is retried
        whole or the turn fails (or runs on legacy), but it is not the engine's fault, and isolating the
        engine for the process would outlive the cause.

        Every error the database answers, as the store translates it (``StoreUnavailable`` and its kinds, a
        missing table's ``SchemaNotCurrent``): a lost connection or a deadlock, a full disk, a missing grant
        or a read-only file, a closed store, and as much a misconfigured pooler ("prepared statement ...
        does not exist") or a table dropped or renamed by hand, which the legacy engine's reads meet too
        and an operator mends while the process runs. Quarantined, the engine stayed out of use for the
        life of the process after the cause was gone.

        Not a statement the engine got wrong: a constraint it broke, SQL the database cannot parse, a
        column or value it named wrong fail the same way every turn, and are the engine's (quarantined)."""
        driver = error if isinstance(error, DBAPIError) else _driver_error(error)
        if isinstance(error, DBAPIError):
            error = self.store.db.translate(error)  # raised inside a transaction, not translated yet
        if not isinstance(error, (StoreUnavailable, SchemaNotCurrent)):
            return False
        if type(error) is not StoreUnavailable:  # its kinds (transient, full, denied, closed), a missing table
            return True
        return driver is None or not self.store.db.dialect.is_statement_fault(driver)

    def commit_in(self, engine_id: str) -> CommitIn | None:
        """The engine's commit_turn as an in-transaction callable, or None when it is unavailable."""
        try:
            engine, _info = self.engine(engine_id)
        except EngineError:
            return None
        method = getattr(engine, "commit_turn", None)
        if method is None:
            return None
        # An engine whose ledger is this store's may take the payload the host already validated and
        # hashed (``commit_prepared(tx, turn)``), instead of validating and hashing it a second time.
        # Only when the class that defines commit_prepared also defines commit_turn: a subclass that
        # overrides commit_turn (to add its own state, say) must keep getting commit_turn.
        prepared = None
        if _same_owner(engine, "commit_turn", "commit_prepared"):
            prepared = getattr(engine, "commit_prepared", None)

        def run(c: Core, p: TurnPayload) -> CommitResult:
            try:
                if prepared is not None and p.engine_id == engine_id:
                    done: CommitResult = prepared(c, p)
                    return done
                result: CommitResult = method(
                    tx=c,
                    advancement_key=p.advancement_key,
                    admission=p.admission,
                    terminal=p.terminal,
                    messages=list(p.messages),
                    is_heartbeat=p.is_heartbeat,
                )
                return result
            except SystemExit as e:  # the plugin's failure (``_call``): the turn is queued, the engine isolated
                error = _exited(engine_id, "commit_turn", e)
                self.quarantine(engine_id, "commit_turn", error, in_transaction=True)
                raise error from e
            except AdvancementKeyCollision:
                # The ledger's answer, not the engine's failure: the key was committed before as another
                # payload (a direct commit of a queued turn's key). The drain settles that row
                # (``committed_other_version``); isolating the engine for it sent the session's next
                # queued turn, and the process's every later turn, to legacy.
                raise
            except Exception as e:
                if not self._database_failed(e):
                    self.quarantine(engine_id, "commit_turn", e, in_transaction=True)
                raise

        return run

    # ------------------------------------------------------------------------------------ sessions

    def resolve_session(self, scope: str, session_id: str) -> str:
        """Follow successor sessions (after a compaction that changed the session identity)."""
        check_id("scope", scope)
        check_id("session_id", session_id)
        return self._chain(scope, session_id)[-1]

    def _chain(self, scope: str, session_id: str) -> list[str]:
        """``session_id`` and its successors in order, the session now in use last."""
        chain = [session_id]
        while (scope, chain[-1]) in self._successors and self._successors[(scope, chain[-1])] not in chain:
            chain.append(self._successors[(scope, chain[-1])])
        return chain

    def _session_of_turn(self, scope: str, session_id: str, turn_id: str) -> str:
        """The session a turn runs in: the successor of ``session_id`` (``resolve_session``), unless a
        session on the way holds the turn (its intent or its receipt).

        A retry of a turn admitted before a compaction named a successor (its own pre-prompt one, say)
        belongs where it was admitted: there it is joined, or answered "duplicate" once committed; in
        the successor it would run, and reach the engine, a second time. A turn that left nothing there
        (a failed attempt's intent is discarded) runs on the successor, as OpenClaw's next retry does.
        Only sessions with a successor are looked at, in one read; none in the common case.
        """
        chain = self._chain(scope, session_id)
        if len(chain) == 1:
            return session_id

        def first_holding(c: Core) -> str:
            for at in chain[:-1]:
                if outbox.get_intent(c, scope, at, turn_id) is not None or receipts_for_key(c, scope, at, turn_id):
                    return at
            return chain[-1]

        return self.store.read(first_holding)

    def follow(self, scope: str, old_session_id: str, target: SessionTarget | None) -> str:
        """Record a successor session target; returns the session the next turn uses."""
        check_id("scope", scope)
        check_id("session_id", old_session_id)
        if target is None:
            return old_session_id
        if not isinstance(target, SessionTarget):
            raise InvalidInput(f"a session target must be a SessionTarget, not {type(target).__name__}")
        check_id("session_target.scope", target.scope)
        check_id("session_target.session_id", target.session_id)
        if target.scope != scope:  # even under the same id: that is another scope's session
            raise InvalidInput("a successor session must stay in the same scope")
        if target.session_id == old_session_id:
            return old_session_id
        self._successors[(scope, old_session_id)] = target.session_id
        # The target is the session in use now: a successor it had (a rotation back to it) is over, and
        # the chains stay without cycles.
        self._successors.pop((scope, target.session_id), None)
        return target.session_id

    # ------------------------------------------------------------------------------------ turns

    def decide(self, scope: str, session_id: str, turn_id: str) -> _Decision:
        """The engine of a logical turn, decided once before it starts (retries reuse it)."""
        check_id("scope", scope)
        check_id("session_id", session_id)
        check_id("turn_id", turn_id)
        return self._decide(scope, session_id, turn_id)

    def _decide(self, scope: str, session_id: str, turn_id: str) -> _Decision:
        """``decide`` for ids already checked (``run_turn`` checks them once, before anything else)."""
        key = (scope, session_id, turn_id)
        if key in self._decisions:
            self._decisions.move_to_end(key)
            return self._decisions[key]
        configured = self.settings.engine
        decision = _Decision(configured, None)
        if configured != LEGACY:
            try:
                engine, info = self.engine(configured)
            except EngineError as e:
                decision = _Decision(LEGACY, f"engine unavailable: {e}")
            else:
                self._check_requirements(info, "agent-run")
                durable, reason, broken = durable_declaration(engine, info)
                if broken:
                    log.warning(
                        "context engine %r: partial durable declaration (invariant failure): %s", configured, reason
                    )
                if not durable:
                    decision = _Decision(LEGACY, reason)
        self._remember(key, decision)
        if decision.reason:
            log.warning("turn %s runs on the legacy context path: %s", turn_id, decision.reason)
        return decision

    def _check_requirements(self, info: EngineInfo, operation: str) -> None:
        missing, message = missing_capabilities(info, operation, self.settings.capabilities)
        if missing:
            raise HostRequirementError(
                f'Context engine "{info.id}" cannot run operation "{operation}" on transcript-store host. '
                f"Missing host capabilities: {', '.join(missing)}." + (f" {message}" if message else "")
            )

    def _remember(self, key: tuple[str, str, str], decision: _Decision) -> None:
        self._decisions[key] = decision
        self._decisions.move_to_end(key)
        while len(self._decisions) > _MAX_DECISIONS:
            self._decisions.popitem(last=False)

    def _degrade(self, scope: str, session_id: str, turn_id: str, reason: str) -> _Decision:
        decision = _Decision(LEGACY, reason)
        self._remember((scope, session_id, turn_id), decision)
        log.warning("turn %s runs on the legacy context path: %s", turn_id, reason)
        return decision

    def run_turn(
        self,
        scope: str,
        session_id: str,
        message: dict[str, Any] | str,
        *,
        turn_id: str | None = None,
        runtime_context: dict[str, Any] | None = None,
    ) -> TurnOutcome:
        """Run one logical turn to its commit (see module doc); retries reuse the same turn id.

        ``PromptTooLarge`` before anything is written when the budget cannot hold the request even
        without any context."""
        user = validate_message({"role": "user", "content": message} if isinstance(message, str) else message)
        if user["role"] != "user":
            raise InvalidInput("a turn starts with a user message")
        check_id("scope", scope)
        check_id("session_id", session_id)
        values = host_values(runtime_context)
        if turn_id is not None:  # "" or 0 is refused below, never taken for "draw one"
            # A turn id given may be a retry's: the session on the way that holds it (one read, only for
            # a session with successors). Checked first: it is looked up before the admission checks it.
            check_id("turn_id", turn_id)
            session_id = self._session_of_turn(scope, session_id, turn_id)
        else:
            turn_id = new_id()
            session_id = self._chain(scope, session_id)[-1]  # resolve_session, the ids checked above
        self._settle_background_failures()
        # An unknown session is refused by the admission's transaction (UnknownSession), before any
        # write: no read transaction of its own to ask first.
        try:
            return self._run_turn(scope, session_id, user, turn_id, values)
        finally:
            self.flush_quarantines()

    def _replaced(self, scope: str, session_id: str, admission: Admission) -> bool:
        """Whether the session of ``admission`` is gone, or another session now holds its id."""
        try:
            info = self.store.get_session(scope, session_id)
        except UnknownSession:
            return True
        made = admission.anchor.incarnation
        return made is not None and info.incarnation != made

    def _run_turn(
        self, scope: str, session_id: str, user: dict[str, Any], turn_id: str, values: dict[str, Any]
    ) -> TurnOutcome:
        decision = self._decide(scope, session_id, turn_id)
        # This call's attempts hold the turn's intent under one lease owner of their own, and a failing
        # one discards the intent only while they still hold it: a retry of the turn by another worker
        # or thread may have taken it over meanwhile, and is running on.
        owner = new_owner()
        attempts = 0
        first = True
        # The lease of a live attempt of this turn that this call's first admission took over (this
        # call is a retry, presented while that attempt may still run): if this call fails, the turn
        # is handed back to it, not discarded, since its work may still complete the turn.
        displaced: list[outbox.AdmittedLease] = []
        # The engine an attempt of this call reached the model on (its model call then timed out): the
        # turn has started there, and a later attempt's degradation may not move it to legacy.
        started_on: str | None = None

        def give_up() -> str:
            """This call's attempts failed: hand the turn back, or discard its intent (a note on which).

            Either only while this call holds the turn; one that no longer does (a retry took it over)
            leaves the intent's list of displaced attempts, so that the turn is never handed back to it."""
            lease = displaced.pop() if displaced else None
            if lease is not None:
                if self.turns.hand_back(scope, session_id, turn_id, owner=owner, lease=lease):
                    return "; handed back to the earlier attempt of the turn, still running: it may complete it"
                return ""  # discarded (no earlier attempt lives), or left to the retry holding it
            self.turns.discard(scope, session_id, turn_id, owner=owner)
            return ""

        # Between attempts the turn keeps its admitted intent (and so the session: a session runs one
        # turn at a time): the next attempt takes its admission and lease over. Handing the session
        # back in between would let another turn in, and this one would then be overtaken.
        while True:
            attempts += 1
            taken: list[outbox.AdmittedLease] = []
            try:
                try:
                    outcome = self._attempt(scope, session_id, user, turn_id, decision, values, owner, taken)
                finally:
                    self._leases.release(scope, session_id, turn_id, owner)
                    displaced[:] = displaced or taken
            except _Degrade as d:
                if decision.engine_id == LEGACY:
                    note = give_up()
                    raise TurnFailed(f"turn {turn_id} cannot run even on legacy: {d.reason}{note}") from None
                if started_on is not None and started_on != LEGACY:
                    note = give_up()
                    raise TurnFailed(
                        f"turn {turn_id} started on engine {started_on!r} (an attempt reached the model) and "
                        f"cannot switch engines; its retry failed there: {d.reason}{note}"
                    ) from None
                if displaced and give_up():
                    # The turn runs on its engine in the attempt this call took it from: a started turn
                    # never switches engines, so this call may not move it to legacy. It is busy.
                    until = self.store.read(lambda c: outbox.busy_until(c, scope, session_id, turn_id))
                    self._decisions.pop((scope, session_id, turn_id), None)
                    raise SessionBusy(session_id, turn_id, until) from None
                # Only while this call's attempts hold the turn: a retry that took it over runs on.
                try:
                    self.store.write(lambda c: outbox.reassign(c, scope, session_id, turn_id, LEGACY, owner))
                except SessionBusy:
                    give_up()  # this call is over: it leaves the turn to the attempts that hold it
                    raise
                decision = self._degrade(scope, session_id, turn_id, d.reason)
                attempts -= 1
                first = False
                continue
            except ModelTimeout as e:
                started_on = decision.engine_id
                log.warning("turn %s attempt %d: model timeout, retrying the same logical turn", turn_id, attempts)
                if attempts >= self.settings.max_attempts:
                    note = give_up()
                    raise TurnFailed(f"turn {turn_id} failed after {attempts} attempts: {e}{note}") from e
                first = False
                continue
            except _Refused as r:
                # The turn was refused (by the admission, or before it: PromptTooLarge): on its first
                # attempt nothing of it was written, and its engine is decided again when it is
                # presented again. A refusal naming this very turn is about another attempt's intent
                # (on another engine), never this attempt's.
                if not first:
                    # (One naming this turn: this call no longer holds it, and only leaves it to the
                    # attempts that do: ``give_up`` hands back or discards only while this call holds it.)
                    give_up()
                self._decisions.pop((scope, session_id, turn_id), None)
                raise r.error from None
            except BaseException:
                give_up()
                raise
            outcome.attempts = attempts
            self._decisions.pop((scope, session_id, turn_id), None)
            return outcome

    def _branched_away(self, fence: Anchor) -> bool:
        """Whether the admitted entry left the active branch in its own generation (a branch, not a rewrite)."""

        def look(c: Core) -> bool:
            sess = c.session_row(fence.scope, fence.session_id)
            return sess is not None and c.branched_away(fence.scope, fence.session_id, fence.seq, int(sess.generation))

        return self.store.read(look)

    def _already_accepted(
        self, scope: str, session_id: str, turn_id: str, engine_id: str, delivered_here: bool = False
    ) -> TurnOutcome | None:
        """A retry of a turn an earlier attempt already accepted: report it, never run it twice.

        ``committed`` when this call delivered it (the recovery before it, ``delivered_here``, or the
        drain here: the earlier attempt got as far as the acceptance), ``duplicate`` when it was
        committed before this call."""

        def look(c: Core) -> tuple[list[Receipt], TurnIntent | None]:
            return receipts_for_key(c, scope, session_id, turn_id), outbox.get_intent(c, scope, session_id, turn_id)

        found, intent = self.store.read(look)
        if intent is not None and intent.state == "admitted":
            if intent.engine_id != engine_id:
                self._leave_running_attempt(scope, session_id, turn_id)
            return None
        if intent is not None and intent.state in ("accepted", "ready"):
            drained = self.turns.drain(self.commit_in, scope=scope, session_id=session_id)
            delivered_here = delivered_here or (session_id, turn_id) in drained.committed_turns
            found, intent = self.store.read(look)
        if not found and intent is None:
            return None
        if found:
            receipt = found[0]
            messages = self.store.read(lambda c: committed_messages(c, scope, session_id, receipt.engine_id, turn_id))
            status, used = "committed" if delivered_here else "duplicate", receipt.engine_id
        else:
            assert intent is not None
            messages = intent.messages or []
            status = "blocked" if intent.state == "blocked" else "queued"
            used = intent.engine_id
        return TurnOutcome(
            turn_id=turn_id,
            scope=scope,
            session_id=session_id,
            engine_id=used,
            configured_engine=self.settings.engine,
            degraded_reason=None,
            reply=messages[-1] if messages else {},
            messages=messages,
            commit_status=status,
            attempts=0,
            assembled_tokens=0,
            admission=intent.admission if intent else None,
            terminal=intent.terminal if intent else None,
        )

    def _leave_running_attempt(self, scope: str, session_id: str, turn_id: str) -> None:
        """An attempt of this turn on another engine holds its admitted intent: refuse this one while
        that attempt's worker lives (``SessionBusy``), discard the intent once the worker is gone.

        A retry on the same engine takes the intent's lease over and runs on: the first completion
        wins, the other learns "duplicate". One on another engine cannot: a started turn never switches
        engines, and discarding the running attempt's intent to admit it again here would throw that
        attempt's work away (its completion finds no intent) or hand its turn to this engine.
        """
        live = self.store.write(lambda c: outbox.discard_unless_running(c, scope, session_id, turn_id))
        if live is not None:
            raise _Refused(SessionBusy(session_id, turn_id, live.busy_until()))

    def _runtime_settings(self, decision: _Decision, reserved: int) -> RuntimeSettings:
        source = "fallback" if decision.reason else self.settings.engine_source
        # The contract's diagnostics: why the selection fell back to legacy and the run is degraded. Its
        # reference names no closed set of codes, so the reason is the host's own text (as the turn's
        # ``degraded_reason`` and the warning say it).
        return RuntimeSettings(
            runtime=RuntimeInfo(mode="degraded" if decision.reason else "normal"),
            context_engine_selection=EngineSelection(id=decision.engine_id, source=source),
            diagnostics=Diagnostics(fallback_reason=decision.reason, degraded_reason=decision.reason),
            model=ModelSettings(
                requested=getattr(self.model, "name", None), resolved=getattr(self.model, "name", None)
            ),
            # The prompt's budget is what assemble gets (the window less the reply's tokens and what the
            # request carries besides the context), as the service says it too: an engine reading it
            # in maintain compacts to what assemble will fit.
            limits=Limits(
                prompt_token_budget=self.prompt_budget(reserved),
                max_output_tokens=self.settings.max_output_tokens,
            ),
        )

    def _attempt(
        self,
        scope: str,
        session_id: str,
        user: dict[str, Any],
        turn_id: str,
        decision: _Decision,
        values: dict[str, Any],
        owner: str,
        taken: list[outbox.AdmittedLease],
    ) -> TurnOutcome:
        engine_id = decision.engine_id
        try:
            engine, info = self.engine(engine_id)
        except EngineError as e:
            raise _Degrade(f"engine unavailable: {e}") from None
        try:
            engine_tools = self._engine_tools(engine, info)
        except Exception as e:
            if engine_id == LEGACY:
                raise
            # Before the model is first called: the turn may still run on legacy, as for assemble.
            raise _Degrade(f"engine {engine_id} failed: {describe(e)}") from None
        # What every request of the turn carries besides the assembled context: the system prompt, the
        # user message and the tools' schemas. Assemble gets the prompt's budget less these, so the
        # request the model receives fits the budget, not just the transcript part of it; known before
        # the admission, so a turn no budget can hold is refused before anything is written.
        tools = [s for s, _ in self.host_tools.values()] + list(engine_tools.values())
        reserved = self._reserved_tokens(user, tools)
        self._check_room(reserved)
        # The common case in one transaction: nothing to recover, not a retry, admitted, and (for an
        # engine that can) the assembly's reads done there too, under the admission's session lock.
        within, prefetched = self._prefetch(engine, info, scope, session_id)
        try:
            admitted = self.turns.admit_if_clear(
                scope, session_id, user, turn_id=turn_id, engine_id=engine_id, within=within, owner=owner
            )
        except TurnOvertaken as e:
            raise _Refused(e) from None
        except _PrefetchFailed as e:  # the admission rolled back: nothing of this attempt was written
            if engine_id == LEGACY:
                raise e.error from None
            self.quarantine(engine_id, "prefetch_in", e.error)
            raise _Degrade(f"engine {engine_id} failed: {type(e.error).__name__}: {e.error}") from None
        # What the last run of ``within`` read belongs to the transaction that returned the admission
        # (it runs last in it); anything else (no admission, the recovery path below) is not used.
        ahead = prefetched[-1] if admitted is not None and prefetched else None
        if admitted is None:
            report = self.turns.recover(scope, session_id, engine_id, self.commit_in)
            recovered_here = (session_id, turn_id) in report.drain.committed_turns
            done = self._already_accepted(scope, session_id, turn_id, engine_id, recovered_here)
            if done is not None:
                return done
            running = [t for t in report.running if t != turn_id]
            if running:  # the admission below would refuse it; say so before any degradation
                until = self.store.read(lambda c: outbox.busy_until(c, scope, session_id, running[0]))
                raise _Refused(SessionBusy(session_id, running[0], until))
            if [t for t in report.pending if t != turn_id]:
                raise _Degrade("an earlier turn of the session is still pending")
            try:
                admitted = self.turns.admit(
                    scope, session_id, user, turn_id=turn_id, engine_id=engine_id, owner=owner, taken_over=taken
                )
            except (SessionBusy, TurnOvertaken) as e:
                raise _Refused(e) from None
            except OutboxCollision:
                # Another attempt of this turn id committed it since the look above: report that one.
                done = self._already_accepted(scope, session_id, turn_id, engine_id)
                if done is None:
                    raise
                return done
        if admitted[1].state != "admitted":
            # The admission met this turn accepted (or queued) by another attempt, between the look for
            # one (``_already_accepted``) and the admission: that attempt's turn, reported as such.
            # Assembling here called the model and ran the tools a second time for an accepted turn.
            done = self._already_accepted(scope, session_id, turn_id, engine_id)
            if done is None:
                raise OutboxCollision(f"turn {turn_id!r} was accepted by another attempt, then discarded")
            return done
        admission = admitted[0]
        # From the admission until the completion, the turn's lease is renewed in the background, so
        # no model or tool call, however long, lets another turn take the session over (leases.py).
        if admitted[1].state == "admitted" and admitted[1].lease_owner == owner:  # renewal matches it
            self._leases.hold(scope, session_id, turn_id, self.turns.config.turn_lease_seconds, owner,
                              self.settings.max_turn_seconds)
        fence = admission.anchor
        if self.before_assemble is not None:
            self.before_assemble(scope, session_id, admission)
        session_key = fence.session_key
        rt = RuntimeContext(self, scope, session_id, fence, turn_id, self.prompt_budget(reserved), values)
        host_params = {
            "session_key": session_key,
            "prompt": user,
            "runtime_settings": self._runtime_settings(decision, reserved),
            "runtime_context": rt,
        }
        read_fence: Anchor | None = fence
        unfenced: str | None = None
        if engine_id != LEGACY and ahead is None:
            # Probe the fence before any other engine runs: it may assemble from its own state without
            # a fenced read, or wrap the error. The legacy engine's own reads are fenced (they check the
            # admitted entry, unless they ran in the admission that appended it), so it needs no
            # separate read transaction for this; nor does an engine that read in the admission.
            try:
                self.store.read_visible_delta(scope, session_id, max_messages=1, fence=fence)
            except ReadFenceError as e:
                raise _Degrade(f"read fence: {e.reason}") from None
        try:
            assembled = self._assemble(engine, info, scope, session_id, read_fence, host_params, ahead, reserved)
        except ReadFenceError as e:
            if e.reason == "missing" and self._branched_away(fence):
                # (A retry after the admitted message was branched away: its answer would have no
                # question on the branch, and the completion refuses it. Refused before the model call.)
                raise TurnBranchedAway(session_id, turn_id) from None
            if engine_id != LEGACY:
                raise _Degrade(f"read fence: {e.reason}") from None
            # The legacy path reads the transcript as it is now; this turn's commit will be blocked
            # as stale (kept as evidence) because its admission no longer matches.
            log.warning("turn %s: fence cannot be honoured (%s); legacy reads unfenced", turn_id, e.reason)
            read_fence = None
            unfenced = f"read fence: {e.reason} (legacy read unfenced)"
            settings = host_params["runtime_settings"]
            assert isinstance(settings, RuntimeSettings)
            host_params["runtime_settings"] = settings.model_copy(update={
                "runtime": settings.runtime.model_copy(update={"mode": "degraded"}),
                "diagnostics": settings.diagnostics.model_copy(update={"degraded_reason": decision.reason or unfenced}),
            })
            # Every read of this turn from here is unfenced, the compaction before the prompt's included
            # (it read with the broken fence and raised again, failing the turn).
            host_params["runtime_context"] = replace(rt, fence=None)
            assembled = self._assemble(engine, info, scope, session_id, read_fence, host_params, None, reserved)
        except Exception as e:
            if engine_id == LEGACY:
                raise
            raise _Degrade(f"engine {engine_id} failed: {describe(e)}") from None
        if read_fence is None and assembled.messages and assembled.messages[-1] == user:
            assembled = assembled.model_copy(update={"messages": assembled.messages[:-1]})
        # From here the turn has started on this engine: no switch, ever.
        ran_tools: list[str] = []  # the tool calls this turn's model loop ran
        try:
            replies = self._model_loop(engine, info, scope, session_id, user, assembled, engine_tools, tools, reserved,
                                       ran_tools)
        except ModelError as e:
            if not is_context_overflow(e) or ran_tools:
                # After a tool ran, starting over would run it again (a side effect twice) and drop its
                # result: only an overflow of the turn's first request is recovered.
                raise
            # OpenClaw's provider overflow recovery: compact once, assemble again, retry once, all inside
            # this admitted turn (same admission, fence and lease; the completion below persists it once).
            # A second overflow fails the turn as any model error does.
            assembled = self._recover_overflow(engine, info, scope, session_id, read_fence, host_params, reserved, e)
            if read_fence is None and assembled.messages and assembled.messages[-1] == user:
                assembled = assembled.model_copy(update={"messages": assembled.messages[:-1]})
            replies = self._model_loop(engine, info, scope, session_id, user, assembled, engine_tools, tools, reserved)
        # The completion locks the turn's row and ends its lease: nothing to renew from here on.
        self._leases.release(scope, session_id, turn_id, owner)
        try:
            completion = self.turns.complete(
                scope, session_id, turn_id, [AppendItem(message=m) for m in replies], self.commit_in(engine_id)
            )
        except OutboxCollision as e:
            # Another attempt of this turn id (a worker given the same turn after a timeout, alive
            # and slower) completed it while this one ran its model: it is that attempt's turn, and
            # this one learns what became of it ("duplicate" once committed), its replies unwritten.
            done = self._already_accepted(scope, session_id, turn_id, engine_id)
            if done is None:
                # Or its intent was discarded while it ran (its worker looked dead: the lease could not
                # be renewed in time) and the session moved on: say so, as an admission retry would.
                self.store.read(lambda c: outbox.check_not_overtaken(c, admission))
                if isinstance(e, UnknownTurn):
                    # A turn that did exist, lost while it ran: a failed turn (OutboxCollision, as
                    # ``run_turn`` always raised for it), not an unknown one (the CLI's "not found").
                    # Its session deleted and created again under the id took the intent with it: no
                    # lease was taken, and the message said one was.
                    if self._replaced(scope, session_id, admission):
                        raise OutboxCollision(
                            f"session {session_id!r} was deleted (and created again under its id) while turn "
                            f"{turn_id!r} ran: its replies were not written; present the message again"
                        ) from e
                    raise OutboxCollision(
                        f"turn {turn_id!r} of session {session_id!r} was discarded while this attempt ran "
                        "(its worker's lease was taken for abandoned): its replies were not written; "
                        "present the message again"
                    ) from e
                raise
            return done
        status: str = completion.commit.status if completion.commit else completion.intent.state
        if completion.commit is None and completion.intent.state in ("accepted", "ready"):
            drained = self.turns.drain(self.commit_in, scope=scope, session_id=session_id)
            # The row itself, not ``Turns.intent``: a session deleted meanwhile is no reason to fail a turn
            # that completed (that call raises UnknownSession for it).
            left = self.store.read(lambda c: outbox.get_intent(c, scope, session_id, turn_id))
            # Gone from the outbox: delivered, by this drain or by another process's running at the same
            # time (its receipt tells; "queued" promised a delivery that had happened). Blocked by this
            # drain (another version of the key receipted) or by an operator since the completion: it will
            # never be delivered, so "queued" would promise what cannot happen.
            if left is None and (
                (session_id, turn_id) in drained.committed_turns
                or self.store.read(lambda c: get_receipt(c, scope, session_id, engine_id, turn_id)) is not None
            ):
                status = "committed"
            else:
                status = "blocked" if left is not None and left.state == "blocked" else "queued"
        self._after_turn(engine, info, scope, session_id, admission, completion.terminal, host_params)
        if decision.engine_id != engine_id:
            raise EngineSwitchError("a started turn cannot switch engines")
        return TurnOutcome(
            turn_id=turn_id,
            scope=scope,
            session_id=session_id,
            engine_id=engine_id,
            configured_engine=self.settings.engine,
            degraded_reason=decision.reason or unfenced,
            reply=replies[-1],
            messages=[user, *replies],
            commit_status=status,
            attempts=0,
            assembled_tokens=assembled.estimated_tokens,
            admission=admission,
            terminal=completion.terminal,
        )

    def _prefetch(
        self, engine: Any, info: EngineInfo, scope: str, session_id: str
    ) -> tuple[Callable[[Core, Admission], None] | None, list[Any]]:
        """The engine's ``prefetch_in`` as an admission callback, and the list its result goes to.

        Not when ``before_assemble`` is set (that seam promises to run before the engine reads
        anything), nor before the engine's ``bootstrap`` ran for the session. A refusal of this
        library's raised there (a fence that does not hold, a cursor) only skips the prefetch, and
        ``assemble`` then reads in its own snapshot, unless a statement of the transaction failed
        (PostgreSQL could only roll it back: it must never look committed). Anything else rolls the
        admission back and fails the attempt (``_PrefetchFailed``): another engine is quarantined and
        the turn runs on legacy.
        """
        results: list[Any] = []
        prefetch = getattr(engine, "prefetch_in", None)
        needs_bootstrap = getattr(engine, "bootstrap", None) is not None
        if (
            prefetch is None
            or self.before_assemble is not None
            or (needs_bootstrap and (info.id, scope, session_id) not in self._bootstrapped)
        ):
            return None, results

        def within(c: Core, admission: Admission) -> None:
            results.clear()  # a retried transaction runs this again: only the last run counts
            try:
                results.append(prefetch(c, scope=scope, session_id=session_id, fence=admission.anchor))
            except (StoreUnavailable, SQLAlchemyError):
                raise  # the transaction's own failure: translated, retried or reported with the admission
            except TranscriptStoreError as e:
                if c.transaction_failed():
                    raise
                log.info("engine %s: pre-turn read in the admission skipped: %s", info.id, e)
            except Exception as e:
                raise _PrefetchFailed(e) from e

        return within, results

    def _assemble(
        self,
        engine: Any,
        info: EngineInfo,
        scope: str,
        session_id: str,
        fence: Anchor | None,
        host: dict[str, Any],
        prefetched: Any = None,
        reserved: int = 0,
    ) -> AssembleResult:
        key = (info.id, scope, session_id)
        bootstrap = getattr(engine, "bootstrap", None)
        if bootstrap is not None and key not in self._bootstrapped:
            params = project_params(info, {"scope": scope, "session_id": session_id, "fence": fence}, host)
            self._call(info.id, "bootstrap", lambda: bootstrap(**params))
            self._bootstrapped.add(key)
            self._maintain_after_bootstrap(engine, info, scope, session_id, fence, host)
        budget = self.prompt_budget(reserved)
        base = {
            "scope": scope,
            "session_id": session_id,
            "fence": fence,
            "token_budget": budget,
            "available_tools": sorted(self.host_tools),
        }
        if prefetched is not None and fence is not None:
            base["prefetched"] = prefetched  # what prefetch_in read for this fence in its admission
        params = project_params(info, base, host)
        result = self._call(info.id, "assemble", lambda: _assembled(info, engine.assemble(**params)))
        precheck = not info.owns_compaction or result.prompt_authority == "preassembly_may_overflow"
        threshold = int(budget * self.settings.compaction_threshold)
        estimate = result.estimated_tokens
        if (
            precheck and not info.owns_compaction and result.prompt_authority == "preassembly_may_overflow"
            and estimate <= threshold
        ):
            # OpenClaw: the larger of the assembled estimate and the pre-assembly (unwindowed) history's. The
            # engine says its assembled view may hide what the transcript holds; compared alone, it never did.
            # Not for an engine owning compaction: that history is the built-in compaction's (its summary and
            # what follows), which its own compaction never shortens, so it was asked to compact every turn.
            estimate = max(estimate, self._preassembly_tokens(scope, session_id, fence))
        if precheck and estimate > threshold:
            # Compaction before the prompt, then assemble again from the new pointer: the built-in one,
            # unless the engine owns compaction (its safeguard asks the engine, never the built-in).
            rt: RuntimeContext = host["runtime_context"]
            if info.owns_compaction:
                done = self._owned_compaction(engine, info, scope, session_id, budget, host, fence)
            else:
                done = delegate_compaction_to_runtime(rt, force=False, prompt_budget=budget)
            # A compaction that changed the session identity names the successor (OpenClaw's
            # sessionTarget), as a manual one does: the next turn runs on it. This turn, and a retry of
            # it, keep the session they were admitted to: their admission, fence and commit are there.
            self.follow(scope, session_id, done.session_target)
            if done.compacted:
                params.pop("prefetched", None)  # read before the compaction: the pointer moved
                result = self._call(
                    info.id, "assemble", lambda: _assembled(info, engine.assemble(**params))
                )
        return self._fit_addition(engine, info, params, host, result, reserved)

    def _recover_overflow(
        self,
        engine: Any,
        info: EngineInfo,
        scope: str,
        session_id: str,
        fence: Anchor | None,
        host: dict[str, Any],
        reserved: int,
        error: ModelError,
    ) -> AssembleResult:
        """After the provider refused the request as over its context window: the session compacted (forced)
        and the context assembled again from the new pointer; ``error`` again when nothing was compacted.

        As OpenClaw's overflow recovery, the engine's ``compact`` runs whether or not it owns compaction
        (a non-owning one delegates to the built-in; one without ``compact`` gets the built-in), and a
        successor session it names is followed by the next turn, not this one (as before the prompt).
        A ``compact`` that declares ``fence`` is given ``fence``, the turn's (``_fenced``).
        The model loop then starts over: tool calls of the refused pass ran, their results are dropped.
        """
        log.warning("session %s: the provider refused the request as over its context window (%s);"
                    " compacting, then retrying the model call once", session_id, error)
        rt: RuntimeContext = host["runtime_context"]
        base = {"scope": scope, "session_id": session_id, "force": True, "focus": None, "token_budget": rt.budget}
        params = project_params(info, _fenced(getattr(engine, "compact", None), base, fence), host)
        done = self._call(info.id, "compact", lambda: self._engine_compact(engine, info, scope, session_id, rt, params))
        self.follow(scope, session_id, done.session_target)
        if not done.compacted:
            log.warning("session %s: the overflow compaction compacted nothing (%s)", session_id, done.reason)
            raise error
        return self._assemble(engine, info, scope, session_id, fence, host, None, reserved)

    def _preassembly_tokens(self, scope: str, session_id: str, fence: Anchor | None) -> int:
        """The tokens of the session's unwindowed history before the fence, as the runtime would send it: the
        built-in compaction's latest summary and every visible message after it (the legacy view, without a
        budget; it reads only the messages its projection has not seen)."""
        legacy, _info = self.engine(LEGACY)
        view = legacy.assemble(scope=scope, session_id=session_id, fence=fence, token_budget=MAX_TOKENS)
        return AssembleResult.model_validate(view).estimated_tokens

    def _fit_addition(
        self,
        engine: Any,
        info: EngineInfo,
        params: dict[str, Any],
        host: dict[str, Any],
        result: AssembleResult,
        reserved: int,
    ) -> AssembleResult:
        """The assembly again with the engine's system-prompt addition reserved, when it did not fit.

        The addition goes into the request's system prompt, but it is known only once assemble has
        answered, so the first assembly cannot have left room for it. When the context and the addition
        together are over the prompt's budget, the engine is asked once more with the addition's tokens
        reserved as well: the engine decides what the model sees, and an engine whose addition does not
        grow as its room shrinks (the lossless engine's is one fixed hint, or none) then fits. Only once:
        asking until the answer settles could go on forever for an engine whose addition grows as its
        room shrinks; such an answer is logged, and the request gets less of its context, oldest first
        (``_model_loop``), as a tool round over the budget does.
        """
        extra = self._addition_tokens(result.system_prompt_addition)
        budget = self.prompt_budget(reserved)
        if result.estimated_tokens + extra <= budget:
            return result  # the common case: no addition, or room for it: one assembly
        self._check_addition(info, extra, budget)
        again = {**params, "token_budget": self.prompt_budget(reserved + extra)}
        again.pop("prefetched", None)  # the engine reads in its own snapshot, as after a compaction
        if "runtime_settings" in host:
            # after_turn and maintain see the budget the assembly the model gets was made for
            host["runtime_settings"] = self._with_budget(host["runtime_settings"], again["token_budget"])
            if "runtime_settings" in again:
                again["runtime_settings"] = host["runtime_settings"]
        rt = host.get("runtime_context")
        if isinstance(rt, RuntimeContext):  # and so does a built-in compaction delegated from there
            rt.budget = again["token_budget"]
        result = self._call(info.id, "assemble", lambda: _assembled(info, engine.assemble(**again)))
        extra = self._addition_tokens(result.system_prompt_addition)
        self._check_addition(info, extra, budget)  # the second answer's addition may have grown
        over = result.estimated_tokens + extra - budget
        if over > 0:
            log.warning("engine %s: the assembled context and its system-prompt addition are %d tokens over the"
                        " prompt's budget even with the addition reserved", info.id, over)
        return result

    def prompt_budget(self, reserved: int = 0) -> int:
        """The tokens an engine may assemble into: the budget less the reply's and ``reserved`` (at least 1)."""
        if isinstance(reserved, bool) or not isinstance(reserved, int) or reserved < 0:
            raise InvalidInput(f"reserved must be a non-negative integer, not {reserved!r}")
        return max(1, self.settings.token_budget - self.settings.max_output_tokens - reserved)

    def _check_room(self, reserved: int) -> None:
        """PromptTooLarge (as a refusal: nothing written yet) when ``reserved`` and the reply leave the
        context not even one token: the request would overflow whatever the engine assembled."""
        settings = self.settings
        if reserved + settings.max_output_tokens >= settings.token_budget:
            raise _Refused(PromptTooLarge(reserved, settings.max_output_tokens, settings.token_budget))

    def _owned_compaction(
        self,
        engine: Any,
        info: EngineInfo,
        scope: str,
        session_id: str,
        budget: int,
        host: dict[str, Any],
        fence: Anchor | None = None,
    ) -> CompactResult:
        """The engine's own compaction, for the pre-prompt safeguard of an engine that owns compaction
        (given the turn's ``fence`` when its ``compact`` declares one, see ``_fenced``)."""
        method = getattr(engine, "compact", None)
        if method is None:
            return CompactResult(ok=True, compacted=False, reason="the engine has no compact()")
        base = {"scope": scope, "session_id": session_id, "force": False, "focus": None, "token_budget": budget}
        params = project_params(info, _fenced(method, base, fence), host)

        def run() -> CompactResult:
            return self._checked_target(info, scope, session_id, CompactResult.model_validate(method(**params)))

        return self._call(info.id, "compact", run)

    def _checked_target(self, info: EngineInfo, scope: str, session_id: str, result: CompactResult) -> CompactResult:
        """``result`` when the successor session it names (if any) is a session of ``scope``; else the engine's
        failure (EngineContractError, inside its call: quarantined). Followed unchecked, a successor that did
        not exist sent every later turn of the session to it (UnknownSession, every time, the engine never
        isolated), and one of another scope was the caller's InvalidInput."""
        target = result.session_target
        if target is None or (target.scope, target.session_id) == (scope, session_id):
            return result
        if target.scope != scope:
            raise EngineContractError(f"engine {info.id!r} named a successor session of another scope")
        try:
            self.store.get_session(scope, target.session_id)
        except (UnknownSession, InvalidInput):
            raise EngineContractError(
                f"engine {info.id!r} named a successor session {quoted(target.session_id)} that does not exist"
            ) from None
        return result

    def _model_loop(
        self,
        engine: Any,
        info: EngineInfo,
        scope: str,
        session_id: str,
        user: dict[str, Any],
        assembled: AssembleResult,
        engine_tools: dict[str, Any],
        tools: list[dict[str, Any]],
        reserved: int = 0,
        ran_tools: list[str] | None = None,
    ) -> list[dict[str, Any]]:
        system = with_addition(self.settings.system_prompt, assembled.system_prompt_addition)
        paired = pair_tool_calls(assembled.messages)
        context = prune_tool_results(
            paired, self.settings.prune_keep_recent_tool_results, self.settings.prune_tool_result_max_chars
        )
        replies: list[dict[str, Any]] = []
        # The budget covers every request of the turn, the first one's and the tool rounds' alike: what
        # this turn's replies add is counted as they come (a few messages), and a request over the budget
        # gets less of the engine's context, oldest first (see ``fit_tool_round``). The first one can be:
        # its stand-in tool results are the host's, and an engine's answer to the assembly asked again
        # with its system-prompt addition reserved may still be over (``_fit_addition``).
        # The system prompt's addition rides on the request too, outside what was reserved for it.
        limit = self.prompt_budget(reserved) - self._addition_tokens(assembled.system_prompt_addition)
        context_tokens, replies_tokens = assembled.estimated_tokens, 0
        near = limit - max(64, limit // 20)  # past it, the engine's estimate is not trusted to the token
        # Stand-ins added (or orphan results left out) are not in the engine's estimate: counted then.
        counted = len(paired) != len(assembled.messages)
        if counted:
            context_tokens = int(self.estimator.count_messages(context)) if context else 0
        for _step in range(self.settings.max_tool_steps):
            if not counted and context_tokens + replies_tokens > near:
                # Counted by the host's estimator when the request comes near the budget (the engine may
                # count otherwise); far from it, the engine's own estimate stands: counting every turn's
                # whole context costs a quarter of a host turn.
                context_tokens = int(self.estimator.count_messages(context)) if context else 0
                counted = True
            if context_tokens + replies_tokens > limit:
                context, context_tokens, sent = fit_tool_round(self.estimator, context, replies, limit)
                if context_tokens + int(self.estimator.count_messages(sent)) > limit:
                    # The engine's context is gone and this turn's tool results are cut, and its own tool
                    # calls still take the request over the budget (a provider refuses such a request):
                    # the loop ends here, as at its step limit, never with a request over the budget.
                    log.warning("turn of session %s: its tool calls outgrew the token budget after %d steps",
                                session_id, _step)
                    replies.append({"role": "assistant", "content": STOPPED_OVER_BUDGET})
                    return replies
            else:
                sent = replies
            request = [{"role": "system", "content": system}, *context, user, *sent]
            response = self.model.complete(
                request,
                tools or None,
                max_tokens=self.settings.max_output_tokens,
                timeout=self.settings.model_timeout_seconds,
            )
            # The model's answer, not the caller's input: an invalid one is the provider's failure
            # (ModelError; InvalidInput would read as the caller's mistake), and only an assistant
            # message answers (a user, system or tool one was committed as the turn's answer).
            try:
                reply = validate_message(response.message)
            except InvalidInput as e:
                raise ModelError(f"the model answered an invalid message: {e}") from None
            if reply.get("role") != "assistant":
                raise ModelError(f"the model answered a {reply.get('role')!r} message, not an assistant's")
            replies.append(reply)
            calls = reply.get("tool_calls") or []
            if not calls:
                return replies
            results = []
            for call in calls:
                if ran_tools is not None:
                    ran_tools.append(str(call.get("id", "")))
                results.append(self._run_tool(engine, info, scope, session_id, call, engine_tools))
            replies += results
            replies_tokens += int(self.estimator.count_messages([reply, *results]))
        replies.append({"role": "assistant", "content": "(stopped: the tool loop reached its step limit)"})
        return replies

    def _engine_tools(self, engine: Any, info: EngineInfo) -> dict[str, Any]:
        """The engine's tools by name, as OpenAI function schemas (a schema without a name is its fault)."""
        get_schemas = getattr(engine, "get_tool_schemas", None)
        if get_schemas is None:
            return {}

        def read() -> dict[str, Any]:
            out = {}
            for schema in get_schemas() or []:
                fn = schema.get("function", schema)
                out[fn["name"]] = {"type": "function", "function": fn}
            return out

        return self._call(info.id, "get_tool_schemas", read)

    def _run_tool(
        self,
        engine: Any,
        info: EngineInfo,
        scope: str,
        session_id: str,
        call: dict[str, Any],
        engine_tools: dict[str, Any],
    ) -> dict[str, Any]:
        name = call["function"]["name"]
        try:
            args = json.loads(call["function"].get("arguments") or "{}")
        except (ValueError, TypeError, RecursionError):
            # Not only malformed JSON: an integer of more digits than Python converts (ValueError, not a
            # JSONDecodeError), nesting past the recursion limit, arguments that are no string. The model
            # hears it, as it hears any tool's error; the turn goes on.
            args = None
        if not isinstance(args, dict):
            content = json.dumps({"error": f"the arguments of tool {name!r} are not a JSON object it can read"})
        elif name in engine_tools and info.id in self.quarantined:
            content = json.dumps({"error": f"tool {name!r} is unavailable: its context engine failed"})
        elif name in engine_tools:
            handler = getattr(engine, "handle_tool_call", None)

            def run() -> Any:
                if handler is None:  # offered tools, cannot run them: the engine's failure, quarantined
                    raise EngineContractError(f"engine {info.id!r} offers tools but has no handle_tool_call()")
                return handler(name, args, scope=scope, session_id=session_id)

            try:
                content = self._call(info.id, "handle_tool_call", run)
            except Exception as e:
                if info.id == LEGACY or self._database_failed(e):
                    raise
                # The engine is quarantined now, but the turn has started: the host tools it ran must not
                # run again on legacy. The model learns the tool failed and answers; the accepted turn
                # waits in the outbox for the engine, as after a failed commit.
                content = json.dumps({"error": f"tool {name!r} failed: {type(e).__name__}"})
        elif name in self.host_tools:
            content = self.host_tools[name][1](args)
        else:
            content = json.dumps({"error": f"unknown tool {name!r}"})
        return {"role": "tool", "tool_call_id": call["id"], "content": str(content)}

    def _after_turn(
        self,
        engine: Any,
        info: EngineInfo,
        scope: str,
        session_id: str,
        admission: Admission,
        terminal: Anchor,
        host: dict[str, Any],
    ) -> None:
        method = getattr(engine, "after_turn", None)
        if method is not None and info.id not in self.quarantined:  # quarantined during the turn: not again
            params = project_params(
                info, {"scope": scope, "session_id": session_id, "admission": admission, "terminal": terminal}, host
            )
            try:
                self._call(info.id, "after_turn", lambda: method(**params))
            except Exception as e:  # after the commit: never fails the turn
                log.warning("after_turn of engine %s failed after the turn committed: %s", info.id, e)
        self._maintain(engine, info, scope, session_id, host, "the turn committed")

    def _maintain(
        self, engine: Any, info: EngineInfo, scope: str, session_id: str, host: dict[str, Any], after: str
    ) -> None:
        """The engine's ``maintain`` after a completed turn or a compaction: inline in foreground mode,
        deferred to the maintenance thread in background mode; a failure never reaches the caller."""
        method = getattr(engine, "maintain", None)
        if method is None or info.id in self.quarantined:
            return
        params = project_params(info, {"scope": scope, "session_id": session_id}, host)
        if info.turn_maintenance_mode == "background":
            # Deferred work (OpenClaw's background mode): the reply does not wait for it.
            self.maintenance.schedule((info.id, scope, session_id), params)
            return
        try:
            self._call(info.id, "maintain", lambda: method(**params))
        except Exception as e:
            log.warning("maintain of engine %s failed after %s: %s", info.id, after, e)

    def _maintain_after_bootstrap(
        self, engine: Any, info: EngineInfo, scope: str, session_id: str, fence: Anchor | None, host: dict[str, Any]
    ) -> None:
        """OpenClaw's maintenance with reason "bootstrap": the engine's ``maintain`` right after the
        bootstrap of a turn, before the prompt is assembled, inline whatever the engine's
        turn-maintenance mode, inside the turn's fence (given as ``fence``).

        Only for a ``maintain`` that declares a ``fence`` keyword, and only with a fence to give it: the
        turn's user entry is in the transcript already, and a maintain reading the session as it is (no
        fence) could read it, or compact it into a summary before the turn is committed. Such an engine
        is maintained after the turn's commit, as always. A failure is logged and handled as the other
        inline passes': the engine's failure quarantines it (``_call``), and this turn then runs on
        legacy (it has not started: nothing was assembled yet); a database's failure is logged and the
        turn goes on with the engine. A fence that no longer holds raises ``ReadFenceError`` as the
        bootstrap's would (the turn degrades).
        """
        method = getattr(engine, "maintain", None)
        if method is None or info.id in self.quarantined:
            return
        if fence is None or not takes_keyword(method, "fence"):
            log.debug("engine %s: no maintain after bootstrap of %s (it takes no fence)", info.id, session_id)
            return
        params = project_params(info, {"scope": scope, "session_id": session_id, "fence": fence}, host)
        try:
            self._call(info.id, "maintain", lambda: method(**params))
        except ReadFenceError:
            raise
        except Exception as e:
            log.warning("maintain of engine %s failed after its bootstrap: %s", info.id, describe(e))
            if info.id in self.quarantined:  # the engine's own failure: the turn must not go on with it
                raise

    # ------------------------------------------------------------------------------------ operations

    def compact(self, scope: str, session_id: str, *, focus: str | None = None, force: bool = True) -> CompactResult:
        """Manual compaction through the selected engine (host requirements fail closed)."""
        check_focus(focus)  # refused here too, not only in the engine (which may be isolated)
        if not isinstance(force, bool):
            raise InvalidInput(f"force must be a bool, not {type(force).__name__}")
        session_id = self.resolve_session(scope, session_id)
        sess = self.store.get_session(scope, session_id)
        self._settle_background_failures()
        engine, info = self._engine_or_legacy()
        self._check_requirements(info, "manual-compact")
        # The prompt's budget, as before a prompt (the budget less the reply, the system prompt and the
        # tools' schemas; no user message is known here): a compaction to the whole token_budget would
        # leave more than assemble then takes.
        with self._typed_engine_errors(info.id, "compaction"):
            tools = [s for s, _ in self.host_tools.values()] + list(self._engine_tools(engine, info).values())
            budget = self.prompt_budget(self._carried_tokens(tools))
            # A turn still running on the session (admitted, not completed): its admitted message is no
            # engine's to read yet, a compaction's neither. Unfenced, the built-in compaction counted it
            # among the keep_last kept verbatim and named it in the pointer, before the turn committed.
            fence = self._running_fence(scope, session_id)
            rt = RuntimeContext(self, scope, session_id, fence, None, budget)
            host = {"session_key": sess.session_key, "runtime_context": rt}
            self._bootstrap_before_compaction(engine, info, scope, session_id, host, fence)
            base = {"scope": scope, "session_id": session_id, "force": force, "focus": focus, "token_budget": budget}
            params = project_params(info, _fenced(getattr(engine, "compact", None), base, fence), host)

            result = self._call(
                info.id, "compact", lambda: self._engine_compact(engine, info, scope, session_id, rt, params)
            )
        current = self.follow(scope, session_id, result.session_target)
        if result.compacted:  # the contract's "maintain follows a compaction"
            # a successor session is not the one the runtime context and session key were made for
            self._maintain(engine, info, scope, current, host if current == session_id else {}, "a compaction")
        return result

    def _engine_compact(
        self, engine: Any, info: EngineInfo, scope: str, session_id: str, rt: RuntimeContext, params: dict[str, Any]
    ) -> CompactResult:
        """The engine's ``compact(**params)`` (run inside ``_call``): for ``/compact`` and the overflow recovery.

        Validated inside the engine guard: an answer that is no CompactResult is the engine's failure
        (quarantined), as an exception of its compact is, not a ValidationError out of the host."""
        method = getattr(engine, "compact", None)
        if not callable(method):
            # ``compact`` is optional: an engine without it was called all the same, and its
            # AttributeError quarantined it for the process. One that leaves compaction to the
            # host gets the host's (as its delegate would); one that owns compaction, none.
            if info.owns_compaction:
                return CompactResult(ok=True, compacted=False, reason="the engine has no compact()")
            return rt.delegate_compaction_to_runtime(force=params["force"], focus=params["focus"])
        answer = method(**params)
        try:
            done = CompactResult.model_validate(answer)
        except ValidationError as e:
            raise EngineContractError(f"engine {info.id!r} compact answered no CompactResult: {e}") from None
        if done.compacted and not info.owns_compaction:
            # The session compacted (the legacy engine's compact is the built-in compaction, with a pause of
            # its own): the built-in's pause before the prompt, after an earlier failure, is over too.
            self.summary_backoff.succeeded((scope, session_id))
        return self._checked_target(info, scope, session_id, done)

    @contextmanager
    def _typed_engine_errors(self, engine_id: str, operation: str) -> Iterator[None]:
        """An engine's own exception (a KeyError of its code) as ``EngineError``, the store's errors as
        they are (a driver's translated): an operation outside a turn that FAILED in its engine is not
        run again on legacy (an engine that cannot be used at all is replaced by legacy before it starts,
        ``_engine_or_legacy``), and its caller (the CLI's chat loop, an operator's script) handles the
        library's errors. The engine is quarantined as for any failed call (``_call``)."""
        try:
            yield
        except TranscriptStoreError:
            raise
        except DBAPIError as e:
            raise self.store.db.translate(e) from e
        except Exception as e:
            raise EngineError(f"engine {engine_id!r} failed during {operation}: {describe(e)}") from e

    def _running_fence(self, scope: str, session_id: str) -> Anchor | None:
        """The fence of a turn still running on the session (its admitted intent's anchor), else None.

        Not of one whose worker is gone (``outbox.abandoned_admitted``: a chat killed mid-turn), which the
        session's next turn discards: once its message was branched away (the next chat's ``/branch``),
        fenced there every manual compaction was ``ReadFenceError`` until a turn ran."""

        def read(c: Core) -> list[Any]:
            gone = {lease.turn_id for lease in outbox.abandoned_admitted(c, scope, session_id)}
            return [
                i for i in outbox.pending(c, scope, session_id) if i.state == "admitted" and i.turn_id not in gone
            ]

        running = self.store.read(read)
        return running[0].admission.anchor if running else None

    def _bootstrap_before_compaction(
        self, engine: Any, info: EngineInfo, scope: str, session_id: str, host: dict[str, Any], fence: Anchor | None
    ) -> None:
        """Let an engine ingest what the transcript holds and it has not seen before it compacts.

        An engine that keeps its own copy (lossless) compacts that copy: messages it never ingested (turns
        that ran on legacy, the history of a session from before the engine was selected) would be
        missing from it, and the compaction would make no progress on a long transcript. Fenced at the
        admission of a turn still running on the session, whose messages no engine may read yet.
        """
        bootstrap = getattr(engine, "bootstrap", None)
        if bootstrap is None:
            return
        params = project_params(info, {"scope": scope, "session_id": session_id, "fence": fence}, host)
        try:
            self._call(info.id, "bootstrap", lambda: bootstrap(**params))
        except ReadFenceError as e:  # the running turn's entry moved: compact what the engine holds
            log.warning("compaction of %s: the engine could not import first: %s", session_id, e.reason)

    def _engine_or_legacy(self) -> tuple[Any, EngineInfo]:
        """The configured engine for an operation outside a turn, or legacy when it is quarantined, not
        installed or fails to load (as a turn would degrade)."""
        engine_id = self.settings.engine if self.settings.engine not in self.quarantined else LEGACY
        try:
            return self.engine(engine_id)
        except EngineError:
            return self.engine(LEGACY)

    def spawn_subagent(
        self,
        scope: str,
        parent_session_id: str,
        child_session_key: str,
        run_child: Callable[[str], T],
        *,
        context_mode: str = "isolated",
        ttl_seconds: float | None = None,
    ) -> T:
        """Run a child session: prepare_subagent_spawn first, rollback if the spawn fails, then ended."""
        if context_mode not in ("isolated", "fork"):
            raise InvalidInput("context_mode is isolated or fork")
        if not callable(run_child):
            raise InvalidInput(f"run_child must be callable, not {type(run_child).__name__}")
        # The caller's value, handed to the engine's hook: a mistake of it is the caller's (InvalidInput), never
        # the engine's (a hook refusing it quarantined the engine for the process).
        if ttl_seconds is not None and (
            isinstance(ttl_seconds, bool)
            or not isinstance(ttl_seconds, int | float)
            or not 0 < ttl_seconds < math.inf
        ):
            shown = repr(ttl_seconds) if isinstance(ttl_seconds, int | float) else type(ttl_seconds).__name__
            raise InvalidInput(f"ttl_seconds must be a positive finite number of seconds or None, not {shown}")
        parent = self.store.get_session(scope, parent_session_id)
        # As before a turn or a compaction: an engine whose deferred maintenance failed is quarantined
        # first, and the child spawns on legacy; its hooks were called on the failed engine otherwise.
        self._settle_background_failures()
        engine, info = self._engine_or_legacy()  # best effort: a broken engine spawns on legacy
        self._check_requirements(info, "subagent-spawn")
        child = self.store.open_session(scope, child_session_key)
        prep: SubagentSpawnPreparation | None = None
        prepare = getattr(engine, "prepare_subagent_spawn", None)
        if prepare is not None:
            prep = self._best_effort(
                info.id,
                "prepare_subagent_spawn",
                lambda: prepare(
                    scope=scope,
                    parent_session_key=parent.session_key,
                    child_session_key=child_session_key,
                    context_mode=context_mode,
                    ttl_seconds=ttl_seconds,
                ),
            )
        try:
            result = run_child(child.session_id)
        except BaseException:
            rollback = getattr(prep, "rollback", None)  # None, or whatever the engine returned
            if rollback is not None:
                self._best_effort(info.id, "subagent_rollback", rollback)
            raise  # the child's own failure, never one of the hooks'
        ended = getattr(engine, "on_subagent_ended", None)
        if ended is not None:
            self._best_effort(
                info.id,
                "on_subagent_ended",
                lambda: ended(scope=scope, child_session_key=child_session_key, reason="completed"),
            )
        return result

    def _best_effort(self, engine_id: str, operation: str, fn: Callable[[], T]) -> T | None:
        """A subagent hook: its failure quarantines the engine (``_call``) and is logged, but the spawn goes
        on as it would on legacy, which has no such hooks (a failing prepare leaves the child unprepared, a
        failing end hook does not lose the finished child's result). A quarantined engine is not called."""
        if engine_id in self.quarantined:
            return None
        try:
            return self._call(engine_id, operation, fn)
        except Exception as e:
            log.warning("%s of engine %s failed; the subagent goes on without it: %s", operation, engine_id,
                        describe(e))
            return None

    def _maintain_in_background(self, key: tuple[str, str, str], params: dict[str, Any]) -> None:
        """One deferred ``maintain`` pass (the maintenance thread), logged when it fails.

        It changes nothing of the runtime's own: it calls the live instance only (an engine quarantined
        or disposed since is skipped, none is created here), and a failure is handed to the caller's
        thread, which quarantines the engine before its next turn or compaction. Quarantining it here
        would pull it from under a turn already running on it on the caller's thread (that turn's
        commit would find the engine gone, and its accepted turn would wait in the outbox).
        """
        engine_id, scope, session_id = key
        # list() copies the deque in one step: the caller's thread may be taking from it meanwhile
        failed = [f[0] for f in list(self._failed_in_background)]
        with self._engines_lock:  # the instance looked up and marked in use at once: ``dispose`` sees it
            live = self._engines.get(engine_id)
            if live is None or engine_id in self.quarantined or engine_id in failed:
                return
            self._passing = live[0]
        params = dict(params)
        ctx = params.get("runtime_context")
        if isinstance(ctx, RuntimeContext):  # the turn that asked is over: no fence, no turn id
            params["runtime_context"] = RuntimeContext(self, scope, session_id, None, None, ctx.budget, ctx.values)
        try:
            live[0].maintain(**params)
        except Exception as e:
            log.warning("background maintain of engine %s for %s/%s failed: %s", engine_id, scope, session_id,
                        describe(e))
            if not self._database_failed(e):
                self._failed_in_background.append((engine_id, e))
        finally:
            with self._engines_lock:
                self._passing = None
                left, self._dispose_after_pass = self._dispose_after_pass, None
            if left is not None:  # ``dispose`` ran while this pass did: its engine is released now
                log.info("the maintenance pass of %s ended: its engine is disposed of", left[0])
                _dispose_engine(*left)

    def _settle_background_failures(self) -> None:
        """Quarantine the engines whose deferred maintenance failed (the caller's thread, between turns)."""
        while self._failed_in_background:
            engine_id, error = self._failed_in_background.popleft()
            if engine_id not in self.quarantined:
                self.quarantine(engine_id, "maintain", error)

    def dispose(self) -> None:
        """Let deferred maintenance finish (bounded), write pending quarantine records, stop renewing
        leases and dispose of every engine it made (those quarantined since too: their resources are released;
        one a maintenance pass still runs on as that pass ends); no engine is made after it (EngineError)."""
        self.maintenance.close()
        self._leases.close()
        self._settle_background_failures()
        if not self.flush_quarantines():
            log.error(
                "quarantine records not written, the database refusing them: %s (this process isolated "
                "those engines; other processes will not see the records)",
                ", ".join(e for e, _o, _r in self._unrecorded),
            )
        with self._engines_lock:  # from here no engine is made or kept (a request still running)
            self._disposed = True
            live = [(engine_id, engine) for engine_id, (engine, _info) in self._engines.items()]
            made = [*self._retired, *live]
            self._engines.clear()
            self._retired.clear()
            # A maintenance pass that outlived close's wait: disposing its engine under it would pull its
            # state (and perhaps its store) from a pass that still writes. The pass disposes of it as it ends.
            running = [(engine_id, engine) for engine_id, engine in made if engine is self._passing]
            self._dispose_after_pass = running[0] if running else None
        for engine_id, engine in made:
            if (engine_id, engine) in running:
                log.warning("a maintenance pass of %s is still running: the engine is disposed of when it ends",
                            engine_id)
                continue
            _dispose_engine(engine_id, engine)


def _exited(engine_id: str, operation: str, error: SystemExit) -> EngineContractError:
    """An engine's SystemExit as its failure."""
    return EngineContractError(f"context engine {engine_id!r}: {operation} raised SystemExit({error.code!r})")


def _dispose_engine(engine_id: str, engine: Any) -> None:
    """An engine's ``dispose``, when it has one; its failure is logged, never raised (a SystemExit of the
    plugin's too: it stopped the dispose of the engines after it, and a service's close of its store)."""
    dispose_engine(engine, engine_id)
