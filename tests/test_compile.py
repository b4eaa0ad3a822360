"""When training compiles its blocks (train.compile), and what it compiles."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from mlflow.tracking import MlflowClient

from ssl_vit.config import ConfigError, load_config
from ssl_vit.engine import compile as comp
from ssl_vit.models import build_backbone

CPU = torch.device("cpu")


def test_auto_compiles_long_gpu_runs_and_measures_on_cpu(monkeypatch):
    """auto: on a GPU for long runs without ZeRO-3; on a CPU with a C++ compiler, a trial."""
    gpu = torch.device("cuda")  # only its type is read
    monkeypatch.setattr(comp, "_cpu_compiler", lambda: "/usr/bin/g++")
    long, short = comp.AUTO_MIN_IMAGES, comp.AUTO_MIN_IMAGES - 1
    assert comp.resolve_compile("auto", long, 0, gpu) == ("on", f"auto: on, {long} images")
    assert comp.resolve_compile("auto", short, 0, gpu) == (
        "off", f"auto: off, {short} images < {long} do not pay it back")  # fmt: skip
    assert comp.resolve_compile("auto", long, 3, gpu)[0] == "off"  # ZeRO-3
    assert comp.resolve_compile("auto", 1, 0, CPU)[0] == "trial"  # the launch decides the length
    assert comp.resolve_compile("auto", long, 3, CPU)[0] == "off"
    assert comp.resolve_compile(True, 1, 0, CPU) == ("on", "train.compile=true")
    assert comp.resolve_compile(False, long, 0, gpu)[0] == "off"
    monkeypatch.setattr(comp, "_cpu_compiler", lambda: None)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        comp.resolve_compile(True, long, 0, CPU)
    assert comp.resolve_compile("auto", long, 0, CPU) == (
        "off", "auto: off, no C++ compiler for Inductor's CPU kernels")  # fmt: skip
    assert comp.resolve_compile(True, long, 0, gpu)[0] == "on"  # Triton, not a C++ compiler


class _Clock:
    """time.perf_counter for the trial: each step takes `eager` or `compiled` seconds."""

    def __init__(self, trial: comp.CompileTrial, eager: float, compiled: float) -> None:
        self.trial, self.eager, self.compiled, self.now = trial, eager, compiled, 0.0

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.compiled if self.trial.compiled else self.eager


def _tiny_backbone():
    return build_backbone("vit_tiny_patch16_224", img_size=16, patch_size=4, in_chans=1,
                          embed_dim=32, depth=2, num_heads=2)  # fmt: skip


@pytest.mark.parametrize("eager_s, compiled_s, keeps", [(0.2, 0.1, True), (0.1, 0.2, False)])
def test_trial_times_both_ways_and_keeps_the_faster(monkeypatch, eager_s, compiled_s, keeps):
    model = _tiny_backbone()
    first = 7  # a resumed launch: the trial counts its steps from there
    trial = comp.start_trial("trial", model, first, first + comp.TRIAL_MIN_STEPS, rank=0)
    clock = _Clock(trial, eager_s, compiled_s)
    monkeypatch.setattr(comp.time, "perf_counter", clock)
    results, compiled_at = [], None
    for step in range(first + 1, first + 2 * (comp.TRIAL_WARM + comp.TRIAL_STEPS) + 10):
        clock.step()
        if (result := trial.after_step(step)) is not None:
            results.append((step, result))
        if compiled_at is None and trial.compiled:
            compiled_at = step
    assert compiled_at == first + comp.TRIAL_WARM + comp.TRIAL_STEPS
    # The first TRIAL_WARM compiled steps (the compile itself) are not timed.
    assert [s for s, _ in results] == [compiled_at + comp.TRIAL_WARM + comp.TRIAL_STEPS]
    result = results[0][1]
    assert result["compile/eager_step_s"] == pytest.approx(eager_s)
    assert result["compile/compiled_step_s"] == pytest.approx(compiled_s)
    assert result["compile/on"] == float(keeps) and trial.compiled is keeps
    if not keeps:  # the compiled blocks run eager from now on: no frame is traced
        from torch._dynamo.utils import counters

        traced = counters["frames"]["total"]
        with torch.no_grad():
            model.forward_features(torch.rand(2, 1, 16, 16))
        assert counters["frames"]["total"] == traced
    trial.close()
    assert trial.compiled is keeps


def test_short_launches_and_other_modes_get_no_trial():
    model = _tiny_backbone()
    assert comp.start_trial("trial", model, 100, 99 + comp.TRIAL_MIN_STEPS, rank=0) is None
    assert comp.start_trial("on", model, 0, 10**6, rank=0) is None
    assert comp.start_trial("off", model, 0, 10**6, rank=0) is None


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


@pytest.mark.slow
def test_auto_trial_on_two_ranks(tiny_shards, tmp_path, mlflow_db):
    """A CPU run with train.compile=auto on two real ranks times both ways, makes one choice
    (a collective at the deciding step: no hang, the same line on every rank that logs), logs
    it to MLflow, and trains to the end (the kNN monitor at the end runs the blocks eager)."""
    # The setup installs g++ (DeepSpeed's CPU op needs it too): without it the trial is off.
    assert comp._cpu_compiler() is not None, "no C++ compiler: Inductor's CPU kernels need g++"
    run_dir, db = tmp_path / "run", mlflow_db
    steps = comp.TRIAL_MIN_STEPS + 6
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                "--master_port", str(_free_port())]  # fmt: skip
    proc = subprocess.run([
        *launcher, "pipelines/mpp_pretrain.py", "--config", "configs/fmnist_vit_tiny_mpp.yaml",
        f"data.root={tiny_shards}", f"run.dir={run_dir}", f"tracking.uri=sqlite:///{db}",
        "model.img_size=16", "model.patch_size=4",
        "model.kwargs={depth: 2, embed_dim: 32, num_heads: 2}", "data.num_workers=1",
        "train.global_batch=16", "train.epochs=null", f"train.steps={steps}",
        "train.precision=fp32", "train.compile=auto", "optim.warmup_steps=4",
        "run.log_every=50", f"run.checkpoint_every={steps}", f"monitor.knn_every={steps}",
    ], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "torch.compile trial (auto: measured in the run, eager against compiled)" in out
    lines = {ln.split("torch.compile trial:")[1] for ln in out.splitlines() if "trial:" in ln}
    assert len(lines) == 1, lines  # every rank that logs says the same
    decided = comp.TRIAL_WARM * 2 + comp.TRIAL_STEPS * 2
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    [on] = client.get_metric_history(run_id, "compile/on")
    [eager_s] = client.get_metric_history(run_id, "compile/eager_step_s")
    [compiled_s] = client.get_metric_history(run_id, "compile/compiled_step_s")
    assert on.step == eager_s.step == compiled_s.step == decided
    assert on.value == float(compiled_s.value < eager_s.value) and eager_s.value > 0
    assert lines.pop().endswith("keeping compiled" if on.value else "keeping eager")
    assert (run_dir / "export" / "backbone.safetensors").is_file()
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == steps
    knn = client.get_metric_history(run_id, "monitor/knn_top1")  # evaluated with eager blocks
    assert [m.step for m in knn] == [steps]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
