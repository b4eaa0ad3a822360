"""The MPP recipe of the ViT paper (sec. 4.6, appendix B.1.2), defined once (torch-free).

The config's defaults, the objective's defaults, the corruption draw, the targets, the plots
and the docs all read these. Changing a number here changes it everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["CorruptionKind", "MPPRecipe", "MPP", "TARGETS"]

# Prediction targets of MPP (appendix B.1.2): the 3-bit mean colour (the paper's choice), the
# 4x4-downsized patch in 3-bit colour (parallel predictions), or the full patch (L2).
TARGETS = ("mean_color", "downsized_color", "pixels")


class CorruptionKind(IntEnum):
    """What happened to a corrupted patch's embedding (BERT's three kinds); the value is the
    int64 code in `Corruption.kinds`."""

    MASK = 0  # replaced by the learnable [mask] embedding
    RANDOM = 1  # replaced by another patch's embedding of the same image
    KEPT = 2  # left unchanged

    @property
    def key(self) -> str:
        """Metric suffix: mpp/acc_mask, mpp/acc_random, mpp/acc_kept."""
        return self.name.lower()

    @property
    def label(self) -> str:
        """Legend text of the plots."""
        return ("[mask]", "random patch", "kept")[self]


@dataclass(frozen=True)
class MPPRecipe:
    """The numbers of the paper's MPP: corrupt 50% of the patch embeddings, of those 80% to
    [mask], 10% to another patch, 10% kept (BERT), predict the 3-bit mean colour."""

    corrupt_ratio: float = 0.5  # share of patches corrupted per image (sec. 4.6)
    mask_prob: float = 0.8  # of the corrupted: [mask] embedding (B.1.2)
    random_prob: float = 0.1  # of the corrupted: another patch's embedding
    target: str = "mean_color"  # one of TARGETS
    bits: int = 3  # colour bits per channel of the targets: 512 classes for RGB, 8 for gray
    downsize: int = 4  # side of the downsized patch for target="downsized_color"


MPP = MPPRecipe()
