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
