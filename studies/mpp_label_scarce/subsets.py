"""Class-balanced labelled subsets of the training split, drawn with fixed seeds.

A subset holds `per_class` images of every class, picked uniformly at random (numpy's PCG64,
seeded) among the eligible images: those of the training split that are neither held out (the
hashed 2% that chooses, `ssl_vit.data.holdout`) nor in an excluded set (the pilot subset, for
the evaluated ones). Each subset depends on its seed alone, not on how many others are drawn.
Indices are manifest indices within the split, sorted.

    labels = ...                                   # int array, one label per training image
    held = held_out_indices(len(labels), 0.02)
    pilot = class_balanced_subset(labels, 60, PILOT_SEED, exclude=held)
    subset = class_balanced_subset(labels, 10, seed=1, exclude=np.union1d(held, pilot))

As a command it reads the split's labels from the shards, in manifest order, and writes the
study's subset files (`data.subset_file`, `--train-indices`) and subsets.json naming them:

    python studies/mpp_label_scarce/subsets.py --data shards/fashion-mnist \
        --out studies/mpp_label_scarce/subsets
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from ssl_vit.data.holdout import held_out_indices  # noqa: E402
from studies.mpp_label_scarce import steps  # noqa: E402


def class_balanced_subset(
    labels: np.ndarray, per_class: int, seed: int, exclude: np.ndarray | None = None
) -> np.ndarray:
    """Sorted indices of `per_class` images of each class of `labels`, none in `exclude`."""
    labels = np.asarray(labels)
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    eligible = np.ones(len(labels), dtype=bool)
    if exclude is not None and len(exclude):
        eligible[np.asarray(exclude, dtype=np.int64)] = False
    rng = np.random.default_rng(seed)
    picked = []
    for c in np.unique(labels):  # classes in a fixed order: the draw depends on the seed only
        pool = np.flatnonzero(eligible & (labels == c))
        if len(pool) < per_class:
            raise ValueError(f"class {c} has {len(pool)} eligible images, {per_class} asked")
        picked.append(rng.choice(pool, size=per_class, replace=False))
    return np.sort(np.concatenate(picked))


def split_labels(data: str, split: str = "train") -> np.ndarray:
    """The label of every sample of `split`, indexed by manifest index: read from the shards
    (checked against the manifest's checksums where it has them) through the product's own
    reader and label parsing, so the indices mean what training's do. A sample that cannot be
    read or has no valid label is an error: a subset must not shift onto other images."""
    from ssl_vit.data.augment import sample_label
    from ssl_vit.data.manifest import load_manifest
    from ssl_vit.data.shards import ReadCounter, read_shard, select_shards

    manifest = load_manifest(data)
    if manifest.num_classes is None:
        raise ValueError(f"{data}: an unlabelled shard set; class-balanced subsets need labels")
    n = manifest.split(split).num_samples
    labels = np.full(n, -1, dtype=np.int64)
    counter = ReadCounter(mp.get_context("spawn"))
    for ref in select_shards(manifest, split, "error"):
        for sample in read_shard(ref, counter, missing="error"):
            labels[sample["__index__"]] = sample_label(
                sample, labelled=True, num_classes=manifest.num_classes, layout=manifest.layout
            )
    if (labels < 0).any():
        raise ValueError(
            f"{data}: {int((labels < 0).sum())} of the {n} {split} samples were not read"
        )
    return labels


def draw(
    labels: np.ndarray,
    holdout_fraction: float,
    pilot: tuple[int, int],
    per_class: tuple[int, ...],
    seeds: tuple[int, ...],
) -> dict[tuple[int, int], np.ndarray]:
    """(per class, seed) -> sorted indices: the pilot from the images not held out, each
    evaluated subset from those neither held out nor in the pilot (PLAN.md, Data)."""
    held = held_out_indices(len(labels), holdout_fraction)
    first = class_balanced_subset(labels, *pilot, exclude=held)
    out = {pilot: first}
    pool_out = np.union1d(held, first)
    for n in per_class:
        for seed in seeds:
            if (n, seed) == pilot:
                raise ValueError(f"subset {n} per class, seed {seed} is the pilot's; give another")
            out[(n, seed)] = class_balanced_subset(labels, n, seed, exclude=pool_out)
    return out


def write_subsets(
    data: str,
    out: Path,
    split: str = "train",
    holdout_fraction: float = steps.HOLDOUT,
    pilot: tuple[int, int] = steps.PILOT,
    per_class: tuple[int, ...] = steps.PER_CLASS,
    seeds: tuple[int, ...] = steps.SUBSET_SEEDS,
) -> dict:
    """Write every subset file into `out` and subsets.json (last) naming them; returns that."""
    from ssl_vit.io import atomic_write_text

    labels = split_labels(data, split)
    subsets = draw(labels, holdout_fraction, pilot, per_class, seeds)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for (n, seed), idx in subsets.items():
        name = steps.subset_file(n, seed).name
        text = json.dumps(idx.tolist()) + "\n"
        atomic_write_text(out / name, text)
        classes, counts = np.unique(labels[idx], return_counts=True)
        files.append(
            {
                "file": name,
                "role": "pilot" if (n, seed) == pilot else "evaluated",
                "per_class": n,
                "seed": seed,
                "count": len(idx),
                "class_counts": {str(c): int(k) for c, k in zip(classes, counts, strict=True)},
                "sha256": hashlib.sha256(text.encode()).hexdigest(),
            }
        )
    index = {
        "data": data,
        "split": split,
        "num_samples": len(labels),
        "holdout_fraction": holdout_fraction,
        "held_out": len(held_out_indices(len(labels), holdout_fraction)),
        "drawn_by": "class_balanced_subset: per class, uniformly without replacement, numpy "
        "PCG64 seeded with the subset's seed; the evaluated ones exclude the held-out images "
        "and the pilot's",
        "subsets": files,
    }
    atomic_write_text(out / "subsets.json", json.dumps(index, indent=2) + "\n")
    return index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the shard set (a folder or URL)")
    p.add_argument("--out", required=True, type=Path, help="folder for the subset files")
    p.add_argument("--split", default="train", help="the split drawn from (train)")
    p.add_argument(
        "--holdout-fraction",
        type=float,
        default=steps.HOLDOUT,
        help=f"held-out share never drawn, as training's data.holdout_fraction ({steps.HOLDOUT})",
    )
    p.add_argument(
        "--pilot",
        type=int,
        nargs=2,
        default=list(steps.PILOT),
        metavar=("PER_CLASS", "SEED"),
        help=f"the pilot subset {steps.PILOT}",
    )
    p.add_argument("--per-class", type=int, nargs="+", default=list(steps.PER_CLASS))
    p.add_argument("--seeds", type=int, nargs="+", default=list(steps.SUBSET_SEEDS))
    args = p.parse_args(argv)
    try:
        index = write_subsets(
            args.data,
            args.out,
            args.split,
            args.holdout_fraction,
            tuple(args.pilot),
            tuple(args.per_class),
            tuple(args.seeds),
        )
    except (OSError, ValueError) as e:  # ManifestError, ShardReadError, CorruptSample among them
        print(f"subsets.py: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    for f in index["subsets"]:
        print(f"{args.out / f['file']}: {f['count']} images ({f['role']}, seed {f['seed']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
