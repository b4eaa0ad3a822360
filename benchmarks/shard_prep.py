"""Benchmark: make_shards on Fashion-MNIST vs the bare decode+encode of the same images.

Both run in this process, interleaved, `--repeats` times; prints medians, images/s and the ratio
job time / bare time (goal <= 1.3: tar writing, hashing, planning and stats cost little on top
of the unavoidable PNG encoding). The job runs with --workers 1 so both use one core.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from ssl_vit.data.imaging import ImageOptions
from ssl_vit.data.shard_job import run_job
from ssl_vit.data.shard_plan import ShardOptions
from ssl_vit.data.sources import open_source


def bare(source: Path) -> tuple[float, int]:
    """Decode the IDX files and PNG-encode every image: the work no sharder can avoid."""
    t0 = time.perf_counter()
    items = open_source(source).items
    for it in items:
        buf = io.BytesIO()
        Image.fromarray(it.pixels).save(buf, "PNG")
    return time.perf_counter() - t0, len(items)


def job(source: Path, workers: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory(prefix="shard_bench_") as tmp:
        t0 = time.perf_counter()
        s = run_job(
            source,
            Path(tmp) / "out",
            ShardOptions(image=ImageOptions(mode="auto")),
            workers=workers,
        )
        return time.perf_counter() - t0, s.kept


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--source", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=0, help="also time the job with N workers")
    a = p.parse_args()
    if not a.source.is_dir():
        print(f"shard_prep.py: error: {a.source}: no Fashion-MNIST IDX files", file=sys.stderr)
        return 1
    times: dict[str, list[float]] = {"bare": [], "job": [], "job_workers": []}
    n = 0
    for r in range(a.repeats):
        tb, n = bare(a.source)
        tj, kept = job(a.source, 1)
        assert kept == n, (kept, n)
        times["bare"].append(tb)
        times["job"].append(tj)
        if a.workers > 1:
            times["job_workers"].append(job(a.source, a.workers)[0])
        print(f"round {r}: bare {tb:.2f}s  job {tj:.2f}s  ratio {tj / tb:.3f}", flush=True)
    mb, mj = statistics.median(times["bare"]), statistics.median(times["job"])
    print(f"images: {n}")
    print(f"bare decode+encode: median {mb:.2f}s  {n / mb:,.0f} images/s")
    print(f"make_shards (1 worker): median {mj:.2f}s  {n / mj:,.0f} images/s")
    if times["job_workers"]:
        mw = statistics.median(times["job_workers"])
        print(f"make_shards ({a.workers} workers): median {mw:.2f}s  {n / mw:,.0f} images/s")
    print(
        f"ratio job/bare: {mj / mb:.3f} (goal <= 1.3); per-round ratios: "
        + ", ".join(f"{j / b:.3f}" for j, b in zip(times["job"], times["bare"], strict=True))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
