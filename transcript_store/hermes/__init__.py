"""Any transcript-store engine as a Hermes Agent ``ContextEngine`` (imports ``agent.context_engine`` lazily).

How the adapter maps Hermes onto the store:

- Scope ``hermes`` (configurable); one store session per Hermes conversation lineage, opened by the
  Hermes session id as its session key.
- Every Hermes message except the leading system prompt is appended once, with the idempotency key
  ``sha256(store session | ordinal | canonical message)``; the ordinal is the message's index in the
  uncompressed conversation. Re-sending the same list (``compress``, ``on_session_end``,
  ``on_turn_complete``, a retry after a host timeout) stores nothing new.
- The host's list is aligned with the store session's visible transcript in order, message by message
  compared by ``identity`` (a reloaded conversation is the same one): only its longest common prefix
  is skipped. A list that differs after that (an undo, an edit, a regenerated reply)
  branches the session after the last message both agree on and appends the rest, as the OpenClaw
  mirror does (``mirror.align``): nothing is deleted, the visible transcript becomes the host's list.
  Once the session has off-branch entries, a key also names the seq the write follows, so that it can
  never name an off-branch entry at the same ordinal.
- A message the store refuses as it is (its shape, its size) is stored in a form it takes, its text or
  JSON kept (``storable``; a tool round's calls and call ids kept as they are where the store takes
  them, ``in_round``), and the host's list is aligned by that form: one such message never blocks
  the rest of the conversation. Over the store's cap, a tool round's message keeps its calls or call
  id too: its text and its calls' arguments are cut to a share of the cap, an argument to a marked
  JSON stand-in (``cut_round``). A message nested past Python's recursion limit is copied and written
  without recursion (``detached``, ``deep_json``).
- ``compress`` aims below Hermes' trigger: three quarters of it, less the system prompt and tools (what
  Hermes' count of the request exceeds the messages by). The fresh tail (the current user message and
  the pending exchange) is kept verbatim whatever the budget; the engine's context gets the rest. A
  list the engine cannot shorten (an answer no smaller than it), or our own answer sent back, comes back
  unchanged and is not counted.
- ``compress`` compacts in the engine, assembles its context, and records the answer as an unreferenced
  *candidate* (a metadata entry keyed by the answer's hash). A later call whose messages start with a
  candidate proves the host took it: the candidate is adopted (lineage, ordinals of what follows) and only
  then may ``select_context`` show the compacted view. A pass the host discarded after a timeout changes
  nothing the session shows; the originals are already stored, so nothing is ever lost.
- Deep-copy / pickle safe: the store, the engine and every lock live in a runtime opened lazily per
  copy; ``__deepcopy__`` / ``__getstate__`` drop it.
"""

from __future__ import annotations

from typing import Any

from .compress import COMPRESS_TARGET, FIT_ATTEMPTS, MIN_CONTEXT, OVERHEAD_SAMPLES
from .config import DEFAULT_SCOPE, DEFAULT_THRESHOLD, MIN_CTX_TRIGGER_RATIO, as_int, resolve_threshold, threshold_tokens
from .context import (  # noqa: F401
    _CHAT_ROLES,
    _LOSSLESS_HEAD,
    ACK,
    ACK_MESSAGE,
    CONTEXT_MARKER,
    HOST_SCAFFOLDING,
    MAX_MEMORY_CHARS,
    MEMORY_HEAD,
    _is_summary_text,
    addition_of,
    checked_assembly,
    fresh_tail,
    is_context_message,
    is_summary,
    is_user_turn,
    is_valid_sequence,
    memory_block,
    merge_context,
    place_addition,
    split_system,
    valid_sequence,
    with_addition,
    with_fresh_tail,
)
from .engine import TranscriptStoreEngineMixin, log  # noqa: F401
from .forms import (
    CUT_ARGUMENTS_KEY,
    CUT_SLACK,
    KEPT_AS_JSON,
    TEXT_ROLES,
    Checked,
    Cuttable,
    align,
    as_text,
    checked,
    cut_mark,
    cut_round,
    cut_to,
    cuttables,
    fit,
    in_round,
    json_size,
    new_entry,
    share,
    stand_in,
    storable,
    storable_tail,
)
from .hooks import end_turn, note_turn, observe_turn
from .install import (  # noqa: F401
    MIN_CONTEXT_LENGTH,
    PLUGIN_DIR,
    PLUGIN_NAME,
    TEMPLATE_DIR,
    _write_private,
    config_snippet,
    install_plugin,
    settings_json,
)
from .lineage import ADOPTED, ALIAS, CANDIDATE, INDEX_KEY, _remember_candidate  # noqa: F401
from .messages import (  # noqa: F401
    _SURROGATES,
    HOST_KEYS,
    PERSISTED_MARK,
    _call_identity,
    _json_text,
    _key_text,
    _Piece,
    _sorted_items,
    bounded,
    canonical,
    clean,
    deep_json,
    detached,
    digest,
    fingerprint,
    host_copy,
    identity,
    jsonable,
    message_key,
)
from .request import as_sent, prefill_count, request_copy, settled, with_incoming
from .runtime import (  # noqa: F401
    _BOUND,
    _LIVE,
    _RUNTIME_LOCK,
    _SHARED_RUNTIMES,
    _TURN,
    EMPTY,
    _Candidate,
    _Runtime,
    _Selection,
    _Visible,
)
from .sessions import _branch_parent, saved_conversation  # noqa: F401

# Every name of the module this package was (hermes.py) stays importable from it; private ones, too,
# for code that reached into it (the imports marked noqa).
__all__ = [
    "ACK", "ACK_MESSAGE", "ADOPTED", "ALIAS", "CANDIDATE", "COMPRESS_TARGET", "CONTEXT_MARKER", "CUT_ARGUMENTS_KEY",
    "CUT_SLACK", "DEFAULT_SCOPE", "DEFAULT_THRESHOLD", "EMPTY", "FIT_ATTEMPTS", "HOST_KEYS", "HOST_SCAFFOLDING",
    "INDEX_KEY", "KEPT_AS_JSON", "MAX_MEMORY_CHARS", "MEMORY_HEAD", "MIN_CONTEXT", "MIN_CONTEXT_LENGTH",
    "MIN_CTX_TRIGGER_RATIO", "OVERHEAD_SAMPLES", "PERSISTED_MARK", "PLUGIN_DIR", "PLUGIN_NAME", "TEMPLATE_DIR",
    "TEXT_ROLES", "Checked", "Cuttable", "TranscriptStoreEngineMixin", "addition_of", "align", "as_int", "as_sent",
    "as_text", "bounded", "canonical", "checked", "checked_assembly", "clean", "config_snippet", "create_engine",
    "cut_mark", "cut_round", "cut_to", "cuttables", "deep_json", "detached", "digest", "end_turn", "engine_class",
    "fingerprint", "fit", "fresh_tail", "host_copy", "identity", "in_round", "install_plugin", "is_context_message",
    "is_summary", "is_user_turn", "is_valid_sequence", "json_size", "jsonable", "memory_block", "merge_context",
    "message_key", "new_entry", "note_turn", "observe_turn", "place_addition", "prefill_count", "request_copy",
    "resolve_threshold", "saved_conversation", "settings_json", "settled", "share", "split_system", "stand_in",
    "storable", "storable_tail", "threshold_tokens", "valid_sequence", "with_addition", "with_fresh_tail",
    "with_incoming",
]


class _StandInContextEngine:
    """Used only when ``agent.context_engine`` is not importable (unit tests without hermes-agent)."""


_CLASSES: dict[bool, type] = {}


def engine_class(*, allow_stand_in: bool = False) -> type:
    """The adapter class subclassing Hermes' ``ContextEngine`` (a stand-in base only when allowed)."""
    with _RUNTIME_LOCK:
        try:
            from agent.context_engine import ContextEngine as base  # type: ignore[import-not-found]

            real = True
        except ImportError:
            if not allow_stand_in:
                raise
            base, real = _StandInContextEngine, False
        if real not in _CLASSES:
            cls_name = "TranscriptStoreContextEngine" if real else "TranscriptStoreContextEngineStandIn"
            cls = type(
                cls_name,
                (TranscriptStoreEngineMixin, base),
                {"__module__": __name__, "__doc__": "A transcript-store engine as a Hermes ContextEngine."},
            )
            # The host identity-checks hooks against the ABC; ours are the mixin's, so they run.
            _CLASSES[real] = cls
            globals()[cls_name] = cls  # importable by name: pickling works
        return _CLASSES[real]


def create_engine(*, allow_stand_in: bool = False, **kwargs: Any) -> Any:
    """An adapter instance (see ``TranscriptStoreEngineMixin.__init__`` for the arguments)."""
    return engine_class(allow_stand_in=allow_stand_in)(**kwargs)
