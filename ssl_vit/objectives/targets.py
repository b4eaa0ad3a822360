"""MPP prediction targets, computed from the un-normalised image in [0, 1] (appendix B.1.2).

Colour quantisation: a channel value v in [0, 1] falls in level floor(v * 2^bits), with v = 1.0
in the top level; a patch's class is its channel levels read as digits in base 2^bits, first
channel most significant (RGB: class = 64 r + 8 g + b for 3 bits, 512 classes; gray: 8 classes).
Patch pixels are flattened in (P, P, C) order, row-major.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssl_vit.recipe import MPP

__all__ = [
    "quantize",
    "color_class",
    "decode_color_classes",
    "patchify",
    "mean_color_targets",
    "downsized_color_targets",
    "patch_pixel_targets",
]


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
