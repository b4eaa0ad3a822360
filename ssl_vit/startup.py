"""What an entry script does before it loads the heavy libraries.

1. MLflow's usage telemetry is off unless the user turns it on (MLFLOW_DISABLE_TELEMETRY=false
   opts back in): a job of ours should not talk to a third party its user did not name. It is
   set before MLflow is imported (DeepSpeed imports it), since MLflow reads it then.

2. No cyclic garbage collection over what the imports load: none of the millions of objects
   torch, timm, DeepSpeed and MLflow create is garbage. An entry script's `__main__` calls
   `begin()` before it loads them and the job calls `ready()` where its real work starts: what is
   loaded by then is frozen out of later collections (`gc.freeze`) and collection resumes. Both
   are no-ops in a process that did not call `begin()` (a user's program, the tests).

Why, what it saves and what it costs: docs/training.md, "Start-up".
"""

from __future__ import annotations

import atexit
import gc
import os

__all__ = ["begin", "ready"]

_paused = False
_resumed = False  # ready() ran: the process is past its start-up


def begin(pause_gc: bool = True) -> None:
    """MLflow telemetry off by default; with `pause_gc`, pause cyclic collection while the
    modules load and freeze the heap at interpreter exit (then call `ready()`).

    Call from an entry script's `__main__` block only: it changes the whole process."""
    global _paused
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    if not pause_gc or _paused or _resumed or not gc.isenabled():
        return
    gc.disable()
    _paused = True
    # Registered first, so it runs after every later atexit handler, just before the
    # interpreter's final collection, which then has nothing left to walk.
    atexit.register(gc.freeze)


def ready() -> None:
    """Loading is over: freeze what is loaded and resume collection (only after `begin()`)."""
    global _paused, _resumed
    if not _paused:
        return
    gc.freeze()
    gc.enable()
    _paused, _resumed = False, True
