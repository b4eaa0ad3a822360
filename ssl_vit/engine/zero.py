"""What ZeRO-3 needs from our objectives, kept here so models and objectives stay engine-agnostic.

ZeRO-3 splits every parameter across ranks and gathers a module's own parameters only around
that module's forward. MPP drives the timm backbone in pieces (it corrupts patch embeddings
between the patch projection and the position embeddings, sec. 4.6), and the supervised head
calls `forward_features` / `forward_head`, so the backbone's own tensors (`pos_embed`,
`cls_token`, `reg_token`) are read outside any forward of the backbone. They are registered as
external parameters of the objective (DeepSpeed's API for this case) so the objective's forward
gathers them, and gathered explicitly around calls that bypass that forward (evaluation).

Every forward under ZeRO-3 is a collective, so ranks must run the same number of them:
`even_batches` pads a rank that runs out with placeholder batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import deepspeed
import torch
from torch import nn

from ssl_vit.engine.distributed import all_reduce_sum

__all__ = ["loose_parameters", "register_loose_parameters", "gathered_loose", "even_batches"]


def loose_parameters(objective: nn.Module) -> list[nn.Parameter]:
    """The backbone's direct parameters (owned by no submodule whose forward we call), and
    whatever else the objective declares through its own `loose_parameters()` (a cascade's
    stages)."""
    backbone = getattr(objective, "backbone", None)
    params = [] if backbone is None else list(backbone.parameters(recurse=False))
    declared = getattr(objective, "loose_parameters", None)
    if callable(declared):
        params += [p for p in declared() if all(p is not q for q in params)]
    return params


def register_loose_parameters(objective: nn.Module) -> None:
    for p in loose_parameters(objective):
        deepspeed.zero.register_external_parameter(objective, p)


def is_zero3(module: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


def gathered_loose(objective: nn.Module) -> contextlib.AbstractContextManager:
    """Gather the loose parameters on every rank (collective), for calls other than forward."""
    params = loose_parameters(objective)
    if not params or not is_zero3(objective):
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def even_batches(
    batches: Iterable[tuple], placeholder: tuple, device: torch.device
) -> Iterator[tuple[tuple, bool]]:
    """(batch, real) pairs until no rank has a batch left; a rank that ran out gets
    `(placeholder, False)` so every rank makes the same number of (collective) forwards."""
    it = iter(batches)
    while True:
        batch = next(it, None)
        left = all_reduce_sum(torch.tensor(float(batch is not None), device=device))
        if left.item() == 0:
            return
        yield (batch, True) if batch is not None else (placeholder, False)
