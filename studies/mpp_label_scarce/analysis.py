"""The label-scarce study's statistics and verdict, as PLAN.md fixes them, in pure functions.

Accuracies are in points. For an arm and a subset size, `arm[k]` and `base[k]` hold the test
accuracies of the arm's pretraining seeds and of random init's seeds on evaluated subset k.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

from studies.mpp_fashion_mnist.stats import t_quantile, t_sf2

WIN_GAIN = 2.0  # points at 60 per class: the smallest gain that counts as a win
NULL_BAND = 1.0  # a convincing null's CI lies within +-1 point
PROBE_GAIN = 3.0  # the frozen probe's gain a win needs


@dataclass(frozen=True)
class Paired:
    """The paired t over subsets of d_k = mean(arm's seeds) - mean(random init's seeds)."""

    mean: float
    low: float  # the 95% confidence interval of the mean gain
    high: float
    se: float
    t: float
    p: float  # two-sided
    df: int


def subset_gains(arm: list[list[float]], base: list[list[float]]) -> list[float]:
    """d_k for every subset k."""
    if len(arm) != len(base) or not arm:
        raise ValueError(
            f"paired gains need the same subsets on both sides ({len(arm)}, {len(base)})"
        )
    return [statistics.mean(a) - statistics.mean(b) for a, b in zip(arm, base, strict=True)]


def paired_t(gains: list[float], level: float = 0.95) -> Paired:
    """Student's t on the per-subset gains, n - 1 degrees of freedom (PLAN.md, Statistics)."""
    n = len(gains)
    if n < 2:
        raise ValueError(f"a paired t needs 2+ subsets (got {n})")
    mean, se = statistics.mean(gains), statistics.stdev(gains) / math.sqrt(n)
    half = t_quantile(1.0 - (1.0 - level) / 2.0, n - 1) * se
    if se == 0.0:  # every subset gained the same: a degenerate but exact interval
        return Paired(mean, mean, mean, 0.0, math.copysign(math.inf, mean) if mean else 0.0,
                      0.0 if mean else 1.0, n - 1)  # fmt: skip
    return Paired(mean, mean - half, mean + half, se, mean / se, t_sf2(mean / se, n - 1), n - 1)


def bootstrap_interval(
    arm: list[list[float]],
    base: list[list[float]],
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """The two-level bootstrap: subsets drawn with replacement, then within each drawn subset
    the arm's seeds and random init's seeds, each with replacement; percentile interval."""
    rng = np.random.Generator(np.random.PCG64(seed))
    a, b = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)  # (K, seeds)
    k = len(a)
    picks = rng.integers(0, k, size=(resamples, k))[..., None]  # (R, K, 1): the drawn subsets
    seeds_a = rng.integers(0, a.shape[1], size=(resamples, k, a.shape[1]))  # (R, K, Sa)
    seeds_b = rng.integers(0, b.shape[1], size=(resamples, k, b.shape[1]))
    stats = (a[picks, seeds_a].mean(-1) - b[picks, seeds_b].mean(-1)).mean(-1)  # (R,)
    tail = 100 * (1.0 - level) / 2.0
    low, high = np.percentile(stats, [tail, 100 - tail])
    return float(low), float(high)


def clear_gain(p: Paired) -> bool:
    """A clear gain: the CI's lower bound above 0 and a mean gain of 2 points or more."""
    return p.low > 0.0 and p.mean >= WIN_GAIN


def null_ci(p: Paired) -> bool:
    """A null's interval: the whole 95% CI within +-1 point of 0."""
    return -NULL_BAND <= p.low and p.high <= NULL_BAND


@dataclass(frozen=True)
class Verdict:
    word: str  # "win", "convincing null" or "inconclusive"
    parts: list[tuple[str, bool]]  # each part of the rule, said with its number, and whether met


def verdict(
    mpp60: Paired,
    mpp10_gain: float,
    dose: tuple[float, float, float],
    probe60_gain: float,
    controls: dict[str, Paired],
) -> Verdict:
    """PLAN.md's rule for MPP (40 epochs) against random init. `dose`: mean fine-tuned accuracy
    at 60 per class after 0, 10 and 40 epochs; `controls`: the positive control's and the
    upper bound's paired results at 60 per class."""
    win = [
        (f"60/class: CI lower bound {mpp60.low:+.2f} > 0", mpp60.low > 0.0),
        (f"60/class: mean gain {mpp60.mean:+.2f} >= {WIN_GAIN:g}", mpp60.mean >= WIN_GAIN),
        (f"10/class: mean gain {mpp10_gain:+.2f} > 0", mpp10_gain > 0.0),
        (
            "60/class accuracy rises with epochs: " + " < ".join(f"{x:.2f}" for x in dose),
            dose[0] < dose[1] < dose[2],
        ),  # fmt: skip
        (
            f"frozen probe at 60/class: gain {probe60_gain:+.2f} >= {PROBE_GAIN:g}",
            probe60_gain >= PROBE_GAIN,
        ),  # fmt: skip
    ]
    if all(met for _, met in win):
        return Verdict("win", win)
    is_null = null_ci(mpp60)
    shown = {name: clear_gain(p) for name, p in controls.items()}
    null = [
        (f"60/class: CI [{mpp60.low:+.2f}, {mpp60.high:+.2f}] within +-{NULL_BAND:g}", is_null),
        *(
            (
                f"{name}: clear gain (CI lower bound {p.low:+.2f} > 0, mean {p.mean:+.2f} "
                f">= {WIN_GAIN:g})",
                shown[name],
            )  # fmt: skip
            for name, p in controls.items()
        ),
    ]
    if is_null and any(shown.values()):
        return Verdict("convincing null", null)
    return Verdict("inconclusive", win + null)


def plateau_rise(history: list[float]) -> float:
    """Mean of the last quarter of the evaluations minus the mean of the third quarter (PLAN.md:
    the pilot's step-count check and the baseline's plateau)."""
    n = len(history)
    if n < 4:
        raise ValueError(f"a plateau check needs 4+ evaluations (got {n})")
    third, last = history[n // 2 : 3 * n // 4], history[3 * n // 4 :]
    return statistics.mean(last) - statistics.mean(third)
