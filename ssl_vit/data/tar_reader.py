"""Reading shards fast: a tar file's members, grouped into samples of raw bytes.

webdataset reads a tar through Python's tarfile, which builds a TarInfo and parses every header
field of every member: on Fashion-MNIST shards (three tiny members per sample) that was about
110 us per sample on 2 cores, more than decoding and augmenting the image, and so a large part
of what the loader workers take from training on a small machine. This reader parses only what
a shard needs (name, size, type, checksum) and groups members as webdataset does: the key is the
path up to the first dot of the file name, the rest (lower-cased) names the field. Compared side
by side in `python benchmarks/loader.py`. The writer is ssl_vit/data/shard_writer.py (USTAR);
GNU long names and pax `path` records are read too, other member types are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
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


def iter_members(f, path: str | Path) -> Iterator[tuple[str, bytes]]:
    """(name, contents) of each regular file in the tar stream `f`, in order."""
    long_name: str | None = None
    while True:
        header = f.read(BLOCK)
        if not header or header.count(0) == BLOCK:  # end of archive (or of a cut-off file)
            return
        if len(header) < BLOCK:
            raise TarFormatError(f"{path}: cut short inside a tar header")
        stored = _number(header[148:156], "checksum", path)
        if stored != sum(header) - sum(header[148:156]) + 8 * 32:  # the field counts as spaces
            raise TarFormatError(f"{path}: a tar header's checksum does not match (corrupt)")
        size = _number(header[124:136], "size", path)
        data = f.read(size)
        if len(data) < size:
            raise TarFormatError(f"{path}: cut short inside a member ({len(data)} of {size} bytes)")
        f.read(-size % BLOCK)  # padding to the next block
        kind = header[156:157]
        if kind == b"L":  # GNU: the next member's long name
            long_name = data.split(b"\0", 1)[0].decode("utf-8")
            continue
        if kind == b"x":  # pax: the next member's attributes
            long_name = _pax_path(data) or long_name
            continue
        if kind not in (b"0", b"\0"):  # directories, links, global pax headers...
            long_name = None
            continue
        name = long_name
        if name is None:
            name = header[:100].split(b"\0", 1)[0].decode("utf-8")
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
            if prefix:
                name = prefix.decode("utf-8") + "/" + name
        long_name = None
        yield name, data


def iter_samples(path: str | Path) -> Iterator[dict]:
    """Samples of one shard, as webdataset makes them: {"__key__", "__url__", ext: bytes}.

    Raises TarFormatError where the file stops being a readable tar, after yielding the sample
    read so far (it may lack a member; decoding it says so), as webdataset does."""
    sample: dict | None = None
    try:
        with open(path, "rb", buffering=1 << 20) as f:
            for name, data in iter_members(f, path):
                match = _KEY.match(name)
                if match is None:  # no extension: not part of a sample
                    continue
                key, ext = match.group(1), match.group(2).lower()
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
