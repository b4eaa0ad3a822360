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

import torch
from torch.utils.data import DataLoader, IterableDataset

from .augment import crop_resize, decode_with_pil, to_batch
from .datasets import STALL_TIMEOUT, EpochPosition, EvalStream, LoaderSpec, TrainStream
from .device_decode import DeviceDecodeError, decode_crop_batch
from .holdout import excluded_indices, held_out_indices
from .manifest import Manifest, load_manifest
from .memory import LoaderCounts, MemoryTrainLoader, load_training_samples
from .shards import ReadCounter, ShardReadError, ShardRef, report_skip, select_shards
from .stream_plan import Exclusions, read_factor
from .urls import Retry
from .workers import worker_context


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
        device = self._dl["device"]
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
):
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    # the trainer hands over the manifest and shards its preflight loaded and selected: one
    # read, one version of them
    manifest = root if isinstance(root, Manifest) else load_manifest(root)
    if shards is None:
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
        shards,
    )  # fmt: skip
    if spec.in_memory:
        images, labels = load_training_samples(
            manifest, split, shards, spec.num_workers, spec.holdout_fraction, counter, ctx,
            spec.train_fraction, spec.missing, spec.subset,
        )  # fmt: skip
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
    dataset = TrainStream(
        shards,
        spec,
        channels=manifest.channels,
        labelled=manifest.class_names is not None,
        num_classes=manifest.num_classes,
        layout=manifest.layout,
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
    dl = _dl_options(spec.num_workers, spec.pin_memory, spec.prefetch_factor, spec.timeout, ctx)
    loader = TrainLoader(
        dataset, manifest=manifest, split=split, **dl, persistent=True, device=device
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
