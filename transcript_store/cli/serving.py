"""``serve``: the store and its engines over HTTP."""

from __future__ import annotations

import ipaddress
import logging
import socket

import click

from ..errors import InvalidInput
from ..terminal import show_process_output
from .group import cli
from .hosting import engine_output_on_stderr, refuse_bad_legacy_config, warn_unusable_engines
from .options import EXIT_FAILED, EXIT_USAGE, CommandError, Integer, common, state
from .stores import open_store


def _loopback(sock: socket.socket) -> bool:
    """Whether a listening socket is bound to a loopback address (reachable from this machine only)."""
    address = str(sock.getsockname()[0]).split("%", 1)[0]
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (loopback unless you mean it).")
@click.option("--port", type=Integer(0, 65535), default=8765, show_default=True,
              help="Port; 0 picks a free one (the URL is printed).")
@click.option("--tokens", "tokens_file", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Bearer tokens, one 'TOKEN SCOPE' per line [also env TRANSCRIPT_STORE_TOKENS='tok=scope,...'].")
@click.option("--max-body", type=Integer(min=1024), default=8 * 1024 * 1024, show_default=True,
              help="Largest request body in bytes (413 above).")
@click.option("--body-timeout", type=Integer(1, 3600), default=30, show_default=True, metavar="SECONDS",
              help="A request body that pauses this long gets 408, and its connection is closed; so is a "
              "connection whose request head is not whole this long after it opened or its last response.")
@click.option("--access-log", is_flag=True, help="Log every request.")
@common
def serve(host: str, port: int, tokens_file: str | None, max_body: int, body_timeout: int, access_log: bool) -> None:
    """Serve the store and its engines over HTTP: JSON API, OpenAPI at /openapi.json, one scope per token."""
    from ..service import Service, TokenMap
    from ..service_app import bind, create_app
    from ..service_app import serve as run_server

    try:
        tokens = TokenMap.load(tokens_file)
    except InvalidInput as e:  # a malformed tokens file or TRANSCRIPT_STORE_TOKENS: a usage error
        raise CommandError(str(e), EXIT_USAGE) from None
    if not len(tokens):
        raise CommandError("no tokens: pass --tokens FILE or set TRANSCRIPT_STORE_TOKENS", EXIT_USAGE)
    settings = state().settings()
    refuse_bad_legacy_config(settings)  # as a port in use, it must not leave a new store behind
    # The port first: a port in use must not leave a new store behind (the default is a file here).
    try:
        sock = bind(host, port)
    except OSError as e:
        raise CommandError(f"cannot listen on {host}:{port}: {e.strerror or e}", EXIT_FAILED) from None
    try:
        store = open_store(create=True)
    except BaseException:
        sock.close()
        raise
    service: Service | None = None
    try:
        with engine_output_on_stderr():  # a plugin's import prints there, escaped (it went to stdout as it was)
            service = Service(store, settings)
        # Before the requests that would run its turns on legacy; checked in the service's runtime, an engine
        # that loads is kept for them: the start waits for its factory once, and its first request does not.
        warn_unusable_engines(settings, store, service.runtime)
        app = create_app(service, tokens, max_body_bytes=max_body, body_timeout_seconds=body_timeout)
        if not _loopback(sock):
            # By the address bound, not the host's spelling: 127.0.0.2 and 127.1 are this machine; '' is not.
            click.echo(f"warning: listening on {host or 'every interface'} ({sock.getsockname()[0]}), beyond "
                       "this machine", err=True)
        logging.getLogger("transcript_store").setLevel(logging.INFO)
        # Engines run in this process: their print() and warnings.warn() quote stored text as their log
        # records do (uvicorn logs through the root handler here: log_config=None).
        show_process_output()
        run_server(app, sock, access_log=access_log, head_timeout=body_timeout,
                   announce=lambda url: click.echo(f"transcript-store serve: listening on {url} ({store.url})"))
    finally:
        # Stopped by Ctrl-C, SIGTERM or SIGHUP, serve returns here (exit 0): the engines are disposed of (their
        # maintenance finished) and the store released.
        if service is not None:
            service.close()
        else:
            store.close()
