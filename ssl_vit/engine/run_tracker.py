"""The MLflow side of a training run (rank 0 logs; other ranks hold a disabled Tracker): the
run opened or continued from RUN/mlflow_run_id, its parameters and lineage logged once, and the
export registered as a model version when the config asks.

A run directory is one MLflow run, whatever was down when: RUN/mlflow_run_key, written by its
first launch, names the run before MLflow gives it an id. Every launch's record carries it, so a
launch (or a replay) that reaches the store finds the run tagged with it, or creates it once, and
takes in the records of the launches that could not reach it (ssl_vit.tracking.tracker)."""

from __future__ import annotations

import json
import logging
import math
import uuid
from pathlib import Path
from typing import Any

from ssl_vit.config import Config
from ssl_vit.engine import launches
from ssl_vit.engine.launches import Launch
from ssl_vit.io import atomic_write_text
from ssl_vit.registry import register_export
from ssl_vit.tracking import PARENT_TAG, Tracker, flatten

log = logging.getLogger("ssl_vit.train")
HEADLINE = ("loss", "acc", "top1")  # metric keys holding these words become version tags


def headline_metrics(run_dir: Path) -> dict[str, str]:
    """The run's headline numbers, as a registered version's tags: the last metrics.jsonl row's
    loss/accuracy keys, the step, and a classifier's final / best top-1 from results.json."""
    tags: dict[str, str] = {}
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    if lines:
        last: dict[str, Any] = json.loads(lines[-1])
        tags["step"] = str(last.get("step"))
        for k, v in last.items():
            if any(w in k for w in HEADLINE) and isinstance(v, (int, float)) and math.isfinite(v):
                tags[k] = f"{v:.6g}"
    results = run_dir / "results.json"
    if results.is_file():
        res = json.loads(results.read_text())
        for k in ("final_top1", "best_top1", "eval_split"):
            if res.get(k) is not None:
                tags[k] = str(res[k]) if isinstance(res[k], str) else f"{res[k]:.6g}"
    return tags


def saved_run_id(path: Path) -> str | None:
    """The MLflow run id a launch saved in `path` (RUN/mlflow_run_id), if any."""
    return path.read_text().strip() if path.is_file() else None


def run_key(run_dir: Path) -> str:
    """The run directory's key for its MLflow run: made by its first launch, kept for good."""
    path = run_dir / "mlflow_run_key"
    if not path.is_file():
        atomic_write_text(path, uuid.uuid4().hex + "\n")
    return path.read_text().strip()


def register_run(tracker: Tracker, name: str, run_dir: Path) -> None:
    """`tracking.register_as`: the logged export becomes a version of `name` (rank 0)."""
    if not tracker.flushed:  # the export is not in the store yet: registering would dangle
        log.warning(
            "not registered as %s: the MLflow store did not take the export; after `python -m "
            "ssl_vit.tracking replay %s`, run `python -m ssl_vit.tracking register %s %s`",
            name,
            run_dir / "mlflow_spool",
            tracker.run_id or "RUN_ID",
            name,
        )
        return
    register_export(tracker.tracking_uri, name, tracker.run_id, tags=headline_metrics(run_dir))


def open_run_tracker(
    cfg: Config,
    run_dir: Path,
    rank: int,
    fresh: bool,
    derived: dict,
    source_run_id: str | None,
    this_launch: Launch | None = None,
    step: int = 0,
) -> Tracker:
    """The run's Tracker; on rank 0 with the params logged once (the first launch to get here;
    later launches log only keys that are new) and this launch on record (ssl_vit.engine.
    launches: its changes as a tag, its file as an artifact, a log line)."""
    run_id_file = run_dir / "mlflow_run_id"
    tracker = Tracker(
        enabled=rank == 0,
        experiment=cfg.tracking.experiment,
        run_name=cfg.tracking.run_name or run_dir.name,
        run_id=saved_run_id(run_id_file),
        run_key=run_key(run_dir) if rank == 0 else None,
        run_id_file=run_id_file,  # written by the tracker as soon as the store gives the id
        tracking_uri=cfg.tracking.uri,
        spool_dir=run_dir / "mlflow_spool",
        metrics_file=run_dir / "metrics.jsonl",  # the run's metric record: replayed from here
        tags={PARENT_TAG: cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else None,
    )
    if rank == 0:
        params = {**cfg.to_dict(), "derived": derived}
        logged = (
            this_launch.logged_params(fresh, derived)
            if this_launch is not None
            else None
            if fresh
            else set(flatten(params))
        )
        if logged is None:
            tracker.log_params(params)
            if cfg.model.init_from:  # lineage: what this run started from
                lineage = {"ssl_vit.init_from": cfg.model.init_from}
                if source_run_id:
                    lineage["pretrain_run_id"] = source_run_id
                tracker.set_tags(lineage)
        else:  # MLflow refuses a changed value: those are in the launch's tag and artifact
            new = {k: v for k, v in flatten(params).items() if k not in logged}
            if new:
                tracker.log_params(new)
        tracker.log_artifact(run_dir / "config.yaml")  # this launch's: the earlier are in launches
        tracker.log_artifact(run_dir / "ds_config.json")
        if this_launch is not None:
            record_launch(tracker, this_launch, derived, step)
    return tracker


def record_launch(tracker: Tracker, this_launch: Launch, derived: dict, step: int) -> None:
    """RUN/launches/ as artifacts (this launch's file, and any earlier one that never reached
    the run: a launch that failed before its tracker opened), its changes as a tag, the launch
    count as a tag, and a log line from the second launch on."""
    this_launch.finish(derived, step)
    tracker.log_artifact(this_launch.path.parent, artifact_path=launches.FOLDER)
    tags = {launches.COUNT_TAG: this_launch.number}
    if this_launch.changed:
        tag = launches.TAG.format(n=this_launch.number)
        tags[tag] = launches.describe(this_launch.changed, this_launch.artifact)
    tracker.set_tags(tags)
    if this_launch.number > 1:
        log.info("%s", this_launch.summary())
