"""Decoding and the paper's augmentation, on uint8 arrays.

The ViT paper pretrains MPP with "the classification one" (appendix B.1.2): an Inception-style
random resized crop plus a random horizontal flip; `data.translate` optionally adds a random
shift between the two (small images, where a crop that resizes loses too much). All run on the
decoded uint8 image (PIL's box resize, antialiased as torchvision's `antialias=True` is, and
several times faster than torch kernels on small images); batches leave as uint8 (B, C, H, W)
tensors, and normalisation with the manifest's mean/std happens later, on the device, inside
the objective.

The loader workers share two CPU cores with training on a small machine, so every microsecond
per sample shows in training speed (benchmarks/train_throughput.py): an 8-bit PNG already in
the target mode (what data_prep writes) is decoded by torchvision's libpng op, about 10 us faster
per sample than PIL's Python-side open; a crop box that is the whole image at the output
size skips the resize, and a flip is a numpy view. Any other image takes the PIL path. Both give
the same pixels (tests/test_augment.py).

Randomness comes from an explicit `random.Random` seeded per chunk of a batch (never torch's
global RNG; see ssl_vit.data.datasets), so a sample's augmentation depends only on (seed,
epoch, stream, position) and a resumed epoch that skips batches without decoding them
reproduces the tail exactly.
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


def _libpng_op():
    """torchvision's libpng decoding op, or None where this torchvision build has none (PIL
    decodes everything then). Called as the op: torchvision 0.29's Python wrapper warns on every
    call (its image codecs are deprecated in favour of TorchCodec, not a dependency here)."""
    try:
        import torchvision.io  # noqa: F401  (loads the image extension, registering the op)

        return torch.ops.image.decode_png
    except (ImportError, AttributeError, RuntimeError):
        return None


_DECODE_PNG = _libpng_op()


class CorruptSample(ValueError):
    """A sample that cannot be used (undecodable image, bad or missing label, no image)."""


def mix_seed(*parts: int) -> int:
    """A 64-bit seed from integers; stable across processes and Python versions."""
    raw = struct.pack(f"<{len(parts)}q", *(int(p) & 0x7FFFFFFFFFFFFFFF for p in parts))
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def _png_fast_path(data: bytes, channels: int) -> tuple[int, int] | None:
    """(width, height) when `data` is an 8-bit, non-interlaced PNG whose colour type is the
    target's (gray for 1 channel, RGB for 3): the PNG torchvision can decode with the same
    pixels PIL gives; None for any other image (PIL decodes and converts it)."""
    # signature (8) | IHDR length (4) | b"IHDR" | width (4) | height (4) | depth | colour | ...
    if len(data) < 33 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    depth, colour, interlace = data[24], data[25], data[28]
    if depth != 8 or interlace != 0 or colour != (0 if channels == 1 else 2):
        return None
    return width, height


def _decode_image(data: bytes, channels: int) -> np.ndarray:  # (H, W) or (H, W, 3) uint8
    size = _png_fast_path(data, channels) if _DECODE_PNG is not None else None
    if size is not None:
        limit = Image.MAX_IMAGE_PIXELS  # PIL's guard against decompression bombs, kept here
        if limit is not None and size[0] * size[1] > limit:
            raise ValueError(f"declares {size[0]}x{size[1]} pixels, above the limit of {limit}")
        out = _DECODE_PNG(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, False)
        if out.shape[0] == channels:  # (C, H, W); a tRNS chunk adds alpha: PIL's path drops it
            return out[0].numpy() if channels == 1 else out.permute(1, 2, 0).numpy()
    return decode_with_pil(data, channels)


def decode_with_pil(data: bytes, channels: int) -> np.ndarray:  # (H, W) or (H, W, 3) uint8
    """Any PNG, JPEG or WebP, converted to gray or RGB by PIL."""
    with warnings.catch_warnings():
        # A decompression bomb is refused, not decoded (PIL warns below its hard limit).
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data), formats=_FORMATS) as raw:
            return np.asarray(raw.convert("L" if channels == 1 else "RGB"))


def decode_sample(sample: dict, *, channels: int, labelled: bool) -> tuple[np.ndarray, int]:
    """Decode a raw webdataset sample dict to ((H, W) or (H, W, 3) uint8 pixels, label); raise
    CorruptSample saying what is wrong."""
    data = sample_image(sample)
    try:
        img = _decode_image(data, channels)
    except Exception as e:  # PIL and libpng raise many types for bad data
        key = sample.get("__key__", "?")
        raise CorruptSample(f"{key}: undecodable image ({type(e).__name__}: {e})") from None
    return img, sample_label(sample, labelled=labelled)


def sample_image(sample: dict) -> bytes:
    """The encoded image of a raw sample; CorruptSample when it has none."""
    data = next((sample[e] for e in IMAGE_EXTS if e in sample), None)
    if data is None:
        key = sample.get("__key__", "?")
        raise CorruptSample(f"{key}: no image ({'/'.join(IMAGE_EXTS)}) in the sample")
    return data


def sample_label(sample: dict, *, labelled: bool) -> int:
    """The sample's integer label (-1 in an unlabelled set); CorruptSample when it is bad."""
    key = sample.get("__key__", "?")
    if "cls" in sample:
        try:
            label = int(sample["cls"].decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise CorruptSample(f"{key}: .cls is not an ascii integer") from None
    elif labelled:
        raise CorruptSample(f"{key}: no .cls in a labelled shard set")
    else:
        label = -1
    return label


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


def crop_resize(img: np.ndarray, size: int, box: tuple[int, int, int, int]) -> np.ndarray:
    """The (top, left, h, w) box of `img` resized to size x size (PIL bilinear, antialiased);
    the image itself when the box is all of it at that size already."""
    top, left, h, w = box
    if (top, left, h, w) == (0, 0, size, size) == (0, 0, *img.shape[:2]):
        return img
    pil_box = (left, top, left + w, top + h)
    out = Image.fromarray(img).resize((size, size), Image.BILINEAR, box=pil_box)
    return np.asarray(out)


def train_transform(
    img: np.ndarray,
    rng: random.Random,
    size: int,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hflip: bool = True,
    translate: int = 0,
) -> np.ndarray:  # (size, size) or (size, size, 3) uint8
    """Random resized crop to size x size, a random shift of up to `translate` pixels per axis
    (zero-filled), then a horizontal flip with probability 1/2."""
    height, width = img.shape[:2]
    if scale[0] >= 1.0 and ratio[0] <= width / height <= ratio[1]:
        box = (0, 0, height, width)  # the only box of the whole area: no draws needed
    else:
        box = crop_params(height, width, rng, scale, ratio)
    out = crop_resize(img, size, box)
    if translate:  # no draw without it: the crop and flip draws stay what they were
        out = shift_image(out, *shift_params(rng, translate))
    if hflip and rng.random() < 0.5:
        out = out[:, ::-1]  # a view; to_batch copies
    return out


def shift_params(rng: random.Random, translate: int) -> tuple[int, int]:
    """(dy, dx), each uniform over the integers in [-translate, translate]."""
    return rng.randint(-translate, translate), rng.randint(-translate, translate)


def shift_image(img: np.ndarray, dy: int, dx: int) -> np.ndarray:  # same shape as img
    """`img` (H, W[, C]) moved down by dy and right by dx pixels, the uncovered border zero:
    the "pad and random crop" of small-image training, with the crop kept at the image size."""
    h, w = img.shape[:2]
    if dy == dx == 0:
        return img
    out = np.zeros_like(img)
    if abs(dy) < h and abs(dx) < w:
        out[max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = img[
            max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
        ]
    return out


def eval_transform(img: np.ndarray, size: int) -> np.ndarray:  # (size, size[, 3]) uint8
    """Resize the shorter side to `size` and centre-crop a square; a no-op at the right size."""
    h, w = img.shape[:2]
    side = min(h, w)  # the central square, resized: same as resize-shorter + centre crop
    return crop_resize(img, size, ((h - side) // 2, (w - side) // 2, side, side))


def to_batch(arrays: list[np.ndarray]) -> torch.Tensor:  # (B, C, H, W) uint8
    """Stack HxW (grayscale) or HxWx3 (RGB) uint8 arrays into one channels-first tensor."""
    x = torch.from_numpy(np.stack(arrays))  # (B, H, W) or (B, H, W, 3)
    return x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2).contiguous()
