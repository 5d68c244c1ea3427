"""A second hostile review of engine loading: a KeyboardInterrupt that is a plugin's and not the operator's, and
engine info declarations of any size (what `doctor`, `engines list`, the logs and the service's /engines show)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from transcript_store import engine as engine_module
from transcript_store.engine import EngineContext, EngineInfo, HostRequirement, coerce_info
from transcript_store.errors import EngineContractError
from transcript_store.registry import EngineRegistry

GOOD = """
from transcript_store.engine import AssembleResult, EngineInfo


class Engine:
    info = {info}

    def assemble(self, **kw):
        return AssembleResult(messages=[], estimated_tokens=0)


def create_engine(ctx):
    return Engine()
"""

CLI = [str(Path(sys.executable).parent / "transcript-store")]
#: the limits of engine.py (MAX_ACCEPTED_HOST_PARAMS, MAX_HOST_PARAM_CHARS, MAX_REQUIRED_CAPABILITIES,
#: MAX_CAPABILITY_CHARS, MAX_UNSUPPORTED_MESSAGE_CHARS), as documented
LIMITS = {
    "MAX_ACCEPTED_HOST_PARAMS": 16,
    "MAX_HOST_PARAM_CHARS": 64,
    "MAX_REQUIRED_CAPABILITIES": 64,
    "MAX_CAPABILITY_CHARS": 128,
    "MAX_UNSUPPORTED_MESSAGE_CHARS": 1024,
}
#: the longest refusal of an info expected: a short message, never the declaration it refuses
SHORT = 400


def plugin(root: Path, folder: str, source: str, manifest: str | None = None) -> Path:
    d = root / folder
    d.mkdir(parents=True)
    (d / "plugin.yaml").write_text(manifest or f"name: {folder}\n", encoding="utf-8")
    (d / "__init__.py").write_text(source, encoding="utf-8")
    return d


def good(root: Path, engine_id: str = "good", info: str | None = None) -> Path:
    return plugin(root, engine_id, GOOD.format(info=info or f"EngineInfo(id={engine_id!r})"))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TRANSCRIPT_STORE_ENGINE", "TRANSCRIPT_STORE_PLUGIN_DIRS", "TRANSCRIPT_STORE_CONFIG"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(autouse=True)
def _sigint_handler_kept() -> Any:
    """Every test leaves Python's own SIGINT handler installed: the registry restores what it found."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, before)
    assert after is before


def plugin_modules() -> set[str]:
    return {name for name in sys.modules if name.startswith("_transcript_store_plugin_")}


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    env["COLUMNS"] = "200"
    return subprocess.run(
        [*CLI, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=120, preexec_fn=_default_sigint
    )


def _default_sigint() -> None:
    """In the child before exec: SIGINT as a terminal's foreground process has it (a background job of a
    non-interactive shell inherits it ignored, and Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ---------------------------------------------------------------------------------------------- KeyboardInterrupt


@contextmanager
def not_interrupted() -> Iterator[None]:
    """A KeyboardInterrupt escaping is this test's failure (not the end of the whole pytest session)."""
    try:
        yield
    except KeyboardInterrupt:
        pytest.fail("a plugin's KeyboardInterrupt escaped, taken for the operator's Ctrl-C")


RAISE_ON_IMPORT = "raise KeyboardInterrupt\n"
RAISE_IN_FACTORY = "def create_engine(ctx):\n    raise KeyboardInterrupt\n"
RAISE_IN_INFO = GOOD.format(info="property(lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))")
RAISE_IN_DISPOSE = GOOD.format(info="EngineInfo(id='kbd-dispose')") + (
    "\nEngine.dispose = lambda self: (_ for _ in ()).throw(KeyboardInterrupt())\n"
)


def _kbd_zoo(root: Path) -> Path:
    plugins = root / "plugins"
    plugin(plugins, "kbd-import", RAISE_ON_IMPORT)
    plugin(plugins, "kbd-factory", RAISE_IN_FACTORY)
    plugin(plugins, "kbd-info", RAISE_IN_INFO)
    plugin(plugins, "kbd-dispose", RAISE_IN_DISPOSE)
    good(plugins, "z-good")
    return plugins


def _assert_kbd_zoo_is_reported(plugins: Path) -> None:
    with not_interrupted():
        registry = EngineRegistry([str(plugins)])
        _assert_reported(registry)


def _assert_reported(registry: EngineRegistry) -> None:
    assert {"kbd-import", "kbd-factory", "kbd-info", "kbd-dispose", "z-good"} <= set(registry.specs)
    spec = registry.specs["kbd-import"]
    assert spec.factory is None and "KeyboardInterrupt" in (spec.error or ""), spec.error
    ctx = EngineContext(store=None)
    for engine_id in ("kbd-factory", "kbd-info"):
        status = registry.check(engine_id, ctx)
        assert not status.valid and "KeyboardInterrupt" in (status.reason or ""), status.reason
        with pytest.raises(EngineContractError, match="KeyboardInterrupt"):
            registry.create(engine_id, ctx)
    assert registry.check("kbd-dispose", ctx).valid  # a dispose that fails is logged, as any other failure
    assert registry.check("z-good", ctx).valid


def test_a_keyboard_interrupt_raised_by_plugin_code_is_that_plugins_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No SIGINT arrived: the KeyboardInterrupt is the plugin's own. Before, it stopped the discovery (and so
    `doctor`) as the operator's Ctrl-C would, the other engines unseen."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    before = plugin_modules()
    _assert_kbd_zoo_is_reported(_kbd_zoo(tmp_path))
    assert not any("kbd-import" in name for name in plugin_modules() - before)  # nothing half-loaded
    assert "dispose of kbd-dispose failed" in caplog.text and "KeyboardInterrupt" in caplog.text


def test_a_plugins_keyboard_interrupt_without_python_sigint_handler_or_off_the_main_thread(tmp_path: Path) -> None:
    """SIGINT ignored, or the registry used in another thread: no signal can raise KeyboardInterrupt there, so
    every one is the plugin's."""
    plugins = _kbd_zoo(tmp_path)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _assert_kbd_zoo_is_reported(plugins)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    outcome: list[BaseException | None] = []

    def in_a_thread() -> None:
        try:
            _assert_kbd_zoo_is_reported(plugins)
            outcome.append(None)
        except BaseException as e:  # the thread's failure, for the test's
            outcome.append(e)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(60)
    assert outcome == [None], outcome


def test_a_keyboard_interrupt_from_an_entry_point_is_its_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    pkg = site / "kbd_engines"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(RAISE_ON_IMPORT)
    dist = site / "kbd_engines-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kbd-engines\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[transcript_store.engines]\nkbd-ep = kbd_engines:create_engine\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        with not_interrupted():
            registry = EngineRegistry()
    finally:
        sys.modules.pop("kbd_engines", None)
    spec = registry.specs["kbd-ep"]
    assert spec.factory is None and "KeyboardInterrupt" in (spec.error or ""), spec.error
    assert registry.check("legacy", EngineContext(store=None)).valid


SIGINT_ON_IMPORT = "import signal\nsignal.raise_signal(signal.SIGINT)\n"
SIGINT_SWALLOWED = "import signal\ntry:\n    signal.raise_signal(signal.SIGINT)\nexcept KeyboardInterrupt:\n    pass\n"
SIGINT_REPLACED = (
    "import signal\ntry:\n    signal.raise_signal(signal.SIGINT)\nexcept KeyboardInterrupt:\n"
    "    raise RuntimeError('not an interrupt')\n"
)
SIGINT_IN_FACTORY = "import signal\n\ndef create_engine(ctx):\n    signal.raise_signal(signal.SIGINT)\n"


@pytest.mark.parametrize(
    "source", [SIGINT_ON_IMPORT, SIGINT_SWALLOWED, SIGINT_REPLACED], ids=["interrupted", "swallowed", "replaced"]
)
def test_a_real_sigint_during_a_plugins_import_still_interrupts(tmp_path: Path, source: str) -> None:
    """A SIGINT delivered while plugin code runs is the operator's: the process is interrupted, even when the
    plugin caught the KeyboardInterrupt (or turned it into another error)."""
    plugins = tmp_path / "plugins"
    plugin(plugins, "sigint", source)
    good(plugins, "z-good")
    before = plugin_modules()
    with pytest.raises(KeyboardInterrupt):
        EngineRegistry([str(plugins)])
    assert plugin_modules() == before


def test_a_real_sigint_in_a_factory_still_interrupts(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugin(plugins, "sigint", SIGINT_IN_FACTORY)
    registry = EngineRegistry([str(plugins)])
    with pytest.raises(KeyboardInterrupt):
        registry.check("sigint", EngineContext(store=None))
    with pytest.raises(KeyboardInterrupt):
        registry.create("sigint", EngineContext(store=None))


@pytest.mark.parametrize("backend", ["sqlite"])  # plugin discovery opens no store: one backend says it (CI time)
def test_doctor_reports_a_plugin_raising_keyboard_interrupt(store_url: str, tmp_path: Path) -> None:
    """As a real subprocess: before, `doctor` said "error: aborted" (exit 1), as after a Ctrl-C, and listed none
    of the other engines."""
    _kbd_zoo(tmp_path)
    (tmp_path / "transcript-store.toml").write_text('[engine]\nplugin_dirs = ["plugins"]\n', encoding="utf-8")
    report = _cli("doctor", "--json", "--db", store_url, cwd=tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr  # a broken plugin that is not selected
    assert "aborted" not in report.stderr and "Traceback" not in report.stderr
    engines = {e["id"]: e for e in json.loads(report.stdout)["engines"]}
    for engine_id in ("kbd-import", "kbd-factory", "kbd-info"):
        assert not engines[engine_id]["valid"] and "KeyboardInterrupt" in engines[engine_id]["reason"]
    assert engines["z-good"]["valid"] and engines["legacy"]["valid"] and engines["legacy"]["selected"]
    text = _cli("doctor", "--db", store_url, cwd=tmp_path)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "kbd-import" in text.stdout and "z-good" in text.stdout and text.stdout.rstrip().endswith("ok")


def test_a_real_sigint_stops_doctor_stuck_in_a_slow_plugin_import(tmp_path: Path) -> None:
    """Ctrl-C while a plugin's import sleeps: the process stops as a Ctrl-C stops it (no engine reported)."""
    started = tmp_path / "started"
    plugins = tmp_path / "plugins"
    plugin(plugins, "slow", f"import time\nopen({str(started)!r}, 'w').close()\ntime.sleep(120)\n")
    good(plugins, "z-good")
    (tmp_path / "transcript-store.toml").write_text('[engine]\nplugin_dirs = ["plugins"]\n', encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSCRIPT_STORE_", "OPENAI_"))}
    url = f"sqlite:///{tmp_path / 'none.db'}"
    proc = subprocess.Popen(
        [*CLI, "doctor", "--json", "--db", url],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the plugin's import never started"
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("SIGINT did not stop the process stuck in the plugin's import")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out + err  # as every command a Ctrl-C ends
    assert err.strip() == "error: interrupted" and out == "", out + err


# ---------------------------------------------------------------------------------------------- info bounds

MILLION = 1_000_000
HUGE = "h" * MILLION


class _Engine:
    def __init__(self, info: Any) -> None:
        self.info = info

    def assemble(self, **kw: Any) -> Any:
        raise AssertionError("not called")


def _refused(info: Any, words: str) -> None:
    """``info`` is refused by coerce_info and by the registry, with a short message holding ``words``."""
    with pytest.raises(EngineContractError) as caught:
        engine_module.validate_engine(_Engine(info))
    message = str(caught.value)
    short = len(message) <= SHORT and words in message  # plain values: pytest would show the message whole
    assert short, message[:SHORT]
    registry = EngineRegistry(discover=False)
    registry.register_factory("x", lambda ctx: _Engine(info))
    status = registry.check("x", EngineContext(store=None))
    reason = status.reason or ""
    short = not status.valid and len(reason) <= SHORT and words in reason
    assert short, reason[:SHORT]


def _requirement(**fields: Any) -> dict[str, Any]:
    return {"id": "x", "host_requirements": {"agent-run": fields}}


@pytest.mark.parametrize(
    ("info", "words"),
    [
        ({"id": "x", "accepted_host_params": ["session_key"] * MILLION}, "accepted_host_params"),
        ({"id": "x", "accepted_host_params": [HUGE]}, "accepted_host_params"),
        ({"id": "x", "accepted_host_params": ["x" * 60] * 16}, "unknown host params"),  # once echoed whole
        ({"id": "x", "accepted_host_params": ["\x1b]0;owned\x07"]}, "unknown host params"),
        (_requirement(required_capabilities=["c"] * MILLION), "required_capabilities"),
        (_requirement(required_capabilities=[HUGE]), "required_capabilities"),
        (_requirement(required_capabilities=["ev\x1b[31mil"]), "required_capabilities"),
        (_requirement(unsupported_message=HUGE), "unsupported_message"),
        (_requirement(unsupported_message="Use \x1b]0;owned\x07 another host."), "unsupported_message"),
        ({"id": "x", "host_requirements": {HUGE: {}}}, "host_requirements"),
        ({"id": "x", "host_requirements": {f"{i}{HUGE[:100]}": {} for i in range(10_000)}}, "host_requirements"),
        ({"id": "x", **{f"extra{i}": i for i in range(100_000)}}, "invalid info"),
        ({"id": "x", HUGE: 1}, "invalid info"),
        ({"id": "x", "transcript_semantics": {HUGE: 1}}, "transcript_semantics"),
        ({"id": "x", "host_requirements": {"agent-run": {HUGE: 1}}}, "host_requirements"),
        (EngineInfo(id="x").model_copy(update={"accepted_host_params": ["prompt"] * MILLION}), "accepted_host_params"),
        (
            EngineInfo(id="x").model_copy(
                update={
                    "host_requirements": {
                        "agent-run": HostRequirement.model_construct(required_capabilities=["c"] * MILLION)
                    }
                }
            ),
            "required_capabilities",
        ),
    ],
)
def test_an_info_of_unbounded_size_is_refused_in_few_words(info: Any, words: str) -> None:
    """Before, each was taken as declared (a million host params or capabilities reached `doctor`'s table and
    JSON and the service's /engines answer, escape sequences the error text) or refused quoting its content."""
    _refused(info, words)


def test_the_limits_are_the_documented_ones() -> None:
    for name, value in LIMITS.items():
        assert getattr(engine_module, name, None) == value, name


def test_an_info_at_the_limits_is_taken() -> None:
    params = ["session_key", "prompt", "runtime_settings", "session_target", "runtime_context"]
    info = coerce_info(
        {
            "id": "x",
            "accepted_host_params": (params * 4)[:16],
            "host_requirements": {
                op: {
                    "required_capabilities": [f"{i:03d}" + "c" * 125 for i in range(64)],
                    "unsupported_message": "Use another host. " + "m" * (1024 - 18),
                }
                for op in ("agent-run", "manual-compact", "subagent-spawn")
            },
        }
    )
    assert len(info.host_requirements["agent-run"].required_capabilities) == 64
    assert coerce_info(info) == info
    assert coerce_info(
        {
            "id": "x",
            "host_requirements": {
                "agent-run": {
                    "required_capabilities": ["assemble-before-prompt"],
                    "unsupported_message": "Use mötor's host — please.",
                }
            },
        }
    )
    for too_many in (
        {"accepted_host_params": (params * 4)[:17]},
        {"host_requirements": {"agent-run": {"required_capabilities": ["c"] * 65}}},
        {"host_requirements": {"agent-run": {"required_capabilities": ["c" * 129]}}},
        {"host_requirements": {"agent-run": {"unsupported_message": "m" * 1025}}},
    ):
        with pytest.raises(EngineContractError):
            coerce_info({"id": "x", **too_many})


@pytest.mark.parametrize("backend", ["sqlite"])  # plugin discovery opens no store: one backend says it (CI time)
def test_doctor_shows_no_unbounded_info(store_url: str, tmp_path: Path) -> None:
    """As a real subprocess: before, one engine's million declared host params and capabilities were all in
    `doctor --json` and the engines table (megabytes for one engine)."""
    plugins = tmp_path / "plugins"
    good(plugins, "many-params", "EngineInfo(id='many-params', accepted_host_params=['session_key'] * 20_000)")
    good(
        plugins,
        "many-caps",
        "EngineInfo(id='many-caps', host_requirements={'agent-run': {"
        "'required_capabilities': ['c' * 100] * 20_000, 'unsupported_message': 'x' * 10**6}})",
    )
    good(
        plugins,
        "esc-message",
        "EngineInfo(id='esc-message', host_requirements={'agent-run': {"
        "'unsupported_message': 'ev\\x1b]0;owned\\x07il'}})",
    )
    good(plugins, "z-good")
    (tmp_path / "transcript-store.toml").write_text('[engine]\nplugin_dirs = ["plugins"]\n', encoding="utf-8")
    report = _cli("doctor", "--json", "--db", store_url, cwd=tmp_path)
    assert report.returncode == 0, report.stdout[:2000] + report.stderr[:2000]
    size = len(report.stdout)
    assert size < 20_000, size
    engines = {e["id"]: e for e in json.loads(report.stdout)["engines"]}
    for engine_id, words in [
        ("many-params", "accepted_host_params"),
        ("many-caps", "required_capabilities"),
        ("esc-message", "unsupported_message"),
    ]:
        assert not engines[engine_id]["valid"] and words in engines[engine_id]["reason"], engines[engine_id]
    assert engines["z-good"]["valid"]
    text = _cli("engines", "list", "--db", store_url, cwd=tmp_path)
    assert text.returncode == 0, text.stdout[:2000] + text.stderr[:2000]
    size, escaped = len(text.stdout), "\x1b" in text.stdout + text.stderr
    assert size < 20_000 and not escaped, (size, text.stdout[:2000])
