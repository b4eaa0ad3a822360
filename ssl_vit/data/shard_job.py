"""Run a sharding job (parallel, resumable, one of N machines) and merge it into a shard set.

Layout while running: OUT/.work/ holds plan.json (what is being made), group records and part
tars. `merge` renames the parts to `{split}-{index:06d}.tar`, writes errors.jsonl and, last,
manifest.json, then removes OUT/.work. A folder with a manifest is complete.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tqdm import tqdm

import ssl_vit
from ssl_vit.data.imaging import (
    BadImage,
    Encoded,
    ImageOptions,
    configure_pil,
    mean_std,
    process_bytes,
    process_pixels,
)
from ssl_vit.data.manifest import (
    ERRORS_NAME,
    IMAGE_KEYS,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    SplitInfo,
    write_manifest,
)
from ssl_vit.data.shard_plan import Group, ShardOptions, make_plan
from ssl_vit.data.shard_writer import (
    GroupWriter,
    load_record,
    sample_members,
    sample_meta,
    shutdown_io,
    verify_record,
)
from ssl_vit.data.sources import Listing, is_remote, open_source
from ssl_vit.data.tar_reader import (
    TarFormatError,
    _drop,
    block_digests,
    read_samples,
    sample_offsets,
)
from ssl_vit.data.urls import Retry, is_missing, normalise_root, open_url, read_bytes, reason
from ssl_vit.io import atomic_write_text

WORK = ".work"
TOOL = "data_prep/make_shards.py"
# The manifest lists the byte offset of every k-th sample of each shard, k = INDEX_EVERY or a
# twentieth of the smallest shard if less: a reader that starts at an arbitrary sample reads at
# most k - 1 samples it does not need (at most 5% of a shard), and the index stays small (about
# 13k numbers for ImageNet's 1.28M images).
INDEX_EVERY = 100


def index_stride(shard_counts: list[int]) -> int:
    return max(1, min([INDEX_EVERY, *(n // 20 for n in shard_counts)]))


class JobError(ValueError):
    """A problem with the arguments or the output folder; the message is one line."""


@dataclass
class Summary:
    kept: int
    skipped: int
    written_groups: int
    reused_groups: int
    merged: bool
    up_to_date: bool = False


_OPTS: ImageOptions | None = None


def _init_worker(opts: ImageOptions) -> None:
    global _OPTS
    _OPTS = opts
    configure_pil()


def _read(path: str, offset: int | None = None) -> bytes:
    if offset is not None:  # a sample of a WebDataset shard: its image
        return _read_sample_image(path, offset)
    if is_remote(path):  # an image of a source at a URL, read where it is
        try:
            return read_bytes(path)
        except Exception as e:  # after the retries
            if is_missing(e):
                raise BadImage("file not found (deleted since the listing)") from None
            raise BadImage(f"unreadable ({reason(e)})") from None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        why = _LOCAL_READ_ERRORS.get(type(e), f"unreadable file ({e.strerror or e})")
        raise BadImage(why) from None


# What the usual failures to read a local image file mean, as recorded in errors.jsonl.
_LOCAL_READ_ERRORS = {
    PermissionError: "unreadable file (permission denied)",
    FileNotFoundError: "file not found (deleted, or a dangling symlink)",
    IsADirectoryError: "is a folder, not an image file",
}


def _read_sample_image(url: str, offset: int) -> bytes:
    """The image of the sample at byte `offset` of the tar at `url` (one ranged read)."""
    try:
        f, at = Retry().call(lambda: open_url(url, offset), url)
        with f:
            if at < offset:  # a source that cannot seek: read up to the sample
                _drop(f, offset - at, url)
            first = next(iter(read_samples(f, url, offset)), (offset, None))[1] or {}
    except TarFormatError as e:
        raise BadImage(f"unreadable sample ({e})") from None
    except Exception as e:  # after the retries
        raise BadImage(f"unreadable ({reason(e)})") from None
    data = next((first[k] for k in IMAGE_KEYS if k in first), None)
    if data is None:
        raise BadImage(f"no image ({'/'.join(IMAGE_KEYS)}) in the sample")
    return data


def _work(
    task: tuple[str | None, np.ndarray | None, bool, int | None],
) -> tuple[Encoded | None, str | None]:
    path, pixels, want_stats, offset = task
    assert _OPTS is not None
    try:
        if pixels is not None:
            return process_pixels(pixels, _OPTS, want_stats=want_stats), None
        return process_bytes(_read(path or "", offset), _OPTS, want_stats=want_stats), None
    except BadImage as e:
        return None, str(e)
    except Exception as e:  # one odd file must not end a long job; it is recorded instead
        return None, f"unexpected {type(e).__name__} while decoding: {e}"


class Progress:
    """tqdm with images/s on a TTY, otherwise a log line every `every` seconds."""

    def __init__(self, total: int, desc: str, every: float = 10.0) -> None:
        self.total, self.desc, self.every = total, desc, every
        self.n, self.t0 = 0, time.monotonic()
        self.last = self.t0
        on_tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=desc, unit="img", smoothing=0.1) if on_tty else None

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            return
        if self.n & 255:  # look at the clock every 256 images only
            return
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            rate = self.n / max(now - self.t0, 1e-9)
            eta = (self.total - self.n) / rate if rate > 0 else float("inf")
            print(
                f"{self.desc}: {self.n}/{self.total} images, {rate:.0f} img/s, ETA {eta:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def fingerprint(source: Path | str, opts: ShardOptions) -> dict[str, Any]:
    return {"source": normalise_root(source), "options": opts.to_json()}


def _check_output(out: Path, fp: dict[str, Any]) -> bool:
    """Raise when OUT holds another shard set; return True when this set is already complete."""
    if out.exists() and not out.is_dir():
        raise JobError(f"{out}: exists and is not a folder; choose a folder for the shards")
    if not out.exists():
        parent = next((p for p in out.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise JobError(f"{out}: cannot be created, {parent} is a file; choose another folder")
        return False
    other = (
        f"{out}: holds a different shard set (other source or options); "
        "choose an empty OUT folder or delete this one"
    )
    manifest = out / MANIFEST_NAME
    if manifest.is_file():
        try:
            made = json.loads(manifest.read_text(encoding="utf-8")).get("created_by", {})
        except (ValueError, AttributeError):
            raise JobError(f"{manifest}: unreadable manifest; delete {out} and rerun") from None
        if {"source": made.get("source"), "options": made.get("options")} != fp:
            raise JobError(other)
        return True
    plan = out / WORK / "plan.json"
    if plan.is_file():
        try:
            planned = json.loads(plan.read_text(encoding="utf-8"))
        except ValueError:
            raise JobError(f"{plan}: unreadable; delete {out / WORK} and rerun") from None
        if planned != fp:  # raised out here: a JobError is a ValueError too
            raise JobError(other)
    elif any(out.glob("*.tar")):
        raise JobError(f"{out}: holds .tar files of no known shard set; choose an empty folder")
    return False


def prepare(source: Path | str, opts: ShardOptions) -> tuple[Listing, ShardOptions, list[Group]]:
    """Enumerate the source, resolve --mode auto (L for IDX, RGB otherwise) and plan."""
    listing = open_source(
        source,
        follow_symlinks=opts.follow_symlinks,
        class_names=list(opts.class_names) if opts.class_names else None,
        labels=opts.labels,
    )
    if opts.image.mode == "auto":
        mode = "L" if listing.grayscale else "RGB"
        opts = replace(opts, image=replace(opts.image, mode=mode))
    return listing, opts, make_plan(listing, opts)


def run_job(
    source: Path | str,
    out: Path,
    opts: ShardOptions,
    *,
    workers: int = 1,
    num_jobs: int = 1,
    job_index: int = 0,
    merge_only: bool = False,
) -> Summary:
    """Write this job's groups (skipping verified ones), then merge when it is the only job."""
    if not 0 <= job_index < num_jobs:
        raise JobError(f"--job-index {job_index} must be in [0, --num-jobs={num_jobs})")
    listing, opts, groups = prepare(source, opts)
    if not listing.items and not listing.errors:
        raise JobError(f"{source}: no images found (looked for .png .jpg .webp .bmp .gif .tif ...)")
    fp = fingerprint(source, opts)
    if _check_output(out, fp):
        return _already_done(out)
    work = out / WORK
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "plan.json").is_file():
        atomic_write_text(work / "plan.json", json.dumps(fp))
    if merge_only:
        return merge(source, out, opts, listing, groups)
    mine = [g for i, g in enumerate(groups) if i % num_jobs == job_index]
    todo: list[Group] = []
    for g in mine:
        rec = load_record(work, g.split, g.index)
        if rec is None or not verify_record(work, rec, g.items_sha):
            todo.append(g)
    written = _write_groups(work, todo, opts, workers)
    reused = len(mine) - len(todo)
    if num_jobs == 1:
        return merge(source, out, opts, listing, groups, reused=reused)
    recs = [rec for g in mine if (rec := load_record(work, g.split, g.index)) is not None]
    kept, skipped = sum(r.num_samples for r in recs), sum(len(r.errors) for r in recs)
    return Summary(kept, skipped, written, reused, merged=False)


def _write_groups(work: Path, todo: list[Group], opts: ShardOptions, workers: int) -> int:
    total = sum(len(g.items) for g in todo)
    if total == 0:
        return len(todo)
    progress = Progress(total, "make_shards")
    pil_limit = Image.MAX_IMAGE_PIXELS  # restored below: callers keep their own guard
    pool = None
    tasks = ((it.path, it.pixels, g.split == "train", it.offset) for g in todo for it in g.items)
    if workers > 1:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        pool = mp.get_context(method).Pool(workers, _init_worker, (opts.image,))
        chunk = max(1, min(256, total // (workers * 16)))
        results: Iterator = pool.imap(_work, tasks, chunksize=chunk)
    else:
        _init_worker(opts.image)
        results = map(_work, tasks)
    try:
        for g in todo:
            writer = GroupWriter(work, g.split, g.index, g.items_sha, opts.shard_bytes)
            for it, key in zip(g.items, g.keys, strict=True):
                enc, reason = next(results)
                progress.update()
                if enc is None:
                    writer.errors.append({"source": it.rel, "reason": reason or "unknown"})
                    continue
                meta = sample_meta(it.rel, enc.original_size)
                writer.add(sample_members(key, enc.ext, enc.data, it.label, meta), enc.size)
                if enc.histogram is not None:
                    writer.add_histogram(enc.histogram)
            writer.finish()
    finally:
        progress.close()
        Image.MAX_IMAGE_PIXELS = pil_limit
        shutdown_io()  # no thread may be alive when the next job forks its workers
        if pool is not None:
            pool.terminate()
            pool.join()
    return len(todo)


def merge(
    source: Path | str,
    out: Path,
    opts: ShardOptions,
    listing: Listing,
    groups: list[Group],
    *,
    reused: int = 0,
) -> Summary:
    """Give every part its final name and write errors.jsonl and manifest.json (in that order)."""
    work = out / WORK
    records = []
    for i, g in enumerate(groups):
        rec = load_record(work, g.split, g.index)
        if rec is None or not verify_record(work, rec, g.items_sha, hash_parts=False):
            raise JobError(
                f"{out}: group {g.split}-g{g.index:06d} is not written yet; run or rerun the job "
                f"that owns it (--job-index = {i} mod --num-jobs) before --merge"
            )
        records.append(rec)
    # The index is read back from the parts rather than kept by the writer: parts kept from an
    # earlier (resumed) run or written by another job get it the same way, and it is a function
    # of the part's bytes alone, so it is the same whatever --workers or --num-jobs. All parts
    # are read before any is renamed, so a bad part stops the merge with the folder unchanged.
    parts = [p for rec in records for p in rec.parts]
    every = index_stride([p.num_samples for p in parts])
    offsets = {p.name: _part_offsets(work / p.name, p.num_samples, every) for p in parts}
    by_split: dict[str, list[ShardInfo]] = {}
    errors = list(listing.errors)
    sizes: set[tuple[int, ...]] = set()
    mixed = False
    for rec in records:
        shards = by_split.setdefault(rec.split, [])
        for p in rec.parts:
            name = f"{rec.split}-{len(shards):06d}.tar"
            os.replace(work / p.name, out / name)
            shards.append(ShardInfo(name, p.num_samples, p.bytes, p.sha256, *offsets[p.name]))
        errors.extend(rec.errors)
        mixed |= rec.mixed_sizes
        if rec.image_size:
            sizes.add(tuple(rec.image_size))
    splits = {k: SplitInfo(sum(s.num_samples for s in v), v) for k, v in by_split.items()}
    channels = 1 if opts.image.mode == "L" else 3
    train_stats = [r.stats for r in records if r.split == "train" and r.stats]
    mean, std = mean_std(train_stats, channels)
    manifest = Manifest(
        splits=splits,
        class_names=listing.class_names,
        channels=channels,
        image_size=list(next(iter(sizes))) if len(sizes) == 1 and not mixed else None,
        mean=mean,
        std=std,
        stats_split="train" if train_stats else None,
        num_skipped=len(errors),
        index_every=every,
        created_by={"tool": TOOL, "version": ssl_vit.__version__, **fingerprint(source, opts)},
    )
    atomic_write_text(out / ERRORS_NAME, "".join(json.dumps(e) + "\n" for e in errors))
    write_manifest(out, manifest)  # the commit point: from here on the folder is a shard set
    shutil.rmtree(work, ignore_errors=True)
    kept = sum(s.num_samples for s in splits.values())
    return Summary(kept, len(errors), len(groups) - reused, reused, merged=True)


def _part_offsets(path: Path, num_samples: int, every: int) -> tuple[list[int], list[str]]:
    """The part's sample offsets (every `every`-th), checked against its recorded count, and
    the sha256 of each block between them (ssl_vit.data.tar_reader): one more read of the part,
    which the merge has just had the writer put in the page cache."""
    try:
        with open(path, "rb") as f:
            offsets = sample_offsets(f, every)
            digests = block_digests(f, offsets, path.stat().st_size)
    except ValueError as e:
        raise JobError(f"{path}: unreadable part ({e}); delete it and rerun its job") from None
    if len(offsets) != -(-num_samples // every):
        raise JobError(
            f"{path}: holds another number of samples than its record says ({num_samples}); "
            "delete it and rerun its job"
        )
    return offsets, digests


def _already_done(out: Path) -> Summary:
    shutil.rmtree(out / WORK, ignore_errors=True)  # left if a run died right after its manifest
    raw = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
    kept = sum(s["num_samples"] for s in raw["splits"].values())
    for split in raw["splits"].values():
        for sh in split["shards"]:
            path = out / sh["name"]
            if not path.is_file() or path.stat().st_size != sh["bytes"]:
                raise JobError(
                    f"{path}: missing or resized although the manifest lists it; "
                    "run data_prep/verify_shards.py, or delete the folder and rerun"
                )
    return Summary(kept, int(raw.get("num_skipped", 0)), 0, 0, merged=True, up_to_date=True)
