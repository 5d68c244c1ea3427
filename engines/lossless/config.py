"""Configuration of the lossless engine and the token thresholds of one session's context.

Thresholds are fractions of the context window in force: the smaller of ``context_window`` and the
host's budget (the assemble budget, else the run's ``limits.prompt_token_budget``), whichever of them
is known, else DEFAULT_WINDOW. Compaction starts when the context exceeds
``threshold`` and runs until it is under ``target``. ``model_thresholds`` overrides ``threshold`` per
model: the longest configured substring found in the run's resolved (else requested) model name wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, model_validator

from transcript_store.engine import RuntimeSettings
from transcript_store.errors import InvalidInput
from transcript_store.shapes import Shape

DEFAULT_WINDOW = 32_000


class LosslessConfig(Shape):
    """Every knob of the engine (``[engine.config.lossless]``); each default is documented."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    context_window: int | None = Field(
        None, ge=256, description="tokens; the host's budget caps it; default: the host's budget"
    )
    threshold: float = Field(0.75, gt=0, le=1, description="compact when the context exceeds this share")
    target: float = Field(0.5, gt=0, le=1, description="compact until the context is under this share")
    model_thresholds: dict[str, float] = Field(default_factory=dict, description="model substring -> threshold")
    fresh_tail_messages: int = Field(8, ge=0, description="recent messages never compacted")
    fresh_tail_share: float = Field(0.5, gt=0, le=1, description="the protected tail's cap, as a share of target")
    leaf_chunk_messages: int = Field(24, ge=1, description="at most this many messages per leaf summary")
    leaf_chunk_tokens: int = Field(6000, ge=64, description="about this many source tokens per leaf summary")
    leaf_summary_tokens: int = Field(600, ge=16, description="max tokens of a leaf summary")
    condensed_summary_tokens: int = Field(800, ge=16, description="max tokens of a condensed summary")
    condense_fanin: int = Field(4, ge=2, description="condense this many summaries of one depth into one")
    max_rounds: int = Field(24, ge=1, description="leaf/condense steps per compaction")
    page_messages: int = Field(500, ge=1, le=10_000, description="messages per transcript page on import")
    page_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="bytes per transcript page on import")
    expand_max_chars: int = Field(4000, ge=100, description="content cut per item returned by lcm_expand")

    @model_validator(mode="after")
    def _check(self) -> LosslessConfig:
        if self.target > self.threshold:
            raise ValueError("target must not exceed threshold")
        for name, fraction in self.model_thresholds.items():
            if not name or not 0 < fraction <= 1:
                raise ValueError(f"model_thresholds[{name!r}] must be a fraction in (0, 1]")
        return self

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> LosslessConfig:
        """The config from ``ctx.config``; InvalidInput names the first bad key.

        Strict, as the settings file's [turn] knobs and the legacy engine's: a TOML ``true``, ``"16"`` or
        ``16.0`` is no count (lax validation took them as 1 and 16), a string no fraction."""
        try:
            return cls.model_validate(raw or {}, strict=True)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "config"
            raise InvalidInput(f"lossless config: {where}: {first['msg']}") from None


@dataclass(frozen=True)
class Budget:
    """The token marks of one session's context: compact above ``trigger``, down to ``target``."""

    window: int
    trigger: int
    target: int
    tail_tokens: int


def model_threshold(config: LosslessConfig, settings: RuntimeSettings | None) -> float:
    """The threshold for the run's model: the longest matching ``model_thresholds`` key, else the default."""
    if settings is None or not config.model_thresholds:
        return config.threshold
    for name in (settings.model.resolved, settings.model.requested):
        if not name:
            continue
        hits = [key for key in config.model_thresholds if key.lower() in name.lower()]
        if hits:
            return config.model_thresholds[max(hits, key=len)]
    return config.threshold


def budget(config: LosslessConfig, window: int | None, settings: RuntimeSettings | None) -> Budget:
    """The marks for the window in force: the smaller of the configured one and the host's (see module doc)."""
    host = window or (settings.limits.prompt_token_budget if settings is not None else None)
    # A configured window above the host's budget would let the context outgrow what assemble can show:
    # compaction would wait for a threshold the context never reaches, and assemble would cut raw history.
    known = [size for size in (config.context_window, host) if size]
    size = min(known) if known else DEFAULT_WINDOW
    threshold = model_threshold(config, settings)
    trigger = int(size * threshold)
    # A per-model threshold moves the target with it: the hysteresis keeps its configured proportion.
    target = int(trigger * config.target / config.threshold)
    return Budget(size, trigger, target, int(target * config.fresh_tail_share))
