"""Group runs under a parent MLflow run: one parent per method of a study, its steps as children.

A job started with $SSL_VIT_PARENT_RUN_ID set (the study sets it for each step it starts)
creates its MLflow run as a child of that run: tagged `mlflow.parentRunId` and placed in the
parent's experiment, which is what the MLflow UI needs to show it nested. The `pretrain_run_id`
tag of an eval keeps the lineage to the pretraining run either way.

    parents = ParentRuns(Path("runs/study/mlflow_parents.json"), experiment="ssl-vit-study")
    env = {**os.environ, PARENT_ENV: parents.run_id("mpp50")}   # created once, then reused
    parents.log_metrics("mpp50", {"probe_top1": 0.81})           # compared across methods in the UI
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from ssl_vit.io import atomic_write_text
from ssl_vit.tracking.store import open_client, resolve_uri

log = logging.getLogger("ssl_vit.tracking")

PARENT_ENV = "SSL_VIT_PARENT_RUN_ID"


def parent_from_env() -> str | None:
    return os.environ.get(PARENT_ENV) or None


def run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI (for a file store: once `mlflow ui` serves it)."""
    base = tracking_uri if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


class ParentRuns:
    """One parent run per name, its ids kept in a JSON file so a rerun reuses them."""

    def __init__(self, path: Path, experiment: str, tracking_uri: str | None = None) -> None:
        self.path, self.experiment = path, experiment
        self.uri = resolve_uri(tracking_uri)
        self.runs: dict[str, dict[str, str]] = (
            json.loads(path.read_text()) if path.is_file() else {}
        )

    def _client(self):
        return open_client(self.uri)

    def run_id(self, name: str, tags: dict[str, str] | None = None) -> str | None:
        """The parent run of `name`, created on first use; None when the store is down."""
        if name in self.runs:
            return self.runs[name]["run_id"]
        try:
            client = self._client()
            exp = client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment)
            run = client.create_run(
                exp_id, run_name=name, tags={"ssl_vit.method": name, **(tags or {})}
            )
        except Exception as e:  # the study goes on without grouping
            log.warning("MLflow store %s: no parent run for %s (%s)", self.uri, name, e)
            return None
        self.runs[name] = {"run_id": run.info.run_id, "experiment_id": exp_id}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.runs, indent=2) + "\n")
        return run.info.run_id

    def log_metrics(self, name: str, metrics: dict[str, float]) -> None:
        """Headline numbers of a finished step on its parent, for the UI's comparison view."""
        if name not in self.runs or not metrics:
            return
        from mlflow.entities import Metric

        try:
            client, rid = self._client(), self.runs[name]["run_id"]
            now = int(time.time() * 1000)
            rows = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
            client.log_batch(rid, metrics=rows)
        except Exception as e:
            log.warning("MLflow store %s: metrics of %s not logged (%s)", self.uri, name, e)

    def log_artifacts(self, name: str, paths: list[Path]) -> None:
        """Files (figures) on the parent run of `name` (best effort, like the metrics)."""
        if name not in self.runs:
            return
        try:
            client, rid = self._client(), self.runs[name]["run_id"]
            for path in paths:
                client.log_artifact(rid, str(path))
        except Exception as e:
            log.warning("MLflow store %s: artifacts of %s not logged (%s)", self.uri, name, e)
