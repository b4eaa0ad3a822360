"""The local on-disk spool of events the MLflow store did not take yet, and its replay.

A spool file is `SPOOL_DIR/<run>.jsonl`: a header line (`{"type": "run", ...}` with the store,
experiment, run name/id and tags), then one JSON event a line; small artifacts are copied
beside it under `artifacts/`. Events the store rejected go to `SPOOL_DIR/rejected.jsonl`.
`replay_file` pushes one spool file and renames it `*.done-<time>`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from ssl_vit.io import atomic_write_text
from ssl_vit.tracking.store import Store, Unreachable, send_or_raise

log = logging.getLogger("ssl_vit.tracking")
COPY_LIMIT = 64 << 20  # spooled artifacts up to this size are copied, larger ones referenced


class Spool:
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


def replay_file(
    path: Path,
    tracking_uri: str | None = None,
    *,
    store: Store | None = None,
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
        store = Store(tracking_uri or header["tracking_uri"])
        if not store.reachable():
            raise Unreachable(f"{store.uri} is not reachable; start it and replay again")
        run_id = store.connect(header)
    if not header.get("run_id"):
        atomic_write_text(sidecar, run_id)
    spool = Spool(path.parent, header)
    for ev in events:
        send_or_raise(store, run_id, ev, spool.reject)
    path.rename(path.with_name(f"{path.name}.done-{time.strftime('%Y%m%dT%H%M%S')}"))
    sidecar.unlink(missing_ok=True)
    return run_id, len(events)


def read_header(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            head = json.loads(f.readline())
        return head if isinstance(head, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}
