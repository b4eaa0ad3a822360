"""The MLflow side of tracking: find or create the run, send events, tell outage from rejection.

`Store.send` dedupes metrics per key by step against what the run already holds;
`send_or_raise` turns an outage into `Unreachable` (spool and retry) and a rejection
(retrying cannot help) into a line in the spool's `rejected.jsonl`.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("ssl_vit.tracking")
MAX_METRICS = 1000  # per log_batch
DEFAULT_URI = "sqlite:///mlflow.db"
PARENT_TAG = "mlflow.parentRunId"


def resolve_uri(uri: str | None) -> str:
    """The tracking store: `uri`, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` store (relative to the working directory), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///")).expanduser().resolve()


def open_client(uri: str) -> Any:
    """An MlflowClient on `uri`. A SQLite store is opened under an exclusive lock (a file in the
    temporary directory, named by the database's path): creating the client creates and
    migrates a new database, and processes doing that at once race on its tables; measured
    with 4 processes on one fresh file, 3 failed ("table ... already exists", "duplicate column
    name") and one left a half-migrated schema. The lock file is not the database itself:
    closing any descriptor of a SQLite file drops that process's SQLite locks on it."""
    from mlflow.tracking import MlflowClient

    path = sqlite_path(uri)
    if path is None:
        return MlflowClient(uri)
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    lock = Path(tempfile.gettempdir()) / f"ssl-vit-mlflow-{digest}.lock"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
        return MlflowClient(uri)


def parent_experiment(client: Any, parent: str) -> str | None:
    """The parent run's experiment id, or None (with a warning) when the store lacks it."""
    try:
        return client.get_run(parent).info.experiment_id
    except Exception as e:
        log.warning("parent run %s not found (%s); not nesting", parent, str(e)[:200])
        return None


MAX_PARAMS = 100  # per log_batch


class Unreachable(Exception):
    pass


class Store:
    """The MLflow side: find or create the run, send events with per-key step dedupe."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.client = open_client(uri)
        self.last: dict[str, int] = {}
        self.start_time: float | None = None

    def reachable(self) -> bool:
        try:
            self.client.search_experiments(max_results=1)
            return True
        except Exception:
            return False

    def connect(self, header: dict) -> str:
        """Get (or create) the run; read the last stored step per metric key."""
        from mlflow.exceptions import MlflowException

        run = None
        if header.get("run_id"):
            try:
                run = self.client.get_run(header["run_id"])
            except MlflowException as e:
                if not self.reachable():
                    raise
                log.warning(
                    "run %s not in %s (%s); starting a new run", header["run_id"], self.uri, e
                )
        if run is None:
            tags = dict(header.get("tags") or {})
            exp_id = None
            if tags.get(PARENT_TAG):  # a child lives in its parent's experiment (UI nesting)
                exp_id = parent_experiment(self.client, tags[PARENT_TAG])
                if exp_id is None:
                    tags.pop(PARENT_TAG)
            if exp_id is None:
                name = header["experiment"]
                exp = self.client.get_experiment_by_name(name)
                exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
            run = self.client.create_run(exp_id, run_name=header.get("run_name"), tags=tags)
        elif run.info.status != "RUNNING":
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.last = {m.key: m.step for m in run.data._metric_objs}  # latest step per key
        self.start_time = run.info.start_time / 1000
        return run.info.run_id

    def send(self, run_id: str, ev: dict) -> None:
        from mlflow.entities import Metric, Param, RunTag

        kind = ev["type"]
        if kind == "metrics":
            fresh = [m for m in ev["metrics"] if m[3] > self.last.get(m[0], -(2**62))]
            for i in range(0, len(fresh), MAX_METRICS):
                chunk = fresh[i : i + MAX_METRICS]
                self.client.log_batch(run_id, metrics=[Metric(*m) for m in chunk])
                for key, _, _, step in chunk:
                    self.last[key] = max(step, self.last.get(key, step))
        elif kind in ("params", "tags"):
            items = list(ev["items"].items())
            for i in range(0, len(items), MAX_PARAMS):
                chunk = items[i : i + MAX_PARAMS]
                if kind == "params":
                    self.client.log_batch(run_id, params=[Param(k, v) for k, v in chunk])
                else:
                    self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in chunk])
        elif kind == "artifact":
            path = Path(ev["path"])
            if path.is_dir():
                self.client.log_artifacts(run_id, str(path), ev.get("artifact_path"))
            elif path.is_file():
                self.client.log_artifact(run_id, str(path), ev.get("artifact_path"))
            else:
                log.warning("artifact %s no longer exists; not logged", path)
        elif kind == "end":
            self.client.set_terminated(run_id, ev["status"], end_time=ev.get("time"))


# Error codes meaning "the store refuses this event" (retrying cannot help). Anything else
# (connection refused, timeout, 5xx, a locked SQLite file) counts as an outage: spool and retry.
_REJECTED = {
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS",
    "INVALID_STATE", "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED",
}  # fmt: skip


def send_or_raise(
    store: Store, run_id: str, ev: dict, reject: Callable[[dict, Exception], None]
) -> None:
    """Send; an outage raises Unreachable, a rejection goes to `reject` (the spool's
    rejected.jsonl)."""
    from mlflow.exceptions import MlflowException

    try:
        store.send(run_id, ev)
    except Exception as e:
        if isinstance(e, MlflowException) and e.error_code in _REJECTED and store.reachable():
            reject(ev, e)
        else:
            raise Unreachable(f"{type(e).__name__}: {str(e)[:300]}") from None
