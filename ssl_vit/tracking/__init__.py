"""MLflow tracking on rank 0, tolerant of an unreachable server.

    from ssl_vit.tracking import Tracker         # Tracker(enabled=rank == 0, experiment=...)
    python -m ssl_vit.tracking replay SPOOL_DIR [--tracking-uri URI]

Modules: `tracker` (the Tracker, and the whole contract: outages, spooling, resume without
duplicates, system metrics), `store` (the MLflow client side: the run, sending events, outage
versus rejection), `spool` (the on-disk spool of events the store did not take, and its replay),
`cli` (the replay command; `__main__` runs it).
"""

from ssl_vit.tracking.cli import main
from ssl_vit.tracking.spool import COPY_LIMIT, replay_file
from ssl_vit.tracking.store import DEFAULT_URI, MAX_METRICS, MAX_PARAMS
from ssl_vit.tracking.tracker import MAX_PARAM_LEN, Tracker, flatten

__all__ = [
    "COPY_LIMIT",
    "DEFAULT_URI",
    "MAX_METRICS",
    "MAX_PARAMS",
    "MAX_PARAM_LEN",
    "Tracker",
    "flatten",
    "main",
    "replay_file",
]
