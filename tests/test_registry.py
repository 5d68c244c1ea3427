"""Engine discovery and selection: bundled folders, entry points, plugin folders, settings, quarantine records."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from transcript_store import TranscriptStore
from transcript_store.engine import EngineContext
from transcript_store.errors import EngineContractError, InvalidInput
from transcript_store.identity import ProcessIdentity
from transcript_store.quarantine import records
from transcript_store.registry import EngineRegistry
from transcript_store.schema import quarantine
from transcript_store.settings import load_settings

ENGINE_SOURCE = """
from transcript_store.engine import AssembleResult, EngineInfo


class Engine:
    info = EngineInfo(id="{id}", name="{id}")

    def __init__(self, ctx):
        self.ctx = ctx

    def assemble(self, **kw):
        return AssembleResult(messages=[], estimated_tokens=0)


def create_engine(ctx):
    return Engine(ctx)
"""


def plugin(folder: Path, engine_id: str, source: str = ENGINE_SOURCE) -> Path:
    folder.mkdir(parents=True)
    (folder / "plugin.yaml").write_text(f"name: {engine_id}\nversion: 1.0\nentry: create_engine\n")
    (folder / "__init__.py").write_text(source.replace("{id}", engine_id))
    return folder


def test_bundled_engines_are_discovered_and_valid(store: TranscriptStore) -> None:
    registry = EngineRegistry()
    assert {"legacy", "lossless"} <= set(registry.specs)
    for engine_id in ("legacy", "lossless"):
        status = registry.check(engine_id, EngineContext(store=store))
        assert status.valid and status.info is not None and status.info.id == engine_id


def test_plugin_dirs_entry_points_and_duplicates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = tmp_path / "plugins"
    plugin(plugins / "window", "window")
    plugin(plugins / "again", "legacy")  # a second engine with a taken id
    broken = "class Engine:\n    info = {'id': 'broken'}\n\ndef create_engine(ctx):\n    return Engine()\n"
    plugin(plugins / "broken", "broken", broken)
    # A third-party package registering through the entry-point group, installed as a dist-info.
    site = tmp_path / "site"
    pkg = site / "thirdparty_engine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(ENGINE_SOURCE.replace("{id}", "thirdparty"))
    dist = site / "thirdparty_engine-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-engine\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[transcript_store.engines]\nthirdparty = thirdparty_engine:create_engine\n")
    monkeypatch.syspath_prepend(str(site))

    registry = EngineRegistry([str(plugins)])
    assert registry.specs["window"].source == "plugin_dir"
    assert registry.specs["thirdparty"].source == "entry_point"
    assert registry.specs["legacy"].source == "bundled"  # the first registration wins
    assert any("'legacy'" in w and "refused" in w for w in registry.warnings)
    ctx = EngineContext(store=None)
    assert registry.check("window", ctx).valid and registry.check("thirdparty", ctx).valid
    status = registry.check("broken", ctx)
    assert not status.valid and "assemble" in (status.reason or "")
    with pytest.raises(EngineContractError):
        registry.create("broken", ctx)
    sys.modules.pop("thirdparty_engine", None)


def test_a_plugin_that_fails_to_load_is_reported_under_its_name(tmp_path: Path, store: TranscriptStore) -> None:
    plugins = tmp_path / "plugins"
    plugin(plugins / "window-1.2", "window", "def create_engine(ctx):\n    return 1 +\n")  # a syntax error
    plugin(plugins / "shadow", "legacy", "raise ImportError('missing dependency')\n")
    registry = EngineRegistry([str(plugins)])
    assert "window-1.2" not in registry.specs and "shadow" not in registry.specs
    status = registry.check("window", EngineContext(store=store))  # doctor says why the selected id fails
    assert not status.valid and "SyntaxError" in (status.reason or "")
    assert registry.specs["legacy"].source == "bundled"  # a taken id is refused, broken or not
    assert any("'legacy'" in w and "shadow" in w and "refused" in w for w in registry.warnings)


def test_settings_precedence_file_env_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "transcript-store.toml"
    config.write_text(
        textwrap.dedent("""
        [engine]
        slot = "lossless"
        plugin_dirs = ["plugins"]
        [engine.config.legacy]
        keep_last = 3
        [turn]
        token_budget = 9000
    """)
    )
    monkeypatch.delenv("TRANSCRIPT_STORE_ENGINE", raising=False)
    s = load_settings(str(config))
    assert (s.engine, s.engine_source, s.token_budget) == ("lossless", "config", 9000)
    assert s.plugin_dirs == [str(tmp_path / "plugins")] and s.engine_config["legacy"]["keep_last"] == 3
    monkeypatch.setenv("TRANSCRIPT_STORE_ENGINE", "legacy")
    assert (load_settings(str(config)).engine, load_settings(str(config)).engine_source) == ("legacy", "env")
    s = load_settings(str(config), engine="window")
    assert (s.engine, s.engine_source) == ("window", "argument")
    monkeypatch.delenv("TRANSCRIPT_STORE_ENGINE")
    assert load_settings(config_path=None).engine in ("legacy", "lossless")
    with pytest.raises(InvalidInput):
        load_settings(str(config), token_budget=-1)
    with pytest.raises(InvalidInput):
        load_settings(str(tmp_path / "missing.toml"))


def test_settings_file_values_are_type_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRANSCRIPT_STORE_ENGINE", raising=False)
    monkeypatch.delenv("TRANSCRIPT_STORE_PLUGIN_DIRS", raising=False)
    config = tmp_path / "transcript-store.toml"
    for text, words in [
        ('[engine]\nplugin_dirs = "./my-engines"\n', "engine.plugin_dirs must be a list"),
        ("[engine]\nplugin_dirs = [1]\n", "engine.plugin_dirs must be a list"),
        ("turn = 3\n", "turn must be a table"),
        ('engine = "lossless"\n', "engine must be a table"),
        ("other = 1\n", "unknown key 'other'"),
        ('[turn]\nengine = "lossless"\n', r"unknown key turn\.engine \(the engine slot is \[engine\] slot\)"),
        ("[turn]\nno_such_knob = 1\n", r"unknown key turn\.no_such_knob"),
        ('[engine]\nslot = ""\n', r"engine\.slot must be a non-empty string"),
        ("[engine.config]\nlossless = 16\n", r"engine\.config\.lossless must be a table"),
        ("[turn]\ncompaction_threshold = \"0.5\"\n", r"turn\.compaction_threshold"),
        # the reply's tokens come out of the budget: no room left for a prompt is refused here, not per turn
        ("[turn]\ntoken_budget = 1000\nmax_output_tokens = 1000\n", r"max_output_tokens \(1000\) must be below"),
    ]:
        config.write_text(text)
        with pytest.raises(InvalidInput, match=words):
            load_settings(str(config))
    config.write_text("[turn]\ncompaction_threshold = 1\ntoken_budget = 9000\n[engine]\nplugin_dirs = []\n")
    s = load_settings(str(config))
    assert (s.compaction_threshold, s.token_budget, s.plugin_dirs, s.engine_source) == (1.0, 9000, [], "default")


def test_a_settings_file_that_is_no_regular_file_or_too_large_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default ./transcript-store.toml as a folder was skipped silently (its settings never applied);
    a folder or a FIFO named by --config said "does not exist"; and a huge file was read whole."""
    import os

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRANSCRIPT_STORE_ENGINE", raising=False)
    monkeypatch.delenv("TRANSCRIPT_STORE_CONFIG", raising=False)
    (tmp_path / "transcript-store.toml").mkdir()
    with pytest.raises(InvalidInput, match=r"transcript-store\.toml is not a regular file"):
        load_settings()
    with pytest.raises(InvalidInput, match="is not a regular file"):
        load_settings(str(tmp_path / "transcript-store.toml"))
    fifo = tmp_path / "settings.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv("TRANSCRIPT_STORE_CONFIG", str(fifo))
    with pytest.raises(InvalidInput, match=r"\(TRANSCRIPT_STORE_CONFIG\) is not a regular file"):
        load_settings()
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * 200_000)  # 2 MB of comments: valid TOML, no settings file
    with pytest.raises(InvalidInput, match="at most 1048576 bytes"):
        load_settings(str(big))


def test_a_missing_config_file_named_by_the_environment_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRANSCRIPT_STORE_ENGINE", raising=False)
    monkeypatch.setenv("TRANSCRIPT_STORE_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(InvalidInput, match="TRANSCRIPT_STORE_CONFIG"):
        load_settings()
    monkeypatch.delenv("TRANSCRIPT_STORE_CONFIG")
    assert load_settings().engine_source == "default"  # no ./transcript-store.toml: the defaults


def test_quarantine_records_of_dead_processes_are_ignored(store: TranscriptStore) -> None:
    dead = ProcessIdentity("some-other-host", 999_999, 1.0, "deadbeef")
    store.write(
        lambda c: c.conn.execute(
            quarantine.insert().values(
                engine_id="ghost", process=str(dead), operation="assemble", reason="boom", created_us=1
            )
        )
    )
    assert store.read(lambda c: records(c)) == []
    everything = store.read(lambda c: records(c, live_only=False))
    assert [(r.engine_id, r.alive) for r in everything] == [("ghost", False)]
