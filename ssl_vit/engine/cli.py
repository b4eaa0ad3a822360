"""Command line shared by the pretraining entry scripts in pipelines/."""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import shlex
import sys

from ssl_vit.config import FINETUNE_KINDS, ConfigError, load_config, validate
from ssl_vit.data.manifest import ManifestError
from ssl_vit.engine.preflight import check_backbone, check_data
from ssl_vit.logs import setup_logging

EPILOG = """\
overrides: any config key as key=value (YAML values), e.g.
  train.steps=200 optim.lr=1e-3 model.arch=vit_small_patch16_224 model.kwargs='{depth: 6}'

launch:
  python   pipelines/mpp_pretrain.py --config C        one process (CPU or one GPU)
  deepspeed --num_gpus 8 pipelines/mpp_pretrain.py --config C      one node, 8 ranks
  deepspeed --hostfile hosts --num_nodes 4 pipelines/mpp_pretrain.py --config C
Running the same command again resumes from RUN_DIR/checkpoints/latest.
SIGTERM or SIGUSR1 (run.stop_signals) stops at a step boundary with a checkpoint: exit 124.
"""


def parse(argv: list[str] | None, kind: str, description: str):
    p = argparse.ArgumentParser(
        description=description,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML preset (see configs/); defaults apply where it is silent")
    p.add_argument("--data", help="shard set: folder, URL, manifest file or pattern (data.root)")
    if kind == "finetune":
        p.add_argument(
            "--backbone",
            help="export folder, run directory or MLflow URI (runs:/ID/export, "
            "models:/NAME/VERSION, models:/NAME@ALIAS) to start from (model.init_from=...)",
        )
        p.add_argument(
            "--sweep",
            metavar="KEY=V1,V2,...",
            help="one run per value under run.dir, the value best on held-out data chosen "
            "(e.g. optim.lr=0.003,0.01,0.03,0.06, appendix B.1.1)",
        )
    p.add_argument("--check", action="store_true", help="validate the config and data, then exit")
    p.add_argument(
        "--world-sizes",
        metavar="N[,N...]",
        help="with --check: rank counts to check the batch split for, with the memory per GPU "
        "at each ZeRO stage (default: this launch's)",
    )
    p.add_argument(
        "--no-data",
        action="store_true",
        help="with --check: skip the checks against data.root (e.g. on a login node)",
    )
    p.add_argument("--gpu-gib", type=float, default=80.0, help="with --check: GPU memory (GiB)")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="also show the libraries' start-up lines"
    )
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed's
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_intermixed_args(argv)  # key=value overrides may also follow the flags
    overrides = list(args.overrides)
    if (
        kind != "mpp"
        and not any(o.startswith("objective.kind=") for o in overrides)
        and not (kind == "finetune" and _preset_kind(args.config) == "cascade")
    ):
        overrides.insert(0, f"objective.kind={kind}")  # a cascade preset keeps its kind
    if args.data:
        overrides.append(f"data.root={args.data}")
    if getattr(args, "backbone", None):
        overrides.append(f"model.init_from={args.backbone}")
    return args, overrides


def _preset_kind(path: str | None) -> str | None:
    """objective.kind as the preset file says (None if unreadable: load_config reports it)."""
    if not path:
        return None
    import yaml

    try:
        body = yaml.safe_load(open(path, encoding="utf-8")) or {}
        return (body.get("objective") or {}).get("kind")
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def _sweep():
    """ssl_vit.engine.sweep, fine-tuning's --sweep: loaded by name, as the objectives' registry
    loads the cascade, so the pretraining pipelines never reach it."""
    return importlib.import_module("ssl_vit.engine.sweep")


def _world_sizes(text: str | None, world: int) -> list[int]:
    if not text:
        return [world]
    try:
        sizes = [int(n) for n in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--world-sizes {text!r}: give positive rank counts, e.g. 1,8,32")
    return sizes


RANGES = {  # --check's line on a web server's answer to Range requests (None: not a server)
    None: [],
    True: ["  range requests: answered: streams start inside shards at their offsets"],
    False: [
        "  range requests: ignored by the server: streams read each shard from its start "
        "(counted in the reads above)"
    ],
}


def _describe_plan(cfg, plan, world: int) -> str:
    """--check's lines about the data: how long the run is in this data's epochs, how often an
    epoch reads the shard set, and the loader's processes against this machine's cores."""
    d, t = cfg.data, cfg.train
    length = (
        f"train.steps={t.steps} = {plan.epochs:.2f} epochs of this data"
        if t.steps
        else f"train.epochs={t.epochs:g} = {plan.total_steps} steps"
    )
    workers = d.num_workers
    cores = os.cpu_count() or 1
    reads = (
        "held in RAM or resampled: read once"
        if plan.read_factor == 1.0 and (d.resampled or d.in_memory is True)
        else f"each epoch reads the shard set {plan.read_factor:.2f} times"
    )
    return "\n".join(
        [
            f"{world} rank(s): {plan.num_train} of the "
            f"{plan.manifest.split(d.split).num_samples} {d.split!r} samples trained on; "
            f"{plan.steps_per_epoch} steps per epoch at train.global_batch={t.global_batch}",
            f"  length: {length} ({plan.total_steps * t.global_batch:.3g} images seen)",
            f"  reads: {reads} ({world} rank(s) x {max(1, workers)} workers = "
            f"{world * max(1, workers)} loader streams)",
            f"  loader: data.num_workers={workers} per rank, {workers + 1} processes per rank; "
            f"this machine has {cores} cores (room for {max(0, cores // (workers + 1))} rank(s) "
            "at one core per process)",
            *RANGES[plan.ranged],
        ]
    )


def _check(cfg, args, world: int) -> int:
    """--check: the config against each launch size (and the data unless --no-data)."""
    sizes = _world_sizes(args.world_sizes, world)
    in_chans = cfg.model.in_chans or 3
    plans = {}
    for n in sizes:
        validate(cfg, world_size=n)
        if not args.no_data:
            plans[n] = check_data(cfg, n)
            in_chans = cfg.model.in_chans or plans[n].manifest.channels
    # timm loads only now: a bad value or shard set answers before it (check_model loads it
    # itself when the data is checked).
    from ssl_vit.engine.gpu_memory import describe, estimate

    if args.no_data and not cfg.model.init_from:  # as check_data does: one line, not a traceback
        check_backbone(cfg, in_chans)
    precision = "fp32" if cfg.train.precision == "fp32" else "bf16"  # on a GPU
    for n in sizes:
        if n in plans:
            print(_describe_plan(cfg, plans[n], n))
        if not cfg.model.init_from:
            # GPU memory per rank at each ZeRO stage
            print(
                describe(
                    estimate(cfg, n, in_chans, precision),
                    n,
                    args.gpu_gib,
                    configured=cfg.train.zero_stage,
                )
            )
    ranks = ", ".join(str(n) for n in sizes)
    print(f"ok: {args.config or 'defaults'} is valid for {ranks} rank(s)")
    return 0


def main(kind: str, description: str, argv: list[str] | None = None) -> int:
    """Parse, validate, train; configuration and data errors exit 2 with one line, no traceback;
    a stop on a signal (`ssl_vit.engine.distributed.StopSignals`) exits STOPPED_EXIT."""
    args, overrides = parse(argv, kind, description)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(args.verbose, level=logging.INFO if rank == 0 else logging.WARNING)
    header = "# " + shlex.join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])])
    try:
        cfg = load_config(args.config, overrides)
        if kind == "supervised" and cfg.objective.kind not in ("supervised", "joint"):
            raise ConfigError("supervised_pretrain.py: objective.kind must be supervised or joint")
        if kind == "finetune" and cfg.objective.kind not in FINETUNE_KINDS:
            raise ConfigError("finetune.py: objective.kind must be finetune or cascade")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        validate(cfg, world_size=world)
        if getattr(args, "sweep", None):
            sweep = _sweep()
            sweep.check_sweep(args.config, overrides, *sweep.parse_sweep(args.sweep))
        if args.check:
            return _check(cfg, args, world)
    except (ConfigError, ManifestError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # DeepSpeed loads only now (seconds): a bad config or --check answers without it.
    from ssl_vit.data.shards import ShardReadError
    from ssl_vit.engine.checkpoint import CheckpointError
    from ssl_vit.engine.distributed import STOPPED_EXIT, BarrierTimeout, Stopped, shutdown
    from ssl_vit.engine.trainer import NonFiniteLossError, train

    try:
        if getattr(args, "sweep", None):
            _sweep().run_sweep(args.config, overrides, args.sweep, header, train)
        else:
            train(cfg, header=header)
        shutdown()  # every rank is past the last barrier
    except (ConfigError, ManifestError, CheckpointError, BarrierTimeout, ShardReadError) as e:
        # ShardReadError: data.missing_shards=error, after the read's retries
        line = e.one_line() if isinstance(e, ShardReadError) else e
        print(f"error: {line}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or e.filename is None:
            raise
        print(f"error: {e.filename}: {e.strerror} (a full disk or quota): free space on that "
              "file system, then relaunch (the run resumes from its last complete checkpoint)",
              file=sys.stderr)  # fmt: skip
        return 2
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except Stopped as e:
        shutdown()  # every rank is past the stop's barrier
        if rank == 0:
            print(e, file=sys.stderr)
        return STOPPED_EXIT
    return 0
