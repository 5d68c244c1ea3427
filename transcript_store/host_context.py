"""The host's ``runtime_context`` for engines: ``RuntimeContext``, the caller's checked values and the
built-in compaction delegated to the host (split out of host.py; host.py re-exports every name)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import compaction
from .engine import CompactResult, check_token_budget
from .errors import InvalidInput
from .models import Anchor, Replacement, RewriteResult, compact_json, validate_event_payload

if TYPE_CHECKING:
    from .host import HostRuntime


#: the largest ``runtime_context`` a caller may hand ``run_turn``, as compact JSON
MAX_RUNTIME_CONTEXT_BYTES = 64 * 1024


def host_values(runtime_context: object) -> dict[str, Any]:
    """``run_turn``'s ``runtime_context`` checked (a JSON object of at most 64 KiB, or None) and copied."""
    if runtime_context is None:
        return {}
    if not isinstance(runtime_context, dict):
        kind = type(runtime_context).__name__
        raise InvalidInput(f"runtime_context must be a dict (a JSON object) or None, not {kind}")
    try:
        validate_event_payload(runtime_context)
    except InvalidInput as e:
        raise InvalidInput(f"runtime_context: {e}") from None
    text = compact_json(runtime_context)
    if len(text.encode("utf-8")) > MAX_RUNTIME_CONTEXT_BYTES:
        raise InvalidInput(f"runtime_context must be at most {MAX_RUNTIME_CONTEXT_BYTES} bytes of JSON")
    copied: dict[str, Any] = json.loads(text)
    return copied


@dataclass
class RuntimeContext:
    """What the host offers an engine during one turn (the ``runtime_context`` host param)."""

    host: HostRuntime
    scope: str
    session_id: str
    fence: Anchor | None
    turn_id: str | None
    #: the prompt's budget of the operation (what the delegated compaction works to); None: the
    #: budget less the reply's tokens
    budget: int | None = None
    #: the caller's own facts for the engine (``run_turn``'s ``runtime_context``: a JSON object, copied)
    values: dict[str, Any] = field(default_factory=dict)

    def rewrite_transcript_entries(
        self,
        replacements: Sequence[Replacement | dict[str, Any]],
        allowed_rewrite_suffix_entry_ids: Sequence[str] | None = None,
    ) -> RewriteResult:
        """Safe transcript edits for maintenance (branch-and-reappend; the generation rotates)."""
        return self.host.store.rewrite_entries(
            self.scope, self.session_id, replacements, allowed_rewrite_suffix_entry_ids=allowed_rewrite_suffix_entry_ids
        )

    def delegate_compaction_to_runtime(self, *, force: bool = False, focus: str | None = None) -> CompactResult:
        """Run the host's built-in compaction for this session (for engines that do not own it)."""
        return delegate_compaction_to_runtime(self, force=force, focus=focus)


def delegate_compaction_to_runtime(
    ctx: RuntimeContext, *, force: bool = False, focus: str | None = None, prompt_budget: int | None = None
) -> CompactResult:
    """The built-in summarising compaction, for non-owning engines' ``compact`` (to ``compaction_threshold``
    of ``prompt_budget``: by default the operation's, ``ctx.budget``, as the engine's ``compact`` got it)."""
    h = ctx.host
    check_token_budget(prompt_budget, optional=True, what="prompt_budget")  # force, focus: compact_session's
    budget = prompt_budget if prompt_budget is not None else ctx.budget
    if budget is None:
        budget = h.prompt_budget()
    return compaction.compact_session(
        h.store,
        ctx.scope,
        ctx.session_id,
        summarizer=h.summarizer,
        estimator=h.estimator,
        fence=ctx.fence,
        keep_last=h.keep_last,
        focus=focus,
        force=force,
        token_budget=max(1, int(budget * h.settings.compaction_threshold)),
        backoff=h.summary_backoff,
    )
