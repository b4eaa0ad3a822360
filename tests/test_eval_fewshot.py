"""Few-shot ridge (ViT paper sec. 4.1): closed form, leave-one-out choice of its strength."""

import numpy as np
import pytest
import torch

from ssl_vit.evaluation.fewshot import (
    ALPHA_GRID,
    DEFAULT_ALPHA,
    fewshot_accuracy,
    fewshot_eval,
    loo_predictions,
    pm1_targets,
    ridge_fit,
    sample_shots,
    select_l2,
)


def _normal_equations(x: torch.Tensor, y: torch.Tensor, l2: float):
    """Solve [X 1]^T [X 1] theta = [X 1]^T Y with l2 on W only (not on the bias)."""
    xa = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    reg = l2 * torch.eye(xa.shape[1], dtype=x.dtype)
    reg[-1, -1] = 0.0
    theta = torch.linalg.solve(xa.T @ xa + reg, xa.T @ y)
    return theta[:-1], theta[-1]


def test_ridge_equals_normal_equations_primal_and_dual():
    g = torch.Generator().manual_seed(0)
    for n, d in ((200, 12), (15, 40)):  # N > D (primal solve) and N < D (dual solve)
        x = torch.randn(n, d, generator=g, dtype=torch.float64) * 3 + 1
        y = pm1_targets(np.arange(n) % 5, 5)
        w, b = ridge_fit(x, y, l2=0.7)
        w_ref, b_ref = _normal_equations(x, y, 0.7)
        torch.testing.assert_close(w, w_ref, rtol=1e-8, atol=1e-8)
        torch.testing.assert_close(b, b_ref, rtol=1e-8, atol=1e-8)


def test_targets_are_plus_minus_one():
    t = pm1_targets(np.array([2, 0]), 3)
    assert t.tolist() == [[-1, -1, 1], [1, -1, -1]]


def test_sample_shots_per_class():
    labels = np.repeat(np.arange(4), [10, 10, 10, 2])
    idx = sample_shots(labels, 5, np.random.default_rng(0))
    assert np.bincount(labels[idx]).tolist() == [5, 5, 5, 2]  # a small class gives what it has
    assert len(set(idx.tolist())) == len(idx)


def test_fewshot_eval_separable_and_chance():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(5, 64)) * 3
    y = np.repeat(np.arange(5), 100)
    x = (centres[y] + rng.normal(size=(500, 64))).astype(np.float32)
    yt = np.repeat(np.arange(5), 40)
    xt = (centres[yt] + rng.normal(size=(200, 64))).astype(np.float32)
    out = fewshot_eval(x, y, xt, yt, shots=(1, 5), seeds=3)
    assert out["fewshot_5shot_mean"] > 0.95
    assert len(out["fewshot_1shot_all"]) == 3
    noise = fewshot_eval(rng.normal(size=(500, 64)), y, rng.normal(size=(200, 64)), yt, shots=(5,))
    assert noise["fewshot_5shot_mean"] < 0.45  # chance is 0.2
    draws = noise["fewshot_5shot_all"]  # at chance, the draws differ: the spread is real
    assert len(set(draws)) > 1 and noise["fewshot_5shot_std"] == pytest.approx(np.std(draws))
    assert noise["fewshot_5shot_mean"] == pytest.approx(np.mean(draws))


def _gaussian_classes(seed: int, k: int = 10, d: int = 50, spread: float = 0.6):
    """k Gaussian classes in d dims: with 5 shots n = d, where a weak ridge interpolates."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, d)) * spread

    def draw(n):
        y = rng.integers(0, k, n)
        return centres[y] + rng.normal(size=(n, d)), y

    return (*draw(3000), *draw(2000))


def test_loo_predictions_equal_refitting_without_each_example():
    g = torch.Generator().manual_seed(1)
    for n, d in ((12, 40), (60, 8)):  # dual-sized and primal-sized problems
        x = torch.randn(n, d, generator=g, dtype=torch.float64) * 2 + 0.5
        y = pm1_targets(np.arange(n) % 3, 3)
        l2s = [1e-3, 0.3, 25.0]
        fast = loo_predictions(x, y, l2s)  # (L, N, K)
        for j, l2 in enumerate(l2s):
            for i in range(n):
                keep = torch.arange(n) != i
                w, b = ridge_fit(x[keep], y[keep], l2)
                torch.testing.assert_close(fast[j, i], x[i] @ w + b, rtol=1e-7, atol=1e-7)


def test_loo_choice_is_near_the_test_oracle_and_avoids_interpolation():
    x, y, xt, yt = _gaussian_classes(0)
    idx = sample_shots(y, 5, np.random.default_rng(0))  # n = 50 = d
    xs = torch.from_numpy(x[idx])
    xs = (xs - xs.mean(0)) / xs.std(0, unbiased=False)
    l2, alpha, loo_acc = select_l2(xs, y[idx], 10)
    assert alpha in ALPHA_GRID and 0 <= loo_acc <= 1
    energy = float(((xs - xs.mean(0)) ** 2).sum())
    assert l2 == pytest.approx(alpha * energy)
    grid = {a: fewshot_accuracy(x[idx], y[idx], xt, yt, 10, a * energy) for a in ALPHA_GRID}
    assert fewshot_accuracy(x[idx], y[idx], xt, yt, 10, l2) >= max(grid.values()) - 0.05
    assert grid[ALPHA_GRID[0]] < max(grid.values()) - 0.2  # the grid's weak end does interpolate
    assert alpha > ALPHA_GRID[0]


def test_accuracy_grows_with_shots_where_a_fixed_l2_dips():
    x, y, xt, yt = _gaussian_classes(0)
    fixed = fewshot_eval(x, y, xt, yt, l2=1e-3)
    means = [fixed[f"fewshot_{n}shot_mean"] for n in (1, 5, 10, 25)]
    assert means[1] < means[0]  # the double-descent dip this selection is for
    loo = fewshot_eval(x, y, xt, yt)
    means = [loo[f"fewshot_{n}shot_mean"] for n in (1, 5, 10, 25)]
    assert means == sorted(means), means
    assert loo["l2_selection"] == "loo"
    assert loo["fewshot_5shot_l2_source"].startswith("leave-one-out")
    assert len(loo["fewshot_25shot_l2_all"]) == 5 and loo["ridge_l2@25shot"] > 0
    # 1 example per class: LOO cannot judge, so the 5-shot choice (relative alpha) is reused.
    assert loo["fewshot_1shot_l2_source"].startswith("median alpha chosen at 5-shot")
    assert set(loo["fewshot_1shot_alpha_all"]) == {np.median(loo["fewshot_5shot_alpha_all"])}
    alone = fewshot_eval(x, y, xt, yt, shots=(1,), seeds=2)
    assert alone["fewshot_1shot_l2_source"].startswith(f"default alpha {DEFAULT_ALPHA}")


def test_accuracy_grows_with_shots_on_real_digits():
    from sklearn.datasets import load_digits

    d = load_digits()  # 1,797 real 8x8 handwritten digits, shipped with scikit-learn
    perm = np.random.default_rng(0).permutation(len(d.target))
    te, tr = perm[:540], perm[540:]
    x = d.data / 16.0
    out = fewshot_eval(x[tr], d.target[tr], x[te], d.target[te])
    means = [out[f"fewshot_{n}shot_mean"] for n in (1, 5, 10, 25)]
    assert means == sorted(means) and means[-1] > 0.85, means
