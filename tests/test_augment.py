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
