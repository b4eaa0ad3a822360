"""Reading a shard set's shards: which shards a split has, and their raw samples.

    refs = select_shards(manifest, "train", missing="error")   # list[ShardRef] with offsets
    for sample in read_shard(refs[0], keep=None, counter=SkipCounter(mp.get_context())):
        sample["__index__"]            # the sample's manifest index within the split

`ShardRef.offset` is the manifest index of a shard's first sample, so every sample has a global
index that streams can split on. A truncated or vanished shard ends early: its lost samples (and
the shard, once) are counted in a `SkipCounter`, whose counters live in shared memory so that
DataLoader workers write them and the main process reads them. `report_skip` logs skip events,
rate-limited per process. Used by ssl_vit.data.stream (the loaders).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from .manifest import Manifest, ManifestError, check_shards_exist
from .tar_reader import TarFormatError, iter_samples

log = logging.getLogger(__name__)
_MAX_LOGGED = 20  # per process; then every 1000th, so junk data cannot flood the log
_n_logged = 0


@dataclass(frozen=True)
class ShardRef:
    path: str
    num_samples: int
    offset: int  # manifest index (within the split) of the shard's first sample


class SkipCounter:
    """Counters in shared memory, written by DataLoader workers and read by the main process."""

    def __init__(self, ctx: Any) -> None:
        self._samples = ctx.Value("q", 0)
        self._shards = ctx.Value("q", 0)

    def add(self, samples: int = 0, shard_errors: int = 0) -> None:
        with self._samples.get_lock():
            self._samples.value += samples
        with self._shards.get_lock():
            self._shards.value += shard_errors

    @property
    def samples(self) -> int:
        return int(self._samples.value)

    @property
    def shard_errors(self) -> int:
        return int(self._shards.value)


def report_skip(msg: str) -> None:
    """Log a skipped sample or shard: the first few, then every 1000th (per process)."""
    global _n_logged
    _n_logged += 1
    if _n_logged <= _MAX_LOGGED or _n_logged % 1000 == 0:
        log.warning("skipped: %s (%d skip events in this process)", msg, _n_logged)


def select_shards(
    manifest: Manifest, split: str, missing: Literal["error", "skip"] = "error"
) -> list[ShardRef]:
    """The split's shards with their sample offsets; missing ones raise or are dropped."""
    infos = manifest.split(split).shards
    if missing == "error":
        paths = check_shards_exist(manifest, split)
    elif missing == "skip":
        paths = manifest.shard_paths(split)
        gone = [p for p in paths if not p.is_file()]
        if gone:
            log.warning(
                "%d of %d %s shards missing, skipped (first: %s)",
                len(gone),
                len(paths),
                split,
                gone[0],
            )
    else:
        raise ValueError(f"missing must be 'error' or 'skip', not {missing!r}")
    refs, offset = [], 0
    for info, path in zip(infos, paths, strict=True):
        if path.is_file():
            refs.append(ShardRef(str(path), info.num_samples, offset))
            offset += info.num_samples
    if not refs:
        raise ManifestError(f"{manifest.root}: no {split} shard exists; restore the shard set")
    return refs


def read_shard(
    ref: ShardRef, keep: Callable[[int], bool] | None, counter: SkipCounter
) -> Iterator[dict]:
    """Raw samples of one shard (ssl_vit.data.tar_reader), tagged with `__index__`; only those
    whose index passes `keep`. A shard that fails or ends early counts its lost kept samples."""
    error: Exception | None = None  # what ended the shard, if anything did
    pos = 0
    try:
        for sample in iter_samples(ref.path):
            if pos >= ref.num_samples:
                log.warning("%s: more samples than the manifest says; extra ignored", ref.path)
                break
            index = ref.offset + pos
            pos += 1
            if keep is None or keep(index):
                sample["__index__"] = index
                yield sample
    except (OSError, TarFormatError, UnicodeDecodeError) as e:  # ends the shard; counted below
        error = e
    if error is not None or pos < ref.num_samples:
        lost = range(ref.offset + pos, ref.offset + ref.num_samples)
        n_lost = sum(1 for i in lost if keep is None or keep(i))
        # Streams that share the shard count the error once: the owner of the first lost sample.
        owner = keep is None or keep(ref.offset + min(pos, ref.num_samples - 1))
        counter.add(samples=n_lost, shard_errors=int(owner))
        if owner:
            why = f"{type(error).__name__}: {error}" if error is not None else "ended early"
            report_skip(f"{ref.path}: read {pos} of {ref.num_samples} samples ({why})")
