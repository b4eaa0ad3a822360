"""Inspect a ViT the way the paper does (section 4.5, figure 7) and log the plots to MLflow.

    python evals/inspect_vit.py --backbone runs/mpp_ti --data shards/fmnist \
        --out runs/mpp_ti/inspect
    python evals/inspect_vit.py --random-init vit_tiny_patch16_224 --patch-size 4 \
        --data shards/fmnist --out runs/inspect_random     # untrained baseline

Writes embedding_filters.png, position_similarity.png, attention_distance.png,
attention_rollout.png (and mpp_predictions.png for an MPP run) plus inspect.json under --out,
and logs them to an MLflow run (MLFLOW_TRACKING_URI, default sqlite:///mlflow.db) tagged with
the pretraining run's id when --backbone is a run directory.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ssl_vit import startup
from ssl_vit.data.manifest import check_shards_exist, load_manifest
from ssl_vit.evaluation.cli import add_verbose_arg, backbone_source, run_main
from ssl_vit.evaluation.report import pretrain_run_id
from ssl_vit.logs import OneLineParser
from ssl_vit.registry import resolve_export
from ssl_vit.tracking import Tracker

if TYPE_CHECKING:  # torch, timm and matplotlib load after the arguments parse
    import torch

log = logging.getLogger("inspect_vit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--backbone",
        type=backbone_source,
        help="export folder, pretraining run directory, or MLflow URI (runs:/ID/export, "
        "models:/NAME/VERSION, models:/NAME@ALIAS)",
    )
    src.add_argument("--random-init", metavar="ARCH", help="timm arch, untrained (a baseline)")
    p.add_argument("--data", required=True, help="shard set: a folder or URL with manifest.json")
    p.add_argument("--split", default="test", help="split to draw images from (default: test)")
    p.add_argument("--out", type=Path, required=True, help="folder for the PNGs and inspect.json")
    p.add_argument(
        "--num-images", type=int, default=64, help="images averaged for attention distance"
    )
    p.add_argument("--num-show", type=int, default=8, help="images shown in the rollout plot")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--img-size", type=int, default=None, help="input size (default: the model's)")
    p.add_argument("--patch-size", type=int, default=None, help="with --random-init")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--experiment", default="inspect", help="MLflow experiment name")
    p.add_argument("--seed", type=int, default=0, help="seed of the MPP corruption shown")
    p.add_argument("--no-mpp", action="store_true", help="skip the MPP predictions panel")
    p.add_argument("--no-mlflow", action="store_true", help="only write the files")
    add_verbose_arg(p)
    return p.parse_args(argv)


def read_images(data: str, split: str, n: int, size: int, batch: int) -> torch.Tensor:
    """The first n images of the split, in order, as (n, C, size, size) float in [0, 1]."""
    import torch

    from ssl_vit.data.stream import make_eval_loader

    loader = make_eval_loader(data, split, batch_size=batch, img_size=size, num_workers=0)
    out, got = [], 0
    for images, _ in loader:
        out.append(images[: n - got])
        got += out[-1].shape[0]
        if got >= n:
            break
    if not got:
        raise SystemExit(f"{data}: split {split!r} holds no decodable images")
    return torch.cat(out).float() / 255.0


def load_mpp_objective(path: Path, model: torch.nn.Module, mean, std) -> torch.nn.Module | None:
    """The MPP objective exported beside the backbone ([mask] token and head), or None."""
    from ssl_vit.objectives import MaskedPatchPrediction
    from ssl_vit.objectives.export import load_objective

    objective = load_objective(path, model, mean, std)
    objective = getattr(objective, "mpp", objective)  # a joint objective's MPP half
    if not isinstance(objective, MaskedPatchPrediction):
        log.warning("%s: the export holds no MPP head; skipping the MPP panel", path)
        return None
    return objective


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    manifest = load_manifest(args.data)
    check_shards_exist(manifest, args.split)
    import numpy as np  # torch, timm and matplotlib load once the arguments and data check out
    import torch

    from ssl_vit.inspect import inspect_model
    from ssl_vit.models import build_backbone, load_backbone, token_geometry
    from ssl_vit.objectives import MaskedPatchPrediction

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    parent_run, mpp = None, None
    if args.backbone is not None:
        source = resolve_export(args.backbone)  # a path, or an MLflow URI (downloaded, cached)
        model, meta = load_backbone(source.path, img_size=args.img_size)
        mean, std, name = meta["mean"], meta["std"], meta["arch"]
        # The pretraining run: the URI's run, RUN_DIR/mlflow_run_id, or the export's record.
        parent_run = source.run_id or pretrain_run_id(source.path, meta)
        if not args.no_mpp:
            try:
                mpp = load_mpp_objective(source.path, model, mean, std)
            except (ValueError, KeyError) as e:  # an export that does not match
                log.warning("%s: no MPP panel (%s)", args.backbone, e)
    else:
        size = args.img_size or (min(manifest.image_size) if manifest.image_size else None)
        if size is None:
            raise SystemExit(f"{args.data}: images vary in size; pass --img-size")
        model = build_backbone(
            args.random_init, img_size=size, in_chans=manifest.channels, patch_size=args.patch_size
        )
        mean, std, name = manifest.mean, manifest.std, f"{args.random_init} (random init)"
        if not args.no_mpp:  # an untrained head: the chance-level baseline of the MPP panel
            mpp = MaskedPatchPrediction(model, mean=mean, std=std)
    geo = token_geometry(model)
    if geo.in_chans != manifest.channels:
        raise SystemExit(
            f"{args.data}: images have {manifest.channels} channels, the backbone takes "
            f"{geo.in_chans}; pick a matching shard set or backbone"
        )
    size = geo.img_size[0]
    model.to(args.device)
    if mpp is not None:
        mpp.to(args.device)
    startup.ready()  # the model is loaded: later GC passes skip it (ssl_vit/startup.py)
    images = read_images(args.data, args.split, args.num_images, size, args.batch_size)
    log.info("inspecting %s on %d %s images of %s", name, len(images), args.split, args.data)
    summary = inspect_model(
        model,
        images,
        args.out,
        mean=mean,
        std=std,
        batch_size=args.batch_size,
        num_show=args.num_show,
        title=name,
        mpp=mpp,
        seed=args.seed,
    )
    if not args.no_mlflow:  # $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
        tags = {"ssl_vit.job": "inspect_vit", "ssl_vit.backbone": name}
        if parent_run:
            tags["ssl_vit.pretrain_run_id"] = parent_run
        with Tracker(
            enabled=True,
            experiment=args.experiment,
            run_name=f"inspect {name}",
            tags=tags,
            spool_dir=args.out / ".mlflow-spool",
            system_metrics=False,
        ) as tracker:
            tracker.log_params(
                {"data": str(args.data), "split": args.split, "num_images": summary["num_images"]}
            )
            for layer, heads in enumerate(summary.get("mean_attention_distance_px", [])):
                tracker.log_metrics({"mean_attention_distance_px": float(np.mean(heads))}, layer)
            for path in [*summary["pngs"].values(), args.out / "inspect.json"]:
                tracker.log_artifact(path, artifact_path="inspect")
    log.info("wrote %s", ", ".join(sorted(summary["pngs"].values())))
    for plot, why in summary.get("not_applicable", {}).items():
        print(f"{plot}: {why}")
    return summary


def cli(argv: list[str] | None = None) -> int:
    main(argv)
    return 0


if __name__ == "__main__":
    startup.begin()  # no GC passes over the modules it loads (ssl_vit/startup.py)
    sys.exit(run_main(cli))  # bad input: a one-line error, exit 2
