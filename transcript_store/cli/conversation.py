"""``chat``: an interactive, persisted conversation through the host runtime."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from typing import IO, Any, TypeVar

import click

from ..core import check_id
from ..errors import InvalidInput, TranscriptStoreError
from ..terminal import shown
from .compacting import _compact_line, compact_json
from .group import cli, error_line, exit_code
from .hosting import _runtime, engine_output_on_stderr, refuse_bad_legacy_config, warn_unusable_engines
from .options import EXIT_DENIED, EXIT_FAILED, EXIT_UNAVAILABLE, EXIT_USAGE, CommandError, common, filled, state
from .output import holds_unicode
from .rendering import entry_json, message_text, print_entries
from .stores import store_session

CHAT_KEY = "cli:chat"

F = TypeVar("F", bound=Callable[..., Any])

#: the options of the commands that run turns (chat, gateway): the engine and the model
_MODEL_OPTIONS = (
    click.option("--engine", metavar="NAME", callback=filled(), help="The context engine (overrides settings)."),
    click.option("--model-url", metavar="URL", callback=filled(),
                 help="OpenAI-compatible endpoint [env OPENAI_BASE_URL; default: the local responder]."),
    click.option("--model", "model_name", metavar="NAME", callback=filled(),
                 help="Model name [env TRANSCRIPT_STORE_MODEL]."),
    click.option("--api-key", metavar="KEY", callback=filled(), help="API key [env OPENAI_API_KEY]."),
)


def model_options(fn: F) -> F:
    """Add --engine, --model-url, --model and --api-key (``chosen_model`` reads the last three)."""
    for option in reversed(_MODEL_OPTIONS):
        fn = option(fn)
    return fn


@cli.command()
@click.option("--session", "session_key", default=CHAT_KEY, show_default=True, metavar="KEY", callback=filled(),
              help="The session key to open (created when missing).")
@model_options
@common
def chat(session_key: str, engine: str | None, model_url: str | None, model_name: str | None,
         api_key: str | None) -> None:
    """An interactive, persisted conversation through the host runtime (reads lines from stdin).

    Slash commands: /compact [focus], /branch, /history, /engine, /help, /quit.
    """
    st = state()
    settings = st.settings(engine)  # a bad settings file or variable: refused before the store is created
    model = chosen_model(model_url, model_name, api_key)  # so is a bad model URL
    scope = st.scope_name  # so are a bad scope and a bad session key (open_session would refuse them after)
    check_id("session_key", session_key, new=True)
    refuse_bad_legacy_config(settings)  # exit 1, but before the store is created too (the host checks it again)
    source = sys.stdin if sys.stdin is not None else io.StringIO("")  # stdin closed (``<&-``): no input
    # Never None (a closed stdout is refused before any command runs): the loop took None for "sys.stdout",
    # which by then was stderr, and every turn ran and committed with its replies there, exit 0.
    stdout = sys.stdout  # the conversation's own output; an engine's goes to stderr
    from ..gateway import sigterm_ends_the_run

    # A SIGTERM (`timeout`, `kill`, a service manager) or a SIGHUP (the terminal closed, the SSH connection
    # dropped) ended chat where it stood: a turn waiting for the model stayed admitted in the outbox
    # (discarded, with a warning, by the session's next admission) and the runtime was never disposed of.
    # Raised as Ctrl-C is, it discards the turn, disposes of the runtime and closes the store, then ends the
    # process as that signal would.
    with sigterm_ends_the_run(), store_session(create=True) as store, engine_output_on_stderr():
        # Built before the session is opened: a bad [engine.config.legacy] (which the host checks whole)
        # stops chat with nothing written, not after it opened the session.
        runtime = _runtime(store, settings, model)
        try:
            info = store.open_session(scope, session_key)
            loop = ChatLoop(runtime, scope, info.session_id, st.json, stdout)
            # Before the first turn runs it on legacy, said once; checked in the runtime, the engine
            # (imported once, made once) is the one the turns use.
            warn_unusable_engines(settings, store, runtime)
            if not st.json:
                loop.banner(session_key)
            loop.run(_lenient(source))
        finally:
            runtime.dispose()
    if loop.failed:
        # The database's refusal (5 unavailable, 6 permission denied) keeps its own exit code.
        raise CommandError(f"{loop.failed} turn(s) or command(s) failed", loop.code)


def chosen_model(model_url: str | None, model_name: str | None, api_key: str | None) -> Any:
    """The model of --model-url/--model/--api-key (or their variables); a URL that is not http(s), or
    --model/--api-key without an endpoint, is a usage error, refused before any work."""
    from ..model import LocalResponder, model_from_settings

    try:
        model = model_from_settings(model_url, model_name, api_key)
    except InvalidInput as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    if isinstance(model, LocalResponder) and (model_name is not None or api_key is not None):
        # No endpoint: the local stand-in answered, the model named or the key given silently unused
        # (`chat --model gpt-4o` talked to the stand-in, exit 0).
        given = "--model" if model_name is not None else "--api-key"
        raise CommandError(f"{given} needs an endpoint: give --model-url (or set OPENAI_BASE_URL); without one "
                           "the local stand-in answers", EXIT_USAGE)
    return model


CHAT_HELP = "/compact [focus]  /branch  /history  /engine  /help  /quit"


def _lenient(stream: IO[str]) -> IO[str]:
    """``stream`` decoding bytes that are not valid in its encoding as lone surrogates (surrogateescape).

    Strictly decoded, one such byte on ``chat``'s stdin raised UnicodeDecodeError out of the loop: the
    lines after it were never read and the run ended as an internal error. Decoded leniently, that line
    is one failed turn (a message with a lone surrogate is refused, as every one is) and the rest run.
    A handler chosen with PYTHONIOENCODING (``utf-8:replace``) is kept."""
    if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":  # not a handler the user chose
        stream.reconfigure(errors="surrogateescape")
    return stream


class ChatLoop:
    """One conversation: user lines become logical turns, slash lines become commands."""

    def __init__(self, runtime: Any, scope: str, session_id: str, as_json: bool, stdout: IO[str] | None = None) -> None:
        """Bind to a host runtime and an open session; write the conversation to ``stdout`` (default
        sys.stdout now: the chat command passes its own, engines' output going to stderr meanwhile)."""
        self.runtime = runtime
        self.scope = scope
        self.session_id = session_id
        self.as_json = as_json
        self.stdout = stdout if stdout is not None else sys.stdout
        from rich.console import Console

        self.out = Console(file=self.stdout, highlight=False, soft_wrap=False, markup=False, emoji=False)
        self.last: Any = None  # the last TurnOutcome
        self.failed = 0
        self.code = EXIT_FAILED  # the exit code of the failures: the worst error's (see exit_code)
        #: the longest input line read (characters): a message over the payload cap is refused anyway
        config = getattr(getattr(runtime, "store", None), "config", None)
        self.max_line = int(config.max_payload_bytes) if config is not None else 64 * 1024 * 1024

    def failure(self, error: TranscriptStoreError) -> None:
        """Count a failed turn or command and show its error line."""
        self.failed += 1
        # 1, or the database's refusal (5 unavailable, 6 permission denied) as documented: a turn whose
        # session was deleted under it (3) or a schema changed under it (4) is a failed turn, 1.
        code = exit_code(error)
        self.code = max(self.code, code if code in (EXIT_UNAVAILABLE, EXIT_DENIED) else EXIT_FAILED)
        click.echo(error_line(error, None), err=True)

    def banner(self, session_key: str) -> None:
        """Say what this conversation runs on."""
        from ..model import mask_url as mask_model_url  # every query value masked: an endpoint's key

        s = self.runtime.settings
        model = self.runtime.model
        where = f" at {mask_model_url(model.base_url)}" if getattr(model, "base_url", None) else ""
        click.echo(f"chat: session {session_key} ({self.session_id}), engine {s.engine} "
                   f"(from {s.engine_source}), model {getattr(model, 'name', '?')}{where}", file=self.stdout)
        click.echo(f"commands: {CHAT_HELP}", file=self.stdout)

    def run(self, stream: IO[str]) -> None:
        """Read lines until /quit or the end of input."""
        interactive = stream.isatty()
        while True:
            if interactive:
                # Under --json stdout holds JSON lines only (`chat --json | jq` at a terminal): the
                # prompt goes to stderr there.
                click.echo("you> ", nl=False, file=sys.stderr if self.as_json else self.stdout)
            # At most a message's worth: a line of any length was read whole (``chat < /dev/zero``
            # took memory until the process was killed).
            line = stream.readline(self.max_line + 1)
            if not line:
                return
            # The cap is in bytes (UTF-8, as stored): a line of 1,500 "é" is 3,000 bytes.
            if len(line) > self.max_line or len(line.encode("utf-8", "surrogatepass")) > self.max_line:
                raise InvalidInput(f"an input line of more than {self.max_line} bytes (over the "
                                   "store's payload cap for one message)")
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return
            else:
                self.turn(text)

    def emit(self, event: str, data: dict[str, Any], text: str | None) -> None:
        """One event: a JSON line, or text for people."""
        if self.as_json:
            ascii_only = not holds_unicode(getattr(self.stdout, "encoding", None) or "utf-8")
            click.echo(json.dumps({"event": event, **data}, ensure_ascii=ascii_only, default=str), file=self.stdout)
        elif text is not None:
            click.echo(text, file=self.stdout)

    def turn(self, text: str) -> None:
        """Run one logical turn and show the replies."""
        try:
            outcome = self.runtime.run_turn(self.scope, self.session_id, text)
        except TranscriptStoreError as e:
            self.failure(e)
            return
        self.last = outcome
        self.session_id = outcome.session_id
        for m in outcome.messages[1:-1]:
            self.emit("step", {"message": m}, f"  [{m['role']}] {shown(message_text(m))}")
        if outcome.degraded_reason:
            self.emit("degraded", {"reason": outcome.degraded_reason},
                      f"  (this turn ran on {outcome.engine_id}: {shown(outcome.degraded_reason)})")
        data = {
            "turn_id": outcome.turn_id, "session_id": outcome.session_id, "engine_id": outcome.engine_id,
            "degraded_reason": outcome.degraded_reason, "commit_status": outcome.commit_status,
            "attempts": outcome.attempts, "reply": message_text(outcome.reply),
        }
        self.emit("reply", data, f"assistant: {shown(message_text(outcome.reply))}")

    def command(self, line: str) -> bool:
        """Run a slash command; False ends the conversation."""
        # Any whitespace ends the name (`/compact<TAB>focus` was an unknown command "/compact\tfocus").
        name, arg = (*line.split(None, 1), "")[:2]
        if name in ("/quit", "/exit"):
            self.emit("quit", {}, "bye")
            return False
        handlers: dict[str, Callable[[str], None]] = {
            "/compact": self.compact, "/branch": self.branch, "/history": self.history,
            "/engine": self.engine, "/help": lambda _arg: self.emit("help", {"commands": CHAT_HELP}, CHAT_HELP),
        }
        handler = handlers.get(name)
        if handler is None:
            # A typo or a command of another tool: said with the known ones, the conversation going on (at a
            # terminal, the next line can be the right command), and counted as a failed command, so that
            # the run ends with exit 1: a script's unknown command was a warning on stderr only, exit 0.
            self.failure(InvalidInput(f"unknown command {name}; the commands are {CHAT_HELP}"))
            return True
        try:
            handler(arg.strip())
        except TranscriptStoreError as e:
            self.failure(e)
        return True

    def compact(self, focus: str) -> None:
        """/compact [focus]: manual compaction through the selected engine."""
        result = self.runtime.compact(self.scope, self.session_id, focus=focus or None)
        self.session_id = self.runtime.resolve_session(self.scope, self.session_id)
        self.emit("compact", compact_json(result), _compact_line(result))
        if not result.ok:  # a failed compaction, as `compact` counts it (exit 1)
            self.failed += 1

    def branch(self, _arg: str) -> None:
        """/branch: move the head to before the last user message; the next message regenerates."""
        store = self.runtime.store
        visible = store.read_visible(self.scope, self.session_id)
        last_user = next((e for e in reversed(visible) if e.role == "user"), None)
        if last_user is None:
            self.emit("branch", {"moved": False}, "nothing to branch from: no user message yet")
            return
        info = store.branch(self.scope, self.session_id, last_user.parent_id)
        text = message_text(last_user.message or {})
        self.emit("branch", {"moved": True, "before_entry_id": last_user.entry_id, "head_entry_id": info.head_entry_id,
                             "visible_count": info.visible_count},
                  f"branched: the head is back before {text!r}; your next message starts a new branch")

    def history(self, _arg: str) -> None:
        """/history: the visible transcript."""
        entries = self.runtime.store.read_visible(self.scope, self.session_id)
        if self.as_json:
            self.emit("history", {"entries": [entry_json(e) for e in entries]}, None)
        else:
            print_entries(self.out, entries, every=False, title=f"session {self.session_id}")

    def engine(self, _arg: str) -> None:
        """/engine: the selected engine, and what the last turn ran on."""
        s = self.runtime.settings
        last = self.last
        data = {
            "selected": s.engine, "source": s.engine_source,
            "last_turn_engine": last.engine_id if last else None,
            "last_turn_degraded_reason": last.degraded_reason if last else None,
            "quarantined": {k: {"operation": op, "reason": why} for k, (op, why) in self.runtime.quarantined.items()},
        }
        text = f"engine: {s.engine} (from {s.engine_source})"
        if last is not None:
            text += f"; last turn ran on {last.engine_id}"
            # An engine's error text, as outbox status and doctor show it: read, not obeyed.
            text += f" (degraded: {shown(last.degraded_reason)})" if last.degraded_reason else " (not degraded)"
        if self.runtime.quarantined:
            text += "; quarantined: " + ", ".join(sorted(self.runtime.quarantined))
        self.emit("engine", data, text)
