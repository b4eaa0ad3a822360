"""The study in the MLflow UI: one parent run per method, every step of it a nested child run.

study.py asks `parent_env` for each step's environment (the step's own MLflow run then nests
under its method's parent, see `ssl_vit.tracking.nesting`) and calls `log_step` after a step
succeeds, which copies the step's headline numbers onto the parent, so selecting the parents in
`mlflow ui` and pressing Compare puts MPP, supervised and from-scratch side by side.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ssl_vit.tracking.nesting import PARENT_ENV, ParentRuns

EXPERIMENT = "ssl-vit-study"
PARENTS_FILE = "mlflow_parents.json"  # in the study folder: method -> parent run id
HEADLINE = {  # step kind -> (key in its output JSON, metric name on the parent)
    "probe": [("probe_top1", "probe_top1")],
    "knn": [("knn_top1@k=20", "knn_top1_k20")],
    "fewshot": [(f"fewshot_{n}shot_mean", f"fewshot_{n}shot") for n in (1, 5, 10, 25)],
}


def method_of(step_name: str) -> str:
    """mpp, mpp_e2/probe, ft_mpp_s1, inspect_mpp -> mpp; scratch_s0, ft_scratch -> scratch."""
    top = step_name.split("/")[0]
    for prefix in ("ft_", "inspect_"):
        top = top.removeprefix(prefix)
    return re.sub(r"_[es]\d+$", "", top)


def parents(study: Path, root: Path) -> ParentRuns:
    """The study's parent runs, in the store the steps log to (run from `root`)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"
    return ParentRuns(study / PARENTS_FILE, EXPERIMENT, tracking_uri=uri)


def parent_env(runs: ParentRuns, step_name: str) -> dict[str, str]:
    """The environment for a step: ours plus its method's parent run id (when the store is up)."""
    env = dict(os.environ)
    rid = runs.run_id(method_of(step_name), tags={"ssl_vit.study": EXPERIMENT})
    if rid:
        env[PARENT_ENV] = rid
    return env


def log_step(runs: ParentRuns, step_name: str, output: Path) -> None:
    """Copy a finished step's headline numbers onto its method's parent run."""
    if not output.is_file() or output.suffix != ".json":
        return
    res = json.loads(output.read_text())
    kind = step_name.split("/")[1] if "/" in step_name else ""
    metrics = {}
    for key, name in HEADLINE.get(kind, []):
        if key in res.get("metrics", {}):
            metrics[name] = res["metrics"][key]
    if res.get("selected_top1") is not None:  # a training run's results.json
        metrics["finetune_top1"] = res["selected_top1"]
    runs.log_metrics(method_of(step_name), metrics)


def report_lines(study: Path) -> list[str]:
    """RESULTS.md's section linking each method's parent run to its page in `mlflow ui`."""
    from ssl_vit.tracking.nesting import run_link

    path = study / PARENTS_FILE
    parents = json.loads(path.read_text()) if path.is_file() else {}
    if not parents:
        return []
    uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    lines = ["", "## In MLflow", "",
             f"Each method is a parent run in experiment `{EXPERIMENT}` with its pretraining, "
             "evaluations and fine-tuning nested under it, and its headline numbers logged on "
             f"it: `mlflow ui --backend-store-uri {uri}`, select the parents, Compare. These are "
             "the parents in the store of the machine that last ran the study (stores stay on "
             "their machine); every step's own run id is in the step table below.", "",
             "| method | parent run |", "|---|---|"]  # fmt: skip
    for method, p in parents.items():
        link = run_link(uri, p["experiment_id"], p["run_id"])
        lines.append(f"| {method} | [{p['run_id']}]({link}) |")
    return lines
