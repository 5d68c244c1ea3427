"""Hermes plugin: a transcript-store engine as the context engine (written by `transcript-store hermes install`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SETTINGS = Path(__file__).resolve().parent / "settings.json"


def _settings() -> dict[str, Any]:
    """The install-time settings (engine id, database URL, thresholds)."""
    try:
        data = json.loads(SETTINGS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    return data if isinstance(data, dict) else {}


def register(ctx: Any) -> None:
    """Register the adapter instance with the Hermes plugin context."""
    from transcript_store.hermes import create_engine

    settings = _settings()
    kwargs: dict[str, Any] = {"engine": settings.get("engine") or "lossless", "db_url": settings.get("db_url")}
    for key in ("scope", "threshold_percent", "model_thresholds", "engine_config", "context_length", "plugin_dirs"):
        if settings.get(key) is not None:
            kwargs[key] = settings[key]
    ctx.register_context_engine(create_engine(**kwargs))
    register_hook = getattr(ctx, "register_hook", None)
    if callable(register_hook):
        # hermes-agent calls the engine with no conversation at the end of a turn, and cron jobs and
        # subagents never end their session: each finished turn is stored from this hook.
        from transcript_store.hermes import end_turn, note_turn, observe_turn

        register_hook("post_llm_call", observe_turn)
        # A turn interrupted before its reply fires no post_llm_call: stored from what Hermes saved of it,
        # or, in an agent without a session database, from the live list its turn started with.
        register_hook("pre_llm_call", note_turn)
        register_hook("on_session_end", end_turn)
