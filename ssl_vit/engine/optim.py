"""Optimizer, learning-rate schedule and the DeepSpeed config built from a `Config`."""

from __future__ import annotations

import math

import torch
from timm.optim import param_groups_layer_decay

from ssl_vit.config import Config
from ssl_vit.objectives import no_weight_decay_names, param_groups


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


def _merge(base: dict, extra: dict) -> dict:
    """`base` with `extra` merged in, nested dicts key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def clips_in_step(cfg: Config, engine_precision: str) -> bool:
    """Whether the training step clips the gradients (torch's clip_grad_norm_, on the device,
    no host sync) in place of DeepSpeed: fp32 weights at ZeRO-0, where every rank holds whole
    gradients, already averaged over ranks when the step begins. There DeepSpeed's clip walks
    the parameters in Python, builds tensors and all-reduces a norm every rank already has, a
    cost that matters for small models (docs/training.md). ZeRO stages and half
    precision keep DeepSpeed's: their gradients are partitioned or kept in fp32 copies."""
    return engine_precision == "fp32" and cfg.train.zero_stage == 0 and cfg.optim.grad_clip > 0


def deepspeed_config(
    cfg: Config,
    world_size: int,
    micro: int,
    accum: int,
    engine_precision: str,
    *,
    on_gpu: bool = False,
    params: int = 0,
    width: int = 0,
) -> dict:
    """DeepSpeed's JSON config for the weights' precision in the engine: "fp32", "bf16" or
    "fp16" (on CPU, bf16 runs as torch autocast around fp32 weights, i.e. "fp32" here).

    Half-precision weights keep fp32 master copies, and gradients accumulate and are reduced
    in fp32: summing many micro-batches or ranks in bf16 (8 mantissa bits) loses the small
    contributions. ZeRO-0 has no fp32-accumulating bf16 path in DeepSpeed (it would train the
    bf16 weights directly), so a bf16 run at stage 0 runs DeepSpeed's bf16 optimizer, which
    also shards the fp32 master weights and moments like stage 1.

    `on_gpu`: the engine runs on CUDA, where ZeRO's communication is given its GPU settings,
    sized by the model's `params` (elements) and `width` (`comm_settings`)."""
    stage = cfg.train.zero_stage
    ds: dict = {
        "train_batch_size": cfg.train.global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        # the step clips where `clips_in_step`; DeepSpeed clips everywhere else
        "gradient_clipping": 0.0 if clips_in_step(cfg, engine_precision) else cfg.optim.grad_clip,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": engine_precision == "bf16"},
        "fp16": {"enabled": engine_precision == "fp16", "loss_scale": 0},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronizes the GPU at every forward and
        # every step to time them, for a line it prints every steps_per_print steps: never here
        # (the trainer measures images/s itself). Off, so it stalls no step.
        "timers": {"throughput": {"enabled": False}},
    }
    if engine_precision == "bf16":
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        ds["communication_data_type"] = "fp32"
        ds["zero_optimization"]["stage"] = max(stage, 1)
    if on_gpu:
        ds["zero_optimization"].update(
            comm_settings(ds["zero_optimization"]["stage"], params, width)
        )
    return _merge(ds, cfg.train.deepspeed)


# A ZeRO-1/2 gradient bucket (elements). Not below 25 MiB of fp32 gradients, the bucket
# PyTorch's DistributedDataParallel reduces by default (`bucket_cap_mb=25`, torch.nn.parallel
# docs): smaller collectives stop filling the links. Not above 5e8, DeepSpeed's own default
# for `reduce_bucket_size` / `allgather_bucket_size` (DeepSpeed config JSON docs, ZeRO section).
_MIN_BUCKET = 25 * 2**20 // 4
_MAX_BUCKET = 500_000_000
_BUCKETS_PER_MODEL = 8  # gradients of a step leave in about this many reductions


def comm_settings(stage: int, params: int, width: int = 0) -> dict:
    """ZeRO communication settings for GPUs (NCCL), sized to a model of `params` parameters
    whose transformer width is `width` (0: not known); {} at stage 0, which has no ZeRO
    optimizer.

    `overlap_comm` reduces a bucket of gradients on a side stream while the backward pass goes
    on (DeepSpeed turns it on by itself only at stage 3), and `contiguous_gradients` copies each
    gradient into the bucket as it is produced, so the bucket is sent without a gather.
    DeepSpeed's default bucket (5e8 elements) is larger than a ViT-B or ViT-L: the whole
    reduction would wait for the end of the backward, with nothing to overlap, and each rank
    would hold a 1-2 GB staging buffer (5e8 bf16 or fp32 elements, allocated whole whatever the
    model; two of them with overlap). Here a ZeRO-1/2 bucket is an eighth of the model, within
    [25 MiB of fp32, 5e8 elements]: a ViT-B/16's gradients leave in 8 reductions of 44 MiB.

    Stage 3 follows the sizes the Hugging Face Transformers DeepSpeed integration fills in for
    "auto" (its DeepSpeed guide, ZeRO-3 config): reduce bucket width^2, prefetch bucket
    0.9 x width^2 and parameters under 10 x width kept whole on every rank (the biases and
    norms: gathering them costs a collective each for a few kB). Without a width, stage 3 keeps
    DeepSpeed's prefetch and persistence defaults and takes the ZeRO-1/2 bucket."""
    if stage < 1:
        return {}
    bucket = -(-params // _BUCKETS_PER_MODEL)  # ceil
    bucket = -(-bucket // 2**20) * 2**20  # whole MiB-elements; all-gather wants an even count
    bucket = min(_MAX_BUCKET, max(_MIN_BUCKET, bucket))
    out: dict = {"overlap_comm": True, "contiguous_gradients": True}
    if stage < 3:
        return out | {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if not width:
        return out | {"reduce_bucket_size": bucket}
    return out | {
        "reduce_bucket_size": width * width,
        "stage3_prefetch_bucket_size": int(0.9 * width * width),
        "stage3_param_persistence_threshold": 10 * width,
    }


def model_size(module: torch.nn.Module) -> dict[str, int]:
    """`params` and `width` for `deepspeed_config`: the parameter count of the whole objective
    and its backbone's token width (`embed_dim` of timm's ViTs, hybrids and Mixers; 0 when
    there is none)."""
    backbone = getattr(module, "backbone", module)
    return {
        "params": sum(p.numel() for p in module.parameters()),
        "width": int(getattr(backbone, "embed_dim", 0) or 0),
    }
