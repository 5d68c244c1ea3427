"""The host's token counts: the tokens a request carries besides the engine's
context (system prompt, tools, user message, an engine's system-prompt addition), counted once per
distinct text. A mixin of ``HostRuntime`` (host.py), split out of it."""

from __future__ import annotations

import json
from typing import Any

from .engine import EngineInfo, RuntimeSettings
from .errors import EngineContractError
from .host_messages import with_addition
from .settings import HostSettings


class TokenCounts:
    """``HostRuntime``'s token counting of what a request carries (its fields, declared here for the type checker)."""

    settings: HostSettings
    estimator: Any
    _fixed_tokens: dict[tuple[str, str], int]
    _addition_counts: dict[tuple[str, str], int]

    @staticmethod
    def _check_addition(info: EngineInfo, extra: int, budget: int) -> None:
        """EngineContractError when an addition alone takes the prompt's whole budget: fitting the request
        would drop all of the engine's context and still send an addition over the budget. The turn goes
        to the legacy path (an engine failure, turn-local: ``_attempt``), and its reason says why."""
        if extra >= budget:
            raise EngineContractError(
                f"the system-prompt addition of engine {info.id} alone is {extra} tokens, and the prompt has"
                f" {budget} besides the system prompt, the user message, the tools and the reply"
            )

    @staticmethod
    def _with_budget(settings: RuntimeSettings, budget: int) -> RuntimeSettings:
        limits = settings.limits.model_copy(update={"prompt_token_budget": budget})
        return settings.model_copy(update={"limits": limits})

    def _addition_tokens(self, addition: str | None) -> int:
        """What an engine's system-prompt addition adds to the request's system message (``with_addition``):
        the difference of the two counts, exact whatever the estimator's framing or merges across the join."""
        if not addition:
            return 0
        system = self.settings.system_prompt
        # Counted once per distinct addition (an engine's is mostly one fixed hint): each turn asks twice.
        key = (system, addition)
        extra = self._addition_counts.get(key)
        if extra is None:
            est = self.estimator
            joined = int(est.count_messages([{"role": "system", "content": with_addition(system, addition)}]))
            extra = max(0, joined - int(est.count_messages([{"role": "system", "content": system}])))
            if len(self._addition_counts) >= 64:
                self._addition_counts.clear()
            self._addition_counts[key] = extra
        return extra

    def _reserved_tokens(self, user: dict[str, Any], tools: list[dict[str, Any]]) -> int:
        """The tokens of what a request carries besides the assembled context (system prompt, the user
        message, the tools' schemas as JSON); the engine's system-prompt addition, known only once it has
        assembled, is reserved after that (``_fit_addition``)."""
        return self._carried_tokens(tools) + int(self.estimator.count_messages([user]))

    def _carried_tokens(self, tools: list[dict[str, Any]]) -> int:
        """The tokens every request carries whatever its user message: the system prompt and the tools."""
        # Counted once per distinct system prompt and tool list (they rarely change), the user message
        # every turn: a host turn is ~2 ms of CPU, and counting the schemas each time was 15 µs of it.
        est = self.estimator
        key = (self.settings.system_prompt, json.dumps(tools) if tools else "")
        fixed = self._fixed_tokens.get(key)
        if fixed is None:
            system = int(est.count_messages([{"role": "system", "content": key[0]}]))
            fixed = system + (int(est.count_text(key[1])) if tools else 0)
            if len(self._fixed_tokens) >= 64:
                self._fixed_tokens.clear()
            self._fixed_tokens[key] = fixed
        return fixed
