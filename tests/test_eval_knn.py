"""kNN evaluator: FAISS search, DINO's weighted vote, retrieval metrics, ANN recall."""

import math

import numpy as np
import torch

from ssl_vit.knn import (
    build_index,
    knn_eval,
    knn_vote,
    l2_normalize,
    map_at_r,
    recall_at_k,
    search,
)


def _clusters(n_per: int, classes: int, dim: int, seed: int, spread: float = 0.3):
    centres = np.random.default_rng(100 + classes + dim).normal(size=(classes, dim))  # shared
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(classes), n_per)
    x = centres[y] + spread * rng.normal(size=(len(y), dim))
    return x.astype(np.float32), y.astype(np.int64)


def test_faiss_neighbours_equal_bruteforce_torch():
    rng = np.random.default_rng(0)
    g = l2_normalize(rng.normal(size=(700, 32)))
    q = l2_normalize(rng.normal(size=(60, 32)))
    sims, ids = search(build_index(g, "flat", gpu=False), q, 15, chunk=25)
    ref = torch.from_numpy(q) @ torch.from_numpy(g).T  # (Q, N) cosine similarities
    ref_sims, ref_ids = ref.topk(15, dim=1)
    np.testing.assert_array_equal(ids, ref_ids.numpy())
    np.testing.assert_allclose(sims, ref_sims.numpy(), atol=1e-5)


def test_l2_normalize_does_not_touch_input():
    x = np.array([[3.0, 4.0]], dtype=np.float64)
    out = l2_normalize(x)
    np.testing.assert_allclose(out, [[0.6, 0.8]], rtol=1e-6)
    assert x[0, 0] == 3.0 and out.dtype == np.float32


def test_vote_matches_hand_computation():
    # One query; neighbours (best first) of class 0, 1, 1 with cosine 0.50, 0.45, 0.44.
    sims = np.array([[0.50, 0.45, 0.44]], dtype=np.float32)
    labels = np.array([[0, 1, 1]])
    s = knn_vote(sims, labels, k=3, num_classes=3, temperature=0.07)
    want0 = math.exp(0.50 / 0.07)
    want1 = math.exp(0.45 / 0.07) + math.exp(0.44 / 0.07)
    np.testing.assert_allclose(s[0].numpy(), [want0, want1, 0.0], rtol=1e-5)
    assert s[0].argmax() == 0  # the sharp weighting lets the single closer neighbour win
    assert knn_vote(sims, labels, 3, 3, temperature=10.0)[0].argmax() == 1  # ~ majority vote
    assert knn_vote(sims, labels, 1, 3)[0].argmax() == 0  # only the first neighbour counts


def test_map_at_r_hand_computed():
    # Query A (class 0, R=3 in the gallery), ranks: 0 1 0 0 -> relevant at 1 and 3 within R.
    # AP = (P@1 + P@3) / R = (1 + 2/3) / 3.  Query B (class 1, R=2), ranks: 0 1 -> (1/2) / 2.
    nb = np.array([[0, 1, 0, 0], [0, 1, 1, 0]])
    q = np.array([0, 1])
    r = np.array([3, 2])
    want = ((1 + 2 / 3) / 3 + (1 / 2) / 2) / 2
    assert math.isclose(map_at_r(nb, q, r), want, rel_tol=1e-12)
    assert map_at_r(np.array([[1, 1, 0]]), np.array([1]), np.array([2])) == 1.0


def test_recall_at_k_hand_computed():
    nb = np.array([[2, 0, 1], [1, 1, 1], [0, 0, 2]])
    q = np.array([0, 1, 1])
    assert recall_at_k(nb, q, 1) == 1 / 3
    assert recall_at_k(nb, q, 2) == 2 / 3


def test_knn_eval_on_clusters_and_exact_map():
    x, y = _clusters(60, 4, 16, seed=1)
    xt, yt = _clusters(20, 4, 16, seed=7)
    out = knn_eval(x, y, xt, yt, ks=(5, 10, 500), gpu=False)
    assert out["knn_top1@k=10"] == 1.0 and out["recall@1"] == 1.0
    assert out["knn_top5@k=10"] == 1.0
    assert out["map@r"] > 0.99
    # k above the gallery size is clipped to it, not an error
    whole = knn_eval(x, y, xt, yt, ks=(len(x),), gpu=False)
    assert out["knn_top1@k=500"] == whole[f"knn_top1@k={len(x)}"]
    # Unstructured features: accuracy near chance (1/4), so the metric can fail.
    rng = np.random.default_rng(3)
    noise = knn_eval(rng.normal(size=(240, 16)), y, rng.normal(size=(80, 16)), yt, ks=(10,))
    assert noise["knn_top1@k=10"] < 0.5 and noise["map@r"] < 0.5


def test_approximate_indexes_report_recall_against_exact():
    x, y = _clusters(500, 4, 16, seed=2, spread=1.0)
    xt, yt = _clusters(50, 4, 16, seed=5, spread=1.0)
    for kind in ("ivf", "hnsw"):
        out = knn_eval(x, y, xt, yt, ks=(10,), index=kind, nprobe=64, retrieval=False, gpu=False)
        assert 0.9 <= out["ann_recall@10"] <= 1.0, (kind, out)
        assert out["knn_top1@k=10"] > 0.9
