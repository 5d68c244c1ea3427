"""A hostile review of engine discovery and host settings: plugin manifests and entries, entry points, engine
info declarations, the settings file and TRANSCRIPT_STORE_* variables, and what `doctor` / `engines list` show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from transcript_store.engine import EngineContext, EngineInfo, TranscriptSemantics, coerce_info
from transcript_store.errors import EngineContractError, InvalidInput, UnknownEngine
from transcript_store.registry import EngineRegistry
from transcript_store.settings import HostSettings, load_settings

GOOD = """
from transcript_store.engine import AssembleResult, EngineInfo


class Engine:
    info = EngineInfo(id={id!r})

    def assemble(self, **kw):
        return AssembleResult(messages=[], estimated_tokens=0)


def create_engine(ctx):
    return Engine()
"""

ESC = "ev\x1b]0;owned\x07il"
CLI = [str(Path(sys.executable).parent / "transcript-store")]
#: the largest plugin.yaml read (registry.MAX_MANIFEST_BYTES)
MAX_MANIFEST_BYTES = 64 * 1024


def plugin(root: Path, folder: str, manifest: str | bytes, source: str | None = None) -> Path:
    """A plugin folder under ``root``: its plugin.yaml as given, and ``__init__.py`` when ``source`` is."""
    d = root / folder
    d.mkdir(parents=True)
    (d / "plugin.yaml").write_bytes(manifest if isinstance(manifest, bytes) else manifest.encode("utf-8"))
    if source is not None:
        (d / "__init__.py").write_text(source, encoding="utf-8")
    return d


def good(root: Path, engine_id: str = "good") -> Path:
    return plugin(root, engine_id, f"name: {engine_id}\n", GOOD.format(id=engine_id))


def marker_source(marker: Path, body: str = "") -> str:
    """Module code that leaves ``marker`` behind when it is run."""
    return f"open({str(marker)!r}, 'w').close()\n{body}"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TRANSCRIPT_STORE_ENGINE", "TRANSCRIPT_STORE_PLUGIN_DIRS", "TRANSCRIPT_STORE_CONFIG"):
        monkeypatch.delenv(var, raising=False)


def plugin_modules() -> set[str]:
    return {name for name in sys.modules if name.startswith("_transcript_store_plugin_")}


# ---------------------------------------------------------------------------------------------- plugin code


def test_a_plugin_that_exits_is_a_broken_plugin_not_the_end_of_discovery(tmp_path: Path) -> None:
    """SystemExit from a plugin's import or factory: before, EngineRegistry() (and so `doctor`) exited with the
    plugin's code, silently, the other engines unseen."""
    plugins = tmp_path / "plugins"
    plugin(plugins, "a-exits", "name: exits-on-import\n", "raise SystemExit(0)\n")
    plugin(plugins, "b-factory", "name: exits-in-factory\n", "def create_engine(ctx):\n    raise SystemExit(3)\n")
    good(plugins, "z-good")
    before = plugin_modules()
    registry = EngineRegistry([str(plugins)])
    assert {"exits-on-import", "exits-in-factory", "z-good"} <= set(registry.specs)
    broken = registry.specs["exits-on-import"]
    assert broken.factory is None and "SystemExit" in (broken.error or "")
    assert not any("a-exits" in name for name in plugin_modules() - before)
    ctx = EngineContext(store=None)
    status = registry.check("exits-in-factory", ctx)
    assert not status.valid and "SystemExit: 3" in (status.reason or "")
    with pytest.raises(EngineContractError, match="SystemExit"):
        registry.create("exits-in-factory", ctx)
    assert registry.check("z-good", ctx).valid


def test_a_plugin_that_fails_to_import_leaves_no_module_behind(tmp_path: Path) -> None:
    """Nothing half-loaded: before, a failed plugin module stayed in sys.modules (KeyboardInterrupt
    included: raised by the plugin, with no interrupt signal, it is that plugin's failure)."""
    plugins = tmp_path / "plugins"
    plugin(plugins, "raises", "name: raises\n", "import sys\nraise RuntimeError('boom')\n")
    plugin(plugins, "uncallable", "name: uncallable\n", "create_engine = 42\n")
    before = plugin_modules()
    registry = EngineRegistry([str(plugins)])
    assert "RuntimeError: boom" in (registry.specs["raises"].error or "")
    assert "no callable 'create_engine'" in (registry.specs["uncallable"].error or "")
    assert plugin_modules() == before
    interrupted = tmp_path / "interrupted"
    plugin(interrupted, "kbd", "name: kbd\n", "raise KeyboardInterrupt\n")
    spec = EngineRegistry([str(interrupted)]).specs["kbd"]
    assert spec.factory is None and "KeyboardInterrupt" in (spec.error or "")
    assert plugin_modules() == before


@pytest.mark.parametrize(("entry", "words"), [
    ("../outside:create_engine", "is not module:factory"),          # a path up
    ("...outside:create_engine", "is not module:factory"),          # dots made slashes: once /outside.py
    ("{outside}:create_engine", "is not module:factory"),           # an absolute path: once loaded
    ("sub/../../outside:create_engine", "is not module:factory"),
    ("outside:create_engine:x", "is not module:factory"),
    (":create_engine", "is not module:factory"),
    ("outside:", "is not module:factory"),
    ("os.path:join", "outside/os/path.py is not a file"),           # a folder's entry names its own files only
])
def test_an_entry_never_names_code_outside_its_folder(tmp_path: Path, entry: str, words: str) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "outside.py").write_text(marker_source(marker, GOOD.format(id="outside")), encoding="utf-8")
    plugins = tmp_path / "plugins"
    (plugins / "outside" / "sub").mkdir(parents=True)
    entry = entry.replace("{outside}", str(tmp_path / "outside"))
    (plugins / "outside" / "plugin.yaml").write_text(f"name: outside\nentry: {json.dumps(entry)}\n")
    registry = EngineRegistry([str(plugins)])
    spec = registry.specs["outside"]
    assert spec.factory is None and words in (spec.error or ""), spec.error
    assert not marker.exists()


def test_an_entry_module_that_is_no_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A FIFO named as the entry module: before, discovery read it forever (in a subprocess here, bounded)."""
    plugins = tmp_path / "plugins"
    os.mkfifo(plugin(plugins, "fifo", "name: fifo\n") / "__init__.py")
    plugin(plugins, "folder", "name: folder\nentry: 'folder:create_engine'\n")
    (plugins / "folder" / "folder.py").mkdir()
    script = (
        "import json, sys\nfrom transcript_store.registry import EngineRegistry\n"
        "specs = EngineRegistry([sys.argv[1]]).specs\n"
        "print(json.dumps({k: specs[k].error for k in ('fifo', 'folder')}))\n"
    )
    try:
        result = subprocess.run([sys.executable, "-c", script, str(plugins)], capture_output=True, text=True,
                                timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("discovery read the FIFO for 20 s")
    errors = json.loads(result.stdout)
    for engine_id in ("fifo", "folder"):
        assert "is not a file" in (errors[engine_id] or ""), errors


def test_a_refused_duplicate_is_never_run(tmp_path: Path) -> None:
    """An id already taken is refused before the plugin's code is loaded: before, its module ran (and stayed in
    sys.modules) only to be refused."""
    marker = tmp_path / "ran"
    plugins = tmp_path / "plugins"
    plugin(plugins, "a-first", "name: twin\n", GOOD.format(id="twin"))
    plugin(plugins, "b-second", "name: twin\n", marker_source(marker, GOOD.format(id="twin")))
    plugin(plugins, "c-legacy", "name: legacy\n", marker_source(marker))
    registry = EngineRegistry([str(plugins)])
    assert registry.specs["twin"].location.endswith("a-first")
    assert sum("'twin'" in w and "refused" in w for w in registry.warnings) == 1
    assert any("'legacy'" in w and "c-legacy" in w for w in registry.warnings)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------- manifests


def _laughs(levels: int) -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("manifest", "words"), [
    ("- name\n- entry\n", "is not a mapping"),
    ("name: yes\n", "name must be a string, not bool (quote it)"),         # was the engine 'True'
    ("name: {a: 1}\n", "name must be a string, not dict"),                   # was the engine "{'a': 1}"
    ("name: laughs\nentry: [create_engine]\n", "entry must be a string"),
    (_laughs(9) + "name: laughs\nversion: *l8\n", "version must be a string, not list"),  # 9**9 items if shown
    (_laughs(9) + "name: laughs\ndescription: *l8\n", "description must be a string"),
    ('name: laughs\nversion: "1\\e[31m"\n', "version must have no control characters"),
    (b"name: caf\xe9\n", "is not UTF-8"),
    ("name: [unclosed\n", "is not valid YAML"),
    ("name: " + "[" * 5000 + "\n", "nested too deeply"),
    ("# padding\n" * (MAX_MANIFEST_BYTES // 10 + 1) + "name: big\n", f"larger than {MAX_MANIFEST_BYTES} bytes"),
])
def test_a_bad_manifest_is_one_broken_plugin_named_by_its_folder(tmp_path: Path, manifest: str | bytes,
                                                                 words: str) -> None:
    plugins = tmp_path / "plugins"
    # the code is there and loads: only the manifest is wrong (a laughs version once reached the JSON of doctor)
    plugin(plugins, "laughs", manifest, "def create_engine(ctx):\n    return None\n")
    good(plugins)
    registry = EngineRegistry([str(plugins)])
    spec = registry.specs["laughs"]
    # plain values only in the assertion: pytest would show the spec, an aliased manifest expanded
    loaded, error = spec.factory is not None, spec.error or ""
    assert not loaded and words in error, error
    assert all(isinstance(v, str) for v in spec.manifest.values())
    assert registry.check("good", EngineContext(store=None)).valid


def test_a_numeric_version_is_a_version(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugin(plugins, "numbered", "name: numbered\nversion: 1.0\ndescription: one\nauthor: [x]\n",
           GOOD.format(id="numbered"))
    spec = EngineRegistry([str(plugins)]).specs["numbered"]
    assert spec.manifest == {"name": "numbered", "version": "1.0", "description": "one"}


@pytest.mark.parametrize("name", [ESC, "nul\x00id", " legacy", "legacy ", "x" * 129, "csi\x9b31m"])
def test_an_engine_id_that_no_terminal_or_slot_can_take_is_refused(tmp_path: Path, name: str) -> None:
    """Before, `name: "ev\\e]0;owned\\aile"` registered an engine whose id the engines table printed raw."""
    plugins = tmp_path / "plugins"
    marker = tmp_path / "ran"
    plugin(plugins, "named", f"name: {json.dumps(name)}\n", marker_source(marker, GOOD.format(id=name)))
    good(plugins)
    registry = EngineRegistry([str(plugins)])
    assert set(registry.specs) == {"legacy", "lossless", "good"}
    assert any("refused" in w and "named" in w for w in registry.warnings), registry.warnings
    assert not marker.exists()
    if "\x00" in name:
        return  # no folder has such a name
    # a folder's own name, used when its manifest cannot be read, is held to the same rule
    other = tmp_path / "other"
    plugin(other, name, b"\xff")
    registry = EngineRegistry([str(other)])
    assert set(registry.specs) == {"legacy", "lossless"} and any("refused" in w for w in registry.warnings)


# ---------------------------------------------------------------------------------------------- entry points


def test_entry_points_with_bad_names_taken_names_or_no_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    marker = tmp_path / "ran"
    site = tmp_path / "site"
    pkg = site / "review_engines"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(marker_source(marker, "NOT_A_FACTORY = 7\n" + GOOD.format(id="ep-good")))
    dist = site / "review_engines-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: review-engines\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[transcript_store.engines]\n"
        "legacy = review_engines:create_engine\n"                # taken: never imported
        "ev\x1b]0;owned = review_engines:create_engine\n"        # no engine id: never imported
    )
    monkeypatch.syspath_prepend(str(site))
    registry = EngineRegistry()
    assert registry.specs["legacy"].source == "bundled"
    assert not any("\x1b" in engine_id for engine_id in registry.specs)
    assert len([w for w in registry.warnings if "review_engines" in w and "refused" in w]) == 2
    assert not marker.exists() and "review_engines" not in sys.modules
    (dist / "entry_points.txt").write_text("[transcript_store.engines]\nep-seven = review_engines:NOT_A_FACTORY\n")
    registry = EngineRegistry()
    spec = registry.specs["ep-seven"]
    assert spec.factory is None and "not callable" in (spec.error or ""), spec.error
    sys.modules.pop("review_engines", None)


# ---------------------------------------------------------------------------------------------- engine info


class _Engine:
    def __init__(self, info: Any) -> None:
        self.info = info
        self.disposed = False

    def assemble(self, **kw: Any) -> Any:
        raise AssertionError("not called")

    def dispose(self) -> None:
        self.disposed = True


@pytest.mark.parametrize(("info", "words"), [
    # EngineInfo instances made without validation: before, taken as they were (a dict for its semantics
    # crashed `doctor` with AttributeError: 'dict' object has no attribute 'current_turn_fence')
    (EngineInfo.model_construct(id="x", transcript_semantics={"current_turn_fence": 1}), "transcript_semantics"),
    (EngineInfo.model_construct(id=None), "info.id"),
    (EngineInfo(id="x").model_copy(update={"accepted_host_params": "session_key"}), "accepted_host_params"),
    (EngineInfo(id="x").model_copy(update={"owns_compaction": "yes please"}), "owns_compaction"),
    ({"id": "x", "version": "\x1b[31m"}, "info.version: no control characters"),
    ({"id": "x", "name": "n" * 300}, "info.name: at most 256"),
    ({"id": "x\x1b"}, "info.id: an engine id must not contain control characters"),
    ({"id": "x", "transcript_semantics": "atomic"}, "transcript_semantics"),
    ([("id", "x")], "engine has no info"),
])
def test_engine_info_is_validated_however_it_was_made(info: Any, words: str) -> None:
    with pytest.raises(EngineContractError, match=words.replace(".", r"\.")):
        coerce_info(info)
    registry = EngineRegistry(discover=False)
    made: list[_Engine] = []
    registry.register_factory("x", lambda ctx: made.append(_Engine(info)) or made[-1])
    status = registry.check("x", EngineContext(store=None))
    assert not status.valid and status.info is None and "EngineContractError" in (status.reason or "")
    assert made and made[0].disposed  # an engine that failed validation is disposed of again


def test_a_valid_info_built_any_way_is_still_taken() -> None:
    semantics = TranscriptSemantics(current_turn_fence="before-current-turn-entry-v1")
    info = EngineInfo(id="x", version="1.2.3").model_copy(update={"transcript_semantics": semantics})
    assert coerce_info(info) == info
    assert coerce_info({"id": "mötor-1.2", "name": "Mötor"}).id == "mötor-1.2"


def test_a_factory_returning_nothing_and_an_unknown_id_are_typed_errors() -> None:
    registry = EngineRegistry(discover=False)
    registry.register_factory("none", lambda ctx: None)
    with pytest.raises(EngineContractError, match="returned None"):
        registry.create("none", EngineContext(store=None))
    # an unknown id is UnknownEngine (a LookupError), from create and from check (before: EngineError, KeyError)
    with pytest.raises(UnknownEngine):
        registry.create("missing", EngineContext(store=None))
    with pytest.raises(UnknownEngine):
        registry.check("missing", EngineContext(store=None))
    assert not registry.register_factory("bad\x1bid", lambda ctx: None)
    assert "bad\x1bid" not in registry.specs and "refused" in registry.warnings[-1]


# ---------------------------------------------------------------------------------------------- plugin folders


def test_plugin_dirs_that_are_files_loops_or_named_twice(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    good(plugins)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    (plugins / "self").symlink_to(plugins)  # a plugin dir holding a link to itself
    registry = EngineRegistry([str(a_file), str(loop), str(plugins), str(plugins) + "/", str(tmp_path / "no")])
    assert registry.check("good", EngineContext(store=None)).valid
    assert f"plugin dir {a_file} is not a folder" in registry.warnings
    assert f"plugin dir {tmp_path / 'no'} does not exist" in registry.warnings
    assert not any("refused" in w for w in registry.warnings), registry.warnings  # the same folder is read once


# ---------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(("text", "words"), [
    ('[engine]\nslot = "ev\\u001b]0;owned\\u0007il"\n', r"engine\.slot .*control characters"),
    ('[engine]\nslot = " lossless"\n', r"engine\.slot ' lossless': .*whitespace"),
    ('[engine]\nslot = "' + "x" * 129 + '"\n', r"engine\.slot .*1\.\.128 characters"),
    ('[engine]\nplugin_dirs = ["ok", "\\u0000"]\n', r"engine\.plugin_dirs: '\\x00' is no folder name"),
    ("a = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("[turn]\ncompaction_threshold = nan\n", r"turn\.compaction_threshold"),
    ("[turn]\nmodel_timeout_seconds = inf\n", r"turn\.model_timeout_seconds: Input should be a finite number"),
    ("[turn]\nmax_tool_steps = 99999999999999999999999999\n", r"turn\.max_tool_steps"),
    ("[turn]\nprune_keep_recent_tool_results = -1\n", r"turn\.prune_keep_recent_tool_results"),
    ("[turn]\nmax_attempts = 2.0\n", r"turn\.max_attempts"),
])
def test_bad_settings_files_are_invalid_input(tmp_path: Path, text: str, words: str) -> None:
    config = tmp_path / "transcript-store.toml"
    config.write_text(text, encoding="utf-8")
    with pytest.raises(InvalidInput, match=words):
        load_settings(str(config))


def test_a_plugin_dir_that_is_a_link_loop_is_the_registrys_warning(tmp_path: Path) -> None:
    """Before, Path.resolve raised RuntimeError (an internal error line in every command)."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    config = tmp_path / "transcript-store.toml"
    config.write_text('[engine]\nplugin_dirs = ["loop"]\n', encoding="utf-8")
    assert load_settings(str(config)).plugin_dirs == [str(tmp_path / "loop")]


@pytest.mark.parametrize(("value", "words"), [
    (" ", "whitespace"), ("  legacy", "whitespace"), ("legacy\n", "control characters"), (ESC, "control characters"),
])
def test_the_engine_variable_must_be_an_engine_id(monkeypatch: pytest.MonkeyPatch, value: str, words: str) -> None:
    """Before, TRANSCRIPT_STORE_ENGINE=" " selected the engine " " (and an ESC reached the engines table's title)."""
    monkeypatch.setenv("TRANSCRIPT_STORE_ENGINE", value)
    with pytest.raises(InvalidInput, match=f"TRANSCRIPT_STORE_ENGINE .*{words}"):
        load_settings(config_path=None)
    monkeypatch.setenv("TRANSCRIPT_STORE_ENGINE", "")  # empty: not set
    assert load_settings(config_path=None).engine_source == "default"


def test_the_engine_argument_must_be_an_engine_id() -> None:
    """Before, engine="" kept the configured source with the engine "" (no engine at all)."""
    for value in ("", ESC, " x"):
        with pytest.raises(InvalidInput, match="engine argument"):
            load_settings(config_path=None, engine=value)
    with pytest.raises(InvalidInput, match="invalid HostSettings: engine"):
        HostSettings(engine="x\x00")
    assert load_settings(config_path=None, engine="mötor").engine == "mötor"


# ---------------------------------------------------------------------------------------------- the commands


def _zoo(root: Path) -> None:
    """A plugin dir with every kind of broken plugin, and one good one."""
    plugins = root / "plugins"
    plugin(plugins, "exits", "name: exits\n", "raise SystemExit(0)\n")
    plugin(plugins, "factory-exits", "name: factory-exits\n", "def create_engine(ctx):\n    raise SystemExit(0)\n")
    unvalidated = "EngineInfo.model_construct(id='unvalidated', transcript_semantics={'fence': 1})"
    plugin(plugins, "unvalidated", "name: unvalidated\n",
           GOOD.format(id="unvalidated").replace("EngineInfo(id='unvalidated')", unvalidated))
    plugin(plugins, "esc-id", f"name: {json.dumps(ESC)}\n", GOOD.format(id=ESC))
    plugin(plugins, "esc-version", "name: esc-version\n", GOOD.format(id="esc-version").replace(
        "EngineInfo(id='esc-version')", f"EngineInfo.model_construct(id='esc-version', version={ESC!r})"))
    plugin(plugins, "laughs", _laughs(6) + "name: laughs\nversion: *l5\n", "def create_engine(ctx):\n    return 1\n")
    plugin(plugins, "outside", f"name: outside\nentry: '{root / 'outside'}:create_engine'\n")
    (root / "outside.py").write_text(marker_source(root / "ran", GOOD.format(id="outside")), encoding="utf-8")
    good(plugins)
    (root / "transcript-store.toml").write_text('[engine]\nplugin_dirs = ["plugins"]\n', encoding="utf-8")


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    clean.update({"COLUMNS": "200", **(env or {})})
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, env=clean, timeout=120)


@pytest.mark.parametrize("backend", ["sqlite"])  # plugin discovery opens no store: one backend says it (CI time)
def test_doctor_and_engines_list_report_every_broken_plugin_and_the_good_one(store_url: str, tmp_path: Path) -> None:
    """As real subprocesses: before, the exiting plugin ended `doctor` with exit 0 and no output at all."""
    _zoo(tmp_path)
    report = _cli("doctor", "--json", "--db", store_url, cwd=tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    assert "Traceback" not in report.stderr
    data = json.loads(report.stdout)
    engines = {e["id"]: e for e in data["engines"]}
    assert data["ok"] and engines["good"]["valid"] and engines["legacy"]["selected"]
    for engine_id, words in [("exits", "SystemExit"), ("factory-exits", "SystemExit"),
                             ("unvalidated", "transcript_semantics"), ("esc-version", "info.version"),
                             ("laughs", "version must be a string"), ("outside", "is not module:factory")]:
        assert not engines[engine_id]["valid"] and words in engines[engine_id]["reason"], engines[engine_id]
    assert not any("\x1b" in engine_id for engine_id in engines)
    assert any("refused" in w and "esc-id" in w for w in data["warnings"])
    assert not (tmp_path / "ran").exists()
    for command in (("doctor",), ("engines", "list")):
        result = _cli(*command, "--db", store_url, cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        assert "\x1b" not in result.stdout + result.stderr, repr(result.stdout)
        assert "good" in result.stdout and "factory-exits" in result.stdout


def test_a_bad_slot_is_a_usage_error_not_an_escape_on_the_terminal(tmp_path: Path) -> None:
    """Before, an ESC in engine.slot or TRANSCRIPT_STORE_ENGINE reached the engines table's title raw."""
    url = f"sqlite:///{tmp_path / 'none.db'}"
    (tmp_path / "transcript-store.toml").write_text('[engine]\nslot = "ev\\u001b]0;owned\\u0007il"\n')
    (tmp_path / "elsewhere").mkdir()
    for command, cwd, env in [(("engines", "list"), tmp_path, {}), (("doctor",), tmp_path, {}),
                              (("engines", "list"), tmp_path / "elsewhere", {"TRANSCRIPT_STORE_ENGINE": ESC})]:
        result = _cli(*command, "--db", url, cwd=cwd, env=env)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "\x1b" not in result.stdout + result.stderr and "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
