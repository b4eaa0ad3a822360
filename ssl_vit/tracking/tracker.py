"""The Tracker: one MLflow run on rank 0, sent with MLflow's asynchronous logging, never stalled
by an unreachable store.

    tracker = Tracker(enabled=rank == 0, experiment="mpp", run_id=saved_id_or_None,
                      run_key=the_run_dirs_key, run_id_file=run_dir / "mlflow_run_id",
                      spool_dir=run_dir / "mlflow_spool", metrics_file=run_dir / "metrics.jsonl")
    tracker.log_params({"optim": {"lr": 2e-4}})    # flattened to "optim.lr"
    tracker.log_metrics({"loss": 1.2}, step=100)  # a step at or below the run's last: dropped
    tracker.log_artifact("run/config.yaml")       # uploaded at close
    tracker.close("FINISHED")                     # or a context manager: FAILED / KILLED

Each call goes to a local record in `spool_dir` (ssl_vit.tracking.store; not the metric points
`metrics_file` holds) and to the store when it is reachable; otherwise a thread retries every
`retry_interval` seconds. How a run stays one run (`run_key`) whatever was down when:
docs/tracking.md#a-server-that-is-down.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import wait
from pathlib import Path
from threading import Event, RLock, Thread
from typing import Any

from ssl_vit.logs import first_line
from ssl_vit.tracking.store import (
    KEY_PATTERN,
    Store,
    batch,
    read_record,
    records,
    remember_run,
    resolve_uri,
)

log = logging.getLogger("ssl_vit.tracking")
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
