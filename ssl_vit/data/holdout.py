"""A held-out part of a training split, for choices made during training (best epoch, lr).

Test data must never choose anything, so fine-tuning sets aside a fixed share of the *training*
split (appendix B.1.1 of the ViT paper holds out 2% of the training set to pick the learning
rate). Membership depends only on a sample's manifest index within its split, through a fixed
hash: the same samples are held out whatever the number of ranks, loader workers or epochs,
and the train loader never yields them.

A second, independent hash picks the share of the remaining samples a run trains on
(`data.train_fraction`): a fine-tune on 10% of the labels, the label-scarce regime in which
pretraining on all the images is meant to pay (the paper pretrains on more images than it
fine-tunes on). The shares nest: the 10% subset lies inside the 20% one.

    held = held_out_indices(num_samples=60000, fraction=0.02)   # sorted int64 array (~1200)
    skip = excluded_indices(60000, 0.02, train_fraction=0.1)    # ~54,000: held out or unused
"""

from __future__ import annotations

import numpy as np

_SALT = np.uint64(0x9E3779B97F4A7C15 ^ 0x484F4C444F5554)  # fixed: changing it moves samples
_SUBSET_SALT = np.uint64(0x9E3779B97F4A7C15 ^ 0x535542534554)  # the train_fraction's own hash
HOLDOUT_SPLIT = "holdout"  # the name the in-training evals give this part (of data.split)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (wrapping uint64 arithmetic), uniform output bits."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _uniform(indices: np.ndarray, salt: np.uint64) -> np.ndarray:
    """A fixed pseudo-random number in [0, 1) per manifest index."""
    u = _splitmix64(np.asarray(indices, dtype=np.uint64) ^ salt) >> np.uint64(11)
    return u.astype(np.float64) * 2.0**-53


def held_out_mask(indices: np.ndarray, fraction: float) -> np.ndarray:
    """True where a sample (by manifest index within its split) is held out."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    return _uniform(indices, _SALT) < fraction


def held_out_indices(num_samples: int, fraction: float) -> np.ndarray:
    """Sorted manifest indices of the held-out samples of a split of `num_samples`."""
    idx = np.arange(num_samples, dtype=np.int64)
    return idx[held_out_mask(idx, fraction)]


def excluded_indices(
    num_samples: int, holdout_fraction: float, train_fraction: float = 1.0
) -> np.ndarray:
    """Sorted manifest indices that training never reads: the held-out ones, and with
    `train_fraction` < 1 those outside that hashed share of the split (module doc)."""
    if not 0.0 < train_fraction <= 1.0:
        raise ValueError(f"train fraction must be in (0, 1], got {train_fraction}")
    idx = np.arange(num_samples, dtype=np.int64)
    unused = held_out_mask(idx, holdout_fraction) | (_uniform(idx, _SUBSET_SALT) >= train_fraction)
    return idx[unused]
