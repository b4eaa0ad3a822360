"""MLflow tracking on rank 0, tolerant of an unreachable server (shared contract 5).

Public API:

    tracker = Tracker(enabled=rank == 0, experiment="mpp", run_name="vit-b16",
                      run_id=saved_run_id_or_None, spool_dir=run_dir / "mlflow-spool")
    tracker.run_id                       # None until a store that was down at start returns
    tracker.log_params({"optim": {"lr": 2e-4}})        # flattened to "optim.lr"
    tracker.log_metrics({"loss": 1.2}, step=100)      # floats or 0-d tensors
    tracker.log_artifact("run/config.yaml", artifact_path="config")   # a file or a folder
    tracker.set_tags({"stage": "pretrain"})
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

import argparse
import json
import logging
import os
import queue
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
DEFAULT_URI = "sqlite:///mlflow.db"
MAX_PARAM_LEN = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH (500 before MLflow 1.x)
MAX_METRICS = 1000  # per log_batch
MAX_PARAMS = 100  # per log_batch
COPY_LIMIT = 64 << 20  # spooled artifacts up to this size are copied, larger ones referenced
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


class _Unreachable(Exception):
    pass


class _Store:
    """The MLflow side: find or create the run, send events with per-key step dedupe."""

    def __init__(self, uri: str) -> None:
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(uri)
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
            exp = self.client.get_experiment_by_name(header["experiment"])
            exp_id = (
                exp.experiment_id if exp else self.client.create_experiment(header["experiment"])
            )
            run = self.client.create_run(
                exp_id, run_name=header.get("run_name"), tags=header.get("tags") or {}
            )
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


class _Spool:
    """Append-only JSONL of events the store did not take yet: header line, then events."""

    def __init__(self, root: Path, header: dict) -> None:
        self.root, self.header = root, dict(header)
        self.lock = threading.Lock()
        self.name = header.get("run_id") or f"new-{uuid.uuid4().hex[:12]}"

    @property
    def path(self) -> Path:
        return self.root / f"{self.name}.jsonl"

    def append(self, events: Iterable[dict]) -> None:
        with self.lock:
            self.root.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists()
            with open(self.path, "a", encoding="utf-8") as f:
                if new:
                    f.write(json.dumps({"type": "run", **self.header}) + "\n")
                for ev in events:
                    f.write(json.dumps(self._keep_artifact(ev)) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def _keep_artifact(self, ev: dict) -> dict:
        if ev["type"] != "artifact" or not Path(ev["path"]).is_file():
            return ev
        src = Path(ev["path"])
        if src.stat().st_size > COPY_LIMIT:
            return ev
        dst = self.root / "artifacts" / uuid.uuid4().hex[:12] / src.name
        dst.parent.mkdir(parents=True)
        shutil.copy2(src, dst)
        return {**ev, "path": str(dst.resolve())}

    def reject(self, ev: dict, err: Exception) -> None:
        log.warning("MLflow rejected a %s event (%s); kept in %s", ev["type"], err, self.root)
        with self.lock:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / "rejected.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({**ev, "error": str(err)[:500]}) + "\n")


# Error codes meaning "the store refuses this event" (retrying cannot help). Anything else
# (connection refused, timeout, 5xx, a locked SQLite file) counts as an outage: spool and retry.
_REJECTED = {
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS",
    "INVALID_STATE", "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED",
}  # fmt: skip


def _send_or_raise(store: _Store, run_id: str, ev: dict, spool: _Spool) -> None:
    """Send; an outage raises _Unreachable, a rejection goes to rejected.jsonl."""
    from mlflow.exceptions import MlflowException

    try:
        store.send(run_id, ev)
    except Exception as e:
        if isinstance(e, MlflowException) and e.error_code in _REJECTED and store.reachable():
            spool.reject(ev, e)
        else:
            raise _Unreachable(f"{type(e).__name__}: {str(e)[:300]}") from None


def replay_file(
    path: Path,
    tracking_uri: str | None = None,
    *,
    store: _Store | None = None,
    run_id: str | None = None,
) -> tuple[str, int]:
    """Push one spool file to its store (or `tracking_uri`); return (run_id, events sent).
    `store` and `run_id` (both or neither) reuse a connection made by a Tracker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    events = []
    for n, line in enumerate(lines, 1):
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash mid-write
            log.warning("%s:%d: not valid JSON, skipped", path, n)
    if not events or events[0].get("type") != "run":
        raise ValueError(f"{path}: no header line; not an ssl-vit MLflow spool file")
    header = events.pop(0)
    sidecar = path.with_name(path.name + ".run_id")  # a run created by an interrupted replay
    if not header.get("run_id") and sidecar.is_file():
        header["run_id"] = sidecar.read_text().strip()
    if store is None or run_id is None:
        store = _Store(tracking_uri or header["tracking_uri"])
        if not store.reachable():
            raise _Unreachable(f"{store.uri} is not reachable; start it and replay again")
        run_id = store.connect(header)
    if not header.get("run_id"):
        sidecar.write_text(run_id)
    spool = _Spool(path.parent, header)
    for ev in events:
        _send_or_raise(store, run_id, ev, spool)
    path.rename(path.with_name(f"{path.name}.done-{time.strftime('%Y%m%dT%H%M%S')}"))
    sidecar.unlink(missing_ok=True)
    return run_id, len(events)


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
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
        if self.tracking_uri.startswith(("http://", "https://")):
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(timeout)))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        self.retry_interval = retry_interval
        header = dict(
            tracking_uri=_absolute_uri(self.tracking_uri), experiment=experiment, run_name=run_name,
            run_id=run_id, tags={k: str(v) for k, v in (tags or {}).items()},
        )  # fmt: skip
        self._spool = _Spool(Path(spool_dir or "mlflow-spool").resolve(), header)
        self._store = _Store(self.tracking_uri)
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
            self._spool.append(ev for ev in left if ev is not _STOP)
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
                if p != self._spool.path and _read_header(p).get("run_id") == self._run_id
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
        if self._online and not self._abandon and self._run_id is not None:
            try:
                _send_or_raise(self._store, self._run_id, ev, self._spool)
                return
            except _Unreachable as e:
                log.warning("MLflow store %s unreachable (%s); spooling to %s",
                            self.tracking_uri, e, self._spool.root)  # fmt: skip
                self._online = False
        self._spool.append([ev])

    def _start_system_metrics(self, interval: float) -> None:
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


def _read_header(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            head = json.loads(f.readline())
        return head if isinstance(head, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ssl_vit.tracking", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser(
        "replay", help="push spooled MLflow events (SPOOL_DIR/*.jsonl) to the store"
    )
    rp.add_argument("spool_dir", type=Path, help="the Tracker's spool_dir")
    rp.add_argument(
        "--tracking-uri", default=None, help="store to push to (default: the spooled one)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    files = sorted(p for p in args.spool_dir.glob("*.jsonl") if p.name != "rejected.jsonl")
    if not args.spool_dir.is_dir():
        print(f"error: {args.spool_dir}: no such folder", file=sys.stderr)
        return 2
    failed = 0
    for path in files:
        try:
            run_id, n = replay_file(path, args.tracking_uri)
            print(f"{path}: {n} events -> run {run_id}")
        except (_Unreachable, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            failed += 1
    if not files:
        print(f"{args.spool_dir}: nothing to replay")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
