"""Shard loader vs torchvision ImageFolder + DataLoader on the same PNG images.

    python benchmarks/loader.py [--num-images 10000] [--workers 2] [--img-size 28] [--repeats 3]

Writes N Fashion-MNIST training images once as PNGs into an ImageFolder tree and as WebDataset
shards (webdataset.TarWriter + write_manifest), then times full epochs of both loaders with the
same transform (the paper's random resized crop + flip on the uint8 PIL image), batch size and
worker count, alternating which goes first. Prints per-epoch images/s, medians and the ratio.
Then reads the shards' raw samples side by side with webdataset's reader (Python's tarfile
underneath) and ssl_vit.data.tar_reader (ours, used by the loader), in one process, and prints
microseconds per sample and the ratio. Fashion-MNIST images are tiny, so reading and file opens
weigh most; use --img-size 224 to weigh decode/resize.
"""

from __future__ import annotations

import argparse
import gzip
import io
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.v2 as T
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from ssl_vit.data.manifest import Manifest, ShardInfo, SplitInfo, write_manifest
from ssl_vit.data.stream import make_train_loader
from ssl_vit.data.tar_reader import iter_samples
from ssl_vit.io import sha256_file

FMNIST = Path("/usr/share/datasets/fashion-mnist")
ROOT = Path(__file__).resolve().parents[1]


def read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def prepare(work: Path, n: int, per_shard: int) -> tuple[Path, Path]:
    """PNG folder tree and shard set of the first n training images (reused if present)."""
    folder, shards = work / "imagefolder", work / "shards"
    if (shards / "manifest.json").is_file() and folder.is_dir():
        return folder, shards
    images = read_idx(FMNIST / "train-images-idx3-ubyte.gz")[:n]
    labels = read_idx(FMNIST / "train-labels-idx1-ubyte.gz")[:n]
    pngs = [png_bytes(a) for a in images]
    for i, (data, y) in enumerate(zip(pngs, labels, strict=True)):
        d = folder / f"{int(y):02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.png").write_bytes(data)
    shards.mkdir(parents=True, exist_ok=True)
    infos = []
    for s, start in enumerate(range(0, n, per_shard)):
        path = shards / f"train-{s:06d}.tar"
        with wds.TarWriter(str(path)) as w:
            for i in range(start, min(n, start + per_shard)):
                w.write(
                    {"__key__": f"{i:06d}", "png": pngs[i], "cls": str(int(labels[i])).encode()}
                )
        count = min(n, start + per_shard) - start
        infos.append(ShardInfo(path.name, count, path.stat().st_size, sha256_file(path)))
    x = images.astype(np.float64) / 255
    manifest = Manifest(
        splits={"train": SplitInfo(num_samples=n, shards=infos)},
        class_names=[str(c) for c in range(10)],
        channels=1,
        image_size=[28, 28],
        mean=[float(x.mean())],
        std=[float(x.std())],
        stats_split="train",
        created_by={"tool": "benchmarks/loader.py"},
    )
    write_manifest(shards, manifest)
    return folder, shards


def time_epoch(loader) -> float:
    """Images per second over one full epoch (worker start-up included, as a trainer sees it)."""
    t0, n = time.perf_counter(), 0
    for x, _ in loader:
        n += x.shape[0]
    return n / (time.perf_counter() - t0)


def compare_tar_readers(shards: Path, repeats: int) -> None:
    """Raw samples of every shard, webdataset's reader vs ours, alternating; us per sample."""
    paths = sorted(str(p) for p in shards.glob("*.tar"))
    readers = {
        "webdataset.tarfile_samples": lambda: wds.tarfile_samples([{"url": p} for p in paths]),
        "ssl_vit.data.tar_reader": lambda: (s for p in paths for s in iter_samples(p)),
    }
    times: dict[str, list[float]] = {k: [] for k in readers}
    for r in range(repeats):
        for name, read in list(readers.items())[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            n = sum(1 for _ in read())
            times[name].append((time.perf_counter() - t0) / n * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, m in med.items():
        print(f"tar reading {name:30s} {m:7.1f} us/sample (median of {repeats})")
    ratio = med["webdataset.tarfile_samples"] / med["ssl_vit.data.tar_reader"]
    print(f"ratio webdataset / ours: {ratio:.1f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-images", type=int, default=10000, help="Fashion-MNIST images to use")
    p.add_argument("--per-shard", type=int, default=1000, help="samples per shard")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers, both loaders")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--img-size", type=int, default=28, help="crop output size")
    p.add_argument("--repeats", type=int, default=3, help="epochs timed per loader")
    p.add_argument(
        "--work",
        type=Path,
        default=ROOT / "runs" / "bench" / "loader",
        help="scratch folder for the images and shards",
    )
    args = p.parse_args()

    folder, shards = prepare(args.work, args.num_images, args.per_shard)
    scale = (0.08, 1.0)  # the paper's classification augmentation (appendix B.1.2)
    # The usual torchvision pipeline, on the PIL image like ours (same antialiased box resize).
    tf = T.Compose(
        [
            T.RandomResizedCrop(args.img_size, scale=scale, antialias=True),
            T.RandomHorizontalFlip(),
            T.PILToTensor(),
        ]
    )
    folder_ds = ImageFolder(str(folder), transform=tf, loader=lambda p: Image.open(p).convert("L"))
    folder_dl = DataLoader(
        folder_ds,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        pin_memory=torch.cuda.is_available(),
    )
    shard_dl = make_train_loader(
        shards,
        "train",
        global_batch=args.batch_size,
        num_workers=args.workers,
        img_size=args.img_size,
        scale=scale,
    )
    results: dict[str, list[float]] = {"shards (ssl_vit.data.stream)": [], "ImageFolder": []}
    for r in range(args.repeats):
        order = [("shards (ssl_vit.data.stream)", shard_dl), ("ImageFolder", folder_dl)]
        for name, loader in order if r % 2 == 0 else order[::-1]:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(r)
            rate = time_epoch(loader)
            results[name].append(rate)
            print(f"repeat {r + 1}/{args.repeats}  {name:30s} {rate:9.0f} images/s", flush=True)
    print(
        f"\n{args.num_images} PNGs {args.img_size}px, batch {args.batch_size}, "
        f"{args.workers} workers, torch {torch.__version__}"
    )
    med = {k: statistics.median(v) for k, v in results.items()}
    for name, m in med.items():
        print(f"median {name:30s} {m:9.0f} images/s")
    ratio = med["shards (ssl_vit.data.stream)"] / med["ImageFolder"]
    print(f"ratio shards / ImageFolder: {ratio:.2f}x\n")
    compare_tar_readers(shards, max(3, args.repeats))


if __name__ == "__main__":
    main()
