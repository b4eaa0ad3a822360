"""The choices of the tools on frozen features below the evaluators, importable without torch:
the read-outs (ssl_vit.readout), the feature cache (ssl_vit.features) and kNN's protocol
(ssl_vit.knn). The evaluators' argument parsers offer them (ssl_vit.evaluation.options)."""

from __future__ import annotations

# Read-outs of a backbone (ssl_vit.readout). auto: [class] when the pretraining trained it, else
# mean (ssl_vit.features.resolve_pool); tokens: the patch tokens concatenated in grid order,
# (B, N*D): the spatial layout kept.
POOLS = ("auto", "cls", "mean", "lastn", "tokens")
DEFAULT_CACHE_DIR = ".cache/features"  # ssl_vit.features: extracted features, by identity

# kNN (DINO's protocol, ssl_vit.knn): neighbour counts, vote temperature, FAISS index kinds
DEFAULT_KS = (10, 20, 100, 200)
DEFAULT_T = 0.07
INDEX_KINDS = ("flat", "ivf", "hnsw")
