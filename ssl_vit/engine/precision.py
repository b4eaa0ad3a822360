"""The arithmetic a run trains in: fp32, bf16 (GPU weights or CPU autocast) or fp16.

`auto` takes bf16 on GPUs whose tensor cores run it and fp16 on older ones; on a CPU, fp32
unless it has native bf16 (AVX512-BF16 / AMX), and there whichever of fp32 and bf16 autocast a
short timing of the real model finds faster. A run keeps what it resolved to in RUN/precision.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ssl_vit.config import Config
from ssl_vit.engine.distributed import all_reduce_sum, broadcast_object
from ssl_vit.io import atomic_write_text

log = logging.getLogger("ssl_vit.train")
# bf16 autocast must beat fp32 by this much to be chosen: it costs precision, so a tie is fp32.
BF16_MIN_SPEEDUP = 1.05


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them CPU bf16 is emulated and slower than fp32 (we measured
    about 4x slower on an AVX2-only machine, see benchmarks/mpp_step.py)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def gpu_precision(capability: tuple[int, int]) -> str:
    """bf16 from compute capability 8.0 (Ampere) on, where the tensor cores run it; fp16 before.

    Not `torch.cuda.is_bf16_supported()`: by default it also counts emulation, which would hand
    V100 / T4 an emulated bf16 many times slower than their fp16 tensor cores."""
    return "bf16" if capability >= (8, 0) else "fp16"


def measure_step_seconds(
    objective: torch.nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    autocast: bool,
    repeats: int = 3,
) -> float:
    """Median seconds of one forward + backward of `objective(images, labels)` on CPU, with or
    without bf16 autocast, after one warm-up; the gradients it makes are cleared."""
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss, _ = objective(images, labels)
        loss.backward()
        if i:  # the first call warms up (allocations, oneDNN kernel choice)
            times.append(time.perf_counter() - t0)
    objective.zero_grad(set_to_none=True)
    return statistics.median(times)


def resolve_precision(requested: str, timer: Callable[[bool], float] | None = None) -> str:
    """'auto': on GPUs `gpu_precision`. On CPU: fp32 without native bf16 (emulated bf16 is
    several times slower), and with it, whichever of fp32 and bf16 autocast `timer` (seconds of
    a training step of the real model, given autocast on/off) finds faster: native bf16 is
    slower than fp32 for some models (small ViTs: we saw 560 vs 640 images/s). bf16 must win by
    BF16_MIN_SPEEDUP; with no timer, fp32."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return gpu_precision(torch.cuda.get_device_capability())
    if not cpu_has_native_bf16() or timer is None:
        return "fp32"
    # Interleaved rounds, best of each: a busy neighbour slows whichever runs during its burst,
    # and the fastest round is the closest to the machine's own speed.
    rounds = [(timer(False), timer(True)) for _ in range(2)]
    fp32, bf16 = min(r[0] for r in rounds), min(r[1] for r in rounds)
    choice = "bf16" if bf16 * BF16_MIN_SPEEDUP < fp32 else "fp32"
    log.info(
        "precision auto: a training step takes %.1f ms in fp32, %.1f ms in bf16 autocast -> %s",
        1e3 * fp32,
        1e3 * bf16,
        choice,
    )
    return choice


def step_timer(objective: torch.nn.Module, in_chans: int, img_size: int, micro: int):
    """For precision=auto on CPU: seconds of one micro-batch step, averaged over ranks so every
    rank makes the same choice."""

    def timer(autocast: bool) -> float:
        x = torch.rand(micro, in_chans, img_size, img_size)
        y = torch.zeros(micro, dtype=torch.long)
        seconds = measure_step_seconds(objective, x, y, autocast)
        total = all_reduce_sum(torch.tensor([seconds], dtype=torch.float64))
        return float(total.item()) / torch.distributed.get_world_size()

    return timer


def run_precision(cfg: Config, run_dir: Path, rank: int, timer) -> str:
    """The precision of this run: resolved once (`auto` may time the model), then read back
    from RUN/precision on every resume, so a run never changes arithmetic halfway."""
    saved = run_dir / "precision"
    known = broadcast_object(saved.read_text().strip() if rank == 0 and saved.is_file() else None)
    if known and cfg.train.precision in ("auto", known):
        return str(known)
    precision = resolve_precision(cfg.train.precision, timer)
    if rank == 0:
        atomic_write_text(saved, precision + "\n")
    return precision
