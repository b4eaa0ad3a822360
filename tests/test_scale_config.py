"""Scale-out configuration without a launch: batch split per world size, precision choice,
DeepSpeed config for half precision, the FAISS install choice, feature-cache identity."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import ROOT, run_cli

from ssl_vit.config import CHOICES, Config, ConfigError, load_config, local_batch
from ssl_vit.engine.optim import deepspeed_config
from ssl_vit.engine.precision import gpu_precision
from ssl_vit.features import random_backbone, split_features


def cfg_with(*overrides: str):
    return load_config(None, ["train.steps=10", *overrides])


@pytest.mark.parametrize(
    ("world", "expect"),
    [(1, (4096, 256, 16)), (8, (512, 256, 2)), (32, (128, 128, 1)), (48, None)],
)
def test_micro_batch_is_a_cap_that_fits_every_launch(world, expect):
    cfg = cfg_with("train.global_batch=4096", "train.micro_batch=256")
    if expect is None:  # 4096 over 48 ranks does not split
        with pytest.raises(ConfigError, match="not divisible by the 48 ranks"):
            local_batch(cfg, world)
    else:
        assert local_batch(cfg, world) == expect


def test_micro_batch_cap_picks_the_largest_divisor():
    cfg = cfg_with("train.global_batch=96", "train.micro_batch=64")
    assert local_batch(cfg, 1) == (96, 48, 2)


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_every_choice_key_refuses_a_value_outside_its_choices(key):
    section, name = key.split(".")
    default = getattr(getattr(Config(), section), name)
    assert default in CHOICES[key]  # the default is a choice
    bad = 7 if type(default) is int else "nope"  # of the field's type, not a choice
    with pytest.raises(ConfigError, match=rf"^{re.escape(f'{key}={bad!r}')}: choose .+ or "):
        cfg_with(f"{key}={bad}")


@pytest.mark.parametrize(
    ("override", "key"),
    [("train.compile=1", "train.compile"), ("data.in_memory=0", "data.in_memory")],
)
def test_a_number_is_not_taken_for_true_or_false(override, key):
    # YAML reads 1 as an int, and 1 == True: a plain `in` check would let it through
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=\d: choose true, false or auto"):
        cfg_with(override)


def test_imagenet_preset_checks_for_its_header_launch_sizes():
    """The preset's header runs 4 nodes x 8 GPUs: 128 images per rank under a 256 cap."""
    proc = run_cli(["pipelines/mpp_pretrain.py", "--config", "configs/vit_b16_imagenet_mpp.yaml",
                    "--check", "--no-data", "--world-sizes", "1,8,32"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "1 rank(s): per-rank batch 4096 = micro 256 x 16" in out
    assert "8 rank(s): per-rank batch 512 = micro 256 x 2" in out
    assert "32 rank(s): per-rank batch 128 = micro 128 x 1" in out
    assert "85.8M parameters, 197 tokens" in out  # ViT-B/16 at 224 plus [class]
    gib = [float(g) for g in re.findall(r"= +([\d.]+) GiB per GPU", out)]
    assert len(gib) == 12 and gib[0] == gib[3]  # one rank: nothing to partition
    assert gib[4] > gib[5] > gib[6] > gib[7]  # 8 ranks: each stage partitions more
    assert "ok: configs/vit_b16_imagenet_mpp.yaml is valid for 1, 8, 32 rank(s)" in out


def test_gpu_precision_needs_real_bf16():
    assert gpu_precision((7, 0)) == "fp16"  # V100: bf16 only emulated
    assert gpu_precision((7, 5)) == "fp16"  # T4
    assert gpu_precision((8, 0)) == "bf16"  # A100
    assert gpu_precision((9, 0)) == "bf16"  # H100


def test_half_precision_accumulates_and_reduces_in_fp32():
    cfg = cfg_with("train.global_batch=64", "train.zero_stage=0")
    ds = deepspeed_config(cfg, 2, 8, 4, "bf16")
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["communication_data_type"] == "fp32"
    assert ds["zero_optimization"]["stage"] == 1  # DeepSpeed's fp32-accumulating bf16 path
    fp32 = deepspeed_config(cfg, 2, 8, 4, "fp32")
    assert "data_types" not in fp32 and fp32["zero_optimization"]["stage"] == 0
    extra = cfg_with("train.deepspeed={zero_optimization: {stage3_param_persistence_threshold: 0}}")
    merged = deepspeed_config(extra, 1, 8, 1, "fp32")["zero_optimization"]
    assert merged == {"stage": 0, "stage3_param_persistence_threshold": 0}


def test_faiss_cpu_and_gpu_are_never_installed_together():
    """Both wheels write one `faiss` package: base deps carry neither, each extra at most one,
    and the Makefile installs exactly one."""
    text = (ROOT / "pyproject.toml").read_text()

    def faiss_of(reqs: str) -> set[str]:
        return set(re.findall(r'"(faiss[\w-]*)', reqs))

    base = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert faiss_of(base) == set()
    extras_text = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = {m[0]: faiss_of(m[1]) for m in re.findall(r"^([\w-]+) = \[(.*)\]$", extras_text, re.M)}
    assert extras["cpu"] == {"faiss-cpu"} and extras["gpu-cu12"] == {"faiss-gpu-cu12"}
    assert all(len(v) <= 1 for v in extras.values())
    installs = re.findall(r"pip install -q -e '\.\[([\w,]+)\]'", (ROOT / "Makefile").read_text())
    faiss_per_install = [
        len(set().union(*(extras.get(e, set()) for e in line.split(",")))) for line in installs
    ]
    assert faiss_per_install[0] == 1 and max(faiss_per_install) == 1  # setup: exactly one


def test_feature_cache_keeps_fp32_and_bf16_apart(tiny_shards, tmp_path):
    backbone = random_backbone("vit_tiny_patch16_224", img_size=16, in_chans=1, patch_size=4,
                               mean=[0.5], std=[0.25], seed=0, embed_dim=32, depth=1,
                               num_heads=2)  # fmt: skip
    kw = dict(cache_dir=tmp_path, num_workers=0, device=torch.device("cpu"))
    fp32 = split_features(backbone, tiny_shards, "test", bf16=False, **kw)
    bf16 = split_features(backbone, tiny_shards, "test", bf16=True, **kw)
    again = split_features(backbone, tiny_shards, "test", bf16=False, **kw)
    assert not fp32.cache_hit and not bf16.cache_hit and again.cache_hit
    assert not torch.equal(torch.from_numpy(fp32.features), torch.from_numpy(bf16.features))
