"""Backbones, position-embedding interpolation, heads, export/load, FLOP counting."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT
from torch import nn

from ssl_vit.config import ConfigError, load_config
from ssl_vit.models import (
    FinetuneHead,
    PretrainHead,
    build_backbone,
    export_backbone,
    load_backbone,
    resample_pos_embed,
    token_geometry,
)
from ssl_vit.objectives import param_groups
from ssl_vit.perf import count_train_flops

TINY = dict(embed_dim=32, depth=1, num_heads=2)


@pytest.mark.parametrize(
    "arch,patch,kw,grid,px",
    [
        ("vit_tiny_patch16_224", 4, TINY, (7, 7), 4),
        ("vit_small_patch16_224", 7, TINY, (4, 4), 7),
        ("vit_tiny_r_s16_p8_224", 1, TINY, (7, 7), 4),  # hybrid: ResNet stem, stride 4
        ("mixer_s16_224", 4, dict(embed_dim=32, num_blocks=1), (7, 7), 4),
    ],
)
def test_fashion_mnist_sized_backbones(arch, patch, kw, grid, px):
    model = build_backbone(arch, img_size=28, in_chans=1, patch_size=patch, **kw)
    x = torch.rand(2, 1, 28, 28)
    tokens = model.forward_features(x)
    prefix = 0 if arch.startswith("mixer") else 1
    assert tokens.shape == (2, prefix + grid[0] * grid[1], 32)
    assert model.forward_head(tokens, pre_logits=True).shape == (2, 32)
    assert model(x).shape == (2, 32)
    geo = token_geometry(model)
    assert (geo.grid, geo.patch_px, geo.in_chans) == (grid, px, 1)


@pytest.mark.parametrize(
    "arch,dim,depth",
    [
        ("vit_tiny_patch16_224", 192, 12),
        ("vit_small_patch32_224", 384, 12),
        ("vit_base_patch8_224", 768, 12),
        ("vit_large_patch14_224", 1024, 24),
        ("vit_huge_patch14_224", 1280, 32),
    ],
)
def test_paper_sizes_by_name(arch, dim, depth):
    with torch.device("meta"):  # no memory for the 632M-parameter H/14
        model = build_backbone(arch, img_size=224, in_chans=3)
    assert (model.embed_dim, len(model.blocks)) == (dim, depth)


def test_unknown_arch_is_a_clear_error():
    with pytest.raises(ValueError, match="vit_nonexistent"):
        build_backbone("vit_nonexistent", img_size=28, in_chans=1)


def test_pos_embed_identity_at_same_size():
    pe = torch.randn(1, 1 + 49, 8)
    assert resample_pos_embed(pe, (7, 7), (7, 7), num_prefix_tokens=1) is pe


def test_pos_embed_interpolation_keeps_prefix_and_smooth_fields():
    gy, gx = torch.meshgrid(torch.linspace(0, 1, 7), torch.linspace(0, 1, 7), indexing="ij")
    field = torch.stack([torch.ones(7, 7), gy, gx], -1).reshape(1, 49, 3)
    pe = torch.cat([torch.full((1, 1, 3), 5.0), field], 1)
    out = resample_pos_embed(pe, (14, 14), (7, 7), num_prefix_tokens=1)
    assert out.shape == (1, 1 + 196, 3)
    assert torch.equal(out[:, :1], pe[:, :1])  # [class] embedding untouched
    grid = out[0, 1:].reshape(14, 14, 3)
    assert torch.allclose(grid[..., 0], torch.ones(14, 14), atol=1e-5)  # constants stay constant
    assert (grid[1:, :, 1] - grid[:-1, :, 1]).min() > 0  # rows still increase top to bottom
    assert (grid[:, 1:, 2] - grid[:, :-1, 2]).min() > 0  # columns left to right


def test_heads_as_in_paper():
    ft = FinetuneHead(16, 10)
    assert torch.count_nonzero(ft.weight) == 0 and torch.count_nonzero(ft.bias) == 0
    assert torch.equal(ft(torch.randn(3, 16)), torch.zeros(3, 10))
    pt = PretrainHead(16, 10)
    assert isinstance(pt.act, nn.Tanh) and pt.fc1.out_features == 16
    assert pt(torch.randn(3, 16)).shape == (3, 10)


def _vit(img_size=28):
    return build_backbone(
        "vit_tiny_patch16_224", img_size=img_size, in_chans=1, patch_size=4, **TINY
    )


def test_export_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = _vit().eval()
    kwargs = dict(img_size=28, in_chans=1, patch_size=4, **TINY)
    run = tmp_path / "run"
    out = export_backbone(
        model, run / "export", arch="vit_tiny_patch16_224", kwargs=kwargs,
        mean=[0.286], std=[0.353], extra={"objective": "mpp"},
    )  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["backbone.json", "backbone.safetensors"]
    meta = json.loads((out / "backbone.json").read_text())
    assert meta["format_version"] == 1 and meta["arch"] == "vit_tiny_patch16_224"
    assert meta["kwargs"] == kwargs and meta["mean"] == [0.286] and meta["objective"] == "mpp"
    x = torch.rand(2, 1, 28, 28)
    for path in (out, run):  # an export folder or a run directory
        loaded, meta2 = load_backbone(path)
        assert meta2 == meta
        assert torch.equal(loaded.eval()(x), model(x))


def test_drop_path_for_fine_tuning_is_not_kept_in_the_export(tmp_path):
    """model.drop_path_rate: stochastic depth in training (rising to the rate at the last
    block), the same function in eval, and nothing of it in the backbone's kwargs."""
    torch.manual_seed(0)
    kwargs = dict(img_size=28, in_chans=1, patch_size=4, **{**TINY, "depth": 2})
    model = build_backbone("vit_tiny_patch16_224", **kwargs).eval()  # block 0 never drops
    export_backbone(
        model, tmp_path, arch="vit_tiny_patch16_224", kwargs=kwargs, mean=[0.5], std=[0.5]
    )
    loaded, meta = load_backbone(tmp_path, drop_path_rate=0.2)
    assert "drop_path_rate" not in meta["kwargs"]
    assert loaded.blocks[-1].drop_path1.drop_prob == pytest.approx(0.2)
    x = torch.rand(4, 1, 28, 28)
    assert torch.equal(loaded.eval()(x), model(x))  # off in eval: the same weights, same output
    torch.manual_seed(1)
    assert not torch.allclose(loaded.train()(x), model(x))  # blocks dropped per sample
    with pytest.raises(ConfigError, match="model.drop_path_rate"):
        load_config(None, ["model.drop_path_rate=1.0"])
    with pytest.raises(ConfigError, match="set model.drop_path_rate instead"):
        load_config(None, ["model.kwargs={drop_path_rate: 0.1}"])
    # an export made with the rate among its kwargs (before model.drop_path_rate) loads too
    meta["kwargs"]["drop_path_rate"] = 0.1
    (tmp_path / "backbone.json").write_text(json.dumps(meta))
    again, _ = load_backbone(tmp_path, drop_path_rate=0.2)
    assert again.blocks[-1].drop_path1.drop_prob == pytest.approx(0.2)


def test_load_at_new_img_size_interpolates_pos_embed(tmp_path):
    model = _vit()
    kwargs = dict(img_size=28, in_chans=1, patch_size=4, **TINY)
    export_backbone(
        model, tmp_path, arch="vit_tiny_patch16_224", kwargs=kwargs, mean=[0.5], std=[0.5]
    )
    big, _ = load_backbone(tmp_path, img_size=56)
    assert big.pos_embed.shape == (1, 1 + 196, 32)
    assert torch.equal(big.pos_embed[:, 0], model.pos_embed[:, 0])
    assert torch.equal(big.patch_embed.proj.weight, model.patch_embed.proj.weight)
    assert big(torch.rand(1, 1, 56, 56)).shape == (1, 32)


def test_hybrid_loads_at_a_new_size(tmp_path):
    kw = dict(img_size=28, in_chans=1, patch_size=1, **TINY)
    hybrid = build_backbone("vit_tiny_r_s16_p8_224", **kw)
    export_backbone(
        hybrid, tmp_path, arch="vit_tiny_r_s16_p8_224", kwargs=kw, mean=[0.5], std=[0.5]
    )
    big, meta = load_backbone(tmp_path, img_size=56)
    assert meta["token_grid"] == [7, 7] and tuple(big.patch_embed.grid_size) == (14, 14)
    assert big.forward_features(torch.rand(1, 1, 56, 56)).shape == (1, 1 + 196, 32)


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="backbone.json"):
        load_backbone(tmp_path)
    (tmp_path / "backbone.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_backbone(tmp_path)
    mixer = build_backbone("mixer_s16_224", img_size=28, in_chans=1, patch_size=4, num_blocks=1)
    kw = dict(img_size=28, in_chans=1, patch_size=4, num_blocks=1)
    export_backbone(mixer, tmp_path / "m", arch="mixer_s16_224", kwargs=kw, mean=[0.5], std=[0.5])
    assert load_backbone(tmp_path / "m")[0](torch.rand(1, 1, 28, 28)).shape == (1, 512)
    with pytest.raises(ValueError, match="no position embeddings"):
        load_backbone(tmp_path / "m", img_size=56)


def test_param_groups_exempt_tokens_biases_norms():
    model = _vit()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in no_decay["params"]}
    named = dict(model.named_parameters())
    for name in ("pos_embed", "cls_token", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias"):
        assert id(named[name]) in ids, name
    assert id(named["blocks.0.attn.qkv.weight"]) not in ids
    assert len(decay["params"]) + len(no_decay["params"]) == len(named)


def test_count_train_flops_of_a_linear_layer():
    class Obj(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 32, bias=False)

        def forward(self, x, y):
            return self.fc(x).sum(), {}

    obj = Obj()
    flops = count_train_flops(obj, torch.randn(8, 64), torch.zeros(8, dtype=torch.long))
    # forward 2*B*in*out; backward the same for the weight gradient (the input needs none)
    assert flops == 2 * (2 * 8 * 64 * 32)
    assert obj.fc.weight.grad is None  # gradients are cleared


def test_count_train_flops_includes_attention_on_cpu():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x, y):  # x: (B, heads, T, d)
            out = F.scaled_dot_product_attention(x * self.scale, x, x)
            return out.sum(), {}

    b, h, t, d = 2, 2, 16, 8
    flops = count_train_flops(Attn(), torch.randn(b, h, t, d), torch.zeros(b, dtype=torch.long))
    # forward alone: QK^T and AV, 2 * (2*B*H*T*T*d); CPU's flash kernel would count as 0
    assert flops >= 2 * (2 * b * h * t * t * d)


def test_layer_decay_gives_each_block_its_lr_and_keeps_the_decay_exemptions():
    """optim.layer_decay (fine-tuning option): the head and the last block (with the final
    norm) at the full lr, each block below one factor less, the patch embedding the least."""
    from ssl_vit.engine.optim import make_optimizer
    from ssl_vit.objectives import build_objective

    depth, decay, lr = 3, 0.5, 0.1
    bb = build_backbone("vit_tiny_patch16_224", img_size=28, in_chans=1, patch_size=4,
                        **{**TINY, "depth": depth})  # fmt: skip
    sup = build_objective("finetune", bb, num_classes=10, mean=[0.5], std=[0.25])
    overrides = [f"optim.layer_decay={decay}", f"optim.lr={lr}", "optim.weight_decay=0.05"]
    cfg = load_config(str(ROOT / "configs/fmnist_finetune.yaml"), overrides)
    opt, sched = make_optimizer(sup, cfg, total_steps=100)
    peak, wd = {}, {}
    for group, group_peak in zip(opt.param_groups, sched.peaks, strict=True):
        for p in group["params"]:
            peak[id(p)], wd[id(p)] = group_peak, group["weight_decay"]
    named = dict(sup.named_parameters())
    assert set(peak) == {id(p) for p in named.values()}  # every weight in exactly one group
    want = {"head.weight": lr, "backbone.norm.weight": lr,
            "backbone.patch_embed.proj.weight": lr * decay**depth,
            **{f"backbone.blocks.{i}.mlp.fc1.weight": lr * decay ** (depth - 1 - i)
               for i in range(depth)}}  # fmt: skip
    for name, value in want.items():
        assert peak[id(named[name])] == pytest.approx(value), name
    assert wd[id(named["backbone.blocks.0.mlp.fc1.weight"])] == 0.05
    for exempt in ("backbone.pos_embed", "backbone.blocks.0.norm1.weight", "head.bias"):
        assert wd[id(named[exempt])] == 0.0, exempt


@pytest.mark.parametrize("dynamic", [False, True])
def test_mpp_token_path_matches_timm_forward_features(dynamic):
    """MPP drives timm's ViT in two halves through its private `_pos_embed` (no public twin):
    with nothing corrupted, the halves must give timm's own forward_features. A timm release
    that changes `_pos_embed` fails here (pyproject pins the range this was tested on)."""
    from ssl_vit.objectives.mpp import embed_patches, encode_patches

    torch.manual_seed(0)
    kwargs = {"dynamic_img_size": True} if dynamic else {}
    model = build_backbone(
        "vit_tiny_patch16_224", img_size=28, in_chans=1, patch_size=7, embed_dim=32, depth=2,
        num_heads=2, reg_tokens=2, **kwargs,
    )  # fmt: skip
    model.eval()
    x = torch.rand(3, 1, 28, 28)
    with torch.no_grad():
        ours = encode_patches(model, embed_patches(model, x), (4, 4))
        theirs = model.forward_features(x)
    assert ours.shape == theirs.shape == (3, 1 + 2 + 16, 32)
    torch.testing.assert_close(ours, theirs)
