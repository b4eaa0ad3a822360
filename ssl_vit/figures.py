"""Figures beside a run's results: drawn when they can be, never the reason a run fails.

A figure is a convenience next to what a run is for (its export, its metrics, the registered
model). matplotlib may be missing on a GPU node, or raise on an odd font cache or a full disk;
the run then logs one line and goes on to export, upload and register.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec

__all__ = ["optional_figure"]

log = logging.getLogger("ssl_vit.figures")
P = ParamSpec("P")


def optional_figure(
    what: str, draw: Callable[P, Path | None], *args: P.args, **kwargs: P.kwargs
) -> Path | None:
    """`draw(*args, **kwargs)`, or None with one warning when it raises (ImportError too)."""
    try:
        return draw(*args, **kwargs)
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:200]
        log.warning(
            "%s not drawn (%s: %s); the run goes on without it", what, type(e).__name__, first
        )
        return None
