"""Streaming input from a shard set: split by rank and worker, shuffle, decode, augment, batch.

    loader = make_train_loader(root, "train", global_batch=4096, rank=r, world_size=ws,
                               num_workers=8, img_size=224, seed=0, epoch=0, skip_batches=0)
    for images, labels in loader:      # images uint8 (B, C, H, W), labels int64 (B,)
        ...                            # B = global_batch // world_size; len(loader) batches
    loader.set_epoch(epoch + 1)        # next epoch (skip_batches back to 0)
    for images, labels in make_eval_loader(root, "test", batch_size=256, img_size=224):
        ...                            # every sample once, in manifest order (rank's part)

webdataset gives pipe: URLs and the shuffle buffer; equal per-stream quotas, the exact
mid-epoch resume, ranged remote reads and the tar parsing are ours. What the loaders guarantee
(equal step counts, resume, bad data, held-out samples, shared memory): docs/streaming.md,
"The loaders' contract".
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from .augment import crop_resize, decode_with_pil, to_batch
from .datasets import EpochPosition, EvalStream, TrainStream
from .device_decode import DeviceDecodeError, decode_crop_batch
from .holdout import excluded_indices, held_out_indices
from .manifest import Manifest, load_manifest
from .memory import LoaderCounts, MemoryTrainLoader, load_training_samples
from .shards import ReadCounter, ShardReadError, report_skip, select_shards
from .stream_plan import Exclusions, read_factor
from .urls import Retry
from .workers import worker_context

# Seconds a loader may go without a batch (its workers' start included) before it stops: far
# above any honest batch time, short of a job that waits all night (data.stall_timeout).
STALL_TIMEOUT = 600.0


class ShardLoader(LoaderCounts):
    """Iterates a stream through a torch DataLoader; batches are assembled in the workers,
    which persist across epochs (one DataLoader for the loader's life)."""

    def __init__(self, dataset: IterableDataset, *, manifest: Manifest, split: str, **dl: Any):
        self.dataset, self.manifest, self.split = dataset, manifest, split
        self._dl = dl  # num_workers pin_memory prefetch_factor timeout ctx
        self._loader: DataLoader | None = None

    @property
    def counter(self) -> ReadCounter:
        return self.dataset.counter

    def _dataloader(self) -> DataLoader:
        if self._loader is None:
            n = self._dl["num_workers"]
            self._loader = DataLoader(
                self.dataset,
                batch_size=None,  # the workers batch
                num_workers=n,
                pin_memory=self._dl["pin_memory"],
                prefetch_factor=self._dl["prefetch_factor"] if n > 0 else None,
                timeout=self._dl["timeout"] if n > 0 else 0,
                multiprocessing_context=self._dl["ctx"] if n > 0 else None,
                persistent_workers=n > 0 and self._dl.get("persistent", False),
            )
        return self._loader

    def _batches(self) -> Iterator[tuple]:
        """The DataLoader's batches; a stall past `timeout` becomes one line naming what the
        workers were reading (torch's own error names none)."""
        it = iter(self._dataloader())
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except RuntimeError as e:
                if "timed out" not in str(e):
                    raise
                raise ShardReadError(
                    f"no batch from the data loader in {self._dl['timeout']:g} s "
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
        """How many times this epoch's plan reads the shard set (ssl_vit.data.stream_plan)."""
        if self.dataset.resampled:
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
        device = self._dl["device"]
        images = torch.empty(
            (len(labels), d.channels, d.img_size, d.img_size), dtype=torch.uint8, device=device
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
                    d.img_size,
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
            img = crop_resize(img, d.img_size, tuple(box.tolist()))
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
):
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    # the trainer hands over the manifest its preflight loaded: one read, one version of it
    manifest = root if isinstance(root, Manifest) else load_manifest(root)
    shards = select_shards(manifest, split, missing, verify)  # type: ignore[arg-type]
    mp_ctx = worker_context(ctx, num_workers)
    return manifest, shards, mp_ctx, ReadCounter(mp_ctx)


def _dl_options(num_workers, pin_memory, prefetch_factor, timeout, ctx) -> dict[str, Any]:
    """The DataLoader settings a ShardLoader keeps (pinned memory by default where CUDA is)."""
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    return dict(
        num_workers=num_workers,
        pin_memory=pin,
        prefetch_factor=prefetch_factor,
        timeout=timeout,
        ctx=ctx,
    )


def make_train_loader(
    root: str | Path | Manifest,
    split: str,
    *,
    global_batch: int,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 4,
    img_size: int = 224,
    seed: int = 0,
    epoch: int = 0,
    skip_batches: int = 0,
    augment: bool = True,
    scale: tuple[float, float] = (0.08, 1.0),
    hflip: bool = True,
    translate: int = 0,
    missing: Literal["error", "skip"] = "error",
    holdout_fraction: float = 0.0,
    train_fraction: float = 1.0,
    subset: np.ndarray | None = None,
    shuffle_buffer: int = 2000,
    shuffle_initial: int = 500,
    pin_memory: bool | None = None,
    prefetch_factor: int = 2,
    timeout: float = STALL_TIMEOUT,
    multiprocessing_context: str | None = None,
    in_memory: bool = False,
    device: torch.device | str | None = None,
    resampled: bool = False,
    retry: Retry | None = None,
    verify: Literal["read", "all"] = "read",
    decode: Literal["cpu", "gpu"] = "cpu",
) -> TrainLoader | MemoryTrainLoader:
    """Training batches for `rank` of `world_size`: uint8 (B, C, img_size, img_size) images and
    int64 labels (-1 when unlabelled), B = global_batch // world_size. `augment` applies the
    paper's random resized crop (`scale`) and flip (`hflip`), and a random shift of up to
    `translate` pixels per axis (zero-filled; 0: none); without it, a centre resize.
    `holdout_fraction` keeps that hashed share of the split out of training (module doc);
    `train_fraction` < 1 trains on that hashed share of the rest, `subset` (sorted manifest
    indices, from ssl_vit.data.holdout.read_subset_file) on those only (ssl_vit.data.holdout).
    Resume with the same seed, world_size and num_workers for an exact continuation.
    `in_memory`: the split decoded once by `num_workers` workers and batched from RAM
    (ssl_vit.data.memory, same contract), held and augmented on `device` when given (a GPU).
    `decode="gpu"`: JPEGs decoded, cropped and flipped on `device` in the main process
    (ssl_vit.data.device_decode), other images in the workers as always.
    `resampled`: shards drawn with replacement (ssl_vit.data.stream_plan); `retry`: how remote
    reads are retried (ssl_vit.data.urls.Retry); `missing`: a shard that cannot be read stops
    training ("error") or is counted and passed over ("skip"); `verify`: which bytes read are
    checked against the manifest's block checksums (ssl_vit.data.blocks); `timeout`: seconds
    without a batch before the loader stops, naming what its workers were reading."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if global_batch < world_size or global_batch % world_size:
        raise ValueError(f"global_batch {global_batch} is not divisible by world_size {world_size}")
    manifest, shards, ctx, counter = _common(
        root, split, num_workers, multiprocessing_context, missing, verify
    )
    if in_memory:
        images, labels = load_training_samples(
            manifest,
            split,
            shards,
            num_workers,
            holdout_fraction,
            counter,
            ctx,
            train_fraction,
            missing,
            subset,
        )
        num_samples = len(images)
    else:
        total = sum(r.num_samples for r in shards)
        unused = excluded_indices(total, holdout_fraction, train_fraction, subset)
        exclusions = Exclusions(unused.tolist())
        num_samples = total - len(exclusions.sorted)
    steps = num_samples // global_batch
    if steps == 0:
        raise ValueError(
            f"{manifest.root}: split {split!r} has {num_samples} samples to train on, fewer than "
            f"one global batch of {global_batch}; lower the batch size"
            + (f" or raise data.train_fraction={train_fraction}" if train_fraction < 1 else "")
            + (" or list more samples in the subset" if subset is not None else "")
        )
    aug = dict(
        img_size=img_size, augment=augment, scale=tuple(scale), hflip=hflip, translate=translate
    )
    part = dict(rank=rank, world_size=world_size, seed=seed, counter=counter)
    if in_memory:
        loader: TrainLoader | MemoryTrainLoader = MemoryTrainLoader(
            images,
            labels,
            manifest=manifest,
            split=split,
            global_batch=global_batch,
            **part,
            **aug,
            device=device,
        )
        loader.set_epoch(epoch, skip_batches)
        return loader
    dataset = TrainStream(
        shards,
        channels=manifest.channels,
        labelled=manifest.class_names is not None,
        num_classes=manifest.num_classes,
        layout=manifest.layout,
        workers=max(1, num_workers),
        batch=global_batch // world_size,
        steps=steps,
        position=EpochPosition(ctx, epoch, 0),
        **part,
        **aug,
        shuffle_buffer=shuffle_buffer,
        shuffle_initial=shuffle_initial,
        exclusions=exclusions,
        resampled=resampled,
        retry=retry or Retry(),
        missing=missing,
        device_decode=decode == "gpu",
    )
    if decode == "gpu" and (device is None or translate):
        raise ValueError("decode='gpu' needs a device, and translate=0 (a CPU-path shift)")
    check_shared_memory(
        dataset.batch * manifest.channels * img_size**2, num_workers, prefetch_factor
    )
    dl = _dl_options(num_workers, pin_memory, prefetch_factor, timeout, ctx)
    loader = TrainLoader(
        dataset, manifest=manifest, split=split, **dl, persistent=True, device=device
    )
    loader.set_epoch(epoch, skip_batches)
    return loader


def make_eval_loader(
    root: str | Path,
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
    dataset = EvalStream(
        shards,
        channels=manifest.channels,
        labelled=manifest.class_names is not None,
        num_classes=manifest.num_classes,
        layout=manifest.layout,
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
    dl = _dl_options(num_workers, pin_memory, prefetch_factor, timeout, ctx)
    return EvalLoader(dataset, manifest=manifest, split=split, **dl)
