"""Optimizer, learning-rate schedule and the DeepSpeed config built from a `Config`."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from timm.optim import param_groups_layer_decay

from ssl_vit.config import Config
from ssl_vit.objectives import no_weight_decay_names, param_groups

log = logging.getLogger("ssl_vit.train")
# bf16 autocast must beat fp32 by this much to be chosen: it costs precision, so a tie is fp32.
BF16_MIN_SPEEDUP = 1.05


class _SkippableStep:
    """`step()` does nothing while `skip` is set, for steps with a non-finite loss.

    DeepSpeed calls the client optimizer's `step()` (also under ZeRO, on the fp32 partitions;
    ZeRO-1/2 call it once per parameter group), so the trainer sets `skip` around the whole
    engine step and clears it after: weights and moments stay untouched however the engine
    wraps us.
    """

    skip: bool = False

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        if self.skip:
            return None
        return super().step(closure)


class SkippableAdamW(_SkippableStep, torch.optim.AdamW):
    pass


class SkippableSGD(_SkippableStep, torch.optim.SGD):
    pass


class StepSchedule:
    """Each group's lr = its peak lr x `lr_lambda(step)`: a pure function of the step count.

    The trainer sets it from its own step counter (not DeepSpeed's, which does not advance on
    an fp16 overflow), so the schedule and the step count agree in every mode and a resume
    needs no scheduler state.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, fn) -> None:
        self.optimizer, self.fn = optimizer, fn
        self.peaks = [g["lr"] for g in optimizer.param_groups]
        self.set(0)

    def set(self, step: int) -> None:
        for group, peak in zip(self.optimizer.param_groups, self.peaks, strict=True):
            group["lr"] = peak * self.fn(step)

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]


def _groups(module: torch.nn.Module, weight_decay: float, lr: float, layer_decay: float | None):
    """Weight-decay groups; with `layer_decay`, the backbone's blocks get lr * decay^(depth-i)."""
    if layer_decay is None:
        return param_groups(module, weight_decay)
    backbone = module.backbone
    no_decay = no_weight_decay_names(backbone)
    groups = param_groups_layer_decay(
        backbone, weight_decay, no_weight_decay_list=no_decay, layer_decay=layer_decay
    )
    in_backbone = {id(p) for p in backbone.parameters()}
    exempt = no_weight_decay_names(module)
    rest = [(n, p) for n, p in module.named_parameters() if id(p) not in in_backbone]
    groups += [  # the head (and any other non-backbone weights): full lr
        {"params": [p for n, p in rest if n not in exempt], "weight_decay": weight_decay},
        {"params": [p for n, p in rest if n in exempt], "weight_decay": 0.0},
    ]
    for g in groups:
        g["lr"] = lr * g.pop("lr_scale", 1.0)
    return [g for g in groups if g["params"]]


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Linear warmup to the peak, then cosine or linear decay to `min_ratio` of it (B.1)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def effective_warmup(warmup_steps: int, total_steps: int) -> int:
    """The configured warmup, or a tenth of a run too short to hold it (a quick smoke run)."""
    return warmup_steps if warmup_steps < total_steps else max(1, total_steps // 10)


def make_optimizer(
    module: torch.nn.Module, cfg: Config, total_steps: int
) -> tuple[torch.optim.Optimizer, StepSchedule]:
    o = cfg.optim
    groups = _groups(module, o.weight_decay, o.lr, o.layer_decay)
    if o.name == "sgd":
        opt = SkippableSGD(groups, lr=o.lr, momentum=o.momentum)
    else:
        opt = SkippableAdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
    warmup = effective_warmup(o.warmup_steps, total_steps)
    sched = StepSchedule(
        opt, lambda s: lr_lambda(s, warmup, total_steps, o.schedule, o.min_lr_ratio)
    )
    return opt, sched


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them CPU bf16 is emulated and slower than fp32 (we measured
    about 4x slower on an AVX2-only machine, see benchmarks/mpp_step.py)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def gpu_precision(capability: tuple[int, int]) -> str:
    """bf16 from compute capability 8.0 (Ampere) on, where the tensor cores run it; fp16 before.

    Not `torch.cuda.is_bf16_supported()`: by default it also counts emulation, which would hand
    V100 / T4 an emulated bf16 many times slower than their fp16 tensor cores."""
    return "bf16" if capability >= (8, 0) else "fp16"


def measure_step_seconds(
    objective: torch.nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    autocast: bool,
    repeats: int = 3,
) -> float:
    """Median seconds of one forward + backward of `objective(images, labels)` on CPU, with or
    without bf16 autocast, after one warm-up; the gradients it makes are cleared."""
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss, _ = objective(images, labels)
        loss.backward()
        if i:  # the first call warms up (allocations, oneDNN kernel choice)
            times.append(time.perf_counter() - t0)
    objective.zero_grad(set_to_none=True)
    return statistics.median(times)


def resolve_precision(requested: str, timer: Callable[[bool], float] | None = None) -> str:
    """'auto': on GPUs `gpu_precision`. On CPU: fp32 without native bf16 (emulated bf16 is
    several times slower), and with it, whichever of fp32 and bf16 autocast `timer` (seconds of
    a training step of the real model, given autocast on/off) finds faster: native bf16 is
    slower than fp32 for some models (small ViTs: we saw 560 vs 640 images/s). bf16 must win by
    BF16_MIN_SPEEDUP; with no timer, fp32."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return gpu_precision(torch.cuda.get_device_capability())
    if not cpu_has_native_bf16() or timer is None:
        return "fp32"
    # Interleaved rounds, best of each: a busy neighbour slows whichever runs during its burst,
    # and the fastest round is the closest to the machine's own speed.
    rounds = [(timer(False), timer(True)) for _ in range(2)]
    fp32, bf16 = min(r[0] for r in rounds), min(r[1] for r in rounds)
    choice = "bf16" if bf16 * BF16_MIN_SPEEDUP < fp32 else "fp32"
    log.info("precision auto: a training step takes %.1f ms in fp32, %.1f ms in bf16 autocast "
             "-> %s", 1e3 * fp32, 1e3 * bf16, choice)  # fmt: skip
    return choice


def _merge(base: dict, extra: dict) -> dict:
    """`base` with `extra` merged in, nested dicts key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(
    cfg: Config, world_size: int, micro: int, accum: int, engine_precision: str
) -> dict:
    """DeepSpeed's JSON config for the weights' precision in the engine: "fp32", "bf16" or
    "fp16" (on CPU, bf16 runs as torch autocast around fp32 weights, i.e. "fp32" here).

    Half-precision weights keep fp32 master copies, and gradients accumulate and are reduced
    in fp32: summing many micro-batches or ranks in bf16 (8 mantissa bits) loses the small
    contributions. ZeRO-0 has no fp32-accumulating bf16 path in DeepSpeed (it would train the
    bf16 weights directly), so a bf16 run at stage 0 runs DeepSpeed's bf16 optimizer, which
    also shards the fp32 master weights and moments like stage 1."""
    stage = cfg.train.zero_stage
    ds: dict = {
        "train_batch_size": cfg.train.global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": engine_precision == "bf16"},
        "fp16": {"enabled": engine_precision == "fp16", "loss_scale": 0},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if engine_precision == "bf16":
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        ds["communication_data_type"] = "fp32"
        ds["zero_optimization"]["stage"] = max(stage, 1)
    return _merge(ds, cfg.train.deepspeed)
