"""The evaluators' choices and defaults, importable without torch.

The evals/*.py scripts build their argument parsers from these, so `--help` and a bad argument
answer before torch, timm or FAISS load (seconds); the evaluators import them from here too.
"""

from __future__ import annotations

# The read-outs, the feature cache and kNN belong below the evaluators.
from ssl_vit.feature_options import DEFAULT_CACHE_DIR, DEFAULT_KS, DEFAULT_T, INDEX_KINDS, POOLS

__all__ = [
    "POOLS",
    "DEFAULT_CACHE_DIR",
    "DEFAULT_KS",
    "DEFAULT_T",
    "INDEX_KINDS",
    "DEFAULT_SHOTS",
    "DEFAULT_L2_GRID",
    "DEFAULT_LR_GRID",
]

DEFAULT_SHOTS = (1, 5, 10, 25)  # few-shot examples per class (ViT paper, sec. 4.1)

# Linear probe: L2 strengths (L-BFGS) / weight decays (AdamW), and AdamW learning rates
DEFAULT_L2_GRID = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
DEFAULT_LR_GRID = (1e-3, 1e-2)
