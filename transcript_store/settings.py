"""Host settings: which engine fills the slot, and the knobs of a turn. File, environment, arguments.

Precedence (later wins): defaults < the TOML file < environment variables < explicit arguments. The
file is ``transcript-store.toml`` in the working directory, or the path in TRANSCRIPT_STORE_CONFIG:

    [engine]
    slot = "legacy"                 # TRANSCRIPT_STORE_ENGINE
    plugin_dirs = ["./my-engines"]  # TRANSCRIPT_STORE_PLUGIN_DIRS (os.pathsep-separated)

    [engine.config.lossless]        # passed to that engine's factory as ctx.config
    fresh_tail_messages = 16

    [turn]
    token_budget = 32000
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from . import faults
from .engine import MAX_TOKENS, engine_id_problem, require_engine_id
from .errors import InvalidInput
from .quarantine import MAX_RECORD_SECONDS, MIN_RECORD_SECONDS, RECORD_SECONDS
from .shapes import Shape
from .terminal import quoted

CONFIG_FILE = "transcript-store.toml"
#: extra engine plugin folders, os.pathsep-separated (after the settings file's)
PLUGIN_DIRS_ENV = "TRANSCRIPT_STORE_PLUGIN_DIRS"
#: the largest token count a setting takes (a budget, an output cap, a threshold): past any model's context
#: window, as the service's own bound on a request's budget; more is a typo, taken until a model call failed

#: the largest count of steps or messages a setting takes: a turn's tool loop past it is a typo
MAX_COUNT = 10_000
#: the longest a setting's time span may be (a week): a model call or a turn past it is a typo, and a
#: timeout past what the clock and the HTTP client take fails inside the first model call
MAX_SECONDS = 604_800.0

SelectionSource = Literal["default", "config", "env", "argument", "fallback"]


class HostSettings(Shape):
    """Everything the host runtime reads; each field documents its default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: str = Field("legacy", description="the engine slot: one engine id per host")
    engine_source: SelectionSource = Field("default", description="where the slot value came from")
    plugin_dirs: list[str] = Field(default_factory=list, description="extra engine plugin folders")
    engine_config: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-engine config")
    token_budget: int = Field(
        32_000, ge=256, le=MAX_TOKENS, description="tokens of a whole model request, reply included"
    )
    max_output_tokens: int = Field(1024, ge=1, le=MAX_TOKENS, description="model output cap per call")
    compaction_threshold: float = Field(
        0.8, gt=0, le=1, description="built-in auto-compaction fires above this share of the budget"
    )
    prune_keep_recent_tool_results: int = Field(
        4, ge=0, le=MAX_COUNT, description="tool results this recent are never trimmed in the request"
    )
    prune_tool_result_max_chars: int = Field(
        2000, ge=200, le=MAX_TOKENS, description="older tool results longer than this are trimmed in the request only"
    )
    max_tool_steps: int = Field(8, ge=1, le=MAX_COUNT, description="model calls per turn (tool loop bound)")
    max_attempts: int = Field(3, ge=1, le=100, description="attempts of one logical turn on provider timeouts")
    model_timeout_seconds: float = Field(
        60.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False, description="one model call's timeout"
    )
    max_turn_seconds: float = Field(
        3600.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False,
        description="a turn running longer stops renewing its lease: another turn may then take the session over",
    )
    quarantine_record_seconds: float = Field(
        RECORD_SECONDS, ge=MIN_RECORD_SECONDS, le=MAX_RECORD_SECONDS, allow_inf_nan=False,
        description="quarantine records of processes not alive here are pruned, and no longer shown, this long after",
    )
    capabilities: list[str] = Field(
        default_factory=lambda: ["assemble-before-prompt"], description="what this host can do for engines"
    )
    system_prompt: str = Field("You are a helpful assistant.", description="the base system prompt")

    @field_validator("engine")
    @classmethod
    def _an_engine_id(cls, value: str) -> str:
        return require_engine_id(value)

    @model_validator(mode="after")
    def _room_for_a_prompt(self) -> HostSettings:
        # The reply's tokens come out of the request's budget: a cap at or above it leaves no prompt,
        # and every turn would be refused (PromptTooLarge) instead of the settings.
        if self.max_output_tokens >= self.token_budget:
            raise ValueError(
                f"max_output_tokens ({self.max_output_tokens}) must be below token_budget ({self.token_budget}):"
                " the reply's tokens are part of the request's budget"
            )
        return self


#: [turn] keys that are not turn knobs: the engine slot and its plugins live in [engine]
_NOT_TURN = frozenset({"engine", "engine_source", "plugin_dirs", "engine_config"})
_ENGINE_KEYS = ("slot", "plugin_dirs", "config")


def _table(path: Path, data: dict[str, Any], key: str) -> dict[str, Any]:
    """``data[key]`` as a TOML table ({} when absent); InvalidInput naming the key otherwise."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise InvalidInput(f"{path}: {key} must be a table ([{key}]), got {type(value).__name__} {value!r}")
    return value


#: the largest settings file read (bytes): a settings file is a few hundred bytes; a device or a stray
#: huge file named by mistake must not be read into memory
MAX_CONFIG_BYTES = 1024 * 1024


def _from_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise InvalidInput(f"cannot read {path}: a settings file is at most {MAX_CONFIG_BYTES} bytes")
        data = tomllib.loads(raw.decode("utf-8"))
    except InvalidInput:  # a ValueError too: not one of the parser's below
        raise
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise InvalidInput(f"cannot read {path}: {e}") from e
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise InvalidInput(f"cannot read {path}: arrays or tables nested too deeply") from None
    except ValueError:  # tomllib's int() past Python's limit on the digits of an integer
        raise InvalidInput(
            f"cannot read {path}: an integer of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    for key in data:
        if key not in ("engine", "turn"):
            raise InvalidInput(f"{path}: unknown key {key!r} (expected the tables [engine] and [turn])")
    engine, turn = _table(path, data, "engine"), _table(path, data, "turn")
    out: dict[str, Any] = {}
    for key in engine:
        if key not in _ENGINE_KEYS:
            raise InvalidInput(f"{path}: unknown key engine.{key} (expected one of {', '.join(_ENGINE_KEYS)})")
    if "slot" in engine:
        slot = engine["slot"]
        if not isinstance(slot, str) or not slot.strip():
            raise InvalidInput(f"{path}: engine.slot must be a non-empty string (an engine id), got {slot!r}")
        if (problem := engine_id_problem(slot)) is not None:
            raise InvalidInput(f"{path}: engine.slot {quoted(slot)}: {problem}")
        out["engine"], out["engine_source"] = slot, "config"
    if "plugin_dirs" in engine:
        dirs = engine["plugin_dirs"]
        if not isinstance(dirs, list) or not all(isinstance(d, str) and d for d in dirs):
            raise InvalidInput(f"{path}: engine.plugin_dirs must be a list of folder names, got {dirs!r}")
        out["plugin_dirs"] = [_folder(path, d) for d in dirs]
    if "config" in engine:
        config = _table(path, engine, "config")
        for engine_id, value in config.items():
            if not isinstance(value, dict):
                raise InvalidInput(f"{path}: engine.config.{engine_id} must be a table, got {value!r}")
        out["engine_config"] = config
    for key in turn:
        if key in _NOT_TURN or key not in HostSettings.model_fields:
            hint = " (the engine slot is [engine] slot)" if key == "engine" else ""
            raise InvalidInput(f"{path}: unknown key turn.{key}{hint}")
    try:  # TOML values are typed: no string-to-number coercion here
        HostSettings.model_validate(turn, strict=True)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        what = f"setting turn.{where}" if where else "settings in [turn]"
        raise InvalidInput(f"{path}: invalid {what}: {_reason(first['msg'])}") from None
    out.update(turn)
    return out


def _folder(path: Path, name: str) -> str:
    """A plugin folder of the settings file at ``path``, absolute (relative to the file's folder)."""
    if "\x00" in name:
        raise InvalidInput(f"{path}: engine.plugin_dirs: {quoted(name)} is no folder name (it holds NUL)")
    folder = path.parent / name
    try:
        return str(folder.resolve())
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13): the registry warns
        return str(folder.absolute())


def _engine_id(value: str, where: str) -> str:
    """``value`` as the engine slot, or InvalidInput naming ``where`` it came from."""
    problem = engine_id_problem(value)
    if problem is not None:
        raise InvalidInput(f"{where} {quoted(value)} is no engine id: {problem}")
    return value


def check_tokenizer_and_summarizer() -> None:
    """Refuse a bad TRANSCRIPT_STORE_TOKENIZER or _SUMMARIZER, and the openai summarizer's endpoint
    (OPENAI_BASE_URL): else refused only when an engine is built, after a chat wrote its session, and
    by some commands only."""
    from .tokens import check_tokenizer

    check_tokenizer()
    if not os.environ.get("TRANSCRIPT_STORE_SUMMARIZER", "").strip():
        return  # the extractive summarizer: nothing to check, nor summarize (regex, a model client) to import for it
    from .summarize import summarizer_choice, summarizer_from_env

    if summarizer_choice() == "openai":
        try:
            summarizer_from_env()
        except InvalidInput as e:
            raise InvalidInput(f"TRANSCRIPT_STORE_SUMMARIZER=openai: OPENAI_BASE_URL: {e}") from None


def check_settings_env() -> None:
    """Refuse a bad TRANSCRIPT_STORE_ENGINE, _TOKENIZER, _SUMMARIZER, _FAULTS or _FAULT_SEED value
    (InvalidInput), files unread.

    For a command that reads no host settings: a variable set wrong is a usage error there too, as the
    README's exit codes say, not something only the commands that build engines notice.
    """
    check_tokenizer_and_summarizer()
    faults.check_env()
    env_engine = os.environ.get("TRANSCRIPT_STORE_ENGINE")
    if env_engine:
        _engine_id(env_engine, "TRANSCRIPT_STORE_ENGINE")


def load_settings(config_path: str | None = None, **overrides: Any) -> HostSettings:
    """Settings from defaults, the TOML file, TRANSCRIPT_STORE_* variables and ``overrides``.

    InvalidInput for a bad file or variable, including the tokenizer and summarizer variables the host
    runtime reads when it starts: refused here, before a command (or a gateway worker) does any work.
    """
    check_tokenizer_and_summarizer()
    faults.check_env()  # the fault points read it at the first one passed: inside a turn
    values: dict[str, Any] = {}
    path = Path(config_path or os.environ.get("TRANSCRIPT_STORE_CONFIG") or CONFIG_FILE)
    if path.is_file():
        values.update(_from_file(path))
    elif path.exists():  # a folder, a FIFO, a device: never read as settings, never silently skipped
        from_env = config_path is None and os.environ.get("TRANSCRIPT_STORE_CONFIG")
        named = " (TRANSCRIPT_STORE_CONFIG)" if from_env else ""
        raise InvalidInput(f"config file {path}{named} is not a regular file")
    elif config_path is not None:
        raise InvalidInput(f"config file {config_path} does not exist")
    elif os.environ.get("TRANSCRIPT_STORE_CONFIG"):
        raise InvalidInput(f"config file {path} (TRANSCRIPT_STORE_CONFIG) does not exist")
    env_engine = os.environ.get("TRANSCRIPT_STORE_ENGINE")
    if env_engine:  # empty: not set; anything else is an engine id (" " or " legacy" is none)
        values["engine"] = _engine_id(env_engine, "TRANSCRIPT_STORE_ENGINE")
        values["engine_source"] = "env"
    env_dirs = os.environ.get(PLUGIN_DIRS_ENV)
    if env_dirs:
        values["plugin_dirs"] = [*values.get("plugin_dirs", []), *filter(None, env_dirs.split(os.pathsep))]
    engine = overrides.pop("engine", None)
    if engine is not None:  # an empty one too: "" names no engine, and is no reason to use another
        values["engine"], values["engine_source"] = _engine_id(engine, "engine argument"), "argument"
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return HostSettings.model_validate(values)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidInput(f"invalid setting{f' {where}' if where else 's'}: {_reason(first['msg'])}") from None


def _reason(message: str) -> str:
    """pydantic's message of a rule of ours, without the "Value error, " it puts in front."""
    return message.removeprefix("Value error, ")
