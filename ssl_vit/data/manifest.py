"""The shard-set contract: `manifest.json`, its dataclasses, and its strict loader.

A shard set is `{split}-{index:06d}.tar` WebDataset shards written by data_prep/make_shards.py,
or a set made by another tool and indexed in place by data_prep/index_shards.py, with a
manifest (format_version 1) listing every shard's count, bytes, sha256, sample offsets and
block checksums, and the set's classes, channels, image size and mean/std. docs/data.md
("Manifest") gives the schema, key by key.

`load_manifest` treats the file as untrusted: every value must have its type and range, shard
names must be plain file names (`{split}-{digits}.tar` for make_shards' sets: they are joined
to the root, which may be a URL or a shell command), offsets must be where a reader can seek;
anything else is a one-line ManifestError naming the entry and the key. It also takes a
manifest kept apart from its shards and brace patterns naming some shards of a set. Standard
library only, so that data_prep runs without torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ssl_vit.data.urls import (
    Retry,
    is_missing,
    is_pipe,
    is_plain_name,
    join,
    local_path,
    normalise_root,
    read_bytes,
    reason,
    split_pattern,
)
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
    block_sha256: list[str] | None = None  # sha256 of the bytes between offsets (data.tar_reader)


# The fields a sample's image may be in, in the order looked for: what make_shards writes,
# and the image fields of WebDataset sets made by other tools.
IMAGE_KEYS = ("png", "jpg", "jpeg", "webp")


@dataclass(frozen=True)
class SampleLayout:
    """Which fields of a sample hold its image and its label. make_shards' sets use the
    default; a set indexed in place (data_prep/index_shards.py) records its own."""

    image_keys: tuple[str, ...] = IMAGE_KEYS
    # "cls" (or any field holding an ASCII integer), "json:KEY" (a key of the sample's .json:
    # an integer, or a class name of the manifest's class_names), or None: unlabelled
    label: str | None = "cls"
    # class name -> index, for a JSON label that holds names (filled from class_names)
    classes: dict[str, int] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"image_keys": list(self.image_keys), "label": self.label}


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
    layout: SampleLayout = field(default_factory=SampleLayout)  # written as "sample"
    # a WebDataset set indexed in place (data_prep/index_shards.py): its shards keep their
    # names, and "sample" is always written
    indexed: bool = False
    # where the shards are when the manifest is kept apart from them (a read-only set indexed
    # in place): an absolute path or URL; None: beside the manifest
    shards_root: str | None = None
    root: str | None = field(default=None, compare=False)  # the shards' folder or URL (data.urls)
    sha256: str | None = field(default=None, compare=False)  # of the manifest.json it was read from
    # what was given to load_manifest (a folder, a manifest file, a brace pattern): loading it
    # again gives this manifest; `location`: the manifest file's path or URL
    source: str | None = field(default=None, compare=False)
    location: str | None = field(default=None, compare=False)

    @property
    def num_classes(self) -> int | None:
        return None if self.class_names is None else len(self.class_names)

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise ManifestError(
                f"{self.where}: no split {name!r}; it has {sorted(self.splits)}. "
                "Choose one of those or re-run data_prep/make_shards.py with that split."
            )
        return self.splits[name]

    @property
    def where(self) -> str:
        """The manifest file, for messages."""
        if self.location:
            return self.location
        return join(self.root, MANIFEST_NAME) if self.root else MANIFEST_NAME

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
        for key in ("root", "sha256", "source", "location", "layout", "indexed"):
            body.pop(key)
        if self.indexed or self.layout != SampleLayout():  # make_shards' sets: as before
            body["sample"] = self.layout.to_json()
        for key in ("shards_root", "index_every"):
            if body[key] is None:
                del body[key]
        for split in body["splits"].values():
            for shard in split["shards"]:
                for key in ("offsets", "block_sha256"):
                    if shard[key] is None:
                        del shard[key]
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **body}


def write_manifest(root: str | os.PathLike, manifest: Manifest, name: str = MANIFEST_NAME) -> Path:
    path = Path(root) / name
    atomic_write_text(path, json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n")
    return path


# A shard name is joined to the set's root, which may be a folder, a URL or a `pipe:` shell
# command: only this form can never leave the folder nor be more than a word to a shell.
# A set indexed in place keeps the names another tool gave its shards: any plain `*.tar` name
# (urls.join's rule), still never a folder part nor a leading dot.
SHARD_NAME = re.compile(r"([A-Za-z0-9_]+)-[0-9]+\.tar")  # group 1: the split
SPLIT_NAME = re.compile(r"[A-Za-z0-9_]+")
_REDO = "re-create the manifest with data_prep/make_shards.py"
_SPLIT_KEYS = {"num_samples", "shards"}
_SHARD_KEYS = {"name", "num_samples", "bytes", "sha256", "offsets", "block_sha256"}
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REQUIRED = object()  # _Checker.get's default: the key must be there
_JSON_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
               list: "a list", dict: "an object", type(None): "null"}  # fmt: skip


def is_shard_name(split: str, name: object, indexed: bool = False) -> bool:
    """Whether `name` is a valid name of a shard of split `split`: `{split}-{digits}.tar`, or
    for a set indexed in place (`indexed`) any plain name ending in .tar."""
    if indexed:
        return isinstance(name, str) and is_plain_name(name) and name.endswith(".tar")
    match = SHARD_NAME.fullmatch(name) if isinstance(name, str) else None
    return match is not None and match.group(1) == split


def _short(value: object) -> str:
    """A value of a manifest, on one line (repr escapes line breaks) and at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _show(value: object) -> str:
    """A value of a manifest with its JSON type, for an error message."""
    return f"{_short(value)} ({_JSON_TYPES.get(type(value), type(value).__name__)})"


def _is_int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def _is_number(value: object) -> bool:
    """A finite number that a float holds (JSON has NaN, Infinity and 400-digit integers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        return False


class _Checker:
    """Checks of the values of one manifest; each failure is a one-line ManifestError naming the
    manifest, the entry and the key, and what to do."""

    def __init__(self, path: str, indexed: bool = False) -> None:
        self.path = path
        self.indexed = indexed  # a set indexed in place: its shards keep their own names
        self.redo = "index the set again with data_prep/index_shards.py" if indexed else _REDO

    def error(self, where: str, problem: str) -> ManifestError:
        return ManifestError(f"{self.path}: {where}{problem}; {self.redo}")

    def get(
        self,
        obj: dict,
        key: str,
        where: str,
        ok: Callable[[Any], bool],
        want: str,
        default: Any = _REQUIRED,
    ) -> Any:
        """obj[key] where `ok` accepts it (`default` where the key is absent, if given);
        `want` says what it must be."""
        if key not in obj and default is _REQUIRED:
            raise self.error(where, f"missing key {key!r}")
        value = obj.get(key, default)
        if not ok(value):
            raise self.error(where, f"key {key!r} is {_show(value)}, not {want}")
        return value

    def entry(self, obj: object, keys: set[str], where: str) -> dict:
        """A split or shard entry: an object with no keys but `keys`."""
        if not isinstance(obj, dict):
            raise self.error(where, f"is {_show(obj)}, not an object")
        unknown = sorted(set(obj) - keys)
        if unknown:
            raise self.error(where, f"has the unknown key {unknown[0]!r} (known: {sorted(keys)})")
        return obj

    def shard(self, split: str, i: int, raw: object, every: int | None) -> ShardInfo:
        where = f"split {split!r} shard {i} "
        sh = self.entry(raw, _SHARD_KEYS, where)
        name = self.get(sh, "name", where, lambda v: isinstance(v, str), "a string")
        if not is_shard_name(split, name, self.indexed):
            rule = "plain file names ending in .tar" if self.indexed else "<split>-<digits>.tar"
            raise ManifestError(
                f"{self.path}: {where}has the name {_short(name)}; shard names must be "
                f"{rule} ({self.redo})"
            )
        n = self.get(sh, "num_samples", where, lambda v: _is_int(v, 0), "an integer >= 0")
        size = self.get(sh, "bytes", where, lambda v: _is_int(v, 0), "an integer >= 0")
        hex64 = "64 lower-case hex digits"
        sha = self.get(sh, "sha256", where, _is_sha256, hex64)
        offsets = sh.get("offsets")
        if offsets is not None:
            self.offsets(where, offsets, n, size, every)
        blocks = self.get(
            sh,
            "block_sha256",
            where,
            lambda v: v is None or isinstance(v, list) and all(_is_sha256(b) for b in v),
            f"a list of {hex64}",
            None,
        )
        if blocks is not None and (offsets is None or len(blocks) != len(offsets)):
            raise self.error(
                where,
                f"key 'block_sha256' has {len(blocks)} entries, one per offset needs "
                f"{len(offsets or [])}",
            )
        return ShardInfo(name, n, size, sha, offsets, blocks)

    def offsets(self, where: str, offsets: object, n: int, size: int, every: int | None) -> None:
        """The index must be where a reader can seek: samples 0, every, ... of the shard, so
        starting at 0, increasing, inside the file, one per `every` samples."""
        if not isinstance(offsets, list) or not all(_is_int(o, 0) for o in offsets):
            raise self.error(where, f"key 'offsets' is {_show(offsets)}, not a list of integers")
        if every is None:
            raise self.error(where, "has 'offsets' but the manifest has no 'index_every'")
        need = -(-n // every)
        if len(offsets) != need:
            raise self.error(
                where,
                f"key 'offsets' has {len(offsets)} entries; {n} samples indexed every {every} "
                f"need {need}",
            )
        if offsets and offsets[0] != 0:
            raise self.error(where, f"key 'offsets' starts at {offsets[0]}, not 0")
        for j in range(1, len(offsets)):
            if offsets[j] <= offsets[j - 1]:
                raise self.error(
                    where,
                    f"key 'offsets' does not increase at entry {j} "
                    f"({offsets[j - 1]} then {offsets[j]})",
                )
        if offsets and offsets[-1] >= size:
            raise self.error(
                where,
                f"key 'offsets' entry {len(offsets) - 1} ({offsets[-1]}) is not inside the "
                f"shard's {size} bytes",
            )

    def splits(self, raw: dict, every: int | None) -> dict[str, SplitInfo]:
        splits: dict[str, SplitInfo] = {}
        seen: dict[str, str] = {}  # shard name -> where it was first listed
        listing = self.get(raw, "splits", "", lambda v: isinstance(v, dict), "an object")
        for split, s in listing.items():
            if SPLIT_NAME.fullmatch(split) is None:
                raise self.error("", f"the split name {split!r} is not letters, digits and _ only")
            where = f"split {split!r} "
            s = self.entry(s, _SPLIT_KEYS, where)
            listed = self.get(s, "shards", where, lambda v: isinstance(v, list), "a list")
            shards = [self.shard(split, i, sh, every) for i, sh in enumerate(listed)]
            for i, sh in enumerate(shards):
                if sh.name in seen:
                    raise self.error(
                        f"split {split!r} shard {i} ",
                        f"has the name {sh.name!r} of {seen[sh.name]} too",
                    )
                seen[sh.name] = f"split {split!r} shard {i}"
            n = self.get(s, "num_samples", where, lambda v: _is_int(v, 0), "an integer >= 0")
            held = sum(sh.num_samples for sh in shards)
            if n != held:
                raise self.error(where, f"has num_samples {n} but its shards hold {held}")
            splits[split] = SplitInfo(num_samples=n, shards=shards)
        return splits


def load_manifest(root: str | os.PathLike, retry: Retry | None = None) -> Manifest:
    """Read and validate a shard set's manifest. `root` is the set's folder or URL
    (ssl_vit.data.urls) holding manifest.json, a manifest file itself (any `*.json`: one kept
    apart from a read-only set), or a brace pattern naming some shards of a set
    (`.../data-{000000..000099}.tar`: the manifest beside them, reduced to those shards).
    `retry`: how a remote read is retried (None: Retry()). Every byte of it is untrusted:
    whatever it holds, this returns a manifest whose values have the types and ranges the
    dataclasses above say, or raises a one-line ManifestError."""
    root = os.fspath(root)
    try:
        pattern = split_pattern(root)
    except ValueError as e:
        raise ManifestError(str(e)) from None
    if pattern is not None:
        return _only(load_manifest(pattern[0], retry), pattern[1], root)
    if root.rstrip("/").endswith(".json") and not is_pipe(root):
        path = normalise_root(root.rstrip("/"))
        folder = str(Path(path).parent) if local_path(path) is not None else path.rsplit("/", 1)[0]
    else:
        folder = normalise_root(root)
        path = join(folder, MANIFEST_NAME)
    try:
        data = read_bytes(path, retry)
    except Exception as e:  # a server or bucket that cannot be reached, after the retries
        if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError)) and (
            is_missing(e) or local_path(path) is not None
        ):
            raise ManifestError(
                f"{path}: not found; point at a shard set made by data_prep/make_shards.py, or "
                "index a WebDataset set in place with data_prep/index_shards.py"
            ) from None
        raise ManifestError(
            f"{path}: unreadable ({reason(e)}); check the URL, the server and the credentials"
        ) from None
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # also: not UTF-8, too deep, a 5000-digit number
        raise ManifestError(f"{path}: not valid JSON ({e}); re-create the shard set") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ManifestError(f"{path}: not an ssl-vit shard manifest (format != {FORMAT!r})")
    version = raw.get("format_version")
    if not _is_int(version, 0) or version != FORMAT_VERSION:
        raise ManifestError(
            f"{path}: format_version {version!r} is not supported "
            f"(this ssl-vit reads {FORMAT_VERSION}); re-create the shard set"
        )
    m = _from_json(raw, path)
    root_of_shards = normalise_root(m.shards_root) if m.shards_root else folder
    digest = hashlib.sha256(data).hexdigest()
    return replace(m, root=root_of_shards, sha256=digest, source=root, location=path)


def _from_json(raw: dict, path: str) -> Manifest:
    """The manifest whose JSON object `raw` was read from `path`: every value checked."""
    indexed = "sample" in raw  # a set indexed in place: names and fields of another tool
    check = _Checker(path, indexed)
    layout = _layout(check, raw["sample"]) if indexed else SampleLayout()
    shards_root = raw.get("shards_root")
    if shards_root is not None:
        _check_shards_root(check, shards_root)
    every = check.get(
        raw,
        "index_every",
        "",
        lambda v: v is None or _is_int(v, 1),
        "an integer >= 1 or null",
        None,
    )
    splits = check.splits(raw, every)
    channels = check.get(raw, "channels", "", lambda v: _is_int(v, 1) and v in (1, 3), "1 or 3")
    numbers = f"a list of {channels} finite numbers (one per channel)"
    mean = check.get(raw, "mean", "", lambda v: _numbers(v, channels), numbers)
    std = check.get(raw, "std", "", lambda v: _numbers(v, channels), numbers)
    class_names = check.get(
        raw,
        "class_names",
        "",
        lambda v: v is None or isinstance(v, list) and all(isinstance(c, str) for c in v),
        "a list of strings or null",
        None,
    )
    image_size = check.get(
        raw,
        "image_size",
        "",
        lambda v: (
            v is None or isinstance(v, list) and len(v) == 2 and all(_is_int(x, 1) for x in v)
        ),
        "[height, width] in positive integers or null",
        None,
    )
    stats_split = check.get(
        raw, "stats_split", "", lambda v: v is None or isinstance(v, str), "a string or null", None
    )
    num_skipped = check.get(raw, "num_skipped", "", lambda v: _is_int(v, 0), "an integer >= 0", 0)
    created_by = check.get(raw, "created_by", "", lambda v: isinstance(v, dict), "an object", {})
    return Manifest(
        splits=splits,
        class_names=class_names,
        channels=channels,
        image_size=image_size,
        mean=[float(m) for m in mean],
        std=[float(s) for s in std],
        stats_split=stats_split,
        num_skipped=num_skipped,
        index_every=every,
        created_by=created_by,
        layout=_with_classes(layout, class_names),
        indexed=indexed,
        shards_root=shards_root,
    )


# A sample's field name as the tar reader gives it (lower-cased, after the key's first dot).
_FIELD = re.compile(r"[a-z0-9_][a-z0-9_.-]{0,31}")
_JSON_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def is_field(value: object) -> bool:
    """A sample's field name as the tar reader gives it (lower case)."""
    return isinstance(value, str) and _FIELD.fullmatch(value) is not None


def is_label_field(value: object) -> bool:
    """Where a label may be: a field name or `json:KEY`."""
    return is_field(value) or (
        isinstance(value, str)
        and value.startswith("json:")
        and _JSON_KEY.fullmatch(value[5:]) is not None
    )


def _layout(check: _Checker, raw: object) -> SampleLayout:
    sample = check.entry(raw, {"image_keys", "label"}, "sample ")
    keys = check.get(
        sample,
        "image_keys",
        "sample ",
        lambda v: isinstance(v, list) and v and all(is_field(k) for k in v),
        "a non-empty list of field names (lower case)",
    )
    label = check.get(
        sample,
        "label",
        "sample ",
        lambda v: v is None or is_label_field(v),
        "a field name, 'json:KEY' or null",
        "cls",
    )
    return SampleLayout(tuple(keys), label)


def _with_classes(layout: SampleLayout, class_names: list[str] | None) -> SampleLayout:
    """The layout with the name -> index map a JSON label of class names is read through."""
    if not (layout.label or "").startswith("json:") or class_names is None:
        return layout
    return replace(layout, classes={name: i for i, name in enumerate(class_names)})


def _check_shards_root(check: _Checker, value: object) -> None:
    """A manifest kept apart names where its shards are. It is data, so the place must be an
    absolute path or a URL of a store (never a pipe, which is a shell command), and a manifest
    read from a remote store may not point readers at this machine's files."""
    remote = ("http://", "https://", "s3://", "gs://")
    if not isinstance(value, str) or not value or "{" in value or "\n" in value:
        raise check.error("", f"key 'shards_root' is {_show(value)}, not a path or a URL")
    if value.startswith(remote):
        return
    if is_pipe(value) or "://" in value and not value.startswith("file://"):
        raise check.error("", f"key 'shards_root' is {_short(value)}, not a path or a URL of "
                          "http(s)://, s3:// or gs://")  # fmt: skip
    if local_path(check.path) is None:
        raise check.error("", f"key 'shards_root' is the local path {_short(value)}, which a "
                          "manifest read from a remote store may not name")  # fmt: skip
    if not Path(str(local_path(value))).is_absolute():
        raise check.error("", f"key 'shards_root' is {_short(value)}, not an absolute path")


def _only(m: Manifest, names: list[str], pattern: str) -> Manifest:
    """The manifest `m` reduced to the shards a brace pattern names (each must be listed)."""
    listed = {sh.name for info in m.splits.values() for sh in info.shards}
    unknown = [n for n in names if n not in listed]
    if unknown:
        raise ManifestError(
            f"{pattern}: {unknown[0]} is not listed in {m.where} ({len(unknown)} of the "
            f"pattern's {len(names)} shards are not); index the set again with "
            "data_prep/index_shards.py, or fix the pattern"
        )
    wanted = set(names)
    splits = {}
    for split, info in m.splits.items():
        shards = [sh for sh in info.shards if sh.name in wanted]
        if shards:
            splits[split] = SplitInfo(sum(sh.num_samples for sh in shards), shards)
    # cached features are keyed by this digest: a subset's is its own
    digest = hashlib.sha256(f"{m.sha256}\n{sorted(wanted)}".encode()).hexdigest()
    return replace(m, splits=splits, sha256=digest, source=pattern)


def _numbers(value: object, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(_is_number(v) for v in value)


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
