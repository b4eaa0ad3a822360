"""The Tracker: one MLflow run on rank 0, logged with MLflow's asynchronous logging, that an
unreachable store never stalls.

    tracker = Tracker(enabled=rank == 0, experiment="mpp", run_id=saved_id_or_None,
                      spool_dir=run_dir / "mlflow_spool", metrics_file=run_dir / "metrics.jsonl")
    tracker.log_params({"optim": {"lr": 2e-4}})    # flattened to "optim.lr"
    tracker.log_metrics({"loss": 1.2}, step=100)  # steps at or below the run's last are dropped
    tracker.log_artifact("run/config.yaml")       # uploaded at close
    tracker.wait_sent()                           # before a checkpoint
    tracker.close("FINISHED")                     # or a context manager: FAILED / KILLED

Every call appends to a local record (`spool_dir`, see `store`), except metric points when
`metrics_file` (written by the caller) already holds them, and sends at once when the store is
reachable. When it is not, or a send fails, a thread retries every `retry_interval` seconds and
on reconnecting logs, from the record, what the run lacks (`Store.sync`). A record whose run got
everything is deleted at close; one left behind is pushed by `python -m ssl_vit.tracking replay`.
A resumed run (`run_id`) first syncs the records of earlier processes of the same run.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import wait
from pathlib import Path
from typing import Any

from ssl_vit.tracking.store import Store, read_record, refused, reject, resolve_uri

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
        self.tracking_uri = resolve_uri(tracking_uri)
        if self.tracking_uri.startswith(("http://", "https://")):  # fail fast, retry ourselves
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(timeout)))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        uri = self.tracking_uri
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            uri = f"sqlite:///{Path(uri[10:]).resolve()}"  # a replay from elsewhere finds it
        self._metrics_file = Path(metrics_file).resolve() if metrics_file else None
        self.head = dict(
            tracking_uri=uri,
            experiment=experiment,
            run_name=run_name,
            run_id=run_id,
            tags={k: str(v) for k, v in (tags or {}).items()},
            metrics_file=self._metrics_file and str(self._metrics_file),
        )
        self.dir = Path(spool_dir or "mlflow-spool").resolve()
        self.path = self.dir / f"{uuid.uuid4().hex[:12]}.jsonl"
        self._store = Store(self.tracking_uri)
        self._lock, self._stop = threading.RLock(), threading.Event()
        self._last: dict[str, int] = {}  # per key, the last step logged (here or in the run)
        self._max_step, self._ops, self._clean, self._online = -1, [], True, False
        self._sys_interval = system_metrics_interval if system_metrics else None
        self._monitor: Any = None
        self._retry_s = retry_interval
        self._online = self._connect()
        if not self._online:
            log.warning(
                "MLflow store %s unreachable; the run is kept in %s and sent when it is back",
                self.tracking_uri,
                self.path,
            )
        self._thread = threading.Thread(target=self._retry, name="ssl-vit-mlflow", daemon=True)
        self._thread.start()

    @property
    def run_id(self) -> str | None:
        return self._run_id

    # ---- the caller's side: a line in the record and, online, an asynchronous send ----
    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.enabled:
            self._log({"params": flatten(params)})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.enabled:
            self._log({"tags": {k: str(v) for k, v in tags.items()}})

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.enabled:
            return
        now, rows = int(time.time() * 1000), []
        with self._lock:
            for key, value in metrics.items():
                if step > self._last.get(key, -1):  # at or below: logged already (a resume)
                    self._last[key] = step
                    rows.append([key, float(value), now, int(step)])
            if rows:
                self._max_step = max(self._max_step, int(step))
                self._log({"metrics": rows}, keep=self._metrics_file is None)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._log({"artifact": str(Path(path).resolve()), "artifact_path": artifact_path})

    def wait_sent(self, timeout: float = 5.0) -> bool:
        """Wait (at most `timeout` s) until what was sent so far is in the store; True when it
        got there in time. Everything is on disk already (the record, or the metrics file)."""
        if not self.enabled:
            return True
        pending = wait([f for f, _ in self._ops], timeout).not_done
        self._reap()
        return not pending

    def close(self, status: str = "FINISHED", timeout: float = 15.0) -> None:
        """End the run: wait at most `timeout` s for what is in flight, upload the artifacts,
        set the status; the record is deleted when the run got everything."""
        if not self.enabled or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._monitor is not None:
            self._monitor.finish()
        self._log({"end": status, "time": int(time.time() * 1000)}, send=False)
        sent = self.wait_sent(timeout)  # else a sync could log twice what is still in flight
        if sent and not self._online:  # one more try to reach the store
            self._online, self._clean = self._connect(), False
        try:
            if sent and self._online:
                self._store.sync(self.path, self._run_id, full=not self._clean)
                self.path.unlink()
                self.flushed = True
        except Exception as e:
            log.warning("MLflow store %s: %s", self.tracking_uri, str(e).splitlines()[0][:300])
        if not self.flushed:
            log.warning(
                "MLflow store %s unreachable: the run is kept in %s; push it with "
                "`python -m ssl_vit.tracking replay %s`",
                self.tracking_uri,
                self.path,
                self.dir,
            )

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type | None, *_: Any) -> None:
        status = "FINISHED" if exc_type is None else "FAILED"
        self.close("KILLED" if exc_type is KeyboardInterrupt else status)

    def _log(self, ev: dict, keep: bool = True, send: bool = True) -> None:
        with self._lock:
            if keep:
                new = not self.path.exists()
                self.dir.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write("".join(json.dumps(x) + "\n" for x in [self.head] * new + [ev]))
            if not (send and self._online) or "artifact" in ev:
                return
            from mlflow.entities import Metric, Param, RunTag

            ops = self._store.client.log_batch(
                self._run_id,
                metrics=[Metric(*m) for m in ev.get("metrics", [])],
                params=[Param(k, v) for k, v in ev.get("params", {}).items()],
                tags=[RunTag(k, v) for k, v in ev.get("tags", {}).items()],
                synchronous=False,
            )
            # RunOperations keeps one concurrent future per batch sent
            self._ops += [(f, ev) for f in (ops._operation_futures if ops else [])]
            if len(self._ops) > 256:
                self._reap()

    def _reap(self) -> None:
        """Forget the sends that are done; a failed one puts the tracker offline."""
        with self._lock:
            for f, ev in [op for op in self._ops if op[0].done()]:
                self._ops.remove((f, ev))
                if f.exception() is None:
                    continue
                if refused(f.exception()):
                    reject(ev, f.exception(), self.dir)
                elif self._online:
                    log.warning(
                        "MLflow store %s unreachable (%s); retrying every %gs",
                        self.tracking_uri,
                        str(f.exception())[:200],
                        self._retry_s,
                    )
                    self._online = self._clean = False
                else:
                    self._clean = False

    def _connect(self) -> bool:
        """Reach the store, get the run, sync earlier records of it, then this one."""
        try:
            if not self._store.reachable():
                return False
            wait([f for f, _ in self._ops])  # what failed in flight: synced below, not twice
            self._reap()
            run = self._store.run(self.head)
            rid = run.info.run_id
            if rid != self.head["run_id"]:
                with self._lock:
                    self.head["run_id"] = rid
                    if self.path.exists():
                        self._log({"run_id": rid}, send=False)
            for other in sorted(self.dir.glob("*.jsonl")):
                if other != self.path and other.name != "rejected.jsonl":
                    if read_record(other)[0].get("run_id") == rid:
                        self._store.sync(other, rid)
                        other.unlink()
            run = self._store.client.get_run(rid)
            if run.info.status != "RUNNING":
                self._store.client.update_run(rid, status="RUNNING")
            with self._lock:
                for m in run.data._metric_objs:  # the latest step of each key
                    self._last[m.key] = max(m.step, self._last.get(m.key, -1))
                self._online, self._run_id, upto = True, rid, self._max_step
            if self.path.exists():
                self._store.sync(self.path, rid, upto=upto)
        except Exception as e:
            log.warning("MLflow store %s unreachable (%s)", self.tracking_uri, str(e)[:300])
            self._online = False
            return False
        self._start_system_metrics()
        return True

    def _retry(self) -> None:
        while not self._stop.wait(self._retry_s):
            self._reap()
            if not self._online and not self._stop.is_set():
                self._online = self._connect()

    def _start_system_metrics(self) -> None:
        """MLflow's own monitor (CPU, memory, disk, network, GPU; needs psutil), logging to the
        run from its thread; it stops on an outage and starts again on reconnecting."""
        if self._sys_interval is None:
            return
        if self._monitor is not None:
            self._monitor.finish()
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(
                self._run_id,
                sampling_interval=self._sys_interval,
                resume_logging=True,
                tracking_uri=self.tracking_uri,
            )
            self._monitor.start()
        except Exception as e:  # psutil missing
            log.info("system metrics off (%s)", e)
