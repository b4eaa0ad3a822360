"""Supervised objective (tanh-MLP head, label smoothing, unlabelled samples) and joint mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.models import build_backbone
from ssl_vit.objectives import (
    JointObjective,
    MaskedPatchPrediction,
    SupervisedObjective,
    build_objective,
    param_groups,
)

TINY = dict(embed_dim=32, depth=1, num_heads=2)


def _backbone(arch="vit_tiny_patch16_224", **kw):
    kw = kw or TINY
    return build_backbone(arch, img_size=28, in_chans=1, patch_size=4, **kw)


def test_loss_is_cross_entropy_of_the_tanh_head_on_the_class_token():
    torch.manual_seed(0)
    sup = SupervisedObjective(_backbone(), num_classes=10, mean=[0.5], std=[0.25])
    assert isinstance(sup.head.act, nn.Tanh)
    images, labels = torch.rand(4, 1, 28, 28), torch.tensor([3, 1, 4, 1])
    loss, metrics = sup(images, labels)
    tokens = sup.backbone.forward_features((images - 0.5) / 0.25)
    logits = sup.head(tokens[:, 0])  # the [class] token (global_pool="token")
    assert torch.allclose(loss, F.cross_entropy(logits, labels), atol=1e-6)
    acc = (logits.argmax(-1) == labels).float().mean()
    assert torch.allclose(metrics["sup/acc"], acc) and metrics["sup/loss"].ndim == 0


def test_label_smoothing_and_unlabelled_samples():
    torch.manual_seed(0)
    sup = SupervisedObjective(
        _backbone(), num_classes=5, mean=[0.5], std=[0.25], label_smoothing=0.1
    )
    images = torch.rand(4, 1, 28, 28)
    labels = torch.tensor([2, -1, 0, -1])
    loss, metrics = sup(images, labels)
    logits = sup.head(sup.features(images))
    want = F.cross_entropy(logits[[0, 2]], labels[[0, 2]], label_smoothing=0.1)
    assert torch.allclose(loss, want, atol=1e-6)  # -1 left out of the mean
    none, m = sup(images, torch.full((4,), -1))
    assert none.item() == 0.0 and m["sup/acc"].item() == 0.0
    none.backward()  # still a graph: a step on an unlabelled batch does not crash


def test_mixer_pools_by_average():
    bb = _backbone("mixer_s16_224", embed_dim=32, num_blocks=1)
    sup = SupervisedObjective(bb, num_classes=3, mean=[0.5], std=[0.25])
    loss, _ = sup(torch.rand(2, 1, 28, 28), torch.tensor([0, 2]))
    loss.backward()
    assert bb.stem.proj.weight.grad.abs().sum() > 0


def test_joint_is_the_weighted_sum_on_one_backbone():
    torch.manual_seed(0)
    bb = _backbone()
    joint = build_objective(
        "joint", bb, num_classes=10, mean=[0.5], std=[0.25], mpp_weight=0.7, supervised_weight=0.3
    )
    assert isinstance(joint, JointObjective) and joint.backbone is bb
    assert joint.mpp.backbone is bb and joint.supervised.backbone is bb
    images, labels = torch.rand(4, 1, 28, 28), torch.tensor([1, 2, 3, -1])
    torch.manual_seed(5)
    loss, metrics = joint(images, labels)
    torch.manual_seed(5)  # same corruption draw
    l_mpp, _ = joint.mpp(images, labels)
    l_sup, _ = joint.supervised(images, labels)
    assert torch.allclose(loss, 0.7 * l_mpp + 0.3 * l_sup, atol=1e-6)
    assert {"mpp/loss", "mpp/acc_mask", "sup/loss", "sup/acc", "joint/loss"} <= set(metrics)
    groups = param_groups(joint, 0.1)
    n_params = len({id(p) for p in joint.parameters()})
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == n_params


def test_build_objective_defaults_and_errors():
    bb = _backbone()
    mpp = build_objective("mpp", bb, mean=[0.5], std=[0.25])
    assert isinstance(mpp, MaskedPatchPrediction)
    assert (mpp.num_corrupt, mpp.mask_prob, mpp.random_prob) == (24, 0.8, 0.1)
    assert (mpp.target, mpp.bits, mpp.num_classes) == ("mean_color", 3, 8)
    sup = build_objective("supervised", bb, num_classes=10, mean=[0.5], std=[0.25])
    assert isinstance(sup, SupervisedObjective) and sup.label_smoothing == 0.0
    with pytest.raises(ValueError, match="choose one of"):
        build_objective("byol", bb)
    with pytest.raises(ValueError, match="num_classes"):
        build_objective("supervised", bb, mean=[0.5], std=[0.25])
    with pytest.raises(ValueError, match="unknown option"):
        build_objective("supervised", bb, num_classes=3, mean=[0.5], std=[0.25], bits=3)


def test_supervised_fits_a_separable_batch():
    torch.manual_seed(0)
    sup = SupervisedObjective(_backbone(), num_classes=2, mean=[0.5], std=[0.25])
    images = torch.rand(16, 1, 28, 28) * 0.5
    labels = torch.arange(16) % 2
    images[labels == 1] += 0.5  # class 1 is bright
    opt = torch.optim.AdamW(param_groups(sup, 0.0), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(30):
            loss, metrics = sup(images, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert metrics["sup/acc"].item() == 1.0 and loss.item() < 0.2
