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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssl_vit.inspect import plots
from ssl_vit.inspect.analyses import (
    attention_statistics,
    embedding_filter_components,
    mean_pairwise_grid_distance,
    mpp_mean_colours,
    patch_grid,
    patch_pixels,
    patch_position_embeddings,
    position_similarity,
)
from ssl_vit.io import atomic_write_text
from ssl_vit.models import backbone_kind
from ssl_vit.recipe import CorruptionKind

__all__ = ["inspect_model"]  # the analyses: ssl_vit.inspect.analyses, .attention; figures: .plots

log = logging.getLogger(__name__)


def _patch_projection_weight(model: nn.Module) -> torch.Tensor | None:
    """(D, C, P, P) filters applied to raw pixels, or None (hybrids project CNN features)."""
    embed = model.patch_embed if backbone_kind(model) == "vit" else model.stem
    w = getattr(getattr(embed, "proj", None), "weight", None)
    return (
        w if (w is not None and w.dim() == 4 and getattr(embed, "backbone", None) is None) else None
    )


@dataclass
class _Inspection:
    """What every analysis reads, and the summary and PNG paths they add to."""

    model: nn.Module
    images01: torch.Tensor  # (N, C, H, W) in [0, 1], on the CPU
    out: Path
    prefix: str  # figure title prefix
    device: torch.device
    summary: dict[str, Any]
    pngs: dict[str, str]

    def save(self, key: str, fig: Any, name: str) -> None:
        self.pngs[key] = str(plots.save_figure(fig, self.out / name))


def _embedding_filters(ins: _Inspection, num_filters: int) -> None:
    weight = _patch_projection_weight(ins.model)
    if weight is None:
        log.info("no pixel patch projection (hybrid backbone): skipping embedding filters")
        return
    comps, ratio = embedding_filter_components(weight, num_filters)
    ins.save(
        "filters",
        plots.plot_embedding_filters(comps, ratio, title=ins.prefix),
        "embedding_filters.png",
    )
    ins.summary["filter_variance_ratio"] = [round(float(r), 5) for r in ratio]


def _not_applicable(ins: _Inspection, names: tuple[str, ...], why: str) -> None:
    """Say in inspect.json (and the log) which analyses this backbone has nothing for."""
    ins.summary.setdefault("not_applicable", {}).update(
        {n: f"not applicable: {why}" for n in names}
    )
    log.info("%s: not applicable: %s", " and ".join(names), why)


def _position_similarity(ins: _Inspection) -> None:
    if getattr(ins.model, "pos_embed", None) is None:  # a Mixer: mixing weights are per position
        why = f"a {backbone_kind(ins.model)} backbone has no position embeddings"
        _not_applicable(ins, ("position_similarity",), why)
        return
    sim = position_similarity(patch_position_embeddings(ins.model), patch_grid(ins.model))
    ins.save(
        "position", plots.plot_position_similarity(sim, title=ins.prefix), "position_similarity.png"
    )


def _attention(ins: _Inspection, mean, std, batch_size: int, num_show: int) -> None:
    """Mean attention distance per head and depth, and attention rollout (ViTs only)."""
    kind = backbone_kind(ins.model)
    if kind != "vit":  # an MLP-Mixer mixes tokens with MLPs: no attention weights to plot
        why = f"a {kind} backbone has no attention (token-mixing MLPs)"
        _not_applicable(ins, ("attention_distance", "attention_rollout"), why)
        return
    images = ins.images01
    m = torch.tensor(mean, dtype=torch.float32, device=ins.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=ins.device).view(1, -1, 1, 1)

    def batches():
        for i in range(0, images.shape[0], batch_size):
            j = min(i + batch_size, images.shape[0])
            log.info("attention: images %d-%d of %d", i, j, images.shape[0])
            yield (images[i : i + batch_size].to(ins.device).float() - m) / s

    stats = attention_statistics(ins.model, batches(), num_rollout=num_show)
    uniform = mean_pairwise_grid_distance(patch_grid(ins.model), patch_pixels(ins.model))
    H, W = images.shape[-2:]
    fig = plots.plot_attention_distance(
        stats.distance,
        uniform=uniform,
        max_distance=float((H**2 + W**2) ** 0.5),
        num_images=stats.num_images,
        title=ins.prefix,
    )
    ins.save("distance", fig, "attention_distance.png")
    ins.summary["mean_attention_distance_px"] = stats.distance.tolist()  # (L, H)
    ins.summary["uniform_attention_distance_px"] = uniform
    if stats.rollout.shape[0]:
        fig = plots.plot_rollout(images[:num_show], stats.rollout, title=ins.prefix)
        ins.save("rollout", fig, "attention_rollout.png")


def _mpp_predictions(ins: _Inspection, mpp: nn.Module, num_mpp: int, seed: int) -> None:
    """What MPP predicts for the patches it could not see (sec. 4.6)."""
    mpp.eval()
    gen = torch.Generator(device=ins.device).manual_seed(seed)
    pred = mpp.predict(ins.images01[:num_mpp].to(ins.device).float(), generator=gen)
    if pred.target_kind != "mean_color":
        log.info("MPP target %s has no single colour per patch: no panel", pred.target_kind)
        return
    pos, kinds, pc, tc = mpp_mean_colours(pred)
    shown, patch = ins.images01[: pos.shape[0]], patch_pixels(ins.model)
    fig = plots.plot_mpp_predictions(shown, pos, kinds, pc, tc, patch=patch, title=ins.prefix)
    ins.save("mpp", fig, "mpp_predictions.png")
    hit = (pred.pred == pred.target).float()  # (S, M)
    ins.summary["mpp_shown_accuracy"] = {
        k.key: float(hit[pred.kinds == k].mean()) if bool((pred.kinds == k).any()) else None
        for k in CorruptionKind
    }


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
    summary: dict[str, Any] = {
        "num_images": int(images01.shape[0]),
        "grid": list(patch_grid(model)),
    }
    prefix, device = f"{title}: " if title else "", next(model.parameters()).device
    ins = _Inspection(model, images01, out, prefix, device, summary, {})
    _embedding_filters(ins, num_filters)
    _position_similarity(ins)
    _attention(ins, mean, std, batch_size, num_show)
    if mpp is not None:
        _mpp_predictions(ins, mpp, num_mpp, seed)
    summary["pngs"] = ins.pngs
    atomic_write_text(out / "inspect.json", json.dumps(summary, indent=2) + "\n")
    return summary
