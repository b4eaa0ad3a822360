"""The pretraining loop shared by MPP, supervised and joint pretraining, on DeepSpeed.

`train(cfg)`, run by every rank:
  set up the process group -> build backbone + objective (FLOPs counted before any wrapping)
  -> DeepSpeed engine -> resume from RUN/checkpoints/latest if present -> stream shards, step,
  log, checkpoint -> export the backbone (fp32 master weights).

Running the same command again resumes the same run: model, optimizer, step, data position
(epoch and batch) and MLflow run; with another number of ranks too, the interrupted epoch then
restarting from its first batch (ssl_vit/engine/checkpoint.py). The learning rate is a
function of the step count, set by us every step, so it never lags the step whatever DeepSpeed
skips. Randomness is re-seeded from (seed, rank, step) at every step, so a resumed run draws
the masks and augmentations it would have drawn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import torch

from ssl_vit import startup
from ssl_vit.config import Config, ConfigError, holdout_fraction, local_batch, save_config
from ssl_vit.data.manifest import Manifest
from ssl_vit.data.memory import MemoryTrainLoader, resolve_in_memory
from ssl_vit.data.stream import TrainLoader, make_train_loader
from ssl_vit.data.urls import Retry
from ssl_vit.data.workers import IN_TRAINING_START
from ssl_vit.engine import checkpoint, zero
from ssl_vit.engine.build import ModelSpec, build_from_config, export_run
from ssl_vit.engine.compile import compile_blocks, eager, resolve_compile, start_trial
from ssl_vit.engine.distributed import (
    barrier,
    device_for,
    init_distributed,
)
from ssl_vit.engine.evaluate import InTrainingEvals
from ssl_vit.engine.optim import (
    StepSchedule,
    clips_in_step,
    deepspeed_config,
    make_optimizer,
    model_size,
)
from ssl_vit.engine.precision import run_precision, step_timer
from ssl_vit.engine.preflight import check_data
from ssl_vit.engine.progress import MetricWindow, TrainProgress, write_loss_plot
from ssl_vit.engine.run_tracker import open_run_tracker, register_run, save_run_id
from ssl_vit.engine.train_step import train_step
from ssl_vit.io import atomic_write_text
from ssl_vit.perf import count_train_flops, mfu_peaks
from ssl_vit.tracking import Tracker

log = logging.getLogger("ssl_vit.train")


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss."""


@dataclass
class Counters:
    """What the loop counts, saved in every checkpoint."""

    step: int = 0
    nonfinite_in_row: int = 0
    nonfinite_total: int = 0
    skipped_total: int = 0  # optimizer steps not applied (non-finite loss or fp16 overflow)
    # steps that re-read the start of an epoch restarted on another world size (or loader
    # worker count, checkpoint.resume): the loader is `step - replayed_steps` batches in
    replayed_steps: int = 0

    def state(self) -> dict:
        return dataclasses.asdict(self)


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


def _prepare_run_dir(cfg: Config, rank: int, header: str) -> Path:
    run_dir = Path(cfg.run.dir)
    if rank == 0:
        _check_run_dir(run_dir, cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml", header)
    barrier()
    checkpoint.check_shared(run_dir, rank)
    checkpoint.latest_tag(run_dir / "checkpoints")  # a broken pointer fails now, before setup
    return run_dir


def _is_log_step(step: int, every: int, total: int) -> bool:
    return step % every == 0 or step == total


def _flops_per_step(objective: torch.nn.Module, cfg: Config, in_chans: int, images: int) -> float:
    """Model FLOPs of one optimizer step over `images` images, counted on the plain module
    before DeepSpeed wraps it (a forward on one rank through a ZeRO engine would be a
    collective on one rank) with two images: every op here is linear in the batch."""
    size = cfg.model.img_size
    x = torch.rand(2, in_chans, size, size)
    y = torch.zeros(2, dtype=torch.long)
    flops = count_train_flops(objective, x, y) / 2 * images
    objective.zero_grad(set_to_none=True)
    return flops


@dataclass
class _Setup:
    """What one rank trains with: the run directory, the engine and the data stream."""

    cfg: Config
    rank: int
    world: int
    micro: int
    run_dir: Path
    manifest: Manifest
    spec: ModelSpec
    objective_options: dict
    precision: str
    cpu_autocast: bool
    loader: TrainLoader | MemoryTrainLoader
    total_steps: int
    flops_per_step: float  # model FLOPs of one optimizer step (rank 0; 0 elsewhere)
    engine: deepspeed.DeepSpeedEngine
    optimizer: torch.optim.Optimizer
    schedule: StepSchedule
    derived: dict  # values resolved for this launch, logged as params
    clip: float = 0.0  # the global-norm clip the step applies itself (optim.clips_in_step)

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def export(self, out: Path, extra: dict) -> None:
        """Every rank calls this (ZeRO gathers); rank 0 writes."""
        module, kind = self.engine.module, self.cfg.objective.kind
        export_run(module, self.spec, kind, self.objective_options, out, extra, self.rank)


def _setup(cfg: Config, header: str) -> _Setup:
    """Process group, run directory, model (FLOPs counted before any wrapping), data stream,
    DeepSpeed engine."""
    rank, local_rank, world = init_distributed()
    _, micro, accum = local_batch(cfg, world)
    device = device_for(local_rank)
    manifest, _, _ = check_data(cfg, world)
    run_dir = _prepare_run_dir(cfg, rank, header)
    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
    objective, objective_options, spec = build_from_config(cfg, manifest)
    timer = step_timer(objective, spec.in_chans, cfg.model.img_size, micro)
    precision = run_precision(cfg, run_dir, rank, timer)
    in_ram, why_ram = resolve_in_memory(cfg.data.in_memory, manifest, cfg.data.split)
    if rank == 0:
        log.info("training data %s (%s)", "in RAM" if in_ram else "streamed", why_ram)
    decode = cfg.data.decode
    if decode == "auto":
        decode = "gpu" if device.type == "cuda" and not cfg.data.translate else "cpu"
    if rank == 0 and not in_ram:
        log.info("training images decoded on the %s (data.decode=%s)", decode, cfg.data.decode)
    loader = make_train_loader(
        cfg.data.root, cfg.data.split, global_batch=cfg.train.global_batch, rank=rank,
        world_size=world, num_workers=cfg.data.num_workers, img_size=cfg.model.img_size,
        seed=cfg.run.seed, augment=cfg.data.augment, scale=cfg.data.crop_scale,
        hflip=cfg.data.hflip, translate=cfg.data.translate, missing=cfg.data.missing_shards,
        resampled=cfg.data.resampled, decode=decode,
        retry=Retry(cfg.data.read_retries, timeout=cfg.data.read_timeout),
        holdout_fraction=holdout_fraction(cfg),  # chosen on, never trained on
        train_fraction=cfg.data.train_fraction,
        in_memory=in_ram, multiprocessing_context=IN_TRAINING_START,
        # batches made on the GPU; decode=gpu on a CPU runs the same code there (tests)
        device=device if device.type == "cuda" or decode == "gpu" else None,
    )  # fmt: skip
    total_steps = cfg.train.steps or math.ceil(cfg.train.epochs * loader.steps_per_epoch)
    flops = 0.0
    if rank == 0:
        flops = _flops_per_step(objective, cfg, spec.in_chans, cfg.train.global_batch)
    optimizer, schedule = make_optimizer(objective, cfg, total_steps)
    ds_precision = precision if device.type == "cuda" else "fp32"
    on_gpu, size = device.type == "cuda", model_size(objective)  # ZeRO's bucket sizes
    ds_config = deepspeed_config(cfg, world, micro, accum, ds_precision, on_gpu=on_gpu, **size)
    if rank == 0:
        atomic_write_text(run_dir / "ds_config.json", json.dumps(ds_config, indent=2))
    if ds_config["zero_optimization"]["stage"] == 3:
        zero.register_loose_parameters(objective)
    engine, _, _, _ = deepspeed.initialize(model=objective, optimizer=optimizer, config=ds_config)
    if world == 1 and ds_config["zero_optimization"]["stage"] == 0:
        # One rank has no peers: skip the engine's gradient flatten + all-reduce (~1.5 ms of a
        # 220 ms step on 2 CPU cores). ZeRO stages reduce inside their own optimizer.
        engine.enable_backward_allreduce = False
    images = total_steps * cfg.train.global_batch
    mode, why = resolve_compile(cfg.train.compile, images, cfg.train.zero_stage, device)
    compiled = mode == "on" and compile_blocks(engine.module) > 0
    if rank == 0:
        log.info("torch.compile %s (%s)", "on: each block" if mode == "on" else mode, why)
    cpu_autocast = device.type == "cpu" and precision == "bf16"
    derived = {"world_size": world, "accum": accum, "micro": micro, "precision": precision,
               "compile": "trial" if mode == "trial" else compiled,
               "in_memory": in_ram}  # fmt: skip
    return _Setup(
        cfg, rank, world, micro, run_dir, manifest, spec, objective_options, precision,
        cpu_autocast, loader, total_steps, flops, engine, optimizer, schedule, derived,
        clip=cfg.optim.grad_clip if clips_in_step(cfg, ds_precision) else 0.0,
    )  # fmt: skip


class _StepLog:
    """Metric lines of the logging steps: averaged over ranks, then MLflow and metrics.jsonl
    (rank 0). The MFU denominators are found once here, at start: the device's published peak
    (`train/mfu`, the measured one where there is none) and a matmul peak measured now
    (`train/mfu_measured`), both in the arithmetic of the run's matmuls."""

    def __init__(self, s: _Setup, tracker: Tracker, start_step: int) -> None:
        self.s, self.tracker, self.peak, self.measured = s, tracker, 0.0, 0.0
        self.file = s.run_dir / "metrics.jsonl"
        device = s.engine.device
        if s.rank == 0:
            self.peak, self.measured, why = mfu_peaks(s.precision, device)
            log.info("train/mfu against %s", why)
        self.window = MetricWindow(device, s.cfg.train.global_batch)
        if s.rank == 0:
            self.window.truncate_file(self.file, start_step)  # lines past the resumed checkpoint

    def write(self, n: Counters, grad_norm: float) -> dict[str, float]:
        s = self.s
        extra = {
            "lr": max(s.schedule.get_last_lr()),  # the head's under layer decay
            "grad_norm": grad_norm,
            "epoch": n.step / s.loader.steps_per_epoch,
            "samples_seen": n.step * s.cfg.train.global_batch,
            "nonfinite_steps": n.nonfinite_total,
            "skipped_steps": n.skipped_total,
            "skipped_samples": s.loader.num_skipped,
            # this rank's reads: shards lost or retried, bytes read (ssl_vit.data.shards)
            "data/shard_errors": s.loader.counter.shard_errors,
            "data/read_retries": s.loader.counter.retries,
            "data/gbytes_read": s.loader.counter.bytes_read / 1e9,
        }
        row = self.window.flush(extra, s.flops_per_step, self.peak, s.world, self.measured)
        if s.rank == 0:
            save_run_id(self.tracker, s.run_dir / "mlflow_run_id")
            self.tracker.log_metrics(row, step=n.step)
            with open(self.file, "a") as f:
                f.write(json.dumps({"step": n.step, **row}) + "\n")
        return row


def _batches(
    loader: TrainLoader | MemoryTrainLoader, n: Counters, total_steps: int
) -> Iterator[tuple]:
    """(images, labels, seconds waited for them) until `total_steps`, epoch after epoch; the
    caller advances `n.step`."""
    while n.step < total_steps:
        batches = iter(loader)
        while n.step < total_steps:
            t0 = time.perf_counter()
            images, labels = next(batches, (None, None))
            if images is None:
                break
            yield images, labels, time.perf_counter() - t0
        loader.set_epoch((n.step - n.replayed_steps) // loader.steps_per_epoch)


def _save_checkpoint(s: _Setup, n: Counters, evals: InTrainingEvals, tracker: Tracker) -> None:
    tracker.wait_sent()  # the metrics up to this step outlive a kill right after it (rank 0)
    state = {
        **n.state(),
        "world_size": s.world,
        "num_workers": s.cfg.data.num_workers,
        "steps_per_epoch": s.loader.steps_per_epoch,
        **evals.state(),
    }
    checkpoint.save(s.engine, s.ckpt_dir, n.step, state, s.rank, s.cfg.run.keep_checkpoints)


def train(cfg: Config, header: str = "") -> Path:
    """Train as `cfg` says (pretraining or fine-tuning); returns the export folder.

    Every rank calls this."""
    s = _setup(cfg, header)
    launch = {"world_size": s.world, "num_workers": cfg.data.num_workers,
              "steps_per_epoch": s.loader.steps_per_epoch}  # fmt: skip
    state = checkpoint.resume(s.engine, s.ckpt_dir, launch)
    n = Counters(**{k: int(state.get(k, 0)) for k in Counters().state()})
    s.loader.set_epoch(*divmod(n.step - n.replayed_steps, s.loader.steps_per_epoch))
    s.schedule.set(n.step)
    tracker = open_run_tracker(cfg, s.run_dir, s.rank, n.step == 0, s.derived, s.spec.source_run_id)
    step_log = _StepLog(s, tracker, n.step)
    progress = TrainProgress(s.total_steps, n.step, enabled=s.rank == 0)
    trial = start_trial(s.derived["compile"], s.engine.module, n.step, s.total_steps, s.rank)
    compiled = s.derived["compile"] is True

    def evaluating():  # compiled blocks run eager here: not worth a compile of their own
        return eager() if (trial.compiled if trial else compiled) else contextlib.nullcontext()

    evals = InTrainingEvals(
        cfg, s.manifest, s.spec, s.rank, s.world, s.loader.steps_per_epoch,
        s.total_steps, s.cpu_autocast, state, export=s.export,
    )  # fmt: skip
    startup.ready()  # everything is loaded: later GC passes skip it (ssl_vit/startup.py)
    with tracker:  # ends the MLflow run as FAILED (or KILLED) if training raises
        for images, labels, t_data in _batches(s.loader, n, s.total_steps):
            torch.manual_seed(cfg.run.seed * 1_000_003 + s.rank * 7_919 + n.step)
            log_now = _is_log_step(n.step + 1, cfg.run.log_every, s.total_steps)
            finite, applied, grad_norm = train_step(
                s.engine, s.optimizer, images, labels, s.micro, s.cpu_autocast,
                step_log.window, log_now, s.clip,
            )  # fmt: skip
            n.step += 1
            s.schedule.set(n.step)
            _count_step(n, finite, applied, cfg.run.max_nonfinite_steps, s.ckpt_dir)
            step_log.window.end_step(t_data)
            row = step_log.write(n, grad_norm) if log_now else None
            progress.update(n.step, row)
            with evaluating():
                evals.maybe_run(s.engine.module, n.step, tracker)
            if n.step % cfg.run.checkpoint_every == 0 or n.step == s.total_steps:
                _save_checkpoint(s, n, evals, tracker)
            _export_snapshot(s, tracker, n.step)
            if trial and (measured := trial.after_step(n.step)) and s.rank == 0:
                tracker.log_metrics(measured, step=n.step)
        progress.close()
        with evaluating():
            export_dir = _finish(s, tracker, evals, n)
        if trial:
            trial.close()
    barrier()
    sys.stdout.flush()
    return export_dir


def _export_snapshot(s: _Setup, tracker: Tracker, step: int) -> None:
    """RUN/export_epoch<E>/ once `step` ends epoch E of `run.export_epochs` (every rank); an
    epoch the run does not reach gets none."""
    for epoch in s.cfg.run.export_epochs:
        if step == epoch * s.loader.steps_per_epoch:
            extra = {"mlflow_run_id": tracker.run_id, "step": step, "epoch": epoch,
                     "objective": s.cfg.objective.kind}  # fmt: skip
            s.export(s.run_dir / f"export_epoch{epoch}", extra)


def _count_step(n: Counters, finite: bool, applied: bool, max_in_row: int, ckpt_dir: Path):
    n.nonfinite_in_row = 0 if finite else n.nonfinite_in_row + 1
    n.nonfinite_total += not finite
    n.skipped_total += not applied
    if n.nonfinite_in_row >= max_in_row:
        raise NonFiniteLossError(
            f"{n.nonfinite_in_row} steps in a row had a non-finite loss (at step {n.step}); "
            f"stopping. The last good checkpoint is kept in {ckpt_dir}; lower optim.lr or "
            "check the data"
        )


def _finish(s: _Setup, tracker: Tracker, evals: InTrainingEvals, n: Counters) -> Path:
    """Export the backbone (every rank: ZeRO gathers), then plot and log (rank 0)."""
    cfg, run_dir = s.cfg, s.run_dir
    export_dir = run_dir / "export"
    s.export(
        export_dir,
        {"mlflow_run_id": tracker.run_id, "step": n.step, "objective": cfg.objective.kind},
    )
    if s.rank == 0:
        plot = write_loss_plot(run_dir / "metrics.jsonl", run_dir / "loss_curve.png")
        tracker.log_artifact(export_dir, artifact_path="export")
        if plot is not None:
            tracker.log_artifact(plot)
        evals.write_results(run_dir / "results.json", tracker)
        tracker.close()
        if cfg.tracking.register_as:
            register_run(tracker, cfg.tracking.register_as, run_dir)
        log.info(
            "done: %d steps; backbone exported to %s; MLflow run %s",
            n.step,
            export_dir,
            tracker.run_id,
        )
    return export_dir
