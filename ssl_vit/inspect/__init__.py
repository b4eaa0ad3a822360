"""Inspecting a ViT (paper section 4.5, figure 7): embedding filters, position-embedding
similarity, mean attention distance, attention rollout, and MPP predictions.

The maths lives in `analyses` (and `attention` for getting the weights out of timm's fused
attention); `plots` draws; `inspect_model` ties them together for `evals/inspect_vit.py`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssl_vit.data.manifest import atomic_write_text
from ssl_vit.inspect import plots
from ssl_vit.inspect.analyses import (
    AttentionStats,
    attention_rollout,
    attention_statistics,
    class_rollout_maps,
    embedding_filter_components,
    mean_attention_distance,
    mean_pairwise_grid_distance,
    mpp_mean_colours,
    patch_distances,
    patch_grid,
    patch_pixels,
    patch_position_embeddings,
    position_similarity,
)
from ssl_vit.inspect.attention import AttentionRecorder, attention_from_qkv, record_attention
from ssl_vit.models import backbone_kind

__all__ = [
    "AttentionRecorder",
    "AttentionStats",
    "attention_from_qkv",
    "attention_rollout",
    "attention_statistics",
    "class_rollout_maps",
    "embedding_filter_components",
    "inspect_model",
    "mean_attention_distance",
    "mean_pairwise_grid_distance",
    "mpp_mean_colours",
    "patch_distances",
    "patch_grid",
    "patch_pixels",
    "patch_position_embeddings",
    "position_similarity",
    "record_attention",
]

log = logging.getLogger(__name__)


def _patch_projection_weight(model: nn.Module) -> torch.Tensor | None:
    """(D, C, P, P) filters applied to raw pixels, or None (hybrids project CNN features)."""
    embed = model.patch_embed if backbone_kind(model) == "vit" else model.stem
    proj = getattr(embed, "proj", None)
    w = getattr(proj, "weight", None)
    return (
        w if (w is not None and w.dim() == 4 and getattr(embed, "backbone", None) is None) else None
    )


@torch.no_grad()
def inspect_model(
    model: nn.Module,
    images01: torch.Tensor,
    out_dir: str | os.PathLike,
    *,
    mean: Sequence[float],
    std: Sequence[float],
    batch_size: int = 32,
    num_show: int = 8,
    num_filters: int = 28,
    title: str = "",
    mpp: nn.Module | None = None,
    num_mpp: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """Run every analysis the backbone supports on `images01` (N, C, H, W) in [0, 1]; write the
    PNGs and `inspect.json` under out_dir. Returns the summary (also in inspect.json).

    `mpp`: a MaskedPatchPrediction around `model` (with its trained head) for the MPP panel,
    drawn on the first `num_mpp` images with a corruption seeded by `seed`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    device = next(model.parameters()).device
    kind = backbone_kind(model)
    grid, patch = patch_grid(model), patch_pixels(model)
    m = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    summary: dict[str, Any] = {"num_images": int(images01.shape[0]), "grid": list(grid)}
    pngs: dict[str, str] = {}
    prefix = f"{title}: " if title else ""

    weight = _patch_projection_weight(model)
    if weight is not None:
        comps, ratio = embedding_filter_components(weight, num_filters)
        fig = plots.plot_embedding_filters(comps, ratio, title=prefix)
        pngs["filters"] = str(plots.save_figure(fig, out / "embedding_filters.png"))
        summary["filter_variance_ratio"] = [round(float(r), 5) for r in ratio]
    else:
        log.info("no pixel patch projection (hybrid backbone): skipping embedding filters")

    if getattr(model, "pos_embed", None) is not None:
        sim = position_similarity(patch_position_embeddings(model), grid)
        fig = plots.plot_position_similarity(sim, title=prefix)
        pngs["position"] = str(plots.save_figure(fig, out / "position_similarity.png"))
    else:  # a Mixer's token-mixing weights are tied to positions: no embedding to compare
        summary.setdefault("not_applicable", {})["position_similarity"] = (
            f"not applicable: a {kind} backbone has no position embeddings"
        )

    if kind == "vit":

        def batches():
            for i in range(0, images01.shape[0], batch_size):
                j = min(i + batch_size, images01.shape[0])
                log.info("attention: images %d-%d of %d", i, j, images01.shape[0])
                yield (images01[i : i + batch_size].to(device).float() - m) / s

        stats = attention_statistics(model, batches(), num_rollout=num_show)
        uniform = mean_pairwise_grid_distance(grid, patch)
        H, W = images01.shape[-2:]
        fig = plots.plot_attention_distance(
            stats.distance,
            uniform=uniform,
            max_distance=float((H**2 + W**2) ** 0.5),
            num_images=stats.num_images,
            title=prefix,
        )
        pngs["distance"] = str(plots.save_figure(fig, out / "attention_distance.png"))
        summary["mean_attention_distance_px"] = stats.distance.tolist()  # (L, H)
        summary["uniform_attention_distance_px"] = uniform
        if stats.rollout.shape[0]:
            fig = plots.plot_rollout(images01[:num_show], stats.rollout, title=prefix)
            pngs["rollout"] = str(plots.save_figure(fig, out / "attention_rollout.png"))
    else:  # an MLP-Mixer mixes tokens with MLPs: there are no attention weights to plot
        why = f"not applicable: a {kind} backbone has no attention (token-mixing MLPs)"
        summary.setdefault("not_applicable", {}).update(
            {"attention_distance": why, "attention_rollout": why}
        )
        log.info("attention distance and rollout %s", why)

    if mpp is not None:
        mpp.eval()
        gen = torch.Generator(device=device).manual_seed(seed)
        pred = mpp.predict(images01[:num_mpp].to(device).float(), generator=gen)
        if pred.target_kind == "mean_color":
            pos, kinds, pc, tc = mpp_mean_colours(pred)
            fig = plots.plot_mpp_predictions(
                images01[: pos.shape[0]], pos, kinds, pc, tc, patch=patch, title=prefix
            )
            pngs["mpp"] = str(plots.save_figure(fig, out / "mpp_predictions.png"))
            hit = (pred.pred == pred.target).float()  # (S, M)
            summary["mpp_shown_accuracy"] = {
                name: float(hit[pred.kinds == k].mean()) if bool((pred.kinds == k).any()) else None
                for k, name in ((0, "mask"), (1, "random"), (2, "kept"))
            }
        else:
            log.info("MPP target %s has no single colour per patch: no panel", pred.target_kind)

    summary["pngs"] = pngs
    atomic_write_text(out / "inspect.json", json.dumps(summary, indent=2) + "\n")
    return summary
