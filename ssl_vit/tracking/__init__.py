"""MLflow tracking on rank 0 that an unreachable store never stalls (`tracker`), and the command
`python -m ssl_vit.tracking replay|register` (`cli`), a run's export registered as a model
version (`tracker.register_export`). Backbones by MLflow URI: ssl_vit.registry."""

from ssl_vit.tracking.cli import main
from ssl_vit.tracking.tracker import DEFAULT_URI, MAX_PARAM_LEN, PARENT_TAG, Tracker, flatten

__all__ = ["DEFAULT_URI", "MAX_PARAM_LEN", "PARENT_TAG", "Tracker", "flatten", "main"]
