"""A cascade fine-tune through evals/finetune.py (real DeepSpeed engine, checkpoints, resume,
MLflow) and evals/dynamic_vit.py on its export, on the real toy shards of conftest."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, run_cli
from mlflow.tracking import MlflowClient

from ssl_vit.evaluation.dynamic import StageOutputs, choose_thresholds, simulate
from ssl_vit.models import build_backbone, export_backbone

pytestmark = pytest.mark.slow

KW = {"img_size": 16, "in_chans": 1, "patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(shards: Path, run_dir: Path, db: Path, init: Path, steps: int) -> list[str]:
    return [
        "evals/finetune.py", "--config", "configs/fmnist_cascade.yaml", "--backbone", str(init),
        f"data.root={shards}", f"run.dir={run_dir}", f"tracking.uri=sqlite:///{db}",
        "model.img_size=16", "objective.cascade_sizes=[8]", "data.num_workers=1",
        "train.global_batch=32", "train.epochs=null", f"train.steps={steps}",
        "train.precision=fp32", "optim.lr=0.05", "optim.warmup_steps=2", "run.log_every=2",
        "run.checkpoint_every=2", "run.eval_every=4",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def cascade_run(tiny_shards, tmp_path_factory, mlflow_template) -> tuple[Path, Path, list[str]]:
    """A random 16-px ViT export (4x4 tokens), fine-tuned as a 2-stage cascade (8 px: 2x2)."""
    base = tmp_path_factory.mktemp("cascade")
    torch.manual_seed(0)
    init = export_backbone(
        build_backbone("vit_tiny_patch16_224", **KW), base / "init",
        arch="vit_tiny_patch16_224", kwargs=KW, mean=[0.3], std=[0.3],
    )  # fmt: skip
    run_dir, db = base / "run", base / "mlflow.db"
    shutil.copyfile(mlflow_template, db)  # a migrated store: its tables are made already
    args = _args(tiny_shards, run_dir, db, init, steps=4)
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, db, args


def test_cascade_finetune_exports_and_resumes(cascade_run):
    run_dir, db, args = cascade_run
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    assert all("train/cascade/acc_s0" in r and "train/cascade/acc_s1" in r for r in rows)
    assert json.loads((run_dir / "export" / "objective.json").read_text())["kind"] == "cascade"
    meta = json.loads((run_dir / "export" / "backbone.json").read_text())
    assert meta["token_grid"] == [4, 4]  # the finest stage is the run's backbone
    run_id = (run_dir / "mlflow_run_id").read_text().strip()

    # Same command, more steps: resumes from step 4, same MLflow run, no duplicated step.
    more = [a if a != "train.steps=4" else "train.steps=6" for a in args]
    proc = run_cli(more)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 4" in proc.stderr
    steps = [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6]
    assert (run_dir / "mlflow_run_id").read_text().strip() == run_id
    history = MlflowClient(f"sqlite:///{db}").get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [2, 4, 6]


def test_dynamic_vit_cli_on_the_cascade_export(cascade_run, tiny_shards, tmp_path):
    run_dir, db, _ = cascade_run
    out = tmp_path / "dyn"
    proc = run_cli(
        ["evals/dynamic_vit.py", "--backbone", str(run_dir), "--data", str(tiny_shards),
         "--out", str(out), "--workers", "0", "--batch-size", "32", "--speed-images", "64",
         "--repeats", "1", "--num-budgets", "4", "--tracking-uri", f"sqlite:///{db}"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["metrics"]["num_test"] == 128 and 0 < res["metrics"]["num_held_out"] < 30
    costs = res["stage_gflops"]
    assert len(costs) == 2 and 0 < costs[0] < costs[1]
    for p in res["budgets"]:  # each point fits its budget on held-out; shares sum to 1
        assert p["held_mean_flops"] <= p["budget_flops"] * (1 + 1e-9)
        assert sum(p["exit_share"]) == pytest.approx(1.0)
        reach = [costs[0], costs[0] + costs[1]]
        spent = sum(s * r for s, r in zip(p["exit_share"], reach, strict=True))
        assert p["gflops"] == pytest.approx(spent)
    assert (out / "accuracy_vs_gflops.png").stat().st_size > 1000
    run = MlflowClient(f"sqlite:///{db}").get_run(res["mlflow_run_id"])
    artifacts = {a.path for a in MlflowClient(f"sqlite:///{db}").list_artifacts(run.info.run_id)}
    assert {"results.json", "accuracy_vs_gflops.png"} <= artifacts
    # An export that is not a cascade: one line, exit 2.
    bad = run_cli(
        ["evals/dynamic_vit.py", "--backbone", str(run_dir.parent / "init"),
         "--data", str(tiny_shards), "--out", str(tmp_path / "x"), "--no-mlflow"]
    )  # fmt: skip
    assert bad.returncode == 2 and "not a cascade export" in bad.stderr


def test_thresholds_are_chosen_on_held_out_within_each_budget():
    """Known outputs: stage 0 is right exactly when confident; the choice must find that."""
    rng = np.random.default_rng(0)
    conf0 = rng.uniform(0.3, 1.0, 200)
    held = StageOutputs(
        np.stack([conf0, np.full(200, 0.9)], 1), np.stack([conf0 > 0.6, np.ones(200, bool)], 1)
    )
    costs = [1.0, 3.0]  # an image that reaches stage 1 costs 4
    chosen = choose_thresholds(held, costs, budgets=[1.0, 2.5, 4.0], grid=101)
    assert [c["budget_flops"] for c in chosen] == [1.0, 2.5, 4.0]
    assert chosen[0]["thresholds"][0] <= conf0.min()  # budget 1: everyone leaves at stage 0
    assert chosen[-1]["held_top1"] == 1.0  # all budget: the confident-and-right exit, rest on
    for c in chosen:
        r = simulate(held, c["thresholds"], costs)
        assert r["mean_flops"] <= c["budget_flops"] + 1e-9 and r["top1"] == c["held_top1"]


def test_cascade_under_zero3_on_two_ranks_exports_what_zero0_exports(cascade_run, tiny_shards):
    """Every stage's position embedding and [class] token are read in the cascade's forward,
    outside their ViT's: under ZeRO-3 (persistence 0: everything partitioned) they must be
    gathered, and the run must train exactly as ZeRO-0 does."""
    from safetensors.torch import load_file

    run_dir, db, args = cascade_run
    init = run_dir.parent / "init"
    exports = {}
    for stage in (0, 3):
        out = run_dir.parent / f"zero{stage}"
        cmd = [
            sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
            "--master_port", str(free_port()),
            *_args(tiny_shards, out, db, init, steps=4),
            f"train.zero_stage={stage}", "optim.eps=1e-6",
            "train.deepspeed={zero_optimization: {stage3_param_persistence_threshold: 0}}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        exports[stage] = load_file(str(out / "export" / "objective.safetensors"))
    assert exports[0].keys() == exports[3].keys()
    assert any("stages.0.vit.pos_embed" in k for k in exports[0])
    for name, w in exports[0].items():
        torch.testing.assert_close(exports[3][name], w, rtol=1e-4, atol=1e-5, msg=name)
