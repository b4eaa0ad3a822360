"""Every preset in configs/ loads, passes validation and starts with the command that runs it;
the Fashion-MNIST pretraining presets build their objective on real shards and take a step."""

from pathlib import Path

import pytest
import torch

from ssl_vit.config import load_config, validate
from ssl_vit.data.manifest import load_manifest
from ssl_vit.engine.build import build_from_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_preset_loads_validates_and_names_its_command(path):
    lines = path.read_text().splitlines()
    command = lines[0]
    for line in lines[1:]:  # a long command continues its first line with a backslash
        if not command.endswith("\\"):
            break
        command += line
    assert command.startswith(("# python ", "# deepspeed ")) and path.name in command
    validate(load_config(path))


@pytest.mark.parametrize(
    "path", [p for p in CONFIGS if p.name.startswith("fmnist_") and "finetune" not in p.name
             and "cascade" not in p.name], ids=lambda p: p.name,
)  # fmt: skip
def test_fmnist_pretraining_presets_build_and_step(path, tiny_shards):
    cfg = load_config(path)
    objective, _, _ = build_from_config(cfg, load_manifest(tiny_shards))
    size = cfg.model.img_size
    loss, _ = objective(torch.rand(2, 1, size, size), torch.zeros(2, dtype=torch.long))
    loss.backward()
    assert torch.isfinite(loss)
