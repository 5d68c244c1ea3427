"""transcript-store: a durable conversation-transcript store with turn commits."""

# Imported when first asked for (PEP 562), not with the package: importing any module of it (the console
# script's ``transcript_store.entry``, ``python -m transcript_store``) imported the store, SQLAlchemy and
# pydantic first, the second or so in which a Ctrl-C was a traceback out of the import machinery. A name
# asked for is imported then, and kept: ``from transcript_store import TranscriptStore`` is as it was.
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import StoreConfig
    from .errors import (
        AdvancementKeyCollision,
        IdempotencyConflict,
        InvalidInput,
        InvalidMessage,
        PayloadTooLarge,
        PermissionDenied,
        PromptTooLarge,
        ReadFenceError,
        SchemaNotCurrent,
        SessionBusy,
        SessionDeleted,
        SessionKeyConflict,
        SessionReplaced,
        StorageFull,
        StoreClosed,
        StoreUnavailable,
        TranscriptStoreError,
        TransientStoreError,
        TurnBranchedAway,
        TurnFailed,
        TurnKeyConflict,
        TurnOvertaken,
        UnknownEntry,
        UnknownSession,
        UnknownTurn,
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

#: the module of each public name
_MODULES = {
    "config": ("StoreConfig",),
    "errors": (
        "AdvancementKeyCollision", "IdempotencyConflict", "InvalidInput", "InvalidMessage", "PayloadTooLarge",
        "PermissionDenied", "PromptTooLarge", "ReadFenceError", "SchemaNotCurrent", "SessionBusy", "SessionDeleted",
        "SessionKeyConflict", "SessionReplaced", "StorageFull", "StoreClosed", "StoreUnavailable",
        "TranscriptStoreError", "TransientStoreError", "TurnBranchedAway", "TurnFailed", "TurnKeyConflict",
        "TurnOvertaken", "UnknownEntry", "UnknownSession", "UnknownTurn",
    ),
    "models": (
        "CURRENT_TURN_FENCE", "TURN_ADVANCEMENT_IDEMPOTENCY", "Admission", "Anchor", "ClosedRange",
        "ClosedRangeFailure", "DeltaMissing", "DeltaPage", "DeltaReset", "Entry", "Replacement", "RewriteResult",
        "SessionInfo",
    ),
    "store": ("AppendItem", "TranscriptStore"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

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
    "PermissionDenied",
    "PromptTooLarge",
    "ReadFenceError",
    "Replacement",
    "RewriteResult",
    "SchemaNotCurrent",
    "SessionBusy",
    "SessionDeleted",
    "SessionInfo",
    "SessionKeyConflict",
    "SessionReplaced",
    "StorageFull",
    "StoreClosed",
    "StoreConfig",
    "StoreUnavailable",
    "TranscriptStore",
    "TranscriptStoreError",
    "TransientStoreError",
    "TurnBranchedAway",
    "TurnFailed",
    "TurnKeyConflict",
    "TurnOvertaken",
    "UnknownEntry",
    "UnknownSession",
    "UnknownTurn",
]


# The interpreter's alone: a type checker that sees a module's ``__getattr__`` takes every name the module
# lacks for Any (a misspelt name passed unflagged); it has the public names from the imports above.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        """A public name, imported from its module the first time it is asked for; a submodule too."""
        from importlib import import_module
        from importlib.util import find_spec

        module = _HOME.get(name)
        if module is None:
            # A submodule (``transcript_store.store``, ``.errors``) was an attribute once the eager package had
            # imported it; importing it sets the attribute, as ``import transcript_store.store`` does.
            if name.isidentifier() and not name.startswith("__") and find_spec(f"{__name__}.{name}") is not None:
                return import_module(f".{name}", __name__)
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """The module's names, the public ones not imported yet too."""
    return sorted({*globals(), *__all__})
