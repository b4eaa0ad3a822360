"""`--check` answers what a preflight is for: the run's length in epochs of this data, how often
an epoch reads the shard set, the loader against the cores, the configured ZeRO stage beside
the lowest that fits, and the largest micro batch that fits."""

from __future__ import annotations

import json
import re

import pytest
from conftest import run_cli

from ssl_vit.config import ConfigError, load_config
from ssl_vit.data.holdout import held_out_indices


def test_check_reports_length_reads_stage_and_micro_batch(tiny_shards):
    proc = run_cli(["pipelines/mpp_pretrain.py", "--config", "configs/fmnist_vit_tiny_mpp.yaml",
                    f"data.root={tiny_shards}", "train.global_batch=64", "train.epochs=null",
                    "train.steps=40", "train.zero_stage=2", "model.img_size=16",
                    "model.patch_size=4", "data.num_workers=3", "--check",
                    "--world-sizes", "1,4"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # 512 training samples at 64 a step: 8 steps an epoch, so 40 steps are 5 epochs
    assert "512 of the 512 'train' samples trained on; 8 steps per epoch" in out
    assert "length: train.steps=40 = 5.00 epochs of this data" in out
    assert re.search(r"reads: each epoch reads the shard set 1\.0\d times \(4 rank\(s\) x 3 "
                     r"workers = 12 loader streams\)", out)  # fmt: skip
    assert "data.num_workers=3 per rank, 4 processes per rank" in out
    assert re.search(r"ZeRO-2: .*<- configured \(train.zero_stage\)", out)
    assert re.search(r"ZeRO-0: .*<- lowest stage that fits", out)
    largest = [
        int(n) for n in re.findall(r"largest micro batch that fits 80 GiB at ZeRO-2: (\d+)", out)
    ]
    assert len(largest) == 2 and all(n > 64 for n in largest)  # a tiny ViT: far more than 64


def test_check_counts_the_subset_file_and_refuses_a_bad_one(tiny_shards, tmp_path):
    """data.subset_file: `--check` counts the listed samples as those trained on; a listed
    held-out sample stops the start in one line naming the file; the keys that would fight
    over which samples train are refused before any data is read."""
    held = set(held_out_indices(512, 0.02).tolist())
    listed = [i for i in range(512) if i not in held][::5][:100]
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(listed))
    bad.write_text(json.dumps(sorted([*listed[:10], min(held)])))
    base = ["pipelines/mpp_pretrain.py", "--config", "configs/fmnist_vit_tiny_mpp.yaml",
            f"data.root={tiny_shards}", "train.global_batch=32", "train.epochs=2",
            "model.img_size=16", "model.patch_size=4", "data.holdout_fraction=0.02",
            "--check"]  # fmt: skip
    proc = run_cli([*base, f"data.subset_file={good}"])
    assert proc.returncode == 0, proc.stderr
    assert "100 of the 512 'train' samples trained on; 3 steps per epoch" in proc.stdout
    proc = run_cli([*base, f"data.subset_file={bad}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"data.subset_file: {bad}: lists 1 held-out index(es) (first {min(held)};" in last

    preset = "configs/fmnist_vit_tiny_mpp.yaml"
    with pytest.raises(ConfigError, match=r"data.subset_file=.* and data.train_fraction=0.5 "):
        load_config(preset, [f"data.subset_file={good}", "data.train_fraction=0.5"])
    with pytest.raises(ConfigError, match="set data.missing_shards=error"):
        load_config(preset, [f"data.subset_file={good}", "data.missing_shards=skip"])
    assert load_config(preset, [f"data.subset_file={good}"]).data.subset_file == str(good)
