"""JPEG decoding, random resized crop and flip of a whole batch on the training device.

The GPU path of `data.decode`: a loader worker reads only a JPEG's size (`jpeg_size`) and draws
the crop box and flip as the CPU path would (`crop_box_for`); the main process decodes the batch
on the device (torchvision's `decode_jpeg`, nvjpeg on CUDA) and crops, resizes and flips it in a
few batched kernels (`decode_crop_batch`, one `roi_align` per chunk of images). A sample it
cannot use raises `DeviceDecodeError` with its batch position, so the caller can decode that one
on the CPU instead.

How it resamples against PIL, its memory and its contract:
docs/streaming.md#where-images-are-decoded.
"""

from __future__ import annotations

import random
import warnings
from typing import TYPE_CHECKING

import torch

from .augment import crop_resize_batch, jpeg_frame, train_box

if TYPE_CHECKING:
    from torchvision.io import ImageReadMode

Buffer = bytes | bytearray | memoryview


class DeviceDecodeError(ValueError):
    """A sample of the batch that the device path cannot use; `position` is its batch index."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(f"batch position {position}: {reason}")
        self.position = position


def jpeg_size(data: Buffer) -> tuple[int, int] | None:
    """(height, width) from the JPEG's start-of-frame header (`augment.jpeg_frame`); None when
    `data` is not a JPEG, is cut before the frame header ends, or has a malformed segment or no
    frame (a height of 0, left to a DNL marker, counts too)."""
    frame = jpeg_frame(data)
    if frame is None or not frame.height or not frame.width:
        return None
    return frame.height, frame.width


def crop_box_for(
    height: int,
    width: int,
    rng: random.Random,
    *,
    augment: bool,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hflip: bool = True,
    translate: int = 0,
) -> tuple[tuple[int, int, int, int], bool]:
    """((top, left, h, w), flip) of an image of height x width: with `augment`, the box and
    flip `augment.train_transform` draws, taking the same numbers from `rng` in the same order;
    without, `augment.eval_transform`'s central square, unflipped, and no draw. A shift
    (`translate` > 0) is not done on the device: ValueError."""
    if translate:
        raise ValueError(f"translate={translate}: random shifts are a CPU-path feature")
    if not augment:
        side = min(height, width)
        return ((height - side) // 2, (width - side) // 2, side, side), False
    return train_box(height, width, rng, scale, ratio), hflip and rng.random() < 0.5


def decode_crop_batch(
    encoded: list[torch.Tensor],
    boxes: torch.Tensor,
    flips: torch.Tensor,
    size: int,
    channels: int,
    device: torch.device,
    *,
    chunk: int = 256,
) -> torch.Tensor:  # (B, channels, size, size) uint8 on `device`
    """Decode JPEGs (1-D uint8 CPU tensors) on `device`, resample each one's (top, left, h, w)
    box (int (B, 4), pixel coordinates of the decoded image) to size x size and mirror those
    whose `flips` (bool (B,)) is set; `chunk` images at a time. A sample that cannot be used
    raises DeviceDecodeError naming its position."""
    B = len(encoded)
    if channels not in (1, 3):
        raise ValueError(f"channels={channels}: 1 (gray) or 3 (RGB)")
    if tuple(boxes.shape) != (B, 4) or tuple(flips.shape) != (B,):
        raise ValueError(
            f"{B} images need boxes of shape ({B}, 4) and flips of shape ({B},); "
            f"got {tuple(boxes.shape)} and {tuple(flips.shape)}"
        )
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: must be positive")
    device = torch.device(device)
    out = torch.empty((B, channels, size, size), dtype=torch.uint8, device=device)
    box_list = boxes.tolist()
    for lo in range(0, B, chunk):
        hi = min(lo + chunk, B)
        images = _decode(encoded[lo:hi], channels, device, lo)
        out[lo:hi] = _crop_resize(images, box_list[lo:hi], size, lo)
    flip = flips.to(device=device, dtype=torch.bool).view(B, 1, 1, 1)
    return torch.where(flip, out.flip(-1), out)


def _decode(
    encoded: list[torch.Tensor], channels: int, device: torch.device, first: int
) -> list[torch.Tensor]:  # [(C, H, W) uint8 on device]
    """The images of `encoded` (batch positions first, first + 1, ...), decoded in one call."""
    for j, t in enumerate(encoded):
        if t.dtype != torch.uint8 or t.ndim != 1 or t.device.type != "cpu":
            raise DeviceDecodeError(first + j, "encoded bytes must be a 1-D uint8 CPU tensor")
        if jpeg_size(memoryview(t.contiguous().numpy())) is None:
            raise DeviceDecodeError(first + j, "not a JPEG with a readable frame header")
    # here, not at the top: loader workers import this module for jpeg_size and crop_box_for,
    # and torchvision's package import pulls in torch._dynamo (seconds of CPU per process)
    from torchvision.io import ImageReadMode

    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    try:
        return _decode_jpeg(encoded, mode, device)
    except RuntimeError as batch_error:
        # One bad image fails the whole call: find it, or decode them one by one if none is.
        images = []
        for j, t in enumerate(encoded):
            try:
                images += _decode_jpeg([t], mode, device)
            except RuntimeError as e:
                raise DeviceDecodeError(first + j, f"undecodable JPEG ({e})") from batch_error
        return images


def _decode_jpeg(
    encoded: list[torch.Tensor], mode: ImageReadMode, device: torch.device
) -> list[torch.Tensor]:
    from torchvision.io import decode_jpeg

    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its image codecs (for TorchCodec) and warns on every call.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision")
        return decode_jpeg(encoded, mode=mode, device=device)


def _crop_resize(
    images: list[torch.Tensor], boxes: list[list[int]], size: int, first: int
) -> torch.Tensor:  # (n, C, size, size) uint8
    """Each image's (top, left, h, w) box resampled to size x size (augment.crop_resize_batch),
    once every box is known to lie inside its image (the boxes come from JPEG headers)."""
    for j, (img, (top, left, h, w)) in enumerate(zip(images, boxes, strict=True)):
        H, W = img.shape[1:]
        if not (top >= 0 and left >= 0 and h >= 1 and w >= 1 and top + h <= H and left + w <= W):
            raise DeviceDecodeError(
                first + j, f"box (top, left, h, w)={(top, left, h, w)} is not inside {H}x{W}"
            )
    return crop_resize_batch(images, boxes, size)
