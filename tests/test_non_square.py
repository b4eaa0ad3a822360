"""Images that are not square (photographs, scans): a shard set of 20 x 24 and 24 x 20 images
made by make_shards trains, in RAM and streamed alike, and evaluates end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli
from PIL import Image
from test_train_e2e import overrides

from ssl_vit.data.manifest import load_manifest
from ssl_vit.data.memory import MemoryTrainLoader
from ssl_vit.data.stream import TrainLoader, make_train_loader


def _photos(root: Path, h: int, w: int, n: int = 96) -> Path:
    """n RGB images of h x w in 3 class folders; the class sets the mean colour."""
    rng = np.random.default_rng(h * 100 + w)
    for i in range(n):
        label = i % 3
        img = rng.integers(0, 80, (h, w, 3), dtype=np.uint8)
        img[..., label] += 120
        path = root / f"class{label}" / f"img{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(path)
    return root


@pytest.fixture(scope="module", params=[(20, 24), (24, 20)], ids=["wide", "tall"])
def shards(request, tmp_path_factory) -> Path:
    h, w = request.param
    base = tmp_path_factory.mktemp(f"photos{h}x{w}")
    out = base / "shards"
    proc = run_cli(["data_prep/make_shards.py", str(_photos(base / "src", h, w)), str(out),
                    "--test-fraction", "0.25", "--workers", "1"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert load_manifest(out).image_size == [h, w]
    return out


def _epoch(loader) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*loader, strict=True)
    return torch.cat(xs), torch.cat(ys)


def test_in_ram_and_streamed_give_the_same_images(shards):
    """Without augmentation both paths take the central square, resized; with it, both crop
    the whole non-square image to img_size squares."""
    kw = dict(global_batch=8, num_workers=1, img_size=16, seed=0, augment=False)
    ram = make_train_loader(shards, "train", in_memory=True, **kw)
    streamed = make_train_loader(shards, "train", in_memory=False, **kw)
    assert isinstance(ram, MemoryTrainLoader) and isinstance(streamed, TrainLoader)
    (xr, yr), (xs, ys) = _epoch(ram), _epoch(streamed)
    assert xr.shape[1:] == xs.shape[1:] == (3, 16, 16)
    # The same pixels but for resampling (torch vs PIL): each image's nearest neighbour on the
    # other path is its twin, but for the few samples past the last full batch, which each
    # path leaves out of its epoch by its own order.
    left_out = ram.num_samples - len(xr)
    dist = torch.cdist(xr.flatten(1).float(), xs.flatten(1).float()) / xr[0].numel() ** 0.5
    twins, twin = dist.min(1).values < 2.0, dist.argmin(1)
    assert twins.sum() >= len(xr) - left_out
    assert len(set(twin[twins].tolist())) == twins.sum()  # one twin each
    assert torch.equal(yr[twins], ys[twin[twins]])  # with the same label
    aug = make_train_loader(shards, "train", in_memory=True, **{**kw, "augment": True})
    xa, _ = _epoch(aug)
    assert xa.shape[1:] == (3, 16, 16)


@pytest.mark.slow
def test_pretrain_knn_probe_and_finetune(shards, tmp_path, mlflow_db):
    pre = tmp_path / "pre"
    size = ["model.img_size=16", "model.patch_size=4", "train.global_batch=16"]
    args = overrides(shards, pre, mlflow_db, "train.steps=4", *size)
    proc = run_cli(["pipelines/mpp_pretrain.py", *args])  # data.in_memory=auto: held in RAM
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "in RAM" in proc.stderr
    for script in ("evals/knn.py", "evals/linear_probe.py"):
        out = tmp_path / f"{Path(script).stem}.json"
        proc = run_cli([script, "--backbone", str(pre), "--data", str(shards), "--out", str(out),
                        "--tracking-uri", f"sqlite:///{mlflow_db}"])  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(out.read_text())
    ft = tmp_path / "ft"
    args = [
        a
        for a in overrides(shards, ft, mlflow_db, "train.epochs=2", *size)
        if a != "train.epochs=null" and not a.startswith(("optim.lr", "model.kwargs"))
    ]
    proc = run_cli(["evals/finetune.py", "--config", "configs/fmnist_finetune.yaml",
                    "--backbone", str(pre), *args, "model.img_size=20", "optim.lr=0.05",
                    "optim.warmup_steps=2", "data.holdout_fraction=0.1"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((ft / "export" / "backbone.json").read_text())
    assert meta["kwargs"]["img_size"] == 20 and meta["token_grid"] == [5, 5]
