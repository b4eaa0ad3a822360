"""Dynamic ViT cascade: exits and thresholds on known inputs, FLOPs of the stages actually run,
the reuse switches, and the `cascade` objective's loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.evaluation.dynamic import stage_flops
from ssl_vit.models import build_backbone
from ssl_vit.models.cascade import CascadeViT, resize_matrix
from ssl_vit.objectives import build_objective


def _vit(img: int = 28, **kw):
    torch.manual_seed(0)
    return build_backbone(
        "vit_tiny_patch16_224", img_size=img, in_chans=1, patch_size=7,
        embed_dim=32, depth=2, num_heads=2, **kw,
    )  # fmt: skip


def _cascade(**kw) -> CascadeViT:
    c = CascadeViT(_vit(), [14], num_classes=4, **kw).eval()
    torch.manual_seed(1)
    for st in c.stages:  # random (not zero) heads so confidences differ between images
        torch.nn.init.normal_(st.head.weight, std=3.0)
    return c


def _count_calls(module: torch.nn.Module) -> list[int]:
    sizes: list[int] = []
    module.register_forward_pre_hook(lambda m, args: sizes.append(int(args[0].shape[0])))
    return sizes


def test_confident_stage_one_images_never_reach_stage_two():
    c = _cascade()
    x = torch.randn(32, 1, 28, 28)
    with torch.no_grad():
        conf = c(x, upto=0)[0].softmax(-1).amax(-1)  # stage-1 confidence of every image
    thr = float(conf.median())
    seen = _count_calls(c.stages[1])
    logits, exits = c.early_exit(x, [thr])
    confident = conf >= thr
    assert 0 < int(confident.sum()) < 32
    assert torch.equal(exits == 0, confident)  # exactly the confident ones left at stage 1
    assert seen == [int((~confident).sum())]  # stage 2 saw only the others, once, batched
    with torch.no_grad():
        s0, s1 = c(x)
    assert torch.allclose(logits[confident], s0[confident])
    assert torch.allclose(logits[~confident], s1[~confident], atol=1e-5)  # same with reuse

    # A threshold every stage-1 confidence reaches: stage 2 never runs at all.
    seen.clear()
    _, exits = c.early_exit(x, [float(conf.min())])
    assert seen == [] and bool((exits == 0).all())
    # Above any softmax probability: everything goes to the last stage.
    _, exits = c.early_exit(x, [1.01])
    assert seen == [32] and bool((exits == 1).all())


def test_gflops_of_a_cascade_is_the_sum_over_the_stages_run():
    c = CascadeViT(_vit(), [7, 14], num_classes=4).eval()
    costs = stage_flops(c, in_chans=1)  # per image, each stage given its predecessors
    assert len(costs) == 3 and costs[0] < costs[1] < costs[2]
    x = torch.randn(16, 1, 28, 28)
    with torch.no_grad():
        conf0 = c(x, upto=0)[0].softmax(-1).amax(-1)
    for thr in ([0.0, 0.0], [float(conf0.median()), 0.0], [1.01, 1.01]):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            _, exits = c.early_exit(x, thr)
        reached = [int((exits >= s).sum()) for s in range(3)]
        expected = sum(n * f for n, f in zip(reached, costs, strict=True))
        assert counter.get_total_flops() == pytest.approx(expected, rel=1e-9), (thr, reached)


def test_no_reuse_stage_is_the_plain_vit_and_switches_change_the_model():
    vit = _vit()
    plain = CascadeViT(vit, [14], 4, feature_reuse=False, relation_reuse=False).eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        _, feat, _ = plain.stages[1](x)
        ref = vit.forward_head(vit.forward_features(x), pre_logits=True)
    assert torch.allclose(feat, ref, atol=1e-5)
    names = {n for n, _ in CascadeViT(_vit(), [14], 4).named_parameters()}
    assert any("feature." in n for n in names) and any("relation_weight" in n for n in names)
    only_f = {n for n, _ in CascadeViT(_vit(), [14], 4, relation_reuse=False).named_parameters()}
    assert not any("relation_weight" in n for n in only_f) and any("feature." in n for n in only_f)


def test_relation_reuse_adds_the_resized_previous_logits():
    r = resize_matrix((2, 2), (4, 4))
    assert r.shape == (17, 5) and r[0, 0] == 1 and torch.allclose(r.sum(1), torch.ones(17))
    c = CascadeViT(_vit(), [14], 4, feature_reuse=False).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        _, f0, rel0 = c.stages[0](x)
        _, _, rel_zero = c.stages[1](x, (f0, rel0))  # weights start at 0: no effect
        c.stages[1].relation_weight.fill_(1.0)
        c.stages[1].vit.blocks = c.stages[1].vit.blocks[:1]  # layer 0 alone: bias is exact
        _, _, rel_one = c.stages[1](x, (f0, rel0))
    assert torch.allclose(rel_one[0] - rel_zero[0], r @ rel0[0] @ r.T, atol=1e-5)


def test_cascade_objective_sums_stage_cross_entropies_and_trains():
    torch.manual_seed(0)
    obj = build_objective(
        "cascade", _vit(), num_classes=4, mean=[0.5], std=[0.25], coarse_sizes=[14]
    )
    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 4, (8,))
    loss, metrics = obj(x, y)
    stage = obj.stage_logits(x)
    expected = sum(F.cross_entropy(s, y) for s in stage)
    assert torch.allclose(loss, expected) and set(metrics) >= {"cascade/acc_s0", "sup/acc"}
    assert obj.backbone is obj.cascade.stages[-1].vit
    assert not any(k.startswith("backbone.") for k in obj.state_dict())  # no duplicate keys
    assert len(obj.loose_parameters()) == 4  # pos_embed + cls_token of each stage
    opt = torch.optim.SGD(obj.parameters(), lr=0.1, momentum=0.9)
    first = float(loss.detach())
    for _ in range(30):
        opt.zero_grad()
        loss, _ = obj(x, y)
        loss.backward()
        opt.step()
    assert float(loss) < 0.5 * first
    with pytest.raises(ValueError, match="increasing"):
        build_objective("cascade", _vit(), num_classes=4, mean=[0.5], std=[0.25],
                        coarse_sizes=[28])  # fmt: skip


def test_cascade_preset_keeps_its_kind_and_bad_sizes_are_one_line_errors():
    from ssl_vit.config import ConfigError, load_config
    from ssl_vit.engine.cli import parse

    _, overrides = parse(["--config", "configs/fmnist_cascade.yaml"], "finetune", "")
    cfg = load_config("configs/fmnist_cascade.yaml", overrides)
    assert cfg.objective.kind == "cascade" and cfg.holdout_share == 0.02  # held-out 2%
    _, overrides = parse(["--config", "configs/fmnist_finetune.yaml"], "finetune", "")
    assert load_config("configs/fmnist_finetune.yaml", overrides).objective.kind == "finetune"
    for bad in ("[28, 14]", "[49]", "[]", "7"):
        with pytest.raises(ConfigError, match="objective.cascade_sizes"):
            load_config("configs/fmnist_cascade.yaml", [f"objective.cascade_sizes={bad}"])
