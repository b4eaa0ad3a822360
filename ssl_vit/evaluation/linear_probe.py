"""Linear probe: multinomial logistic regression on frozen, standardised features.

Default recipe: full-batch L-BFGS on softmax cross-entropy + (l2 / 2) ||W||^2 (the bias is not
penalised), on the GPU when there is one. Each loss and gradient is summed over chunks of
CHUNK rows, so the logits of a 1.28M-image, 1000-class set never exist at once. The strength
l2 (and, for the minibatch AdamW solver, the learning rate) is chosen on a held-out part of the
training split, or with `cv_folds` by stratified cross-validation over it (a fitting set of a
few labelled images per class has no part to spare); the probe is then refit on the whole
training split and reported on the test split (top-1, top-5).

Option `mae_probe`: the MAE paper's probe (He et al. 2022, appendix A.2) for comparability
with published numbers: BatchNorm without affine in front of the linear layer, LARS with
momentum 0.9, no weight decay, lr = base_lr * batch / 256 with warmup then cosine decay.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.optim import Lars
from tqdm.auto import tqdm

from ssl_vit.evaluation.options import DEFAULT_L2_GRID, DEFAULT_LR_GRID
from ssl_vit.knn import topk_accuracy


def _tensors(features: np.ndarray, labels: np.ndarray, dev: torch.device) -> tuple:
    """(features as float32, labels as int64) on dev."""
    x = torch.as_tensor(np.asarray(features, dtype=np.float32)).to(dev)
    return x, torch.as_tensor(labels).long().to(dev)


def _zero_head(x: torch.Tensor, num_classes: int) -> nn.Linear:
    """A linear head on x's features and device, all zeros."""
    head = nn.Linear(x.shape[1], num_classes, device=x.device)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def _standardize(train: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    mean, std = train.mean(0), train.std(0) + 1e-6
    return [(t - mean) / std for t in (train, *others)]


def topk_accuracies(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(top-1, top-5) accuracy of class scores (N, K)."""
    return topk_accuracy(logits, labels, 1), topk_accuracy(logits, labels, 5)


CHUNK = 65536  # rows per forward/backward of the full-batch loss: (CHUNK, classes) logits


def probe_device(device: str | torch.device | None = None) -> torch.device:
    """Where the probe fits: the given device, else the GPU when there is one."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fit_lbfgs(
    x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float, max_iter: int = 300
) -> nn.Linear:
    """Full-batch L-BFGS with a strong-Wolfe line search; x standardised (N, D), on the device
    the head is made on (x's)."""
    head = _zero_head(x, num_classes)
    opt = torch.optim.LBFGS(
        head.parameters(),
        lr=1.0,
        max_iter=max_iter,
        history_size=20,
        tolerance_grad=1e-7,
        tolerance_change=1e-10,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        total = 0.5 * l2 * head.weight.pow(2).sum()
        total.backward()
        total = total.detach()
        for xc, yc in zip(x.split(CHUNK), y.split(CHUNK), strict=True):  # the mean, in parts
            part = F.cross_entropy(head(xc), yc, reduction="sum") / len(x)
            part.backward()
            total = total + part.detach()
        return total

    opt.step(closure)
    return head


def fit_adamw(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    weight_decay: float,
    lr: float,
    epochs: int = 30,
    batch_size: int = 1024,
    seed: int = 0,
) -> nn.Linear:
    """Minibatch AdamW with cosine decay, for feature sets too big for full-batch L-BFGS."""
    g = torch.Generator().manual_seed(seed)
    head = _zero_head(x, num_classes)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * math.ceil(len(x) / batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            idx = idx.to(x.device)
            loss = F.cross_entropy(head(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return head


def _scores(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """head(x) in chunks: the class scores of a whole split at once can be gigabytes."""
    return torch.cat([head(xc) for xc in x.split(CHUNK)])


def stratified_folds(labels: np.ndarray, n_folds: int, seed: int = 0) -> np.ndarray:
    """The fold (0 .. n_folds-1) of each sample: each class's samples shuffled (numpy PCG64,
    seeded) and dealt to the folds in turn, the deal going on from class to class, so every
    fold holds each class within one sample of its share and the folds' sizes differ by at
    most one. Depends on the labels and the seed only."""
    labels = np.asarray(labels)
    if n_folds < 2:
        raise ValueError(f"cross-validation needs at least 2 folds, got {n_folds}")
    classes, counts = np.unique(labels, return_counts=True)
    if len(classes) and counts.min() < n_folds:
        c = classes[counts.argmin()]
        raise ValueError(
            f"class {c} has {counts.min()} fitting samples, fewer than the {n_folds} folds: "
            "some folds would not see it; lower --cv-folds"
        )
    rng = np.random.default_rng(seed)
    folds = np.empty(len(labels), dtype=np.int64)
    dealt = 0
    for c in classes:  # a fixed order: the folds depend on the seed only
        members = rng.permutation(np.flatnonzero(labels == c))
        folds[members] = (dealt + np.arange(len(members))) % n_folds
        dealt += len(members)
    return folds


def _sweep(fit, grid: list, train: tuple, val: tuple) -> list[dict[str, float]]:
    """Validation top-1 of a head fitted on `train` for every (l2, lr) of `grid`."""
    sweep = []
    for l2, lr in tqdm(grid, desc="probe sweep", disable=None):
        head = fit(*train, l2, lr)
        with torch.no_grad():
            top1, _ = topk_accuracies(_scores(head, val[0]), val[1])
        sweep.append({"l2": l2, "lr": lr, "val_top1": top1})
    return sweep


def linear_probe_eval(
    train_features: np.ndarray,
    train_labels: np.ndarray,
    test_features: np.ndarray,
    test_labels: np.ndarray,
    *,
    solver: str = "lbfgs",
    l2_grid: tuple[float, ...] = DEFAULT_L2_GRID,
    lr_grid: tuple[float, ...] = DEFAULT_LR_GRID,
    val_fraction: float = 0.1,
    cv_folds: int | None = None,
    max_iter: int = 300,
    epochs: int = 30,
    batch_size: int = 1024,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Choose l2 (and lr) on a held-out part of train (`val_fraction`), or by the mean top-1
    over stratified `cv_folds`-fold cross-validation, refit on all of train, report on test;
    on `device` (default: the GPU when there is one)."""
    if (train_labels < 0).any() or (test_labels < 0).any():
        raise ValueError("the linear probe needs labelled train and test splits (found label -1)")
    if solver not in ("lbfgs", "adamw"):
        raise ValueError(f"unknown solver {solver!r}; choose lbfgs or adamw")
    torch.manual_seed(seed)
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    dev = probe_device(device)
    x, y = _tensors(train_features, train_labels, dev)
    xt, yt = _tensors(test_features, test_labels, dev)

    def fit(xf: torch.Tensor, yf: torch.Tensor, l2: float, lr: float) -> nn.Linear:
        if solver == "lbfgs":
            return fit_lbfgs(xf, yf, num_classes, l2, max_iter)
        return fit_adamw(xf, yf, num_classes, l2, lr, epochs, batch_size, seed)

    grid = [(l2, lr) for l2 in l2_grid for lr in (lr_grid if solver == "adamw" else (0.0,))]
    if cv_folds is None:
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed)).to(dev)
        n_val = max(1, int(round(val_fraction * len(x))))
        va, tr = perm[:n_val], perm[n_val:]
        xtr, xva = _standardize(x[tr], x[va])  # statistics of the fitting part only
        sweep = _sweep(fit, grid, (xtr, y[tr]), (xva, y[va]))
    else:
        folds = torch.as_tensor(stratified_folds(train_labels, cv_folds, seed)).to(dev)
        per_fold = []
        for k in range(cv_folds):
            tr, va = (folds != k).nonzero()[:, 0], (folds == k).nonzero()[:, 0]
            xtr, xva = _standardize(x[tr], x[va])  # each fold standardised by its fitting part
            per_fold.append(_sweep(fit, grid, (xtr, y[tr]), (xva, y[va])))
        sweep = []  # each point's mean over the folds, and its fold scores
        for points in zip(*per_fold, strict=True):
            scores = [p["val_top1"] for p in points]
            sweep.append({**points[0], "val_top1": float(np.mean(scores)), "fold_top1": scores})
    best = max(sweep, key=lambda r: (r["val_top1"], r["l2"]))  # ties: the stronger penalty

    xs, xts = _standardize(x, xt)
    head = fit(xs, y, best["l2"], best["lr"])
    with torch.no_grad():
        top1, top5 = topk_accuracies(_scores(head, xts), yt)
        train_top1, _ = topk_accuracies(_scores(head, xs), y)
    out: dict[str, Any] = {
        "probe_top1": top1,
        "probe_top5": top5,
        "probe_train_top1": train_top1,
        "probe_val_top1": best["val_top1"],
        "probe_l2": best["l2"],
        "solver": solver,
        "sweep": sweep,
    }
    if cv_folds is not None:  # the chosen point's mean is probe_val_top1; its folds here
        out.update(
            selection=f"stratified {cv_folds}-fold cross-validation",
            cv_folds=cv_folds,
            cv_fold_sizes=np.bincount(folds.cpu().numpy(), minlength=cv_folds).tolist(),
            probe_cv_fold_top1=best["fold_top1"],
        )
    else:
        out["selection"] = f"held-out {val_fraction} of the fitting set"
    if solver == "adamw":
        out["probe_lr"] = best["lr"]
    return out


def lars(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum 0.9 and a layer-wise trust ratio (You et al. 2017), as MAE's probe:
    the ratio 0.001 |w| / |g| on weight matrices only (biases and norms get plain SGD), no
    weight decay. timm's Lars with eps=0 computes exactly that."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim > 1], "always_adapt": True},
        {"params": [p for p in params if p.ndim <= 1], "always_adapt": False},
    ]
    return Lars(groups, lr=lr, momentum=0.9, trust_coeff=0.001, eps=0.0)


def mae_probe_eval(
    train_features: np.ndarray,
    train_labels: np.ndarray,
    test_features: np.ndarray,
    test_labels: np.ndarray,
    *,
    epochs: int = 90,
    warmup_epochs: int = 10,
    batch_size: int = 4096,
    base_lr: float = 0.1,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """MAE-style probe: BatchNorm1d(affine=False) + Linear, LARS, warmup + cosine, no wd; on
    `device` (default: the GPU when there is one)."""
    torch.manual_seed(seed)
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    dev = probe_device(device)
    x, y = _tensors(train_features, train_labels, dev)
    model = nn.Sequential(
        nn.BatchNorm1d(x.shape[1], affine=False, eps=1e-6), nn.Linear(x.shape[1], num_classes)
    ).to(dev)
    nn.init.trunc_normal_(model[1].weight, std=0.01)  # MAE's head init
    nn.init.zeros_(model[1].bias)
    lr = base_lr * batch_size / 256
    opt = lars(model, lr)
    steps_per_epoch = math.ceil(len(x) / batch_size)
    total, warm = epochs * steps_per_epoch, warmup_epochs * steps_per_epoch
    g = torch.Generator().manual_seed(seed)
    step = 0
    model.train()
    for _ in tqdm(range(epochs), desc="mae probe", disable=None):
        for idx in torch.randperm(len(x), generator=g).to(dev).split(batch_size):
            scale = (
                step / max(warm, 1)
                if step < warm
                else 0.5 * (1 + math.cos(math.pi * (step - warm) / max(total - warm, 1)))
            )
            for group in opt.param_groups:
                group["lr"] = lr * scale
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    model.eval()
    with torch.no_grad():
        x_test, y_test = _tensors(test_features, test_labels, dev)
        top1, top5 = topk_accuracies(_scores(model, x_test), y_test)
    return {
        "probe_top1": top1,
        "probe_top5": top5,
        "solver": "mae_lars",
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
    }
