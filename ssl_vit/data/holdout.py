"""A held-out part of a training split, for choices made during training (best epoch, lr).

Test data must never choose anything, so fine-tuning sets aside a fixed share of the *training*
split (appendix B.1.1 of the ViT paper holds out 2% of the training set to pick the learning
rate). Membership depends only on a sample's manifest index within its split, through a fixed
hash: the same samples are held out whatever the number of ranks, loader workers or epochs,
and the train loader never yields them.

    held = held_out_indices(num_samples=60000, fraction=0.02)   # sorted int64 array (~1200)
"""

from __future__ import annotations

import numpy as np

_SALT = np.uint64(0x9E3779B97F4A7C15 ^ 0x484F4C444F5554)  # fixed: changing it moves samples
HOLDOUT_SPLIT = "holdout"  # the name the in-training evals give this part (of data.split)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (wrapping uint64 arithmetic), uniform output bits."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def held_out_mask(indices: np.ndarray, fraction: float) -> np.ndarray:
    """True where a sample (by manifest index within its split) is held out."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    u = _splitmix64(np.asarray(indices, dtype=np.uint64) ^ _SALT) >> np.uint64(11)
    return u.astype(np.float64) * 2.0**-53 < fraction  # u in [0, 1)


def held_out_indices(num_samples: int, fraction: float) -> np.ndarray:
    """Sorted manifest indices of the held-out samples of a split of `num_samples`."""
    idx = np.arange(num_samples, dtype=np.int64)
    return idx[held_out_mask(idx, fraction)]
