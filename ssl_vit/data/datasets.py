"""The IterableDatasets behind the loaders of `ssl_vit.data.stream` (which documents the
sharding, shuffling, resume and bad-data rules they implement): `TrainStream` for training
batches, `EvalStream` for evaluation in manifest order."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field
from itertools import count
from typing import Any, Literal

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from .augment import (
    CorruptSample,
    LabelOutOfRange,
    decode_sample,
    eval_transform,
    mix_seed,
    sample_image,
    sample_label,
    to_batch,
    train_transform,
)
from .device_decode import crop_box_for, jpeg_size
from .manifest import SampleLayout
from .shards import ReadCounter, ShardReadError, ShardRef, read_shard, report_skip
from .stream_plan import Exclusions, Piece, exact_pieces, resampled_pieces, stream_quota
from .urls import Retry


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class EpochPosition:
    """(epoch, batches of it already trained on) in shared memory: the main process sets it,
    persistent loader workers read it when each epoch starts."""

    def __init__(self, ctx: Any, epoch: int = 0, skip_batches: int = 0) -> None:
        self._value = ctx.Array("q", [epoch, skip_batches])

    def get(self) -> tuple[int, int]:
        with self._value.get_lock():
            return int(self._value[0]), int(self._value[1])

    def set(self, epoch: int, skip_batches: int) -> None:
        with self._value.get_lock():
            self._value[0], self._value[1] = epoch, skip_batches


# Seconds a loader may go without a batch (its workers' start included) before it stops: far
# above any honest batch time, short of a job that waits all night (data.stall_timeout).
STALL_TIMEOUT = 600.0


@dataclass(frozen=True, eq=False)
class LoaderSpec:
    """How a training loader reads its split: one frozen record from the config (or a caller's
    keywords) down to the streams, defaults declared here once. Which set and split, which rank
    and device are the loader's arguments; everything about reading them is this."""

    global_batch: int  # images per optimizer step over all ranks
    num_workers: int = 4  # loader worker processes (0: in the main process)
    img_size: int = 224
    seed: int = 0  # shuffles and augmentations are functions of (seed, epoch, stream, position)
    augment: bool = True  # random resized crop + flip (paper, B.1.2); False: a centre resize
    scale: tuple[float, float] = (0.08, 1.0)  # the crop's share of the image area
    hflip: bool = True
    translate: int = 0  # random shift of up to this many pixels per axis (0: none)
    missing: Literal["error", "skip"] = "error"  # a shard that cannot be read: stop, or count
    holdout_fraction: float = 0.0  # the hashed share held out to choose on (never trained on)
    train_fraction: float = 1.0  # train on this hashed share of the rest
    subset: np.ndarray | None = None  # sorted manifest indices: train on these only
    shuffle_buffer: int = 2000
    shuffle_initial: int = 500
    pin_memory: bool | None = None  # None: where CUDA is
    prefetch_factor: int = 2
    timeout: float = STALL_TIMEOUT  # seconds without a batch before the loader stops
    multiprocessing_context: str | None = None
    in_memory: bool = False  # the split decoded once into RAM (ssl_vit.data.memory)
    resampled: bool = False  # shards drawn with replacement (ssl_vit.data.stream_plan)
    retry: Retry = field(default_factory=Retry)  # how remote reads are retried
    verify: Literal["read", "all"] = "read"  # which bytes read are checked (ssl_vit.data.blocks)
    decode: Literal["cpu", "gpu"] = "cpu"  # gpu: JPEGs decoded on the loader's device


@dataclass(eq=False)
class TrainStream(IterableDataset):
    """One epoch of fixed-size batches for one rank; see the module docstring."""

    shards: list[ShardRef]
    spec: LoaderSpec
    _: KW_ONLY
    channels: int
    labelled: bool
    num_classes: int | None  # the manifest's; a label outside it stops the run
    layout: SampleLayout  # the fields of a sample its image and label are in
    rank: int
    world_size: int
    workers: int  # loader worker processes (at least 1)
    batch: int  # per-rank batch
    steps: int  # batches per epoch and rank
    position: EpochPosition  # (epoch, skip_batches), shared with persistent workers
    counter: ReadCounter
    exclusions: Exclusions  # held-out manifest indices, never yielded

    @property
    def device_decode(self) -> bool:
        """JPEGs leave as bytes + crop box + flip for the main process to decode on the GPU
        (ssl_vit.data.device_decode); other images are decoded in the workers as always."""
        return self.spec.decode == "gpu"

    def quotas(self) -> list[int]:
        """Samples per stream this epoch, streams in order (rank-major)."""
        W = self.workers
        per_rank = [stream_quota(self.steps, self.batch, W, role) for role in range(W)]
        return per_rank * self.world_size

    def plan(self, epoch: int) -> list[list[Piece]]:
        """Every stream's pieces of an epoch (exact epochs; ssl_vit.data.stream_plan)."""
        quotas = self.quotas()
        return exact_pieces(self.shards, quotas, self.exclusions, seed=self.spec.seed, epoch=epoch)

    def _raw(self, stream: int, epoch: int) -> Iterator[dict]:
        """The stream's samples, buffer-shuffled. After data was lost (a broken shard), the
        stream's pieces are read again, reshuffled, so its quota still fills."""
        keep = (lambda i: i not in self.exclusions.set) if self.exclusions.sorted else None
        if self.spec.resampled:
            pieces: Iterator[Piece] | list[Piece] = resampled_pieces(
                self.shards, seed=self.spec.seed, epoch=epoch, stream=stream
            )
        else:
            pieces = self.plan(epoch)[stream]
        for p in count():
            order = pieces
            if p > 0:
                order = list(pieces)
                random.Random(mix_seed(self.spec.seed, epoch, stream, p)).shuffle(order)
            rng = random.Random(mix_seed(self.spec.seed, epoch, stream, -1 - p))
            shuffle = wds.shuffle(self.spec.shuffle_buffer, self.spec.shuffle_initial, rng=rng)
            samples = (
                s
                for piece in order
                for s in read_shard(
                    piece.ref,
                    self.counter,
                    start=piece.start,
                    stop=piece.stop,
                    keep=keep,
                    retry=self.spec.retry,
                    missing=self.spec.missing,  # type: ignore[arg-type]
                )
            )
            n = 0
            for sample in shuffle(samples):
                n += 1
                yield sample
            if n == 0:  # would loop forever otherwise
                raise RuntimeError(
                    f"no readable sample in the pieces of stream {stream}; check the shard set"
                )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        w, W = _worker()
        if W != self.workers:
            raise RuntimeError(f"built for {self.workers} workers, run with {W}")
        # Read once: a persistent worker may still be making this epoch's last batches when the
        # main process moves the shared position on.
        epoch, skip_batches = self.position.get()
        role = (skip_batches + w) % W  # the worker this one stands for; see module doc
        stream = self.rank * W + role
        n_total = (self.steps - role + W - 1) // W
        n_skip = max(0, (skip_batches - role + W - 1) // W)
        src = self._raw(stream, epoch)
        pos = 0
        for _ in range(n_skip * self.batch):  # skip before decoding
            next(src)
            pos += 1
        for _ in range(n_total - n_skip):
            imgs: list = []  # uint8 arrays, or (JPEG bytes, box, flip) for the device
            labels: list[int] = []
            for _chunk in range(100):
                # One generator per chunk, seeded by its first position: a resume that skips
                # whole batches meets the same seeds; one per sample would cost more.
                aug_rng = random.Random(mix_seed(self.spec.seed, epoch, stream, pos))
                for _ in range(self.batch):
                    sample = next(src)
                    pos += 1
                    try:
                        img, label = self._prepare(sample, aug_rng)
                    except LabelOutOfRange as e:
                        raise ShardReadError(f"{sample.get('__url__')}: {e}") from None
                    except CorruptSample as e:
                        self.counter.add(samples=1)
                        report_skip(f"{sample.get('__url__')}: {e}")
                        continue
                    imgs.append(img)
                    labels.append(label)
                if imgs:
                    break
            else:
                raise RuntimeError(f"stream {stream}: 100 batches in a row were all corrupt")
            for i in range(self.batch - len(imgs)):  # fill corrupt places from the same batch
                imgs.append(imgs[i])
                labels.append(labels[i])
            targets = torch.tensor(labels, dtype=torch.int64)
            yield (
                (to_batch(imgs), targets) if not self.device_decode else self._split(imgs, targets)
            )

    def _prepare(self, sample: dict, rng: random.Random) -> tuple[Any, int]:
        """(augmented uint8 pixels, or (JPEG bytes, box, flip) for the device; label)."""
        if self.device_decode:
            data = sample_image(sample, self.layout)
            size = jpeg_size(data)
            if size is not None:
                label = sample_label(
                    sample,
                    labelled=self.labelled,
                    num_classes=self.num_classes,
                    layout=self.layout,
                )
                box, flip = crop_box_for(
                    *size,
                    rng,
                    augment=self.spec.augment,
                    scale=self.spec.scale,
                    hflip=self.spec.hflip,
                )
                return (data, box, flip), label
        img, label = decode_sample(
            sample,
            channels=self.channels,
            labelled=self.labelled,
            num_classes=self.num_classes,
            layout=self.layout,
        )
        return self._transform(img, rng), label

    def _split(self, entries: list, labels: torch.Tensor) -> tuple:
        """A device batch: (the J JPEGs' bytes end to end (N,) uint8, their lengths (J,), boxes
        (J, 4), flips (J,), batch positions (J,), the other images decoded here (B - J, C, S, S)
        uint8, labels (B,)). One tensor for all the bytes: each tensor a worker sends travels
        as a shared-memory file descriptor of its own, and hundreds per batch exhaust the
        process's limit of open files."""
        jpeg = [i for i, e in enumerate(entries) if isinstance(e, tuple)]
        pixels = [e for e in entries if not isinstance(e, tuple)]
        S = self.spec.img_size
        blob = b"".join(entries[i][0] for i in jpeg)
        return (
            torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0),
            torch.tensor([len(entries[i][0]) for i in jpeg], dtype=torch.int64),
            torch.tensor([entries[i][1] for i in jpeg], dtype=torch.int64).view(-1, 4),
            torch.tensor([entries[i][2] for i in jpeg], dtype=torch.bool),
            torch.tensor(jpeg, dtype=torch.int64),
            to_batch(pixels)
            if pixels
            else torch.empty((0, self.channels, S, S), dtype=torch.uint8),
            labels,
        )

    def _transform(self, img: np.ndarray, rng: random.Random) -> np.ndarray:
        if not self.spec.augment:
            return eval_transform(img, self.spec.img_size)
        return train_transform(
            img,
            rng,
            self.spec.img_size,
            scale=self.spec.scale,
            hflip=self.spec.hflip,
            translate=self.spec.translate,
        )


@dataclass(eq=False)
class EvalStream(IterableDataset):
    """One rank's contiguous part of a split, in manifest order; see the module docstring."""

    shards: list[ShardRef]
    _: KW_ONLY
    channels: int
    labelled: bool
    num_classes: int | None  # the manifest's; a label outside it stops the run
    layout: SampleLayout  # the fields of a sample its image and label are in
    lo: int  # this rank's positions lo..hi-1 (of the split, or of `subset`)
    hi: int
    batch: int
    img_size: int | None  # centre-resized to img_size x img_size; None: kept as decoded
    with_keys: bool
    counter: ReadCounter
    subset: np.ndarray | None  # sorted manifest indices (the held-out samples), or None
    with_indices: bool = False  # the samples' manifest indices as a last item (int64 tensor)
    retry: Retry = field(default_factory=Retry)
    missing: str = "error"

    def _batch_samples(self, b: int) -> Iterator[dict]:
        """The raw samples of batch b of this rank's part, in order; only its shards' pieces
        are read (a worker skips the other workers' batches through the offset index)."""
        lo, bs = self.lo, self.batch
        p0, p1 = lo + b * bs, min(self.hi, lo + (b + 1) * bs)  # positions p0..p1-1
        keep = None
        if self.subset is None:  # positions are manifest indices
            first, last = p0, p1 - 1
        else:  # positions index the sorted subset (the held-out samples)
            members = frozenset(int(i) for i in self.subset[p0:p1])
            first, last = int(self.subset[p0]), int(self.subset[p1 - 1])
            keep = members.__contains__
        for ref in self.shards:
            if ref.offset > last or ref.offset + ref.num_samples <= first:
                continue
            start = max(0, first - ref.offset)
            stop = min(ref.num_samples, last + 1 - ref.offset)
            yield from read_shard(
                ref,
                self.counter,
                start=start,
                stop=stop,
                keep=keep,
                retry=self.retry,
                missing=self.missing,  # type: ignore[arg-type]
            )

    def __iter__(self) -> Iterator[tuple]:
        w, W = _worker()
        num_batches = (self.hi - self.lo + self.batch - 1) // self.batch
        for b in range(w, num_batches, W):  # worker w makes batches w, w + W, ... (torch's order)
            imgs, labels, keys, indices = [], [], [], []
            for sample in self._batch_samples(b):
                try:
                    img, label = decode_sample(
                        sample,
                        channels=self.channels,
                        labelled=self.labelled,
                        num_classes=self.num_classes,
                        layout=self.layout,
                    )
                    if self.img_size is not None:
                        img = eval_transform(img, self.img_size)
                    imgs.append(img)
                    labels.append(label)
                    keys.append(sample["__key__"])
                    indices.append(sample["__index__"])
                except LabelOutOfRange as e:
                    raise ShardReadError(f"{sample.get('__url__')}: {e}") from None
                except CorruptSample as e:
                    self.counter.add(samples=1)
                    report_skip(f"{sample.get('__url__')}: {e}")
            # An empty batch is still sent (and dropped by the loader) to keep worker order.
            side = self.img_size or 0  # an empty batch's shape (dropped by the loader anyway)
            images = (
                to_batch(imgs)
                if imgs
                else torch.empty((0, self.channels, side, side), dtype=torch.uint8)
            )
            out: tuple = (images, torch.tensor(labels, dtype=torch.int64))
            if self.with_keys:
                out = (*out, keys)
            if self.with_indices:
                out = (*out, torch.tensor(indices, dtype=torch.int64))
            yield out
