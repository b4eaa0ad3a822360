"""What a GPU machine does with ssl-vit, in one table and at most about 8 minutes on one GPU.

    bash benchmarks/gpu_check.sh                       # on the GPU machine (the same as below)
    python benchmarks/gpu_check.py --out results/device/gpu_check.json
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/check.json   # any machine

Four sections, each measured side by side in this one run and printed as rows of one table:

  step    a ViT-B/16 MPP training step (forward, backward, AdamW) on a synthetic batch held in
          device memory, bf16 autocast on CUDA (fp32 on a CPU), eager and with each block
          compiled: images/s and MFU, against the device's published dense peak where
          ssl_vit.perf knows it and against the matmul peak measured here.
  loader  the training loader at 224 px from JPEG shards (benchmarks/photo_set.py's photos when
          --shards names them, else photo-like JPEGs made here): data.decode=cpu against gpu,
          images/s with nothing else running, then the share of each step of that ViT-B/16
          spent waiting for the next batch when it trains from the loader.
  knn     10k queries against 100k x 768 normalised features, top 20: FAISS on the GPU where its
          GPU build is installed, else exact search by torch on the device.
  zero3   the real pretraining script at ZeRO-3 on one rank for 20 steps (a small ViT on the
          JPEG shards), killed with SIGKILL after its checkpoint at step 10, resumed to the end:
          the metric steps continue and the export is written.

--quick shrinks every size (a tiny ViT, 32-px images, a 2k-row gallery) so that the same code
runs on a CPU in about a minute: the test suite runs it so (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere

from ssl_vit.data.stream import make_train_loader  # noqa: E402
from ssl_vit.models import build_backbone  # noqa: E402
from ssl_vit.objectives import build_objective, param_groups  # noqa: E402
from ssl_vit.perf import count_train_flops, describe_machine, mfu_peaks  # noqa: E402

FULL = {
    "arch": "vit_base_patch16_224",
    "img": 224,
    "patch": 16,
    "kwargs": {},
    "batch": 128,
    "steps": 20,
    "loader_batches": 30,
    "workers": 4,
    "gallery": 100_000,
    "dim": 768,
    "queries": 10_000,
    "jpegs": 2000,
}
QUICK = {
    "arch": "vit_tiny_patch16_224",
    "img": 32,
    "patch": 8,
    "kwargs": {"depth": 2, "embed_dim": 64, "num_heads": 2},
    "batch": 16,
    "steps": 4,
    "loader_batches": 6,
    "workers": 2,
    "gallery": 2000,
    "dim": 64,
    "queries": 200,
    "jpegs": 160,
}


_T0 = time.perf_counter()


def say(msg: str) -> None:
    """A progress line on stderr with the time since start: full sizes on a CPU run for many
    minutes, and a silent terminal looks like a hang."""
    print(f"[gpu_check {time.perf_counter() - _T0:6.0f} s] {msg}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _objective(p: dict, device: torch.device) -> torch.nn.Module:
    bb = build_backbone(
        p["arch"], img_size=p["img"], in_chans=3, patch_size=p["patch"], **p["kwargs"]
    )
    return build_objective("mpp", bb, mean=[0.5] * 3, std=[0.25] * 3).to(device)


class Step:
    """One MPP objective + AdamW; `__call__(images, labels)` trains one step on a batch."""

    def __init__(self, p: dict, device: torch.device, compiled: bool) -> None:
        from ssl_vit.engine.compile import compile_blocks

        self.device = device
        self.model = _objective(p, device)
        if compiled:
            compile_blocks(self.model)
        self.opt = torch.optim.AdamW(param_groups(self.model, 0.05), lr=1e-4)
        self.bf16 = device.type == "cuda"

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss, _ = self.model(images, labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def section_step(p: dict, device: torch.device, quick: bool) -> list[dict]:
    """Images/s and MFU of the training step, eager and compiled (eager only with --quick: the
    compile of a CPU build takes longer than the rest), on a batch in device memory."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (p["batch"], 3, p["img"], p["img"]), generator=gen)
    images = images.to(torch.uint8).to(device)
    labels = torch.zeros(p["batch"], dtype=torch.int64, device=device)
    flops = count_train_flops(_objective(p, device), images, labels)
    peak, measured, why = mfu_peaks("bf16" if device.type == "cuda" else "fp32", device)
    rows = []
    for compiled in (False,) if quick else (False, True):
        what = "compiled" if compiled else "eager"
        say(f"step ({what}): warm-up{' and compilation' if compiled else ''}")
        step = Step(p, device, compiled)
        for _ in range(3):  # warm-up (and compilation)
            step(images, labels)
        _sync(device)
        times = []
        for i in range(p["steps"]):
            t0 = time.perf_counter()
            step(images, labels)
            _sync(device)
            times.append(time.perf_counter() - t0)
            if i % 5 == 4 or i + 1 == p["steps"]:
                say(f"step ({what}): {i + 1}/{p['steps']} timed, {times[-1]:.2f} s each")
        t = statistics.median(times)
        rows.append(
            {
                "section": "step",
                "what": "compiled" if compiled else "eager",
                "images_per_s": p["batch"] / t,
                "step_ms": 1e3 * t,
                "mfu": flops / t / peak,
                "mfu_measured": flops / t / measured,
                "peak": why,
            }
        )
    return rows


def photo_like_jpeg_shards(out: Path, n: int, size: int) -> Path:
    """`n` smooth, textured RGB JPEGs (shorter side `size`, q90) in class folders, sharded by
    data_prep/make_shards.py: photo-like decode and resize costs, made offline."""
    from PIL import Image

    shards = out / "shards"
    if (shards / "manifest.json").is_file():
        return shards
    rng = np.random.default_rng(0)
    for i in range(n):
        h, w = (size, int(size * rng.uniform(1.0, 1.5)))[:: 1 if i % 2 else -1]
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        base = rng.uniform(0, 255, 3) + 60 * np.sin(x[..., None] / rng.uniform(5, 40, 3))
        img = (
            base + 40 * np.cos(y[..., None] / rng.uniform(5, 40, 3)) + rng.normal(0, 12, (h, w, 3))
        )
        folder = out / "images" / f"class_{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        (folder / f"{i:05d}.jpg").write_bytes(buf.getvalue())
    cmd = [
        sys.executable,
        str(ROOT / "data_prep" / "make_shards.py"),
        str(out / "images"),
        str(shards),
        "--format",
        "keep",
        "--num-shards",
        "8",
        "--workers",
        "2",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return shards


def section_loader(p: dict, device: torch.device, shards: Path) -> list[dict]:
    """The loader alone, CPU against GPU decoding, then the data-wait share of training on it."""
    rows = []
    for decode in ("cpu", "gpu"):
        loader = make_train_loader(
            shards,
            "train",
            global_batch=p["batch"],
            num_workers=p["workers"],
            img_size=p["img"],
            decode=decode,
            device=device,
            timeout=300,
        )
        batches = iter(loader)
        next(batches)  # workers started
        t0, n = time.perf_counter(), 0
        for _ in range(min(p["loader_batches"], len(loader) - 1)):
            images, _ = next(batches)
            n += len(images)
        _sync(device)
        rate = n / (time.perf_counter() - t0)
        step = Step(p, device, compiled=False)
        wait = busy = 0.0
        loader.set_epoch(1)
        batches = iter(loader)
        step(*next(batches))  # warm-up
        for _ in range(min(p["loader_batches"], len(loader) - 1)):
            t0 = time.perf_counter()
            images, labels = next(batches)
            images = images.to(device, non_blocking=True)
            t1 = time.perf_counter()
            step(images, labels.to(device))
            _sync(device)
            wait, busy = wait + t1 - t0, busy + time.perf_counter() - t1
        rows.append(
            {
                "section": "loader",
                "what": f"decode={decode}",
                "images_per_s": rate,
                "data_wait_share": wait / (wait + busy),
                "workers": p["workers"],
            }
        )
    return rows


def section_knn(p: dict, device: torch.device) -> list[dict]:
    """Exact top-20 inner-product search of `queries` against `gallery` normalised rows."""
    from ssl_vit.knn import build_index, l2_normalize, search, use_faiss_gpu

    rng = np.random.default_rng(0)
    gallery = l2_normalize(rng.standard_normal((p["gallery"], p["dim"]), dtype=np.float32))
    queries = l2_normalize(rng.standard_normal((p["queries"], p["dim"]), dtype=np.float32))
    t0 = time.perf_counter()
    if device.type == "cpu" or use_faiss_gpu():
        backend = "faiss-gpu" if device.type == "cuda" else "faiss-cpu"
        search(build_index(gallery, "flat", gpu=device.type == "cuda"), queries, 20)
    else:  # no FAISS GPU build here: the same search in torch on the device
        backend = "torch"
        g = torch.from_numpy(gallery).to(device)
        for s in range(0, len(queries), 4096):
            q = torch.from_numpy(queries[s : s + 4096]).to(device)
            (q @ g.T).topk(20, dim=1)
        _sync(device)
    seconds = time.perf_counter() - t0
    return [
        {
            "section": "knn",
            "what": backend,
            "queries_per_s": len(queries) / seconds,
            "gallery": p["gallery"],
            "dim": p["dim"],
        }
    ]


def section_zero3(p: dict, shards: Path, work: Path) -> list[dict]:
    """The pretraining script at ZeRO-3 on one rank, SIGKILLed after step 10's checkpoint and
    run again: the metric steps must continue to 20 and the export appear."""
    run = work / "zero3"
    cmd = [
        sys.executable,
        str(ROOT / "pipelines" / "mpp_pretrain.py"),
        f"data.root={shards}",
        f"run.dir={run}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        "model.arch=vit_tiny_patch16_224",
        f"model.img_size={min(p['img'], 64)}",
        "model.patch_size=8",
        "model.kwargs={depth: 2, embed_dim: 64, num_heads: 2}",
        "train.zero_stage=3",
        "train.epochs=null",
        "train.steps=20",
        "train.compile=false",
        f"train.global_batch={p['batch']}",
        "run.checkpoint_every=10",
        "run.log_every=2",
        "optim.warmup_steps=2",
        "monitor.knn_every=0",
        "data.num_workers=1",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    latest = run / "checkpoints" / "latest"
    while proc.poll() is None and not (latest.is_file() and "step00000010" in latest.read_text()):
        time.sleep(0.2)
    killed = proc.poll() is None
    if killed:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    ok = (
        again.returncode == 0
        and steps == list(range(2, 21, 2))
        and (run / "export" / "backbone.safetensors").is_file()
    )
    if not ok:
        print(again.stderr[-3000:], file=sys.stderr)
    return [
        {
            "section": "zero3",
            "what": "kill at step 10, resume to 20",
            "ok": ok,
            "killed_mid_run": killed,
            "seconds": time.perf_counter() - t0,
            "metric_steps": steps,
        }
    ]


def table(rows: list[dict]) -> str:
    """The rows as one Markdown table: section, what, and its figures."""
    lines = ["| section | what | figures |", "|---|---|---|"]
    for r in rows:
        figures = ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in r.items()
            if k not in ("section", "what", "metric_steps")
        )
        lines.append(f"| {r['section']} | {r['what']} | {figures} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--quick", action="store_true", help="tiny sizes (a CPU in about a minute)")
    a.add_argument("--shards", type=Path, help="JPEG shards (default: photo-like ones made here)")
    a.add_argument(
        "--work",
        type=Path,
        default=ROOT / "runs" / "gpu_check",
        help="scratch folder (shards made here, the zero3 run)",
    )
    a.add_argument("--only", default="step,loader,knn,zero3", help="sections, comma-separated")
    a.add_argument("--out", type=Path, help="results JSON")
    args = a.parse_args(argv)
    p, device = (QUICK if args.quick else FULL), torch.device(args.device)
    only = set(args.only.split(","))
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    shards = args.shards
    if shards is None and only & {"loader", "zero3"}:
        size = 256 if not args.quick else 48
        say(f"making {p['jpegs']} photo-like JPEG shards at {size} px")
        shards = photo_like_jpeg_shards(args.work / f"jpegs{size}", p["jpegs"], size)
    rows: list[dict] = []
    sections = {
        "step": lambda: section_step(p, device, args.quick),
        "loader": lambda: section_loader(p, device, shards),
        "knn": lambda: section_knn(p, device),
        "zero3": lambda: section_zero3(p, shards, args.work),
    }
    for name, run in sections.items():
        if name in only:
            say(f"{name}: starting")
            rows += run()
            say(f"{name}: done")
    print(
        f"{describe_machine()}; {'quick' if args.quick else 'full'} sizes; "
        f"{time.perf_counter() - t0:.0f} s\n"
    )
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "machine": describe_machine(),
            "quick": args.quick,
            "sizes": p,
            "rows": rows,
            "seconds": time.perf_counter() - t0,
        }
        args.out.write_text(json.dumps(body, indent=1) + "\n")
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
