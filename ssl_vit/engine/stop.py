"""Stopping a run on a signal: every rank at the same step, with a checkpoint, to go on later.

A scheduler's signal (SLURM's SIGTERM, a `--signal=USR1@300` ahead of the time limit) reaches
some ranks, or all at slightly different moments, anywhere in a step. So `StopSignals` only
notes the signals of `run.stop_signals`, and `agreed()`, called by every rank at each step
boundary, makes them agree: a MAX all-reduce of one integer over the CPU group, started at one
boundary and read at the next, so that it costs the step nothing. The trainer then checkpoints
at that step, ends the MLflow run as KILLED and raises `Stopped`; the entry script exits with
STOPPED_EXIT, and running the same command again resumes.

When a run stops, what it leaves and how each launcher passes the signal on:
docs/training.md#stopping-on-a-signal.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ssl_vit.engine.distributed import cpu_group

# The exit code of a run stopped on a signal, with its checkpoint written. Not 0: the run is not
# finished, and a scheduler's accounting or a CI job must not record it as done. Not 1-3 (our
# errors: ssl_vit/engine/cli.py) and below 126, so that it never reads as a shell's "not found"
# or 128+N "killed by signal N", which is what a stop without a checkpoint looks like. 124 is
# what timeout(1) reports for a command it stopped at its time limit, the commonest reason for
# this stop too (`timeout 2h python pipelines/mpp_pretrain.py ...` stops it with SIGTERM).
STOPPED_EXIT = 124


class Stopped(Exception):
    """The run stopped on a signal at a step boundary, checkpointed; a rerun goes on from it."""

    def __init__(self, signal_name: str, step: int, checkpoint: str) -> None:
        super().__init__(
            f"stopped by {signal_name} at step {step}; checkpoint {checkpoint}: run the same "
            "command again to go on from it"
        )
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class StopSignals:
    """While entered, the signals named (e.g. ["SIGTERM", "SIGUSR1"]) are noted instead of
    ending the process; `agreed()`, called by every rank at every step boundary, says when to
    stop. An empty list changes nothing and `agreed()` is always None (the config is the same
    on every rank, so none of them starts a reduction)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.signals = [signal.Signals[name] for name in names]
        self.received = 0  # the first signal this rank got (its number), 0 for none
        self.stopped_by: str | None = None  # set by `agreed` on every rank at once
        self._previous: dict[signal.Signals, Any] = {}
        self._sent: torch.Tensor | None = None
        self._work: Any = None  # the reduction in flight since the last boundary

    def __enter__(self) -> StopSignals:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, exc_type: type | None, *_: Any) -> None:
        for sig, handler in self._previous.items():  # None: one not set from Python
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()
        if exc_type is None and self._work is not None:
            self._work.wait()  # every rank started it: it completes; after an error it may not

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # Only a note: the step in progress, a checkpoint being written, a collective all go on.
        self.received = self.received or signum

    def agreed(self) -> str | None:
        """The signal some rank received (the same name on every rank, at the same call), or
        None to go on. Every rank calls this at every step boundary until it answers."""
        if not self.signals or self.stopped_by:
            return self.stopped_by
        if not dist.is_initialized() or dist.get_world_size() == 1:
            seen = self.received
        else:
            seen = 0
            if self._work is not None:  # started at the last boundary: long done by now
                self._work.wait()
                seen = int(self._sent.item())  # type: ignore[union-attr]
            self._work = None
            if not seen:
                self._sent = torch.tensor([self.received], dtype=torch.int64)
                self._work = dist.all_reduce(
                    self._sent, op=dist.ReduceOp.MAX, group=cpu_group(), async_op=True
                )
        self.stopped_by = signal.Signals(seen).name if seen else None
        return self.stopped_by
