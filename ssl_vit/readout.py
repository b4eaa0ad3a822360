"""Read-out: which block's output, pooled how, becomes a frozen backbone's feature vector.

    tokens = block_tokens(vit, x, [3, 6])            # {3: (B, T, D), 6: (B, T, D)}, normed
    f = pool_tokens(vit, x, "mean")                  # (B, D): mean patch token, last block
    f = pool_tokens(vit, x, "tokens", layer=4)       # (B, N*D): block 4's patch tokens, in order

Blocks are numbered from 1 (the first transformer or mixer block) to the depth; `layer=None`
is the last block, which is what `forward_features` returns. Every block's output goes through
the backbone's final norm, so features of different depths are on one scale (DINO's
`lastn` read-out normalises each block the same way).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ssl_vit.feature_options import POOLS

__all__ = [
    "POOLS",
    "depth_of",
    "block_tokens",
    "pool_from_tokens",
    "pool_tokens",
    "readout_name",
    "last_n_cls",
]


def depth_of(model: nn.Module) -> int:
    """Number of blocks a read-out can choose from (0 for a model without `blocks`)."""
    blocks = getattr(model, "blocks", None)
    return len(blocks) if blocks is not None else 0


def _check_layer(model: nn.Module, layer: int) -> None:
    depth = depth_of(model)
    if not 1 <= layer <= depth:
        raise ValueError(f"layer {layer}: this backbone has blocks 1..{depth}; pick one of those")


def block_tokens(
    model: nn.Module, x: torch.Tensor, layers: Sequence[int]
) -> dict[int, torch.Tensor]:
    """Output tokens (B, T, D) of the given blocks (1-based), each through the final norm.

    One forward pass serves every requested block (forward hooks), so choosing among all the
    blocks of a backbone costs what reading the last one does.
    """
    for layer in layers:
        _check_layer(model, layer)
    grabbed: dict[int, torch.Tensor] = {}
    blocks = model.blocks
    hooks = [
        blocks[layer - 1].register_forward_hook(
            lambda m, i, o, layer=layer: grabbed.__setitem__(layer, o)
        )
        for layer in set(layers)
    ]
    try:
        model.forward_features(x)
    finally:
        for h in hooks:
            h.remove()
    norm = getattr(model, "norm", nn.Identity())
    return {layer: norm(grabbed[layer]) for layer in layers}


def pool_from_tokens(tokens: torch.Tensor, pool: str, num_prefix: int) -> torch.Tensor:
    """(B, T, D) tokens -> (B, D') feature; `num_prefix` tokens ([class], registers) lead."""
    if pool == "cls":
        return tokens[:, 0]
    if pool == "mean":
        return tokens[:, num_prefix:].mean(dim=1)  # patch tokens only, not [class]/registers
    if pool == "tokens":
        return tokens[:, num_prefix:].flatten(1)  # (B, N*D), row-major over the grid
    raise ValueError(f"unknown pool {pool!r}; choose one of {POOLS}")


def last_n_cls(model: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
    """[class] tokens of the last n blocks, each through the final norm, concatenated.

    DINO's linear eval of ViT-S uses n=4.
    """
    depth = depth_of(model)
    if depth < n:
        raise ValueError(f"pool 'lastn' needs a ViT with at least {n} blocks")
    layers = list(range(depth - n + 1, depth + 1))
    out = block_tokens(model, x, layers)
    return torch.cat([out[layer][:, 0] for layer in layers], dim=-1)  # (B, n*D)


def pool_tokens(
    model: nn.Module, x: torch.Tensor, pool: str, n_last: int = 4, layer: int | None = None
) -> torch.Tensor:
    """Features (B, D') of normalised images x (B, C, H, W) from block `layer` (None: last)."""
    has_cls = bool(getattr(model, "cls_token", None) is not None)
    if pool in ("cls", "lastn") and not has_cls:
        raise ValueError(f"pool {pool!r} needs a [class] token; this backbone has none, use mean")
    if pool == "lastn":
        if layer is not None:
            raise ValueError("pool 'lastn' reads the last n blocks; drop --layer or pick a pool")
        return last_n_cls(model, x, n_last)
    if pool not in POOLS or pool == "auto":
        raise ValueError(f"unknown pool {pool!r}; choose one of {POOLS[1:]}")
    if layer is None:
        tokens = model.forward_features(x)  # (B, T, D), final norm applied
    else:
        tokens = block_tokens(model, x, [layer])[layer]
    return pool_from_tokens(tokens, pool, int(getattr(model, "num_prefix_tokens", 0)))


def readout_name(pool: str, layer: int | None) -> str:
    """How results and cache keys name a read-out: 'mean' (last block), 'tokens@block4'."""
    return pool if layer is None else f"{pool}@block{layer}"
