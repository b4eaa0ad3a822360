"""Turn an image corpus into deterministic WebDataset shards: see --help."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ssl_vit.data.imaging import FORMATS, RESIZE_MODES, ImageOptions
from ssl_vit.data.manifest import ManifestError
from ssl_vit.data.shard_job import JobError, run_job
from ssl_vit.data.shard_plan import ShardOptions
from ssl_vit.data.sources import SourceError
from ssl_vit.logs import OneLineParser

DESCRIPTION = """\
Turn an image corpus into WebDataset shards that every later stage reads.

SOURCE is one of:
  an image folder   class subfolders become labels (sorted names -> 0, 1, ...); a flat folder is
                    unlabelled; top-level train/ val/ test/ folders keep their split.
  a list file       .txt ("path" or "path<TAB>label"), .csv (columns path[,label][,split], header
                    optional) or .jsonl ({"path": ..., "label": ..., "split": ...}); paths are
                    relative to the list file; labels are integers or class names.
  an IDX folder     MNIST / Fashion-MNIST files (*-images-idx3-ubyte[.gz] with their labels); the
                    train/test split of the files is kept and the class names are recognised.
  a WebDataset set  a folder of .tar shards, a brace pattern or one .tar (labels from .cls): to
                    re-shard or resize it.

OUT receives {split}-{index:06d}.tar shards (samples {key}.png|jpg|webp, {key}.cls, {key}.json),
manifest.json (counts, sizes, sha256, class names, per-channel mean/std of the train split, how it
was made) and errors.jsonl (every skipped input and why). The same input and options always give
byte-identical files, whatever --workers or --num-jobs.
"""

EPILOG = """\
splits:    --val-fraction/--test-fraction move a stable, path-hashed fraction of the unsplit (or
           train) inputs to val/test: adding files later never moves existing ones.
sizing:    a shard closes at --shard-size samples or --shard-bytes bytes, whichever comes first.
           --num-shards N instead cuts each split into N shards of equal size (+-1 sample): give
           training at least ranks x loader workers shards so each stream reads its own. The
           train split must hold N samples; a smaller other split gets one sample per shard.
index:     manifest.json lists the byte offset of every 100th sample of each shard, so a reader
           can start inside a shard without reading its head.
encoding:  --format keep stores the original bytes when nothing had to change (PNG/JPEG/WebP with
           the right mode, no rotation or resize) and re-encodes in the same format otherwise;
           png/jpg/webp always re-encode (--quality for jpg/webp). IDX images are stored as PNG.
hygiene:   EXIF rotation applied; CMYK, palette, 1-bit, 16-bit (scaled) and alpha (on white)
           converted to --mode; first frame of animations; bad files are skipped and logged.
parallel:  --workers N decodes on N processes on this machine.
machines:  run the same command with --num-jobs N --job-index I (I = 0..N-1, e.g. a SLURM
           array index) on N machines sharing OUT; each writes disjoint shards. Then run it once
           more with --merge to name the shards and write the manifest.
resume:    rerun the same command after a crash: complete, verified shards are kept, the rest is
           redone. A shard appears under its final name only when complete.

examples:
  python data_prep/make_shards.py /usr/share/datasets/fashion-mnist shards/fashion-mnist
  python data_prep/make_shards.py photos/ shards/photos --resize shorter --size 256 --format jpg \\
      --val-fraction 0.05 --workers 16
"""

T = TypeVar("T")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _bytes(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 500M or 1G") from None
    if value < 4096:
        raise argparse.ArgumentTypeError(f"{text!r} is too small for a shard (at least 4K)")
    return value


def _number(convert: Callable[[str], T], ok: Callable[[T], bool], what: str) -> Callable[[str], T]:
    """An argparse type: the text converted, where `ok` holds of it; else "TEXT is not WHAT"."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


_fraction = _number(float, lambda v: 0.0 <= v < 1.0, "a fraction in [0, 1)")
_positive = _number(int, lambda v: v >= 1, "a positive integer")
_quality = _number(int, lambda v: 1 <= v <= 100, "a quality from 1 to 100")


def _cpus() -> int:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux: the CPUs this job may use
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="make_shards.py",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source",
        help="image folder, list file, IDX folder or WebDataset set (a folder of .tar "
        "shards, a brace pattern data-{000000..000099}.tar); folders, list files and sets may "
        "be URLs (s3://bucket/photos, gs://..., https://...), read where they are",
    )
    p.add_argument("out", type=Path, help="output folder for shards, manifest.json, errors.jsonl")
    g = p.add_argument_group("splits and order")
    g.add_argument("--val-fraction", type=_fraction, default=0.0, help="fraction to val (0)")
    g.add_argument("--test-fraction", type=_fraction, default=0.0, help="fraction to test (0)")
    g.add_argument("--seed", type=int, default=0, help="seed of the shuffle inside each split (0)")
    g = p.add_argument_group("sizing")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--shard-size", type=_positive, default=None, help="samples per shard (5000)")
    one.add_argument(
        "--num-shards",
        type=_positive,
        default=None,
        metavar="N",
        help="instead of --shard-size: every split in N shards of equal size (+-1 sample; more "
        "if --shard-bytes splits one). Use N >= ranks x loader workers: training then gives each "
        "stream shards of its own; with fewer, every stream reads every shard",
    )
    g.add_argument("--shard-bytes", type=_bytes, default=1 << 30, help="bytes per shard (1G)")
    g = p.add_argument_group("images")
    g.add_argument(
        "--mode",
        choices=("auto", "L", "RGB"),
        default="auto",
        help="stored channels: auto = L for IDX, RGB otherwise",
    )
    g.add_argument(
        "--resize",
        choices=RESIZE_MODES,
        default="none",
        help="scale the shorter or longer side to --size, or center-crop to a square",
    )
    g.add_argument(
        "--size", type=_positive, default=None, help="target side in pixels for --resize"
    )
    g.add_argument("--format", choices=FORMATS, default="keep", help="output encoding (keep)")
    g.add_argument(
        "--quality", type=_quality, default=95, metavar="1..100", help="jpg/webp quality (95)"
    )
    g.add_argument(
        "--max-pixels",
        type=_positive,
        default=100_000_000,
        help="skip images with more pixels (decompression-bomb guard, 1e8)",
    )
    g = p.add_argument_group("inputs")
    g.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="include symlinks that point outside SOURCE (skipped by default)",
    )
    g.add_argument("--no-labels", action="store_true", help="ignore labels (an unlabelled set)")
    g.add_argument(
        "--class-names",
        default=None,
        help="comma-separated class names, or @FILE with one name per line",
    )
    g = p.add_argument_group("parallelism, machines, resume")
    g.add_argument(
        "--workers",
        type=_positive,
        default=_cpus(),
        help="decoding processes on this machine (all CPUs)",
    )
    g.add_argument("--num-jobs", type=_positive, default=1, help="machines sharing OUT (1)")
    g.add_argument("--job-index", type=int, default=0, help="this machine's index, 0..N-1")
    g.add_argument(
        "--merge",
        action="store_true",
        help="after all --num-jobs jobs finished: name shards, write the manifest",
    )
    return p


def _class_names(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    if text.startswith("@"):
        try:
            lines = Path(text[1:]).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise SourceError(
                f"--class-names {text}: cannot read {text[1:]} ({reason}); give a text file "
                "with one class name per line"
            ) from None
        return tuple(line.strip() for line in lines if line.strip())
    return tuple(n.strip() for n in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if (a.resize == "none") != (a.size is None):
        parser.error("--resize and --size go together")
    if a.val_fraction + a.test_fraction >= 1.0:
        parser.error("--val-fraction + --test-fraction must be below 1")
    try:
        opts = ShardOptions(
            image=ImageOptions(a.mode, a.resize, a.size, a.format, a.quality, a.max_pixels),
            seed=a.seed,
            val_fraction=a.val_fraction,
            test_fraction=a.test_fraction,
            shard_size=5000 if a.shard_size is None else a.shard_size,
            num_shards=a.num_shards,
            shard_bytes=a.shard_bytes,
            follow_symlinks=a.follow_symlinks,
            labels=not a.no_labels,
            class_names=_class_names(a.class_names),
        )
        s = run_job(
            a.source,
            a.out,
            opts,
            workers=a.workers,
            num_jobs=a.num_jobs,
            job_index=a.job_index,
            merge_only=a.merge,
        )
    except (JobError, SourceError, ManifestError, ValueError) as e:
        print(f"make_shards.py: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # "PATH: Permission denied" rather than "[Errno 13] ...: 'PATH'"
        where = f"{e.filename}: " if e.filename else ""
        print(f"make_shards.py: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("make_shards.py: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    if s.up_to_date:
        print(f"{a.out}: already complete ({s.kept} samples, {s.skipped} skipped); nothing to do")
    elif s.merged:
        print(
            f"kept {s.kept} images, skipped {s.skipped} (reasons in {a.out / 'errors.jsonl'}); "
            f"{s.written_groups} shard groups written, {s.reused_groups} reused; "
            f"manifest: {a.out / 'manifest.json'}"
        )
    else:
        print(
            f"job {a.job_index}/{a.num_jobs}: kept {s.kept} images, skipped {s.skipped}; "
            f"{s.written_groups} groups written, {s.reused_groups} reused. When all jobs are "
            "done, rerun this command with --merge instead of --job-index."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
