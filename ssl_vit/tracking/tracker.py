"""MLflow tracking: the Tracker, one run on rank 0 sent with MLflow's asynchronous logging and
never stalled by an unreachable store, and the store side (`Store.sync`, `register_export`).

    tracker = Tracker(enabled=rank == 0, experiment="mpp", run_id=saved_id_or_None,
                      run_key=the_run_dirs_key, run_id_file=run_dir / "mlflow_run_id",
                      spool_dir=run_dir / "mlflow_spool", metrics_file=run_dir / "metrics.jsonl")
    tracker.log_params({"optim": {"lr": 2e-4}})    # flattened to "optim.lr"
    tracker.log_metrics({"loss": 1.2}, step=100)  # a step at or below the run's last: dropped
    tracker.log_artifact("run/config.yaml")       # uploaded at close
    tracker.close("FINISHED")                     # or a context manager: FAILED / KILLED

Each call goes to a local record in `spool_dir` and to the store when it is reachable, else a
thread retries; `Store.sync` logs what a record holds and the run lacks, found by its run key
(docs/tracking.md#a-server-that-is-down).
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
import uuid
from collections.abc import Mapping
from concurrent.futures import wait
from pathlib import Path
from threading import Event, RLock, Thread
from typing import Any

from ssl_vit.io import atomic_write_text
from ssl_vit.logs import first_line

log = logging.getLogger("ssl_vit.tracking")
DEFAULT_URI = "sqlite:///mlflow.db"
PARENT_TAG = "mlflow.parentRunId"
KEY_TAG = "ssl_vit.run_key"  # the run key (docs/tracking.md) of a run made for a record
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


MAX_PARAM_LEN = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}, values stringified and truncated to MLflow's limit."""
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:MAX_PARAM_LEN]
    return out


class Tracker:
    """MLflow run of one job; see the module docstring."""

    def __init__(
        self,
        *,
        enabled: bool,
        experiment: str,
        run_name: str | None = None,
        run_id: str | None = None,
        run_key: str | None = None,
        run_id_file: str | Path | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, Any] | None = None,
        spool_dir: str | Path | None = None,
        metrics_file: str | Path | None = None,
        system_metrics: bool = True,
        system_metrics_interval: float = 10.0,
        timeout: int = 5,
        retry_interval: float = 5.0,
    ) -> None:
        self.enabled, self._run_id, self.flushed = enabled, run_id, False
        if not enabled:
            return
        if run_key is not None and not KEY_PATTERN.fullmatch(run_key):
            raise ValueError(f"run_key {run_key!r}: use 1 to 64 letters, digits, - and _")
        self.tracking_uri = uri = resolve_uri(tracking_uri)
        if uri.startswith(("http://", "https://")):  # fail fast: the thread below retries
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(timeout)))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        elif uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            uri = f"sqlite:///{Path(uri[10:]).resolve()}"  # a replay from elsewhere finds it
        self._metrics_file = metrics_file and str(Path(metrics_file).resolve())
        self.head = {
            "tracking_uri": uri,
            "experiment": experiment,
            "run_name": run_name,
            "run_id": run_id,
            "run_key": run_key,
            "tags": {k: str(v) for k, v in (tags or {}).items()},
            "metrics_file": self._metrics_file,
            "run_id_file": run_id_file and str(Path(run_id_file).resolve()),
            "begun": int(time.time() * 1000),  # records replay in the order they began
        }  # the record's line 1
        self.dir = Path(spool_dir or "mlflow-spool").resolve()
        self.path = self.dir / f"{uuid.uuid4().hex[:12]}.jsonl"
        self._store, self._lock, self._stop = Store(self.tracking_uri), RLock(), Event()
        self._last: dict[str, int] = {}  # per key, the last step logged, here or in the run
        self._ops, self._max_step, self._clean, self._online = [], -1, True, False
        self._sys, self._retry_s = system_metrics and system_metrics_interval, retry_interval
        self._monitor: Any = None
        if not self._connect():
            log.warning("MLflow store %s unreachable; run kept in %s", self.tracking_uri, self.path)
        self._thread = Thread(target=self._retry, name="ssl-vit-mlflow", daemon=True)
        self._thread.start()

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.enabled:
            self._log_batch("params", flatten(params))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.enabled:
            self._log_batch("tags", {k: str(v) for k, v in tags.items()})

    def log_metrics(self, metrics: Mapping[str, Any], step: int, in_file: bool = False) -> None:
        """Send the points (asynchronously); `in_file`: the caller's metrics file holds them,
        else they go into the record too (evaluations, the compile trial)."""
        if not self.enabled:
            return
        now, step = int(time.time() * 1000), int(step)
        with self._lock:  # a step at or below the key's last is logged already (a resume)
            rows = [
                [k, float(v), now, step] for k, v in metrics.items() if step > self._last.get(k, -1)
            ]
            self._last.update((k, step) for k, *_ in rows)
            self._max_step = max(self._max_step, step)
            if rows and not (self._metrics_file and in_file):
                self._append({"metrics": rows})
            if rows and self._online:
                ops = self._store.client.log_batch(
                    self._run_id, **batch({"metrics": rows}), synchronous=False
                )
                self._ops += ops._operation_futures  # a concurrent future per batch
                if len(self._ops) > 256:
                    self._settle()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._append({"artifact": str(Path(path).resolve()), "artifact_path": artifact_path})

    def wait_sent(self, timeout: float = 5.0) -> bool:
        """Wait (at most `timeout` s) until the metric points sent so far are in the store; True
        when they got there in time. (Everything is on disk already, in a record or the metrics
        file, so a checkpoint needs no wait.)"""
        return not self.enabled or self._settle(timeout)

    def close(self, status: str = "FINISHED", timeout: float = 15.0) -> None:
        """End the run: upload the artifacts, set the status, delete the record; or keep it."""
        if not self.enabled or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._monitor is not None:
            self._monitor.finish()
        self._append({"end": status, "time": int(time.time() * 1000)})
        sent, data = self._settle(timeout), not self._clean  # in flight: a sync could log twice
        if sent and not self._online:
            self._online, data = self._connect(), False  # which synced the data
        if sent and self._online:
            try:
                self._store.sync(self.path, self._run_id, data=data)
                self.path.unlink()
                self.flushed = True
            except Exception as e:
                log.warning("MLflow store %s: %s", self.tracking_uri, first_line(e))
        if not self.flushed:
            log.warning(
                "MLflow run kept in %s; once %s is back: `python -m ssl_vit.tracking replay %s`",
                self.path,
                self.tracking_uri,
                self.dir,
            )

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type | None, *_: Any) -> None:
        status = "FINISHED" if exc_type is None else "FAILED"
        self.close("KILLED" if exc_type is KeyboardInterrupt else status)

    def _append(self, ev: dict) -> None:
        with self._lock:
            lines = [ev] if self.path.exists() else [self.head, ev]
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(x) + "\n" for x in lines))

    def _log_batch(self, kind: str, items: dict[str, str]) -> None:
        """Params or tags: recorded, and sent at once (a changed param is refused here)."""
        with self._lock:
            self._append({kind: items})
            if self._online:
                try:
                    self._store.send(self.dir, self._run_id, **batch({kind: items}))
                except Exception as e:
                    self._offline(e)

    def _offline(self, e: BaseException) -> None:
        if self._online:
            log.warning(
                "MLflow store %s unreachable (%s); retrying", self.tracking_uri, str(e)[:200]
            )
        self._online = self._clean = False

    def _settle(self, timeout: float | None = 0) -> bool:
        """Wait for the metric batches in flight; one that failed puts the tracker offline (the
        points are in the record or the metrics file). True when none is left in flight."""
        done, pending = wait(list(self._ops), timeout)
        with self._lock:
            self._ops = [f for f in self._ops if f not in done]
            for e in filter(None, (f.exception() for f in done)):
                self._offline(e)
        return not pending

    def _connect(self) -> bool:
        """Reach the store; get the run (by id, else by key, else created) and set it RUNNING;
        sync into it the records earlier processes left of it; then send what this record holds
        and the run lacks."""
        try:
            if not self._store.reachable():
                return False
            self._settle(None)  # what failed in flight is synced below, once
            run = self._store.run(self.head)
            rid = run.info.run_id
            if self._sync_earlier(rid):  # their end events ended the run; it has their points
                run = self._store.run({**self.head, "run_id": rid})
            remember_run(self.head, rid)
            with self._lock:
                if rid != self.head["run_id"] and self.path.exists():
                    self._append({"run_id": rid})
                self.head["run_id"] = self._run_id = rid
                for m in run.data._metric_objs:  # each key's latest point
                    self._last[m.key] = max(m.step, self._last.get(m.key, -1))
                # From here on points are sent live; the sync takes what was logged before.
                upto, size = self._max_step, self.path.stat().st_size if self.path.exists() else 0
                self._online = True
            if size:
                self._store.sync(self.path, self._run_id, upto=upto, final=False, size=size)
        except Exception as e:
            self._offline(e)
            return False
        if self._sys and not self._stop.is_set():
            self._start_monitor()
        return True

    def _sync_earlier(self, run_id: str) -> bool:
        """Sync into `run_id`, oldest first, and delete the other records in the spool folder
        that belong to it (by its id, or by this Tracker's run key: launches that never learned
        the id); True when there was one."""
        key, synced = self.head["run_key"], False
        for other in records(self.dir):
            if other == self.path:
                continue
            try:
                head = read_record(other)[0]
            except (OSError, ValueError) as e:  # cut short by a crash: the replay reports it
                log.warning("%s", str(e)[:300])
                continue
            if head["run_id"] == run_id or (key and head.get("run_key") == key):
                self._store.sync(other, run_id)
                other.unlink()
                synced = True
        return synced

    def _retry(self) -> None:
        while not self._stop.wait(self._retry_s):
            self._settle()
            if not self._online:
                self._connect()

    def _start_monitor(self) -> None:
        """MLflow's system metrics (CPU, memory, disk, network, GPU; needs psutil), logged to the
        run by its own thread; stopped by an outage, started again on reconnecting."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            if self._monitor is not None:
                self._monitor.finish()
            kw = {"resume_logging": True, "tracking_uri": self.tracking_uri}
            self._monitor = SystemMetricsMonitor(self._run_id, sampling_interval=self._sys, **kw)
            self._monitor.start()
        except Exception as e:
            log.info("system metrics off (%s)", e)
