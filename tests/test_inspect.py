"""ssl_vit.inspect: the paper's analyses on cases with known answers, and the CLI end to end."""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import timm
import torch
import webdataset as wds
from PIL import Image

from ssl_vit.data.manifest import Manifest, ShardInfo, SplitInfo, write_manifest
from ssl_vit.inspect import inspect_model
from ssl_vit.inspect.analyses import (
    attention_rollout,
    class_rollout_maps,
    embedding_filter_components,
    mean_attention_distance,
    mpp_mean_colours,
    patch_distances,
    position_similarity,
)
from ssl_vit.inspect.attention import AttentionRecorder
from ssl_vit.io import sha256_file
from ssl_vit.models import build_backbone, export_backbone, load_backbone
from ssl_vit.objectives import MaskedPatchPrediction

REPO = Path(__file__).resolve().parents[1]


def tiny_vit(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", img_size=28, patch_size=4, in_chans=1, num_classes=0, depth=2, **kw
    ).eval()


def brute_mean_pairwise(gh: int, gw: int, p: int) -> float:
    cells = [(r, c) for r in range(gh) for c in range(gw)]
    d = [p * ((r1 - r2) ** 2 + (c1 - c2) ** 2) ** 0.5 for r1, c1 in cells for r2, c2 in cells]
    return sum(d) / len(d)


def test_uniform_attention_gives_mean_pairwise_grid_distance():
    gh, gw, p, npre = 3, 4, 5, 1
    T = gh * gw + npre
    attn = torch.full((2, 3, T, T), 1.0 / T)  # uniform, including the [class] key
    got = mean_attention_distance(attn, patch_distances((gh, gw), (p, p)), npre)
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, torch.full((2, 3), brute_mean_pairwise(gh, gw, p)))


def test_identity_attention_gives_zero_distance_and_identity_rollout():
    T = 1 + 16
    eye = torch.eye(T).expand(2, 4, T, T)
    assert mean_attention_distance(eye, patch_distances((4, 4), (4, 4)), 1).abs().max() == 0
    rollout = attention_rollout([eye, eye, eye])
    torch.testing.assert_close(rollout, torch.eye(T).expand(2, T, T))


def test_rollout_of_one_uniform_layer_is_half_uniform_half_identity():
    T = 5
    u = torch.full((1, 2, T, T), 1.0 / T)
    expected = 0.5 * torch.full((T, T), 1.0 / T) + 0.5 * torch.eye(T)
    torch.testing.assert_close(attention_rollout([u])[0], expected)
    # Two layers multiply: rows still sum to 1.
    two = attention_rollout([u, torch.softmax(torch.randn(1, 2, T, T), -1)])
    torch.testing.assert_close(two.sum(-1), torch.ones(1, T))
    maps = class_rollout_maps(two[:, :, :], (2, 2), 1)
    assert maps.shape == (1, 2, 2) and float(maps.max()) == pytest.approx(1.0)


def test_attention_distance_drops_class_and_renormalises():
    # Each patch query puts half its weight on [class], half on the patch to its right
    # (or itself at the right edge): the distance is p for (gw-1)/gw of the queries.
    gh, gw, p = 2, 3, 4
    N = gh * gw
    attn = torch.zeros(1, 1, N + 1, N + 1)
    attn[..., 0] = 0.5
    for q in range(N):
        r, c = divmod(q, gw)
        attn[0, 0, 1 + q, 1 + r * gw + min(c + 1, gw - 1)] = 0.5
    got = mean_attention_distance(attn, patch_distances((gh, gw), (p, p)), 1)
    assert float(got) == pytest.approx(p * (gw - 1) / gw)


def test_position_similarity_is_one_with_itself_and_cosine():
    pos = torch.randn(12, 8) * torch.linspace(0.1, 10, 12)[:, None]  # very unequal norms
    sim = position_similarity(pos, (3, 4))
    assert sim.shape == (3, 4, 3, 4)
    flat = sim.reshape(12, 12)
    torch.testing.assert_close(torch.diagonal(flat), torch.ones(12))
    assert flat.abs().max() <= 1 + 1e-5
    i, j = 2, 7
    cos = torch.dot(pos[i], pos[j]) / (pos[i].norm() * pos[j].norm())
    assert float(flat[i, j]) == pytest.approx(float(cos), abs=1e-5)


def test_filter_components_are_orthonormal_principal_components():
    import sklearn.decomposition as sklearn_decomp  # a dev dependency

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 3, 4, 4, generator=g) @ torch.randn(4, 4, generator=g)  # correlated
    comps, ratio = embedding_filter_components(w, k=10)
    assert comps.shape == (10, 3, 4, 4)
    flat = comps.reshape(10, -1)
    torch.testing.assert_close(flat @ flat.T, torch.eye(10), atol=1e-5, rtol=0)
    assert torch.all(ratio[:-1] >= ratio[1:])
    ref = sklearn_decomp.PCA(n_components=10).fit(w.reshape(64, -1).numpy())
    np.testing.assert_allclose(ratio.numpy(), ref.explained_variance_ratio_, rtol=1e-4)
    dots = (flat.numpy() * ref.components_).sum(-1)  # same directions up to sign
    np.testing.assert_allclose(np.abs(dots), 1.0, atol=1e-4)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_hook_attention_matches_unfused_reference_and_leaves_output_unchanged(qk_norm):
    model = tiny_vit(qk_norm=qk_norm)
    assert model.blocks[0].attn.fused_attn  # the case that needs the hooks
    if qk_norm:  # make the norms matter
        for blk in model.blocks:
            torch.nn.init.normal_(blk.attn.q_norm.weight, 1.0, 0.5)
            torch.nn.init.normal_(blk.attn.k_norm.bias, 0.0, 0.5)
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(x)
        with AttentionRecorder(model) as rec:
            hooked = model(x)
        again = model(x)  # hooks removed
    assert torch.equal(plain, hooked) and torch.equal(plain, again)
    assert len(rec.maps) == 2 and rec.maps[0].shape == (3, 3, 50, 50)

    # Reference: timm's own unfused path, softmax(q k^T * scale), caught at attn_drop.
    ref_model = copy.deepcopy(model)
    caught: list[torch.Tensor] = []
    for blk in ref_model.blocks:
        blk.attn.fused_attn = False
        blk.attn.attn_drop.register_forward_hook(lambda m, i, o: caught.append(o.detach()))
    with torch.no_grad():
        ref_out = ref_model(x)
    torch.testing.assert_close(ref_out, plain, atol=1e-5, rtol=1e-5)
    for got, ref in zip(rec.maps, caught, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    assert rec.maps[1].shape == (3, 3, 50, 50)


def test_mpp_colours_are_the_patches_3bit_mean_and_the_panel_is_drawn(tmp_path):
    model = tiny_vit()
    mpp = MaskedPatchPrediction(model, mean=[0.5], std=[0.25]).eval()
    images = torch.rand(2, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    pred = mpp.predict(images, generator=torch.Generator().manual_seed(0))
    pos, kinds, pc, tc = mpp_mean_colours(pred)
    assert pos.shape == kinds.shape == (2, 24) and pc.shape == tc.shape == (2, 24, 1)
    for b, n in [(0, 0), (1, 5)]:  # true colour = bin centre of the patch's mean grey level
        r, c = divmod(int(pos[b, n]), 7)
        mean = float(images[b, 0, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4].mean())
        assert float(tc[b, n, 0]) == pytest.approx((int(mean * 8) + 0.5) / 8)
    assert set(torch.unique(pc * 8 - 0.5).round().long().tolist()) <= set(range(8))
    summary = inspect_model(model, images, tmp_path, mean=[0.5], std=[0.25], mpp=mpp, num_show=2)
    assert (tmp_path / "mpp_predictions.png").stat().st_size > 1000
    assert set(summary["mpp_shown_accuracy"]) == {"mask", "random", "kept"}


def write_shards(root: Path, n: int = 12) -> None:
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    name = "test-000000.tar"
    with wds.TarWriter(str(root / name)) as w:
        for i in range(n):
            img = np.zeros((28, 28), np.uint8)
            r, c = rng.integers(0, 20, size=2)
            img[r : r + 8, c : c + 8] = 255  # a bright square somewhere
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            w.write(
                {
                    "__key__": f"{i:06d}",
                    "png": buf.getvalue(),
                    "cls": str(i % 2).encode(),
                    "json": json.dumps({"source": f"synthetic/{i}"}).encode(),
                }
            )
    shard = ShardInfo(name, n, (root / name).stat().st_size, sha256_file(root / name))
    manifest = Manifest(
        splits={"test": SplitInfo(n, [shard])},
        class_names=["a", "b"],
        channels=1,
        image_size=[28, 28],
        mean=[0.1],
        std=[0.3],
    )
    write_manifest(root, manifest)


PNGS = ("embedding_filters", "position_similarity", "attention_distance", "attention_rollout")


def run_cli(*args: str, env_uri: str) -> None:
    cmd = [sys.executable, str(REPO / "evals" / "inspect_vit.py"), *args]
    env = {"MLFLOW_TRACKING_URI": env_uri, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_cli_random_init_writes_pngs(tmp_path):
    write_shards(tmp_path / "shards")
    out = tmp_path / "out"
    run_cli(
        "--random-init", "vit_tiny_patch16_224", "--patch-size", "4",
        "--data", str(tmp_path / "shards"), "--out", str(out),
        "--num-images", "6", "--num-show", "3", "--batch-size", "4", "--no-mlflow",
        env_uri="sqlite:///unused.db",
    )  # fmt: skip
    for name in (*PNGS, "mpp_predictions"):  # random init: MPP with an untrained head
        png = out / f"{name}.png"
        assert png.stat().st_size > 1000
        assert Image.open(png).size[0] > 200
    summary = json.loads((out / "inspect.json").read_text())
    assert summary["num_images"] == 6
    assert np.array(summary["mean_attention_distance_px"]).shape == (12, 3)
    assert not list(out.glob(".*tmp*"))  # no temporary files left behind


def load_cli():
    spec = importlib.util.spec_from_file_location("inspect_vit", REPO / "evals/inspect_vit.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_cli_run_dir_logs_to_mlflow_tagged_with_pretraining_run(tmp_path, monkeypatch):
    write_shards(tmp_path / "shards")
    run_dir = tmp_path / "run"
    kwargs = {"img_size": 28, "in_chans": 1, "patch_size": 4, "depth": 2}
    model = build_backbone("vit_tiny_patch16_224", **kwargs)
    export_backbone(
        model, run_dir / "export", arch="vit_tiny_patch16_224", kwargs=kwargs, mean=[0.1], std=[0.3]
    )
    (run_dir / "mlflow_run_id").write_text("pretrain123\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    load_cli().main(
        ["--backbone", str(run_dir), "--data", str(tmp_path / "shards"),
         "--out", str(tmp_path / "out"), "--num-images", "4", "--num-show", "2"]
    )  # fmt: skip
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("inspect")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.tags["ssl_vit.pretrain_run_id"] == "pretrain123"
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "inspect")}
    assert {f"inspect/{n}.png" for n in PNGS} <= logged
    hist = client.get_metric_history(run.info.run_id, "mean_attention_distance_px")
    assert sorted(m.step for m in hist) == [0, 1]


def test_mpp_head_is_read_from_the_export(tmp_path):
    """The trainer exports the objective beside the backbone; the CLI rebuilds MPP from it."""
    from ssl_vit.objectives.export import save_objective

    kw = {"img_size": 16, "in_chans": 1, "patch_size": 4, "depth": 1, "embed_dim": 32,
          "num_heads": 2}  # fmt: skip
    model = build_backbone("vit_tiny_patch16_224", **kw)
    obj = MaskedPatchPrediction(model, mean=[0.1], std=[0.3])
    with torch.no_grad():  # shift away from any fresh initialisation: "trained" weights
        for p in [obj.mask_token, *obj.head.parameters()]:
            p.add_(1.0)
    export = tmp_path / "export"
    export_backbone(model, export, arch="vit_tiny_patch16_224", kwargs=kw, mean=[0.1], std=[0.3])
    save_objective(obj, export, "mpp", {"patch_size": 4, "in_chans": 1})
    loaded, meta = load_backbone(tmp_path)
    objective = load_cli().load_mpp_objective(tmp_path, loaded, meta["mean"], meta["std"])
    assert objective is not None
    got = objective.state_dict()
    for k, v in obj.state_dict().items():
        torch.testing.assert_close(got[k], v, msg=k)
