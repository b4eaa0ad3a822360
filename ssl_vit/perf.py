"""Model FLOPs and the dense-matmul peak, to report training speed as a fraction of peak."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_train_flops", "describe_machine", "measure_matmul_peak"]


def count_train_flops(objective: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Model FLOPs of one forward + backward of `objective(images, labels)` (matmuls, convs,
    attention, as counted by torch's FlopCounterMode). Gradients it creates are cleared."""
    had_grad = {p: p.grad for p in objective.parameters()}
    # torch's CPU attention kernel (_scaled_dot_product_flash_attention_for_cpu) has no FLOP
    # formula and would count as 0; the math backend does the same products as countable matmuls.
    on_cpu = images.device.type == "cpu"
    backend = sdpa_kernel(SDPBackend.MATH) if on_cpu else contextlib.nullcontext()
    with backend, FlopCounterMode(display=False) as counter:
        loss, _ = objective(images, labels)
        loss.backward()
    for p, g in had_grad.items():
        p.grad = g
    return float(counter.get_total_flops())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    n: int = 2048,
    repeats: int = 5,
    min_time: float = 0.2,
) -> float:
    """Dense (n x n) @ (n x n) FLOP/s measured now on `device` in `dtype` (median of `repeats`
    timings, each running matmuls for at least `min_time` seconds).

    Uses `F.linear`, the GEMM that nn.Linear layers run: on CPUs without native bf16 it takes
    oneDNN's bf16 path, which is several times faster than `torch.matmul` in bf16."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    F.linear(a, b)  # warm-up
    _sync(device)
    rates = []
    for _ in range(repeats):
        iters, t0 = 0, time.perf_counter()
        while True:
            F.linear(a, b)
            iters += 1
            _sync(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time:
                break
        rates.append(2.0 * n**3 * iters / elapsed)
    return statistics.median(rates)


def describe_machine() -> str:
    """One line for reports: CPU model, cores, RAM, GPU, Python and torch versions."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu}; {os.cpu_count()} cores; {mem:.0f} GiB RAM; {gpu}; "
            f"Python {platform.python_version()}; torch {torch.__version__}")  # fmt: skip
