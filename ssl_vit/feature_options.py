"""The read-outs a frozen backbone's features can take and where extracted features are cached:
the choices of ssl_vit.readout and ssl_vit.features, importable without torch (the evaluators'
argument parsers offer them, ssl_vit.evaluation.options)."""

from __future__ import annotations

# Read-outs of a backbone (ssl_vit.readout). auto: [class] when the pretraining trained it, else
# mean (ssl_vit.features.resolve_pool); tokens: the patch tokens concatenated in grid order,
# (B, N*D): the spatial layout kept.
POOLS = ("auto", "cls", "mean", "lastn", "tokens")
DEFAULT_CACHE_DIR = ".cache/features"  # ssl_vit.features: extracted features, by identity
