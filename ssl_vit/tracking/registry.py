"""Register an exported backbone in the MLflow model registry (`tracking.register_as: NAME`).

    version = register_export(tracking_uri, "fmnist-mpp", run_id, tags={"train/loss": "1.93"})
    python -m ssl_vit.tracking register RUN_ID NAME [--tracking-uri URI]   # later, by hand

The version's source is `runs:/RUN_ID/export`, the artifact the trainer logged, so
`models:/NAME/VERSION` resolves to the same files (and cache entry) as the run's URI. Nothing is
registered unless asked. Like the rest of tracking, a failure (server down, no registry) is a
warning naming the command that registers later; the export on disk and in the run is kept.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("ssl_vit.tracking")

HEADLINE = ("loss", "acc", "top1")  # metric keys holding these words become version tags


def headline_metrics(run_dir: Path) -> dict[str, str]:
    """The run's headline numbers: the last metrics.jsonl row's loss/accuracy keys, the step,
    and a classifier's final / best top-1 from results.json."""
    tags: dict[str, str] = {}
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    if lines:
        last: dict[str, Any] = json.loads(lines[-1])
        tags["step"] = str(last.get("step"))
        for k, v in last.items():
            if any(w in k for w in HEADLINE) and isinstance(v, (int, float)) and math.isfinite(v):
                tags[k] = f"{v:.6g}"
    results = run_dir / "results.json"
    if results.is_file():
        res = json.loads(results.read_text())
        for k in ("final_top1", "best_top1", "eval_split"):
            if res.get(k) is not None:
                tags[k] = str(res[k]) if isinstance(res[k], str) else f"{res[k]:.6g}"
    return tags


def register_export(
    tracking_uri: str,
    name: str,
    run_id: str,
    *,
    artifact_path: str = "export",
    tags: dict[str, str] | None = None,
) -> str | None:
    """A new version of `name` from the run's export artifact; its number, or None on failure."""
    try:
        from mlflow.exceptions import MlflowException

        from ssl_vit.tracking.artifacts import client_for

        client = client_for(tracking_uri)
        try:
            client.create_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        if not client.list_artifacts(run_id, artifact_path):
            raise ValueError(f"run {run_id} has no {artifact_path!r} artifact yet")
        mv = client.create_model_version(
            name, f"runs:/{run_id}/{artifact_path}", run_id=run_id, tags=tags or {}
        )
        client.set_tag(run_id, "ssl_vit.registered_as", f"models:/{name}/{mv.version}")
    except Exception as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        log.warning(
            "not registered as %s (%s); the export is kept: once the store is back, run "
            "`python -m ssl_vit.tracking register %s %s --tracking-uri %s`",
            name, first, run_id, name, tracking_uri,
        )  # fmt: skip
        return None
    log.info("registered %s as models:/%s/%s", f"runs:/{run_id}/{artifact_path}", name, mv.version)
    return str(mv.version)
