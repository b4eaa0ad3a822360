"""Deterministic tar shards: fixed member metadata, atomic parts, verifiable group records.

A *group* is a fixed run of planned items (`--shard-size` of them) that one job writes as one or
more *parts* (a part closes early when `--shard-bytes` would be exceeded). Each part is written to
a hidden temporary name, fsynced and renamed; then the group's record (part names, counts, bytes,
sha256, skipped inputs, pixel statistics) is written atomically. The record is the commit point:
on a rerun a group whose record and parts verify is kept, anything else is rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from json.encoder import encode_basestring_ascii as _json_str
from pathlib import Path
from typing import Any

import numpy as np

from ssl_vit.data.imaging import histogram_stats
from ssl_vit.io import atomic_write_text, sha256_file

_BLOCK = 512
_END = b"\0" * (2 * _BLOCK)  # two zero blocks end a tar archive


# ustar header fields after the name (offset 100) up to the size (124), and after the size (136).
_MODE_IDS = b"0000644\0" + b"0000000\0" + b"0000000\0"  # mode 0644, uid 0, gid 0
_MTIME = b"00000000000\0"  # mtime 0: no wall clock in the bytes
_TAIL = b"0" + b"\0" * 100 + b"ustar\x0000" + b"\0" * (_BLOCK - 265)  # regular file, no link
_FIXED_SUM = sum(_MODE_IDS) + sum(_MTIME) + sum(_TAIL) + 8 * 32  # checksum field counts as spaces


def tar_header(name: str, size: int) -> bytes:
    """One ustar member header (uid/gid 0, mode 0644, mtime 0, empty owner names).

    Written by hand for speed (tarfile's `tobuf` costs as much as encoding a 28x28 PNG); the
    bytes equal tarfile's USTAR output for the same fields
    (tests/test_data_prep_jobs.py::test_hand_written_tar_bytes_equal_tarfile_ustar).
    """
    raw = name.encode("ascii")
    if len(raw) > 100 or size >= 8**11:
        raise ValueError(f"tar member {name!r} too long or too large ({size} bytes)")
    size_field = b"%011o\0" % size
    checksum = b"%06o\0 " % (_FIXED_SUM + sum(raw) + sum(size_field))
    return b"".join((raw.ljust(100, b"\0"), _MODE_IDS, size_field, _MTIME, checksum, _TAIL))


def sample_meta(source: str, original_size: tuple[int, int]) -> bytes:
    """The {key}.json member: {"source": ..., "original_size": [H, W]} (hand-formatted: fast)."""
    h, w = original_size
    return b'{"source": %s, "original_size": [%d, %d]}' % (_json_str(source).encode(), h, w)


def sample_members(
    key: str, ext: str, data: bytes, label: int | None, meta: bytes
) -> list[tuple[str, bytes]]:
    """The tar members of one sample, in sorted name order (cls < jpg < json < png < webp)."""
    info = (f"{key}.json", meta)
    image = (f"{key}.{ext}", data)
    members = [image, info] if ext == "jpg" else [info, image]
    if label is not None:
        members.insert(0, (f"{key}.cls", b"%d" % label))
    return members


def sample_blob(members: list[tuple[str, bytes]]) -> bytes:
    """The archive bytes of a sample's members: header, data, zero padding to a block."""
    out = []
    for name, data in members:
        out += (tar_header(name, len(data)), data, _ZEROS[: -len(data) % _BLOCK])
    return b"".join(out)


_ZEROS = bytes(_BLOCK)
_FLUSH = 4 << 20  # write in 4 MiB pieces: few syscalls, bounded memory


@functools.cache
def _io() -> ThreadPoolExecutor:
    """One background thread writes and hashes full buffers (both release the GIL), so disk
    and sha256 overlap with encoding; at most one buffer is in flight, which bounds memory."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-io")


def shutdown_io() -> None:
    """Join the writer thread, if one was made (call before forking worker processes again)."""
    if _io.cache_info().currsize:
        _io().shutdown(wait=True)
        _io.cache_clear()


class _PartFile:
    """A tar being written to a temporary name, hashed as it goes."""

    def __init__(self, tmp: Path, final: Path) -> None:
        self.tmp, self.final = tmp, final
        self.f = open(tmp, "wb")
        self.h = hashlib.sha256()
        self.buf = bytearray()
        self.pending: Future | None = None
        self.bytes = self.num_samples = 0

    def write(self, blob: bytes) -> None:
        self.buf += blob
        self.bytes += len(blob)
        if len(self.buf) >= _FLUSH:
            self._flush()

    def _put(self, chunk: bytes) -> None:
        self.f.write(chunk)
        self.h.update(chunk)

    def _flush(self) -> None:
        if self.pending is not None:
            self.pending.result()  # keeps order and surfaces write errors (disk full)
        self.pending = _io().submit(self._put, bytes(self.buf))
        self.buf.clear()

    def close(self) -> None:
        self.write(_END)
        self._flush()
        self.pending.result()  # type: ignore[union-attr]
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


@dataclass
class PartInfo:
    name: str
    num_samples: int
    bytes: int
    sha256: str


@dataclass
class GroupRecord:
    split: str
    group: int
    items_sha: str  # identifies the planned inputs; a changed source invalidates the group
    parts: list[PartInfo]
    errors: list[dict[str, str]]
    stats: dict[str, Any] | None  # {"pixels": n, "sums": [...], "squares": [...]} (train only)
    image_size: list[int] | None  # [H, W] when every sample has it
    mixed_sizes: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return sum(p.num_samples for p in self.parts)


def group_stem(split: str, group: int) -> str:
    return f"{split}-g{group:06d}"


def record_path(work: Path, split: str, group: int) -> Path:
    return work / f"{group_stem(split, group)}.json"


class GroupWriter:
    """Write one group's samples into parts of at most `max_bytes` bytes."""

    def __init__(self, work: Path, split: str, group: int, items_sha: str, max_bytes: int) -> None:
        self.work, self.split, self.group = work, split, group
        self.items_sha, self.max_bytes = items_sha, max_bytes
        self.stem = group_stem(split, group)
        for stale in work.glob(f".{self.stem}-*"):  # temporaries of a killed earlier attempt
            stale.unlink(missing_ok=True)
        self.parts: list[_PartFile] = []
        self.errors: list[dict[str, str]] = []
        self.sizes: set[tuple[int, int]] = set()
        self.hists: list[list[int]] = []  # per-sample histograms, folded in batches
        self.hist: np.ndarray | None = None  # (C * 256,) int64 counts of this group

    def _new_part(self) -> _PartFile:
        name = f"{self.stem}-p{len(self.parts):03d}.tar"
        part = _PartFile(self.work / f".{name}.tmp{os.getpid()}", self.work / name)
        self.parts.append(part)
        return part

    def add(self, members: list[tuple[str, bytes]], size: tuple[int, int]) -> None:
        blob = sample_blob(members)
        part = self.parts[-1] if self.parts else self._new_part()
        if part.num_samples and part.bytes + len(blob) + len(_END) > self.max_bytes:
            part.close()
            part = self._new_part()
        part.write(blob)
        part.num_samples += 1
        self.sizes.add(size)

    def add_histogram(self, hist: list[int]) -> None:
        self.hists.append(hist)
        if len(self.hists) >= 1024:
            self._fold()

    def _fold(self) -> None:
        if self.hists:
            # zip(*) + sum runs in C on Python ints: ~3x cheaper than converting to numpy.
            total = np.array(list(map(sum, zip(*self.hists, strict=True))), dtype=np.int64)
            self.hist = total if self.hist is None else self.hist + total
            self.hists.clear()

    def finish(self) -> GroupRecord:
        infos = []
        for part in self.parts:
            if not part.f.closed:
                part.close()
            os.replace(part.tmp, part.final)
            infos.append(
                PartInfo(part.final.name, part.num_samples, part.bytes, part.h.hexdigest())
            )
        size = next(iter(self.sizes)) if len(self.sizes) == 1 else None
        self._fold()
        stats = None if self.hist is None else histogram_stats(self.hist)
        rec = GroupRecord(
            self.split,
            self.group,
            self.items_sha,
            infos,
            self.errors,
            stats,
            list(size) if size else None,
            mixed_sizes=len(self.sizes) > 1,
        )
        atomic_write_text(record_path(self.work, self.split, self.group), json.dumps(asdict(rec)))
        return rec


def load_record(work: Path, split: str, group: int) -> GroupRecord | None:
    path = record_path(work, split, group)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw["parts"] = [PartInfo(**p) for p in raw["parts"]]
        return GroupRecord(**raw)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def verify_record(work: Path, rec: GroupRecord, items_sha: str, *, hash_parts: bool = True) -> bool:
    """True when the record belongs to these inputs and every part is intact."""

    def intact(p: PartInfo) -> bool:
        path = work / p.name
        if not path.is_file() or path.stat().st_size != p.bytes:
            return False
        return not hash_parts or sha256_file(path) == p.sha256

    return rec.items_sha == items_sha and all(intact(p) for p in rec.parts)
