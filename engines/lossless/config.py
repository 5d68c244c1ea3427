"""Configuration of the lossless engine and the token thresholds of one session's context.

Thresholds are fractions of the context window in force: the smaller of ``context_window`` and the
host's budget (the assemble budget, else the run's ``limits.prompt_token_budget``), whichever of them
is known, else DEFAULT_WINDOW. Compaction starts when the context exceeds
``threshold`` and runs until it is under ``target``. ``model_thresholds`` overrides ``threshold`` per
model: the longest configured substring found in the run's resolved (else requested) model name wins.

The summary budgets follow the window too (``summary_caps``): the target less the fresh tail's share is
the room the summaries have, and a leaf is held to ``room // condense_fanin`` (a full run of leaves
fits it before it is condensed), a condensed summary to ``room // 2`` (the leaves made after it fit
beside it), each at most its configured size and at least 16 tokens. With the defaults a window of
9,600 tokens or more keeps the configured 600 and 800.
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
    leaf_summary_tokens: int = Field(
        600, ge=16, description="max tokens of a leaf summary; a small window lowers it (see module doc)"
    )
    condensed_summary_tokens: int = Field(
        800, ge=16, description="max tokens of a condensed summary; a small window lowers it (see module doc)"
    )
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


#: the least a summary budget is lowered to by a small window (the smallest one the config accepts)
MIN_SUMMARY_TOKENS = 16


@dataclass(frozen=True)
class Budget:
    """The token marks of one session's context: compact above ``trigger``, down to ``target``; and the
    summary budgets in force for that window (``summary_caps``)."""

    window: int
    trigger: int
    target: int
    tail_tokens: int
    leaf_summary_tokens: int
    condensed_summary_tokens: int


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
    tail = int(target * config.fresh_tail_share)
    return Budget(size, trigger, target, tail, *summary_caps(config, target - tail))


def summary_caps(config: LosslessConfig, room: int) -> tuple[int, int]:
    """The (leaf, condensed) summary budgets for ``room``, the target's tokens the fresh tail leaves.

    Fixed budgets outgrew a small window: at a window of 1,024 tokens (target 512, tail 256) one leaf of
    600 was larger than the target, compaction ended over it, and the context stayed over the threshold
    (every maintenance pass compacted again, for nothing); at a host budget of 2,000 a summarizer writing
    what it is allowed made condensed summaries of 800, over the target's room, and maintenance condensed
    again after most turns (73 summarizer calls in 30 turns; 19 now). A leaf gets ``room // condense_fanin``: a run of
    ``condense_fanin`` leaves fits the room before it is condensed, with no condensation out of order
    just to reach the target. A condensed summary gets ``room // 2``: it halves at least a full run of
    leaves, and leaves room for the leaves made after it. Each at most its configured size (with the
    defaults, unchanged from a room of 2,400 tokens: a window of 9,600), at least MIN_SUMMARY_TOKENS."""
    leaf = min(config.leaf_summary_tokens, max(MIN_SUMMARY_TOKENS, room // config.condense_fanin))
    condensed = min(config.condensed_summary_tokens, max(MIN_SUMMARY_TOKENS, room // 2))
    return leaf, condensed
