"""Training batches from a split decoded once into RAM (`data.in_memory`), for splits that fit.

`resolve_in_memory` decides (`auto`: images of one size, at most MEMORY_BUDGET decoded bytes per
rank); ssl_vit.data.stream's `load_training_samples` decodes the split's training samples into
one uint8 tensor with the streaming eval reader; `MemoryTrainLoader` batches it by an index
gather and the streaming loader's crop, shift and flip, drawn for the whole global batch and
applied to the batch at once, on the host or (`device`) on the GPU. It keeps the streaming
TrainLoader's contract (docs/streaming.md#the-loaders-contract): the same steps per epoch on
every rank, no held-out sample, and `set_epoch(e, k)` yields exactly batches k.. of epoch e.

Why, and how its batches compare with streamed ones: docs/training.md#small-datasets-in-ram.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .augment import crop_params, crop_resize_batch, mix_seed, shift_params
from .manifest import Manifest
from .shards import LoaderCounts, ReadCounter

MEMORY_BUDGET = 2 << 30  # bytes of decoded images per rank that `auto` holds in RAM


def resolve_in_memory(setting: Any, manifest: Manifest, split: str) -> tuple[bool, str]:
    """(hold the split in RAM?, why) for `data.in_memory` = true, false or auto."""
    # bytes of the split decoded to uint8, or None when its images differ in size
    h, w = manifest.image_size or (0, 0)
    size = manifest.split(split).num_samples * manifest.channels * h * w if h else None
    if setting is False:
        return False, "data.in_memory=false"
    if size is None:
        if setting is True:
            raise ValueError(
                f"{manifest.root}: data.in_memory=true needs images of one size (the manifest's "
                "image_size is null); set data.in_memory=false or auto"
            )
        return False, "images differ in size"
    mb = f"{size / 2**20:.0f} MB decoded"
    if setting is True:
        return True, f"data.in_memory=true, {mb}"
    if size > MEMORY_BUDGET:
        return False, f"{mb}, above the {MEMORY_BUDGET >> 20} MB budget"
    return True, f"auto: {mb}"


class MemoryTrainLoader(LoaderCounts):
    """`len(self)` batches of one epoch from RAM; `set_epoch` moves on (the module doc)."""

    def __init__(
        self,
        images: torch.Tensor,  # (N, C, H, W) uint8, training samples only
        labels: torch.Tensor,  # (N,) int64
        *,
        manifest: Manifest,
        split: str,
        global_batch: int,
        rank: int,
        world_size: int,
        img_size: int,
        seed: int,
        augment: bool,
        scale: tuple[float, float],
        hflip: bool,
        counter: ReadCounter,
        translate: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        if device is not None:  # the split on the GPU: 45 MB for Fashion-MNIST
            images, labels = images.to(device), labels.to(device)
        self.images, self.labels, self.manifest, self.split = images, labels, manifest, split
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        self.batch_size = global_batch // world_size
        self.img_size, self.seed, self.augment = img_size, seed, augment
        self.scale, self.hflip, self.counter = tuple(scale), hflip, counter
        self.translate = translate
        self.steps_per_epoch = len(images) // global_batch
        self.epoch = self.skip_batches = 0

    num_samples = property(lambda self: len(self.images))

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        if not 0 <= skip_batches <= self.steps_per_epoch:
            raise ValueError(f"skip_batches={skip_batches} outside [0, {self.steps_per_epoch}]")
        self.epoch, self.skip_batches = epoch, skip_batches

    def __len__(self) -> int:
        return self.steps_per_epoch - self.skip_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch, 0x3E3) >> 1)
        order = torch.randperm(len(self.images), generator=gen)
        G, B = self.global_batch, self.batch_size
        for step in range(self.skip_batches, self.steps_per_epoch):
            mine = order[step * G + self.rank * B : step * G + (self.rank + 1) * B]
            mine = mine.to(self.images.device)
            images = self.images[mine]  # (B, C, H, W) uint8
            if self.augment:
                images = self._augment(images, step)
            elif images.shape[-1] != self.img_size or images.shape[-2] != self.img_size:
                images = _centre_resize(images, self.img_size)
            yield images, self.labels[mine]

    def _augment(self, images: torch.Tensor, step: int) -> torch.Tensor:
        """The streaming loader's crop, shift and flip distribution, drawn for the whole global
        batch from (seed, epoch, step) so that each rank's slice is the same whatever the rank
        count."""
        rng = random.Random(mix_seed(self.seed, self.epoch, step, 0xA06))
        h, w = images.shape[-2:]
        size, lo = self.img_size, self.rank * self.batch_size
        whole = self.scale[0] >= 1.0 and 3 / 4 <= w / h <= 4 / 3
        boxes = [
            (0, 0, h, w) if whole else crop_params(h, w, rng, self.scale)
            for _ in range(self.global_batch)
        ][lo : lo + self.batch_size]
        flips = [self.hflip and rng.random() < 0.5 for _ in range(self.global_batch)]
        if whole:
            if (h, w) != (size, size):
                images = _centre_resize(images, size, square=False)
        else:
            images = crop_resize_batch(images, boxes, size)
        if self.translate:  # drawn after the flips: without it, the draws are what they were
            shifts = [shift_params(rng, self.translate) for _ in range(self.global_batch)]
            images = shift_batch(images, shifts[lo : lo + self.batch_size], self.translate)
        flip = torch.tensor(flips[lo : lo + self.batch_size], device=images.device)
        return torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)


def shift_batch(images: torch.Tensor, shifts: list[tuple[int, int]], pad: int) -> torch.Tensor:
    """ssl_vit.data.augment.shift_image for a batch on any device: image b moved down by
    shifts[b][0] and right by shifts[b][1] pixels (each at most `pad`), the border zero."""
    B, C, H, W = images.shape
    d = torch.tensor(shifts, dtype=torch.long, device=images.device).view(B, 2)
    padded = F.pad(images, (pad, pad, pad, pad))  # (B, C, H + 2 pad, W + 2 pad), zeros
    ar = lambda n: torch.arange(n, device=images.device)  # noqa: E731
    rows = ar(H) + pad - d[:, :1]  # (B, H): output row y reads padded row y + pad - dy
    cols = ar(W) + pad - d[:, 1:]  # (B, W)
    out = padded[ar(B)[:, None, None], :, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)
    return out.permute(0, 3, 1, 2).contiguous()


def _centre_resize(images: torch.Tensor, size: int, square: bool = True) -> torch.Tensor:
    """The central square (or, with square=False, the whole image) resized to size x size."""
    h, w = images.shape[-2:]
    side = min(h, w)
    box = ((h - side) // 2, (w - side) // 2, side, side) if square else (0, 0, h, w)
    return crop_resize_batch(images, [box] * len(images), size)
