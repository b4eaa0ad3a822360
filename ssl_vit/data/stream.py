"""Streaming input from a shard set: which samples each loader stream reads, the datasets that
read, decode, augment and batch them, and the loaders around them.

    loader = make_train_loader(root, "train", global_batch=4096, rank=r, world_size=ws,
                               num_workers=8, img_size=224, seed=0, epoch=0, skip_batches=0)
    for images, labels in loader:      # images uint8 (B, C, H, W), labels int64 (B,)
        ...                            # B = global_batch // world_size; len(loader) batches
    loader.set_epoch(epoch + 1)        # next epoch (skip_batches back to 0)
    for images, labels in make_eval_loader(root, "test", batch_size=256, img_size=224):
        ...                            # every sample once, in manifest order (rank's part)

webdataset gives pipe: URLs and the shuffle buffer; the plan, the exact mid-epoch resume and
the rest are ours. The plan, the contract and why: docs/streaming.md.
"""

from __future__ import annotations

import bisect
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .augment import (
    CorruptSample,
    LabelOutOfRange,
    crop_resize,
    decode_sample,
    decode_with_pil,
    eval_transform,
    mix_seed,
    sample_image,
    sample_label,
    to_batch,
    train_transform,
)
from .device_decode import DeviceDecodeError, crop_box_for, decode_crop_batch, jpeg_size
from .holdout import excluded_indices, held_out_indices
from .manifest import Manifest, SampleLayout, load_manifest
from .memory import MemoryTrainLoader, resolve_in_memory
from .shards import (
    LoaderCounts,
    ReadCounter,
    ShardReadError,
    ShardRef,
    entry,
    read_shard,
    report_skip,
    select_shards,
)
from .urls import Retry, is_pipe, local_path, ranged
from .workers import IN_PROCESS_SAMPLES, worker_context

log = logging.getLogger("ssl_vit.data")


# --- The plan: which pieces of which shards each stream reads -----------------------------------

# A stream is one DataLoader worker of one rank, numbered rank * workers + role; its quota
# (`stream_quota`) is its batch size times the batches it makes. Exact epochs
# (data.resampled=false): `exact_pieces` lays the epoch's shuffled shards (`epoch_order`) end to
# end and gives each stream the next run of its quota of training samples, so every sample is
# read by exactly one stream. Resampled epochs: `resampled_pieces` draws whole shards with
# replacement per stream. `read_factor` says how many times a plan reads the shard set; the
# preflight refuses a plan above MAX_READ_FACTOR. Why: docs/streaming.md (which samples each
# stream reads).

MAX_READ_FACTOR = 1.05  # reads of the shard set per epoch the preflight accepts


@dataclass(frozen=True)
class Piece:
    """Samples start..stop-1 (positions within the shard) of shard `ref`."""

    ref: ShardRef
    start: int
    stop: int


def stream_quota(steps: int, batch: int, workers: int, role: int) -> int:
    """Samples that worker `role` of a rank delivers in an epoch of `steps` batches."""
    return batch * ((steps - role + workers - 1) // workers)


class Exclusions:
    """Manifest indices no stream yields (the held-out part, the unused share of labels)."""

    def __init__(self, excluded: Sequence[int]) -> None:
        self.sorted = tuple(sorted(excluded))
        self.set = frozenset(self.sorted)

    def in_shard(self, ref: ShardRef) -> int:
        ex = self.sorted
        hi = bisect.bisect_left(ex, ref.offset + ref.num_samples)
        return hi - bisect.bisect_left(ex, ref.offset)

    def kept(self, ref: ShardRef) -> int:
        return ref.num_samples - self.in_shard(ref)

    def position(self, ref: ShardRef, k: int) -> int:
        """Position in the shard of its k-th kept sample (0-based)."""
        ex = self.sorted
        lo, hi = k, k + self.in_shard(ref)  # the answer p has k kept samples before it
        while lo < hi:  # smallest p with kept(0..p) == k + 1
            mid = (lo + hi) // 2
            excluded = bisect.bisect_right(ex, ref.offset + mid) - bisect.bisect_left(
                ex, ref.offset
            )
            if mid + 1 - excluded >= k + 1:
                hi = mid
            else:
                lo = mid + 1
        return lo


def epoch_order(shards: Sequence[ShardRef], seed: int, epoch: int) -> list[ShardRef]:
    order = list(shards)
    random.Random(mix_seed(seed, epoch, 0x5EED)).shuffle(order)
    return order


def exact_pieces(
    shards: Sequence[ShardRef],
    quotas: Sequence[int],
    exclusions: Exclusions,
    *,
    seed: int,
    epoch: int,
) -> list[list[Piece]]:
    """Each stream's pieces: consecutive runs of the epoch's shard order (module doc)."""
    order = epoch_order(shards, seed, epoch)
    plans: list[list[Piece]] = []
    i, used = 0, 0  # the shard being dealt, and its kept samples already given out
    for quota in quotas:
        pieces: list[Piece] = []
        while quota > 0:
            ref = order[i]
            take = min(quota, exclusions.kept(ref) - used)
            if take > 0:
                start = exclusions.position(ref, used)
                stop = exclusions.position(ref, used + take - 1) + 1
                pieces.append(Piece(ref, start, stop))
                used, quota = used + take, quota - take
            if quota > 0:
                i, used = i + 1, 0
        plans.append(pieces)
    return plans


def resampled_pieces(
    shards: Sequence[ShardRef], *, seed: int, epoch: int, stream: int
) -> Iterator[Piece]:
    """Whole shards drawn with replacement, for ever (the stream stops at its quota)."""
    rng = random.Random(mix_seed(seed, epoch, stream, 0x2E5A))
    while True:
        ref = shards[rng.randrange(len(shards))]
        yield Piece(ref, 0, ref.num_samples)


def read_start(piece: Piece, assume_ranged: bool = False) -> int:
    """The position a reader of `piece` starts reading bytes at: its start for a local file, the
    indexed sample at or before it where a remote source can seek, else 0 (docs/streaming.md,
    the read factor); `assume_ranged`: as if every web server answered Range requests."""
    if local_path(piece.ref.url) is not None:
        return piece.start
    can_seek = ranged(piece.ref.url) or assume_ranged and not is_pipe(piece.ref.url)
    return entry(piece.ref, piece.start)[0] if can_seek else 0  # where read_shard enters


def read_factor(
    shards: Sequence[ShardRef], plans: Sequence[Sequence[Piece]], assume_ranged: bool = False
) -> float:
    """Samples read (delivered or read to be dropped) over the samples of the set."""
    total = sum(r.num_samples for r in shards)
    read = sum(p.stop - read_start(p, assume_ranged) for pieces in plans for p in pieces)
    return read / max(1, total)


# --- The datasets: what a loader worker runs -------------------------------------------------


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
    resampled: bool = False  # shards drawn with replacement (the plan above)
    retry: Retry = field(default_factory=Retry)  # how remote reads are retried
    verify: Literal["read", "all"] = "read"  # bytes checked: data/tar_reader.py, BlockReader
    decode: Literal["cpu", "gpu"] = "cpu"  # gpu: JPEGs decoded on the loader's device


@dataclass(eq=False, kw_only=True)
class _Reader(IterableDataset):
    """What both datasets share: the shards they read, how a sample decodes (the manifest's
    channels, classes and fields), and the counters a corrupt sample goes to."""

    shards: list[ShardRef]
    channels: int
    labelled: bool
    num_classes: int | None  # the manifest's; a label outside it stops the run
    layout: SampleLayout  # the fields of a sample its image and label are in
    counter: ReadCounter

    @classmethod
    def of(cls, manifest: Manifest, shards: list[ShardRef], **fields: Any) -> Any:
        """A reader of `shards` that decodes as `manifest` says; `fields`: its own fields."""
        labelled = manifest.class_names is not None
        return cls(shards=shards, channels=manifest.channels, labelled=labelled,
                   num_classes=manifest.num_classes, layout=manifest.layout, **fields)  # fmt: skip

    def _decode(self, sample: dict) -> tuple[np.ndarray, int]:
        return decode_sample(
            sample,
            channels=self.channels,
            labelled=self.labelled,
            num_classes=self.num_classes,
            layout=self.layout,
        )

    def _guarded(self, prepare: Callable[..., Any], sample: dict, *args: Any) -> Any:
        """prepare(sample, *args), or None for a corrupt sample (counted and logged); a label
        that is not one of the manifest's classes stops the run."""
        try:
            return prepare(sample, *args)
        except LabelOutOfRange as e:
            raise ShardReadError(f"{sample.get('__url__')}: {e}") from None
        except CorruptSample as e:
            self.counter.add(samples=1)
            report_skip(f"{sample.get('__url__')}: {e}")
            return None


@dataclass(eq=False, kw_only=True)
class TrainStream(_Reader):
    """One epoch of fixed-size batches for one rank; see the module docstring."""

    spec: LoaderSpec
    rank: int
    world_size: int
    workers: int  # loader worker processes (at least 1)
    batch: int  # per-rank batch
    steps: int  # batches per epoch and rank
    position: EpochPosition  # (epoch, skip_batches), shared with persistent workers
    exclusions: Exclusions  # held-out manifest indices, never yielded

    @property
    def device_decode(self) -> bool:
        """JPEGs leave as bytes + crop box + flip for the main process to decode on the GPU
        (ssl_vit.data.device_decode); other images are decoded in the workers as always."""
        return self.spec.decode == "gpu"

    def plan(self, epoch: int) -> list[list[Piece]]:
        """Every stream's pieces of an epoch (exact epochs), streams in order (rank-major)."""
        W = self.workers
        quotas = [stream_quota(self.steps, self.batch, W, r) for r in range(W)] * self.world_size
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
        pos = n_skip * self.batch
        for _ in range(pos):  # skip before decoding
            next(src)
        for _ in range(n_total - n_skip):
            imgs: list = []  # uint8 arrays, or (JPEG bytes, box, flip) for the device
            labels: list[int] = []
            for _chunk in range(100):
                # One generator per chunk, seeded by its first position: a resume that skips
                # whole batches meets the same seeds; one per sample would cost more.
                aug_rng = random.Random(mix_seed(self.spec.seed, epoch, stream, pos))
                for _ in range(self.batch):
                    pos += 1
                    got = self._guarded(self._prepare, next(src), aug_rng)
                    if got is not None:
                        imgs.append(got[0])
                        labels.append(got[1])
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
        s = self.spec
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
                    *size, rng, augment=s.augment, scale=s.scale, hflip=s.hflip
                )
                return (data, box, flip), label
        img, label = self._decode(sample)
        if not s.augment:
            return eval_transform(img, s.img_size), label
        out = train_transform(
            img, rng, s.img_size, scale=s.scale, hflip=s.hflip, translate=s.translate
        )
        return out, label

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


@dataclass(eq=False, kw_only=True)
class EvalStream(_Reader):
    """One rank's contiguous part of a split, in manifest order; see the module docstring."""

    lo: int  # this rank's positions lo..hi-1 (of the split, or of `subset`)
    hi: int
    batch: int
    img_size: int | None  # centre-resized to img_size x img_size; None: kept as decoded
    with_keys: bool
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
                got = self._guarded(self._decode, sample)
                if got is None:
                    continue
                img, label = got
                imgs.append(img if self.img_size is None else eval_transform(img, self.img_size))
                labels.append(label)
                keys.append(sample["__key__"])
                indices.append(sample["__index__"])
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


# --- The loaders ---------------------------------------------------------------------------------


class ShardLoader(LoaderCounts):
    """Iterates a stream through a torch DataLoader; batches are assembled in the workers,
    which persist across epochs (one DataLoader for the loader's life)."""

    def __init__(
        self,
        dataset: IterableDataset,
        *,
        manifest: Manifest,
        split: str,
        num_workers: int,
        pin_memory: bool | None,  # None: where CUDA is
        prefetch_factor: int,
        timeout: float,
        ctx: Any,
        persistent: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        self.dataset, self.manifest, self.split, self.device = dataset, manifest, split, device
        self.timeout, workers = timeout, num_workers > 0
        self._loader = DataLoader(
            dataset,
            batch_size=None,  # the workers batch
            num_workers=num_workers,
            pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
            prefetch_factor=prefetch_factor if workers else None,
            timeout=timeout if workers else 0,
            multiprocessing_context=ctx if workers else None,
            persistent_workers=workers and persistent,
        )

    @property
    def counter(self) -> ReadCounter:
        return self.dataset.counter

    def _batches(self) -> Iterator[tuple]:
        """The DataLoader's batches; a stall past `timeout` becomes one line naming what the
        workers were reading (torch's own error names none)."""
        it = iter(self._loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except RuntimeError as e:
                if "timed out" not in str(e):
                    raise
                raise ShardReadError(
                    f"no batch from the data loader in {self.timeout:g} s "
                    f"(data.stall_timeout); its workers last opened "
                    f"{self.counter.reading() or 'nothing'}; check that source, or raise "
                    "data.stall_timeout"
                ) from None
            yield batch

    def __iter__(self) -> Iterator[tuple]:
        for batch in self._batches():
            if batch[0].shape[0] > 0:
                yield batch


class TrainLoader(ShardLoader):
    """`len(self)` batches of one epoch; `set_epoch` moves on. See make_train_loader."""

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset.steps

    @property
    def batch_size(self) -> int:
        return self.dataset.batch

    @property
    def num_samples(self) -> int:
        """Training samples of the split (held-out ones not counted)."""
        return sum(r.num_samples for r in self.dataset.shards) - len(self.dataset.exclusions.sorted)

    @property
    def epoch(self) -> int:
        return self.dataset.position.get()[0]

    @property
    def skip_batches(self) -> int:
        return self.dataset.position.get()[1]

    @property
    def read_factor(self) -> float:
        """How many times this epoch's plan reads the shard set (the plan above)."""
        if self.dataset.spec.resampled:
            return 1.0
        return read_factor(self.dataset.shards, self.dataset.plan(self.epoch))

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        if not 0 <= skip_batches <= self.steps_per_epoch:
            raise ValueError(f"skip_batches={skip_batches} outside [0, {self.steps_per_epoch}]")
        self.dataset.position.set(epoch, skip_batches)

    def __len__(self) -> int:
        return self.steps_per_epoch - self.skip_batches

    def __iter__(self) -> Iterator[tuple]:
        if not self.dataset.device_decode:
            yield from super().__iter__()
            return
        for batch in self._batches():
            yield self._on_device(*batch)

    def _on_device(self, blob, lengths, boxes, flips, where, pixels, labels) -> tuple:
        """(images (B, C, S, S) uint8 on the device, labels): the workers' JPEGs decoded,
        cropped and flipped there (ssl_vit.data.device_decode), beside the images they decoded."""
        d = self.dataset
        encoded = list(torch.split(blob, lengths.tolist())) if len(lengths) else []
        device = self.device
        images = torch.empty(
            (len(labels), d.channels, d.spec.img_size, d.spec.img_size),
            dtype=torch.uint8,
            device=device,
        )
        other = torch.ones(len(labels), dtype=torch.bool)
        other[where] = False
        images[other.to(device)] = pixels.to(device, non_blocking=True)
        todo, lost = list(range(len(encoded))), []
        while todo:  # a JPEG that will not decode there is decoded here, or is lost
            try:
                out = decode_crop_batch(
                    [encoded[i] for i in todo],
                    boxes[todo],
                    flips[todo],
                    d.spec.img_size,
                    d.channels,
                    device,
                )
                images[where[todo].to(device)] = out
                break
            except DeviceDecodeError as e:
                bad = todo.pop(e.position)
                img = self._on_cpu(encoded[bad], boxes[bad], flips[bad])
                if img is None:
                    lost.append(int(where[bad]))
                else:
                    images[int(where[bad])] = img.to(device)
        if lost:  # as the workers do with a corrupt sample: a good one of the batch instead
            good = next(i for i in range(len(labels)) if i not in lost)
            images[lost], labels[lost] = images[good].clone(), labels[good].clone()
        return images, labels.to(device, non_blocking=True)

    def _on_cpu(self, data, box, flip) -> torch.Tensor | None:
        d = self.dataset
        try:
            img = decode_with_pil(data.numpy().tobytes(), d.channels)
            img = crop_resize(img, d.spec.img_size, tuple(box.tolist()))
            return to_batch([img[:, ::-1] if flip else img])[0]
        except Exception as e:  # undecodable here too: a corrupt sample, counted
            d.counter.add(samples=1)
            report_skip(f"a JPEG of the batch: {type(e).__name__}: {e}")
            return None


class EvalLoader(ShardLoader):
    @property
    def num_samples(self) -> int:
        """Samples in this rank's part (fewer may come if some are corrupt)."""
        return self.dataset.hi - self.dataset.lo

    def __len__(self) -> int:
        return (self.num_samples + self.dataset.batch - 1) // self.dataset.batch


def check_shared_memory(batch_bytes: int, num_workers: int, prefetch_factor: int) -> None:
    """Refuse, in one line, loader workers whose batches in flight would not fit in /dev/shm
    (where torch passes them); a container's default of 64 MB is the usual cause."""
    if num_workers == 0 or not os.path.isdir("/dev/shm"):
        return
    need = batch_bytes * (num_workers * prefetch_factor + 1)
    free = shutil.disk_usage("/dev/shm").free
    if need > free:
        raise RuntimeError(
            f"/dev/shm has {free / 2**20:.0f} MB free but {num_workers} loader workers need "
            f"about {need / 2**20:.0f} MB for their batches in flight; give the container more "
            "(docker run --shm-size=16g, or the runtime's equivalent) or lower data.num_workers"
        )


def _common(
    root: str | Path | Manifest,
    split: str,
    num_workers: int,
    ctx: str | None,
    missing: str,
    verify: str,
    shards: list[ShardRef] | None = None,
    start: bool = True,
):
    """The manifest, its selected shards, the workers' multiprocessing context (with its fork
    server started when `start` and num_workers > 0) and the loader's read counters."""
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    # the trainer hands over the manifest and shards its preflight loaded and selected: one
    # read, one version of them
    manifest = root if isinstance(root, Manifest) else load_manifest(root)
    if shards is None:
        shards = select_shards(manifest, split, missing, verify)  # type: ignore[arg-type]
    mp_ctx = worker_context(ctx, num_workers if start else 0)
    return manifest, shards, mp_ctx, ReadCounter(mp_ctx)


def load_training_samples(
    manifest: Manifest,
    split: str,
    shards: list[ShardRef],
    spec: LoaderSpec,
    counter: ReadCounter,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (N, C, H, W) uint8, labels (N,)) of the split's readable samples that training
    uses (not held out, inside `spec.train_fraction` or `spec.subset`: ssl_vit.data.holdout),
    decoded by the eval reader (in `spec.num_workers` workers when the split is larger than
    IN_PROCESS_SAMPLES), for ssl_vit.data.memory's MemoryTrainLoader to batch (data.in_memory)."""
    resolve_in_memory(True, manifest, split)  # one size of image, or a one-line error
    start = time.perf_counter()
    n = sum(r.num_samples for r in shards)
    h, w = manifest.image_size  # type: ignore[misc]
    reader = EvalStream.of(
        manifest,
        shards,
        counter=counter,
        lo=0,
        hi=n,
        batch=1024,
        img_size=None,  # as decoded: the crops are drawn on the whole image, as when streamed
        with_keys=False,
        subset=None,
        with_indices=True,
        missing=spec.missing,  # a shard that fails its checks: stop, or skip it counted
    )
    workers = spec.num_workers if n > IN_PROCESS_SAMPLES else 0  # ssl_vit.data.workers
    ctx = worker_context(spec.multiprocessing_context, workers)  # no fork server for none
    images = torch.empty((n, manifest.channels, h, w), dtype=torch.uint8)
    labels = torch.empty(n, dtype=torch.int64)
    index = torch.empty(n, dtype=torch.int64)
    got = 0
    for imgs, labs, idx in DataLoader(
        reader,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=ctx if workers > 0 else None,
    ):
        if imgs.shape[0] and imgs.shape[2:] != (h, w):
            raise ValueError(
                f"{manifest.root}: a {split} image is {tuple(imgs.shape[2:])}, not the "
                f"manifest's image_size {h}x{w}; rebuild the manifest or set data.in_memory=false"
            )
        k = imgs.shape[0]
        images[got : got + k], labels[got : got + k], index[got : got + k] = imgs, labs, idx
        got += k
    # The held-out hash ranges over the shards present, as the streaming loaders number them.
    unused = excluded_indices(n, spec.holdout_fraction, spec.train_fraction, spec.subset)
    keep = ~torch.isin(index[:got], torch.from_numpy(unused))
    images, labels = images[:got][keep].contiguous(), labels[:got][keep].contiguous()
    secs = time.perf_counter() - start
    log.info(
        "%s: %d %s images decoded into RAM (%.0f MB) in %.1f s, %.0f images/s; %d skipped",
        manifest.root,
        len(images),
        split,
        images.numel() / 2**20,
        secs,
        got / max(secs, 1e-9),
        counter.samples,
    )
    return images, labels


def make_train_loader(
    root: str | Path | Manifest,
    split: str,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str | None = None,
    epoch: int = 0,
    skip_batches: int = 0,
    shards: list[ShardRef] | None = None,
    spec: LoaderSpec | None = None,
    **options: Any,
) -> TrainLoader | MemoryTrainLoader:
    """Training batches of `split` for `rank` of `world_size`: uint8 (B, C, H, W) images and
    int64 labels (-1 when unlabelled), B = global_batch // world_size, read as `spec` says (or
    a LoaderSpec made of `options`: its fields document them). `root`: a shard set, or the
    Manifest a caller already loaded, with the `shards` it already selected. Resume with the
    same seed, world_size and num_workers for an exact continuation. In memory, batches are
    held and augmented on `device` when given (a GPU); decode="gpu" decodes JPEGs there."""
    if spec is None:
        spec = LoaderSpec(**options)
    elif options:
        raise TypeError(f"make_train_loader: pass a LoaderSpec or its fields, not both ({options})")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if spec.global_batch < world_size or spec.global_batch % world_size:
        raise ValueError(
            f"global_batch {spec.global_batch} is not divisible by world_size {world_size}"
        )
    manifest, shards, ctx, counter = _common(
        root, split, spec.num_workers, spec.multiprocessing_context, spec.missing, spec.verify,
        shards, start=not spec.in_memory,  # in memory: load_training_samples decides
    )  # fmt: skip
    if spec.in_memory:
        images, labels = load_training_samples(manifest, split, shards, spec, counter)
        num_samples = len(images)
    else:
        total = sum(r.num_samples for r in shards)
        unused = excluded_indices(total, spec.holdout_fraction, spec.train_fraction, spec.subset)
        exclusions = Exclusions(unused.tolist())
        num_samples = total - len(exclusions.sorted)
    steps = num_samples // spec.global_batch
    if steps == 0:
        fewer = f" or raise data.train_fraction={spec.train_fraction}"
        raise ValueError(
            f"{manifest.root}: split {split!r} has {num_samples} samples to train on, fewer than "
            f"one global batch of {spec.global_batch}; lower the batch size"
            + (fewer if spec.train_fraction < 1 else "")
            + (" or list more samples in the subset" if spec.subset is not None else "")
        )
    if spec.in_memory:
        loader: TrainLoader | MemoryTrainLoader = MemoryTrainLoader(
            images, labels, manifest=manifest, split=split, global_batch=spec.global_batch,
            rank=rank, world_size=world_size, seed=spec.seed, counter=counter,
            img_size=spec.img_size, augment=spec.augment, scale=tuple(spec.scale),
            hflip=spec.hflip, translate=spec.translate, device=device,
        )  # fmt: skip
        loader.set_epoch(epoch, skip_batches)
        return loader
    if spec.decode == "gpu" and (device is None or spec.translate):
        raise ValueError("decode='gpu' needs a device, and translate=0 (a CPU-path shift)")
    dataset = TrainStream.of(
        manifest,
        shards,
        spec=spec,
        rank=rank,
        world_size=world_size,
        workers=max(1, spec.num_workers),
        batch=spec.global_batch // world_size,
        steps=steps,
        position=EpochPosition(ctx, epoch, 0),
        counter=counter,
        exclusions=exclusions,
    )
    check_shared_memory(
        dataset.batch * manifest.channels * spec.img_size**2,
        spec.num_workers,
        spec.prefetch_factor,
    )
    loader = TrainLoader(
        dataset,
        manifest=manifest,
        split=split,
        num_workers=spec.num_workers,
        pin_memory=spec.pin_memory,
        prefetch_factor=spec.prefetch_factor,
        timeout=spec.timeout,
        ctx=ctx,
        persistent=True,
        device=device,
    )
    loader.set_epoch(epoch, skip_batches)
    return loader


def make_eval_loader(
    root: str | Path | Manifest,
    split: str,
    *,
    batch_size: int,
    img_size: int,
    num_workers: int = 2,
    rank: int = 0,
    world_size: int = 1,
    with_keys: bool = False,
    missing: Literal["error", "skip"] = "error",
    holdout_fraction: float | None = None,
    pin_memory: bool | None = None,
    prefetch_factor: int = 2,
    timeout: float = STALL_TIMEOUT,
    multiprocessing_context: str | None = None,
    retry: Retry | None = None,
    verify: Literal["read", "all"] = "read",
) -> EvalLoader:
    """Every sample of the split exactly once, in manifest order, centre-resized to img_size;
    with world_size > 1, rank r gets the r-th contiguous part. With `holdout_fraction`, only the
    samples the train loader holds out at that fraction, as if they were a split."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    manifest, shards, ctx, counter = _common(
        root, split, num_workers, multiprocessing_context, missing, verify
    )
    n = sum(r.num_samples for r in shards)
    subset = None
    if holdout_fraction is not None:
        subset = held_out_indices(n, holdout_fraction)
        n = len(subset)
        if n == 0:
            raise ValueError(
                f"{manifest.root}: a held-out share of {holdout_fraction} of split {split!r} "
                "holds no sample; raise data.holdout_fraction"
            )
    dataset = EvalStream.of(
        manifest,
        shards,
        lo=n * rank // world_size,
        hi=n * (rank + 1) // world_size,
        batch=batch_size,
        img_size=img_size,
        with_keys=with_keys,
        counter=counter,
        subset=subset,
        retry=retry or Retry(),
        missing=missing,
    )
    return EvalLoader(
        dataset,
        manifest=manifest,
        split=split,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        timeout=timeout,
        ctx=ctx,
    )
