"""Per-GPU memory of a training config under each ZeRO stage: an estimate for `--check`.

Model states, per parameter (Rajbhandari et al. 2020, "ZeRO", sec. 3): with bf16/fp16 weights
2 bytes of weights, 2 of gradients and 12 of optimizer state (fp32 master, Adam's two moments);
in fp32, 4 + 4 + 8. Stage 1 splits the optimizer state over the ranks, stage 2 the gradients
too, stage 3 the weights as well.

Activations kept for the backward pass, per transformer block: s*b*h*(34 + 5*a*s/h) bytes in
half precision (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sec. 4.1; s tokens, b micro batch, h width, a heads); the 5as/h term is the attention
matrix, which flash attention does not keep. Twice that in fp32. Not counted: the framework's
workspace, fragmentation, and ZeRO-3's gathered-parameter buffers: leave a margin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssl_vit.config import Config, local_batch
from ssl_vit.models import build_backbone
from ssl_vit.models.networks import token_geometry

GIB = 2**30


@dataclass
class MemoryEstimate:
    params: int  # backbone parameters
    tokens: int  # sequence length (patches + prefix tokens)
    micro: int
    accum: int
    per_rank_batch: int
    model_states: dict[int, float]  # ZeRO stage -> bytes per GPU
    activations: float  # bytes per GPU for one micro batch (attention matrix kept)
    activations_flash: float  # the same with flash attention

    def total(self, stage: int, flash: bool = True) -> float:
        return self.model_states[stage] + (self.activations_flash if flash else self.activations)


def estimate(cfg: Config, world: int, in_chans: int, precision: str) -> MemoryEstimate:
    """Memory per GPU for `cfg` on `world` ranks, training in `precision` ("bf16", "fp16",
    "fp32"); the backbone is built on the meta device (no memory, no weights)."""
    per_rank, micro, accum = local_batch(cfg, world)
    with torch.device("meta"):
        model = build_backbone(cfg.model.arch, **cfg.model.backbone_kwargs(in_chans))
    params = sum(p.numel() for p in model.parameters())
    depth, width = len(model.blocks), int(model.embed_dim)
    attn = getattr(model.blocks[0], "attn", None)  # None: an MLP-Mixer
    heads = int(attn.num_heads) if attn is not None else 0
    grid = token_geometry(model).grid
    tokens = int(grid[0] * grid[1]) + int(getattr(model, "num_prefix_tokens", 0))

    half = precision in ("bf16", "fp16")
    weights, grads, optim = (2, 2, 12) if half else (4, 4, 8)
    states = {
        0: params * (weights + grads + optim),
        1: params * (weights + grads + optim / world),
        2: params * (weights + (grads + optim) / world),
        3: params * (weights + grads + optim) / world,
    }
    scale = 1 if half else 2
    per_block = tokens * micro * width * 34 * scale
    attention = tokens * micro * 5 * heads * tokens * scale
    return MemoryEstimate(
        params=params,
        tokens=tokens,
        micro=micro,
        accum=accum,
        per_rank_batch=per_rank,
        model_states=states,
        activations=depth * (per_block + attention),
        activations_flash=depth * per_block,
    )


def max_micro(est: MemoryEstimate, stage: int, gpu_gib: float) -> int:
    """The largest micro batch whose estimate fits `gpu_gib` at ZeRO `stage` (activations grow
    linearly with it); 0 when even the model states do not fit."""
    per_sample = est.activations_flash / est.micro
    room = gpu_gib * GIB - est.model_states[stage]
    return max(0, int(room // per_sample))


def describe(est: MemoryEstimate, world: int, gpu_gib: float = 80.0, configured: int = 0) -> str:
    """Lines for `--check`: the batch split, then GiB per GPU at each stage, the configured
    stage and the lowest that fits marked, and the largest micro batch that fits."""
    lines = [
        f"{world} rank(s): per-rank batch {est.per_rank_batch} = micro {est.micro} x "
        f"{est.accum} accumulation step(s); {est.params / 1e6:.1f}M parameters, "
        f"{est.tokens} tokens",
    ]
    fits = [s for s in range(4) if est.total(s) / GIB <= gpu_gib]
    for stage in range(4):
        states, total = est.model_states[stage] / GIB, est.total(stage) / GIB
        notes = ["configured (train.zero_stage)"] if stage == configured else []
        if fits and stage == fits[0]:
            notes.append("lowest stage that fits")
        note = f"  <- {', '.join(notes)}" if notes else ""
        lines.append(
            f"  ZeRO-{stage}: model states {states:6.1f} GiB + activations "
            f"{est.activations_flash / GIB:5.1f} GiB (flash; {est.activations / GIB:.1f} "
            f"without) = {total:6.1f} GiB per GPU{note}"
        )
    largest = max_micro(est, configured, gpu_gib)
    lines.append(
        f"  largest micro batch that fits {gpu_gib:g} GiB at ZeRO-{configured}: {largest} "
        f"(now {est.micro}; set train.micro_batch to cap it)"
    )
    if configured not in fits:
        lines.append(
            f"  ZeRO-{configured} does not fit {gpu_gib:.0f} GiB at micro batch {est.micro}: "
            + (f"use ZeRO-{fits[0]} or " if fits else "")
            + "lower train.micro_batch"
        )
    return "\n".join(lines)
