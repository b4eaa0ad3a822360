"""A held-out part of a training split, for choices made during training (best epoch, lr).

Test data must never choose anything, so fine-tuning sets aside a fixed share of the *training*
split (appendix B.1.1 of the ViT paper holds out 2% to pick the learning rate). Membership
depends only on a sample's manifest index, through a fixed hash: the same samples are held out
whatever the ranks, loader workers or epochs. A second, independent hash picks the nested share
of the rest a run trains on (`data.train_fraction`), or a run names its samples
(`data.subset_file`, a sorted JSON list; a listed index that is held out is refused).

    held = held_out_indices(num_samples=60000, fraction=0.02)   # sorted int64 array (~1200)
    skip = excluded_indices(60000, 0.02, train_fraction=0.1)    # ~54,000: held out or unused
    keep = read_subset_file("subsets/n10_seed1.json", 60000, 0.02)  # checked, int64
    skip = excluded_indices(60000, 0.02, subset=keep)           # all but those 100
"""

from __future__ import annotations

import json
import os
from pathlib import Path

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
    num_samples: int,
    holdout_fraction: float,
    train_fraction: float = 1.0,
    subset: np.ndarray | None = None,
) -> np.ndarray:
    """Sorted manifest indices that training never reads: the held-out ones, and with
    `train_fraction` < 1 those outside that hashed share of the split, or with `subset` (from
    `read_subset_file`) those not in it (module doc)."""
    if not 0.0 < train_fraction <= 1.0:
        raise ValueError(f"train fraction must be in (0, 1], got {train_fraction}")
    if subset is not None and train_fraction < 1:
        raise ValueError("give a subset or a train fraction below 1, not both")
    idx = np.arange(num_samples, dtype=np.int64)
    unused = held_out_mask(idx, holdout_fraction) | (_uniform(idx, _SUBSET_SALT) >= train_fraction)
    if subset is not None:
        unused |= ~np.isin(idx, subset)
    return idx[unused]


# A subset file is read before training (and by --check): it may come from anywhere, so its
# size is bounded before it is parsed. 64 MiB holds tens of millions of indices.
MAX_SUBSET_BYTES = 64 << 20


def read_subset_file(
    path: str | os.PathLike, num_samples: int, holdout_fraction: float
) -> np.ndarray:
    """The manifest indices a `data.subset_file` lists (int64, sorted), checked against a
    split of `num_samples` with `holdout_fraction` held out. Anything else (not a file, too
    large, not JSON, not a sorted list of distinct non-negative integers, an index past the
    split's end or held out, no index at all) is a one-line ValueError naming the file."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise IsADirectoryError("not a file")
        if size > MAX_SUBSET_BYTES:
            raise ValueError(
                f"{size} bytes, more than the {MAX_SUBSET_BYTES} a subset file may hold"
            )
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{p}: cannot read the subset file ({e.__class__.__name__}: {e})"
        ) from None
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    try:
        values = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(
            f"{p}: not JSON ({e.__class__.__name__}); give a list of indices"
        ) from None
    what = "give a JSON list of sorted, distinct, non-negative manifest indices"
    if not isinstance(values, list) or not values:
        raise ValueError(f"{p}: holds {type(values).__name__} {_short(values)}; {what}")
    # bool is an int to Python: true would read as index 1
    bad = next((v for v in values if type(v) is not int or v < 0), None)
    if bad is not None:
        raise ValueError(f"{p}: lists {_short(bad)}, not a manifest index; {what}")
    if any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{p}: its indices are not sorted, or one repeats; {what}")
    if values[-1] >= num_samples:
        raise ValueError(
            f"{p}: lists index {values[-1]}, past the {num_samples} samples of the split; "
            "was it drawn for another shard set or split?"
        )
    idx = np.asarray(values, dtype=np.int64)
    held = idx[held_out_mask(idx, holdout_fraction)]
    if len(held):
        raise ValueError(
            f"{p}: lists {len(held)} held-out index(es) (first {int(held[0])}; "
            f"data.holdout_fraction={holdout_fraction}); a subset must leave the held-out "
            "samples out: draw it again excluding them, or match the holdout fraction"
        )
    return idx


def _short(value: object) -> str:
    """A value for an error message, cut to a few characters (the file is untrusted)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
