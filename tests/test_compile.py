"""When training compiles its blocks (train.compile), and what it compiles."""

from __future__ import annotations

import pytest
import torch

from ssl_vit.config import ConfigError, load_config
from ssl_vit.engine import compile as comp
from ssl_vit.models import build_backbone

CPU = torch.device("cpu")


def test_auto_compiles_long_gpu_runs_only(monkeypatch):
    """auto: on a GPU for long runs without ZeRO-3; off on CPU, where it measured slower."""
    gpu = torch.device("cuda")  # only its type is read
    monkeypatch.setattr(comp, "_cpu_compiler", lambda: "/usr/bin/g++")
    long, short = comp.AUTO_MIN_IMAGES, comp.AUTO_MIN_IMAGES - 1
    assert comp.resolve_compile("auto", long, 0, gpu) == (True, f"auto: on, {long} images")
    assert comp.resolve_compile("auto", short, 0, gpu) == (
        False, f"auto: off, {short} images < {long} do not pay it back")  # fmt: skip
    assert comp.resolve_compile("auto", long, 3, gpu)[0] is False  # ZeRO-3
    assert comp.resolve_compile("auto", long, 0, CPU)[0] is False
    assert comp.resolve_compile(True, 1, 0, CPU) == (True, "train.compile=true")
    assert comp.resolve_compile(False, long, 0, gpu)[0] is False
    monkeypatch.setattr(comp, "_cpu_compiler", lambda: None)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        comp.resolve_compile(True, long, 0, CPU)
    assert comp.resolve_compile(True, long, 0, gpu)[0] is True  # Triton, not a C++ compiler


@pytest.mark.parametrize(
    "override, message",
    [("train.compile=sometimes", "choose true, false or auto"),
     ("train.zero_stage=3", "does not run under ZeRO-3")],
)  # fmt: skip
def test_bad_compile_settings_are_refused_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/fmnist_vit_tiny_mpp.yaml", ["train.compile=true", override])


def test_compile_blocks_keeps_the_state_dict():
    model = build_backbone("vit_tiny_patch16_224", img_size=16, patch_size=4, in_chans=1,
                           embed_dim=32, depth=3, num_heads=2)  # fmt: skip
    keys = list(model.state_dict())
    assert comp.compile_blocks(model) == 3
    assert list(model.state_dict()) == keys  # checkpoints and exports unchanged
