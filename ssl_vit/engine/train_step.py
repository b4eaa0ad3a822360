"""One optimizer step of the rank's batch on the DeepSpeed engine, in micro-batches.

Kept apart from the training loop (ssl_vit.engine.trainer) so the hot path reads in one place:
uint8 images to [0, 1] floats on the device, forward under CPU bf16 autocast when chosen,
backward, and the step, skipped on every rank when any rank's loss is not finite.
"""

from __future__ import annotations

import deepspeed
import torch

from ssl_vit.engine.distributed import all_reduce_sum
from ssl_vit.engine.progress import MetricWindow


def _grad_norm(module: torch.nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def train_step(
    engine: deepspeed.DeepSpeedEngine,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    micro: int,
    cpu_autocast: bool,
    window: MetricWindow,
    want_grad_norm: bool,
    clip: float = 0.0,
) -> tuple[bool, bool, float]:
    """One optimizer step over the rank's batch, in micro-batches; returns
    (loss finite, step applied, grad norm). `clip` > 0: clip the gradients to that global norm
    here, before the engine steps (ZeRO-0 fp32, ssl_vit.engine.optim.clips_in_step); 0: the
    engine clips (or nothing does).

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
        with torch.autocast("cpu", torch.bfloat16, enabled=cpu_autocast):
            loss, metrics = engine(x, y)
        bad += ~torch.isfinite(loss.detach())
        engine.backward(loss)
        boundary = i == len(chunks) - 1  # grads are all-reduced now
        if boundary:
            finite = all_reduce_sum(bad).item() == 0
            optimizer.skip = not finite  # ZeRO-1/2 call step() once per param group: all skip
            if clip > 0:  # whole gradients, averaged over ranks by the backward just done
                norm = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), clip)
                grad_norm = float(norm) if want_grad_norm else 0.0  # a sync on log steps only
            elif want_grad_norm:
                grad_norm = _grad_norm(engine.module)
        engine.step()
        optimizer.skip = False
        window.add(loss.detach(), metrics)
    applied = finite and engine.was_step_applied()  # False on an fp16 overflow too
    reported = engine.get_global_grad_norm()  # set under ZeRO / half precision only
    if want_grad_norm and reported is not None:
        grad_norm = float(reported)
    return finite, applied, grad_norm
