"""The MLflow side: a client per store, and `Store.sync`, which brings a run up to date with a
Tracker's local record.

A record is a JSONL file: its first line names the run (store, experiment, name, id, tags, and
the metrics file, if any, that holds its metric rows), then one event a line: `params`, `tags`,
`artifact`, `end`, and `metrics` when there is no metrics file. A metrics file is the trainer's
RUN/metrics.jsonl: `{"step": S, "key": value, ...}` a line.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("ssl_vit.tracking")
DEFAULT_URI = "sqlite:///mlflow.db"
PARENT_TAG = "mlflow.parentRunId"
# Error codes of a request the store refuses (a changed param value): retrying cannot help.
REFUSED = {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE", "BAD_REQUEST"}


def resolve_uri(uri: str | None) -> str:
    """The tracking store: `uri`, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def open_client(uri: str) -> Any:
    """An MlflowClient on `uri`. A new SQLite store is created and migrated by the first client,
    and processes doing that at once race on its tables ("table ... already exists"), so a
    SQLite client is made under an exclusive lock named by the database's path. The lock is a
    separate file: closing any descriptor of a SQLite file drops the process's locks on it."""
    from mlflow.tracking import MlflowClient

    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    digest = hashlib.sha256(str(Path(uri[10:]).resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"ssl-vit-mlflow-{digest}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
        return MlflowClient(uri)


def read_record(path: Path) -> tuple[dict, list[dict]]:
    """(first line, events) of a record; a line cut by a crash mid-write is skipped."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s: a line that is not JSON skipped", path)
    if not lines or "experiment" not in lines[0]:
        raise ValueError(f"{path}: no run on its first line; not an ssl-vit tracking record")
    for ev in lines:  # the id of a run created after the record began
        lines[0]["run_id"] = ev.get("run_id", lines[0]["run_id"])
    return lines[0], lines[1:]


def file_rows(path: Path, now: int) -> list[list]:
    """[key, value, time, step] of every number in a metrics file ({"step": S, ...} lines)."""
    rows = []
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                rows.append([k, float(v), now, int(row["step"])])
    return rows


class Store:
    """One tracking store: find or create a run, and sync a record into it."""

    def __init__(self, uri: str) -> None:
        self.uri, self.client = uri, open_client(uri)

    def reachable(self) -> bool:
        try:
            self.client.search_experiments(max_results=1)
            return True
        except Exception:
            return False

    def run(self, head: dict) -> Any:
        """The record's run; created (in its parent's experiment, for the UI) when it has none."""
        from mlflow.exceptions import MlflowException

        if head.get("run_id"):
            try:
                return self.client.get_run(head["run_id"])
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                log.warning("run %s not in %s; starting a new run", head["run_id"], self.uri)
        tags, exp_id = dict(head.get("tags") or {}), None
        if tags.get(PARENT_TAG):
            try:
                exp_id = self.client.get_run(tags[PARENT_TAG]).info.experiment_id
            except MlflowException:
                log.warning("parent run %s not in %s; not nesting", tags.pop(PARENT_TAG), self.uri)
        if exp_id is None:
            exp = self.client.get_experiment_by_name(head["experiment"])
            exp_id = exp.experiment_id if exp else self.client.create_experiment(head["experiment"])
        return self.client.create_run(exp_id, run_name=head.get("run_name"), tags=tags)

    def sync(
        self, path: Path, run_id: str | None = None, *, upto: float = math.inf, full: bool = True
    ) -> str:
        """Log what record `path` holds and run `run_id` lacks: params and tags (a refused one
        goes to rejected.jsonl beside the record), the metric points at steps <= `upto` that
        MLflow's history of their key does not have, the artifacts, and the end status. With
        `full=False`, only the artifacts and the end (the rest reached the store already)."""
        from mlflow.entities import Metric, Param, RunTag

        head, events = read_record(path)
        if run_id is None and (run_id := self.run(head).info.run_id) != head["run_id"]:
            with open(path, "a", encoding="utf-8") as f:  # a second replay finds this run
                f.write(json.dumps({"run_id": run_id}) + "\n")
        rows = []
        if full and head.get("metrics_file"):
            rows = file_rows(Path(head["metrics_file"]), int(time.time() * 1000))
        for ev in events:
            if full and ("params" in ev or "tags" in ev):
                params = [Param(k, v) for k, v in ev.get("params", {}).items()]
                tags = [RunTag(k, v) for k, v in ev.get("tags", {}).items()]
                try:
                    self.client.log_batch(run_id, params=params, tags=tags)
                except Exception as e:
                    if not refused(e):
                        raise
                    reject(ev, e, path.parent)
            elif full and "metrics" in ev:
                rows += ev["metrics"]
            elif "artifact" in ev:
                self.upload(run_id, Path(ev["artifact"]), ev.get("artifact_path"))
            elif "end" in ev:
                self.client.set_terminated(run_id, ev["end"], end_time=ev["time"])
        have = {
            k: {m.step for m in self.client.get_metric_history(run_id, k)}
            for k in {r[0] for r in rows if r[3] <= upto}
        }
        new = []
        for key, value, ms, step in rows:
            if step <= upto and step not in have[key]:
                have[key].add(step)
                new.append(Metric(key, value, ms, step))
        self.client.log_batch(run_id, metrics=new)  # split into allowed batch sizes by MLflow
        return run_id

    def upload(self, run_id: str, path: Path, artifact_path: str | None) -> None:
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        elif path.is_file():
            self.client.log_artifact(run_id, str(path), artifact_path)
        else:
            log.warning("artifact %s no longer exists; not logged", path)


def refused(e: Exception) -> bool:
    """A request the store refuses (retrying cannot help), not an outage."""
    return getattr(e, "error_code", None) in REFUSED


def reject(ev: dict, err: Exception, folder: Path) -> None:
    log.warning("MLflow refused %s (%s); kept in %s", list(ev), str(err)[:300], folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "rejected.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({**ev, "error": str(err)[:500]}) + "\n")
