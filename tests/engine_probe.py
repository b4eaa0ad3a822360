"""Checks of our DeepSpeed wiring on a real engine, run by tests/test_zero.py in a fresh process
(a DeepSpeed engine needs a process group, which must not leak into the pytest process).

    python tests/engine_probe.py OUT_DIR   -> prints one JSON line of findings
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param
from safetensors.torch import load_file

from ssl_vit.config import load_config
from ssl_vit.engine.build import ModelSpec, export_run
from ssl_vit.engine.distributed import init_distributed
from ssl_vit.engine.optim import clips_in_step, deepspeed_config, make_optimizer
from ssl_vit.engine.trainer import MetricWindow, optimizer_step
from ssl_vit.models import build_backbone
from ssl_vit.objectives import build_objective

KW = {"img_size": 16, "in_chans": 1, "patch_size": 4, "depth": 2, "embed_dim": 32, "num_heads": 2}


def engine_for(stage: int, precision: str, global_batch: int, micro: int, *overrides: str):
    cfg = load_config(
        None, ["train.steps=10", f"train.global_batch={global_batch}", f"train.zero_stage={stage}",
               "optim.lr=1e-2", "optim.warmup_steps=1", *overrides],
    )  # fmt: skip
    torch.manual_seed(0)
    objective = build_objective(
        "mpp", build_backbone("vit_tiny_patch16_224", **KW), mean=[0.5], std=[0.25]
    )
    optimizer, schedule = make_optimizer(objective, cfg, 10)
    ds = deepspeed_config(cfg, 1, micro, global_batch // micro, precision)
    engine, *_ = deepspeed.initialize(model=objective, optimizer=optimizer, config=ds)
    return engine, optimizer, ds, cfg


def step(engine, optimizer, skip: bool, micro_batches: int = 1) -> None:
    for i in range(micro_batches):
        x = torch.rand(engine.train_micro_batch_size_per_gpu(), 1, 16, 16)
        loss, _ = engine(x, torch.zeros(len(x), dtype=torch.long))
        engine.backward(loss)
        if i == micro_batches - 1:
            optimizer.skip = skip
        engine.step()
        optimizer.skip = False


def masters(engine) -> list[torch.Tensor]:
    out = []
    for p in engine.module.parameters():
        m = safe_get_full_fp32_param(p)
        out.append((p if m is None else m).detach().float().clone())
    return out


def skip_under_zero2() -> dict:
    """A skipped step leaves every parameter group untouched (ZeRO-2 steps group by group)."""
    engine, optimizer, *_ = engine_for(2, "fp32", 8, 8)
    step(engine, optimizer, skip=False)
    before = masters(engine)
    step(engine, optimizer, skip=True)
    after_skip = masters(engine)
    step(engine, optimizer, skip=False)
    after_step = masters(engine)
    return {
        "throughput_timer": engine.tput_timer.config.enabled,  # it syncs the device every step
        "param_groups": len(optimizer.param_groups),
        "tensors_changed_by_skipped_step": sum(
            not torch.equal(a, b) for a, b in zip(before, after_skip, strict=True)
        ),
        "tensors_changed_by_applied_step": sum(
            not torch.equal(a, b) for a, b in zip(after_skip, after_step, strict=True)
        ),
    }


def bf16_export(out: Path) -> dict:
    """bf16 weights in the engine, 2 micro-batches accumulated: the export holds the fp32
    masters, not the bf16 working copy."""
    engine, optimizer, ds, _ = engine_for(0, "bf16", 8, 4)
    for _ in range(3):
        step(engine, optimizer, skip=False, micro_batches=2)
    spec = ModelSpec("vit_tiny_patch16_224", KW, 1, [0.5], [0.25])
    export_run(engine.module, spec, "mpp", {}, out, {}, rank=0)
    saved = load_file(str(out / "backbone.safetensors"))
    names = [n for n, _ in engine.module.backbone.named_parameters()]
    fp32 = {n: safe_get_full_fp32_param(p) for n, p in engine.module.backbone.named_parameters()}
    return {
        "optimizer": type(engine.optimizer).__name__,
        "ds_stage": ds["zero_optimization"]["stage"],
        "working_dtype": str(next(engine.module.parameters()).dtype),
        "export_dtypes": sorted({str(saved[n].dtype) for n in names}),
        "export_equals_master": all(torch.equal(saved[n], fp32[n].float().cpu()) for n in names),
        "export_off_bf16_grid": sum(
            not torch.equal(saved[n], saved[n].bfloat16().float()) for n in names
        ),
        "tensors": len(names),
    }


def clip_in_step_against_deepspeed() -> dict:
    """ZeRO-0 fp32, 2 micro-batches a step, a clip small enough to act at every step: the
    training step's own clip (optim.clips_in_step) and DeepSpeed's, from the same weights on
    the same batches and masks, through the real optimizer_step."""
    found = {}
    for who, extra in (("step", []), ("deepspeed", ["train.deepspeed={gradient_clipping: 0.05}"])):
        engine, optimizer, ds, cfg = engine_for(0, "fp32", 8, 4, "optim.grad_clip=0.05", *extra)
        clip = cfg.optim.grad_clip if clips_in_step(cfg, "fp32") and not extra else 0.0
        window, norms, start = MetricWindow(engine.device, 8), [], masters(engine)
        data = torch.Generator().manual_seed(1)
        for i in range(3):
            x = torch.randint(0, 256, (8, 1, 16, 16), generator=data, dtype=torch.uint8)
            torch.manual_seed(100 + i)  # the same MPP masks both ways
            labels = torch.zeros(8, dtype=torch.long)
            step = optimizer_step(engine, optimizer, x, labels, micro=4, autocast=False,
                                  window=window, want_grad_norm=True, clip=clip)  # fmt: skip
            norms.append(step.grad_norm)
        found[who] = {"engine_clip": ds["gradient_clipping"], "step_clip": clip,
                      "norms": norms, "start": start, "weights": masters(engine)}  # fmt: skip
    ours, theirs = found["step"], found["deepspeed"]
    return {
        "engine_clip": [ours["engine_clip"], theirs["engine_clip"]],
        "step_clip": [ours["step_clip"], theirs["step_clip"]],
        "norms": [ours["norms"], theirs["norms"]],
        "max_weight_diff": max(float((a - b).abs().max())
                               for a, b in zip(ours["weights"], theirs["weights"], strict=True)),
        "moved": sum(not torch.equal(a, b)
                     for a, b in zip(ours["weights"], ours["start"], strict=True)),
    }  # fmt: skip


if __name__ == "__main__":
    init_distributed()
    found = {"skip": skip_under_zero2(), "bf16": bf16_export(Path(sys.argv[1])),
             "clip": clip_in_step_against_deepspeed()}  # fmt: skip
    print(json.dumps(found))
