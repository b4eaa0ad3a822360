"""Eval results: a JSON file, a printed table, and an MLflow run linked to the pretraining run.

The MLflow run is tagged `pretrain_run_id` with the pretraining run's id (the run an MLflow URI
resolved to, RUN_DIR/mlflow_run_id, or backbone.json's `mlflow_run_id` when the exporter put it
there) and, when that run is in the same tracking store, created as its child
(mlflow.parentRunId), so the UI lists evals under the run they judge, unless `nest_under`
(an eval's --parent-run-id) names another parent run.
A tracking failure is a warning, never fatal: the numbers are already in the JSON.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from ssl_vit.io import atomic_write_text
from ssl_vit.tracking import PARENT_TAG

log = logging.getLogger(__name__)

EVAL_EXPERIMENT = "ssl-vit-evals"


def write_results(path: str | os.PathLike, results: dict[str, Any]) -> Path:
    """Write results as indented JSON, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(results, indent=2, sort_keys=False, default=str) + "\n")
    return path


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The scalar numbers of a metrics dict (lists, strings and bools left out)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def format_table(title: str, metrics: dict[str, Any]) -> str:
    """A two-column text table of the scalar metrics; accuracies shown in percent."""
    rows = numeric_metrics(metrics)
    width = max((len(k) for k in rows), default=6)
    lines = [title, "-" * (width + 14)]
    for k, v in rows.items():
        if any(t in k for t in ("top1", "top5", "recall", "map@r", "shot_")):  # a rate
            shown = f"{100 * v:9.2f} %"
        elif float(v).is_integer() and abs(v) < 1e12:  # counts: 60000, not 6e+04
            shown = f"{int(v):11d}"
        else:
            shown = f"{v:11.4g}"
        lines.append(f"{k:<{width}}  {shown}")
    return "\n".join(lines)


def pretrain_run_id(backbone_path: str | os.PathLike | None, meta: dict | None) -> str | None:
    """The MLflow run id of the pretraining run that produced this backbone, if known."""
    if backbone_path:
        p = Path(backbone_path)
        for cand in (p / "mlflow_run_id", p.parent / "mlflow_run_id"):  # run dir, or its export/
            if cand.is_file():
                if text := cand.read_text(encoding="utf-8").strip():
                    return text
    if meta and isinstance(meta.get("mlflow_run_id"), str):
        return meta["mlflow_run_id"]
    return None


def log_to_mlflow(
    eval_name: str,
    metrics: dict[str, Any],
    params: dict[str, Any],
    *,
    parent_run_id: str | None = None,
    results_path: str | os.PathLike | None = None,
    tracking_uri: str | None = None,
    artifacts: tuple[str | os.PathLike, ...] = (),
    nest_under: str | None = None,
) -> str | None:
    """Log one eval as an MLflow run through the trainer's `Tracker` (one MLflow path: same
    default store, param handling, and a local record sent once a down store is back); returns
    its id, or None if the store could not be reached. `artifacts`: files logged beside the
    results (plots); `nest_under`: the parent run (default: the pretraining run)."""
    from ssl_vit.tracking import Tracker

    tags = {"ssl_vit.eval": eval_name}
    if parent_run_id:
        tags["pretrain_run_id"] = parent_run_id
    # A parent that is not in this store is dropped (a warning): the lineage tag stays.
    if nest_under := nest_under or parent_run_id:
        tags[PARENT_TAG] = nest_under
    spool = Path(results_path).parent if results_path else Path(".")
    try:
        with Tracker(
            enabled=True,
            experiment=EVAL_EXPERIMENT,
            run_name=eval_name,
            tags=tags,
            tracking_uri=tracking_uri,
            spool_dir=spool / "mlflow_spool",
            system_metrics=False,
        ) as tracker:
            tracker.log_params(params)
            tracker.log_metrics({_metric_key(k): v for k, v in numeric_metrics(metrics).items()}, 0)
            for path in (results_path, *artifacts):
                if path is not None:
                    tracker.log_artifact(path)
        return tracker.run_id
    except Exception as e:  # tracking must never lose an eval's result
        print(f"warning: MLflow logging failed ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def _metric_key(k: str) -> str:
    """MLflow keys allow alphanumerics, _ - . / and space; '@' and '=' are not allowed."""
    return k.replace("@", "_at_").replace("=", "")
