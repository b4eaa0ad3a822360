"""Steady-state training throughput of the real pipeline on Fashion-MNIST shards, side by side
with a plain in-memory timm + AdamW loop on the same model and batch.

    python benchmarks/train_throughput.py [--shards shards/fashion-mnist] [--steps 60]
        [--config configs/fmnist_vit_tiny_mpp.yaml] [--out RESULT.json] [key=value ...]

Runs `pipelines/mpp_pretrain.py` (DeepSpeed, real loader) in a temporary run directory and
reports, over the logging windows after the first (warm-up), the medians of: images/s, model
FLOP/s, model FLOP utilisation against the dense matmul peak the trainer measures at start at
the same precision, and the share of step time spent waiting for the data loader (goal: < 5%).

The peer: the same objective (timm backbone + MPP head, built by the same config) trained by a
bare loop, `loss.backward(); AdamW.step()`, on random batches of images decoded once into
memory: no DeepSpeed, no loader, no augmentation, no metrics. It runs before and after the
pipeline (machine drift shows as a difference); the ratio pipeline / plain is the overhead of
everything the pipeline adds (goal: >= 0.9). Both run in fp32 unless train.precision is given.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def plain_loop(config: str, shards: str, overrides: list[str], steps: int, window: int) -> dict:
    """images/s per window of `window` steps (first window dropped) of a bare training loop."""
    import torch

    from ssl_vit.config import load_config
    from ssl_vit.data.manifest import load_manifest
    from ssl_vit.data.stream import make_eval_loader
    from ssl_vit.engine.build import build_from_config
    from ssl_vit.engine.precision import resolve_precision

    cfg = load_config(config, [f"data.root={shards}", "train.epochs=null", "train.steps=1",
                               *overrides])  # fmt: skip
    torch.manual_seed(0)
    objective, _, _ = build_from_config(cfg, load_manifest(shards))
    autocast = resolve_precision(cfg.train.precision) == "bf16"
    batch = cfg.train.global_batch
    loader = make_eval_loader(shards, "train", batch_size=512, img_size=cfg.model.img_size,
                              num_workers=0)  # fmt: skip
    n = max(4096, 2 * batch)
    images = torch.cat([x for x, _ in itertools.islice(loader, -(-n // 512))])[:n]  # uint8
    labels = torch.zeros(batch, dtype=torch.long)
    opt = torch.optim.AdamW(objective.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                            weight_decay=cfg.optim.weight_decay)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    rates = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x = images[torch.randint(0, len(images), (batch,), generator=gen)].float().div_(255)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss, _ = objective(x, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % window == 0:
            loss.item()  # one sync per window, as a logging loop would
            now = time.perf_counter()
            rates.append(window * batch / (now - t0))
            t0 = now
    return {"rates": rates[1:], "precision": "bf16" if autocast else "fp32",
            "threads": torch.get_num_threads()}  # fmt: skip


def pipeline(args: argparse.Namespace, overrides: list[str]) -> tuple[list[dict], dict]:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "pipelines/mpp_pretrain.py", "--config", args.config,
               f"data.root={args.shards}", f"run.dir={run}", "train.epochs=null",
               f"train.steps={args.steps}", f"run.log_every={args.log_every}",
               f"run.checkpoint_every={10 * args.steps}", "monitor.knn_every=0",
               f"tracking.uri=sqlite:///{Path(tmp) / 'mlflow.db'}", *overrides]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                       stdout=subprocess.DEVNULL)  # fmt: skip
        rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()][1:]
        ds = json.loads((run / "ds_config.json").read_text())
    return rows, ds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", default="shards/fashion-mnist")
    p.add_argument("--config", default="configs/fmnist_vit_tiny_mpp.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", type=Path, help="also write the medians and the ratio here (JSON)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    overrides = list(args.overrides)
    if not any(o.startswith("train.precision=") for o in overrides):
        overrides.append("train.precision=fp32")  # the same arithmetic on both sides
    plain = plain_loop(args.config, args.shards, overrides, args.steps, args.log_every)
    rows, ds = pipeline(args, overrides)
    after = plain_loop(args.config, args.shards, overrides, args.steps, args.log_every)
    med = {
        k: statistics.median(r[k] for r in rows)
        for k in (
            "train/images_per_s",
            "train/model_flops_per_s",
            "train/mfu",
            "train/data_wait_share",
        )
    }
    plain_before, plain_after = statistics.median(plain["rates"]), statistics.median(after["rates"])
    plain_med = statistics.median(plain["rates"] + after["rates"])
    print(
        f"config {args.config} {' '.join(overrides)}; global batch "
        f"{ds['train_batch_size']}; {len(rows)} windows of {args.log_every} steps after warm-up"
    )
    print(f"images/s              {med['train/images_per_s']:10.1f}")
    print(f"model GFLOP/s         {med['train/model_flops_per_s'] / 1e9:10.2f}")
    print(f"fraction of peak      {med['train/mfu']:10.3f}   (dense matmul peak, same precision)")
    print(f"data wait share       {med['train/data_wait_share']:10.3f}   (goal < 0.05)")
    where = f"{plain['precision']}, {plain['threads']} threads"
    print(f"plain loop images/s   {plain_med:10.1f}   (timm + AdamW in memory, {where}; "
          f"before {plain_before:.1f}, after {plain_after:.1f})")  # fmt: skip
    ratio = med["train/images_per_s"] / plain_med
    print(f"pipeline / plain      {ratio:10.2f}x  (goal >= 0.9)")
    if args.out is not None:
        from ssl_vit.io import atomic_write_text
        from ssl_vit.perf import describe_machine

        result = {
            "config": args.config, "overrides": overrides, "steps": args.steps, "pipeline": med,
            "plain_images_per_s": plain_med, "plain_before": plain_before,
            "plain_after": plain_after, "ratio": ratio, "machine": describe_machine(),
        }  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
