"""Engine discovery: bundled plugin folders, Python entry points, and extra plugin folders.

A plugin folder holds ``plugin.yaml`` (name, description, version, entry) and the code. ``entry`` is
``package.module:factory`` for an importable package (bundled engines) or ``module:factory`` /
``factory`` relative to the folder (extra plugin folders; ``__init__`` by default). Third-party
packages register a factory under the ``transcript_store.engines`` entry-point group. A second engine
registering an id that is taken is refused with a warning; nothing is ever auto-activated.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import yaml

from .engine import EngineContext, EngineFactory, EngineInfo, validate_engine
from .errors import EngineContractError, EngineError

log = logging.getLogger("transcript_store.registry")

ENTRY_POINT_GROUP = "transcript_store.engines"
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "engines"


@dataclass
class EngineSpec:
    """A discovered engine: where it came from and how to make it."""

    id: str
    source: str  # bundled | entry_point | plugin_dir
    location: str
    factory: EngineFactory | None
    manifest: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class EngineStatus:
    """The result of loading and validating one engine (for `doctor` and `engines list`)."""

    spec: EngineSpec
    info: EngineInfo | None
    valid: bool
    reason: str | None


def _manifest(folder: Path) -> dict[str, Any]:
    data = yaml.safe_load((folder / "plugin.yaml").read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise EngineContractError(f"{folder / 'plugin.yaml'} is not a mapping")
    return data


def _load_from_folder(folder: Path, entry: str) -> EngineFactory:
    module_name, _, attr = entry.rpartition(":") if ":" in entry else ("__init__", ":", entry)
    path = folder / ("__init__.py" if module_name == "__init__" else f"{module_name.replace('.', '/')}.py")
    unique = f"_transcript_store_plugin_{folder.name}_{abs(hash(str(folder)))}"
    spec = importlib.util.spec_from_file_location(
        unique, path, submodule_search_locations=[str(folder)] if module_name == "__init__" else None
    )
    if spec is None or spec.loader is None:
        raise EngineContractError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique] = module
    spec.loader.exec_module(module)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EngineContractError(f"{path} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


class EngineRegistry:
    """Every engine this host can see, by id."""

    def __init__(self, plugin_dirs: list[str] | tuple[str, ...] = (), *, discover: bool = True) -> None:
        """Discover bundled engines, entry points and ``plugin_dirs`` (unless ``discover`` is False)."""
        self.specs: dict[str, EngineSpec] = {}
        self.warnings: list[str] = []
        if discover:
            self._discover_folder_tree(BUNDLED_DIR, "bundled", importable=True)
            self._discover_entry_points()
            for d in plugin_dirs:
                self._discover_folder_tree(Path(d), "plugin_dir", importable=False)

    def register(self, spec: EngineSpec) -> bool:
        """Add an engine; an id already taken is refused with a warning."""
        if spec.id in self.specs:
            msg = (
                f"engine id {spec.id!r} from {spec.location} refused: "
                f"already registered from {self.specs[spec.id].location}"
            )
            log.warning(msg)
            self.warnings.append(msg)
            return False
        self.specs[spec.id] = spec
        return True

    def register_factory(self, engine_id: str, factory: EngineFactory, location: str = "code") -> bool:
        """Register an engine factory given in code."""
        return self.register(EngineSpec(engine_id, "code", location, factory))

    def _discover_folder_tree(self, root: Path, source: str, importable: bool) -> None:
        if not root.is_dir():
            if source == "plugin_dir":
                self.warnings.append(f"plugin dir {root} does not exist")
            return
        folders = (
            [root]
            if (root / "plugin.yaml").is_file()
            else sorted(p for p in root.iterdir() if (p / "plugin.yaml").is_file())
        )
        for folder in folders:
            self._discover_folder(folder, source, importable)

    def _discover_folder(self, folder: Path, source: str, importable: bool) -> None:
        engine_id = folder.name
        try:
            manifest = _manifest(folder)
            engine_id = str(manifest.get("name") or folder.name)
            entry = str(manifest.get("entry") or "create_engine")
            if importable:
                module_name, _, attr = entry.partition(":")
                factory = getattr(importlib.import_module(module_name), attr or "create_engine")
            else:
                factory = _load_from_folder(folder, entry)
            self.register(EngineSpec(engine_id, source, str(folder), factory, manifest))
        except Exception as e:  # a broken plugin is reported (under the name it gives), never fatal for the host
            self.register(EngineSpec(engine_id, source, str(folder), None, {}, f"{type(e).__name__}: {e}"))

    def _discover_entry_points(self) -> None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                factory = ep.load()
                self.register(EngineSpec(ep.name, "entry_point", ep.value, factory))
            except Exception as e:
                self.register(EngineSpec(ep.name, "entry_point", ep.value, None, {}, f"{type(e).__name__}: {e}"))

    def create(self, engine_id: str, ctx: EngineContext) -> tuple[Any, EngineInfo]:
        """Make and validate an engine; EngineError when unknown, broken or invalid."""
        spec = self.specs.get(engine_id)
        if spec is None:
            raise EngineError(f"unknown context engine {engine_id!r}; known: {', '.join(sorted(self.specs))}")
        if spec.factory is None:
            raise EngineContractError(f"engine {engine_id!r} failed to load: {spec.error}")
        engine = spec.factory(ctx)
        return engine, validate_engine(engine, expected_id=engine_id)

    def check(self, engine_id: str, ctx: EngineContext) -> EngineStatus:
        """Load and validate one engine, disposing of it again."""
        spec = self.specs[engine_id]
        try:
            engine, info = self.create(engine_id, ctx)
        except Exception as e:
            return EngineStatus(spec, None, False, f"{type(e).__name__}: {e}")
        dispose = getattr(engine, "dispose", None)
        if callable(dispose):
            try:
                dispose()
            except Exception as e:
                log.warning("dispose of %s failed: %s", engine_id, e)
        return EngineStatus(spec, info, True, None)
