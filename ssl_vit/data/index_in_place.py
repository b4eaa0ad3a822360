"""Indexing a WebDataset set made by another tool where it lies: its manifest, shards untouched.

    python data_prep/index_shards.py SOURCE [SPLIT=SOURCE ...] [--out DIR]

A SOURCE is a folder or URL of `*.tar` shards, a brace pattern or a list file. Each shard is
read once, front to back, by a pool of workers: size, sha256, sample count, the offset of every
`index_every`-th sample and the sha256 of each block between them (ssl_vit.data.tar_reader), its
labels, every image's size and mode from its header, and one image in `stats_every` decoded for
the mean and std. The manifest goes beside the shards, or to --out with `shards_root` naming
them. Finished shards wait in `DIR/.index-work/`, so a rerun after a crash reads only the rest.
docs/data.md ("WebDataset sets made by other tools") says how to use it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import shutil
import sys
import time
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

import ssl_vit
from ssl_vit.data.imaging import histogram_stats, mean_std
from ssl_vit.data.manifest import (
    IMAGE_KEYS,
    MANIFEST_NAME,
    SPLIT_NAME,
    Manifest,
    SampleLayout,
    ShardInfo,
    SplitInfo,
    is_field,
    is_label_field,
    write_manifest,
)
from ssl_vit.data.tar_reader import TarFormatError, read_samples
from ssl_vit.data.urls import (
    Retry,
    has_braces,
    is_pipe,
    is_plain_name,
    join,
    list_folder,
    local_path,
    normalise_root,
    open_url,
    reason,
    split_pattern,
)
from ssl_vit.io import atomic_write_text

log = logging.getLogger(__name__)
TOOL = "data_prep/index_shards.py"
WORK = ".index-work"
_GRAY_MODES = {"1", "L", "LA", "I", "I;16", "F", "P;L"}  # what decodes to one channel


class IndexJobError(ValueError):
    """A source or output that cannot be indexed; the message is one line."""


@dataclass(frozen=True)
class IndexOptions:
    image_keys: tuple[str, ...] = IMAGE_KEYS
    label: str | None = "cls"  # "cls" (a field of ASCII integers), "json:KEY", or None
    class_names: tuple[str, ...] | None = None  # names of labels 0..K-1 (or of JSON names)
    stats_every: int = 20  # one image in this many is decoded for the mean and std
    index_every: int = 100  # the manifest's offset stride (make_shards' INDEX_EVERY)

    def __post_init__(self) -> None:
        if not self.image_keys or not all(is_field(k) for k in self.image_keys):
            raise IndexJobError(f"--image-keys {','.join(self.image_keys)!r}: not field names")
        if self.label is not None and not is_label_field(self.label):
            raise IndexJobError(f"--label {self.label!r}: give a field name, json:KEY or none")


def list_shards(source: str) -> tuple[str, list[str]]:
    """(root, shard names) of a source: a brace pattern, a list file, a folder or URL of
    *.tar files, or one shard. Every name must be one plain file name of one folder."""
    if is_pipe(source):
        raise IndexJobError(f"{source}: a pipe cannot be indexed; give the folder or URL it reads")
    if has_braces(source):
        try:
            root, names = split_pattern(source)  # type: ignore[misc]
        except ValueError as e:
            raise IndexJobError(str(e)) from None
    elif source.endswith(".tar"):
        root, _, name = source.rpartition("/")
        root, names = root or ".", [name]
    elif local_path(source) is not None and Path(source).is_file():
        root, names = _list_file(Path(source))
    else:
        root, names = source, _tar_files(source)
    bad = [n for n in names if not (is_plain_name(n) and n.endswith(".tar"))]
    if bad:
        raise IndexJobError(f"{source}: {bad[0]!r} is not a plain file name ending in .tar")
    if not names:
        raise IndexJobError(f"{source}: no .tar files found there")
    return normalise_root(root), names


def _list_file(path: Path) -> tuple[str, list[str]]:
    """A list of shard paths or URLs (paths relative to the list's folder), `#` comments."""
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    urls = [ln if "://" in ln or ln.startswith("/") else str(path.parent / ln)
            for ln in lines if ln and not ln.startswith("#")]  # fmt: skip
    folders = {u.rpartition("/")[0] for u in urls}
    if not urls:
        raise IndexJobError(f"{path}: lists no shards")
    if len(folders) > 1:
        raise IndexJobError(
            f"{path}: lists shards of {len(folders)} folders; a shard set is one folder "
            "(index each folder apart)"
        )
    return (folders.pop() or "."), [u.rpartition("/")[2] for u in urls]


def _tar_files(root: str) -> list[str]:
    folder = local_path(root)
    if folder is not None and not folder.is_dir():
        raise IndexJobError(f"{root}: not found; give a folder, URL, brace pattern or list file")
    if root.startswith(("http://", "https://")):
        raise IndexJobError(
            f"{root}: a web server cannot be listed; give a brace pattern "
            "(.../data-{000000..000099}.tar) or a list file of the shards' URLs"
        )
    try:
        return [n for n in list_folder(root) if n.endswith(".tar")]
    except Exception as e:  # a bucket that cannot be listed, after the retries
        raise IndexJobError(f"{root}: cannot be listed ({reason(e)}); check the URL") from None


class _Tee:
    """A stream read front to back that hashes what passes: the whole file, and the blocks
    between sample offsets (kept until the offset that ends them is known)."""

    def __init__(self, f) -> None:
        self.f, self.pos = f, 0
        self.whole = hashlib.sha256()
        self.pending, self.pending_at = bytearray(), 0  # bytes from `pending_at` to `pos`
        self.blocks: list[str] = []

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.whole.update(data)
        self.pending += data
        self.pos += len(data)
        return data

    def seekable(self) -> bool:
        return False  # the tar reader then reads every byte, and the hashes see them all

    def cut(self, at: int) -> None:
        """A block starts at `at`: the one before it ends there."""
        if at > self.pending_at:
            self.blocks.append(hashlib.sha256(self.pending[: at - self.pending_at]).hexdigest())
            del self.pending[: at - self.pending_at]
            self.pending_at = at

    def finish(self) -> None:
        while self.read(1 << 20):
            pass
        self.blocks.append(hashlib.sha256(self.pending).hexdigest())
        self.pending.clear()


def index_shard(url: str, opts: IndexOptions) -> dict[str, Any]:
    """Everything the manifest needs of one shard, from one read of it."""
    from PIL import Image

    f, _ = Retry().call(lambda: open_url(url), url)
    tee = _Tee(f)
    offsets: list[int] = []
    labels: Counter[str] = Counter()  # label as text -> count
    sizes: set[tuple[int, int]] = set()
    gray, no_image, unlabelled, bad_image = True, 0, 0, 0
    hist = np.zeros(3 * 256, dtype=np.int64)  # of the images decoded for the mean and std
    n = 0
    with f:
        for at, sample in read_samples(tee, url):
            if n % opts.index_every == 0:
                offsets.append(at)
                tee.cut(at)
            n += 1
            sample = sample or {}
            data = next((sample[k] for k in opts.image_keys if k in sample), None)
            if data is None:
                no_image += 1
            else:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("error", Image.DecompressionBombWarning)
                        with Image.open(io.BytesIO(data)) as img:
                            if len(sizes) < 2:  # two sizes already make the set's "mixed"
                                sizes.add((img.height, img.width))
                            gray = gray and img.mode in _GRAY_MODES
                            if n % opts.stats_every == 1 or opts.stats_every == 1:
                                hist += img.convert("RGB").histogram()
                except Exception:  # a broken image: readers skip it as corrupt
                    bad_image += 1
            label = _label_text(sample, opts.label)
            if label is None:
                unlabelled += 1
            else:
                labels[label] += 1
        tee.finish()
    if len(sizes) > 1:
        sizes = {(-1, -1)}  # mixed: no need to keep them all
    return {
        "url": url,
        "num_samples": n,
        "bytes": tee.pos,
        "sha256": tee.whole.hexdigest(),
        "offsets": offsets,
        "block_sha256": tee.blocks if offsets else [],
        "labels": labels,
        "unlabelled": unlabelled,
        "no_image": no_image,
        "bad_image": bad_image,
        "sizes": sorted(sizes),
        "gray": gray,
        "stats": histogram_stats(hist),
    }


def _label_text(sample: dict, label: str | None) -> str | None:
    """A sample's label as text (an integer's digits, or a class name), None where it has
    none: counted here, turned into class indices once every shard is read."""
    if label is None:
        return None
    if label.startswith("json:"):
        try:
            value = json.loads(sample.get("json", b"{}")).get(label[5:])
        except (ValueError, AttributeError, RecursionError):
            return None
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return None
        return f"#{value}" if isinstance(value, int) else value
    text = sample.get(label, b"").decode("ascii", "replace").strip()
    return f"#{int(text)}" if text.isdigit() else None


def _class_names(labels: dict[str, int], opts: IndexOptions) -> list[str] | None:
    """The set's class names: --class-names, or the integers 0..max, or the sorted names a
    JSON label holds; None for a set without labels."""
    if opts.label is None or not labels:
        return None
    numbers = [int(k[1:]) for k in labels if k.startswith("#")]
    names = sorted(k for k in labels if not k.startswith("#"))
    if numbers and names:
        raise IndexJobError(
            f"labels under {opts.label!r} mix integers and names (e.g. {names[0]!r}); "
            "index with one kind"
        )
    if opts.class_names is not None:
        given = list(opts.class_names)
        unknown = [x for x in names if x not in given] + [
            str(i) for i in numbers if i >= len(given)
        ]
        if unknown:
            raise IndexJobError(
                f"label {unknown[0]!r} is not one of the {len(given)} --class-names; "
                "add it to the file"
            )
        return given
    return names or [str(i) for i in range(max(numbers) + 1)]


def run_index(
    sources: dict[str, str], out: str | None, opts: IndexOptions, workers: int
) -> Manifest:
    """Index the shards of each split's source (all in one folder) and write the manifest to
    that folder, or to `out` (then it names the shards' folder)."""
    roots: dict[str, str] = {}
    names: dict[str, list[str]] = {}
    for split, source in sources.items():
        if SPLIT_NAME.fullmatch(split) is None:
            raise IndexJobError(f"{split!r}: a split name is letters, digits and _ only")
        roots[split], names[split] = list_shards(source)
    root = next(iter(roots.values()))
    if any(r != root for r in roots.values()):
        raise IndexJobError(
            f"the splits' shards lie in {len(set(roots.values()))} folders; a shard set is one "
            "folder (index each folder apart)"
        )
    every = [n for ns in names.values() for n in ns]
    if len(set(every)) != len(every):
        raise IndexJobError(f"{root}: a shard is named by two splits; give each split its own")
    dest = Path(out) if out is not None else local_path(root)
    if dest is None:
        raise IndexJobError(f"{root}: the set is at a URL; give --out DIR for its manifest")
    _check_dest(dest)
    work = dest / WORK
    work.mkdir(parents=True, exist_ok=True)
    records = _index_all(root, every, opts, workers, work)
    manifest = _manifest(root, names, records, opts, sources, apart=out is not None)
    write_manifest(dest, manifest)  # the commit point
    shutil.rmtree(work)
    return manifest


def _check_dest(dest: Path) -> None:
    """Refuse to replace a manifest that make_shards wrote (a set indexed before is redone)."""
    path = dest / MANIFEST_NAME
    if not path.is_file():
        return
    try:
        indexed = "sample" in json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        indexed = False
    if not indexed:
        raise IndexJobError(
            f"{path}: exists and was not written by {TOOL}; give --out another folder"
        )


def _index_all(
    root: str, names: list[str], opts: IndexOptions, workers: int, work: Path
) -> dict[str, dict]:
    """Each shard's record, from `work` where a run before this one finished it."""
    records: dict[str, dict] = {}
    todo = []
    for name in names:
        done = work / f"{name}.json"
        rec = json.loads(done.read_text(encoding="utf-8")) if done.is_file() else None
        if rec is not None and rec.get("url") == join(root, name) and rec.get("opts") == _key(opts):
            records[name] = rec
        else:
            todo.append(name)
    if records:
        print(f"index: {len(records)} shards done before, {len(todo)} to read", file=sys.stderr)
    start = last = time.monotonic()
    nbytes = 0
    # spawned: fsspec's event loop thread does not survive a fork
    pool = ProcessPoolExecutor(max(1, workers), mp_context=get_context("spawn"))
    try:
        futures = {n: pool.submit(index_shard, join(root, n), opts) for n in todo}
        for i, (name, fut) in enumerate(futures.items(), 1):
            try:
                rec = fut.result()
            except TarFormatError as e:
                raise IndexJobError(f"{e}; repair or drop the shard, then rerun") from None
            except Exception as e:  # a read that failed after its retries
                raise IndexJobError(f"{join(root, name)}: unreadable ({reason(e)})") from None
            rec["opts"] = _key(opts)
            atomic_write_text(work / f"{name}.json", json.dumps(rec))
            records[name] = rec
            nbytes += rec["bytes"]
            now = time.monotonic()
            if now - last >= 10 or i == len(todo):  # a log line every 10 s, and at the end
                last = now
                print(f"index: {i}/{len(todo)} shards read, {nbytes / 1e6:.0f} MB at "
                      f"{nbytes / 1e6 / max(now - start, 1e-9):.0f} MB/s",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:  # on an error, the shards not started are not read
        pool.shutdown(wait=True, cancel_futures=True)
    return records


def _key(opts: IndexOptions) -> dict[str, Any]:
    """What a shard's record depends on (a rerun with other options reads it again)."""
    return {"image_keys": list(opts.image_keys), "label": opts.label,
            "stats_every": opts.stats_every, "index_every": opts.index_every}  # fmt: skip


def _manifest(
    root: str,
    names: dict[str, list[str]],
    records: dict[str, dict],
    opts: IndexOptions,
    sources: dict[str, str],
    apart: bool,
) -> Manifest:
    labels: Counter[str] = Counter()
    for rec in records.values():
        labels.update(rec["labels"])
    class_names = _class_names(labels, opts)
    splits = {}
    for split, shard_names in names.items():
        shards = [
            ShardInfo(
                n,
                records[n]["num_samples"],
                records[n]["bytes"],
                records[n]["sha256"],
                records[n]["offsets"],
                records[n]["block_sha256"],
            )
            for n in shard_names
        ]
        splits[split] = SplitInfo(sum(s.num_samples for s in shards), shards)
    sizes = {tuple(s) for rec in records.values() for s in rec["sizes"]}
    channels = 1 if all(rec["gray"] for rec in records.values()) else 3
    stats_split = "train" if "train" in names else next(iter(names))
    stats = [records[n]["stats"] for n in names[stats_split]]
    mean, std = mean_std(stats, channels)
    no_image, bad_image, unlabelled = (
        sum(r[k] for r in records.values()) for k in ("no_image", "bad_image", "unlabelled")
    )
    if class_names is not None and unlabelled:
        log.warning("%d samples have no label under %r: readers skip them", unlabelled, opts.label)
    if no_image or bad_image:
        log.warning(
            "%d samples have no image (%s) and %d an unreadable one: readers skip them",
            no_image,
            "/".join(opts.image_keys),
            bad_image,
        )
    layout = SampleLayout(opts.image_keys, opts.label if class_names is not None else None)
    return Manifest(
        splits=splits,
        class_names=class_names,
        channels=channels,
        image_size=list(sizes.pop()) if len(sizes) == 1 and (-1, -1) not in sizes else None,
        mean=mean,
        std=std,
        stats_split=stats_split,
        num_skipped=0,
        index_every=opts.index_every,
        created_by={
            "tool": TOOL,
            "version": ssl_vit.__version__,
            "source": sources,
            "options": _key(opts),
            "samples_without_image": no_image,
            "samples_with_bad_image": bad_image,
            "samples_without_label": unlabelled if class_names is not None else 0,
        },
        layout=layout,
        indexed=True,
        shards_root=root if apart else None,
        root=root,
    )


def parse_sources(args: list[str]) -> dict[str, str]:
    """`SOURCE` (the train split) or `SPLIT=SOURCE` arguments -> {split: source}."""
    out: dict[str, str] = {}
    for a in args:
        m = re.fullmatch(r"([A-Za-z0-9_]+)=(.+)", a)
        split, source = (m.group(1), m.group(2)) if m else ("train", a)
        if split in out:
            raise IndexJobError(f"{a}: split {split!r} given twice")
        out[split] = source
    return out
