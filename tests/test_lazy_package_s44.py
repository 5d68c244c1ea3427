"""The package's lazy public names (PEP 562) as a library user reaches them (session 44): a submodule as an
attribute of the package, without importing it by name first, as ``import transcript_store`` allowed when
the package imported its modules eagerly."""

from __future__ import annotations

import subprocess
import sys


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
