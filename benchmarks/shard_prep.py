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


def bare(source: Path) -> tuple[float, float, int]:
    """Decode the IDX files and PNG-encode every image: the work no sharder can avoid."""
    t0, c0 = time.perf_counter(), time.process_time()
    items = open_source(source).items
    for it in items:
        buf = io.BytesIO()
        Image.fromarray(it.pixels).save(buf, "PNG")
    return time.perf_counter() - t0, time.process_time() - c0, len(items)


def job(source: Path, workers: int) -> tuple[float, float, int]:
    """The whole job: read, plan, encode, write tars, hash, fsync, merge, manifest."""
    with tempfile.TemporaryDirectory(prefix="shard_bench_") as tmp:
        t0, c0 = time.perf_counter(), time.process_time()
        opts = ShardOptions(image=ImageOptions(mode="auto"))
        s = run_job(source, Path(tmp) / "out", opts, workers=workers)
        return time.perf_counter() - t0, time.process_time() - c0, s.kept


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--source", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=0, help="also time the job with N workers")
    a = p.parse_args()
    if not a.source.is_dir():
        print(f"shard_prep.py: error: {a.source}: no Fashion-MNIST IDX files", file=sys.stderr)
        return 1
    # Wall time is what the goal is about; CPU time of this process (all its threads) is the
    # steadier figure on a shared machine, where other users' load shifts wall time by 30%.
    times: dict[str, list[float]] = {k: [] for k in ("bare", "job", "bare_cpu", "job_cpu", "jw")}
    n = 0
    for r in range(a.repeats):
        tb, cb, n = bare(a.source)
        tj, cj, kept = job(a.source, 1)
        assert kept == n, (kept, n)
        for k, v in (("bare", tb), ("job", tj), ("bare_cpu", cb), ("job_cpu", cj)):
            times[k].append(v)
        if a.workers > 1:
            times["jw"].append(job(a.source, a.workers)[0])
        print(
            f"round {r}: bare {tb:.2f}s (cpu {cb:.2f}s)  job {tj:.2f}s (cpu {cj:.2f}s)  "
            f"ratio wall {tj / tb:.3f} cpu {cj / cb:.3f}",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in times.items() if v}
    print(f"images: {n}")
    print(f"bare decode+encode: median {med['bare']:.2f}s  {n / med['bare']:,.0f} images/s")
    print(f"make_shards (1 worker): median {med['job']:.2f}s  {n / med['job']:,.0f} images/s")
    if "jw" in med:
        w = med["jw"]
        print(f"make_shards ({a.workers} workers): median {w:.2f}s  {n / w:,.0f} images/s")
    print(f"ratio job/bare, wall: {med['job'] / med['bare']:.3f} (goal <= 1.3)")
    print(f"ratio job/bare, cpu:  {med['job_cpu'] / med['bare_cpu']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
