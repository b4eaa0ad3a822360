"""Reading a shard set's shards: which shards a split has, and their raw samples.

    refs = select_shards(manifest, "train", missing="error")   # list[ShardRef] with offsets
    counter = ReadCounter(mp.get_context())
    for sample in read_shard(refs[0], counter, start=120, stop=240):
        sample["__index__"]            # the sample's manifest index within the split

`ShardRef.offset` is the manifest index of a shard's first sample, so every sample has a global
index that streams can split on. `read_shard` enters a shard at `start` through the manifest's
offset index and retries a failed read from the sample it reached (`Retry`). A `ReadCounter`
keeps, in shared memory, samples skipped, shard errors, retries, and the samples and bytes
really read; `report_skip` logs skip events, rate-limited per process.

How a reader seeks, and what each failure does: docs/streaming.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from .manifest import Manifest, ManifestError, check_shards_exist
from .tar_reader import BlockReader, ShardIntegrityError, TarFormatError, _drop, read_samples
from .urls import (
    Retry,
    UnsafeNameError,
    exists,
    is_missing,
    join,
    local_path,
    note_no_range,
    open_url,
    reason,
)

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
    size: int = 0  # bytes, as the manifest says
    digests: tuple[str, ...] = ()  # sha256 of each block between offsets (ssl_vit.data.tar_reader)
    verify_all: bool = False  # read every byte of a block touched, never seek (data.verify=all)

    @property
    def remote(self) -> bool:
        return local_path(self.url) is None


# samples: skipped or lost; unverified: delivered from a block not checked (ssl_vit.data.tar_reader)
_FIELDS = ("samples", "shard_errors", "retries", "samples_read", "bytes_read", "unverified")


class ReadCounter:
    """Counters in shared memory, written by DataLoader workers and read by the main process."""

    def __init__(self, ctx: Any) -> None:
        self._values = {name: ctx.Value("q", 0) for name in _FIELDS}
        self._reading = ctx.Array("c", 512)  # what a reader opened last: for a stall's message

    def reading(self, what: str | None = None) -> str:
        """What a reader opened last (set it with `what`), for a message about a stall."""
        if what is not None:
            data = what.encode("utf-8", "replace")[:511]
            with self._reading.get_lock():
                self._reading.value = data
        return self._reading.value.decode("utf-8", "replace")

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


class LoaderCounts:
    """What every loader reports: skipped samples, shard errors (its `counter`) and the shard
    set's channels, mean and std (its `manifest`)."""

    num_skipped = property(lambda self: self.counter.samples)  # corrupt or lost samples so far
    num_shard_errors = property(lambda self: self.counter.shard_errors)
    channels = property(lambda self: self.manifest.channels)
    mean = property(lambda self: self.manifest.mean)
    std = property(lambda self: self.manifest.std)


def report_skip(msg: str) -> None:
    """Log a skipped sample or shard: the first few, then every 1000th (per process)."""
    global _n_logged
    _n_logged += 1
    if _n_logged <= _MAX_LOGGED or _n_logged % 1000 == 0:
        log.warning("skipped: %s (%d skip events in this process)", msg, _n_logged)


def select_shards(
    manifest: Manifest,
    split: str,
    missing: Literal["error", "skip"] = "error",
    verify: Literal["read", "all"] = "read",
) -> list[ShardRef]:
    """The split's shards with their sample offsets and block checksums. Missing local ones
    raise or are dropped; a remote one is found missing only when read (see read_shard).
    `verify`: what of the bytes read is checked against the block checksums
    (docs/streaming.md#what-is-checked)."""
    infos = manifest.split(split).shards
    where = manifest.where
    try:
        urls = [join(str(manifest.root), info.name) for info in infos]
    except UnsafeNameError as e:
        raise ManifestError(f"{where}: split {split!r} lists a shard {e}") from None
    if missing == "error":
        check_shards_exist(manifest, split)
    elif missing != "skip":
        raise ValueError(f"missing must be 'error' or 'skip', not {missing!r}")
    checked = bool(manifest.index_every) and all(i.block_sha256 for i in infos)
    if verify == "all" and not checked:
        raise ManifestError(
            f"{where}: has no block checksums, which data.verify=all needs; re-create the set "
            "with data_prep/make_shards.py, or set data.verify=read"
        )
    if not checked:
        _warn_once(
            f"{where}: has no block checksums, so the bytes read from its {split} shards are "
            "not verified (data_prep/verify_shards.py checks whole files); re-create the set "
            "with data_prep/make_shards.py to have every read checked"
        )
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
        refs.append(
            ShardRef(
                url,
                info.num_samples,
                offset,
                offsets=tuple(info.offsets or ()) if manifest.index_every else (),
                every=manifest.index_every or 0,
                size=info.bytes,
                digests=tuple(info.block_sha256 or ()) if checked else (),
                verify_all=verify == "all",
            )
        )
        offset += info.num_samples
    if not refs:
        raise ManifestError(f"{manifest.root}: no {split} shard exists; restore the shard set")
    return refs


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning("%s", msg)


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
    order, tagged with `__index__`; the others are passed over unread. Retries (`retry`: None =
    Retry()) and what `missing` does with a shard that cannot be read: docs/streaming.md.
    With block checksums (`ref.digests`) a sample leaves only once its block has been checked
    (ssl_vit.data.tar_reader): the reader reads whole blocks, so a piece that starts or stops
    inside one reads up to a block more. Bytes that disagree with the manifest, and an indexed
    sample found at another offset than the index says, are a `ShardIntegrityError`: retried
    for a remote shard, then an error under missing="error" or a counted skip."""
    stop = ref.num_samples if stop is None else min(stop, ref.num_samples)
    retry = retry or Retry()
    nxt = start  # position of the next sample still to deliver
    failures = 0
    error: Exception | None = None
    checked = bool(ref.digests)

    def excluded(p: int) -> bool:
        return keep is not None and not keep(ref.offset + p)

    while nxt < stop:
        error, before = None, nxt
        first, byte = entry(ref, nxt)
        src: BlockReader | None = None
        pending: list[tuple[int, dict | None]] = []  # read, their block not checked yet
        seen = first  # positions read from this open
        try:
            counter.reading(f"{ref.url} from byte {byte}")
            raw, at = open_url(ref.url, byte, retry=retry)
            src = BlockReader(
                raw, ref.url, at, ref.offsets, ref.size, ref.digests, seekable=not ref.verify_all
            )
            with raw:
                if at < byte:  # a pipe starts at 0
                    _drop(src, byte - at, ref.url)
                # late binding on purpose: the skip rule follows `nxt` as samples are delivered
                skip = _skipper(ref, first, lambda: nxt, stop, excluded)  # noqa: B023
                for j, (at_j, sample) in enumerate(read_samples(src, ref.url, byte, skip=skip)):
                    p, seen = first + j, first + j + 1
                    _check_offset(ref, p, at_j)
                    if p >= stop:
                        break
                    if p >= nxt:
                        pending.append((p, sample))
                    while pending and src.closed_before(pending[0][0] // (ref.every or 1)):
                        nxt, _ = pending[0]
                        yield from _deliver(ref, counter, src, *pending.pop(0))
                        nxt += 1
                if checked and seen < stop:
                    raise ShardIntegrityError(
                        f"{ref.url}: ends after {seen} samples, the manifest says {ref.num_samples}"
                    )
                if pending:
                    src.finish_block()
                while pending:
                    nxt, _ = pending[0]
                    yield from _deliver(ref, counter, src, *pending.pop(0))
                    nxt += 1
                break  # the shard (or the range) ended: short ends are counted below
        except TarFormatError as e:
            error = e
            if byte > 0 and seen == first:  # the index pointed at no tar header
                error = ShardIntegrityError(
                    f"{ref.url}: no sample starts at byte {byte}, where the manifest's offset "
                    f"index says sample {first} does ({e})"
                )
        except (OSError, ShardIntegrityError, UnicodeDecodeError, TimeoutError) as e:
            error = e
        except Exception as e:  # e.g. aiohttp's errors, which are not OSErrors
            if not ref.remote:
                raise
            error = e
        finally:
            if src is not None:
                counter.add(bytes_read=src.bytes)
        if ref.remote and note_no_range(error, ref.url):  # reopened from byte 0: not a failure
            continue
        failures = 1 if nxt > before else failures + 1  # a try that moved on starts afresh
        retryable = ref.remote and not is_missing(error)
        if not retryable or failures >= retry.attempts:
            break
        counter.add(retries=1)
        log.warning(
            "%s: read failed (%s); retrying from sample %d",
            ref.url,
            reason(error),  # type: ignore[arg-type]
            nxt,
        )
        time.sleep(retry.backoff * 2 ** (failures - 1))
    if error is None and nxt >= stop:
        return
    _stopped_short(ref, counter, error, start, nxt, stop, keep, retry, missing)


def entry(ref: ShardRef, nxt: int) -> tuple[int, int]:
    """Where a read that must reach sample `nxt` opens the shard: (position, byte) of the
    last indexed sample at or before it, or the shard's start without an index."""
    anchor = min(nxt // ref.every, len(ref.offsets) - 1) if ref.every and ref.offsets else -1
    first = anchor * ref.every if anchor >= 0 else 0
    byte = ref.offsets[anchor] if anchor >= 0 else 0
    return first, byte


def _stopped_short(
    ref: ShardRef,
    counter: ReadCounter,
    error: Exception | None,
    start: int,
    nxt: int,
    stop: int,
    keep: Callable[[int], bool] | None,
    retry: Retry,
    missing: Literal["error", "skip"],
) -> None:
    """A read of start..stop-1 that gave up at `nxt` (`error`, or None if the shard ended
    early): raise under missing="error" where that applies, else count the lost samples and
    the shard error and log the skip."""
    lost = range(ref.offset + nxt, ref.offset + stop)
    n_lost = sum(1 for i in lost if keep is None or keep(i))
    why = reason(error) if error is not None else "ended early"
    if missing == "error" and isinstance(error, ShardIntegrityError):
        raise ShardReadError(
            f"{error}; nothing of it was trained on. Restore the shard or its manifest, or set "
            "data.missing_shards=skip to train on without it"
        )
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


def _skipper(
    ref: ShardRef,
    first: int,
    nxt: Callable[[], int],
    stop: int,
    excluded: Callable[[int], bool],
) -> Callable[[int], bool]:
    """Which samples of a read from position `first` pass unread (`read_samples`'s `skip`).

    Unchecked, all but the wanted ones (nxt()..stop-1, not excluded). Checked, a block's bytes
    must all pass to be hashed: only excluded samples in range, and those in blocks after the
    one holding sample stop-1."""
    if not ref.digests:
        return lambda j: not (nxt() <= first + j < stop and not excluded(first + j))
    last_block = (stop - 1) // ref.every

    def skip(j: int) -> bool:
        p = first + j
        return (nxt() <= p < stop and excluded(p)) or (p >= stop and p // ref.every > last_block)

    return skip


def _check_offset(ref: ShardRef, p: int, at: int) -> None:
    """An indexed sample must start where the manifest's index says."""
    if ref.every and p % ref.every == 0 and p // ref.every < len(ref.offsets):
        if at != ref.offsets[p // ref.every]:
            raise ShardIntegrityError(
                f"{ref.url}: sample {p} starts at byte {at}, the manifest's offset index says "
                f"{ref.offsets[p // ref.every]}; the shard and its manifest disagree"
            )


def _deliver(
    ref: ShardRef, counter: ReadCounter, src: Any, p: int, sample: dict | None
) -> Iterator[dict]:
    if sample is None:  # passed over (not wanted) or without members
        return
    counter.add(samples_read=1)
    if ref.digests and p // ref.every in src.unverified:
        counter.add(unverified=1)
    sample["__index__"] = ref.offset + p
    yield sample
