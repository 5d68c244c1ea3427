"""The project's code standards, checked over the package's source (no backend involved).

- Every error the library raises to a caller is in ``transcript_store/errors.py``, the one error tree:
  ``TurnFailed``, which ``HostRuntime.run_turn`` raises, lived in ``host.py`` and was missing from the
  package's exports.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import transcript_store
from transcript_store.errors import TranscriptStoreError

PACKAGE = Path(transcript_store.__file__).resolve().parent


def _modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="transcript_store."):
        if ".migrations" not in info.name and not info.name.endswith("__main__"):
            names.append(info.name)
    return names


def _subclasses(kind: type) -> set[type]:
    found: set[type] = set()
    todo = [kind]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def test_every_error_of_the_package_is_in_errors_py() -> None:
    for name in _modules():
        importlib.import_module(name)
    elsewhere = sorted(
        f"{kind.__module__}.{kind.__qualname__}"
        for kind in _subclasses(TranscriptStoreError)
        if kind.__module__.startswith("transcript_store") and kind.__module__ != "transcript_store.errors"
    )
    assert elsewhere == [], elsewhere
    from transcript_store.host import TurnFailed as from_host

    assert from_host is transcript_store.TurnFailed and "TurnFailed" in transcript_store.__all__
