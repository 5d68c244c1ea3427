"""The context-engine protocol: declarations, lifecycle shapes, host parameters, contract validation.

An engine is any object with an ``info`` (EngineInfo) and an ``assemble`` method; every other
lifecycle method is optional and looked up by name (``ingest`` is OpenClaw's name, validated but never
called: a durable engine gets each accepted turn's messages in ``commit_turn``). The host passes each
method its base keyword arguments plus the host parameters the engine's ``accepted_host_params``
allows (None = all). This is the Python form of OpenClaw's ContextEngine contract, with the store
underneath.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .core import check_anchor, check_id
from .errors import EngineContractError, InvalidInput
from .models import CURRENT_TURN_FENCE, TURN_ADVANCEMENT_IDEMPOTENCY
from .terminal import quoted

HostParam = Literal["session_key", "prompt", "runtime_settings", "session_target", "runtime_context"]
HOST_PARAMS: tuple[str, ...] = ("session_key", "prompt", "runtime_settings", "session_target", "runtime_context")
Operation = Literal["agent-run", "manual-compact", "subagent-spawn"]
OPERATIONS: tuple[str, ...] = ("agent-run", "manual-compact", "subagent-spawn")
LIFECYCLE = (
    "bootstrap",
    "ingest",
    "assemble",
    "compact",
    "after_turn",
    "commit_turn",
    "maintain",
    "prepare_subagent_spawn",
    "on_subagent_ended",
    "get_tool_schemas",
    "handle_tool_call",
    "dispose",
)

#: the longest engine id: a manifest's name, an entry point's name, an engine slot, ``info.id``
MAX_ENGINE_ID_CHARS = 128
#: the longest ``info.name`` / ``info.version`` an engine declares
MAX_ENGINE_LABEL_CHARS = 256
#: the most ``info.accepted_host_params`` an engine lists (five are known: a repeated one is harmless), and the
#: longest one (an unknown one is refused, quoted)
MAX_ACCEPTED_HOST_PARAMS = 16
MAX_HOST_PARAM_CHARS = 64
#: the most capabilities one operation of ``info.host_requirements`` requires, and the longest one
MAX_REQUIRED_CAPABILITIES = 64
MAX_CAPABILITY_CHARS = 128
#: the longest ``unsupported_message`` of a host requirement (quoted by HostRequirementError)
MAX_UNSUPPORTED_MESSAGE_CHARS = 1024
#: the longest refusal of an engine's info: the error quotes where, never the declaration it refuses
MAX_INFO_ERROR_CHARS = 240
#: what no engine id, name or version may hold (C0, DEL, C1, lone surrogates): they are shown on terminals by
#: ``doctor`` and ``engines list``, written to quarantine records, and compared as the engine slot
_BAD_ENGINE_CHAR = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def engine_id_problem(value: object) -> str | None:
    """Why ``value`` cannot be an engine id (None when it can): a string of 1..128 characters, without control
    characters, NUL or lone surrogates, and without whitespace around it (``" legacy"`` is no other engine)."""
    if not isinstance(value, str):
        return f"an engine id must be a string, not {type(value).__name__}"
    if not value or len(value) > MAX_ENGINE_ID_CHARS:
        return f"an engine id must be 1..{MAX_ENGINE_ID_CHARS} characters"
    if _BAD_ENGINE_CHAR.search(value) is not None:
        return "an engine id must not contain control characters, NUL or lone surrogates"
    if value != value.strip():
        return "an engine id must not start or end with whitespace"
    return None


def require_engine_id(value: str) -> str:
    """``value`` when it can be an engine id (``engine_id_problem``), else ValueError (a pydantic validator's)."""
    problem = engine_id_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def engine_label_problem(value: str) -> str | None:
    """Why ``value`` cannot be an engine's name or version (None when it can): at most 256 characters, without
    control characters, NUL or lone surrogates (``engines list`` shows it: an escape sequence would act on the
    operator's terminal)."""
    if len(value) > MAX_ENGINE_LABEL_CHARS:
        return f"at most {MAX_ENGINE_LABEL_CHARS} characters"
    if _BAD_ENGINE_CHAR.search(value) is not None:
        return "no control characters, NUL or lone surrogates"
    return None


def _shown_text(value: str, limit: int) -> str:
    """``value`` when it is at most ``limit`` characters without control characters, NUL or lone surrogates:
    what an engine declares for a terminal, a log line or an error message (ValueError otherwise)."""
    if len(value) > limit:
        raise ValueError(f"at most {limit} characters")
    if _BAD_ENGINE_CHAR.search(value) is not None:
        raise ValueError("no control characters, NUL or lone surrogates")
    return value


#: the largest token count any setting or budget takes
MAX_TOKENS = 100_000_000


def check_token_budget(value: object, *, optional: bool = False, what: str = "token_budget") -> int | None:
    """A token budget given to an engine's assemble or compact: an integer in 1..MAX_TOKENS (or None when
    ``optional``), else InvalidInput. The host and the service never pass another; a library caller
    could, and a negative one was taken for no budget at all (lossless compacted everything, fresh
    tail included; legacy assembled nothing)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        raise InvalidInput(f"{what} must be an integer in 1..{MAX_TOKENS}, got {value!r}")
    return value


def check_call(
    scope: object,
    session_id: object,
    *,
    fence: object = None,
    session_key: object = None,
    runtime_settings: object = None,
) -> None:
    """The arguments every engine method shares, checked before it reads or writes anything: InvalidInput.

    The host and the service check them before they call an engine; an application holding an engine
    itself (the plugin factory returns one) did not, and a lone surrogate in an id, an ``Admission``
    for the fence or a dict for the runtime settings surfaced as a UnicodeEncodeError, AttributeError
    or TypeError from deep inside the engine. A fence is an anchor of the session the call names."""
    check_id("scope", scope)
    check_id("session_id", session_id)
    if fence is not None:
        anchor = check_anchor("fence", fence)
        if (anchor.scope, anchor.session_id) != (scope, session_id):
            raise InvalidInput(f"fence is an anchor of session {anchor.session_id!r}, not of {session_id!r}")
    check_id("session_key", session_key, optional=True)
    if runtime_settings is not None and not isinstance(runtime_settings, RuntimeSettings):
        raise InvalidInput(f"runtime_settings must be RuntimeSettings or None, not {type(runtime_settings).__name__}")


def check_flag(what: str, value: object) -> bool:
    """A yes/no argument: a bool, else InvalidInput (a truthy string such as "no" forced a compaction)."""
    if not isinstance(value, bool):
        raise InvalidInput(f"{what} must be true or false, not {type(value).__name__}")
    return value


def check_focus(value: object) -> str | None:
    """A compaction's focus: None or a string a summary can hold (valid UTF-8), else InvalidInput.

    Checked before the summarizer runs: a lone surrogate was refused only when the summary holding it was
    stored, after the (possibly paid) summarizer call."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidInput(f"focus must be a string or None, not {type(value).__name__}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInput("focus must not contain lone surrogates") from None
    return value


DEGRADE_NO_FENCE = "current-turn transcript fencing is not declared"
DEGRADE_NO_IDEMPOTENCY = "atomic idempotent turn advancement is not declared"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Declaration(_Model):
    """A part of an engine's info: a mapping of more keys than it has fields is refused before any is read (a
    million unknown keys would be a million errors, each quoting its key)."""

    @model_validator(mode="before")
    @classmethod
    def _few_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(data) > len(cls.model_fields):
            raise ValueError(f"at most {len(cls.model_fields)} fields, not {len(data)}")
        return data


class TranscriptSemantics(_Declaration):
    """What an engine promises about transcript reads and turn advancement."""

    current_turn_fence: Literal["before-current-turn-entry-v1"] | None = None
    turn_advancement_idempotency: Literal["atomic-idempotent-v1"] | None = None


class HostRequirement(_Declaration):
    """Host capabilities an operation needs, and what to tell the user when they are missing: at most 64
    capabilities of at most 128 characters, a message of at most 1024, without control characters."""

    required_capabilities: list[str] = Field(default_factory=list, max_length=MAX_REQUIRED_CAPABILITIES)
    unsupported_message: str | None = None

    @field_validator("required_capabilities")
    @classmethod
    def _capabilities(cls, value: list[str]) -> list[str]:
        for capability in value:
            _shown_text(capability, MAX_CAPABILITY_CHARS)
        return value

    @field_validator("unsupported_message")
    @classmethod
    def _message(cls, value: str | None) -> str | None:
        return None if value is None else _shown_text(value, MAX_UNSUPPORTED_MESSAGE_CHARS)


class EngineInfo(_Declaration):
    """An engine's identity and declarations, each bounded: shown by ``doctor`` and ``engines list``, served by
    the service's /engines, quoted by errors and logs."""

    id: str = Field(min_length=1, max_length=128)
    name: str = ""
    version: str = "0"
    owns_compaction: bool = False
    accepted_host_params: list[Annotated[str, Field(max_length=MAX_HOST_PARAM_CHARS)]] | None = Field(
        default=None, max_length=MAX_ACCEPTED_HOST_PARAMS
    )
    transcript_semantics: TranscriptSemantics = Field(default_factory=TranscriptSemantics)
    host_requirements: dict[Operation, HostRequirement] = Field(default_factory=dict)
    #: ``background``: the host runtime defers ``maintain`` to its maintenance thread, where it may run
    #: while the same instance serves another turn (maintenance.py): the engine must be thread-safe
    turn_maintenance_mode: Literal["foreground", "background"] = "foreground"

    @field_validator("id")
    @classmethod
    def _an_engine_id(cls, value: str) -> str:
        return require_engine_id(value)

    @field_validator("name", "version")
    @classmethod
    def _a_label(cls, value: str) -> str:
        if (problem := engine_label_problem(value)) is not None:
            raise ValueError(problem)
        return value

    @field_validator("host_requirements", mode="before")
    @classmethod
    def _few_operations(cls, value: Any) -> Any:
        # before the keys are read: each one not an operation would be an error quoting it
        if isinstance(value, Sized) and len(value) > len(OPERATIONS):
            raise ValueError(f"at most {len(OPERATIONS)} operations, not {len(value)}")
        return value


# ---------------------------------------------------------------------------------------------- runtime settings


class RuntimeInfo(_Model):
    """Which host runs the hook and in which mode."""

    host: str = "transcript-store"
    mode: Literal["normal", "fallback", "degraded"] = "normal"
    harness_id: str | None = None
    runtime_id: str | None = None


class EngineSelection(_Model):
    """Which engine was selected, and from where."""

    id: str
    source: Literal["default", "config", "env", "argument", "fallback"]


class ExecutionHost(_Model):
    """The surface invoking the hook."""

    id: str | None = None
    label: str | None = None


class ModelSettings(_Model):
    """The model of the run."""

    requested: str | None = None
    resolved: str | None = None
    provider: str | None = None
    family: str | None = None


class Limits(_Model):
    """Token limits when known."""

    prompt_token_budget: int | None = None
    max_output_tokens: int | None = None


class Diagnostics(_Model):
    """Closed fallback / degraded reason codes when known."""

    fallback_reason: str | None = None
    degraded_reason: str | None = None


class RuntimeSettings(_Model):
    """Versioned, read-only facts about the run, passed only to engines that accept them."""

    schema_version: Literal[1] = 1
    runtime: RuntimeInfo = Field(default_factory=RuntimeInfo)
    context_engine_selection: EngineSelection
    execution_host: ExecutionHost = Field(default_factory=ExecutionHost)
    model: ModelSettings = Field(default_factory=ModelSettings)
    limits: Limits = Field(default_factory=Limits)
    diagnostics: Diagnostics = Field(default_factory=Diagnostics)


# ---------------------------------------------------------------------------------------------- results


class SessionTarget(_Model):
    """A typed session identity (the successor after a compaction that changed it)."""

    scope: str
    session_id: str
    session_key: str | None = None


class ContextProjection(_Model):
    """Projection lifecycle for hosts with persistent backend threads."""

    mode: Literal["per_turn", "thread_bootstrap"] = "per_turn"
    epoch: str | None = None


class AssembleResult(BaseModel):
    """What the model sees before the current turn's own messages."""

    model_config = ConfigDict(extra="forbid")
    messages: list[dict[str, Any]]
    estimated_tokens: int = Field(ge=0)
    system_prompt_addition: str | None = None
    prompt_authority: Literal["assembled", "preassembly_may_overflow"] = "assembled"
    context_projection: ContextProjection | None = None
    #: when the engine last replaced messages these follow (its newest summary shown), in milliseconds since
    #: the epoch; None when it replaced none. A reply generated before then was generated after another
    #: prefix, and a provider's signature bound to that prefix (Anthropic's signed thinking) no longer holds.
    compacted_at_ms: int | None = Field(default=None, ge=0)


class CompactResult(BaseModel):
    """What a compaction did; ``compacted`` is False when it made no progress."""

    model_config = ConfigDict(extra="forbid")
    ok: bool
    compacted: bool
    reason: str | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None
    session_target: SessionTarget | None = None

    @property
    def session_id(self) -> str | None:
        """The successor session id, mirroring ``session_target``."""
        return self.session_target.session_id if self.session_target else None


class BootstrapResult(BaseModel):
    """What a bootstrap imported."""

    model_config = ConfigDict(extra="forbid")
    bootstrapped: bool
    imported_messages: int = 0
    reason: str | None = None


class MaintainResult(BaseModel):
    """What a maintenance pass changed."""

    model_config = ConfigDict(extra="forbid")
    changed: bool = False
    rewritten_entries: int = 0
    bytes_freed: int = 0
    reason: str | None = None


@dataclass
class SubagentSpawnPreparation:
    """Returned by prepare_subagent_spawn; ``rollback`` is called when the spawn fails afterwards."""

    rollback: Callable[[], None] | None = None
    detail: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- the engine


@runtime_checkable
class ContextEngine(Protocol):
    """The one required shape: ``info`` and ``assemble``. Optional methods are found by name (LIFECYCLE)."""

    info: EngineInfo

    def assemble(self, **kwargs: Any) -> AssembleResult:
        """Build the model's context before the current turn (see HostRuntime for the arguments)."""
        ...


@dataclass
class EngineContext:
    """What an engine factory receives: the store, configuration, and the pluggable helpers."""

    store: Any  # TranscriptStore (Any: engines must not import host internals)
    config: dict[str, Any] = field(default_factory=dict)
    summarizer: Any = None
    estimator: Any = None
    workspace_dir: str | None = None


EngineFactory = Callable[[EngineContext], Any]


def coerce_info(raw: object) -> EngineInfo:
    """A validated EngineInfo from an engine's ``info`` (a model or a dict), or EngineContractError.

    An EngineInfo instance is validated again, from its fields: ``model_construct`` and ``model_copy(update=...)``
    make one without validation, whose fields may be anything (a dict for ``transcript_semantics``, a None id).
    """
    if isinstance(raw, EngineInfo):
        try:
            data: object = raw.model_dump(warnings=False)
        except Exception as e:  # a field pydantic cannot even read back
            raise EngineContractError(f"invalid info: {type(e).__name__}") from None
    elif isinstance(raw, dict):
        data = raw
    else:
        raise EngineContractError("engine has no info (EngineInfo)")
    try:
        return EngineInfo.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False, include_context=False, include_input=False)[0]
        where = ".".join(_loc_part(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        line = f"invalid info{'.' + where if where else ''}: {message}"
        if len(line) > MAX_INFO_ERROR_CHARS:
            line = line[: MAX_INFO_ERROR_CHARS - 10] + " ... (cut)"
        raise EngineContractError(line) from None


def _loc_part(part: str | int) -> str:
    """One step of a validation error's location: a field name as it is, a key an engine made up (an unknown
    field, a mapping's key) quoted and cut."""
    if isinstance(part, int) or (len(part) <= 40 and part.isprintable() and " " not in part):
        return str(part)
    return quoted(part)


def validate_engine(engine: object, expected_id: str | None = None) -> EngineInfo:
    """Contract validation at load: info.id, known declarations, a callable assemble."""
    info = coerce_info(getattr(engine, "info", None))
    if expected_id is not None and info.id != expected_id:
        raise EngineContractError(f"engine registered as {expected_id!r} reports info.id {info.id!r}")
    if not callable(getattr(engine, "assemble", None)):
        raise EngineContractError(f"engine {info.id!r} has no assemble()")
    if info.accepted_host_params is not None:
        unknown = [p for p in info.accepted_host_params if p not in HOST_PARAMS]
        if unknown:  # each one quoted and cut: at most 16 of 64 characters
            listed = ", ".join(quoted(p) for p in unknown[:3]) + (
                f" and {len(unknown) - 3} more" if unknown[3:] else ""
            )
            raise EngineContractError(f"engine {info.id!r} accepts unknown host params {listed}")
    for name in LIFECYCLE:
        member = getattr(engine, name, None)
        if member is not None and not callable(member):
            raise EngineContractError(f"engine {info.id!r}: {name} is not callable")
    return info


def durable_declaration(engine: object, info: EngineInfo) -> tuple[bool, str | None, bool]:
    """(durable, degrade reason, invariant failure): may this engine take durable admitted turns?"""
    semantics = info.transcript_semantics
    has_commit = callable(getattr(engine, "commit_turn", None))
    if semantics.current_turn_fence != CURRENT_TURN_FENCE:
        return False, DEGRADE_NO_FENCE, semantics.turn_advancement_idempotency is not None or has_commit
    if semantics.turn_advancement_idempotency != TURN_ADVANCEMENT_IDEMPOTENCY:
        return False, DEGRADE_NO_IDEMPOTENCY, has_commit
    if not has_commit:
        # Declared idempotent advancement without the method: a broken promise, not a choice.
        return False, DEGRADE_NO_IDEMPOTENCY, True
    return True, None, False


def project_params(info: EngineInfo, base: dict[str, Any], host: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of one lifecycle call: base ones plus the host params the engine accepts."""
    accepted = HOST_PARAMS if info.accepted_host_params is None else info.accepted_host_params
    out = dict(base)
    for name in HOST_PARAMS:
        if name in host and name in accepted:
            out[name] = host[name]
    return out


def takes_keyword(method: object, name: str) -> bool:
    """Whether ``method`` declares a keyword parameter ``name`` by that name (``**kwargs`` alone is no
    promise to honour it): how the host tells an engine's ``maintain`` that takes the turn's ``fence``."""
    try:
        parameter = inspect.signature(method).parameters.get(name)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # no signature to read (a builtin, a C extension): no promise either
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
    )


def missing_capabilities(info: EngineInfo, operation: str, capabilities: Sequence[str]) -> tuple[list[str], str]:
    """Capabilities an operation needs that the host lacks, and the engine's message for it."""
    req = info.host_requirements.get(operation)  # type: ignore[call-overload]
    if req is None:
        return [], ""
    missing = [c for c in req.required_capabilities if c not in capabilities]
    return missing, req.unsupported_message or ""
