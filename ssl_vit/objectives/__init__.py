"""Training objectives: nn.Modules called as `objective(images01, labels)` -> `(loss, metrics)`,
each with a `.backbone`.

- "mpp": MaskedPatchPrediction (paper sec. 4.6), ssl_vit.objectives.mpp
- "supervised": SupervisedObjective (sec. 4.1), ssl_vit.objectives.supervised
- "joint": JointObjective, loss = mpp_weight * MPP + supervised_weight * supervised
- "finetune": SupervisedObjective with the zero-initialised linear head (appendix B.1.1)
- "cascade": CascadeObjective, a Dynamic ViT cascade (sum of the stages' cross-entropies),
  ssl_vit.objectives.cascade

`options_from_config` maps the `objective.*` config keys to one kind's options; `build_objective`
builds it. Weight decay: `param_groups(objective, weight_decay)` gives the optimizer's two groups.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from timm.optim import param_groups_weight_decay
from torch import nn

from ssl_vit.config import OBJECTIVE_KINDS, ObjectiveConfig
from ssl_vit.objectives.mpp import MaskedPatchPrediction, MPPPrediction
from ssl_vit.objectives.supervised import JointObjective, SupervisedObjective

__all__ = [
    "build_objective",
    "options_from_config",
    "MaskedPatchPrediction",
    "MPPPrediction",
    "SupervisedObjective",
    "JointObjective",
    "param_groups",
    "no_weight_decay_names",
    "OBJECTIVES",
    "OPTIONS",
]


def _keywords(cls: type) -> tuple[str, ...]:
    """The keyword options of an objective class besides the input normalisation (mean, std):
    its signature is their one declaration."""
    params = inspect.signature(cls.__init__).parameters.values()
    return tuple(
        p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in ("mean", "std")
    )


MPP_OPTIONS = _keywords(MaskedPatchPrediction)
SUPERVISED_OPTIONS = _keywords(SupervisedObjective)
# Cascade is loaded by name only when it runs (MPP pretraining never imports it): named here.
CASCADE_OPTIONS = (
    "num_classes",
    "coarse_sizes",
    "feature_reuse",
    "relation_reuse",
    "label_smoothing",
)
OPTIONS: dict[str, tuple[str, ...]] = {
    "mpp": MPP_OPTIONS,
    "supervised": SUPERVISED_OPTIONS,
    "joint": (*MPP_OPTIONS, *SUPERVISED_OPTIONS, "mpp_weight", "supervised_weight"),
    "finetune": SUPERVISED_OPTIONS,
    "cascade": CASCADE_OPTIONS,
}


def options_from_config(o: ObjectiveConfig, *, in_chans: int, num_classes: int | None) -> dict:
    """The `objective.*` config keys (and the data's channels and classes) as the options of
    the objective `o.kind`: what `build_objective` takes and the export records."""
    config_keys = {f.name for f in dataclasses.fields(o)}

    def given(names: tuple[str, ...]) -> dict:  # the options a config key of that name sets
        return {k: getattr(o, k) for k in names if k in config_keys}

    mpp = {"in_chans": in_chans, **given(MPP_OPTIONS)}
    supervised = {"num_classes": num_classes, **given(SUPERVISED_OPTIONS)}
    if o.kind == "mpp":
        return mpp
    if o.kind in ("supervised", "finetune"):
        return supervised
    if o.kind == "joint":
        return {**mpp, **supervised, **given(("mpp_weight", "supervised_weight"))}
    return {  # cascade: the coarser stages' image sizes (the finest is model.img_size)
        **supervised,
        "coarse_sizes": [int(s) for s in o.cascade_sizes],
        "feature_reuse": o.feature_reuse,
        "relation_reuse": o.relation_reuse,
    }


def _joint(
    backbone: nn.Module, mpp_weight: float = 1.0, supervised_weight: float = 1.0, **options: Any
) -> JointObjective:
    mean, std = options.pop("mean"), options.pop("std")
    mpp = {k: v for k, v in options.items() if k in MPP_OPTIONS}
    supervised = {k: v for k, v in options.items() if k in SUPERVISED_OPTIONS}
    return JointObjective(
        MaskedPatchPrediction(backbone, mean=mean, std=std, **mpp),
        SupervisedObjective(backbone, mean=mean, std=std, **supervised),
        mpp_weight=mpp_weight,
        supervised_weight=supervised_weight,
    )


def _finetune(backbone: nn.Module, **options: Any) -> SupervisedObjective:
    return SupervisedObjective(backbone, **{"head": "linear", **options})


# kind -> builder, or "module:name" of a builder imported only when that kind is built: MPP
# pretraining never loads the cascade (and the Dynamic ViT model under it). A new objective is
# one line here, its options in OPTIONS and its name in ssl_vit.config.OBJECTIVE_KINDS (which
# validation reads without importing torch).
OBJECTIVES: dict[str, Callable[..., nn.Module] | str] = {
    "mpp": MaskedPatchPrediction,
    "supervised": SupervisedObjective,
    "joint": _joint,
    "finetune": _finetune,
    "cascade": "ssl_vit.objectives.cascade:CascadeObjective",
}
if tuple(OBJECTIVES) != OBJECTIVE_KINDS:
    raise ImportError(
        f"ssl_vit.objectives registers {tuple(OBJECTIVES)} but ssl_vit.config.OBJECTIVE_KINDS "
        f"is {OBJECTIVE_KINDS}; name each objective in both"
    )


def _builder(kind: str) -> Callable[..., nn.Module]:
    builder = OBJECTIVES[kind]
    if isinstance(builder, str):
        module, name = builder.split(":")
        builder = getattr(importlib.import_module(module), name)
    return builder


def build_objective(kind: str, backbone: nn.Module, **options: Any) -> nn.Module:
    """Build an objective by name with the paper's defaults (ssl_vit.recipe) for any option not
    given; every kind needs the input normalisation `mean` and `std`, and takes `OPTIONS[kind]`.

    mpp: the `MaskedPatchPrediction` options.
    supervised: num_classes (required); label_smoothing=0.0, head_hidden=None.
    joint: the union of both, plus mpp_weight=1.0, supervised_weight=1.0.
    finetune: as supervised, with the zero-initialised linear head (appendix B.1.1).
    cascade: num_classes (required); coarse_sizes=(14, 28), feature_reuse=True,
        relation_reuse=True, label_smoothing=0.0 (a CascadeViT around the backbone).
    """
    if kind not in OBJECTIVES:
        raise ValueError(f"objective {kind!r}: choose one of {tuple(OBJECTIVES)}")
    unknown = sorted(set(options) - {"mean", "std", *OPTIONS[kind]})
    if unknown:
        raise ValueError(f"objective {kind!r}: unknown option(s) {unknown}; known: {OPTIONS[kind]}")
    try:
        return _builder(kind)(backbone, **options)
    except TypeError as e:  # a missing required option, e.g. num_classes
        raise ValueError(f"objective {kind!r}: {e}") from e


# Exempt from weight decay besides biases and norm scales (ndim <= 1): position embeddings and
# special tokens (the usual ViT practice; the paper's high weight decay, appendix B.1, is meant
# for the weights).
_TOKEN_NAMES = ("pos_embed", "cls_token", "reg_token", "dist_token", "mask_token")


def no_weight_decay_names(module: nn.Module) -> set[str]:
    """Names of trainable parameters of `module` that get no weight decay."""
    declared = set(getattr(module, "no_weight_decay", set)())
    return {
        name
        for name, p in module.named_parameters()
        if p.requires_grad
        and (p.ndim <= 1 or name in declared or name.rsplit(".", 1)[-1] in _TOKEN_NAMES)
    }


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups, decayed first: [{"params": decayed, "weight_decay": wd},
    {"params": rest, "weight_decay": 0.0}] (timm's split, with our exemptions).

    Pass the objective (not only the backbone) so the heads and the mask token are included.
    """
    exempt = no_weight_decay_names(module)
    # Split as if decayed (timm puts everything in one group when weight_decay is 0), so the
    # groups, and the optimizer state a checkpoint holds, do not depend on the value.
    groups = param_groups_weight_decay(module, 1.0, no_weight_decay_list=exempt)
    split = {bool(g["weight_decay"]): g["params"] for g in groups}  # timm omits an empty group
    return [
        {"params": split.get(True, []), "weight_decay": float(weight_decay)},
        {"params": split.get(False, []), "weight_decay": 0.0},
    ]
