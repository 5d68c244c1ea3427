"""transcript-store as a service: the store and the engines behind bearer tokens, one scope per token.

``Service`` is the whole API without HTTP: every operation takes the caller's scope (which the token
decided, never the request) and checks that anything the request names (a session, an anchor) is of
that scope, so another scope's session looks exactly like an unknown one. The engine lifecycle is the
host runtime's calling convention (``project_params``), with a host transcript mirror in front of it
for hosts that keep their own transcript: ``bootstrap`` imports it page by page and ``commit_turn``
mirrors the accepted turn and commits it through the engine's ledger in ONE transaction.
``service_app`` puts HTTP on top.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from sqlalchemy import text

from . import compaction, mirror
from .core import Core, check_anchor, check_id, derived_id, session_info
from .engine import (
    AssembleResult,
    BootstrapResult,
    CompactResult,
    EngineInfo,
    EngineSelection,
    Limits,
    MaintainResult,
    RuntimeInfo,
    RuntimeSettings,
    durable_declaration,
    project_params,
    takes_keyword,
)
from .errors import (
    AdvancementKeyCollision,
    EngineContractError,
    IdempotencyConflict,
    InvalidInput,
    MirrorConflict,
    ReadFenceError,
    SessionDeleted,
    SessionKeyConflict,
    TranscriptStoreError,
    TransientStoreError,
    UnknownEngine,
    UnknownSession,
)
from .fences import MAX_TURN_BYTES
from .host import HostRuntime, RuntimeContext, _assembled
from .ledger import (
    DEFAULT_RECEIPTS_PAGE,
    CommitResult,
    Receipt,
    ReceiptPage,
    get_receipt,
)
from .models import (
    Admission,
    Anchor,
    DeltaMissing,
    DeltaPage,
    DeltaReset,
    Entry,
    SessionInfo,
    check_json,
    validate_message,
)
from .registry import EngineRegistry
from .service_models import (
    AdmitRequest,
    AppendRequest,
    AssembleRequest,
    BootstrapRequest,
    BootstrapResponse,
    BootstrapState,
    CommitTurnRequest,
    CommitTurnResponse,
    CompactRequest,
    DeltaRequest,
    EngineDescription,
    EngineSummary,
    HostCompactionRequest,
    HostCompactionResponse,
    MaintainRequest,
    OpenSession,
    rebind_problem,
)
from .settings import HostSettings
from .store import AppendItem, TranscriptStore, landed_since, replaced
from .turns import Turns

log = logging.getLogger("transcript_store.service")

TOKENS_ENV = "TRANSCRIPT_STORE_TOKENS"


# ---------------------------------------------------------------------------------------------- tokens


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _printable_token(token: str) -> bool:
    """Whether ``token`` can be a bearer token: non-empty printable ASCII without whitespace (what an HTTP
    header carries: the service reads its Authorization header as Latin-1)."""
    return bool(token) and token.isascii() and token.isprintable() and not any(c.isspace() for c in token)


def _shown(path: object) -> str:
    """A path for an error message, on one printable line (a NUL or lone surrogate escaped)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


#: the largest tokens file read (bytes): a device (/dev/zero) or a stray huge file must not fill memory
MAX_TOKENS_FILE_BYTES = 16 * 1024 * 1024

#: a transaction-scoped lock on one (scope, session key): rebinds of a key queue up on PostgreSQL
_KEY_LOCK = text("SELECT pg_advisory_xact_lock(hashtext(:k))")


def _lock_key(c: Core, scope: str, key: str) -> None:
    """Rebinds of one key wait for each other (SQLite's writers already do): each then finds the one
    before it as the holder instead of racing it into the unique index. Held to the transaction's end."""
    if not c.dialect.is_sqlite:
        c.conn.execute(_KEY_LOCK, {"k": f"{scope}\x1f{key}"})


class TokenMap:
    """Bearer tokens, each mapped to exactly one scope; only their SHA-256 digests are kept.

    A token is non-empty printable ASCII without whitespace; a scope is an id a session can be created
    under. Anything else, from a file, the environment or a caller, is refused with ``InvalidInput``.
    A presented token is looked up by its digest: its own characters are never compared with a known
    token's, so the time a lookup takes says nothing about them.
    """

    def __init__(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Map each (token, scope); a token given twice with two scopes is refused."""
        if isinstance(pairs, str | bytes | Mapping) or not isinstance(pairs, Iterable):
            # A dict's keys would be unpacked as pairs: {"ab": "s"} mapped the token "a" to scope "b".
            raise InvalidInput("tokens must be (token, scope) pairs, not a " + type(pairs).__name__)
        self._scopes: dict[str, str] = {}
        for pair in pairs:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise InvalidInput(f"tokens must be (token, scope) pairs, got a {type(pair).__name__}")
            token, scope = pair
            if not isinstance(token, str):
                raise InvalidInput(f"a token must be a string, not {type(token).__name__}")
            if not token or any(c.isspace() for c in token):
                raise InvalidInput("a token must be non-empty and contain no whitespace")
            if not _printable_token(token):
                # A request's Authorization header is read as Latin-1: such a token could never match.
                raise InvalidInput("a token must be printable ASCII (an HTTP header carries no other)")
            # new: a scope the store cannot create a session under would refuse every request of its token
            check_id("scope", scope, new=True)
            digest = _digest(token)
            if self._scopes.get(digest, scope) != scope:
                raise InvalidInput("a token maps to exactly one scope; one is listed with two")
            self._scopes[digest] = scope

    def __len__(self) -> int:
        """How many tokens are known."""
        return len(self._scopes)

    def scope_for(self, token: str) -> str | None:
        """The scope of a presented token, or None (for anything that is not exactly a known token)."""
        if not isinstance(token, str) or not _printable_token(token):
            return None  # never a known token; and a lone surrogate could not even be hashed
        return self._scopes.get(_digest(token))

    @classmethod
    def parse_file(cls, path: str | Path) -> list[tuple[str, str]]:
        """``token scope`` per line; blank lines and ``#`` comments are skipped."""
        if not isinstance(path, str | os.PathLike):
            raise InvalidInput(f"a tokens file path must be a string, not {type(path).__name__}")
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_TOKENS_FILE_BYTES + 1)
            if len(data) > MAX_TOKENS_FILE_BYTES:
                raise InvalidInput(f"{_shown(path)}: a tokens file is at most {MAX_TOKENS_FILE_BYTES} bytes")
            # utf-8-sig: an editor's byte-order mark would otherwise be part of the first token, which
            # then never matched a request's.
            text = data.decode("utf-8-sig")
        except InvalidInput:
            raise
        # ValueError: a NUL in the path; UnicodeError: a lone surrogate in it, or a file that is not UTF-8
        except (OSError, ValueError) as e:
            raise InvalidInput(f"cannot read {_shown(path)}: {e}") from e
        pairs = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            words = line.split()
            if len(words) != 2:
                raise InvalidInput(f"{_shown(path)}:{number}: expected 'TOKEN SCOPE'")
            pairs.append((words[0], words[1]))
        return pairs

    @classmethod
    def parse_env(cls, value: str) -> list[tuple[str, str]]:
        """``tok1=scopeA,tok2=scopeB``; each item splits at its LAST '=' (a token may end in base64 '='
        padding, a scope never holds '='), and an empty token or scope is refused."""
        if not isinstance(value, str):
            raise InvalidInput(f"{TOKENS_ENV} must be a string, not {type(value).__name__}")
        pairs = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            token, sep, scope = part.rpartition("=")
            if not sep:
                raise InvalidInput(f"{TOKENS_ENV}: expected TOKEN=SCOPE, got an item without '='")
            token, scope = token.strip(), scope.strip()
            if not token or not scope:
                raise InvalidInput(f"{TOKENS_ENV}: expected TOKEN=SCOPE, got an item with an empty token or scope")
            pairs.append((token, scope))
        return pairs

    @classmethod
    def load(cls, path: str | Path | None = None, env: str | None = None) -> TokenMap:
        """Tokens from ``path`` and the TRANSCRIPT_STORE_TOKENS value (``env``; default: the environment)."""
        value = os.environ.get(TOKENS_ENV, "") if env is None else env
        pairs = (cls.parse_file(path) if path is not None and path != "" else []) + cls.parse_env(value)
        return cls(pairs)


# ---------------------------------------------------------------------------------------------- the service


@dataclass
class _Call:
    """One engine lifecycle call's context."""

    engine: Any
    info: EngineInfo
    session: SessionInfo


#: how long closing the service waits for requests still running in their threads
CLOSE_WAIT_SECONDS = 60.0


class InFlight:
    """The service calls running in request threads.

    A request the server stopped waiting for at shutdown (answered 503 once the graceful period was
    over) still runs in its thread: closing the store under it made its write fail half way or land in
    a store being disposed of. ``Service.close`` waits for these calls first.
    """

    def __init__(self) -> None:
        self._count = 0
        self._idle = threading.Condition()

    @contextmanager
    def call(self) -> Iterator[None]:
        """Count one call while it runs."""
        with self._idle:
            self._count += 1
        try:
            yield
        finally:
            with self._idle:
                self._count -= 1
                self._idle.notify_all()

    @property
    def running(self) -> int:
        """How many calls run now."""
        with self._idle:
            return self._count

    def wait_idle(self, timeout: float) -> int:
        """Wait until no call runs, ``timeout`` seconds at most; how many still run."""
        with self._idle:
            self._idle.wait_for(lambda: self._count == 0, timeout)
            return self._count


class Service:
    """Every operation of the HTTP API, for one caller scope at a time (see module doc)."""

    def __init__(self, store: TranscriptStore, settings: HostSettings) -> None:
        """Serve ``store`` with the engines ``settings`` can discover (created on first use)."""
        self.store = store
        self.settings = settings
        self.runtime = HostRuntime(store, settings, model=None, registry=EngineRegistry(settings.plugin_dirs))
        self._lock = threading.Lock()
        #: the calls request threads run now (the HTTP layer counts them; ``close`` waits for them)
        self.inflight = InFlight()

    # ------------------------------------------------------------------------------------ sessions

    def open_session(self, scope: str, req: OpenSession, idempotency_key: str | None = None) -> SessionInfo:
        """Create by id (idempotent), or open by key; ``rebind_key`` (with both) ends the key's other holder
        first. ``idempotency_key`` (the request's ``Idempotency-Key``) names a request without an id: its
        retry finds the session the first attempt made (``_open_once``); beside an id it is refused."""
        _check_request(req, OpenSession)
        problem = rebind_problem(req)  # validated already, unless built with model_construct or changed since
        if problem is not None:
            raise InvalidInput(problem)
        if idempotency_key is not None:
            _check_idempotency_key(idempotency_key)
            if req.session_id is not None:
                # The key is remembered by the session it derives the id of: a request naming its own id
                # leaves no trace of the key, so the same key on another request could not be told from a
                # retry. Such a request is idempotent by its id: the key would do nothing, and is refused.
                raise InvalidInput("an Idempotency-Key names a request without a session_id: this one names "
                                   "its session, and is retried safely by it; send it without the header")
        if req.session_id is None:
            if idempotency_key is not None:
                return self._open_once(scope, idempotency_key, req.session_key)
            if req.session_key is None:
                return self.store.create_session(scope)
            return self.store.open_session(scope, req.session_key)
        check_id("scope", scope)
        check_id("session_id", req.session_id)
        check_id("session_key", req.session_key, optional=True)
        sid, key = req.session_id, req.session_key
        landed: list[SessionInfo] = []  # the session as an attempt that ran to its end left it

        def run(c: Core) -> SessionInfo:
            if landed and req.rebind_key and key is not None:
                # Before the row lock ``landed_since`` takes: every rebind takes the key's lock, then the
                # holder's row. The other way round, a rebind by another caller holding the key's lock and
                # waiting for this session's row (to end it) deadlocked with this retry.
                _lock_key(c, scope, key)
            if landed and landed_since(c, scope, sid, landed[0]):
                # An earlier attempt ran to its end and only its COMMIT was uncertain: its session was
                # ended (a rebind of its key by another caller) or deleted since. Answered as that attempt
                # left it, as ``TranscriptStore.open_session`` answers. (Gone without a tombstone of its
                # incarnation, or another's, is an attempt whose COMMIT did not land: the id is the
                # caller's, not drawn here.)
                return landed[0]
            landed[:] = [self._open_by_id(c, scope, sid, key, req.rebind_key)]
            return landed[0]

        return self.store.write(run)

    def _open_once(self, scope: str, idempotency_key: str, key: str | None) -> SessionInfo:
        """A request without an id, under an Idempotency-Key: the session it creates takes the id the key
        derives (``derived_id``), so the row itself records the request and a retry finds it there (no
        table of keys: a session creation is no hot path, and this is one lookup more). Otherwise as
        without the key: a new session, or (``key``) the active session holding it, created when none does.

        The derived session is the answer once it exists, ended since or not (a retry is answered as the
        first attempt was); one made with another session key is another request's: IdempotencyConflict.
        Deleted since (its tombstone kept), a retry is SessionDeleted, never the session made again."""
        check_id("scope", scope, new=True)
        check_id("session_key", key, optional=True, new=True)
        sid = derived_id("Idempotency-Key\x00" + idempotency_key)
        reused = IdempotencyConflict(
            f"Idempotency-Key {idempotency_key!r} was used for another request (a session with another session_key)"
        )

        landed: list[SessionInfo] = []  # the session an attempt of this call created

        def run(c: Core) -> SessionInfo:
            if landed and landed_since(c, scope, sid, landed[0]):
                # This call's earlier attempt made it and only its COMMIT was uncertain: ended or deleted
                # since. Answered as it was made (``TranscriptStore.create_session``).
                return landed[0]
            row = c.session_row(scope, sid)
            if row is not None:
                if row.session_key != key:
                    raise reused
                return session_info(row)
            if c.deleted(scope, sid, None):
                # An earlier request under the key made the session and it was deleted since (a retry whose
                # answer was lost): made again, it is a session its deleter saw go.
                raise SessionDeleted(scope, sid, f"the request under Idempotency-Key {idempotency_key!r}")
            if key is not None:
                holder = c.find_session_by_key(scope, key)
                if holder is not None:  # nothing to create: the key's holder, as without the header
                    return session_info(holder)
            try:
                landed[:] = [c.create_session(scope, sid, key)]
                return landed[0]
            except IdempotencyConflict:  # the same key's other request made the session after the lookup
                raise reused from None
            except SessionKeyConflict:
                # Another open of ``key`` created its holder after the lookup: that session is the answer
                # (``TranscriptStore.open_session``); ended since, the whole transaction runs again.
                holder = c.find_session_by_key(scope, key) if key is not None else None
                if holder is None:
                    raise TransientStoreError(f"the holder of key {key!r} ended while it was opened") from None
                return session_info(holder)

        return self.store.write(run)

    @staticmethod
    def _open_by_id(c: Core, scope: str, sid: str, key: str | None, rebind_key: bool) -> SessionInfo:
        """The session of ``sid``, created when there is none (``rebind_key``: taking ``key`` from its holder)."""
        if c.session_row(scope, sid) is None:
            # Only a session this call creates takes the new-id byte limit: one whose id an earlier
            # release stored longer is still opened by its id (and changes nothing below if so).
            check_id("scope", scope, new=True)
            check_id("session_id", sid, new=True)
            check_id("session_key", key, optional=True, new=True)
        if rebind_key and key is not None:
            _lock_key(c, scope, key)
            holder = c.find_session_by_key(scope, key)
            if holder is not None and holder.session_id != sid:
                own = c.session_row(scope, sid)
                if own is not None and not own.active:
                    # An ended session never holds a key again: ending the holder would leave the key
                    # to nobody (a late replay of an old host session ending the live one). It is
                    # still the session of its id: answered as a create by id answers it (as it is, the
                    # holder keeping the key; asked with another key than its own, IdempotencyConflict:
                    # it was answered as it is, 200, whenever that other key had a holder).
                    return c.create_session(scope, sid, key)
                c.end_session(scope, holder.session_id)
        try:
            return c.create_session(scope, sid, key)
        except SessionKeyConflict:
            if not rebind_key:
                raise
            # The key's holder was made after the lookup above by a request that takes no lock on the key
            # (an open by key, a create by id without rebind_key, an Idempotency-Key open): PostgreSQL's
            # insert waited for it and did nothing. A rebind ends that holder too: the whole transaction
            # runs again and finds it. (SQLite's writers queue up whole: the lookup already saw it there.)
            raise TransientStoreError(f"the key {key!r} was given to another session while it was rebound") from None

    def get_session(self, scope: str, session_id: str) -> SessionInfo:
        """One session of the scope (UnknownSession otherwise)."""
        return self.store.get_session(scope, session_id)

    def list_sessions(self, scope: str, session_key: str | None, after: str | None, limit: int) -> list[SessionInfo]:
        """The active session holding ``session_key``, or the scope's sessions in id order."""
        if session_key is not None:
            # ``after`` does not apply to a key's one session, but one that is not an id is refused all the
            # same (400), as without the key: it was not looked at, and the request answered 200.
            check_id("after", after, optional=True)
            found = self.store.find_session(scope, session_key)
            return [] if found is None else [found]
        return self.store.list_sessions(scope, after=after, limit=limit)

    def delta(self, scope: str, session_id: str, req: DeltaRequest) -> DeltaPage | DeltaReset:
        """A visible-delta page or reset; an unknown session is UnknownSession (a 404), not ``missing``
        (a fenced read of one raises ReadFenceError("missing"), a 409, as a fenced read_visible does)."""
        _check_request(req, DeltaRequest)
        fence = self._own(scope, session_id, req.fence)
        result = self.store.read_visible_delta(
            scope, session_id, req.cursor, max_messages=req.max_messages, max_bytes=req.max_bytes, fence=fence
        )
        if isinstance(result, DeltaMissing):
            raise UnknownSession(scope, session_id)
        return result

    def append(
        self, scope: str, session_id: str, req: AppendRequest, idempotency_key: str | None = None
    ) -> list[Entry]:
        """Append entries as one chain. ``idempotency_key`` (the request's ``Idempotency-Key``) gives each
        item with neither an ``entry_id`` nor an ``idempotency_key`` the key ``header_item_key`` derives,
        so that a retry finds the entries its first attempt appended instead of appending them again."""
        _check_request(req, AppendRequest)
        if isinstance(req.items, str | bytes) or not isinstance(req.items, Sequence):
            # As ``TranscriptStore.prepare`` says it; iterated below first, None was a TypeError (a request
            # built without validation).
            raise InvalidInput("items must be a list of entries")
        for item in req.items:
            if _item_field(item, "idempotency_key").startswith(HEADER_ITEM_KEY_PREFIX):
                # Reserved, so that no caller's key is ever taken for one derived from a header (or the
                # other way round): it would answer that request's entry instead of appending its own.
                raise InvalidInput(f"an item's idempotency_key must not start with {HEADER_ITEM_KEY_PREFIX!r}: "
                                   "such keys are derived from an Idempotency-Key header")
        if idempotency_key is None:
            return self.store.append_many(scope, session_id, req.items)
        _check_idempotency_key(idempotency_key)
        try:
            return self._append_once(scope, session_id, req.items, idempotency_key)
        except IdempotencyConflict as e:
            if HEADER_ITEM_KEY_PREFIX not in str(e):
                raise
            raise IdempotencyConflict(
                f"Idempotency-Key {idempotency_key!r} was used for another request: {e} (an item without an "
                "entry_id or idempotency_key takes the key of its index in the request)"
            ) from e

    def _append_once(self, scope: str, session_id: str, items: list[Any], idempotency_key: str) -> list[Entry]:
        """Append ``items`` under an Idempotency-Key, refusing (IdempotencyConflict) a request whose keyed
        indexes are not those of the first request under the key, in the append's own transaction."""
        # The append compares each keyed item with its stored entry; the shape is checked here, or a prefix
        # of the first request was answered its first entries, and a longer one appended the rest. No table
        # of keys: the entries keep the request, by the keys the header gave its items. A first request's
        # entries land all or none, so its keyed indexes are all stored: this one's (``ours``) must be all
        # found (a retry, which then appends nothing either) or all new, and the header's keys in the
        # session must be this request's, none other (``HeaderKeys``).
        check_id("scope", scope)
        check_id("session_id", session_id)
        ours = _header_indexes(items)
        prepared = self.store.prepare(_keyed_items(items, idempotency_key))
        keys = HeaderKeys(scope, session_id, idempotency_key)
        if not ours:
            raise keys.keying_nothing(self.store)

        def check(c: Core, sess: Any, out: list[Entry]) -> None:
            # After the append, under the session lock it took: an earlier request under the key that
            # committed before is seen, one still running waits for this one (or this for it).
            found = [i for i in ours if out[i].seq <= sess.last_seq]
            if found and len(found) < len(ours):
                new = next(i for i in ours if out[i].seq > sess.last_seq)
                raise keys.conflict(f"with no item without an entry_id or idempotency_key at index {new}, where "
                                    "this one has one")
            appended = next((i for i, e in enumerate(out) if e.seq > sess.last_seq), None) if found else None
            if appended is not None:
                # Every entry of the first request is stored: its retry finds each of its items.
                raise keys.conflict("whose entries this one's items without an entry_id or idempotency_key found, "
                                    "but none with the entry_id or idempotency_key this one has at index "
                                    f"{appended}")
            keys.check_only(c, {header_item_key(idempotency_key, i) for i in ours})

        return self.store._append(scope, session_id, prepared, check)

    def admit(self, scope: str, session_id: str, req: AdmitRequest) -> Admission:
        """Admit the user message of a logical turn."""
        _check_request(req, AdmitRequest)
        return self.store.admit(scope, session_id, req.message, turn_id=req.turn_id, entry_id=req.entry_id)

    # ------------------------------------------------------------------------------------ engines

    def engines(self) -> list[EngineSummary]:
        """Every registered engine."""
        registry = self.runtime.registry
        assert registry is not None
        return [EngineSummary(id=s.id, source=s.source, error=s.error) for s in registry.specs.values()]

    def engine(self, engine_id: str) -> tuple[Any, EngineInfo]:
        """The live engine (created once per process); UnknownEngine when none has this id."""
        self._known_engine(engine_id)
        with self._lock:
            return self.runtime.engine(engine_id)

    def _known_engine(self, engine_id: str) -> None:
        """UnknownEngine when no registered engine has this id (the engine is not created)."""
        check_id("engine", engine_id)
        registry = self.runtime.registry
        assert registry is not None
        if engine_id not in registry.specs:
            raise UnknownEngine(f"no context engine {engine_id!r}")

    def describe(self, engine_id: str) -> EngineDescription:
        """An engine's declarations."""
        engine, info = self.engine(engine_id)
        durable, _reason, _broken = durable_declaration(engine, info)
        return EngineDescription(id=engine_id, info=info, durable=durable)

    def limits(self) -> dict[str, int]:
        """What one stored entry and one turn's closed range may weigh (their JSON in bytes): a client
        sizing what it sends reads them instead of assuming the defaults (``service_app`` adds its body limit)."""
        return {"max_entry_bytes": self.store.config.max_payload_bytes, "max_turn_bytes": MAX_TURN_BYTES}

    def _call(self, scope: str, engine_id: str, session_id: str) -> _Call:
        engine, info = self.engine(engine_id)
        return _Call(engine, info, self.store.get_session(scope, session_id))

    def _host(self, call: _Call, fence: Anchor | None, budget: int | None, **more: Any) -> dict[str, Any]:
        """The host parameters of a lifecycle call (projected onto what the engine accepts)."""
        sess = call.session
        settings = RuntimeSettings(
            runtime=RuntimeInfo(host="transcript-store-service"),
            context_engine_selection=EngineSelection(id=call.info.id, source="argument"),
            limits=Limits(prompt_token_budget=budget, max_output_tokens=self.settings.max_output_tokens),
        )
        rt = RuntimeContext(self.runtime, sess.scope, sess.session_id, fence, None, budget)
        host = {"session_key": sess.session_key, "runtime_settings": settings, "runtime_context": rt}
        host.update({k: v for k, v in more.items() if v is not None})
        return host

    def _lifecycle(self, call: _Call, name: str) -> Callable[..., Any]:
        method: Callable[..., Any] | None = getattr(call.engine, name, None)
        if not callable(method):
            raise EngineContractError(f"context engine {call.info.id!r} has no {name}()")
        return method

    @property
    def default_budget(self) -> int:
        """The prompt budget used when a request names none."""
        return self.settings.token_budget - self.settings.max_output_tokens

    def bootstrap_state(self, scope: str, engine_id: str, session_id: str) -> BootstrapState:
        """Where the next import page of the session resumes."""
        self.engine(engine_id)
        check_id("scope", scope)
        check_id("session_id", session_id)

        return self.store.read(lambda c: _bootstrap_state(c, scope, session_id))

    def bootstrap(self, scope: str, engine_id: str, session_id: str, req: BootstrapRequest) -> BootstrapResponse:
        """Mirror one host page (idempotent), then on ``done`` run the engine's bootstrap."""
        _check_request(req, BootstrapRequest)
        call = self._call(scope, engine_id, session_id)
        page = req.page
        if page is None:
            current = self.bootstrap_state(scope, engine_id, session_id)
            out = BootstrapResponse(
                cursor=current.cursor, position=current.position, visible_count=current.visible_count
            )
        else:
            hosted = [mirror.HostMessage(e.entry_id, e.message) for e in page.entries]
            # what an attempt left: its answer, and the mirror as it left it (resume point, size, head)
            landed: list[tuple[mirror.Alignment, BootstrapState, tuple[str | None, int]]] = []

            def run(c: Core) -> tuple[mirror.Alignment, BootstrapState, tuple[str | None, int]]:
                if landed and _bootstrap_mark(c, scope, session_id) == landed[0][1:]:
                    # An earlier attempt ran to its end and only its COMMIT was uncertain: the resume point
                    # is where that page left it. Imported again, the page's cursor is one the mirror moved
                    # past, by this very page (409 ``cursor``). The head too: a page that rewinds the mirror
                    # leaves the resume point and the size as they were, and only its head (the message it
                    # appended, the branch it went back to) tells it landed from an attempt that did not.
                    return landed[0]
                # The answer is what this page's transaction left: read after it commits, another
                # importer's page (or a turn) could already have moved the resume point.
                done, _after = mirror.import_page(
                    c, self.store.config, scope, session_id, cursor=page.cursor, next_cursor=page.next_cursor,
                    messages=hosted,
                )
                landed[:] = [(done, *_bootstrap_mark(c, scope, session_id))]
                return landed[0]

            done, current, _head = self.store.write(run)
            out = BootstrapResponse(
                imported=done.imported, matched=done.matched, rewound=done.rewound, cursor=current.cursor,
                position=current.position, visible_count=current.visible_count,
            )
            log.info("bootstrap page engine=%s scope=%s session=%s imported=%d matched=%d rewound=%s", engine_id,
                     scope, session_id, done.imported, done.matched, done.rewound)
        if req.done:
            out = out.model_copy(update={"result": self._engine_bootstrap(call, scope, session_id)})
        return out

    def _engine_bootstrap(
        self, call: _Call, scope: str, session_id: str, fence: Anchor | None = None
    ) -> BootstrapResult:
        """The engine's bootstrap over what the mirror holds, before ``fence`` when given (nothing to do
        for an engine without one)."""
        method = getattr(call.engine, "bootstrap", None)
        if not callable(method):
            return BootstrapResult(bootstrapped=True, reason="the engine reads the transcript itself")
        base = {"scope": scope, "session_id": session_id, "fence": fence}
        raw = method(**project_params(call.info, base, self._host(call, fence, self.default_budget)))
        return raw if isinstance(raw, BootstrapResult) else BootstrapResult.model_validate(raw or {})

    def assemble(self, scope: str, engine_id: str, session_id: str, req: AssembleRequest) -> AssembleResult:
        """The engine's context for the next model call (before ``fence`` when given)."""
        _check_request(req, AssembleRequest)
        call = self._call(scope, engine_id, session_id)
        fence = self._own(scope, session_id, req.fence)
        budget = req.token_budget or self.default_budget
        prompt = {"role": "user", "content": req.prompt} if isinstance(req.prompt, str) else req.prompt
        # Checked as a stored message is (no NaN, lone surrogates, nesting past 64, a valid chat message),
        # and the tool names as JSON text: an engine, perhaps a third party's, gets only what it could
        # store and send on, and a bad value is a 400 here, not an engine's failure.
        if prompt is not None:
            prompt = validate_message(prompt)
        check_json(list(req.available_tools))
        base = {
            "scope": scope,
            "session_id": session_id,
            "fence": fence,
            "token_budget": budget,
            "available_tools": list(req.available_tools),
        }
        params = project_params(call.info, base, self._host(call, fence, budget, prompt=prompt))
        # Every message with a chat role, as the host checks (``_assembled``): one without goes on to the
        # client's model, whose provider refuses the request; here it is the engine's failure (409).
        result = _assembled(call.info, call.engine.assemble(**params))
        log.info("assemble engine=%s scope=%s session=%s messages=%d estimated_tokens=%d", engine_id, scope,
                 session_id, len(result.messages), result.estimated_tokens)
        return result

    def compact(self, scope: str, engine_id: str, session_id: str, req: CompactRequest) -> CompactResult:
        """The engine's compaction (inside ``fence`` when given and its ``compact`` declares one)."""
        _check_request(req, CompactRequest)
        call = self._call(scope, engine_id, session_id)
        fence = self._own(scope, session_id, req.fence)
        method = self._lifecycle(call, "compact")
        # A running turn's fence goes to a ``compact`` that declares a ``fence`` keyword, as the host's
        # compactions inside a turn give it (``host._fenced``): the lossless engine holds it in its reads
        # and its write, ReadFenceError (409 ``read_fence``) before anything is written when it no longer
        # holds. Without it, the compaction covered the turn's own message once the engine's copy held it.
        fenced = fence is not None and takes_keyword(method, "fence")
        # An engine that keeps its own copy (lossless) compacts that copy: pages a host imported without
        # ``done`` (the OpenClaw plugin's import before a compaction) must reach it first, or a long
        # transcript compacts to "no progress". Fenced at a running turn's admission when the client
        # says so (as the host does): imported unfenced, the turn's own message went into the engine,
        # and the turn's next fenced assemble raised ReadFenceError("crossed").
        try:
            self._engine_bootstrap(call, scope, session_id, fence)
        except ReadFenceError as e:
            if fenced:  # its compaction holds the same fence, and would refuse it: nothing is written
                raise
            # the running turn's entry moved: an engine that takes no fence compacts what it holds
            log.warning("compaction of %s: the engine could not import first: %s", session_id, e.reason)
        # The prompt's budget, as assemble and maintain get it: the whole token_budget would compact to
        # more than the assembly then takes (the host's own compaction uses the prompt's budget too).
        budget = req.token_budget or self.default_budget
        base: dict[str, Any] = {"scope": scope, "session_id": session_id, "force": req.force, "focus": req.focus,
                                "token_budget": budget}
        if fenced:
            base["fence"] = fence
        # Its runtime context carries the request's fence whether or not ``compact`` declares one, as the
        # host's does (inside a turn, and ``HostRuntime.compact`` during a running turn): a compaction the
        # engine hands to the runtime (``delegate_compaction_to_runtime``) holds it; given it only with a
        # ``fence`` keyword, the built-in compaction of an engine that delegates read the turn's message.
        host = self._host(call, fence, budget)
        return CompactResult.model_validate(method(**project_params(call.info, base, host)))

    def host_compaction(
        self, scope: str, engine_id: str, session_id: str, req: HostCompactionRequest
    ) -> HostCompactionResponse:
        """Record a compaction the host made of its own transcript (``compaction.record_host_compaction``)."""
        _check_request(req, HostCompactionRequest)
        call = self._call(scope, engine_id, session_id)
        if call.info.owns_compaction and req.reset is not True:
            # An engine that owns compaction (lossless) never delegates it: only the host's reset, which
            # starts its context again, reaches it (``compaction.reset_in``); a summary would be ignored.
            raise InvalidInput(f"context engine {engine_id!r} owns compaction: only a host's reset is taken")
        if req.first_kept_entry_id is not None:
            check_id("entry_id", req.first_kept_entry_id)

        landed: list[tuple[int, HostCompactionResponse]] = []  # the session an attempt wrote to, its answer

        def run(c: Core) -> HostCompactionResponse:
            if landed and replaced(c, scope, session_id, landed[0][0]):
                # An earlier attempt ran to its end and only its COMMIT was uncertain; the session was
                # deleted since, perhaps made again under the id: its pointer is never written there.
                return landed[0][1]
            pointer = compaction.record_host_compaction(
                c, scope, session_id, summary=req.summary, first_kept_position=req.first_kept_position,
                first_kept_entry_id=req.first_kept_entry_id, compacted_ms=req.compacted_ms,
                compacted_at_count=req.compacted_at_count, reset=req.reset,
            )
            sess = c.require_session(scope, session_id)
            out = HostCompactionResponse(
                first_kept_position=pointer["first_kept_position"], visible_count=int(sess.visible_count)
            )
            landed[:] = [(int(sess.incarnation), out)]
            return out

        out: HostCompactionResponse = self.store.write(run)
        log.info("host compaction engine=%s scope=%s session=%s first_kept_position=%d", engine_id, scope,
                 session_id, out.first_kept_position)
        return out

    def maintain(
        self, scope: str, engine_id: str, session_id: str, req: MaintainRequest | None = None
    ) -> MaintainResult:
        """The engine's maintenance pass (nothing to do when it has none), against ``req.token_budget`` when
        given: to a ``maintain`` that takes a ``token_budget`` keyword (lossless), and as the run's prompt
        budget. Without it the engine's own choice stands (lossless: the last assemble budget this process
        saw for the session, else the run's, the service's default)."""
        req = req or MaintainRequest()
        _check_request(req, MaintainRequest)
        call = self._call(scope, engine_id, session_id)
        method = getattr(call.engine, "maintain", None)
        if not callable(method):
            return MaintainResult(changed=False, reason="the engine has no maintenance")
        base: dict[str, Any] = {"scope": scope, "session_id": session_id}
        if req.token_budget is not None and takes_keyword(method, "token_budget"):
            base["token_budget"] = req.token_budget
        host = self._host(call, None, req.token_budget or self.default_budget)
        raw = method(**project_params(call.info, base, host))
        return raw if isinstance(raw, MaintainResult) else MaintainResult.model_validate(raw or {})

    def commit_turn(self, scope: str, engine_id: str, session_id: str, req: CommitTurnRequest) -> CommitTurnResponse:
        """Mirror the turn and commit it through the engine's ledger, in ONE transaction."""
        _check_request(req, CommitTurnRequest)
        call = self._call(scope, engine_id, session_id)
        durable, reason, _broken = durable_declaration(call.engine, call.info)
        if not durable:
            raise EngineContractError(f"context engine {engine_id!r} cannot take durable turns: {reason}")
        method = self._lifecycle(call, "commit_turn")
        check_id("advancement_key", req.advancement_key)
        check_id("entry_id", req.admission.entry_id)
        check_id("entry_id", req.terminal.entry_id)
        target = (req.session_target or {}).get("session_id")
        if target is not None and target != session_id:
            raise InvalidInput("session_target names another session than the one committed to")

        mine: list[Receipt] = []  # the receipts this call's attempts wrote

        def run(c: Core) -> tuple[CommitResult, Anchor, Anchor]:
            replay = _committed_range(c, scope, session_id, call.info.id, req)
            if replay is not None:
                # A replay of a committed key: the ledger alone answers (duplicate, or a collision when
                # the content differs); the mirror is not touched again.
                first, last = replay
                messages = list(req.messages)
            else:
                # A first commit stores the key: it takes the new-id byte limit (a replay above may name
                # a longer one an earlier release stored).
                check_id("advancement_key", req.advancement_key, new=True)
                first, last, messages = mirror.mirror_turn(
                    c, self.store.config, scope, session_id,
                    admission=(req.admission.entry_id, req.admission.position),
                    terminal=(req.terminal.entry_id, req.terminal.position),
                    messages=req.messages,
                )
            result: CommitResult = method(
                tx=c, advancement_key=req.advancement_key, admission=first, terminal=last, messages=messages,
                is_heartbeat=req.is_heartbeat,
            )
            if not isinstance(result, CommitResult) or result.status not in ("committed", "duplicate"):
                # An engine breaking the contract: refused here, inside the transaction, so that the turn it
                # was given is not left mirrored (it was refused after the COMMIT, a 500 that had written).
                got = result.status if isinstance(result, CommitResult) else type(result).__name__
                raise EngineContractError(f"context engine {engine_id!r} returned {got!r} from commit_turn, "
                                          "not a committed or duplicate CommitResult")
            if result.status == "committed":
                mine.append(result.receipt)
            elif result.status == "duplicate" and any(r.model_dump() == result.receipt.model_dump() for r in mine):
                # A retry after an uncertain COMMIT found the receipt its earlier attempt wrote (the
                # commit time, fresh per attempt, tells it from another caller's): this call's own
                # commit, answered as ``Turns.commit_turn`` answers it, not as a replay.
                result = CommitResult.model_construct(status="committed", receipt=result.receipt)
            return result, first, last

        try:
            result, first, last = self.store.write(run)
        except MirrorConflict as e:
            if e.reason == "behind":
                # The caller imports and retries: its import must be able to reach the turn's admission,
                # in a transaction of its own (the refused one wrote nothing). See mirror.reopen_import.
                admission = (req.admission.entry_id, req.admission.position)
                try:
                    if self.store.write(lambda c: mirror.reopen_import(c, scope, session_id, admission)):
                        log.info("commit_turn behind: the import starts again engine=%s scope=%s session=%s key=%s",
                                 engine_id, scope, session_id, req.advancement_key)
                except TranscriptStoreError as failed:  # the answer stays ``behind``; the next refusal tries again
                    log.warning("commit_turn behind: the import's resume point was not reset: %s", failed)
            raise
        log.info("commit_turn engine=%s scope=%s session=%s key=%s status=%s messages=%d", engine_id, scope,
                 session_id, req.advancement_key, result.status, len(req.messages))
        return CommitTurnResponse(status=result.status, receipt=result.receipt, admission=first, terminal=last)

    def receipts(
        self, scope: str, engine_id: str, session_id: str, after: str | None = None, limit: int = DEFAULT_RECEIPTS_PAGE
    ) -> ReceiptPage:
        """A page of the engine's ledger for one session, after the cursor ``after`` (UnknownEngine when no
        engine has this id, like every engine route)."""
        self._known_engine(engine_id)
        return Turns(self.store).receipts_page(scope, session_id, engine_id, after=after, limit=limit)

    # ------------------------------------------------------------------------------------ scope checks

    @staticmethod
    def _own(scope: str, session_id: str, anchor: Anchor | None) -> Anchor | None:
        """An anchor the caller sent, if it is of the caller's scope and session; else as if unknown."""
        if anchor is None:
            return None
        check_anchor("anchor", anchor)  # its integers in range too: an engine may read with it directly
        if anchor.scope != scope:
            raise UnknownSession(scope, anchor.session_id)
        if anchor.session_id != session_id:
            raise InvalidInput("the anchor names another session")
        return anchor

    def close(self, wait_seconds: float = CLOSE_WAIT_SECONDS) -> None:
        """Dispose of the engines and release the store, once the calls still running in request threads
        have ended (``wait_seconds`` at most)."""
        if self.inflight.running:
            log.info("waiting for %d request(s) still running before closing the store", self.inflight.running)
            left = self.inflight.wait_idle(wait_seconds)
            if left:
                log.warning("closing the store with %d request(s) still running after %g s", left, wait_seconds)
        try:
            self.runtime.dispose()
        finally:  # an operator's Ctrl-C during a plugin's dispose: the store is released all the same
            self.store.close()


#: the longest ``Idempotency-Key`` taken, in characters (printable ASCII: one byte each)
MAX_IDEMPOTENCY_KEY_CHARS = 255


#: how the idempotency key of an appended item derived from an ``Idempotency-Key`` starts (refused on items)
HEADER_ITEM_KEY_PREFIX = "Idempotency-Key:"


def header_item_key(idempotency_key: str, index: int) -> str:
    """The idempotency key an appended item at ``index`` takes under the request's ``Idempotency-Key``:
    ``Idempotency-Key:<derived_id of the header>:<index>`` (at most 43 characters, whatever the header)."""
    return f"{header_items_prefix(idempotency_key)}{index}"


def header_items_prefix(idempotency_key: str) -> str:
    """What the idempotency keys of the items appended under an ``Idempotency-Key`` start with (all indexes)."""
    request = derived_id("Idempotency-Key entries\x00" + idempotency_key)
    return f"{HEADER_ITEM_KEY_PREFIX}{request}:"


#: how many nines after a header's prefix end the range of its keys: more digits than any item's index has
_INDEX_DIGITS = 19


class HeaderKeys:
    """The idempotency keys an ``Idempotency-Key`` gave the items of an append to a session: all those of
    the first request under it, read off the keys' index over the range they sort in (bounded: no other
    key starts with ``HEADER_ITEM_KEY_PREFIX``), never the session's other entries."""

    def __init__(self, scope: str, session_id: str, idempotency_key: str) -> None:
        self.scope, self.session_id, self.idempotency_key = scope, session_id, idempotency_key
        self.prefix = header_items_prefix(idempotency_key)

    def stored(self, c: Core, limit: int) -> list[str]:
        """Up to ``limit`` of the header's keys the session holds."""
        # Whatever the collation, a key of index i sorts from the prefix followed by "0" to the prefix
        # followed by nines, as its digits do: the range holds them all.
        return c.keys_between(self.scope, self.session_id, f"{self.prefix}0", self.prefix + "9" * _INDEX_DIGITS,
                              self.prefix, limit)

    def check_only(self, c: Core, ours: set[str]) -> None:
        """IdempotencyConflict when the session holds a key of the header that is not one of ``ours`` (this
        request's, all stored by now): another request's under the same header."""
        other = [k[len(self.prefix):] for k in self.stored(c, len(ours) + 1) if k not in ours]
        if other:
            index = min(other, key=lambda digits: (len(digits), digits))
            raise self.conflict(f"with an item without an entry_id or idempotency_key at index {index}, where "
                                "this one has none")

    def keying_nothing(self, store: TranscriptStore) -> TranscriptStoreError:
        """What a request with no item for the header to key is refused with: UnknownSession when the scope
        has no such session (as without the header: a 404, not a 400 that a client would fix by dropping the
        header, only to get the 404 then), IdempotencyConflict when the header keyed another request's items
        in the session, else InvalidInput (it would leave no trace: another request under the header
        afterwards could not be told from it)."""

        def look(c: Core) -> None:
            # Two statements, each answer standing alone: a session deleted between them holds no keys.
            c.require_session(self.scope, self.session_id)
            self.check_only(c, set())

        try:
            store.statement(look)
        except (UnknownSession, IdempotencyConflict) as e:
            return e
        return InvalidInput(
            "an Idempotency-Key keys the items without an entry_id or idempotency_key, and this request has "
            "none: each of its items is safe to retry by its own; send it without the header"
        )

    def conflict(self, why: str) -> IdempotencyConflict:
        """The header was used for another request, ``why`` says how it differs; nothing was written."""
        return IdempotencyConflict(
            f"Idempotency-Key {self.idempotency_key!r} was used for another request, {why}; nothing was written"
        )


def _keyed_items(items: list[Any], idempotency_key: str) -> list[Any]:
    """``items``, each one with neither an ``entry_id`` nor an ``idempotency_key`` given the key
    ``header_item_key`` derives for its index (a dict, in a request built without validation, too)."""
    out = list(items)
    for i in _header_indexes(items):
        item = items[i]
        key = header_item_key(idempotency_key, i)
        if isinstance(item, AppendItem):
            out[i] = item.model_copy(update={"idempotency_key": key})
        elif isinstance(item, dict):
            out[i] = {**item, "idempotency_key": key}
    return out


def _header_indexes(items: list[Any]) -> list[int]:
    """The indexes of the ``items`` the header keys: those with neither an ``entry_id`` nor an ``idempotency_key``."""
    # Given, even empty or not text: its own key (or id), refused by ``prepare`` as without the header,
    # never replaced by the header's (an empty key was appended under it, answered 200).
    return [
        i for i, item in enumerate(items)
        if _item_value(item, "entry_id") is None and _item_value(item, "idempotency_key") is None
    ]


def _item_value(item: object, name: str) -> object:
    """An append item's ``entry_id`` or ``idempotency_key`` as given (None: not given)."""
    return item.get(name) if isinstance(item, dict) else getattr(item, name, None)


def _item_field(item: object, name: str) -> str:
    """An append item's ``entry_id`` or ``idempotency_key`` when it is a string, else ''."""
    value = _item_value(item, name)
    return value if isinstance(value, str) else ""


def _check_idempotency_key(value: object) -> None:
    """InvalidInput unless ``value`` is an Idempotency-Key: 1 to 255 characters of printable ASCII (what an
    HTTP header carries as it was sent; the service reads headers as Latin-1)."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_IDEMPOTENCY_KEY_CHARS or not (
        value.isascii() and value.isprintable()
    ):
        raise InvalidInput(
            f"an Idempotency-Key is 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters of printable ASCII"
        )


def _check_request(req: object, model: type[BaseModel]) -> None:
    """InvalidInput unless ``req`` is a ``model`` (what the HTTP layer validates a request body into)."""
    if not isinstance(req, model):
        raise InvalidInput(f"the request must be a {model.__name__}, not {type(req).__name__}")


def _committed_range(
    c: Core, scope: str, session_id: str, engine_id: str, req: CommitTurnRequest
) -> tuple[Anchor, Anchor] | None:
    """The anchors of an already committed key (a replay), or None.

    The ledger's hash covers the admission and terminal entries (ids and positions), so a replay that
    names other entries, gives other positions or holds another message count collides. A receipt
    names a host entry as the mirror stored it: under its host id, or an id derived from it
    (``mirror.names``).
    """
    receipt = get_receipt(c, scope, session_id, engine_id, req.advancement_key)
    if receipt is None:
        return None
    if receipt.message_count != len(req.messages):
        raise AdvancementKeyCollision(req.advancement_key)
    sess = c.require_session(scope, session_id)
    rows = c.entry_rows(scope, session_id, [receipt.admission_entry_id, receipt.terminal_entry_id])
    first, last = rows.get(receipt.admission_entry_id), rows.get(receipt.terminal_entry_id)
    if first is None or last is None:  # pragma: no cover - entries are never deleted by normal operation
        return None
    for ref, row, message in ((req.admission, first, req.messages[0]), (req.terminal, last, req.messages[-1])):
        # The receipt names the host's entry, or the one the mirror derived for it (a reused host id).
        if not mirror.names(c.config, ref.entry_id, row, message) or (
            ref.position is not None and ref.position != row.position
        ):
            raise AdvancementKeyCollision(req.advancement_key)
    return c.anchor_for(sess, first), c.anchor_for(sess, last)


def _bootstrap_state(c: Core, scope: str, session_id: str) -> BootstrapState:
    """The import's resume point and the mirror's size, read in the caller's transaction."""
    return _bootstrap_mark(c, scope, session_id)[0]


def _bootstrap_mark(c: Core, scope: str, session_id: str) -> tuple[BootstrapState, tuple[str | None, int]]:
    """``_bootstrap_state`` and the session's (head entry id, incarnation), from the same session row."""
    sess = c.require_session(scope, session_id)
    state = mirror.import_state(c, scope, session_id)
    out = BootstrapState(cursor=state.cursor, position=state.position, visible_count=sess.visible_count)
    return out, (sess.head_entry_id, int(sess.incarnation))
