"""MLP-Mixer beside ViT, end to end on real shards: MPP pretraining through the DeepSpeed
engine, then every evaluator (kNN, linear probe, few-shot, fine-tuning) and the inspection,
whose attention plots must say "not applicable" rather than fail. Pretraining and fine-tuning
are launches of their own; the frozen evaluators and the inspection run their `main` in this
process (their command lines are launched in test_eval_features, test_inspect and
test_bad_inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from test_eval_features import _load_script

pytestmark = pytest.mark.slow

MIXER = [
    "model.arch=mixer_s16_224", "model.img_size=16", "model.patch_size=4",
    "model.kwargs={embed_dim: 32, num_blocks: 2}", "data.num_workers=1",
    "train.global_batch=32", "train.epochs=null", "train.precision=fp32",
    "optim.warmup_steps=2", "run.log_every=2",
]  # fmt: skip


def test_mixer_through_mpp_every_evaluator_and_inspect(
    tiny_shards: Path, tmp_path: Path, mlflow_db: Path, capsys: pytest.CaptureFixture
):
    db = f"sqlite:///{mlflow_db}"
    pre = tmp_path / "pre"
    proc = run_cli(
        ["pipelines/mpp_pretrain.py", "--config", "configs/fmnist_vit_tiny_mpp.yaml",
         f"data.root={tiny_shards}", f"run.dir={pre}", f"tracking.uri={db}", "train.steps=6",
         "optim.lr=2e-3", *MIXER]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((pre / "export" / "backbone.json").read_text())
    assert meta["arch"] == "mixer_s16_224" and meta["objective"] == "mpp"
    rows = [json.loads(ln) for ln in (pre / "metrics.jsonl").read_text().splitlines()]
    assert 0 <= rows[-1]["train/mpp/acc"] <= 1  # MPP predicts the corrupted patches' colours

    common = ["--backbone", str(pre), "--data", str(tiny_shards), "--workers", "0",
              "--cache-dir", str(tmp_path / "cache"), "--tracking-uri", db]  # fmt: skip
    evals = {
        "knn": ["--k", "5"],
        "linear_probe": ["--l2", "1e-3", "1e-1"],
        "fewshot": ["--shots", "1", "5", "--seeds", "2"],
    }
    keys = {"knn": "knn_top1@k=5", "linear_probe": "probe_top1", "fewshot": "fewshot_5shot_mean"}
    for name, extra in evals.items():
        out = tmp_path / f"{name}.json"
        assert _load_script(name).main([*common, *extra, "--out", str(out)]) == 0, name
        res = json.loads(out.read_text())
        # No [class] token: --pool auto takes the mean of the tokens (the Mixer's own pooling).
        assert res["params"]["pool"] == "mean" and res["params"]["arch"] == "mixer_s16_224"
        assert 0.25 < res["metrics"][keys[name]] <= 1.0, (name, res["metrics"])  # chance 0.25

    ft = tmp_path / "ft"
    done = run_cli(
        ["evals/finetune.py", "--config", "configs/fmnist_finetune.yaml", "--backbone", str(pre),
         f"data.root={tiny_shards}", f"run.dir={ft}", f"tracking.uri={db}",
         "model.img_size=16",  # a Mixer's token-mixing MLPs are sized by N: no resolution change
         "data.num_workers=1", "train.global_batch=32", "train.epochs=2",
         "train.precision=fp32", "optim.lr=0.05", "optim.warmup_steps=4"]
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((ft / "results.json").read_text())
    assert result["selection_split"].startswith("train (held-out") and result["selected_top1"]
    assert json.loads((ft / "export" / "backbone.json").read_text())["arch"] == "mixer_s16_224"

    insp = tmp_path / "inspect"
    capsys.readouterr()
    _load_script("inspect_vit").main(
        ["--backbone", str(pre), "--data", str(tiny_shards), "--out", str(insp),
         "--num-images", "16", "--no-mlflow"]
    )  # fmt: skip
    summary = json.loads((insp / "inspect.json").read_text())
    na = summary["not_applicable"]
    assert set(na) == {"attention_distance", "attention_rollout", "position_similarity"}
    assert all(v.startswith("not applicable") for v in na.values())
    assert "attention_distance: not applicable" in capsys.readouterr().out
    assert {"filters", "mpp"} <= set(summary["pngs"])  # what does apply is still drawn
    assert not (insp / "attention_distance.png").exists()
