"""The shard-set contract: `manifest.json` beside `{split}-{index:06d}.tar` shards.

A shard set is a folder written by `data_prep/make_shards.py` and read by every later stage:

    OUT/
      train-000000.tar ...   # WebDataset shards: {key}.png|jpg|webp, {key}.cls, {key}.json
      test-000000.tar ...
      manifest.json          # this module's schema (below)
      errors.jsonl           # one JSON object per skipped input: {"source": ..., "reason": ...}

manifest.json (format_version 1):

    {
      "format": "ssl-vit-shards",
      "format_version": 1,
      "splits": {
        "train": {"num_samples": 60000,
                  "shards": [{"name": "train-000000.tar", "num_samples": 5000,
                              "bytes": 12345678, "sha256": "...",
                              "offsets": [0, 309248, ...],
                              "block_sha256": ["...", ...]}, ...]},
        "test": {...}
      },
      "class_names": ["T-shirt/top", ...],   # null for an unlabelled set
      "channels": 1,                         # 1 (grayscale) or 3 (RGB)
      "image_size": [28, 28],                # [H, W] when every image has it, else null
      "mean": [0.286], "std": [0.353],       # per channel, pixel values in [0, 1]
      "stats_split": "train",                # the split mean/std were computed on
      "num_skipped": 0,                      # lines in errors.jsonl
      "index_every": 100,                    # "offsets" holds every 100th sample's byte offset
      "created_by": {"tool": "...", "version": "...", "source": "...", "options": {...}}
    }

`offsets` (optional; shard sets made before it have none) is the byte offset in the tar of
samples 0, index_every, 2 * index_every, ... of the shard: a reader that starts inside a shard
seeks there (a ranged request for a remote shard) instead of reading the shard's head.
`block_sha256` (optional too) holds the sha256 of each block between consecutive offsets, the
last one running to the end of the file: what readers check every read against
(ssl_vit.data.blocks).

This module depends only on the standard library so data_prep runs without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ssl_vit.data.urls import is_missing, join, local_path, normalise_root, read_bytes, reason
from ssl_vit.io import atomic_write_text

FORMAT = "ssl-vit-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
ERRORS_NAME = "errors.jsonl"


class ManifestError(ValueError):
    """A shard set that is missing, malformed or inconsistent; the message says which file."""


@dataclass(frozen=True)
class ShardInfo:
    name: str
    num_samples: int
    bytes: int
    sha256: str
    offsets: list[int] | None = None  # byte offsets of samples 0, index_every, ... (see above)
    block_sha256: list[str] | None = None  # sha256 of the bytes between offsets (data.blocks)


@dataclass(frozen=True)
class SplitInfo:
    num_samples: int
    shards: list[ShardInfo]


@dataclass
class Manifest:
    splits: dict[str, SplitInfo]
    class_names: list[str] | None
    channels: int
    image_size: list[int] | None
    mean: list[float]
    std: list[float]
    stats_split: str | None = None
    num_skipped: int = 0
    index_every: int | None = None  # the stride of ShardInfo.offsets
    created_by: dict[str, Any] = field(default_factory=dict)
    root: str | None = field(default=None, compare=False)  # a local path or URL (data.urls)
    sha256: str | None = field(default=None, compare=False)  # of the manifest.json it was read from

    @property
    def num_classes(self) -> int | None:
        return None if self.class_names is None else len(self.class_names)

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            where = join(self.root, MANIFEST_NAME) if self.root else MANIFEST_NAME
            raise ManifestError(
                f"{where}: no split {name!r}; it has {sorted(self.splits)}. "
                "Choose one of those or re-run data_prep/make_shards.py with that split."
            )
        return self.splits[name]

    def shard_paths(self, split: str) -> list[Path]:
        """Absolute paths of a split's shards, in manifest order (a local set's)."""
        root = local_path(self.root or ".")
        if root is None:
            raise ValueError(f"{self.root}: not a local shard set")
        return [Path(join(str(root), s.name)) for s in self.split(split).shards]

    def to_json(self) -> dict[str, Any]:
        """The manifest.json object. The optional index (`offsets`, `index_every`) is left out
        where absent, so a set made without it serialises exactly as before it existed."""
        body = asdict(self)
        body.pop("root")
        body.pop("sha256")
        if body["index_every"] is None:
            del body["index_every"]
        for split in body["splits"].values():
            for shard in split["shards"]:
                for key in ("offsets", "block_sha256"):
                    if shard[key] is None:
                        del shard[key]
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **body}


def write_manifest(root: str | os.PathLike, manifest: Manifest) -> Path:
    path = Path(root) / MANIFEST_NAME
    atomic_write_text(path, json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n")
    return path


def _require(obj: dict, key: str, kind: type | tuple, where: Path) -> Any:
    if key not in obj:
        raise ManifestError(
            f"{where}: missing key {key!r}; re-create it with data_prep/make_shards.py"
        )
    if not isinstance(obj[key], kind):
        raise ManifestError(f"{where}: key {key!r} has the wrong type ({type(obj[key]).__name__})")
    return obj[key]


def load_manifest(root: str | os.PathLike) -> Manifest:
    """Read and validate `root/manifest.json`: root is a folder or URL (ssl_vit.data.urls), or
    the manifest file itself."""
    root = os.fspath(root)
    if root.rstrip("/").endswith("/" + MANIFEST_NAME) or root == MANIFEST_NAME:
        root = root.rstrip("/")[: -len(MANIFEST_NAME)] or "."
    root = normalise_root(root)
    path = join(root, MANIFEST_NAME)
    try:
        data = read_bytes(path)
    except Exception as e:  # a server or bucket that cannot be reached, after the retries
        if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError)) and (
            is_missing(e) or local_path(path) is not None
        ):
            raise ManifestError(
                f"{path}: not found; point at a shard set made by data_prep/make_shards.py"
            ) from None
        raise ManifestError(
            f"{path}: unreadable ({reason(e)}); check the URL, the server and the credentials"
        ) from None
    try:
        raw = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: not valid JSON ({e}); re-create the shard set") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ManifestError(f"{path}: not an ssl-vit shard manifest (format != {FORMAT!r})")
    if raw.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"{path}: format_version {raw.get('format_version')!r} is not supported "
            f"(this ssl-vit reads {FORMAT_VERSION}); re-create the shard set"
        )
    splits: dict[str, SplitInfo] = {}
    for name, s in _require(raw, "splits", dict, path).items():
        shards = [ShardInfo(**sh) for sh in _require(s, "shards", list, path)]
        n = _require(s, "num_samples", int, path)
        if n != sum(sh.num_samples for sh in shards):
            raise ManifestError(f"{path}: split {name!r} num_samples disagrees with its shards")
        splits[name] = SplitInfo(num_samples=n, shards=shards)
    channels = _require(raw, "channels", int, path)
    mean = _require(raw, "mean", list, path)
    std = _require(raw, "std", list, path)
    if len(mean) != channels or len(std) != channels:
        raise ManifestError(f"{path}: mean/std must have one entry per channel ({channels})")
    return Manifest(
        splits=splits,
        class_names=raw.get("class_names"),
        channels=channels,
        image_size=raw.get("image_size"),
        mean=[float(m) for m in mean],
        std=[float(s) for s in std],
        stats_split=raw.get("stats_split"),
        num_skipped=int(raw.get("num_skipped", 0)),
        index_every=raw.get("index_every"),
        created_by=raw.get("created_by", {}),
        root=root,
        sha256=hashlib.sha256(data).hexdigest(),
    )


def check_shards_exist(manifest: Manifest, split: str) -> list[Path]:
    """Return a local split's shard paths, or raise naming the first missing one (a remote
    set's shards are found missing when read: ssl_vit.data.shards)."""
    if local_path(manifest.root or ".") is None:
        return []
    paths = manifest.shard_paths(split)
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise ManifestError(
            f"{missing[0]}: listed in the manifest but missing ({len(missing)} of {len(paths)} "
            f"{split} shards missing); restore them or re-run data_prep/make_shards.py"
        )
    return paths
