"""The adapter: Hermes' ``ContextEngine`` verbs over the store session and the engine."""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from ..errors import describe
from ..tokens import RoughEstimator
from .compress import MIN_CONTEXT, CompressMixin
from .config import as_int, resolve_threshold, threshold_tokens
from .context import checked_assembly, merge_context, split_system, valid_sequence
from .messages import canonical, detached, digest
from .request import as_sent, prefill_count, settled, with_incoming
from .runtime import _Selection
from .sessions import SessionsMixin

log = logging.getLogger("transcript_store.hermes")


class TranscriptStoreEngineMixin(CompressMixin, SessionsMixin):
    """The adapter logic; ``engine_class()`` combines it with Hermes' ``ContextEngine`` base."""

    # ------------------------------------------------------------------------------------ ContextEngine

    def update_from_response(self, usage: dict[str, Any]) -> None:
        """Record the token counts of the last API response."""
        self._mark_turn()
        if not isinstance(usage, dict):
            return
        prompt = as_int(usage.get("prompt_tokens") or usage.get("input_tokens"))
        completion = as_int(usage.get("completion_tokens") or usage.get("output_tokens"))
        self.last_prompt_tokens = prompt
        self.last_completion_tokens = completion
        self.last_total_tokens = as_int(usage.get("total_tokens")) or prompt + completion

    def should_compress(self, prompt_tokens: int | None = None) -> bool:
        """Whether the prompt reached the threshold."""
        self._mark_turn()
        # A count that is no number (a string, a dict) is read as a host's usage value is: never a
        # TypeError into Hermes' turn loop.
        tokens = as_int(self.last_prompt_tokens if prompt_tokens is None else prompt_tokens)
        return self.threshold_tokens > 0 and tokens >= self.threshold_tokens

    def should_compress_preflight(self, messages: list[dict[str, Any]]) -> bool:
        """A cheap estimate of the messages against the threshold."""
        try:
            return self.should_compress(RoughEstimator().count_messages(messages))
        except Exception:
            return False

    def on_session_reset(self) -> None:
        """Reset the token counters."""
        self.last_prompt_tokens = 0
        self.last_completion_tokens = 0
        self.last_total_tokens = 0
        self.compression_count = 0

    def update_model(
        self,
        model: str,
        context_length: int,
        base_url: str = "",
        api_key: str = "",
        provider: str = "",
        **kwargs: Any,
    ) -> None:
        """A new model: its context window and threshold (``model_thresholds``: longest substring match)."""
        self.model = str(model or "")
        if as_int(context_length) > 0:
            self.context_length = as_int(context_length)
        pct = resolve_threshold(self.model, getattr(self, "model_thresholds", None), self.threshold_setting)
        self.threshold_tokens = threshold_tokens(self.context_length, pct)

    def get_tool_schemas(self) -> list[dict[str, Any]]:
        """The engine's recall tools (lossless: lcm_grep, lcm_describe, lcm_expand) in Hermes' format."""
        try:
            engine = self.runtime().engine
            fn = getattr(engine, "get_tool_schemas", None)
            raw = fn() if callable(fn) else []
        except Exception:
            log.exception("transcript-store: tool schemas unavailable")
            return []
        return [s.get("function", s) if isinstance(s, dict) else s for s in raw]

    def handle_tool_call(self, name: str, args: dict[str, Any], **kwargs: Any) -> str:
        """Run a recall tool on the current session; errors come back as JSON."""
        try:
            rt = self.runtime()
            fn = getattr(rt.engine, "handle_tool_call", None)
            if not callable(fn):
                return json.dumps({"error": f"Unknown tool: {name}"})
            if isinstance(args, str):
                args = json.loads(args or "{}")
            hermes_session = kwargs.get("session_id") or self.session_id
            live = settled(kwargs.get("messages"))
            if live:
                # hermes-agent passes the conversation in memory ("for live ingestion"): stored first, a
                # recall tool finds this conversation's turns before its first compaction too.
                try:
                    self.ingest(detached(live), hermes_session)
                except Exception:
                    log.exception("transcript-store: storing the live conversation for a tool call failed")
            store_session = self._store_session(rt, hermes_session)
            boot = getattr(rt.engine, "bootstrap", None)
            if callable(boot):
                # The engine imports what is stored and it has not seen (by on_session_end, on_turn_complete,
                # this call): without it, its recall tools searched only what a compress had imported.
                try:
                    boot(scope=self.scope, session_id=store_session, fence=None)
                except Exception:
                    log.exception("transcript-store: the engine's import before a tool call failed")
            return str(fn(name, args, scope=self.scope, session_id=store_session))
        except Exception as e:
            return json.dumps({"error": describe(e)})

    def get_status(self) -> dict[str, Any]:
        """Token counters, threshold and the store in use."""
        # Hermes sets last_prompt_tokens to -1 after a compression ("unknown until the next call"):
        # reported as 0, never a negative usage.
        prompt = max(0, as_int(self.last_prompt_tokens))
        return {
            "engine": self.engine_id,
            "last_prompt_tokens": prompt,
            "threshold_tokens": self.threshold_tokens,
            "context_length": self.context_length,
            "compression_count": self.compression_count,
            "usage_percent": (
                min(100, prompt / self.context_length * 100) if self.context_length else 0
            ),
            "store": self.scope,
        }

    # ------------------------------------------------------------------------------------ newer verbs

    def select_context(
        self,
        request_messages: Any,
        *,
        conversation_messages: Any = None,
        incoming_message: Any = None,
        budget_tokens: int = 0,
        **_kwargs: Any,
    ) -> list[dict[str, Any]] | None:
        """This request's context: None (unchanged) unless it is over budget and an adopted compaction exists."""
        try:
            if not isinstance(request_messages, list) or not request_messages:
                return None
            if not all(isinstance(m, dict) for m in request_messages):
                return None
            rt = self.runtime()
            if isinstance(conversation_messages, list):
                source = with_incoming([m for m in conversation_messages if isinstance(m, dict)], incoming_message)
            else:
                source = request_messages  # the request holds the incoming message itself
            store_session, _n = self.ingest(detached(source), _kwargs.get("session_id"))
            if not budget_tokens:
                return None
            est = RoughEstimator()
            system, rest = split_system(request_messages)
            # Hermes' prefill messages stay where it put them, in every request it sends
            k = prefill_count(request_messages, source) if isinstance(conversation_messages, list) else 0
            head = [*system, *rest[:k]]
            # The budget is the model's whole window (Hermes passes ``context_length``), and the request
            # carries its tool schemas besides these messages: the head goes out with the engine's context,
            # the schemas with both (``beside``). Left out, a request that fit by its messages went out
            # over the window by the schemas, and a selection filled the window less the head only.
            beside = self._beside_messages(est.count_messages(head))
            estimate = est.count_messages(request_messages) - est.count_messages(head) + beside
            if estimate <= budget_tokens:
                return None
            with rt.lock:
                pending = store_session in rt.pending
                adopted = store_session in rt.adopted
            if pending or not adopted:
                return None  # nothing compacted for this session that the host has taken
            key = digest(canonical(request_messages), str(budget_tokens), str(beside))
            with rt.lock:
                cached = rt.selections.get(store_session)
            if cached is not None and cached.key == key:
                return cached.messages()  # the caller's own copy: it may change it as it likes
            room = max(MIN_CONTEXT, int(budget_tokens) - beside)
            assembled = checked_assembly(
                rt.engine.assemble(scope=self.scope, session_id=store_session, fence=None, token_budget=room)
            )
            selected = merge_context(valid_sequence(copy.deepcopy(assembled.messages)))
            body = as_sent(selected, [*system, *rest[k:]], source)
            kept = _Selection(key, copy.deepcopy(head), json.dumps(body) if body else None)
            with rt.lock:
                rt.selections[store_session] = kept
            return kept.messages()
        except RecursionError:
            # A message nested past Python's recursion limit (counting its tool call's arguments, the
            # selection's key): the traceback was thousands of lines, at every request of the session.
            log.warning("transcript-store select_context: a message of the request is nested too deep to "
                        "count (RecursionError); request unchanged")
            return None
        except Exception:
            log.exception("transcript-store select_context failed; request unchanged")
            return None

    def _beside_messages(self, head: int) -> int:
        """What a request carries besides its conversation, in tokens: its ``head`` (system prompt and
        prefill messages, counted) and its tool schemas, which no message holds. Those are Hermes' own
        count (``request_overhead``: what its count of a request exceeded the conversation by, its
        system prompt included, which hermes-agent passes ``compress`` without), else at least the
        engine's own recall tools, which every request carries (``own_tool_tokens``)."""
        return max(head + self.own_tool_tokens(), as_int(getattr(self, "request_overhead", 0)))

    def own_tool_tokens(self) -> int:
        """The engine's recall tools as Hermes sends them with every request (OpenAI function schemas), in
        tokens (counted once per copy)."""
        known = getattr(self, "_own_tools", None)
        if isinstance(known, int):
            return known
        schemas = self.get_tool_schemas()
        tokens = RoughEstimator().count_text(canonical([{"type": "function", "function": s} for s in schemas]))
        if schemas:  # none: the engine may not be open yet; counted again next time
            self._own_tools = tokens
        return tokens

    def on_turn_complete(self, messages: Any, usage: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Store the finished turn's messages once each (read-only on ``messages``)."""
        try:
            if isinstance(usage, dict):
                self.update_from_response(usage)
            if isinstance(messages, list) and messages:
                # The copies stored are the list as Hermes holds it now (a message it changes in place
                # later is read again next turn): noted by the fingerprints the store's alignment computes
                # of them (ingest's ``memo``), each message fingerprinted once a turn, not twice.
                copies = detached([m for m in messages if isinstance(m, dict)])
                memo: dict[int, str] = {}
                try:
                    self.ingest(copies, kwargs.get("session_id"), memo=memo)
                finally:
                    self._note_shown(kwargs.get("session_id") or self.session_id, copies, memo)
        except Exception:
            log.exception("transcript-store on_turn_complete failed")

    # ------------------------------------------------------------------------------------ inspection

    def stored_messages(self, hermes_session: str | None = None) -> list[dict[str, Any]]:
        """Every message entry of the session's store lineage, in store order."""
        rt = self.runtime()
        store_session = self._store_session(rt, hermes_session)
        out: list[dict[str, Any]] = []
        after = -1
        while True:
            page = rt.store.list_entries(self.scope, store_session, after_seq=after, limit=1000)
            out.extend(e.message for e in page if e.kind == "message" and e.message is not None)
            if len(page) < 1000:
                return out
            after = page[-1].seq
