"""How loader workers start, and when a split is read without any.

A training process runs threads beside its main one (MLflow's tracking and system metrics,
the collectives' transport). Forking it while one of them holds a lock leaves the child waiting
on that lock forever: seen once here as an in-training evaluation whose worker was parked on a
futex inside os.fork under ZeRO-3. So loaders that start inside a training run take their
workers from a fork server (IN_TRAINING_START): a clean single-threaded process that imports
the entry script (without running it) and our readers once per training process, and forks the
workers from there. Splits of at most IN_PROCESS_SAMPLES samples are read in the training
process itself instead, which is quicker than starting any worker.
"""

from __future__ import annotations

import multiprocessing as mp

IN_TRAINING_START = "forkserver" if "forkserver" in mp.get_all_start_methods() else None
IN_PROCESS_SAMPLES = 20_000  # Fashion-MNIST's test split (10k) decodes in about half a second


def worker_context(name: str | None) -> mp.context.BaseContext:
    """The multiprocessing context `name` (None: the platform's default)."""
    ctx = mp.get_context(name)
    if name == "forkserver":  # __main__ first: a worker that finds it imported skips doing so
        ctx.set_forkserver_preload(["__main__", "ssl_vit.data.datasets"])
    return ctx
