"""How loader workers start, and when a split is read without any.

Loaders that start inside a training run take their workers from a fork server
(IN_TRAINING_START), never as forks of the threaded training process, which could leave a
child waiting forever on a lock one of its threads held. `worker_context` gives a loader its
multiprocessing context and starts the fork server and multiprocessing's resource tracker with
JOB_SIGNALS blocked, so that the workers go on feeding the ranks until a stop signal stops the
run at a step boundary; daemonic workers still running at exit are killed. Splits of at most
IN_PROCESS_SAMPLES samples are read in the training process itself, without workers.

Why, in full: docs/streaming.md#workers-and-shared-memory.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import signal

from ssl_vit.config import STOP_SIGNALS

IN_TRAINING_START = "forkserver" if "forkserver" in mp.get_all_start_methods() else None
IN_PROCESS_SAMPLES = 20_000  # read without workers up to here: Fashion-MNIST's test split (10k)
JOB_SIGNALS = tuple(signal.Signals[name] for name in STOP_SIGNALS)  # run.stop_signals' choices


def worker_context(name: str | None, workers: int = 0) -> mp.context.BaseContext:
    """The multiprocessing context `name` (None: the platform's default). A fork server for
    `workers` > 0 is started now, deaf to JOB_SIGNALS (the module doc)."""
    ctx = mp.get_context(name)
    if name == "forkserver":  # __main__ first: a worker that finds it imported skips doing so
        ctx.set_forkserver_preload(["__main__", "ssl_vit.data.stream"])
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
