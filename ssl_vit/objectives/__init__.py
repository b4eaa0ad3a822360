"""Training objectives (contract 3): nn.Modules called as `objective(images01, labels)` ->
`(loss, metrics)`, each with a `.backbone`.

- "mpp": MaskedPatchPrediction (paper sec. 4.6), ssl_vit.objectives.mpp
- "supervised": SupervisedObjective (sec. 4.1), ssl_vit.objectives.supervised
- "joint": JointObjective, loss = mpp_weight * MPP + sup_weight * supervised
- "finetune": SupervisedObjective with the zero-initialised linear head (appendix B.1.1)
- "cascade": CascadeObjective, a Dynamic ViT cascade (sum of the stages' cross-entropies),
  ssl_vit.objectives.cascade

Weight decay: `param_groups(objective, weight_decay)` gives the optimizer's two groups.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ssl_vit.objectives.cascade import CascadeObjective
from ssl_vit.objectives.mpp import MaskedPatchPrediction, MPPPrediction
from ssl_vit.objectives.param_groups import no_weight_decay_names, param_groups
from ssl_vit.objectives.supervised import JointObjective, SupervisedObjective

__all__ = [
    "build_objective",
    "MaskedPatchPrediction",
    "MPPPrediction",
    "SupervisedObjective",
    "JointObjective",
    "CascadeObjective",
    "param_groups",
    "no_weight_decay_names",
    "OBJECTIVES",
]

OBJECTIVES = ("mpp", "supervised", "joint", "finetune", "cascade")


def _keywords(cls: type) -> set[str]:
    return {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "backbone")}


def _split(cls: type, cfg: dict[str, Any]) -> dict[str, Any]:
    keys = _keywords(cls)
    return {k: v for k, v in cfg.items() if k in keys}


def build_objective(kind: str, backbone: nn.Module, **cfg: Any) -> nn.Module:
    """Build an objective by name with the paper's defaults for anything not in `cfg`.

    mpp: mean, std (required); corrupt_ratio=0.5, mask_prob=0.8, random_prob=0.1,
        target="mean_color", bits=3, downsize=4, normalize_pixels=False, head_hidden=None.
    supervised: num_classes, mean, std (required); label_smoothing=0.0, head_hidden=None.
    joint: the union of both, plus mpp_weight=1.0, sup_weight=1.0 (head_hidden goes to both).
    finetune: as supervised, with the zero-initialised linear head (appendix B.1.1).
    cascade: num_classes, mean, std (required); coarse_sizes=(14, 28), feature_reuse=True,
        relation_reuse=True, label_smoothing=0.0 (a CascadeViT around the backbone).
    """
    if kind not in OBJECTIVES:
        raise ValueError(f"objective {kind!r}: choose one of {OBJECTIVES}")
    known = _keywords(MaskedPatchPrediction) | _keywords(SupervisedObjective)
    if kind == "joint":
        known |= {"mpp_weight", "sup_weight"}
    elif kind == "mpp":
        known = _keywords(MaskedPatchPrediction)
    elif kind == "cascade":
        known = _keywords(CascadeObjective)
    else:
        known = _keywords(SupervisedObjective)
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"objective {kind!r}: unknown option(s) {unknown}; known: {sorted(known)}")
    try:
        if kind == "mpp":
            return MaskedPatchPrediction(backbone, **cfg)
        if kind == "supervised":
            return SupervisedObjective(backbone, **cfg)
        if kind == "finetune":
            return SupervisedObjective(backbone, **{"head": "linear", **cfg})
        if kind == "cascade":
            return CascadeObjective(backbone, **cfg)
        weights = {k: cfg[k] for k in ("mpp_weight", "sup_weight") if k in cfg}
        return JointObjective(
            MaskedPatchPrediction(backbone, **_split(MaskedPatchPrediction, cfg)),
            SupervisedObjective(backbone, **_split(SupervisedObjective, cfg)),
            **weights,
        )
    except TypeError as e:  # a missing required option, e.g. num_classes
        raise ValueError(f"objective {kind!r}: {e}") from e
