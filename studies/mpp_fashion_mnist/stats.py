"""Welch's two-sample t-test, with Python's `math` only: the difference of two means, its
confidence interval (Welch-Satterthwaite degrees of freedom, Student t quantile) and the
two-sided p-value. Student's t distribution comes from the regularized incomplete beta
function, evaluated by its continued fraction (modified Lentz's method)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (converges fast for x < (a + 1) / (a + b + 2))."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    frac = d
    for m in range(1, 1000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            frac *= c * d
        if abs(c * d - 1.0) < eps:
            return frac
    raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}")


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc: x={x} is outside [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_sf2(t: float, df: float) -> float:
    """Two-sided tail P(|T| >= |t|) of Student's t with `df` degrees of freedom."""
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: float) -> float:
    """The t with P(T <= t) = q (0.5 < q < 1), by bisection on the two-sided tail."""
    if not 0.5 < q < 1.0:
        raise ValueError(f"t_quantile: q={q} must lie in (0.5, 1)")
    target = 2.0 * (1.0 - q)  # P(|T| >= t)
    lo, hi = 0.0, 1.0
    while t_sf2(hi, df) > target:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_sf2(mid, df) > target else (lo, mid)
    return (lo + hi) / 2.0


@dataclass(frozen=True)
class Welch:
    diff: float  # mean(a) - mean(b)
    low: float  # the confidence interval of diff
    high: float
    df: float  # Welch-Satterthwaite
    t: float
    p: float  # two-sided


def welch(a: list[float], b: list[float], level: float = 0.95) -> Welch:
    """Welch's test of mean(a) - mean(b); each sample needs two values, and some spread."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"Welch's test needs 2+ values per sample (got {len(a)} and {len(b)})")
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        raise ValueError("Welch's test: both samples have zero spread")
    diff = statistics.mean(a) - statistics.mean(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(1.0 - (1.0 - level) / 2.0, df) * se
    return Welch(diff, diff - half, diff + half, df, diff / se, t_sf2(diff / se, df))
