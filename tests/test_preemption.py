"""A SLURM job's ordinary day on real launches: a preemption's SIGTERM and the time-limit
warning's SIGUSR1 each stop every rank at one step, with a checkpoint there and the MLflow run
KILLED, and the same command goes on from it (ssl_vit/engine/distributed.py, `StopSignals`).

The launches: two ranks on CPUs (gloo), the tiny ViT of test_train_e2e, a step logged every
step and no periodic checkpoint, so a checkpoint can only be a stop's. Before them, the ranks'
agreement alone, in two plain processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT
from mlflow.tracking import MlflowClient
from test_launchers import NODE_SH, SCONTROL, clean_env, executable, job_id_with_free_port
from test_train_e2e import free_port, metric_steps, overrides

from ssl_vit.engine.distributed import STOPPED_EXIT

PIPE = "pipelines/mpp_pretrain.py"
STEPS = 60  # never reached: each launch is stopped

# Two ranks of a gloo group calling StopSignals.agreed() at 8 step boundaries; rank 1 alone gets
# SIGUSR1 just before boundary 3. Prints the boundary at which each rank was told to stop.
AGREE = """
import json, os, signal
import torch.distributed as dist
from ssl_vit.engine.distributed import StopSignals, shutdown
dist.init_process_group("gloo")
rank, stops = dist.get_rank(), {}
with StopSignals(["SIGUSR1"]) as stop:
    for boundary in range(1, 9):
        if rank == 1 and boundary == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        stops.setdefault(stop.agreed(), boundary)
restored = signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
shutdown()  # without it a rank died at exit (SIGABRT) in 7 runs of 20: see its docstring
print(json.dumps({"rank": rank, "stops": stops, "received": stop.received, "restored": restored,
                  "down": not dist.is_initialized()}))
"""


def test_every_rank_stops_at_the_same_boundary_when_one_got_the_signal():
    """The ranks agree one boundary late (the reduction started at one is read at the next),
    all at the same one; the rank that got nothing stops too; the handler is put back."""
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, "-c", AGREE], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(rank)})
        for rank in (0, 1)
    ]  # fmt: skip
    out = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    for rank, found in enumerate(out):
        assert found["stops"] == {"null": 1, "SIGUSR1": 4}, found
        assert found["received"] == (signal.SIGUSR1 if rank == 1 else 0)
        assert found["restored"]
        assert found["down"]


def _args(shards: Path, run_dir: Path, db: Path) -> list[str]:
    """Streamed through a loader worker per rank (not held in RAM): the workers get the signal
    too."""
    return overrides(shards, run_dir, db, f"train.steps={STEPS}", "run.log_every=1",
                     "run.checkpoint_every=1000", "data.in_memory=false")  # fmt: skip


def _start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """`cmd` in its own process group, as a job step is (its loader workers included)."""
    out = open(log, "ab")  # noqa: SIM115 (the launch's lifetime)
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=out, stderr=out, start_new_session=True,
        env=env or {**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def _deepspeed(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
            "--master_port", str(free_port()), PIPE, *args]  # fmt: skip


def _last_step(run_dir: Path) -> int:
    """The newest logged step; 0 while metrics.jsonl is missing or still empty."""
    steps = metric_steps(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    return steps[-1] if steps else 0


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, log: Path) -> int:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (seen := _last_step(run_dir)) >= step:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"no step {step} (exit {proc.poll()}): {log.read_text()[-3000:]}")


def _training_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """The ranks under a launcher: `python -u ENTRY ...` (the launchers' own command lines name
    the entry script too, and so do the fork servers')."""
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if PIPE in p.cmdline()[:3]]  # fmt: skip


def _wait_gone(procs: list[psutil.Process], timeout: float = 120) -> None:
    """Until every process has exited (a zombie has: its parent may have died first)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"{p.pid} ({' '.join(p.cmdline())[:200]}) still runs")


def _assert_stopped(run_dir: Path, db: Path, by: str, seen: int, last: int) -> int:
    """The run stopped at one step in [seen, last + 2] (the ranks agree one step late), whose
    checkpoint `latest` names, and its MLflow run is KILLED, tagged with the signal and step."""
    ckpt = run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    step = json.loads((ckpt / tag / "trainer_state.json").read_text())["step"]
    assert seen <= step <= last + 2, (seen, step, last)
    assert metric_steps(run_dir)[-1] == step  # every step up to the stop is logged
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "KILLED"
    assert run.data.tags["ssl_vit.stopped_by"] == by
    assert run.data.tags["ssl_vit.stopped_at_step"] == str(step)
    return step


@pytest.mark.slow
def test_a_preemption_and_time_limit_warnings_stop_every_rank_and_the_run_goes_on(
    tiny_shards, tmp_path, mlflow_db
):
    """Three launches of one run, each stopped the way a job is.
    1. deepspeed --num_gpus 2; SIGTERM to the launch's whole process group, as SLURM signals a
       job step: the DeepSpeed launcher on one node has no handler and dies at once; its
       per-node launcher passes SIGTERM on to the ranks, which have it already, and waits for
       them. The ranks stop at one step with a checkpoint; their loader workers, signalled
       too, keep feeding them until then.
    2. The same command resumes there; SIGUSR1 to the two training processes alone: they stop
       the same way, and the launcher exits with their code, 124.
    3. configs/slurm/node.sh (torchrun, 2 processes) resumes there; SIGUSR1 to torchrun alone,
       as pretrain.sbatch forwards it: torchrun (which would die of it by default) passes it
       to the ranks, which stop; it reports that as 1, like any failed rank.
    Each step is logged once, in metrics.jsonl and in MLflow."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    args = _args(tiny_shards, run_dir, mlflow_db)

    proc = _start(_deepspeed(args), log)
    seen = _wait_for_step(run_dir, proc, 3, log)
    ranks = _training_processes(proc)
    assert len(ranks) == 2
    os.killpg(proc.pid, signal.SIGTERM)
    last = _last_step(run_dir)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # DeepSpeed's runner, not ours
    _wait_gone(ranks)
    stop = _assert_stopped(run_dir, mlflow_db, "SIGTERM", seen, last)
    text = log.read_text()
    assert f"stopped by SIGTERM at step {stop}; checkpoint {run_dir}" in text, text[-3000:]
    assert "DataLoader worker" not in text, text[-3000:]  # none died of the signal

    offset = log.stat().st_size
    proc = _start(_deepspeed(args), log)
    seen = _wait_for_step(run_dir, proc, stop + 3, log)
    for p in _training_processes(proc):
        p.send_signal(signal.SIGUSR1)
    last = _last_step(run_dir)
    assert proc.wait(timeout=180) == STOPPED_EXIT, log.read_text()[-3000:]
    text = log.read_bytes()[offset:].decode()
    assert f"resumed from step {stop}" in text, text[-3000:]
    stop = _assert_stopped(run_dir, mlflow_db, "SIGUSR1", seen, last)

    executable(tmp_path / "bin" / "scontrol", SCONTROL)
    job, _ = job_id_with_free_port()
    env = clean_env(SLURM_JOB_NODELIST="node0", SLURM_NNODES="1", SLURM_NODEID="0",
                    SLURM_JOB_ID=str(job), SLURM_CPUS_ON_NODE="2", NPROC_PER_NODE="2",
                    PYTHON=sys.executable,
                    PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")  # fmt: skip
    offset = log.stat().st_size
    proc = _start(["bash", NODE_SH, PIPE, *args], log, env)
    seen = _wait_for_step(run_dir, proc, stop + 3, log)
    ranks = _training_processes(proc)
    assert len(ranks) == 2
    proc.send_signal(signal.SIGUSR1)  # node.sh ran torchrun in its place (exec)
    last = _last_step(run_dir)
    assert proc.wait(timeout=180) == 1, log.read_text()[-3000:]
    _wait_gone(ranks)
    text = log.read_bytes()[offset:].decode()
    assert f"resumed from step {stop}" in text, text[-3000:]
    stop = _assert_stopped(run_dir, mlflow_db, "SIGUSR1", seen, last)

    assert metric_steps(run_dir) == list(range(1, stop + 1))
    client = MlflowClient(tracking_uri=f"sqlite:///{mlflow_db}")
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, stop + 1))
    assert len(list((run_dir / "checkpoints").glob("step*"))) == 2  # run.keep_checkpoints
