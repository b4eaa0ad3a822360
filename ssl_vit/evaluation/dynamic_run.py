"""`evals/dynamic_vit.py`: adaptive inference of a fine-tuned cascade, from export to report.

Load the cascade exported by a `cascade` fine-tune (a folder, run directory or MLflow URI) ->
every stage's outputs on the held-out part of the training split (the fine-tune's own held-out
hash, `data.holdout_fraction`) and on test -> per budget, thresholds chosen on held-out ->
test accuracy, mean GFLOPs and exit shares; the operating point matching the finest stage's
held-out accuracy at the least compute, timed with batched early exit against the finest stage
alone -> results JSON, accuracy-vs-GFLOPs PNG, MLflow run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ssl_vit import startup
from ssl_vit.data.manifest import load_manifest
from ssl_vit.data.stream import make_eval_loader
from ssl_vit.data.urls import normalise_root
from ssl_vit.evaluation import dynamic
from ssl_vit.evaluation.cli import eval_split
from ssl_vit.evaluation.report import (
    format_table,
    log_to_mlflow,
    write_results,
)
from ssl_vit.figures import optional_figure
from ssl_vit.io import atomic_open
from ssl_vit.models import load_backbone
from ssl_vit.objectives.export import load_objective
from ssl_vit.registry import resolve_export

log = logging.getLogger("ssl_vit.dynamic")


def load_cascade(source: str, tracking_uri: str | None) -> tuple[Any, dict, Any]:
    """(CascadeObjective, backbone.json, ResolvedExport) of a cascade fine-tune's export."""
    resolved = resolve_export(source, tracking_uri=tracking_uri)
    backbone, meta = load_backbone(resolved.path)
    objective = load_objective(resolved.path, backbone, meta["mean"], meta["std"])
    if objective is None or not hasattr(objective, "cascade"):
        raise ValueError(
            f"{source}: not a cascade export (objective.json kind must be cascade); fine-tune "
            "one with `python evals/finetune.py --config configs/fmnist_cascade.yaml`"
        )
    return objective.eval(), meta, resolved


def _images(loader, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys, n = [], [], 0
    for x, y in loader:
        xs.append(x)
        ys.append(y)
        n += len(y)
        if limit and n >= limit:
            break
    x, y = torch.cat(xs), torch.cat(ys)
    return (x[:limit], y[:limit]) if limit else (x, y)


def plot(points: list[dict], singles: list[dict], matched: dict | None, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.plot(
        [p["gflops"] for p in points],
        [100 * p["top1"] for p in points],
        "o-",
        label="cascade (thresholds chosen on held-out train)",
    )
    for s in singles:  # every image leaves at stage s: stages 1..s run for all of them
        ax.plot(
            s["gflops_in_cascade"],
            100 * s["top1"],
            "s",
            label=f"stage {s['stage'] + 1} ({s['grid'][0]}x{s['grid'][1]}) for every image",
        )
    if singles:
        ax.axvline(
            singles[-1]["gflops_alone"],
            color="gray",
            ls=":",
            lw=1,
            label="finest stage's ViT alone (GFLOPs)",
        )
    if matched:
        ax.plot(
            matched["gflops"], 100 * matched["top1"], "*", ms=14, color="k", label="matched point"
        )
    ax.set_xlabel("mean GFLOPs per image")
    ax.set_ylabel("test top-1 (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return path


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline in the module docstring, up to the results `report` writes."""
    device = torch.device(args.device)
    objective, meta, resolved = load_cascade(args.backbone, args.tracking_uri)
    objective.to(device)
    cascade = objective.cascade
    manifest = load_manifest(args.data)
    args.test_split = eval_split(manifest, args.test_split)
    manifest.split(args.train_split)
    manifest.split(args.test_split)
    in_chans = int(meta["kwargs"]["in_chans"])
    startup.ready()  # the model is loaded: later GC passes skip it (ssl_vit/startup.py)

    def loader(split: str, holdout: float | None):
        return make_eval_loader(
            args.data,
            split,
            batch_size=args.batch_size,
            img_size=cascade.sizes[-1],
            num_workers=args.workers,
            holdout_fraction=holdout,
        )

    t0 = time.perf_counter()
    log.info("held-out part (%.3g) of %s", args.holdout_fraction, args.train_split)
    held_x, held_y = _images(loader(args.train_split, args.holdout_fraction), None)
    test_x, test_y = _images(loader(args.test_split, None), args.max_test)
    norm = objective.normalize
    size = args.batch_size
    held = dynamic.stage_outputs(
        cascade, zip(held_x.split(size), held_y.split(size), strict=True), norm, device
    )
    log.info("test: %d images through every stage", len(test_y))
    test = dynamic.stage_outputs(
        cascade, zip(test_x.split(size), test_y.split(size), strict=True), norm, device
    )

    costs = dynamic.stage_flops(cascade, in_chans, device)
    reach = np.cumsum(costs)
    alone = [dynamic.standalone_flops(cascade, s, in_chans) for s in range(cascade.num_stages)]
    budgets = np.linspace(reach[0], reach[-1], args.num_budgets)
    chosen = dynamic.choose_thresholds(held, costs, budgets, grid=args.grid)
    points = []
    for c in chosen:
        r = dynamic.simulate(test, c["thresholds"], costs)
        points.append(
            {**c, "top1": r["top1"], "gflops": r["mean_flops"] / 1e9, "exit_share": r["exit_share"]}
        )
    singles = _single_stages(cascade, held, test, alone, reach)
    finest = singles[-1]
    # The operating point, chosen on held-out: the least compute whose held-out accuracy
    # reaches the finest stage's held-out accuracy.
    ok = [p for p in points if p["held_top1"] >= finest["held_top1"]]
    matched = min(ok, key=lambda p: p["held_mean_flops"]) if ok else None
    metrics: dict[str, Any] = {
        "finest_top1": finest["top1"],
        "finest_gflops": finest["gflops_alone"],
        "num_test": len(test_y),
        "num_held_out": len(held_y),
    }
    speed: dict[str, Any] = {}
    if matched:
        xs = norm(test_x[: args.speed_images].to(device).float().div_(255))
        speed = _time_matched(cascade, matched["thresholds"], xs, args.batch_size, args.repeats)
        metrics.update(
            {
                "matched_top1": matched["top1"],
                "matched_gflops": matched["gflops"],
                "matched_gflops_ratio": matched["gflops"] / finest["gflops_alone"],
                "matched_top1_minus_finest": matched["top1"] - finest["top1"],
                "matched_speedup": speed["speedup"],
            }
        )
    return {
        "eval": "dynamic_vit",
        "params": {
            "backbone": resolved.uri or str(resolved.path),
            "data": normalise_root(args.data),
            "sizes": cascade.sizes,
            "feature_reuse": cascade.feature_reuse,
            "relation_reuse": cascade.relation_reuse,
            "holdout_fraction": args.holdout_fraction,
            "selection": "thresholds and the matched point chosen on the held-out part of "
            f"{args.train_split}; {args.test_split} is only reported",
            "device": str(device),
            "threads": torch.get_num_threads(),
        },
        "metrics": metrics,
        "reference": "finest_top1: the finest stage's test accuracy with every image run "
        "through every stage; finest_gflops and finest_images_per_s: that stage's ViT and "
        "classifier alone (what a single-stage model of this size costs). With a reuse on, "
        "the finest stage's accuracy also draws on the stages before it.",
        "stage_gflops": [c / 1e9 for c in costs],
        "singles": singles,
        "budgets": points,
        "matched": matched,
        "speed": speed,
        "pretrain_run_id": resolved.run_id or meta.get("mlflow_run_id"),
        "seconds": time.perf_counter() - t0,
    }


def _single_stages(
    cascade: Any, held: Any, test: Any, alone: list[float], reach: np.ndarray
) -> list[dict]:
    """Each stage as an operating point of its own: every image leaves at it, so stages 1..s
    run for all of them (`gflops_in_cascade`); `gflops_alone` is its ViT without the rest."""
    return [
        {
            "stage": s,
            "grid": list(cascade.stages[s].grid),
            "top1": float(test.correct[:, s].mean()),
            "held_top1": float(held.correct[:, s].mean()),
            "gflops_alone": alone[s] / 1e9,
            "gflops_in_cascade": float(reach[s]) / 1e9,
        }
        for s in range(cascade.num_stages)
    ]


def _time_matched(
    cascade: Any, thr: Any, xs: torch.Tensor, batch_size: int, repeats: int
) -> dict[str, Any]:
    """Images per second of batched early exit at thresholds `thr` against the finest stage
    alone, on the normalised images `xs`, with what the timing ran under."""
    last = cascade.stages[-1]
    # The single-stage reference runs timm's own forward (fused attention where torch has
    # it): the cascade must beat the fastest plain ViT, not our unfused blocks.
    fns = {
        "cascade_images_per_s": lambda x: cascade.early_exit(x, thr),
        "finest_images_per_s": lambda x: last.head(
            last.vit.forward_head(last.vit.forward_features(x), pre_logits=True)
        ),
        "finest_unfused_images_per_s": lambda x: last(x, None),
    }
    speed = dynamic.images_per_second(fns, xs, batch_size, repeats)
    speed.update(
        {
            "batch_size": batch_size,
            "images": len(xs),
            "repeats": repeats,
            "threads": torch.get_num_threads(),
            "load_avg": os.getloadavg(),
        }
    )
    speed["speedup"] = speed["cascade_images_per_s"] / speed["finest_images_per_s"]
    return speed


def report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    out = Path(args.out)
    png = optional_figure(
        "accuracy-vs-GFLOPs plot",
        plot,
        results["budgets"],
        results["singles"],
        results["matched"],
        out / "accuracy_vs_gflops.png",
        f"Dynamic ViT {results['params']['sizes']} on "
        f"{normalise_root(args.data).rstrip('/').rsplit('/', 1)[-1]}",
    )
    rows = {**results["metrics"]}
    for i, p in enumerate(results["budgets"]):
        rows[f"budget{i}_gflops"] = p["gflops"]
        rows[f"budget{i}_top1"] = p["top1"]
    print(format_table(f"dynamic_vit: {results['params']['backbone']}", results["metrics"]))
    for p in results["budgets"]:
        shares = " ".join(f"{100 * s:5.1f}%" for s in p["exit_share"])
        print(f"  {p['gflops']:.4f} GFLOPs  top1 {100 * p['top1']:6.2f}%  exits {shares}")
    path = write_results(out / "results.json", results)
    print(f"results: {path}", file=sys.stderr)
    if args.no_mlflow:
        return
    rid = log_to_mlflow(
        "dynamic_vit",
        rows,
        dict(results["params"]),
        parent_run_id=results["pretrain_run_id"],
        results_path=path,
        tracking_uri=args.tracking_uri,
        artifacts=(png,) if png else (),
    )
    if rid:
        results["mlflow_run_id"] = rid
        write_results(path, results)
