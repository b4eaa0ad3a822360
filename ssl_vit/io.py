"""Atomic file writes: the one implementation every module uses.

A file is written to a hidden temporary sibling, flushed, fsynced and renamed over its final
name, so a reader (a resumed run, another rank, an eval) sees the old file or the whole new
one, never a half-written file it would trust. An append (a metric line) is all or nothing
too. A failed write (a full disk) raises an OSError that names the file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["append_text", "atomic_open", "atomic_write_bytes", "atomic_write_text", "sha256_file"]


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of `path` for writing; on a clean exit fsync and rename it to
    `path`, on an error remove it (the old `path`, if any, stays)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    encoding = None if "b" in mode else "utf-8"
    try:
        with _naming(path), open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append `text` to `path` whole or not at all: a write that fails part-way (a full disk)
    cuts the file back to where it was, so a reader never meets half a line."""
    data = text.encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        with _naming(path):
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
    finally:
        os.close(fd)


# What a failing write to an open file says; it names no file. (Other errors inside a
# `with atomic_open(...)` body, such as a network read's, are not this file's.)
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}


@contextlib.contextmanager
def _naming(path: str | os.PathLike) -> Iterator[None]:
    """A failing write raises an OSError naming `path`."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno not in _WRITE_ERRNOS:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
