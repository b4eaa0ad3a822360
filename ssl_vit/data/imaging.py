"""Image hygiene: decode anything Pillow reads into a clean L or RGB image, resize, encode.

Every image that enters a shard goes through `process_bytes` (files) or `process_pixels` (IDX
arrays): EXIF orientation applied, odd modes converted (CMYK, palette, 1-bit, 16-bit scaled,
alpha composited on white), first frame of animations, a pixel-count guard against decompression
bombs. Failures raise `BadImage` with a one-line reason that goes to errors.jsonl.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

RESIZE_MODES = ("none", "shorter", "longer", "center-crop")
FORMATS = ("keep", "png", "jpg", "webp")
_EXT_OF_PIL = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp"}
_ORIENTATION = 0x0112
_ALPHA_MODES = ("RGBA", "LA", "PA", "La", "RGBa")
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")


class BadImage(Exception):
    """An input that cannot become a sample; str(e) is the reason recorded in errors.jsonl."""


@dataclass(frozen=True)
class ImageOptions:
    mode: str = "RGB"  # stored mode: "L" (1 channel) or "RGB" (3 channels)
    resize: str = "none"  # one of RESIZE_MODES
    size: int | None = None  # target side for resize
    fmt: str = "keep"  # one of FORMATS; keep = original bytes when nothing had to change
    quality: int = 95  # jpg / webp quality
    max_pixels: int = 100_000_000  # decompression-bomb guard, width * height


@dataclass
class Encoded:
    data: bytes
    ext: str  # "png" | "jpg" | "webp"
    original_size: tuple[int, int]  # (H, W) after EXIF orientation, before resize
    size: tuple[int, int]  # (H, W) as stored
    histogram: list[int] | None  # 256 pixel counts per channel (for mean/std), when asked


def configure_pil() -> None:
    """Let our own --max-pixels check decide (Pillow's global guard would warn or raise first)."""
    Image.MAX_IMAGE_PIXELS = None


def _sniff(data: bytes) -> None:
    if not data:
        raise BadImage("empty file (0 bytes)")
    head = data[:1024].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html", b"<?xml")) or b"<html" in head[:256]:
        raise BadImage("HTML/XML text saved with an image extension (a failed download?)")


def _to_mode(img: Image.Image, target: str) -> Image.Image:
    """Convert any Pillow mode to `target` ("L" or "RGB") without clipping or black backgrounds."""
    mode = img.mode
    if mode == target:
        return img
    if mode in _SIXTEEN_BIT or mode == "I":
        a = np.asarray(img).astype(np.int64)  # (H, W)
        # 16-bit data spans 0..65535: scale to 0..255 (rounded) instead of clipping at 255.
        a = (np.clip(a, 0, 65535) * 255 + 32767) // 65535
        img = Image.fromarray(a.astype(np.uint8))
    elif mode == "F":
        a = np.asarray(img, dtype=np.float64)
        a = a * 255.0 if a.size and np.nanmax(a) <= 1.0 else a  # float images are usually 0..1
        img = Image.fromarray(np.clip(np.nan_to_num(a) + 0.5, 0, 255).astype(np.uint8))
    elif mode in _ALPHA_MODES or "transparency" in img.info:
        # Transparent pixels become white (a black background would invent dark borders).
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba).convert("RGB")
    elif mode not in ("L", "RGB"):
        img = img.convert("RGB")  # CMYK, P, 1, YCbCr, LAB, HSV: Pillow's conversions are exact
    return img.convert(target) if img.mode != target else img


def _resize(img: Image.Image, how: str, size: int | None) -> Image.Image:
    if how == "none" or size is None:
        return img
    w, h = img.size
    if how == "center-crop":
        side = min(w, h)
        box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
        new, scale = (size, size), size / side
    else:
        scale = size / (min(w, h) if how == "shorter" else max(w, h))
        new, box = (max(1, round(w * scale)), max(1, round(h * scale))), None
        if new == (w, h):
            return img
    # Lanczos when shrinking (sharp, little aliasing); bicubic when enlarging (less ringing).
    # reducing_gap=3 first box-reduces large images, which is fast and visually lossless.
    if scale < 1:
        return img.resize(new, Image.Resampling.LANCZOS, box=box, reducing_gap=3.0)
    return img.resize(new, Image.Resampling.BICUBIC, box=box)


def _encode(img: Image.Image, fmt: str, quality: int) -> bytes:
    buf = io.BytesIO()
    if fmt == "png":
        img.save(buf, "PNG")
    elif fmt == "jpg":
        img.save(buf, "JPEG", quality=quality)
    else:
        img.save(buf, "WEBP", quality=quality, method=4)
    return buf.getvalue()


def _finish(
    img: Image.Image,
    opts: ImageOptions,
    original: tuple[int, int],
    keep: tuple[bytes, str] | None,
    fallback: str,
    want_stats: bool,
) -> Encoded:
    # 256 counts per band, bands in order: Pillow's C histogram is ~5x cheaper than numpy sums
    stats = img.histogram() if want_stats else None
    fmt = fallback if opts.fmt == "keep" else opts.fmt
    data, ext = keep or (_encode(img, fmt, opts.quality), fmt)
    return Encoded(data, ext, original, (img.size[1], img.size[0]), stats)


def process_bytes(data: bytes, opts: ImageOptions, *, want_stats: bool = False) -> Encoded:
    """Decode an image file's bytes, clean it up and encode it; raise BadImage with the reason."""
    _sniff(data)
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise BadImage("not an image (Pillow recognises no image format in it)") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise BadImage(f"unreadable image header ({e})") from None
    w, h = img.size
    if w * h > opts.max_pixels:
        raise BadImage(
            f"{w}x{h} = {w * h} pixels exceeds --max-pixels {opts.max_pixels} "
            "(decompression-bomb guard; raise it if the image is genuine)"
        )
    if w == 0 or h == 0:
        raise BadImage("image has zero width or height")
    src_format = img.format or ""
    frames = getattr(img, "n_frames", 1)
    try:
        orientation = int(img.getexif().get(_ORIENTATION, 1))
    except Exception:  # a broken EXIF block should not lose the pixels
        orientation = 1
    original = (w, h) if orientation in (5, 6, 7, 8) else (h, w)  # (H, W) as displayed
    if src_format == "JPEG" and opts.resize in ("shorter", "center-crop") and opts.size:
        # Let libjpeg decode at 1/2..1/8 scale when the result stays >= 2x the target: much
        # faster, and the final Lanczos step still sees enough pixels to avoid aliasing.
        img.draft(img.mode, (2 * opts.size, 2 * opts.size))
    try:
        img.seek(0)  # multi-frame files (GIF, TIFF, APNG): the first frame
        img.load()
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise BadImage(f"corrupt or truncated image data ({e})") from None
    changed = frames > 1 or img.size != (w, h)
    if orientation != 1:
        img = ImageOps.exif_transpose(img)
        changed = True
    out = _to_mode(img, opts.mode)
    changed |= out is not img
    resized = _resize(out, opts.resize, opts.size)
    changed |= resized is not out
    unchanged = opts.fmt == "keep" and not changed and src_format in _EXT_OF_PIL
    keep = (data, _EXT_OF_PIL[src_format]) if unchanged else None
    fallback = _EXT_OF_PIL.get(src_format, "png")
    return _finish(resized, opts, original, keep, fallback, want_stats)


def process_pixels(pixels: np.ndarray, opts: ImageOptions, *, want_stats: bool = False) -> Encoded:
    """Encode an already-decoded uint8 array (H, W) or (H, W, 3), e.g. an IDX image."""
    img = Image.fromarray(pixels)  # (H, W) -> L, (H, W, 3) -> RGB
    original = (img.size[1], img.size[0])
    out = _resize(_to_mode(img, opts.mode), opts.resize, opts.size)
    # Arrays have no original bytes: "keep" stores them losslessly as PNG.
    return _finish(out, opts, original, None, "png", want_stats)


def histogram_stats(hist: Any) -> dict[str, Any]:
    """A histogram's (256 counts per channel) pixel count and per-channel sums and sums of
    squares: exact integers, so merging them in any order gives the same mean/std."""
    counts = np.asarray(hist, dtype=np.int64).reshape(-1, 256)  # (C, 256)
    v = np.arange(256, dtype=np.int64)
    return {
        "pixels": int(counts[0].sum()),
        "sums": [int(x) for x in counts @ v],
        "squares": [int(x) for x in counts @ (v * v)],
    }


def mean_std(stats: list[dict[str, Any]], channels: int) -> tuple[list[float], list[float]]:
    """Exact integer sums -> per-channel mean/std of pixel values scaled to [0, 1]."""
    n = sum(s["pixels"] for s in stats)
    if n == 0:
        return [0.0] * channels, [1.0] * channels
    sums = [sum(s["sums"][c] for s in stats) for c in range(channels)]
    squares = [sum(s["squares"][c] for s in stats) for c in range(channels)]
    mean = [round(sums[c] / n / 255.0, 6) for c in range(channels)]
    # Var = (N*Q - S^2) / N^2, computed in integers so it is exact and order independent.
    std = [
        round(math.sqrt((n * squares[c] - sums[c] ** 2) / n**2) / 255.0, 6) for c in range(channels)
    ]
    return mean, std
