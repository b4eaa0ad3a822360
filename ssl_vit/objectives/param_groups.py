"""Weight-decay parameter groups for the optimizer.

Decay applies to weight matrices only; biases, norm scales, position embeddings, [class] /
register tokens and the MPP [mask] embedding are exempt (the usual ViT practice; the paper's
high weight decay, appendix B.1, is meant for the weights).
"""

from __future__ import annotations

from torch import nn

__all__ = ["no_weight_decay_names", "param_groups"]

_TOKEN_NAMES = ("pos_embed", "cls_token", "reg_token", "dist_token", "mask_token")


def no_weight_decay_names(module: nn.Module) -> set[str]:
    """Names of trainable parameters of `module` that get no weight decay."""
    declared = set(getattr(module, "no_weight_decay", set)())
    out = set()
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim <= 1 or name in declared or leaf in _TOKEN_NAMES:
            out.add(name)
    return out


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups: [{"params": decayed, "weight_decay": wd}, {"params": rest, 0.0}].

    Pass the objective (not only the backbone) so the heads and the mask token are included.
    """
    skip = no_weight_decay_names(module)
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (no_decay if name in skip else decay).append(p)
    return [
        {"params": decay, "weight_decay": float(weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
    ]
