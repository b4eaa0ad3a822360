"""End-to-end pretraining with the real DeepSpeed engine and launcher and a real MLflow store.

Tiny ViTs on the 16x16 toy shards of conftest; each test is a few dozen steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_cli
from mlflow.tracking import MlflowClient

from ssl_vit.data.holdout import held_out_indices

pytestmark = pytest.mark.slow

TINY = [
    "model.img_size=16",
    "model.patch_size=4",
    "model.kwargs={depth: 2, embed_dim: 32, num_heads: 2}",
    "data.num_workers=1",
    "data.crop_scale=[0.5, 1.0]",
    "train.global_batch=32",
    "train.epochs=null",
    "train.precision=fp32",
    "optim.lr=2e-3",
    "optim.warmup_steps=4",
    "run.log_every=2",
]


def overrides(shards: Path, run_dir: Path, db: Path, *extra: str) -> list[str]:
    return [
        f"data.root={shards}",
        f"run.dir={run_dir}",
        f"tracking.uri=sqlite:///{db}",
        *TINY,
        *extra,
    ]


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pretrain_exports_tracks_and_resumes(tiny_shards, tmp_path, mlflow_db):
    run_dir, db = tmp_path / "run", mlflow_db
    args = overrides(tiny_shards, run_dir, db, "train.steps=8", "run.checkpoint_every=4")
    proc = run_cli(["pipelines/mpp_pretrain.py", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]

    # Run directory contract: resolved config, checkpoints with `latest`, export, run id.
    assert (run_dir / "config.yaml").read_text().startswith("# mpp_pretrain.py")
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000008"
    meta = json.loads((run_dir / "export" / "backbone.json").read_text())
    assert meta["arch"] == "vit_tiny_patch16_224" and meta["kwargs"]["img_size"] == 16
    assert (run_dir / "export" / "objective.safetensors").is_file()
    assert (run_dir / "loss_curve.png").stat().st_size > 1000
    assert metric_steps(run_dir) == [2, 4, 6, 8]
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the counters of each line follow the step (global batch 32)
    assert [(r["train/samples_seen"], r["train/skipped_steps"]) for r in rows] == [
        (32 * r["step"], 0) for r in rows
    ]
    run_id = (run_dir / "mlflow_run_id").read_text().strip()

    # The exported backbone loads and gives features.
    from ssl_vit.models import load_backbone
    from ssl_vit.objectives.export import load_objective

    model, _ = load_backbone(run_dir)
    assert load_objective(run_dir, model, meta["mean"], meta["std"]) is not None

    assert "torch.compile off (train.compile=false)" in proc.stderr

    # Same command, more steps: resumes at 8, same MLflow run, no duplicated metric step. It
    # resumes compiled: each block compiled in place keeps the eager model's checkpoint keys.
    args[args.index("train.steps=8")] = "train.steps=12"
    proc = run_cli(["pipelines/mpp_pretrain.py", *args, "train.compile=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch.compile on: each block (train.compile=true)" in proc.stderr
    assert metric_steps(run_dir) == [2, 4, 6, 8, 10, 12]
    assert (run_dir / "mlflow_run_id").read_text().strip() == run_id

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("ssl-vit").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    run = client.get_run(run_id)
    assert run.data.params["objective.corrupt_ratio"] == "0.5"
    assert run.data.params["model.patch_size"] == "4"
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [2, 4, 6, 8, 10, 12]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "ds_config.json", "export", "loss_curve.png"} <= artifacts


def test_a_run_without_matplotlib_exports_tracks_and_registers(tiny_shards, tmp_path, mlflow_db):
    """A node without matplotlib: the loss plot is one warning, and the run still exports,
    logs the export, ends FINISHED in MLflow and registers the model."""
    shadow = tmp_path / "site" / "matplotlib"  # found ahead of the real one: its import fails
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    run_dir = tmp_path / "run"
    args = overrides(tiny_shards, run_dir, mlflow_db, "train.steps=4", "tracking.register_as=tiny")
    env = {"PYTHONPATH": os.pathsep.join([str(shadow.parent), str(ROOT)])}
    proc = run_cli(["pipelines/mpp_pretrain.py", *args], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "not drawn" in ln]
    assert len(lines) == 1 and "loss plot not drawn (ImportError: No module named" in lines[0]
    assert (run_dir / "export" / "backbone.json").is_file()
    assert not (run_dir / "loss_curve.png").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{mlflow_db}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED"
    assert "export" in {a.path for a in client.list_artifacts(run.info.run_id)}
    (version,) = client.search_model_versions("name='tiny'")
    assert version.run_id == run.info.run_id


def test_a_relaunch_that_changes_the_config_is_on_the_run(tiny_shards, tmp_path, mlflow_db):
    """MLflow's params never change: a second launch with a lower optim.lr keeps launch 1's
    params, and the change is on the same run (tag, artifact, log line), not dropped."""
    run_dir, db = tmp_path / "run", mlflow_db
    args = overrides(tiny_shards, run_dir, db, "train.steps=4")
    first = run_cli(["pipelines/mpp_pretrain.py", *args])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "launch 1" not in first.stderr  # nothing to say of a first launch
    new_key = "train.deepspeed={wall_clock_breakdown: false}"  # a param launch 1 did not have
    args = [*args, "train.steps=6", "optim.lr=1e-3", new_key]
    second = run_cli(["pipelines/mpp_pretrain.py", *args])
    assert second.returncode == 0, second.stderr[-3000:]
    line = next(ln for ln in second.stderr.splitlines() if "launch 2 of" in ln)
    assert f"launch 2 of {run_dir} (from step 4) changes optim.lr: 0.002 -> 0.001; " in line
    assert "tag ssl_vit.launch.2.changed and artifact launches/launch-2.yaml" in line
    assert "MLflow refused" not in second.stderr

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("ssl-vit").experiment_id])
    rid = run.info.run_id
    assert (run_dir / "mlflow_run_id").read_text().strip() == rid
    assert run.data.params["optim.lr"] == "0.002" and run.data.params["train.steps"] == "4"
    assert run.data.params["train.deepspeed.wall_clock_breakdown"] == "False"
    changed = run.data.tags["ssl_vit.launch.2.changed"]
    assert changed.startswith("optim.lr: 0.002 -> 0.001; train.steps: 4 -> 6; "), changed
    assert run.data.tags["ssl_vit.launches"] == "2"
    files = {a.path for a in client.list_artifacts(rid, "launches")}
    assert files == {"launches/launch-1.yaml", "launches/launch-2.yaml"}
    record = yaml.safe_load(
        Path(client.download_artifacts(rid, "launches/launch-2.yaml", str(tmp_path))).read_text()
    )
    assert record["launch"] == 2 and record["step"] == 4
    assert record["changed"]["optim.lr"] == {"old": 0.002, "new": 0.001}
    # config.yaml (here and in MLflow) is the current launch's; launch 1's is kept beside it
    saved = yaml.safe_load((run_dir / "config.yaml").read_text().split("\n", 1)[1])
    assert saved["optim"]["lr"] == 0.001
    kept = yaml.safe_load((run_dir / "launches" / "launch-1.yaml").read_text())
    assert kept["config"]["optim"]["lr"] == 0.002
    logged = client.download_artifacts(rid, "config.yaml", str(tmp_path / "mlflow"))
    assert yaml.safe_load(Path(logged).read_text())["optim"]["lr"] == 0.001


def test_two_ranks_match_one_rank_with_twice_the_batch(tmp_path):
    """2 ranks x 16 == 1 rank x 32 in a deterministic setting: every sample identical, no
    augmentation, supervised loss (no random masks), so batch composition cannot differ."""
    import numpy as np
    from conftest import write_idx

    img = np.zeros((1, 16, 16), np.uint8)
    img[0, 2:8, 2:8] = 200
    write_idx(tmp_path / "idx", "train", np.repeat(img, 128, 0), np.zeros(128, np.uint8))
    write_idx(tmp_path / "idx", "t10k", img, np.zeros(1, np.uint8))
    shards = tmp_path / "shards"
    assert run_cli(["data_prep/make_shards.py", str(tmp_path / "idx"), str(shards),
                    "--class-names", "a,b"]).returncode == 0  # fmt: skip
    common = ["train.steps=6", "data.augment=false", "objective.kind=supervised"]

    one = overrides(shards, tmp_path / "one", tmp_path / "db1", *common)
    assert run_cli(["pipelines/supervised_pretrain.py", *one]).returncode == 0

    two = overrides(shards, tmp_path / "two", tmp_path / "db2", *common)
    port = str(free_port())
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                "--master_port", port]  # fmt: skip
    proc = subprocess.run(
        [*launcher, "pipelines/supervised_pretrain.py", *two],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [2, 4, 6]
    assert (
        json.loads((tmp_path / "two" / "ds_config.json").read_text())[
            "train_micro_batch_size_per_gpu"
        ]
        == 16
    )
    for ra, rb in zip(a, b, strict=True):
        assert rb["train/loss"] == pytest.approx(ra["train/loss"], rel=1e-3, abs=1e-5)
        assert rb["train/grad_norm"] == pytest.approx(ra["train/grad_norm"], rel=1e-3, abs=1e-6)


def test_two_node_rehearsal_with_no_ssh(tiny_shards, tmp_path, mlflow_db):
    """What a scheduler does: one launcher per node, `--no_ssh --node_rank`, here on localhost."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    run_dir = tmp_path / "run"
    args = overrides(tiny_shards, run_dir, mlflow_db, "train.steps=4")
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deepspeed.launcher.runner",
                "--hostfile",
                str(hostfile),
                "--no_ssh",
                "--node_rank",
                str(node),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                "pipelines/mpp_pretrain.py",
                *args,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] == 16  # 32 over 2 "nodes"
    assert metric_steps(run_dir) == [2, 4]


def test_finetune_at_higher_resolution_beats_its_start(tiny_shards, tmp_path, mlflow_db):
    """Pretrain 16 px, fine-tune at 24 px (pos-embed interpolated) with SGD + zero-init head."""
    pre = tmp_path / "pre"
    args = overrides(tiny_shards, pre, mlflow_db, "train.steps=4")
    assert run_cli(["pipelines/mpp_pretrain.py", *args]).returncode == 0
    ft = tmp_path / "ft"
    args = [
        a
        for a in overrides(tiny_shards, ft, mlflow_db, "train.epochs=3")
        if a != "train.epochs=null" and not a.startswith(("optim.lr", "model.kwargs"))
    ]
    proc = run_cli(
        ["evals/finetune.py", "--config", "configs/fmnist_finetune.yaml", "--backbone", str(pre),
         *args, "model.img_size=24", "optim.lr=0.05", "optim.warmup_steps=4",
         "run.export_epochs=[1,2,5]"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((ft / "results.json").read_text())
    # The zero-initialised head starts by predicting class 0 for every image.
    from conftest import toy_images

    start = float((toy_images(128, 16, 4, seed=1)[1] == 0).mean())
    # The paper's held-out 2% of train (15 of 512 here) chooses; test is only reported.
    assert result["selection_split"].startswith("train (held-out 0.02")
    assert result["report_split"] == "test"
    steps_per_epoch = (512 - len(held_out_indices(512, 0.02))) // 32  # held-out never trains
    assert [h[0] for h in result["history"]] == [steps_per_epoch * e for e in (1, 2, 3)]
    _assert_chosen_on_selection_split(result)
    # The checkpoint chosen on held-out data (export_best) beats the start on test.
    assert result["selected_top1"] > start + 0.1, (start, result)
    meta = json.loads((ft / "export_best" / "backbone.json").read_text())
    assert meta["kwargs"]["img_size"] == 24 and meta["token_grid"] == [6, 6]
    assert meta["step"] == result["best_step"] and meta["selection_split"] == "holdout"
    # Snapshots for a curve against training length: the weights at the end of epochs 1 and 2.
    for epoch in (1, 2):
        snap = json.loads((ft / f"export_epoch{epoch}" / "backbone.json").read_text())
        assert snap["step"] == steps_per_epoch * epoch and snap["epoch"] == epoch
    assert not (ft / "export_epoch5").exists()  # an epoch the 3-epoch run never reaches


def _assert_chosen_on_selection_split(result: dict) -> None:
    """best_step is the first step with the top held-out accuracy; test only reported at it."""
    hist = result["history"]
    best = max(hist, key=lambda h: (h[1], -h[0]))
    assert result["best_step"] == best[0] and result["selection_best_top1"] == best[1]
    assert result["selected_top1"] == best[2] and result["final_top1"] == hist[-1][2]


def test_finetune_lr_sweep_chooses_on_held_out_nested_in_mlflow(tiny_shards, tmp_path, mlflow_db):
    """--sweep optim.lr=...: one run per value, nested MLflow runs, the held-out best chosen,
    and a rerun skips what is done."""
    pre = tmp_path / "pre"
    db = mlflow_db
    assert run_cli(["pipelines/mpp_pretrain.py",
                    *overrides(tiny_shards, pre, db, "train.steps=2")]).returncode == 0  # fmt: skip
    sweep = tmp_path / "sweep"
    args = [
        a
        for a in overrides(tiny_shards, sweep, db, "train.epochs=1")
        if a != "train.epochs=null" and not a.startswith(("optim.lr", "model.kwargs"))
    ]
    cmd = ["evals/finetune.py", "--config", "configs/fmnist_finetune.yaml", "--backbone", str(pre),
           "--sweep", "optim.lr=0.0001,0.05", *args, "model.img_size=16", "optim.warmup_steps=2",
           "data.holdout_fraction=0.1", "run.eval_every=7"]  # fmt: skip
    proc = run_cli(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((sweep / "results.json").read_text())
    assert res["sweep"] == {"key": "optim.lr", "values": [0.0001, 0.05]}
    runs = res["runs"]
    assert [r["run_dir"] for r in runs] == [
        str(sweep / "optim.lr=0.0001"),
        str(sweep / "optim.lr=0.05"),
    ]
    for r in runs:
        _assert_chosen_on_selection_split(r)
        child = json.loads((Path(r["run_dir"]) / "results.json").read_text())
        assert child["selection_best_top1"] == r["selection_best_top1"]
    best = max(runs, key=lambda r: r["selection_best_top1"])
    assert res["chosen"] == {"optim.lr": best["value"]} and res["chosen_run_dir"] == best["run_dir"]
    assert res["selected_top1"] == best["selected_top1"]  # the chosen run's test top-1, reported
    assert res["selection_split"].startswith("train (held-out 0.1")
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    parent = client.get_run(res["mlflow_run_id"])
    assert parent.data.tags["chosen.optim.lr"] == str(best["value"])
    for r in runs:
        child = client.get_run(r["mlflow_run_id"])
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.params["optim.lr"] == str(r["value"])
    # Resumable: the rerun of a grown grid trains only the new value; the finished ones, same
    # settings, are kept as they are and chosen from again.
    mtimes = [
        (sweep / d / "results.json").stat().st_mtime_ns
        for d in ("optim.lr=0.0001", "optim.lr=0.05")
    ]
    grown = [a if a != "optim.lr=0.0001,0.05" else "optim.lr=0.0001,0.05,0.01" for a in cmd]
    more = run_cli(grown)
    assert more.returncode == 0, more.stderr[-3000:]
    assert more.stderr.count("finished before, kept") == 2
    assert [
        (sweep / d / "results.json").stat().st_mtime_ns
        for d in ("optim.lr=0.0001", "optim.lr=0.05")
    ] == mtimes
    res3 = json.loads((sweep / "results.json").read_text())
    assert [r["value"] for r in res3["runs"]] == [0.0001, 0.05, 0.01]
    assert res3["runs"][:2] == runs  # the kept values' results, as the first sweep chose from
    tags = client.get_run(res["mlflow_run_id"]).data.tags  # the same parent run, continued
    assert tags["sweep.values"] == "[0.0001, 0.05, 0.01]"
    assert tags["chosen.optim.lr"] == str(res3["chosen"]["optim.lr"])
    assert (sweep / "optim.lr=0.01" / "results.json").is_file()


def test_sweep_retrains_a_value_whose_settings_changed(tmp_path):
    """A value's directory from a sweep with other settings moves aside; the same stays."""
    from ssl_vit.config import load_config, save_config
    from ssl_vit.engine.sweep import _set_aside_if_changed

    out = tmp_path / "optim.lr=0.01"
    out.mkdir()
    base = [f"run.dir={out}", "optim.lr=0.01"]
    save_config(load_config("configs/fmnist_finetune.yaml", base), out / "config.yaml", "# h")
    tracked = load_config("configs/fmnist_finetune.yaml", [*base, "tracking.parent_run_id=abc"])
    _set_aside_if_changed(out, tracked)  # tracking does not change what was trained
    assert out.is_dir()
    compiled = load_config("configs/fmnist_finetune.yaml", [*base, "train.compile=true"])
    _set_aside_if_changed(out, compiled)  # nor does compiling the same arithmetic
    assert out.is_dir()
    changed = load_config("configs/fmnist_finetune.yaml", [*base, "train.epochs=3"])
    _set_aside_if_changed(out, changed)
    assert not out.exists()
    assert [p.name.split(".stale-")[0] for p in tmp_path.iterdir()] == ["optim.lr=0.01"]


def test_finetune_on_a_subset_file_trains_its_samples_only(tiny_shards, tmp_path, mlflow_db):
    """data.subset_file in a real run: the epoch is the listed samples (64 at batch 32: 2
    steps), the held-out 2% still chooses, and the log names the file's digest."""
    held = set(held_out_indices(512, 0.02).tolist())
    subset = tmp_path / "subset.json"
    subset.write_text(json.dumps([i for i in range(512) if i not in held][3::7][:64]))
    ft = tmp_path / "ft"
    args = [a for a in overrides(tiny_shards, ft, mlflow_db, "train.epochs=2")
            if a != "train.epochs=null"]  # fmt: skip
    proc = run_cli(["evals/finetune.py", "--config", "configs/fmnist_finetune.yaml",
                    "model.init_from=null", *args, f"data.subset_file={subset}",
                    "optim.warmup_steps=1"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((ft / "results.json").read_text())
    assert [h[0] for h in result["history"]] == [2, 4]
    assert result["selection_split"].startswith("train (held-out 0.02")
    digest = hashlib.sha256(subset.read_bytes()).hexdigest()
    assert f"training on the 64 samples of {subset} (sha256 {digest})" in proc.stderr
