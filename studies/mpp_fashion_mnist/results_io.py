"""The study's committed results (results/study/<step>.json), read by step name, and the few
ways RESULTS.md writes a number from them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

SHOTS = (1, 5, 10, 25)


class Results:
    """The study's results folder, read by step name."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, step: str) -> dict[str, Any] | None:
        path = self.root / f"{step}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def output(self, step: str) -> dict[str, Any] | None:
        res = self.get(step)
        return None if res is None else res["result"]

    def metric(self, evals: str, kind: str, key: str) -> float | None:
        out = self.output(f"{evals}/{kind}")
        return None if out is None else out["metrics"].get(key)

    def metric_lines(self, step: str) -> list[dict]:
        path = self.root / f"{step}.metrics.jsonl"
        return [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []

    def selected(self, step: str) -> float | None:
        """Test top-1 at the evaluation the held-out split chose (None: not run yet)."""
        out = self.output(step)
        return None if out is None else out.get("selected_top1")


def pct(x: float | None) -> str:
    return "pending" if x is None else f"{100 * x:.1f}"


def fewshot(r: Results, evals: str) -> str:
    out = r.output(f"{evals}/fewshot")
    if out is None:
        return "pending"
    m = out["metrics"]
    return " / ".join(f"{100 * m[f'fewshot_{n}shot_mean']:.1f}" for n in SHOTS)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def arm_scores(r: Results, steps: list[str]) -> list[float]:
    return [v for v in (r.selected(s) for s in steps) if v is not None]


def mean_std_text(scores: list[float]) -> str:
    """'85.65 ± 0.56 (n=3)' in percent ('75.73 (n=1)': one seed has no spread), or 'pending'."""
    if not scores:
        return "pending"
    mean, std = mean_std(scores)
    spread = f" ± {100 * std:.2f}" if len(scores) > 1 else ""
    return f"{100 * mean:.2f}{spread} (n={len(scores)})"


def arm_row(r: Results, label: str, steps: list[str], lr: str) -> str:
    scores = arm_scores(r, steps)
    if not scores:
        return f"| {label} | pending | - | {lr} |"
    each = ", ".join(f"{100 * v:.2f}" for v in scores)
    return f"| {label} | {mean_std_text(scores)} | {each} | {lr} |"


def sweep_choice(r: Results, sweep: str) -> str:
    """The value a sweep chose ("0.03"), or "pending"."""
    out = r.output(sweep)
    return "pending" if out is None else str(out["chosen"][out["sweep"]["key"]])


def sweep_text(r: Results, sweep: str) -> str:
    """A sweep's chosen value and each value's held-out top-1: "0.03 (held-out top-1 ...)"."""
    out = r.output(sweep)
    if out is None:
        return "pending"
    held = ", ".join(f"{run['value']}: {100 * run['selection_best_top1']:.2f}"
                     for run in out["runs"])  # fmt: skip
    return f"{sweep_choice(r, sweep)} (held-out top-1 {held})"


def readout_label(r: Results, evals: str) -> str:
    """The read-out an eval's `--layer auto` chose ('tokens@block4'), from its kNN result."""
    out = r.output(f"{evals}/knn")
    sel = None if out is None else out.get("readout_selection")
    return "pending" if sel is None else sel["name"]
