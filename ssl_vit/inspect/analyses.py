"""The paper's inspection maths (section 4.5, figure 7) and attention rollout; no plotting here.

Conventions: a timm VisionTransformer with `num_prefix_tokens` leading tokens ([class] and any
registers) followed by N = gh * gw patch tokens in row-major order; attention maps are
(B, H, T, T) with rows = queries, summing to 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ssl_vit.inspect.attention import AttentionRecorder
from ssl_vit.models import token_geometry
from ssl_vit.objectives.mpp import MPPPrediction, decode_color_classes


def patch_grid(model: nn.Module) -> tuple[int, int]:
    """(rows, cols) of the token grid."""
    return token_geometry(model).grid


def patch_pixels(model: nn.Module) -> tuple[int, int]:
    """Pixels between neighbouring tokens: the patch size (stem stride x patch for hybrids)."""
    p = token_geometry(model).patch_px
    return p, p


def embedding_filter_components(
    weight: torch.Tensor, k: int = 28
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k principal components of the patch projection (section 4.5, figure 7 left).

    weight: (D, C, P, P), the conv/linear filters of the patch embedding. Each of the D
    filters is one sample in C*P*P pixel space; the components are the eigenvectors of their
    covariance, i.e. the right singular vectors of the centred (D, C*P*P) matrix.
    Returns components (k, C, P, P), orthonormal when flattened, and the fraction of the
    variance each explains (k,).
    """
    w = weight.detach().float().flatten(1)  # (D, C*P*P)
    w = w - w.mean(dim=0, keepdim=True)
    _, s, vh = torch.linalg.svd(w, full_matrices=False)  # vh: (min(D, CPP), CPP)
    k = min(k, vh.shape[0])
    var = s.square()
    ratio = var[:k] / var.sum().clamp_min(1e-12)
    return vh[:k].reshape(k, *weight.shape[1:]), ratio


def patch_position_embeddings(model: nn.Module) -> torch.Tensor:
    """The patches' position embeddings (N, D), prefix-token embeddings dropped."""
    pos = model.pos_embed.detach()[0]  # (T or N, D)
    if not getattr(model, "no_embed_class", False):
        pos = pos[model.num_prefix_tokens :]
    gh, gw = patch_grid(model)
    if pos.shape[0] != gh * gw:
        raise ValueError(f"pos_embed has {pos.shape[0]} patch entries, grid is {gh}x{gw}")
    return pos


def position_similarity(pos: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Cosine similarity of every patch's position embedding with every other's (figure 7 centre).

    pos: (N, D). Returns (gh, gw, gh, gw): [r, c] is the map for the patch at row r, column c.
    Cosine, not raw dot products: embedding norms would otherwise dominate the picture.
    """
    p = torch.nn.functional.normalize(pos.float(), dim=-1)  # (N, D)
    return (p @ p.T).reshape(*grid, *grid)  # (N, N) -> (gh, gw, gh, gw)


def patch_distances(grid: tuple[int, int], patch: tuple[int, int]) -> torch.Tensor:
    """(N, N) Euclidean distances in pixels between patch centres."""
    gh, gw = grid
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    xy = torch.stack([rows.flatten() * patch[0], cols.flatten() * patch[1]], dim=-1).float()
    return torch.cdist(xy, xy)  # (N, N)


def mean_attention_distance(
    attn: torch.Tensor, dist: torch.Tensor, num_prefix_tokens: int
) -> torch.Tensor:
    """Attention-weighted mean query-key distance in pixels, per image and head (figure 7 right).

    attn: (B, H, T, T); dist: (N, N) from `patch_distances`. Prefix tokens are dropped as
    queries and keys, and each query's remaining weights are renormalised to sum to 1 (the
    [class] token has no position in the image). Returns (B, H), the mean over queries.
    """
    a = attn[:, :, num_prefix_tokens:, num_prefix_tokens:].float()  # (B, H, N, N)
    a = a / a.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    return (a * dist.to(a.device)).sum(dim=-1).mean(dim=-1)  # per query (B, H, N), then mean


def attention_rollout(attns: list[torch.Tensor]) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020) through all layers.

    Per layer: heads averaged, identity added for the residual path, rows renormalised; then
    the layers multiplied, later layers on the left (R = A_L ... A_1). Returns (B, T, T);
    row t says how much each input token flows into output token t.
    """
    rollout = None
    for a in attns:
        a = a.float().mean(dim=1)  # (B, T, T)
        a = a + torch.eye(a.shape[-1], device=a.device)
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout
    if rollout is None:
        raise ValueError("attention_rollout needs at least one layer")
    return rollout


def class_rollout_maps(
    rollout: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int
) -> torch.Tensor:
    """The [class] row of a rollout over the patches, as (B, gh, gw) maps scaled to max 1."""
    if num_prefix_tokens < 1:
        raise ValueError("model has no [class] token; there is no [class] rollout row")
    m = rollout[:, 0, num_prefix_tokens:]  # (B, N)
    m = m / m.amax(dim=-1, keepdim=True).clamp_min(1e-12)
    return m.reshape(-1, *grid)


def mean_pairwise_grid_distance(grid: tuple[int, int], patch: tuple[int, int]) -> float:
    """Mean distance over all ordered patch pairs, self-pairs included (uniform attention)."""
    return float(patch_distances(grid, patch).mean())


@dataclass
class AttentionStats:
    distance: torch.Tensor  # (L, H) mean attention distance in pixels, averaged over images
    rollout: torch.Tensor  # (S, gh, gw) [class] rollout maps of the first S images
    num_images: int


@torch.no_grad()
def attention_statistics(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    num_rollout: int = 8,
) -> AttentionStats:
    """Run normalised image batches (B, C, H, W) through the model, accumulating figure 7's
    mean attention distance and keeping the [class] rollout of the first `num_rollout` images."""
    grid, patch = patch_grid(model), patch_pixels(model)
    npre = int(model.num_prefix_tokens)
    dist = patch_distances(grid, patch)
    total: torch.Tensor | None = None
    n = kept = 0
    maps: list[torch.Tensor] = []
    with AttentionRecorder(model) as rec:
        for x in batches:
            model.forward_features(x)
            per_layer = torch.stack(
                [mean_attention_distance(a, dist, npre) for a in rec.maps]
            )  # (L, B, H)
            s = per_layer.sum(dim=1).cpu()  # (L, H)
            total = s if total is None else total + s
            n += x.shape[0]
            if kept < num_rollout and npre > 0:
                take = min(num_rollout - kept, x.shape[0])
                r = attention_rollout([a[:take] for a in rec.maps])
                maps.append(class_rollout_maps(r, grid, npre).cpu())
                kept += take
    if total is None:
        raise ValueError("attention_statistics got no images")
    rollout = torch.cat(maps) if maps else torch.empty(0, *grid)
    return AttentionStats(distance=total / n, rollout=rollout, num_images=n)


def mpp_mean_colours(
    prediction: MPPPrediction,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MPP predictions (section 4.6) as colours: (positions (B, M), kinds (B, M),
    predicted (B, M, C), true (B, M, C)) with colours the 3-bit bin centres in [0, 1].
    Only the paper's mean-colour target has one colour per patch."""
    if prediction.target_kind != "mean_color":
        raise ValueError(
            f"MPP target {prediction.target_kind!r}: the colour panel needs target mean_color"
        )

    bits, chans = prediction.bits, prediction.in_chans
    pred = decode_color_classes(prediction.pred, bits=bits, in_chans=chans)  # (B, M, C)
    true = decode_color_classes(prediction.target, bits=bits, in_chans=chans)  # (B, M, C)
    return prediction.positions, prediction.kinds, pred, true
