"""Photo JPEGs at 224 px: our shard loader vs torchvision ImageFolder, per core; bytes read per
epoch at 1..512 streams; GPU decode where there is a GPU.

    python benchmarks/jpeg_loader.py [--quick] [--batch-size 64] [--rounds 5] [--batches 12]
        [--photos DIR] [--set runs/bench/photos] [--out results/bench/jpeg_loader.json]

Input: benchmarks/photo_set.py's set (made first if missing): 2,000 random crops of real photos
(Debian's mate-backgrounds), shorter side 256, JPEG quality 90, as an ImageFolder tree and as
shards of the same JPEG bytes (data_prep/make_shards.py --format keep).

(a) Images/s per core, training augmentation at 224 px (random resized crop, scale 0.08..1, ratio
3/4..4/3, horizontal flip, uint8 (B, 3, 224, 224) batches): ours, make_train_loader(...,
num_workers=1, decode="cpu"), against ImageFolder + RandomResizedCrop(224) +
RandomHorizontalFlip + PILToTensor in a DataLoader(num_workers=1, batch_size=B, shuffle,
drop_last, persistent workers), torchvision's transforms v2 and v1 (each on the PIL image). All
in this one process: every loader has one worker process and the same batch size; the main
process only iterates. Threads: torch's DataLoader sets one torch thread in each worker, for all
of them alike; nothing else is pinned. Each of --rounds rounds times every loader in turn (the
order reversed every other round): --warmup batches first (they drain what its worker prefetched
while the others were timed), then --batches batches timed. Medians over rounds; the ratio is
ours over the faster torchvision pipeline, taken within each round, median over rounds.

(b) Bytes read per epoch. The plan (ssl_vit.data.stream.exact_pieces and read_factor) at
1, 2, 8, 32, 128, 320 and 512 streams (ranks x loader workers) for this photo set and for an
ImageNet-like set (257 shards x 5,000 samples, offset index every 100 samples, ~110 kB a
sample), each as local files, as remote shards with the offset index and as remote shards
without it. Then a real count on the photo shards: one epoch of our train loader at world size x
workers 1x1, 2x2 and 4x2 (ranks one after another in this process), the loaders' counters of
samples and bytes read against the set's samples and bytes.

(c) With CUDA: images/s of make_train_loader(decode="gpu", device="cuda") against decode="cpu",
4 workers each; skipped with a line saying so otherwise.

Writes everything to --out (JSON; paths relative to the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torchvision
import torchvision.transforms as T1
import torchvision.transforms.v2 as T2
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from photo_set import DEFAULT_OUT, ROOT, make_photo_set  # noqa: E402

from ssl_vit.data.manifest import load_manifest  # noqa: E402
from ssl_vit.data.shards import ShardRef, select_shards  # noqa: E402
from ssl_vit.data.stream import (  # noqa: E402
    Exclusions,
    exact_pieces,
    make_train_loader,
    read_factor,
    stream_quota,
)
from ssl_vit.perf import describe_machine  # noqa: E402

STREAMS = (1, 2, 8, 32, 128, 320, 512)
OURS = "ours (ssl_vit shards)"


def endless(loader) -> Iterator[torch.Tensor]:
    """Image batches of epoch after epoch."""
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        for batch in loader:
            yield batch[0]
        epoch += 1


def timed(batches: Iterator[torch.Tensor], warmup: int, n: int, sync=None) -> float:
    """images/s over n batches, after `warmup` untimed ones."""
    for _ in range(warmup):
        next(batches)
    if sync:
        sync()
    t0, images = time.perf_counter(), 0
    for _ in range(n):
        images += next(batches).shape[0]
    if sync:
        sync()
    return images / (time.perf_counter() - t0)


def folder_loader(folder: Path, tf, batch: int) -> DataLoader:
    return DataLoader(
        ImageFolder(str(folder), transform=tf),
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=1,
        persistent_workers=True,
        prefetch_factor=2,
        pin_memory=False,
    )


def throughput(folder: Path, shards: Path, a: argparse.Namespace) -> dict:
    """(a): images/s per round of each loader, medians and the ratio."""
    size, scale = 224, (0.08, 1.0)
    tf2 = T2.Compose(
        [
            T2.RandomResizedCrop(size, scale=scale, antialias=True),
            T2.RandomHorizontalFlip(),
            T2.PILToTensor(),
        ]
    )
    tf1 = T1.Compose(
        [
            T1.RandomResizedCrop(size, scale=scale, antialias=True),
            T1.RandomHorizontalFlip(),
            T1.PILToTensor(),
        ]
    )
    ours = make_train_loader(
        shards,
        "train",
        global_batch=a.batch_size,
        num_workers=1,
        img_size=size,
        scale=scale,
        decode="cpu",
        prefetch_factor=2,
        pin_memory=False,
    )
    loaders = {
        OURS: endless(ours),
        "torchvision v2 ImageFolder": endless(folder_loader(folder, tf2, a.batch_size)),
        "torchvision v1 ImageFolder": endless(folder_loader(folder, tf1, a.batch_size)),
    }
    for it in loaders.values():  # start every worker before timing anything
        next(it)
    rates: dict[str, list[float]] = {k: [] for k in loaders}
    ratios: list[float] = []
    for r in range(a.rounds):
        names = list(loaders) if r % 2 == 0 else list(loaders)[::-1]
        for name in names:
            rates[name].append(timed(loaders[name], a.warmup, a.batches))
        best_tv = max(rates[k][-1] for k in loaders if k != OURS)
        ratios.append(rates[OURS][-1] / best_tv)
        line = "  ".join(
            f"{k.split(' ')[0] if k == OURS else k.split(' ')[1]} {rates[k][-1]:6.0f}"
            for k in loaders
        )
        print(f"round {r + 1}/{a.rounds}: images/s  {line}  ratio {ratios[-1]:.2f}", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    best = max((k for k in loaders if k != OURS), key=med.get)
    print(
        f"\n{a.num_images} photo JPEGs (shorter side 256, q90) -> 224 px, batch {a.batch_size}, "
        f"1 worker each, {a.rounds} rounds x {a.batches} batches after {a.warmup} warm-up; "
        f"torch {torch.__version__}, torchvision {torchvision.__version__}"
    )
    for k, v in med.items():
        print(f"median {k:30s} {v:7.0f} images/s  ({1e6 / v:5.0f} us/image)")
    ratio = statistics.median(ratios)
    print(
        f"ours / {best}: {med[OURS] / med[best]:.2f}x (medians); within rounds {ratio:.2f}x "
        f"median, {min(ratios):.2f}..{max(ratios):.2f}  (goal >= 1.2)\n"
    )
    return {
        "images_per_s": rates,
        "median": med,
        "ratio_per_round": ratios,
        "ratio_median": ratio,
        "baseline": best,
        "batch": a.batch_size,
        "rounds": a.rounds,
        "batches": a.batches,
        "warmup": a.warmup,
    }


def _plan_row(refs: list[ShardRef], streams: int, batch: int) -> dict:
    """Read factor of epoch 0 with `streams` streams (one worker per rank) of `batch` each."""
    total = sum(r.num_samples for r in refs)
    steps = total // (streams * batch)
    quotas = [stream_quota(steps, batch, 1, 0)] * streams
    plans = exact_pieces(refs, quotas, Exclusions([]), seed=0, epoch=0)
    return {
        "streams": streams,
        "batch": batch,
        "delivered": sum(quotas) / total,
        "read_factor": read_factor(refs, plans),
    }


def _variants(refs: list[ShardRef]) -> dict[str, list[ShardRef]]:
    """The same shards as local files, as https URLs with the offset index, and without it."""
    remote = [
        ShardRef(
            "https://data.example/" + Path(r.url).name, r.num_samples, r.offset, r.offsets, r.every
        )
        for r in refs
    ]
    bare = [ShardRef(r.url, r.num_samples, r.offset) for r in remote]
    return {"local": refs, "remote, indexed": remote, "remote, no index": bare}


def read_plans(shards: Path, a: argparse.Namespace) -> dict:
    """(b), planned: read factors at 1..512 streams."""
    photo = select_shards(load_manifest(shards), "train")
    photo_bytes = sum(s.bytes for s in load_manifest(shards).split("train").shards)
    photo_n = sum(r.num_samples for r in photo)
    per, n, every, sample_kb = 5000, 257, 100, 110
    imagenet = [
        ShardRef(
            f"/data/imagenet/train-{i:06d}.tar",
            per,
            i * per,
            tuple(k * every * sample_kb * 1024 for k in range(per // every)),
            every,
        )
        for i in range(n)
    ]
    sets = {
        f"photo set ({photo_n:,} samples, {len(photo)} shards)": (
            photo,
            photo_bytes,
            lambda p: max(1, min(64, photo_n // p)),
        ),
        "ImageNet-like (257 x 5,000 samples)": (
            imagenet,
            n * per * sample_kb * 1024,
            lambda p: max(1, 4096 // p),
        ),
    }
    out: dict = {}
    for set_name, (refs, nbytes, batch_of) in sets.items():
        print(
            f"{set_name}: read factor per epoch (samples read, dropped ones included / the "
            f"set's samples), one loader worker per rank"
        )
        variants = _variants(refs)
        print(
            f"{'streams':>8} {'batch':>6} {'delivered':>10}"
            + "".join(f" {v:>17}" for v in variants)
            + "   GB read, remote no index"
        )
        rows = []
        for p in STREAMS:
            batch = batch_of(p)
            row = {v: _plan_row(r, p, batch) for v, r in variants.items()}
            first = next(iter(row.values()))
            gb = row["remote, no index"]["read_factor"] * nbytes / 1e9
            print(
                f"{p:>8} {batch:>6} {first['delivered']:>10.3f}"
                + "".join(f" {row[v]['read_factor']:>17.3f}" for v in variants)
                + f"   {gb:.2f} of {nbytes / 1e9:.2f}"
            )
            rows.append(
                {
                    "streams": p,
                    "batch": batch,
                    "delivered": first["delivered"],
                    **{v: row[v]["read_factor"] for v in variants},
                }
            )
        out[set_name] = rows
        print()
    return out


def read_counts(shards: Path, a: argparse.Namespace) -> list[dict]:
    """(b), counted: one real epoch of our loader per (world size, workers)."""
    man = load_manifest(shards)
    total_n = man.split("train").num_samples
    total_b = sum(s.bytes for s in man.split("train").shards)
    print(
        f"counted: one epoch of the train loader over the photo shards ({total_n} samples, "
        f"{total_b / 1e6:.1f} MB), global batch {a.count_batch}, ranks one after another"
    )
    print(
        f"{'ranks x workers':>16} {'delivered':>10} {'samples read':>13} {'bytes read':>12} "
        f"{'x samples':>10} {'x bytes':>8} {'plan':>6}"
    )
    rows = []
    for ws, workers in ((1, 1), (2, 2), (4, 2)):
        samples = nbytes = delivered = 0
        factor = None
        for rank in range(ws):
            loader = make_train_loader(
                shards,
                "train",
                global_batch=a.count_batch,
                rank=rank,
                world_size=ws,
                num_workers=workers,
                img_size=a.count_size,
                pin_memory=False,
            )
            factor = loader.read_factor
            for x, _ in loader:
                delivered += x.shape[0]
            samples += loader.counter.samples_read
            nbytes += loader.counter.bytes_read
            del loader
        row = {
            "world_size": ws,
            "workers": workers,
            "delivered": delivered,
            "samples_read": samples,
            "bytes_read": nbytes,
            "samples_factor": samples / total_n,
            "bytes_factor": nbytes / total_b,
            "planned_factor": factor,
        }
        rows.append(row)
        print(
            f"{f'{ws} x {workers}':>16} {delivered:>10} {samples:>13} {nbytes:>12} "
            f"{samples / total_n:>10.3f} {nbytes / total_b:>8.3f} {factor:>6.3f}"
        )
    print("(bytes of a shard file include its tar end blocks, which a reader need not read)\n")
    return rows


def gpu_decode(shards: Path, a: argparse.Namespace, device: str | None = None) -> dict | None:
    """(c): decode='gpu' vs decode='cpu', 4 workers each, images/s on the device (CUDA; another
    `device` only to check this code where there is none)."""
    device = device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        print("GPU decode: skipped, no CUDA device on this machine")
        return None
    cuda = device == "cuda"
    name = torch.cuda.get_device_name(0) if cuda else device
    loaders = {}
    for mode in ("gpu", "cpu"):
        loaders[mode] = make_train_loader(
            shards,
            "train",
            global_batch=a.batch_size,
            num_workers=4,
            img_size=224,
            decode=mode,
            device=device,
            pin_memory=cuda,
        )

    def on_device(loader) -> Iterator[torch.Tensor]:
        for x in endless(loader):
            yield x.to(device, non_blocking=True)

    its = {m: on_device(loader) for m, loader in loaders.items()}
    for it in its.values():
        next(it)
    rates: dict[str, list[float]] = {m: [] for m in its}
    sync = torch.cuda.synchronize if cuda else None
    for r in range(a.rounds):
        for m in list(its) if r % 2 == 0 else list(its)[::-1]:
            # 4 workers x 2 prefetched batches come at once: drain them before timing
            rates[m].append(timed(its[m], max(a.warmup, 4 * 2 + 2), a.batches, sync))
    med = {m: statistics.median(v) for m, v in rates.items()}
    ratio = med["gpu"] / med["cpu"]
    print(
        f"GPU decode ({name}), 4 workers: decode='gpu' {med['gpu']:.0f} images/s, "
        f"decode='cpu' {med['cpu']:.0f} images/s, ratio {ratio:.2f}x"
    )
    return {"images_per_s": rates, "median": med, "device": name}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and batches")
    p.add_argument("--photos", type=Path, help="source photo folder for photo_set.py")
    p.add_argument("--set", type=Path, default=DEFAULT_OUT, help="photo set folder")
    p.add_argument("--num-images", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", type=int, default=12, help="timed batches per loader and round")
    p.add_argument("--warmup", type=int, default=4, help="untimed batches before each timing")
    p.add_argument("--count-batch", type=int, default=64, help="global batch, real counts")
    p.add_argument("--count-size", type=int, default=224, help="image size, real counts")
    p.add_argument("--out", type=Path, help="results JSON (results/bench/jpeg_loader[.quick].json)")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.batches = 3, 6
    out = a.out or ROOT / "results" / "bench" / f"jpeg_loader{'.quick' if a.quick else ''}.json"
    load0, t0 = os.getloadavg()[0], time.time()
    folder, shards = make_photo_set(a.set, photos=a.photos, num=a.num_images, quiet=True)
    print(f"machine: {describe_machine()}; load average {load0:.1f} at start")
    result = {
        "machine": describe_machine(),
        "command": " ".join(["python", *sys.argv]),
        "set": os.path.relpath(a.set if a.set.is_absolute() else ROOT / a.set, ROOT),
        "date": time.strftime("%Y-%m-%d"),
    }
    result["throughput"] = throughput(folder, shards, a)
    result["read_plan"] = read_plans(shards, a)
    result["read_count"] = read_counts(shards, a)
    result["gpu_decode"] = gpu_decode(shards, a)
    result["load_average"] = [load0, os.getloadavg()[0]]
    result["minutes"] = (time.time() - t0) / 60
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
