"""Reading a shard set's shards: which shards a split has, and their raw samples.

    refs = select_shards(manifest, "train", missing="error")   # list[ShardRef] with offsets
    counter = ReadCounter(mp.get_context())
    for sample in read_shard(refs[0], counter, start=120, stop=240):
        sample["__index__"]            # the sample's manifest index within the split

`ShardRef.offset` is the manifest index of a shard's first sample, so every sample has a global
index that streams can split on. A reader asked to start at sample `start` of a shard seeks to
the nearest sample at or before it that the manifest's offset index lists (a ranged request for a
remote shard), then passes over at most `index_every - 1` samples without reading their bytes
where the source can seek (a local file, http(s), s3, gs) or reading and dropping them where it
cannot (a pipe). Without an index, it walks the shard's headers from its start (ssl_vit.data.urls).

Failed reads are retried from the sample they reached (`Retry`; docs/streaming.md says what
each failure does). A `ReadCounter` keeps, in shared memory written by the workers and read by
the main process, samples skipped, shard errors, retries, and the samples and bytes really read.
`report_skip` logs skip events, rate-limited per process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from .manifest import Manifest, ManifestError, check_shards_exist
from .tar_reader import TarFormatError, _drop, read_samples
from .urls import Retry, exists, is_missing, join, local_path, open_url

log = logging.getLogger(__name__)
_MAX_LOGGED = 20  # per process; then every 1000th, so junk data cannot flood the log
_n_logged = 0


class ShardReadError(OSError):
    """A shard that could not be read after its retries, under missing="error"."""

    def one_line(self) -> str:
        """The message alone: raised in a loader worker, the DataLoader re-raises it with the
        worker's traceback in front, the original line last."""
        last = str(self).strip().splitlines()[-1] if str(self).strip() else ""
        return last.split(f"{type(self).__name__}: ", 1)[-1]


@dataclass(frozen=True)
class ShardRef:
    url: str  # a local path or a URL (ssl_vit.data.urls)
    num_samples: int
    offset: int  # manifest index (within the split) of the shard's first sample
    offsets: tuple[int, ...] = ()  # byte offsets of samples 0, every, 2 * every, ...
    every: int = 0

    @property
    def remote(self) -> bool:
        return local_path(self.url) is None


_FIELDS = ("samples", "shard_errors", "retries", "samples_read", "bytes_read")


class ReadCounter:
    """Counters in shared memory, written by DataLoader workers and read by the main process."""

    def __init__(self, ctx: Any) -> None:
        self._values = {name: ctx.Value("q", 0) for name in _FIELDS}

    def add(self, **counts: int) -> None:
        for name, n in counts.items():
            if n:
                value = self._values[name]
                with value.get_lock():
                    value.value += n

    def __getattr__(self, name: str) -> int:
        if name.startswith("_") or name not in _FIELDS:
            raise AttributeError(name)
        return int(self._values[name].value)


def report_skip(msg: str) -> None:
    """Log a skipped sample or shard: the first few, then every 1000th (per process)."""
    global _n_logged
    _n_logged += 1
    if _n_logged <= _MAX_LOGGED or _n_logged % 1000 == 0:
        log.warning("skipped: %s (%d skip events in this process)", msg, _n_logged)


def select_shards(
    manifest: Manifest, split: str, missing: Literal["error", "skip"] = "error"
) -> list[ShardRef]:
    """The split's shards with their sample offsets. Missing local ones raise or are dropped;
    a remote one is found missing only when read (see read_shard)."""
    infos = manifest.split(split).shards
    if missing == "error":
        check_shards_exist(manifest, split)
    elif missing != "skip":
        raise ValueError(f"missing must be 'error' or 'skip', not {missing!r}")
    urls = [join(str(manifest.root), info.name) for info in infos]
    gone = {u for u in urls if exists(u) is False}
    if gone:
        log.warning(
            "%d of %d %s shards missing, skipped (first: %s)",
            len(gone),
            len(urls),
            split,
            min(gone),
        )
    refs, offset = [], 0
    for info, url in zip(infos, urls, strict=True):
        if url in gone:
            continue
        index = tuple(info.offsets or ()) if manifest.index_every else ()
        refs.append(ShardRef(url, info.num_samples, offset, index, manifest.index_every or 0))
        offset += info.num_samples
    if not refs:
        raise ManifestError(f"{manifest.root}: no {split} shard exists; restore the shard set")
    return refs


class _Counting:
    """A file's reads, counted in bytes (what a reader really pulled from the source)."""

    def __init__(self, f) -> None:
        self.f, self.bytes = f, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.bytes += len(data)
        return data

    def seekable(self) -> bool:
        return self.f.seekable() if hasattr(self.f, "seekable") else False

    def seek(self, n: int, whence: int = 0) -> int:
        return self.f.seek(n, whence)


def read_shard(
    ref: ShardRef,
    counter: ReadCounter,
    *,
    start: int = 0,
    stop: int | None = None,
    keep: Callable[[int], bool] | None = None,
    retry: Retry | None = None,
    missing: Literal["error", "skip"] = "skip",
) -> Iterator[dict]:
    """Samples start..stop-1 (positions in the shard) whose manifest index passes `keep`, in
    order, tagged with `__index__`; the others are passed over unread. See the module doc for
    retries (`retry`: None = Retry()) and what `missing` does with a shard that cannot be read."""
    stop = ref.num_samples if stop is None else min(stop, ref.num_samples)
    retry = retry or Retry()
    nxt = start  # position of the next sample still to deliver
    failures = 0
    error: Exception | None = None

    def wanted(p: int) -> bool:
        return nxt <= p < stop and (keep is None or keep(ref.offset + p))

    while nxt < stop:
        error, before = None, nxt
        anchor = min(nxt // ref.every, len(ref.offsets) - 1) if ref.every and ref.offsets else -1
        first = anchor * ref.every if anchor >= 0 else 0
        byte = ref.offsets[anchor] if anchor >= 0 else 0
        src = None
        try:
            raw, at = open_url(ref.url, byte, timeout=retry.timeout)
            src = _Counting(raw)
            with raw:
                if at < byte:  # a pipe starts at 0
                    _drop(src, byte - at, ref.url)
                skip = lambda j, f=first: not wanted(f + j)  # noqa: E731
                samples = read_samples(src, ref.url, byte, skip=skip)
                for j, (_, sample) in enumerate(samples):
                    p = first + j
                    if p >= stop:
                        break
                    if p < nxt:
                        continue
                    nxt = p + 1
                    if sample is not None:
                        counter.add(samples_read=1)
                        sample["__index__"] = ref.offset + p
                        yield sample
                break  # the shard (or the range) ended: short ends are counted below
        except (OSError, TarFormatError, UnicodeDecodeError, TimeoutError) as e:
            error = e
        except Exception as e:  # e.g. aiohttp's errors, which are not OSErrors
            if not ref.remote:
                raise
            error = e
        finally:
            if src is not None:
                counter.add(bytes_read=src.bytes)
        failures = 1 if nxt > before else failures + 1  # a try that moved on starts afresh
        if not ref.remote or is_missing(error) or failures >= retry.attempts:
            break
        counter.add(retries=1)
        log.warning(
            "%s: read failed (%s: %s); retrying from sample %d",
            ref.url,
            type(error).__name__,
            error,
            nxt,
        )
        time.sleep(retry.backoff * 2 ** (failures - 1))
    if error is None and nxt >= stop:
        return
    lost = range(ref.offset + nxt, ref.offset + stop)
    n_lost = sum(1 for i in lost if keep is None or keep(i))
    why = f"{type(error).__name__}: {error}" if error is not None else "ended early"
    if ref.remote and missing == "error":
        raise ShardReadError(
            f"{ref.url}: unreadable after {retry.attempts} tries ({why}); fix the source or set "
            "data.missing_shards=skip to train on without it"
        )
    # Readers of later parts of a broken shard deliver nothing: the reader of the part where it
    # broke counts the shard error, once.
    owner = nxt > start or start == 0
    counter.add(samples=n_lost, shard_errors=int(owner))
    if owner:
        report_skip(f"{ref.url}: read {nxt - start} of {stop - start} samples ({why})")
