"""Steady-state training throughput of the real pipeline on Fashion-MNIST shards.

    python benchmarks/train_throughput.py [--shards shards/fashion-mnist] [--steps 60]
        [--config configs/fmnist_vit_tiny_mpp.yaml] [key=value ...]

Runs `pipelines/mpp_pretrain.py` (DeepSpeed, real loader) in a temporary run directory and
reports, over the logging windows after the first (warm-up), the medians of: images/s, model
FLOP/s, model FLOP utilisation against the dense matmul peak the trainer measures at start at
the same precision, and the share of step time spent waiting for the data loader (goal: < 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", default="shards/fashion-mnist")
    p.add_argument("--config", default="configs/fmnist_vit_tiny_mpp.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "pipelines/mpp_pretrain.py", "--config", args.config,
               f"data.root={args.shards}", f"run.dir={run}", "train.epochs=null",
               f"train.steps={args.steps}", f"run.log_every={args.log_every}",
               f"run.checkpoint_every={10 * args.steps}", "monitor.knn_every=0",
               f"tracking.uri=sqlite:///{Path(tmp) / 'mlflow.db'}", *args.overrides]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                       stdout=subprocess.DEVNULL)  # fmt: skip
        rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()][1:]
        ds = json.loads((run / "ds_config.json").read_text())
    med = {
        k: statistics.median(r[k] for r in rows)
        for k in (
            "train/images_per_s",
            "train/model_flops_per_s",
            "train/mfu",
            "train/data_wait_share",
        )
    }
    print(
        f"config {args.config} {' '.join(args.overrides)}; global batch "
        f"{ds['train_batch_size']}; {len(rows)} windows of {args.log_every} steps after warm-up"
    )
    print(f"images/s              {med['train/images_per_s']:10.1f}")
    print(f"model GFLOP/s         {med['train/model_flops_per_s'] / 1e9:10.2f}")
    print(f"fraction of peak      {med['train/mfu']:10.3f}   (dense matmul peak, same precision)")
    print(f"data wait share       {med['train/data_wait_share']:10.3f}   (goal < 0.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
