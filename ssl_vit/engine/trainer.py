"""The pretraining loop shared by MPP, supervised and joint pretraining, on DeepSpeed.

One function, `train(cfg)`, run by every rank:
  set up the process group -> build backbone + objective -> DeepSpeed engine -> resume from
  RUN/checkpoints/latest if present -> stream shards, step, log, checkpoint -> export backbone.

Running the same command again resumes the same run: model, optimizer, scheduler, step, data
position (epoch and batch) and MLflow run. Randomness is re-seeded from (seed, rank, step) at
every step, so a resumed run draws the same masks and augmentations it would have drawn.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

from ssl_vit.config import Config, ConfigError, local_batch, save_config
from ssl_vit.data.manifest import Manifest, atomic_write_text, check_shards_exist, load_manifest
from ssl_vit.engine import checkpoint
from ssl_vit.engine.distributed import all_reduce_sum, barrier, device_for, init_distributed
from ssl_vit.engine.optim import deepspeed_config, make_optimizer, resolve_precision
from ssl_vit.engine.progress import MetricWindow, Progress, write_loss_plot

log = logging.getLogger("ssl_vit.train")


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss."""


def _check_run_dir(run_dir: Path, cfg: Config) -> None:
    """A run directory belongs to one model and objective: refuse to resume a different one."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return
    import yaml

    old = yaml.safe_load(saved.read_text())
    for section in ("model", "objective"):
        if old.get(section) != cfg.to_dict()[section]:
            raise ConfigError(
                f"{saved}: this run directory holds a run with a different {section} config; "
                "use another run.dir (or delete this one) to start a new run"
            )


def _build(cfg: Config, manifest: Manifest, in_chans: int):
    from ssl_vit.models import build_backbone
    from ssl_vit.objectives import build_objective

    m, o = cfg.model, cfg.objective
    backbone = build_backbone(
        m.arch, img_size=m.img_size, in_chans=in_chans, patch_size=m.patch_size, **m.kwargs
    )
    objective = build_objective(
        o.kind,
        backbone,
        patch_size=m.patch_size,
        in_chans=in_chans,
        mean=manifest.mean,
        std=manifest.std,
        num_classes=manifest.num_classes,
        corrupt_ratio=o.corrupt_ratio,
        mask_prob=o.mask_prob,
        random_prob=o.random_prob,
        target=o.target,
        bits=o.bits,
        label_smoothing=o.label_smoothing,
        mpp_weight=o.mpp_weight,
        supervised_weight=o.supervised_weight,
    )
    return backbone, objective


def check_data(cfg: Config, world: int) -> tuple[Manifest, int, int]:
    """Validate the config against the shard set; returns (manifest, steps/epoch, total steps)."""
    local_batch(cfg, world)
    manifest = load_manifest(cfg.data.root)
    split = manifest.split(cfg.data.split)
    if cfg.data.missing_shards == "error":
        check_shards_exist(manifest, cfg.data.split)
    if cfg.objective.kind != "mpp" and manifest.num_classes is None:
        raise ConfigError(
            f"objective.kind={cfg.objective.kind!r} needs labels, but {cfg.data.root} is "
            "unlabelled; use objective.kind=mpp or a labelled shard set"
        )
    in_chans = cfg.model.in_chans or manifest.channels
    if in_chans != manifest.channels:
        raise ConfigError(
            f"model.in_chans={in_chans} but the shards in {cfg.data.root} have "
            f"{manifest.channels} channel(s); drop model.in_chans to follow the data"
        )
    steps_per_epoch = split.num_samples // cfg.train.global_batch
    if steps_per_epoch == 0:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} exceeds the {split.num_samples} "
            f"samples of split {cfg.data.split!r}; lower the batch"
        )
    total_steps = cfg.train.steps or math.ceil(cfg.train.epochs * steps_per_epoch)
    return manifest, steps_per_epoch, total_steps


def train(cfg: Config, header: str = "") -> Path:
    """Pretrain as `cfg` says; returns the export folder. Every rank calls this."""
    import deepspeed

    from ssl_vit.data.stream import make_train_loader
    from ssl_vit.models import export_backbone
    from ssl_vit.perf import count_train_flops, measure_matmul_peak
    from ssl_vit.tracking import Tracker

    rank, local_rank, world = init_distributed()
    per_rank, micro, accum = local_batch(cfg, world)
    device = device_for(local_rank)
    precision = resolve_precision(cfg.train.precision)

    manifest, steps_per_epoch, total_steps = check_data(cfg, world)
    in_chans = cfg.model.in_chans or manifest.channels

    run_dir = Path(cfg.run.dir)
    ckpt_dir = run_dir / "checkpoints"
    if rank == 0:
        _check_run_dir(run_dir, cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml", header)
    barrier()

    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
    backbone, objective = _build(cfg, manifest, in_chans)
    optimizer, scheduler = make_optimizer(objective, cfg, total_steps)
    ds_config = deepspeed_config(cfg, world, micro, accum, precision)
    if rank == 0:
        atomic_write_text(run_dir / "ds_config.json", json.dumps(ds_config, indent=2))
    engine, _, _, _ = deepspeed.initialize(
        model=objective, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    if cfg.train.compile and device.type == "cuda":
        engine.compile()
    cpu_autocast = device.type == "cpu" and precision == "bf16"

    state = checkpoint.load(engine, ckpt_dir) or {}
    step = int(state.get("step", 0))

    run_id_file = run_dir / "mlflow_run_id"
    tracker = Tracker(
        enabled=rank == 0,
        experiment=cfg.tracking.experiment,
        run_name=cfg.tracking.run_name or run_dir.name,
        run_id=run_id_file.read_text().strip() if run_id_file.is_file() else None,
        tracking_uri=cfg.tracking.uri,
        spool_dir=run_dir / "mlflow_spool",
    )
    if rank == 0:
        if tracker.run_id and not run_id_file.is_file():
            atomic_write_text(run_id_file, tracker.run_id + "\n")
        if step == 0:
            tracker.log_params(
                {**cfg.to_dict(), "derived": {"world_size": world, "accum": accum, "micro": micro}}
            )
            tracker.log_artifact(run_dir / "config.yaml")
            tracker.log_artifact(run_dir / "ds_config.json")

    # Model FLOPs of one optimizer step, counted once on a real-shaped batch (rank 0 only;
    # every rank does the same work). The matmul peak is measured now, at the same precision.
    flops_per_step = peak = 0.0
    if rank == 0:
        x = torch.rand(micro, in_chans, cfg.model.img_size, cfg.model.img_size, device=device)
        y = torch.zeros(micro, dtype=torch.long, device=device)
        with torch.autocast("cpu", torch.bfloat16, enabled=cpu_autocast):
            flops_per_step = count_train_flops(engine.module, x, y) * accum * world
        engine.module.zero_grad(set_to_none=True)
        peak = measure_matmul_peak(torch.bfloat16 if precision == "bf16" else torch.float32, device)

    window = MetricWindow(device, cfg.train.global_batch)
    metrics_file = run_dir / "metrics.jsonl"
    if rank == 0:
        window.truncate_file(metrics_file, step)  # drop lines past the checkpoint we resumed
    progress = Progress(total_steps, step, enabled=rank == 0)
    nonfinite_in_row = int(state.get("nonfinite_in_row", 0))
    nonfinite_total = int(state.get("nonfinite_total", 0))

    while step < total_steps:
        epoch, skip = divmod(step, steps_per_epoch)
        loader = make_train_loader(
            cfg.data.root,
            cfg.data.split,
            global_batch=cfg.train.global_batch,
            rank=rank,
            world_size=world,
            num_workers=cfg.data.num_workers,
            img_size=cfg.model.img_size,
            seed=cfg.run.seed,
            epoch=epoch,
            skip_batches=skip,
            augment=cfg.data.augment,
            scale=cfg.data.crop_scale,
            hflip=cfg.data.hflip,
            missing=cfg.data.missing_shards,
        )
        batches = iter(loader)
        while step < total_steps:
            t0 = time.perf_counter()
            try:
                images, labels = next(batches)
            except StopIteration:
                break
            t_data = time.perf_counter() - t0
            torch.manual_seed(cfg.run.seed * 1_000_003 + rank * 7_919 + step)
            images = images.to(device, non_blocking=True).float().div_(255)  # (B, C, H, W) in [0,1]
            labels = labels.to(device, non_blocking=True)
            bad = torch.zeros((), device=device)
            for i, (x, y) in enumerate(zip(images.split(micro), labels.split(micro), strict=True)):
                with torch.autocast("cpu", torch.bfloat16, enabled=cpu_autocast):
                    loss, metrics = engine(x, y)
                bad += ~torch.isfinite(loss.detach())
                engine.backward(loss)
                if i == accum - 1:
                    # Skip the whole optimizer step on every rank if any rank saw inf/nan.
                    if all_reduce_sum(bad).item() > 0:
                        optimizer.skip_next = True
                        nonfinite_in_row += 1
                        nonfinite_total += 1
                    else:
                        nonfinite_in_row = 0
                engine.step()
                window.add(loss.detach(), metrics)
            step += 1
            if nonfinite_in_row >= cfg.run.max_nonfinite_steps:
                raise NonFiniteLossError(
                    f"{nonfinite_in_row} steps in a row had a non-finite loss (at step {step}); "
                    f"stopping. The last good checkpoint is kept in {ckpt_dir}; lower optim.lr "
                    "or check the data"
                )
            window.end_step(t_data)
            if step % cfg.run.log_every == 0 or step == total_steps:
                extra = {
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                    "epoch": epoch + (skip + 1) / steps_per_epoch,
                    "samples_seen": step * cfg.train.global_batch,
                    "nonfinite_steps": nonfinite_total,
                    "skipped_samples": getattr(loader, "num_skipped", 0),
                }
                row = window.flush(extra, flops_per_step, peak, world)
                if rank == 0:
                    tracker.log_metrics(row, step=step)
                    with open(metrics_file, "a") as f:
                        f.write(json.dumps({"step": step, **row}) + "\n")
                progress.update(step, row)
            else:
                progress.update(step, None)
            if step % cfg.run.checkpoint_every == 0 or step == total_steps:
                train_state = {
                    "step": step,
                    "epoch": epoch,
                    "nonfinite_in_row": nonfinite_in_row,
                    "nonfinite_total": nonfinite_total,
                    "world_size": world,
                }
                checkpoint.save(engine, ckpt_dir, step, train_state, rank, cfg.run.keep_checkpoints)
    progress.close()

    export_dir = run_dir / "export"
    params = list(engine.module.backbone.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if rank == 0:
            export_backbone(
                engine.module.backbone,
                export_dir,
                arch=cfg.model.arch,
                kwargs={
                    "img_size": cfg.model.img_size,
                    "in_chans": in_chans,
                    "patch_size": cfg.model.patch_size,
                    **cfg.model.kwargs,
                },
                mean=manifest.mean,
                std=manifest.std,
                extra={
                    "mlflow_run_id": tracker.run_id,
                    "step": step,
                    "objective": cfg.objective.kind,
                },
            )
    if rank == 0:
        plot = write_loss_plot(metrics_file, run_dir / "loss_curve.png")
        for path in (export_dir, plot):
            if path is not None:
                tracker.log_artifact(path)
        tracker.close()
        log.info(
            "done: %d steps; backbone exported to %s; MLflow run %s",
            step,
            export_dir,
            tracker.run_id,
        )
    barrier()
    sys.stdout.flush()
    return export_dir
