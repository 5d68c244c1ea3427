"""Store configuration: every setting, its default and its environment variable."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError

from .errors import InvalidInput
from .shapes import Shape

DEFAULT_URL = "sqlite:///transcripts.db"

#: setting name -> environment variable
ENV_VARS: dict[str, str] = {
    "url": "TRANSCRIPT_STORE_URL",
    "max_payload_bytes": "TRANSCRIPT_STORE_MAX_PAYLOAD_BYTES",
    "sqlite_synchronous": "TRANSCRIPT_STORE_SQLITE_SYNCHRONOUS",
    "busy_timeout_ms": "TRANSCRIPT_STORE_BUSY_TIMEOUT_MS",
    "retry_attempts": "TRANSCRIPT_STORE_RETRY_ATTEMPTS",
    "auto_upgrade": "TRANSCRIPT_STORE_AUTO_UPGRADE",
    "pg_generic_plans": "TRANSCRIPT_STORE_PG_GENERIC_PLANS",
    "pg_prepared_statements": "TRANSCRIPT_STORE_PG_PREPARED_STATEMENTS",
}

#: an integer as written in an environment variable, a command-line option or a query parameter: an optional
#: ``-`` and ASCII digits, nothing else. Python's ``int`` (and pydantic, reading a string) also took ``+5``,
#: ``4_096``, `` 4096 `` and ``4096.0`` as the number they spell: a typo or a stray character was a setting.
#: The ``-`` is taken as written everywhere; a count that cannot be negative refuses it by its range.
INTEGER_TEXT = re.compile("-?[0-9]+")
INTEGER_RULE = "must be an integer written as ASCII digits (an optional '-' in front), nothing else"

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(var: str, raw: str) -> bool:
    """A boolean environment value (1/0, true/false, yes/no, on/off; any case); InvalidInput otherwise."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    words = ", ".join((*TRUE_WORDS, *FALSE_WORDS))
    raise InvalidInput(f"invalid store setting {var}={raw!r}: expected one of {words} (any case)")


def parse_int_text(var: str, raw: str) -> str:
    """An integer environment value as written (INTEGER_TEXT), its bounds left to the setting; InvalidInput
    naming the variable otherwise."""
    if not INTEGER_TEXT.fullmatch(raw):
        raise InvalidInput(f"invalid store setting {var}={raw!r}: {INTEGER_RULE}")
    return raw


class StoreConfig(Shape):
    """How a store connects and what it accepts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(DEFAULT_URL, description="SQLAlchemy URL; default a SQLite file in the working dir")
    max_payload_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024, description="cap on one entry's JSON payload"
    )
    sqlite_synchronous: Literal["FULL", "NORMAL"] = Field(
        "FULL", description="SQLite durability: FULL survives power loss, NORMAL only process crashes"
    )
    # SQLite keeps it in a C int: a value past 2**31 - 1 ms was read back as 0, no wait for any lock.
    busy_timeout_ms: int = Field(
        10_000, ge=0, le=86_400_000, description="SQLite busy timeout per statement (a day at most)"
    )
    retry_attempts: int = Field(12, ge=1, le=100, description="tries of one transaction on transient errors")
    auto_upgrade: bool | None = Field(
        None, description="migrate an existing database on open; None: yes for SQLite, no for PostgreSQL"
    )
    pool_size: int = Field(5, ge=1, le=100, description="connections kept per process (PostgreSQL)")
    pg_generic_plans: bool = Field(
        True,
        description="PostgreSQL: plan each statement once per connection (plan_cache_mode=force_generic_plan)",
    )
    # Off behind a pooler that moves a client between server connections within its session (PgBouncer
    # before 1.21 in transaction mode): a statement prepared on one was missing on the next.
    pg_prepared_statements: bool = Field(
        True,
        description="PostgreSQL: let psycopg prepare a statement run five times on a connection "
        "(off: prepare_threshold=None, for a pooler in transaction mode)",
    )

    @classmethod
    def from_env(cls, **overrides: object) -> StoreConfig:
        """Settings from TRANSCRIPT_STORE_* variables, then the given overrides (None ones ignored)."""
        values: dict[str, object] = {}
        given = {k: v for k, v in overrides.items() if v is not None}
        for name, var in ENV_VARS.items():
            raw = os.environ.get(var)
            if raw is None or raw == "" or name in given:  # an argument given wins: its variable is not read
                continue
            if name in ("auto_upgrade", "pg_generic_plans", "pg_prepared_statements"):
                values[name] = parse_bool(var, raw)
            elif name == "sqlite_synchronous":
                values[name] = raw.strip().upper()  # any case, as the boolean settings
            elif cls.model_fields[name].annotation is int:
                values[name] = parse_int_text(var, raw)
            else:
                values[name] = raw
        values.update(given)
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "config"
            if where in ENV_VARS and where not in given:  # the value came from the environment: name it
                shown = "(not shown)" if where == "url" else repr(os.environ.get(ENV_VARS[where]))
                where = f"{ENV_VARS[where]}={shown}"
            raise InvalidInput(f"invalid store setting {where}: {first['msg']}") from None
