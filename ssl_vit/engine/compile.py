"""torch.compile for training: each repeated block of the model compiled in place.

Blocks, not the whole objective: the objectives hold data-dependent Python (MPP's corruption,
the cascade's exits) that breaks graphs, while every `blocks.<i>` (a ViT or Mixer block) is one
static graph, traced once and reused by every block of the same shape. In place
(`nn.Module.compile`), so state_dict keys stay the eager model's: checkpoints, resume and
exports are the same files either way. Evaluations during training run the blocks eagerly
(`eager`): they are a small share of a run, and their other batch sizes and no-grad graphs
would each cost a compile of their own.

`train.compile`: true, false, or auto. Measured on 2 CPU cores (AMD EPYC, fp32, the MPP preset's
model, batch 256; benchmarks/train_throughput.py, side by side in one run): the plain loop
compiled 1110 vs 1092 images/s eager (+1.6%), the pipeline 854 vs 917 (-7%) after a ~20 s
compile. So auto is off on CPUs (true still compiles there, given a C++ compiler for Inductor's
kernels), and on GPUs on for runs of at least AUTO_MIN_IMAGES images, without ZeRO-3 (its
parameter hooks run inside each block's forward). The GPU threshold is not measured here (no
GPU in these runs): it asks that a compile of a minute or two be a small share of the run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil

import torch
from torch import nn

from ssl_vit.config import ConfigError

AUTO_MIN_IMAGES = 2_000_000  # GPUs only; not measured here (see the module doc)
_BLOCK = re.compile(r"(^|\.)blocks\.\d+$")


def _cpu_compiler() -> str | None:
    """The C++ compiler Inductor would use for CPU kernels, if there is one."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")


def resolve_compile(requested: object, total_images: int, zero_stage: int,
                    device: torch.device) -> tuple[bool, str]:  # fmt: skip
    """(compile or not, why) for `train.compile` = `requested` (true, false or "auto") and a
    run of `total_images` (steps x global batch)."""
    if requested is False:
        return False, "train.compile=false"
    if zero_stage == 3:  # train.compile=true is refused with ZeRO-3 by config validation
        return False, "auto: off under ZeRO-3"
    if device.type == "cpu":
        if requested is not True:  # auto
            return False, "auto: off on CPU (measured slower there, see ssl_vit.engine.compile)"
        if _cpu_compiler() is None:
            raise ConfigError("train.compile=true needs a C++ compiler for Inductor's CPU kernels "
                              "(none found as $CXX, g++ or clang++): install g++ or set "
                              "train.compile=false")  # fmt: skip
    if requested is True:
        return True, "train.compile=true"
    if total_images < AUTO_MIN_IMAGES:
        return False, f"auto: off, {total_images} images < {AUTO_MIN_IMAGES} do not pay it back"
    return True, f"auto: on, {total_images} images"


def compile_blocks(module: nn.Module) -> int:
    """Compile every `blocks.<i>` submodule in place; returns how many."""
    blocks = [m for name, m in module.named_modules() if _BLOCK.search(name)]
    for block in blocks:
        block.compile()
    return len(blocks)


def eager() -> contextlib.AbstractContextManager:
    """Run compiled modules eagerly inside (evaluations during training)."""
    return torch.compiler.set_stance("force_eager")
