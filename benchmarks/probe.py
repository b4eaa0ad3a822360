"""What a linear probe at ImageNet size costs: feature extraction and the probe's L-BFGS fit,
measured at a size this machine holds, and extrapolated to ImageNet-1k's 1.28M images.

    python benchmarks/probe.py [--rows 100000] [--dim 768] [--classes 1000] [--device cuda]

1. Features/s: a ViT-B/16 forward at 224 px (random weights, bf16 autocast on CUDA, fp32 on
   the CPU), the work `evals/*.py` does once per image before any probe.
2. The probe: one L-BFGS closure (loss and gradient over every row, in CHUNK-row parts) on
   random standardised features of `--rows` x `--dim` with `--classes` classes, the median
   of `--reps`; beside it, one closure over all rows at once (what the probe did before it
   summed over chunks), for the ratio. A fit takes about 1.25 closures per iteration (the
   strong-Wolfe line search), up to --max-iter iterations, for every l2 of the grid and once
   more to refit: the extrapolation multiplies those out, linear in the rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ssl_vit.evaluation import linear_probe as lp  # noqa: E402
from ssl_vit.evaluation.options import DEFAULT_L2_GRID  # noqa: E402
from ssl_vit.models import build_backbone  # noqa: E402
from ssl_vit.perf import describe_machine  # noqa: E402

IMAGENET = 1_281_167


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def features_per_second(device: torch.device, batch: int, reps: int) -> float:
    model = build_backbone("vit_base_patch16_224", img_size=224, in_chans=3).to(device).eval()
    x = torch.randn(batch, 3, 224, 224, device=device)
    times = []
    bf16 = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    with torch.no_grad(), bf16:
        model(x[:2])  # warm-up
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            model(x)
            _sync(device)
            times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def closure_seconds(x: torch.Tensor, y: torch.Tensor, classes: int, reps: int):
    """Median seconds of one closure (loss and gradient over every row) in CHUNK-row parts and
    in one pass, the two timed in turn so that other work on the machine slows both alike."""
    head = torch.nn.Linear(x.shape[1], classes, device=x.device)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(reps):
        for chunked in (True, False):
            head.zero_grad()
            _sync(x.device)
            t0 = time.perf_counter()
            if chunked:
                for xc, yc in zip(x.split(lp.CHUNK), y.split(lp.CHUNK), strict=True):
                    (F.cross_entropy(head(xc), yc, reduction="sum") / len(x)).backward()
            else:
                F.cross_entropy(head(x), y).backward()
            _sync(x.device)
            times[chunked].append(time.perf_counter() - t0)
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-iter", type=int, default=300, help="the probe's L-BFGS iterations")
    p.add_argument("--feature-batch", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    print(f"machine: {describe_machine()}; device {device}")

    fps = features_per_second(device, a.feature_batch, max(3, a.reps // 2))
    print(f"features: ViT-B/16 at 224 px, {fps:.1f} images/s (median of batch {a.feature_batch})")
    print(f"  ImageNet-1k train: {IMAGENET / fps / 3600:.1f} h for its features")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.rows, a.dim, generator=g).to(device)
    y = torch.randint(0, a.classes, (a.rows,), generator=g).to(device)
    chunked, whole = closure_seconds(x, y, a.classes, a.reps)
    print(
        f"probe closure at {a.rows} x {a.dim}, {a.classes} classes: {chunked:.3f} s in chunks of "
        f"{lp.CHUNK} rows, {whole:.3f} s in one pass (ratio {chunked / whole:.2f}x; the one pass "
        f"holds {a.rows * a.classes * 4 / 2**30:.2f} GiB of logits, a chunk "
        f"{min(a.rows, lp.CHUNK) * a.classes * 4 / 2**30:.2f} GiB)"
    )
    fits = len(DEFAULT_L2_GRID) + 1  # the sweep, then the refit on all of train
    per_fit = 1.25 * a.max_iter * chunked
    scale = IMAGENET / a.rows
    print(
        f"  at {a.rows} rows: <= {per_fit:.0f} s per fit, {fits} fits (l2 grid + refit): "
        f"<= {fits * per_fit / 3600:.1f} h"
    )
    print(
        f"  extrapolated to ImageNet-1k ({IMAGENET} rows, linear in the rows): "
        f"{chunked * scale:.1f} s per closure, <= {fits * per_fit * scale / 3600:.1f} h "
        f"on this {device.type}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
