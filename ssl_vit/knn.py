"""Weighted kNN classification and retrieval metrics on frozen features, with FAISS.

Protocol (DINO, Caron et al. 2021): features are L2-normalised, the gallery (train split) goes
into an inner-product index so similarity = cosine, each test image takes its k nearest
gallery images, and each neighbour votes for its class with weight exp(sim / T), T = 0.07.
Reported for k in {10, 20, 100, 200}: top-1 and top-5 accuracy.

Retrieval (test images as queries against the train gallery): recall@k = share of queries
with at least one same-class image among their k nearest; mAP@R (Musgrave et al. 2020,
"A Metric Learning Reality Check") with R = the number of gallery images of the query's class.

For galleries too large for exact search an IVF or HNSW index can be used; its neighbour
recall against exact search is then measured on the queries and reported.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ssl_vit.feature_options import DEFAULT_KS, DEFAULT_T, INDEX_KINDS

if TYPE_CHECKING:
    import faiss


def _faiss():
    """FAISS, imported on first use (after the entry script set logging up: -v shows its
    loader lines), with the install line when neither FAISS extra is installed."""
    try:
        import faiss
    except ImportError as e:
        raise ImportError(
            "FAISS is not installed: pip install 'ssl-vit[cpu]', or 'ssl-vit[gpu-cu12]' beside a "
            "CUDA 12 build of torch (one of the two, never both)"
        ) from e
    return faiss


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalisation into a new float32 C-contiguous array (FAISS needs both)."""
    faiss = _faiss()
    x = np.array(x, dtype=np.float32, order="C", copy=True)
    faiss.normalize_L2(x)
    return x


def use_faiss_gpu() -> bool:
    faiss = _faiss()
    return hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0


_GPU_RESOURCES: dict[int, Any] = {}  # one FAISS scratch allocator per device, reused


def to_own_gpu(index: faiss.Index) -> faiss.Index:
    """`index` on this process's current CUDA device only: under a launcher every rank has its
    own GPU, and FAISS's all-GPU copy would take memory on the other ranks' devices."""
    faiss = _faiss()
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    if device not in _GPU_RESOURCES:
        _GPU_RESOURCES[device] = faiss.StandardGpuResources()
    return faiss.index_cpu_to_gpu(_GPU_RESOURCES[device], device, index)


def build_index(
    gallery: np.ndarray,
    kind: str = "flat",
    *,
    nlist: int | None = None,
    nprobe: int = 16,
    hnsw_m: int = 32,
    ef_search: int = 256,
    gpu: bool | None = None,
) -> faiss.Index:
    """An inner-product index over (already normalised) gallery rows (N, D)."""
    faiss = _faiss()
    n, d = gallery.shape
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif kind == "ivf":
        nlist = nlist or max(1, min(int(4 * np.sqrt(n)), n // 39))  # >= 39 points per centroid
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(gallery)
        index.nprobe = min(nprobe, nlist)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = ef_search
    else:
        raise ValueError(f"unknown index kind {kind!r}; choose one of {INDEX_KINDS}")
    gpu = use_faiss_gpu() if gpu is None else gpu
    if gpu and kind != "hnsw":  # FAISS has no GPU HNSW
        index = to_own_gpu(index)
    index.add(gallery)
    return index


def search(
    index: faiss.Index, queries: np.ndarray, k: int, *, chunk: int = 8192, desc: str = "knn"
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (similarities (Q, k) float32, ids (Q, k) int64), best first, in query chunks."""
    sims = np.empty((len(queries), k), dtype=np.float32)
    ids = np.empty((len(queries), k), dtype=np.int64)
    for s in tqdm(range(0, len(queries), chunk), desc=desc, disable=None, leave=False):
        sims[s : s + chunk], ids[s : s + chunk] = index.search(queries[s : s + chunk], k)
    return sims, ids


def knn_vote(
    sims: np.ndarray | torch.Tensor,
    neighbour_labels: np.ndarray | torch.Tensor,
    k: int,
    num_classes: int,
    temperature: float = DEFAULT_T,
) -> torch.Tensor:
    """Class scores (Q, C): sum over the k nearest of exp(sim / T) into each neighbour's class."""
    s = torch.as_tensor(sims)[:, :k].double()  # (Q, k)
    lab = torch.as_tensor(neighbour_labels)[:, :k].long()  # (Q, k)
    scores = torch.zeros(s.shape[0], num_classes, dtype=torch.float64)
    return scores.scatter_add_(1, lab, torch.exp(s / temperature))  # (Q, C)


def topk_accuracy(scores: torch.Tensor, labels: np.ndarray | torch.Tensor, k: int) -> float:
    """Share of rows whose label is among their k highest scores (all of them when k >= K)."""
    k = min(k, scores.shape[1])
    top = scores.topk(k, dim=1).indices  # (Q, k)
    return (top == torch.as_tensor(labels).long()[:, None]).any(dim=1).double().mean().item()


def recall_at_k(neighbour_labels: np.ndarray, query_labels: np.ndarray, k: int) -> float:
    """Share of queries with a same-class gallery item among their k nearest."""
    return float((neighbour_labels[:, :k] == query_labels[:, None]).any(axis=1).mean())


def map_at_r(neighbour_labels: np.ndarray, query_labels: np.ndarray, r: np.ndarray) -> float:
    """mAP@R: mean over queries of (1/R) sum_{i<=R} P@i * rel(i).

    neighbour_labels (Q, >= max R) are the gallery labels in rank order; r (Q,) is each
    query's number of same-class gallery items.
    """
    rel = neighbour_labels == query_labels[:, None]  # (Q, K)
    ranks = np.arange(1, rel.shape[1] + 1)
    rel &= ranks[None, :] <= r[:, None]  # only the first R ranks count
    prec = np.cumsum(rel, axis=1) / ranks[None, :]
    ap = (prec * rel).sum(axis=1) / np.maximum(r, 1)
    return float(ap[r > 0].mean())


def _exact_map_at_r(
    gallery: np.ndarray,
    gallery_labels: np.ndarray,
    queries: np.ndarray,
    query_labels: np.ndarray,
    chunk: int = 512,
) -> float:
    """mAP@R with exact neighbours; R can be thousands, so ranks come from a torch top-R."""
    r = np.bincount(gallery_labels, minlength=int(query_labels.max()) + 1)[query_labels]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.from_numpy(gallery).to(dev)
    gl = torch.from_numpy(gallery_labels)
    total, n = 0.0, 0
    for s in tqdm(range(0, len(queries), chunk), desc="mAP@R", disable=None, leave=False):
        rr = r[s : s + chunk]
        valid = rr > 0
        if not valid.any():
            continue
        q = torch.from_numpy(queries[s : s + chunk]).to(dev)
        top = (q @ g.T).topk(int(rr.max()), dim=1).indices.cpu()  # (q, R_max)
        total += map_at_r(gl[top].numpy(), query_labels[s : s + chunk], rr) * valid.sum()
        n += int(valid.sum())
    return total / max(n, 1)


def knn_eval(
    train_features: np.ndarray,
    train_labels: np.ndarray,
    test_features: np.ndarray,
    test_labels: np.ndarray,
    *,
    ks: tuple[int, ...] = DEFAULT_KS,
    temperature: float = DEFAULT_T,
    index: str = "flat",
    nprobe: int = 16,
    ef_search: int = 256,
    retrieval: bool = True,
    gpu: bool | None = None,
) -> dict[str, Any]:
    """kNN accuracy for each k, retrieval metrics, and timings; a flat dict of numbers."""
    if (train_labels < 0).any() or (test_labels < 0).any():
        raise ValueError("kNN needs labelled train and test splits (found label -1)")
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    g = l2_normalize(train_features)
    q = l2_normalize(test_features)
    kmax = min(max(ks), len(g))
    out: dict[str, Any] = {"num_train": len(g), "num_test": len(q), "dim": g.shape[1]}
    t0 = time.perf_counter()
    idx = build_index(g, index, nprobe=nprobe, ef_search=ef_search, gpu=gpu)
    sims, ids = search(idx, q, kmax)
    out["search_seconds"] = time.perf_counter() - t0
    out["faiss_gpu"] = bool(use_faiss_gpu() if gpu is None else gpu)
    if index != "flat":  # how much of exact search the approximate index finds
        exact = build_index(g, "flat", gpu=gpu)
        _, exact_ids = search(exact, q, kmax, desc="exact")
        found = [
            len(np.intersect1d(a, b, assume_unique=True))
            for a, b in zip(ids, exact_ids, strict=True)
        ]
        out[f"ann_recall@{kmax}"] = float(np.mean(found) / kmax)
    missing = ids < 0  # an approximate index may find fewer than k: those get no vote
    if missing.any():
        sims = np.where(missing, -np.inf, sims).astype(np.float32)
        ids = np.where(missing, 0, ids)
    nb_labels = train_labels[ids]  # (Q, kmax)
    for k in ks:
        scores = knn_vote(sims, nb_labels, min(k, kmax), num_classes, temperature)
        out[f"knn_top1@k={k}"] = topk_accuracy(scores, test_labels, 1)
        out[f"knn_top5@k={k}"] = topk_accuracy(scores, test_labels, 5)
    if retrieval:
        found_labels = np.where(missing, -1, nb_labels)  # a missing neighbour is no match
        out["recall@1"] = recall_at_k(found_labels, test_labels, 1)
        out["recall@5"] = recall_at_k(found_labels, test_labels, min(5, kmax))
        out["map@r"] = _exact_map_at_r(g, train_labels, q, test_labels)
    return out
