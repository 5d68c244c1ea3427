"""transcript-store: a durable conversation-transcript store with turn commits."""

from .config import StoreConfig
from .errors import (
    AdvancementKeyCollision,
    IdempotencyConflict,
    InvalidInput,
    InvalidMessage,
    PayloadTooLarge,
    ReadFenceError,
    SchemaNotCurrent,
    SessionKeyConflict,
    StoreUnavailable,
    TranscriptStoreError,
    TransientStoreError,
    UnknownEntry,
    UnknownSession,
)
from .models import (
    CURRENT_TURN_FENCE,
    TURN_ADVANCEMENT_IDEMPOTENCY,
    Admission,
    Anchor,
    ClosedRange,
    ClosedRangeFailure,
    DeltaMissing,
    DeltaPage,
    DeltaReset,
    Entry,
    Replacement,
    RewriteResult,
    SessionInfo,
)
from .store import AppendItem, TranscriptStore

__version__ = "0.1.0"

__all__ = [
    "CURRENT_TURN_FENCE",
    "TURN_ADVANCEMENT_IDEMPOTENCY",
    "Admission",
    "AdvancementKeyCollision",
    "Anchor",
    "AppendItem",
    "ClosedRange",
    "ClosedRangeFailure",
    "DeltaMissing",
    "DeltaPage",
    "DeltaReset",
    "Entry",
    "IdempotencyConflict",
    "InvalidInput",
    "InvalidMessage",
    "PayloadTooLarge",
    "ReadFenceError",
    "Replacement",
    "RewriteResult",
    "SchemaNotCurrent",
    "SessionInfo",
    "SessionKeyConflict",
    "StoreConfig",
    "StoreUnavailable",
    "TranscriptStore",
    "TranscriptStoreError",
    "TransientStoreError",
    "UnknownEntry",
    "UnknownSession",
]
