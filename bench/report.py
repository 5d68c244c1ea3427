"""Figures: each one ours against its baseline, as a ratio, checked against the issue's target."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Figure:
    """One measured figure: ours, the baseline measured in the same run, their ratio, the target."""

    bench: str
    target: str
    figure: str
    unit: str
    ours: float
    raw: float
    op: str | None = None  # ">=", "<=" or "==" against ``goal``; None: reported, no target
    goal: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """ours / baseline."""
        if self.raw == 0:
            return 1.0 if self.ours == 0 else math.inf
        return self.ours / self.raw

    @property
    def met(self) -> bool | None:
        """Whether the ratio meets the target (None: no target)."""
        if self.op is None or self.goal is None:
            return None
        r = round(self.ratio, 4)
        return {">=": r >= self.goal, "<=": r <= self.goal, "==": abs(r - self.goal) < 1e-9}[self.op]

    def record(self) -> dict[str, Any]:
        """The JSON line of this figure."""
        out = asdict(self)
        out.update(ratio=self.ratio, met=self.met)
        return out


def fmt(value: float, unit: str) -> str:
    """A value with its unit, at a readable precision."""
    if unit == "ms":  # latencies are recorded in milliseconds, as their unit says
        return f"{value:.3f} ms" if value < 10 else f"{value:.2f} ms"
    if unit in ("B", "rows", "statements"):
        return f"{value:,.0f} {unit}" if value >= 100 or value == int(value) else f"{value:.1f} {unit}"
    return f"{value:,.1f} {unit}" if value < 100 else f"{value:,.0f} {unit}"


def table(figures: list[Figure]) -> str:
    """The Markdown table of every figure."""
    lines = ["| figure | ours | raw | ratio | target | met? |", "| --- | ---: | ---: | ---: | :---: | :---: |"]
    for f in figures:
        target = f"{f.op} {f.goal:g}x" if f.op and f.goal is not None else "-"
        met = {True: "yes", False: "**no**", None: "-"}[f.met]
        lines.append(
            f"| {f.bench} [{f.target}]: {f.figure} | {fmt(f.ours, f.unit)} | {fmt(f.raw, f.unit)} "
            f"| {_ratio_text(f)} | {target} | {met} |"
        )
    return "\n".join(lines)


def _ratio_text(f: Figure) -> str:
    """The ratio at two decimals, or at four where two would read as the other verdict (0.7951x is
    not >= 0.8x, though it rounds to 0.80x)."""
    text = f"{f.ratio:.2f}x"
    if f.met is not None and f.op in (">=", "<=") and f.goal is not None:
        shown = round(f.ratio, 2)
        if (shown >= f.goal if f.op == ">=" else shown <= f.goal) != f.met:
            text = f"{f.ratio:.4f}x"
    return text


def write_jsonl(path: Path, header: dict[str, Any], figures: list[Figure]) -> None:
    """One ``run`` line (machine, options), then one line per figure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        out.write(json.dumps({"type": "run", **header}) + "\n")
        for f in figures:
            out.write(json.dumps({"type": "figure", **f.record()}) + "\n")
