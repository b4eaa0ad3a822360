"""The IterableDatasets behind the loaders of `ssl_vit.data.stream` (which documents the
sharding, shuffling, resume and bad-data rules they implement): `TrainStream` for training
batches, `EvalStream` for evaluation in manifest order."""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass
from itertools import count

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from .augment import (
    CorruptSample,
    decode_sample,
    eval_transform,
    mix_seed,
    to_batch,
    train_transform,
)
from .shards import ShardRef, SkipCounter, read_shard, report_skip


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


@dataclass(eq=False)
class TrainStream(IterableDataset):
    """One epoch of fixed-size batches for one rank; see the module docstring."""

    shards: list[ShardRef]
    _: KW_ONLY
    channels: int
    labelled: bool
    rank: int
    world_size: int
    workers: int  # loader worker processes (at least 1)
    batch: int  # per-rank batch
    steps: int  # batches per epoch and rank
    seed: int
    epoch: int
    skip_batches: int  # batches of this epoch already trained on (a mid-epoch resume)
    img_size: int
    augment: bool
    scale: tuple[float, float]
    hflip: bool
    translate: int  # random shift of up to this many pixels per axis (0: none)
    shuffle_buffer: int
    shuffle_initial: int
    counter: SkipCounter
    exclude: frozenset[int]  # held-out manifest indices, never yielded
    exclude_sorted: tuple[int, ...]

    def plan(self) -> tuple[list[list[ShardRef]], bool]:
        """Shards per stream for this epoch, and whether streams split by sample index."""
        num_streams, W = self.world_size * self.workers, self.workers
        order = list(self.shards)
        random.Random(mix_seed(self.seed, self.epoch, 0x5EED)).shuffle(order)
        if len(order) < num_streams:
            return [order] * num_streams, True
        deficit = [self.batch * ((self.steps - s % W + W - 1) // W) for s in range(num_streams)]
        plan: list[list[ShardRef]] = [[] for _ in range(num_streams)]
        for i, ref in enumerate(order):
            s = i if i < num_streams else max(range(num_streams), key=deficit.__getitem__)
            plan[s].append(ref)
            deficit[s] -= ref.num_samples - self._num_excluded(ref)
        return plan, False

    def _num_excluded(self, ref: ShardRef) -> int:
        """Held-out samples inside `ref` (never yielded by the train stream)."""
        ex = self.exclude_sorted
        return bisect.bisect_left(ex, ref.offset + ref.num_samples) - bisect.bisect_left(
            ex, ref.offset
        )

    def _pass(self, order: list[ShardRef], keep: Callable[[int], bool] | None) -> Iterator[dict]:
        for ref in order:
            yield from read_shard(ref, keep, self.counter)

    def _raw(self, stream: int, shards: list[ShardRef], modulo: bool) -> Iterator[dict]:
        """The stream's samples, pass after pass over its shards, each pass buffer-shuffled on
        its own (so one pass is drained before the next begins: no sample twice per pass)."""
        num_streams, exclude = self.world_size * self.workers, self.exclude
        if modulo:
            keep = lambda i: i % num_streams == stream and i not in exclude  # noqa: E731
        else:
            keep = (lambda i: i not in exclude) if exclude else None
        for p in count():
            order = list(shards)
            if p > 0:  # re-read a short stream, reshuffled
                random.Random(mix_seed(self.seed, self.epoch, stream, p)).shuffle(order)
            rng = random.Random(mix_seed(self.seed, self.epoch, stream, -1 - p))
            shuffle = wds.shuffle(self.shuffle_buffer, self.shuffle_initial, rng=rng)
            n = 0
            for sample in shuffle(self._pass(order, keep)):
                n += 1
                yield sample
            if n == 0:  # would loop forever otherwise
                raise RuntimeError(
                    f"no readable sample in the {len(order)} shards of stream {stream} "
                    f"(e.g. {order[0].path if order else '-'}); check the shard set"
                )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        w, W = _worker()
        if W != self.workers:
            raise RuntimeError(f"built for {self.workers} workers, run with {W}")
        role = (self.skip_batches + w) % W  # the worker this one stands for; see module doc
        stream = self.rank * W + role
        n_total = (self.steps - role + W - 1) // W
        n_skip = max(0, (self.skip_batches - role + W - 1) // W)
        plan, modulo = self.plan()
        src = self._raw(stream, plan[stream], modulo)
        pos = 0
        for _ in range(n_skip * self.batch):  # skip before decoding
            next(src)
            pos += 1
        for _ in range(n_total - n_skip):
            imgs: list[np.ndarray] = []
            labels: list[int] = []
            for _chunk in range(100):
                # One generator per chunk, seeded by its first position: a resume that skips
                # whole batches meets the same seeds (a generator per sample cost ~6 us each).
                aug_rng = random.Random(mix_seed(self.seed, self.epoch, stream, pos))
                for _ in range(self.batch):
                    sample = next(src)
                    pos += 1
                    try:
                        img, label = decode_sample(
                            sample, channels=self.channels, labelled=self.labelled
                        )
                    except CorruptSample as e:
                        self.counter.add(samples=1)
                        report_skip(f"{sample.get('__url__')}: {e}")
                        continue
                    imgs.append(self._transform(img, aug_rng))
                    labels.append(label)
                if imgs:
                    break
            else:
                raise RuntimeError(f"stream {stream}: 100 batches in a row were all corrupt")
            for i in range(self.batch - len(imgs)):  # fill corrupt places from the same batch
                imgs.append(imgs[i])
                labels.append(labels[i])
            yield to_batch(imgs), torch.tensor(labels, dtype=torch.int64)

    def _transform(self, img: np.ndarray, rng: random.Random) -> np.ndarray:
        if not self.augment:
            return eval_transform(img, self.img_size)
        return train_transform(
            img, rng, self.img_size, scale=self.scale, hflip=self.hflip, translate=self.translate
        )


@dataclass(eq=False)
class EvalStream(IterableDataset):
    """One rank's contiguous part of a split, in manifest order; see the module docstring."""

    shards: list[ShardRef]
    _: KW_ONLY
    channels: int
    labelled: bool
    lo: int  # this rank's positions lo..hi-1 (of the split, or of `subset`)
    hi: int
    batch: int
    img_size: int
    with_keys: bool
    counter: SkipCounter
    subset: np.ndarray | None  # sorted manifest indices (the held-out samples), or None
    with_indices: bool = False  # the samples' manifest indices as a last item (int64 tensor)

    def __iter__(self) -> Iterator[tuple]:
        w, W = _worker()
        lo, hi, bs = self.lo, self.hi, self.batch
        num_batches = (hi - lo + bs - 1) // bs
        if self.subset is None:  # positions lo..hi-1 are manifest indices lo..hi-1
            pos: Callable[[int], int] = lambda i: i - lo if lo <= i < hi else -1  # noqa: E731
            first, last = lo, hi - 1
        else:  # positions lo..hi-1 of the sorted subset (the held-out samples)
            mine_idx = self.subset[lo:hi]
            where = {int(i): p for p, i in enumerate(mine_idx)}
            pos = lambda i: where.get(i, -1)  # noqa: E731
            first, last = (int(mine_idx[0]), int(mine_idx[-1])) if len(mine_idx) else (0, -1)

        def mine(i: int) -> bool:  # worker w owns batches w, w + W, ... (torch's order)
            p = pos(i)
            return p >= 0 and (p // bs) % W == w

        refs = [r for r in self.shards if r.offset <= last and r.offset + r.num_samples > first]
        samples = (s for r in refs for s in read_shard(r, mine, self.counter))
        pending = next(samples, None)
        for b in range(w, num_batches, W):
            imgs, labels, keys, indices = [], [], [], []
            while pending is not None and pos(pending["__index__"]) // bs == b:
                try:
                    img, label = decode_sample(
                        pending, channels=self.channels, labelled=self.labelled
                    )
                    imgs.append(eval_transform(img, self.img_size))
                    labels.append(label)
                    keys.append(pending["__key__"])
                    indices.append(pending["__index__"])
                except CorruptSample as e:
                    self.counter.add(samples=1)
                    report_skip(f"{pending.get('__url__')}: {e}")
                pending = next(samples, None)
            # An empty batch is still sent (and dropped by the loader) to keep worker order.
            images = (
                to_batch(imgs)
                if imgs
                else torch.empty(
                    (0, self.channels, self.img_size, self.img_size), dtype=torch.uint8
                )
            )
            out: tuple = (images, torch.tensor(labels, dtype=torch.int64))
            if self.with_keys:
                out = (*out, keys)
            if self.with_indices:
                out = (*out, torch.tensor(indices, dtype=torch.int64))
            yield out
