"""Process start-up and exit without the cyclic garbage collector walking what was imported.

Importing torch, timm, DeepSpeed and MLflow creates millions of long-lived Python objects, and
CPython's collector walks all of them at each full collection: several times while they load and
once more when the interpreter exits. None of it is garbage. Measured on 2 CPU cores (Python
3.11, a tiny 24-step training process): 13.7 s from launch to exit by default, 11.3 s with the
heap frozen at exit (the final collection alone took 2.4 s), 10.4 s with collection also paused
while the modules load.

So an entry script's `__main__` block calls `begin()` before it loads the heavy modules, and the
job calls `ready()` where its real work starts: what is loaded by then is frozen out of later
collections (`gc.freeze`) and collection resumes, so a long run still frees the reference cycles
it makes. Both are no-ops in a process that did not call `begin()` (the library imported by a
user's program or by the tests keeps the collector as it found it).
"""

from __future__ import annotations

import atexit
import gc

__all__ = ["begin", "ready"]

_paused = False
_resumed = False  # ready() ran: the process is past its start-up


def begin() -> None:
    """Pause cyclic collection while the modules load; freeze the heap at interpreter exit.

    Call from an entry script's `__main__` block only: it changes the whole process."""
    global _paused
    if _paused or _resumed or not gc.isenabled():
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
