"""The Tracker: MLflow tracking on rank 0, tolerant of an unreachable server.

Public API:

    tracker = Tracker(enabled=rank == 0, experiment="mpp", run_name="vit-b16",
                      run_id=saved_run_id_or_None, spool_dir=run_dir / "mlflow-spool")
    tracker.run_id                       # None until a store that was down at start returns
    tracker.log_params({"optim": {"lr": 2e-4}})        # flattened to "optim.lr"
    tracker.log_metrics({"loss": 1.2}, step=100)      # floats or 0-d tensors
    tracker.log_artifact("run/config.yaml", artifact_path="config")   # a file or a folder
    tracker.set_tags({"stage": "pretrain"})
    tracker.wait_sent()                  # before a checkpoint: what came before it is on record
    tracker.close("FINISHED")            # or FAILED / KILLED; also a context manager

    python -m ssl_vit.tracking replay SPOOL_DIR [--tracking-uri URI]

Store: `tracking_uri`, else $MLFLOW_TRACKING_URI, else `sqlite:///mlflow.db` in the current
directory. `enabled=False` (ranks != 0) makes every call a no-op.

Never stalls training: the constructor makes one bounded attempt to reach the store (HTTP
timeouts default to `timeout` seconds with no client retries, via MLFLOW_HTTP_REQUEST_TIMEOUT /
MLFLOW_HTTP_REQUEST_MAX_RETRIES unless already set); after that every call only puts an event
on a queue. A background thread sends the events. When the store cannot be reached it appends
them to `spool_dir/<run>.jsonl` (one JSON event a line, small artifacts copied beside it),
retries every `retry_interval` seconds, and on reconnecting replays the spool and renames it
`*.done-<time>`. What is still spooled when the process ends is pushed later by the replay
command above (it creates the run if it never existed). Requests the store rejects with a
client error (e.g. a changed param value) are not retried: a warning, and the event goes to
`spool_dir/rejected.jsonl`. Any other failure (refused, timeout, 5xx, locked SQLite) is an
outage: spool and retry.

Resume without duplicates: pass the run_id saved in the run directory. Per metric key, steps
must increase; a step at or below the last one already stored (read from the run when the
connection is made) or already logged by this process is dropped, so a job resumed from an
older checkpoint re-logs nothing twice. The run is set back to RUNNING.

System metrics (CPU, memory, disk, network, GPU when present; needs psutil) are sampled every
`system_metrics_interval` seconds with mlflow's monitors and logged through the same queue as
`system/...`, with step = whole seconds since the run started.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ssl_vit.tracking.nesting import parent_from_env
from ssl_vit.tracking.spool import Spool, read_header, replay_file
from ssl_vit.tracking.store import (
    MAX_METRICS,
    PARENT_TAG,
    Store,
    Unreachable,
    resolve_uri,
    send_or_raise,
)

log = logging.getLogger("ssl_vit.tracking")
MAX_PARAM_LEN = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH (500 before MLflow 1.x)
_STOP = object()


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}, values stringified and truncated to MLflow's limit."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:MAX_PARAM_LEN]
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
        tags: dict[str, str] | None = None,
        spool_dir: str | Path | None = None,
        system_metrics: bool = True,
        system_metrics_interval: float = 10.0,
        timeout: int = 5,
        retry_interval: float = 5.0,
    ) -> None:
        self.enabled = enabled
        self._run_id = run_id
        if not enabled:
            return
        self.tracking_uri = resolve_uri(tracking_uri)
        if self.tracking_uri.startswith(("http://", "https://")):
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(timeout)))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        self.retry_interval = retry_interval
        tags = {k: str(v) for k, v in (tags or {}).items()}
        if parent_from_env() and PARENT_TAG not in tags:  # started by a study: nest under it
            tags[PARENT_TAG] = parent_from_env()
        header = dict(
            tracking_uri=_absolute_uri(self.tracking_uri), experiment=experiment, run_name=run_name,
            run_id=run_id, tags=tags,
        )  # fmt: skip
        self._spool = Spool(Path(spool_dir or "mlflow-spool").resolve(), header)
        self._store = Store(self.tracking_uri)
        self._queue: queue.Queue = queue.Queue()
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()
        self._abandon = False
        self._t0 = time.time()
        self._online = self._connect()
        self._thread = threading.Thread(target=self._loop, name="ssl-vit-mlflow", daemon=True)
        self._thread.start()
        self._sys_stop = threading.Event()
        self._sys_thread = None
        if system_metrics:
            self._start_system_metrics(system_metrics_interval)

    @property
    def run_id(self) -> str | None:
        return self._run_id

    @property
    def flushed(self) -> bool:
        """After `close`: every event reached the store (nothing left in the spool)."""
        return self.enabled and self._run_id is not None and not self._spool.path.exists()

    # ---- the caller's side: only queue puts ----
    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.enabled:
            self._queue.put({"type": "params", "items": flatten(params)})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.enabled:
            self._queue.put({"type": "tags", "items": {k: str(v) for k, v in tags.items()}})

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.enabled:
            return
        now, rows = int(time.time() * 1000), []
        with self._lock:
            for key, value in metrics.items():
                if step <= self._last.get(key, -(2**62)):
                    continue  # an already-logged step (resume): dropped, see module doc
                self._last[key] = step
                rows.append((key, float(value), now, int(step)))
        if rows:
            self._queue.put({"type": "metrics", "metrics": rows})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled:
            ev = {"type": "artifact", "path": str(Path(path).resolve())}
            self._queue.put({**ev, "artifact_path": artifact_path})

    def wait_sent(self, timeout: float = 5.0) -> bool:
        """Wait (at most `timeout` s) until every event queued so far is in the store or in the
        spool on disk. A trainer calls it before writing a checkpoint: a run killed right after
        the checkpoint then resumes from it with every earlier metric on record; without it the
        killed process took the last queued points with it, and the resumed run, which starts
        after the checkpoint's step, never logged them again. True when it got there in time."""
        if not self.enabled or not self._thread.is_alive():
            return True
        sent = threading.Event()
        self._queue.put({"type": "mark", "sent": sent})
        return sent.wait(timeout)

    def close(self, status: str = "FINISHED", timeout: float = 15.0) -> None:
        """End the run; wait at most `timeout` s for the queue, then spool what is left."""
        if not self.enabled or not self._thread.is_alive():
            return
        self._sys_stop.set()
        if self._sys_thread is not None:
            self._sys_thread.join(timeout=2)
        self._queue.put({"type": "end", "status": status, "time": int(time.time() * 1000)})
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():  # stuck on a slow store: keep the rest on disk
            self._abandon = True
            left = self._drain()
            self._spool.append(ev for ev in left if ev is not _STOP and ev["type"] != "mark")
        if self._spool.path.exists():
            log.warning(
                "MLflow store %s unreachable: events kept in %s; push them with "
                "`python -m ssl_vit.tracking replay %s`",
                self.tracking_uri, self._spool.path, self._spool.root,
            )  # fmt: skip

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type | None, *_: Any) -> None:
        status = "FINISHED" if exc_type is None else "FAILED"
        self.close("KILLED" if exc_type is KeyboardInterrupt else status)

    # ---- the background thread ----
    def _connect(self) -> bool:
        """Reach the store, get the run, replay this run's spools. False if unreachable."""
        try:
            if not self._store.reachable():
                return False
            self._run_id = self._store.connect({**self._spool.header, "run_id": self._run_id})
            self._t0 = self._store.start_time or self._t0
            self._spool.header["run_id"] = self._run_id
            mine = [self._spool.path] + [  # ours, then earlier processes' spools of this run
                p
                for p in sorted(self._spool.root.glob("*.jsonl"))
                if p != self._spool.path and read_header(p).get("run_id") == self._run_id
            ]
            for path in mine:
                if path.exists():
                    replay_file(path, store=self._store, run_id=self._run_id)
        except Exception as e:
            log.warning("MLflow store %s unreachable (%s); spooling to %s", self.tracking_uri, e,
                        self._spool.root)  # fmt: skip
            return False
        self._spool.name = self._run_id
        return True

    def _drain(self, limit: int = 1 << 30) -> list:
        out = []
        while len(out) < limit:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return out

    def _loop(self) -> None:
        last_try = time.monotonic()
        while True:
            try:
                ev = self._queue.get(timeout=self.retry_interval)
            except queue.Empty:
                ev = None
            if not self._online and time.monotonic() - last_try >= self.retry_interval:
                last_try = time.monotonic()
                self._online = self._connect()
            if ev is None:
                continue
            if ev is _STOP:
                return
            for e in _merge_metrics([ev] + self._drain(limit=256)):
                if e is _STOP:
                    return
                self._handle(e)

    def _handle(self, ev: dict) -> None:
        if ev["type"] == "mark":  # every event queued before it has been sent or spooled
            ev["sent"].set()
            return
        if self._online and not self._abandon and self._run_id is not None:
            try:
                send_or_raise(self._store, self._run_id, ev, self._spool.reject)
                return
            except Unreachable as e:
                log.warning("MLflow store %s unreachable (%s); spooling to %s",
                            self.tracking_uri, e, self._spool.root)  # fmt: skip
                self._online = False
        self._spool.append([ev])

    def _start_system_metrics(self, interval: float) -> None:
        # mlflow.enable_system_metrics_logging would log straight to the store from its own
        # thread; sampling its monitors here puts the values through our queue and spool, so a
        # store outage loses none of them.
        try:
            import psutil  # noqa: F401  (mlflow's monitors need it)
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(self._run_id or "-", tracking_uri=self.tracking_uri)
        except Exception as e:  # psutil missing, or an mlflow without the monitors
            log.info("system metrics off (%s)", e)
            return

        def sample() -> None:
            while not self._sys_stop.wait(interval):
                try:
                    monitor.collect_metrics()
                    values = monitor.aggregate_metrics()
                    for m in monitor.monitors:
                        m.clear_metrics()
                except Exception as e:
                    log.info("system metrics stopped (%s)", e)
                    return
                step = int(time.time() - self._t0)
                self.log_metrics({f"system/{k}": v for k, v in values.items()}, step=step)

        self._sys_thread = threading.Thread(target=sample, name="ssl-vit-sysmetrics", daemon=True)
        self._sys_thread.start()


def _merge_metrics(events: list) -> list:
    """Consecutive metrics events become one (so one log_batch sends them)."""
    out: list = []
    for ev in events:
        prev = out[-1] if out else None
        if (
            ev is not _STOP
            and ev["type"] == "metrics"
            and prev is not None
            and prev is not _STOP
            and prev["type"] == "metrics"
            and len(prev["metrics"]) + len(ev["metrics"]) <= MAX_METRICS
        ):
            out[-1] = {"type": "metrics", "metrics": prev["metrics"] + ev["metrics"]}
        else:
            out.append(ev)
    return out


def _absolute_uri(uri: str) -> str:
    """sqlite:///rel.db -> sqlite:////abs/rel.db, so a later replay finds the same file."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri
