"""Which samples each loader stream reads in an epoch, and how much of the data that reads.

A *stream* is one DataLoader worker of one rank, numbered rank * workers + role; its quota
(`stream_quota`) is its batch size times the batches it makes. Exact epochs
(data.resampled=false): `exact_pieces` lays the epoch's shuffled shards (`epoch_order`) end to
end and gives each stream the next run of its quota of training samples, so every sample is read
by exactly one stream. Resampled epochs (data.resampled=true): `resampled_pieces` draws whole
shards with replacement per stream. `read_factor` says how many times a plan reads the shard set
(`read_start`: where a reader of a piece starts); the preflight refuses a plan above
MAX_READ_FACTOR.

The scheme and its guarantees: docs/streaming.md#which-samples-each-stream-reads.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .augment import mix_seed
from .shards import ShardRef
from .urls import is_pipe, local_path, ranged

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
    if piece.ref.every and piece.ref.offsets and can_seek:
        anchor = min(piece.start // piece.ref.every, len(piece.ref.offsets) - 1)
        return anchor * piece.ref.every
    return 0


def read_factor(
    shards: Sequence[ShardRef], plans: Sequence[Sequence[Piece]], assume_ranged: bool = False
) -> float:
    """Samples read (delivered or read to be dropped) over the samples of the set."""
    total = sum(r.num_samples for r in shards)
    read = sum(p.stop - read_start(p, assume_ranged) for pieces in plans for p in pieces)
    return read / max(1, total)
