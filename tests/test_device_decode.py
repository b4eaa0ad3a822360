"""The device path of decoding and augmentation (ssl_vit.data.device_decode): the JPEG header
parser agrees with PIL and never raises; the worker-side box draws are train_transform's, number
for number; and the batched decode + roi_align crop gives the CPU path's pixels within a stated
tolerance, with no seam where a box meets the padding, exact flips, and a bad sample named by
its batch position. Runs on the CPU; the CUDA variants run where a GPU is present."""

from __future__ import annotations

import io
import random
import time
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from ssl_vit.data.augment import (
    decode_with_pil,
    eval_transform,
    is_jpeg,
    to_batch,
    train_transform,
)
from ssl_vit.data.device_decode import DeviceDecodeError, crop_box_for, decode_crop_batch, jpeg_size

CPU = torch.device("cpu")
# The CUDA variants exist where a GPU does (nvjpeg then decodes): collected there, absent here.
DEVICES = [pytest.param(CPU, id="cpu")] + (
    [pytest.param(torch.device("cuda"), id="cuda")] if torch.cuda.is_available() else []
)
SIZES = [(256, 341), (300, 256), (256, 256)]  # (height, width) of pre-resized shard images


def _photo(h: int, w: int, channels: int, seed: int) -> np.ndarray:  # (H, W[, 3]) uint8
    """A photo-like image: gradients and waves, a few flat discs with sharp edges, and noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    planes = []
    for _ in range(channels):
        wave = np.sin(x / rng.uniform(8, 40) + rng.uniform(0, 6)) * np.cos(y / rng.uniform(8, 40))
        plane = 128 + 60 * wave + 40 * (x / w - y / h)
        for _ in range(6):
            cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(10, 60)
            plane[(y - cy) ** 2 + (x - cx) ** 2 < r**2] = rng.uniform(0, 255)
        planes.append(plane + rng.normal(0, 6, (h, w)))
    img = np.clip(np.stack(planes, -1), 0, 255).astype(np.uint8)
    return img[..., 0] if channels == 1 else img


def _jpeg(img: np.ndarray | Image.Image, **save) -> bytes:
    buf = io.BytesIO()
    pil = img if isinstance(img, Image.Image) else Image.fromarray(img)
    pil.save(buf, format="JPEG", **{"quality": 90, **save})
    return buf.getvalue()


def _tensor(data: bytes) -> torch.Tensor:  # (N,) uint8
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _run(
    datas: list[bytes], boxes: list, flips: list, size: int, channels: int, device, **kw
) -> torch.Tensor:  # (B, C, size, size) uint8 on the CPU
    out = decode_crop_batch(
        [_tensor(d) for d in datas],
        torch.tensor(boxes, dtype=torch.int64).view(-1, 4),
        torch.tensor(flips, dtype=torch.bool),
        size,
        channels,
        device,
        **kw,
    )
    assert out.dtype == torch.uint8 and out.device.type == device.type
    assert tuple(out.shape) == (len(datas), channels, size, size)
    return out.cpu()


# --- jpeg_size ----------------------------------------------------------------------------------


def _with_before_sof(data: bytes, extra: bytes) -> bytes:
    """`data` with `extra` bytes inserted right before its frame header's marker."""
    at = data.index(b"\xff\xc0") if b"\xff\xc0" in data else data.index(b"\xff\xc2")
    return data[:at] + extra + data[at:]


def _jpegs() -> dict[str, tuple[bytes, tuple[int, int]]]:
    """name: (JPEG bytes, (height, width)), encoded by PIL in many flavours."""
    rgb, gray = _photo(37, 53, 3, 0), _photo(64, 20, 1, 1)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: a tag, not applied by either path
    exif[0x010E] = "a description"
    big_icc = b"\0" * 150_000  # above 64 kB: split over several APP2 segments
    plain = _jpeg(rgb)
    cases = {
        "rgb": (plain, rgb.shape[:2]),
        "gray": (_jpeg(gray), gray.shape),
        "progressive": (_jpeg(rgb, progressive=True), rgb.shape[:2]),
        "progressive gray": (_jpeg(gray, progressive=True), gray.shape),
        "optimized 4:4:4": (_jpeg(rgb, optimize=True, subsampling=0), rgb.shape[:2]),
        "exif, comment, icc": (
            _jpeg(rgb, exif=exif.tobytes(), comment=b"hello", icc_profile=big_icc),
            rgb.shape[:2],
        ),
        "restart markers": (_jpeg(rgb, restart_marker_blocks=1), rgb.shape[:2]),
        "restart rows": (_jpeg(gray, restart_marker_rows=1), gray.shape),
        "1x1": (_jpeg(_photo(1, 1, 3, 2)), (1, 1)),
        "wide": (_jpeg(_photo(3, 1000, 1, 3)), (3, 1000)),
        "cmyk": (_jpeg(Image.fromarray(rgb).convert("CMYK")), rgb.shape[:2]),
        "fill bytes before a marker": (_with_before_sof(plain, b"\xff\xff"), rgb.shape[:2]),
        "TEM marker (no length)": (_with_before_sof(plain, b"\xff\x01"), rgb.shape[:2]),
    }
    return {k: (d, tuple(hw)) for k, (d, hw) in cases.items()}


@pytest.mark.parametrize("name", list(_jpegs()))
def test_jpeg_size_is_pils(name: str) -> None:
    data, hw = _jpegs()[name]
    if name != "TEM marker (no length)":  # valid JPEG, but PIL's parser does not know TEM
        with Image.open(io.BytesIO(data)) as im:
            assert (im.height, im.width) == hw, "the case is what it claims"
    assert is_jpeg(data)
    for buf in (data, bytearray(data), memoryview(data), memoryview(_tensor(data).numpy())):
        assert jpeg_size(buf) == hw, (name, type(buf))


def _png(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_photo(h, w, 1, 0)).save(buf, format="PNG")
    return buf.getvalue()


def test_jpeg_size_is_none_without_a_frame_header() -> None:
    data = _jpegs()["rgb"][0]
    sof = data.index(b"\xff\xc0")
    sos_first = b"\xff\xd8\xff\xda\x00\x08" + bytes(6) + data[sof:]  # scan before any frame
    zero_height = bytearray(data)
    zero_height[sof + 5 : sof + 7] = b"\0\0"  # height left to a DNL marker
    for bad in (
        b"",
        b"\xff\xd8",
        _png(8, 8),
        bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8)),
        data[:sof],  # cut before the frame header
        data[: sof + 7],  # cut inside it
        data[:2] + b"\x00" + data[3:],  # no marker after the SOI
        data[:sof] + b"\xff\xd9",  # EOI before any frame
        sos_first,
        bytes(zero_height),
    ):
        assert jpeg_size(bad) is None, bad[:16]
    assert not is_jpeg(_png(8, 8)) and not is_jpeg(b"\xff\xd8")


def test_jpeg_size_never_raises() -> None:
    """Every prefix and many corrupted copies: a size that is the true one, or None."""
    data, hw = _jpegs()["exif, comment, icc"]
    head = data[: data.index(b"\xff\xda") + 4]  # up to the scan: all the parser reads
    for n in range(len(head) + 1):
        assert jpeg_size(head[:n]) in (None, hw)
    assert jpeg_size(head) == hw
    rng = random.Random(0)
    small = _jpegs()["rgb"][0][:700]
    for _ in range(3000):
        bad = bytearray(small)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(2, len(bad))] = rng.randrange(256)
        got = jpeg_size(bytes(bad))
        assert got is None or (len(got) == 2 and min(got) >= 1)


def test_jpeg_size_is_fast() -> None:
    data = _jpegs()["exif, comment, icc"][0]  # eight segments before the frame
    start = time.perf_counter()
    for _ in range(2000):
        jpeg_size(data)
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 100e-6, (
        f"{per_call * 1e6:.1f} us a call"
    )  # 7 us on 2 busy cores (1.3 us: plain)


# --- crop_box_for -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"hflip": False},
        {"scale": (0.5, 1.0), "ratio": (0.5, 2.0)},
        {"scale": (1.0, 1.0)},  # train_transform's no-draw shortcut where the aspect allows
        {"scale": (0.9, 1.0), "ratio": (2.0, 3.0)},  # often falls back to the central box
    ],
)
def test_crop_box_for_draws_what_train_transform_draws(kw: dict) -> None:
    size = 13
    for hw in ((37, 29), (20, 61), (24, 24), (13, 13)):
        img = np.random.default_rng(0).integers(0, 256, hw, dtype=np.uint8)  # every box differs
        for seed in range(60):
            ours, theirs = random.Random(seed), random.Random(seed)
            (top, left, h, w), flip = crop_box_for(*hw, ours, augment=True, **kw)
            got = train_transform(img, theirs, size, **kw)
            assert ours.getstate() == theirs.getstate(), (hw, seed)
            assert 0 <= top and 0 <= left and top + h <= hw[0] and left + w <= hw[1]
            want = Image.fromarray(img).resize(
                (size, size), Image.BILINEAR, box=(left, top, left + w, top + h)
            )
            want = np.asarray(want)[:, ::-1] if flip else np.asarray(want)
            assert np.array_equal(got, want), (hw, seed, (top, left, h, w), flip)


def test_crop_box_for_eval_is_the_central_square() -> None:
    img = np.random.default_rng(0).integers(0, 256, (21, 34), dtype=np.uint8)
    rng = random.Random(0)
    before = rng.getstate()
    (top, left, h, w), flip = crop_box_for(21, 34, rng, augment=False)
    assert rng.getstate() == before and not flip
    want = eval_transform(img, 16)
    got = Image.fromarray(img).resize((16, 16), Image.BILINEAR, box=(left, top, left + w, top + h))
    assert np.array_equal(np.asarray(got), want)


def test_crop_box_for_refuses_a_shift() -> None:
    with pytest.raises(ValueError, match="translate"):
        crop_box_for(32, 32, random.Random(0), augment=True, translate=4)


# --- decode_crop_batch --------------------------------------------------------------------------


def _cpu_path(data: bytes, seed: int, size: int, channels: int) -> np.ndarray:
    return train_transform(decode_with_pil(data, channels), random.Random(seed), size)


def _device_path(
    datas: list[bytes], seeds: list[int], size: int, channels: int, device, **kw
) -> torch.Tensor:
    boxes, flips = [], []
    for data, seed in zip(datas, seeds, strict=True):
        box, flip = crop_box_for(*jpeg_size(data), random.Random(seed), augment=True)
        boxes.append(box)
        flips.append(flip)
    return _run(datas, boxes, flips, size, channels, device, **kw)


# Measured on the CPU (libjpeg both sides, so the decoded pixels are equal) over these 18 images:
#   size 224 (crops mostly enlarged, at most 1.5x shrunk): mean 0.23-0.28 levels, p99 1-2,
#   max 24 (gray) and 12 (RGB), single pixels on the discs' sharp edges in shrunk crops;
#   size 96 (crops shrunk up to 3.5x, roi_align's box of bilinear samples vs PIL's triangle
#   filter): mean 0.47-0.61, p99 3-4, max 23.
# Enlarging, the only difference is PIL's rounding to 8 bits between its two passes. nvjpeg's
# IDCT may differ from libjpeg's by a level or so: the CUDA bounds add that (not measured here).
BOUNDS = {224: (0.5, 3.0), 96: (1.2, 6.0)}  # size: (mean, 99th percentile) in gray levels


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("size", [224, 96])
def test_matches_the_cpu_path(size: int, channels: int, device: torch.device) -> None:
    datas = [_jpeg(_photo(*SIZES[k % 3], channels, k)) for k in range(18)]
    seeds = list(range(100, 118))
    got = _device_path(datas, seeds, size, channels, device)
    want = to_batch([_cpu_path(d, s, size, channels) for d, s in zip(datas, seeds, strict=True)])
    diff = (got.int() - want.int()).abs().float()
    mean, p99 = diff.mean().item(), np.percentile(diff.numpy(), 99)
    slack = 0.0 if device.type == "cpu" else 1.0
    max_mean, max_p99 = BOUNDS[size]
    assert mean < max_mean + slack and p99 <= max_p99 + 2 * slack, (mean, p99)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels", [1, 3])
def test_whole_image_at_the_size_is_the_decoded_image(channels: int, device) -> None:
    datas = [_jpeg(_photo(48, 48, c, c)) for c in (1, 3)]  # a gray and a colour JPEG
    got = _run(datas, [(0, 0, 48, 48)] * 2, [False, False], 48, channels, device)
    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    for k, data in enumerate(datas):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torchvision's codecs
            decoded = decode_jpeg(_tensor(data), mode=mode, device=device).cpu()
        assert (got[k].int() - decoded.int()).abs().max() <= 1
        if device.type == "cpu" and channels == k * 2 + 1:  # libjpeg both: PIL's very pixels
            assert np.array_equal(to_batch([decode_with_pil(data, channels)])[0], got[k])


@pytest.mark.parametrize("device", DEVICES)
def test_flips_mirror_the_crop(device) -> None:
    img = _photo(64, 80, 3, 5)
    img[:, :20] = 0  # dark on the left: a mirror cannot go unnoticed
    data = _jpeg(img)
    box = (5, 7, 30, 36)  # enlarged to 40 x 40: PIL's pixels within rounding
    plain, mirrored = _run([data, data], [box, box], [False, True], 40, 3, device)
    assert torch.equal(mirrored, plain.flip(-1)) and not torch.equal(mirrored, plain)
    assert plain[:, :, :8].float().mean() < 40 < mirrored[:, :, :8].float().mean()
    cpu = Image.fromarray(decode_with_pil(data, 3)).resize(
        (40, 40), Image.BILINEAR, box=(7, 5, 43, 35)
    )
    want = torch.from_numpy(np.asarray(cpu)[:, ::-1].copy()).permute(2, 0, 1)  # (C, H, W)
    assert (mirrored.int() - want.int()).abs().max() <= 1


@pytest.mark.parametrize("device", DEVICES)
def test_no_seam_where_a_box_meets_the_padding(device) -> None:
    """A bright small image beside a larger one sits in zero padding: boxes on its right and
    bottom edges (enlarged, so the last output pixels sample its last half pixel) must read
    only its own pixels, as when it is decoded alone and as PIL resamples it."""
    small = np.full((50, 70), 230, dtype=np.uint8)
    small[::2] = 220  # some texture, flat near the edges
    datas = [_jpeg(small), _jpeg(_photo(120, 160, 1, 0))]
    size = 64
    for box in ((20, 30, 30, 40), (0, 0, 50, 70), (30, 0, 20, 20), (0, 50, 10, 20)):
        got = _run(datas, [box, (0, 0, 120, 160)], [False, False], size, 1, device)
        alone = _run(datas[:1], [box], [False], size, 1, device)
        assert torch.equal(got[0], alone[0]), box  # in the pad or at the tensor's edge: the same
        top, left, h, w = box
        want = Image.fromarray(decode_with_pil(datas[0], 1)).resize(
            (size, size), Image.BILINEAR, box=(left, top, left + w, top + h)
        )
        want = torch.from_numpy(np.array(want))
        edges = (got[0, 0, :, -1], got[0, 0, -1, :])  # last column, last row
        for edge, ref in zip(edges, (want[:, -1], want[-1, :]), strict=True):
            assert edge.min() >= 200 and (edge.int() - ref.int()).abs().max() <= 2, box


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_sizes_batches_chunks_and_one_image(device) -> None:
    datas = [_jpeg(_photo(*SIZES[k % 3], 3, k)) for k in range(5)]
    datas.append(_jpeg(_photo(30, 44, 1, 9)))  # a gray JPEG in a colour batch
    seeds = list(range(6))
    whole = _device_path(datas, seeds, 32, 3, device)
    assert torch.equal(whole, _device_path(datas, seeds, 32, 3, device, chunk=2))
    for k in range(len(datas)):
        assert torch.equal(
            whole[k], _device_path(datas[k : k + 1], seeds[k : k + 1], 32, 3, device)[0]
        )
    empty = decode_crop_batch(
        [], torch.zeros(0, 4), torch.zeros(0, dtype=torch.bool), 32, 3, device
    )
    assert tuple(empty.shape) == (0, 3, 32, 32)


def test_no_deprecation_warning_leaks() -> None:
    data = _jpeg(_photo(16, 16, 3, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run([data], [(0, 0, 16, 16)], [False], 8, 3, CPU)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_sample_is_named_by_its_position(device) -> None:
    good = _jpeg(_photo(40, 40, 3, 0))
    sof = good.index(b"\xff\xc0")
    bad_samples = {
        "PNG": _png(40, 40),
        "garbage": bytes(range(256)),
        "cut before the frame header": good[:sof],
    }
    if device.type == "cpu":  # libjpeg (in torchvision) refuses a cut scan; nvjpeg may not
        bad_samples["cut in the scan"] = good[: len(good) // 2]
    box = (0, 0, 40, 40)
    for name, bad in bad_samples.items():
        datas = [good, good, bad, good]
        with pytest.raises(DeviceDecodeError, match="batch position 2") as err:
            _run(datas, [box] * 4, [False] * 4, 16, 3, device)
        assert err.value.position == 2 and isinstance(err.value, ValueError), name
        with pytest.raises(DeviceDecodeError, match="batch position 6") as err:  # 2nd chunk
            _run([good] * 4 + datas, [box] * 8, [False] * 8, 16, 3, device, chunk=3)
    with pytest.raises(DeviceDecodeError, match=r"batch position 1: box .* not inside 40x40"):
        _run([good, good], [box, (1, 0, 40, 40)], [False, False], 16, 3, device)
    with pytest.raises(ValueError, match="boxes of shape"):
        _run([good, good], [box], [False], 16, 3, device)
