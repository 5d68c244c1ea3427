"""The bundled engines' code comes from the folder their manifests are read from, whatever else is
called ``engines`` on sys.path.

The registry imported ``engines.legacy`` by name: a folder ``engines/`` in the working directory under
``python -m transcript_store`` had its code run in place of the default engine (``engines list`` showing
the bundled location and exiting 0), and an application with a top-level ``engines`` package of its own
lost both bundled engines (ModuleNotFoundError).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from transcript_store.registry import BUNDLED_DIR

FOREIGN = textwrap.dedent("""
    from pathlib import Path
    Path(__file__).resolve().parent.parent.joinpath("FOREIGN_RAN").write_text(__name__)
""")


def foreign_package(root: Path, with_legacy: bool) -> None:
    (root / "engines").mkdir()
    (root / "engines" / "__init__.py").write_text(FOREIGN)
    if with_legacy:
        (root / "engines" / "legacy").mkdir()
        code = FOREIGN.replace("parent.parent", "parent.parent.parent")
        code += "def create_engine(ctx):\n    raise RuntimeError\n"
        (root / "engines" / "legacy" / "__init__.py").write_text(code)


def test_python_m_in_a_folder_with_an_engines_package_runs_the_bundled_engines(tmp_path: Path) -> None:
    foreign_package(tmp_path, with_legacy=True)
    command = ["-m", "transcript_store", "engines", "list", "--json", "--db", f"sqlite:///{tmp_path / 'x.db'}"]
    done = subprocess.run([sys.executable, *command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "FOREIGN_RAN").exists(), "the working directory's engines package ran"
    listed = {e["id"]: e for e in json.loads(done.stdout)["engines"]}
    for engine_id in ("legacy", "lossless"):
        assert listed[engine_id]["valid"] and listed[engine_id]["location"] == str(BUNDLED_DIR / engine_id)


def test_an_application_with_its_own_engines_package_keeps_the_bundled_engines(tmp_path: Path) -> None:
    foreign_package(tmp_path, with_legacy=False)
    script = textwrap.dedent("""
        import inspect, sys
        import engines  # the application's own package, first on sys.path (the script's folder)
        from transcript_store import StoreConfig, TranscriptStore
        from transcript_store.engine import EngineContext
        from transcript_store.registry import BUNDLED_DIR, EngineRegistry
        registry = EngineRegistry()
        store = TranscriptStore(config=StoreConfig(url=sys.argv[1]))
        for engine_id in ("legacy", "lossless"):
            spec = registry.specs[engine_id]
            assert spec.error is None and spec.factory is not None, (engine_id, spec.error)
            assert inspect.getfile(spec.factory).startswith(str(BUNDLED_DIR)), inspect.getfile(spec.factory)
            spec.factory(EngineContext(store=store))
        assert engines.__file__.startswith(sys.path[0])  # the application's own is left as it was
        print("ok")
    """)
    (tmp_path / "app.py").write_text(script)
    done = subprocess.run([sys.executable, str(tmp_path / "app.py"), f"sqlite:///{tmp_path / 'x.db'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
