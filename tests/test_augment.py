"""Decoding and augmentation of one sample (ssl_vit.data.augment): the fast paths (libpng for
PNGs already in the target mode, no resize for a whole-image box, flips as views) give exactly
the pixels of the PIL path they stand in for, and bad images stay one-line CorruptSample errors."""

from __future__ import annotations

import io
import random
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from ssl_vit.data import augment
from ssl_vit.data.augment import (
    CorruptSample,
    decode_sample,
    decode_with_pil,
    eval_transform,
    shift_image,
    train_transform,
)


def _encode(img: Image.Image, **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **save)
    return buf.getvalue()


def _noise(mode: str, w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    shape = (h, w) if mode in ("L", "P", "I;16") else (h, w, len(mode))
    dtype = np.uint16 if mode == "I;16" else np.uint8
    arr = rng.integers(0, np.iinfo(dtype).max, shape, dtype=dtype)
    return Image.fromarray(arr) if mode == "I;16" else Image.fromarray(arr).convert(mode)


def _pngs() -> dict[str, bytes]:
    gray_trns = _noise("L", 9, 7)
    gray_trns.info["transparency"] = 17
    return {
        "gray": _encode(_noise("L", 28, 28)),
        "gray non-square": _encode(_noise("L", 31, 20)),
        "rgb": _encode(_noise("RGB", 12, 10)),
        "rgba": _encode(_noise("RGBA", 12, 10)),
        "palette": _encode(_noise("RGB", 8, 8).convert("P")),
        "gray 16-bit": _encode(_noise("I;16", 8, 8)),
        "gray interlaced": _encode(_noise("L", 16, 16), interlace=1),
        "gray with tRNS": _encode(gray_trns, transparency=17),
    }


@pytest.mark.parametrize("name", list(_pngs()))
@pytest.mark.parametrize("channels", [1, 3])
def test_decode_gives_the_pixels_of_pil(name: str, channels: int) -> None:
    data = _pngs()[name]
    img, label = decode_sample({"png": data, "cls": b"3"}, channels=channels, labelled=True)
    want = decode_with_pil(data, channels)
    assert label == 3 and img.dtype == np.uint8 and img.shape == want.shape
    assert np.array_equal(img, want), name


def test_fast_path_is_taken_for_what_data_prep_writes() -> None:
    # The pinned torchvision has the op; losing it would silently slow every loader worker.
    assert augment._DECODE_PNG is not None, "torchvision's image.decode_png op is missing"
    assert augment._png_fast_path(_pngs()["gray"], 1) == (28, 28)
    assert augment._png_fast_path(_pngs()["rgb"], 3) == (12, 10)
    for name, channels in (("rgb", 1), ("gray", 3), ("gray 16-bit", 1), ("palette", 3)):
        assert augment._png_fast_path(_pngs()[name], channels) is None, name


def _bomb(side: int) -> bytes:
    """A valid gray PNG declaring side x side pixels of zeros, a few kB on disk."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    rows = zlib.compress(b"\0" * (side + 1) * side, 9)
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def test_bombs_and_garbage_are_corrupt_samples(monkeypatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 64)
    with pytest.raises(CorruptSample, match="k1: undecodable image.*limit"):
        decode_sample({"__key__": "k1", "png": _bomb(100), "cls": b"0"}, channels=1, labelled=True)
    at_limit, _ = decode_sample({"png": _bomb(64), "cls": b"0"}, channels=1, labelled=True)
    assert at_limit.shape == (64, 64)
    cut = _pngs()["gray"][:-40]
    for data in (cut, b"\x89PNG\r\n\x1a\n" + b"\0" * 40, b"not an image"):
        with pytest.raises(CorruptSample, match="k2: undecodable image"):
            decode_sample({"__key__": "k2", "png": data, "cls": b"0"}, channels=1, labelled=True)


def _pil_train_transform(img: np.ndarray, rng: random.Random, size: int, scale) -> np.ndarray:
    """The transform as PIL alone would do it: crop box, bilinear resize, flip."""
    h, w = img.shape[:2]
    if scale[0] >= 1.0 and 3 / 4 <= w / h <= 4 / 3:
        top, left, bh, bw = 0, 0, h, w
    else:
        top, left, bh, bw = augment.crop_params(h, w, rng, scale, (3 / 4, 4 / 3))
    out = Image.fromarray(img).resize(
        (size, size), Image.BILINEAR, (left, top, left + bw, top + bh)
    )
    if rng.random() < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(out)


@pytest.mark.parametrize("shape", [(28, 28), (28, 28, 3), (40, 33)])
@pytest.mark.parametrize("scale", [(1.0, 1.0), (0.35, 1.0)])
def test_train_transform_matches_pil(shape, scale) -> None:
    img = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    flips = set()
    for seed in range(40):
        got = train_transform(img, random.Random(seed), 28, scale=scale)
        want = _pil_train_transform(img, random.Random(seed), 28, scale)
        assert got.shape == want.shape and np.array_equal(got, want), seed
        flips.add(np.array_equal(got, img))
    assert len(flips) == 2 or shape != (28, 28) or scale != (1.0, 1.0)  # both flip outcomes met


def test_eval_transform_is_a_no_op_at_size_and_a_centre_crop_otherwise() -> None:
    img = np.random.default_rng(2).integers(0, 256, (28, 28), dtype=np.uint8)
    assert eval_transform(img, 28) is img
    wide = np.random.default_rng(3).integers(0, 256, (20, 30), dtype=np.uint8)
    want = np.asarray(Image.fromarray(wide).resize((16, 16), Image.BILINEAR, (5, 0, 25, 20)))
    assert np.array_equal(eval_transform(wide, 16), want)


def _shift_of(out: np.ndarray, img: np.ndarray, bound: int) -> tuple[int, int] | None:
    """The (dy, dx) within `bound` that turns `img` into `out`, or None."""
    return next(((dy, dx) for dy in range(-bound, bound + 1) for dx in range(-bound, bound + 1)
                 if np.array_equal(shift_image(img, dy, dx), out)), None)  # fmt: skip


def test_shift_moves_pixels_and_zero_fills_the_border() -> None:
    img = np.arange(1, 26, dtype=np.uint8).reshape(5, 5)
    out = shift_image(img, 1, -2)  # down 1, left 2
    assert np.array_equal(out[1:, :3], img[:4, 2:]) and not out[0].any() and not out[:, 3:].any()
    rgb = np.stack([img, img + 30, img + 60], -1)
    assert np.array_equal(shift_image(rgb, -1, 1)[..., 2], shift_image(rgb[..., 2], -1, 1))
    assert shift_image(img, 0, 0) is img and not shift_image(img, 5, 0).any()


def test_train_transform_shifts_within_the_bound_and_keeps_the_other_draws() -> None:
    """translate=t shifts by each (dy, dx) in [-t, t]^2, all of them met; translate=0 draws
    nothing more, so a run without it augments exactly as before."""
    img = np.random.default_rng(4).integers(1, 256, (12, 12), dtype=np.uint8)
    seen = set()
    for seed in range(300):
        out = train_transform(img, random.Random(seed), 12, scale=(1.0, 1.0), hflip=False,
                              translate=1)  # fmt: skip
        seen.add(_shift_of(out, img, 1))
        crop = dict(scale=(0.5, 1.0))
        plain = train_transform(img, random.Random(seed), 12, translate=0, **crop)
        assert np.array_equal(plain, train_transform(img, random.Random(seed), 12, **crop))
    assert seen == {(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)}


# --- JPEG decoding, torch's resampling and batching (the 224-px photo path) ---------------------


def _photo(h: int, w: int, seed: int = 0) -> np.ndarray:  # (h, w, 3) uint8, photo-like
    """Smooth gradients, a few hard-edged discs and a little noise: edges and flat areas both."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([xx / w * 200, yy / h * 180 + 40, (xx + yy) / (h + w) * 255], -1)
    for _ in range(6):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(5, min(h, w) / 3)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _jpeg(img: np.ndarray | Image.Image, **save) -> bytes:
    buf = io.BytesIO()
    pil = img if isinstance(img, Image.Image) else Image.fromarray(img)
    pil.save(buf, format="JPEG", **save)
    return buf.getvalue()


def _jpegs() -> dict[str, bytes]:
    photo = _photo(61, 83)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: neither path applies it
    return {
        "rgb q90 4:2:0": _jpeg(photo, quality=90),
        "rgb q95 4:4:4": _jpeg(photo, quality=95, subsampling=0),
        "rgb progressive": _jpeg(photo, quality=85, progressive=True),
        "rgb restart markers": _jpeg(photo, quality=90, restart_marker_blocks=1),
        "rgb exif + icc": _jpeg(photo, exif=exif, icc_profile=b"\0" * 300),
        "gray": _jpeg(Image.fromarray(photo).convert("L"), quality=90),
        "cmyk": _jpeg(Image.fromarray(photo).convert("CMYK")),
    }


@pytest.mark.parametrize("name", list(_jpegs()))
@pytest.mark.parametrize("channels", [1, 3])
def test_jpeg_decode_gives_the_pixels_of_pil(name: str, channels: int) -> None:
    """libjpeg-turbo through torchvision's op where the JPEG's components are the target's,
    PIL otherwise (CMYK, colour to gray, gray to colour): PIL's pixels either way."""
    data = _jpegs()[name]
    img, _ = decode_sample({"jpg": data, "cls": b"1"}, channels=channels, labelled=True)
    want = decode_with_pil(data, channels)
    assert img.dtype == np.uint8 and img.shape == want.shape and np.array_equal(img, want), name


def test_jpeg_fast_path_is_taken_for_what_data_prep_writes() -> None:
    assert augment._DECODE_JPEG is not None, "torchvision's image.decode_jpeg op is missing"
    jpegs = _jpegs()
    for name in ("rgb q90 4:2:0", "rgb progressive", "rgb restart markers", "rgb exif + icc"):
        assert augment._jpeg_fast_path(jpegs[name], 3) == (83, 61), name
        assert augment._jpeg_fast_path(jpegs[name], 1) is None, name  # PIL's luma, not libjpeg's
    assert augment._jpeg_fast_path(jpegs["gray"], 1) == (83, 61)
    assert augment._jpeg_fast_path(jpegs["gray"], 3) is None
    assert augment._jpeg_fast_path(jpegs["cmyk"], 3) is None
    data = jpegs["rgb q90 4:2:0"]
    for cut in range(0, 700, 7):  # cut anywhere before or in the frame header: None, no raise
        assert augment._jpeg_fast_path(data[:cut], 3) in (None, (83, 61))
    assert augment._jpeg_fast_path(b"\xff\xd8\xff\xd9", 3) is None


def test_bad_jpegs_are_corrupt_samples_with_pils_reason(monkeypatch) -> None:
    data = _jpegs()["rgb q90 4:2:0"]
    for bad in (data[: len(data) // 2], data[:-2], data[:300]):
        with pytest.raises(CorruptSample, match="k3: undecodable image.*(truncated|Truncated)"):
            decode_sample({"__key__": "k3", "jpg": bad, "cls": b"0"}, channels=3, labelled=True)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 60 * 80)
    with pytest.raises(CorruptSample, match="k4: undecodable image.*limit"):
        decode_sample({"__key__": "k4", "jpg": data, "cls": b"0"}, channels=3, labelled=True)


def _pil_resize(img: np.ndarray, size: int, box: tuple[int, int, int, int]) -> np.ndarray:
    top, left, h, w = box
    out = Image.fromarray(img).resize((size, size), Image.BILINEAR, (left, top, left + w, top + h))
    return np.asarray(out)


def _boxes(seed: int, n: int, H: int, W: int, size: int) -> list[tuple[int, int, int, int]]:
    """Random boxes, and those that meet the edge cases: a side equal to the output size, one
    a few pixels short of it (the margin would make torch's input that long), touching the
    image's far edges, 1 pixel, and shrinking up to 8x."""
    rng = random.Random(seed)
    boxes = []
    for k in range(n):
        h, w = rng.randint(1, H), rng.randint(1, W)
        if k % 5 == 1:
            h = min(H, size)
        if k % 7 == 2:
            w = max(1, min(W, size - rng.randint(1, 5)))
        top, left = rng.randint(0, H - h), rng.randint(0, W - w)
        if k % 3 == 0:
            top, left = H - h, W - w
        boxes.append((top, left, h, w))
    return boxes + [(0, 0, 1, 1), (H - 1, W - 1, 1, 1), (0, 0, H, W)]


@pytest.mark.parametrize("kind", ["photo", "noise"])
@pytest.mark.parametrize("size", [64, 224])
def test_torch_resampling_is_within_a_level_of_pil(kind: str, size: int) -> None:
    """The tolerance accepted for RGB outputs from TORCH_RESIZE_MIN px up (crop_resize; 64 px
    here to shrink crops several-fold, by the same function): values within 1
    level of PIL's, 2 where both of torch's passes round the other way (10 of 602M values over
    4,000 crops of benchmarks/photo_set.py's photos: torch's weights are 16-bit fixed point,
    PIL's 22-bit; the rows and columns whose PIL weights reach before the box are PIL's own),
    most equal. Photo-like images and noise (the hardest case for rounding)."""
    H, W = (257, 341) if size == 224 else (600, 47)
    img = _photo(H, W, 5) if kind == "photo" else np.random.default_rng(5).integers(
        0, 256, (H, W, 3), dtype=np.uint8)  # fmt: skip
    differing = []
    for box in _boxes(size, 60, H, W, size):
        got = augment._resize_torch(img, size, box)
        if got is None:  # the rare box torch's kernel cannot take: PIL's path
            got = augment.crop_resize(img, size, box)
        want = _pil_resize(img, size, box)
        assert got.shape == want.shape == (size, size, 3) and got.dtype == np.uint8
        diff = np.abs(got.astype(np.int16) - want)
        assert diff.max() <= 2 and (diff > 1).mean() < 1e-4, (box, diff.max())
        differing.append((diff > 0).mean())
    # Measured: 0.3% (photo) and 0.7% (noise) of values at 224 px (crops of a 257 x 341 image,
    # mostly enlarged); 14-16% at 64 px from a 600 x 47 one (shrunk up to 9x: more weights,
    # each rounded).
    assert np.mean(differing) < (0.02 if size == 224 else 0.25), np.mean(differing)


def test_torch_resampling_is_used_and_leaves_the_thread_count() -> None:
    assert augment._RESAMPLE is not None, "torch's _upsample_bilinear2d_aa is missing"
    img = _photo(256, 320)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert augment._resize_torch(img, 224, (10, 20, 150, 200)) is not None
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    # Below TORCH_RESIZE_MIN, gray images and read-only or flipped arrays: PIL's exact pixels.
    small = augment.crop_resize(img, 32, (10, 20, 150, 200))
    assert np.array_equal(small, _pil_resize(img, 32, (10, 20, 150, 200)))
    gray = img[..., 0].copy()
    assert augment._resize_torch(gray, 224, (10, 20, 150, 200)) is None
    assert augment._resize_torch(img[:, ::-1], 224, (10, 20, 150, 200)) is None
    frozen = img.copy()
    frozen.flags.writeable = False
    assert np.array_equal(augment.crop_resize(frozen, 224, (3, 4, 99, 120)),
                          augment.crop_resize(img, 224, (3, 4, 99, 120)))  # fmt: skip


def test_train_transform_at_224_draws_as_before_and_stays_within_a_level() -> None:
    """The 224-px JPEG path: the same random numbers as the PIL-only transform (resume depends
    on it), pixels within the tolerance above of decode_with_pil + PIL's resize + flip."""
    data = _jpeg(_photo(256, 320, 2), quality=90)
    img, _ = decode_sample({"jpg": data}, channels=3, labelled=False)
    flips = set()
    for seed in range(30):
        ours, theirs = random.Random(seed), random.Random(seed)
        got = train_transform(img, ours, 224)
        want = _pil_train_transform(decode_with_pil(data, 3), theirs, 224, (0.08, 1.0))
        assert ours.getstate() == theirs.getstate(), seed
        assert np.abs(got.astype(np.int16) - want).max() <= 2, seed
        flips.add(got.strides[1] < 0)
    assert flips == {True, False}


def test_to_batch_copies_each_image_once_into_place(monkeypatch) -> None:
    rng = np.random.default_rng(6)
    hwc = [rng.integers(0, 256, (5, 7, 3), dtype=np.uint8) for _ in range(3)]
    planar = torch.from_numpy(rng.integers(0, 256, (3, 5, 7), dtype=np.uint8))
    rgb = [hwc[0], hwc[1][:, ::-1], planar.permute(1, 2, 0).numpy(),
           planar.permute(1, 2, 0).numpy()[:, ::-1]]  # fmt: skip
    want = torch.from_numpy(np.stack(rgb)).permute(0, 3, 1, 2)
    got = augment.to_batch(rgb)
    assert got.shape == (4, 3, 5, 7) and got.is_contiguous() and torch.equal(got, want)
    gray = [hwc[2][..., 0], hwc[2][::-1, ::-1, 1]]
    assert torch.equal(augment.to_batch(gray), torch.from_numpy(np.stack(gray))[:, None])
    with pytest.raises(ValueError, match="shape"):
        augment.to_batch([hwc[0], hwc[0][:4]])
    with pytest.raises(ValueError, match="at least one"):
        augment.to_batch([])
    monkeypatch.setattr(augment, "get_worker_info", lambda: object())  # as in a loader worker
    shared = augment.to_batch(rgb)
    assert shared.is_shared() and torch.equal(shared, want)
