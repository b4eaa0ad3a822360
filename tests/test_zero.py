"""ZeRO stages 0-3 on two real ranks (`deepspeed --num_gpus 2`, CPU accelerator, gloo).

Each stage trains the joint objective (MPP and supervised on one backbone, with the in-training
evaluation), stage 3 is SIGKILLed mid-run and resumed (ssl-vit's resume has one path for every
stage above 0; stage 3 shards the most), and every export must equal what ZeRO-0 exports for
the same seed. ZeRO-3's persistence threshold is 0, so the position embedding and [class] token
are partitioned like a ViT-B's would be. The test split has 513 images: the two ranks'
evaluation shards differ in batch count (256 vs 257 at batch 256).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli, toy_images, write_idx
from test_train_e2e import TINY as E2E_TINY

from ssl_vit.engine.optim import lr_lambda
from ssl_vit.models import load_backbone

pytestmark = pytest.mark.slow

STEPS, WARMUP, LR = 16, 4, 2e-3
TINY = [
    *(o for o in E2E_TINY if not o.startswith(("optim.lr=", "optim.warmup_steps=", "run.log"))),
    f"train.steps={STEPS}",
    f"optim.lr={LR}",
    f"optim.warmup_steps={WARMUP}",
    # The attention key bias has a mathematically zero gradient (softmax ignores a constant
    # per query); with Adam's default eps the update of that noise is full-size and its sign
    # follows the reduction order of each stage. A larger eps keeps it at noise level.
    "optim.eps=1e-6",
    "objective.kind=joint",
    "run.log_every=2",
    "run.checkpoint_every=4",
    "run.eval_every=8",
    "data.holdout_fraction=0.1",  # export_best is chosen on a held-out part of train
    "train.deepspeed={zero_optimization: {stage3_param_persistence_threshold: 0}}",
]


@pytest.fixture(scope="module")
def zero_shards(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("zero")
    for prefix, n, seed in (("train", 256, 0), ("t10k", 513, 1)):
        write_idx(base / "idx", prefix, *toy_images(n, 16, 4, seed))
    out = base / "shards"
    proc = run_cli(["data_prep/make_shards.py", str(base / "idx"), str(out), "--shard-size",
                    "64", "--class-names", "a,b,c,d", "--workers", "1"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def db(tmp_path_factory, mlflow_template) -> Path:
    """One MLflow store for the module, migrated already (a copy of the suite's template)."""
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    shutil.copyfile(mlflow_template, path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(shards: Path, run_dir: Path, db: Path, stage: int, ranks: int = 2) -> list[str]:
    return [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
        "--master_port", str(free_port()),
        "pipelines/supervised_pretrain.py", f"data.root={shards}", f"run.dir={run_dir}",
        f"tracking.uri=sqlite:///{db}", f"train.zero_stage={stage}", *TINY,
    ]  # fmt: skip


def shm_left_by(cmd: list[str]) -> list[Path]:
    """DeepSpeed's CPU shared-memory workspaces of this launch still in /dev/shm (RAM)."""
    port = cmd[cmd.index("--master_port") + 1]
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert shm_left_by(cmd) == []  # 66 MB of RAM per rank, until reboot
    return proc


def kill_after_checkpoint(cmd: list[str], run_dir: Path, at: str) -> str:
    """Start the launch, SIGKILL every process of it once `latest` reaches `at`."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= at:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert shm_left_by(cmd) == []  # gone even when the run is killed
    return latest.read_text().strip()


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def export_of(run_dir: Path, sub: str = "export") -> dict[str, torch.Tensor]:
    model, meta = load_backbone(run_dir / sub)  # plain timm, strict load
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_zero_stages_train_resume_and_export_what_zero0_exports(zero_shards, db, tmp_path):
    ref = tmp_path / "zero0"
    run(launch(zero_shards, ref, db, 0))
    want = export_of(ref)
    ref_rows = rows(ref)
    for r in ref_rows:  # the schedule follows the step count exactly
        assert r["train/lr"] == pytest.approx(LR * lr_lambda(r["step"], WARMUP, STEPS,
                                                             "cosine", 0.0))  # fmt: skip

    for stage in (1, 2, 3):
        run_dir = tmp_path / f"zero{stage}"
        cmd = launch(zero_shards, run_dir, db, stage)
        if stage < 3:
            run(cmd)
        else:  # resume reads each rank's shard of parameters and optimizer state
            killed_at = kill_after_checkpoint(cmd, run_dir, "step00000008")
            done = run(cmd)
            assert f"resumed from step {int(killed_at[4:])}" in done.stderr
        got = rows(run_dir)
        assert [r["step"] for r in got] == list(range(2, STEPS + 1, 2)), stage
        for a, b in zip(ref_rows, got, strict=True):
            for key in ("train/loss", "train/lr", "train/sup/acc"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (stage, a["step"], key)
        exported = export_of(run_dir)
        assert exported.keys() == want.keys()
        for name, w in want.items():
            torch.testing.assert_close(exported[name], w, rtol=1e-4, atol=1e-5, msg=name)
        best = json.loads((run_dir / "export_best" / "backbone.json").read_text())
        assert best["objective"] == "joint"  # --pool auto then reads [class], as trained
        results = json.loads((run_dir / "results.json").read_text())
        assert [h[0] for h in results["history"]] == [8, 16]
        assert results["history"] == json.loads((ref / "results.json").read_text())["history"]

    # A ZeRO run resumed by another number of ranks goes through DeepSpeed's universal
    # checkpoint (tests/test_elastic.py trains on after it). With no step left to train, the
    # new export must be the 2-rank run's exactly, and no metric line changes.
    before = (tmp_path / "zero2" / "metrics.jsonl").read_text()
    want = export_of(tmp_path / "zero2")
    done = run(launch(zero_shards, tmp_path / "zero2", db, 2, ranks=1))
    assert "world size 2 -> 1: converted to a universal checkpoint" in done.stderr
    assert (tmp_path / "zero2" / "metrics.jsonl").read_text() == before
    exported = export_of(tmp_path / "zero2")
    assert all(torch.equal(exported[name], w) for name, w in want.items())


def test_node_local_run_dirs_are_refused_at_start(zero_shards, tmp_path):
    """Two "nodes" whose run.dir resolves to different local folders (relative path, other
    working directories): without the check, each would checkpoint and resume on its own."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    port = str(free_port())
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile),
             "--no_ssh", "--node_rank", str(node), "--master_addr", "127.0.0.1",
             "--master_port", port, str(ROOT / "pipelines" / "mpp_pretrain.py"),
             f"data.root={zero_shards}", "run.dir=run", f"tracking.uri=sqlite:///{cwd}/db",
             *TINY[:-2], "objective.kind=mpp"],
            cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    line = "cannot see the run directory that rank 0 wrote; put run.dir on storage"
    assert any(line in e and "rank 1 on" in e for e in errs), errs[0][-2000:]
    assert not (tmp_path / "node0" / "run" / "checkpoints").exists()


def test_engine_skip_and_bf16_export(tmp_path):
    """On a real engine: a skipped step touches no parameter group under ZeRO-2 (which steps
    the optimizer group by group), and a bf16 engine exports its fp32 master weights."""
    proc = run_cli(["tests/engine_probe.py", str(tmp_path / "export")],
                   env={"PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    skip = found["skip"]
    assert skip["throughput_timer"] is False  # DeepSpeed's: a GPU sync at every step
    assert skip["param_groups"] >= 2  # decay and no-decay groups
    assert skip["tensors_changed_by_skipped_step"] == 0
    assert skip["tensors_changed_by_applied_step"] > 0
    bf16 = found["bf16"]
    assert bf16["working_dtype"] == "torch.bfloat16"
    assert bf16["optimizer"] == "BF16_Optimizer" and bf16["ds_stage"] >= 1  # fp32 accumulation
    assert bf16["export_dtypes"] == ["torch.float32"] and bf16["export_equals_master"]
    assert bf16["export_off_bf16_grid"] > bf16["tensors"] // 2  # not rounded to bf16
    # ZeRO-0 fp32: the step clips (DeepSpeed's clip off) and trains as DeepSpeed's clip does.
    clip = found["clip"]
    assert clip["engine_clip"] == [0.0, 0.05] and clip["step_clip"] == [0.05, 0.0]
    ours, theirs = clip["norms"]
    assert all(n > 0.05 for n in ours)  # the clip acted at every step
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert clip["moved"] > 0 and clip["max_weight_diff"] < 1e-5
