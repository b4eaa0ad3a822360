"""Read-outs (which block, pooled how) and their choice on held-out training data."""

import json

import numpy as np
import pytest
import torch
from test_eval_features import TINY, _load_script, _tiny_backbone, _write_shards

from ssl_vit.data.holdout import held_out_mask
from ssl_vit.evaluation.readout_select import readout_candidates, select_readout
from ssl_vit.features import FeatureError, extract_features, raw_pixels_backbone
from ssl_vit.knn import knn_eval
from ssl_vit.readout import block_tokens, pool_tokens

CPU = torch.device("cpu")


def _batches(n: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    imgs = torch.randint(0, 256, (n, 1, 16, 16), dtype=torch.uint8, generator=g)
    return [(imgs, torch.arange(n))]


def test_block_outputs_are_normed_and_the_last_is_forward_features():
    model = _tiny_backbone().model.eval()
    x = torch.randn(3, 1, 16, 16)
    with torch.no_grad():
        out = block_tokens(model, x, [1, 2, 4])
        ref = model.forward_features(x)  # (B, 1 + 16, D)
    assert set(out) == {1, 2, 4} and out[1].shape == ref.shape
    torch.testing.assert_close(out[4], ref)  # the last block through the final norm
    assert not torch.allclose(out[1], out[4])
    # LayerNorm without learned scale at init: each token has mean 0 and unit variance
    torch.testing.assert_close(out[1].mean(-1), torch.zeros(3, 17), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="blocks 1..4"):
        block_tokens(model, x, [5])


def test_pools_at_a_layer():
    bb = _tiny_backbone()
    mean4, _ = extract_features(bb, _batches(), pool="mean", layer=4, device=CPU)
    mean_last, _ = extract_features(bb, _batches(), pool="mean", device=CPU)
    np.testing.assert_allclose(mean4, mean_last, atol=1e-6)  # block 4 of 4 is the last
    mean2, _ = extract_features(bb, _batches(), pool="mean", layer=2, device=CPU)
    tok2, _ = extract_features(bb, _batches(), pool="tokens", layer=2, device=CPU)
    assert tok2.shape == (6, 16 * TINY["embed_dim"])  # 4x4 patch tokens, [class] left out
    # the mean of the concatenated patch tokens is the mean pool of the same block
    np.testing.assert_allclose(tok2.reshape(6, 16, -1).mean(1), mean2, atol=1e-5)
    with pytest.raises(FeatureError, match="lastn"):
        extract_features(bb, _batches(), pool="lastn", layer=2, device=CPU)
    with pytest.raises(ValueError, match="tokens"):
        pool_tokens(bb.model, torch.randn(1, 1, 16, 16), "bogus")


def test_candidates_cover_every_block_and_respect_the_size_cap():
    bb = _tiny_backbone()
    names = [c.name for c in readout_candidates(bb, ("mean", "tokens"), max_dim=8192)]
    assert names[:2] == ["mean@block4", "tokens@block4"] and len(names) == 8  # last first
    small = readout_candidates(bb, ("mean", "tokens"), max_dim=16 * TINY["embed_dim"] - 1)
    assert {c.pool for c in small} == {"mean"} and len(small) == 4
    pixels = raw_pixels_backbone(img_size=16, in_chans=1, mean=[0.5], std=[0.25])
    with pytest.raises(FeatureError, match="no blocks"):
        readout_candidates(pixels, ("mean",), max_dim=8192)


def test_selection_scores_each_candidate_on_held_out_train_only(tmp_path):
    # A shard set with no test split at all: choosing cannot have looked at one.
    data = _write_shards(tmp_path / "shards", {"train": 120})
    bb = _tiny_backbone()
    sel = select_readout(bb, data, "train", holdout_fraction=0.25, k=5, num_workers=0,
                         batch_size=32, cache_dir=tmp_path / "cache", device=CPU)  # fmt: skip
    assert len(sel["scores"]) == 8 and sel["name"] == f"{sel['pool']}@block{sel['layer']}"
    assert sel["scores"][sel["name"]] == max(sel["scores"].values())
    held = held_out_mask(np.arange(120), 0.25)
    assert sel["num_held_out"] == held.sum() > 10
    # Each score is the held-out kNN top-1 of that read-out, recomputed here independently.
    for layer, pool in ((1, "mean"), (3, "tokens")):
        f, y = extract_features(bb, _shard_batches(data), pool=pool, layer=layer, device=CPU)
        m = knn_eval(f[~held], y[~held], f[held], y[held], ks=(5,), retrieval=False)
        assert sel["scores"][f"{pool}@block{layer}"] == pytest.approx(m["knn_top1@k=5"], abs=0.04)
    # The choice is cached: a second call reads it back without a feature pass.
    files = list((tmp_path / "cache").glob("readout-*.json"))
    assert len(files) == 1
    again = select_readout(bb, data, "train", holdout_fraction=0.25, k=5, num_workers=0,
                           batch_size=32, cache_dir=tmp_path / "cache", device=CPU)  # fmt: skip
    assert again == sel


def _shard_batches(data):
    from ssl_vit.data.stream import make_eval_loader

    return make_eval_loader(data, "train", batch_size=32, img_size=16, num_workers=0)


def test_cli_layer_auto_records_the_choice(tmp_path, capsys):
    data = _write_shards(tmp_path / "shards", {"train": 150, "test": 30})
    common = ["--random-init", "vit_tiny_patch16_224", "--patch-size", "4", "--model-kwargs",
              json.dumps(TINY), "--data", str(data), "--workers", "0", "--batch-size", "32",
              "--cache-dir", str(tmp_path / "cache"), "--no-mlflow", "--device", "cpu"]  # fmt: skip
    knn = _load_script("knn")
    out = tmp_path / "knn.json"
    assert knn.main([*common, "--layer", "auto", "--k", "5", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    sel = res["readout_selection"]
    assert res["params"]["layer"] == sel["layer"] and res["params"]["pool"] == sel["pool"]
    assert "held-out" in res["params"]["readout_chosen_by"] and len(sel["scores"]) == 8
    assert "read-out " in capsys.readouterr().err
    dim = TINY["embed_dim"] * (16 if sel["pool"] == "tokens" else 1)
    assert res["metrics"]["dim"] == dim
    # A fixed block by number; a block the backbone lacks and pixels with --layer are errors.
    assert (
        knn.main([*common, "--layer", "2", "--pool", "tokens", "--k", "5", "--out", str(out)]) == 0
    )
    res = json.loads(out.read_text())
    assert res["params"]["layer"] == 2 and res["metrics"]["dim"] == 16 * TINY["embed_dim"]
    assert "readout_selection" not in res
    assert knn.run_main(knn.main, [*common, "--layer", "7"]) == 2
    assert "blocks 1..4" in capsys.readouterr().err
    pixels = ["--raw-pixels", *common[6:], "--layer", "auto"]
    assert knn.run_main(knn.main, pixels) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drop --layer" in err[0]
