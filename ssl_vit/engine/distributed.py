"""Ranks working together: process-group set-up under the DeepSpeed launcher, torchrun or plain
`python`; barriers that name the ranks that did not come; small collectives; and stopping every
rank at the same step on a scheduler's signal.

Stopping: a signal (SLURM's SIGTERM, a `--signal=USR1@300` ahead of the time limit) reaches some
ranks, or all at slightly different moments, anywhere in a step. So `StopSignals` only notes the
signals of `run.stop_signals`, and `agreed()`, called by every rank at each step boundary, makes
them agree: a MAX all-reduce of one integer over the CPU group, started at one boundary and read
at the next, so that it costs the step nothing. The trainer then checkpoints at that step, ends
the MLflow run as KILLED and raises `Stopped`; the entry script exits with STOPPED_EXIT, and
running the same command again resumes. What a stopped run leaves and how each launcher passes
the signal on: docs/training.md#stopping-on-a-signal.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ssl_vit.logs import first_line, quiet_prints


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def extensions_dir() -> Path:
    """Where this Python environment builds DeepSpeed's just-in-time ops: TORCH_EXTENSIONS_DIR
    when the user set it, else a folder of torch's default build root for this environment.

    torch's default is one folder per Python version and CUDA, shared by every environment of
    the user; the ninja build in it records its include paths, which differ from one
    environment to the next, so a start in one environment rebuilt the op the other had built
    (DeepSpeed's CPU communication op: over a minute, each time the two alternate)."""
    if user_dir := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(user_dir)
    from torch.utils.cpp_extension import get_default_build_root

    accel = f"cu{torch.version.cuda}" if torch.version.cuda else "cpu"
    if torch.version.hip:
        accel = f"rocm{torch.version.hip}"
    env = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    name = f"py{sys.version_info.major}{sys.version_info.minor}_{accel.replace('.', '')}_{env}"
    return Path(get_default_build_root()) / name


def init_distributed() -> tuple[int, int, int]:
    """Start (or join) the process group; returns (rank, local_rank, world_size).

    A plain `python script.py` has no launcher variables: we make it a world of one on
    127.0.0.1 so the same DeepSpeed code path runs on a laptop and on a cluster. Under a
    launcher (deepspeed, torchrun, one per node or not) the process group is the launcher's:
    RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are all it needs.
    """
    import deepspeed

    # Before DeepSpeed builds its communication op (in init_distributed) or others (at
    # deepspeed.initialize): one build folder per environment (extensions_dir).
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not dist.is_initialized():
        with quiet_prints():  # on a CPU it prints that its communication op was built
            deepspeed.init_distributed(dist_init_required=True, verbose=False)
        _unlink_shm_workspace()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks on one machine share its cores: oversubscribed threads make a step many
        # times slower, so each rank takes its share.
        # ranks on this machine: torchrun sets LOCAL_WORLD_SIZE, the DeepSpeed launcher LOCAL_SIZE
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
        share = max(1, (os.cpu_count() or 1) // max(1, local_world))
        # Only when it changes: setting even the same count again slowed every CPU step down
        # (measured with benchmarks/train_throughput.py; docs/training.md).
        if share != torch.get_num_threads():
            torch.set_num_threads(share)
    return dist.get_rank(), local_rank, dist.get_world_size()


def _unlink_shm_workspace() -> None:
    """DeepSpeed's CPU backend never unlinks its workspace: every CPU launch left 66 MB of RAM
    per rank in /dev/shm until reboot (14 GB here after a day of runs). Once every rank has
    mapped the others' (they do inside init), the names can go: the mappings live on, and a
    killed run leaves nothing behind."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":  # the op is CPU-only
        return
    dist.barrier()  # every rank has mapped every workspace
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    # where DeepSpeed's CPU communication op puts this rank's 66 MB shared-memory workspace
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{dist.get_rank()}"
    Path("/dev/shm", name).unlink(missing_ok=True)


def device_for(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


# Seconds a rank waits at one of our barriers for the others (SSL_VIT_BARRIER_TIMEOUT_S
# overrides): as long as the process group's own timeout (DeepSpeed's 10 minutes), but the
# error names the ranks that did not arrive.
BARRIER_TIMEOUT_S = 600.0
_monitor_group: object | None = None


class BarrierTimeout(RuntimeError):
    """Some ranks never reached a barrier: they died or hang; the message names them."""


def cpu_group() -> object:
    """A gloo group of every rank (the world's own when it is gloo), made by the first call,
    which every rank makes together: collectives of CPU tensors that never wait on a GPU
    stream (the barriers below, the stop agreement of `StopSignals`)."""
    global _monitor_group
    if _monitor_group is None:
        _monitor_group = (
            dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        )
    return _monitor_group


def barrier(what: str = "a barrier") -> None:
    """Wait for every rank, at most BARRIER_TIMEOUT_S; then a one-line BarrierTimeout naming
    the ranks that did not come. Through `cpu_group()`: torch's monitored barrier runs only on
    gloo."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    limit = float(os.environ.get("SSL_VIT_BARRIER_TIMEOUT_S", BARRIER_TIMEOUT_S))
    try:
        dist.monitored_barrier(
            group=cpu_group(), timeout=timedelta(seconds=limit), wait_all_ranks=True
        )
    except RuntimeError as e:
        text = first_line(e, limit=10_000)
        found = re.search(r"[Rr]anks? ([0-9, ]+) failed to pass", text)
        who = f"rank(s) {found.group(1).strip()}" if found else "some rank"
        raise BarrierTimeout(
            f"rank {dist.get_rank()} on {socket.gethostname()}: {who} did not reach {what} "
            f"within {limit:g} s ({text[:200]}); they died or hang: check their logs, then "
            "relaunch (the run resumes from its last checkpoint)"
        ) from None


def shutdown() -> None:
    """Take the process group down once every rank is past its last collective (torch's
    documented teardown); a no-op without one.

    Why before exit: gloo's worker threads drop their last reference to a finished
    collective's tensors after the caller's `wait()` returned, and that decref needs the GIL. A
    process that went straight from a collective to interpreter shutdown left such a thread
    unable to take it, and died with "terminate called without an active exception" (SIGABRT)
    after finishing its work. A destroyed group that nothing else holds joins its threads
    first; so our own reference goes too."""
    global _monitor_group
    if not dist.is_initialized():
        return
    group, _monitor_group = _monitor_group, None
    if group is not None and group is not dist.group.WORLD:
        dist.destroy_process_group(group)
    dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: object, src: int = 0) -> object:
    """Send a small picklable object (a string, a dict of numbers) from `src` to every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: object) -> list:
    """Every rank's `obj` (small and picklable), in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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
            self._work = None

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
