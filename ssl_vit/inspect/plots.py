"""Figures for the inspection analyses (matplotlib, Agg backend, no display needed).

Every function returns a Figure; `save_figure` writes it atomically and closes it.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from ssl_vit.io import atomic_open  # noqa: E402
from ssl_vit.recipe import CorruptionKind  # noqa: E402

KIND_COLOURS = {
    CorruptionKind.MASK: "red",
    CorruptionKind.RANDOM: "orange",
    CorruptionKind.KEPT: "deepskyblue",
}


def save_figure(fig: Figure, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Write `fig` as PNG to a temporary sibling, fsync, rename; then close it."""
    path = Path(path)
    try:
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format="png", dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def _to_hwc(img: torch.Tensor | np.ndarray) -> np.ndarray:
    """(C, H, W) in [0, 1] -> (H, W) for gray or (H, W, 3) for RGB, clipped."""
    a = np.asarray(img, dtype=np.float32)
    a = a[0] if a.shape[0] == 1 else np.transpose(a, (1, 2, 0))
    return np.clip(a, 0.0, 1.0)


def _show(ax: plt.Axes, img: np.ndarray) -> None:
    if img.ndim == 2:
        ax.imshow(img, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
    else:
        ax.imshow(img, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_embedding_filters(
    components: torch.Tensor, variance_ratio: torch.Tensor, *, title: str = ""
) -> Figure:
    """Principal components of the patch projection as small patches (figure 7 left).

    components: (K, C, P, P). Each is min-max scaled on its own: a component's sign and scale
    are arbitrary, only its pattern matters.
    """
    K = components.shape[0]
    cols = min(7, K)
    rows = -(-K // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.3 * cols, 1.45 * rows + 0.6), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= K:
            ax.axis("off")
            continue
        c = components[i].float().cpu().numpy()
        c = (c - c.min()) / max(float(c.max() - c.min()), 1e-12)
        _show(ax, _to_hwc(c))
        ax.set_title(f"PC{i + 1} ({100 * float(variance_ratio[i]):.1f}%)", fontsize=7)
    P, kind = components.shape[-1], "gray" if components.shape[1] == 1 else "RGB"
    fig.suptitle(
        f"{title}Embedding filters: top {K} principal components of the "
        f"{P}x{P} patch projection ({kind}; % = variance explained)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def plot_position_similarity(sim: torch.Tensor, *, title: str = "") -> Figure:
    """A grid of small maps: at (row r, col c), the cosine similarity of that patch's position
    embedding with every patch's (figure 7 centre). sim: (gh, gw, gh, gw)."""
    gh, gw = sim.shape[:2]
    s = sim.float().cpu().numpy()
    gap = 1
    H, W = gh * (gh + gap) - gap, gw * (gw + gap) - gap
    mosaic = np.full((H, W), np.nan, dtype=np.float32)
    for r in range(gh):
        for c in range(gw):
            y, x = r * (gh + gap), c * (gw + gap)
            mosaic[y : y + gh, x : x + gw] = s[r, c]
    fig, ax = plt.subplots(figsize=(6.2, 5.6))
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")  # white gaps between maps
    im = ax.imshow(mosaic, cmap=cmap, vmin=-1.0, vmax=1.0, interpolation="nearest")
    ax.set_xticks(
        [c * (gw + gap) + (gw - 1) / 2 for c in range(gw)], [str(c + 1) for c in range(gw)]
    )
    ax.set_yticks(
        [r * (gh + gap) + (gh - 1) / 2 for r in range(gh)], [str(r + 1) for r in range(gh)]
    )
    ax.tick_params(labelsize=7, length=0)
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="Cosine similarity")
    ax.set_title(f"{title}Position embedding similarity", fontsize=10)
    fig.tight_layout()
    return fig


def plot_attention_distance(
    distance: torch.Tensor,
    *,
    uniform: float | None = None,
    max_distance: float | None = None,
    num_images: int | None = None,
    title: str = "",
) -> Figure:
    """Mean attention distance of every head against depth (figure 7 right). distance: (L, H)."""
    d = distance.float().cpu().numpy()
    L, H = d.shape
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    cmap = plt.get_cmap("tab20" if H > 10 else "tab10")
    depth = np.arange(1, L + 1)
    for h in range(H):
        ax.scatter(depth, d[:, h], s=16, color=cmap(h % cmap.N), label=f"Head {h + 1}")
    if uniform is not None:
        ax.axhline(uniform, ls="--", lw=1, color="gray", label="uniform attention")
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_xticks(depth)
    ax.set_ylim(0, max_distance if max_distance is not None else float(d.max()) * 1.1)
    ax.grid(alpha=0.3)
    if H <= 16:
        ax.legend(fontsize=6, ncol=2, loc="lower right", framealpha=0.8)
    n = f", averaged over {num_images} images" if num_images else ""
    ax.set_title(f"{title}Mean attention distance per head{n}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_rollout(images: torch.Tensor, maps: torch.Tensor, *, title: str = "") -> Figure:
    """Sample images (top) and their [class] attention rollout overlaid (bottom).

    images: (S, C, H, W) in [0, 1]; maps: (S, gh, gw) scaled to max 1.
    """
    S = min(images.shape[0], maps.shape[0])
    up = torch.nn.functional.interpolate(
        maps[:S, None].float(), size=tuple(images.shape[-2:]), mode="bilinear", align_corners=False
    )[:, 0]  # (S, H, W)
    fig, axes = plt.subplots(2, S, figsize=(1.6 * S + 0.8, 3.6), squeeze=False)
    im = None
    for i in range(S):
        img = _to_hwc(images[i].cpu())
        _show(axes[0, i], img)
        _show(axes[1, i], img)
        im = axes[1, i].imshow(up[i].numpy(), cmap="jet", alpha=0.5, vmin=0.0, vmax=1.0)
    axes[0, 0].set_ylabel("input", fontsize=8)
    axes[1, 0].set_ylabel("rollout", fontsize=8)
    if im is not None:
        fig.colorbar(im, ax=axes[1, :].tolist(), fraction=0.02, pad=0.01, label="relative weight")
    fig.suptitle(f"{title}Attention rollout: [class] token's attention to the patches", fontsize=9)
    return fig


def _fill_patches(
    img: np.ndarray, positions: np.ndarray, colours: np.ndarray, gw: int, p: tuple[int, int]
) -> np.ndarray:
    """img (H, W, 3); paint each listed patch (row-major index) a flat colour (3,)."""
    out = img.copy()
    for pos, col in zip(positions, colours, strict=True):
        r, c = divmod(int(pos), gw)
        out[r * p[0] : (r + 1) * p[0], c * p[1] : (c + 1) * p[1]] = col
    return out


def _rgb(a: np.ndarray) -> np.ndarray:
    """An image (H, W) gray or (H, W, 3) -> (H, W, 3)."""
    return np.repeat(a[..., None], 3, axis=-1) if a.ndim == 2 else a


def _rgb_colours(a: np.ndarray) -> np.ndarray:
    """Colours (M, 1) gray or (M, 3) -> (M, 3)."""
    return np.repeat(a, 3, axis=-1) if a.shape[-1] == 1 else a


def _outline(ax: plt.Axes, pos: int, gw: int, p: tuple[int, int], colour: str, **kw) -> None:
    r, c = divmod(int(pos), gw)
    ax.add_patch(
        Rectangle((c * p[1] - 0.5, r * p[0] - 0.5), p[1], p[0], fill=False, edgecolor=colour, **kw)
    )


def plot_mpp_predictions(
    images: torch.Tensor,
    positions: torch.Tensor,
    kinds: torch.Tensor,
    pred_colours: torch.Tensor,
    true_colours: torch.Tensor,
    *,
    patch: tuple[int, int],
    title: str = "",
) -> Figure:
    """Masked patch prediction on sample images (section 4.6): per row, the original, the
    corrupted input, the predicted 3-bit mean colour of each corrupted patch, and the true one.

    images: (S, C, H, W) in [0, 1]; positions, kinds: (S, M) patch indices (row-major) and
    `CorruptionKind` codes; *_colours: (S, M, C) in [0, 1].
    In the colour panels the uncorrupted patches are shown dimmed and tinted blue.
    """
    S = images.shape[0]
    gw = images.shape[-1] // patch[1]
    fig, axes = plt.subplots(S, 4, figsize=(7.2, 1.95 * S + 0.7), squeeze=False)
    heads = ["original", "corrupted input", "predicted mean colour", "true mean colour"]
    tint = np.array([0.25, 0.3, 0.55], dtype=np.float32)
    for i in range(S):
        img = _rgb(_to_hwc(images[i].cpu()))  # (H, W, 3)
        pos = positions[i].cpu().numpy()
        kin = kinds[i].cpu().numpy()
        pc = _rgb_colours(pred_colours[i].cpu().numpy())  # (M, 3)
        tc = _rgb_colours(true_colours[i].cpu().numpy())
        masked = pos[kin == CorruptionKind.MASK]
        corrupted = _fill_patches(img, masked, np.full((len(masked), 3), 0.5), gw, patch)
        context = img * tint  # uncorrupted patches: dim, blue, clearly not predictions
        pred = _fill_patches(context, pos, pc, gw, patch)
        true = _fill_patches(context, pos, tc, gw, patch)
        for j, panel in enumerate([img, corrupted, pred, true]):
            _show(axes[i, j], panel)
            if i == 0:
                axes[i, j].set_title(heads[j], fontsize=8)
        for pp, kk in zip(pos, kin, strict=True):
            hatch = "////" if kk == CorruptionKind.MASK else None
            _outline(axes[i, 1], pp, gw, patch, KIND_COLOURS[int(kk)], lw=0.8, hatch=hatch)
        right = int((np.abs(pc - tc).max(-1) < 1e-6).sum())
        axes[i, 2].set_xlabel(f"{right}/{len(pos)} right", fontsize=7)
    legend = [
        Patch(
            edgecolor=c,
            fill=False,
            hatch="////" if k == CorruptionKind.MASK else None,
            label=k.label,
        )
        for k, c in KIND_COLOURS.items()
    ]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(
        f"{title}Masked patch prediction: 3-bit mean colour of the corrupted patches", fontsize=9
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig
