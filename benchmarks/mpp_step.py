"""MPP training-step throughput: ssl_vit vs vit-pytorch's MPP, side by side in one run.

Both get the same model dims (D, depth, heads, MLP 4D), batch, image data and optimizer (AdamW),
the paper's corruption rates (50% of patches; 80% mask, 10% random, 10% kept) and the 3-bit mean
colour target. Steps are timed alternately (A B B A ...) and medians reported, in fp32 and under
bf16 autocast, with model FLOP/s (torch FlopCounterMode) as a fraction of a dense matmul peak
measured in the same run at the same precision and thread count.

    .venv/bin/pip install vit-pytorch==1.12.5   # newer releases break its MPP
    .venv/bin/python benchmarks/mpp_step.py                  # ~5 minutes on 2 busy cores
    .venv/bin/python benchmarks/mpp_step.py --dtypes fp32 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ssl_vit.models import build_backbone
from ssl_vit.objectives import build_objective, param_groups
from ssl_vit.perf import count_train_flops, measure_matmul_peak

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def ours(args: argparse.Namespace) -> torch.nn.Module:
    bb = build_backbone(
        "vit_small_patch16_224",
        img_size=args.img,
        in_chans=3,
        patch_size=args.patch,
        embed_dim=args.dim,
        depth=args.depth,
        num_heads=args.heads,
        mlp_ratio=4.0,
    )
    return build_objective("mpp", bb, mean=[0.5] * 3, std=[0.25] * 3)


def peer(args: argparse.Namespace) -> torch.nn.Module:
    from vit_pytorch import ViT
    from vit_pytorch.mpp import MPP

    vit = ViT(
        image_size=args.img,
        patch_size=args.patch,
        num_classes=10,
        dim=args.dim,
        depth=args.depth,
        heads=args.heads,
        mlp_dim=4 * args.dim,
        dim_head=args.dim // args.heads,
    )
    # Its mask_prob is the corrupted share; replace_prob the [mask] share (paper: 50%, 80/10/10).
    return MPP(
        vit,
        patch_size=args.patch,
        dim=args.dim,
        mask_prob=0.5,
        replace_prob=0.8,
        random_patch_prob=0.1,
    )


class Runner:
    """One model + optimizer; `step()` runs forward, backward and AdamW on the fixed batch."""

    def __init__(self, name: str, model: torch.nn.Module, images, labels, autocast_dtype):
        self.name, self.model, self.images, self.labels = name, model, images, labels
        self.dtype = autocast_dtype
        self.opt = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-4)
        self.is_ours = name == "ssl_vit"

    def loss(self) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self.dtype or torch.bfloat16, enabled=bool(self.dtype)):
            if self.is_ours:
                return self.model(self.images, self.labels)[0]
            return self.model(self.images)

    def step(self) -> None:
        loss = self.loss()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def flops(self) -> float:
        wrapper = _LossOnly(self)
        with torch.autocast("cpu", dtype=self.dtype or torch.bfloat16, enabled=bool(self.dtype)):
            return count_train_flops(wrapper, self.images, self.labels)


class _LossOnly(torch.nn.Module):
    def __init__(self, runner: Runner):
        super().__init__()
        self.runner, self.inner = [runner], runner.model

    def forward(self, images, labels):
        return self.runner[0].loss(), {}


def time_steps(runner: Runner, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dim", type=int, default=384, help="embedding width D (ViT-S: 384)")
    p.add_argument("--depth", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--img", type=int, default=32, help="image side (RGB)")
    p.add_argument("--patch", type=int, default=4, help="patch side: (img/patch)^2 tokens")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=1, help="timed steps per measurement")
    p.add_argument("--reps", type=int, default=5, help="alternating measurements per model (fp32)")
    p.add_argument("--bf16-reps", type=int, default=2, help="the same under bf16 autocast")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--peak-n", type=int, default=1024, help="matmul side for the peak")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    images = torch.rand(args.batch, 3, args.img, args.img)
    labels = torch.full((args.batch,), -1)
    print(
        f"# D={args.dim} depth={args.depth} heads={args.heads} img={args.img} patch={args.patch} "
        f"tokens={(args.img // args.patch) ** 2} batch={args.batch} "
        f"threads={torch.get_num_threads()} torch={torch.__version__}",
        flush=True,
    )
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        reps = args.reps if dtype is None else args.bf16_reps
        runners = [
            Runner("ssl_vit", ours(args), images, labels, dtype),
            Runner("vit-pytorch", peer(args), images, labels, dtype),
        ]
        # counting FLOPs runs each model once: also the warm-up (allocator, oneDNN primitives)
        flops = {r.name: r.flops() for r in runners}
        times: dict[str, list[float]] = {r.name: [] for r in runners}
        for rep in range(reps):
            order = runners if rep % 2 == 0 else runners[::-1]
            for r in order:
                times[r.name].append(time_steps(r, args.steps))
            line = "  ".join(f"{n} {t[-1]:.3f}s" for n, t in times.items())
            print(f"[{dname}] rep {rep + 1}/{reps}: s/step {line}", flush=True)
        peak = measure_matmul_peak(dtype or torch.float32, "cpu", n=args.peak_n, repeats=3)
        med = {n: statistics.median(t) for n, t in times.items()}
        print(f"[{dname}] dense matmul peak ({args.peak_n}^3): {peak / 1e9:.1f} GFLOP/s")
        for n in med:
            rate = flops[n] / med[n]
            print(
                f"[{dname}] {n:12s} median {med[n]:.3f} s/step  {args.batch / med[n]:7.1f} img/s  "
                f"model {flops[n] / 1e9:.2f} GFLOP/step  {rate / 1e9:.1f} GFLOP/s  "
                f"= {100 * rate / peak:.0f}% of peak",
                flush=True,
            )
        ratio = med["vit-pytorch"] / med["ssl_vit"]
        print(f"[{dname}] speed-up ssl_vit / vit-pytorch: {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
