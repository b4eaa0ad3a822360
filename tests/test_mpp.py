"""Masked patch prediction: targets to the number, corruption statistics, wiring, learning."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ssl_vit.models import build_backbone
from ssl_vit.objectives import build_objective, param_groups
from ssl_vit.objectives.mpp import (
    KEPT,
    MASK,
    RANDOM,
    MaskedPatchPrediction,
    apply_corruption,
    decode_color_classes,
    downsized_color_targets,
    draw_corruption,
    mean_color_targets,
    patch_pixel_targets,
)

TINY = dict(embed_dim=32, depth=1, num_heads=2)


def _blocks(colors: list[list[float]], patch: int) -> torch.Tensor:
    """One row of uniform patches, colours (N, C) -> image (1, C, patch, N*patch)."""
    c = torch.tensor(colors, dtype=torch.float32)  # (N, C)
    return c.T[:, None, :, None].expand(-1, patch, -1, patch).reshape(1, c.shape[1], patch, -1)


def test_mean_color_targets_rgb_known_colours_and_bin_edges():
    colors = [
        [0.0, 0.0, 0.0],  # 0
        [1.0, 1.0, 1.0],  # 7,7,7 -> 511 (1.0 goes to the top bin)
        [0.125, 0.1249, 0.875],  # 1,0,7 -> 64 + 0 + 7
        [0.5, 0.25, 0.999],  # 4,2,7 -> 256 + 16 + 7
        [0.8749, 0.375, 0.0],  # 6,3,0 -> 384 + 24
        [32 / 255, 31 / 255, 255 / 255],  # uint8 edges: 1,0,7 -> 71
    ]
    got = mean_color_targets(_blocks(colors, 4), patch_size=4)
    assert got.tolist() == [[0, 511, 71, 279, 408, 71]]
    assert got.dtype == torch.int64


def test_mean_color_targets_average_then_quantise_and_grayscale():
    img = torch.zeros(1, 1, 2, 6)
    img[0, 0, :, 0] = 0.25  # half the 2x2 patch at 0.25 -> mean 0.125 -> level 1
    img[0, 0, 0, 2:4] = 0.2499  # mean 0.12495 -> level 0
    img[0, 0, :, 4:6] = 1.0
    assert mean_color_targets(img, patch_size=2).tolist() == [[1, 0, 7]]
    gray = [[v] for v in (0.0, 0.124, 0.125, 0.5, 0.8749, 0.875, 1.0)]
    assert mean_color_targets(_blocks(gray, 2), 2).tolist() == [[0, 0, 1, 4, 6, 7, 7]]
    # bits configurable: 2 bits -> 4 levels per channel
    assert mean_color_targets(_blocks(gray, 2), 2, bits=2).tolist() == [[0, 0, 0, 2, 3, 3, 3]]


def test_decode_inverts_the_class_code():
    classes = torch.tensor([0, 71, 279, 511])
    rgb = decode_color_classes(classes, bits=3, in_chans=3)  # (4, 3) bin centres
    assert rgb[1].tolist() == [1.5 / 8, 0.5 / 8, 7.5 / 8]
    image = rgb.T[None, :, None, :]  # (1, 3, 1, 4): one pixel per patch
    assert mean_color_targets(image, 1)[0].tolist() == classes.tolist()
    gray = decode_color_classes(torch.tensor([0, 7]), bits=3, in_chans=1)
    assert gray.tolist() == [[0.5 / 8], [7.5 / 8]]


def test_downsized_targets_known_cells():
    # an 8x8 patch whose 4x4 cells (2x2 pixels each) have gray levels 0..7 and back
    levels = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0]).view(4, 4)
    cells = (levels.float() + 0.5) / 8
    img = cells.repeat_interleave(2, 0).repeat_interleave(2, 1)[None, None]  # (1, 1, 8, 8)
    got = downsized_color_targets(img, patch_size=8)
    assert got.shape == (1, 1, 16) and got[0, 0].tolist() == levels.flatten().tolist()
    rgb = torch.rand(2, 3, 28, 28)
    assert downsized_color_targets(rgb, 7).shape == (2, 16, 16)  # 7 px: adaptive bins
    flat = torch.full((1, 3, 7, 7), 0.5)
    assert downsized_color_targets(flat, 7).unique().tolist() == [4 * 64 + 4 * 8 + 4]


def test_pixel_targets_order_and_normalisation():
    img = torch.arange(2 * 4 * 4, dtype=torch.float32).view(1, 2, 4, 4) / 32
    t = patch_pixel_targets(img, 2)  # (1, 4, 2*2*2), pixels (P, P, C)
    assert t.shape == (1, 4, 8)
    assert t[0, 1].tolist() == [v / 32 for v in (2, 18, 3, 19, 6, 22, 7, 23)]
    n = patch_pixel_targets(torch.rand(3, 3, 16, 16), 4, normalize=True)
    assert torch.allclose(n.mean(-1), torch.zeros(3, 16), atol=1e-5)
    assert torch.allclose(n.std(-1, unbiased=False), torch.ones(3, 16), atol=1e-3)


def test_corruption_counts_split_and_uniformity():
    g = torch.Generator().manual_seed(0)
    B, N, M = 4096, 196, 98
    c = draw_corruption(B, N, M, generator=g)
    assert c.positions.shape == c.kinds.shape == c.sources.shape == (B, M)
    srt = c.positions.sort(1).values
    assert (srt[:, 1:] > srt[:, :-1]).all()  # M distinct patches in every image: exactly 50%
    share = torch.bincount(c.kinds.flatten(), minlength=3).float() / (B * M)
    # 401k draws: the std of a 10% share is 0.0005, so 0.003 is a 6-sigma band
    assert torch.allclose(share, torch.tensor([0.8, 0.1, 0.1]), atol=0.003), share
    hits = torch.bincount(c.positions.flatten(), minlength=N).float() / B
    assert (hits - 0.5).abs().max() < 0.04  # every position corrupted half the time
    assert not (c.sources == c.positions).any()  # random replacement never picks itself
    off = (c.sources - c.positions) % N
    assert off.min() >= 1 and off.max() == N - 1  # and reaches every other patch


def test_corruption_rates_configurable():
    c = draw_corruption(2048, 49, 7, mask_prob=0.5, random_prob=0.3)
    share = torch.bincount(c.kinds.flatten(), minlength=3).float() / c.kinds.numel()
    assert torch.allclose(share, torch.tensor([0.5, 0.3, 0.2]), atol=0.02)
    with pytest.raises(ValueError, match="sum <= 1"):
        draw_corruption(2, 4, 2, mask_prob=0.9, random_prob=0.2)


def test_apply_corruption_exact_values():
    g = torch.Generator().manual_seed(1)
    B, N, D = 64, 16, 8
    tokens = torch.randn(B, N, D)
    mask = torch.randn(D)
    c = draw_corruption(B, N, 8, generator=g)
    out = apply_corruption(tokens, c, mask)
    corrupted = torch.zeros(B, N, dtype=torch.bool).scatter(1, c.positions, True)
    assert torch.equal(out[~corrupted], tokens[~corrupted])  # untouched: bit-identical
    b = torch.arange(B)[:, None].expand(-1, 8)
    kept = c.kinds == KEPT
    assert torch.equal(out[b[kept], c.positions[kept]], tokens[b[kept], c.positions[kept]])
    masked = c.kinds == MASK
    assert torch.equal(out[b[masked], c.positions[masked]], mask.expand(int(masked.sum()), D))
    rnd = c.kinds == RANDOM
    assert torch.equal(out[b[rnd], c.positions[rnd]], tokens[b[rnd], c.sources[rnd]])
    assert not torch.equal(out[b[rnd], c.positions[rnd]], tokens[b[rnd], c.positions[rnd]])


def _mpp(arch="vit_tiny_patch16_224", patch=4, chans=1, **cfg):
    kw = dict(TINY)
    if arch.startswith("mixer"):
        kw = dict(embed_dim=32, num_blocks=1)
    bb = build_backbone(
        arch, img_size=16 if chans == 3 else 28, in_chans=chans, patch_size=patch, **kw
    )
    return MaskedPatchPrediction(bb, mean=[0.5] * chans, std=[0.25] * chans, **cfg)


def test_corruption_is_in_embedding_space_before_position_embeddings():
    torch.manual_seed(0)
    mpp = _mpp(mask_prob=1.0, random_prob=0.0)
    seen = {}
    mpp.backbone.pos_drop.register_forward_hook(lambda m, i, o: seen.update(x=i[0]))
    pred = mpp.predict(torch.rand(2, 1, 28, 28), generator=torch.Generator().manual_seed(3))
    x = seen["x"]  # (B, 1 + N, D): after _pos_embed
    pos = mpp.backbone.pos_embed[0]
    for b in range(2):
        for p in pred.positions[b].tolist():
            assert torch.allclose(x[b, 1 + p], mpp.mask_token + pos[1 + p])
    assert mpp.num_corrupt == round(0.5 * 49)


def test_head_runs_on_corrupted_positions_only_and_gradients_reach_mask_token():
    mpp = _mpp()
    shapes = []
    mpp.head.fc1.register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
    loss, metrics = mpp(torch.rand(3, 1, 28, 28), torch.full((3,), -1))
    assert shapes == [(3, mpp.num_corrupt, 32)]
    loss.backward()
    assert mpp.mask_token.grad is not None and mpp.mask_token.grad.abs().sum() > 0
    assert mpp.backbone.patch_embed.proj.weight.grad.abs().sum() > 0
    for k in ("loss", "acc", "acc_mask", "acc_random", "acc_kept"):
        v = metrics[f"mpp/{k}"]
        assert isinstance(v, torch.Tensor) and v.ndim == 0 and torch.isfinite(v)
    assert id(mpp.mask_token) in {id(p) for p in param_groups(mpp, 0.1)[1]["params"]}


@pytest.mark.parametrize(
    "target,shape,dtype",
    [
        ("mean_color", (2, 24), torch.int64),
        ("downsized_color", (2, 24, 16), torch.int64),
        ("pixels", (2, 24, 4, 4, 1), torch.float32),
    ],
)
def test_three_target_kinds_shapes(target, shape, dtype):
    mpp = _mpp(target=target)
    g = torch.Generator().manual_seed(0)
    out = mpp.predict(torch.rand(2, 1, 28, 28), generator=g)
    assert out.positions.shape == out.kinds.shape == (2, 24)
    assert out.pred.shape == out.target.shape == shape and out.target.dtype == dtype
    loss, _ = mpp(torch.rand(2, 1, 28, 28), torch.zeros(2, dtype=torch.long))
    assert loss.ndim == 0 and torch.isfinite(loss)
    # the true targets are those of the corrupted patches
    if target == "mean_color":
        img = torch.rand(2, 1, 28, 28)
        out = mpp.predict(img, generator=torch.Generator().manual_seed(5))
        assert torch.equal(out.target, mean_color_targets(img, 4).gather(1, out.positions))


def test_metrics_match_the_predictions_per_corruption_kind():
    torch.manual_seed(0)
    mpp = _mpp(patch=4, chans=3).eval()
    img = torch.rand(8, 3, 16, 16)
    torch.manual_seed(1)
    loss, metrics = mpp(img, torch.full((8,), -1))
    torch.manual_seed(1)  # the same corruption draw
    out = mpp.predict(img)
    correct = (out.pred == out.target).float()
    assert torch.allclose(metrics["mpp/acc"], correct.mean())
    for kind, name in ((0, "mask"), (1, "random"), (2, "kept")):
        sel = out.kinds == kind
        want = correct[sel].mean() if sel.any() else torch.tensor(0.0)
        assert torch.allclose(metrics[f"mpp/acc_{name}"], want), name


def test_predict_is_reproducible_with_a_generator():
    mpp = _mpp().eval()
    img = torch.rand(2, 1, 28, 28)
    a = mpp.predict(img, generator=torch.Generator().manual_seed(7))
    b = mpp.predict(img, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.positions, b.positions) and torch.equal(a.pred, b.pred)


@pytest.mark.parametrize("arch,patch", [("vit_tiny_r_s16_p8_224", 1), ("mixer_s16_224", 4)])
def test_hybrid_and_mixer_pretrain_with_mpp(arch, patch):
    mpp = _mpp(arch, patch)
    assert mpp.patch_size == 4 and mpp.grid == (7, 7)
    loss, metrics = mpp(torch.rand(2, 1, 28, 28), torch.zeros(2, dtype=torch.long))
    loss.backward()
    assert torch.isfinite(loss) and mpp.mask_token.grad.abs().sum() > 0


def test_hybrid_hides_corrupted_pixels_from_the_stem():
    """The stem's receptive field spans neighbouring patches: for a hybrid, what a masked or
    replaced patch held must not reach any output, while a plain ViT's kept pixels do."""
    mpp = _mpp("vit_tiny_r_s16_p8_224", 1).eval()  # 7x7 tokens of 4 px
    assert mpp.hide_pixels and not _mpp().hide_pixels
    img = torch.rand(1, 1, 28, 28)
    probe = mpp.predict(img, generator=torch.Generator().manual_seed(3))
    kinds = dict(zip(probe.positions[0].tolist(), probe.kinds[0].tolist(), strict=True))
    hidden = next(p for p, k in kinds.items() if k != KEPT)
    r, c = divmod(hidden, 7)
    other = img.clone()
    other[..., r * 4 : r * 4 + 4, c * 4 : c * 4 + 4] = torch.rand(4, 4)  # only that patch differs
    with torch.no_grad():
        a = mpp._forward(img, torch.Generator().manual_seed(3))[0]
        b = mpp._forward(other, torch.Generator().manual_seed(3))[0]
    torch.testing.assert_close(a, b)  # every prediction blind to the hidden patch
    kept = [p for p, k in kinds.items() if k == KEPT]
    untouched = [p for p in range(49) if p not in kinds]
    r, c = divmod((kept or untouched)[0], 7)
    other = img.clone()
    other[..., r * 4 : r * 4 + 4, c * 4 : c * 4 + 4] = torch.rand(4, 4)
    with torch.no_grad():
        b = mpp._forward(other, torch.Generator().manual_seed(3))[0]
    assert not torch.allclose(a, b)  # a visible patch does reach the predictions


def test_a_bf16_cast_model_takes_float32_images_and_keeps_exact_targets():
    mpp = _mpp().to(torch.bfloat16)  # what a DeepSpeed bf16 engine does to the module
    img = torch.rand(2, 1, 28, 28)
    out = mpp.predict(img, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.target, mean_color_targets(img, 4).gather(1, out.positions))
    loss, _ = mpp(img, torch.zeros(2, dtype=torch.long))
    loss.backward()
    assert mpp.mask_token.grad.dtype == torch.bfloat16 and torch.isfinite(loss)


def test_bad_configuration_is_a_clear_error():
    bb = build_backbone("vit_tiny_patch16_224", img_size=28, in_chans=1, patch_size=4, **TINY)
    with pytest.raises(ValueError, match="patch_size=7"):
        MaskedPatchPrediction(bb, mean=[0.5], std=[0.5], patch_size=7)
    with pytest.raises(ValueError, match="mean/std need 1"):
        MaskedPatchPrediction(bb, mean=[0.5] * 3, std=[0.5] * 3)
    with pytest.raises(ValueError, match="target="):
        MaskedPatchPrediction(bb, mean=[0.5], std=[0.5], target="colour")
    with pytest.raises(ValueError, match="unknown option"):
        build_objective("mpp", bb, mean=[0.5], std=[0.5], mask_ratio=0.5)


def test_tiny_model_learns_mean_colours_well_below_chance():
    """RGB 16x16, 4x4 patches, 512 classes; each image is one flat colour, so a corrupted
    patch's colour follows from the visible ones. 80 steps take a few seconds."""
    torch.manual_seed(0)
    mpp = _mpp(patch=4, chans=3)
    g = torch.Generator().manual_seed(0)
    images = torch.rand(16, 3, 1, 1, generator=g).expand(-1, -1, 16, 16).contiguous()
    opt = torch.optim.AdamW(param_groups(mpp, 0.0), lr=3e-3)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only waits on a shared CPU
    try:
        for _ in range(80):
            loss, metrics = mpp(images, torch.full((16,), -1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 0.9 * math.log(512)  # starts at chance, ln 512 = 6.24
    assert max(losses[-5:]) < 0.25 * math.log(512), losses[-5:]
    assert metrics["mpp/acc"] > 0.7


def test_hybrid_preset_overrides_build_mpp_with_image_pixel_patches(tiny_shards):
    """model.patch_size is in the stem's feature-map pixels for a hybrid: the objective takes
    its pixels per token from the backbone (8 = stem stride 4 x 2), as the study's track runs."""
    from ssl_vit.config import load_config
    from ssl_vit.data.manifest import load_manifest
    from ssl_vit.engine.build import build_from_config

    cfg = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "fmnist_vit_tiny_mpp.yaml",
        ["model.arch=vit_tiny_r_s16_p8_224", "model.img_size=32", "model.patch_size=2",
         "model.kwargs={embed_dim: 32, depth: 1, num_heads: 2}"],
    )  # fmt: skip
    objective, _, _ = build_from_config(cfg, load_manifest(tiny_shards))
    assert objective.patch_size == 8 and objective.grid == (4, 4) and objective.hide_pixels
    loss, _ = objective(torch.rand(2, 1, 32, 32), torch.zeros(2, dtype=torch.long))
    assert torch.isfinite(loss)


def test_normalize_pixels_key_reaches_the_objective_and_needs_pixel_targets(tiny_shards, tmp_path):
    """objective.normalize_pixels: read from a preset and overrides, kept in the saved config,
    passed to MaskedPatchPrediction (targets of zero mean, unit std per patch); refused with a
    target other than pixels, where it would change nothing."""
    from ssl_vit.config import ConfigError, load_config, save_config
    from ssl_vit.data.manifest import load_manifest
    from ssl_vit.engine.build import build_from_config

    preset = Path(__file__).resolve().parents[1] / "configs" / "fmnist_vit_tiny_mpp.yaml"
    tiny = ["model.kwargs={embed_dim: 32, depth: 1, num_heads: 2}", "model.patch_size=7"]
    cfg = load_config(preset, [*tiny, "objective.target=pixels", "objective.normalize_pixels=true"])
    assert cfg.objective.normalize_pixels is True
    saved = tmp_path / "config.yaml"
    save_config(cfg, saved)
    assert load_config(saved).objective.normalize_pixels is True  # the run dir's config resumes

    objective, options, _ = build_from_config(cfg, load_manifest(tiny_shards))
    assert options["normalize_pixels"] is True and objective.normalize_pixels
    images = torch.rand(2, 1, 28, 28)
    target = objective.predict(images).target.flatten(2)  # the corrupted patches' targets
    assert torch.allclose(target.mean(-1), torch.zeros(()), atol=1e-4)
    assert torch.allclose(target.std(-1, unbiased=False), torch.ones(()), atol=1e-3)
    loss, metrics = objective(images, torch.zeros(2, dtype=torch.long))
    assert torch.isfinite(loss) and "mpp/acc" not in metrics  # no colour to score

    plain_pixels = load_config(preset, [*tiny, "objective.target=pixels"])
    assert plain_pixels.objective.normalize_pixels is False  # the default: raw pixel targets
    assert build_from_config(plain_pixels, load_manifest(tiny_shards))[0].normalize_pixels is False

    with pytest.raises(ConfigError, match=r"normalize_pixels=true .*target='mean_color'"):
        load_config(preset, ["objective.normalize_pixels=true"])
    with pytest.raises(ConfigError, match="objective.normalize_pixels"):
        load_config(preset, ["objective.normalize_pixels=maybe"])
