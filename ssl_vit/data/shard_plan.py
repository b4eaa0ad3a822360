"""From a source listing to a deterministic plan: split, key, order and group of every item.

Everything here is a pure function of the inputs' relative paths and the options, never of file
system order, worker count or job count, which is what makes reruns, resumes and multi-machine
jobs produce the same bytes.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ssl_vit.data.imaging import ImageOptions
from ssl_vit.data.sources import Item, Listing

SPLIT_ORDER = ("train", "val", "test")
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass(frozen=True)
class ShardOptions:
    """Every option that changes the bytes of the shard set (recorded in the manifest)."""

    image: ImageOptions = field(default_factory=ImageOptions)
    seed: int = 0
    val_fraction: float = 0.0
    test_fraction: float = 0.0
    shard_size: int | None = 5000  # samples per shard (at most); None when num_shards is set
    shard_bytes: int = 1 << 30  # bytes per shard (at most; one oversized sample still fits)
    follow_symlinks: bool = False
    labels: bool = True
    class_names: tuple[str, ...] | None = None
    num_shards: int | None = None  # instead of shard_size: each split in this many shards

    def __post_init__(self) -> None:
        if self.num_shards is not None:
            if self.num_shards < 1:
                raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
            # num_shards replaces shard_size: recording both would name a size never used.
            object.__setattr__(self, "shard_size", None)
        elif self.shard_size is None or self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {self.shard_size}")

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["class_names"] = list(self.class_names) if self.class_names else None
        if self.num_shards is None:  # absent, not null: older shard sets' options stay equal
            del body["num_shards"]
        return body


@dataclass
class Group:
    split: str
    index: int  # within the split
    items: list[Item]
    keys: list[str]
    items_sha: str


def assign_split(rel: str, fixed: str | None, val_fraction: float, test_fraction: float) -> str:
    """A stable function of the relative path: adding files never moves existing ones.

    Items whose source fixes the split (IDX files, split folders, a list's split column) keep it,
    except that val/test fractions may carve a held-out part out of a fixed "train" split.
    """
    if fixed not in (None, "train"):
        return fixed
    if val_fraction == 0 and test_fraction == 0:
        return fixed or "train"
    digest = hashlib.sha256(f"ssl-vit-split\0{rel}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1), independent of --seed
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"


def make_key(rel: str) -> str:
    """A WebDataset-safe key: no dots or slashes; readable stem plus a hash for uniqueness."""
    stem = rel.rsplit(".", 1)[0] if "." in rel.rsplit("/", 1)[-1] else rel
    readable = _KEY_UNSAFE.sub("_", stem).strip("_")[-48:].lstrip("_-")
    digest = hashlib.sha1(rel.encode()).hexdigest()[:10]
    return f"{readable}_{digest}" if readable else digest


def _bounds(split: str, n: int, opts: ShardOptions) -> list[int]:
    """Where a split of n ordered items is cut into groups: [0, ..., n].

    `shard_size`: full groups and a smaller last one. `num_shards` N: N groups whose sizes differ
    by at most one (so N streams get nearly equal work). Fewer than N train samples is an error,
    as then some training stream could not get a shard of its own; another split with fewer
    than N samples gets one per sample (held-out splits are read by contiguous ranges, whatever
    their shard count).
    """
    if opts.num_shards is None:
        assert opts.shard_size is not None
        return [*range(0, n, opts.shard_size), n]
    if split == "train" and n < opts.num_shards:
        raise ValueError(
            f"--num-shards {opts.num_shards} is more than the {n} samples of the train split; "
            f"use at most {n} (every shard needs a sample)"
        )
    k = min(opts.num_shards, n)
    return [i * n // k for i in range(k + 1)]


def make_plan(listing: Listing, opts: ShardOptions) -> list[Group]:
    """Groups per split (see `_bounds` for their sizes), in a seeded shuffled order."""
    by_split: dict[str, list[tuple[bytes, str, Item]]] = {}
    seed = f"ssl-vit-order{opts.seed}".encode()[:64]
    for it in listing.items:
        split = assign_split(it.rel, it.split, opts.val_fraction, opts.test_fraction)
        # Seeded shuffle as a sort by a keyed hash: stable when files are added elsewhere.
        rank = hashlib.blake2b(it.rel.encode(), digest_size=8, key=seed).digest()
        by_split.setdefault(split, []).append((rank, it.rel, it))
    names = [s for s in SPLIT_ORDER if s in by_split] + sorted(set(by_split) - set(SPLIT_ORDER))
    groups: list[Group] = []
    seen: dict[str, str] = {}
    for split in names:
        ordered = [it for _, _, it in sorted(by_split[split], key=lambda t: (t[0], t[1]))]
        bounds = _bounds(split, len(ordered), opts)
        for gi, (start, stop) in enumerate(zip(bounds, bounds[1:], strict=False)):
            chunk = ordered[start:stop]
            keys = [it.key or make_key(it.rel) for it in chunk]
            for k, it in zip(keys, chunk, strict=True):
                if k in seen:
                    raise ValueError(f"{it.rel}: key {k} collides with {seen[k]}; rename one file")
                seen[k] = it.rel
            lines = "".join(
                f"{k}\0{it.rel}\0{it.label}\n" for k, it in zip(keys, chunk, strict=True)
            ).encode()
            groups.append(Group(split, gi, chunk, keys, hashlib.sha256(lines).hexdigest()))
    return groups
