"""Multi-node launchers rehearsed on one machine: torchrun with two "nodes" on 127.0.0.1 (static
rendezvous, one process each), and the SLURM script, whose per-node part runs twice under the
variables SLURM would set, with a stand-in `scontrol` on PATH. Real launches, real DeepSpeed;
the fast tests check the scripts' wiring with stand-ins for `srun` and the interpreter."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_train_e2e import free_port, metric_steps, overrides

NODE_SH = "configs/slurm/node.sh"
SBATCH = "configs/slurm/pretrain.sbatch"
# What the launchers decide for themselves: a test's own environment must not choose for them.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "PYTHON", "NPROC_PER_NODE")  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM")
    }
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def run_nodes(cmds: list[list[str]], envs: list[dict], timeout: float = 600) -> list[str]:
    """Start every node's command at once, wait for all; stderr of each. A node that fails or
    hangs is reported after the others are stopped (a peer left alone waits in rendezvous)."""
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
        for cmd, env in zip(cmds, envs, strict=True)
    ]  # fmt: skip
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=timeout)[1])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # torchrun and the training process it started
                p.wait()
    for p, err in zip(procs, errs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return errs


def assert_trained_together(run_dir: Path) -> None:
    """Two ranks split the global batch of 32, logged every 2 of 4 steps, and exported."""
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 16
    assert metric_steps(run_dir) == [2, 4]
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # on a CPU both MFUs divide by the measured matmul peak
    assert all(r["train/mfu"] == r["train/mfu_measured"] > 0 for r in rows)
    assert json.loads((run_dir / "export" / "backbone.json").read_text())["arch"]
    assert (run_dir / "export" / "backbone.safetensors").is_file()


@pytest.mark.slow
def test_torchrun_two_nodes_train_together(tiny_shards, tmp_path, mlflow_db):
    """torchrun --nnodes 2 --nproc-per-node 1, one launcher per "node" with its --node-rank:
    init_distributed reads the RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE it sets."""
    run_dir = tmp_path / "run"
    args = overrides(tiny_shards, run_dir, mlflow_db, "train.steps=4")
    port = str(free_port())
    cmds = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
         "--master-port", port, "pipelines/mpp_pretrain.py", *args]
        for node in (0, 1)
    ]  # fmt: skip
    # two "nodes" share this machine's cores: a thread each
    errs = run_nodes(cmds, [clean_env(OMP_NUM_THREADS="1")] * 2)
    assert_trained_together(run_dir)
    assert "train/mfu against the fp32 matmul peak measured at start" in errs[0]
    assert "(a CPU)" in errs[0]


def job_id_with_free_port() -> tuple[int, int]:
    """A SLURM job id whose port (node.sh: 20000 + id mod 10000) is free here now."""
    rng = random.Random()
    for _ in range(200):
        job = 4_000_000 + rng.randrange(10_000)
        port = 20000 + job % 10000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job, port
    raise AssertionError("no free port in 20000-29999")


SCONTROL = """#!/bin/sh
# stands in for SLURM's scontrol on one machine: every "node" of the job is 127.0.0.1
[ "$1 $2" = "show hostnames" ] || { echo "stub scontrol: $*" >&2; exit 1; }
echo 127.0.0.1
echo 127.0.0.1
"""


@pytest.mark.slow
def test_slurm_node_script_on_two_nodes_trains_one_run(tiny_shards, tmp_path, mlflow_db):
    """configs/slurm/node.sh as srun runs it on each node of a 2-node job, here twice on
    127.0.0.1: the master from `scontrol show hostnames`, the port from the job id."""
    executable(tmp_path / "bin" / "scontrol", SCONTROL)
    job, port = job_id_with_free_port()
    run_dir = tmp_path / "run"
    args = overrides(tiny_shards, run_dir, mlflow_db, "train.steps=4")
    slurm = {"SLURM_JOB_NODELIST": "node[0-1]", "SLURM_NNODES": "2", "SLURM_JOB_ID": str(job),
             "SLURM_CPUS_ON_NODE": "1", "NPROC_PER_NODE": "1", "PYTHON": sys.executable,
             "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    envs = [clean_env(**slurm, SLURM_NODEID=str(node)) for node in (0, 1)]
    cmd = ["bash", NODE_SH, "pipelines/mpp_pretrain.py", *args]
    errs = run_nodes([cmd, cmd], envs)
    assert_trained_together(run_dir)
    for node, err in enumerate(errs):
        assert f"node {node}/2" in err and f"master 127.0.0.1:{port}" in err, err[-2000:]
        assert "OMP_NUM_THREADS=1" in err


ECHO_ARGS = """#!/bin/sh
# stands in for {what}: records its arguments and the environment it was given
{{ for a in "$@"; do printf '%s\\n' "$a"; done
  ignored=$(sed -n 's/^SigIgn:[[:space:]]*//p' /proc/$$/status)  # a mask, bit 9 for SIGUSR1
  echo "ENV OMP_NUM_THREADS=$OMP_NUM_THREADS PYTHON=$PYTHON" \\
    "USR1_IGNORED=$(((0x$ignored >> 9) & 1)) SIGNALS=$PET_SIGNALS_TO_HANDLE" \\
    "STOP_TIMEOUT=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT NCCL_DEBUG=$NCCL_DEBUG"
}} > "$ARGS_OUT"
"""


def test_node_script_computes_the_rendezvous_from_slurm_variables(tmp_path):
    """The torchrun command node.sh starts on node 2 of a 4-node job with 8 GPUs a node."""
    python = executable(tmp_path / "python", ECHO_ARGS.format(what="the interpreter"))
    out = tmp_path / "args"
    executable(tmp_path / "bin" / "scontrol", "#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\n'\n")
    env = clean_env(SLURM_JOB_NODELIST="gpu-[a-c]", SLURM_NNODES="4", SLURM_NODEID="2",
                    SLURM_JOB_ID="1234567", SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="96",
                    PYTHON=str(python), ARGS_OUT=str(out),
                    PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")  # fmt: skip
    cmd = ["bash", NODE_SH, "pipelines/mpp_pretrain.py", "--config", "c.yaml"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    *argv, env_line = out.read_text().splitlines()
    assert argv == ["-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node", "8",
                    "--node-rank", "2", "--rdzv-backend", "static", "--master-addr", "gpu-a",
                    "--master-port", str(20000 + 1234567 % 10000),
                    "pipelines/mpp_pretrain.py", "--config", "c.yaml"]  # fmt: skip
    assert env_line.startswith("ENV OMP_NUM_THREADS=12 ")  # 96 CPUs over 8 processes
    # torchrun passes SIGUSR1 on to the ranks, or (one too old to read the list) ignores it
    stop = " USR1_IGNORED=1 SIGNALS=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 STOP_TIMEOUT=120 "
    assert stop in env_line, env_line
    outside = subprocess.run(["bash", NODE_SH, "x.py"], cwd=ROOT, env=clean_env(),
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert outside.returncode != 0 and "not inside a SLURM job" in outside.stderr


def test_sbatch_script_runs_one_node_script_per_node_with_its_arguments(tmp_path):
    """pretrain.sbatch as the batch step runs it, with a stand-in srun on PATH: the entry script
    and overrides go through unchanged, one task per node, NCCL's variables in the
    environment; its header is the command that submits it."""
    out = tmp_path / "args"
    executable(tmp_path / "bin" / "srun", ECHO_ARGS.format(what="SLURM's srun"))
    env = clean_env(SLURM_NNODES="4", SLURM_CPUS_PER_TASK="64", ARGS_OUT=str(out),
                    PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")  # fmt: skip
    args = ["pipelines/mpp_pretrain.py", "--config", "configs/vit_b16_imagenet_mpp.yaml",
            "data.root=s3://bucket/shards/imagenet", "model.kwargs={depth: 12}"]  # fmt: skip
    proc = subprocess.run(["bash", SBATCH, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    *argv, env_line = out.read_text().splitlines()
    assert argv == ["--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=64",
                    "--kill-on-bad-exit=1", "bash", NODE_SH, *args]  # fmt: skip
    venv = ROOT / ".venv" / "bin" / "python"
    assert f"PYTHON={venv if venv.exists() else ''} " in env_line
    assert env_line.endswith("NCCL_DEBUG=WARN")

    lines = (ROOT / SBATCH).read_text().splitlines()
    assert lines[1].startswith(f"# sbatch {SBATCH} pipelines/mpp_pretrain.py")
    # sbatch reads #SBATCH lines only before the first command
    first_command = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    directives = [i for i, ln in enumerate(lines) if ln.startswith("#SBATCH")]
    assert directives and max(directives) < first_command
    assert "#SBATCH --ntasks-per-node=1" in lines
    no_args = subprocess.run(["bash", SBATCH], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert no_args.returncode == 2 and "usage: sbatch" in no_args.stderr


SRUN_UNTIL_SIGNALLED = """#!/bin/bash
# stands in for SLURM's srun: runs until signalled, and says which signal reached it; USR1 ends
# it with 1, what torchrun reports after its ranks stopped on it
trap 'echo USR1 >> "$SRUN_LOG"; exit 1' USR1
trap 'echo TERM >> "$SRUN_LOG"; exit 143' TERM
echo "started $$" >> "$SRUN_LOG"
for _ in $(seq 600); do sleep 0.1; done
"""


def _sbatch_until_signalled(tmp_path: Path) -> tuple[subprocess.Popen, int, Path, Path]:
    """pretrain.sbatch as the batch step runs it, with a stand-in srun that runs until
    signalled and a stand-in scontrol that records its arguments; (batch shell, srun's pid, the
    signals srun got, scontrol's calls) once srun runs."""
    srun_log, scontrol_log = tmp_path / "srun.log", tmp_path / "scontrol.log"
    executable(tmp_path / "bin" / "srun", SRUN_UNTIL_SIGNALLED)
    executable(tmp_path / "bin" / "scontrol", '#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    env = clean_env(SLURM_NNODES="2", SLURM_CPUS_PER_TASK="8", SLURM_JOB_ID="4242",
                    SRUN_LOG=str(srun_log), SCONTROL_LOG=str(scontrol_log),
                    PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")  # fmt: skip
    batch = subprocess.Popen(["bash", SBATCH, "pipelines/mpp_pretrain.py"], cwd=ROOT, env=env,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 30
    while not (srun_log.is_file() and srun_log.read_text().startswith("started ")):
        assert time.monotonic() < deadline and batch.poll() is None, "srun never started"
        time.sleep(0.05)
    return batch, int(srun_log.read_text().split()[1]), srun_log, scontrol_log


def test_sbatch_passes_the_time_limit_signal_to_the_step_and_requeues_the_job(tmp_path):
    """SIGUSR1 to the batch shell alone (--signal=B:USR1@300): srun gets it, and when the step
    ends unfinished the job is requeued; the script exits with the step's status."""
    batch, _, srun_log, scontrol_log = _sbatch_until_signalled(tmp_path)
    batch.send_signal(signal.SIGUSR1)
    _, err = batch.communicate(timeout=30)
    assert batch.returncode == 1, err
    assert srun_log.read_text().splitlines()[1:] == ["USR1"]
    assert scontrol_log.read_text().splitlines() == ["requeue 4242"]
    assert "requeueing job 4242" in err
    lines = (ROOT / SBATCH).read_text().splitlines()
    for directive in ("--signal=B:USR1@300", "--requeue", "--open-mode=append"):
        assert f"#SBATCH {directive}" in lines


def test_sbatch_waits_for_the_step_after_sigterm_and_requeues_nothing(tmp_path):
    """SIGTERM (scancel, a preemption, the time limit) reaches the batch shell and the step
    alike: the shell waits for the step, which may be writing its checkpoint, and a cancelled
    job stays cancelled."""
    batch, srun, srun_log, scontrol_log = _sbatch_until_signalled(tmp_path)
    batch.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert batch.poll() is None  # still waiting for srun
    os.kill(srun, signal.SIGTERM)
    _, err = batch.communicate(timeout=30)
    assert batch.returncode == 143, err
    assert srun_log.read_text().splitlines()[1:] == ["TERM"]
    assert not scontrol_log.exists()
