"""The ``transcript-store`` console script and ``python -m transcript_store``: the CLI's ``main``, a Ctrl-C
while its modules are still imported ending the command as a Ctrl-C anywhere in it does.

Light on purpose (nothing but the standard library until ``main`` runs): the CLI's modules, the store's,
SQLAlchemy, pydantic, click and rich take a second or two to import, and a Ctrl-C then was Python's
KeyboardInterrupt traceback through the import machinery, ended by the signal (it was before any
``except`` of the CLI could catch it). A signal the process was started ignoring (a background job of a
script, ``nohup``) stays ignored: Python raises KeyboardInterrupt only where SIGINT has its handler.
"""

from __future__ import annotations

import sys
from typing import NoReturn

#: a command ended by Ctrl-C (128 + SIGINT, as a shell reports a process that SIGINT ended)
EXIT_INTERRUPTED = 130
INTERRUPTED = "error: interrupted"


def interrupted(line: str = INTERRUPTED) -> NoReturn:
    """End the command after a Ctrl-C: ``line`` on stderr, exit 130 (SystemExit)."""
    try:
        if sys.stderr is not None:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or gone: the exit status says it
        pass
    sys.exit(EXIT_INTERRUPTED)


def main() -> NoReturn:
    """Run the ``transcript-store`` command (``transcript_store.cli.main``), its modules imported here."""
    try:
        from .cli import main as run

        run()
    except KeyboardInterrupt:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process is ending: a second Ctrl-C is no traceback
        interrupted()
