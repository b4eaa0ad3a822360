"""How loader workers start, and when a split is read without any.

A training process runs threads beside its main one (MLflow's tracking and system metrics,
the collectives' transport). Forking it while one of them holds a lock leaves the child waiting
on that lock forever: seen once here as an in-training evaluation whose worker was parked on a
futex inside os.fork under ZeRO-3. So loaders that start inside a training run take their
workers from a fork server (IN_TRAINING_START): a clean single-threaded process that imports
the entry script (without running it) and our readers once per training process, and forks the
workers from there. Splits of at most IN_PROCESS_SAMPLES samples are read in the training
process itself instead, which is quicker than starting any worker.

A scheduler's signal goes to every process of a job (SLURM's SIGTERM at preemption, the SIGUSR1
asked for ahead of the time limit; torchrun forwards to a rank's whole process group), the
workers and their fork server included. The training process stops on it at a step boundary
(ssl_vit/engine/stop.py), reading batches until then; a worker or fork server that died of it
would end that stream with an error first. So the fork server, and multiprocessing's resource
tracker beside it, start with JOB_SIGNALS blocked, and every worker forked from the server
inherits that. They end when the training process ends, as always: its DataLoaders tell them
to, and at exit the daemonic ones still running are killed (multiprocessing would send them
the SIGTERM they block, then wait for them forever).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import signal

from ssl_vit.config import STOP_SIGNALS

IN_TRAINING_START = "forkserver" if "forkserver" in mp.get_all_start_methods() else None
IN_PROCESS_SAMPLES = 20_000  # Fashion-MNIST's test split (10k) decodes in about half a second
JOB_SIGNALS = tuple(signal.Signals[name] for name in STOP_SIGNALS)  # run.stop_signals' choices


def worker_context(name: str | None, workers: int = 0) -> mp.context.BaseContext:
    """The multiprocessing context `name` (None: the platform's default). A fork server for
    `workers` > 0 is started now, deaf to JOB_SIGNALS (see the module docstring)."""
    ctx = mp.get_context(name)
    if name == "forkserver":  # __main__ first: a worker that finds it imported skips doing so
        ctx.set_forkserver_preload(["__main__", "ssl_vit.data.datasets"])
        # A blocked signal stays blocked across fork and exec: both helpers inherit the mask
        # this thread has while it starts them (each starts once per process; later calls
        # find them running). The tracker unblocks SIGINT and SIGTERM here after starting
        # (it ignores them itself), hence the second block.
        before = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
        try:
            multiprocessing.resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
            if workers > 0:
                multiprocessing.forkserver.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        # after multiprocessing's own exit hook in registration, so before it at exit
        atexit.unregister(_kill_workers_left)
        atexit.register(_kill_workers_left)
    return ctx


def _kill_workers_left() -> None:
    for child in mp.active_children():
        if child.daemon:  # a loader worker: nothing of it outlives the training process
            child.kill()
