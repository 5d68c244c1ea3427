"""The benchmarks run: `python -m bench --quick` on one cheap benchmark exits 0 and prints its table.

Not a timing assertion: a benchmark never fails on speed. This only keeps `make bench` from rotting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_commit_turn_benchmark_prints_a_table(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "commit_turn", "--backend", "sqlite",
         "--results", str(tmp_path), "--tmpdir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| figure | ours | raw | ratio | target | met? |" in proc.stdout
    assert "commit_turn [sqlite-full]: turns/s" in proc.stdout
    assert "commit_turn [sqlite-normal]: turns/s" in proc.stdout
    lines = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert lines[0]["type"] == "run" and lines[0]["machine"]["nproc"] >= 1
    figures = [line for line in lines if line["type"] == "figure"]
    assert {f["bench"] for f in figures} == {"commit_turn"}
    assert all(f["ours"] > 0 and f["raw"] > 0 for f in figures)


def test_an_unreachable_benchmark_server_is_named_without_its_password(tmp_path: Path) -> None:
    """The banner printed BENCH_PG as given, password and all (the CLI masks it everywhere else)."""
    for dsn in ("postgresql://postgres:s3cretpw@127.0.0.1:1/postgres", "host=127.0.0.1 port=1 password=s3cretpw"):
        proc = subprocess.run(
            [sys.executable, "-m", "bench", "--quick", "--only", "commit_turn", "--backend", "postgresql",
             "--results", str(tmp_path)],
            cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "BENCH_PG": dsn},
        )
        assert "ITS FIGURES ARE SKIPPED" in proc.stderr + proc.stdout, proc.stderr[-2000:]
        assert "s3cretpw" not in proc.stderr + proc.stdout and "***" in proc.stderr + proc.stdout


def test_a_missing_tmpdir_is_a_usage_error(tmp_path: Path) -> None:
    """A folder that does not exist gave a traceback (FileNotFoundError) after the run had started."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--tmpdir", str(tmp_path / "missing"), "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "--tmpdir" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
