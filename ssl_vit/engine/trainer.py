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
import sys
import time
from pathlib import Path

import deepspeed
import torch

from ssl_vit.config import Config, ConfigError, holdout_fraction, local_batch, save_config
from ssl_vit.data.manifest import atomic_write_text
from ssl_vit.data.stream import make_train_loader
from ssl_vit.engine import checkpoint
from ssl_vit.engine.build import build_from_config, export_run
from ssl_vit.engine.distributed import all_reduce_sum, barrier, device_for, init_distributed
from ssl_vit.engine.evaluate import InTrainingEvals
from ssl_vit.engine.optim import (
    deepspeed_config,
    make_optimizer,
    measure_step_seconds,
    resolve_precision,
)
from ssl_vit.engine.preflight import check_data
from ssl_vit.engine.progress import MetricWindow, Progress, write_loss_plot
from ssl_vit.perf import count_train_flops, measure_matmul_peak
from ssl_vit.tracking import Tracker

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


def _is_log_step(step: int, every: int, total: int) -> bool:
    return step % every == 0 or step == total


def _grad_norm(module: torch.nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def _train_step(
    engine: deepspeed.DeepSpeedEngine,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    micro: int,
    cpu_autocast: bool,
    window: MetricWindow,
    want_grad_norm: bool,
) -> tuple[bool, float]:
    """One optimizer step over the rank's batch, in micro-batches; returns (finite, grad norm).

    A non-finite loss on any rank skips the optimizer step on every rank (weights and moments
    untouched); the step still counts, so the data and schedule stay aligned.
    """
    device = engine.device
    images = images.to(device, non_blocking=True).float().div_(255)  # (B, C, H, W) in [0, 1]
    labels = labels.to(device, non_blocking=True)
    chunks = list(zip(images.split(micro), labels.split(micro), strict=True))
    bad = torch.zeros((), device=device)
    grad_norm = 0.0
    for i, (x, y) in enumerate(chunks):
        with torch.autocast("cpu", torch.bfloat16, enabled=cpu_autocast):
            loss, metrics = engine(x, y)
        bad += ~torch.isfinite(loss.detach())
        engine.backward(loss)
        if i == len(chunks) - 1:  # the accumulation boundary: grads are all-reduced now
            finite = all_reduce_sum(bad).item() == 0
            optimizer.skip_next = not finite
            if want_grad_norm:
                grad_norm = _grad_norm(engine.module)
        engine.step()
        window.add(loss.detach(), metrics)
    reported = engine.get_global_grad_norm()  # set under ZeRO / half precision only
    if want_grad_norm and reported is not None:
        grad_norm = float(reported)
    return finite, grad_norm


def _step_timer(objective: torch.nn.Module, in_chans: int, img_size: int, micro: int):
    """For precision=auto on CPU: seconds of one micro-batch step, averaged over ranks so every
    rank makes the same choice."""

    def timer(autocast: bool) -> float:
        x = torch.rand(micro, in_chans, img_size, img_size)
        y = torch.zeros(micro, dtype=torch.long)
        seconds = measure_step_seconds(objective, x, y, autocast)
        total = all_reduce_sum(torch.tensor([seconds], dtype=torch.float64))
        return float(total.item()) / torch.distributed.get_world_size()

    return timer


def _save_run_id(tracker: Tracker, path: Path) -> None:
    """Remember the MLflow run so a rerun continues it (the id may arrive late: store down)."""
    if tracker.run_id and not path.is_file():
        atomic_write_text(path, tracker.run_id + "\n")


def train(cfg: Config, header: str = "") -> Path:
    """Train as `cfg` says (pretraining or fine-tuning); returns the export folder.

    Every rank calls this."""
    rank, local_rank, world = init_distributed()
    per_rank, micro, accum = local_batch(cfg, world)
    device = device_for(local_rank)

    manifest, steps_per_epoch, total_steps = check_data(cfg, world)

    run_dir = Path(cfg.run.dir)
    ckpt_dir = run_dir / "checkpoints"
    if rank == 0:
        _check_run_dir(run_dir, cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml", header)
    barrier()

    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
    objective, objective_options, spec = build_from_config(cfg, manifest)
    precision = resolve_precision(
        cfg.train.precision, _step_timer(objective, spec.in_chans, cfg.model.img_size, micro)
    )
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
    if step and rank == 0:
        log.info("resumed from step %d (%s)", step, ckpt_dir / checkpoint.tag_for(step))

    run_id_file = run_dir / "mlflow_run_id"
    tracker = Tracker(
        enabled=rank == 0,
        experiment=cfg.tracking.experiment,
        run_name=cfg.tracking.run_name or run_dir.name,
        run_id=run_id_file.read_text().strip() if run_id_file.is_file() else None,
        tracking_uri=cfg.tracking.uri,
        spool_dir=run_dir / "mlflow_spool",
        tags={"mlflow.parentRunId": cfg.tracking.parent_run_id}
        if cfg.tracking.parent_run_id
        else None,
    )
    if rank == 0:
        _save_run_id(tracker, run_id_file)
        if step == 0:
            derived = {"world_size": world, "accum": accum, "micro": micro, "precision": precision}
            tracker.log_params({**cfg.to_dict(), "derived": derived})
            tracker.log_artifact(run_dir / "config.yaml")
            tracker.log_artifact(run_dir / "ds_config.json")

    # Model FLOPs of one optimizer step, counted once on a real-shaped batch (rank 0 only;
    # every rank does the same work). The matmul peak is measured now, at the same precision.
    flops_per_step = peak = 0.0
    if rank == 0:
        x = torch.rand(micro, spec.in_chans, cfg.model.img_size, cfg.model.img_size, device=device)
        y = torch.zeros(micro, dtype=torch.long, device=device)
        with torch.autocast("cpu", torch.bfloat16, enabled=cpu_autocast):
            flops_per_step = count_train_flops(engine.module, x, y) * accum * world
        engine.module.zero_grad(set_to_none=True)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        peak = measure_matmul_peak(dtype, device, n=4096 if device.type == "cuda" else 1024)

    window = MetricWindow(device, cfg.train.global_batch)
    metrics_file = run_dir / "metrics.jsonl"
    if rank == 0:
        window.truncate_file(metrics_file, step)  # drop lines past the checkpoint we resumed
    progress = Progress(total_steps, step, enabled=rank == 0)
    evals = InTrainingEvals(
        cfg, manifest, spec, rank, world, steps_per_epoch, total_steps, cpu_autocast, state,
        export=lambda out, extra: export_run(
            engine.module, spec, cfg.objective.kind, objective_options, out, extra, rank
        ),
    )  # fmt: skip
    nonfinite_in_row = int(state.get("nonfinite_in_row", 0))
    nonfinite_total = int(state.get("nonfinite_total", 0))

    with tracker:  # ends the MLflow run as FAILED (or KILLED) if training raises
        loader = make_train_loader(
            cfg.data.root,
            cfg.data.split,
            global_batch=cfg.train.global_batch,
            rank=rank,
            world_size=world,
            num_workers=cfg.data.num_workers,
            img_size=cfg.model.img_size,
            seed=cfg.run.seed,
            epoch=step // steps_per_epoch,
            skip_batches=step % steps_per_epoch,
            augment=cfg.data.augment,
            scale=cfg.data.crop_scale,
            hflip=cfg.data.hflip,
            missing=cfg.data.missing_shards,
            holdout_fraction=holdout_fraction(cfg),  # chosen on, never trained on
        )
        while step < total_steps:
            batches = iter(loader)
            while step < total_steps:
                t0 = time.perf_counter()
                images, labels = next(batches, (None, None))
                if images is None:
                    break
                t_data = time.perf_counter() - t0
                torch.manual_seed(cfg.run.seed * 1_000_003 + rank * 7_919 + step)
                log_now = _is_log_step(step + 1, cfg.run.log_every, total_steps)
                finite, grad_norm = _train_step(
                    engine, optimizer, images, labels, micro, cpu_autocast, window, log_now
                )
                step += 1
                nonfinite_in_row = 0 if finite else nonfinite_in_row + 1
                nonfinite_total += not finite
                if nonfinite_in_row >= cfg.run.max_nonfinite_steps:
                    raise NonFiniteLossError(
                        f"{nonfinite_in_row} steps in a row had a non-finite loss (at step "
                        f"{step}); stopping. The last good checkpoint is kept in {ckpt_dir}; "
                        "lower optim.lr or check the data"
                    )
                window.end_step(t_data)
                row = None
                if log_now:
                    extra = {
                        "lr": scheduler.get_last_lr()[0],
                        "grad_norm": grad_norm,
                        "epoch": step / loader.steps_per_epoch,
                        "samples_seen": step * cfg.train.global_batch,
                        "nonfinite_steps": nonfinite_total,
                        "skipped_samples": loader.num_skipped,
                    }
                    row = window.flush(extra, flops_per_step, peak, world)
                    if rank == 0:
                        _save_run_id(tracker, run_id_file)
                        tracker.log_metrics(row, step=step)
                        with open(metrics_file, "a") as f:
                            f.write(json.dumps({"step": step, **row}) + "\n")
                progress.update(step, row)
                evals.maybe_run(engine.module, step, tracker)
                if step % cfg.run.checkpoint_every == 0 or step == total_steps:
                    train_state = {
                        "step": step,
                        "nonfinite_in_row": nonfinite_in_row,
                        "nonfinite_total": nonfinite_total,
                        "world_size": world,
                        **evals.state(),
                    }
                    checkpoint.save(
                        engine, ckpt_dir, step, train_state, rank, cfg.run.keep_checkpoints
                    )
            loader.set_epoch(step // loader.steps_per_epoch)
        progress.close()

        export_dir = run_dir / "export"
        extra = {"mlflow_run_id": tracker.run_id, "step": step, "objective": cfg.objective.kind}
        export_run(
            engine.module, spec, cfg.objective.kind, objective_options, export_dir, extra, rank
        )
        if rank == 0:
            plot = write_loss_plot(metrics_file, run_dir / "loss_curve.png")
            tracker.log_artifact(export_dir, artifact_path="export")
            if plot is not None:
                tracker.log_artifact(plot)
            evals.write_results(run_dir / "results.json", tracker)
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
