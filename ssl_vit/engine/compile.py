"""torch.compile for training: each repeated block of the model compiled in place.

`resolve_compile` turns `train.compile` (true, false or auto) into on, off or a trial: on a GPU
auto compiles runs of at least AUTO_MIN_IMAGES images without ZeRO-3; on a CPU it measures in
the run itself (`CompileTrial`: TRIAL_STEPS steps eager, then as many compiled, the faster
kept, the same choice on every rank). `BlockCompile` holds a run's state for the training loop;
`compile_blocks` compiles every `blocks.<i>` in place (`nn.Module.compile`), so state_dict keys
stay the eager model's; `eager` runs them eagerly for evaluations during training.

Why blocks, and how auto decides: docs/training.md#compilation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import statistics
import time

import torch
from torch import nn

from ssl_vit.config import ConfigError
from ssl_vit.engine.distributed import all_reduce_sum

log = logging.getLogger("ssl_vit.train")

AUTO_MIN_IMAGES = 2_000_000  # GPUs only; a judgement, not a measurement (docs/training.md)
TRIAL_WARM = 3  # steps not timed: the launch's first (warm-up) and the compiled first (compiling)
TRIAL_STEPS = 15  # steps timed each way; the medians decide
TRIAL_MIN_STEPS = 8 * (TRIAL_WARM + TRIAL_STEPS)  # a launch shorter than this stays eager
_BLOCK = re.compile(r"(^|\.)blocks\.\d+$")


def _cpu_compiler() -> str | None:
    """The C++ compiler Inductor would use for CPU kernels, if there is one."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")


def resolve_compile(
    requested: object, total_images: int, zero_stage: int, device: torch.device
) -> tuple[str, str]:
    """("on", "off" or "trial", why) for `train.compile` = `requested` (true, false or "auto")
    and a run of `total_images` (steps x global batch); "trial": see `CompileTrial`."""
    if requested is False:
        return "off", "train.compile=false"
    if zero_stage == 3:  # train.compile=true is refused with ZeRO-3 by config validation
        return "off", "auto: off under ZeRO-3"
    if device.type == "cpu":
        if _cpu_compiler() is None:
            if requested is True:
                raise ConfigError(
                    "train.compile=true needs a C++ compiler for Inductor's CPU "
                    "kernels (none found as $CXX, g++ or clang++): install g++ or "
                    "set train.compile=false"
                )
            return "off", "auto: off, no C++ compiler for Inductor's CPU kernels"
        if requested is not True:
            return "trial", "auto: measured in the run, eager against compiled"
    if requested is True:
        return "on", "train.compile=true"
    if total_images < AUTO_MIN_IMAGES:
        return "off", f"auto: off, {total_images} images < {AUTO_MIN_IMAGES} do not pay it back"
    return "on", f"auto: on, {total_images} images"


class CompileTrial:
    """train.compile=auto on a CPU: time steps eager, compile the blocks, time as many compiled,
    keep the faster. A step's time is the wall time from one `after_step` to the next, so it
    holds what the run pays for (waiting for data, loader workers taking the cores); the choice
    uses the sum over ranks of each side's median, so every rank makes the same one. Eager is
    restored by torch.compiler's "force_eager" stance: the modules and their state_dict keys
    stay as they are."""

    def __init__(self, module: nn.Module, first_step: int) -> None:
        self.module, self.first_step = module, first_step
        self.times: dict[bool, list[float]] = {False: [], True: []}
        self.last: float | None = None
        self.compiled = False  # the blocks compiled now (evaluations switch them to eager)
        self.result: dict[str, float] | None = None  # set once decided

    def after_step(self, step: int) -> dict[str, float] | None:
        """Call after each training step; returns the measurement once, the step it decides."""
        now = time.perf_counter()
        last, self.last = self.last, now
        if self.result is not None or last is None:
            return None
        phase = step - self.first_step - TRIAL_WARM  # 1..TRIAL_STEPS eager, then compiled
        if 1 <= phase <= TRIAL_STEPS:
            self.times[False].append(now - last)
            if phase == TRIAL_STEPS:
                self.compiled = compile_blocks(self.module) > 0
        elif phase > TRIAL_STEPS + TRIAL_WARM:  # the first TRIAL_WARM compiled steps compile
            self.times[True].append(now - last)
            if len(self.times[True]) == TRIAL_STEPS:
                return self._decide()
        return None

    def close(self) -> None:
        """Leave torch.compiler's stance as it was before the trial (the process may go on)."""
        if self.result is not None and not self.compiled:
            torch.compiler.set_stance("default")

    def _decide(self) -> dict[str, float]:
        medians = torch.tensor([statistics.median(self.times[c]) for c in (False, True)])
        eager_s, compiled_s = all_reduce_sum(medians.double()).tolist()
        keep = compiled_s < eager_s
        if not keep:
            torch.compiler.set_stance("force_eager")
            self.compiled = False
        self.result = {
            "compile/eager_step_s": eager_s,
            "compile/compiled_step_s": compiled_s,
            "compile/on": float(keep),
        }
        log.info(
            "torch.compile trial: eager %.1f ms/step, compiled %.1f ms/step (medians of %d "
            "steps, summed over ranks): keeping %s",
            1e3 * eager_s,
            1e3 * compiled_s,
            TRIAL_STEPS,
            "compiled" if keep else "eager",
        )
        return self.result


def compile_blocks(module: nn.Module) -> int:
    """Compile every `blocks.<i>` submodule in place; returns how many."""
    blocks = [m for name, m in module.named_modules() if _BLOCK.search(name)]
    for block in blocks:
        block.compile()
    return len(blocks)


def start_trial(
    mode: object, module: nn.Module, first_step: int, total_steps: int, rank: int
) -> CompileTrial | None:
    """The trial of a launch whose compile mode resolved to "trial", when enough steps are left
    for it to pay; None otherwise (eager)."""
    if mode != "trial":
        return None
    if total_steps - first_step < TRIAL_MIN_STEPS:
        if rank == 0:
            log.info(
                "torch.compile off: %d steps left, fewer than the %d the trial needs",
                total_steps - first_step,
                TRIAL_MIN_STEPS,
            )
        return None
    return CompileTrial(module, first_step)


class BlockCompile:
    """A run's torch.compile state for the training loop: blocks compiled at setup ("on"),
    left eager ("off"), or compiled on trial (`CompileTrial`, started once the loop knows
    its first step)."""

    def __init__(self, mode: str, module: nn.Module) -> None:
        self.mode, self.module, self.trial = mode, module, None
        self.compiled = mode == "on" and compile_blocks(module) > 0
        self.param = "trial" if mode == "trial" else self.compiled  # logged with the run

    def start_trial(self, first_step: int, total_steps: int, rank: int) -> None:
        self.trial = start_trial(self.mode, self.module, first_step, total_steps, rank)

    def eager(self) -> contextlib.AbstractContextManager:
        """Compiled blocks run eagerly inside (evaluations, the export)."""
        on = self.trial.compiled if self.trial else self.compiled
        return torch.compiler.set_stance("force_eager") if on else contextlib.nullcontext()

    def after_step(self, step: int) -> dict[str, float] | None:
        """The trial's measurement, once, at the step it decides; None otherwise."""
        return self.trial.after_step(step) if self.trial else None

    def close(self) -> None:
        if self.trial:
            self.trial.close()
