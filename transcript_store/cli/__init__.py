"""The ``transcript-store`` command: stores, sessions, the outbox, engines, chat and the gateway run.

Every command takes ``--db URL`` (else TRANSCRIPT_STORE_URL, else ``sqlite:///transcripts.db`` in the
working directory), ``--scope`` (else TRANSCRIPT_STORE_SCOPE, else ``default``; ``gateway`` for the
gateway), ``--json``, ``--config PATH`` (host settings TOML) and ``--debug``, before or after the command
name. A settings file named by --config or TRANSCRIPT_STORE_CONFIG is checked by every command.

Exit codes: 0 ok; 1 the operation or a check failed; 2 usage error (a bad option or ``--db`` URL, an
empty value of an option or argument, a number not written as ASCII digits, a bad settings file or
TRANSCRIPT_STORE_* value);
3 not found (unknown session); 4 schema not current (or no store yet: run ``init``); 5 database
unavailable; 6 permission denied (the database role lacks a grant); 130 interrupted (Ctrl-C, also while the
command's modules are still imported: ``transcript_store.entry``; ``serve`` stops on it, exit 0).
An error is one line on stderr,
``error: ...``; ``--debug`` adds the traceback.
"""

from __future__ import annotations

# In the order their commands were registered (``cli.commands`` keeps it), so not sorted: importing a
# module registers its commands.
# isort: off
from .options import (  # noqa: F401
    _COMMON, _NO_STDOUT_NEEDED, BLANK_SCOPE, DEFAULT_SCOPE, EXIT_DENIED, EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK,
    EXIT_SCHEMA, EXIT_UNAVAILABLE, EXIT_USAGE, F, NUMBER_TEXT, SCOPE_ENV, URL_ENV, CommandError, Integer, Number,
    State, _bounds, _db_option, _discard_stdout, _remember, _scope_option, common, common_options, filled, state,
)
from .output import (  # noqa: F401
    _UNICODE_PROBE, WholeStdout, _unencodable, _write_all, console, emit_json, holds_unicode,
)
from .stores import (  # noqa: F401
    _NOT_SQLITE, _NOT_SQLITE_ADVICE, _SQLITE_MAGIC, _no_store_advice, _no_store_file, _not_a_store_database,
    _not_sqlite, _refuse_non_sqlite_file, find_session, make_url_or_usage, open_store, schema_advice, schema_state,
    store_session, url_source,
)
from .rendering import _show_json, entry_json, entry_text, message_text, print_entries  # noqa: F401
from .group import (  # noqa: F401
    _LINE_BREAK_RUN, _Command, _Group, _fail, _show_help, _show_version, _write_info, cli, error_line, exit_code,
    main,
)
from .hosting import (  # noqa: F401
    _engine_report, _engines_table, _optional_store, _runtime, engine_context, engine_output_on_stderr,
    engine_report, refuse_bad_legacy_config, unknown_engine_reason, unusable_engines, unusable_warning,
    warn_unusable_engines,
)
from .revisions import _migrate, current, init, upgrade  # noqa: F401
from .transcripts import (  # noqa: F401
    _all_sessions, sessions, sessions_delete, sessions_export, sessions_import, sessions_list, sessions_show,
)
from .exports import (  # noqa: F401
    _ENTRY_AT, _NO_HEADER, _SPOOL_FAILED, _Ambiguous, _ExportFile, _at_line, _export_record, _export_records,
    _names_the_store, _no_constant, _scratch_file, _spooled, _unique_keys, _write_file, export_line_limit,
)
from .intents import (  # noqa: F401
    OUTBOX_PAGE, OUTBOX_STATUS_ROWS, _outbox_counts, _outbox_sessions, outbox, outbox_block, outbox_drain,
    outbox_recover, outbox_status,
)
from .checks import _doctor_store, _print_doctor, doctor, engines, engines_list  # noqa: F401
from .compacting import _check_focus, _compact_line, compact, compact_json  # noqa: F401
from .conversation import CHAT_HELP, CHAT_KEY, ChatLoop, _lenient, chat, chosen_model  # noqa: F401
from .gateway_run import gateway
from .serving import _loopback, serve  # noqa: F401
from .plugins import (  # noqa: F401
    _absolute_sqlite, _check_engine_id, _check_hermes_config, _check_hermes_engine_config, _check_threshold,
    _merged_keys, _no_empty_path, check_service_url, hermes, hermes_install, openclaw, openclaw_install_line,
)
# isort: on

# Every name of the module this package was (cli.py) stays importable from it; private ones, too, for code
# that reached into it (the imports marked noqa).
__all__ = [
    "BLANK_SCOPE", "CHAT_HELP", "CHAT_KEY", "DEFAULT_SCOPE", "EXIT_DENIED", "EXIT_FAILED", "EXIT_NOT_FOUND",
    "EXIT_OK", "EXIT_SCHEMA", "EXIT_UNAVAILABLE", "EXIT_USAGE", "NUMBER_TEXT", "OUTBOX_PAGE", "OUTBOX_STATUS_ROWS",
    "SCOPE_ENV", "URL_ENV", "ChatLoop", "CommandError", "F", "Integer", "Number", "State", "WholeStdout", "chat",
    "check_service_url", "chosen_model", "cli", "common", "common_options", "compact", "compact_json", "console",
    "current", "doctor", "emit_json", "engine_context", "engine_output_on_stderr", "engine_report", "engines",
    "engines_list", "entry_json", "entry_text", "error_line", "exit_code", "export_line_limit", "filled",
    "find_session", "gateway", "hermes", "hermes_install", "holds_unicode", "init", "main", "make_url_or_usage",
    "message_text", "open_store", "openclaw", "openclaw_install_line", "outbox", "outbox_block", "outbox_drain",
    "outbox_recover", "outbox_status", "print_entries", "refuse_bad_legacy_config", "schema_advice", "schema_state",
    "serve", "sessions", "sessions_delete", "sessions_export", "sessions_import", "sessions_list", "sessions_show",
    "state", "store_session", "unknown_engine_reason", "unusable_engines", "unusable_warning", "upgrade",
    "url_source", "warn_unusable_engines",
]
