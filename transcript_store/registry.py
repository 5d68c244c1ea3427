"""Engine discovery: bundled plugin folders, Python entry points, and extra plugin folders.

A plugin folder holds ``plugin.yaml`` (name, description, version, entry: strings, a version may be a
number; at most 64 KiB) and the code. ``entry`` is ``package.module:factory`` for an importable package
(bundled engines) or ``module:factory`` / ``factory`` relative to the folder (extra plugin folders;
``__init__`` by default; dotted names only: never a path, nor a module outside the folder). Third-party
packages register a factory under the ``transcript_store.engines`` entry-point group. A second engine
registering an id that is taken, or an id that is no engine id (control characters, whitespace around
it, over 128 characters), is refused with a warning before its code is loaded; nothing is ever
auto-activated. A plugin that fails to load (SystemExit included) is registered with its error, so that
``doctor`` says why; it never stops the discovery of the others.

A KeyboardInterrupt is the operator's Ctrl-C only when a SIGINT arrived while the plugin's code ran (its import,
its factory, the validation of what it made, its dispose): that one goes on and stops the process, even when
the plugin caught it. One that plugin code raised by itself is that plugin's failure, as SystemExit is
(``_plugin_code``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import yaml

from .engine import (
    EngineContext,
    EngineFactory,
    EngineInfo,
    engine_id_problem,
    engine_label_problem,
    validate_engine,
)
from .errors import DESCRIBE_LIMIT, EngineContractError, InvalidInput, UnknownEngine
from .terminal import quoted

log = logging.getLogger("transcript_store.registry")

_T = TypeVar("_T")

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


#: the largest plugin.yaml read: a manifest is four short strings; past this it is no manifest
MAX_MANIFEST_BYTES = 64 * 1024
#: the manifest's keys that are read (others are ignored, and not kept)
_MANIFEST_KEYS = ("name", "description", "version", "entry")


def _why(error: BaseException) -> str:
    """``Type: message`` of a plugin's error, bounded: an engine's exception says whatever it likes."""
    try:
        text = str(error)
    except Exception:  # an exception whose __str__ raises
        text = "(a message that cannot be read)"
    line = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return line if len(line) <= DESCRIBE_LIMIT else line[: DESCRIBE_LIMIT - 10] + " ... (cut)"


def _manifest(folder: Path) -> dict[str, str]:
    """The plugin.yaml of ``folder``: its name, description, version and entry, as strings (absent ones left out);
    EngineContractError naming the file and the problem otherwise."""
    path = folder / "plugin.yaml"
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise EngineContractError(f"cannot read {path}: {_why(e)}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise EngineContractError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: no plugin manifest")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EngineContractError(f"{path} is not UTF-8 (byte {e.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise EngineContractError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise EngineContractError(f"{path} is nested too deeply") from None
    except ValueError:  # PyYAML's int() past Python's limit on the digits of an integer
        raise EngineContractError(f"{path} holds an integer of too many digits") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EngineContractError(
            f"{path} is not a mapping (name, description, version, entry): a {type(data).__name__}"
        )
    out: dict[str, str] = {}
    for key in _MANIFEST_KEYS:
        value = data.get(key)
        if value is None:
            continue
        # Only a string is taken (a version may be a number): `name: yes` is YAML's True, and an aliased list
        # (a "billion laughs") would be expanded by every str() or JSON dump of it.
        if key == "version" and isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            hint = " (quote it)" if isinstance(value, bool | int | float) else ""
            raise EngineContractError(f"{path}: {key} must be a string, not {type(value).__name__}{hint}")
        if key == "version" and (problem := engine_label_problem(value)) is not None:
            raise EngineContractError(f"{path}: version must have {problem}")
        out[key] = value
    return out


def _entry(entry: str, importable: bool) -> tuple[str, str]:
    """``(module, factory)`` of a manifest's entry: ``module:factory`` or ``factory`` (in ``__init__``), the module
    dotted names only: a plugin folder's entry names a module inside that folder, never a path."""
    module, sep, attr = entry.rpartition(":")
    if not sep:
        module = "__init__"
    if importable and module == "__init__":
        raise EngineContractError(f"entry {entry!r} must be package.module:factory")
    if not attr.isidentifier() or not all(part.isidentifier() for part in module.split(".")):
        raise EngineContractError(
            f"entry {quoted(entry)} is not module:factory (a module of the plugin's folder, dotted names only)"
        )
    return module, attr


def _plugin_code(what: str, call: Callable[[], _T]) -> _T:
    """``call()``, plugin code, with a KeyboardInterrupt told apart from the operator's Ctrl-C.

    Python raises KeyboardInterrupt for a SIGINT, but any code may raise it too. In the main thread, while a
    Python handler of SIGINT is installed (``default_int_handler``: KeyboardInterrupt), a handler that notes a
    KeyboardInterrupt it raised and then calls it is installed around the call (and the one found put back).
    A KeyboardInterrupt is the operator's when that handler raised one during the call: it goes on, and is
    raised again when the plugin caught it (swallowed, or turned into another error). Any other is the
    plugin's own: an EngineContractError naming ``what``. Where no such handler can be installed no SIGINT
    raises in this code (Python runs signal handlers in the main thread only; an ignored SIGINT raises
    nothing, a default one ends the process without Python): every KeyboardInterrupt there is the plugin's.
    """
    interrupted = False
    previous: Any = None
    installed = False

    def note(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        try:
            previous(signum, frame)
        except KeyboardInterrupt:
            interrupted = True
            raise

    if threading.current_thread() is threading.main_thread():
        try:
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                signal.signal(signal.SIGINT, note)
                installed = True
        except (ValueError, OSError):  # not the main interpreter, or no signals here: nothing to tell apart
            pass
    try:
        try:
            result = call()
        finally:
            if installed:
                signal.signal(signal.SIGINT, previous)
    except KeyboardInterrupt as e:
        if interrupted:
            raise
        raise EngineContractError(f"{what} raised KeyboardInterrupt (no interrupt signal arrived)") from e
    except BaseException as e:
        if interrupted:  # the operator's Ctrl-C, turned by the plugin into another error
            raise KeyboardInterrupt from e
        raise
    if interrupted:  # the operator's Ctrl-C, caught by the plugin
        raise KeyboardInterrupt
    return result


def _forget(name: str) -> None:
    """Drop a plugin module that failed to load (and its submodules) from sys.modules: nothing half-loaded."""
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        sys.modules.pop(key, None)


#: the name the bundled engines' package is loaded under when ``engines`` on sys.path is another package
_BUNDLED_ALIAS = "_transcript_store_bundled_engines"


def _import_bundled(module_name: str) -> Any:
    """A bundled engine's module (``engines.<id>``), from BUNDLED_DIR whatever else is called ``engines``.

    The manifests are read from BUNDLED_DIR; the code must come from there too. An application's own
    top-level ``engines`` package, or a folder of that name in the working directory under ``python -m
    transcript_store``, comes first on sys.path: importing ``engines.legacy`` by name ran its code (or
    found no such module) in place of the default engine. The bundled package is then loaded from its
    folder under a private name (its modules import each other relatively)."""
    top, _, rest = module_name.partition(".")
    if top != BUNDLED_DIR.name:
        return importlib.import_module(module_name)
    found = sys.modules.get(top)
    if found is None:
        try:
            spec = importlib.util.find_spec(top)  # finds, runs nothing
        except (ImportError, ValueError):
            spec = None
        places = list(spec.submodule_search_locations or []) if spec is not None else []
    else:
        places = list(getattr(found, "__path__", []))
    if any(Path(p).resolve() == BUNDLED_DIR for p in places):
        return importlib.import_module(module_name)
    if _BUNDLED_ALIAS not in sys.modules:
        _exec_file(_BUNDLED_ALIAS, BUNDLED_DIR / "__init__.py", BUNDLED_DIR)
    return importlib.import_module(f"{_BUNDLED_ALIAS}.{rest}" if rest else _BUNDLED_ALIAS)


def _exec_file(name: str, path: Path, package_dir: Path | None) -> Any:
    """Run the module at ``path`` as ``name`` (a package of ``package_dir`` when given), registered in
    sys.modules; one that fails to load is dropped from it again (``_forget``)."""
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(package_dir)] if package_dir is not None else None
    )
    if spec is None or spec.loader is None:
        raise EngineContractError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        _forget(name)
        raise
    return module


def _load_from_folder(folder: Path, module_name: str, attr: str) -> EngineFactory:
    rel = "__init__.py" if module_name == "__init__" else "/".join(module_name.split(".")) + ".py"
    path = folder / rel
    if not path.is_file():  # missing, a folder, or a FIFO (whose read would never end)
        raise EngineContractError(f"entry module {path} is not a file")
    unique = f"_transcript_store_plugin_{folder.name}_{abs(hash(str(folder)))}"
    module = _exec_file(unique, path, folder if module_name == "__init__" else None)
    try:
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise EngineContractError(f"{path} has no callable {attr!r}")
    except BaseException:
        _forget(unique)
        raise
    return factory  # type: ignore[no-any-return]


class EngineRegistry:
    """Every engine this host can see, by id."""

    def __init__(self, plugin_dirs: list[str] | tuple[str, ...] = (), *, discover: bool = True) -> None:
        """Discover bundled engines, entry points and ``plugin_dirs`` (unless ``discover`` is False).

        ``plugin_dirs`` is a list (or tuple) of folders: a single string was read as a list of one-letter
        folders, each warned about as missing, the folder it named never searched (InvalidInput now)."""
        if isinstance(plugin_dirs, str | bytes | os.PathLike) or not isinstance(plugin_dirs, list | tuple):
            raise InvalidInput(f"plugin_dirs must be a list of folders, not {type(plugin_dirs).__name__}")
        if not all(isinstance(d, str | os.PathLike) for d in plugin_dirs):
            raise InvalidInput("plugin_dirs must be a list of folders (strings or paths)")
        self.specs: dict[str, EngineSpec] = {}
        self.warnings: list[str] = []
        #: the warnings about a ``plugin_dirs`` folder that is missing, no folder, or unreadable: every engine
        #: it was meant to hold is missing too (a typo in the path said nothing where engines run)
        self.plugin_dir_problems: list[str] = []
        if discover:
            self._discover_folder_tree(BUNDLED_DIR, "bundled", importable=True)
            self._discover_entry_points()
            seen: set[str] = set()
            for d in plugin_dirs:
                try:
                    key = os.path.realpath(d)
                except (OSError, ValueError):
                    key = str(d)
                if key not in seen:  # a folder named twice (the settings file and the environment) is read once
                    seen.add(key)
                    self._discover_folder_tree(Path(d), "plugin_dir", importable=False)

    def _refusal(self, engine_id: object, location: str) -> str | None:
        """Why an engine claiming ``engine_id`` is refused (None when it is not): a bad id, or one taken."""
        problem = engine_id_problem(engine_id)
        if problem is not None:
            return f"engine id {quoted(engine_id)} from {location} refused: {problem}"
        assert isinstance(engine_id, str)
        if engine_id in self.specs:
            return (
                f"engine id {engine_id!r} from {location} refused: "
                f"already registered from {self.specs[engine_id].location}"
            )
        return None

    def _claim(self, engine_id: object, location: str) -> bool:
        """Whether ``engine_id`` is free to register; a warning otherwise. Checked before a plugin's code is
        loaded: a refused plugin's module is never run."""
        msg = self._refusal(engine_id, location)
        if msg is not None:
            log.warning(msg)
            self.warnings.append(msg)
            return False
        return True

    def register(self, spec: EngineSpec) -> bool:
        """Add an engine; an id already taken, or no engine id at all, is refused with a warning."""
        if not self._claim(spec.id, spec.location):
            return False
        self.specs[spec.id] = spec
        return True

    def register_factory(self, engine_id: str, factory: EngineFactory, location: str = "code") -> bool:
        """Register an engine factory given in code (InvalidInput when it is not callable: it was taken, and
        failed only when the engine was first made, quarantining it for a mistake of registration)."""
        if not callable(factory):
            raise InvalidInput(f"engine factory for {quoted(engine_id)} must be callable, not {type(factory).__name__}")
        return self.register(EngineSpec(engine_id, "code", location, factory))

    def _discover_folder_tree(self, root: Path, source: str, importable: bool) -> None:
        try:
            if not root.is_dir():
                if source == "plugin_dir":
                    what = "is not a folder" if root.exists() else "does not exist"
                    self._plugin_dir_problem(f"plugin dir {root} {what}")
                return
            children = [root] if _has_manifest(root) else sorted(root.iterdir())
        except (OSError, ValueError) as e:
            msg = f"plugin dir {root} cannot be read: {_why(e)}"
            if source == "plugin_dir":
                self._plugin_dir_problem(msg)
            else:
                self.warnings.append(msg)
            return
        for folder in children:
            try:
                if folder is not root and not _has_manifest(folder):
                    continue
            except (OSError, ValueError) as e:  # one unreadable folder hides no other
                self.warnings.append(f"plugin folder {folder} cannot be read: {_why(e)}")
                continue
            self._discover_folder(folder, source, importable)

    def _plugin_dir_problem(self, msg: str) -> None:
        self.warnings.append(msg)
        self.plugin_dir_problems.append(msg)

    def _discover_folder(self, folder: Path, source: str, importable: bool) -> None:
        location = str(folder)
        try:
            manifest = _manifest(folder)
        except Exception as e:  # a broken plugin is reported (under its folder's name), never fatal for the host
            if self._claim(folder.name, location):
                self.register(EngineSpec(folder.name, source, location, None, {}, _why(e)))
            return
        engine_id = manifest.get("name") or folder.name
        if not self._claim(engine_id, location):
            return
        try:
            module_name, attr = _entry(manifest.get("entry") or "create_engine", importable)
            if importable:
                factory = getattr(
                    _plugin_code("the plugin's import", lambda: _import_bundled(module_name)), attr, None
                )
                if not callable(factory):
                    raise EngineContractError(f"{module_name} has no callable {attr!r}")
            else:
                factory = _plugin_code("the plugin's import", lambda: _load_from_folder(folder, module_name, attr))
        except KeyboardInterrupt:  # the operator's (a SIGINT arrived, _plugin_code): it stops the process
            raise
        except BaseException as e:  # SystemExit from a plugin's import is its failure, not the host's exit
            self.register(EngineSpec(engine_id, source, location, None, manifest, _why(e)))
            return
        self.register(EngineSpec(engine_id, source, location, factory, manifest))

    def _discover_entry_points(self) -> None:
        try:
            found = list(entry_points(group=ENTRY_POINT_GROUP))
        except Exception as e:  # an installed distribution's unreadable metadata
            self.warnings.append(f"entry points of {ENTRY_POINT_GROUP} cannot be read: {_why(e)}")
            return
        for ep in found:
            if not self._claim(ep.name, ep.value):
                continue
            try:
                factory = _plugin_code("the entry point's import", ep.load)
                if not callable(factory):
                    raise EngineContractError(f"entry point {ep.value!r} is not callable: a {type(factory).__name__}")
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                self.register(EngineSpec(ep.name, "entry_point", ep.value, None, {}, _why(e)))
                continue
            self.register(EngineSpec(ep.name, "entry_point", ep.value, factory))

    def create(self, engine_id: str, ctx: EngineContext) -> tuple[Any, EngineInfo]:
        """Make and validate an engine; UnknownEngine when unknown, EngineError when broken or invalid (an
        engine that fails validation is disposed of again). A factory's own exception is raised as it is,
        but one that would end the process (SystemExit) is an EngineContractError."""
        spec = self._spec(engine_id)
        if spec.factory is None:
            raise EngineContractError(f"engine {engine_id!r} failed to load: {spec.error}")
        factory = spec.factory
        try:
            engine = _plugin_code(f"engine {engine_id!r} factory", lambda: factory(ctx))
        except (Exception, KeyboardInterrupt):
            raise
        except BaseException as e:
            raise EngineContractError(f"engine {engine_id!r} factory raised {_why(e)}") from e
        if engine is None:
            raise EngineContractError(f"engine {engine_id!r}: its factory returned None, not an engine")
        try:
            info = _plugin_code(
                f"engine {engine_id!r}: its validation", lambda: validate_engine(engine, expected_id=engine_id)
            )
        except BaseException as e:
            dispose_engine(engine, engine_id)
            if isinstance(e, Exception | KeyboardInterrupt):
                raise
            raise EngineContractError(f"engine {engine_id!r}: its validation raised {_why(e)}") from e
        return engine, info

    def _spec(self, engine_id: object) -> EngineSpec:
        """The registered engine ``engine_id``; UnknownEngine for an id not registered, or for no engine id at
        all (a list raised TypeError from the lookup; a long one is quoted cut)."""
        problem = engine_id_problem(engine_id)
        if problem is not None:
            raise UnknownEngine(f"unknown context engine {quoted(engine_id)}: {problem}")
        assert isinstance(engine_id, str)
        spec = self.specs.get(engine_id)
        if spec is None:
            raise UnknownEngine(f"unknown context engine {engine_id!r}; known: {', '.join(sorted(self.specs))}")
        return spec

    def check(self, engine_id: str, ctx: EngineContext) -> EngineStatus:
        """Load and validate one engine, disposing of it again; UnknownEngine for an id not registered."""
        status, engine = self.load(engine_id, ctx)
        if status.valid:
            dispose_engine(engine, engine_id)
        return status

    def load(self, engine_id: str, ctx: EngineContext) -> tuple[EngineStatus, Any]:
        """``check``, keeping the engine it made (None when it is not valid) for the caller to use and dispose of."""
        spec = self._spec(engine_id)
        try:
            engine, info = self.create(engine_id, ctx)
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            return EngineStatus(spec, None, False, _why(e)), None
        return EngineStatus(spec, info, True, None), engine


def _has_manifest(folder: Path) -> bool:
    return (folder / "plugin.yaml").is_file()


def dispose_engine(engine: Any, engine_id: str) -> None:
    """Dispose of an engine (made only to be checked, found invalid, or done with); a failure is logged,
    never raised, a SystemExit or the plugin's own KeyboardInterrupt too (an operator's Ctrl-C goes on)."""

    def call() -> None:
        dispose = getattr(engine, "dispose", None)
        if callable(dispose):
            dispose()

    try:
        _plugin_code(f"engine {engine_id!r} dispose", call)
    except KeyboardInterrupt:  # the operator's
        raise
    except BaseException as e:
        log.warning("dispose of %s failed: %s", engine_id, _why(e))
