"""Masked patch prediction, as in the ViT paper (sec. 4.6, appendix B.1.2).

Corrupt round(corrupt_ratio * N) patch embeddings per image (default 50%): of those 80% become a
learnable [mask] embedding, 10% another patch's embedding, 10% stay unchanged (BERT). From each
corrupted patch's own output token, a tanh-MLP head predicts (default) its 3-bit mean colour, 512
classes for RGB. Usage outside the trainer:

    from ssl_vit.models import build_backbone
    from ssl_vit.objectives.mpp import MaskedPatchPrediction, mean_color_targets

    vit = build_backbone("vit_tiny_patch16_224", img_size=28, in_chans=1, patch_size=4)
    mpp = MaskedPatchPrediction(vit, mean=[0.286], std=[0.353])
    loss, metrics = mpp(images01, labels)  # images in [0, 1], (B, 1, 28, 28)
    loss.backward()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.models import checkpoint_seq
from torch import nn

from ssl_vit.models.networks import (
    PretrainHead,
    backbone_kind,
    is_hybrid,
    normalize,
    token_geometry,
)
from ssl_vit.recipe import MPP, TARGETS, CorruptionKind

__all__ = [
    "MaskedPatchPrediction",
    "MPPPrediction",
    "TARGETS",
    "mean_color_targets",
    "downsized_color_targets",
    "patch_pixel_targets",
    "decode_color_classes",
    "draw_corruption",
    "apply_corruption",
    "Corruption",
    "embed_patches",
    "encode_patches",
]


# Corruption of patch embeddings (sec. 4.6, B.1.2): drawn on the tokens' device with torch ops
# (top-k of uniform noise, uniform kind draws, random offsets), so a step never waits on the host

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


# The backbone in two halves, so the patch embeddings can be corrupted in between (sec. 4.6).
# ViT (and hybrid): patch_embed -> [corrupt] -> _pos_embed -> patch_drop -> norm_pre -> blocks ->
# norm, i.e. timm's forward_features with the corruption after the patch projection and before
# the position embeddings are added. Mixer: stem -> [corrupt] -> blocks -> norm. `_pos_embed` is
# private to timm: its version is pinned, and tests/test_models.py checks the two halves against
# `forward_features`.


def embed_patches(backbone: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Normalised images (B, C, H, W) -> patch embeddings (B, N, D), before position embeddings."""
    embed = backbone.patch_embed if backbone_kind(backbone) == "vit" else backbone.stem
    t = embed(x)
    return t.flatten(1, 2) if t.ndim == 4 else t  # dynamic_img_size gives NHWC


def encode_patches(
    backbone: nn.Module, tokens: torch.Tensor, grid: tuple[int, int]
) -> torch.Tensor:
    """(Corrupted) patch embeddings (B, N, D) -> output tokens (B, T, D), prefix tokens first."""
    if backbone_kind(backbone) == "vit":
        if getattr(backbone, "dynamic_img_size", False):
            tokens = tokens.unflatten(1, grid)  # _pos_embed wants NHWC here
        x = backbone._pos_embed(tokens)
        x = backbone.patch_drop(x)
        x = backbone.norm_pre(x)
    else:
        x = tokens
    if backbone.grad_checkpointing and not torch.jit.is_scripting():
        x = checkpoint_seq(backbone.blocks, x)
    else:
        x = backbone.blocks(x)
    return backbone.norm(x)


# Prediction targets, from the un-normalised image in [0, 1] (B.1.2). A channel value v in [0, 1]
# falls in level floor(v * 2^bits), v = 1.0 in the top level; a patch's class is its channel
# levels read as digits in base 2^bits, first channel most significant (RGB, 3 bits: class =
# 64 r + 8 g + b, 512 classes; gray: 8). Patch pixels are flattened in (P, P, C) order.


def quantize(values: torch.Tensor, bits: int = MPP.bits) -> torch.Tensor:
    """[0, 1] values -> int64 levels in [0, 2^bits - 1] (bins of width 2^-bits, 1.0 in the top)."""
    levels = 1 << bits
    return (values.float() * levels).floor_().clamp_(0, levels - 1).long()


def color_class(levels: torch.Tensor, bits: int = MPP.bits) -> torch.Tensor:
    """(..., C) channel levels -> (...) class index in [0, 2^(bits*C))."""
    weights = (1 << bits) ** torch.arange(levels.shape[-1] - 1, -1, -1, device=levels.device)
    return (levels * weights).sum(-1)


def decode_color_classes(
    classes: torch.Tensor, *, bits: int = MPP.bits, in_chans: int = 3
) -> torch.Tensor:
    """Inverse of quantise + color_class: (...) classes -> (..., C) bin-centre colours in [0, 1]."""
    levels = 1 << bits
    place = levels ** torch.arange(in_chans - 1, -1, -1, device=classes.device)
    digits = (classes.unsqueeze(-1) // place) % levels
    return (digits.float() + 0.5) / levels


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, P, P, C), patches in row-major grid order (as timm's tokens)."""
    B, C, H, W = images.shape
    P = patch_size
    if H % P or W % P:
        raise ValueError(f"image {H}x{W} is not divisible by patch size {P}")
    x = images.reshape(B, C, H // P, P, W // P, P)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(B, (H // P) * (W // P), P, P, C)


def mean_color_targets(images: torch.Tensor, patch_size: int, bits: int = MPP.bits) -> torch.Tensor:
    """The paper's target: each patch's mean colour, `bits` per channel -> (B, N) int64 classes
    in [0, 2^(bits*C)) (512 for RGB at 3 bits, 8 for grayscale)."""
    means = F.avg_pool2d(images.float(), patch_size)  # (B, C, gh, gw)
    means = means.flatten(2).transpose(1, 2)  # (B, N, C)
    return color_class(quantize(means, bits), bits)


def downsized_color_targets(
    images: torch.Tensor, patch_size: int, bits: int = MPP.bits, size: int = MPP.downsize
) -> torch.Tensor:
    """Each patch downsized to size x size (area average) in `bits`-bit colour ->
    (B, N, size*size) int64 classes: size^2 parallel 2^(bits*C)-way predictions."""
    if patch_size < size:
        raise ValueError(f"patch size {patch_size} is smaller than the downsized size {size}")
    images = images.float()
    B, C = images.shape[:2]
    if patch_size % size == 0:  # one pooling pass over the whole image
        small = F.avg_pool2d(images, patch_size // size)  # (B, C, gh*s, gw*s)
        gh, gw = small.shape[2] // size, small.shape[3] // size
        cells = small.reshape(B, C, gh, size, gw, size).permute(0, 2, 4, 3, 5, 1)
        cells = cells.reshape(B, gh * gw, size * size, C)
    else:  # e.g. 7x7 patches: adaptive (overlapping) area bins per patch
        p = patchify(images, patch_size)  # (B, N, P, P, C)
        N = p.shape[1]
        p = p.permute(0, 1, 4, 2, 3).reshape(B * N, C, patch_size, patch_size)
        cells = F.adaptive_avg_pool2d(p, size).reshape(B, N, C, size * size).transpose(2, 3)
    return color_class(quantize(cells, bits), bits)  # (B, N, s*s)


def patch_pixel_targets(
    images: torch.Tensor, patch_size: int, normalize: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Full patches for L2 regression -> (B, N, P*P*C) float; with `normalize` each patch is
    shifted and scaled to zero mean and unit variance over its own pixels."""
    p = patchify(images.float(), patch_size).flatten(2)  # (B, N, P*P*C)
    if normalize:
        mean = p.mean(-1, keepdim=True)
        var = p.var(-1, keepdim=True, unbiased=False)
        p = (p - mean) / (var + eps).sqrt()
    return p


@dataclass
class MPPPrediction:
    """What the model predicts for the patches it could not (fully) see.

    positions: (B, M) corrupted patch indices (row-major over the token grid).
    kinds: (B, M) `CorruptionKind` codes (MASK, RANDOM, KEPT).
    pred, target: (B, M) classes for "mean_color", (B, M, S*S) for "downsized_color",
        (B, M, P, P, C) pixels for "pixels" (per-patch normalised if the objective is).
    Colour classes decode to RGB/gray with `decode_color_classes(c, bits=bits, in_chans=C)`.
    """

    positions: torch.Tensor
    kinds: torch.Tensor
    pred: torch.Tensor
    target: torch.Tensor
    target_kind: str
    bits: int
    in_chans: int
    patch_size: int
    grid: tuple[int, int]


class MaskedPatchPrediction(nn.Module):
    """MPP objective around a timm ViT, hybrid ViT or MLP-Mixer.

    Called as `objective(images, labels) -> (loss, metrics)` with images (B, C, H, W) float32 in
    [0, 1] (normalised here with `mean`/`std` and cast to the module's dtype; targets use the raw
    float32 values, so pass float32, not bf16, images); labels are ignored.
    Metrics (tensors): mpp/loss, mpp/acc, mpp/acc_{mask,random,kept}, mpp/loss_{mask,random,kept}
    (the acc metrics are absent for target="pixels" with normalize_pixels=True).

    With a hybrid backbone the ResNet stem's receptive field overlaps neighbouring patches, so
    the uncorrupted neighbours' embeddings would carry much of a masked patch's pixels (at 32 px
    with 2x2 patches of the stem's map, a token sees 15 px around its 8-px cell). So for a
    hybrid the pixels of every masked or replaced patch are set to the dataset mean (0 after
    normalisation) before the stem, as well as their embeddings corrupted: no token can see
    what it is asked to predict. Kept patches keep their pixels. (The paper pretrains plain
    ViTs with MPP, where the patch projection does not overlap.)

    Args:
        backbone: from `ssl_vit.models.build_backbone`.
        patch_size, in_chans: image pixels per token side and channels; read from the backbone
            when None, checked when given (a hybrid's token covers stem stride x patch pixels).
        mean, std: per-channel normalisation of the backbone input.
        corrupt_ratio: share of patches corrupted per image, exactly round(ratio * N) each
            (Python's round: 24 of 49 patches at 0.5, 98 of 196).
        mask_prob, random_prob: of the corrupted, share given the [mask] embedding / another
            patch's embedding; the rest stay unchanged.
        target: "mean_color" (paper's choice), "downsized_color" (downsize x downsize patch,
            parallel predictions), or "pixels" (L2 regression of the full patch).
        bits: colour bits per channel for the colour targets (8^C classes at 3).
        downsize: side of the downsized patch for "downsized_color".
        normalize_pixels: per-patch normalise the "pixels" target.
        head_hidden: hidden width of the tanh-MLP head (default: the embedding width).
    """

    def __init__(
        self,
        backbone: nn.Module,
        *,
        mean: Sequence[float],
        std: Sequence[float],
        patch_size: int | None = None,
        in_chans: int | None = None,
        corrupt_ratio: float = MPP.corrupt_ratio,
        mask_prob: float = MPP.mask_prob,
        random_prob: float = MPP.random_prob,
        target: str = MPP.target,
        bits: int = MPP.bits,
        downsize: int = MPP.downsize,
        normalize_pixels: bool = False,
        head_hidden: int | None = None,
    ) -> None:
        super().__init__()
        geo = token_geometry(backbone)
        if patch_size is not None and patch_size != geo.patch_px:
            raise ValueError(
                f"patch_size={patch_size} but the backbone's tokens are {geo.patch_px} px"
            )
        if in_chans is not None and in_chans != geo.in_chans:
            raise ValueError(f"in_chans={in_chans} but the backbone takes {geo.in_chans} channels")
        if target not in TARGETS:
            raise ValueError(f"target={target!r}; choose one of {TARGETS}")
        if len(mean) != geo.in_chans or len(std) != geo.in_chans:
            raise ValueError(f"mean/std need {geo.in_chans} values, got {len(mean)}/{len(std)}")
        if not 0 < corrupt_ratio <= 1:
            raise ValueError(f"corrupt_ratio must be in (0, 1], got {corrupt_ratio}")
        if getattr(getattr(backbone, "patch_drop", None), "prob", 0.0) > 0:
            raise ValueError(
                "MPP needs every patch token; build the backbone with patch_drop_rate=0"
            )
        self.backbone = backbone
        self.patch_size, self.in_chans, self.grid = geo.patch_px, geo.in_chans, geo.grid
        self.num_patches = geo.num_patches
        self.num_corrupt = max(1, round(corrupt_ratio * self.num_patches))
        self.mask_prob, self.random_prob = float(mask_prob), float(random_prob)
        self.target, self.bits, self.downsize = target, int(bits), int(downsize)
        self.normalize_pixels = bool(normalize_pixels)
        self.num_classes = (1 << self.bits) ** self.in_chans
        dim = int(backbone.embed_dim)
        if target == "mean_color":
            out = self.num_classes
        elif target == "downsized_color":
            if self.patch_size < self.downsize:
                raise ValueError(f"patch of {self.patch_size} px < downsize {self.downsize}")
            out = self.downsize**2 * self.num_classes
        else:
            out = self.patch_size**2 * self.in_chans
        self.mask_token = nn.Parameter(torch.empty(dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.head = PretrainHead(dim, out, head_hidden)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        # tokens before the patch tokens in the encoder's output ([class], registers)
        vit = backbone_kind(backbone) == "vit"
        self._prefix = int(getattr(backbone, "num_prefix_tokens", 0)) if vit else 0
        self.hide_pixels = is_hybrid(backbone)  # see the class docstring

    def no_weight_decay(self) -> set[str]:
        """Parameter names exempt from weight decay (see ssl_vit.objectives.param_groups)."""
        names = getattr(self.backbone, "no_weight_decay", set)()
        return {"mask_token"} | {f"backbone.{n}" for n in names}

    def _targets(self, images: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Targets of the corrupted patches: (B, M) | (B, M, S*S) int64 or (B, M, P*P*C) float."""
        if self.target == "mean_color":
            return mean_color_targets(images, self.patch_size, self.bits).gather(1, positions)
        if self.target == "downsized_color":
            t = downsized_color_targets(images, self.patch_size, self.bits, self.downsize)
        else:
            t = patch_pixel_targets(images, self.patch_size, self.normalize_pixels)
        return t.gather(1, positions.unsqueeze(-1).expand(-1, -1, t.shape[-1]))

    def _forward(
        self, images: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, Corruption]:
        """-> head outputs (B, M, out), targets, corruption."""
        B = images.shape[0]
        x = normalize(images, self.mean, self.std, self.backbone)
        corr = draw_corruption(
            B,
            self.num_patches,
            self.num_corrupt,
            mask_prob=self.mask_prob,
            random_prob=self.random_prob,
            device=x.device,
            generator=generator,
        )
        if self.hide_pixels:
            x = x * visible_pixels(corr, self.grid, self.patch_size).to(x.dtype)
        tokens = embed_patches(self.backbone, x)  # (B, N, D)
        tokens = apply_corruption(tokens, corr, self.mask_token)
        feats = encode_patches(self.backbone, tokens, self.grid)[:, self._prefix :]  # (B, N, D)
        idx = corr.positions.unsqueeze(-1).expand(-1, -1, feats.shape[-1])
        out = self.head(feats.gather(1, idx))  # (B, M, out): the head sees corrupted tokens only
        with torch.autocast(images.device.type, enabled=False):
            target = self._targets(images.float(), corr.positions)
        return out, target, corr

    def _per_patch(self, out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """-> per corrupted patch loss (B, M) and correctness (B, M) float (or None)."""
        B, M = target.shape[:2]
        if self.target == "pixels":
            loss = (out.float() - target).pow(2).mean(-1)
            correct = None
            if not self.normalize_pixels:  # score the predicted patch's mean colour
                C = self.in_chans
                pm = out.float().view(B, M, -1, C).mean(2)
                tm = target.view(B, M, -1, C).mean(2)
                correct = (
                    color_class(quantize(pm, self.bits), self.bits)
                    == color_class(quantize(tm, self.bits), self.bits)
                ).float()
            return loss, correct
        logits = out.float().view(B, M, -1, self.num_classes)  # (B, M, S, K); S = 1 or downsize^2
        target = target.view(B, M, -1)
        loss = F.cross_entropy(logits.flatten(0, 2), target.flatten(), reduction="none")
        correct = (logits.argmax(-1) == target).float().mean(-1)
        return loss.view(B, M, -1).mean(-1), correct

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """images (B, C, H, W) in [0, 1] -> (loss, metrics); labels are unused."""
        out, target, corr = self._forward(images, None)
        loss_pp, correct = self._per_patch(out, target)
        loss = loss_pp.mean()  # every image has the same M, so this averages over patches
        metrics = {"mpp/loss": loss.detach()}
        kinds = torch.arange(len(CorruptionKind), device=corr.kinds.device)
        onehot = (corr.kinds.unsqueeze(-1) == kinds).float()  # (B, M, 3); F.one_hot checks on host
        counts = onehot.sum((0, 1)).clamp_min(1.0)  # (3,)
        kind_loss = (loss_pp.detach().unsqueeze(-1) * onehot).sum((0, 1)) / counts
        for k in CorruptionKind:
            metrics[f"mpp/loss_{k.key}"] = kind_loss[k]
        if correct is not None:
            metrics["mpp/acc"] = correct.mean()
            kind_acc = (correct.unsqueeze(-1) * onehot).sum((0, 1)) / counts
            for k in CorruptionKind:
                metrics[f"mpp/acc_{k.key}"] = kind_acc[k]
        return loss, metrics

    @torch.no_grad()
    def predict(
        self, images: torch.Tensor, generator: torch.Generator | None = None
    ) -> MPPPrediction:
        """Corrupt, predict and return positions, kinds, predictions and true targets.

        Runs in the module's current mode; call `.eval()` first for dropout-free predictions.
        """
        out, target, corr = self._forward(images, generator)
        B, M = corr.positions.shape
        if self.target == "pixels":
            shape = (B, M, self.patch_size, self.patch_size, self.in_chans)
            pred, target = out.float().view(shape), target.view(shape)
        else:
            pred = out.float().view(B, M, -1, self.num_classes).argmax(-1)
            if self.target == "mean_color":
                pred = pred.squeeze(-1)
        return MPPPrediction(
            positions=corr.positions,
            kinds=corr.kinds,
            pred=pred,
            target=target,
            target_kind=self.target,
            bits=self.bits,
            in_chans=self.in_chans,
            patch_size=self.patch_size,
            grid=self.grid,
        )
