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


def test_config_errors_answer_before_torch_loads(tmp_path):
    """Validation and the data checks import neither torch nor timm (seconds on a small
    machine): a bad value or shard set is reported at once, and every kind the config accepts
    is one the objectives' registry builds."""
    import subprocess
    import sys

    from ssl_vit.config import OBJECTIVE_KINDS
    from ssl_vit.objectives import OBJECTIVES

    assert tuple(OBJECTIVES) == OBJECTIVE_KINDS
    probe = (
        "import sys\n"
        "from ssl_vit.config import load_config\n"
        "from ssl_vit.engine.cli import main\n"
        f"for kind in {OBJECTIVE_KINDS!r}:\n"
        "    load_config(None, [f'objective.kind={kind}', 'model.img_size=56', 'train.steps=3'])\n"
        f"code = main('mpp', 'x', ['data.root={tmp_path}', 'train.steps=3', '--check'])\n"
        "assert code == 2, code\n"
        "print(sorted(m for m in ('torch', 'timm', 'deepspeed', 'mlflow') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "manifest.json: not found" in proc.stderr
    assert proc.stdout.strip() == "[]"
