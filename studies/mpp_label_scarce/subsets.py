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
"""

from __future__ import annotations

import numpy as np


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
