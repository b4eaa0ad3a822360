"""Adaptive inference of a Dynamic ViT cascade: costs, exit thresholds, accuracy per budget.

- `stage_flops`: model FLOPs per image of each stage given its predecessors (what reaching that
  stage adds), counted with torch's FlopCounterMode like `ssl_vit.perf`.
- `stage_outputs`: every stage's confidence and correctness for every image of a loader (all
  stages run on all images: a stage's output for an image does not depend on which others
  share its batch, so exits can then be simulated for any thresholds).
- `choose_thresholds`: for each compute budget, the thresholds with the best accuracy on the
  *held-out* images whose mean FLOPs fit the budget (a grid over confidence quantiles).
- `simulate`: accuracy, mean FLOPs and exit shares of given thresholds on a set of images.
- `images_per_second`: measured throughput of a batched callable.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.models.cascade import CascadeViT

__all__ = [
    "stage_flops",
    "standalone_flops",
    "StageOutputs",
    "stage_outputs",
    "simulate",
    "choose_thresholds",
    "images_per_second",
]

NEVER = 1.01  # a threshold no softmax probability reaches: nobody exits there


def _count(fn: Callable[[], object]) -> float:
    # CPU's fused attention has no FLOP formula; the math backend counts the same products.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as c:
        fn()
    return float(c.get_total_flops())


def stage_flops(cascade: CascadeViT, in_chans: int, device: str | torch.device = "cpu") -> list:
    """FLOPs per image that stage s adds on top of stages < s (reuse modules included)."""
    x = torch.zeros(1, in_chans, cascade.sizes[-1], cascade.sizes[-1], device=device)
    totals = [_count(lambda s=s: cascade(x, upto=s)) for s in range(cascade.num_stages)]
    return [totals[0]] + [b - a for a, b in zip(totals, totals[1:], strict=False)]


def standalone_flops(cascade: CascadeViT, stage: int, in_chans: int) -> float:
    """FLOPs per image of one stage's ViT and classifier alone (no predecessor, no reuse)."""
    x = torch.zeros(1, in_chans, cascade.sizes[-1], cascade.sizes[-1])
    return _count(lambda: cascade.stages[stage](x, None))


@dataclass
class StageOutputs:
    confidence: np.ndarray  # (N, S) max softmax probability per stage
    correct: np.ndarray  # (N, S) bool: the stage's argmax is the label


@torch.no_grad()
def stage_outputs(
    cascade: CascadeViT,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    normalize: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
) -> StageOutputs:
    """Run every stage on every image of `batches` ((uint8 images, labels) pairs)."""
    conf, correct = [], []
    cascade.eval()
    for images, labels in batches:
        x = normalize(images.to(device).float().div_(255))
        probs = torch.stack([lg.softmax(-1) for lg in cascade(x)], 1)  # (B, S, K)
        c, pred = probs.max(-1)
        conf.append(c.cpu().numpy())
        correct.append((pred.cpu() == labels.view(-1, 1)).numpy())
    return StageOutputs(np.concatenate(conf), np.concatenate(correct))


def exit_stages(confidence: np.ndarray, thresholds: Sequence[float]) -> np.ndarray:
    """(N,) the first stage s < S-1 with confidence >= thresholds[s], else S-1."""
    n, s = confidence.shape
    out = np.full(n, s - 1)
    for k in reversed(range(s - 1)):
        out = np.where(confidence[:, k] >= thresholds[k], k, out)
    return out


def simulate(out: StageOutputs, thresholds: Sequence[float], costs: Sequence[float]) -> dict:
    """Accuracy, mean FLOPs per image and share of images leaving at each stage."""
    exits = exit_stages(out.confidence, thresholds)
    reach = np.cumsum(costs)  # FLOPs of an image that leaves at stage s
    shares = np.bincount(exits, minlength=out.confidence.shape[1]) / len(exits)
    return {
        "top1": float(out.correct[np.arange(len(exits)), exits].mean()),
        "mean_flops": float(reach[exits].mean()),
        "exit_share": [float(v) for v in shares],
    }


def _candidates(confidence: np.ndarray, num: int) -> list[float]:
    """Quantiles of one stage's held-out confidences, plus 'nobody exits here'."""
    q = np.quantile(confidence, np.linspace(0.0, 1.0, num))
    return sorted({float(v) for v in q} | {NEVER})


def choose_thresholds(
    held: StageOutputs, costs: Sequence[float], budgets: Sequence[float], grid: int = 33
) -> list[dict]:
    """Per budget (mean FLOPs per image), the thresholds best on the held-out images among
    those fitting the budget there (ties: fewer FLOPs). Budgets nothing fits are skipped."""
    axes = [_candidates(held.confidence[:, s], grid) for s in range(held.confidence.shape[1] - 1)]
    table = []
    for thr in itertools.product(*axes):
        r = simulate(held, thr, costs)
        table.append((r["top1"], r["mean_flops"], [float(t) for t in thr]))
    chosen = []
    for b in budgets:
        fits = [t for t in table if t[1] <= b * (1 + 1e-9)]
        if fits:
            top1, flops, thr = max(fits, key=lambda t: (t[0], -t[1]))
            chosen.append(
                {
                    "budget_flops": float(b),
                    "thresholds": thr,
                    "held_top1": top1,
                    "held_mean_flops": flops,
                }
            )
    return chosen


def images_per_second(
    fns: dict[str, Callable[[torch.Tensor], object]],
    images: torch.Tensor,
    batch: int,
    repeats: int = 3,
) -> dict[str, float]:
    """Median images/s of each callable over `images` in batches of `batch`, side by side: the
    callables take turns within each of `repeats` rounds, so a change in the machine's load
    hits them alike (one untimed warm-up call each first)."""
    rates: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn(images[:batch])
        for _ in range(repeats):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for i in range(0, len(images), batch):
                    fn(images[i : i + batch])
                rates[name].append(len(images) / (time.perf_counter() - t0))
    return {name: statistics.median(r) for name, r in rates.items()}
