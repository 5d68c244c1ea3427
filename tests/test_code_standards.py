"""The project's code standards, checked over the package's source (no backend involved).

- Every error the library raises to a caller is in ``transcript_store/errors.py``, the one error tree:
  ``TurnFailed``, which ``HostRuntime.run_turn`` raises, lived in ``host.py`` and was missing from the
  package's exports.
- Every public function and method of ``transcript_store/`` has type hints and a docstring.
- Doors go one way (DESIGN.md, README "Architecture"): cli -> host -> engine -> store -> schema. The store's
  modules import no engine, host or command; the engine protocol and the bundled engines import no host.
"""

from __future__ import annotations

import ast
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


def _public_functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
                out.append((prefix + node.name, node))

    visit(tree.body, "")
    return out


def test_every_public_function_has_type_hints_and_a_docstring() -> None:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.relative_to(PACKAGE).parts:
            continue
        for name, fn in _public_functions(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(PACKAGE)}:{fn.lineno} {name}"
            if not ast.get_docstring(fn):
                problems.append(f"{where}: no docstring")
            args = fn.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None and arg.arg not in ("self", "cls") and arg.annotation is None:
                    problems.append(f"{where}: {arg.arg} has no type hint")
            if fn.returns is None:
                problems.append(f"{where}: no return type")
    assert problems == [], "\n".join(problems)


#: the modules above the store: the engine protocol and discovery, the host and what runs it
ABOVE_STORE = {
    "engine", "registry", "settings", "host", "host_context", "host_messages", "host_tokens", "compaction",
    "maintenance", "quarantine", "model", "summarize",
    "bundled", "cli", "gateway", "service", "service_app", "service_models", "hermes", "openclaw",
}
#: the modules above the engines: the host runtime and its faces
ABOVE_ENGINE = {
    "host", "host_context", "host_messages", "host_tokens", "maintenance", "cli", "gateway", "service",
    "service_app", "hermes", "openclaw",
}
#: the store's modules: the backend-neutral core, its reads and writes, the outbox and ledger
STORE = {
    "store", "core", "reads", "paths", "fences", "cursors", "schema", "models", "db", "hot", "mirror", "transfer",
    "ledger", "outbox", "turns", "leases", "migrate", "config", "errors", "identity", "shapes", "faults",
}


def _imports(path: Path) -> set[str]:
    """The package's modules ``path`` imports, at its top or inside a function (``engines`` for any of those)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level == 1 or module.startswith("transcript_store"):
            parts = module.split(".")[1:] if module.startswith("transcript_store") else module.split(".")
            found.update([parts[0]] if parts and parts[0] else [a.name for a in node.names])
        elif module == "engines" or module.startswith("engines."):
            found.add("engines")
    return found


def test_doors_go_one_way() -> None:
    """A store module importing the host (or an engine importing it) is the layering DESIGN.md forbids."""
    wrong = []
    for name in sorted(STORE):
        above = _imports(PACKAGE / f"{name}.py") & (ABOVE_STORE | {"engines"})
        if above:
            wrong.append(f"transcript_store/{name}.py imports {sorted(above)}")
    for path in [PACKAGE / "engine.py", PACKAGE / "registry.py", *sorted((PACKAGE.parent / "engines").rglob("*.py"))]:
        above = _imports(path) & ABOVE_ENGINE
        if above:
            wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {sorted(above)}")
    assert wrong == []
