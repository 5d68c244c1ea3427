"""``python -m bench`` (``make bench``)."""

from .cli import main

raise SystemExit(main())
