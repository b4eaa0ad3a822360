"""Few-shot ridge (ViT paper sec. 4.1): closed form equals a direct normal-equations solve."""

import numpy as np
import torch

from ssl_vit.evaluation.fewshot import fewshot_eval, pm1_targets, ridge_fit, sample_shots


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
    assert len(out["fewshot_1shot_all"]) == 3 and out["fewshot_1shot_std"] >= 0
    noise = fewshot_eval(rng.normal(size=(500, 64)), y, rng.normal(size=(200, 64)), yt, shots=(5,))
    assert noise["fewshot_5shot_mean"] < 0.45  # chance is 0.2
