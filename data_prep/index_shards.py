"""Index a WebDataset set made by another tool where it lies: write its manifest. See --help.

    python data_prep/index_shards.py /data/laion-subset --label none
    python data_prep/index_shards.py 'https://host/set/data-{000000..000099}.tar' --out idx/
    python data_prep/index_shards.py train=s3://bucket/in1k/train val=s3://bucket/in1k/val \\
        --out idx/in1k --label cls
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ssl_vit.data.index_in_place import IndexJobError, IndexOptions, parse_sources, run_index
from ssl_vit.data.manifest import IMAGE_KEYS, MANIFEST_NAME


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="index_shards.py",
        description="Index an existing WebDataset shard set (webdataset's ShardWriter, "
        "img2dataset, public sets) in place: read every shard once, in parallel, and write "
        "the manifest (counts, offsets, checksums, classes, image statistics) that training "
        "and evaluation read. The shards are not changed.",
    )
    p.add_argument(
        "sources",
        nargs="+",
        metavar="[SPLIT=]SOURCE",
        help="a folder or URL of .tar shards, a brace pattern (data-{000000..000099}.tar) or "
        "a list file of shard paths or URLs; SPLIT= names its split (default: train). Every "
        "split's shards must lie in one folder",
    )
    p.add_argument(
        "--out",
        help="folder for manifest.json when the set's own folder is read-only or remote; "
        "the manifest then records where the shards are: point readers at OUT/manifest.json",
    )
    p.add_argument(
        "--image-keys",
        default=",".join(IMAGE_KEYS),
        help="fields that may hold a sample's image, in the order looked for",
    )
    p.add_argument(
        "--label",
        default="cls",
        help="where a sample's label is: a field of ASCII integers (cls), json:KEY (a key of "
        "the sample's .json: integers or class names), or none",
    )
    p.add_argument(
        "--class-names",
        type=Path,
        help="a text file, one class name per line, for labels 0..K-1 (or the order of the "
        "names a JSON label holds); default: the integers found, or the sorted names",
    )
    p.add_argument(
        "--stats-every",
        type=int,
        default=20,
        help="decode one image in this many for the mean and std (every image's size and "
        "mode are read from its header)",
    )
    p.add_argument(
        "--index-every",
        type=int,
        default=100,
        help="record the byte offset of every N-th sample (where readers can start inside a "
        "shard) and a checksum of each block between two",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="shards read at a time",
    )
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if min(a.stats_every, a.workers, a.index_every) < 1:
        p.error("--stats-every, --index-every and --workers must be at least 1")
    try:
        names = None
        if a.class_names is not None:
            lines = a.class_names.read_text(encoding="utf-8").splitlines()
            names = tuple(ln.strip() for ln in lines if ln.strip())
        opts = IndexOptions(
            image_keys=tuple(k.strip().lower() for k in a.image_keys.split(",") if k.strip()),
            label=None if a.label == "none" else a.label,
            class_names=names,
            stats_every=a.stats_every,
            index_every=a.index_every,
        )
        m = run_index(parse_sources(a.sources), a.out, opts, a.workers)
    except (IndexJobError, OSError) as e:
        print(f"index_shards.py: error: {e}", file=sys.stderr)
        return 1
    where = Path(a.out).resolve() / MANIFEST_NAME if a.out else Path(str(m.root)) / MANIFEST_NAME
    for split, info in m.splits.items():
        print(f"{split:>6}: {info.num_samples} samples in {len(info.shards)} shards")
    classes = "unlabelled" if m.class_names is None else f"{len(m.class_names)} classes"
    print(f"{classes}, {m.channels} channel(s), image size {m.image_size or 'mixed'}")
    print(f"manifest: {where}   train with: data.root={where if a.out else m.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
