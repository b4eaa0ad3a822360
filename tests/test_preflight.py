"""`--check` answers what a preflight is for: the run's length in epochs of this data, how often
an epoch reads the shard set, the loader against the cores, the configured ZeRO stage beside
the lowest that fits, and the largest micro batch that fits."""

from __future__ import annotations

import re

from conftest import run_cli


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
