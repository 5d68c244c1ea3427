"""The adapter's defaults and its compression trigger (thresholds, token counts)."""

from __future__ import annotations

import math
from typing import Any

DEFAULT_SCOPE = "hermes"
DEFAULT_THRESHOLD = 0.75


def resolve_threshold(model: str, thresholds: dict[str, Any] | None, default: float) -> float:
    """The threshold of the longest key of ``thresholds`` contained in ``model`` (else ``default``)."""
    best: tuple[int, float] | None = None
    # Keys YAML reads as numbers (``3.5: 0.7``) are model name parts too; values that are no positive
    # finite number are skipped, as is a map that is no mapping.
    items = thresholds.items() if isinstance(thresholds, dict) else ()
    for raw, value in items:
        key = "" if raw is None else str(raw)
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if not math.isfinite(number) or number <= 0:
            continue
        if key and key.lower() in str(model or "").lower() and (best is None or len(key) > best[0]):
            best = (len(key), number)
    return best[1] if best is not None else default


#: the share of the window the trigger is when a threshold would reach the whole window (hermes-agent's
#: built-in compressor, ``_MIN_CTX_TRIGGER_RATIO``, does the same for its own)
MIN_CTX_TRIGGER_RATIO = 0.85


def threshold_tokens(context_length: int, threshold: float) -> int:
    """The trigger in tokens: ``threshold`` is a fraction of the window, or a token count when > 1 (0 for
    no finite number or none above 0, at least 1 for a positive one); one that reaches the window is
    MIN_CTX_TRIGGER_RATIO of it.

    A trigger at or over the window never fires: the provider refuses the request first. A token count
    meets a smaller window when Hermes learns one (a provider's "maximum context length is N", a
    ``/model`` switch, a fallback model), and Hermes then sent every request that grew back over the
    window for the provider to refuse before it compressed."""
    try:
        threshold = float(threshold)
    except (TypeError, ValueError):
        return 0
    if not math.isfinite(threshold):
        return 0
    tokens = int(threshold) if threshold > 1 else int(context_length * threshold)
    if threshold > 0 and context_length > 0:
        # A positive fraction under one token of the window is the smallest trigger: 0 means none, and
        # compression was off for a threshold asking for it almost at once.
        tokens = max(1, tokens)
    if context_length > 0 and tokens >= context_length:
        return max(1, min(int(context_length * MIN_CTX_TRIGGER_RATIO), context_length - 1))
    return tokens


def as_int(value: Any) -> int:
    """A token count from a host's usage value (0 for anything that is no finite number)."""
    try:
        number = float(value or 0)
    except (TypeError, ValueError):
        return 0
    return int(number) if math.isfinite(number) else 0
