"""Few-shot linear evaluation (ViT paper, section 4.1).

"Few-shot accuracies are obtained by solving a regularized least-squares regression problem
that maps the (frozen) representation of a subset of training images to {-1, 1}^K target
vectors." For each number of shots per class and each seed we draw that many training images
per class, standardise the features with their statistics, solve the ridge problem in closed
form, and classify the whole test split by the argmax of the K outputs. Mean and spread over
seeds are reported.

The paper gives no ridge strength, and no single one serves every shot count and feature
size: with n examples near the feature rank, a weak ridge nearly interpolates and accuracy dips
(double descent; we saw 5-shot below 1-shot on raw digit pixels). So the strength is chosen
per draw, from the few-shot examples alone, by the closed-form leave-one-out (LOO) error of
ridge (see `loo_predictions`); the test split is only scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ssl_vit.evaluation.options import DEFAULT_SHOTS

# The ridge strength is searched as l2 = alpha * tr(Xc Xc^T) (the centred features' total
# energy), i.e. alpha on the per-example-averaged loss relative to the feature scale, so one
# grid serves 64-d and 768-d features and 10 or 25000 examples alike.
ALPHA_GRID = tuple(float(a) for a in 10.0 ** np.arange(-5.0, 1.01, 0.5))
# Used only when no shot count with >= 2 examples per class is evaluated (1-shot alone): the
# middle of the grid, a moderate ridge.
DEFAULT_ALPHA = 1e-2


def pm1_targets(labels: np.ndarray, num_classes: int) -> torch.Tensor:
    """{-1, 1}^K targets (N, K): +1 at the label, -1 elsewhere."""
    y = -torch.ones(len(labels), num_classes, dtype=torch.float64)
    y[torch.arange(len(labels)), torch.as_tensor(labels).long()] = 1.0
    return y


def ridge_fit(x: torch.Tensor, y: torch.Tensor, l2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin_W,b ||X W + b - Y||^2 + l2 ||W||^2 in closed form; x (N, D), y (N, K).

    Centring removes the (unregularised) bias; when N < D the equivalent dual form
    W = Xc^T (Xc Xc^T + l2 I)^-1 Yc is solved instead, an N x N system.
    """
    x, y = x.double(), y.double()
    xm, ym = x.mean(0), y.mean(0)
    xc, yc = x - xm, y - ym  # (N, D), (N, K)
    n, d = xc.shape
    if n < d:
        w = xc.T @ torch.linalg.solve(xc @ xc.T + l2 * torch.eye(n, dtype=x.dtype), yc)
    else:
        w = torch.linalg.solve(xc.T @ xc + l2 * torch.eye(d, dtype=x.dtype), xc.T @ yc)
    return w, ym - xm @ w  # W (D, K), b (K,)


def loo_predictions(x: torch.Tensor, y: torch.Tensor, l2s: list[float]) -> torch.Tensor:
    """Leave-one-out predictions of `ridge_fit` for every l2 at once: (L, N, K).

    Ridge with an unpenalised bias is a linear smoother, Yhat = H Y with
    H = 11^T/N + Xc (Xc^T Xc + l2 I)^-1 Xc^T, and refitting without example i predicts
    y_i - e_i / (1 - H_ii) (e = Y - Yhat), exactly. With the thin SVD Xc = U S V^T, H is
    11^T/N + U diag(S^2 / (S^2 + l2)) U^T: one SVD of the smaller side serves every l2.
    """
    x, y = x.double(), y.double()
    n = x.shape[0]
    xc, ym = x - x.mean(0), y.mean(0)
    u, s, _ = torch.linalg.svd(xc, full_matrices=False)  # (N, R), (R,)
    uty = u.T @ (y - ym)  # (R, K)
    out = []
    for l2 in l2s:
        shrink = s**2 / (s**2 + l2)  # (R,)
        fitted = ym + u @ (shrink[:, None] * uty)  # (N, K)
        h_ii = 1.0 / n + (u**2) @ shrink  # (N,)
        out.append(y - (y - fitted) / (1.0 - h_ii)[:, None])
    return torch.stack(out)


def select_l2(
    x: torch.Tensor, labels: np.ndarray, num_classes: int, alphas: tuple[float, ...] = ALPHA_GRID
) -> tuple[float, float, float]:
    """(l2, alpha, LOO accuracy) of the grid point with the best LOO accuracy on (x, labels).

    Accuracy is what the eval reports, so it decides; ties (common with a few dozen examples)
    go to the lower LOO squared error, then to the stronger ridge.
    """
    x = x.double()
    energy = float(((x - x.mean(0)) ** 2).sum())  # tr(Xc Xc^T)
    l2s = [a * max(energy, 1e-12) for a in alphas]
    y = pm1_targets(labels, num_classes)
    pred = loo_predictions(x, y, l2s)  # (L, N, K)
    acc = (pred.argmax(2) == torch.as_tensor(labels).long()).double().mean(1)  # (L,)
    mse = ((pred - y) ** 2).mean((1, 2))  # (L,)
    best = max(range(len(l2s)), key=lambda i: (float(acc[i]), -float(mse[i]), i))
    return l2s[best], alphas[best], float(acc[best])


def sample_shots(labels: np.ndarray, shots: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of `shots` random examples of every class (all of them if a class has fewer)."""
    groups = (np.flatnonzero(labels == c) for c in np.unique(labels))
    return np.concatenate([rng.choice(m, size=min(shots, len(m)), replace=False) for m in groups])


def _standardise(x: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(np.asarray(x, dtype=np.float64))
    mean, std = t.mean(0), t.std(0, unbiased=False) + 1e-6
    return (t - mean) / std, mean, std


def fewshot_accuracy(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    l2: float,
) -> float:
    """Fit on (train_x, train_y) with ridge strength l2, return test accuracy."""
    x, mean, std = _standardise(train_x)
    w, b = ridge_fit(x, pm1_targets(train_y, num_classes), l2)
    xt = (torch.from_numpy(np.asarray(test_x, dtype=np.float64)) - mean) / std
    return float(((xt @ w + b).argmax(1).numpy() == test_y).mean())


@dataclass
class _Draws:
    """One shot count over every seed: accuracy, ridge strength, alpha, LOO accuracy."""

    accs: list[float] = field(default_factory=list)
    l2s: list[float] = field(default_factory=list)
    alphas: list[float] = field(default_factory=list)
    loo_accs: list[float] = field(default_factory=list)


def _draw_and_score(
    data: tuple[np.ndarray, ...], n: int, seeds: int, l2: float | None, alphas, carried
) -> _Draws:
    """Draw n shots per class `seeds` times; fit each draw with the l2 chosen for it."""
    train_x, train_y, test_x, test_y, num_classes = data
    loo_ok = min(n, int(np.bincount(train_y, minlength=num_classes).min())) >= 2
    d = _Draws()
    for seed in range(seeds):
        idx = sample_shots(train_y, n, np.random.default_rng(seed))
        x, _, _ = _standardise(train_x[idx])
        if l2 is not None:
            chosen = l2
        elif loo_ok:
            chosen, alpha, loo_acc = select_l2(x, train_y[idx], num_classes, alphas)
            d.alphas.append(alpha)
            d.loo_accs.append(loo_acc)
        else:
            alpha = carried[0] if carried else DEFAULT_ALPHA
            d.alphas.append(alpha)
            chosen = alpha * float(((x - x.mean(0)) ** 2).sum())
        d.l2s.append(chosen)
        d.accs.append(
            fewshot_accuracy(train_x[idx], train_y[idx], test_x, test_y, num_classes, chosen)
        )
    return d


def fewshot_eval(
    train_features: np.ndarray,
    train_labels: np.ndarray,
    test_features: np.ndarray,
    test_labels: np.ndarray,
    *,
    shots: tuple[int, ...] = DEFAULT_SHOTS,
    seeds: int = 5,
    l2: float | None = None,
    alphas: tuple[float, ...] = ALPHA_GRID,
) -> dict[str, Any]:
    """Accuracy mean/std over seeds for each shot count: {"fewshot_{n}shot_mean": ..., ...}.

    l2=None chooses the ridge strength per draw by LOO on the drawn examples (`select_l2`).
    LOO cannot judge a draw with one example of a class: leaving it out removes its class,
    so it is always misclassified whatever l2 (and its squared error favours the strongest
    ridge). Such draws (1-shot) reuse the median alpha chosen at the smallest evaluated shot
    count with >= 2 per class, or DEFAULT_ALPHA if there is none; the source is recorded.
    A number passed as l2 is used everywhere, unselected.
    """
    if (train_labels < 0).any() or (test_labels < 0).any():
        raise ValueError("few-shot needs labelled train and test splits (found label -1)")
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    data = (train_features, train_labels, test_features, test_labels, num_classes)
    out: dict[str, Any] = {"l2_selection": "fixed" if l2 is not None else "loo", "seeds": seeds}
    out.update({"l2": l2} if l2 is not None else {"alpha_grid": list(alphas)})
    shots = tuple(dict.fromkeys(shots))
    min_count = int(np.bincount(train_labels, minlength=num_classes).min())
    # Shot counts LOO can judge first, so 1-shot can borrow their choice.
    order = sorted(shots, key=lambda n: (min(n, min_count) < 2, n))
    carried: tuple[float, int] | None = None  # (alpha, shots) from the first LOO-judged count
    for n in order:
        d = _draw_and_score(data, n, seeds, l2, alphas, carried)
        out[f"fewshot_{n}shot_mean"] = float(np.mean(d.accs))
        out[f"fewshot_{n}shot_std"] = float(np.std(d.accs))
        out[f"fewshot_{n}shot_all"] = [float(a) for a in d.accs]
        if l2 is not None:
            continue
        out[f"ridge_l2@{n}shot"] = float(np.median(d.l2s))  # scalar: logged to MLflow
        out[f"fewshot_{n}shot_l2_all"] = [float(v) for v in d.l2s]
        out[f"fewshot_{n}shot_alpha_all"] = [float(a) for a in d.alphas]
        if min(n, min_count) >= 2:
            out[f"fewshot_{n}shot_loo_acc_all"] = d.loo_accs
            out[f"fewshot_{n}shot_l2_source"] = "leave-one-out on the drawn examples"
            carried = carried or (float(np.median(d.alphas)), n)
        else:
            out[f"fewshot_{n}shot_l2_source"] = (
                f"median alpha chosen at {carried[1]}-shot (LOO undefined at 1 per class)"
                if carried
                else f"default alpha {DEFAULT_ALPHA} (LOO undefined at 1 per class)"
            )
    # Report in the order asked for.
    keys = [
        k for n in shots for k in out if k.startswith((f"fewshot_{n}shot_", f"ridge_l2@{n}shot"))
    ]
    head = {k: v for k, v in out.items() if k not in keys}
    return {**head, **{k: out[k] for k in keys}}
