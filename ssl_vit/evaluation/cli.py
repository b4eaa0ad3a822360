"""What the evals/*.py entry scripts share: backbone/data arguments, features, reporting.

Importable without torch: the scripts parse their arguments first, so `--help` and a bad
argument answer at once; torch, timm and FAISS load with the first feature work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ssl_vit import startup
from ssl_vit.data.manifest import Manifest, ManifestError, load_manifest
from ssl_vit.data.urls import normalise_root
from ssl_vit.evaluation.options import DEFAULT_CACHE_DIR, POOLS
from ssl_vit.evaluation.report import format_table, log_to_mlflow, pretrain_run_id, write_results
from ssl_vit.logs import first_line, setup_logging, wants_verbose
from ssl_vit.registry import MLFLOW_SCHEMES, resolve_export

if TYPE_CHECKING:
    import numpy as np

    from ssl_vit.features import EvalBackbone, FeatureSet


def add_verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-v", "--verbose", action="store_true", help="also show the libraries' start-up lines"
    )


def backbone_source(value: str) -> str:
    """`--backbone` as given, checked while the arguments are parsed: an MLflow URI, or a folder
    that exists (a mistyped path answers before torch loads; what the folder holds is checked
    when it is read)."""
    if value.startswith(MLFLOW_SCHEMES) or os.path.isdir(value):
        return value
    raise argparse.ArgumentTypeError(
        f"{value}: no such backbone folder; pass an export folder or run dir"
    )


def add_common_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--backbone",
        type=backbone_source,
        help="export folder (backbone.safetensors + .json), run dir, or an MLflow URI: "
        "runs:/RUN_ID/export, models:/NAME/VERSION, models:/NAME@ALIAS",
    )
    src.add_argument("--random-init", metavar="ARCH", help="baseline: a random timm backbone")
    src.add_argument(
        "--raw-pixels", action="store_true", help="baseline: the normalised pixels as features"
    )
    p.add_argument(
        "--data",
        required=True,
        help="shard set: a folder or URL holding manifest.json (http(s), s3, gs, file, "
        "pipe:), a manifest file kept apart from its shards, or a brace pattern of shards",
    )
    p.add_argument("--train-split", default="train", help="gallery / fitting split")
    p.add_argument(
        "--test-split",
        default=None,
        help="evaluation split (default: test, or val where the shard set has no test split)",
    )
    p.add_argument(
        "--pool",
        choices=POOLS,
        default="auto",
        help="[class] token, mean of patch tokens, last n blocks' [class] tokens, or the patch "
        "tokens concatenated (tokens); auto: [class] when the pretraining trained it "
        "(supervised), else the patch-token mean (MPP)",
    )
    p.add_argument(
        "--layer",
        type=_layer_arg,
        default=None,
        help="read block N (from 1) instead of the last; auto: choose the block, and with "
        "--pool auto the pooling (mean, tokens, trained [class]), by kNN on the held-out 2%% "
        "of the training split (never the test split)",
    )
    p.add_argument("--n-last", type=int, default=4, help="blocks concatenated by --pool lastn")
    p.add_argument(
        "--img-size",
        type=int,
        default=None,
        help="input size (default: the export's; random init: the shards')",
    )
    p.add_argument("--in-chans", type=int, default=None, help="random init: input channels")
    p.add_argument("--patch-size", type=int, default=None, help="random init: patch size")
    p.add_argument("--seed", type=int, default=0, help="random init: weight seed")
    p.add_argument(
        "--model-kwargs",
        type=json.loads,
        default={},
        help="random init: more build_backbone kwargs as JSON, e.g. '{\"depth\": 2}'",
    )
    p.add_argument("--batch-size", type=int, default=256, help="feature extraction batch")
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="data loader workers (default: the cores, at most 8)",
    )
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="feature cache folder")
    p.add_argument("--no-cache", action="store_true", help="always recompute features")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast for extraction (default: on for CUDA, off for CPU)",
    )
    p.add_argument("--out", default=None, help="results JSON (default: print only)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    add_verbose_arg(p)
    p.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)",
    )
    p.add_argument(
        "--parent-run-id",
        default=None,
        help="MLflow run to nest this eval's run under (default: the pretraining run)",
    )


def add_train_indices_arg(p: argparse.ArgumentParser, fits: str) -> None:
    p.add_argument(
        "--train-indices",
        metavar="JSON",
        default=None,
        help=f"{fits} on these samples of the training split only: a JSON list of their "
        "manifest indices, sorted (a data.subset_file fits); the test split is scored whole. "
        "The file's sha256 and count go in the results",
    )


def read_train_indices(args: argparse.Namespace, manifest: Manifest) -> np.ndarray | None:
    """The indices `--train-indices` lists, checked against the training split (None without
    it); their file, digest and count are kept in args.train_indices_record for the results."""
    args.train_indices_record = None
    path = getattr(args, "train_indices", None)
    if path is None:
        return None
    from ssl_vit.data.holdout import read_subset_file
    from ssl_vit.io import sha256_file

    try:
        idx = read_subset_file(path, manifest.split(args.train_split).num_samples, 0.0)
    except ValueError as e:
        raise ValueError(f"--train-indices: {e}") from None
    args.train_indices_record = {
        "train_indices": str(path),
        "train_indices_sha256": sha256_file(path),
        "train_indices_count": len(idx),
    }
    return idx


def select_rows(fs: FeatureSet, indices: np.ndarray, num_samples: int, where: str) -> FeatureSet:
    """The rows of a split's features at these manifest indices. The features hold one row per
    sample in manifest order only when every sample was readable (the loader passes over a
    corrupt one), so anything else is refused rather than a row taken for another image."""
    from ssl_vit.features import FeatureError

    if len(fs.labels) != num_samples:
        raise FeatureError(
            f"{where}: {len(fs.labels)} of its {num_samples} training samples were readable, so "
            "feature rows no longer match manifest indices and --train-indices cannot pick "
            "them; repair the set (data_prep/verify_shards.py)"
        )
    return dataclasses.replace(fs, features=fs.features[indices], labels=fs.labels[indices])


def _layer_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        layer = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: give a block number (from 1) or auto"
        ) from None
    if layer < 1:
        raise argparse.ArgumentTypeError(f"{value}: blocks are numbered from 1")
    return layer


def choose_readout(args: argparse.Namespace, bb: EvalBackbone, kw: dict[str, Any]) -> None:
    """--layer auto: set args.layer and args.pool to the read-out best on held-out training
    data, keeping every candidate's score in args.readout_selection for the results."""
    from ssl_vit.evaluation.readout_select import select_readout
    from ssl_vit.features import FeatureError, resolve_pool

    pools: tuple[str, ...] = (args.pool,)
    if args.pool == "auto":  # [class] only where the pretraining trained it (resolve_pool)
        pools = (
            ("mean", "tokens", "cls") if resolve_pool(bb, "auto") == "cls" else ("mean", "tokens")
        )
    if args.pool == "lastn":
        raise FeatureError("--layer auto chooses one block; --pool lastn reads several")
    sel = select_readout(
        bb, args.data, args.train_split, pools=pools, batch_size=kw["batch_size"],
        num_workers=kw["num_workers"], cache_dir=kw["cache_dir"], device=kw["device"],
        bf16=kw["bf16"],
    )  # fmt: skip
    args.layer, args.pool, args.readout_selection = sel["layer"], sel["pool"], sel
    print(
        f"read-out {sel['name']}: best of {len(sel['scores'])} by {sel['criterion']} "
        f"({sel['scores'][sel['name']]:.2%})",
        file=sys.stderr,
    )


def load_backbone_from_args(args: argparse.Namespace) -> EvalBackbone:
    from ssl_vit.features import (
        FeatureError,
        load_eval_backbone,
        random_backbone,
        raw_pixels_backbone,
    )

    if args.backbone:
        resolved = resolve_export(args.backbone, tracking_uri=args.tracking_uri)
        bb = load_eval_backbone(resolved.path, img_size=args.img_size)
        if resolved.uri:  # lineage: the URI as given, and the run that logged the export
            bb.source, bb.source_run_id = resolved.uri, resolved.run_id
        return bb
    m = load_manifest(args.data)
    size = args.img_size or (min(m.image_size) if m.image_size else None)  # the centre square
    if size is None:
        raise FeatureError(f"{args.data}: images have mixed sizes; pass --img-size")
    chans = args.in_chans or m.channels
    if args.raw_pixels:
        return raw_pixels_backbone(img_size=size, in_chans=chans, mean=m.mean, std=m.std)
    return random_backbone(
        args.random_init,
        img_size=size,
        in_chans=chans,
        patch_size=args.patch_size,
        mean=m.mean,
        std=m.std,
        seed=args.seed,
        **args.model_kwargs,
    )


def eval_split(manifest: Manifest, requested: str | None) -> str:
    """The split evaluations report on: the one asked for, else test, else val (a set made
    from photos by class folders has train and val only)."""
    if requested:
        return requested
    for name in ("test", "val"):
        if name in manifest.splits:
            return name
    raise ManifestError(
        f"{manifest.root}: has neither a test nor a val split (it has {sorted(manifest.splits)}); "
        "pass --test-split"
    )


def features_from_args(args: argparse.Namespace) -> tuple[EvalBackbone, FeatureSet, FeatureSet]:
    import torch

    from ssl_vit.features import resolve_pool, split_features

    manifest = load_manifest(args.data)
    args.test_split = eval_split(manifest, args.test_split)
    for split in (args.train_split, args.test_split):  # fail before any model or feature work
        manifest.split(split)
    subset = read_train_indices(args, manifest)
    bb = load_backbone_from_args(args)
    kw: dict[str, Any] = dict(
        n_last=args.n_last,
        batch_size=args.batch_size,
        num_workers=args.workers,
        cache_dir=None if args.no_cache else args.cache_dir,
        device=torch.device(args.device) if args.device else None,
        bf16=args.bf16,
    )
    args.readout_selection = None
    if args.layer == "auto":
        choose_readout(args, bb, kw)
    args.pool = resolve_pool(bb, args.pool)  # recorded in the results as what was used
    startup.ready()  # the models are loaded: later GC passes skip them (ssl_vit/startup.py)
    kw.update(pool=args.pool, layer=args.layer)
    train = split_features(bb, args.data, args.train_split, **kw)
    if subset is not None:  # the whole split's features are cached; the subset is rows of them
        n = manifest.split(args.train_split).num_samples
        train = select_rows(train, subset, n, manifest.where)
    test = split_features(bb, args.data, args.test_split, **kw)
    return bb, train, test


def report(
    args: argparse.Namespace,
    eval_name: str,
    bb: EvalBackbone,
    metrics: dict[str, Any],
    options: dict[str, Any],
    seconds: float,
) -> dict[str, Any]:
    """Print the table, write the JSON, log to MLflow; return the results dict."""
    parent = (
        (bb.source_run_id or pretrain_run_id(args.backbone, bb.meta)) if args.backbone else None
    )
    params = {
        "backbone": bb.source,
        "backbone_id": bb.ident,
        "arch": bb.meta.get("arch"),
        "data": normalise_root(args.data),
        "train_split": args.train_split,
        "test_split": args.test_split,
        "pool": args.pool if args.pool != "lastn" else f"lastn{args.n_last}",
        "layer": args.layer if args.layer is not None else "last",
        "img_size": bb.img_size,
        **(getattr(args, "train_indices_record", None) or {}),
        **options,
    }
    results = {
        "eval": eval_name,
        "params": params,
        "metrics": metrics,
        "pretrain_run_id": parent,
        "seconds": seconds,
    }
    if getattr(args, "readout_selection", None):  # --layer auto: what was chosen, and how
        results["readout_selection"] = args.readout_selection
        params["readout_chosen_by"] = args.readout_selection["criterion"]
    print(format_table(f"{eval_name}: {bb.source} on {args.data}", metrics))
    if args.out:
        write_results(args.out, results)
        print(f"results: {args.out}", file=sys.stderr)
    if not args.no_mlflow:
        rid = log_to_mlflow(
            eval_name,
            metrics,
            params,
            parent_run_id=parent,
            results_path=args.out,
            tracking_uri=args.tracking_uri,
            nest_under=getattr(args, "parent_run_id", None),
        )
        results["mlflow_run_id"] = rid
        if rid and args.out:  # keep the JSON complete: it now names its MLflow run
            write_results(args.out, results)
    return results


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run an eval's main; bad input becomes a one-line error and exit status 2."""
    # Progress lines (features, probe sweep) go through logging when stderr is not a TTY;
    # library start-up lines only with -v (read here: the parser runs inside `main`).
    setup_logging(wants_verbose(argv), fmt="%(asctime)s %(name)s: %(message)s", datefmt=None)
    from ssl_vit.data.shards import ShardReadError

    try:
        return main(argv)
    except ShardReadError as e:  # a shard unreadable after its retries (in a loader worker)
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 2
    except (ManifestError, FileNotFoundError, ValueError) as e:  # FeatureError is a ValueError
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
