"""Benchmarks of transcript-store, every figure a ratio to a raw-driver baseline measured in the same run.

See bench/README.md for the method; ``python -m bench --help`` for the options.
"""
