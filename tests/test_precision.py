"""train.precision=auto on CPU: fp32 without native bf16, else the faster of fp32 and bf16
autocast, measured on the real model (ssl_vit.engine.precision.resolve_precision)."""

from __future__ import annotations

import logging

import pytest
import torch

from ssl_vit.engine import precision
from ssl_vit.engine.precision import BF16_MIN_SPEEDUP, measure_step_seconds, resolve_precision
from ssl_vit.models import build_backbone
from ssl_vit.objectives.mpp import MaskedPatchPrediction


@pytest.fixture(scope="module")
def mpp_step():
    """A timer of real MPP training steps of a small ViT, recording what it measured."""
    torch.manual_seed(0)
    bb = build_backbone("vit_tiny_patch16_224", img_size=28, in_chans=1, patch_size=4,
                        depth=2, embed_dim=64, num_heads=2)  # fmt: skip
    objective = MaskedPatchPrediction(bb, mean=[0.5], std=[0.25])
    x, y = torch.rand(32, 1, 28, 28), torch.zeros(32, dtype=torch.long)
    calls: list[tuple[bool, float]] = []

    def timer(autocast: bool) -> float:
        seconds = measure_step_seconds(objective, x, y, autocast, repeats=2)
        calls.append((autocast, seconds))
        return seconds

    return objective, timer, calls


def test_measuring_leaves_the_model_as_it_was(mpp_step):
    objective, timer, _ = mpp_step
    before = {k: v.clone() for k, v in objective.state_dict().items()}
    assert timer(False) > 0 and timer(True) > 0
    assert all(p.grad is None for p in objective.parameters())
    for k, v in objective.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_without_native_bf16_fp32_and_no_measurement(mpp_step, monkeypatch):
    _, timer, calls = mpp_step
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU branch, anywhere
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    calls.clear()
    assert resolve_precision("auto", timer) == "fp32" and calls == []
    assert resolve_precision("bf16", timer) == "bf16" and calls == []  # asked for: kept


def test_with_native_bf16_the_measured_faster_wins(mpp_step, monkeypatch, caplog):
    _, timer, calls = mpp_step
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    calls.clear()
    with caplog.at_level(logging.INFO, logger="ssl_vit.train"):
        choice = resolve_precision("auto", timer)
    assert [a for a, _ in calls] == [False, True, False, True]  # interleaved rounds
    fp32 = min(t for a, t in calls if not a)  # the fastest round of each
    bf16 = min(t for a, t in calls if a)
    assert choice == ("bf16" if bf16 * BF16_MIN_SPEEDUP < fp32 else "fp32")
    assert f"{1e3 * fp32:.1f} ms in fp32, {1e3 * bf16:.1f} ms in bf16" in caplog.text
    # Handicap one side by a second: the choice follows the measurement, not the CPU flags.
    assert resolve_precision("auto", lambda a: timer(a) + (1.0 if a else 0.0)) == "fp32"
    assert resolve_precision("auto", lambda a: timer(a) + (0.0 if a else 1.0)) == "bf16"
    assert resolve_precision("auto", None) == "fp32"  # nothing measured: the safe choice
