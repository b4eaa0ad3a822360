"""How cost grows: MPP training-step time and memory against image size (sequence length) and
model size.

    .venv/bin/python benchmarks/scaling.py            # ~3 minutes on 2 busy cores
    .venv/bin/python benchmarks/scaling.py --quick    # under a minute
    .venv/bin/python benchmarks/scaling.py --imgs 16,32,64 --models 192x4,384x6 --reps 3

Times one full training step of the library's MPP objective (build_backbone + build_objective
"mpp" with the paper's defaults, AdamW over param_groups: forward, backward, optimizer step) on
a fixed random RGB batch:
  (a) one model (--dim/--depth/--heads) at growing image sizes, so the token count
      (img/patch)^2 + [class] grows;
  (b) one image size (--img) for models of growing width x depth (heads = width / --head-dim).
Each table's configurations are timed in turn (round-robin), so load from other processes falls
on all of them alike; medians of --reps steps are reported. Model FLOPs: ssl_vit.perf's
count_train_flops (torch FlopCounterMode, forward + backward; the optimizer's elementwise work
is not counted). Peak memory: what one step allocates above what is live at its start
(parameters, AdamW state, batch; gradients freed beforehand, so the peak includes the new ones):
torch.cuda.max_memory_allocated on CUDA, the same
quantity from torch.profiler's allocator records on CPU (live tensor bytes, not RSS, which the
allocator's caching blurs). The closing lines fit power laws (least-squares log-log slopes).
On CPU it runs one thread unless --threads says otherwise.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ssl_vit.models import build_backbone
from ssl_vit.objectives import build_objective, param_groups
from ssl_vit.perf import count_train_flops

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
FULL = {"imgs": "16,32,48,64,96", "models": "128x4,192x4,256x6,384x6,512x8", "batch": 8, "reps": 5}
QUICK = {"imgs": "16,32,48,64", "models": "128x2,192x4,256x4,384x4", "batch": 4, "reps": 3}
MIB = 2**20


class Step:
    """One MPP objective + AdamW on a fixed batch; `run()` is one training step."""

    def __init__(self, args, img: int, dim: int, depth: int, heads: int, device: torch.device):
        self.img, self.dim, self.depth, self.heads, self.device = img, dim, depth, heads, device
        bb = build_backbone(
            "vit_small_patch16_224",
            img_size=img,
            in_chans=3,
            patch_size=args.patch,
            embed_dim=dim,
            depth=depth,
            num_heads=heads,
            mlp_ratio=4.0,
        )
        self.tokens = bb.patch_embed.num_patches + bb.num_prefix_tokens
        self.model = build_objective("mpp", bb, mean=[0.5] * 3, std=[0.25] * 3).to(device)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.opt = torch.optim.AdamW(param_groups(self.model, 0.05), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        self.images = torch.rand(args.batch, 3, img, img, generator=gen).to(device)
        self.labels = torch.full((args.batch,), -1, device=device)
        self.dtype = DTYPES[args.dtype]
        self.times: list[float] = []

    def autocast(self):
        return torch.autocast(
            self.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None
        )

    def run(self) -> None:
        with self.autocast():
            loss = self.model(self.images, self.labels)[0]
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def timed(self) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        self.run()
        sync(self.device)
        return time.perf_counter() - t0

    def flops(self) -> float:
        with self.autocast():  # attention is counted on CPU too (see count_train_flops)
            return count_train_flops(self.model, self.images, self.labels)

    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state live between steps."""
        tensors = [t for p in self.model.parameters() for t in (p, p.grad) if t is not None]
        tensors += [v for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def step_peak(self) -> float:
        """Bytes one step allocates above what is live at its start, at its peak. Gradients are
        freed first (the step would free them after its forward), so every block the step frees
        is one it allocated and the peak includes the new gradients."""
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            self.run()
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - base
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.run()
        # every allocation (+) and free (-) of CPU tensor memory during the step, in time order
        records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for e in sorted(records, key=lambda e: e.start_ns()):
            live += e.nbytes()
            peak = max(peak, live)
        return peak


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(steps: list[Step], reps: int, what: str) -> list[dict]:
    rows = []
    for s in steps:  # counting FLOPs runs a forward + backward: also the first warm-up
        rows.append({"flops": s.flops()})
        s.run()  # the first optimizer step allocates gradients and AdamW state
        print(f"[{what}] {s.img}px D{s.dim} d{s.depth}: warmed up", file=sys.stderr, flush=True)
    for rep in range(reps):
        for s in steps if rep % 2 == 0 else steps[::-1]:
            s.times.append(s.timed())
        line = "  ".join(f"{1e3 * s.times[-1]:.0f}" for s in steps)
        print(f"[{what}] rep {rep + 1}/{reps} ms: {line}", file=sys.stderr, flush=True)
    for s, row in zip(steps, rows, strict=True):
        med = statistics.median(s.times)
        row.update(
            step=s,
            ms=1e3 * med,
            rate=row["flops"] / med,
            peak=s.step_peak() / MIB,
            state=s.state_bytes() / MIB,
        )
    return rows


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x: the exponent k of y ~ x^k."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    var = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / var if var else math.nan


def table(header: list[str], lines: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for cells in lines:
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smaller defaults: {' '.join(f'--{k} {v}' for k, v in QUICK.items())}",
    )
    p.add_argument("--imgs", help=f"(a) comma list of image sides (default {FULL['imgs']})")
    p.add_argument("--dim", type=int, default=192, help="(a) embedding width D")
    p.add_argument("--depth", type=int, default=4, help="(a) transformer blocks")
    p.add_argument("--heads", type=int, default=3, help="(a) attention heads")
    p.add_argument("--models", help=f"(b) comma list of DxDEPTH (default {FULL['models']})")
    p.add_argument("--img", type=int, default=32, help="(b) image side")
    p.add_argument("--head-dim", type=int, default=64, help="(b) width per attention head")
    p.add_argument("--patch", type=int, default=4, help="patch side: (img/patch)^2 + 1 tokens")
    p.add_argument("--batch", type=int, help=f"images per step (default {FULL['batch']})")
    p.add_argument(
        "--reps",
        type=int,
        help=f"timed steps per configuration (default {FULL['reps']}, median reported)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="bf16: autocast")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch default). 1 by default: the exponents then\n"
        "reflect the work, not how well small matrices spread over cores, and\n"
        "a busy machine's other jobs do not stall a thread team",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    imgs = [int(v) for v in args.imgs.split(",")]
    models = [tuple(int(v) for v in m.split("x")) for m in args.models.split(",")]
    if any(i % args.patch for i in [*imgs, args.img]):
        p.error(f"image sides must be multiples of --patch {args.patch}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    t_start = time.perf_counter()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"# device={where} threads={torch.get_num_threads()} torch={torch.__version__} "
        f"dtype={args.dtype} batch={args.batch} patch={args.patch} median of {args.reps} steps"
    )
    if device.type == "cuda":
        mem = (
            "torch.cuda.max_memory_allocated during one step minus memory_allocated at its "
            "start (gradients freed first)"
        )
    else:
        mem = (
            "torch.profiler allocator records (profile_memory): peak of live CPU tensor bytes "
            "during one step above its start (gradients freed first); not RSS"
        )
    print(f"# peak MiB: {mem}. state MiB: parameters + gradients + AdamW state between steps.")

    # (a) sequence length
    steps = [Step(args, i, args.dim, args.depth, args.heads, device) for i in imgs]
    rows = measure(steps, args.reps, "a")
    r0 = rows[0]
    print(
        f"\n## (a) image size: D={args.dim} depth={args.depth} heads={args.heads}, "
        f"{rows[0]['step'].params / 1e6:.2f} M parameters\n"
    )
    table(
        [
            "img",
            "tokens",
            "GFLOP/step",
            "ms/step",
            "ms/img",
            "GFLOP/s",
            "peak MiB",
            "tokens x",
            "GFLOP x",
            "time x",
            "peak x",
        ],
        [
            [
                f"{r['step'].img}",
                f"{r['step'].tokens}",
                f"{r['flops'] / 1e9:.2f}",
                f"{r['ms']:.0f}",
                f"{r['ms'] / args.batch:.1f}",
                f"{r['rate'] / 1e9:.1f}",
                f"{r['peak']:.1f}",
                f"{r['step'].tokens / r0['step'].tokens:.1f}",
                f"{r['flops'] / r0['flops']:.1f}",
                f"{r['ms'] / r0['ms']:.1f}",
                f"{r['peak'] / r0['peak']:.1f}",
            ]
            for r in rows
        ],
    )
    tokens = [r["step"].tokens for r in rows]
    fit = {k: slope(tokens, [r[k] for r in rows]) for k in ("ms", "flops", "peak")}
    local = slope(tokens[-2:], [r["ms"] for r in rows[-2:]]) if len(rows) > 2 else fit["ms"]
    print(
        f"\nStep time grows as tokens^{fit['ms']:.2f} over {tokens[0]}..{tokens[-1]} tokens "
        f"(tokens^{local:.2f} between the two largest); model FLOPs as tokens^{fit['flops']:.2f}, "
        f"step peak memory as tokens^{fit['peak']:.2f} (least-squares log-log slopes)."
    )
    del steps, rows

    # (b) model size
    steps = [Step(args, args.img, d, n, max(1, d // args.head_dim), device) for d, n in models]
    rows = measure(steps, args.reps, "b")
    print(f"\n## (b) model size: img={args.img} ({rows[0]['step'].tokens} tokens)\n")
    table(
        [
            "D",
            "depth",
            "heads",
            "params M",
            "GFLOP/step",
            "ms/step",
            "ms/img",
            "GFLOP/s",
            "peak MiB",
            "state MiB",
            "time x",
        ],
        [
            [
                f"{r['step'].dim}",
                f"{r['step'].depth}",
                f"{r['step'].heads}",
                f"{r['step'].params / 1e6:.2f}",
                f"{r['flops'] / 1e9:.2f}",
                f"{r['ms']:.0f}",
                f"{r['ms'] / args.batch:.1f}",
                f"{r['rate'] / 1e9:.1f}",
                f"{r['peak']:.1f}",
                f"{r['state']:.1f}",
                f"{r['ms'] / rows[0]['ms']:.1f}",
            ]
            for r in rows
        ],
    )
    params = [r["step"].params for r in rows]
    rates = [r["rate"] / 1e9 for r in rows]
    print(
        f"\nStep time grows as params^{slope(params, [r['ms'] for r in rows]):.2f} and "
        f"GFLOP^{slope([r['flops'] for r in rows], [r['ms'] for r in rows]):.2f}; achieved "
        f"{min(rates):.1f}..{max(rates):.1f} GFLOP/s. Total {time.perf_counter() - t_start:.0f} s."
    )


if __name__ == "__main__":
    main()
