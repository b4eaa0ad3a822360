"""Tar I/O on 224-px photo JPEGs: our shard reader and writer against webdataset's.

    python benchmarks/tar_io.py [--rounds 7] [--set runs/bench/photos]
        [--out results/bench/tar_io.json]

Input: benchmarks/photo_set.py's set (2,000 random crops of real photos, shorter side 256,
JPEG quality 90, made first if missing). Everything runs in this one process on bytes already
in memory, so only the tar work is timed: no disk, no decode.

(a) Reading: samples/s grouping one tar's members into samples of raw bytes: ours
(ssl_vit.data.tar_reader.read_samples, what every training stream runs) against webdataset's
(tariterators.tar_file_expander + group_by_keys, what wds.WebDataset runs under its decoder).
(b) Writing: samples/s writing the same samples (key.cls, key.jpg, key.json) into a tar in
memory: ours (shard_writer.sample_members + sample_blob, what make_shards.py writes) against
webdataset.TarWriter with a fixed mtime (needed for identical bytes from identical input).

Each round times every side in turn, the order reversed every other round; the ratio (ours /
webdataset, samples/s) is taken within each round; medians over rounds. Writes --out (JSON).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import webdataset as wds  # noqa: E402
from webdataset import tariterators  # noqa: E402

from benchmarks.photo_set import make_photo_set  # noqa: E402
from ssl_vit.data.shard_writer import sample_blob, sample_members, sample_meta  # noqa: E402
from ssl_vit.data.tar_reader import read_samples  # noqa: E402
from ssl_vit.perf import describe_machine  # noqa: E402


def load_samples(images: Path) -> list[tuple[str, bytes, int]]:
    """(key, JPEG bytes, label) of every image of the set, in a fixed order."""
    files = sorted(images.rglob("*.jpg"))
    return [(f"{i:06d}", p.read_bytes(), i % 10) for i, p in enumerate(files)]


def write_ours(samples) -> bytes:
    out = io.BytesIO()
    for key, jpg, label in samples:
        meta = sample_meta(key, (256, 256))
        out.write(sample_blob(sample_members(key, "jpg", jpg, label, meta)))
    out.write(b"\0" * 1024)
    return out.getvalue()


def write_webdataset(samples) -> bytes:
    out = io.BytesIO()
    with wds.TarWriter(out, mtime=0.0, encoder=False) as w:
        for key, jpg, label in samples:
            meta = sample_meta(key, (256, 256))
            w.write({"__key__": key, "cls": b"%d" % label, "jpg": jpg, "json": meta})
    return out.getvalue()


def read_ours(blob: bytes) -> int:
    return sum(1 for _, s in read_samples(io.BytesIO(blob), "bench.tar") if s is not None)


def read_webdataset(blob: bytes) -> int:
    members = tariterators.tar_file_expander([{"stream": io.BytesIO(blob), "url": "bench.tar"}])
    return sum(1 for _ in tariterators.group_by_keys(members))


def timed(fn, arg) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(arg)
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--set", type=Path, default=Path("runs/bench/photos"))
    p.add_argument("--out", type=Path, default=ROOT / "results/bench/tar_io.json")
    args = p.parse_args()
    images, _ = make_photo_set(args.set, quiet=True)
    samples = load_samples(images)
    n = len(samples)
    blob = write_ours(samples)
    assert read_ours(blob) == read_webdataset(blob) == n  # both read every sample back

    sides = {
        "read": (("ours", read_ours), ("webdataset", read_webdataset), blob),
        "write": (("ours", write_ours), ("webdataset", write_webdataset), samples),
    }
    results = {}
    for what, (a, b, arg) in sides.items():
        rates: dict[str, list[float]] = {a[0]: [], b[0]: []}
        ratios = []
        for r in range(args.rounds):
            order = (a, b) if r % 2 == 0 else (b, a)
            rate = {name: n / timed(fn, arg)[0] for name, fn in order}
            for name in rate:
                rates[name].append(rate[name])
            ratios.append(rate["ours"] / rate["webdataset"])
        results[what] = {
            "samples_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "ratio_ours_over_webdataset": statistics.median(ratios),
            "ratios": ratios,
        }
        med = results[what]["samples_per_s"]
        print(
            f"{what:5}: ours {med['ours']:9.0f} samples/s, webdataset {med['webdataset']:9.0f}"
            f" samples/s, ratio {results[what]['ratio_ours_over_webdataset']:.2f}"
            f" (median of {args.rounds} rounds)",
            flush=True,
        )
    out = {
        "samples": n,
        "mean_sample_kb": len(blob) / n / 1e3,
        "rounds": args.rounds,
        "machine": describe_machine(),
        **results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
