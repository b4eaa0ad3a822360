"""Steady-state training throughput of the real pipeline on Fashion-MNIST shards, side by side
with a plain in-memory timm + AdamW loop on the same model and batch.

    python benchmarks/train_throughput.py [--shards shards/fashion-mnist] [--steps 60]
        [--rounds 3] [--config configs/fmnist_vit_tiny_mpp.yaml] [--out RESULT.json] [k=v ...]

Runs `pipelines/mpp_pretrain.py` (DeepSpeed, the real input path as the preset resolves it:
with `data.in_memory=auto`, Fashion-MNIST is decoded once into RAM at start, ssl_vit.data.memory;
pass data.in_memory=false to time the streaming loader) in a temporary run directory and
reports, over the logging windows after the first (warm-up), the medians of: images/s, model
FLOP/s, model FLOP utilisation against the dense matmul peak the trainer measures at start at
the same precision, and the share of step time spent waiting for the data loader (goal: < 5%).

The peer: the same objective (timm backbone + MPP head, built by the same config) trained by a
bare loop, `loss.backward(); AdamW.step()`, on random batches of images decoded once into
memory: no DeepSpeed, no loader, no augmentation, no metrics. Both run in fp32 unless
train.precision is given, eager and with each block compiled (train.compile,
ssl_vit.engine.compile), so the table has both like-for-like ratios.

Rounds: a process's speed on a shared 2-core VM drifts by several percent from one process to
the next, more than the effects measured here, so each of `--rounds` rounds runs all four
(plain eager, pipeline eager, pipeline compiled, plain compiled; every other round in reverse
order) and the ratios are taken within a round, then their median over rounds is reported.
The headline, the goal's measure (>= 0.9): the pipeline as a full-length run of the preset
trains (its train.compile resolved for a long run) against the plain eager loop a user would
write by hand.
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


def plain_loop(
    config: str, shards: str, overrides: list[str], steps: int, window: int, compiled: bool = False
) -> dict:
    """images/s per window of `window` steps (first window dropped) of a bare training loop;
    `compiled`: its blocks compiled as the pipeline compiles them (ssl_vit.engine.compile)."""
    import torch

    from ssl_vit.config import load_config
    from ssl_vit.data.manifest import load_manifest
    from ssl_vit.data.stream import make_eval_loader
    from ssl_vit.engine.build import build_from_config
    from ssl_vit.engine.precision import resolve_precision

    cfg = load_config(
        config, [f"data.root={shards}", "train.epochs=null", "train.steps=1", *overrides]
    )
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as the pipeline's
    objective, _, _ = build_from_config(cfg, load_manifest(shards))
    objective.to(device)
    if compiled:
        from ssl_vit.engine.compile import compile_blocks

        compile_blocks(objective)
    autocast = resolve_precision(cfg.train.precision) == "bf16"
    batch = cfg.train.global_batch
    loader = make_eval_loader(
        shards, "train", batch_size=512, img_size=cfg.model.img_size, num_workers=0
    )
    n = max(4096, 2 * batch)
    images = torch.cat([x for x, _ in itertools.islice(loader, -(-n // 512))])[:n].to(device)
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    opt = torch.optim.AdamW(
        objective.parameters(),
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        weight_decay=cfg.optim.weight_decay,
    )
    gen = torch.Generator(device).manual_seed(0)
    rates = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        pick = torch.randint(0, len(images), (batch,), generator=gen, device=device)
        x = images[pick].float().div_(255)  # (B, C, H, W) in [0, 1]
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss, _ = objective(x, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % window == 0:
            loss.item()  # one sync per window, as a logging loop would
            now = time.perf_counter()
            rates.append(window * batch / (now - t0))
            t0 = now
    return {
        "rates": rates[1:],
        "precision": "bf16" if autocast else "fp32",
        "threads": torch.get_num_threads(),
    }


def pipeline(args: argparse.Namespace, overrides: list[str]) -> tuple[list[dict], dict]:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "pipelines/mpp_pretrain.py",
            "--config",
            args.config,
            f"data.root={args.shards}",
            f"run.dir={run}",
            "train.epochs=null",
            f"train.steps={args.steps}",
            f"run.log_every={args.log_every}",
            f"run.checkpoint_every={10 * args.steps}",
            "monitor.knn_every=0",
            f"tracking.uri=sqlite:///{Path(tmp) / 'mlflow.db'}",
            *overrides,
        ]
        subprocess.run(
            cmd,
            cwd=ROOT,
            check=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.DEVNULL,
        )
        rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()][1:]
        ds = json.loads((run / "ds_config.json").read_text())
    return rows, ds


MEDIANS = ("train/images_per_s", "train/model_flops_per_s", "train/mfu", "train/data_wait_share")


def full_run_mode(config: str, shards: str, overrides: list[str]) -> str:
    """How a full-length run of the preset compiles on this machine: "on", "off" or "trial"
    (train.compile resolved as the trainer does for a run of the preset's length)."""
    import torch

    from ssl_vit.config import load_config
    from ssl_vit.data.manifest import load_manifest
    from ssl_vit.engine.compile import resolve_compile

    cfg = load_config(config, [f"data.root={shards}", *overrides])
    n = load_manifest(shards).splits[cfg.data.split].num_samples
    images = (
        cfg.train.steps * cfg.train.global_batch
        if cfg.train.steps
        else (cfg.train.epochs * n * (1 - cfg.holdout_share))
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_compile(cfg.train.compile, int(images), cfg.train.zero_stage, device)[0]


def _as_a_full_run(r: dict, mode: str) -> float:
    """Images/s of the pipeline as a full run of the preset trains: its trial (auto on a CPU)
    times eager against compiled in the run and keeps the faster, as this round did."""
    eager, compiled = (r["pipeline", c]["train/images_per_s"] for c in (False, True))
    return {"on": compiled, "off": eager, "trial": max(eager, compiled)}[mode]


def _round(args: argparse.Namespace, overrides: list[str], reverse: bool) -> dict:
    """Plain eager, pipeline eager, pipeline compiled, plain compiled (or the reverse): medians
    over each run's logging windows."""
    out: dict = {}
    order = [("plain", False), ("pipeline", False), ("pipeline", True), ("plain", True)]
    for kind, compiled in reversed(order) if reverse else order:
        if kind == "plain":
            rates = plain_loop(
                args.config, args.shards, overrides, args.steps, args.log_every, compiled
            )["rates"]
            out[kind, compiled] = statistics.median(rates)
        else:
            rows, out["ds"] = pipeline(args, [*overrides, f"train.compile={str(compiled).lower()}"])
            out[kind, compiled] = {k: statistics.median(r[k] for r in rows) for k in MEDIANS}
            out["windows"] = len(rows)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", default="shards/fashion-mnist")
    p.add_argument("--config", default="configs/fmnist_vit_tiny_mpp.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", type=Path, help="also write the medians and the ratio here (JSON)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    overrides = list(args.overrides)
    if not any(o.startswith("train.precision=") for o in overrides):
        overrides.append("train.precision=fp32")  # the same arithmetic on both sides
    overrides = [o for o in overrides if not o.startswith("train.compile=")]
    mode = full_run_mode(args.config, args.shards, overrides)
    rounds = [_round(args, overrides, reverse=r % 2 == 1) for r in range(args.rounds)]
    ips = "train/images_per_s"

    def med(values) -> float:
        return statistics.median(values)

    both = (False, True)
    pipe = {c: {k: med(r["pipeline", c][k] for r in rounds) for k in MEDIANS} for c in both}
    plain = {c: med(r["plain", c] for r in rounds) for c in both}
    like = [med(r["pipeline", c][ips] / r["plain", c] for r in rounds) for c in both]
    per_round = [_as_a_full_run(r, mode) / r["plain", False] for r in rounds]
    ratio = med(per_round)
    batch, windows = rounds[0]["ds"]["train_batch_size"], rounds[0]["windows"]
    print(
        f"config {args.config} {' '.join(overrides)}; global batch {batch}; "
        f"{args.rounds} rounds, each run {windows} windows of {args.log_every} steps "
        "after warm-up; medians"
    )
    how = {"on": "yes", "off": "no", "trial": "the faster, timed in the run (auto's trial)"}
    print(f"a full run of the preset compiles its blocks: {how[mode]}")
    print(f"{'':34}{'eager':>10}{'compiled':>10}")
    table = (("pipeline images/s", "train/images_per_s", 1),
             ("pipeline model GFLOP/s", "train/model_flops_per_s", 1e-9),
             ("pipeline fraction of matmul peak", "train/mfu", 1),
             ("pipeline data wait share (< 0.05)", "train/data_wait_share", 1))  # fmt: skip
    for label, key, scale in table:
        print(f"{label:34}{pipe[False][key] * scale:10.3f}{pipe[True][key] * scale:10.3f}")
    print(f"{'plain loop images/s':34}{plain[False]:10.1f}{plain[True]:10.1f}")
    print(f"{'pipeline / plain, like for like':34}{like[0]:10.2f}{like[1]:10.2f}")
    print(
        f"pipeline as a full run trains / plain eager loop: {ratio:.2f}x  (goal >= 0.9; "
        f"rounds: {', '.join(f'{x:.2f}' for x in per_round)})"
    )
    if args.out is not None:
        from ssl_vit.io import atomic_write_text
        from ssl_vit.perf import describe_machine

        result = {
            "config": args.config,
            "overrides": overrides,
            "steps": args.steps,
            "rounds": args.rounds,
            "compile_mode": mode,
            "plain_images_per_s": plain[False],
            "ratio": ratio,
            "ratio_per_round": per_round,
            "pipeline_eager": pipe[False],
            "pipeline_compiled": pipe[True],
            "plain_compiled_images_per_s": plain[True],
            "ratio_like_for_like": like,
            "machine": describe_machine(),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
