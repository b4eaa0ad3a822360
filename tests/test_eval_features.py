"""Frozen features (pools, cache) and the evals end to end on real shards with a random backbone."""

import argparse
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from ssl_vit.data.manifest import Manifest, ShardInfo, SplitInfo, write_manifest
from ssl_vit.features import (
    cached,
    extract_features,
    random_backbone,
    raw_pixels_backbone,
    resolve_pool,
)
from ssl_vit.io import sha256_file

REPO = Path(__file__).resolve().parents[1]
TINY = dict(embed_dim=32, depth=4, num_heads=2)  # a 4-block ViT small enough for a shared CPU


def _tiny_backbone(seed: int = 0):
    return random_backbone(
        "vit_tiny_patch16_224",
        img_size=16,
        in_chans=1,
        patch_size=4,
        mean=[0.5],
        std=[0.25],
        seed=seed,
        **TINY,
    )


def test_cache_hit_on_second_call(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return np.arange(12, dtype=np.float32).reshape(4, 3), np.array([0, 1, 0, 1])

    fields = {"backbone": "sha256:abc", "manifest_sha256": "def", "split": "train", "pool": "cls"}
    first = cached(tmp_path, fields, compute)
    second = cached(tmp_path, fields, compute)
    assert not first.cache_hit and second.cache_hit and len(calls) == 1
    np.testing.assert_array_equal(first.features, second.features)
    assert second.labels.dtype == np.int64 and second.labels.tolist() == [0, 1, 0, 1]
    other = cached(tmp_path, {**fields, "pool": "mean"}, compute)  # another key: recomputed
    assert not other.cache_hit and len(calls) == 2
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(f.endswith(".safetensors") for f in files)  # no temp files


def test_pools_shapes_and_lastn_ends_with_cls():
    bb = _tiny_backbone()
    g = torch.Generator().manual_seed(0)
    imgs = torch.randint(0, 256, (6, 1, 16, 16), dtype=torch.uint8, generator=g)
    batches = [(imgs[:4], torch.tensor([0, 1, 2, 3])), (imgs[4:], torch.tensor([4, 5]))]
    cls, y = extract_features(bb, batches, pool="cls", device=torch.device("cpu"))
    mean, _ = extract_features(bb, batches, pool="mean", device=torch.device("cpu"))
    last, _ = extract_features(bb, batches, pool="lastn", n_last=3, device=torch.device("cpu"))
    assert cls.shape == (6, 32) and mean.shape == (6, 32) and last.shape == (6, 96)
    assert y.tolist() == [0, 1, 2, 3, 4, 5] and cls.dtype == np.float32
    np.testing.assert_allclose(last[:, -32:], cls, atol=1e-5)  # last block + final norm = cls
    assert not np.allclose(cls, mean)
    # Resizing to the model's input happens inside: 32x32 images give the same shapes.
    big = [(torch.randint(0, 256, (2, 1, 32, 32), dtype=torch.uint8), torch.tensor([0, 1]))]
    assert extract_features(bb, big, device=torch.device("cpu"))[0].shape == (2, 32)


def test_auto_pool_follows_what_the_pretraining_trained():
    bb = _tiny_backbone()
    assert resolve_pool(bb, "auto") == "mean"  # random init: [class] is as untrained as any
    for objective, pool in [("mpp", "mean"), ("supervised", "cls"), ("joint", "cls"),
                            ("finetune", "cls")]:  # fmt: skip
        bb.meta["objective"] = objective
        assert resolve_pool(bb, "auto") == pool, objective
        assert resolve_pool(bb, "lastn") == "lastn"  # an explicit choice is kept
    pixels = raw_pixels_backbone(img_size=16, in_chans=1, mean=[0.5], std=[0.25])
    assert resolve_pool(pixels, "cls") == "pixels"


def test_raw_pixels_features_are_the_normalised_images():
    bb = raw_pixels_backbone(img_size=8, in_chans=1, mean=[0.5], std=[0.25])
    imgs = torch.randint(0, 256, (3, 1, 8, 8), dtype=torch.uint8)
    f, _ = extract_features(bb, [(imgs, torch.tensor([0, 1, 2]))], device=torch.device("cpu"))
    expected = ((imgs.float() / 255 - 0.5) / 0.25).flatten(1).numpy()
    np.testing.assert_allclose(f, expected, atol=1e-5)


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _write_shards(root: Path, sizes: dict[str, int], classes: int = 3) -> Path:
    """A tiny labelled grey shard set: class c images are bright in a different third."""
    rng = np.random.default_rng(0)
    splits = {}
    root.mkdir(parents=True, exist_ok=True)
    for split, n in sizes.items():
        name = f"{split}-000000.tar"
        with wds.TarWriter(str(root / name)) as w:
            for i in range(n):
                c = i % classes
                arr = rng.integers(0, 60, (16, 16), dtype=np.uint8)
                arr[:, c * 5 : c * 5 + 5] += 180
                w.write(
                    {
                        "__key__": f"{split}{i:05d}",
                        "png": _png(arr),
                        "cls": str(c).encode(),
                        "json": json.dumps({"source": "t"}).encode(),
                    }
                )
        p = root / name
        info = ShardInfo(name, n, p.stat().st_size, sha256_file(p))
        splits[split] = SplitInfo(n, [info])
    m = Manifest(
        splits=splits,
        class_names=[f"c{i}" for i in range(classes)],
        channels=1,
        image_size=[16, 16],
        mean=[0.3],
        std=[0.3],
    )
    write_manifest(root, m)
    return root


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"evals_{name}", REPO / "evals" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_random_backbone_evals_end_to_end_on_real_shards(tmp_path, capsys):
    data = _write_shards(tmp_path / "shards", {"train": 60, "test": 30})
    common = [
        "--random-init",
        "vit_tiny_patch16_224",
        "--patch-size",
        "4",
        "--data",
        str(data),
        "--workers",
        "0",
        "--batch-size",
        "16",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--no-mlflow",
        "--device",
        "cpu",
    ]
    # Random ViT-Ti features of 3 separable patterns: all three evals beat chance (1/3).
    knn = _load_script("knn")
    assert knn.main([*common, "--k", "5", "10", "--out", str(tmp_path / "knn.json")]) == 0
    res = json.loads((tmp_path / "knn.json").read_text())
    assert res["metrics"]["num_train"] == 60 and res["metrics"]["num_test"] == 30
    assert res["metrics"]["knn_top1@k=5"] > 0.6
    assert "from backbone" in capsys.readouterr().err
    few = _load_script("fewshot")
    assert (
        few.main([*common, "--shots", "1", "5", "--seeds", "2", "--out", str(tmp_path / "f.json")])
        == 0
    )
    assert "from cache" in capsys.readouterr().err  # same backbone + shards + pool: reused
    few_m = json.loads((tmp_path / "f.json").read_text())["metrics"]
    assert few_m["fewshot_5shot_mean"] > 0.5
    assert few_m["l2_selection"] == "loo" and len(few_m["fewshot_5shot_l2_all"]) == 2
    assert few_m["fewshot_1shot_l2_source"].startswith("median alpha chosen at 5-shot")
    probe = _load_script("linear_probe")
    assert probe.main([*common, "--l2", "1e-3", "1e-1", "--out", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["metrics"]["probe_top1"] > 0.6
    assert json.loads((tmp_path / "p.json").read_text())["params"]["pool"] == "mean"  # auto
    # The raw-pixel baseline through the same CLI: the patterns are separable in pixel space.
    pixels = ["--raw-pixels", *common[2:], "--k", "5", "--out", str(tmp_path / "px.json")]
    assert knn.main(pixels) == 0
    res = json.loads((tmp_path / "px.json").read_text())
    assert res["params"]["pool"] == "pixels" and res["metrics"]["dim"] == 256
    assert res["metrics"]["knn_top1@k=5"] > 0.9


@pytest.mark.slow
def test_run_dir_cli_links_mlflow_run(tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    from ssl_vit.models import export_backbone

    data = _write_shards(tmp_path / "shards", {"train": 30, "test": 12})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment(
        "pretrain", artifact_location=(tmp_path / "artifacts").as_uri()
    )  # artifacts stay in tmp
    parent = client.create_run(exp).info.run_id
    run_dir = tmp_path / "run"
    bb = _tiny_backbone()
    kwargs = {"img_size": 16, "in_chans": 1, "patch_size": 4, **TINY}
    export_backbone(
        bb.model,
        run_dir / "export",
        arch="vit_tiny_patch16_224",
        kwargs=kwargs,
        mean=[0.3],
        std=[0.3],
    )
    (run_dir / "mlflow_run_id").write_text(parent + "\n")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    cmd = [
        sys.executable,
        "evals/knn.py",
        "--backbone",
        str(run_dir),
        "--data",
        str(data),
        "--workers",
        "0",
        "--k",
        "3",
        "--cache-dir",
        str(tmp_path / "c"),
        "--out",
        str(tmp_path / "r.json"),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "knn_top1@k=3" in done.stdout
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["pretrain_run_id"] == parent and res["params"]["backbone_id"].startswith("sha256:")
    run = client.get_run(res["mlflow_run_id"])
    assert run.data.tags["pretrain_run_id"] == parent
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert "knn_top1_at_k3" in run.data.metrics
    mlflow.set_tracking_uri(None)


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    knn = _load_script("knn")
    data = _write_shards(tmp_path / "shards", {"train": 6, "test": 3})
    argv = ["--backbone", str(tmp_path / "nope"), "--data", str(data), "--no-mlflow"]
    with pytest.raises(SystemExit) as stop:  # refused while parsing, before torch loads
        knn.run_main(knn.main, argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error: argument --backbone: " in lines[0], lines
    assert "nope: no such backbone folder" in lines[0]
    argv = ["--random-init", "vit_tiny_patch16_224", "--data", str(data), "--test-split", "val"]
    argv += ["--no-mlflow", "--workers", "0", "--cache-dir", str(tmp_path / "cache")]
    assert knn.run_main(knn.main, argv) == 2
    err = capsys.readouterr().err
    assert "manifest.json" in err and "'val'" in err


def test_feature_cache_key_changes_with_backbone_seed():
    a, b = _tiny_backbone(0), _tiny_backbone(1)
    assert a.ident != b.ident and a.ident == _tiny_backbone(0).ident


def test_train_indices_fit_on_those_rows_only(tiny_shards, tmp_path, capsys):
    """--train-indices: kNN's gallery (and the probe's fitting set) is the listed samples of the
    training split, their rows of the split's features in manifest order; the test split is
    scored whole; the results name the file's digest and count; a bad file is one line."""
    from ssl_vit.data.manifest import load_manifest
    from ssl_vit.data.tar_reader import iter_samples
    from ssl_vit.evaluation.cli import add_common_args, add_train_indices_arg, features_from_args

    listed = list(range(3, 512, 9))  # 57 samples across the 4 shards
    subset = tmp_path / "subset.json"
    subset.write_text(json.dumps(listed))
    common = ["--random-init", "vit_tiny_patch16_224", "--patch-size", "4",
              "--model-kwargs", json.dumps(TINY), "--data", str(tiny_shards), "--workers", "0",
              "--cache-dir", str(tmp_path / "cache"), "--no-mlflow", "--device", "cpu"]  # fmt: skip

    def features(*extra: str):
        p = argparse.ArgumentParser()
        add_common_args(p)
        add_train_indices_arg(p, "fit")
        return features_from_args(p.parse_args([*common, *extra]))

    _, whole, test = features()
    _, part, test_again = features("--train-indices", str(subset))
    shards = load_manifest(tiny_shards).split("train").shards  # the labels in manifest order
    labels = np.array([int(s["cls"]) for sh in shards for s in iter_samples(tiny_shards / sh.name)])
    np.testing.assert_array_equal(whole.labels, labels)
    np.testing.assert_array_equal(part.labels, labels[listed])
    np.testing.assert_array_equal(part.features, whole.features[listed])
    np.testing.assert_array_equal(test.features, test_again.features)  # scored as before

    knn = _load_script("knn")
    out = tmp_path / "knn.json"
    assert knn.main([*common, "--train-indices", str(subset), "--k", "5", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["metrics"]["num_train"] == len(listed) and res["metrics"]["num_test"] == 128
    assert res["metrics"]["knn_top1@k=5"] > 0.35  # 4 brightness classes: chance is 0.25
    assert res["params"]["train_indices_count"] == len(listed)
    assert res["params"]["train_indices_sha256"] == sha256_file(subset)
    probe = _load_script("linear_probe")
    out = tmp_path / "probe.json"
    argv = [*common, "--train-indices", str(subset), "--cv-folds", "3", "--out", str(out)]
    assert probe.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["params"]["train_indices_count"] == len(listed) and res["params"]["cv_folds"] == 3
    assert sum(res["metrics"]["cv_fold_sizes"]) == len(listed)  # the folds split the subset
    assert len(res["metrics"]["probe_cv_fold_top1"]) == 3

    capsys.readouterr()
    for body, why in (("[3, 512]", "index 512, past the 512 samples"), ("[1, 1]", "not sorted")):
        subset.write_text(body)
        assert knn.run_main(knn.main, [*common, "--train-indices", str(subset)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --train-indices: {subset}: ")
        assert why in lines[0]
