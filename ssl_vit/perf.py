"""Model FLOPs and the dense-matmul peak, to report training speed as a fraction of peak.

Model FLOP utilisation (MFU) divides the model FLOP/s by the device's published dense peak for
the run's matmul dtype (`published_peak`), the figure papers quote; a matmul peak measured at
start is kept beside it, and is the denominator on CPUs and on GPUs the table does not know.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

__all__ = [
    "count_train_flops",
    "describe_machine",
    "matmul_dtype",
    "measure_matmul_peak",
    "mfu_denominator",
    "mfu_peaks",
    "published_peak",
]


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
    """Dense (n x n) @ (n x n) FLOP/s measured now on `device` in `dtype`: the best of `repeats`
    timings, each running matmuls for at least `min_time` seconds. A peak is the most the
    matmuls reach: other work on the device during a timing only lowers that timing.

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
    return max(rates)


TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "tf32": torch.float32,
    "fp32": torch.float32,
}


def matmul_dtype(precision: str, device: torch.device) -> str:
    """The arithmetic of the run's matmuls: "bf16" / "fp16" for a half-precision run (bf16
    autocast on a CPU), and for an fp32 run "tf32" where torch lets cuBLAS run fp32 matmuls on
    TF32 tensor cores, else "fp32"."""
    if precision in ("bf16", "fp16"):
        return precision
    return "tf32" if device.type == "cuda" and _cuda_matmul_tf32() else "fp32"


def _cuda_matmul_tf32() -> bool:
    """Whether fp32 matmuls on CUDA may run in TF32. torch's newer `fp32_precision` flags also
    show what the older ones set; the older ones raise once the newer were used, so they are
    read only on a torch without the newer."""
    flag = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if flag is not None:
        return flag == "tf32"
    return (
        torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    )


# Dense peak TFLOP/s of one GPU, without 2:4 structured sparsity (datasheets print the sparse
# figure for tensor cores, twice the dense one, marked with an asterisk: halved here), by the
# dtype of the matmul inputs. Matched in order against torch.cuda.get_device_name(); a name
# that matches nothing (a GPU not listed, an unknown H100 variant, a MIG slice) has no
# published peak and MFU falls back to the measured one.
_PEAKS: tuple[tuple[str, str, dict[str, float], str], ...] = (
    # (pattern, the table's name, {dtype: dense TFLOP/s}, source)
    # A100 SXM4 and PCIe (40 and 80 GB) share their compute figures in the datasheet.
    (r"\bA100\b", "A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},
     "NVIDIA A100 Tensor Core GPU datasheet"),
    # "NVIDIA H100 80GB HBM3" is the SXM5 board; the PCIe card reports "H100 PCIe".
    (r"\bH100 NVL\b", "H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60},
     "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column"),
    (r"\bH100 PCIe\b", "H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378, "fp32": 51},
     "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column"),
    (r"\bH100 (80GB HBM3|SXM)", "H100 SXM",
     {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67},
     "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column"),
    (r"\bH200 NVL\b", "H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60},
     "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column"),
    (r"\bH200\b", "H200 SXM", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67},
     "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column"),
    (r"\bL40S\b", "L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183, "fp32": 91.6},
     "NVIDIA L40S datasheet"),
    (r"\bL4\b", "L4", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3},
     "NVIDIA L4 Tensor Core GPU datasheet"),
    (r"\bA10\b", "A10", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2},
     "NVIDIA A10 Tensor Core GPU datasheet"),
    # Volta: fp16 tensor cores only; bf16 is emulated (no figure), and with TF32 allowed its
    # fp32 matmuls stay fp32 (no TF32 units), so "tf32" is the fp32 figure.
    (r"\bV100-SXM2\b", "V100 SXM2", {"fp16": 125, "tf32": 15.7, "fp32": 15.7},
     "NVIDIA Tesla V100 GPU datasheet, V100 SXM2 column"),
    (r"\bV100-PCIE\b", "V100 PCIe", {"fp16": 112, "tf32": 14, "fp32": 14},
     "NVIDIA Tesla V100 GPU datasheet, V100 PCIe column"),
    (r"\bV100S-PCIE\b", "V100S PCIe", {"fp16": 130, "tf32": 16.4, "fp32": 16.4},
     "NVIDIA V100S datasheet"),
    # No tf32 figure: whether ROCm runs an fp32 matmul in xf32 depends on its environment.
    (r"\bMI300X\b", "MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4},
     "AMD Instinct MI300X accelerator data sheet"),
)  # fmt: skip


def published_peak(device_name: str, dtype: str) -> tuple[str, float, str] | None:
    """(the table's name for the device, its dense peak FLOP/s in `dtype`, the source) for a
    `torch.cuda.get_device_name()`, or None where the table has no figure for it. A MIG slice
    is a fraction of the GPU: never matched."""
    if re.search(r"\bMIG\b", device_name):
        return None
    for pattern, name, peaks, source in _PEAKS:
        if re.search(pattern, device_name):
            tflops = peaks.get(dtype)
            return None if tflops is None else (name, tflops * 1e12, source)
    return None


def mfu_denominator(device_name: str | None, dtype: str, measured: float) -> tuple[float, str]:
    """The peak FLOP/s of one device that `train/mfu` divides by, and a phrase naming it: the
    published dense peak where `published_peak` knows the GPU (`device_name`, None on a CPU),
    else `measured` (the matmul peak measured at start)."""
    found = published_peak(device_name, dtype) if device_name else None
    if found is not None:
        name, flops, source = found
        return (
            flops,
            f"the published dense {dtype} peak of the {name}: {flops / 1e12:g} TFLOP/s ({source})",
        )
    where = f"{device_name} has no published peak in ssl_vit/perf.py" if device_name else "a CPU"
    return (
        measured,
        f"the {dtype} matmul peak measured at start: {measured / 1e12:.3g} TFLOP/s ({where})",
    )


def mfu_peaks(precision: str, device: torch.device) -> tuple[float, float, str]:
    """(the peak FLOP/s of one device that `train/mfu` divides by, the matmul peak measured
    now that `train/mfu_measured` divides by, a phrase naming the first) for a run training in
    `precision` on `device`; both in the arithmetic of the run's matmuls (`matmul_dtype`)."""
    dtype = matmul_dtype(precision, device)
    measured = measure_matmul_peak(
        TORCH_DTYPES[dtype], device, n=4096 if device.type == "cuda" else 1024
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak, why = mfu_denominator(name, dtype, measured)
    return peak, measured, why


def describe_machine() -> str:
    """One line for reports: CPU model, cores, RAM, GPU, Python and torch versions."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}; {os.cpu_count()} cores; {mem:.0f} GiB RAM; {gpu}; "
        f"Python {platform.python_version()}; torch {torch.__version__}"
    )
