"""Block checksums: every byte a reader takes from a shard is checked against its manifest.

The manifest's offset index cuts each shard into blocks: block k is the bytes from the start of
sample k * index_every to the start of the next indexed sample (the last block runs to the end
of the file, tar padding included). `block_sha256` lists each block's sha256. A reader that
starts at an indexed sample (ssl_vit.data.shards) hashes what it reads through `BlockReader`;
when a block's last byte has passed, its digest must match before any sample of that block
leaves the reader. A wrong offset, a byte changed on the server between two reads, or a file
shorter than the manifest says therefore stops the read instead of reaching training.

What is not verified: a block in which the reader seeks past bytes (samples held out of
training passed over without reading them) cannot be hashed; its samples are counted as
unverified. `data.verify=all` reads those bytes too, so every sample is verified.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import IO


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
