"""Decoding and the paper's augmentation, on uint8 tensors.

The ViT paper pretrains MPP with "the classification one" (appendix B.1.2): an Inception-style
random resized crop plus a random horizontal flip. Both run on the decoded uint8 PIL image
(PIL's box resize is antialiased, as torchvision's `antialias=True` is, and several times
faster than torch kernels on small images); batches leave as uint8 (B, C, H, W) tensors, and
normalisation with the manifest's mean/std happens later, on the device, inside the objective.

Randomness comes from an explicit `random.Random` per sample (never torch's global RNG), so a
sample's augmentation depends only on (seed, epoch, stream, position) and a resumed epoch that
skips batches without decoding them reproduces the tail exactly.
"""

from __future__ import annotations

import hashlib
import io
import math
import random
import struct
import warnings

import numpy as np
import torch
from PIL import Image

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")
_FORMATS = ("PNG", "JPEG", "WEBP")  # what data_prep writes; nothing else is parsed


class CorruptSample(ValueError):
    """A sample that cannot be used (undecodable image, bad or missing label, no image)."""


def mix_seed(*parts: int) -> int:
    """A 64-bit seed from integers; stable across processes and Python versions."""
    raw = struct.pack(f"<{len(parts)}q", *(int(p) & 0x7FFFFFFFFFFFFFFF for p in parts))
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def decode_sample(sample: dict, *, channels: int, labelled: bool) -> tuple[Image.Image, int]:
    """Decode a raw webdataset sample dict; raise CorruptSample saying what is wrong."""
    key = sample.get("__key__", "?")
    data = next((sample[e] for e in IMAGE_EXTS if e in sample), None)
    if data is None:
        raise CorruptSample(f"{key}: no image ({'/'.join(IMAGE_EXTS)}) in the sample")
    try:
        with warnings.catch_warnings():
            # A decompression bomb is refused, not decoded (PIL warns below its hard limit).
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=_FORMATS) as raw:
                img = raw.convert("L" if channels == 1 else "RGB")
    except Exception as e:  # PIL raises many types for bad data
        raise CorruptSample(f"{key}: undecodable image ({type(e).__name__}: {e})") from None
    if "cls" in sample:
        try:
            label = int(sample["cls"].decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise CorruptSample(f"{key}: .cls is not an ascii integer") from None
    elif labelled:
        raise CorruptSample(f"{key}: no .cls in a labelled shard set")
    else:
        label = -1
    return img, label


def crop_params(
    height: int,
    width: int,
    rng: random.Random,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """Inception crop box (top, left, h, w): area fraction in `scale`, aspect ratio in `ratio`
    (log-uniform); after 10 misses, the largest central box with an in-range aspect ratio."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def train_transform(
    img: Image.Image,
    rng: random.Random,
    size: int,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hflip: bool = True,
) -> np.ndarray:  # (size, size) or (size, size, 3) uint8
    """Random resized crop to size x size, then a horizontal flip with probability 1/2."""
    top, left, h, w = crop_params(img.height, img.width, rng, scale, ratio)
    out = img.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
    if hflip and rng.random() < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def eval_transform(img: Image.Image, size: int) -> np.ndarray:  # (size, size[, 3]) uint8
    """Resize the shorter side to `size` and centre-crop a square; a no-op at the right size."""
    w, h = img.size
    if (h, w) != (size, size):
        side = min(h, w)  # the central square, resized: same as resize-shorter + centre crop
        top, left = (h - side) // 2, (w - side) // 2
        img = img.resize((size, size), Image.BILINEAR, box=(left, top, left + side, top + side))
    return np.asarray(img)


def to_batch(arrays: list[np.ndarray]) -> torch.Tensor:  # (B, C, H, W) uint8
    """Stack HxW (grayscale) or HxWx3 (RGB) uint8 arrays into one channels-first tensor."""
    x = torch.from_numpy(np.stack(arrays))  # (B, H, W) or (B, H, W, 3)
    return x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2).contiguous()
