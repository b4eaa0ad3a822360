"""The training loop of every job (MPP, supervised, joint pretraining, fine-tuning), on DeepSpeed.

`train(cfg)` runs on every rank and reads top to bottom:

    setup(cfg): process group, run directory, backbone + objective, data stream, DeepSpeed engine
    resume from RUN/checkpoints/latest if there is one
    for each batch: optimizer_step (objective -> backward -> step) -> log -> evaluate -> checkpoint
    export the backbone (fp32 master weights)

A stop signal ends the loop at a step every rank agrees on, with a checkpoint (`StopSignals`,
engine/distributed.py). Running the same command again resumes the same run, on any number of
ranks: model, optimizer, step, data position and MLflow run; the lr is a function of the step
and randomness is re-seeded from (seed, rank, step), so a resumed run draws what it would have
drawn (docs/training.md, "The training loop").
"""

from __future__ import annotations

import dataclasses
import hashlib
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
import yaml

from ssl_vit import startup
from ssl_vit.config import Config, ConfigError, local_batch
from ssl_vit.data.manifest import ManifestError
from ssl_vit.data.memory import MemoryTrainLoader, resolve_in_memory
from ssl_vit.data.stream import LoaderSpec, TrainLoader, make_train_loader
from ssl_vit.data.urls import Retry
from ssl_vit.data.workers import IN_TRAINING_START
from ssl_vit.engine import checkpoint, launches, zero
from ssl_vit.engine.build import ModelSpec, build_from_config, export_run
from ssl_vit.engine.compile import BlockCompile, resolve_compile
from ssl_vit.engine.distributed import (
    Stopped,
    StopSignals,
    all_gather_object,
    all_reduce_sum,
    barrier,
    device_for,
    init_distributed,
)
from ssl_vit.engine.in_training_evals import InTrainingEvals
from ssl_vit.engine.optim import (
    StepSchedule,
    clips_in_step,
    deepspeed_config,
    make_optimizer,
    model_size,
)
from ssl_vit.engine.precision import run_precision, step_timer
from ssl_vit.engine.preflight import DataPlan, check_data
from ssl_vit.engine.run_tracker import open_run_tracker, register_run
from ssl_vit.figures import optional_figure
from ssl_vit.io import append_text, atomic_write_text
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


@dataclass
class Run:
    """What one rank trains with, made once by `setup`."""

    cfg: Config
    rank: int
    world: int
    micro: int  # micro-batch size: the rank's batch is cut into these (gradient accumulation)
    run_dir: Path
    spec: ModelSpec  # what the export records to rebuild the backbone
    options: dict  # the objective's options, saved beside the export
    cpu_autocast: bool  # bf16 on a CPU runs as autocast around an fp32 engine
    clip: float  # the global-norm clip the step applies itself (optim.clips_in_step), or 0
    loader: TrainLoader | MemoryTrainLoader
    total_steps: int
    flops_per_step: float  # model FLOPs of one optimizer step (rank 0; 0 elsewhere)
    peak: float  # FLOP/s of one device: train/mfu's denominator (rank 0)
    peak_measured: float  # the matmul peak measured at start: train/mfu_measured's (rank 0)
    engine: deepspeed.DeepSpeedEngine
    optimizer: torch.optim.Optimizer
    schedule: StepSchedule
    compiler: BlockCompile
    launch: dict  # what this launch resolved (world size, micro batch, precision...): logged
    count: Counters  # where the run is (resumed from the checkpoint)
    tracker: Tracker  # the MLflow run (rank 0; a no-op elsewhere)
    evals: InTrainingEvals
    ckpt_dir: Path  # RUN/checkpoints
    metrics_file: Path  # RUN/metrics.jsonl: the run's metric record

    def export(self, out: Path, extra: dict) -> None:
        """The backbone and objective to `out`. Every rank calls this (ZeRO gathers); rank 0
        writes."""
        kind = self.cfg.objective.kind
        export_run(
            self.engine.module, self.spec, kind, self.options, out, extra=extra, rank=self.rank
        )


def setup(cfg: Config, header: str = "") -> Run:
    """Process group, run directory, model (FLOPs counted before any wrapping), data stream,
    DeepSpeed engine; then the state resumed from the last checkpoint, the MLflow run and the
    in-training evaluations. Every rank calls this."""
    rank, local_rank, world = init_distributed()
    _, micro, accum = local_batch(cfg, world)
    device = device_for(local_rank)
    plan = _check_data_on_every_rank(cfg, rank, world)
    run_dir = Path(cfg.run.dir)
    this_launch = _claim_run_dir(cfg, run_dir, rank, header)

    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
    objective, options, spec = build_from_config(cfg, plan.manifest)
    timer = step_timer(objective, spec.in_chans, cfg.model.img_size, micro)
    precision = run_precision(cfg, run_dir, rank, timer)
    loader = _train_loader(cfg, plan, rank, world, device)
    total_steps = cfg.train.steps or math.ceil(cfg.train.epochs * loader.steps_per_epoch)

    flops = 0.0
    if rank == 0:  # counted on the plain module: through a ZeRO engine it would be a collective
        size = cfg.model.img_size  # with two images: every op here is linear in the batch
        x, y = torch.rand(2, spec.in_chans, size, size), torch.zeros(2, dtype=torch.long)
        flops = count_train_flops(objective, x, y) / 2 * cfg.train.global_batch
        objective.zero_grad(set_to_none=True)

    optimizer, schedule = make_optimizer(objective, cfg, total_steps)
    ds_precision = precision if device.type == "cuda" else "fp32"  # CPU bf16: autocast
    engine = _deepspeed_engine(cfg, objective, optimizer, run_dir, rank, world, micro, accum,
                               ds_precision, on_gpu=device.type == "cuda")  # fmt: skip
    mode, why = resolve_compile(  # auto weighs the images the run will see
        cfg.train.compile, total_steps * cfg.train.global_batch, cfg.train.zero_stage, device
    )
    compiler = BlockCompile(mode, engine.module)
    if rank == 0:
        log.info("torch.compile %s (%s)", "on: each block" if mode == "on" else mode, why)
    cpu_autocast = device.type == "cpu" and precision == "bf16"
    launch = {
        "world_size": world,
        "num_workers": cfg.data.num_workers,
        "steps_per_epoch": loader.steps_per_epoch,
        "accum": accum,
        "micro": micro,
        "precision": precision,
        "compile": compiler.param,
        "in_memory": isinstance(loader, MemoryTrainLoader),
    }

    # Resume (a fresh run finds no checkpoint), then the MLflow run and in-training evaluations
    state = checkpoint.resume(engine, run_dir / "checkpoints", launch)
    count = Counters(**{f.name: int(state.get(f.name, 0)) for f in dataclasses.fields(Counters)})
    loader.set_epoch(*divmod(count.step - count.replayed_steps, loader.steps_per_epoch))
    schedule.set(count.step)
    compiler.start_trial(count.step, total_steps, rank)
    tracker = open_run_tracker(cfg, run_dir, rank, fresh=count.step == 0, derived=launch,
                               source_run_id=spec.source_run_id, this_launch=this_launch,
                               step=count.step)  # fmt: skip
    evals = InTrainingEvals(cfg, plan.manifest, spec, rank, world,
                            steps_per_epoch=loader.steps_per_epoch, total_steps=total_steps,
                            autocast=cpu_autocast, state=state)  # fmt: skip
    peak = peak_measured = 0.0
    if rank == 0:
        truncate_metrics(run_dir / "metrics.jsonl", count.step)  # what followed the checkpoint
        peak, peak_measured, why = mfu_peaks(precision, engine.device)
        log.info("train/mfu against %s", why)
    run = Run(
        cfg=cfg, rank=rank, world=world, micro=micro, run_dir=run_dir, spec=spec,
        options=options, cpu_autocast=cpu_autocast,
        clip=cfg.optim.grad_clip if clips_in_step(cfg, ds_precision) else 0.0, loader=loader,
        total_steps=total_steps, flops_per_step=flops, peak=peak, peak_measured=peak_measured,
        engine=engine, optimizer=optimizer, schedule=schedule, compiler=compiler,
        launch=launch, count=count, tracker=tracker, evals=evals,
        ckpt_dir=run_dir / "checkpoints", metrics_file=run_dir / "metrics.jsonl",
    )  # fmt: skip
    evals.export = run.export  # export_best/ is written through the run's export
    return run


def _check_data_on_every_rank(cfg: Config, rank: int, world: int) -> DataPlan:
    """The preflight (engine/preflight.py) on every rank: the manifest is read and the shards
    selected here, once. A remote set's shards are asked for by rank 0 only; a rank that finds
    a problem stops every rank with its line."""
    try:
        plan, problem = check_data(cfg, world, probe_remote=rank == 0), None
    except (ConfigError, ManifestError) as e:
        plan, problem = None, str(e)
    problems = [p for p in all_gather_object(problem) if p]
    if problems:
        raise ConfigError(problems[0])
    assert plan is not None  # every rank checked, or all stopped above
    return plan


def _claim_run_dir(cfg: Config, run_dir: Path, rank: int, header: str) -> dict | None:
    """The run directory, made or resumed: it belongs to one model and objective. Returns this
    launch's record (RUN/launches/, rank 0; None elsewhere)."""
    saved = run_dir / "config.yaml"
    if rank == 0 and saved.is_file():
        old = yaml.safe_load(saved.read_text())
        for section in ("model", "objective"):
            if old.get(section) != cfg.to_dict()[section]:
                raise ConfigError(
                    f"{saved}: this run directory holds a run with a different {section} "
                    "config; use another run.dir (or delete this one) to start a new run"
                )
    # makes the run directory (RUN/launches/ with its parents) and writes config.yaml too
    this_launch = launches.begin(run_dir, cfg, header) if rank == 0 else None
    barrier()
    checkpoint.check_shared(run_dir / "config.yaml", rank)
    checkpoint.latest_tag(run_dir / "checkpoints")  # a broken pointer fails now, before setup
    return this_launch


def _train_loader(
    cfg: Config, plan: DataPlan, rank: int, world: int, device: torch.device
) -> TrainLoader | MemoryTrainLoader:
    """The data config as one LoaderSpec, over the manifest and shards the preflight read."""
    d = cfg.data
    in_ram, why_ram = resolve_in_memory(d.in_memory, plan.manifest, d.split)
    auto = "gpu" if device.type == "cuda" and not d.translate else "cpu"
    decode = auto if d.decode == "auto" else d.decode
    if rank == 0:
        log.info("training data %s (%s)", "in RAM" if in_ram else "streamed", why_ram)
        if d.subset_file:  # the path alone would not say which samples a rerun trained on
            digest = hashlib.sha256(Path(d.subset_file).read_bytes()).hexdigest()
            log.info("training on the %d samples of %s (sha256 %s)", len(plan.subset),
                     d.subset_file, digest)  # fmt: skip
        if not in_ram:
            log.info("training images decoded on the %s (data.decode=%s)", decode, d.decode)
    spec = LoaderSpec(
        global_batch=cfg.train.global_batch,
        num_workers=d.num_workers,
        img_size=cfg.model.img_size,
        seed=cfg.run.seed,
        augment=d.augment,
        scale=d.crop_scale,
        hflip=d.hflip,
        translate=d.translate,
        missing=d.missing_shards,  # type: ignore[arg-type]
        holdout_fraction=cfg.holdout_share,  # chosen on, never trained on
        train_fraction=d.train_fraction,
        subset=plan.subset,
        timeout=d.stall_timeout,
        multiprocessing_context=IN_TRAINING_START,
        in_memory=in_ram,
        resampled=d.resampled,
        retry=Retry(d.read_retries, timeout=d.read_timeout, min_rate=d.min_read_rate),
        verify=d.verify,  # type: ignore[arg-type]
        decode=decode,  # type: ignore[arg-type]
    )
    return make_train_loader(
        plan.manifest, d.split, rank=rank, world_size=world, shards=plan.shards, spec=spec,
        # batches made on the GPU; decode=gpu on a CPU runs the same code there (tests)
        device=device if device.type == "cuda" or decode == "gpu" else None,
    )  # fmt: skip


def _deepspeed_engine(
    cfg: Config, objective: torch.nn.Module, optimizer: torch.optim.Optimizer, run_dir: Path,
    rank: int, world: int, micro: int, accum: int, precision: str, *, on_gpu: bool,
) -> deepspeed.DeepSpeedEngine:  # fmt: skip
    """The DeepSpeed engine over the objective (its config written to RUN/ds_config.json)."""
    # ZeRO's bucket sizes scale with the model's size
    ds_config = deepspeed_config(
        cfg, world, micro, accum, precision, on_gpu=on_gpu, **model_size(objective)
    )
    if rank == 0:
        atomic_write_text(run_dir / "ds_config.json", json.dumps(ds_config, indent=2))
    if ds_config["zero_optimization"]["stage"] == 3:
        zero.register_loose_parameters(objective)
    engine, _, _, _ = deepspeed.initialize(model=objective, optimizer=optimizer, config=ds_config)
    if world == 1 and ds_config["zero_optimization"]["stage"] == 0:
        # One rank has no peers: skip the engine's gradient flatten + all-reduce. ZeRO stages
        # reduce inside their own optimizer.
        engine.enable_backward_allreduce = False
    return engine


def train(cfg: Config, header: str = "") -> Path:
    """Train as `cfg` says (pretraining or fine-tuning); returns the export folder.

    Every rank calls this."""
    run = setup(cfg, header)
    engine, loader, rank, count, tracker = run.engine, run.loader, run.rank, run.count, run.tracker
    per_epoch, window = loader.steps_per_epoch, MetricWindow(engine.device, cfg.train.global_batch)
    progress = TrainProgress(run.total_steps, count.step, enabled=rank == 0)
    meta = {"mlflow_run_id": tracker.run_id, "objective": cfg.objective.kind}  # in each export
    startup.ready()  # everything is loaded: later GC passes skip it (ssl_vit/startup.py)

    # the tracker ends the MLflow run as FAILED (or KILLED) if training raises
    with tracker, StopSignals(cfg.run.stop_signals) as stop:
        for images, labels, waited in _batches(loader, count, run.total_steps):
            # images: (B, C, H, W) uint8, the rank's share of the global batch; labels: (B,)
            torch.manual_seed(cfg.run.seed * 1_000_003 + rank * 7_919 + count.step)
            log_now = (count.step + 1) % cfg.run.log_every == 0 or count.step + 1 == run.total_steps
            step = optimizer_step(
                engine,
                run.optimizer,
                images,
                labels,
                micro=run.micro,
                autocast=run.cpu_autocast,
                window=window,
                want_grad_norm=log_now,
                clip=run.clip,
            )
            count.step += 1
            run.schedule.set(count.step)  # the lr of the next step
            count.nonfinite_in_row = 0 if step.finite else count.nonfinite_in_row + 1
            count.nonfinite_total += not step.finite
            count.skipped_total += not step.applied
            if count.nonfinite_in_row >= cfg.run.max_nonfinite_steps:
                raise NonFiniteLossError(
                    f"{count.nonfinite_in_row} steps in a row had a non-finite loss (at step "
                    f"{count.step}); stopping. The last good checkpoint is kept in "
                    f"{run.ckpt_dir}; lower optim.lr or check the data"
                )
            window.end_step(waited)

            row = _log_metrics(run, step, window) if log_now else None
            progress.update(count.step, row)

            with run.compiler.eager():  # evaluations are not worth a compile of their own
                run.evals.maybe_run(engine.module, count.step, tracker)

            stopping = stop.agreed()  # a stop signal reached some rank: every rank stops here
            last = stopping or count.step == run.total_steps
            if last or count.step % cfg.run.checkpoint_every == 0:
                tracker.wait_sent()  # the metrics up to this step outlive a kill right after it
                launch = {k: run.launch[k] for k in checkpoint.LAUNCH_KEYS}
                saved = {**dataclasses.asdict(count), **launch, **run.evals.state()}
                checkpoint.save(engine, run.ckpt_dir, count.step, saved, rank=rank,
                                keep=cfg.run.keep_checkpoints)  # fmt: skip
            for epoch in cfg.run.export_epochs:  # snapshots at the end of chosen epochs
                if count.step == epoch * per_epoch:
                    extra = {**meta, "step": count.step, "epoch": epoch}
                    run.export(run.run_dir / f"export_epoch{epoch}", extra)
            measured = run.compiler.after_step(count.step)  # the compile trial's verdict, once
            if measured and rank == 0:
                tracker.log_metrics(measured, step=count.step)
            if stopping:
                break
        progress.close()
        if stop.stopped_by:  # checkpointed above; the same command goes on from there
            _stop(run, stop.stopped_by)
        export_dir = run.run_dir / "export"
        with run.compiler.eager():
            run.export(export_dir, {**meta, "step": count.step})  # every rank: ZeRO gathers
            if rank == 0:
                plot = optional_figure(
                    "loss plot", write_loss_plot, run.metrics_file, run.run_dir / "loss_curve.png"
                )
                tracker.log_artifact(export_dir, artifact_path="export")
                if plot is not None:
                    tracker.log_artifact(plot)
                run.evals.write_results(run.run_dir / "results.json", tracker)
                tracker.close()
                if cfg.tracking.register_as:
                    register_run(tracker, cfg.tracking.register_as, run.run_dir)
                log.info("done: %d steps; backbone exported to %s; MLflow run %s",
                         count.step, export_dir, tracker.run_id)  # fmt: skip
        run.compiler.close()
    barrier()
    sys.stdout.flush()
    return export_dir


def _log_metrics(run: Run, step: StepResult, window: MetricWindow) -> dict:
    """The step's metrics averaged over ranks (every rank calls this); rank 0 writes them to
    MLflow and RUN/metrics.jsonl."""
    cfg, count, loader = run.cfg, run.count, run.loader
    reads = loader.counter  # this rank's shard reads (ssl_vit.data.shards)
    extra = {
        "lr": max(run.schedule.get_last_lr()),  # the head's under layer decay
        "grad_norm": step.grad_norm,
        "epoch": count.step / loader.steps_per_epoch,
        "samples_seen": count.step * cfg.train.global_batch,
        "nonfinite_steps": count.nonfinite_total,
        "skipped_steps": count.skipped_total,
        "skipped_samples": loader.num_skipped,
        "data/shard_errors": reads.shard_errors,
        "data/read_retries": reads.retries,
        "data/gbytes_read": reads.bytes_read / 1e9,
        "data/unverified_samples": reads.unverified,  # ssl_vit.data.tar_reader
    }
    row = window.flush(extra, run.flops_per_step, run.peak, run.world, run.peak_measured)
    if run.rank == 0:
        run.tracker.log_metrics(row, step=count.step, in_file=True)
        append_text(run.metrics_file, json.dumps({"step": count.step, **row}) + "\n")
    return row


def _stop(run: Run, stopped_by: str) -> None:
    """End a run a stop signal reached, after its checkpoint: the MLflow run KILLED, the ranks
    out together; the same command resumes it."""
    step = run.count.step
    run.tracker.set_tags({"ssl_vit.stopped_by": stopped_by, "ssl_vit.stopped_at_step": step})
    run.tracker.close("KILLED")
    run.compiler.close()
    barrier("the stop")  # the ranks leave together: the launcher sees their exit code
    raise Stopped(stopped_by, step, str(run.ckpt_dir / checkpoint.tag_for(step)))


def _batches(
    loader: TrainLoader | MemoryTrainLoader, count: Counters, total_steps: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
    """(images, labels, seconds waited for them) until `total_steps`, epoch after epoch; the
    caller advances `count.step`."""
    while count.step < total_steps:
        batches = iter(loader)
        while count.step < total_steps:
            t0 = time.perf_counter()
            images, labels = next(batches, (None, None))
            if images is None:
                break
            yield images, labels, time.perf_counter() - t0
        loader.set_epoch((count.step - count.replayed_steps) // loader.steps_per_epoch)


@dataclass
class StepResult:
    finite: bool  # every rank's loss was finite (else the step was skipped on every rank)
    applied: bool  # the optimizer moved the weights (False on an fp16 overflow too)
    grad_norm: float  # the global gradient norm (0 unless asked for)


def optimizer_step(
    engine: deepspeed.DeepSpeedEngine,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    micro: int,
    autocast: bool,
    window: MetricWindow,
    want_grad_norm: bool,
    clip: float = 0.0,
) -> StepResult:
    """One optimizer step over the rank's batch, in micro-batches of `micro`: uint8 images to
    [0, 1] floats on the device, the objective's forward (under CPU bf16 `autocast`), backward,
    step. `clip` > 0: clip the gradients to that global norm here, before the engine steps
    (ZeRO-0 fp32, ssl_vit.engine.optim.clips_in_step); 0: the engine clips (or nothing does).

    A non-finite loss on any rank skips the optimizer step on every rank (weights and moments
    untouched); the step still counts, so the data and schedule stay aligned.
    """
    device = engine.device
    images = images.to(device, non_blocking=True).float().div_(255)  # (B, C, H, W) in [0, 1]
    labels = labels.to(device, non_blocking=True)
    chunks = list(zip(images.split(micro), labels.split(micro), strict=True))
    bad = torch.zeros((), device=device)
    grad_norm, finite = 0.0, True
    for i, (x, y) in enumerate(chunks):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss, metrics = engine(x, y)  # the objective: (scalar loss, {name: scalar})
        bad += ~torch.isfinite(loss.detach())
        engine.backward(loss)
        if i == len(chunks) - 1:  # the accumulation boundary: grads are all-reduced now
            finite = all_reduce_sum(bad).item() == 0
            optimizer.skip = not finite  # ZeRO-1/2 call step() once per param group: all skip
            if clip > 0:  # whole gradients, averaged over ranks by the backward just done
                norm = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), clip)
                grad_norm = float(norm) if want_grad_norm else 0.0  # a sync on log steps only
            elif want_grad_norm:
                grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
                grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        engine.step()
        optimizer.skip = False
        window.add(loss.detach(), metrics)
    applied = finite and engine.was_step_applied()  # False on an fp16 overflow too
    reported = engine.get_global_grad_norm()  # set under ZeRO / half precision only
    if want_grad_norm and reported is not None:
        grad_norm = float(reported)
    return StepResult(finite, applied, grad_norm)


class MetricWindow:
    """Sums step metrics as tensors (no host sync per step); `flush` averages over ranks."""

    def __init__(self, device: torch.device, global_batch: int) -> None:
        self.device, self.global_batch = device, global_batch
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count, self.steps, self.data_s = 0, 0, 0.0  # micro-batches, steps, data wait (s)
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        """One micro-batch's loss and metrics (scalar tensors)."""
        for key, value in {"loss": loss, **metrics}.items():
            value = value.detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.count += 1

    def end_step(self, data_wait_s: float) -> None:
        self.steps += 1
        self.data_s += data_wait_s

    def flush(
        self,
        extra: dict[str, float],
        flops_per_step: float,
        peak: float,
        world: int,
        measured_peak: float = 0.0,
    ) -> dict[str, float]:
        """Everything for one log line / MLflow point, identical on every rank. `peak` and
        `measured_peak` are one device's FLOP/s (ssl_vit.perf.mfu_peaks): model FLOP
        utilisation against each, over `world` devices."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        keys = sorted(self.sums)
        count = torch.tensor(float(self.count), device=self.device)
        values = all_reduce_sum(torch.stack([self.sums[k] for k in keys] + [count])).tolist()
        row = {f"train/{k}": v / values[-1] for k, v in zip(keys, values[:-1], strict=True)}
        row["train/images_per_s"] = self.steps * self.global_batch / elapsed
        row["train/data_wait_share"] = self.data_s / elapsed
        if flops_per_step:
            flops_per_s = row["train/model_flops_per_s"] = flops_per_step * self.steps / elapsed
            if peak:  # the published peak where known, else the measured one
                row["train/mfu"] = flops_per_s / (peak * world)
            if measured_peak:  # the matmul peak measured at start
                row["train/mfu_measured"] = flops_per_s / (measured_peak * world)
        row.update({f"train/{k}": float(v) for k, v in extra.items()})
        self._reset()
        return row


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only metric lines up to `step`: a resumed run re-logs the steps after its checkpoint.
    A line that does not parse (half a line a power loss left) is dropped with a warning."""
    if not path.is_file():
        return
    keep, damaged = [], 0
    for ln in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            at = json.loads(ln)["step"]
        except (ValueError, TypeError, KeyError):
            damaged += bool(ln.strip())
            continue
        if isinstance(at, int) and at <= step:
            keep.append(ln)
    if damaged:
        log.warning("%s: %d damaged line(s) dropped on resume", path, damaged)
    atomic_write_text(path, "".join(ln + "\n" for ln in keep))


class TrainProgress:
    """tqdm on a terminal (rank 0); plain log lines at each logging step otherwise."""

    SHOWN = (
        "loss",
        "mpp/acc",
        "sup/acc",
        "lr",
        "grad_norm",
        "images_per_s",
        "data_wait_share",
        "mfu",
    )

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.enabled, self.total, self.bar = enabled, total, None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, row: dict[str, float] | None) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            if row:
                self.bar.set_postfix(
                    loss=f"{row['train/loss']:.4f}", img_s=f"{row['train/images_per_s']:.0f}"
                )
            self.bar.refresh()
        elif row:
            shown = {k.removeprefix("train/"): v for k, v in row.items()}
            text = " ".join(
                f"{k}={v:.4g}" for k, v in shown.items() if k in self.SHOWN or k.startswith("acc")
            )
            log.info("step %d/%d %s", step, self.total, text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_loss_plot(metrics_file: Path, out: Path) -> Path | None:
    """Loss (and accuracy, when logged) against step, from the run's metrics.jsonl."""
    lines = metrics_file.read_text().splitlines() if metrics_file.is_file() else []
    rows = [json.loads(ln) for ln in lines if ln]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc_keys = [k for k in rows[-1] if k.endswith("/acc") and k.startswith("train/")]
    fig, axes = plt.subplots(1, 1 + bool(acc_keys), figsize=(5 + 5 * bool(acc_keys), 3.6))
    axes = axes if acc_keys else [axes]
    steps = [r["step"] for r in rows]
    axes[0].plot(steps, [r["train/loss"] for r in rows])
    axes[0].set(xlabel="step", ylabel="training loss", title="Loss")
    axes[0].grid(alpha=0.3)
    for key in acc_keys:
        axes[1].plot(steps, [r.get(key, float("nan")) for r in rows], label=key[6:])
    if acc_keys:
        axes[1].set(xlabel="step", ylabel="accuracy", title="Training accuracy")
        axes[1].legend()
        axes[1].grid(alpha=0.3)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")  # a failed save leaves no half-written PNG
    try:
        fig.savefig(tmp, dpi=110)
        tmp.replace(out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out
