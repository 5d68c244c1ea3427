"""The lossless engine plugin: a DAG of summaries in the same store, assembled from cursor deltas, with recall tools."""

from __future__ import annotations

from transcript_store.engine import EngineContext

from .engine import LosslessEngine


def create_engine(ctx: EngineContext) -> LosslessEngine:
    """The plugin factory."""
    return LosslessEngine(ctx)


__all__ = ["LosslessEngine", "create_engine"]
