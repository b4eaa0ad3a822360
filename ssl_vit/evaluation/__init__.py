"""Evaluators on frozen features: kNN (FAISS, from ssl_vit.knn), few-shot ridge, linear probe;
results reporting.

The names load on first use (PEP 562): the entry scripts import `ssl_vit.evaluation.options`
and `.cli` to parse their arguments, which must not load torch and FAISS on the way.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "knn_eval": "ssl_vit.knn",
    "knn_vote": "ssl_vit.knn",
    "map_at_r": "ssl_vit.knn",
    "recall_at_k": "ssl_vit.knn",
    "fewshot_eval": "fewshot",
    "ridge_fit": "fewshot",
    "linear_probe_eval": "linear_probe",
    "mae_probe_eval": "linear_probe",
    "format_table": "report",
    "log_to_mlflow": "report",
    "write_results": "report",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _WHERE[name]
    module = where if "." in where else f"{__name__}.{where}"  # kNN lives below, in ssl_vit.knn
    return getattr(importlib.import_module(module), name)
