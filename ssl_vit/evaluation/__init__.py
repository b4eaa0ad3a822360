"""Evaluators on frozen features: kNN (FAISS), few-shot ridge, linear probe; results reporting."""

from ssl_vit.evaluation.fewshot import fewshot_eval, ridge_fit
from ssl_vit.evaluation.knn import knn_eval, knn_vote, map_at_r, recall_at_k
from ssl_vit.evaluation.linear_probe import linear_probe_eval, mae_probe_eval
from ssl_vit.evaluation.report import format_table, log_to_mlflow, write_results

__all__ = [
    "knn_eval",
    "knn_vote",
    "map_at_r",
    "recall_at_k",
    "fewshot_eval",
    "ridge_fit",
    "linear_probe_eval",
    "mae_probe_eval",
    "format_table",
    "log_to_mlflow",
    "write_results",
]
