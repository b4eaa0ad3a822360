"""The study's committed results (results/<step>.json beside this file), read by step name:
the numbers, where each training or evaluation started from (provenance), on which code and
machine, and the few ways RESULTS.md writes a number."""

from __future__ import annotations

import json
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studies.mpp_fashion_mnist.run import start_of
from studies.mpp_fashion_mnist.stats import welch

SHOTS = (1, 5, 10, 25)
KNN, PROBE = "knn_top1@k=20", "probe_top1"


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
    return "-" if x is None else f"{100 * x:.1f}"


def fewshot(r: Results, evals: str) -> str:
    out = r.output(f"{evals}/fewshot")
    if out is None:
        return "-"
    m = out["metrics"]
    return " / ".join(f"{100 * m[f'fewshot_{n}shot_mean']:.1f}" for n in SHOTS)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def arm_scores(r: Results, steps: list[str]) -> list[float]:
    """The selected test top-1 of `steps`, of those with a result a table may show (`shown`)."""
    return [v for v in (r.selected(s) for s in steps if shown(r, s)) if v is not None]


def mean_std_text(scores: list[float]) -> str:
    """'85.65 ± 0.56 (n=3)' in percent ('75.73 (n=1)': one seed has no spread), or 'pending'."""
    if not scores:
        return "pending"
    mean, std = mean_std(scores)
    spread = f" ± {100 * std:.2f}" if len(scores) > 1 else ""
    return f"{100 * mean:.2f}{spread} (n={len(scores)})"


def sweep_choice(r: Results, sweep: str) -> str:
    """The value a sweep chose ("0.03"), or "pending"."""
    out = r.output(sweep)
    return "pending" if out is None else str(out["chosen"][out["sweep"]["key"]])


def sweep_text(r: Results, sweep: str) -> str:
    """A sweep's chosen value and each value's held-out top-1: "0.03 (held-out top-1 ...)"."""
    out = r.output(sweep)
    if out is None:
        return "pending"
    held = ", ".join(
        f"{run['value']}: {100 * run['selection_best_top1']:.2f}" for run in out["runs"]
    )
    return f"{sweep_choice(r, sweep)} (held-out top-1 {held})"


def readout_label(r: Results, evals: str) -> str:
    """The read-out an eval's `--layer auto` chose ('tokens@block4'), from its kNN result."""
    out = r.output(f"{evals}/knn")
    sel = None if out is None else out.get("readout_selection")
    return "pending" if sel is None else sel["name"]


@dataclass(frozen=True)
class Start:
    """The weights a fine-tune or frozen evaluation started from, as its result records them:
    the pretraining's run directory name (and snapshot), the MLflow run that wrote the weights
    and their sha256; None where the result does not record it."""

    pretraining: str
    run_id: str | None
    sha256: str | None

    def text(self) -> str:
        parts = [f"run {self.run_id[:8]}"] if self.run_id else []
        sha = (self.sha256 or "").removeprefix("sha256:")[:12]
        parts.append(f"sha256 {sha}" if sha else "weights not recorded")
        return f"{self.pretraining} ({'; '.join(parts)})"


def _pretraining_name(path: str) -> str:
    """runs/study/mpp -> mpp; runs/study/mpp/export_epoch6 -> mpp, epoch 6."""
    parts = Path(path).parts
    name = parts[2] if len(parts) > 2 and parts[:2] == ("runs", "study") else path
    snap = parts[3] if len(parts) > 3 else ""
    if snap.startswith("export_epoch"):
        return f"{name}, epoch {snap.removeprefix('export_epoch')}"
    return name


def start(r: Results, step: str) -> Start | None:
    """Where `step` started from (None: from scratch, a random init or raw pixels). Results
    written since the runner records `started_from` carry it; older ones: a frozen evaluation's
    own backbone_id and pretrain_run_id, a fine-tune's rebuilt pretraining run, or nothing."""
    res = r.get(step)
    if res is None:
        return None
    recorded = res.get("started_from")
    src = recorded["path"] if recorded else start_of(shlex.split(res["command"])[1:])
    if src is None:
        return None
    name = _pretraining_name(src)
    if recorded:
        return Start(name, recorded.get("mlflow_run_id"), recorded.get("sha256"))
    out = res.get("result") or {}
    ident = (out.get("params") or {}).get("backbone_id") or ""
    if ident.startswith("sha256:"):
        return Start(name, out.get("pretrain_run_id"), ident)
    rebuilt = (res.get("rebuilt_needs") or {}).get(name.split(",")[0])
    if rebuilt:
        return Start(f"{name} (rebuilt)", rebuilt.get("mlflow_run_id"), None)
    return Start(name, None, None)


def one_start(label: str, starts: list[Start | None]) -> Start | None:
    """The one pretraining behind a row; a clear error where its results started from
    different weights (sha256) or runs: such results belong in separate rows."""
    known = {s for s in starts if s is not None}
    shas = {s.sha256 for s in known if s.sha256}
    if len(shas) > 1 or len(known) > 1:
        got = ", ".join(sorted(s.text() for s in known))
        raise ValueError(f"{label}: its results started from different pretrainings ({got})")
    return next(iter(known), None)


def shown(r: Results, step: str) -> bool:
    """Whether `step` has a result a table may show: one that started from nothing (from
    scratch, a random init, raw pixels) or records the sha256 of the weights it started from.
    A result without it cannot say which pretraining it read, so no row holds it (issue 38)."""
    if r.get(step) is None:
        return False
    st = start(r, step)
    return st is None or st.sha256 is not None


def unrecorded(r: Results, steps: list[str]) -> list[str]:
    """The steps among `steps` whose results do not record the weights they started from."""
    return [s for s in steps if r.get(s) is not None and not shown(r, s)]


def by_start(r: Results, steps: list[str]) -> list[tuple[Start | None, list[str]]]:
    """`steps` grouped by the pretraining they started from, in order of first appearance;
    results that do not record their weights are left out."""
    groups: dict[Start | None, list[str]] = {}
    for step in steps:
        if shown(r, step):
            groups.setdefault(start(r, step), []).append(step)
    return list(groups.items())


def device(machine: str) -> str:
    """A result's machine line, short: its GPU, else its CPU and core count."""
    parts = machine.split("; ")
    if len(parts) > 3 and parts[3] != "no GPU":
        return parts[3]
    return f"CPU: {', '.join(parts[:2])}"


def conditions(r: Results, steps: list[str]) -> str:
    """The code versions (git commit) and machines `steps` ran on: 'code 6e6fa8b, 04c1b65;
    CPU: AMD EPYC, 2 cores'."""
    found = [r.get(s) for s in steps]
    found = [res for res in found if res is not None]
    if not found:
        return "-"
    commits = list(dict.fromkeys((res.get("git_commit") or "not recorded")[:7] for res in found))
    machines = list(dict.fromkeys(device(res["machine"]) for res in found))
    return f"code {', '.join(commits)}; {'; '.join(machines)}"


def welch_text(a: list[float], b: list[float]) -> str:
    """'+1.06 [+0.69, +1.43], p=0.0021' in points, or why there is no test."""
    if len(a) < 2 or len(b) < 2:
        return f"{100 * (statistics.mean(a) - statistics.mean(b)):+.2f} (one seed: no CI)"
    w = welch(a, b)
    return f"{100 * w.diff:+.2f} [{100 * w.low:+.2f}, {100 * w.high:+.2f}], p={w.p:.2g}"
