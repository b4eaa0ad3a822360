"""A reproducible set of photo JPEGs to benchmark JPEG loading on, as an ImageFolder and shards.

    python benchmarks/photo_set.py [--photos DIR] [--out runs/bench/photos] [--num 2000]

Debian's `mate-backgrounds` package ships real photographs (`apt-get install mate-backgrounds`):
by default its nature/ folder and abstract/Elephants.jpg are the sources; `--photos DIR` takes
every JPEG of any folder instead. From them N seeded random crops (aspect ratio log-uniform in
3:4..4:3, 5..100% of the largest such box, so images differ in content and detail) are resized
to a shorter side of 256 (PIL, Lanczos) and saved as JPEG quality 90 in an ImageFolder tree,
`OUT/images/class_KK/NNNNN.jpg` (class = source photo modulo --classes), then sharded by the
project's own tool with the original bytes kept:

    python data_prep/make_shards.py OUT/images OUT/shards --format keep --workers 2 \
        --shard-size 250

The same arguments give the same files. A finished set is reused (the images are redone only when
the arguments differ from the stamp `OUT/images.json`, and then the old images and shards are
deleted; make_shards is a no-op when its shards are complete). Benchmark input only: the default
OUT is under the git-ignored runs/.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
MATE = Path("/usr/share/backgrounds/mate")
DEFAULT_OUT = Path("runs/bench/photos")


def default_photos() -> list[Path]:
    """mate-backgrounds' photographs: nature/*.jpg and abstract/Elephants.jpg."""
    photos = sorted((MATE / "nature").glob("*.jpg")) + [MATE / "abstract" / "Elephants.jpg"]
    return [p for p in photos if p.is_file()]


def find_photos(folder: Path | None) -> list[Path]:
    if folder is None:
        photos = default_photos()
        if not photos:
            sys.exit(
                f"photo_set.py: no photos under {MATE}; install them with "
                "`apt-get install mate-backgrounds`, or pass --photos DIR"
            )
        return photos
    exts = {".jpg", ".jpeg"}
    photos = sorted(p for p in folder.rglob("*") if p.suffix.lower() in exts and p.is_file())
    if not photos:
        sys.exit(f"photo_set.py: no .jpg/.jpeg files under {folder}")
    return photos


def crop_box(rng: random.Random, width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom): aspect ratio log-uniform in 3:4..4:3, an area of 5..100% of
    the largest box of that aspect ratio inside the photo, at a uniform position."""
    aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))  # width / height
    w_max = min(width, height * aspect)
    frac = math.sqrt(rng.uniform(0.05, 1.0))  # side fraction: area uniform in 5..100%
    w = max(16, round(w_max * frac))
    h = max(16, min(height, round(w / aspect)))
    left, top = rng.randint(0, width - w), rng.randint(0, height - h)
    return left, top, left + w, top + h


def make_images(
    photos: list[Path], out: Path, n: int, seed: int, size: int, quality: int, classes: int
) -> None:
    """n crops of the photos as an ImageFolder tree under out (the same files for the same
    arguments); skipped when the stamp says they are already there."""
    stamp_path = out / "images.json"
    stamp = {
        "photos": [p.name for p in photos],
        "num": n,
        "seed": seed,
        "size": size,
        "quality": quality,
        "classes": classes,
    }
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
        return
    for old in ("images", "shards"):  # another set's files: start over
        shutil.rmtree(out / old, ignore_errors=True)
    sources = []
    for p in photos:
        with Image.open(p) as im:
            sources.append(im.convert("RGB"))
    rng = random.Random(seed)
    for i in range(n):
        s = i % len(sources)
        src = sources[s]
        box = crop_box(rng, *src.size)
        w, h = box[2] - box[0], box[3] - box[1]
        scale = size / min(w, h)
        target = (max(1, round(w * scale)), max(1, round(h * scale)))
        img = src.resize(target, Image.LANCZOS, box=box, reducing_gap=3.0)
        folder = out / "images" / f"class_{s % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"{i:05d}.jpg", "JPEG", quality=quality)
    stamp_path.write_text(json.dumps(stamp, indent=1) + "\n")


def make_photo_set(
    out: Path = DEFAULT_OUT,
    *,
    photos: Path | None = None,
    num: int = 2000,
    seed: int = 0,
    size: int = 256,
    quality: int = 90,
    classes: int = 10,
    shard_size: int = 250,
    quiet: bool = False,
) -> tuple[Path, Path]:
    """(the ImageFolder, the shard folder) of the set, made if needed."""
    out = out if out.is_absolute() else ROOT / out
    make_images(find_photos(photos), out, num, seed, size, quality, classes)
    shards = out / "shards"
    cmd = [
        sys.executable,
        str(ROOT / "data_prep" / "make_shards.py"),
        str(out / "images"),
        str(shards),
        "--format",
        "keep",
        "--workers",
        "2",
        "--shard-size",
        str(shard_size),
    ]
    if not (shards / "manifest.json").is_file() or not quiet:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=quiet, text=True)
        if done.returncode != 0:
            sys.exit(f"photo_set.py: make_shards failed:\n{done.stderr or ''}")
    return out / "images", shards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--photos", type=Path, help="folder of source JPEGs (mate-backgrounds')")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (%(default)s)")
    p.add_argument("--num", type=int, default=2000, help="images to cut (%(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=256, help="shorter side (%(default)s)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (%(default)s)")
    p.add_argument("--classes", type=int, default=10, help="class folders (%(default)s)")
    p.add_argument("--shard-size", type=int, default=250, help="samples per shard (%(default)s)")
    a = p.parse_args()
    folder, shards = make_photo_set(
        a.out,
        photos=a.photos,
        num=a.num,
        seed=a.seed,
        size=a.size,
        quality=a.quality,
        classes=a.classes,
        shard_size=a.shard_size,
    )
    n = sum(1 for _ in folder.rglob("*.jpg"))
    print(f"{n} JPEGs in {folder}; shards in {shards}")


if __name__ == "__main__":
    main()
