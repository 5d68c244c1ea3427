"""Executable docs: every code block of the README runs here.

- ```python blocks run as scripts in a fresh working directory (the SQLite default lives there);
- ```sh blocks run line by line in bash, in one fresh working directory: `transcript-store ...`
  commands for real (the installed console script), `make TARGET` lines as `make -n TARGET` (the
  target exists and expands; running `make test` inside `make test` would recurse, and `make run`'s
  job has its own test in test_gateway);
- ```text blocks are pictures, and ```toml blocks are parsed.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import shlex
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PG_ADMIN, RUN_ID, _admin_exec, _pg_reachable, pg_url

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, re.S | re.M)


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    problem = _pg_reachable()
    if problem is not None:
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN}: {problem}")
    name = f"ts_readme_{RUN_ID}_{uuid.uuid4().hex[:8]}"
    _admin_exec(f"CREATE DATABASE {name}")
    try:
        yield pg_url(name)
    finally:
        _admin_exec(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_readme_has_the_two_commands_first() -> None:
    first_block = BLOCKS[0][1]
    assert "make run" in first_block and "make test" in first_block


@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(BLOCKS) if lang == "python"])
def test_python_block_runs(index: int, tmp_path: Path) -> None:
    code = BLOCKS[index][1]
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRANSCRIPT_STORE_URL", None)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"README python block {index} failed:\n{code}\n{result.stderr}"


# Every python block opens its store on a SQLite file of its own; on PostgreSQL that URL becomes the test's.
SQLITE_URL = re.compile(r'"sqlite:///[\w.-]+\.db"')


@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(BLOCKS) if lang == "python"])
def test_python_block_runs_on_postgresql(index: int, tmp_path: Path, empty_pg_url: str) -> None:
    """The same examples on PostgreSQL, their one SQLite URL replaced by a fresh database's (migrated first:
    a PostgreSQL store never migrates itself on open)."""
    code = BLOCKS[index][1]
    assert len(SQLITE_URL.findall(code)) == 1, code[:300]
    code = SQLITE_URL.sub(lambda _m: repr(empty_pg_url), code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRANSCRIPT_STORE_URL", None)
    init = subprocess.run([sys.executable, "-m", "transcript_store", "init", "--db", empty_pg_url], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"README python block {index} failed on PostgreSQL:\n{code}\n{result.stderr}"


@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(BLOCKS) if lang == "sh"])
def test_shell_block_runs(index: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRANSCRIPT_STORE_URL", None)
    if "TRANSCRIPT_STORE_URL=postgresql" in BLOCKS[index][1]:
        # The PostgreSQL deployment block runs against a fresh, empty (unmigrated) throwaway database.
        env["TRANSCRIPT_STORE_URL"] = request.getfixturevalue("empty_pg_url")
    for raw in BLOCKS[index][1].splitlines():
        line = raw.split("  #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line)
        if words[0] == "make":
            result = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                                    timeout=300)
        else:
            # The installed console script first on PATH, as after `make install`.
            env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
            result = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                                    timeout=300)
        assert result.returncode == 0, f"README line {line!r} failed:\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(BLOCKS) if lang == "toml"])
def test_toml_block_parses(index: int) -> None:
    tomllib.loads(BLOCKS[index][1])


# ----------------------------------------------------------------------------------- the API tables

def _api() -> dict[str, list[inspect.Signature]]:
    """Every public method and property of the classes the README documents, by name (a name two classes
    share, ``admit``, has both signatures)."""
    from transcript_store import TranscriptStore
    from transcript_store.host import HostRuntime, RuntimeContext
    from transcript_store.turns import Turns

    api: dict[str, list[inspect.Signature]] = {}
    for cls in (TranscriptStore, Turns, HostRuntime, RuntimeContext):
        api.setdefault(cls.__name__, []).append(inspect.signature(cls))
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            if isinstance(member, property):
                api.setdefault(name, [])
            elif isinstance(member, (classmethod, staticmethod)) or callable(member):
                func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                api.setdefault(name, []).append(inspect.signature(func))
    return api


# A call as the README writes it in backticks: `name(...)` or `Class.name(...)`, its keyword parameters
# as `kw=` (no default shown) or `kw=default` (a README signature's default, not in an excerpt with `...`).
CALL = re.compile(r"`(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)\(([^`]*)\)`")
KEYWORD = re.compile(r"\b([a-z_]\w*)=([^,)]*)")


def test_every_public_method_of_the_store_turns_and_host_is_in_the_readme() -> None:
    """A method added to the public classes without a word in the README is an API nobody finds."""
    prose = re.sub(r"^```.*?^```", "", README, flags=re.S | re.M)  # inline spans only (they may wrap a line)
    spans = " ".join(re.findall(r"`([^`]+)`", prose))
    missing = [name for name in _api() if not re.search(rf"(?<![\w]){name}(?![\w])", spans)]
    assert missing == [], f"public methods not named in README.md (in backticks): {missing}"


#: the repository's other documents, whose calls are checked as the README's
DOCS = sorted(
    str(p.relative_to(ROOT))
    for pattern in ("bench/README.md", "engines/*/README.md", "integrations/*/README.md", "docs/*.md")
    for p in ROOT.glob(pattern)
)


@pytest.mark.parametrize("document", ["README.md", *DOCS])
def test_the_documented_methods_of_the_store_turns_and_host_exist(document: str) -> None:
    """`TranscriptStore.x`, `Turns.x`, `HostRuntime.x` or `RuntimeContext.x` in the docs names a real method
    (a method renamed or removed left its documentation behind)."""
    from transcript_store import TranscriptStore
    from transcript_store.host import HostRuntime, RuntimeContext
    from transcript_store.turns import Turns

    known = set(_api())
    for cls in (TranscriptStore, Turns, HostRuntime, RuntimeContext):  # and their attributes (`store.db`)
        known.update(re.findall(r"\bself\.([A-Za-z_]\w*)\s*(?::[^=\n]*)?=", inspect.getsource(cls)))
        known.update(getattr(cls, "__dataclass_fields__", {}))
    text = (ROOT / document).read_text(encoding="utf-8")
    named = re.findall(r"`(?:TranscriptStore|Turns|HostRuntime|RuntimeContext)\.([A-Za-z_]\w*)", text)
    assert sorted({name for name in named if name not in known}) == []


@pytest.mark.parametrize("document", ["README.md", *DOCS])
def test_the_documented_calls_name_real_parameters_and_defaults(document: str) -> None:
    """Every `method(..., kw=...)` the docs write names a parameter the method has, and in the README, whose
    tables give signatures, the default it has when one is shown (a renamed parameter or a changed
    default left the docs behind). The other docs' calls are examples (`config=42`), not defaults."""
    api = _api()
    wrong: list[str] = []
    for name, args in CALL.findall((ROOT / document).read_text(encoding="utf-8")):
        if name not in api or not api[name]:
            continue
        for keyword, default in KEYWORD.findall(args):
            params = [sig.parameters[keyword] for sig in api[name] if keyword in sig.parameters]
            if not params:
                wrong.append(f"{name}(): no parameter {keyword!r}")
                continue
            default = default.strip()
            if document != "README.md" or not default or "..." in args or "…" in args:
                continue  # an excerpt (`admit(..., taken_over=[])`) shows an argument, not the default
            try:
                value = ast.literal_eval(default)
            except (ValueError, SyntaxError):
                continue  # a placeholder (`owner=ATTEMPT`), not a default
            if all(p.default is inspect.Parameter.empty or p.default != value for p in params):
                wrong.append(f"{name}(): {keyword}={default} but the default is {params[0].default!r}")
    assert wrong == [], f"{document}'s calls disagree with the code:\n" + "\n".join(wrong)


def test_the_architecture_names_every_module_of_the_package() -> None:
    """The README's architecture picture is the map of the package: a module added without a place in it
    is drift (DESIGN.md's shape is refined there, module by module)."""
    picture = README.split("## Architecture", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    drawn = set(re.findall(r"[a-z_]+", picture.split("engines/legacy", 1)[0]))
    modules = {p.stem for p in (ROOT / "transcript_store").glob("*.py")} - {"__init__", "__main__"}
    assert sorted(modules - drawn) == []
