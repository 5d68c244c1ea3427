"""The benchmarks run: `python -m bench --quick` on one cheap benchmark exits 0 and prints its table.

Not a timing assertion: a benchmark never fails on speed. This only keeps `make bench` from rotting.
"""

from __future__ import annotations

import json
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
