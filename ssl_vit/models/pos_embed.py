"""2-D interpolation of learned position embeddings when the resolution changes.

Paper sec. 3.2: fine-tuning at higher resolution keeps the patch size, so the token grid grows;
the pretrained position embeddings are 2-D interpolated to the new grid. Prefix tokens ([class],
registers) keep their embeddings. timm's `resample_abs_pos_embed` does the interpolation.
"""

from __future__ import annotations

import torch
from timm.layers import resample_abs_pos_embed
from torch import nn

__all__ = ["resample_pos_embed", "adapt_pos_embed_state"]


def resample_pos_embed(
    posemb: torch.Tensor,
    new_grid: tuple[int, int],
    old_grid: tuple[int, int] | None = None,
    *,
    num_prefix_tokens: int = 1,
    interpolation: str = "bicubic",
) -> torch.Tensor:
    """Resample (1, prefix + Ho*Wo, D) embeddings to (1, prefix + Hn*Wn, D).

    The identity (the same tensor) when the grid does not change; `old_grid` defaults to square.
    """
    n_old = posemb.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = int(round(n_old**0.5))
        old_grid = (side, side)
    if old_grid[0] * old_grid[1] != n_old:
        raise ValueError(f"pos_embed has {n_old} patch entries, not a {old_grid} grid")
    if tuple(old_grid) == tuple(new_grid):
        return posemb
    return resample_abs_pos_embed(
        posemb,
        new_size=list(new_grid),
        old_size=list(old_grid),
        num_prefix_tokens=num_prefix_tokens,
        interpolation=interpolation,
        antialias=True,
    )


def adapt_pos_embed_state(
    state: dict[str, torch.Tensor], model: nn.Module, old_grid: tuple[int, int] | None
) -> dict[str, torch.Tensor]:
    """Return `state` with its "pos_embed" resampled from `old_grid` to `model`'s token grid."""
    posemb = state.get("pos_embed")
    if posemb is None or getattr(model, "pos_embed", None) is None:
        return state
    prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
    new_grid = tuple(model.patch_embed.grid_size)
    out = dict(state)
    out["pos_embed"] = resample_pos_embed(posemb, new_grid, old_grid, num_prefix_tokens=prefix)
    return out
