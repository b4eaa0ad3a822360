"""Check a shard set against its manifest: checksums, sizes, sample counts, the byte-offset
index, a decoded sample."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

from PIL import Image

from ssl_vit.data.manifest import (
    ERRORS_NAME,
    Manifest,
    ManifestError,
    ShardInfo,
    load_manifest,
    write_manifest,
)
from ssl_vit.data.tar_reader import TarFormatError, block_digests, iter_samples, sample_offsets
from ssl_vit.data.urls import has_braces, join, local_path, probe_range, read_bytes
from ssl_vit.io import sha256_file


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)  # any entry means the set is not trustworthy
    warnings: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # the human summary

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_shard(path: Path, m: Manifest, expected: int, decode: bool) -> list[str]:
    """Count samples (keys), check labels as readers read them and decode the first image;
    return problems. Read with our own tar reader, which ends on any input (tarfile may not, on
    a crafted pax header)."""
    from ssl_vit.data.augment import sample_label  # (imports torch: only when verifying)

    problems: list[str] = []
    count, bad, first = 0, [], None
    labelled = m.class_names is not None and m.layout.label is not None
    try:
        for sample in iter_samples(path):
            count += 1
            key = sample["__key__"]
            images = [e for e in m.layout.image_keys if e in sample]
            if len(images) != 1:
                bad.append(key)
            elif first is None:
                first = (f"{key}.{images[0]}", sample[images[0]])
            if labelled:
                try:
                    sample_label(sample, labelled=True, num_classes=m.num_classes, layout=m.layout)
                except ValueError as e:  # CorruptSample, LabelOutOfRange: "KEY: what is wrong"
                    problems.append(f"{path.name}: {e}")
    except TarFormatError as e:
        return [f"{path.name}: unreadable tar ({e})"]
    if count != expected:
        problems.append(f"{path.name}: {count} samples, manifest says {expected}")
    if bad:
        problems.append(f"{path.name}: sample {bad[0]} has no single image ({len(bad)} such)")
    if decode and first is not None:
        try:
            with Image.open(io.BytesIO(first[1])) as img:
                img.load()
                channels = len(img.getbands())
                size = [img.height, img.width]
        except Exception as e:  # any decode failure is a finding, not a crash
            return problems + [f"{path.name}: {first[0]} does not decode ({e})"]
        if channels != m.channels:
            problems.append(f"{path.name}: {first[0]} has {channels} channels, not {m.channels}")
        if m.image_size is not None and size != list(m.image_size):
            problems.append(f"{path.name}: {first[0]} is {size}, manifest says {m.image_size}")
    return problems


def _check_file(path: Path | None, sh: ShardInfo, m: Manifest, decode: bool) -> list[str]:
    """Size, sha256, contents and offset index of one shard (a local file)."""
    if path is None:
        return [f"{sh.name}: missing"]
    size = path.stat().st_size
    if size != sh.bytes:
        return [f"{sh.name}: {size} bytes, manifest says {sh.bytes}"]
    if sha256_file(path) != sh.sha256:
        return [f"{sh.name}: sha256 differs from the manifest"]
    problems = _check_offsets(path, sh, m.index_every)
    if not problems and sh.block_sha256 is not None and sh.offsets is not None:
        with open(path, "rb") as f:
            actual = block_digests(f, sh.offsets, size)
        # the first block that differs, or that one of the two lists lacks (None)
        k = next(
            (i for i, (a, b) in enumerate(zip_longest(actual, sh.block_sha256)) if a != b), None
        )
        if k is not None:
            problems.append(f"{sh.name}: block_sha256[{k}] does not match; re-create the set")
    return _check_shard(path, m, sh.num_samples, decode) + problems


def _check_offsets(path: Path, sh: ShardInfo, every: int | None) -> list[str]:
    """The manifest's offsets of this shard must be exactly where its samples 0, every, ...
    start: a reader seeking to a wrong one would read from the middle of a sample."""
    if sh.offsets is None:
        return []
    if every is None or every < 1:
        return [f"{path.name}: lists offsets, but the manifest has no valid index_every"]
    try:
        with open(path, "rb") as f:
            actual = sample_offsets(f, every)
    except (OSError, ValueError) as e:
        return [f"{path.name}: offsets not checked, unreadable tar ({e})"]
    for i, (listed, real) in enumerate(zip(sh.offsets, actual, strict=False)):  # lengths: below
        if listed != real:
            return [
                f"{path.name}: offsets[{i}] = {listed} is not where sample {i * every} starts "
                f"(byte {real}); re-create the shard set"
            ]
    if len(sh.offsets) != len(actual):
        return [
            f"{path.name}: {len(sh.offsets)} offsets, its samples need {len(actual)} "
            f"(one per {every}); re-create the shard set"
        ]
    return []


@contextlib.contextmanager
def _local_copy(root: str, name: str, tmp: Path) -> Iterator[Path | None]:
    """The shard as a local file: itself for a local set, else downloaded (with retries) into
    `tmp` and removed after; None when it does not exist."""
    local = local_path(root)
    if local is not None:
        yield local / name if (local / name).is_file() else None
        return
    path = tmp / name
    try:
        path.write_bytes(read_bytes(join(root, name)))
    except FileNotFoundError:
        yield None
        return
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def verify_shard_set(root: str | Path, *, decode: bool = True) -> VerifyReport:
    """Check every shard of the set at `root` (a folder or URL: ssl_vit.data.urls) against
    the manifest; a remote set's shards are downloaded one at a time to check them."""
    report = VerifyReport()
    try:
        m = load_manifest(root)
    except ManifestError as e:
        report.problems.append(str(e))
        return report
    root = str(m.root)
    first = next((sh.name for info in m.splits.values() for sh in info.shards), None)
    ranged = probe_range(join(root, first)) if first else None
    if ranged is not None:
        factor = (
            "readers start inside shards at their offsets"
            if ranged
            else "a reader that starts inside a shard reads it from its start (an epoch reads "
            "up to 1.5x the set when shards are split between two loader streams; "
            "--check gives a config's figure)"
        )
        report.lines.append(f"range requests: {'answered' if ranged else 'ignored'}; {factor}")
    with tempfile.TemporaryDirectory(prefix="verify-shards-") as tmp:
        for split, info in m.splits.items():
            for sh in info.shards:
                try:
                    with _local_copy(root, sh.name, Path(tmp)) as path:
                        report.problems.extend(_check_file(path, sh, m, decode))
                except Exception as e:  # a remote read that failed after its retries
                    report.problems.append(f"{sh.name}: unreadable ({type(e).__name__}: {e})")
            report.lines.append(
                f"{split:>6}: {info.num_samples} samples in {len(info.shards)} shards, "
                f"{sum(sh.bytes for sh in info.shards) / 1e6:.1f} MB"
            )
    try:
        errors: str | None = read_bytes(join(root, ERRORS_NAME)).decode("utf-8")
    except FileNotFoundError:
        errors = None
    if errors is not None:
        lines = [ln for ln in errors.splitlines() if ln.strip()]
        try:
            [json.loads(ln) for ln in lines]
        except ValueError:
            report.problems.append(f"{ERRORS_NAME}: not valid JSON lines")
        if len(lines) != m.num_skipped:
            report.problems.append(
                f"{ERRORS_NAME}: {len(lines)} lines, manifest says {m.num_skipped} skipped"
            )
    elif m.num_skipped:
        report.problems.append(f"{ERRORS_NAME}: missing ({m.num_skipped} skipped inputs)")
    folder = local_path(root)
    if folder is not None and not has_braces(str(m.source)):
        # a listing of a remote prefix is not looked for, nor strays of a pattern's subset
        listed = {sh.name for info in m.splits.values() for sh in info.shards}
        stray = sorted(p.name for p in folder.glob("*.tar") if p.name not in listed)
        if stray:
            report.warnings.append(f"{len(stray)} .tar files not in the manifest (e.g. {stray[0]})")
        if (folder / ".work").exists():
            report.warnings.append(".work/ left by an unfinished job (safe to delete)")
    classes = "unlabelled" if m.class_names is None else f"{len(m.class_names)} classes"
    report.lines.append(
        f"{classes}, {m.channels} channel(s), image size {m.image_size or 'mixed'}, "
        f"mean {m.mean}, std {m.std}, {m.num_skipped} skipped inputs"
    )
    return report


def add_block_checksums(root: str | Path) -> int:
    """Write `block_sha256` for every shard of a local set that lacks it (sets made before
    readers checked blocks), after the whole set verified; returns how many shards gained
    them. The manifest is replaced atomically."""
    m = load_manifest(root)
    folder = local_path(str(m.root))
    where = local_path(str(m.location))
    if folder is None or where is None:
        raise ManifestError(f"{m.where}: block checksums are added to a local set only")
    if has_braces(str(m.source)):
        raise ManifestError(f"{m.source}: point at the set's folder or manifest, not a pattern")
    if not m.index_every:
        raise ManifestError(f"{m.root}: has no offset index; re-create it with make_shards.py")
    added = 0
    for info in m.splits.values():
        for i, sh in enumerate(info.shards):
            if sh.block_sha256 is None and sh.offsets is not None:
                with open(join(str(folder), sh.name), "rb") as f:
                    digests = block_digests(f, sh.offsets, sh.bytes)
                info.shards[i] = dataclasses.replace(sh, block_sha256=digests)
                added += 1
    if added:
        write_manifest(where.parent, m, where.name)
    return added
