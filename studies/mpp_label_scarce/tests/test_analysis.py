"""The study's statistics and verdict against hand-worked cases (PLAN.md, Statistics and What
counts): each part of the rule can flip the word."""

from __future__ import annotations

import math

import pytest

from studies.mpp_label_scarce.analysis import (
    Paired,
    bootstrap_interval,
    paired_t,
    plateau_rise,
    subset_gains,
    verdict,
)


def test_paired_t_matches_the_textbook_interval():
    p = paired_t([1.0, 2.0, 3.0, 4.0, 5.0])  # mean 3, sd sqrt(2.5), 4 degrees of freedom
    se = math.sqrt(2.5) / math.sqrt(5)
    assert (p.mean, p.df) == (3.0, 4) and p.se == pytest.approx(se)
    assert p.high - p.mean == pytest.approx(2.7764 * se, rel=1e-4)  # t(0.975, 4) = 2.7764
    assert p.t == pytest.approx(3.0 / se)
    assert 0.0131 < p.p < 0.0134  # two-sided p of t = 4.243 at 4 df
    assert paired_t([-1.0, 1.0, -1.0, 1.0]).p == pytest.approx(1.0)


def test_gains_are_per_subset_means_of_seeds():
    assert subset_gains([[80, 82], [70, 70]], [[79, 79], [71, 73]]) == [2.0, -2.0]
    with pytest.raises(ValueError, match="same subsets"):
        subset_gains([[1.0]], [[1.0], [2.0]])


def test_bootstrap_is_seeded_and_sees_seed_spread():
    base = [[80.0, 80.0]] * 5
    shifted = [[83.0, 83.0]] * 5
    assert bootstrap_interval(shifted, base, resamples=500) == pytest.approx((3.0, 3.0))
    noisy = [[78.0, 88.0]] * 5  # no spread over subsets, all of it between seeds
    lo, hi = bootstrap_interval(noisy, base, resamples=2000)
    assert lo < 3.0 < hi and hi - lo > 4.0
    assert (lo, hi) == bootstrap_interval(noisy, base, resamples=2000)  # seeded


def _p(mean: float, half: float) -> Paired:
    return Paired(mean, mean - half, mean + half, half / 2.776, 0.0, 0.5, 4)


WIN = dict(mpp10_gain=1.0, dose=(70.0, 72.0, 74.0), probe60_gain=4.0)


def test_a_win_needs_every_part():
    assert verdict(_p(3.0, 0.5), controls={}, **WIN).word == "win"
    for change in (
        dict(mpp10_gain=-0.1),
        dict(dose=(70.0, 75.0, 74.0)),
        dict(probe60_gain=2.9),
    ):
        assert verdict(_p(3.0, 0.5), controls={}, **{**WIN, **change}).word == "inconclusive"
    assert verdict(_p(1.9, 0.5), controls={}, **WIN).word == "inconclusive"  # gain < 2
    assert verdict(_p(3.0, 3.5), controls={}, **WIN).word == "inconclusive"  # CI crosses 0


def test_a_null_is_convincing_only_beside_a_clear_gain_elsewhere():
    null = _p(0.1, 0.8)
    assert verdict(null, controls={"pixels": _p(4.0, 1.0)}, **WIN).word == "convincing null"
    v = verdict(null, controls={"pixels": _p(1.5, 1.0), "supervised": _p(4.0, 5.0)}, **WIN)
    assert v.word == "inconclusive" and not any(met for text, met in v.parts if "clear" in text)
    assert verdict(_p(0.1, 1.2), controls={"pixels": _p(4.0, 1.0)}, **WIN).word == "inconclusive"


def test_plateau_rise_compares_the_last_two_quarters():
    assert plateau_rise([50, 60, 70, 80, 81, 82, 83, 84]) == pytest.approx(83.5 - 81.5)
    with pytest.raises(ValueError, match="4\\+"):
        plateau_rise([1.0, 2.0])
