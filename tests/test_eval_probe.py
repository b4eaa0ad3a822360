"""Linear probe on frozen features: separable data is separated, sweep picks from the grid."""

import numpy as np
import pytest
import torch

from ssl_vit.evaluation.linear_probe import linear_probe_eval, mae_probe_eval, topk_accuracies


def _separable(n: int, seed: int, w: np.ndarray):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, w.shape[0])).astype(np.float32)
    scores = x @ w
    keep = np.sort(scores, axis=1)[:, -1] - np.sort(scores, axis=1)[:, -2] > 0.2  # a margin
    return x[keep], scores[keep].argmax(1)


W = np.random.default_rng(42).normal(size=(20, 6))


def test_lbfgs_probe_separates_linearly_separable_features():
    x, y = _separable(2000, 0, W)
    xt, yt = _separable(500, 1, W)
    out = linear_probe_eval(x, y, xt, yt, l2_grid=(1e-5, 1e-2, 10.0))
    assert out["probe_top1"] >= 0.97
    assert out["probe_l2"] in (1e-5, 1e-2)  # 10.0 underfits and must not be chosen
    assert len(out["sweep"]) == 3


def test_adamw_and_mae_probes_learn():
    x, y = _separable(2000, 0, W)
    xt, yt = _separable(500, 1, W)
    out = linear_probe_eval(
        x, y, xt, yt, solver="adamw", l2_grid=(1e-4,), lr_grid=(1e-2,), epochs=20, batch_size=256
    )
    assert out["probe_top1"] > 0.9 and out["probe_lr"] == 1e-2
    # LARS steps are ~ lr * trust_coefficient * |w|: a small set needs a larger base lr.
    mae = mae_probe_eval(x, y, xt, yt, epochs=30, warmup_epochs=3, batch_size=256, base_lr=10.0)
    assert mae["probe_top1"] > 0.9


def test_probe_on_random_labels_is_near_chance():
    rng = np.random.default_rng(0)
    x, xt = rng.normal(size=(1000, 20)), rng.normal(size=(500, 20))
    y, yt = rng.integers(0, 6, 1000), rng.integers(0, 6, 500)
    out = linear_probe_eval(x, y, xt, yt, l2_grid=(1e-3,))
    assert out["probe_top1"] < 0.3  # chance is 1/6; a leak from test would show here


def test_topk_accuracies_count_a_hit_within_the_first_k_only():
    # labels ranked 1st, 2nd, 5th and 6th of six classes: top-1 1/4, top-5 3/4
    ranks = torch.tensor([[6.0, 5, 4, 3, 2, 1]] * 4)
    labels = torch.tensor([0, 1, 4, 5])
    assert topk_accuracies(ranks, labels) == (0.25, 0.75)


def test_the_loss_summed_over_chunks_is_the_full_batch_loss(monkeypatch):
    """L-BFGS's loss and gradient taken over chunks of rows (so that the logits of a large set
    never exist at once) fit the same head as one pass over every row."""
    from ssl_vit.evaluation import linear_probe as lp

    x, y = _separable(1000, 0, W)
    x, y = torch.as_tensor(x), torch.as_tensor(y).long()
    whole = lp.fit_lbfgs(x, y, 6, l2=1e-2, max_iter=50)
    monkeypatch.setattr(lp, "CHUNK", 97)  # 11 chunks, the last one short
    parts = lp.fit_lbfgs(x, y, 6, l2=1e-2, max_iter=50)
    assert torch.allclose(whole.weight, parts.weight, atol=2e-3)  # float sums in another order
    assert torch.allclose(whole.bias, parts.bias, atol=2e-3)


def test_evaluations_report_on_test_else_val(tmp_path):
    from ssl_vit.data.manifest import Manifest, ManifestError, SplitInfo
    from ssl_vit.evaluation.cli import eval_split

    def sets(*names: str) -> Manifest:
        splits = {n: SplitInfo(0, []) for n in names}
        return Manifest(splits, None, 1, None, [0.5], [0.25], root=str(tmp_path))

    assert eval_split(sets("train", "val", "test"), None) == "test"
    assert eval_split(sets("train", "val"), None) == "val"  # photos by class folder
    assert eval_split(sets("train", "val"), "train") == "train"  # as asked
    with pytest.raises(ManifestError, match="neither a test nor a val split"):
        eval_split(sets("train"), None)


def test_stratified_folds_balance_each_class_and_follow_the_seed():
    from ssl_vit.evaluation.linear_probe import stratified_folds

    labels = np.repeat([2, 0, 1], [10, 12, 7])[np.random.default_rng(0).permutation(29)]
    folds = stratified_folds(labels, 5, seed=3)
    assert folds.shape == labels.shape and set(folds.tolist()) == set(range(5))
    for c, n in ((0, 12), (1, 7), (2, 10)):  # each class within one of its share per fold
        per_fold = np.bincount(folds[labels == c], minlength=5)
        assert per_fold.sum() == n and per_fold.max() - per_fold.min() <= 1
    sizes = np.bincount(folds, minlength=5)
    assert sizes.max() - sizes.min() <= 1  # the deal goes on across classes
    np.testing.assert_array_equal(folds, stratified_folds(labels, 5, seed=3))  # deterministic
    assert not np.array_equal(folds, stratified_folds(labels, 5, seed=4))
    ten_per_class = np.repeat(np.arange(10), 10)  # the study's 10 per class in 5 folds: 2 each
    f = stratified_folds(ten_per_class, 5, seed=0)
    assert all((np.bincount(f[ten_per_class == c], minlength=5) == 2).all() for c in range(10))
    with pytest.raises(ValueError, match="class 1 has 7 fitting samples, fewer than the 8 folds"):
        stratified_folds(labels, 8)
    with pytest.raises(ValueError, match="at least 2 folds"):
        stratified_folds(labels, 1)


def test_cv_folds_choose_l2_by_the_mean_fold_score_then_refit_on_all():
    from ssl_vit.evaluation.linear_probe import fit_lbfgs, stratified_folds

    x, y = _separable(400, 0, W)
    xt, yt = _separable(300, 1, W)
    grid = (1e-4, 1e-2, 30.0)
    out = linear_probe_eval(x, y, xt, yt, l2_grid=grid, cv_folds=4, seed=1, device="cpu")
    assert out["cv_folds"] == 4 and sum(out["cv_fold_sizes"]) == len(x)
    assert out["selection"] == "stratified 4-fold cross-validation"
    assert [r["l2"] for r in out["sweep"]] == list(grid)
    for r in out["sweep"]:
        assert len(r["fold_top1"]) == 4 and r["val_top1"] == pytest.approx(np.mean(r["fold_top1"]))
    best = max(out["sweep"], key=lambda r: (r["val_top1"], r["l2"]))
    assert out["probe_l2"] == best["l2"] != 30.0  # a penalty that underfits is not chosen
    assert out["probe_cv_fold_top1"] == best["fold_top1"]
    assert out["probe_val_top1"] == pytest.approx(best["val_top1"])

    # One fold's score by hand: standardised by its fitting part, fitted, scored on the fold.
    folds = stratified_folds(y, 4, seed=1)
    tr, va = folds != 0, folds == 0
    xs = torch.as_tensor(x)
    mean, std = xs[tr].mean(0), xs[tr].std(0) + 1e-6
    head = fit_lbfgs((xs[tr] - mean) / std, torch.as_tensor(y[tr]).long(), 6, best["l2"])
    with torch.no_grad():
        pred = head((xs[va] - mean) / std).argmax(1).numpy()
    assert float((pred == y[va]).mean()) == pytest.approx(best["fold_top1"][0], abs=1e-6)
    assert out["probe_top1"] >= 0.8  # the refit on the whole fitting set generalises
    held = linear_probe_eval(x, y, xt, yt, l2_grid=grid, device="cpu")
    assert held["selection"].startswith("held-out 0.1") and "cv_folds" not in held
