"""``python -m transcript_store``: the same command as the ``transcript-store`` console script."""

from .entry import main

if __name__ == "__main__":
    main()
