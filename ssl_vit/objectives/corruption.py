"""BERT-style corruption of patch embeddings for MPP (paper sec. 4.6, appendix B.1.2).

Everything is drawn on the tokens' device with torch ops (top-k of uniform noise, uniform kind
draws, random offsets), so a training step never waits on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssl_vit.recipe import MPP, CorruptionKind

__all__ = [
    "Corruption",
    "draw_corruption",
    "apply_corruption",
    "visible_pixels",
    "MASK",
    "RANDOM",
    "KEPT",
]

MASK, RANDOM, KEPT = CorruptionKind.MASK, CorruptionKind.RANDOM, CorruptionKind.KEPT


@dataclass
class Corruption:
    """Which patches are corrupted and how.

    positions: (B, M) int64 patch indices (distinct within a row).
    kinds: (B, M) int64 `CorruptionKind` codes (MASK, RANDOM, KEPT).
    sources: (B, M) int64 patch whose embedding replaces a RANDOM position (same image; never
        the position itself); only read where kinds == 1.
    """

    positions: torch.Tensor
    kinds: torch.Tensor
    sources: torch.Tensor


def draw_corruption(
    batch: int,
    num_patches: int,
    num_corrupt: int,
    *,
    mask_prob: float = MPP.mask_prob,
    random_prob: float = MPP.random_prob,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> Corruption:
    """Pick exactly `num_corrupt` distinct patches per image, then a kind for each.

    The kind of each corrupted patch is drawn independently (mask with `mask_prob`, random with
    `random_prob`, else kept), as in BERT: the split is exact in expectation for any M, where
    fixed per-image counts would round 10% of a small M (e.g. 25 on 28x28 / patch 4) to 2 or 3.

    The random replacement is another patch *of the same image*, uniform over the N - 1 others
    (position + uniform offset in [1, N) mod N, so never itself). Same-image sources keep the
    objective independent of batch composition (per-rank batch size, a batch of one in the
    inspection tool) and make the intruder plausible in colour and texture, so the model must
    use context rather than image-level statistics to spot it. The source's *uncorrupted*
    embedding is used.
    """
    if not 0 < num_corrupt <= num_patches:
        raise ValueError(f"num_corrupt must be in [1, {num_patches}], got {num_corrupt}")
    if mask_prob < 0 or random_prob < 0 or mask_prob + random_prob > 1:
        raise ValueError(
            f"need mask_prob, random_prob >= 0 with sum <= 1, got {mask_prob}, {random_prob}"
        )
    if random_prob > 0 and num_patches < 2:
        raise ValueError("random replacement needs at least 2 patches per image")
    noise = torch.rand(batch, num_patches, device=device, generator=generator)
    positions = noise.topk(num_corrupt, dim=1, sorted=False).indices  # (B, M), a random subset
    u = torch.rand(batch, num_corrupt, device=device, generator=generator)
    kinds = (u >= mask_prob).long() + (u >= mask_prob + random_prob).long()  # (B, M) in {0, 1, 2}
    offsets = torch.randint(
        1, max(num_patches, 2), (batch, num_corrupt), device=device, generator=generator
    )
    sources = (positions + offsets) % num_patches  # (B, M), never equal to positions
    return Corruption(positions, kinds, sources)


def apply_corruption(
    tokens: torch.Tensor, corruption: Corruption, mask_token: torch.Tensor
) -> torch.Tensor:
    """Return a corrupted copy of patch embeddings (B, N, D); `mask_token` is (D,).

    Kept and uncorrupted positions are bit-identical to the input; gradients flow to the
    mask token and to the (uncorrupted) embeddings that were copied or kept.
    """
    D = tokens.shape[-1]
    idx = corruption.positions.unsqueeze(-1).expand(-1, -1, D)  # (B, M, D)
    orig = tokens.gather(1, idx)  # (B, M, D)
    src = tokens.gather(1, corruption.sources.unsqueeze(-1).expand(-1, -1, D))  # (B, M, D)
    kind = corruption.kinds.unsqueeze(-1)  # (B, M, 1)
    new = torch.where(kind == int(RANDOM), src, orig)
    new = torch.where(kind == int(MASK), mask_token.to(tokens.dtype), new)
    return tokens.scatter(1, idx, new)


def visible_pixels(corruption: Corruption, grid: tuple[int, int], patch_px: int) -> torch.Tensor:
    """(B, 1, H, W) mask, 0 on the pixels of masked and replaced patches, 1 elsewhere.

    For backbones whose patch embedding sees beyond its own patch (a hybrid's ResNet stem):
    multiplying the normalised image by it hides what a corrupted patch held from its
    neighbours' receptive fields. Kept patches stay visible, as their embeddings do.
    """
    B = corruption.positions.shape[0]
    hidden = (corruption.kinds != int(KEPT)).float()  # (B, M)
    grid_hidden = torch.zeros(B, grid[0] * grid[1], device=hidden.device)
    grid_hidden.scatter_(1, corruption.positions, hidden)  # (B, N)
    up = grid_hidden.view(B, 1, *grid).repeat_interleave(patch_px, 2).repeat_interleave(patch_px, 3)
    return 1.0 - up  # (B, 1, gh * P, gw * P)
