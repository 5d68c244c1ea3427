"""The package's lazy public names (PEP 562) as a library user reaches them (session 44): a submodule as an
attribute of the package, without importing it by name first, as ``import transcript_store`` allowed when
the package imported its modules eagerly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import transcript_store


def test_a_submodule_is_an_attribute_of_the_package_as_before(store_url: str) -> None:
    """``import transcript_store`` then ``transcript_store.store.TranscriptStore(url)``,
    ``transcript_store.errors.InvalidInput``: the submodules the eager package imported were attributes of it;
    the lazy one raised AttributeError for each."""
    probe = ("import sys, transcript_store as ts; assert 'transcript_store.store' not in sys.modules; "
             f"s = ts.store.TranscriptStore({store_url!r}); s.close(); "
             "assert ts.errors.InvalidInput is ts.InvalidInput; assert ts.models.Entry is ts.Entry; "
             "assert ts.config.StoreConfig is ts.StoreConfig; assert ts.db.__name__ == 'transcript_store.db'; "
             "assert hasattr(ts, 'hot') and not hasattr(ts, 'no_such_module')")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_name_neither_public_nor_a_submodule_is_an_attribute_error() -> None:
    """A missing name is AttributeError naming it, as a module's is (``hasattr`` and ``getattr`` with a
    default rely on it), not ImportError or ModuleNotFoundError."""
    import transcript_store

    assert getattr(transcript_store, "no_such_name", None) is None
    try:
        transcript_store.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)


def test_a_type_checker_still_flags_a_name_the_package_lacks(tmp_path: Path) -> None:
    """The lazy ``__getattr__`` is the interpreter's alone: a type checker that saw it took every name the
    package lacks for ``Any``, so ``transcript_store.TranscriptStor`` (a typo) passed mypy, where the eager
    package was an error. The package's ``__init__`` alone is checked here (its modules left out: fast)."""
    package = tmp_path / "stubs" / "transcript_store"
    package.mkdir(parents=True)
    shutil.copy(Path(transcript_store.__file__), package / "__init__.py")
    user = tmp_path / "user.py"
    user.write_text("import transcript_store\n\nx = transcript_store.TranscriptStor\n")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", "--cache-dir", os.devnull,
         str(user)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "MYPYPATH": str(package.parent)},
    )
    assert done.returncode == 1 and 'has no attribute "TranscriptStor"' in done.stdout, done.stdout + done.stderr
