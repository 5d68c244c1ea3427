"""A real OpenClaw host for interop tests: cached install, an isolated state dir, embedded and gateway turns.

Node and OpenClaw come from the npm registry into the project's ignored ``.cache/openclaw`` (reused by
later runs): the ``node-linux-<arch>`` package ships a Node binary new enough for OpenClaw, and the
system npm runs under it. Every host process runs in its own process group with its state, home,
temp dir and log file inside one temporary folder, so ``close()`` can end them all and delete it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "openclaw"
NODE_VERSION = "24.22.3"
OPENCLAW_VERSION = "2026.9.6"
MIN_NODE = (24, 16)
PLUGIN_DIR = ROOT / "integrations" / "openclaw"


class HostUnavailable(Exception):
    """Node or OpenClaw could not be installed or does not run here."""


def _run(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 600, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostUnavailable(f"{' '.join(args[:4])}: {e}") from e
    if done.returncode != 0:
        raise HostUnavailable(f"{' '.join(args[:4])} exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
    return done.stdout


def node_package() -> str:
    """The npm package that ships Node for this machine."""
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    if arch is None or platform.system() != "Linux":
        raise HostUnavailable(f"no node-linux package for {platform.system()} {platform.machine()}")
    return f"node-linux-{arch}"


def install(cache: Path = CACHE) -> tuple[Path, Path]:
    """Node's bin folder and the openclaw executable, installed into ``cache`` once (stamp files)."""
    npm = shutil.which("npm")
    if npm is None:
        raise HostUnavailable("npm is not installed")
    cache.mkdir(parents=True, exist_ok=True)
    package = node_package()
    npm_cache = str(cache / "npm-cache")
    node_bin = cache / "node" / "node_modules" / package / "bin"
    stamp = cache / "node" / f".installed-{package}-{NODE_VERSION}"
    if not stamp.exists():
        _run([npm, "install", "--prefix", str(cache / "node"), "--no-audit", "--no-fund", "--no-save",
              "--cache", npm_cache, f"{package}@{NODE_VERSION}"])
        stamp.touch()
    version = _run([str(node_bin / "node"), "--version"]).strip()
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if found < MIN_NODE:
        raise HostUnavailable(f"node {version} is older than {MIN_NODE}")
    env = {**os.environ, "PATH": f"{node_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    openclaw = cache / "host" / "node_modules" / ".bin" / "openclaw"
    stamp = cache / "host" / f".installed-openclaw-{OPENCLAW_VERSION}"
    if not stamp.exists():
        _run([npm, "install", "--prefix", str(cache / "host"), "--no-audit", "--no-fund", "--no-save",
              "--cache", npm_cache, f"openclaw@{OPENCLAW_VERSION}"], env=env)
        stamp.touch()
    version = _run([str(openclaw), "--version"], env=env, timeout=120)
    if OPENCLAW_VERSION not in version:
        raise HostUnavailable(f"openclaw --version says {version.strip()!r}, not {OPENCLAW_VERSION}")
    return node_bin, openclaw


@dataclass
class TurnRun:
    """One finished host command: its exit code and everything it printed."""

    args: list[str]
    returncode: int
    output: str
    seconds: float


@dataclass
class OpenClawHost:
    """An isolated OpenClaw installation state in ``root`` (config, state, home, temp, logs)."""

    node_bin: Path
    openclaw: Path
    root: Path
    model_url: str
    gateway_port: int
    token: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    gateway: subprocess.Popen[bytes] | None = None

    @property
    def config_path(self) -> Path:
        """openclaw.json of this host."""
        return self.root / "openclaw.json"

    @property
    def log_file(self) -> Path:
        """The host's own log file (logging.file)."""
        return self.root / "logs" / "openclaw.log"

    def env(self) -> dict[str, str]:
        """The environment of every host command: state redirected, offline, quiet, token for the plugin."""
        for sub in ("state", "home", "tmp", "logs", "workspace"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENCLAW_", "TRANSCRIPT_STORE_"))}
        env.update({
            "PATH": f"{self.node_bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": str(self.root / "home"),
            "TMPDIR": str(self.root / "tmp"),
            "OPENCLAW_HOME": str(self.root / "home"),
            "OPENCLAW_STATE_DIR": str(self.root / "state"),
            "OPENCLAW_CONFIG_PATH": str(self.config_path),
            "OPENCLAW_OFFLINE": "1",
            "OPENCLAW_NO_AUTO_UPDATE": "1",
            "OPENCLAW_DISABLE_BONJOUR": "1",
            "OPENCLAW_SKIP_CHANNELS": "1",
            "DO_NOT_TRACK": "1",
            "NO_COLOR": "1",
            "TRANSCRIPT_STORE_TOKEN": self.token,
        })
        return env

    def write_config(self, extra: dict[str, Any] | None = None) -> None:
        """The host config: the local model as the only provider, loopback gateway, no telemetry or heartbeat."""
        self.root.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "models": {
                "mode": "replace",
                "providers": {
                    "fake": {
                        "baseUrl": self.model_url,
                        "apiKey": "local-test-key",
                        "api": "openai-completions",
                        "models": [{"id": "fake-model", "name": "Local test model", "contextWindow": 64000,
                                    "maxTokens": 1024}],
                    }
                },
            },
            "agents": {"defaults": {"model": {"primary": "fake/fake-model"},
                                    "workspace": str(self.root / "workspace"),
                                    "skipBootstrap": True, "heartbeat": {"every": "0m"}}},
            "telemetry": {"enabled": False},
            "logging": {"file": str(self.log_file)},
            "gateway": {"mode": "local", "port": self.gateway_port, "bind": "loopback",
                        "auth": {"mode": "token", "token": "gateway-" + self.token}},
        }
        if self.config_path.exists():
            current = json.loads(self.config_path.read_text(encoding="utf-8"))
            current.update({k: v for k, v in config.items() if k not in current})
            config = current
        if extra:
            _merge(config, extra)
        self.config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")

    def command(self, *args: str, timeout: float = 300) -> TurnRun:
        """Run one host command to completion in its own process group (stragglers are ended)."""
        argv = [str(self.openclaw), *args]
        started = time.monotonic()
        proc = subprocess.Popen(argv, env=self.env(), cwd=self.root, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(proc)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            out, _ = proc.communicate()
        _end_group(proc)
        return TurnRun(argv, proc.returncode, out.decode("utf-8", "replace"), time.monotonic() - started)

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        """Start a host command in the background (its output in ``root/logs``)."""
        env = self.env()  # (makes the host's folders, logs among them)
        log = (self.root / "logs" / f"{args[0]}-{len(self.processes)}.out").open("wb")
        proc = subprocess.Popen([str(self.openclaw), *args], env=env, cwd=self.root, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.processes.append(proc)
        return proc

    def install_plugin(self, plugin_dir: Path = PLUGIN_DIR) -> TurnRun:
        """Link the plugin (selects it as the context engine)."""
        return self.command("plugins", "install", "-l", str(plugin_dir), "--force", "--accept-capabilities")

    def link_plugin(self, plugin_dir: Path = PLUGIN_DIR) -> None:
        """What ``install_plugin`` writes into the config (load path, entry enabled, context-engine slot), without
        the seconds of a CLI start: for tests that need the plugin, not its installation."""
        self.write_config({"plugins": {"load": {"paths": [str(plugin_dir)]},
                                       "entries": {"transcript-store": {"enabled": True}},
                                       "slots": {"contextEngine": "transcript-store"}}})

    def embedded_turn(self, message: str) -> TurnRun:
        """One embedded turn of agent main (``openclaw agent --local``)."""
        return self.command("agent", "--local", "--agent", "main", "--message", message, "--timeout", "240")

    def start_embedded_turn(self, message: str) -> subprocess.Popen[bytes]:
        """An embedded turn running in the background."""
        return self.start("agent", "--local", "--agent", "main", "--message", message, "--timeout", "240")

    def start_gateway(self, timeout: float = 180) -> None:
        """``openclaw gateway run`` until its log says ready."""
        self.gateway = self.start("gateway", "run", "--port", str(self.gateway_port))
        out = self.root / "logs" / f"gateway-{len(self.processes) - 1}.out"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = out.read_text(errors="replace") if out.exists() else ""
            if re.search(r"\[gateway\] ready", text):
                return
            if self.gateway.poll() is not None:
                raise HostUnavailable(f"the gateway exited {self.gateway.returncode}: {text[-2000:]}")
            time.sleep(0.5)
        raise HostUnavailable("the gateway did not get ready in time")

    def gateway_turn(self, message: str) -> TurnRun:
        """One turn through the running gateway (``openclaw agent`` without --local)."""
        return self.command("agent", "--agent", "main", "--message", message, "--timeout", "240")

    def stop_gateway(self) -> None:
        """Stop the gateway's process group."""
        if self.gateway is not None:
            _end_group(self.gateway, signal.SIGTERM, 30)
            self.gateway = None

    def logs(self) -> str:
        """Everything the host logged: its log file and the output of background commands."""
        parts = [p.read_text(errors="replace") for p in sorted((self.root / "logs").glob("*")) if p.is_file()]
        return "\n".join(parts)

    def close(self) -> None:
        """End every host process this object started (and any left behind in its state), delete ``root``."""
        self.stop_gateway()
        for proc in self.processes:
            _end_group(proc)
        for pid in _pids_using(self.root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _end_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace: float = 10) -> None:
    """Signal the process group a command started, then SIGKILL what is left after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _pids_using(root: Path) -> list[int]:
    """Processes whose environment points into ``root`` (host helpers that left their process group)."""
    marker = f"OPENCLAW_STATE_DIR={root / 'state'}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found
