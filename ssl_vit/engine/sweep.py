"""A hyper-parameter sweep chosen on held-out data: one fine-tune per value, the best kept.

    python evals/finetune.py --config configs/fmnist_finetune.yaml --backbone RUN \
        --sweep optim.lr=0.003,0.01,0.03,0.06 run.dir=runs/ft_sweep

The paper picks the fine-tuning learning rate from {0.003, 0.01, 0.03, 0.06} on a held-out 2%
of the training set (appendix B.1.1). Each value trains in RUN/<key>=<value>/ (a run directory
of its own, resumed like any run: a finished one is kept), as an MLflow run nested under a
parent run for the sweep. A value's directory from a sweep with other settings (its saved
config.yaml differs) is moved aside and trained again, so a grid can grow without retraining
the values it had. The value whose run reached the best top-1 on the selection split
(the held-out part of the training split) wins; RUN/results.json names it, with every value's
held-out top-1 and the chosen run's test top-1, which is only reported.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import yaml

from ssl_vit.config import Config, ConfigError, load_config, training_settings
from ssl_vit.engine.run_tracker import saved_run_id
from ssl_vit.io import atomic_write_text

log = logging.getLogger("ssl_vit.train")


def parse_sweep(spec: str) -> tuple[str, list[Any]]:
    """ "optim.lr=0.003,0.01" -> ("optim.lr", [0.003, 0.01]); values are YAML scalars."""
    key, sep, raw = spec.partition("=")
    values = [yaml.safe_load(v) for v in raw.split(",") if v.strip()] if sep else []
    if not key or "." not in key or len(values) < 2:
        raise ConfigError(
            f"--sweep {spec!r}: expected section.key=v1,v2[,...] with two or more values, "
            "e.g. --sweep optim.lr=0.003,0.01,0.03,0.06"
        )
    return key, values


def check_sweep(config_path: str | None, overrides: list[str], key: str, values: list) -> None:
    """Every value makes a valid config, and there is held-out data to choose on."""
    cfg = load_config(config_path, overrides)
    if cfg.holdout_share == 0 and not cfg.run.eval_split:
        raise ConfigError(
            "--sweep chooses on held-out data: set data.holdout_fraction (e.g. 0.02) or "
            "run.eval_split=val"
        )
    for v in values:
        load_config(config_path, [*overrides, f"{key}={v}"])  # raises ConfigError if bad


def _results(run_dir: Path) -> dict:
    """A finished run's RUN/results.json, or {} while there is none."""
    path = run_dir / "results.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def choose(key: str, values: list[Any], runs: list[dict]) -> dict[str, Any]:
    """The sweep's results: the value with the best selection-split top-1 (first on ties)."""
    if any(r.get("selection_best_top1") is None for r in runs):
        raise ConfigError(
            "--sweep needs a selection split in every run (the held-out part of the training "
            "split: data.holdout_fraction > 0, or a val split); none was scored"
        )
    best = max(range(len(runs)), key=lambda i: (runs[i]["selection_best_top1"], -i))
    win = runs[best]
    return {
        "sweep": {"key": key, "values": values},
        "chosen_by": "best selection_best_top1 (held-out top-1 over the run's evals)",
        "selection_split": win["selection_split"],
        "report_split": win["report_split"],
        "chosen": {key: values[best]},
        "chosen_run_dir": win["run_dir"],
        "selection_best_top1": win["selection_best_top1"],
        "best_step": win["best_step"],
        # The chosen run's report-split (test) top-1: at its chosen step and at its end.
        "selected_top1": win["selected_top1"],
        "final_top1": win["final_top1"],
        "runs": runs,
    }


def run_sweep(
    config_path: str | None, overrides: list[str], spec: str, header: str, train_fn
) -> dict[str, Any]:
    """Train one run per value (every rank calls this), then write RUN/results.json (rank 0).

    `train_fn(cfg, header)` is the trainer's `train`."""
    from ssl_vit.engine.distributed import barrier, init_distributed

    key, values = parse_sweep(spec)
    base_cfg: Config = load_config(config_path, overrides)
    base = Path(base_cfg.run.dir)
    check_sweep(config_path, overrides, key, values)
    rank, _, _ = init_distributed()
    parent = _open_parent(base_cfg, key, values, header) if rank == 0 else None
    runs = []
    for value in values:
        out = base / f"{key}={value}"
        child = [*overrides, f"{key}={value}", f"run.dir={out}"]
        if parent is not None and parent.run_id:
            child.append(f"tracking.parent_run_id={parent.run_id}")
        if rank == 0:
            _set_aside_if_changed(out, load_config(config_path, child))
        barrier()
        if (out / "results.json").is_file():
            log.info("sweep %s=%s: finished before, kept (%s)", key, value, out)
        else:
            log.info("sweep %s=%s: training in %s", key, value, out)
            train_fn(load_config(config_path, child), header=f"{header} [{key}={value}]")
        barrier()
        runs.append(
            {
                "value": value,
                "run_dir": str(out),
                "mlflow_run_id": saved_run_id(out / "mlflow_run_id"),
                **_results(out),
            }
        )
    result = choose(key, values, runs)
    if rank == 0 and parent is not None:
        _close_parent(parent, base / "results.json", key, result, runs)
    barrier()
    return result


def _set_aside_if_changed(out: Path, cfg: Config) -> None:
    """A value's run directory trained under other settings moves to `<dir>.stale-<time>`."""
    saved = out / "config.yaml"
    if not saved.is_file() or training_settings(yaml.safe_load(saved.read_text())) == (
        training_settings(cfg.to_dict())
    ):
        return
    dest = out.with_name(f"{out.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
    out.rename(dest)
    log.info("sweep: %s was trained with other settings; moved to %s, training again", out, dest)


def _open_parent(base_cfg: Config, key: str, values: list, header: str):
    """The sweep's parent MLflow run (rank 0), continued on a rerun."""
    from ssl_vit.tracking import Tracker

    base = Path(base_cfg.run.dir)
    base.mkdir(parents=True, exist_ok=True)
    id_file = base / "mlflow_run_id"
    parent = Tracker(
        enabled=True,
        experiment=base_cfg.tracking.experiment,
        run_name=base_cfg.tracking.run_name or base.name,
        run_id=saved_run_id(id_file),
        run_id_file=id_file,  # written by the tracker as soon as the store gives the id
        tracking_uri=base_cfg.tracking.uri,
        spool_dir=base / "mlflow_spool",
        tags={"ssl_vit.sweep": key},
        system_metrics=False,
    )
    # Tags, not params: a grown grid continues this parent run, and MLflow's params never change.
    parent.set_tags({"sweep.key": key, "sweep.values": values, "header": header})
    return parent


def _close_parent(parent, path: Path, key: str, result: dict, runs: list[dict]) -> None:
    """results.json, the chosen value and every value's score on the parent run."""
    result["mlflow_run_id"] = parent.run_id
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    parent.set_tags({f"chosen.{key}": result["chosen"][key]})
    for i, r in enumerate(runs):  # step = position of the value in the sweep
        parent.log_metrics({"sweep/selection_best_top1": r["selection_best_top1"]}, step=i)
    chosen = {"chosen/selection_best_top1": result["selection_best_top1"]}
    if result["selected_top1"] is not None:
        chosen["chosen/selected_top1"] = result["selected_top1"]
    parent.log_metrics(chosen, step=0)
    parent.log_artifact(path)
    parent.close()
    log.info(
        "sweep: chose %s=%s (held-out top-1 %.4f; test top-1 %s); %s",
        key,
        result["chosen"][key],
        result["selection_best_top1"],
        result["selected_top1"],
        path,
    )
