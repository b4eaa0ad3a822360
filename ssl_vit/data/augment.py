"""Decoding and the paper's augmentation, on uint8 arrays.

The ViT paper's MPP augmentation (appendix B.1.2): an Inception-style random resized crop
(`train_box`, `crop_resize`) plus a random horizontal flip, and optionally a random shift
(`data.translate`); `train_transform` and `eval_transform` apply them to a decoded image,
`decode_sample` decodes a raw sample to (pixels, label), `to_batch` stacks uint8 (B, C, H, W)
batches. Normalisation with the manifest's mean/std happens later, on the device, inside the
objective. Randomness comes from an explicit `random.Random` (never torch's global generator),
so a sample's augmentation depends only on (seed, epoch, stream, position).

How the per-sample path is kept short: docs/training.md#streaming-input.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import io
import json
import math
import os
import random
import struct
import warnings
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import get_worker_info

from ssl_vit.data.manifest import SampleLayout

_DEFAULT = SampleLayout()

_FORMATS = ("PNG", "JPEG", "WEBP")  # what data_prep writes; nothing else is parsed


def _load_image_library() -> None:
    """Load torchvision's image extension (the library that registers torch.ops.image) from
    torchvision's folder. `import torchvision.io` would do it too, but it runs torchvision's
    package import, which pulls in its models, ops and torch._dynamo: over a second of CPU in
    every loader's fork server, which needs the decoders only."""
    spec = importlib.util.find_spec("torchvision")  # finds the package, does not import it
    for folder in (spec and spec.submodule_search_locations) or ():
        for stem in ("image_stable", "image"):  # the name from torchvision 0.29 on, before
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                if os.path.isfile(path := os.path.join(folder, stem + suffix)):
                    torch.ops.load_library(path)
                    return
    import torchvision.io  # noqa: F401  (a layout not seen here: the package's own loader)


def _image_ops() -> tuple:
    """torchvision's decoding ops (libpng's decode_png, libjpeg-turbo's decode_jpeg), each None
    where this torchvision build has none (PIL decodes everything then). Called as the ops:
    torchvision 0.29's Python wrapper warns on every call (its image codecs are deprecated in
    favour of TorchCodec, not a dependency here)."""
    try:
        _load_image_library()
    except (ImportError, RuntimeError, OSError):
        return None, None
    return tuple(getattr(torch.ops.image, name, None) for name in ("decode_png", "decode_jpeg"))


_DECODE_PNG, _DECODE_JPEG = _image_ops()
_GRAY, _RGB = 1, 3  # torchvision's ImageReadMode values
# torch's antialiased bilinear kernel (PIL's algorithm in 16-bit fixed point for uint8 RGB);
# below TORCH_RESIZE_MIN px its fixed costs lose to PIL.
_RESAMPLE = getattr(torch._C._nn, "_upsample_bilinear2d_aa", None)
TORCH_RESIZE_MIN = 112


class LabelOutOfRange(ValueError):
    """A label that is not one of the manifest's classes: the shards and their manifest
    disagree, so every label may be wrong. Training stops rather than skip it (a skipped sample
    would hide a mislabelled set)."""


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


def _jpeg_fast_path(data: bytes, channels: int) -> tuple[int, int] | None:
    """(width, height) when `data` is an 8-bit baseline, extended or progressive Huffman JPEG
    with 1 component for channels=1 or 3 for channels=3: the JPEG torchvision's libjpeg-turbo
    decodes to the pixels PIL's (also libjpeg-turbo, same settings) gives; None for anything else
    (CMYK, a colour JPEG wanted in gray, 12-bit, arithmetic coding, no readable frame header)."""
    frame = jpeg_frame(data)
    if frame is None or frame.marker not in (0xC0, 0xC1, 0xC2) or frame.precision != 8:
        return None
    if frame.components != channels or not frame.height or not frame.width:
        return None
    return frame.width, frame.height


def is_jpeg(data: bytes | bytearray | memoryview) -> bool:
    """Whether `data` starts as a JPEG does (SOI, then a marker)."""
    return len(data) >= 3 and data[0] == 0xFF and data[1] == 0xD8 and data[2] == 0xFF


class JpegFrame(NamedTuple):
    marker: int  # SOF0..SOF15: the coding process (0xC0 baseline, 0xC2 progressive, ...)
    precision: int  # bits per sample
    height: int  # 0: given later by a DNL marker
    width: int
    components: int


# Start-of-frame markers: 0xC0..0xCF except DHT (0xC4), JPG (0xC8) and DAC (0xCC), which share
# the range.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM and RST0..7: no length field
_NO_FRAME = frozenset({0x00, 0xD8, 0xD9, 0xDA})  # stuffed byte, SOI, EOI, SOS before any frame


def jpeg_frame(data: bytes | bytearray | memoryview) -> JpegFrame | None:
    """A JPEG's start-of-frame header, found by walking the marker segments from the SOI (a few
    microseconds: no decoding); None when `data` is not a JPEG, is cut before the frame header
    ends, or has a malformed segment or no frame."""
    n = len(data)
    if not is_jpeg(data):
        return None
    i = 2
    while True:
        if i >= n or data[i] != 0xFF:  # a marker must follow each segment
            return None
        while i < n and data[i] == 0xFF:  # fill bytes may precede a marker code
            i += 1
        if i >= n:
            return None
        code = data[i]
        i += 1
        if code in _STANDALONE:
            continue
        if code in _NO_FRAME:
            return None
        if i + 2 > n:
            return None
        length = (data[i] << 8) | data[i + 1]  # includes its own two bytes
        if length < 2:
            return None
        if code in _SOF:
            # length (2) | precision (1) | height (2) | width (2) | components (1) | ...
            if length < 8 or i + 8 > n:
                return None
            height = (data[i + 3] << 8) | data[i + 4]
            width = (data[i + 5] << 8) | data[i + 6]
            return JpegFrame(code, data[i + 2], height, width, data[i + 7])
        i += length


def _check_pixels(size: tuple[int, int]) -> None:
    limit = Image.MAX_IMAGE_PIXELS  # PIL's guard against decompression bombs, kept here
    if limit is not None and size[0] * size[1] > limit:
        raise ValueError(f"declares {size[0]}x{size[1]} pixels, above the limit of {limit}")


def _decode_image(data: bytes, channels: int) -> np.ndarray:  # (H, W) or (H, W, 3) uint8
    if _DECODE_JPEG is not None and data[:2] == b"\xff\xd8":
        size = _jpeg_fast_path(data, channels)
        if size is not None:
            _check_pixels(size)
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            try:  # (C, H, W), an (H, W, C) buffer underneath
                out = _DECODE_JPEG(buf, _GRAY if channels == 1 else _RGB, False)
            except RuntimeError:  # corrupt: PIL decides, and says why in its own words
                out = None
            if out is not None and out.shape[0] == channels:
                return out[0].numpy() if channels == 1 else out.permute(1, 2, 0).numpy()
        return decode_with_pil(data, channels)
    size = _png_fast_path(data, channels) if _DECODE_PNG is not None else None
    if size is not None:
        _check_pixels(size)
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


def decode_sample(
    sample: dict,
    *,
    channels: int,
    labelled: bool,
    num_classes: int | None = None,
    layout: SampleLayout = _DEFAULT,
) -> tuple[np.ndarray, int]:
    """Decode a raw webdataset sample dict to ((H, W) or (H, W, 3) uint8 pixels, label); raise
    CorruptSample saying what is wrong (LabelOutOfRange: see sample_label). `layout`: the
    fields its image and label are in (the manifest's)."""
    data = sample_image(sample, layout)
    try:
        img = _decode_image(data, channels)
    except Exception as e:  # PIL and libpng raise many types for bad data
        key = sample.get("__key__", "?")
        raise CorruptSample(f"{key}: undecodable image ({type(e).__name__}: {e})") from None
    label = sample_label(sample, labelled=labelled, num_classes=num_classes, layout=layout)
    return img, label


def sample_image(sample: dict, layout: SampleLayout = _DEFAULT) -> bytes:
    """The encoded image of a raw sample; CorruptSample when it has none."""
    data = next((sample[e] for e in layout.image_keys if e in sample), None)
    if data is None:
        key = sample.get("__key__", "?")
        raise CorruptSample(f"{key}: no image ({'/'.join(layout.image_keys)}) in the sample")
    return data


def sample_label(
    sample: dict,
    *,
    labelled: bool,
    num_classes: int | None = None,
    layout: SampleLayout = _DEFAULT,
) -> int:
    """The sample's integer label (-1 in an unlabelled set); CorruptSample when it is bad, and
    LabelOutOfRange when it is not one of the manifest's `num_classes` classes."""
    key = sample.get("__key__", "?")
    field = layout.label
    # an unlabelled set's samples may still carry a .cls: it is read, as always
    if field is None or not labelled and (field.startswith("json:") or field not in sample):
        if labelled:
            raise CorruptSample(f"{key}: the manifest has classes but names no label field")
        return -1
    if field.startswith("json:"):
        label, shown = _json_label(sample, key, field[5:], layout), f".json {field[5:]!r}"
    elif field in sample:
        shown = f".{field}"
        try:
            label = int(sample[field].decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise CorruptSample(f"{key}: .{field} is not an ascii integer") from None
    else:
        raise CorruptSample(f"{key}: no .{field} in a labelled shard set")
    if num_classes is not None and not 0 <= label < num_classes:
        raise LabelOutOfRange(
            f"{key}: {shown} is {label}, not a class of the manifest's {num_classes}; "
            "the shard and its manifest disagree: fix or re-create the shard set"
        )
    return label


def _json_label(sample: dict, key: str, name: str, layout: SampleLayout) -> int:
    """The label a sample's JSON holds under `name`: an integer, or a class name."""
    if "json" not in sample:
        raise CorruptSample(f"{key}: no .json in a set labelled by its {name!r} key")
    try:
        meta = json.loads(sample["json"])
    except (ValueError, RecursionError):
        raise CorruptSample(f"{key}: .json is not valid JSON") from None
    value = meta.get(name) if isinstance(meta, dict) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and layout.classes is not None and value in layout.classes:
        return layout.classes[value]
    if isinstance(value, str) and layout.classes is not None:
        raise LabelOutOfRange(
            f"{key}: .json {name!r} is {value[:60]!r}, not a class of the manifest; "
            "the shard and its manifest disagree: index the set again"
        )
    raise CorruptSample(f"{key}: .json has no integer or class name under {name!r}")


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
    the image itself when the box is all of it at that size already. From TORCH_RESIZE_MIN px
    up, RGB images are resampled by torch's kernel (`_resize_torch`): PIL's pixels within 1
    level (2 for a few values in 10^8; tests/test_augment.py). Gray images, smaller outputs
    and what torch's kernel cannot take get PIL's exact pixels."""
    top, left, h, w = box
    if (top, left, h, w) == (0, 0, size, size) == (0, 0, *img.shape[:2]):
        return img
    if size >= TORCH_RESIZE_MIN and _RESAMPLE is not None:
        out = _resize_torch(img, size, box)
        if out is not None:
            return out
    return _resize_pil(img, size, box)


def crop_resize_batch(
    images: torch.Tensor | list[torch.Tensor], boxes: list, size: int
) -> torch.Tensor:  # (B, C, size, size) uint8 on the images' device
    """Each image's (top, left, h, w) box resampled to size x size by one roi_align call: the
    crop-and-resize of every path that resizes a batch on a device (batches held in RAM, JPEGs
    decoded on the GPU). roi_align averages ceil(box / size) bilinear samples per pixel, close
    to the antialiased resize of the per-image path (tests/test_device_decode.py states how
    close); a box of the output's size is its pixels exactly. `images`: a (B, C, H, W) batch,
    or (C, H, W) images of different sizes."""
    from torchvision.ops import roi_align  # here: the per-image path never needs torchvision

    if isinstance(images, torch.Tensor):
        padded = images.float()  # (B, C, H, W)
    else:
        n, C = len(images), images[0].shape[0]
        Hmax = max(img.shape[1] for img in images)
        Wmax = max(img.shape[2] for img in images)
        padded = torch.zeros((n, C, Hmax, Wmax), dtype=torch.float32, device=images[0].device)
        for j, img in enumerate(images):
            H, W = img.shape[1:]
            dst = padded[j]  # (C, Hmax, Wmax)
            dst[:, :H, :W] = img
            # roi_align clamps samples past an image's last row or column only at the tensor's
            # edge: replicate the edge into the pad so that the smaller images get the same.
            if H < Hmax:
                dst[:, H, :W] = img[:, H - 1]
            if W < Wmax:
                rows = min(H + 1, Hmax)
                dst[:, :rows, W] = dst[:, :rows, W - 1]
    rois = torch.tensor(
        [[j, left, top, left + w, top + h] for j, (top, left, h, w) in enumerate(boxes)],
        dtype=torch.float32,
    ).to(padded.device)  # (B, 5): batch index, x1, y1, x2, y2 (pixel edges)
    out = roi_align(
        padded, rois, output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True
    )  # (B, C, size, size)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _resize_pil(img: np.ndarray, size: int | tuple[int, int], box: tuple) -> np.ndarray:
    """PIL's antialiased bilinear resize of the (top, left, h, w) box (floats allowed) to
    size x size, or to (width, height)."""
    top, left, h, w = box
    out_size = (size, size) if isinstance(size, int) else size
    pil_box = (left, top, left + w, top + h)
    out = Image.fromarray(img).resize(out_size, Image.BILINEAR, box=pil_box)
    return np.asarray(out)


# How torch's kernel stands in for PIL's (Pillow's Resample.c, which its AVX2 uint8 path follows
# with 16-bit instead of 22-bit fixed-point weights: a pixel may round one level apart). For each
# output pixel i of an axis, PIL weighs the input pixels around
#     centre = start + (i + 0.5) * scale,   scale = box length / size,
# within max(scale, 1) of it, reading past the box's edges into the rest of the image (clamped to
# the image). torch's kernel computes the same weights over its input tensor, centre measured
# from the tensor's first pixel. So torch gets the box plus a margin past its far edges, with the
# scale given explicitly (not input / output size); a margin of 2 + ceil(support) pixels covers
# every weight PIL uses there. Before the near edges no margin is possible (the centres would
# shift), so the first one or two rows and columns, the only ones whose PIL weights reach before
# the box, are redone by PIL itself on a thin strip of the image around them. One trap: torch
# treats an axis whose input length equals the output size as needing no resampling, whatever
# the scale; a margin that would make it so is one pixel longer (or the image goes to PIL).


def _near_edge(start: int, length: int, size: int) -> int:
    """Output pixels of an axis whose PIL weights reach before the box's start (see above)."""
    if start == 0 or length == size:
        return 0
    scale = length / size
    support = max(scale, 1.0)
    n = 0
    while n < size and int(start + (n + 0.5) * scale - support + 0.5) < start:
        n += 1
    return n


def _far_end(start: int, length: int, total: int, size: int) -> int | None:
    """Where torch's input ends along an axis: the box's end plus the margin (see above)."""
    if length == size:
        return start + length  # an integer shift at scale 1 is PIL's identity too
    end = min(total, start + length + 2 + math.ceil(max(length / size, 1.0)))
    if end - start == size:
        if end == total:
            return None
        end += 1
    return end


def _resize_torch(img: np.ndarray, size: int, box: tuple[int, int, int, int]) -> np.ndarray | None:
    """crop_resize by torch's kernel plus PIL on the near edges (see above); None where it does
    not apply (not a uint8 RGB array with positive strides, or an axis it cannot margin)."""
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3 or min(img.strides) < 0:
        return None
    top, left, h, w = box
    H, W = img.shape[:2]
    bottom, right = _far_end(top, h, H, size), _far_end(left, w, W, size)
    if bottom is None or right is None:
        return None
    if img.flags.writeable:
        src = torch.from_numpy(img)
    else:  # e.g. PIL's pixels: torch warns about any read-only array, though it only reads
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(img)
    chw = src.permute(2, 0, 1)
    x = chw[None, :, top:bottom, left:right]
    threads = torch.get_num_threads()
    if threads > 1:  # one image is too little work to share: threads only slow it down
        torch.set_num_threads(1)
    try:
        out = _RESAMPLE(x, [size, size], False, size / h, size / w)[0]  # (C, size, size)
    finally:
        if threads > 1:
            torch.set_num_threads(threads)
    pixels = out.permute(1, 2, 0).numpy()
    rows, cols = _near_edge(top, h, size), _near_edge(left, w, size)
    if rows or cols:
        sy, sx = h / size, w / size
        my, mx = 2 + math.ceil(max(sy, 1.0)), 2 + math.ceil(max(sx, 1.0))
        r0, c0 = max(0, top - my), max(0, left - mx)
        r1, c1 = min(H, top + h + my), min(W, left + w + mx)
        if rows:  # the first rows, every column
            r = min(H, top + math.ceil(rows * sy) + my)
            strip_box = (top - r0, left - c0, rows * sy, w)
            pixels[:rows] = _resize_pil(img[r0:r, c0:c1], (size, rows), strip_box)
        if cols:  # the first columns, every row
            c = min(W, left + math.ceil(cols * sx) + mx)
            strip_box = (top - r0, left - c0, h, cols * sx)
            pixels[:, :cols] = _resize_pil(img[r0:r1, c0:c], (cols, size), strip_box)
    return pixels


def train_box(
    height: int, width: int, rng: random.Random, scale: tuple, ratio: tuple
) -> tuple[int, int, int, int]:
    """train_transform's crop box: crop_params, or the whole image (no draws) when that is the
    only box the scale and ratio allow."""
    if scale[0] >= 1.0 and ratio[0] <= width / height <= ratio[1]:
        return (0, 0, height, width)
    return crop_params(height, width, rng, scale, ratio)


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
    out = crop_resize(img, size, train_box(*img.shape[:2], rng, scale, ratio))
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
    """Stack HxW (grayscale) or HxWx3 (RGB) uint8 arrays into one channels-first tensor, each
    copied once, straight into its place."""
    if not arrays:
        raise ValueError("to_batch needs at least one image")
    first = arrays[0]
    shape = (
        (len(arrays), 1, *first.shape)
        if first.ndim == 2
        else (len(arrays), first.shape[2], *first.shape[:2])
    )
    if get_worker_info() is not None:
        # In a DataLoader worker, straight into shared memory, as torch's default_collate does:
        # a batch in private memory is copied there again on its way to the main process.
        storage = torch.UntypedStorage._new_shared(math.prod(shape))
        out = torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
    else:
        out = torch.empty(shape, dtype=torch.uint8)
    dst = out.numpy()
    for i, a in enumerate(arrays):
        if a.shape != first.shape:
            raise ValueError(f"image {i} has shape {a.shape}, image 0 {first.shape}")
        dst[i] = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
    return out
