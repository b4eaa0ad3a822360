"""Reading shards fast and checked: a tar file's members, grouped into samples of raw bytes,
read through `BlockReader`, which checks every byte against the manifest's block checksums.

Python's tarfile (webdataset's reader) parses every header field of every member, which costs
more per tiny sample than decoding it; this reader parses only what a shard needs (name, size,
type, checksum) and groups members as webdataset does: the key is the path up to the first dot
of the file name, the rest (lower-cased) names the field (`benchmarks/loader.py` compares them).
It is also what lets a stream start at an indexed sample offset and check each block read
against the manifest, which webdataset's reader cannot (benchmarks/tar_io.py measures both on
224-px JPEGs). The writer is ssl_vit/data/shard_writer.py (USTAR); GNU long names and pax `path`
records are read too, other member types are skipped. What a block is, what a reader verifies
and what it cannot: docs/streaming.md ("Bytes").
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

BLOCK = 512
# Limits that a damaged or hostile tar meets before any read of that size. A member is one
# image, label or metadata file of a sample: a 1e8-pixel image (make_shards' --max-pixels)
# is far below 1 GiB even uncompressed.
MAX_MEMBER = 1 << 30
MAX_META = 1 << 20  # a GNU long name or a pax header: a few KiB in any real archive
# One sample is held in memory whole: an image with its label and metadata, a few members in
# any real set. A tar that keeps one key across more members or bytes is refused, not gathered.
MAX_SAMPLE_MEMBERS = 256
MAX_SAMPLE_BYTES = MAX_MEMBER
_CHUNK = 1 << 24  # larger members are read in pieces: a stream cut short allocates no more
_UNKNOWN_END = 1 << 62  # the end of a stream that cannot seek: only MAX_MEMBER bounds a member


class TarFormatError(ValueError):
    """The bytes are not a readable tar file (bad header, checksum, or cut short)."""


def _number(field: bytes, what: str, path: str | Path, at: int) -> int:
    """A header's octal number field, or GNU base-256 (a first byte of 0x80) for numbers octal
    cannot hold. Never negative: base-256's negative form (0xff) and signs are refused."""
    if field[:1] and field[0] & 0x80:
        if field[0] == 0x80:
            return int.from_bytes(field[1:], "big")
    else:
        text = field.split(b"\0", 1)[0].strip()
        if not text:
            return 0
        if text.isdigit():  # int() alone would also take "-1", "+7" and "1_0"
            try:
                return int(text, 8)
            except ValueError:  # an 8 or a 9
                pass
    raise TarFormatError(
        f"{path}: the tar header at byte {at} has a bad {what} field ({field!r})"
    ) from None


def _pax_path(data: bytes, path: str | Path, at: int) -> str | None:
    """The `path` record of a pax extended header ("<len> <key>=<value>\\n" records, where
    len counts the whole record): the last one, as tarfile reads it. Every record must parse,
    so each one moves the position forward and the loop ends."""
    found: bytes | None = None
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)  # a length of at most 20 digits
        digits = data[pos:space] if space > pos else b""
        length = int(digits) if digits.isdigit() else 0
        end = pos + length
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if length < len(digits) + 4 or end > len(data) or data[end - 1] != 0x0A or not (key and eq):
            raise TarFormatError(
                f"{path}: the pax header at byte {at} has a malformed record at its byte {pos} "
                f"({data[pos : pos + 40]!r})"
            )
        if key == b"path":
            found = value
        pos = end
    if found is None:
        return None
    try:
        return found.decode("utf-8")
    except UnicodeDecodeError:
        raise TarFormatError(
            f"{path}: the pax header at byte {at} has a path that is not UTF-8 ({found[:60]!r})"
        ) from None


def _stream_end(f, pos: int) -> int:
    """The archive offset of the end of `f` (at archive offset `pos`), from one seek to its end
    and back; _UNKNOWN_END where that fails."""
    try:
        here = f.seek(0, 1)
        end = f.seek(0, 2)
        f.seek(here)
    except (OSError, ValueError):
        return _UNKNOWN_END
    return end - here + pos


def iter_members(
    f, path: str | Path, pos: int = 0, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, bytes | None, int]]:
    """(name, contents, header offset) of each regular file in the tar stream `f`, which is at
    byte `pos` of the archive. A member whose name `wanted` refuses is passed over unread
    (contents None): seeked past where `f` can seek, read and dropped where it cannot.

    Whatever the bytes, it ends or raises TarFormatError: every header moves on by at least a
    block, and a declared size beyond MAX_MEMBER (MAX_META for names) or beyond the end of a
    seekable `f` is refused before anything of that size is read."""
    long_name: str | None = None
    seekable = f.seekable() if hasattr(f, "seekable") else False
    end = _stream_end(f, pos) if seekable else _UNKNOWN_END
    chain: int | None = None  # header offset of a long-name record before the member
    while True:
        at = pos if chain is None else chain
        header = f.read(BLOCK)
        if not header or header.count(0) == BLOCK:  # end of archive (or of a cut-off file)
            if seekable and not header and end < pos:  # seeked past the end
                raise TarFormatError(f"{path}: cut short inside a member")
            return
        if len(header) < BLOCK:
            raise TarFormatError(f"{path}: cut short inside a tar header")
        here = pos
        pos += BLOCK
        stored = _number(header[148:156], "checksum", path, here)
        if stored != sum(header) - sum(header[148:156]) + 8 * 32:  # the field counts as spaces
            raise TarFormatError(f"{path}: a tar header's checksum does not match (corrupt)")
        size = _number(header[124:136], "size", path, here)
        if size > MAX_MEMBER:
            raise TarFormatError(
                f"{path}: the tar header at byte {here} declares {size} bytes, more than a "
                f"shard member may hold ({MAX_MEMBER})"
            )
        if size > end - pos:
            raise TarFormatError(
                f"{path}: cut short inside a member (the header at byte {here} declares "
                f"{size} bytes, {end - pos} are left)"
            )
        kind = header[156:157]
        padded = size + (-size % BLOCK)
        if kind == b"0" or kind == b"\0":
            name = long_name
            if name is None:
                raw = header[:100].split(b"\0", 1)[0]
                if header[257:262] == b"ustar" and header[345]:  # a ustar prefix (a folder)
                    raw = header[345:500].split(b"\0", 1)[0] + b"/" + raw
                try:
                    name = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise TarFormatError(
                        f"{path}: the tar header at byte {here} has a name that is not UTF-8 "
                        f"({raw[:60]!r})"
                    ) from None
            if wanted is not None and not wanted(name):
                _pass(f, padded, seekable, path)
                pos += padded
                long_name, chain = None, None
                yield name, None, at
                continue
        elif kind != b"L" and kind != b"x":  # directories, links, global pax headers...
            _pass(f, padded, seekable, path)
            pos += padded
            long_name, chain = None, None
            continue
        elif size > MAX_META:
            raise TarFormatError(
                f"{path}: the {'GNU long name' if kind == b'L' else 'pax header'} at byte {here} "
                f"declares {size} bytes, more than one may hold ({MAX_META})"
            )
        data = f.read(size) if size <= _CHUNK else _read_big(f, size)
        if len(data) < size:
            raise TarFormatError(f"{path}: cut short inside a member ({len(data)} of {size} bytes)")
        f.read(padded - size)  # padding to the next block
        pos += padded
        if kind == b"L":  # GNU: the next member's long name
            try:
                long_name = data.split(b"\0", 1)[0].decode("utf-8")
            except UnicodeDecodeError:
                raise TarFormatError(
                    f"{path}: the GNU long name at byte {here} is not UTF-8 ({data[:60]!r})"
                ) from None
            chain = at
            continue
        if kind == b"x":  # pax: the next member's attributes
            long_name, chain = _pax_path(data, path, here) or long_name, at
            continue
        long_name, chain = None, None
        yield name, data, at


def _pass(f, n: int, seekable: bool, path: str | Path) -> None:
    """Move on n bytes without keeping them: a seek where `f` can, else read and dropped."""
    if seekable:
        f.seek(n, 1)
    else:
        _drop(f, n, path)


def _read_big(f, size: int) -> bytes:
    """`size` bytes of `f` (fewer where it ends first), read in _CHUNK pieces: a stream that
    declares a large member but ends early never has the whole size allocated."""
    parts = []
    while size > 0:
        part = f.read(min(size, _CHUNK))
        if not part:
            break
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


def _drop(f, n: int, path: str | Path) -> None:
    """Read and discard n bytes of a stream that cannot seek."""
    while n > 0:
        chunk = f.read(min(n, 1 << 20))
        if not chunk:
            raise TarFormatError(f"{path}: cut short inside a member")
        n -= len(chunk)


def sample_key(name: str) -> tuple[str, str] | None:
    """("dir/key", "ext.more") of a member name, or None when it has no extension: what
    webdataset's pattern `^((?:.*/|)[^.]+)[.]([^/]*)$` gives, found in linear time (the pattern
    backtracks quadratically on a long name of slashes with no dot after the last one).

    The key ends at the first dot after the last slash. The pattern matches when the text
    between that dot and some earlier slash (or the start) holds no dot and is not empty; the
    slash must lie on the name's first line, as `.*` stops at a line end."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot > slash + 1 and "\n" not in name:  # the usual name: "dir/key.ext"
        return name[:dot], name[dot + 1 :].lower()
    if dot <= 0:
        return None
    newline = name.find("\n")
    start = name.rfind("/", 0, dot - 1 if newline < 0 else min(dot - 1, newline)) + 1
    if "." in name[start:dot]:
        return None
    return name[:dot], name[dot + 1 :].lower()


def read_samples(
    f,
    path: str | Path,
    pos: int = 0,
    skip: Callable[[int], bool] | None = None,
    partial: bool = False,
) -> Iterator[tuple[int, dict | None]]:
    """(byte offset, sample) of each sample of the tar stream `f` (at byte `pos`), as
    webdataset makes them: {"__key__", "__url__", ext: bytes}. `skip(i)` true for the i-th
    sample of the stream (0-based) passes over it unread: its sample is None. A sample without
    members (a name with no extension) is None too.

    Raises TarFormatError where the stream stops being a readable tar, after yielding the
    samples before the one it was reading (whose start offset is the last offset yielded plus
    that sample: callers that retry start again there); with `partial`, that sample too, as
    far as it was read (it may lack a member), as webdataset does."""
    sample: dict | None = None
    start, i, members, held = pos, -1, 0, 0
    state = {"skipping": False}

    def wanted(name: str) -> bool:
        parsed = sample_key(name)
        key = parsed[0] if parsed else None
        if key is not None and (sample is None or key != sample["__key__"]):
            state["skipping"] = skip is not None and skip(i + 1)
        return not state["skipping"]

    try:
        for name, data, at in iter_members(f, path, pos, wanted if skip is not None else None):
            parsed = sample_key(name)
            if parsed is None:  # no extension: not part of a sample
                continue
            key, ext = parsed
            if sample is None or key != sample["__key__"]:
                if sample is not None:
                    yield start, _done(sample)
                sample, start, i = {"__key__": key, "__url__": str(path)}, at, i + 1
                members = held = 0
                if data is None:
                    sample["__skipped__"] = True
            if data is None:
                continue
            if ext in sample:
                raise TarFormatError(f"{path}: {name} appears twice in one sample")
            members, held = members + 1, held + len(data)
            if members > MAX_SAMPLE_MEMBERS or held > MAX_SAMPLE_BYTES:
                raise TarFormatError(
                    f"{path}: the sample {key!r} at byte {start} goes past {MAX_SAMPLE_MEMBERS} "
                    f"members or {MAX_SAMPLE_BYTES} bytes at {name}; a sample is one image "
                    "with its label and metadata: rewrite the shard with data_prep/make_shards.py"
                )
            sample[ext] = data
    except TarFormatError:
        if partial and sample is not None and _done(sample) is not None:
            yield start, sample
        raise
    if sample is not None:
        yield start, _done(sample)


def _done(sample: dict) -> dict | None:
    """The sample, or None when it was passed over or has no member."""
    return None if "__skipped__" in sample or len(sample) <= 2 else sample


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
    with open(path, "rb", buffering=1 << 20) as f:
        yield from (s for _, s in read_samples(f, path, partial=True) if s is not None)


# Block checksums: every byte a reader takes from a shard is checked against its manifest.


class ShardIntegrityError(ValueError):
    """A shard's bytes disagree with its manifest (a block checksum, an offset, its length)."""


def block_digests(f: IO[bytes], offsets: Sequence[int], size: int) -> list[str]:
    """sha256 (hex) of each block of the file `f` of `size` bytes, cut at `offsets`."""
    bounds = [*offsets, size]
    digests = []
    f.seek(offsets[0] if offsets else 0)
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        h, left = hashlib.sha256(), hi - lo
        while left:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                raise ShardIntegrityError(f"file ends at byte {hi - left}, before byte {size}")
            h.update(chunk)
            left -= len(chunk)
        digests.append(h.hexdigest())
    return digests


class BlockReader:
    """A shard file at byte `pos`, read through: each block's bytes are hashed and checked
    against `digests` as its last byte passes (`ShardIntegrityError` on a mismatch).

    `seekable=False` makes the tar reader read and drop what it would otherwise seek past, so
    every block is hashed (`data.verify=all`). A seek leaves the blocks it touches unverified.
    Without `digests` (a set without block checksums) it checks nothing, holds nothing back and
    only counts the bytes read."""

    def __init__(
        self,
        f: IO[bytes],
        url: str,
        pos: int,
        offsets: Sequence[int],
        size: int,
        digests: Sequence[str],
        *,
        seekable: bool,
    ) -> None:
        self.f, self.url, self.pos, self.size = f, url, pos, size
        self.bounds = [*offsets, size]  # block k is bounds[k]..bounds[k+1]-1
        self.digests = digests
        self._seekable = seekable
        self.block = max(0, bisect.bisect_right(self.bounds, pos) - 1)  # block holding `pos`
        # entered in the middle of a block: its first bytes were not seen, it cannot verify
        self.hash = hashlib.sha256() if pos == self.bounds[self.block] else None
        self.unverified: set[int] = set()
        self.bytes = 0  # read from the source

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.bytes += len(data)
        view, i = memoryview(data), 0
        while i < len(view) and self.block < len(self.digests):
            take = min(len(view) - i, self.bounds[self.block + 1] - self.pos)
            if self.hash is not None:
                self.hash.update(view[i : i + take])
            self.pos += take
            i += take
            if self.pos == self.bounds[self.block + 1]:
                self._close()
        self.pos += len(view) - i  # past the last block: more bytes than the manifest says
        return data

    def _close(self) -> None:
        k = self.block
        if self.hash is None:
            self.unverified.add(k)
        elif self.hash.hexdigest() != self.digests[k]:
            raise ShardIntegrityError(
                f"{self.url}: bytes {self.bounds[k]}..{self.bounds[k + 1] - 1} (block {k}) do "
                "not match the manifest's block_sha256; the shard changed or its manifest is wrong"
            )
        self.block += 1
        self.hash = hashlib.sha256() if self.block < len(self.digests) else None

    def closed_before(self, block: int) -> bool:
        """Whether block `block` has been checked (or given up as unverified); every block is,
        without digests."""
        return self.block > block or not self.digests

    def finish_block(self) -> None:
        """Read to the end of the current block, so that it is checked (the end of the file for
        the last one); a file that ends first is an integrity error."""
        if self.block >= len(self.digests):
            return
        end = self.bounds[self.block + 1]
        while self.pos < end:
            if not self.read(min(end - self.pos, 1 << 20)):
                raise ShardIntegrityError(
                    f"{self.url}: ends at byte {self.pos}, the manifest says {self.size} bytes"
                )

    def seekable(self) -> bool:
        return self._seekable and (self.f.seekable() if hasattr(self.f, "seekable") else False)

    def seek(self, n: int, whence: int = 0) -> int:
        if whence == 2:  # where the end is (the tar reader asks once), staying where we are
            end = self.f.seek(n, 2)
            self.f.seek(self.pos)
            return end
        target = self.f.seek(n, whence)
        if target < self.pos:
            raise ValueError(f"{self.url}: a checked read only moves forward")
        if target != self.pos:  # the blocks passed over, and the one left early, go unverified
            while self.block < len(self.digests) and self.bounds[self.block + 1] <= target:
                self.hash = None
                self._close()
            inside = self.block < len(self.digests) and target != self.bounds[self.block]
            self.hash = None if inside or self.block >= len(self.digests) else hashlib.sha256()
            self.pos = target
        return target
