"""Training objectives: nn.Modules called as `objective(images01, labels)` ->
`(loss, metrics)`, each with a `.backbone`.

- "mpp": MaskedPatchPrediction (paper sec. 4.6), ssl_vit.objectives.mpp
- "supervised": SupervisedObjective (sec. 4.1), ssl_vit.objectives.supervised
- "joint": JointObjective, loss = mpp_weight * MPP + supervised_weight * supervised
- "finetune": SupervisedObjective with the zero-initialised linear head (appendix B.1.1)
- "cascade": CascadeObjective, a Dynamic ViT cascade (sum of the stages' cross-entropies),
  ssl_vit.objectives.cascade

Weight decay: `param_groups(objective, weight_decay)` gives the optimizer's two groups.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ssl_vit.config import OBJECTIVE_KINDS
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
    "objective_options",
]


def _joint(backbone: nn.Module, **cfg: Any) -> JointObjective:
    weights = {k: cfg.pop(k) for k in ("mpp_weight", "supervised_weight") if k in cfg}
    return JointObjective(
        MaskedPatchPrediction(backbone, **_split(MaskedPatchPrediction, cfg)),
        SupervisedObjective(backbone, **_split(SupervisedObjective, cfg)),
        **weights,
    )


def _finetune(backbone: nn.Module, **cfg: Any) -> SupervisedObjective:
    return SupervisedObjective(backbone, **{"head": "linear", **cfg})


# The registry: kind -> (builder, the classes whose keyword arguments are its options). A new
# objective is one line here and its name in ssl_vit.config.OBJECTIVE_KINDS (which validation
# reads without importing torch).
OBJECTIVES: dict[str, tuple[Callable[..., nn.Module], tuple[Any, ...]]] = {
    "mpp": (MaskedPatchPrediction, (MaskedPatchPrediction,)),
    "supervised": (SupervisedObjective, (SupervisedObjective,)),
    "joint": (_joint, (MaskedPatchPrediction, SupervisedObjective, JointObjective)),
    "finetune": (_finetune, (SupervisedObjective,)),
    "cascade": (CascadeObjective, (CascadeObjective,)),
}
if tuple(OBJECTIVES) != OBJECTIVE_KINDS:
    raise ImportError(
        f"ssl_vit.objectives registers {tuple(OBJECTIVES)} but ssl_vit.config.OBJECTIVE_KINDS "
        f"is {OBJECTIVE_KINDS}; name each objective in both"
    )


def _keywords(cls: type) -> set[str]:
    skip = ("self", "backbone", "mpp", "supervised")
    return {p for p in inspect.signature(cls.__init__).parameters if p not in skip}


def _split(cls: type, cfg: dict[str, Any]) -> dict[str, Any]:
    keys = _keywords(cls)
    return {k: v for k, v in cfg.items() if k in keys}


def objective_options(kind: str) -> set[str]:
    """The option names the objective `kind` takes (besides the backbone)."""
    if kind not in OBJECTIVES:
        raise ValueError(f"objective {kind!r}: choose one of {tuple(OBJECTIVES)}")
    return set().union(*(_keywords(c) for c in OBJECTIVES[kind][1]))


def build_objective(kind: str, backbone: nn.Module, **cfg: Any) -> nn.Module:
    """Build an objective by name with the paper's defaults (ssl_vit.recipe) for anything not
    in `cfg`.

    mpp: mean, std (required); the `MaskedPatchPrediction` options.
    supervised: num_classes, mean, std (required); label_smoothing=0.0, head_hidden=None.
    joint: the union of both, plus mpp_weight=1.0, supervised_weight=1.0.
    finetune: as supervised, with the zero-initialised linear head (appendix B.1.1).
    cascade: num_classes, mean, std (required); coarse_sizes=(14, 28), feature_reuse=True,
        relation_reuse=True, label_smoothing=0.0 (a CascadeViT around the backbone).
    """
    known = objective_options(kind)
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"objective {kind!r}: unknown option(s) {unknown}; known: {sorted(known)}")
    try:
        return OBJECTIVES[kind][0](backbone, **cfg)
    except TypeError as e:  # a missing required option, e.g. num_classes
        raise ValueError(f"objective {kind!r}: {e}") from e
