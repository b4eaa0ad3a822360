"""The MLflow side of tracking: a client per store, `Store.sync`, which logs into a run what a
Tracker's local record holds and the run lacks, and `register_export`, a run's export made a
registered model version.

A record is a JSONL file: first the run (store, experiment, name, id, key, tags, when the record
began, the file to write the run's id to, and the metrics file, e.g. RUN/metrics.jsonl with a
`{"step": S, "key": value, ...}` line per logged step, that holds its training metrics), then
`params`, `tags`, `artifact`, `end`, `run_id` and `metrics` events (the points no metrics file
holds: evaluations, or all of a Tracker without one), one a line.

A run key names a run before MLflow has given it an id (a run directory's launches all carry
its key): the run is created tagged with it, and a record that knows the key but not the id
finds its run by that tag, so launches and replays that never reached the store together still
make one run, never two.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from ssl_vit.io import atomic_write_text

log = logging.getLogger("ssl_vit.tracking")
DEFAULT_URI = "sqlite:///mlflow.db"
PARENT_TAG = "mlflow.parentRunId"
KEY_TAG = "ssl_vit.run_key"  # the run key (module docstring) of a run made for a record
# A key is put into an MLflow search filter as it is: letters, digits, - and _ only.
KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
REJECTED = "rejected.jsonl"  # batches the store refused, beside the records (not one)
# Error codes of a request the store refuses (a changed param value): retrying cannot help.
REFUSED = {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE", "BAD_REQUEST"}


def resolve_uri(uri: str | None) -> str:
    """The tracking store: `uri`, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db."""
    # Not mlflow.get_tracking_uri(): its default depends on the MLflow version (./mlruns in
    # older ones), and a run must land in the store the docs name whatever MLflow is installed.
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def open_client(uri: str) -> Any:
    """An MlflowClient on `uri`. The first client of a new SQLite store creates its tables, and
    processes doing that at once fail ("table ... already exists"), so a SQLite client is made
    under an exclusive lock named by the database's path: a separate file, since closing any
    descriptor of a SQLite file drops the process's SQLite locks on it."""
    from mlflow.tracking import MlflowClient

    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    digest = hashlib.sha256(str(Path(uri[10:]).resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"ssl-vit-mlflow-{digest}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
        return MlflowClient(uri)


def client_for(store: str) -> Any:
    """An MlflowClient that gives up on a dead server within seconds, not minutes of retries."""
    if store.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    return open_client(store)


def register_export(
    tracking_uri: str,
    name: str,
    run_id: str,
    *,
    artifact_path: str = "export",
    tags: dict[str, str] | None = None,
) -> str | None:
    """A new version of registered model `name` (created if new) from the run's export artifact,
    so `models:/NAME/VERSION` resolves to the same files; its number, or None with a warning
    naming the command that registers it later (server down, no registry)."""
    from mlflow.exceptions import MlflowException

    try:
        client = client_for(tracking_uri)
        try:
            client.create_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        if not client.list_artifacts(run_id, artifact_path):
            raise ValueError(f"run {run_id} has no {artifact_path!r} artifact yet")
        source = f"runs:/{run_id}/{artifact_path}"
        version = client.create_model_version(name, source, run_id=run_id, tags=tags or {}).version
        client.set_tag(run_id, "ssl_vit.registered_as", f"models:/{name}/{version}")
    except Exception as e:
        log.warning(
            "not registered as %s (%s); the export is kept: once the store is back, run "
            "`python -m ssl_vit.tracking register %s %s --tracking-uri %s`",
            name,
            (str(e).splitlines() or [type(e).__name__])[0][:200],
            run_id,
            name,
            tracking_uri,
        )
        return None
    log.info("registered %s as models:/%s/%s", source, name, version)
    return str(version)


def _lines(path: Path, size: int | None = None) -> list[dict]:
    out, text = [], path.read_bytes()[:size].decode(errors="replace") if path.is_file() else ""
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by a crash mid-write
            out.append(json.loads(line))
    return out


def read_record(path: Path, size: int | None = None) -> tuple[dict, list[dict]]:
    """(the run, the events) of a record, or of its first `size` bytes."""
    lines = _lines(path, size)
    if not lines or "experiment" not in lines[0]:
        raise ValueError(f"{path}: no run on its first line; not a record of ssl_vit.tracking")
    for ev in lines:  # the id of a run created after the record began
        lines[0]["run_id"] = ev.get("run_id", lines[0]["run_id"])
    return lines[0], lines[1:]


def records(folder: Path) -> list[Path]:
    """The records in `folder`, oldest first: in the order their Trackers began, i.e. the order
    of a run's launches, so that a replay leaves the run the last launch's tags and status."""

    def begun(path: Path) -> float:
        try:
            with open(path, encoding="utf-8") as f:
                return float(json.loads(f.readline()).get("begun") or path.stat().st_mtime * 1000)
        except (OSError, ValueError, AttributeError):  # a record cut short: sync reports it
            return 0.0

    paths = [p for p in folder.glob("*.jsonl") if p.name != REJECTED]
    return sorted(paths, key=lambda p: (begun(p), p.name))


def remember_run(head: dict, run_id: str) -> None:
    """Write `run_id` to the record's `run_id_file` (e.g. RUN/mlflow_run_id), where the next
    launch of the run looks for it, unless the file holds it already; a folder that is not
    there (a replay on another machine) is left alone."""
    path = Path(head["run_id_file"]) if head.get("run_id_file") else None
    try:
        if path is None or not path.parent.is_dir():
            return
        if not path.is_file() or path.read_text(encoding="utf-8").strip() != run_id:
            atomic_write_text(path, run_id + "\n")
    except OSError as e:
        log.warning("could not write MLflow run id %s to %s: %s", run_id, path, e)


def batch(ev: dict) -> dict[str, list]:
    """log_batch's arguments for a params, tags or metrics event."""
    from mlflow.entities import Metric, Param, RunTag

    return {
        "params": [Param(*p) for p in ev.get("params", {}).items()],
        "tags": [RunTag(*t) for t in ev.get("tags", {}).items()],
        "metrics": [Metric(*m) for m in ev.get("metrics", [])],
    }


class Store:
    """One tracking store: a run for a record, and the sync of a record into its run."""

    def __init__(self, uri: str) -> None:
        self.uri, self.client = uri, open_client(uri)

    def reachable(self) -> bool:
        try:
            self.client.search_experiments(max_results=1)
            return True
        except Exception:
            return False

    def run(self, head: dict) -> Any:
        """The record's run, set RUNNING: the run of its id; else the run tagged with its key
        (made by an earlier launch or a replay of the same run, its id never learned here);
        else a new run, tagged with the key, in its parent's experiment (where the MLflow UI
        shows it nested) when it has a parent."""
        from mlflow.exceptions import MlflowException

        key = head.get("run_key")
        if head.get("run_id"):
            try:
                run = self.client.get_run(head["run_id"])
                if key and KEY_TAG not in run.data.tags:  # a run older than run keys
                    self.client.set_tag(run.info.run_id, KEY_TAG, key)
                return self._running(run)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                log.warning("run %s is not in %s; starting a new run", head["run_id"], self.uri)
        tags, exp = dict(head["tags"]), None
        with contextlib.suppress(MlflowException):
            exp = tags.get(PARENT_TAG) and self.client.get_run(tags[PARENT_TAG]).info.experiment_id
        if tags.get(PARENT_TAG) and not exp:
            log.warning("parent run %s is not in %s; not nested", tags.pop(PARENT_TAG), self.uri)
        if not exp:
            exp = self.client.get_experiment_by_name(head["experiment"])
            exp = exp.experiment_id if exp else self.client.create_experiment(head["experiment"])
        if key:
            if not KEY_PATTERN.fullmatch(key):
                raise ValueError(f"run key {key!r}: use letters, digits, - and _ only")
            found = self.client.search_runs(
                [exp],
                f"tags.`{KEY_TAG}` = '{key}'",
                max_results=1,
                order_by=["attributes.start_time ASC"],  # were there two, the first
            )
            if found:
                return self._running(found[0])
            tags[KEY_TAG] = key
        return self.client.create_run(exp, run_name=head.get("run_name"), tags=tags)

    def _running(self, run: Any) -> Any:
        if run.info.status != "RUNNING":
            self.client.update_run(run.info.run_id, "RUNNING")
        return run

    def send(self, folder: Path, run_id: str, **batch: list) -> None:
        """log_batch; a batch the store refuses goes to folder/rejected.jsonl, not raised."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.log_batch(run_id, **batch)
        except MlflowException as e:
            if e.error_code not in REFUSED:
                raise
            log.warning("MLflow refused %s (%s); kept in %s", list(batch), str(e)[:300], folder)
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / REJECTED, "a", encoding="utf-8") as f:
                sent = {k: [str(x) for x in v] for k, v in batch.items()}
                f.write(json.dumps({**sent, "error": str(e)[:500]}) + "\n")

    def sync(
        self,
        path: Path,
        run_id: str | None = None,
        upto: float = math.inf,
        data: bool = True,
        final: bool = True,
        size: int | None = None,
    ) -> str:
        """Log into the run what record `path` holds and it lacks; returns the run id. `data`:
        params, tags and the metric points at steps <= `upto` that MLflow's history of their
        key does not have; `final`: the artifacts and the end status; `size`: the record's
        first bytes only (the part written before the Tracker went online again)."""
        head, events = read_record(path, size)
        if run_id is None:
            if (run_id := self.run(head).info.run_id) != head["run_id"]:
                with open(path, "a", encoding="utf-8") as f:  # a second replay finds this run
                    f.write(json.dumps({"run_id": run_id}) + "\n")
            remember_run(head, run_id)
        now, rows = int(time.time() * 1000), []
        for row in _lines(Path(head["metrics_file"])) if data and head["metrics_file"] else []:
            rows += [[k, v, now, row["step"]] for k, v in row.items() if type(v) in (int, float)]
        for ev in events:
            if data and ("params" in ev or "tags" in ev):
                self.send(
                    path.parent, run_id, **batch({k: ev.get(k, {}) for k in ("params", "tags")})
                )
            rows += ev.get("metrics", []) if data else []
            art = Path(ev.get("artifact", ""))
            if final and "artifact" in ev and art.exists():
                log_art = self.client.log_artifacts if art.is_dir() else self.client.log_artifact
                log_art(run_id, str(art), ev.get("artifact_path"))
            elif final and "artifact" in ev:
                log.warning("artifact %s no longer exists; not logged", art)
            if final and "end" in ev:
                self.client.set_terminated(run_id, ev["end"], end_time=ev["time"])
        rows = [r for r in rows if r[0] != "step" and r[3] <= upto]
        keys = {r[0] for r in rows}
        have = {k: {m.step for m in self.client.get_metric_history(run_id, k)} for k in keys}
        new = {(k, s): [k, v, t, s] for k, v, t, s in rows if s not in have[k]}
        self.send(path.parent, run_id, **batch({"metrics": list(new.values())}))  # MLflow splits it
        return run_id
