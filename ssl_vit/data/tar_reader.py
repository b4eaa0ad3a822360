"""Reading shards fast: a tar file's members, grouped into samples of raw bytes.

Python's tarfile (webdataset's reader) parses every header field of every member, which costs
more per tiny sample than decoding it; this reader parses only what a shard needs (name, size,
type, checksum) and groups members as webdataset does: the key is the path up to the first dot
of the file name, the rest (lower-cased) names the field (`benchmarks/loader.py` compares them).
The writer is ssl_vit/data/shard_writer.py (USTAR); GNU long names and pax `path` records are
read too, other member types are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

BLOCK = 512
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # "dir/key.ext.more" -> ("dir/key", "ext.more")


class TarFormatError(ValueError):
    """The bytes are not a readable tar file (bad header, checksum, or cut short)."""


def _number(field: bytes, what: str, path: str | Path) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256, for numbers octal cannot hold
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise TarFormatError(f"{path}: a tar header has a bad {what} field") from None


def _pax_path(data: bytes) -> str | None:
    """The `path` record of a pax extended header ("<len> path=<value>\\n" records)."""
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        if key == b"path":
            return value.decode("utf-8")
        pos += length
    return None


def iter_members(
    f, path: str | Path, pos: int = 0, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, bytes | None, int]]:
    """(name, contents, header offset) of each regular file in the tar stream `f`, which is at
    byte `pos` of the archive. A member whose name `wanted` refuses is passed over unread
    (contents None): seeked past where `f` can seek, read and dropped where it cannot."""
    long_name: str | None = None
    seekable = f.seekable() if hasattr(f, "seekable") else False
    chain: int | None = None  # header offset of a long-name record before the member
    while True:
        at = pos if chain is None else chain
        header = f.read(BLOCK)
        if not header or header.count(0) == BLOCK:  # end of archive (or of a cut-off file)
            if seekable and not header and f.seek(0, 2) < pos:  # seeked past the end
                raise TarFormatError(f"{path}: cut short inside a member")
            return
        if len(header) < BLOCK:
            raise TarFormatError(f"{path}: cut short inside a tar header")
        pos += BLOCK
        stored = _number(header[148:156], "checksum", path)
        if stored != sum(header) - sum(header[148:156]) + 8 * 32:  # the field counts as spaces
            raise TarFormatError(f"{path}: a tar header's checksum does not match (corrupt)")
        size = _number(header[124:136], "size", path)
        kind = header[156:157]
        name = long_name
        if kind in (b"0", b"\0") and name is None:
            name = header[:100].split(b"\0", 1)[0].decode("utf-8")
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
            if prefix:
                name = prefix.decode("utf-8") + "/" + name
        padded = size + (-size % BLOCK)
        if kind in (b"0", b"\0") and wanted is not None and not wanted(name):
            if seekable:
                f.seek(padded, 1)
            else:
                _drop(f, padded, path)
            pos += padded
            long_name, chain = None, None
            yield name, None, at
            continue
        data = f.read(size)
        if len(data) < size:
            raise TarFormatError(f"{path}: cut short inside a member ({len(data)} of {size} bytes)")
        f.read(padded - size)  # padding to the next block
        pos += padded
        if kind == b"L":  # GNU: the next member's long name
            long_name, chain = data.split(b"\0", 1)[0].decode("utf-8"), at
            continue
        if kind == b"x":  # pax: the next member's attributes
            long_name, chain = _pax_path(data) or long_name, at
            continue
        long_name, chain = None, None
        if kind not in (b"0", b"\0"):  # directories, links, global pax headers...
            continue
        yield name, data, at  # type: ignore[misc]


def _drop(f, n: int, path: str | Path) -> None:
    """Read and discard n bytes of a stream that cannot seek."""
    while n > 0:
        chunk = f.read(min(n, 1 << 20))
        if not chunk:
            raise TarFormatError(f"{path}: cut short inside a member")
        n -= len(chunk)


def sample_key(name: str) -> tuple[str, str] | None:
    """("dir/key", "ext.more") of a member name, or None when it has no extension."""
    match = _KEY.match(name)
    return None if match is None else (match.group(1), match.group(2).lower())


def read_samples(
    f, path: str | Path, pos: int = 0, skip: Callable[[int], bool] | None = None
) -> Iterator[tuple[int, dict | None]]:
    """(byte offset, sample) of each sample of the tar stream `f` (at byte `pos`), as
    webdataset makes them: {"__key__", "__url__", ext: bytes}. `skip(i)` true for the i-th
    sample of the stream (0-based) passes over it unread: its sample is None.

    Raises TarFormatError where the stream stops being a readable tar, after yielding the
    samples before the one it was reading (whose start offset is the last offset yielded plus
    that sample: callers that retry start again there)."""
    sample: dict | None = None
    start, i = pos, -1
    state = {"skipping": False}

    def wanted(name: str) -> bool:
        parsed = sample_key(name)
        key = parsed[0] if parsed else None
        if key is not None and (sample is None or key != sample["__key__"]):
            state["skipping"] = skip is not None and skip(i + 1)
        return not state["skipping"]

    for name, data, at in iter_members(f, path, pos, wanted if skip is not None else None):
        parsed = sample_key(name)
        if parsed is None:  # no extension: not part of a sample
            continue
        key, ext = parsed
        if sample is None or key != sample["__key__"]:
            if sample is not None:
                yield start, (None if sample.get("__skipped__") else _done(sample))
            sample, start, i = {"__key__": key, "__url__": str(path)}, at, i + 1
            if data is None:
                sample["__skipped__"] = True
        if data is None:
            continue
        if ext in sample:
            raise TarFormatError(f"{path}: {name} appears twice in one sample")
        sample[ext] = data
    if sample is not None:
        yield start, (None if sample.get("__skipped__") else _done(sample))


def _done(sample: dict) -> dict | None:
    return sample if len(sample) > 2 else None


def sample_offsets(f, every: int, path: str | Path = "<tar>") -> list[int]:
    """Byte offsets (from the start of `f`) of samples 0, every, 2 * every, ... of a tar: what
    the manifest's index lists (ssl_vit.data.manifest). Only headers are read where `f` can
    seek. A sample starts at its first member's first header (a GNU long-name or pax record
    where one comes before it), so a reader that seeks there reads whole samples."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    f.seek(0)
    starts = read_samples(f, path, 0, skip=lambda i: True)
    return [at for i, (at, _) in enumerate(starts) if i % every == 0]


def iter_samples(path: str | Path) -> Iterator[dict]:
    """Samples of one local shard, as webdataset makes them: {"__key__", "__url__", ext: bytes}.

    Raises TarFormatError where the file stops being a readable tar, after yielding the sample
    read so far (it may lack a member; decoding it says so), as webdataset does."""
    sample: dict | None = None
    try:
        with open(path, "rb", buffering=1 << 20) as f:
            for name, data, _ in iter_members(f, path):
                parsed = sample_key(name)
                if parsed is None:  # no extension: not part of a sample
                    continue
                key, ext = parsed
                if sample is None or key != sample["__key__"]:
                    if sample is not None and len(sample) > 2:
                        yield sample
                    sample = {"__key__": key, "__url__": str(path)}
                if ext in sample:
                    raise TarFormatError(f"{path}: {name} appears twice in one sample")
                sample[ext] = data
    except TarFormatError:
        if sample is not None and len(sample) > 2:
            yield sample
        raise
    if sample is not None and len(sample) > 2:
        yield sample
