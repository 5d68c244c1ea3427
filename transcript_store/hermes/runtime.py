"""What engine copies share (store, engine, locks, caches) and the adapter's configuration."""

from __future__ import annotations

import copy
import json
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine import EngineContext
from ..registry import EngineRegistry
from ..settings import PLUGIN_DIRS_ENV
from ..store import TranscriptStore
from .config import DEFAULT_SCOPE, DEFAULT_THRESHOLD, resolve_threshold, threshold_tokens
from .messages import fingerprint

_RUNTIME_LOCK = threading.Lock()  # module level: never part of an engine's copied state
#: configuration -> the runtime its engine copies share. hermes-agent deep-copies the engine for every
#: agent and never closes one; a runtime per copy held a pool of its own (on PostgreSQL a server
#: connection each until garbage-collected, and the gateway caches 128 agents against a server's
#: default of 100 connections) and caches of its own that told copies of one process different things.
_SHARED_RUNTIMES: dict[str, _Runtime] = {}
#: the engine copy whose agent made this thread's latest model call (``mark_turn``): hermes-agent's
#: ``post_llm_call`` plugin hook, run in the same thread at the end of the turn, names no agent
_TURN = threading.local()
#: Hermes session id -> the engine copy last bound to it with a session database (``bind_session_state``):
#: the ``on_session_end`` plugin hook (``end_turn``) names the session only
_BOUND: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
#: Hermes session id -> the engine copy last told it (``bind_session_state``, ``on_session_start``), with a
#: session database or without: ``end_turn`` stores an unfinished turn of an agent without one through it
_LIVE: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


@dataclass
class _Candidate:
    """A compress answer the host may or may not have taken.

    ``head``, ``last`` and ``last_len`` are set when the answer ends with a user message (a compaction at
    the start of a turn): the fingerprints of the answer without it and of it alone, and the length of its
    stripped text. Hermes merges the user message it appends after an answer (its todo snapshot) into
    that one before the next request (``repair_message_sequence``): the answer comes back with its last
    message longer, and is told by these (``merged_into``)."""

    fp: str
    length: int
    store_session: str
    next_ordinal: int
    head: str | None = None
    last: str | None = None
    last_len: int = 0
    of: str | None = None  # ``before_last``: the fingerprint of the whole answer (not written to the index)
    #: the fingerprint and count of the answer's leading context messages, when a fresh tail follows them
    #: (``context_only``: an ``/undo`` of the tail's turn leaves the view holding these alone)
    ctx: str | None = None
    ctx_len: int = 0

    def merged_into(self, cleaned: Sequence[dict[str, Any]]) -> bool:
        """Whether ``cleaned`` (at least ``length`` clean messages) starts with this answer whose last
        message Hermes merged a following user message into (its text, a blank line, the rest)."""
        if self.head is None or self.last is None or self.length < 2 or len(cleaned) < self.length:
            return False
        m = cleaned[self.length - 1]
        text = m.get("content")
        if m.get("role") != "user" or not isinstance(text, str):
            return False
        text = text.strip()
        rest = text[self.last_len:]
        if "\n\n" not in rest[: len(rest) - len(rest.lstrip())]:
            return False
        own = {**m, "content": text[: self.last_len]}
        return fingerprint([own]) == self.last and fingerprint(list(cleaned[: self.length - 1])) == self.head

    def context_only(self) -> _Candidate:
        """The answer's leading context messages alone, the fresh tail after them taken back (an ``/undo``
        of its turn): a candidate of its own, adopted in place of the whole answer."""
        tail = self.length - self.ctx_len
        return _Candidate(self.ctx or "", self.ctx_len, self.store_session, self.next_ordinal - tail, of=self.fp)

    def before_last(self) -> _Candidate:
        """The answer without its last message, which the host's list holds changed (an edit of it): a
        candidate of its own (``head`` its fingerprint), adopted in place of the whole answer."""
        return _Candidate(self.head or "", self.length - 1, self.store_session, self.next_ordinal - 1, of=self.fp)


@dataclass(frozen=True)
class _Visible:
    """A store session's visible transcript as ingest last saw it (what host lists are aligned with)."""

    head: str | None  # the session's head entry then: unchanged head, unchanged transcript
    generation: int
    digests: tuple[str, ...]
    entry_ids: tuple[str, ...]
    seqs: tuple[int, ...]
    #: the session's incarnation: one deleted and made again under its id (someone else's session, its
    #: own head, generation 0 and seqs from 0) is read afresh, never aligned by this cache
    incarnation: int = 0
    #: (a host message's digest, its ``api_content``'s (``ingest._sent``), the stored message's digest) for
    #: each message found to be a stored one in Hermes' saved spelling (``spelling.spelled``): a list
    #: holding it again aligns by it, without reading the stored row again (``ingest.respelled``)
    respelled: frozenset[tuple[str, str, str]] = frozenset()


EMPTY = _Visible(None, -1, (), (), ())


@dataclass(frozen=True)
class _Selection:
    """One session's last ``select_context`` answer, kept so that each call gets a list of its own.

    The body (the engine's context: the store's messages and summaries, JSON by construction) is kept
    as its JSON text: parsing it again is a full copy at a third of ``copy.deepcopy``'s cost. The system
    messages (and Hermes' prefill messages after them) are the request's own, a few, deep-copied."""

    key: str
    system: list[dict[str, Any]]
    body: str | None

    def messages(self) -> list[dict[str, Any]] | None:
        """A fresh copy of the selection (None: the request stays as it is)."""
        if self.body is None:
            return None
        body: list[dict[str, Any]] = json.loads(self.body)
        return copy.deepcopy(self.system) + body


@dataclass
class _Runtime:
    """Everything that must not be copied: store, engine, locks, caches."""

    store: TranscriptStore
    engine: Any
    lock: threading.RLock = field(default_factory=threading.RLock)
    session_locks: dict[str, threading.Lock] = field(default_factory=dict)
    #: answer fingerprint -> store session -> candidate (two lineages may get the same answer), newest last
    candidates: dict[str, dict[str, _Candidate]] = field(default_factory=dict)
    adopted: dict[str, str] = field(default_factory=dict)  # store session -> adopted fp
    pending: dict[str, str] = field(default_factory=dict)  # store session -> newest unadopted fp
    aliases: dict[str, str] = field(default_factory=dict)  # hermes session -> store session
    #: store session -> (request key, system messages, the selected body as JSON or None): handed out as
    #: fresh copies only (``_Selection``), never the cached objects a caller could change
    selections: dict[str, _Selection] = field(default_factory=dict)
    visible: dict[str, _Visible] = field(default_factory=dict)  # store session -> its visible transcript
    warned: set[str] = field(default_factory=set)  # user turns whose fresh tail alone was at the trigger
    index_seq: int = -1  # the candidate index is read up to here
    loaded: bool = False
    key: str = ""  # its configuration, in ``_SHARED_RUNTIMES``
    factory: Any = None  # the summarizer factory, kept alive while its id is part of ``key``
    users: int = 0  # the engine copies using it (guarded by ``_RUNTIME_LOCK``)

    def session_lock(self, store_session: str) -> threading.Lock:
        """The lock serializing ingestion into one store session."""
        with self.lock:
            return self.session_locks.setdefault(store_session, threading.Lock())


class RuntimeMixin:
    """The adapter's configuration, its copies and its shared runtime."""

    last_prompt_tokens: int = 0
    last_completion_tokens: int = 0
    last_total_tokens: int = 0
    threshold_tokens: int = 0
    context_length: int = 0
    compression_count: int = 0
    request_overhead: int = 0

    def __init__(
        self,
        *,
        engine: str = "lossless",
        db_url: str | None = None,
        scope: str = DEFAULT_SCOPE,
        context_length: int = 128000,
        threshold_percent: float = DEFAULT_THRESHOLD,
        engine_config: dict[str, Any] | None = None,
        summarizer_factory: Callable[[], Any] | None = None,
        model_thresholds: dict[str, Any] | None = None,
        plugin_dirs: Sequence[str] | None = None,
    ) -> None:
        """Configure the adapter; nothing is opened until the first call that needs the store."""
        self.engine_id = engine
        # Engine plugin folders besides entry points (those of TRANSCRIPT_STORE_PLUGIN_DIRS are added
        # when the runtime opens): an engine ``hermes install`` found in one must load here too.
        self.plugin_dirs: list[str] = [str(d) for d in plugin_dirs or ()]
        self.db_url = db_url
        self.scope = scope
        self.engine_config = dict(engine_config or {})
        self.summarizer_factory = summarizer_factory
        #: the configured threshold (a fraction of the window, or a token count above 1); Hermes reads
        #: ``threshold_percent``, always a fraction
        self.threshold_setting: float = threshold_percent
        self.model_thresholds: dict[str, Any] = dict(model_thresholds or {})
        self.model = ""
        self.session_id: str | None = None
        #: Hermes session ids this agent switched to by ``/branch`` (``bind_session_state``): their first
        #: list starts with the parent's compress answer, and forks its lineage instead of joining it
        self.branches: set[str] = set()
        self.last_prompt_tokens = 0
        self.last_completion_tokens = 0
        self.last_total_tokens = 0
        self.compression_count = 0
        self.request_overhead = 0  # what Hermes' requests carry besides the messages (compress_target)
        self._overheads: list[int] = []  # its last measures
        self.context_length = int(context_length)
        self.threshold_tokens = threshold_tokens(self.context_length, threshold_percent)
        self._rt: _Runtime | None = None
        self._session_db: Any = None  # Hermes' session database (``bind_session_state``), never copied

    # ------------------------------------------------------------------------------------ copies

    def __getstate__(self) -> dict[str, Any]:
        """The plain configuration and counters: no store, engine, connection or lock."""
        state = dict(self.__dict__)
        state["_rt"] = None
        state["_session_db"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a copy; its runtime opens lazily."""
        state = dict(state)
        if "threshold_percent" in state:  # pickled before ``threshold_setting``: the setting as it was
            state.setdefault("threshold_setting", state.pop("threshold_percent"))
        self.__dict__.update(state)
        self._rt = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy with its own lazily opened runtime."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        # A snapshot (one C-level copy): another thread's compress may set an attribute for the first time
        # while this copies, and iterating the live dict then raises.
        for k, v in dict(self.__dict__).items():
            new.__dict__[k] = None if k in ("_rt", "_session_db") else copy.deepcopy(v, memo)
        return new

    # ------------------------------------------------------------------------------------ threshold

    @property
    def threshold_percent(self) -> float:
        """The trigger as the fraction of the window Hermes reads it as (its startup line \"compress at N%\",
        its ``/model`` switch warning, which multiplies the new window by it).

        The setting itself when it is a fraction (``model_thresholds`` applied), else the share of the
        current window the trigger is: a threshold set in tokens (``threshold_setting``) read here as
        the count, 2,500 tokens were \"compress at 250000%\", and the switch warning, predicting a trigger
        of 2,500 windows, never came."""
        setting = getattr(self, "threshold_setting", DEFAULT_THRESHOLD)
        try:
            pct = float(resolve_threshold(self.model, getattr(self, "model_thresholds", None), setting))
        except (TypeError, ValueError):
            pct = 0.0
        if 0 < pct < 1:
            return pct
        window = self.context_length
        return self.threshold_tokens / window if window > 0 and self.threshold_tokens > 0 else 0.0

    @threshold_percent.setter
    def threshold_percent(self, value: float) -> None:
        """The threshold setting: a fraction of the window, or a token count above 1 (Hermes writes a
        fraction when its compression model's window is smaller than the trigger)."""
        self.threshold_setting = value

    # ------------------------------------------------------------------------------------ runtime

    @property
    def name(self) -> str:
        """The engine name Hermes selects with ``context.engine``."""
        return self.engine_id

    def database_url(self) -> str:
        """The store URL: the configured one, else $TRANSCRIPT_STORE_URL, else $HERMES_HOME/transcript-store.db."""
        if self.db_url:
            return self.db_url
        env = os.environ.get("TRANSCRIPT_STORE_URL")
        if env:
            return env
        home = Path(os.environ.get("HERMES_HOME") or Path.home() / ".hermes")
        home.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{home / 'transcript-store.db'}"

    def runtime(self) -> _Runtime:
        """The store and engine of this copy, opened on first use and shared with every copy of the same
        configuration in the process (thread-safe)."""
        rt = self._rt
        if rt is not None:
            return rt
        with _RUNTIME_LOCK:
            if self._rt is None:
                url = self.database_url()
                env_dirs = [d for d in os.environ.get(PLUGIN_DIRS_ENV, "").split(os.pathsep) if d]
                dirs = [*getattr(self, "plugin_dirs", []), *env_dirs]
                factory = self.summarizer_factory
                key = json.dumps(
                    [url, self.engine_id, self.scope, self.engine_config, dirs, id(factory) if factory else None],
                    sort_keys=True, default=repr,
                )
                rt = _SHARED_RUNTIMES.get(key)
                if rt is None:
                    store = TranscriptStore(url)
                    try:
                        summarizer = factory() if factory else None
                        ctx = EngineContext(store=store, config=self.engine_config, summarizer=summarizer)
                        engine, _info = EngineRegistry(dirs).create(self.engine_id, ctx)
                    except BaseException:
                        store.close()
                        raise
                    rt = _Runtime(store=store, engine=engine, key=key, factory=factory)
                    _SHARED_RUNTIMES[key] = rt
                rt.users += 1
                self._rt = rt
            return self._rt

    def close(self) -> None:
        """Release this copy's runtime; the store closes with the last copy using it (it reopens on the
        next use)."""
        with _RUNTIME_LOCK:
            rt, self._rt = self._rt, None
            if rt is None:
                return
            rt.users -= 1
            last = rt.users <= 0
            if last and _SHARED_RUNTIMES.get(rt.key) is rt:
                del _SHARED_RUNTIMES[rt.key]
        if last:
            rt.store.close()
